"""Depthwise convolution (NHWC, one filter per channel) with its epilogue, channels as the
vector lanes.

A depthwise convolution has no reduction over channels, so it is no GEMM: each output
pixel is ``sum over taps of x[tap, c] * w[tap, c]``, a chain of broadcast-free multiply-adds
over contiguous channel vectors (LIBXSMM's depthwise kernels do the same with ``muladd``
TPPs). Per output pixel, the taps loop runs outside a vector of channels, so the
accumulators (a block of output pixels) stay in registers while each tap is one vector FMA;
the bias, activation and residual are applied before the store. Output rows run in
parallel; the zero padding is its own parallel, vectorized pass.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from ..errors import UnsupportedShapeError
from ..intrinsics.registry import vector_isa
from ..intrinsics.vector_math import vector_fn
from .conv import ConvShape


def depthwise_te(shape: ConvShape, bias: bool, activation: str | None, residual: bool,
                 post_activation: str | None = None) -> tuple[list[te.Tensor], te.Tensor]:
    """Inputs x (n, h, w, c), filter (r, s, c)[, bias (c,)][, residual]; the output."""
    sh = shape
    if sh.oc != sh.c:
        raise UnsupportedShapeError(
            f"depthwise conv2d: {sh.c} input channels but {sh.oc} outputs (multiplier 1 only)")
    x = te.placeholder((sh.n, sh.h, sh.w, sh.c), "float32", name="x")
    w = te.placeholder((sh.r, sh.s, sh.c), "float32", name="w")
    top, left, bottom, right = sh.pad
    padded = te.compute(
        (sh.n, sh.h + top + bottom, sh.w + left + right, sh.c),
        lambda b, i, j, k: tirx.if_then_else(
            tirx.all(i >= top, i < sh.h + top, j >= left, j < sh.w + left),
            x[b, i - top, j - left, k], tirx.const(0.0, "float32")),
        name="padded")
    ry = te.reduce_axis((0, sh.r), name="ry")
    rx = te.reduce_axis((0, sh.s), name="rx")
    acc = te.compute(
        (sh.n, sh.oh, sh.ow, sh.c),
        lambda b, i, j, k: te.sum(
            padded[b, i * sh.stride + ry, j * sh.stride + rx, k] * w[ry, rx, k], axis=[ry, rx]),
        name="acc")
    inputs = [x, w]
    bias_t = te.placeholder((sh.c,), "float32", name="bias") if bias else None
    res_t = te.placeholder(acc.shape, "float32", name="residual") if residual else None
    inputs += [t for t in (bias_t, res_t) if t is not None]
    act = vector_fn(activation) if activation else None
    post = vector_fn(post_activation) if post_activation else None

    def epilogue(*i):
        v = acc(*i)
        if bias_t is not None:
            v = v + bias_t[i[-1]]
        if act is not None:
            v = act(v)
        if res_t is not None:
            v = v + res_t(*i)
        if post is not None:
            v = post(v)
        return v

    return inputs, te.compute(acc.shape, epilogue, name="out")


def depthwise_conv_schedule(shape: ConvShape, isa: str = "avx512", *, bias: bool = False,
                            activation: str | None = None, residual: bool = False,
                            post_activation: str | None = None) -> s_tir.Schedule:
    """The scheduled depthwise convolution PrimFunc (parameters as :func:`depthwise_te`).

    Channels are the vector lanes of ``isa``: the channel count must be a multiple of them
    (every depthwise layer of MobileNet, EfficientNet and ConvNeXt is); others stay on TVM."""
    if shape.r * shape.s < 2:
        raise UnsupportedShapeError("depthwise conv2d: a 1x1 window is a channel scale")
    lanes = vector_isa(isa).schedule_lanes("float32")
    if shape.c % lanes:
        raise UnsupportedShapeError(
            f"depthwise conv2d: {shape.c} channels; the kernel takes multiples of {lanes}")
    inputs, out = depthwise_te(shape, bias, activation, residual, post_activation)
    sch = s_tir.Schedule(te.create_prim_func([*inputs, out]))
    # Padding as its own pass: made per output row instead (compute_at), the rows' overlap
    # was copied r times and the kernel got slower (56x56x144, 3x3: 0.31 -> 0.37 ms).
    pad = sch.get_sblock("padded")
    b, i, j, k = sch.get_loops(pad)
    sch.parallel(sch.fuse(b, i))
    sch.vectorize(sch.split(k, [None, lanes])[1])
    out_block = sch.get_sblock("out")
    b, i, j, k = sch.get_loops(out_block)
    rows = sch.fuse(b, i)
    jb = pixel_block(shape.ow)
    jo, ji = sch.split(j, [None, jb])
    ko, ki = sch.split(k, [None, lanes])
    sch.reorder(jo, ko, ji, ki)
    sch.parallel(rows)
    acc = sch.get_sblock("acc")
    sch.compute_at(acc, ko)
    sch.set_scope(acc, 0, "local")  # jb vectors: registers across the taps, not memory
    if jb > 1:
        aj, ac, ry, rx = sch.get_loops(acc)[-4:]
        sch.reorder(ry, rx, aj, ac)
        sch.unroll(aj)
    else:  # the unit pixel loop is gone after compute_at
        ac, ry, rx = sch.get_loops(acc)[-3:]
        sch.reorder(ry, rx, ac)
    sch.vectorize(ac)  # before decompose_reduction (see DESIGN.md)
    sch.vectorize(ki)
    sch.decompose_reduction(acc, ry)
    return sch


#: Output pixels per register block: independent accumulators, so the taps' FMAs overlap
#: instead of waiting on one another (one accumulator ran at the FMA latency, 4x slower).
MAX_PIXEL_BLOCK = 8


def pixel_block(ow: int) -> int:
    """The largest divisor of the output width up to :data:`MAX_PIXEL_BLOCK`."""
    return next(b for b in range(min(MAX_PIXEL_BLOCK, ow), 0, -1) if ow % b == 0)
