"""MetaSchedule rules that tile blocks around TPP tensor intrinsics.

TVM's stock x86 rules tile a matmul for LLVM's auto-vectorizer and only know one int8
dot-product intrinsic. These rules put a BRGEMM TPP at the centre of every contraction
(recognised by :mod:`.contraction`, not by block names) and let the search choose what a
hand schedule fixes:

* the register tile (``mr x nr``) and K block of the TPP — one *design space* per
  choice, because an intrinsic name cannot change under mutation;
* the loop order around the TPP (rows or columns outer; K blocks inside or outside the
  cache tile) — also per design space;
* the cache tile and the parallel split — ``sample_perfect_tile`` decisions the
  evolutionary search mutates.

Element-wise epilogues are computed at the tile that produced their input and become
equation TPPs where their math is one (else vectorized); standalone element-wise blocks
become equation TPPs and row reductions reduce TPPs. Other blocks get TVM's stock rules. Use
:func:`default_rules` / :func:`default_postprocs` for a TPP target.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import logging
import sys
from dataclasses import dataclass

from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from ..intrinsics import TPPSpec, intrinsic
from ..intrinsics.registry import on_short_stack, vector_isa
from ..target import isa_of
from .contraction import ContractionRoles, contraction_roles
from .contraction import product_loads as _product_loads
from .elementwise import match_equation, tensorize_equation
from .gemm_plan import core_table

log = logging.getLogger(__name__)

#: Design spaces per contraction: the best register tiles, K blocks and loop orders.
MAX_TILES = 3
MAX_K_BLOCKS = 2
LOOP_ORDERS = ("rows_outer", "cols_outer", "k_outer")


def register_tiles(m: int, n: int, limit: int = MAX_TILES,
                   isa: str = "avx512") -> list[tuple[int, int]]:
    """Register tiles (mr, nr) dividing (m, n), best first.

    Known tiles are ranked by their measured efficiency (the GEMM schedule's table);
    others fit ``mr * ceil(nr/lanes) + ceil(nr/lanes)`` accumulators and B rows in the
    ISA's vector registers (``lanes``: its fp32 schedule lanes, C's accumulators are 32-bit)
    and rank by FMA chains (more independent accumulators hide latency).
    """
    unit = vector_isa(isa)
    lanes, vregs = unit.schedule_lanes("float32"), unit.num_vregs
    scored, efficiency = [], core_table(isa).tile_efficiency
    for nr in range(8, min(n, 64) + 1):
        if n % nr:
            continue
        nv = -(-nr // lanes)
        for mr in range(2, min(m, 14) + 1):
            if m % mr or (mr + 1) * nv > vregs:
                continue
            eff = efficiency.get((mr, nr))
            if eff is None:  # unmeasured: accumulator chains x lane use, scaled below table
                eff = 0.85 * min(mr * nv, 12) / 12 * nr / (nv * lanes)
            scored.append((eff, mr * nr, (mr, nr)))
    scored.sort(reverse=True)
    return [tile for _, _, tile in scored[:limit]]


def k_blocks(k: int, limit: int = MAX_K_BLOCKS) -> list[int]:
    """K blocks for the TPP: all of K when short, else divisors between 64 and 512."""
    if k <= 256:
        return [k] if k >= 2 else []
    divs = [d for d in range(64, 513) if k % d == 0]
    divs.sort(key=lambda d: (abs(d - 256), d))
    return divs[:limit] or ([k] if k <= 2048 else [])


@derived_object
class ContractionTPP(ms.schedule_rule.PyScheduleRule):
    """Tile a contraction around a BRGEMM TPP; other blocks go to ``fallback`` (TVM's
    multi-level tiling) so every PrimFunc still gets a search space."""

    def __init__(self, isa: str = "avx512", fallback: ms.ScheduleRule | None = None) -> None:
        self.isa = isa
        self.fallback = fallback

    def _initialize_with_tune_context(self, context) -> None:
        if self.fallback is not None:
            self.fallback._initialize_with_tune_context(context)  # noqa: SLF001

    def clone(self) -> ContractionTPP:
        return ContractionTPP(self.isa, self.fallback.clone() if self.fallback else None)

    def apply(self, sch: Schedule, block: SBlockRV) -> list[Schedule]:
        roles = contraction_roles(sch, block)
        if roles is None:
            return self.fallback.apply(sch, block) if self.fallback else [sch]
        spaces = []
        ext = roles.extents
        for (mr, nr), kc, order in itertools.product(
            register_tiles(ext[roles.inner_m], ext[roles.inner_n], isa=self.isa),
            k_blocks(ext[roles.inner_k]), LOOP_ORDERS,
        ):
            space = sch.copy()
            try:
                tile_contraction(space, space.get_sblock(sch.get(block).name_hint), roles,
                                 mr, nr, kc, order, self.isa)
            except Exception as err:  # noqa: BLE001 - TVM raises many types: skip the design
                log.debug("TPP design %dx%d k%d %s rejected: %s", mr, nr, kc, order,
                          str(err).splitlines()[-1])
                continue
            spaces.append(space)
        taps = conv_taps(sch, block, roles)
        if taps is not None:
            for (mr, nr), order in itertools.product(
                register_tiles(ext[roles.inner_m], ext[roles.inner_n], isa=self.isa),
                LOOP_ORDERS[:2],
            ):
                space = sch.copy()
                try:
                    tile_conv_taps(space, space.get_sblock(sch.get(block).name_hint), roles,
                                   taps, mr, nr, order, self.isa)
                except Exception as err:  # noqa: BLE001 - skip the design
                    log.debug("TPP tap design %dx%d %s rejected: %s", mr, nr, order,
                              str(err).splitlines()[-1])
                    continue
                spaces.append(space)
        if not spaces:
            log.debug("contraction %s: no TPP design fits; stock tiling",
                      sch.get(block).name_hint)
            return self.fallback.apply(sch, block) if self.fallback else [sch]
        if self.fallback is not None and not _vector_friendly(roles, self.isa):
            # A TPP tile cannot fill vectors here (an NCHW convolution's pixel row of 28 as
            # N): the stock tiling competes in the same search.
            spaces += self.fallback.apply(sch.copy(), block)
        return spaces


def _vector_friendly(roles: ContractionRoles, isa: str) -> bool:
    """Whether the TPP's N (the contiguous output dim) is a whole number of vectors."""
    return roles.extents[roles.inner_n] % vector_isa(isa).schedule_lanes("float32") == 0


def tile_contraction(sch: Schedule, block: SBlockRV, roles: ContractionRoles, mr: int,
                     nr: int, kc: int, order: str, isa: str) -> None:
    """One design: loops around a ``mr x nr x kc`` GEMM TPP, cache tile and parallel split
    sampled, epilogue at the tile."""
    loops = sch.get_loops(block)
    ext = roles.extents
    mo, mi = sch.split(loops[roles.inner_m], [None, mr])
    no, ni = sch.split(loops[roles.inner_n], [None, nr])
    ko, ki = sch.split(loops[roles.inner_k], [None, kc])
    m1, m2 = sch.split(mo, sch.sample_perfect_tile(mo, n=2, max_innermost_factor=16))
    n1, n2 = sch.split(no, sch.sample_perfect_tile(no, n=2, max_innermost_factor=16))
    outer_m = [loops[p] for p in roles.m if p != roles.inner_m]
    outer_n = [loops[p] for p in roles.n if p != roles.inner_n]
    outer_k = [loops[p] for p in roles.k if p != roles.inner_k]
    batch = [loops[p] for p in roles.batch]
    par = [*batch, *outer_m, m1, *outer_n, n1] if order != "cols_outer" else [
        *batch, *outer_n, n1, *outer_m, m1]
    tile = [m2, n2] if order == "rows_outer" else [n2, m2]
    red = [*outer_k, ko]
    inner = [mi, ni, ki]
    if order == "k_outer":
        sch.reorder(*par, *red, *tile, *inner)
    else:
        sch.reorder(*par, *tile, *red, *inner)
    fused = sch.fuse(*par) if len(par) > 1 else par[0]
    sch.parallel(fused)
    whole_k = not outer_k and ext[roles.inner_k] == kc
    epilogue_at = fused if order == "k_outer" else tile[-1]
    fuse_epilogues(sch, block, epilogue_at, mr, nr, isa)
    if not whole_k:
        init = sch.decompose_reduction(block, red[0])
        sch.vectorize(sch.get_loops(init)[-1])
    pack_weights(sch, block, roles, nr)
    spec = TPPSpec("gemm", roles.dtype, m=mr, n=nr, k=kc, beta=0 if whole_k else 1)
    sch.tensorize(mi, intrinsic(spec, isa))


def fuse_epilogues(sch: Schedule, block: SBlockRV, at, mr: int, nr: int, isa: str) -> None:
    """The contraction's consumers computed at loop ``at``, each an equation TPP where its
    math is one, else vectorized."""
    for consumer in sch.get_consumers(block):
        try:
            sch.reverse_compute_at(consumer, at)
        except Exception as err:  # noqa: BLE001 - e.g. a consumer that is a reduction
            log.debug("epilogue left in place: %s", str(err).splitlines()[-1])
            continue
        matched = match_equation(sch, consumer)
        if matched is None or not tensorize_equation(sch, consumer, matched[0], mr, nr, isa):
            sch.vectorize(sch.get_loops(consumer)[-1])


@dataclass(frozen=True)
class ConvTaps:
    """A stride-1 NHWC convolution seen as a contraction: the reduction positions of the
    filter row (``ry``), the tap (``rx``) and the channel (``rc``), and
    the channel count. Its taps and channels are one contiguous K = S*C run per input row
    once the padded input's (W, C) dims are flattened: a conv BRGEMM over filter rows."""

    ry: int
    rx: int
    rc: int
    channels: int


def conv_taps(sch: Schedule, block: SBlockRV, roles: ContractionRoles) -> ConvTaps | None:
    """The tap structure of ``block`` if it is a stride-1 NHWC convolution whose input is
    an intermediate buffer (the padded copy, which may be re-laid out) and whose filter
    ``(..., R, S, C, N)`` is layout-free; None otherwise."""
    blk = sch.get(block)
    a, b = _product_loads(blk.body)
    func = sch.mod["main"]
    if any(p.same_as(a.source) for p in func.params) or len(a.indices) < 3:
        return None
    free = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    index = next((i for i, p in enumerate(func.params) if p.same_as(b.source)), None)
    if index is None or not free or index not in [int(i) for i in free]:
        return None
    ivs = [iv.var for iv in blk.iter_vars]
    pos = {v: i for i, v in enumerate(ivs)}

    def tap_of(index: tirx.Expr, spatial: int) -> int | None:
        """k position of ``index = spatial_var + k_var``."""
        if not isinstance(index, tirx.Add):
            return None
        for s_, k_ in ((index.a, index.b), (index.b, index.a)):
            if (isinstance(s_, tirx.Var) and pos.get(s_) == spatial
                    and isinstance(k_, tirx.Var) and pos.get(k_) in roles.k):
                return pos[k_]
        return None

    rx = tap_of(a.indices[-2], roles.inner_m)
    if rx is None or [pos.get(i) if isinstance(i, tirx.Var) else None
                      for i in b.indices[-3:]] != [rx, roles.inner_k, roles.inner_n]:
        return None
    rows = [p for p in roles.m if p != roles.inner_m]
    ry = tap_of(a.indices[-3], rows[-1]) if rows else None
    others = [p for p in roles.k if p not in (rx, roles.inner_k, ry)]
    if ry is None or roles.extents[rx] < 2 or roles.extents[ry] < 2:
        return None  # a pointwise (or one-row) convolution is a plain GEMM design
    filter_row = b.indices[-4] if len(b.indices) >= 4 else None
    if others or not isinstance(filter_row, tirx.Var) or pos.get(filter_row) != ry:
        return None
    return ConvTaps(ry, rx, roles.inner_k, roles.extents[roles.inner_k])


def tile_conv_taps(sch: Schedule, block: SBlockRV, roles: ContractionRoles, taps: ConvTaps,
                   mr: int, nr: int, order: str, isa: str) -> None:
    """One convolution design: the padded input's rows flattened (W*C), taps and channels
    fused into one K, the filter packed ``(N/nr, R, S*C, nr)``, and an ``mr x nr`` conv
    BRGEMM TPP over the filter rows with the tile in registers (the hand schedule's
    kernel); cache tile and parallel split sampled as for GEMMs."""
    C = taps.channels
    sch.transform_layout(block, ("read", 0 if _reads_a_first(sch, block) else 1),
                         lambda *i: (*i[:-2], i[-2] * C + i[-1]))
    ext = roles.extents
    S = ext[taps.rx]
    R = ext[taps.ry]
    fused = (taps.rx, taps.rc)
    keep = [p for p in range(len(ext)) if p not in fused]

    def block_map(*v):
        return (*[v[p] for p in keep], v[taps.rx] * C + v[taps.rc])

    index_dtype = str(sch.get(block).iter_vars[0].var.ty)
    sch.transform_block_layout(block, tirx.IndexMap.from_func(block_map, ndim=len(ext),
                                                              index_dtype=index_dtype))
    blk = sch.get(block)
    b_read = next(i for i, r in enumerate(blk.reads)
                  if any(p.same_as(r.source) for p in sch.mod["main"].params))
    cache = sch.cache_read(block, b_read, "global")
    sch.annotate(cache, LAYOUT_REWRITE, True)
    sch.transform_layout(block, ("read", b_read),
                         lambda *i: (i[-1] // nr, *i[:-3], i[-3] * C + i[-2], i[-1] % nr))
    loops = sch.get_loops(block)
    new_pos = {p: i for i, p in enumerate(keep)}
    k = loops[-1]
    m, n = loops[new_pos[roles.inner_m]], loops[new_pos[roles.inner_n]]
    ry = loops[new_pos[taps.ry]]
    mo, mi = sch.split(m, [None, mr])
    no, ni = sch.split(n, [None, nr])
    m1, m2 = sch.split(mo, sch.sample_perfect_tile(mo, n=2, max_innermost_factor=16))
    outer = [loops[new_pos[p]] for p in (*roles.batch, *roles.m, *roles.n)
             if p not in (roles.inner_m, roles.inner_n)]
    par = [*outer, no, m1] if order == "cols_outer" else [*outer, m1, no]
    sch.reorder(*par, m2, mi, ni, ry, k)
    fused_par = sch.fuse(*par) if len(par) > 1 else par[0]
    sch.parallel(fused_par)
    fuse_epilogues(sch, block, m2, mr, nr, isa)
    spec = TPPSpec("conv_brgemm", roles.dtype, m=mr, n=nr, k=S * C, batch=R, beta=0,
                   stride=C)
    sch.tensorize(mi, intrinsic(spec, isa))


def _reads_a_first(sch: Schedule, block: SBlockRV) -> bool:
    blk = sch.get(block)
    a, _ = _product_loads(blk.body)
    return blk.reads[0].source.same_as(a.source)


#: Block annotation TVM's layout-rewrite machinery keys on: MetaSchedule's builder drops
#: such a block before timing (the operand arrives packed), Relax's
#: ``SplitLayoutRewritePreproc`` moves it out of the kernel (folded for constant weights).
LAYOUT_REWRITE = "meta_schedule.layout_rewrite_preproc"


def pack_weights(sch: Schedule, block: SBlockRV, roles: ContractionRoles, nr: int) -> bool:
    """B in (..., N/nr, K, nr) panels, as the hand schedules pack weights, when B is a
    parameter laid out (..., K, N) that the PrimFunc's ``layout_free_buffers`` attribute
    lists (a weight: an activation would be repacked on every call).

    Read straight from (K, N), each of the TPP's B rows is a separate cache line run N
    floats apart (12 KiB for a BERT FFN); packed, a tile's B is one contiguous block.
    The packing is a layout-rewrite block: not timed in tuning, and done once at build
    time for constant weights.
    """
    blk = sch.get(block)
    _, b = _product_loads(blk.body)
    func = sch.mod["main"]
    free = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    index = next((i for i, p in enumerate(func.params) if p.same_as(b.source)), None)
    if index is None or not free or index not in [int(i) for i in free] or len(b.indices) < 2:
        return False
    ivs = [iv.var for iv in blk.iter_vars]
    if not (isinstance(b.indices[-2], tirx.Var) and b.indices[-2].same_as(ivs[roles.inner_k])):
        return False
    n = int(b.source.shape[-1])
    if n % nr:
        return False
    read = next(i for i, r in enumerate(blk.reads) if r.source.same_as(b.source))
    cache = sch.cache_read(block, read, "global")
    sch.annotate(cache, LAYOUT_REWRITE, True)
    sch.transform_layout(block, ("read", read),
                         lambda *i: (*i[:-2], i[-1] // nr, i[-2], i[-1] % nr))
    return True


def register_trace_intrinsics(names) -> None:
    """Register the TPP intrinsics named in tuning records, so a record's trace replays
    in a process that has not generated them. A name is read back into its spec
    (:meth:`TPPSpec.from_name`, any TPP and dtype); other strings are skipped."""
    for name in map(str, names):
        try:
            spec, isa = TPPSpec.from_name(name)
        except ValueError:
            continue
        intrinsic(spec, isa)


@derived_object
class ElementwiseTPP(ms.schedule_rule.PyScheduleRule):
    """A standalone element-wise block that is a TPP equation: rows in parallel, each
    (rows x columns) tile one equation TPP. Other blocks pass through unchanged."""

    def __init__(self, isa: str = "avx512") -> None:
        self.isa = isa

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def clone(self) -> ElementwiseTPP:
        return ElementwiseTPP(self.isa)

    def apply(self, sch: Schedule, block: SBlockRV) -> list[Schedule]:
        try:
            matched = match_equation(sch, block)
        except Exception:  # noqa: BLE001 - a block another rule already restructured
            return [sch]
        loops = sch.get_loops(block)
        if matched is None or len(loops) < 2:
            return [sch]
        cols = sch.get(loops[-1]).extent
        nr = next((d for d in (64, 48, 32, 16) if int(cols) % d == 0), None)
        if nr is None:
            return [sch]
        space = sch.copy()
        try:
            blk = space.get_sblock(sch.get(block).name_hint)
            rows = space.get_loops(blk)[-2]  # fusing rows first would not blockize
            mr = next((d for d in (8, 4, 2) if int(space.get(rows).extent) % d == 0), None)
            outer = mr and tensorize_equation(space, blk, matched[0], mr, nr, self.isa)
            if not outer:
                return [sch]
            # The other axes and the row tiles in parallel; column tiles stay serial.
            space.parallel(space.fuse(*outer[:-1]) if len(outer) > 2 else outer[0])
        except Exception as err:  # noqa: BLE001 - leave it to the stock rules
            log.debug("element-wise TPP rejected: %s", str(err).splitlines()[-1])
            return [sch]
        return [space]


@derived_object
class ParallelizeVectorizeUnroll(ms.schedule_rule.PyScheduleRule):
    """TVM's root-level parallelize/vectorize/unroll rule, but around TPP calls (which
    bring their own parallel loop and vector code) only unrolling is left to sample.

    Vectorizing a loop around a tensorized call breaks the build, and a second parallel
    loop fails the postprocessor, so the design decides which variant applies.
    """

    def __init__(self) -> None:
        self.plain = ms.schedule_rule.ParallelizeVectorizeUnroll(
            max_jobs_per_core=16, max_vectorize_extent=64, unroll_max_steps=[0, 16, 64, 512],
            unroll_explicit=True)
        self.around_tpp = ms.schedule_rule.ParallelizeVectorizeUnroll(
            max_jobs_per_core=-1, max_vectorize_extent=0, unroll_max_steps=[0, 16, 64],
            unroll_explicit=True)

    def _initialize_with_tune_context(self, context) -> None:
        self.plain._initialize_with_tune_context(context)  # noqa: SLF001
        self.around_tpp._initialize_with_tune_context(context)  # noqa: SLF001

    def clone(self) -> ParallelizeVectorizeUnroll:
        return ParallelizeVectorizeUnroll()

    def apply(self, sch: Schedule, block: SBlockRV) -> list[Schedule]:
        has_tpp = any(inst.kind.name == "Tensorize" for inst in sch.trace.insts)
        return (self.around_tpp if has_tpp else self.plain).apply(sch, block)


#: Row reductions a block may compute, as ``reduce_<op>_cols`` TPPs (Y[i] = op_j X[i, j]).
ROW_REDUCTIONS = ("reduce_add_cols", "reduce_max_cols", "reduce_sumsq_cols")


@derived_object
class ReductionTPP(ms.schedule_rule.PyScheduleRule):
    """A reduction over the innermost axis (layer norm's mean and variance, softmax's max and
    sum): rows in parallel, each tile of rows one row-reduction TPP. The TPP is found by
    letting ``tensorize`` compare each candidate's math with the block's."""

    def __init__(self, isa: str = "avx512") -> None:
        self.isa = isa

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def clone(self) -> ReductionTPP:
        return ReductionTPP(self.isa)

    def apply(self, sch: Schedule, block: SBlockRV) -> list[Schedule]:
        try:
            blk = sch.get(block)
            types = [int(iv.iter_type) for iv in blk.iter_vars]
            loops = sch.get_loops(block)
            if (blk.init is None or types.count(2) != 1 or types[-1] != 2
                    or len(loops) != len(types) or len(loops) < 2
                    or str(blk.body.buffer.dtype) != "float32"):
                return [sch]
            name = blk.name_hint
        except Exception:  # noqa: BLE001 - a block another rule already restructured
            return [sch]
        for op in ROW_REDUCTIONS:
            space = sch.copy()
            try:
                b = space.get_sblock(name)
                lps = space.get_loops(b)
                rows = lps[-2]  # tiles of the innermost spatial axis (fusing would not blockize)
                extent = int(space.get(rows).extent)
                mr = next((d for d in (8, 4, 2) if extent % d == 0), None)
                cols = int(space.get(lps[-1]).extent)
                if mr is None or cols < 2:
                    return [sch]
                ro, ri = space.split(rows, [None, mr])
                space.tensorize(ri, intrinsic(TPPSpec(op, "float32", m=mr, n=cols), self.isa))
                outer = [*lps[:-2], ro]
                space.parallel(space.fuse(*outer) if len(outer) > 1 else outer[0])
                return [space]
            except Exception as err:  # noqa: BLE001 - not this reduction; try the next
                log.debug("%s: not %s (%s)", name, op, str(err).splitlines()[-1])
        return [sch]


def default_rules(target: Target | None = None) -> list[ms.ScheduleRule]:
    """Schedule rules for a TPP target: TPP contractions first, TVM's rules for the rest.

    The root-level parallelize/vectorize rule only unrolls around TPP calls.
    """
    isa = isa_of(target) if target is not None else "avx512"
    stock = {type(r).__name__: r for r in ms.ScheduleRule.create("llvm")}
    return [
        stock["InlineConstantScalars"],
        ms.schedule_rule.AutoInline(
            into_producer=False, into_consumer=True, inline_const_tensor=True,
            disallow_if_then_else=True, require_injective=True, require_ordered=True,
            disallow_op=["tirx.exp"],
        ),
        ContractionTPP(isa, fallback=stock["MultiLevelTiling"]),
        ElementwiseTPP(isa),
        ReductionTPP(isa),
        ParallelizeVectorizeUnroll(),
        stock["RandomComputeLocation"],
    ]


def preload_tvm_intrinsics() -> None:
    """Import TVM's tensor-intrinsic package (every ``TuneContext`` does) cheaply.

    Its ~500 TVMScript functions each walk the calling stack with ``inspect``, and
    ``inspect.getmodule`` rescans all of ``sys.modules`` for every frame it cannot map to
    a file — the frozen importlib frames of an import. Mapping those two frames to their
    modules first (what the scan would conclude anyway) and importing on a short stack
    takes it from ~37 s to ~6 s here.
    """
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    for name in ("importlib._bootstrap", "importlib._bootstrap_external"):
        inspect.modulesbyfile.setdefault(f"<frozen {name}>", name)
    on_short_stack(lambda: importlib.import_module("tvm.s_tir.tensor_intrin"))


def default_postprocs() -> list[ms.Postproc]:
    return [
        ms.postproc.DisallowDynamicLoop(),
        ms.postproc.RewriteParallelVectorizeUnroll(),
        ms.postproc.RewriteReductionBlock(),
        RewriteLayoutUnlessPacked(),
    ]


@derived_object
class RewriteLayoutUnlessPacked(ms.postproc.PyPostproc):
    """TVM's ``RewriteLayout`` (weights repacked for the stock tiling's access order) for
    designs whose weights the TPP rule did not already pack into panels."""

    def __init__(self) -> None:
        self.rewrite = ms.postproc.RewriteLayout()

    def _initialize_with_tune_context(self, context) -> None:
        self.rewrite._initialize_with_tune_context(context)  # noqa: SLF001

    def apply(self, sch: Schedule) -> bool:
        trace = sch.trace
        packed = trace is not None and any(
            i.kind.name == "Annotate" and LAYOUT_REWRITE in str(i.attrs) for i in trace.insts)
        return True if packed else self.rewrite.apply(sch)

    def clone(self) -> RewriteLayoutUnlessPacked:
        return RewriteLayoutUnlessPacked()


def default_mutators() -> dict[ms.Mutator, float]:
    return {
        ms.mutator.MutateTileSize(): 0.9,
        ms.mutator.MutateComputeLocation(): 0.05,
        ms.mutator.MutateUnroll(): 0.03,
        ms.mutator.MutateParallel(max_jobs_per_core=16): 0.02,
    }


def space_generator(target: Target | None = None) -> ms.space_generator.PostOrderApply:
    """The search space of a TPP target: our rules, postprocessors and mutators."""
    preload_tvm_intrinsics()
    return ms.space_generator.PostOrderApply(
        sch_rules=default_rules(target), postprocs=default_postprocs(),
        mutator_probs=default_mutators(),
    )
