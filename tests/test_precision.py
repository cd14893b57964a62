"""Graph precision: ``compile_onnx(..., precision="bf16")`` runs the matmuls of a model in
bf16 with fp32 accumulation, says so in its report, and stays within 1e-2 relative of the
fp32 answer."""

from __future__ import annotations

import checks
import numpy as np
import pytest

from tpp_tvm import models
from tpp_tvm.compiled import compile_onnx
from tpp_tvm.errors import UnsupportedDTypeError
from tpp_tvm.onnxruntime_ref import run_onnxruntime

# The model generators export from torch; ONNX Runtime is the fp32 reference.
pytestmark = [pytest.mark.requires_torch, pytest.mark.requires_onnxruntime]


@pytest.mark.requires_avx512_bf16
@pytest.mark.parametrize("name", ["mlp", "bert", "small_cnn"])
def test_bf16_models_within_1e_2_of_fp32(name: str) -> None:
    model = models.GENERATORS[name](**models.TINY_ARGS[name])
    inputs = models.example_inputs(model)
    want = run_onnxruntime(model, inputs)
    compiled = compile_onnx(model, precision="bf16")
    got = compiled(*inputs.values())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32 and g.shape == w.shape
        assert checks.relative_error(g, w) <= 1e-2, (name, checks.relative_error(g, w))
    data = compiled.report_data
    assert data["precision"] == "bfloat16"
    bf16 = [row for row in data["kernels"] if row["precision"] == "bfloat16"]
    assert bf16, data["kernels"]
    assert not data["fallbacks"], data["fallbacks"]
    text = compiled.report()
    assert text.startswith("Precision: bfloat16") and "fp32 accumulation" in text
    if name == "bert":  # its attention (activation x activation) stays fp32
        assert any(row["family"] == "attention" and row["precision"] == "float32"
                   for row in data["kernels"]), data["kernels"]


@pytest.mark.requires_avx512_bf16
def test_bf16_is_really_bf16() -> None:
    """Not fp32 in disguise: the result differs from fp32 by about bf16's rounding."""
    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])
    inputs = models.example_inputs(model)
    fp32 = compile_onnx(model)(*inputs.values())[0]
    bf16 = compile_onnx(model, precision="bf16")(*inputs.values())[0]
    assert 1e-5 < checks.relative_error(bf16, fp32) <= 1e-2


def test_unknown_precision_is_a_clear_error() -> None:
    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])
    with pytest.raises(UnsupportedDTypeError, match="'fp16'.*bfloat16"):
        compile_onnx(model, precision="fp16")


def test_bf16_on_an_amx_target_builds_without_fallbacks() -> None:
    """Compile only (this host may lack AMX): fused bf16 GEMMs run on AMX tiles with their
    epilogues on the AVX-512 unit, so nothing falls back to TVM."""
    from tpp_tvm.frontend import from_onnx
    from tpp_tvm.relay_passes.lower import LoweringReport
    from tpp_tvm.relay_passes.pipeline import build
    from tpp_tvm.target import target

    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])

    report = LoweringReport()
    build(from_onnx(model), target("amx", num_cores=1), report=report, precision="bf16")
    assert not report.fallbacks, report.fallbacks
    assert any(row.precision == "bfloat16" and row.on_tiles for row in report.kernels), \
        report.summary()


@pytest.mark.requires_avx512_bf16
def test_bf16_without_tiles_says_whether_it_pays() -> None:
    """On a target without AMX the report says bf16 runs on vdpbf16ps: a warning (often no
    faster than fp32) unless the target CPU's vdpbf16ps was measured at twice the FMA rate;
    on AMX tiles neither."""
    from tpp_tvm.compiled import BF16_FULL_RATE_CPUS, BF16_WITHOUT_TILES
    from tpp_tvm.target import target

    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])
    tgt = target("avx512", num_cores=1)
    compiled = compile_onnx(model, target=tgt, precision="bf16")
    text = compiled.report()
    assert "[bf16]" in text
    full_rate = str(tgt.attrs.get("mcpu", "")) in BF16_FULL_RATE_CPUS
    assert (BF16_WITHOUT_TILES in text) != full_rate
    assert ("twice the fp32 FMA's work" in text) == full_rate
    # A model exported before the target CPU was recorded keeps the warning.
    assert "target_cpu" in compiled.report_data
    compiled._report.pop("target_cpu")
    assert BF16_WITHOUT_TILES in compiled.report()


@pytest.mark.requires_avx512  # an AVX-512 target's fp32 kernels run here
def test_a_failing_bf16_kernel_runs_on_fp32_tpps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 kernel that cannot be built leaves the layer on the fp32 TPP kernel (reported
    as a rewrite), not on TVM's untuned code, which ran a ViT matmul 100x slower."""
    from tpp_tvm.relay_passes.families import gemm
    from tpp_tvm.target import target

    real = gemm.gemm_schedule

    def failing(*args, dtype: str = "float32", **kwargs):
        if dtype != "float32":
            raise RuntimeError("GEMM microkernel did not tensorize")
        return real(*args, dtype=dtype, **kwargs)

    monkeypatch.setattr(gemm, "gemm_schedule", failing)
    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])
    inputs = models.example_inputs(model)
    compiled = compile_onnx(model, target=target("avx512", num_cores=1), precision="bf16")
    data = compiled.report_data
    assert not data["fallbacks"], data["fallbacks"]
    assert data["kernels"] and all(row["precision"] == "float32" for row in data["kernels"]), \
        data["kernels"]
    assert any("bfloat16 kernel failed" in k for k in data["rewrites"]), data["rewrites"]
    want = run_onnxruntime(model, inputs)[0]
    assert checks.relative_error(compiled(*inputs.values())[0], want) <= 1e-5
