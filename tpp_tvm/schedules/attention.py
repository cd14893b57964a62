"""Scaled dot-product attention as one fused TPP kernel.

softmax(Q Kᵀ · scale + mask) V for every (batch·head) is computed a block of ``mr`` query
rows at a time, everything for the block staying in L1: the scores tile comes from GEMM
TPPs (one per column block of Kᵀ), the row-wise softmax from reduction/broadcast/exp TPPs,
and the output rows from one more GEMM TPP against V. Nothing of the (S x S) score matrix
ever reaches memory, and the blocks are the parallel unit.

On AMX (:func:`attention_tile_schedule`, bf16 models) both products are bf16 tile GEMMs
with fp32 accumulation on 32-row query blocks, the softmax between them fp32 as above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import tvm_ffi
from tvm import s_tir, te, tirx

from ..errors import UnsupportedShapeError
from ..intrinsics import TPPSpec
from ..intrinsics.amx import PREFETCH_PANELS_ATTR, TILE_CONFIG_ATTR
from .gemm import split_tasks
from .gemm_plan import AMX_BLOCK, vector_unit
from .tensorize import tensorize_row_block, try_tensorize


@dataclass(frozen=True)
class AttentionShape:
    """``bh`` (batch x heads) attention of ``seq_q`` queries over ``seq`` keys with head
    size ``dim`` for Q and K and ``dim_v`` for V (``None``: ``dim``; LeViT's values are 2-4x
    wider than its keys);
    ``heads`` maps a (batch x head) index to its mask row (mask has ``bh // heads`` rows),
    ``mask`` says whether an additive (rows, 1 or seq_q, seq) mask is applied, per query
    (a causal mask) when ``mask_per_query``; ``zero_masked_rows``
    gives a row whose keys are all masked (-inf) zero output, as SDPA exports' NaN guard
    does, instead of NaN; ``group`` query heads share each K/V head (grouped-query
    attention: K and V have ``bh // group`` rows, read in place, never repeated);
    ``keys_as_rows``: K comes as (bh/g, seq, dim) rows, not Kᵀ, and each key block is
    transposed in L1 where the scores take it (for one query block a head, a decoding step:
    a Kᵀ copy of the whole cache would be written and read back for one use);
    ``kv_int8`` (with ``keys_as_rows``): K and V come as int8 with one fp32 scale per key
    row ((bh/g, seq) each: an int8 KV cache), dequantized a key block at a time in L1;
    ``skip_masked_blocks``: a per-query mask (a causal mask given as an input) masks whole
    key blocks for some query blocks, which the kernel skips (a decoding step's kernel,
    one mask row per head, always skips them)."""

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
    dim_v: int | None = None
    keys_as_rows: bool = False
    kv_int8: bool = False
    skip_masked_blocks: bool = False

    def __post_init__(self) -> None:
        if self.kv_int8 and not self.keys_as_rows:
            raise UnsupportedShapeError("attention on an int8 K and V reads K as rows "
                                        "(keys_as_rows): a decoding step's kernel")

    @property
    def value_dim(self) -> int:
        """V's head size, which is the output's."""
        return self.dim if self.dim_v is None else self.dim_v


#: Query rows, keys and value columns of one tile product: 2 x 2 tiles of 16 x 16 fp32,
#: the 32 x 32 configuration of the AMX GEMMs, for both products.
TILE_BLOCK = AMX_BLOCK


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
    run as 200, Swin's 49 as 56 on AVX2; the zero rows' outputs are dropped). A long
    sequence that only blocks under half of ``max_rows`` divide is padded to whole
    ``max_rows`` blocks: the Audio Spectrogram Transformer's 1214 tokens (2 x 607) ran in
    2-row blocks, each re-reading a head's K and V (610 KB, past Zen 3's L2) for 2 queries,
    at a third of the FMA rate."""
    if rows == 1:  # a decoding step: the smallest block (2 rows), not 8
        return 2
    divisors = [mr for mr in range(2, min(max_rows, rows) + 1) if rows % mr == 0]
    if divisors and (2 * divisors[-1] >= max_rows or rows < 8 * max_rows):
        return rows
    block = max_rows if divisors else 8
    return -(-rows // block) * block


def padded_keys(keys: int) -> int:
    """Keys the kernel runs on: ``keys`` when 32 divides it, else the next multiple of 32
    (ViT's 197 keys as 224): a key block the whole ragged width spilled the score tile, and
    16-key blocks leave half the accumulators idle (12 heads x 200 queries: 197 keys 3.12 ms,
    208 padded 2.61, 224 padded 1.96). Padded keys get a -inf mask: zero softmax weight."""
    return keys if keys % 32 == 0 else -(-keys // 32) * 32


#: Mask values at or below this mark masked keys a decoding kernel may skip: far below
#: any score, so ``score * scale + mask`` is the mask itself and its softmax weight 0.
MASKED = -1e30


#: Bytes of one head's fp32 K from which a kernel reading K as rows first copies each key
#: block's rows into L1 in memory order, then transposes them there: so large a K is a
#: decoding step's cache, read from memory (the weights evict it between steps), where the
#: transpose's strided reads stalled on each line (1024 slots x 64, 576 live keys, 4 heads,
#: cold: 150 -> 130 us a call, Zen 4, 1 thread). A smaller K was just computed and is in
#: cache, where the copy is only more work (CaiT's class attention, 224 keys x 48: 8.3 ->
#: 9.8 us).
COPY_KEYS_BYTES = 256 * 1024


def copies_key_rows(sh: AttentionShape) -> bool:
    """Whether the kernel copies K's key blocks into L1 before transposing them (fp32 K
    read as rows, at least :data:`COPY_KEYS_BYTES` a head; int8 K is always dequantized
    there)."""
    return sh.keys_as_rows and not sh.kv_int8 and sh.seq * sh.dim * 4 >= COPY_KEYS_BYTES


def _col_block(cols: int, lanes: int = 16) -> int:
    """Column block of both GEMMs: 2 vectors when they divide, else one, else the whole
    width."""
    for nr in (2 * lanes, lanes):
        if cols % nr == 0:
            return nr
    return cols


def _operands(sh: AttentionShape) -> tuple[te.Tensor, list[te.Tensor], te.Tensor,
                                           list[te.Tensor], te.Tensor]:
    """Q; the K inputs and Kᵀ as the scores read it (the input itself, or with
    ``keys_as_rows`` the transposing stage the schedule runs per key block); the V inputs
    and V as the output's product reads it. With ``kv_int8`` K and V are int8 with a scale
    per key, read through dequantizing stages (``k_rows_block``, ``v_block``)."""
    kv_rows = sh.bh // sh.group
    Q = te.placeholder((sh.bh, sh.seq_q, sh.dim), "float32", name="q")
    if not sh.keys_as_rows:
        KT = te.placeholder((kv_rows, sh.dim, sh.seq), "float32", name="k_t")
        V = te.placeholder((kv_rows, sh.seq, sh.value_dim), "float32", name="v")
        return Q, [KT], KT, [V], V
    dtype = "int8" if sh.kv_int8 else "float32"
    K = te.placeholder((kv_rows, sh.seq, sh.dim), dtype, name="k")
    V = te.placeholder((kv_rows, sh.seq, sh.value_dim), dtype, name="v")
    k_inputs, v_inputs, k_rows, v_read = [K], [V], K, V
    if sh.kv_int8:
        def dequantized(x: te.Tensor, name: str) -> tuple[te.Tensor, te.Tensor]:
            scale = te.placeholder((kv_rows, sh.seq), "float32", name=f"{x.name}_scale")
            return scale, te.compute(x.shape, lambda b, j, c: x[b, j, c].astype("float32")
                                     * scale[b, j], name=name)
        k_scale, k_rows = dequantized(K, "k_rows_block")
        v_scale, v_read = dequantized(V, "v_block")
        k_inputs.append(k_scale)
        v_inputs.append(v_scale)
    elif copies_key_rows(sh):  # copied a key block at a time (see attention_schedule)
        k_rows = te.compute(K.shape, lambda b, j, c: K[b, j, c], name="k_rows_block")
    KT = te.compute((kv_rows, sh.dim, sh.seq), lambda b, r, j: k_rows[b, j, r],
                    name="k_t_block")
    return Q, k_inputs, KT, v_inputs, v_read


def _attention_te(sh: AttentionShape, tiles: bool) -> tirx.PrimFunc:
    """The kernel's TE stages as a PrimFunc: fp32 products, or on ``tiles`` bf16 products
    with fp32 accumulation: Q and the probabilities converted per query block, Kᵀ and V
    packed once into :data:`TILE_BLOCK`-column bf16 VNNI panels (``k_t_packed`` (bh/g,
    seq/32, dim/2, 32, 2), ``v_packed`` (bh/g, dim_v/32, seq/2, 32, 2): the tile GEMMs' B
    layout). The softmax between the products is fp32 either way."""
    g = sh.group
    Q, k_inputs, KT, v_inputs, V = _operands(sh)
    inputs = [Q, *k_inputs]
    nb, bf16 = TILE_BLOCK, "bfloat16"

    def tile_product(a: te.Tensor, b_packed: te.Tensor, k: int, name: str) -> te.Tensor:
        ko, kv = te.reduce_axis((0, k // 2), "ko"), te.reduce_axis((0, 2), "kv")
        return te.compute(
            (sh.bh, sh.seq_q, int(b_packed.shape[1]) * nb),
            lambda b, i, j: te.sum(
                a[b, i, ko * 2 + kv].astype("float32")
                * b_packed[b // g, j // nb, ko, j % nb, kv].astype("float32"),
                axis=[ko, kv]), name=name)

    def product(a: te.Tensor, b: te.Tensor, k: int, name: str) -> te.Tensor:
        r = te.reduce_axis((0, k), "r")
        return te.compute((sh.bh, sh.seq_q, int(b.shape[2])),
                          lambda i0, i, j: te.sum(a[i0, i, r] * b[i0 // g, r, j], axis=r),
                          name=name)

    def vnni_panels(x: te.Tensor, name: str) -> te.Tensor:
        """``x`` (bh/g, rows, cols) as bf16 panels of ``nb`` columns in VNNI pairs of rows:
        (bh/g, cols/nb, rows/2, nb, 2)."""
        _, rows, cols = (int(d) for d in x.shape)
        return te.compute(
            (sh.bh // g, cols // nb, rows // 2, nb, 2),
            lambda b, o, r, c, v: x[b, r * 2 + v, o * nb + c].astype(bf16), name=name)

    if tiles:
        q_in = te.compute(Q.shape, lambda b, i, c: Q[b, i, c].astype(bf16), name="q_bf16")
        kt_in = vnni_panels(KT, "k_t_packed")
        v_in = vnni_panels(V, "v_packed")
        scores = tile_product(q_in, kt_in, sh.dim, "scores")
    else:
        scores = product(Q, KT, sh.dim, "scores")
    scale = tirx.const(sh.scale, "float32")
    if sh.mask:
        mq = sh.seq_q if sh.mask_per_query else 1
        M = te.placeholder((sh.bh // sh.heads, mq, sh.seq), "float32", name="mask")
        inputs.append(M)
        z = te.compute(scores.shape, lambda b, i, j: scores[b, i, j] * scale
                       + M[b // sh.heads, i if sh.mask_per_query else 0, j], name="logits")
    else:
        z = te.compute(scores.shape, lambda b, i, j: scores[b, i, j] * scale, name="logits")
    inputs += v_inputs
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
    if tiles:
        p_in = te.compute(p.shape, lambda b, i, j: p[b, i, j].astype(bf16), name="probs_bf16")
        out = tile_product(p_in, v_in, sh.seq, "attention")
    else:
        out = product(p, V, sh.seq, "attention")
    return te.create_prim_func([*inputs, out])


def _softmax_stages(mr: int, seq: int) -> tuple[tuple[str, TPPSpec], ...]:
    """Softmax stages of a query block after the scores, in computing order, with their
    TPPs."""
    return (("row_max", TPPSpec("reduce_max_cols", m=mr, n=seq)),
            ("shifted", TPPSpec("sub", m=mr, n=seq, bcast="col")),
            ("exp", TPPSpec("exp", m=mr, n=seq)),
            ("row_sum", TPPSpec("reduce_add_cols", m=mr, n=seq)),
            ("probs", TPPSpec("mul", m=mr, n=seq, bcast="col")))


def _block_stages(sh: AttentionShape) -> tuple[str, ...]:
    """The stages computed per query block, consumers first (the order compute_at needs)."""
    return ("probs", "inv_sum", "row_sum", "exp", "shifted",
            *(("row_shift",) if sh.zero_masked_rows else ()), "row_max", "logits", "scores")


def _query_blocks(sch: s_tir.Schedule, mr: int) -> tuple:
    """The output's loops split into (batch·head x query block) fused, the block's rows,
    its columns and the reduction loops (one, or a VNNI pair's two)."""
    ob = sch.get_sblock("attention")
    b, i, c, *red = sch.get_loops(ob)
    io, ii = sch.split(i, [None, mr])
    sch.reorder(b, io, ii, c, *red)
    return sch.fuse(b, io), ii, c, red


def attention_schedule(shape: AttentionShape, isa: str) -> s_tir.Schedule:
    """The fused attention kernel: inputs Q (bh, sq, d), Kᵀ (bh/group, d, s) (K (bh/group,
    s, d) with ``keys_as_rows``; with ``kv_int8`` int8, then its scales (bh/group, s)),
    [mask (bh/heads, sq or 1, s)], V (bh/group, s, dv) [its scales]; output (bh, sq, dv)."""
    sh = shape
    unit = vector_unit(isa)
    lanes = unit.static_lanes("float32")
    mr = _row_block(sh.seq_q, query_block_rows(isa))
    nr = _col_block(sh.seq, lanes)
    nd = _col_block(sh.value_dim, lanes)
    # A decoding step (one block of queries a head) skips the key blocks its padding mask
    # masks whole, and reads V in key blocks, whole rows at a time (one pass over V); so
    # does a prompt's causal mask, per query block.
    skips = sh.mask and nr < sh.seq and (
        sh.keys_as_rows and not sh.mask_per_query
        or sh.skip_masked_blocks and sh.mask_per_query)
    if skips and sh.value_dim % lanes == 0 and \
            mr * (sh.value_dim // lanes) <= unit.num_vregs // 2:
        nd = sh.value_dim
    sch = s_tir.Schedule(_attention_te(sh, tiles=False))

    # Output rows: one parallel loop over (batch·head, query block); PV is a GEMM TPP.
    block_loop, ii, c, (kvl,) = _query_blocks(sch, mr)
    sch.parallel(block_loop)
    for name in _block_stages(sh):
        sch.compute_at(sch.get_sblock(name), block_loop)

    # Scores: Q rows x Kᵀ column blocks, each a GEMM TPP (beta 0: no init pass).
    sb = sch.get_sblock("scores")
    si, sj, sk = sch.get_loops(sb)[1:]
    sjo, sji = sch.split(sj, [None, nr])
    sch.reorder(sjo, si, sji, sk)
    if sh.keys_as_rows:  # the key block transposed in L1 for the scores' GEMM
        kb = sch.get_sblock("k_t_block")
        sch.compute_at(kb, sjo)
        if sh.kv_int8 or copies_key_rows(sh):  # the rows dequantized or copied into L1
            _dequantize_at(sch, "k_rows_block", sjo)
        kr = sch.get_loops(kb)[-2]
        if not try_tensorize(sch, kr, TPPSpec("transpose", m=nr, n=sh.dim), isa,
                             "attention key block"):
            sch.vectorize(sch.get_loops(kb)[-1])
    if not try_tensorize(sch, si, TPPSpec("gemm", m=mr, n=nr, k=sh.dim, beta=0), isa,
                         "attention scores"):
        raise RuntimeError("attention score tile did not tensorize")  # a bug
    lb = sch.get_sblock("logits")
    sch.vectorize(sch.get_loops(lb)[-1])
    for name, spec in _softmax_stages(mr, sh.seq):
        tensorize_row_block(sch, name, spec, isa)
    co, ci = sch.split(c, [None, nd])
    if not skips:
        sch.reorder(co, ii, ci, kvl)
        if sh.kv_int8:  # V dequantized whole per query block
            _dequantize_at(sch, "v_block", block_loop)
        if not try_tensorize(sch, ii, TPPSpec("gemm", m=mr, n=nd, k=sh.seq, beta=0), isa,
                             "attention output"):
            raise RuntimeError("attention output tile did not tensorize")  # a bug
        return sch
    kvo, kvi = sch.split(kvl, [None, nr])
    sch.reorder(co, kvo, ii, ci, kvi)
    if sh.kv_int8:  # a key block of V dequantized where the product reads it
        _dequantize_at(sch, "v_block", kvo)
    init = sch.decompose_reduction(sch.get_sblock("attention"), kvo)
    if not try_tensorize(sch, sch.get_loops(init)[-2], TPPSpec("zero", m=mr, n=nd), isa,
                         "attention output init"):
        sch.vectorize(sch.get_loops(init)[-1])
    if not try_tensorize(sch, ii, TPPSpec("gemm", m=mr, n=nd, k=nr, beta=1), isa,
                         "attention output key block"):
        raise RuntimeError("attention output key block did not tensorize")  # a bug
    _skip_masked_key_blocks(sch, block_loop, sjo, kvo, sh, mr, nr)
    return sch


def _dequantize_at(sch: s_tir.Schedule, stage: str, loop) -> None:
    """Compute ``stage`` (K's or V's rows copied, or int8 rows times their scales) under
    ``loop``, the rows it needs there, vectorized along a row."""
    block = sch.get_sblock(stage)
    sch.compute_at(block, loop)
    sch.vectorize(sch.get_loops(block)[-1])


def _skip_masked_key_blocks(sch: s_tir.Schedule, block_loop, score_loop, output_loop,
                            sh: AttentionShape, mr: int, nr: int) -> None:
    """Make the kernel skip the key blocks its mask masks whole for a query block (every
    value at or below :data:`MASKED`, for each of the block's rows where the mask is per
    query): no K block transposed and multiplied (its scores are set to 0, which leaves its
    logits the mask values they were), and, once each row's largest logit shows a key that
    is not masked (their softmax weights are then exactly 0), no V block read. A step in a
    1024-slot cache bucket holding 576 tokens reads 56% of K and V; a causal prompt, about
    half of its blocks. The result is the same bit for bit."""
    func = sch.mod["main"]
    mask = next(p for p in func.params if p.name == "mask")
    row_max = next(b for b in _allocated(func) if b.name == "row_max")
    scores = next(b for b in _allocated(func) if b.name == "scores")
    blocks = sh.seq_q // mr
    fused = sch.get(block_loop).loop_var
    b, row = fused // blocks, (fused % blocks) * mr

    rows = range(mr) if sh.mask_per_query else range(1)
    masked = tirx.const(MASKED, "float32")

    def live(j: tirx.PrimExpr) -> tirx.PrimExpr:
        keys = None
        for r in rows:  # the block's largest mask value per key, over its query rows
            row_keys = mask[b // sh.heads, row + r if sh.mask_per_query else 0,
                            tirx.Ramp(j * nr, 1, nr)]
            keys = row_keys if keys is None else tirx.max(keys, row_keys)
        # any key above the mark: a compare and a mask test (a max reduction must keep NaN
        # order, which LLVM lowers to a serial chain of 32 scalar maxes: ~8 us a call)
        above = keys > tirx.Broadcast(masked, nr)
        return tirx.call_llvm_pure_intrin("bool", "llvm.vector.reduce.or", above)

    def some_row_all_masked() -> tirx.PrimExpr:
        out = None
        for r in range(mr):
            dead = row_max[b, row + r] <= masked
            out = dead if out is None else tirx.Or(out, dead)
        return out

    def guarded(loop_rv, condition, otherwise=None) -> None:
        loop = sch.get(loop_rv)
        body = tirx.IfThenElse(condition(loop.loop_var), loop.body, otherwise)
        sch.state.replace(sch.get_sref(loop_rv), tirx.For(
            loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
            loop.annotations))

    j = sch.get(score_loop).loop_var
    i, col = tirx.Var("i", "int32"), tirx.Var("col", "int32")
    zero = tirx.For(i, 0, mr, tirx.ForKind.SERIAL, tirx.For(
        col, 0, nr, tirx.ForKind.SERIAL,
        tirx.BufferStore(scores, tirx.const(0.0, "float32"), [b, row + i, j * nr + col])))
    guarded(score_loop, live, zero)
    guarded(output_loop, lambda k: tirx.Or(live(k), some_row_all_masked()))


def _allocated(func: tirx.PrimFunc) -> list[tirx.Buffer]:
    """The buffers the scheduled function's blocks allocate."""
    found: list[tirx.Buffer] = []
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock,
                                         lambda blk: found.extend(blk.alloc_buffers))])
    return found


def tile_query_rows(rows: int, dim: int, dim_v: int | None = None) -> int | None:
    """Query rows :func:`attention_tile_schedule` runs ``rows`` queries of head size ``dim``
    (``dim_v`` for V, if it differs) on (the next multiple of :data:`TILE_BLOCK`), or None
    where attention stays fp32: a head size that is not whole tile steps, or under 16
    queries (decoding steps), which would be padded more than twofold."""
    if dim % TILE_BLOCK or (dim_v or dim) % TILE_BLOCK or rows < TILE_BLOCK // 2:
        return None
    return -(-rows // TILE_BLOCK) * TILE_BLOCK


def _fits_tiles(shape: AttentionShape) -> bool:
    """Whether :func:`attention_tile_schedule` takes ``shape``: queries, keys and head sizes
    multiples of :data:`TILE_BLOCK` (keys are padded to 32 anyway, queries by the caller)."""
    return all(x % TILE_BLOCK == 0
               for x in (shape.seq_q, shape.seq, shape.dim, shape.value_dim))


def attention_tile_schedule(shape: AttentionShape, threads: int) -> s_tir.Schedule:
    """:func:`attention_schedule` with both products on AMX tiles: bf16 operands, fp32
    accumulation, the softmax in fp32 on the vector unit between them (as OpenVINO's bf16
    attention). Blocks of 32 query rows; Kᵀ and V are packed into bf16 VNNI panels once
    per (batch·head) before them; the blocks are split into one task per thread of
    ``threads``, each configuring the tiles once (``TILE_CONFIG_ATTR``). The packed panels
    (a head's Kᵀ and V: 32 KiB at 128 keys and head size 64) stay in L2 across its query
    blocks, so the tile steps prefetch no next panel (a GEMM's weights come from memory and
    do)."""
    sh = shape
    if not _fits_tiles(sh):
        raise UnsupportedShapeError(
            f"attention on tiles needs queries, keys and head sizes in multiples of "
            f"{TILE_BLOCK}; got {sh.seq_q} x {sh.seq} keys, head size {sh.dim} "
            f"(V: {sh.value_dim})")
    nb = TILE_BLOCK
    func = _attention_te(sh, tiles=True).with_attrs({TILE_CONFIG_ATTR: [nb, nb],
                                                    PREFETCH_PANELS_ATTR: False})
    sch = s_tir.Schedule(func)
    for name in ("k_t_packed", "v_packed"):
        b, panel, *_ = sch.get_loops(sch.get_sblock(name))
        sch.parallel(sch.fuse(b, panel))

    block_loop, ii, c, red = _query_blocks(sch, nb)
    for name in ("probs_bf16", *_block_stages(sh), "q_bf16"):
        sch.compute_at(sch.get_sblock(name), block_loop)
    bf16_gemm = TPPSpec("gemm", "bfloat16", m=nb, n=nb, k=sh.dim, beta=0)

    si, sj, *sred = sch.get_loops(sch.get_sblock("scores"))[1:]
    sjo, sji = sch.split(sj, [None, nb])
    sch.reorder(sjo, si, sji, *sred)
    if not try_tensorize(sch, si, bf16_gemm, "amx", "attention scores on tiles"):
        raise RuntimeError("attention score tiles did not tensorize")  # a bug
    sch.vectorize(sch.get_loops(sch.get_sblock("logits"))[-1])
    to_bf16 = TPPSpec("copy", m=nb, n=sh.seq, out_dtype="bfloat16")
    for name, spec in (("q_bf16", replace(to_bf16, n=sh.dim)), *_softmax_stages(nb, sh.seq),
                       ("probs_bf16", to_bf16)):
        tensorize_row_block(sch, name, spec, "amx")
    co, ci = sch.split(c, [None, nb])
    sch.reorder(co, ii, ci, *red)
    if not try_tensorize(sch, ii, replace(bf16_gemm, k=sh.seq), "amx",
                         "attention output on tiles"):
        raise RuntimeError("attention output tiles did not tensorize")  # a bug
    split_tasks(sch, block_loop, sh.bh * sh.seq_q // nb, threads)
    return sch
