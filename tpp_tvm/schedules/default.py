"""Default CPU schedules for operators no TPP pattern claimed, so nothing is left slow.

TVM's CPU build schedules nothing: every legalized operator runs as a scalar, single-thread
loop nest. These dlight-style rules (one class, one ``apply`` that returns None when it does
not match) give the leftovers parallel outer loops and vectorized inner loops:

* :class:`Transpose` – layout changes whose input's innermost axis is not the output's
  (NCHW <-> NHWC, a transposed matmul result): tiled so reads and writes stay in cache;
* :class:`Injective` – element-wise / broadcast / layout ops (after inlining chains);
* TVM's own ``dlight.cpu.Reduction`` (softmax, layer norm) and ``dlight.cpu.GEMV``;
* :class:`ParallelFallback` – anything else: the outermost spatial loops in parallel.

They are applied by :func:`default_schedule_pass` in the ``tpp`` pipeline after TVM's
legalization and fusion.
"""

from __future__ import annotations

import logging
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base.common_schedules import try_inline
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.s_tir.schedule import LoopRV
from tvm.target import Target

from ..errors import UnsupportedISAError
from ..intrinsics import TPPSpec
from ..intrinsics.registry import target_vector_isa
from ..target import is_tpp_target, isa_of
from .gemm_plan import register_tile_isa
from .tensorize import try_tensorize

log = logging.getLogger(__name__)

#: Below this many elements a kernel stays single-threaded (fork/join costs more).
MIN_PARALLEL_WORK = 4096
#: Parallel iterations a layout/element-wise kernel's outer loops are fused up to: enough
#: to share evenly among the cores (TVM splits a parallel loop into equal static chunks).
PARALLEL_TASKS = 64


def _extent(sch: s_tir.Schedule, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def _vector_lanes(target: Target) -> int:
    """Width inner loops are split to: the target ISA's fp32 lanes, for every dtype (the
    loop of a narrower dtype is split the same; LLVM packs its vectors)."""
    return target_vector_isa(target).schedule_lanes("float32")


def _merged_axis(block: tirx.Stmt, inner: tirx.Var, extent: int) -> int | None:
    """``k`` when a read indexes with ``inner // k`` or ``inner % k``: the output's innermost
    axis merges two of the input's (a transpose then a reshape, NCHW to (N, H, W*C))."""
    found: list[int] = []

    def visit(node, visitor):
        if isinstance(node, (tirx.FloorDiv, tirx.FloorMod)) and isinstance(node.b, tirx.IntImm) \
                and node.a.same_as(inner) and 1 < int(node.b) < extent \
                and extent % int(node.b) == 0:
            found.append(int(node.b))
        return visitor.default_visit(node)

    for region in block.reads:
        for rng in region.region:
            tvm_ffi.structural_visit(rng.min, visit)
    return found[0] if found else None


def _concat_boundaries(block: tirx.Stmt, inner: tirx.Var, extent: int) -> list[int]:
    """The constants in (0, extent) that a condition compares the innermost axis with: the
    seams of a concatenation along it (``T.if_then_else(48 <= c, b[c - 48], a[c])``)."""
    found: set[int] = set()
    # where ``c OP k`` first changes, as c grows: c < k and c >= k at k; c <= k, c > k at k + 1
    past = {tirx.LT: 0, tirx.GE: 0, tirx.LE: 1, tirx.GT: 1}
    flipped = {tirx.LT: tirx.GT, tirx.GT: tirx.LT, tirx.LE: tirx.GE, tirx.GE: tirx.LE}

    def visit(node, visitor):
        kind = type(node)
        if kind in past:
            if node.a.same_as(inner) and isinstance(node.b, tirx.IntImm):
                found.add(int(node.b) + past[kind])
            elif node.b.same_as(inner) and isinstance(node.a, tirx.IntImm):
                found.add(int(node.a) + past[flipped[kind]])  # k OP c is c OP' k
        return visitor.default_visit(node)

    tvm_ffi.structural_visit(block.body, visit)
    return sorted(b for b in found if 0 < b < extent)


def _vectorize_concat(sch: s_tir.Schedule, block, bounds: list[int], lanes: int) -> None:
    """A concatenation along the innermost axis (and what is fused onto it: DenseNet's and
    MixNet's batch norm): that loop partitioned at the seams, so each piece reads one input
    with no per-lane select, the outer loops in parallel. Seams on whole vectors: the loop
    is split into vectors first (vectorized) and the vector loop partitioned; other seams:
    the pieces are left to LLVM's vectorizer. As one vectorized loop, every vector selected
    its lanes from both inputs (MixNet-S's concat and batch norm kernels took a quarter of
    its run)."""
    loops = sch.get_loops(block)
    extent = _extent(sch, loops[-1])
    outer = loops[:-1]
    if extent % lanes == 0 and all(b % lanes == 0 for b in bounds):
        vectors, inner = sch.split(loops[-1], [None, lanes])
        sch.vectorize(inner)
        cuts, stride = bounds, lanes
    else:
        vectors, cuts, stride = loops[-1], bounds, 1
    edges = [0, *(b // stride for b in cuts), extent // stride]
    sch.loop_partition(vectors, [hi - lo for lo, hi in zip(edges, edges[1:-1], strict=False)]
                       + [None])  # the last piece inferred
    if outer and math.prod(_extent(sch, lp) for lp in outer) * extent >= MIN_PARALLEL_WORK:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def _parallel_vectorize(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Vectorize a spatial block's innermost loop ``lanes`` wide and run its leading loops
    in parallel.

    A merged innermost axis is split back first: vectorized as one axis, its ``// k`` and
    ``% k`` reads became a gather per element (NCHW to (1, 224, 224*3) ran 0.11 ms; split,
    LLVM interleaves the three channel vectors: 0.01 ms). Too short to vectorize, the split
    axis's pixel loop stays out of the parallel loop, so LLVM vectorizes across pixels (a
    QDQ ResNet-50's input quantized to NHWC u8 with 4 channels, each pixel its own parallel
    iteration: 0.130 ms; 0.029 so, AMX Xeon, 1 thread)."""
    loops = sch.get_loops(block)
    if not loops:
        return
    extents = [_extent(sch, lp) for lp in loops]
    if any(e is None for e in extents):
        return
    iters = sch.get(block).iter_vars
    merged = _merged_axis(sch.get(block), iters[-1].var, extents[-1]) \
        if len(iters) == len(loops) else None
    bounds = _concat_boundaries(sch.get(block), iters[-1].var, extents[-1]) \
        if len(iters) == len(loops) and merged is None else []
    if bounds:
        _vectorize_concat(sch, block, bounds, lanes)
        return
    if merged is not None:
        sch.split(loops[-1], [None, merged])
        loops = sch.get_loops(block)
        extents = [_extent(sch, lp) for lp in loops]
    inner = loops[-1]
    # TVM stores bool as int8 and cannot lower a vectorized store to a bool buffer allocated
    # in the kernel ("dtype mismatch on BufferStore"; a bool output is fine): a mask
    # block's loop is left to LLVM's vectorizer, whichever buffer it writes.
    bool_out = any(w.source.dtype == "bool" for w in sch.get(block).writes)
    vectorized = not bool_out and extents[-1] % lanes == 0 and extents[-1] >= lanes
    if vectorized:
        _, inner = sch.split(inner, [None, lanes])
        sch.vectorize(inner)
        loops = sch.get_loops(block)[:-1]
    elif merged is not None and len(loops) > 2:
        loops = loops[:-2]  # LLVM vectorizes the pixel loop, the short merged one unrolled
    elif len(loops) > 1:
        loops = loops[:-1]  # LLVM vectorizes the unsplit innermost loop itself
    else:
        loops = []
    if not loops or math.prod(extents) < MIN_PARALLEL_WORK:
        return
    count = len(loops)
    if vectorized:
        # Only the leading loops that make enough tasks run fused in parallel: the rest
        # stay nested, so LLVM hoists their index arithmetic (fully fused, every vector
        # recomputed its indices by division: Swin's head split, 3136 x 96 to
        # (192, 49, 32), 0.062 -> 0.039 ms). Left to LLVM's vectorizer, a nest of short
        # loops ran slower than one fused loop (ResNet's 7x7x2048 to NCHW 0.13 -> 0.27 ms).
        outer = 1
        for count, loop in enumerate(loops, start=1):
            outer *= _extent(sch, loop)
            if outer >= PARALLEL_TASKS:
                break
    lead = loops[:count]
    sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])


def _written_elements(sch: s_tir.Schedule, block) -> int | None:
    """Elements of the buffer ``block`` writes (None if not one static buffer)."""
    writes = sch.get(block).writes
    if len(writes) != 1:
        return None
    total = 1
    for dim in writes[0].source.shape:
        if not isinstance(dim, tirx.IntImm):
            return None
        total *= int(dim)
    return total


def _injective_blocks(rule: CPUScheduleRule, func: tirx.PrimFunc, target: Target):
    """(schedule, block infos) of a PrimFunc made only of injective blocks, else (None,
    None): what the Injective and Transpose rules both start from."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None, None
    # A reduction whose reduction loops all have extent 1 (a 1x1 convolution over one input
    # channel) looks injective to dlight once normalized, and inlined it read an
    # uninitialized accumulator: wrong results. Blocks with an init are reductions.
    if _has_reduction(func):
        return None, None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None or not all(info.is_injective() for info in infos):
        return None, None
    return sch, infos


def _has_reduction(func: tirx.PrimFunc) -> bool:
    """Whether a top-level block of ``func`` reduces (has an init or a reduction axis)."""
    sch = s_tir.Schedule(func)
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # noqa: BLE001 - no root block (a hand-written shape function)
        return False
    for rv in blocks:
        block = sch.get(rv)
        if block.init is not None or any(
                iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars):
            return True
    return False


class Injective(CPUScheduleRule):
    """Element-wise and broadcast chains: inline into one loop nest, parallel + vectorized.

    A producer smaller than the output (squeeze-excite's ``sigmoid`` of one value per
    channel, broadcast over every pixel) is computed once on its own, not inlined: inlined,
    its ``exp`` ran once per output element (4 ns an element on EfficientNet's scales)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch, infos = _injective_blocks(self, func, target)
        if sch is None:
            return None
        out = _written_elements(sch, infos[-1].block_rv)
        small = [i for i in infos[:-1] if out is not None
                 and (_written_elements(sch, i.block_rv) or out) * 8 <= out]
        rest = try_inline(sch, [i for i in infos if all(i is not s for s in small)])
        lanes = _vector_lanes(target)
        for info in [*small, *rest]:
            _parallel_vectorize(sch, info.block_rv, lanes)
        return sch


class BroadcastReduction(CPUScheduleRule):
    """An element-wise chain over a large tensor that also reads a reduction of a small one:
    ConvNeXt-V2's response norm divides each channel's sum by their mean, then scales and
    shifts every pixel. The small reductions (and what follows them at their size) run
    once; the large chain is inlined into one parallel, vectorized loop nest, as the
    :class:`Injective` rule does. TVM's reduction rule recomputed the mean per row and
    wrote three full-size intermediates (ConvNeXt-V2-atto's at 56x56x160: 0.44 ms)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None or not infos[-1].is_injective():
            return None
        out = _written_elements(sch, infos[-1].block_rv)
        if out is None:
            return None

        def small(info) -> bool:
            work = math.prod(int(it.dom) if isinstance(it.dom, (int, tirx.IntImm)) else out
                             for it in info.iters)
            return work * 8 <= out

        once = [i for i in infos[:-1] if small(i)]
        large = [i for i in infos if all(i is not o for o in once)]
        if not any(i.is_reduction() for i in once) or not all(i.is_injective() for i in large):
            return None
        rest = try_inline(sch, large)
        lanes = _vector_lanes(target)
        for info in rest:
            _parallel_vectorize(sch, info.block_rv, lanes)
        return sch


#: A loop annotation with no meaning to TVM; see :func:`partition_tail`.
KEEP_UNIT_LOOP = "tpp.keep_unit_loop"


def partition_tail(sch: s_tir.Schedule, loop: LoopRV) -> None:
    """Have TIR's ``LoopPartition`` split ``loop``'s ragged last iteration off.

    The pass writes a one-iteration part as its body with the loop variable replaced by an
    int32 0, even where the loop stays int64 (``NarrowDataType`` keeps it so when an index
    is cast from a float: a resize's source pixel). The tail's ``0 + 32`` then mixed int32
    with int64 and the build failed (DeepLabV3's and LR-ASPP's resized logits). A loop with
    any annotation is kept as a loop of one iteration, in its own type."""
    sch.annotate(loop, "pragma_loop_partition_hint", 1)
    sch.annotate(loop, KEEP_UNIT_LOOP, 1)


class Transpose(CPUScheduleRule):
    """A layout change: the output's innermost loop walks the input with a large stride.

    A plain loop nest then touches one element per cache line of the input (a 3199 x 512
    transpose took 7.5 ms, 4.6 ns an element). Tiling the output's innermost axis and the
    axis that indexes the input's innermost dimension by :data:`TILE` keeps a tile of
    both in L1; the tile loops are unrolled and vectorized, the rest runs in parallel."""

    TILE = 16
    #: Tiles of outer work a ragged transpose needs to keep its tile loop out of the
    #: parallel loop (enough to share among the cores).
    MIN_PARALLEL = 16

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch, infos = _injective_blocks(self, func, target)
        if sch is None:
            return None
        infos = try_inline(sch, infos)
        if len(infos) != 1:
            return None
        block = infos[0].block_rv
        iters = [iv.var for iv in sch.get(block).iter_vars]
        if self._strided_axis(sch.get(block), iters) is None:
            reshaped = self._reshapes_inlined(func)
            if reshaped is not None:
                sch, block = reshaped
                iters = [iv.var for iv in sch.get(block).iter_vars]
        loops = sch.get_loops(block)
        extents = [_extent(sch, lp) for lp in loops]
        if len(loops) != len(iters) or len(loops) < 2 or None in extents:
            return None
        strided = self._strided_axis(sch.get(block), iters)
        if strided is None or extents[strided] < self.TILE or extents[-1] < self.TILE:
            return None
        if strided == len(loops) - 2:
            tpp = self._on_transpose_tpp(sch.mod["main"], target)
            if tpp is not None:
                return tpp
        a_out, a_in = sch.split(loops[strided], [None, self.TILE])
        b_out, b_in = sch.split(loops[-1], [None, self.TILE])
        outer = [*loops[:strided], a_out, *loops[strided + 1:-1], b_out]
        sch.reorder(*outer, a_in, b_in)
        if extents[strided] % self.TILE == 0:
            sch.unroll(a_in)
        rest = extents[:strided] + [-(-extents[strided] // self.TILE)] + extents[strided + 1:-1]
        if extents[-1] % self.TILE == 0:
            sch.vectorize(b_in)
        elif math.prod(rest) >= self.MIN_PARALLEL:
            # A ragged last tile (3199 columns): the tile loop stays its own loop, split by
            # TIR's loop partitioning into whole tiles, vectorized, and the tail
            # (3199 x 512: 1.55 -> 0.97 ms); the loops around it run in parallel.
            partition_tail(sch, b_out)
            sch.vectorize(b_in)
            sch.parallel(sch.fuse(*outer[:-1]) if len(outer) > 2 else outer[0])
            return sch
        sch.parallel(sch.fuse(*outer))
        return sch

    @staticmethod
    def _reshapes_inlined(func: tirx.PrimFunc) -> tuple[s_tir.Schedule, s_tir.SBlockRV] | None:
        """A transpose whose result is then reshaped, merging axes (a GroupNorm's NHWC input
        transposed and grouped to (G, C/G * H * W)): the reshapes inlined into the
        transpose, which keeps its loops, one per input axis, so its strided axis shows.
        Inlined the other way, the merged output axis indexed the input's channel too, no
        rule matched and BiT-R50's 3136 x 256 transposes took 4.9 ms each (AMX Xeon)."""
        first = s_tir.Schedule(func)
        blocks = list(first.get_child_blocks(first.get_sblock("root")))
        for anchor, rv in enumerate(blocks if len(blocks) > 1 else []):
            own = first.get(rv)
            if Transpose._strided_axis(own, [iv.var for iv in own.iter_vars]) is None:
                continue  # not the transpose (checked before any inlining: cheap)
            sch = s_tir.Schedule(func)
            rvs = sch.get_child_blocks(sch.get_sblock("root"))
            try:  # blocks before the transpose inlined into it, blocks after it into it too
                for before in rvs[:anchor]:
                    sch.compute_inline(before)
                for later in reversed(rvs[anchor + 1:]):
                    sch.reverse_compute_inline(later)
            except Exception:  # noqa: BLE001 - not a chain of inlinable reshapes
                continue
            block = rvs[anchor]
            iters = [iv.var for iv in sch.get(block).iter_vars]
            if Transpose._strided_axis(sch.get(block), iters) is not None:
                return sch, block
        return None

    @staticmethod
    def _on_transpose_tpp(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        """The transposed plane (the last two output axes) as register-blocked transpose
        TPP calls, or None where that does not apply (then the tiled loops above).

        With gathers, a 16 x 16 tile cost a masked gather per output vector (attention's
        Kᵀ, 197 x 768 to (12, 64, 224) zero padded: 0.11 ms); the TPP loads rows, shuffles
        in registers and stores rows (0.035 ms). A zero pad (keys padded for the attention
        kernel) is decomposed first: zeros stored per plane, then the in-bound transpose.
        """
        isa = _transpose_tpp_isa(target)
        if isa is None:
            return None
        sch = s_tir.Schedule(func)
        block = sch.get_child_blocks(sch.get_sblock("root"))[0]
        dtype = sch.get(block).writes[0].source.dtype
        if dtype not in ("float32", "int32"):
            return None
        *outer, a, b = sch.get_loops(block)
        extents = [_extent(sch, lp) for lp in (*outer, a, b)]
        if None in extents:
            return None
        cols = extents[-2]  # the TPP's X is (rows, cols): rows are b's, cols a's
        tasks = math.prod(extents[:-2])
        if tasks < Transpose.MIN_PARALLEL:
            # Too few planes to share: split the plane's output rows (X's columns) too.
            chunk = max((c for c in range(Transpose.TILE, cols, Transpose.TILE)
                         if cols % c == 0 and tasks * (cols // c) >= Transpose.MIN_PARALLEL),
                        default=None)
            if chunk is not None:
                a_out, a = sch.split(a, [None, chunk])
                outer, cols = [*outer, a_out], chunk
        if sch.can_decompose_padding(block, a):
            pad = sch.decompose_padding(block, a)
            Transpose._store_zeros(sch, pad, len(outer), _vector_lanes(target))
            *_, a, b = sch.get_loops(block)
        rows = _extent(sch, b)
        if not try_tensorize(sch, a, TPPSpec("transpose", dtype, m=rows, n=cols), isa,
                             "transpose plane"):
            return None
        if outer:
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        return sch

    @staticmethod
    def _store_zeros(sch: s_tir.Schedule, pad, shared: int, lanes: int) -> None:
        """The zero fill of a decomposed pad: its plane's loops (under the ``shared`` outer
        loops it has with the transpose) fused and stored whole vectors at a time."""
        own = sch.get_loops(pad)[shared:]
        fused = sch.fuse(*own) if len(own) > 1 else own[0]
        extent = _extent(sch, fused)
        if extent is not None and extent % lanes == 0:
            fused, inner = sch.split(fused, [None, lanes])
            sch.vectorize(inner)
        if shared == 0 and extent is not None and extent >= MIN_PARALLEL_WORK:
            sch.parallel(fused)

    @staticmethod
    def _strided_axis(block, iters: list) -> int | None:
        """The iterator (not the innermost) that indexes a read's last dimension, when the
        innermost iterator does not: that read is the transposed one."""
        def uses(expr) -> set[str]:
            return {v.name for v in tirx.analysis.undefined_vars(expr, [])}

        inner = iters[-1].name
        for region in block.reads:
            used = uses(region.region[-1].min)
            if inner in used or not used:
                continue
            found = [k for k, v in enumerate(iters[:-1]) if v.name in used]
            if found:
                return found[-1]
        return None


class ColumnReduction(CPUScheduleRule):
    """A reduction over outer axes of channels-last data, its element-wise producers inlined:
    ConvNeXt-V2's global response norm (the sum of x² over H and W per channel), a pooled
    statistic. The channels stay the vector lanes inside the reduction loops, so each input
    vector is one load and one FMA into a vector accumulator; the channel vectors run in
    parallel. TVM's reduction rule takes only innermost reductions, and unscheduled this
    was a scalar loop over a materialized x² (GRN at 56x56x160: 0.47 ms a call)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None or [i.is_reduction() for i in infos].count(True) != 1 \
                or not infos[-1].is_reduction():
            return None
        try:
            for info in infos[:-1]:
                if not info.is_injective():
                    return None
                sch.compute_inline(info.block_rv)
        except Exception:  # noqa: BLE001 - a producer that cannot inline: not this rule
            return None
        block = infos[-1].block_rv
        iters, loops = sch.get(block).iter_vars, sch.get_loops(block)
        extents = [_extent(sch, lp) for lp in loops]
        kinds = [it.iter_type for it in iters]
        if len(loops) != len(iters) or None in extents or kinds[-1] != tirx.IterVar.CommReduce:
            return None
        spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == tirx.IterVar.DataPar]
        reduce = [lp for lp, k in zip(loops, kinds, strict=True) if k != tirx.IterVar.DataPar]
        channel = [it for it in iters if it.iter_type == tirx.IterVar.DataPar][-1:]
        if not spatial or not channel or not self._contiguous(sch.get(block), channel[0].var):
            return None
        lanes = _vector_lanes(target)
        width = _extent(sch, spatial[-1])
        outer = spatial[:-1]
        if width % lanes == 0 and width >= lanes:
            vectors, inner = sch.split(spatial[-1], [None, lanes])
            sch.reorder(*outer, vectors, *reduce, inner)
            sch.vectorize(inner)
            outer = [*outer, vectors]
        else:
            sch.reorder(*outer, *reduce, spatial[-1])
        if outer and math.prod(extents) >= MIN_PARALLEL_WORK:
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        sch.decompose_reduction(block, reduce[0])
        return sch

    @staticmethod
    def _contiguous(block, channel: tirx.Var) -> bool:
        """Every read indexes its last dimension by the channel iterator alone."""
        return bool(block.reads) and all(
            isinstance(r.region[-1].min, tirx.Var) and r.region[-1].min.same_as(channel)
            for r in block.reads)


class ParallelFallback(CPUScheduleRule):
    """Anything else: the leading spatial loops of each top-level block run in parallel."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        changed = False
        for info in infos:
            lead = []
            for it in info.iters:
                if it.kind != "S" or not isinstance(it.dom, tirx.IntImm):
                    break
                lead.append(it)
            loops = sch.get_loops(info.block_rv)
            if not lead or len(loops) < len(lead):
                continue
            work = 1
            for it in lead:
                work *= int(it.dom)
            if work < 2:
                continue
            try:
                outer = loops[: len(lead)]
                sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
                changed = True
            except Exception as err:  # noqa: BLE001 - leave this block serial
                log.debug("fallback: %s not parallelized: %s", info.name, err)
        return sch if changed else None


def _transpose_tpp_isa(target: Target) -> str | None:
    """The ISA whose register-blocked transpose TPP a TPP target's layout kernels use (None
    for other targets and for scalable vectors, whose transpose TPP gathers anyway)."""
    try:
        if not is_tpp_target(target):
            return None
        isa = register_tile_isa(isa_of(target))
    except UnsupportedISAError:
        return None
    return None if target_vector_isa(target).scalable else isa


class Guarded(CPUScheduleRule):
    """A TVM rule that declines (None) instead of raising where its analysis breaks:
    ``dlight.cpu.Reduction`` crashes in ``compute_at`` on some training-graph reductions
    (an nll_loss backward fused with its neighbours), which should fall through instead."""

    def __init__(self, rule: CPUScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception as err:  # noqa: BLE001 - TVM raises many types; the next rule runs
            # An exception without a message (a bare assert in dlight) must not break this.
            reason = (str(err).splitlines() or [type(err).__name__])[0]
            log.debug("%s declined: %s", type(self.rule).__name__, reason)
            return None


def default_rules() -> list:
    """The fallback rules in priority order."""
    return [Guarded(dlight.cpu.GEMV()), Guarded(BroadcastReduction()),
            Guarded(dlight.cpu.Reduction()), Guarded(ColumnReduction()), Guarded(Transpose()),
            Injective(),
            ParallelFallback()]


def default_schedule_pass() -> tvm.transform.Pass:
    """Apply :func:`default_rules` to every unscheduled PrimFunc of a module."""
    return dlight.ApplyDefaultSchedule(*default_rules())
