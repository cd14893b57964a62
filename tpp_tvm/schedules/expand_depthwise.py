"""A convolution feeding a depthwise one, as one kernel: the 1x1 expansion of an inverted
residual block (MobileNetV2, EfficientNet), or the stem before the first depthwise
convolution, computed a few rows at a time into a ring buffer that the depthwise taps read
while it is still in cache.

Unfused, the expansion writes its output (six times the block's channels: MobileNetV2's
first, 112 x 112 x 96, is 4.8 MB) and the depthwise convolution reads it back, both from
memory once it exceeds the L2 (measured on one Zen 5 core: that depthwise convolution takes
0.23 ms after the expansion, 0.085 ms on a warm input). oneDNN fuses the same pair (its
depthwise post-op, which OpenVINO uses).

Each task owns a block of expanded channels and a chunk of output rows. Per output row it
expands the input rows the window newly reaches (all ``r`` of them at the chunk's first
row, ``stride`` afterwards) into ring slot ``row mod r`` — a register tile of pixels x
channel vectors accumulating taps x input channels (a stem's padding columns tested in the
border tiles only), the expansion's bias and activation applied before the store — then runs
the depthwise taps of that row (:class:`.depthwise.RowTaps`) on the ring. Only a chunk's
first window re-expands rows its neighbour chunk also expands, so chunks are as few as the
threads allow (:func:`plan_expand_depthwise`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..errors import UnsupportedShapeError
from ..intrinsics.epilogue import Epilogue
from ..intrinsics.equation_template import EQUATION_GROUP
from ..intrinsics.registry import vector_isa
from ..intrinsics.vector_math import LONG_CHAINS, avx512_forms, vector_fn
from ..target import host_isa
from .conv import ConvShape
from .depthwise import RowTaps, apply_epilogue, interior_pixel_blocks

#: Accumulators of the expansion's register tile (pixels x channel vectors) on 32 vector
#: registers, leaving registers for the filter vectors and the broadcast input (three
#: quarters of the register file: 12 on AVX2's 16).
TILE_ACCUMULATORS = 24
#: Channel blocks a task may own, in vectors, best first (3 vectors: an 8 x 48 tile, the
#: shape of the GEMM TPP's own register tile on AVX-512).
BLOCK_VECTORS = (3, 4, 2, 1)
#: Fewest pixels in the expansion's register tile: below that the filter vectors are
#: reloaded for too few FMAs, and the two unfused kernels are faster.
MIN_TILE_PIXELS = 4


def fusion_pays(n: int, h: int, w: int, c: int) -> bool:
    """Whether an expansion output of (n, h, w, c) fp32 is worth fusing away: when it is
    larger than half the L2 (the host's), which the two kernels would stream it through.

    Measured in MobileNetV2 on one Zen 5 core (1 MiB L2), fused against the two kernels:
    112x112x96 0.37 -> 0.27 ms, 56x56x144 0.27 -> 0.17, 28x28x192 0.155 -> 0.145; below half
    the L2 the pair lost (14x14x384 0.248 -> 0.264, 7x7x960 0.257 -> 0.29 for three): the
    GEMM TPP's packed, prefetched panels beat this kernel's expansion tile when nothing
    leaves the cache. MobileNetV2's stem (3x3, stride 2, into 112x112x32) with its first
    depthwise convolution: 0.37 -> 0.22 ms."""
    l2 = host_isa().l2_bytes or 1024 * 1024
    return 4 * n * h * w * c > l2 // 2


@dataclass(frozen=True)
class ExpandPlan:
    """``vectors`` channel vectors per task, ``chunks`` output row chunks per image,
    ``pixels`` pixels per expansion register tile."""

    vectors: int
    chunks: int
    pixels: int


def plan_expand_depthwise(shape: ConvShape, lanes: int, threads: int, vregs: int = 32
                          ) -> ExpandPlan | None:
    """Blocking for :func:`expand_depthwise_schedule`, or None where none is efficient (a
    tile of fewer than :data:`MIN_TILE_PIXELS` pixels: no divisor of the row width fits).

    Chunks trade re-expanded rows (``r - stride`` per chunk boundary) against idle threads:
    the cost of a choice is the expanded rows over the image's times the thread imbalance,
    over the tile's efficiency (a model, not a measurement: the square root of its share of
    :data:`TILE_ACCUMULATORS`, so narrower blocks lose only where they buy balance).
    ``vregs``: the vector registers of the ISA (the tile scales with them)."""
    if shape.c % lanes:
        return None
    accumulators = TILE_ACCUMULATORS * vregs // 32
    best = None
    for vectors in BLOCK_VECTORS:
        if shape.c % (vectors * lanes):
            continue
        pixels = next((p for p in range(min(shape.w, accumulators // vectors), 0, -1)
                       if shape.w % p == 0), 1)
        if pixels < MIN_TILE_PIXELS:
            continue
        efficiency = min(1.0, vectors * pixels / accumulators) ** 0.5
        tasks_per_chunk = shape.n * shape.c // (vectors * lanes)
        for chunks in range(1, shape.oh + 1):
            rows = -(-shape.oh // chunks)
            window = min(shape.h, (rows - 1) * shape.stride + shape.r)
            expanded = chunks * window / shape.h
            tasks = tasks_per_chunk * chunks
            imbalance = -(-tasks // threads) * threads / tasks
            cost = max(expanded, 1.0) * imbalance / efficiency
            if best is None or cost < best[0] - 1e-9:
                best = (cost, ExpandPlan(vectors, chunks, pixels))
    return None if best is None else best[1]


def pack_expand_filter(w_oihw: np.ndarray, block: int) -> np.ndarray:
    """The expansion's filter (c, cin, r, s) as the kernel reads it: one contiguous
    (r, s, cin, block) panel per channel block, ``(c // block, r, s, cin, block)``."""
    c, cin, r, s = w_oihw.shape
    panels = w_oihw.reshape(c // block, block, cin, r, s).transpose(0, 3, 4, 2, 1)
    return np.ascontiguousarray(panels, dtype="float32")


def pointwise(shape: ConvShape, cin: int) -> ConvShape:
    """The 1x1 expansion of ``cin`` channels into the input of the depthwise ``shape``."""
    return ConvShape(shape.n, shape.h, shape.w, cin, shape.c, 1, 1)


def _check_fusable(sh: ConvShape, ex: ConvShape, expansion_epilogue: Epilogue,
                   plan: ExpandPlan | None, lanes: int) -> None:
    """Raise ``UnsupportedShapeError`` unless the fused kernel takes this pair: channels
    in whole vectors and a wide enough row tile, the expansion's output the depthwise
    input, and the expansion's epilogue a bias and an activation in fp32."""
    if sh.oc != sh.c or plan is None:
        raise UnsupportedShapeError(
            f"expansion + depthwise conv2d: {sh.c} channels of {sh.w}-pixel rows (the "
            f"channels a multiple of {lanes}, a row tile of >= {MIN_TILE_PIXELS} pixels)")
    if (ex.n, ex.oh, ex.ow, ex.oc, ex.groups) != (sh.n, sh.h, sh.w, sh.c, 1):
        raise UnsupportedShapeError(
            f"expansion + depthwise conv2d: the expansion's output {ex.n}x{ex.oh}x{ex.ow}x"
            f"{ex.oc} (groups {ex.groups}) is not the depthwise input {sh.n}x{sh.h}x{sh.w}"
            f"x{sh.c}")
    if expansion_epilogue.post_steps or expansion_epilogue.out_dtype != "float32":
        raise UnsupportedShapeError(
            f"expansion + depthwise conv2d: the expansion's epilogue "
            f"{expansion_epilogue.suffix} writing {expansion_epilogue.out_dtype}; a bias and "
            "an activation, in fp32")


@dataclass(frozen=True)
class _ExpandedRows:
    """The expansion's half of the fused kernel, written inside its ``IRBuilder``: rows of
    the expansion's output, pixel tile by pixel tile, into the ring of rows the depthwise
    taps read. ``x``, ``w1``, ``b1``: the kernel's input, packed filter and bias buffers;
    pixel tiles [``first``, ``last``) of a row read no padding column."""

    ex: ConvShape
    plan: ExpandPlan
    lanes: int
    act: Callable | None
    grouped: bool
    x: tirx.Buffer
    w1: tirx.Buffer
    b1: tirx.Buffer | None
    width: int
    first: int
    last: int

    def tiles(self, b, h, ring, slot, c0, lo: int, hi: int, checked: bool) -> None:
        """Pixel tiles [lo, hi) of expanded row ``h``, channels [c0, c0 + block), into
        ring slot ``slot``: taps x input channels as FMAs, then bias and activation."""
        ex, lanes, x, w1, b1 = self.ex, self.lanes, self.x, self.w1, self.b1
        px, nv = self.plan.pixels, self.plan.vectors
        vec, block = f"float32x{lanes}", nv * lanes
        act, grouped = self.act, self.grouped
        if hi <= lo:
            return
        with T.serial(lo, hi) as po:
            acc = T.alloc_buffer((px * nv,), vec, scope="local")
            for u in range(px * nv):
                T.buffer_store(acc, tirx.Broadcast(tirx.const(0.0, "float32"), lanes), [u])
            with T.serial(0, ex.r) as ry:
                row = h * ex.stride + ry - ex.pad[0]
                with T.If(tirx.all(row >= 0, row < ex.h)), T.Then():
                    with T.serial(0, ex.s) as rx, T.serial(0, ex.c) as k:
                        for p in range(px):
                            col = (po * px + p) * ex.stride + rx - ex.pad[1]
                            value = x[b, row, col, k]
                            if checked:
                                value = tirx.if_then_else(
                                    tirx.all(col >= 0, col < ex.w), value,
                                    tirx.const(0.0, "float32"))
                            a = tirx.Broadcast(value, lanes)
                            for v in range(nv):
                                filt = w1[c0 // block, ry, rx, k,
                                          tirx.Ramp(v * lanes, 1, lanes)]
                                T.buffer_store(acc, acc[p * nv + v] + a * filt,
                                               [p * nv + v])
            for v in range(nv):
                bias_v = None if b1 is None else b1[tirx.Ramp(c0 + v * lanes, 1, lanes)]
                size = EQUATION_GROUP if grouped else 1
                for g in range(0, px, size):
                    pixels = list(range(g, min(g + size, px)))

                    def store(value, p, v=v):
                        T.buffer_store(ring, value,
                                       [slot, po * px + p, tirx.Ramp(v * lanes, 1, lanes)])
                    apply_epilogue([acc[p * nv + v] for p in pixels], pixels, lanes,
                                   bias_v, act, None, None, store)

    def row(self, b, h, ring, slot, c0) -> None:
        """Expanded row ``h``: border tiles checked against the padding, interior ones
        not."""
        tiles = self.width // self.plan.pixels
        self.tiles(b, h, ring, slot, c0, 0, self.first, True)
        self.tiles(b, h, ring, slot, c0, self.first, self.last, False)
        self.tiles(b, h, ring, slot, c0, self.last, tiles, True)


def expand_depthwise_schedule(shape: ConvShape, expansion: ConvShape, isa: str = "avx512",
                              *, threads: int = 1,
                              expansion_epilogue: Epilogue = Epilogue(),
                              epilogue: Epilogue = Epilogue()
                              ) -> tuple[s_tir.Schedule, ExpandPlan]:
    """The fused kernel and its blocking: inputs x (n, h1, w1, cin), the expansion's filter
    packed by :func:`pack_expand_filter` with ``plan.vectors`` vectors a block [and its
    bias (c,)], the depthwise filter (r, s, c) [, bias (c,)][, residual (n, oh, ow, c)];
    output (n, oh, ow, c). ``shape`` is the depthwise convolution's (c expanded channels),
    ``expansion`` the convolution producing its input: 1x1 (:func:`pointwise`) or any
    window and stride (a stem). ``expansion_epilogue`` applies to the expanded rows (a bias
    and an activation), ``epilogue`` to the depthwise result."""
    sh, ex = shape, expansion
    lanes = vector_isa(isa).schedule_lanes("float32")
    plan = plan_expand_depthwise(sh, lanes, threads, vector_isa(isa).num_vregs)
    _check_fusable(sh, ex, expansion_epilogue, plan, lanes)
    expand_activation = expansion_epilogue.activation
    block = plan.vectors * lanes
    blocks = sh.c // block
    rows = -(-sh.oh // plan.chunks)
    act = vector_fn(expand_activation) if expand_activation else None
    grouped = not vector_isa(isa).scalable and expand_activation in LONG_CHAINS
    forms = avx512_forms() if isa == "avx512" else nullcontext()
    # pixel tiles whose window columns are all inside the input row run unchecked
    first, last = interior_pixel_blocks(ex, plan.pixels)

    with forms, IRBuilder() as builder, T.prim_func():
        T.func_name("main")
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        x = T.arg("x", T.Buffer((ex.n, ex.h, ex.w, ex.c), "float32"))
        w1 = T.arg("w_expand", T.Buffer((blocks, ex.r, ex.s, ex.c, block), "float32"))
        b1 = T.arg("bias_expand", T.Buffer((sh.c,), "float32")) \
            if expansion_epilogue.bias else None
        taps = RowTaps.declare(sh, isa, epilogue)
        expansion = _ExpandedRows(ex, plan, lanes, act, grouped, x, w1, b1, sh.w, first, last)

        with T.parallel(0, sh.n * plan.chunks * blocks) as task:
            b = task // (plan.chunks * blocks)
            chunk = task // blocks % plan.chunks
            c0 = task % blocks * block
            ring = T.alloc_buffer((sh.r, sh.w, block), "float32")

            def read(b, row, col, kc):
                return ring[tirx.floormod(row, sh.r), col, tirx.Ramp(kc * lanes, 1, lanes)]

            with T.serial(0, rows) as ii:
                i = chunk * rows + ii
                with T.If(i < sh.oh), T.Then():
                    top = i * sh.stride - sh.pad[0]
                    # rows the previous window held: [top - stride, top - stride + r)
                    new = tirx.Select(ii == 0, top, tirx.max(top, top - sh.stride + sh.r))
                    with T.serial(0, sh.r) as k:
                        h = top + k
                        with T.If(tirx.all(h >= new, h >= 0, h < sh.h)), T.Then():
                            expansion.row(b, h, ring, tirx.floormod(h, sh.r), c0)
                    taps.row(b, i, read, c0, plan.vectors)
    return s_tir.Schedule(builder.get()), plan
