"""GEMM on TPPs: C = A @ B (+ bias) (+ activation), plain or batched, with B packed.

The kernel is a loop nest over C tiles of ``mr x nr`` around one BRGEMM microkernel
call per tile (the whole K reduced with C kept in registers, beta = 0), followed by the
epilogue TPPs (bias add with a row broadcast, then the activation) on the tile while it
is still in L1. B is stored packed as ``(ceil(N / nr), K, nr)`` panels, zero padded, so
the microkernel streams one contiguous panel; packing is done once for constant weights
(``tpp_tvm.kernels.GemmKernel.pack_b``; graph lowering packs at build time). Tile sizes come
from the register file and cache sizes, so no tuning is needed; output tiles are
distributed over threads as one flat parallel loop.

Low precision (``dtype="bfloat16"``: bf16 x bf16 -> fp32; ``dtype="int8"``: u8 x s8 ->
int32) runs the same nest on the dot-product microkernels: B's panels are VNNI-packed
``(ceil(N / nr), K / V, nr, V)`` (V = 2 or 4 consecutive k of a column adjacent), K is
padded to a multiple of V, and an int8 GEMM's int32 tile is dequantized to fp32 in its
epilogue (``Y = float(C) * scale[j] + offset[j]``) before the fp32 epilogue steps.

Shapes that are not multiples of the tile are padded internally (A rows only when M has
no good tile divisor, C through a per-tile copy fused into the epilogue), never read or
written out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import s_tir, te, tirx

from ..errors import UnsupportedDTypeError, UnsupportedShapeError
from ..intrinsics import OPS, TPPSpec
from ..intrinsics.spec import equation_expr, equation_operands, quant_expr
from ..target import host_isa
from .tensorize import (
    fuse_epilogue,
    schedule_pads,
    tensorize_epilogue,
    tensorize_rows,
    try_tensorize,
)

#: Activations a GEMM epilogue accepts: every unary TPP except zero/copy.
ACTIVATIONS = tuple(op for op, d in OPS.items() if d.kind == "unary" and op != "copy")


@dataclass(frozen=True)
class Precision:
    """A GEMM precision: A, B and accumulator dtypes and B's VNNI factor."""

    a: str
    b: str
    acc: str
    vnni: int


#: GEMM precisions by the ``dtype`` a user asks for.
PRECISIONS: dict[str, Precision] = {
    "float32": Precision("float32", "float32", "float32", 1),
    "bfloat16": Precision("bfloat16", "bfloat16", "float32", 2),
    "int8": Precision("uint8", "int8", "int32", 4),
}


@dataclass(frozen=True)
class GemmPlan:
    """Blocking of one GEMM: the register tile (mr x nr) and the padded extents."""

    m: int
    n: int
    k: int
    mr: int
    nr: int
    dtype: str = "float32"
    amx: bool = False
    """Tiles on AMX (``amx_gemm.py``): 32 x 32 blocks, K in whole 16-group tile steps."""

    @property
    def precision(self) -> Precision:
        return PRECISIONS[self.dtype]

    @property
    def c_shape(self) -> tuple[int, int]:
        """Shape of the kernel's output: the AMX kernel writes whole (padded) blocks."""
        return (self.mp, self.np_) if self.amx else (self.m, self.n)

    @property
    def mp(self) -> int:
        return -(-self.m // self.mr) * self.mr

    @property
    def np_(self) -> int:
        return -(-self.n // self.nr) * self.nr

    @property
    def kp(self) -> int:
        """K padded to whole VNNI groups, and to at least 2 of them: a unit reduction loop
        cannot be tensorized (TVM drops it)."""
        v = self.precision.vnni
        step = 16 * v if self.amx else v
        return max(-(-self.k // step) * step, 2 * v)

    @property
    def a_prepadded(self) -> bool:
        """Whether the kernel takes A already zero-padded to (mp, kp): bf16 kernels do,
        because TVM's bf16 legalisation widens a bf16 buffer allocated inside a kernel (the
        padded copy of A) to fp32, which the bf16 microkernel cannot read."""
        return self.precision.a == "bfloat16" or self.amx

    def a_shape(self, lead: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Shape of the kernel's A parameter."""
        return (*lead, self.mp, self.kp) if self.a_prepadded else (*lead, self.m, self.k)

    def b_packed_shape(self, lead: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Shape of packed B: ``(N/nr, kp, nr)``, or VNNI ``(N/nr, kp/V, nr, V)``."""
        v = self.precision.vnni
        if v == 1:
            return (*lead, self.np_ // self.nr, self.kp, self.nr)
        return (*lead, self.np_ // self.nr, self.kp // v, self.nr, v)


#: Register tiles (mr, nr) with mr * ceil(nr/16) accumulators plus one row of B inside the
#: 32 zmm registers, and the fraction of the fp32 peak each sustained in this package's
#: measurements (AVX-512 on Zen 5, 1 thread, benchmarks/gemm.py shapes); ties go to the
#: earlier entry. Tiles under 8 independent FMA chains cannot hide the FMA latency on two
#: pipes and serve only tiny M.
TILE_EFFICIENCY: dict[tuple[int, int], float] = {
    (8, 48): 0.97, (4, 64): 0.97, (8, 32): 0.95, (6, 64): 0.93, (5, 64): 0.92,
    (9, 48): 0.92, (7, 48): 0.92, (12, 32): 0.91, (11, 32): 0.90, (10, 32): 0.90, (14, 32): 0.88,
    (3, 64): 0.80, (2, 64): 0.60,
}


def plan_gemm(m: int, n: int, k: int, dtype: str = "float32", isa: str = "avx512"
              ) -> GemmPlan:
    """Choose the register tile minimising padded work / tile efficiency (AMX: 32 x 32
    tile blocks for bf16/int8)."""
    if isa == "amx" and PRECISIONS[dtype].vnni > 1:
        from .amx_gemm import MR, NR

        return GemmPlan(m, n, k, MR, NR, dtype, amx=True)
    best = None
    for (mr, nr), efficiency in TILE_EFFICIENCY.items():
        if mr > max(m, 2) and mr > 2:
            continue
        nv = -(-nr // 16)
        if PRECISIONS[dtype].vnni > 1 and mr * nv + nv + mr > 31:
            # The dot-product kernel holds each row's broadcast A group in a register too
            # (measured: 8x48 ran bf16 at a third of 4x64's rate, spilling).
            continue
        plan = GemmPlan(m, n, k, mr, nr, dtype)
        cost = plan.mp * plan.np_ / efficiency
        if best is None or cost < best[0]:
            best = (cost, plan)
    return best[1]


def check_gemm(m: int, n: int, k: int, dtype: str, activation: str | None) -> None:
    if dtype not in PRECISIONS:
        raise UnsupportedDTypeError(
            f"GEMM: dtype {dtype!r} unsupported; one of {', '.join(PRECISIONS)} (int8 is "
            "u8 activations x s8 weights into int32)")
    if min(m, n, k) < 1:
        raise UnsupportedShapeError(f"GEMM: M, N, K must be >= 1, got {m}x{n}x{k}")
    if activation is not None and activation not in ACTIVATIONS:
        raise UnsupportedShapeError(
            f"GEMM: activation {activation!r} unsupported; one of {', '.join(ACTIVATIONS)}"
        )


def _padded(src: te.Tensor, shape: tuple, valid: tuple, name: str) -> te.Tensor:
    """``src`` zero-padded to ``shape`` (its trailing dims ``valid`` are the real extents)."""
    nd = len(valid)

    def at(*ix):
        inside = tirx.all(*[ix[-nd + d] < valid[d] for d in range(nd)])
        clamped = [tirx.min(ix[-nd + d], valid[d] - 1) for d in range(nd)]
        return tirx.if_then_else(inside, src[(*ix[:-nd], *clamped)], tirx.const(0, src.dtype))

    return te.compute(shape, at, name=name)


def _equation_stage(src: te.Tensor, shape: tuple[int, ...], steps: tuple[str, ...],
                    operands: list[te.Tensor], name: str) -> te.Tensor:
    kinds = equation_operands(steps)
    return te.compute(shape, lambda *ix: equation_expr(steps, src[ix], [
        p[ix[-1]] if k == "bias" else p[ix] for p, k in zip(operands, kinds)
    ]), name=name)


def epilogue_te(C: te.Tensor, valid: tuple[int, ...], bias: bool, activation: str | None,
                residual: bool, post_activation: str | None = None
                ) -> tuple[list[te.Tensor], te.Tensor, list[tuple[str, tuple[str, ...]]]]:
    """The fused epilogue after a contraction C (padded in its last two dims), as equation
    TPPs: Y = post(act(C + bias) + residual), one pass over each register tile.

    Unpadded, that is one stage (``epilogue``). Padded, the steps that work on the padded
    tile (bias, act) form ``epilogue`` and the rest go with dropping the padding (``out``),
    whose edge tiles cannot be tensorized. Returns (extra inputs, output tensor, stages as
    (name, equation steps; none for a plain copy)).
    """
    padded = tuple(int(d) for d in C.shape) != tuple(valid)
    bias_t = te.placeholder((int(C.shape[-1]),), "float32", name="bias_packed") if bias else None
    res_t = te.placeholder(valid, "float32", name="residual") if residual else None
    inputs = [t for t in (bias_t, res_t) if t is not None]
    pre = (("bias",) if bias else ()) + ((activation,) if activation else ())
    post = (("residual",) if residual else ()) + ((post_activation,) if post_activation else ())
    if not padded:
        steps = pre + post
        if not steps:
            return inputs, C, []
        return inputs, _equation_stage(C, valid, steps, inputs, "epilogue"), [("epilogue", steps)]
    out, stages = C, []
    if pre:
        out = _equation_stage(C, tuple(C.shape), pre, [bias_t] if bias else [], "epilogue")
        stages.append(("epilogue", pre))
    src = out
    stages.append(("out", post))
    if post:
        out = _equation_stage(src, valid, post, [res_t] if residual else [], "out")
    else:
        out = te.compute(valid, lambda *ix: src[ix], name="out")
    return inputs, out, stages


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


def _transposed_in(src: te.Tensor, shape: tuple, valid: tuple, name: str) -> te.Tensor:
    """``src`` (..., cols, rows) transposed to (..., rows, cols), zero-padded to ``shape``:
    a transposed operand (a backward pass's Xᵀ) copied into the layout the microkernel reads."""
    rows, cols = valid
    if tuple(shape[-2:]) == tuple(valid):  # no padding: a plain transpose (TPP-matchable)
        return te.compute(shape, lambda *ix: src[(*ix[:-2], ix[-1], ix[-2])], name=name)

    def at(*ix):
        *lead, i, j = ix
        inside = tirx.all(i < rows, j < cols)
        return tirx.if_then_else(inside, src[(*lead, tirx.min(j, cols - 1),
                                              tirx.min(i, rows - 1))],
                                 tirx.const(0, src.dtype))

    return te.compute(shape, at, name=name)


def gemm_te(plan: GemmPlan, batch: int | None, bias: bool, activation: str | None,
            residual: bool = False, b_packed: bool = True,
            post_activation: str | None = None, dequantize: bool = False,
            a_transposed: bool = False, b_transposed: bool = False, a_scale: float = 1.0):
    """TE stages of the GEMM; returns (inputs, output, epilogue stages).

    Inputs in order: A ((M, K), or (K, M) when ``a_transposed``), B (packed panels, or an
    activation operand when ``b_packed`` is False: (K, N), or (N, K) when ``b_transposed``),
    then for int8 with ``dequantize`` the per-column scale and offset (padded to the packed
    width), bias (likewise), residual (M, N). A transposed A is copied into (M, K) rows and a
    transposed B into packed panels inside the kernel (``A_transpose``, ``B_pack``,
    transpose TPPs where unpadded), so backward GEMMs (dY Wᵀ, Xᵀ dY) run the same
    microkernel. ``a_scale`` multiplies A on its way in (C = s·A·B, as a custom
    contraction's constant factor). Transposed or scaled operands are fp32 only.
    """
    m, n, k, nr = plan.m, plan.n, plan.k, plan.nr
    mp, np_, kp = plan.mp, plan.np_, plan.kp
    prec = plan.precision
    V = prec.vnni
    lead = (batch,) if batch else ()
    if V > 1 and (a_transposed or b_transposed or a_scale != 1.0):
        raise UnsupportedDTypeError(
            f"GEMM {plan.dtype}: transposed or scaled operands are supported in fp32 only")
    if a_transposed:
        A = te.placeholder((*lead, k, m), prec.a, name="A")
    else:
        A = te.placeholder(plan.a_shape(lead), prec.a, name="A")
    if b_packed:
        B = te.placeholder(plan.b_packed_shape(lead), prec.b, name="B_packed")
    elif V > 1:
        raise UnsupportedDTypeError(
            f"GEMM {plan.dtype}: B must be a packed constant (VNNI layout); a {plan.dtype} "
            "matmul of two activations is not supported")
    elif b_transposed:
        B = te.placeholder((*lead, n, k), prec.b, name="B")
        B = te.compute((*lead, np_ // nr, kp, nr), _pack_transposed(B, n, k, nr), name="B_pack")
        b_packed = True
    else:
        B = te.placeholder((*lead, k, n), prec.b, name="B")
    inputs = [A, B.op.input_tensors[0] if B.op.name == "B_pack" else B]
    if a_transposed:
        A_in = _transposed_in(A, (*lead, mp, kp), (m, k), "A_transpose")
    else:
        padded_a = (mp, kp) != (m, k) and not plan.a_prepadded
        A_in = _padded(A, (*lead, mp, kp), (m, k), "A_pad") if padded_a else A
    if a_scale != 1.0:
        src = A_in
        A_in = te.compute(tuple(src.shape), lambda *ix: src[ix] * tirx.const(a_scale, "float32"),
                          name="A_scale")

    def mac(a, b):
        if prec.acc == prec.a:
            return a * b
        return tirx.Cast(prec.acc, a) * tirx.Cast(prec.acc, b)

    if V > 1:
        ko = te.reduce_axis((0, kp // V), name="ko")
        kv = te.reduce_axis((0, V), name="kv")
        C = te.compute(
            (*lead, mp, np_),
            lambda *ix: te.sum(mac(A_in[(*ix[:-2], ix[-2], ko * V + kv)],
                                   B[(*ix[:-2], ix[-1] // nr, ko, ix[-1] % nr, kv)]),
                               axis=[ko, kv]),
            name="C",
        )
    elif b_packed:
        r = te.reduce_axis((0, kp), name="k")
        C = te.compute(
            (*lead, mp, np_),
            lambda *ix: te.sum(
                A_in[(*ix[:-2], ix[-2], r)] * B[(*ix[:-2], ix[-1] // nr, r, ix[-1] % nr)], axis=r
            ),
            name="C",
        )
    else:
        r = te.reduce_axis((0, kp), name="k")
        B_in = _padded(B, (*lead, kp, np_), (k, n), "B_pad") if (kp, np_) != (k, n) else B
        C = te.compute(
            (*lead, mp, np_),
            lambda *ix: te.sum(A_in[(*ix[:-2], ix[-2], r)] * B_in[(*ix[:-2], r, ix[-1])], axis=r),
            name="C",
        )
    deq_inputs, deq_stages = [], []
    if dequantize:
        if prec.acc != "int32":
            raise UnsupportedDTypeError(f"GEMM {plan.dtype}: only int8 GEMMs dequantize")
        deq_inputs, C, deq_stages = dequantize_te(C)
    elif prec.acc != "float32" and (bias or activation or residual or post_activation):
        raise UnsupportedDTypeError(
            f"GEMM {plan.dtype}: an epilogue needs fp32; pass dequantize=True")
    epilogue_inputs, out, stages = epilogue_te(C, (*lead, m, n), bias, activation, residual,
                                               post_activation)
    return inputs + deq_inputs + epilogue_inputs, out, deq_stages + stages


def dequantize_te(C: te.Tensor) -> tuple[list[te.Tensor], te.Tensor, list]:
    """An int32 contraction's fp32 value, ``C * scale[j] + offset[j]`` per output column
    (both padded to C's width): inputs, output and its epilogue stage."""
    width = int(C.shape[-1])
    scale = te.placeholder((width,), "float32", name="dq_scale")
    offset = te.placeholder((width,), "float32", name="dq_offset")
    out = te.compute(tuple(C.shape), lambda *ix: quant_expr(
        "dequantize", C[ix], scale[ix[-1]], offset[ix[-1]], "float32"), name="dequant")
    return [scale, offset], out, [("dequant", ("dequantize",))]


def _pack_transposed(B: te.Tensor, n: int, k: int, nr: int):
    """Element (jb, kk, jj) of packed panels from B given as (N, K), zero-padded."""
    if n % nr == 0 and int(B.shape[-1]) == k and k >= 2:
        return lambda *ix: B[(*ix[:-3], ix[-3] * nr + ix[-1], ix[-2])]

    def at(*ix):
        *lead, jb, kk, jj = ix
        j = jb * nr + jj
        inside = tirx.all(kk < k, j < n)
        return tirx.if_then_else(inside, B[(*lead, tirx.min(j, n - 1), tirx.min(kk, k - 1))],
                                 tirx.const(0, "float32"))

    return at


def weights_outer(a_elems: int, b_elems: int) -> bool:
    """Loop order: B panels outer (each panel reused over all rows, A re-streamed per
    panel) unless all of B fits in half the L2 and A is the bigger operand, then rows
    outer so A streams from memory exactly once. (The L2 size is the host's.)"""
    l2_budget = (host_isa().l2_bytes or 1024 * 1024) // 2
    return not (4 * b_elems <= l2_budget and a_elems > b_elems)


#: A convolution's filter panel larger than this leaves L2 between output rows (each row
#: re-reads it): block its reduction then.
PANEL_BYTES = 192 * 1024
#: Target size of one K block of a panel (stays in L2 while all row blocks use it).
PANEL_BLOCK_BYTES = 128 * 1024


def k_block(k: int, nr: int) -> int | None:
    """K block for a GEMM panel too big for half the L2 (a divisor of k, >= 64), or None.

    Below that the panel stays in L2 across row blocks; blocking it then only costs
    (measured: 1024^3 and 2048^3 lost 5-10% with 256-512 KiB panels blocked)."""
    if 4 * k * nr <= (host_isa().l2_bytes or 1024 * 1024) // 2:
        return None
    best = None
    for kc in range(64, k):
        if k % kc == 0 and 4 * kc * nr <= PANEL_BLOCK_BYTES:
            best = kc
    return best


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
    schedule_pads(sch, ("A_pad", "A_scale", "B_pad", *schedule_transposes(sch, plan, isa)))
    epilogue = fuse_epilogue(sch, panel_loop, plan.mp, plan.nr, stages)
    init = sch.decompose_reduction(blk, ko)
    tensorize_rows(sch, init, TPPSpec("zero", m=plan.mp, n=plan.nr), isa, "C panel init")
    gemm = TPPSpec("gemm", "float32", m=plan.mr, n=plan.nr, k=kc, beta=1)
    if not try_tensorize(sch, ii, gemm, isa, "C tile"):
        raise RuntimeError("K-blocked GEMM microkernel did not tensorize")  # a bug
    tensorize_epilogue(sch, epilogue, isa)
    return sch


def schedule_gemm(func: tirx.PrimFunc, plan: GemmPlan, isa: str, batched: bool,
                  stages: list[tuple[str, tuple[str, ...]]]) -> s_tir.Schedule:
    """Tile, tensorize and parallelize a PrimFunc made by :func:`gemm_te`."""
    sch = s_tir.Schedule(func)
    mr, nr, k = plan.mr, plan.nr, plan.kp
    prec = plan.precision
    blk = sch.get_sblock("C")
    loops = list(sch.get_loops(blk))
    b = loops.pop(0) if batched else None
    i, j, *red = loops  # red: (k,) or, VNNI-packed, (k // V, V)
    io, ii = sch.split(i, [None, mr])
    jo, ji = sch.split(j, [None, nr])
    # K-blocking is for fp32 panels; a low-precision panel is 2-4x smaller per k.
    kc = k_block(k, nr) if prec.vnni == 1 else None
    if kc is not None:
        return _schedule_k_blocked(sch, blk, plan, isa, stages, kc,
                                   [b] if batched else [], io, ii, jo, ji, red[0])
    elem = 4 // prec.vnni
    if weights_outer(plan.mp * k * elem // 4, k * plan.np_ * elem // 4):
        sch.reorder(jo, io, ii, ji, *red)
        outer = [b, jo, io] if batched else [jo, io]
    else:
        sch.reorder(io, jo, ii, ji, *red)
        outer = [b, io, jo] if batched else [io, jo]
    tile_loop = sch.fuse(*outer)
    sch.parallel(tile_loop)
    schedule_pads(sch, ("A_pad", "A_scale", "B_pad", *schedule_transposes(sch, plan, isa)))
    epilogue = fuse_epilogue(sch, tile_loop, mr, nr, stages, copy_dtype=prec.acc)
    b_dtype = prec.b if prec.b != prec.a else None
    gemm = TPPSpec("gemm", prec.a, b_dtype=b_dtype, m=mr, n=nr, k=k, beta=0)
    if not try_tensorize(sch, ii, gemm, isa, "C tile"):
        raise RuntimeError("GEMM microkernel did not tensorize")  # a bug, not user input
    tensorize_epilogue(sch, epilogue, isa)
    return sch


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
                    lead: tuple[int, ...] = ()) -> s_tir.Schedule:
    """fp32 A (..., m, k) -> bf16 A zero-padded to (..., mp, kp): the operand a bf16 GEMM
    kernel takes (see :attr:`GemmPlan.a_prepadded`). Rows are parallel; unpadded rows are
    fp32 -> bf16 copy TPPs (``vcvtneps2bf16``), padded ones a scalar loop (TVM cannot
    vectorise predicated bf16 stores)."""
    A = te.placeholder((*lead, m, k), "float32", name="A")
    padded = (mp, kp) != (m, k)

    def at(*ix):
        i, j = ix[-2], ix[-1]
        if not padded:
            return tirx.Cast("bfloat16", A[ix])
        inside = tirx.all(i < m, j < k)
        src = A[(*ix[:-2], tirx.min(i, m - 1), tirx.min(j, k - 1))]
        return tirx.if_then_else(inside, tirx.Cast("bfloat16", src), tirx.const(0, "bfloat16"))

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


def gemm_schedule(m: int, n: int, k: int, isa: str, *, batch: int | None = None,
                  bias: bool = False, activation: str | None = None, residual: bool = False,
                  b_packed: bool = True, post_activation: str | None = None,
                  dtype: str = "float32", dequantize: bool = False,
                  a_transposed: bool = False, b_transposed: bool = False,
                  a_scale: float = 1.0) -> tuple[s_tir.Schedule, GemmPlan]:
    """The scheduled (tensorized) GEMM PrimFunc for these options, and its blocking.

    Parameters in order: A, B (packed), [scale, offset (int8 ``dequantize``)], [bias],
    [residual], output."""
    check_gemm(m, n, k, dtype, activation)
    isa = register_tile_isa(isa)
    plan = plan_gemm(m, n, k, dtype)
    inputs, out, stages = gemm_te(plan, batch, bias, activation, residual, b_packed,
                                  post_activation, dequantize, a_transposed, b_transposed,
                                  a_scale)
    func = te.create_prim_func([*inputs, out])
    return schedule_gemm(func, plan, isa, batch is not None, stages), plan


def register_tile_isa(isa: str) -> str:
    """The ISA of a schedule's tensorized register tiles: AMX's 32 x 32 tile blocks
    without an epilogue are ``amx_gemm.py``; every other kernel of an AMX target runs on
    the AVX-512 (VNNI, BF16) unit each AMX CPU has."""
    return "avx512" if isa == "amx" else isa


def runs_on_tiles(isa: str, dtype: str, batch: int | None = None, bias: bool = False,
                  activation: str | None = None, dequantize: bool = False) -> bool:
    """Whether an AMX target's GEMM runs on tiles: bf16/int8 plain C = A @ B so far. With a
    batch or an epilogue it runs on the AVX-512 (BF16, VNNI) unit every AMX CPU has."""
    return (isa == "amx" and PRECISIONS[dtype].vnni > 1
            and not (batch or bias or activation or dequantize))


