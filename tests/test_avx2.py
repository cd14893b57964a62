"""The AVX2 ISA end to end, on any x86 host (AVX2 code runs on AVX-512 CPUs too): models on
``tpp/avx2`` match ONNX Runtime on its own kernels, int8 layers run exact on s16 dot
products, and what AVX2 lacks (bf16 and u8 x s8 dot products) is said, not crashed into."""

from __future__ import annotations

import numpy as np
import pytest

from tpp_tvm import models
from tpp_tvm.compiled import compile_onnx
from tpp_tvm.errors import UnsupportedDTypeError
from tpp_tvm.kernels import build_gemm
from tpp_tvm.onnxruntime_ref import run_onnxruntime
from tpp_tvm.target import target

pytestmark = [pytest.mark.requires_avx2, pytest.mark.requires_torch,
              pytest.mark.requires_onnxruntime]


def _avx2() -> object:
    return target("avx2", num_cores=2)


@pytest.mark.parametrize("name", ["bert", "resnet50"])
def test_models_run_on_avx2_tpps_like_onnxruntime(name: str) -> None:
    # a 64-pixel image: the tiny one's last stage is 1 x 1, whose pooling no TPP takes
    args = {**models.TINY_ARGS[name], **({"image": 64} if name == "resnet50" else {})}
    model = models.GENERATORS[name](**args)
    inputs = models.example_inputs(model)
    compiled = compile_onnx(model, target=_avx2())
    data = compiled.report_data
    assert data["lowered"] and not data["fallbacks"], data["fallbacks"]
    got = compiled(*inputs.values())[0]
    want = run_onnxruntime(model, inputs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    kernels = [k for k, _, _ in compiled.profile(*inputs.values(), repeat=1)]
    if name == "resnet50":  # 3x3 stride-1 convolutions take Winograd on AVX2 too
        assert any("winograd" in k for k in kernels), kernels


def test_low_precision_is_refused_with_the_reason() -> None:
    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])
    with pytest.raises(UnsupportedDTypeError, match="avx2 target has fp32 TPPs and int16"):
        compile_onnx(model, target=_avx2(), precision="bf16")
    with pytest.raises(UnsupportedDTypeError, match="no int8 dot-product TPP on the avx2 target"):
        build_gemm(8, 16, 8, dtype="int8", target=_avx2())


def test_int16_gemm_is_exact_on_vpmaddwd() -> None:
    """u8 x s8 values widened to s16: vpmaddwd's pair sums into int32 are exact (no
    saturation at 255 x -128 + 255 x -128), across tiles, tails and K padding."""
    rng = np.random.default_rng(0)
    for m, n, k in ((4, 37, 64), (13, 70, 30), (1, 8, 3)):
        kernel = build_gemm(m, n, k, dtype="int16", target=_avx2())
        a = rng.integers(0, 256, (m, k)).astype(np.int16)
        b = rng.integers(-128, 128, (k, n)).astype(np.int16)
        b[:2] = -128  # the extreme products, in one pair
        a[:, :2] = 255
        got = kernel.run_packed(a, kernel.pack_b(b))
        np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))
    asm = kernel.module.inspect_source("asm")
    assert "vpmaddwd" in asm and "%ymm" in asm and "%zmm" not in asm


@pytest.mark.parametrize("kind", ["dynamic", "qdq_s8"])
def test_quantized_models_run_on_s16_kernels(tmp_path, kind: str) -> None:
    """AVX2 has no u8 x s8 dot product into int32: int8 layers run on s16 kernels
    (vpmaddwd; the report says ``int8 via int16``), exact in their integer sums, so at
    least as close to the fp32 model as ONNX Runtime's int8 result."""
    from test_quantized import _fp32_mlp, _quantize

    fp32, path = _fp32_mlp(tmp_path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"))
    inputs = models.example_inputs(fp32)
    compiled = compile_onnx(model, target=_avx2())
    data = compiled.report_data
    ours = [k for k in data["lowered"] if k.endswith("[int8 via int16]")]
    assert len(ours) == 2 and not data["fallbacks"], data
    got = compiled(*inputs.values())[0]
    want = run_onnxruntime(model, inputs)[0]
    exact = run_onnxruntime(fp32, inputs)[0]
    ort_err = np.abs(want - exact).max()
    assert np.abs(got - exact).max() <= 1.05 * ort_err + 1e-5 * np.abs(exact).max()
