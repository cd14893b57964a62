"""Depthwise convolution kernel against numpy (strides, padding, odd channel counts,
epilogues) and through compile_onnx against ONNX Runtime."""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tpp_tvm
from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.schedules.conv import ConvShape
from tpp_tvm.schedules.depthwise import (
    depthwise_conv_schedule,
    interior_pixel_blocks,
    pixel_blocking,
)
from tpp_tvm.tir_pipeline import compile_kernels


def _reference(x, w, shape: ConvShape):
    top, left, bottom, right = shape.pad
    xp = np.pad(x, [(0, 0), (top, bottom), (left, right), (0, 0)])
    st, d = shape.stride, shape.dilation
    out = np.zeros((shape.n, shape.oh, shape.ow, shape.c), "float64")
    for i in range(shape.r):
        for j in range(shape.s):
            out += xp[:, i * d:i * d + st * shape.oh:st, j * d:j * d + st * shape.ow:st, :] \
                * w[i, j]
    return out


@pytest.mark.parametrize("shape", [
    ConvShape(1, 14, 14, 32, 32, 3, 3, 1, (1, 1, 1, 1)),
    ConvShape(2, 15, 13, 48, 48, 3, 3, 2, (1, 1, 1, 1)),   # stride 2, odd sizes, batch 2
    ConvShape(1, 11, 11, 48, 48, 5, 5, 1, (2, 2, 2, 2)),
    ConvShape(1, 9, 7, 16, 16, 7, 7, 1, (3, 3, 3, 3)),     # ConvNeXt's 7x7
    ConvShape(1, 8, 8, 16, 16, 3, 3, 2, (0, 0, 1, 1)),     # asymmetric (TF "same") padding
    ConvShape(1, 1, 1, 16, 16, 3, 3, 1, (1, 1, 1, 1)),     # one pixel: every tap but one pads
    ConvShape(1, 13, 13, 16, 16, 3, 3, 1, (1, 1, 1, 1)),   # prime width: one-pixel blocks
    ConvShape(1, 5, 3, 16, 16, 5, 5, 2, (2, 2, 2, 2)),     # window wider than the input
    ConvShape(1, 19, 19, 40, 40, 3, 3, 1, (1, 1, 1, 1)),   # 2.5 vectors, 8-pixel blocks + 3
    ConvShape(1, 10, 9, 7, 7, 3, 3, 2, (1, 1, 1, 1)),      # fewer channels than one vector
])
@pytest.mark.parametrize("epilogue", ["none", "bias_relu", "bias_residual", "bias_silu_residual"])
def test_depthwise_matches_numpy(shape: ConvShape, epilogue: str) -> None:
    rng = np.random.default_rng(shape.h * shape.c)
    x = rng.standard_normal((shape.n, shape.h, shape.w, shape.c)).astype("float32")
    w = rng.standard_normal((shape.r, shape.s, shape.c)).astype("float32")
    bias = rng.standard_normal(shape.c).astype("float32")
    res = rng.standard_normal((shape.n, shape.oh, shape.ow, shape.c)).astype("float32")
    opts = {"none": {}, "bias_relu": {"bias": True, "activation": "relu"},
            "bias_residual": {"bias": True, "residual": True},
            # SiLU: pixels in groups of four (a remainder where the block is not 4 or 8)
            "bias_silu_residual": {"bias": True, "activation": "silu", "residual": True}}[epilogue]
    sch = depthwise_conv_schedule(shape, checks.VECTOR_ISA, epilogue=Epilogue(**opts))
    lib = compile_kernels(sch.mod, tpp_tvm.target(num_cores=1)).jit()
    arrays = [x, w] + ([bias] if "bias" in opts else []) + ([res] if "residual" in opts else [])
    out = tvm.runtime.tensor(np.zeros(res.shape, "float32"))
    lib(*[tvm.runtime.tensor(a) for a in arrays], out)
    want = _reference(x, w, shape)
    if "bias" in opts:
        want = want + bias
    if opts.get("activation") == "relu":
        want = np.maximum(want, 0)
    if opts.get("activation") == "silu":
        want = want / (1 + np.exp(-want))
    if "residual" in opts:
        want = want + res
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("dtype", "zero", "activation"), [("uint8", 0.0, "relu6"),
                                                             ("int8", -3.0, None),
                                                             ("int8", 0.0, "silu")])
def test_depthwise_writes_the_next_int8_layers_input(dtype: str, zero: float,
                                                     activation: str | None) -> None:
    """In a quantized model the depthwise kernel quantizes its output as it stores it
    (``x / scale + zero point``, rounded half to even and saturated): the same values as
    quantizing its fp32 output, off by one step at most where the reciprocal moves a value
    across a rounding boundary (and the SiLU groups' path stores the same way)."""
    shape = ConvShape(1, 13, 11, 32, 32, 3, 3, 2, (1, 1, 1, 1))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((shape.n, shape.h, shape.w, shape.c)).astype("float32")
    w = rng.standard_normal((shape.r, shape.s, shape.c)).astype("float32")
    bias = rng.standard_normal(shape.c).astype("float32")
    scale = np.float32(0.02)
    opts = {"bias": True, "activation": activation}
    outs = {}
    for out_dtype in ("float32", dtype):
        sch = depthwise_conv_schedule(shape, checks.VECTOR_ISA,
                                      epilogue=Epilogue(out_dtype=out_dtype, **opts))
        lib = compile_kernels(sch.mod, tpp_tvm.target(num_cores=1)).jit()
        q = [np.full(shape.c, 1 / scale, "float32"), np.full(shape.c, zero, "float32")]
        args = [x, w, bias] + (q if out_dtype != "float32" else [])
        out = tvm.runtime.tensor(np.zeros((shape.n, shape.oh, shape.ow, shape.c), out_dtype))
        lib(*[tvm.runtime.tensor(a) for a in args], out)
        outs[out_dtype] = out.numpy()
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    want = np.clip(np.round(outs["float32"] / scale + zero), lo, hi)
    diff = np.abs(outs[dtype].astype(np.int32) - want)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    assert hi in outs[dtype] and (activation is not None or lo in outs[dtype])  # saturated


def _run(shape: ConvShape, seed: int, **opts) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's output for random operands, and the float64 reference."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((shape.n, shape.h, shape.w, shape.c)).astype("float32")
    w = rng.standard_normal((shape.r, shape.s, shape.c)).astype("float32")
    bias = rng.standard_normal(shape.c).astype("float32")
    sch = depthwise_conv_schedule(shape, checks.VECTOR_ISA, epilogue=Epilogue(**opts))
    lib = compile_kernels(sch.mod, tpp_tvm.target(num_cores=1)).jit()
    out = tvm.runtime.tensor(np.zeros((shape.n, shape.oh, shape.ow, shape.c), "float32"))
    args = [x, w] + ([bias] if opts.get("bias") else [])
    lib(*[tvm.runtime.tensor(a) for a in args], out)
    want = _reference(x, w, shape) + (bias if opts.get("bias") else 0)
    return out.numpy(), want


@settings(max_examples=16, deadline=None, derandomize=True)
@given(c=st.sampled_from([2, 3, 5, 8, 13, 17, 24, 31, 58, 72, 116]),
       w=st.sampled_from([1, 2, 7, 11, 17, 19]),
       k=st.sampled_from([2, 3, 5]), stride=st.sampled_from([1, 2, 3]),
       pad=st.sampled_from([0, 1, 2]), dilation=st.sampled_from([1, 1, 2, 3]))
def test_any_channel_count_width_and_window(c: int, w: int, k: int, stride: int,
                                            pad: int, dilation: int) -> None:
    """The kernel takes every size: channel counts off the vector width (and below one
    vector), prime widths (a tail pixel block), any window, stride, padding and dilation."""
    shape = ConvShape(1, w + 2, w, c, c, k, k, stride, (pad, pad, pad, pad), dilation=dilation)
    if shape.oh < 1 or shape.ow < 1:
        return
    out, want = _run(shape, c * w + k, bias=True)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_pixel_blocking_splits_evenly_or_keeps_a_tail() -> None:
    assert pixel_blocking(56) == (8, 0) and pixel_blocking(7) == (7, 0)
    assert pixel_blocking(75) == (5, 0) and pixel_blocking(14) == (7, 0)
    assert pixel_blocking(13) == (8, 5) and pixel_blocking(19) == (8, 3)
    assert pixel_blocking(38) == (8, 6)


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize(("stride", "c"), [(1, 24), (2, 24), (1, 58)])
def test_onnx_depthwise_conv_with_bias_and_relu_runs_on_the_tpp_kernel(stride: int,
                                                                       c: int) -> None:
    """ShuffleNetV2's 58 channels (not whole vectors) run on the kernel too."""
    rng = np.random.default_rng(stride)
    w = rng.standard_normal((c, 1, 3, 3)).astype("float32")
    b = rng.standard_normal(c).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], group=c, pads=[1, 1, 1, 1],
                              strides=[stride, stride]),
             helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 17, 17])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, c, 17, 17)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    assert "tpp.depthwise_conv2d_bias_relu" in compiled.report()


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize(("dilation", "c"), [(2, 24), (4, 19)])
def test_dilated_depthwise_runs_on_the_depthwise_kernel(dilation: int, c: int) -> None:
    """DeepLabV3's dilated depthwise backbone: the taps dilation pixels apart in the kernel
    itself (no phase copies), against ORT."""
    rng = np.random.default_rng(dilation)
    w = rng.standard_normal((c, 1, 3, 3)).astype("float32")
    b = rng.standard_normal(c).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=c, dilations=[dilation] * 2,
                              pads=[dilation] * 4)]
    model = checks.onnx_model(nodes, {"x": [1, c, 14, 13]}, {"w": w, "b": b})
    x = rng.standard_normal((1, c, 14, 13)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    assert compiled.report_data["lowered"].get("tpp.depthwise_conv2d_bias") == 1
    rest = compiled.report_data["default_scheduled"]  # the edge layout transposes alone
    assert all(name.startswith("transpose") for name in rest), rest


@pytest.mark.parametrize("w,s,stride,left,right", [
    (112, 3, 1, 1, 1), (112, 3, 2, 0, 1), (57, 5, 2, 1, 2), (56, 7, 1, 3, 3), (7, 3, 1, 1, 1),
    (3, 5, 2, 2, 2), (1, 3, 1, 1, 1), (13, 3, 1, 1, 1), (28, 5, 1, 2, 2),
])
def test_interior_pixel_blocks_are_exactly_those_without_padding_taps(
        w: int, s: int, stride: int, left: int, right: int) -> None:
    """The unchecked blocks must never read a padding column, and every block left checked
    must need a check (else the kernel pays tests it does not need)."""
    shape = ConvShape(1, 4, w, 16, 16, 3, s, stride, (1, left, 1, right))
    jb, _ = pixel_blocking(shape.ow)
    first, last = interior_pixel_blocks(shape, jb)

    def inside(block: int) -> bool:
        cols = [(block * jb + a) * stride + rx - left for a in range(jb) for rx in range(s)]
        return min(cols) >= 0 and max(cols) < w

    assert [b for b in range(shape.ow // jb) if inside(b)] == list(range(first, last))


@pytest.mark.requires_avx512
def test_depthwise_silu_uses_the_avx512_forms() -> None:
    """The epilogue's sigmoid is vrcp14ps and vscalefps, not a vdivps per vector."""
    shape = ConvShape(1, 8, 8, 16, 16, 3, 3, 1, (1, 1, 1, 1))
    sch = depthwise_conv_schedule(shape, epilogue=Epilogue(bias=True, activation="silu"))
    asm = compile_kernels(sch.mod, tpp_tvm.target(num_cores=1)).jit().inspect_source("asm")
    assert "vdivps" not in asm and "vrcp14ps" in asm and "vscalefps" in asm


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize(("multiplier", "c"), [(2, 24), (3, 5)])
def test_channel_multipliers_run_on_the_depthwise_kernel(multiplier: int, c: int) -> None:
    """FastViT's 7x7 stride-2 convolution of 48 channels into 96 (one input channel a group,
    two filters each) runs on the depthwise kernel over the repeated input channels."""
    rng = np.random.default_rng(multiplier)
    oc = c * multiplier
    w = rng.standard_normal((oc, 1, 7, 7)).astype("float32")
    b = rng.standard_normal(oc).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=c, pads=[3, 3, 3, 3],
                              strides=[2, 2])]
    model = checks.onnx_model(nodes, {"x": [1, c, 19, 19]}, {"w": w, "b": b})
    x = rng.standard_normal((1, c, 19, 19)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    assert compiled.report_data["lowered"].get("tpp.depthwise_conv2d_bias") == 1
    assert not [k for k in compiled.report_data["default_scheduled"] if "conv" in k]
