"""Scaled dot-product attention as one fused TPP kernel.

softmax(Q Kᵀ · scale + mask) V for every (batch·head) is computed a block of ``mr`` query
rows at a time, everything for the block staying in L1: the scores tile comes from GEMM
TPPs (one per column block of Kᵀ), the row-wise softmax from reduction/broadcast/exp TPPs,
and the output rows from one more GEMM TPP against V. Nothing of the (S x S) score matrix
ever reaches memory, and the blocks are the parallel unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, te, tirx

from ..errors import UnsupportedShapeError
from ..intrinsics import TPPSpec
from .gemm_plan import vector_unit
from .tensorize import tensorize_row_block, try_tensorize


@dataclass(frozen=True)
class AttentionShape:
    """``bh`` (batch x heads) attention over ``seq`` keys with head size ``dim``;
    ``heads`` maps a (batch x head) index to its mask row (mask has ``bh // heads`` rows),
    ``mask`` says whether an additive (rows, 1 or seq_q, seq) mask is applied, per query
    (a causal mask) when ``mask_per_query``; ``zero_masked_rows``
    gives a row whose keys are all masked (-inf) zero output, as SDPA exports' NaN guard
    does, instead of NaN; ``group`` query heads share each K/V head (grouped-query
    attention: K and V have ``bh // group`` rows, read in place, never repeated)."""

    bh: int
    seq_q: int
    seq: int
    dim: int
    heads: int
    scale: float
    mask: bool
    zero_masked_rows: bool = False
    group: int = 1
    mask_per_query: bool = False


def _row_block(rows: int, max_rows: int = 8) -> int:
    """Query rows per block: a divisor of ``rows``, up to ``max_rows`` (AVX-512's 8 x 32
    tiles: 16 accumulators of 32 registers; AVX2's 6 x 16: 12 of 16)."""
    for mr in range(min(max_rows, rows), 1, -1):
        if rows % mr == 0:
            return mr
    raise UnsupportedShapeError(f"attention: {rows} query rows have no block size in [2, 8]")


def query_block_rows(isa: str) -> int:
    """The most query rows of one block on ``isa``: 3/8 of its vector registers are the two
    tiles' accumulators at 2 vectors a row, up to 8 (AVX-512: 8; AVX2: 6)."""
    return min(8, vector_unit(isa).num_vregs * 3 // 8)


def padded_query_rows(rows: int, max_rows: int = 8) -> int:
    """Query rows the kernel runs on: ``rows`` when a block size up to ``max_rows``
    (:func:`query_block_rows`) divides it, else the next multiple of 8 (ViT's 197 tokens
    run as 200, Swin's 49 as 56 on AVX2; the zero rows' outputs are dropped)."""
    if any(rows % mr == 0 for mr in range(2, min(max_rows, rows) + 1)):
        return rows
    return -(-rows // 8) * 8


def padded_keys(keys: int) -> int:
    """Keys the kernel runs on: ``keys`` when 32 divides it, else the next multiple of 32
    (ViT's 197 keys as 224): a key block the whole ragged width spilled the score tile, and
    16-key blocks leave half the accumulators idle (12 heads x 200 queries: 197 keys 3.12 ms,
    208 padded 2.61, 224 padded 1.96). Padded keys get a -inf mask: zero softmax weight."""
    return keys if keys % 32 == 0 else -(-keys // 32) * 32


def _col_block(cols: int, lanes: int = 16) -> int:
    """Column block of both GEMMs: 2 vectors when they divide, else one, else the whole
    width."""
    for nr in (2 * lanes, lanes):
        if cols % nr == 0:
            return nr
    return cols


def attention_schedule(shape: AttentionShape, isa: str) -> s_tir.Schedule:
    """The fused attention kernel: inputs Q (bh, sq, d), Kᵀ (bh/group, d, s), [mask
    (bh/heads, sq or 1, s)], V (bh/group, s, d); output (bh, sq, d)."""
    sh = shape
    unit = vector_unit(isa)
    lanes = unit.static_lanes("float32")
    mr = _row_block(sh.seq_q, query_block_rows(isa))
    nr = _col_block(sh.seq, lanes)
    nd = _col_block(sh.dim, lanes)
    Q = te.placeholder((sh.bh, sh.seq_q, sh.dim), "float32", name="q")
    g = sh.group
    KT = te.placeholder((sh.bh // g, sh.dim, sh.seq), "float32", name="k_t")
    V = te.placeholder((sh.bh // g, sh.seq, sh.dim), "float32", name="v")
    inputs = [Q, KT]
    kd = te.reduce_axis((0, sh.dim), "kd")
    scores = te.compute(
        (sh.bh, sh.seq_q, sh.seq),
        lambda b, i, j: te.sum(Q[b, i, kd] * KT[b // g, kd, j], axis=kd), name="scores",
    )
    scale = tirx.const(sh.scale, "float32")
    if sh.mask:
        mq = sh.seq_q if sh.mask_per_query else 1
        M = te.placeholder((sh.bh // sh.heads, mq, sh.seq), "float32", name="mask")
        inputs.append(M)
        z = te.compute(scores.shape, lambda b, i, j: scores[b, i, j] * scale
                       + M[b // sh.heads, i if sh.mask_per_query else 0, j], name="logits")
    else:
        z = te.compute(scores.shape, lambda b, i, j: scores[b, i, j] * scale, name="logits")
    inputs.append(V)
    k1 = te.reduce_axis((0, sh.seq), "k1")
    k2 = te.reduce_axis((0, sh.seq), "k2")
    mx = te.compute((sh.bh, sh.seq_q), lambda b, i: te.max(z[b, i, k1], axis=k1), name="row_max")
    if sh.zero_masked_rows:  # all keys -inf: exp(-inf - finite) = 0, sum 0, output 0
        lowest = tirx.const(-3.4028234663852886e38, "float32")
        shift = te.compute(mx.shape, lambda b, i: tirx.max(mx[b, i], lowest),
                           name="row_shift")
    else:
        shift = mx
    shifted = te.compute(z.shape, lambda b, i, j: z[b, i, j] - shift[b, i], name="shifted")
    e = te.compute(z.shape, lambda b, i, j: tirx.exp(shifted[b, i, j]), name="exp")
    total = te.compute((sh.bh, sh.seq_q), lambda b, i: te.sum(e[b, i, k2], axis=k2),
                       name="row_sum")
    one, zero = tirx.const(1.0, "float32"), tirx.const(0.0, "float32")
    if sh.zero_masked_rows:
        inv = te.compute((sh.bh, sh.seq_q), lambda b, i: tirx.Select(
            total[b, i] > zero, one / total[b, i], zero), name="inv_sum")
    else:
        inv = te.compute((sh.bh, sh.seq_q), lambda b, i: one / total[b, i], name="inv_sum")
    p = te.compute(z.shape, lambda b, i, j: e[b, i, j] * inv[b, i], name="probs")
    kv = te.reduce_axis((0, sh.seq), "kv")
    out = te.compute(
        (sh.bh, sh.seq_q, sh.dim),
        lambda b, i, c: te.sum(p[b, i, kv] * V[b // g, kv, c], axis=kv), name="attention",
    )
    sch = s_tir.Schedule(te.create_prim_func([*inputs, out]))

    # Output rows: one parallel loop over (batch·head, query block); PV is a GEMM TPP.
    ob = sch.get_sblock("attention")
    b, i, c, kvl = sch.get_loops(ob)
    io, ii = sch.split(i, [None, mr])
    sch.reorder(b, io, ii, c, kvl)
    block_loop = sch.fuse(b, io)
    sch.parallel(block_loop)
    for name in ("probs", "inv_sum", "row_sum", "exp", "shifted",
                 *(("row_shift",) if sh.zero_masked_rows else ()), "row_max", "logits",
                 "scores"):
        sch.compute_at(sch.get_sblock(name), block_loop)

    # Scores: Q rows x Kᵀ column blocks, each a GEMM TPP (beta 0: no init pass).
    sb = sch.get_sblock("scores")
    si, sj, sk = sch.get_loops(sb)[1:]
    sjo, sji = sch.split(sj, [None, nr])
    sch.reorder(sjo, si, sji, sk)
    if not try_tensorize(sch, si, TPPSpec("gemm", m=mr, n=nr, k=sh.dim, beta=0), isa,
                         "attention scores"):
        raise RuntimeError("attention score tile did not tensorize")  # a bug
    lb = sch.get_sblock("logits")
    sch.vectorize(sch.get_loops(lb)[-1])
    for name, spec in (
        ("row_max", TPPSpec("reduce_max_cols", m=mr, n=sh.seq)),
        ("shifted", TPPSpec("sub", m=mr, n=sh.seq, bcast="col")),
        ("exp", TPPSpec("exp", m=mr, n=sh.seq)),
        ("row_sum", TPPSpec("reduce_add_cols", m=mr, n=sh.seq)),
        ("probs", TPPSpec("mul", m=mr, n=sh.seq, bcast="col")),
    ):
        tensorize_row_block(sch, name, spec, isa)
    co, ci = sch.split(c, [None, nd])
    sch.reorder(co, ii, ci, kvl)
    if not try_tensorize(sch, ii, TPPSpec("gemm", m=mr, n=nd, k=sh.seq, beta=0), isa,
                         "attention output"):
        raise RuntimeError("attention output tile did not tensorize")  # a bug
    return sch
