"""Attention: softmax(Q Kᵀ / c (+ mask)) V as one kernel, with its mask, NaN guard and
grouped-query variants, and how a broadcast mask is read per (batch·head) row."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from ..exprs import scalar_value
from .base import TPPPattern, static_f32


def _grouped_check(a: dict, qs: tuple[int, ...], keys: int) -> bool:
    """K and V repeat each of their heads ``group`` times in a row (query head h reads K/V
    head h // group), only their heads, and Kᵀ swaps K's last two axes; K's head size is
    Q's, V's may differ. K and V have as many heads (the kernel reads both by one group)."""
    if [int(x) for x in a["k_permute"].attrs.axes] != [0, 1, 3, 2]:
        return False
    kv_heads = set()
    for key in ("k_grouped", "v_grouped"):
        src = a[key]
        if not static_f32(src) or len(src.ty.shape.values) != 4:
            return False
        b, kvh, s, d = (int(x) for x in src.ty.shape.values)
        if [int(x) for x in a[key + "_expand"].attrs.axis] != [2]:
            return False
        if b != qs[0] or s != keys or (key == "k_grouped" and d != qs[-1]) or qs[1] % kvh:
            return False
        kv_heads.add(kvh)
    return len(kv_heads) == 1


#: Most queries of a step that reads K as rows (``k_rows``): a decoding step's few queries,
#: one query block, so the kernel transposes K's blocks in L1 instead of the graph copying
#: all of Kᵀ first (more query blocks would each transpose K again).
ROWS_K_MAX_QUERIES = 8


def _rows_check(a: dict, qs: tuple[int, ...]) -> bool:
    """Kᵀ is K with its last two axes swapped, and there are few queries."""
    rank = len(qs)
    axes = [int(x) for x in a["k_permute"].attrs.axes]
    return (axes == [*range(rank - 2), rank - 1, rank - 2] and static_f32(a["k_rows"])
            and qs[-2] <= ROWS_K_MAX_QUERIES)


def _dequantized_check(a: dict, key: str) -> bool:
    """The operand annotated ``key`` is int8 rows times one static fp32 scale per row
    (``key_int8`` (..., rows, d), ``key_scale`` (..., rows, 1)): an int8 KV cache read."""
    x, scale = a[key + "_int8"], a[key + "_scale"]
    if x.ty.dtype != "int8" or not static_f32(scale) or not hasattr(x.ty.shape, "values"):
        return False
    xs = [int(d) for d in x.ty.shape.values]
    return [int(d) for d in scale.ty.shape.values] == [*xs[:-1], 1]


def _attention_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """Q·Kᵀ·scale (+mask) → softmax(last axis) → ·V with static fp32 shapes; a mask is
    (batch or 1, heads or 1, queries or 1, keys), as padding, causal and ALiBi masks are."""
    a = ctx.annotated_expr
    q, kt, v, scale = a["q"], a["k_t"], a["v"], a["scale"]
    if not all(static_f32(x) for x in (q, kt, v)):
        return False
    qs, ks, vs = (tuple(int(d) for d in x.ty.shape.values) for x in (q, kt, v))
    if len(qs) < 3 or not (len(qs) == len(ks) == len(vs)):
        return False
    if qs[:-2] != ks[:-2] or qs[:-2] != vs[:-2]:
        return False
    if qs[-1] != ks[-2] or ks[-1] != vs[-2]:
        return False
    if scale.value.numpy().size != 1:
        return False
    if "nan_guard" in a and scalar_value(a["nan_guard"]) != 0.0:
        return False
    if "k_grouped" in a and not _grouped_check(a, qs, ks[-1]):
        return False
    if "k_rows" in a and not _rows_check(a, qs):
        return False
    if any(key.endswith("_int8") and not _dequantized_check(a, key[:-5]) for key in a):
        return False
    softmax = a["softmax"]
    if int(softmax.attrs.axis) % len(qs) != len(qs) - 1:
        return False
    if "mask" in a:
        mask = a["mask"]
        if not static_f32(mask):
            return False
        ms = tuple(int(d) for d in mask.ty.shape.values)
        if len(ms) < 2 or len(ms) > len(qs) or ms[-1] != ks[-1] or ms[-2] not in (1, qs[-2]):
            return False
        if len(ms) == len(qs) and mask_rows_broadcast(ms[:-2], qs[:-2]):
            return True
        # A constant mask broadcast otherwise (Swin's relative position bias, one per head
        # for every window) is laid out per (batch·head) row at lowering, if not too big.
        lead = (1,) * (len(qs) - len(ms)) + ms[:-2]
        return (isinstance(mask, tvm.ir.Constant)
                and all(m in (1, q) for m, q in zip(lead, qs[:-2]))
                and 4 * int(np.prod(qs[:-2])) * ms[-2] * ms[-1] <= MAX_MATERIALIZED_MASK)
    return True


#: Largest attention mask (bytes) materialized per (batch·head) row from a broadcast.
MAX_MATERIALIZED_MASK = 16 * 1024 * 1024


def mask_rows_broadcast(mask_lead: tuple[int, ...], lead: tuple[int, ...]) -> bool:
    """Whether an attention mask's leading (batch, head) dims are a prefix of the scores'
    followed by ones: then (batch·head) row ``b`` reads mask row ``b // (rows / mask
    rows)`` (a mask per batch, per batch and head, or one for all)."""
    p = 0
    while p < len(lead) and mask_lead[p] == lead[p]:
        p += 1
    return all(d == 1 for d in mask_lead[p:])


def _operand(ann: dict, key: str, int8: bool) -> DFPattern:
    """A K or V operand annotated ``key``: any tensor, or (``int8``) int8 rows dequantized
    by a scale per row, ``astype(x, f32) * scale`` (``key_int8``, ``key_scale``)."""
    if not int8:
        ann[key] = wildcard()
        return ann[key]
    ann[key + "_int8"], ann[key + "_scale"] = wildcard(), wildcard()
    ann[key] = is_op("relax.multiply")(is_op("relax.astype")(ann[key + "_int8"]),
                                       ann[key + "_scale"])
    return ann[key]


def _repeated_heads(ann: dict, key: str, int8: bool) -> DFPattern:
    """transformers' ``repeat_kv`` of a (batch, kv heads, seq, dim) tensor annotated ``key``:
    ``reshape(broadcast_to(expand_dims(x, 2), (b, kvh, group, s, d)), (b, kvh*group, s, d))``."""
    x = _operand(ann, key, int8)
    expand = is_op("relax.expand_dims")(x)
    ann[key + "_expand"] = expand
    return is_op("relax.reshape")(is_op("relax.broadcast_to")(expand, wildcard()), wildcard())


def attention_patterns() -> list[TPPPattern]:
    """softmax(Q Kᵀ / c (+ mask)) V, with the scale as divide or multiply by a constant;
    optionally with the probabilities' NaNs zeroed (``where(isnan(p), 0, p)``: torch's SDPA
    export guards fully masked rows so), annotated ``nan_guard``; and optionally with K and V
    heads repeated for grouped-query attention (annotated ``k_grouped``/``v_grouped``: the
    kernel reads the shared heads in place); for a decoding step's few queries, optionally
    with Kᵀ the transpose of K (annotated ``k_rows``: the kernel reads K's rows). In those
    two forms K and V may be an int8 KV cache's rows times their scales (tried first: the
    kernel then reads the int8 cache itself)."""
    out = []
    forms = [(form, guarded, int8) for int8 in (True, False)
             for form in ("grouped", "rows", "") for guarded in (True, False)
             if form or not int8]
    for form, guarded, int8 in forms:
        for scale_op in ("relax.divide", "relax.multiply"):
            for with_mask in (True, False):
                q, c = wildcard(), is_const()
                ann = {}
                if form == "grouped":
                    kt = is_op("relax.permute_dims")(_repeated_heads(ann, "k_grouped", int8))
                    v = _repeated_heads(ann, "v_grouped", int8)
                    ann["k_permute"] = kt
                elif form == "rows":
                    kt = ann["k_permute"] = is_op("relax.permute_dims")(
                        _operand(ann, "k_rows", int8))
                    v = _operand(ann, "v", int8)
                else:
                    kt, v = wildcard(), wildcard()
                scores = is_op("relax.matmul")(q, kt)
                z = is_op(scale_op)(scores, c)
                ann |= {"q": q, "k_t": kt, "v": v, "scale": c, "root": scores}
                if with_mask:
                    m = wildcard()
                    z = is_op("relax.add")(z, m)
                    ann["mask"] = m
                sm = probs = is_op("relax.nn.softmax")(z)
                if guarded:
                    zero = is_const()
                    probs = is_op("relax.where")(is_op("relax.isnan")(sm), zero, sm)
                    ann["nan_guard"] = zero
                o = is_op("relax.matmul")(probs, v)
                ann.update({"softmax": sm, "out": o})
                name = "tpp.attention" + ("_mask" if with_mask else "")
                name += "" if scale_op == "relax.divide" else "_mulscale"
                name += ("_nanguard" if guarded else "") + {"grouped": "_gqa",
                                                            "rows": "_krows"}.get(form, "")
                name += "_int8kv" if int8 else ""
                out.append(TPPPattern(name, o, ann,
                                      _attention_check, "attention",
                                      scale_multiplies=scale_op == "relax.multiply"))
    return out
