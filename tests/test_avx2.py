"""The AVX2 ISA end to end, on any x86 host (AVX2 code runs on AVX-512 CPUs too): models on
``tpp/avx2`` match ONNX Runtime on its own kernels, and what AVX2 lacks (bf16 and int8 dot
products) is said, not crashed into."""

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
    with pytest.raises(UnsupportedDTypeError, match="avx2 target has fp32 TPPs only"):
        compile_onnx(model, target=_avx2(), precision="bf16")
    with pytest.raises(UnsupportedDTypeError, match="'int8' needs bf16/int8 dot-product"):
        build_gemm(8, 16, 8, dtype="int8", target=_avx2())


@pytest.mark.parametrize("kind", ["dynamic", "qdq_s8"])
def test_quantized_models_run_on_fp32_tpps(tmp_path, kind: str) -> None:
    """No int8 dot product on AVX2: the model stays as imported, its dequantized weights
    fold to constants and its matmuls run on fp32 TPPs; the report says so, and the result
    is ONNX Runtime's int8 result up to fp32 rounding."""
    from test_quantized import _fp32_mlp, _quantize

    fp32, path = _fp32_mlp(tmp_path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"))
    inputs = models.example_inputs(fp32)
    compiled = compile_onnx(model, target=_avx2())
    data = compiled.report_data
    assert any("int8 layers run on fp32 TPPs" in k for k in data["rewrites"]), data["rewrites"]
    # dense layers on constant (packed) weights, not matmuls re-reading the weight unpacked
    assert any(k.startswith("tpp.dense") for k in data["lowered"]), data["lowered"]
    assert not any(k.startswith("tpp.matmul") for k in data["lowered"]), data["lowered"]
    got = compiled(*inputs.values())[0]
    want = run_onnxruntime(model, inputs)[0]
    exact = run_onnxruntime(fp32, inputs)[0]
    ort_err = np.abs(want - exact).max()
    assert np.abs(got - exact).max() <= 2 * ort_err + 1e-5 * np.abs(exact).max()
