"""GEMM on TPPs, scheduled: C = A @ B (+ bias) (+ activation), plain or batched.

The kernel is a loop nest over C tiles of ``mr x nr`` around one BRGEMM microkernel
call per tile (the whole K reduced with C kept in registers, beta = 0), followed by the
epilogue TPPs (bias add with a row broadcast, then the activation) on the tile while it
is still in L1. B is stored packed as ``(ceil(N / nr), K, nr)`` panels, zero padded, so
the microkernel streams one contiguous panel; packing is done once for constant weights
(``tpp_tvm.kernels.GemmKernel.pack_b``; graph lowering packs at build time). Output tiles
are distributed over threads as one flat parallel loop. Low precision (bf16, int8) runs the
same nest on the dot-product microkernels.

Three modules make a GEMM: ``gemm_plan.py`` chooses the blocking, ``gemm_te.py`` builds the
stages, and this one orders the loops, fuses padding and epilogue stages under the tile
loop and tensorizes them (plus the B-packing and bf16-A conversion kernels that run before
a GEMM). ``tpp_tvm.kernels`` compiles and calls the result.
"""

from __future__ import annotations

import numpy as np
from tvm import s_tir, te, tirx

from ..intrinsics import TPPSpec
from ..intrinsics.amx import A_ROWS_ATTR, TILE_CONFIG_ATTR
from ..intrinsics.epilogue import Epilogue
from ..intrinsics.prefetch import PREFETCH_ATTR
from .gemm_plan import (
    GemmPlan,
    check_gemm,
    check_low_precision,
    col_scale_once,
    k_block,
    plan_gemm,
    register_tile_isa,
    row_block,
    runs_on_tiles,
    tile_rows_outer,
    weights_outer,
)
from .gemm_te import WEIGHTS, gemm_te
from .tensorize import (
    fuse_epilogue,
    schedule_pads,
    tensorize_epilogue,
    tensorize_rows,
    try_tensorize,
)


def gemm_schedule(m: int, n: int, k: int, isa: str, *, epilogue: Epilogue = Epilogue(),
                  batch: int | None = None, b_packed: bool = True, dtype: str = "float32",
                  dequantize: bool = False, a_transposed: bool = False,
                  b_transposed: bool = False, a_scale: float = 1.0, a_col_scale: bool = False,
                  threads: int = 1) -> tuple[s_tir.Schedule, GemmPlan]:
    """The scheduled (tensorized) GEMM PrimFunc for these options, and its blocking.

    On an AMX target a bf16/int8 GEMM with packed B runs on tiles (32 x 32 blocks, one
    parallel task per thread of ``threads``, see ``intrinsics/amx.py``); everything else on the
    vector unit. Parameters in order: A, B (packed), [A's column scale (K,)], [scale,
    offset (int8 ``dequantize``)], the ``epilogue``'s operands (bias, gate, residual [, its
    scale row]), [1/scale, zero point (u8/s8 output)], output: fp32, or the epilogue's
    ``out_dtype`` (bf16: the tile converted on its way out; u8/s8: quantized, see
    :func:`~.gemm_te.epilogue_te`). An int8 GEMM writing u8/s8 with no epilogue step takes
    the requantize rows (:func:`~.gemm_te.int8_epilogue_te`) in place of scale, offset,
    1/scale and zero point."""
    check_gemm(m, n, k, dtype)
    check_low_precision(isa, dtype)
    tiles = runs_on_tiles(isa, dtype) and b_packed
    plan = gemm_plan(m, n, k, isa, dtype, b_packed)
    inputs, out, stages = gemm_te(plan, batch, epilogue, b_packed, dequantize, a_transposed,
                                  b_transposed, a_scale, a_col_scale)
    func = te.create_prim_func([*inputs, out])
    if tiles:
        if batch is None and plan.mp != plan.m and plan.kp == plan.k and not plan.a_prepadded:
            func = func.with_attr(A_ROWS_ATTR, [plan.m, plan.k])  # rows alone padded
        return schedule_tile_gemm(func, plan, batch is not None, stages, threads), plan
    return schedule_gemm(func, plan, register_tile_isa(isa), batch is not None, stages), plan


def gemm_plan(m: int, n: int, k: int, isa: str, dtype: str = "float32", b_packed: bool = True
              ) -> GemmPlan:
    """The blocking :func:`gemm_schedule` uses for these options (AMX tiles for a packed
    low-precision B on an AMX target), known before the kernel is built: it fixes the
    packed operands' layouts."""
    tiles = runs_on_tiles(isa, dtype) and b_packed
    return plan_gemm(m, n, k, dtype, isa if tiles else register_tile_isa(isa))


def schedule_gemm(func: tirx.PrimFunc, plan: GemmPlan, isa: str, batched: bool,
                  stages: list[tuple[str, tuple[str, ...]]]) -> s_tir.Schedule:
    """Tile, tensorize and parallelize a PrimFunc made by :func:`gemm_te`. Its output tiles
    prefetch the next weight panel, or K chunk (``intrinsics.prefetch``, applied by the
    ``tpp`` TIR pipeline), where packed weights are a parameter."""
    if any(param.name == WEIGHTS for param in func.params):
        func = func.with_attr(PREFETCH_ATTR, WEIGHTS)
    return _schedule_blocks(s_tir.Schedule(func), plan, isa, batched, stages)


def schedule_tile_gemm(func: tirx.PrimFunc, plan: GemmPlan, batched: bool,
                       stages: list[tuple[str, tuple[str, ...]]], threads: int
                       ) -> s_tir.Schedule:
    """:func:`schedule_gemm` on AMX tiles: output blocks as one task per thread, marked so
    that each task configures the tiles once (``intrinsics.amx.configure_tiles_per_task``,
    applied by the ``tpp`` TIR pipeline); the epilogue TPPs run on the AVX-512 unit between
    the tile calls."""
    func = func.with_attr(TILE_CONFIG_ATTR, [plan.mr, plan.nr])
    return _schedule_blocks(s_tir.Schedule(func), plan, "amx", batched, stages, threads)


def split_tasks(sch: s_tir.Schedule, loop: s_tir.LoopRV, blocks: int, threads: int
                ) -> tuple[s_tir.LoopRV, s_tir.LoopRV]:
    """Split the flat loop over output blocks into one parallel task per thread (outer,
    parallel) and the task's consecutive blocks (inner, serial)."""
    task, block = sch.split(loop, [max(1, min(threads, blocks)), None])
    sch.parallel(task)
    return task, block


def _schedule_blocks(sch: s_tir.Schedule, plan: GemmPlan, isa: str, batched: bool,
                     stages: list[tuple[str, tuple[str, ...]]], threads: int | None = None
                     ) -> s_tir.Schedule:
    """The loop nest of :func:`schedule_gemm`; with ``threads`` (tile GEMMs) the output
    blocks are split into that many parallel tasks."""
    mr, nr, k = plan.mr, plan.nr, plan.kp
    prec = plan.precision
    blk = sch.get_sblock("C")
    loops = list(sch.get_loops(blk))
    b = loops.pop(0) if batched else None
    batch_extent = int(sch.get(b).extent) if batched else 1
    i, j, *red = loops  # red: (k,) or, VNNI-packed, (k // V, V)
    io, ii = sch.split(i, [None, mr])
    jo, ji = sch.split(j, [None, nr])
    # K-blocking is for fp32 panels; a low-precision panel is 2-4x smaller per k.
    kc = k_block(k, nr, plan.mp, mr) if prec.vnni == 1 else None
    if kc is not None:
        return _schedule_k_blocked(sch, blk, plan, isa, stages, kc,
                                   [b] if batched else [], io, ii, jo, ji, red[0])
    elem = 4 // prec.vnni
    rows_outer = threads is not None and tile_rows_outer(plan.mp // mr, mr * k * elem,
                                                         k * plan.np_ * elem)
    if not rows_outer and weights_outer(plan.mp * k * elem // 4, k * plan.np_ * elem // 4):
        mc = row_block(plan.mp, k * elem, mr) if threads is not None else None
        if mc is not None:  # tiles: a row block of A stays in L2 while all panels pass
            ioo, io = sch.split(io, [None, mc // mr])
            outer = [ioo, jo, io]
        else:
            outer = [jo, io]
        sch.reorder(*outer, ii, ji, *red)
        outer = [b, *outer] if batched else outer
    else:
        sch.reorder(io, jo, ii, ji, *red)
        outer = [b, io, jo] if batched else [io, jo]
    tile_loop = sch.fuse(*outer)
    if threads is None:
        sch.parallel(tile_loop)
    vector_isa = register_tile_isa(isa)
    scale_columns(sch, tile_loop, col_scale_once(plan, batch_extent))
    schedule_pads(sch, ("A_pad", "A_scale", "B_pad",
                        *schedule_transposes(sch, plan, vector_isa)))
    epilogue = fuse_epilogue(sch, tile_loop, mr, nr, stages, copy_dtype=prec.acc)
    b_dtype = prec.b if prec.b != prec.a else None
    gemm = TPPSpec("gemm", prec.a, b_dtype=b_dtype, m=mr, n=nr, k=k, beta=0)
    if not try_tensorize(sch, ii, gemm, isa, "C tile"):
        raise RuntimeError("GEMM microkernel did not tensorize")  # a bug, not user input
    tensorize_epilogue(sch, epilogue, vector_isa)
    if threads is not None:  # after tensorizing: a split fused loop blocks blockize
        split_tasks(sch, tile_loop, (plan.mp // mr) * (plan.np_ // nr) * batch_extent, threads)
    return sch


def scale_columns(sch: s_tir.Schedule, tile_loop: s_tir.LoopRV, once: bool) -> None:
    """A's column-scaled rows (``A_colscale``): ``once``, a parallel pass over all of A
    before the tiles (see :func:`~.gemm_plan.col_scale_once`); otherwise computed per
    output tile, into a row-tile buffer in L1 that the microkernel reads (mr x K
    multiplies per mr x K x nr FMAs)."""
    try:
        blk = sch.get_sblock("A_colscale")
    except Exception:  # noqa: BLE001 - the GEMM has no column scale
        return
    if once:
        schedule_pads(sch, ("A_colscale",))
        return
    sch.compute_at(blk, tile_loop)
    sch.vectorize(sch.split(sch.get_loops(blk)[-1], [None, 16])[1])


def _schedule_k_blocked(sch, blk, plan: GemmPlan, isa: str, stages, kc: int, lead: list,
                        io, ii, jo, ji, kk) -> s_tir.Schedule:
    """Large K: per column panel, reduce K in L2-sized blocks over all row blocks.

    C's (M x nr) panel is zeroed once, each K block accumulates into it (beta 1: the tile
    reload is cheap next to kc FMAs per element) and the epilogue runs on the finished
    panel. Panels are the parallel unit.
    """
    ko, ki = sch.split(kk, [None, kc])
    sch.reorder(*lead, jo, ko, io, ii, ji, ki)
    panel_loop = sch.fuse(*lead, jo) if lead else jo
    sch.parallel(panel_loop)
    schedule_pads(sch, ("A_pad", "A_scale", "A_colscale", "B_pad",
                        *schedule_transposes(sch, plan, isa)))
    epilogue = fuse_epilogue(sch, panel_loop, plan.mp, plan.nr, stages)
    init = sch.decompose_reduction(blk, ko)
    tensorize_rows(sch, init, TPPSpec("zero", m=plan.mp, n=plan.nr), isa, "C panel init")
    gemm = TPPSpec("gemm", "float32", m=plan.mr, n=plan.nr, k=kc, beta=1)
    if not try_tensorize(sch, ii, gemm, isa, "C tile"):
        raise RuntimeError("K-blocked GEMM microkernel did not tensorize")  # a bug
    tensorize_epilogue(sch, epilogue, isa)
    return sch


#: Rows of A per transpose TPP when a transposed A is copied into rows.
TRANSPOSE_ROWS = 16


def schedule_transposes(sch: s_tir.Schedule, plan: GemmPlan, isa: str) -> list[str]:
    """Transposed operands copied in as transpose TPPs (Bᵀ: one (nr x K) block per panel;
    Aᵀ: one (K x 16) block per 16 rows). Returns the stages left for :func:`schedule_pads`
    (padded ones, whose edge blocks no TPP matches)."""
    left = []
    for name in ("A_transpose", "B_pack"):
        try:
            block = sch.get_sblock(name)
        except Exception:  # noqa: BLE001 - no such operand in this GEMM
            continue
        loops = sch.get_loops(block)
        if name == "B_pack":
            *lead, jb, kk, _ = loops
            spec = TPPSpec("transpose", m=plan.nr, n=plan.kp)
            padded = plan.np_ != plan.n or plan.kp != plan.k
            anchor, outer = kk, [*lead, jb]
        else:
            *lead, i, _ = loops
            spec = TPPSpec("transpose", m=plan.kp, n=TRANSPOSE_ROWS)
            padded = plan.mp != plan.m or plan.kp != plan.k or plan.m % TRANSPOSE_ROWS
            if not padded:
                io, anchor = sch.split(i, [None, TRANSPOSE_ROWS])
                outer = [*lead, io]
        if padded:
            left.append(name)
            continue
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        if not try_tensorize(sch, anchor, spec, isa, name):
            sch.vectorize(sch.get_loops(block)[-1])
    return left


def pack_b_schedule(k: int, n: int, nr: int, kp: int, b_layout: str, isa: str
                    ) -> s_tir.Schedule:
    """B packing as a TPP kernel: each (kp x nr) panel is one copy TPP (``kn``: a strided
    block of B) or one transpose TPP (``nk``: a linear layer's weight); zero padding
    (N or K tails) is a plain vectorized loop."""
    np_ = -(-n // nr) * nr
    B = te.placeholder((k, n) if b_layout == "kn" else (n, k), "float32", name="B")

    def at(kk, j):
        return B[kk, j] if b_layout == "kn" else B[j, kk]

    padded = (kp, np_) != (k, n)

    def panel(jb, kk, jj):
        j = jb * nr + jj
        if not padded:
            return at(kk, j)
        return tirx.if_then_else(tirx.all(kk < k, j < n),
                                 at(tirx.min(kk, k - 1), tirx.min(j, n - 1)),
                                 tirx.const(0, "float32"))

    Bp = te.compute((np_ // nr, kp, nr), panel, name="pack")
    sch = s_tir.Schedule(te.create_prim_func([B, Bp]))
    jb, kk, jj = sch.get_loops(sch.get_sblock("pack"))
    sch.parallel(jb)
    spec = (TPPSpec("copy", m=kp, n=nr) if b_layout == "kn"
            else TPPSpec("transpose", m=nr, n=kp))
    if padded or not try_tensorize(sch, kk, spec, isa, "B panel"):
        sch.vectorize(jj)
    return sch


def bf16_a_schedule(m: int, k: int, mp: int, kp: int, isa: str,
                    lead: tuple[int, ...] = (), in_dtype: str = "float32") -> s_tir.Schedule:
    """fp32 A (..., m, k) -> bf16 A zero-padded to (..., mp, kp): the operand a bf16 GEMM
    kernel takes (see :attr:`GemmPlan.a_prepadded`). Rows are parallel; unpadded rows are
    fp32 -> bf16 copy TPPs (``vcvtneps2bf16``), padded ones a scalar loop (TVM cannot
    vectorise predicated bf16 stores). ``in_dtype="bfloat16"`` (a producer wrote bf16):
    the padding only."""
    A = te.placeholder((*lead, m, k), in_dtype, name="A")
    padded = (mp, kp) != (m, k)
    if not padded and in_dtype == "bfloat16":
        raise ValueError("bf16 A needs no conversion kernel unless it is padded")

    def at(*ix):
        i, j = ix[-2], ix[-1]
        if not padded:
            return tirx.Cast("bfloat16", A[ix])
        inside = tirx.all(i < m, j < k)
        src = A[(*ix[:-2], tirx.min(i, m - 1), tirx.min(j, k - 1))]
        value = src if in_dtype == "bfloat16" else tirx.Cast("bfloat16", src)
        return tirx.if_then_else(inside, value, tirx.const(0, "bfloat16"))

    out = te.compute((*lead, mp, kp), at, name="to_bf16")
    sch = s_tir.Schedule(te.create_prim_func([A, out]))
    blk = sch.get_sblock("to_bf16")
    loops = sch.get_loops(blk)
    rows = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    total = mp * int(np.prod(lead or (1,)))
    r = next((d for d in (8, 4, 6, 2, 3, 5, 7) if total % d == 0 and total > d), None)
    if not padded and r is not None:
        ro, ri = sch.split(rows, [None, r])
        sch.parallel(ro)
        if try_tensorize(sch, ri, TPPSpec("copy", "float32", m=r, n=kp,
                                          out_dtype="bfloat16"), isa, "A to bf16"):
            return sch
        sch = s_tir.Schedule(te.create_prim_func([A, out]))
        blk = sch.get_sblock("to_bf16")
    sch.parallel(sch.get_loops(blk)[0])
    return sch
