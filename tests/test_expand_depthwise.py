"""The expansion + depthwise convolution kernel (an inverted residual block's first half)
against numpy — strides, 5x5 windows, odd heights, batches, chunked rows for several
threads — and through compile_onnx against ONNX Runtime, fused where the expanded tensor
outgrows the L2 and left as two kernels where it does not."""

from __future__ import annotations

import re

import checks
import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import tpp_tvm
from tpp_tvm.errors import UnsupportedShapeError
from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.intrinsics.registry import vector_isa
from tpp_tvm.schedules.conv import ConvShape
from tpp_tvm.schedules.expand_depthwise import (
    MIN_TILE_PIXELS,
    expand_depthwise_schedule,
    fusion_pays,
    pack_expand_filter,
    plan_expand_depthwise,
    pointwise,
)
from tpp_tvm.target import host_isa, target
from tpp_tvm.tir_pipeline import compile_kernels

#: fp32 lanes of the host target's vector unit: the packed filter's channel vectors
LANES = vector_isa(checks.VECTOR_ISA).schedule_lanes("float32")

_ACTS = {
    None: lambda v: v,
    "relu6": lambda v: np.clip(v, 0, 6),
    "silu": lambda v: v / (1 + np.exp(-v)),
}


def _reference(x, w_ci, b1, wd, bd, shape: ConvShape, expand_act, act):
    e = _ACTS[expand_act](x.astype("float64") @ w_ci.T.astype("float64") + b1)
    return _ACTS[act](_depthwise(e, wd, shape) + bd)


def _depthwise(e, wd, shape: ConvShape):
    top, left, bottom, right = shape.pad
    ep = np.pad(e, [(0, 0), (top, bottom), (left, right), (0, 0)])
    st = shape.stride
    out = np.zeros((shape.n, shape.oh, shape.ow, shape.c))
    for i in range(shape.r):
        for j in range(shape.s):
            out += ep[:, i:i + st * shape.oh:st, j:j + st * shape.ow:st, :] * wd[i, j]
    return out


@pytest.mark.parametrize("shape,cin", [
    (ConvShape(1, 14, 14, 96, 96, 3, 3, 2, (1, 1, 1, 1)), 16),     # MobileNetV2's first, small
    (ConvShape(1, 16, 16, 144, 144, 3, 3, 1, (1, 1, 1, 1)), 24),   # 3 channel blocks
    (ConvShape(2, 15, 16, 96, 96, 5, 5, 2, (2, 2, 2, 2)), 24),     # 5x5, odd height, batch 2
    (ConvShape(1, 8, 8, 48, 48, 3, 3, 2, (0, 0, 1, 1)), 16),       # TF "same" padding
    (ConvShape(1, 7, 7, 64, 64, 3, 3, 1, (1, 1, 1, 1)), 40),       # 4-vector blocks
    (ConvShape(1, 3, 4, 32, 32, 5, 5, 1, (2, 2, 2, 2)), 8),        # window taller than the image
])
# The thread split and the epilogue are independent: each thread count and each pair of
# activations is checked on every shape, not every combination (``-m slow``: all nine).
@pytest.mark.parametrize("threads,acts", [
    (1, ("relu6", "relu6")), (2, ("silu", "silu")), (3, ("silu", None)),
    *(pytest.param(t, a, marks=pytest.mark.slow) for t, a in [
        (1, ("silu", "silu")), (1, ("silu", None)), (2, ("relu6", "relu6")),
        (2, ("silu", None)), (3, ("relu6", "relu6")), (3, ("silu", "silu"))]),
])
def test_fused_kernel_matches_numpy(shape: ConvShape, cin: int, threads: int, acts) -> None:
    expand_act, act = acts
    rng = np.random.default_rng(shape.h * shape.c + cin)
    x = rng.standard_normal((shape.n, shape.h, shape.w, cin)).astype("float32")
    w_ci = (rng.standard_normal((shape.c, cin)) / np.sqrt(cin)).astype("float32")
    b1 = rng.standard_normal(shape.c).astype("float32")
    wd = rng.standard_normal((shape.r, shape.s, shape.c)).astype("float32")
    bd = rng.standard_normal(shape.c).astype("float32")
    sch, plan = expand_depthwise_schedule(shape, pointwise(shape, cin), checks.VECTOR_ISA,
                                          threads=threads,
                                          expansion_epilogue=Epilogue(True, expand_act),
                                          epilogue=Epilogue(True, act))
    lib = compile_kernels(sch.mod, tpp_tvm.target(num_cores=threads)).jit()
    out = tvm.runtime.tensor(np.zeros((shape.n, shape.oh, shape.ow, shape.c), "float32"))
    packed = pack_expand_filter(w_ci[:, :, None, None], plan.vectors * LANES)
    lib(*[tvm.runtime.tensor(a) for a in (x, packed, b1, wd, bd)], out)
    want = _reference(x, w_ci, b1, wd, bd, shape, expand_act, act)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def _conv(x, w_oihw, shape: ConvShape):
    """A plain NHWC convolution in float64."""
    top, left, bottom, right = shape.pad
    xp = np.pad(x.astype("float64"), [(0, 0), (top, bottom), (left, right), (0, 0)])
    st = shape.stride
    out = np.zeros((shape.n, shape.oh, shape.ow, shape.oc))
    for i in range(shape.r):
        for j in range(shape.s):
            patch = xp[:, i:i + st * shape.oh:st, j:j + st * shape.ow:st, :]
            out += patch @ w_oihw[:, :, i, j].T
    return out


@pytest.mark.parametrize("stem,dw_stride", [
    (ConvShape(1, 29, 30, 3, 32, 3, 3, 2, (1, 1, 1, 1)), 1),   # MobileNet's stem, odd sizes
    (ConvShape(2, 16, 16, 8, 48, 3, 3, 1, (1, 1, 1, 1)), 2),   # batch 2, stride-1 window
    (ConvShape(1, 17, 16, 3, 64, 5, 5, 2, (2, 2, 1, 1)), 1),   # asymmetric padding, 5x5
])
@pytest.mark.parametrize("threads", [1, 2])
def test_stem_conv_feeding_the_depthwise_matches_numpy(stem: ConvShape, dw_stride: int,
                                                       threads: int) -> None:
    """A windowed, strided convolution as the expansion (the stem before MobileNetV2's and
    EfficientNet's first depthwise convolution): border tiles skip the padding taps."""
    shape = ConvShape(stem.n, stem.oh, stem.ow, stem.oc, stem.oc, 3, 3, dw_stride,
                      (1, 1, 1, 1))
    rng = np.random.default_rng(stem.h + stem.oc)
    x = rng.standard_normal((stem.n, stem.h, stem.w, stem.c)).astype("float32")
    w1 = (rng.standard_normal((stem.oc, stem.c, stem.r, stem.s)) / stem.r).astype("float32")
    b1 = rng.standard_normal(stem.oc).astype("float32")
    wd = rng.standard_normal((3, 3, stem.oc)).astype("float32")
    bd = rng.standard_normal(stem.oc).astype("float32")
    sch, plan = expand_depthwise_schedule(shape, stem, checks.VECTOR_ISA, threads=threads,
                                          expansion_epilogue=Epilogue(True, "silu"),
                                          epilogue=Epilogue(True, "silu"))
    lib = compile_kernels(sch.mod, tpp_tvm.target(num_cores=threads)).jit()
    out = tvm.runtime.tensor(np.zeros((shape.n, shape.oh, shape.ow, shape.c), "float32"))
    packed = pack_expand_filter(w1, plan.vectors * LANES)
    lib(*[tvm.runtime.tensor(a) for a in (x, packed, b1, wd, bd)], out)
    e = _ACTS["silu"](_conv(x, w1, stem) + b1)
    want = _ACTS["silu"](_depthwise(e, wd, shape) + bd)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def test_plan_chunks_rows_only_for_idle_threads() -> None:
    """Rows split only when the channel blocks leave threads idle (each chunk re-expands
    the rows its window shares with the one before)."""
    mobilenet = ConvShape(1, 112, 112, 96, 96, 3, 3, 2, (1, 1, 1, 1))
    assert plan_expand_depthwise(mobilenet, 16, 1).chunks == 1
    assert plan_expand_depthwise(mobilenet, 16, 2).chunks == 1   # 2 blocks of 48 channels
    three_blocks = ConvShape(1, 56, 56, 144, 144, 3, 3, 1, (1, 1, 1, 1))
    plan = plan_expand_depthwise(three_blocks, 16, 2)
    assert (plan.vectors, plan.chunks, plan.pixels) == (3, 2, 8)


def test_rows_without_a_wide_enough_tile_are_refused_clearly() -> None:
    prime = ConvShape(1, 29, 29, 48, 48, 3, 3, 1, (1, 1, 1, 1))  # no divisor up to 24
    assert plan_expand_depthwise(prime, 16, 1) is None
    with pytest.raises(UnsupportedShapeError, match=f">= {MIN_TILE_PIXELS} pixels"):
        expand_depthwise_schedule(prime, pointwise(prime, 16))


def _inverted_residual(h: int, cin: int, c: int, stride: int, act: str,
                       window: int = 1) -> object:
    """ONNX: conv (1x1, or a strided ``window`` stem) + activation, depthwise 3x3 +
    activation (NCHW, as exported)."""
    rng = np.random.default_rng(h + c)
    w1 = rng.standard_normal((c, cin, window, window)) / np.sqrt(cin * window * window)
    inits = [numpy_helper.from_array(w1.astype("float32"), "w1"),
             numpy_helper.from_array(rng.standard_normal(c).astype("float32"), "b1"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype("float32"), "wd"),
             numpy_helper.from_array(rng.standard_normal(c).astype("float32"), "bd"),
             numpy_helper.from_array(np.float32(0), "lo"),
             numpy_helper.from_array(np.float32(6), "hi")]

    def activation(src: str, dst: str) -> list:
        if act == "relu6":
            return [helper.make_node("Clip", [src, "lo", "hi"], [dst])]
        return [helper.make_node("Sigmoid", [src], [dst + "_s"]),
                helper.make_node("Mul", [src, dst + "_s"], [dst])]

    stem = {} if window == 1 else {"pads": [window // 2] * 4, "strides": [2, 2]}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["e"], **stem), *activation("e", "ea"),
             helper.make_node("Conv", ["ea", "wd", "bd"], ["d"], group=c, pads=[1, 1, 1, 1],
                              strides=[stride, stride]), *activation("d", "y")]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, h, h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _fused_side(c: int) -> int:
    """The smallest image side (a multiple of 8) whose expansion is fused on this host."""
    side = 8
    while not fusion_pays(1, side, side, c):
        side += 8
    return side


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("act,stride", [("relu6", 2), ("silu", 1)])
def test_onnx_inverted_residual_runs_as_one_kernel(act: str, stride: int) -> None:
    side = _fused_side(96)
    model = _inverted_residual(side, 16, 96, stride, act)
    x = np.random.default_rng(1).standard_normal((1, 16, side, side)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    report = compiled.report()
    assert "tpp.expand_depthwise_conv2d_bias_act: 1" in report, report
    assert not re.search(r"tpp\.(conv2d|depthwise)", report), report


@pytest.mark.requires_onnxruntime
def test_onnx_stem_and_first_depthwise_run_as_one_kernel() -> None:
    """MobileNetV2's start: a 3x3 stride-2 convolution of the RGB image, then a depthwise
    convolution on its output."""
    side = 2 * _fused_side(32)
    model = _inverted_residual(side, 3, 32, 1, "relu6", window=3)
    x = np.random.default_rng(3).standard_normal((1, 3, side, side)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    assert "tpp.expand_depthwise_conv2d_bias_act: 1" in compiled.report()


@pytest.mark.requires_onnxruntime
def test_small_expansions_stay_two_kernels() -> None:
    """An expansion that stays in the L2 runs on the GEMM TPP and the depthwise kernel."""
    side = 8
    assert not fusion_pays(1, side, side, 96)
    model = _inverted_residual(side, 16, 96, 1, "relu6")
    x = np.random.default_rng(2).standard_normal((1, 16, side, side)).astype("float32")
    report = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4,
                                                 atol=1e-4).report()
    assert "tpp.conv2d_bias_relu6" in report and "tpp.depthwise_conv2d_bias_relu6" in report
    assert "expand_depthwise" not in report


def test_fusion_threshold_is_half_the_l2() -> None:
    half = (host_isa().l2_bytes or 1024 * 1024) // 2
    assert fusion_pays(1, 1, 1, half // 4 + 1) and not fusion_pays(1, 1, 1, half // 4)


def test_fused_kernel_compiles_for_the_sve_target() -> None:
    """No cross tools needed: the kernel builds for aarch64. Like the depthwise kernel, it
    is written with fixed 16-lane vectors, which LLVM splits into 128-bit vector FMAs."""
    shape = ConvShape(1, 16, 16, 96, 96, 3, 3, 1, (1, 1, 1, 1))
    sch, _ = expand_depthwise_schedule(shape, pointwise(shape, 16), "sve",
                                       expansion_epilogue=Epilogue(True, "relu6"),
                                       epilogue=Epilogue(True, "relu6"))
    text = tvm.compile(sch.mod, target=target("sve", num_cores=1)).mod.inspect_source("asm")
    assert re.search(r"\n\s+fmla\s+[vz]\d+\.[4s]", text)


def _bf16_block() -> tuple:
    """An inverted residual block, its input and ONNX Runtime's fp32 result."""
    from tpp_tvm.onnxruntime_ref import run_onnxruntime

    side = _fused_side(96)
    model = _inverted_residual(side, 16, 96, 1, "relu6")
    x = np.random.default_rng(4).standard_normal((1, 16, side, side)).astype("float32")
    return model, x, run_onnxruntime(model, {"x": x})[0]


@pytest.mark.requires_onnxruntime
@pytest.mark.requires_avx512_bf16
def test_bf16_keeps_the_fused_fp32_kernel_off_tiles() -> None:
    """precision='bf16' on the AVX-512 unit keeps the fused fp32 kernel (faster than a bf16
    GEMM writing the expanded tensor out) and reports no bf16 for it."""
    from tpp_tvm.compiled import compile_onnx
    from tpp_tvm.target import target

    model, x, want = _bf16_block()
    fused = compile_onnx(model, target=target("avx512", num_cores=2), precision="bf16")
    assert dict(fused.report_data["lowered"]) == {
        "tpp.expand_depthwise_conv2d_bias_act": 1}, fused.report_data["lowered"]
    np.testing.assert_allclose(fused(x)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.requires_onnxruntime
def test_bf16_expansion_runs_on_tiles() -> None:
    """On AMX tiles (the tile model where the host has none) the expansion runs as a bf16
    tile GEMM before the depthwise kernel."""
    import tpp_harness as h

    from tpp_tvm.compiled import compile_onnx

    model, x, want = _bf16_block()
    tiles = compile_onnx(model, target=h.tile_target(2), precision="bf16")
    lowered = tiles.report_data["lowered"]  # the composite, its expansion on tiles
    assert lowered == {"tpp.expand_depthwise_conv2d_bias_act [bf16, amx]": 1}, lowered
    got = tiles(x)[0]
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
