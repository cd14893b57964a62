"""Depthwise convolution (NHWC, one filter per channel) with its epilogue, channels as the
vector lanes.

A depthwise convolution has no reduction over channels, so it is no GEMM: each output
pixel is ``sum over taps of x[tap, c] * w[tap, c]``, a chain of broadcast-free multiply-adds
over contiguous channel vectors (LIBXSMM's depthwise kernels do the same with ``muladd``
TPPs). Per output pixel, the taps loop runs outside a vector of channels, so the
accumulators (a block of output pixels) stay in registers while each tap is one vector FMA;
the bias, activation and residual are applied before the store. Output rows run in
parallel. The kernel is written directly in TIR (not TE plus a schedule) because its pixel
blocks are split by where their taps land, which no schedule primitive here expresses
(``loop_partition`` crashes on this loop nest).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..errors import UnsupportedDTypeError, UnsupportedShapeError
from ..intrinsics.epilogue import Epilogue
from ..intrinsics.equation_template import BOUND_SLOTS, EQUATION_GROUP
from ..intrinsics.registry import vector_isa
from ..intrinsics.spec import quant_expr
from ..intrinsics.vector_math import (
    LONG_CHAINS,
    avx512_forms,
    concat_lanes,
    slice_lanes,
    statement_slots,
    vector_fn,
)
from .conv import ConvShape


def interior_pixel_blocks(shape: ConvShape, jb: int) -> tuple[int, int]:
    """[first, last) of the pixel blocks whose taps all land inside the input row: only the
    blocks outside that range test each tap's column against the padding."""
    step = jb * shape.stride
    blocks = shape.ow // jb
    first = min(blocks, -(-shape.pad[1] // step))
    span = shape.dilation * (shape.s - 1) + 1  # input columns one output pixel's taps cover
    last = (shape.w + shape.pad[1] - span - (jb - 1) * shape.stride) // step + 1
    return first, max(first, min(blocks, last))


class RowTaps:
    """Emits depthwise output rows (inside a TVMScript builder): per block of pixels and
    vector of channels, the taps as FMAs into register accumulators, then the epilogue
    (bias, activation, residual) before the store. Input rows come from ``read``, so a
    fused kernel can feed them from its own buffer (:mod:`.expand_depthwise`)."""

    def __init__(self, sh: ConvShape, isa: str, w: tirx.Buffer, bias: tirx.Buffer | None,
                 residual: tirx.Buffer | None, out: tirx.Buffer, activation: str | None,
                 post_activation: str | None,
                 quantization: tuple[tirx.Buffer, tirx.Buffer] | None = None) -> None:
        self.sh, self.w, self.bias, self.residual, self.out = sh, w, bias, residual, out
        self.quantization = quantization
        self.lanes = vector_isa(isa).schedule_lanes("float32")
        self.act = vector_fn(activation) if activation else None
        self.post = vector_fn(post_activation) if post_activation else None
        self.jb, self.tail = pixel_blocking(sh.ow)
        # A long-chain activation (SiLU) runs on EQUATION_GROUP pixels' vectors at once, so
        # their dependent chains interleave, with the AVX-512 forms (vrcp14ps, not vdivps).
        self.grouped = not vector_isa(isa).scalable and bool(
            LONG_CHAINS.intersection({activation, post_activation}))

    @classmethod
    def declare(cls, sh: ConvShape, isa: str, epilogue: Epilogue) -> RowTaps:
        """Declare the filter, [bias], [residual], [1/scale, zero point (u8/s8 output)] and
        output arguments, in that order. The epilogue's steps are applied to the
        accumulators in registers: bias, activation, residual, post-activation (no gate,
        no quantized residual)."""
        if epilogue.gate or epilogue.quantized_residual or epilogue.out_dtype == "bfloat16":
            raise UnsupportedDTypeError(
                f"depthwise conv2d: epilogue {epilogue.suffix or '(none)'} writing "
                f"{epilogue.out_dtype}; bias, activations and an fp32 residual, written as "
                "float32, uint8 or int8")
        w = T.arg("w", T.Buffer((sh.r, sh.s, sh.c), "float32"))
        bias_t = T.arg("bias", T.Buffer((sh.c,), "float32")) if epilogue.bias else None
        res_t = T.arg("residual", T.Buffer((sh.n, sh.oh, sh.ow, sh.c), "float32")) \
            if epilogue.residual else None
        quantization = None
        if epilogue.out_dtype != "float32":
            quantization = (T.arg("q_scale", T.Buffer((sh.c,), "float32")),
                            T.arg("q_offset", T.Buffer((sh.c,), "float32")))
        out = T.arg("out", T.Buffer((sh.n, sh.oh, sh.ow, sh.c), epilogue.out_dtype))
        return cls(sh, isa, w, bias_t, res_t, out, epilogue.activation,
                   epilogue.post_activation, quantization)

    def row(self, b: tirx.PrimExpr, i: tirx.PrimExpr, read: Callable, c0: tirx.PrimExpr,
            vectors: int, lanes: int | None = None) -> None:
        """Output row ``(b, i)`` for channels ``[c0, c0 + vectors * lanes)`` (``lanes``: the
        ISA's by default; fewer for a channel count below one vector); ``read(b, row, col,
        kc)`` is the input vector of the ``kc``-th of those vectors."""
        lanes = lanes or self.lanes
        first, last = interior_pixel_blocks(self.sh, self.jb)
        blocks = self.sh.ow // self.jb
        for lo, hi, checked in ((0, first, True), (first, last, False), (last, blocks, True)):
            self._pixel_blocks(b, i, lo, hi, self.jb, 0, checked, read, c0, vectors, lanes)
        if self.tail:  # the row's last pixels, fewer than a block: their own register block
            self._pixel_blocks(b, i, 0, 1, self.tail, blocks * self.jb, True, read, c0,
                               vectors, lanes)

    def _pixel_blocks(self, b, i, lo: int, hi: int, jb: int, start: int, checked: bool,
                      read: Callable, c0, vectors: int, lanes: int) -> None:
        """Pixel blocks [lo, hi) of ``jb`` pixels from pixel ``start`` of the row: taps,
        then the epilogue."""
        sh = self.sh
        if hi <= lo:
            return
        top, left = sh.pad[0], sh.pad[1]
        with T.serial(lo, hi) as jo, T.serial(0, vectors) as kc:
            lane = tirx.Ramp(c0 + kc * lanes, 1, lanes)
            acc = T.alloc_buffer((jb,), f"float32x{lanes}", scope="local")
            with T.unroll(0, jb) as aj:
                T.buffer_store(acc, tirx.Broadcast(tirx.const(0.0, "float32"), lanes), [aj])
            with T.serial(0, sh.r) as ry:
                row = i * sh.stride + ry * sh.dilation - top
                with T.If(tirx.all(row >= 0, row < sh.h)), T.Then():
                    with T.serial(0, sh.s) as rx, T.unroll(0, jb) as aj:
                        col = (start + jo * jb + aj) * sh.stride + rx * sh.dilation - left
                        fma = acc[aj] + read(b, row, col, kc) * self.w[ry, rx, lane]
                        if checked:
                            with T.If(tirx.all(col >= 0, col < sh.w)), T.Then():
                                T.buffer_store(acc, fma, [aj])
                        else:
                            T.buffer_store(acc, fma, [aj])
            first_pixel = start + jo * jb
            groups = ([list(range(g, min(g + EQUATION_GROUP, jb)))
                       for g in range(0, jb, EQUATION_GROUP)] if self.grouped else None)
            if groups:
                for pixels in groups:
                    self._epilogue(b, i, first_pixel, lane, lanes, acc, pixels)
            else:
                with T.unroll(0, jb) as aj:
                    self._epilogue(b, i, first_pixel, lane, lanes, acc, [aj])

    def _epilogue(self, b, i, first_pixel, lane, lanes: int, acc, pixels: list) -> None:
        """Bias, activation, residual and store of accumulators ``pixels`` of the block
        whose first pixel is ``first_pixel``."""

        def store(value, aj):
            if self.quantization is not None:  # the next int8 layer's input, quantized
                scale, offset = self.quantization
                value = quant_expr("quantize", value, scale[lane], offset[lane],
                                   str(self.out.dtype))
            T.buffer_store(self.out, value, [b, i, first_pixel + aj, lane])

        res = None if self.residual is None else (
            lambda aj: self.residual[b, i, first_pixel + aj, lane])
        bias = None if self.bias is None else self.bias[lane]
        apply_epilogue([acc[aj] for aj in pixels], pixels, lanes, bias, self.act, res,
                       self.post, store)


def apply_epilogue(values: list, keys: list, lanes: int, bias, act: Callable | None,
                   residual: Callable | None, post: Callable | None, store: Callable) -> None:
    """``post(act(v + bias) + residual(key))`` of the vectors ``values``, stored by
    ``store(value, key)``: all of them as one vector of len(values) registers, so a
    long-chain activation's dependent chains interleave."""
    k = len(values)
    vec = f"float32x{lanes}"

    def joined(vectors):
        return vectors[0] if k == 1 else concat_lanes(vectors)

    wide = vec if k == 1 else f"float32x{lanes * k}"
    bound = T.alloc_buffer((BOUND_SLOTS,), wide, scope="local")
    v = joined(values)
    if bias is not None:
        v = v + joined([bias] * k)
    with statement_slots(bound):
        if act is not None:
            v = act(v)
        if residual is not None:
            v = v + joined([residual(key) for key in keys])
        if post is not None:
            v = post(v)
    if k == 1:
        store(v, keys[0])
        return
    result = T.alloc_buffer((1,), wide, scope="local")
    T.buffer_store(result, v, [0])
    for u, key in enumerate(keys):
        store(slice_lanes(result[0], u * lanes, lanes), key)


def depthwise_conv_schedule(shape: ConvShape, isa: str = "avx512", *,
                            epilogue: Epilogue = Epilogue()) -> s_tir.Schedule:
    """The depthwise convolution PrimFunc: inputs x (n, h, w, c), filter (r, s, c)
    [, bias (c,)][, residual (n, oh, ow, c)][, 1/scale, zero point (c,)], output
    (n, oh, ow, c): fp32, or quantized (u8/s8 ``epilogue.out_dtype``: the next int8 layer's input,
    written by the store instead of a quantize kernel reading the fp32 result back).

    Padding is never materialized: a tap row outside the input is skipped once per output
    row, and only the pixel blocks at the row's ends test their taps' columns (the interior
    blocks run the taps unconditionally). Copying the input into a padded buffer first
    tripled the memory traffic of a layer that is bound by it (MobileNetV2's 112x112x96,
    stride 2: 0.17 -> 0.085 ms on one Zen 5 core, warm cache).

    Channels are the vector lanes of ``isa``. A channel count that is not whole vectors
    (Xception's 728, MobileNetV3's 72 and 120) ends with one vector overlapping the last
    whole one: it recomputes a few channels with the same result instead of masking lanes,
    so every FMA stays one full-width instruction. Fewer channels than one vector run on
    a vector of that many lanes."""
    sh = shape
    if sh.oc != sh.c:
        raise UnsupportedShapeError(
            f"depthwise conv2d: {sh.c} input channels but {sh.oc} outputs (multiplier 1 only)")
    if sh.r * sh.s < 2:
        raise UnsupportedShapeError("depthwise conv2d: a 1x1 window is a channel scale")
    if sh.c < 2:
        raise UnsupportedShapeError(
            "depthwise conv2d: one channel is an ordinary convolution (the conv kernel's)")
    forms = avx512_forms() if isa == "avx512" else nullcontext()
    with forms, IRBuilder() as builder, T.prim_func():
        T.func_name("main")
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        x = T.arg("x", T.Buffer((sh.n, sh.h, sh.w, sh.c), "float32"))
        taps = RowTaps.declare(sh, isa, epilogue)
        whole, rest = divmod(sh.c, taps.lanes)

        def reader(c0: int, lanes: int) -> Callable:
            return lambda b, row, col, kc: x[b, row, col, tirx.Ramp(c0 + kc * lanes, 1, lanes)]

        with T.parallel(0, sh.n * sh.oh) as rows:
            b, i = rows // sh.oh, rows % sh.oh
            if whole:
                taps.row(b, i, reader(0, taps.lanes), 0, whole)
            if rest:
                c0, lanes = (sh.c - taps.lanes, taps.lanes) if whole else (0, sh.c)
                taps.row(b, i, reader(c0, lanes), c0, 1, lanes)
    return s_tir.Schedule(builder.get())


#: Output pixels per register block: independent accumulators, so the taps' FMAs overlap
#: instead of waiting on one another (one accumulator ran at the FMA latency, 4x slower).
MAX_PIXEL_BLOCK = 8
#: The smallest block a row is split into evenly before it takes a tail block instead.
MIN_EVEN_BLOCK = 4


def pixel_blocking(ow: int) -> tuple[int, int]:
    """(block, tail): blocks of the largest divisor of the output width in
    [:data:`MIN_EVEN_BLOCK`, :data:`MAX_PIXEL_BLOCK`], else of :data:`MAX_PIXEL_BLOCK`
    pixels and one tail block of the rest (a prime width such as Xception's 19 keeps
    8-pixel blocks instead of falling to one pixel at a time)."""
    if ow <= MAX_PIXEL_BLOCK:
        return ow, 0
    even = next((b for b in range(MAX_PIXEL_BLOCK, MIN_EVEN_BLOCK - 1, -1) if ow % b == 0),
                None)
    return (even, 0) if even else (MAX_PIXEL_BLOCK, ow % MAX_PIXEL_BLOCK)
