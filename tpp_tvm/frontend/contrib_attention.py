"""ONNX Runtime's attention contrib operators (``com.microsoft:GroupQueryAttention``,
``com.microsoft:MultiHeadAttention``), as the Relax attention form the fused attention
kernel takes: softmax(Q Kᵀ · scale + mask) V, K and V heads repeated as transformers'
``repeat_kv`` writes them (the kernel reads the shared heads in place), the mask additive.

ONNX Runtime GenAI's model builder exports every decoder layer's attention as one
GroupQueryAttention (rotary embedding, KV cache and causal mask inside it), Optimum's
exports use MultiHeadAttention; TVM's importer has neither. The semantics follow ONNX
Runtime's CPU kernels (1.22-1.23):

GroupQueryAttention: Q, K, V from ``query`` (packed QKV when ``key`` is absent), heads
(B, N|Nkv, S, H); per sequence b its past length is 0 in a first prompt
(``S == total_sequence_length``), else ``seqlens_k[b] + 1 - S`` (a right-padded past);
rotary positions are ``past_b + s`` (or ``position_ids``); ``present`` is the past then the
new K/V at row ``past_b``, zeros after (a past not shared with the present: present has
past + S rows); query s sees keys ``j <= past_b + s``, the last ``local_window_size`` of
them when that is > 0; ``softcap``, ``attention_bias``, ``smooth_softmax`` and
``head_sink`` as ONNX Runtime applies them.

MultiHeadAttention: Q, K, V with their ``bias``, K and V (B, L, D) or already (B, N, L, H),
the past concatenated in front (present includes it); a ``key_padding_mask`` of key
lengths (B) or (3B+2), or of flags (B, T) or (B, S, T), adds ``mask_filter_value``;
``unidirectional`` hides keys after ``past + s``; ``attention_bias`` is added.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpp_tvm.errors import UnsupportedOperatorError

from .contrib_ops import rotated

#: The additive mask of a key a query must not see: fp32's lowest, so exp gives exactly 0
#: and a row never sums to 0 (every query sees at least itself).
_HIDDEN = float(np.finfo(np.float32).min)


def _dims(expr: Any) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def _input(inputs: Any, i: int) -> Any:
    return inputs[i] if len(inputs) > i else None


def _heads(bb: Any, x: Any, b: int, s: int, heads: int) -> Any:
    """(B, S, heads·H) -> (B, heads, S, H)."""
    from tvm import relax

    x = bb.normalize(x)
    h = _dims(x)[-1] // heads
    return relax.op.permute_dims(relax.op.reshape(x, (b, s, heads, h)), [0, 2, 1, 3])


def _repeated(x: Any, group: int) -> Any:
    """Each head of (B, Nkv, T, H) ``group`` times in a row: transformers' ``repeat_kv``
    form, which the attention pattern reads as shared heads."""
    from tvm import relax

    if group == 1:
        return x
    b, kv, t, h = _dims(x)
    spread = relax.op.broadcast_to(relax.op.expand_dims(x, 2), (b, kv, group, t, h))
    return relax.op.reshape(spread, (b, kv * group, t, h))


def _attend(bb: Any, q: Any, k: Any, v: Any, scale: float, mask: Any, group: int,
            softcap: float = 0.0, sink: Any = None) -> Any:
    """softmax(q kᵀ · scale (softcapped) + mask (with a sink logit)) v over heads
    (B, N, S, H), K/V heads shared by ``group`` query heads; (B, S, N·Hv)."""
    from tvm import relax

    b, n, s, _ = _dims(bb.normalize(q))
    k, v = _repeated(k, group), _repeated(v, group)
    scores = relax.op.multiply(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])),
                               relax.const(np.float32(scale)))
    if softcap > 0:
        cap = relax.const(np.float32(softcap))
        scores = relax.op.multiply(relax.op.tanh(relax.op.divide(scores, cap)), cap)
    if mask is not None:
        scores = relax.op.add(scores, mask)
    if sink is None:
        probs = relax.op.nn.softmax(scores, axis=-1)
    else:  # one more logit per row in the denominator only
        t = _dims(bb.normalize(scores))[-1]
        column = relax.op.broadcast_to(sink, (b, n, s, 1))
        probs = relax.op.strided_slice(
            relax.op.nn.softmax(relax.op.concat([scores, column], axis=3), axis=-1),
            axes=[3], begin=[0], end=[t])
    out = relax.op.matmul(probs, v)
    return relax.op.reshape(relax.op.permute_dims(out, [0, 2, 1, 3]),
                            (b, s, n * _dims(bb.normalize(v))[-1]))


def _past_lengths(s: int, seqlens_k: Any, total: Any) -> Any:
    """Each sequence's past length (B,) int32: 0 in a first prompt (S == total), else
    ``seqlens_k + 1 - S``."""
    from tvm import relax

    first = relax.op.equal(relax.op.reshape(total, ()), relax.const(s, "int32"))
    later = relax.op.add(seqlens_k, relax.const(1 - s, "int32"))
    return relax.op.where(first, relax.const(0, "int32"), later)


def _rotary_rows(cache: Any, positions: Any) -> Any:
    """The cache rows of (B, S) positions as (B, 1, S, rotary / 2)."""
    from tvm import relax

    return relax.op.expand_dims(relax.op.take(cache, positions, axis=0, mode="clip"), 1)


def _placed(past: Any, new: Any, past_b: Any) -> Any:
    """present (B, Nkv, P + S, H): each sequence's first ``past_b`` past rows, its S new
    rows, then zeros (a right-padded past's padding overwritten, as ONNX Runtime writes)."""
    from tvm import relax

    if past is None:
        return new
    b, kv, p, h = _dims(past)
    s = _dims(new)[2]
    both = relax.op.concat([past, new], axis=2)
    j = relax.const(np.arange(p + s, dtype="int32").reshape(1, p + s))
    start = relax.op.reshape(past_b, (b, 1))
    rows = relax.op.where(relax.op.less(j, start), j,
                          relax.op.add(relax.op.subtract(j, start), relax.const(p, "int32")))
    rows = relax.op.clip(rows, 0, p + s - 1)
    index = relax.op.broadcast_to(relax.op.reshape(rows, (b, 1, p + s, 1)), (b, kv, p + s, h))
    gathered = relax.op.gather_elements(both, index, axis=2)
    live = relax.op.less(j, relax.op.add(start, relax.const(s, "int32")))
    return relax.op.where(relax.op.reshape(live, (b, 1, p + s, 1)), gathered,
                          relax.const(0.0, "float32"))


def _causal_mask(past_b: Any, b: int, s: int, t: int, window: int) -> Any:
    """(B, 1, S, T) additive mask: query s of sequence b sees keys j <= past_b + s, and
    with a window > 0 only the last ``window`` of them (ONNX Runtime 1.24 on; 1.20-1.23
    counted one key more, and 0 as a window of one)."""
    from tvm import relax

    last = relax.op.add(relax.op.reshape(past_b, (b, 1, 1, 1)),
                        relax.const(np.arange(s, dtype="int32").reshape(1, 1, s, 1)))
    j = relax.const(np.arange(t, dtype="int32").reshape(1, 1, 1, t))
    seen = relax.op.less_equal(j, last)
    if window > 0:
        seen = relax.op.logical_and(
            seen, relax.op.greater(j, relax.op.subtract(last, relax.const(window, "int32"))))
    return relax.op.where(seen, relax.const(0.0, "float32"), relax.const(_HIDDEN, "float32"))


def _group_query_attention(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """(output, present_key, present_value) of ``com.microsoft:GroupQueryAttention``."""
    from tvm import relax

    n, kv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    query, key, value = inputs[0], _input(inputs, 1), _input(inputs, 2)
    past_k, past_v = _input(inputs, 3), _input(inputs, 4)
    seqlens_k, total = inputs[5], inputs[6]
    cos, sin, positions = _input(inputs, 7), _input(inputs, 8), _input(inputs, 9)
    bias, head_sink = _input(inputs, 10), _input(inputs, 11)
    if n % kv:
        raise UnsupportedOperatorError(
            f"GroupQueryAttention with num_heads={n} not a multiple of kv_num_heads={kv}")
    b, s, width = _dims(query)
    if key is None:  # packed QKV
        h = width // (n + 2 * kv)
        query, key, value = (bb.normalize(relax.op.strided_slice(query, [2], [lo], [hi]))
                             for lo, hi in ((0, n * h), (n * h, (n + kv) * h),
                                            ((n + kv) * h, width)))
    q, k, v = _heads(bb, query, b, s, n), _heads(bb, key, b, s, kv), _heads(bb, value, b, s, kv)
    h = _dims(bb.normalize(q))[-1]
    past_b = bb.normalize(_past_lengths(s, seqlens_k, total))
    if int(attrs.get("do_rotary", 0)):
        if cos is None or sin is None:
            raise UnsupportedOperatorError("GroupQueryAttention with do_rotary=1 needs "
                                           "cos_cache and sin_cache")
        steps = relax.const(np.arange(s).reshape(1, s), "int64")
        if positions is None:
            positions = relax.op.add(relax.op.astype(relax.op.reshape(past_b, (b, 1)),
                                                     "int64"), steps)
        else:  # a first prompt counts from the first sequence's first position
            first = relax.op.equal(relax.op.reshape(total, ()), relax.const(s, "int32"))
            start = relax.op.add(relax.op.strided_slice(positions, [0, 1], [0, 0], [1, 1]),
                                 steps)
            positions = relax.op.where(first, start, positions)
        rotary = 2 * _dims(cos)[-1]
        cos_rows, sin_rows = _rotary_rows(cos, positions), _rotary_rows(sin, positions)
        interleaved = bool(int(attrs.get("rotary_interleaved", 0)))
        q = rotated(bb, q, cos_rows, sin_rows, rotary, interleaved)
        k = rotated(bb, k, cos_rows, sin_rows, rotary, interleaved)
    present_k = bb.normalize(_placed(past_k, bb.normalize(k), past_b))
    present_v = bb.normalize(_placed(past_v, bb.normalize(v), past_b))
    t = _dims(present_k)[2]
    mask = _causal_mask(past_b, b, s, t, int(attrs.get("local_window_size", -1)))
    if bias is not None:
        mask = relax.op.add(bias, mask)
    sink = None
    if head_sink is not None:
        sink = relax.op.reshape(head_sink, (1, n, 1, 1))
    elif int(attrs.get("smooth_softmax", -1)) == 1:
        sink = relax.const(np.zeros((1, 1, 1, 1), "float32"))
    scale = float(attrs.get("scale", 0.0)) or 1.0 / np.sqrt(h)
    out = _attend(bb, q, present_k, present_v, scale, mask, n // kv,
                  float(attrs.get("softcap", 0.0)), sink)
    return relax.Tuple([bb.normalize(out), present_k, present_v])


def _key_padding(mask: Any, b: int, s: int, t: int, fill: float) -> Any:
    """The additive (B, 1, S|1, T) form of a MultiHeadAttention key padding mask."""
    from tvm import relax

    shape = _dims(mask)
    j = relax.const(np.arange(t, dtype="int32").reshape(1, t))
    if len(shape) == 1 and shape[0] in (b, 3 * b + 2):  # key lengths (right padding)
        lengths = relax.op.reshape(relax.op.strided_slice(mask, [0], [0], [b]), (b, 1))
        hidden = relax.op.reshape(relax.op.greater_equal(j, lengths), (b, 1, 1, t))
    elif shape == [b, t]:
        hidden = relax.op.reshape(relax.op.equal(mask, relax.const(0, "int32")), (b, 1, 1, t))
    elif shape == [b, s, t]:
        hidden = relax.op.reshape(relax.op.less_equal(mask, relax.const(0, "int32")),
                                  (b, 1, s, t))
    else:
        raise UnsupportedOperatorError(
            f"MultiHeadAttention key_padding_mask of shape {shape} (batch {b}, keys {t}): "
            "(B), (3B+2), (B, T) or (B, S, T)")
    return relax.op.where(hidden, relax.const(fill, "float32"), relax.const(0.0, "float32"))


def _multi_head_attention(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """(output, present_key, present_value) of ``com.microsoft:MultiHeadAttention``."""
    from tvm import relax

    n = int(attrs["num_heads"])
    query, key, value, bias = inputs[0], _input(inputs, 1), _input(inputs, 2), _input(inputs, 3)
    padding, attn_bias = _input(inputs, 4), _input(inputs, 5)
    past_k, past_v = _input(inputs, 6), _input(inputs, 7)
    if key is None or value is None or len(_dims(query)) != 3 or len(_dims(key)) == 5:
        raise UnsupportedOperatorError(
            "MultiHeadAttention with packed QKV or packed KV is not supported (ONNX Runtime's "
            "CPU kernel does not run it either); separate query, key and value")
    if _input(inputs, 9) is not None:
        raise UnsupportedOperatorError("MultiHeadAttention with cache_indirection (beam "
                                       "search) is not supported")
    b, s, d = _dims(query)
    if bias is not None:
        dk = d if len(_dims(key)) == 3 else 0
        query = relax.op.add(query, relax.op.strided_slice(bias, [0], [0], [d]))
        if dk:
            dv = _dims(value)[-1]
            key = relax.op.add(key, relax.op.strided_slice(bias, [0], [d], [2 * d]))
            value = relax.op.add(value, relax.op.strided_slice(bias, [0], [2 * d], [2 * d + dv]))
    q = _heads(bb, query, b, s, n)
    key, value = bb.normalize(key), bb.normalize(value)
    if len(_dims(key)) == 3:
        length = _dims(key)[1]
        key, value = _heads(bb, key, b, length, n), _heads(bb, value, b, length, n)
    past = 0 if past_k is None else _dims(past_k)[2]
    if past_k is not None:
        key = relax.op.concat([past_k, key], axis=2)
        value = relax.op.concat([past_v, value], axis=2)
    present_k, present_v = bb.normalize(key), bb.normalize(value)
    t = _dims(present_k)[2]
    mask = None
    if padding is not None:
        mask = _key_padding(padding, b, s, t, float(attrs.get("mask_filter_value", -10000.0)))
    if int(attrs.get("unidirectional", 0)) and s > 1:
        causal = np.where(np.arange(t)[None, :] <= past + np.arange(s)[:, None], 0.0, _HIDDEN)
        causal = relax.const(causal.astype("float32").reshape(1, 1, s, t))
        mask = causal if mask is None else relax.op.add(mask, causal)
    if attn_bias is not None:
        mask = attn_bias if mask is None else relax.op.add(attn_bias, mask)
    h = _dims(bb.normalize(q))[-1]
    scale = float(attrs.get("scale", 0.0)) or 1.0 / np.sqrt(h)
    out = _attend(bb, q, present_k, present_v, scale, mask, 1)
    return relax.Tuple([bb.normalize(out), present_k, present_v])


#: Converters by ONNX op type (for :data:`~.converters.EXTRA_CONVERTERS`).
CONVERTERS = {
    "GroupQueryAttention": _group_query_attention,
    "MultiHeadAttention": _multi_head_attention,
}
