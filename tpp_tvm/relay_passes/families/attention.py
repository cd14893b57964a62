"""The attention family: softmax(Q Kᵀ · scale + mask) V as one fused kernel over the
flattened (batch · head) dimension (``schedules/attention.py``)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ...schedules.attention import (
    AttentionShape,
    attention_schedule,
    attention_tile_schedule,
    padded_keys,
    padded_query_rows,
    query_block_rows,
    tile_query_rows,
)
from ...schedules.gemm_plan import runs_on_tiles
from ..patterns import mask_rows_broadcast
from .base import KernelFamily, Lowered, Match, as_relax_kernel, dims, kernel_name


def lower_attention(bb: relax.BlockBuilder, matched: Match, name: str,
                    isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """One fused attention kernel over the flattened (batch·head) dimension. In bf16 on an
    AMX target its two products run on tiles (queries padded to blocks of 32) where the
    head size is whole 32s and there are 16 queries or more; elsewhere it stays fp32.
    Queries and keys may differ in number, and V's head size (the output's) from Q's and
    K's (LeViT's subsampling attention: 49 queries over 196 keys, values 4x wider)."""
    q, kt = matched["q"], matched["k_t"]
    qs, ks = dims(q), dims(kt)
    dv = dims(matched["v"])[-1]
    tile_rows = (tile_query_rows(qs[-2], qs[-1], dv)
                 if precision != "float32" and runs_on_tiles(isa, precision) else None)
    tiles = tile_rows is not None
    bh = int(np.prod(qs[:-2]))
    group = 1
    k = None  # K as rows (shared heads), where the kernel transposes its key blocks itself
    k_key, v_key = ("k_grouped", "v_grouped") if "k_grouped" in matched else ("k_rows", "v")
    int8 = f"{k_key}_int8" in matched  # K and V: an int8 cache's rows times their scales
    if "k_grouped" in matched:  # shared K/V heads read in place, not repeated
        group = qs[1] // dims(matched[k_key + ("_int8" if int8 else "")])[1]
    if k_key in matched:
        k = matched[k_key] if not int8 else None
    c = float(matched["scale"].value.numpy().reshape(()))
    scale = c if matched.scale_multiplies else 1.0 / c
    if group > 1 and not tiles and _folds_group(matched, qs, query_block_rows(isa)):
        # Few queries (a decoding step): the query heads sharing a K/V head become rows
        # of one block, so each K/V head is read once for all of them and the block is
        # not padded to 8 rows for 1 query. (batch, kv head, group, queries) is a reshape.
        qs = [*qs[:-3], qs[-3] // group, group * qs[-2], qs[-1]]
        q = bb.emit(relax.op.reshape(q, qs))
        bh, group = bh // group, 1
    rows = tile_rows or padded_query_rows(qs[-2], query_block_rows(isa))
    # One query block a head (a decoding step) reads K once: its key blocks are transposed
    # in L1 by the kernel, not copied whole into Kᵀ first.
    keys_as_rows = k_key in matched and not tiles and rows <= query_block_rows(isa)
    kv_int8 = int8 and keys_as_rows  # else dequantized here, for the fp32 kernel
    scales = []
    if kv_int8:
        k, v = matched[k_key + "_int8"], matched[v_key + "_int8"]
        scales = [bb.emit(relax.op.reshape(matched[key + "_scale"], (bh // group, ks[-1])))
                  for key in (k_key, v_key)]
    elif int8:
        k, v = (bb.emit(relax.op.multiply(relax.op.astype(matched[key + "_int8"], "float32"),
                                          matched[key + "_scale"])) for key in (k_key, v_key))
    else:
        v = matched[v_key] if "k_grouped" in matched else matched["v"]
    if k is not None and not keys_as_rows:
        rank = len(dims(k))
        kt = bb.emit(relax.op.permute_dims(k, [*range(rank - 2), rank - 1, rank - 2]))
    keys = padded_keys(ks[-1])
    q3 = bb.emit(relax.op.reshape(q, (bh, qs[-2], qs[-1])))
    if rows != qs[-2]:  # a prime query count: zero rows as the tail, dropped afterwards
        q3 = bb.emit(relax.op.nn.pad(q3, [0, 0, 0, rows - qs[-2], 0, 0]))
    if keys_as_rows:
        kt3 = bb.emit(relax.op.reshape(k, (bh // group, ks[-1], ks[-2])))
    else:
        kt3 = bb.emit(relax.op.reshape(kt, (bh // group, ks[-2], ks[-1])))
    v3 = bb.emit(relax.op.reshape(v, (bh // group, ks[-1], dv)))
    if keys != ks[-1]:  # zero keys and values, masked out below
        key_axis = [0, 0, 0, keys - ks[-1], 0, 0] if keys_as_rows \
            else [0, 0, 0, 0, 0, keys - ks[-1]]
        kt3 = bb.emit(relax.op.nn.pad(kt3, key_axis))
        v3 = bb.emit(relax.op.nn.pad(v3, [0, 0, 0, keys - ks[-1], 0, 0]))
        scales = [bb.emit(relax.op.nn.pad(s, [0, 0, 0, keys - ks[-1]])) for s in scales]
    mask3, heads, per_query = _mask_rows(bb, matched, qs, ks[-1], keys, rows, bh)
    args = [q3, kt3, *scales[:1], *([mask3] if mask3 is not None else []), v3, *scales[1:]]
    shape = AttentionShape(bh, rows, keys, qs[-1], heads, scale, mask3 is not None,
                           zero_masked_rows="nan_guard" in matched, group=group,
                           mask_per_query=per_query, dim_v=dv, keys_as_rows=keys_as_rows,
                           kv_int8=kv_int8, skip_masked_blocks=per_query and not isinstance(
                               matched["mask"], tvm.ir.Constant))
    sch = attention_tile_schedule(shape, threads) if tiles else attention_schedule(shape, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    out = bb.emit(relax.call_tir(gv, args, relax.TensorType((bh, rows, dv), "float32")))
    if rows != qs[-2]:
        out = bb.emit(relax.op.strided_slice(out, axes=[1], begin=[0], end=[qs[-2]]))
    return Lowered(relax.op.reshape(out, (*dims(matched["q"])[:-1], dv)),
                   on_tiles=tiles or None, kept_fp32=precision != "float32" and not tiles)


def _mask_rows(bb: relax.BlockBuilder, matched: Match, qs: list[int], seq: int, keys: int,
               rows: int, bh: int) -> tuple[relax.Expr | None, int, bool]:
    """The kernel's mask argument (mask rows, 1 or ``rows`` queries, ``keys``), the (batch·
    head) rows sharing a mask row, and whether it is per query: the matched mask, its padded
    keys at -inf and padded query rows at zero; or only the padded keys' -inf (None where
    nothing is masked)."""
    if "mask" not in matched:
        if keys == seq:
            return None, bh, False
        pad_mask = np.zeros((1, 1, keys), "float32")
        pad_mask[..., seq:] = -np.inf
        return relax.const(pad_mask), bh, False
    mask = matched["mask"]
    ms = dims(mask)
    if len(ms) != len(qs) or not mask_rows_broadcast(tuple(ms[:-2]), tuple(qs[:-2])):
        # a constant broadcast over inner dims (a bias per head): one row per (b, h)
        full = np.broadcast_to(mask.value.numpy(), (*qs[:-2], *ms[-2:]))
        mask = relax.const(np.ascontiguousarray(full))
        ms = dims(mask)
    mask_rows = int(np.prod(ms[:-2]))
    per_query = ms[-2] > 1
    mask3 = bb.emit(relax.op.reshape(mask, (mask_rows, ms[-2], ms[-1])))
    if keys != seq:
        mask3 = bb.emit(relax.op.nn.pad(mask3, [0, 0, 0, 0, 0, keys - seq],
                                        pad_value=float("-inf")))
    if per_query and rows != qs[-2]:  # the padded query rows' outputs are dropped
        mask3 = bb.emit(relax.op.nn.pad(mask3, [0, 0, 0, rows - qs[-2], 0, 0]))
    return mask3, bh // mask_rows, per_query


def _folds_group(matched: Match, qs: list[int], block_rows: int) -> bool:
    """Whether a grouped attention's shared heads can run as rows of one block: fewer
    queries than a block holds, and a mask (if any) that is the same for every head and
    query (a decoding step's padding mask, (batch or 1, 1, 1, keys))."""
    if len(qs) != 4 or qs[-2] >= block_rows:
        return False
    if "mask" not in matched:
        return True
    ms = dims(matched["mask"])
    return len(ms) == 4 and ms[1] == 1 and ms[2] == 1


FAMILIES = (KernelFamily("attention", lower_attention, ("float32", "bfloat16")),)
