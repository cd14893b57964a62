"""ONNX Runtime's contrib operators that LLM exports use (ONNX Runtime GenAI's model builder,
Optimum) and TVM's importer lacks, written as the Relax ops the kernels already take.

* ``SimplifiedLayerNormalization`` (RMS norm; ONNX Runtime registers it in the standard
  domain): ``relax.nn.rms_norm``, the RMS-norm TPP kernel's pattern.
* ``com.microsoft:SkipSimplifiedLayerNormalization``: the residual sum ``input + skip (+
  bias)`` (its fourth output, which the next layer adds to) and the RMS norm of it.
* ``com.microsoft:RotaryEmbedding`` and the standard (opset 23) ``RotaryEmbedding``: the
  rotation of the first ``rotary_embedding_dim`` channels of each head by the cached cos/sin
  rows of each position, split in halves or interleaved pairs, as element-wise Relax ops
  TVM fuses into one kernel.
* ``com.microsoft:GatherBlockQuantized`` (quantized embeddings): the rows gathered from the
  packed table first, then only those rows unpacked and dequantized.

The two RotaryEmbedding forms share the name and differ in input order (com.microsoft:
input, position_ids, cos_cache, sin_cache; standard: X, cos_cache, sin_cache[,
position_ids]); TVM's converter table ignores the domain, so the form is told by the second
input's dtype (positions are integers, caches floats).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpp_tvm.errors import UnsupportedOperatorError

#: An output the graph does not read (the norms' mean and inverse standard deviation).
_UNUSED = 0.0


def _dims(expr: Any) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def _simplified_layer_norm(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """Y = X / sqrt(mean(X², axes) + epsilon) * scale over the axes from ``axis`` on."""
    from tvm import relax

    x, scale = inputs[0], inputs[1]
    rank = len(_dims(x))
    axis = int(attrs.get("axis", -1)) % rank
    out = relax.op.nn.rms_norm(x, scale, axes=list(range(axis, rank)),
                               epsilon=float(attrs.get("epsilon", 1e-5)))
    unused = relax.const(_UNUSED, "float32")
    return relax.Tuple([bb.normalize(out), unused])


def _skip_simplified_layer_norm(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """(RMS norm of s, -, -, s) with s = input + skip (+ bias) over the last axis."""
    from tvm import relax

    x, skip, gamma = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    total = relax.op.add(x, skip)
    if bias is not None:
        total = relax.op.add(total, bias)
    total = bb.normalize(total)
    out = relax.op.nn.rms_norm(total, gamma, axes=[-1],
                               epsilon=float(attrs.get("epsilon", 1e-12)))
    unused = relax.const(_UNUSED, "float32")
    return relax.Tuple([bb.normalize(out), unused, unused, total])


def _rotary_embedding(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """Both RotaryEmbedding forms (see the module docstring)."""
    from tvm import relax

    x = inputs[0]
    if str(inputs[1].ty.dtype).startswith(("int", "uint")):  # com.microsoft
        positions, cos, sin = inputs[1], inputs[2], inputs[3]
    else:  # ONNX opset 23
        cos, sin = inputs[1], inputs[2]
        positions = inputs[3] if len(inputs) > 3 else None
    if int(attrs.get("is_packed_batching", 0)):
        raise UnsupportedOperatorError("RotaryEmbedding with is_packed_batching=1 (ragged "
                                       "batches packed in one row) is not supported")
    if float(attrs.get("scale", 1.0)) != 1.0:
        raise UnsupportedOperatorError(
            f"RotaryEmbedding with scale={attrs['scale']} (not 1) is not supported")
    shape = _dims(x)
    heads = int(attrs.get("num_heads", 0))
    if len(shape) == 3:  # (batch, sequence, heads * head size): heads from the attribute
        if heads <= 0:
            raise UnsupportedOperatorError(
                "RotaryEmbedding of a 3-D input needs its num_heads attribute")
        b, s, hidden = shape
        x4 = relax.op.permute_dims(relax.op.reshape(x, (b, s, heads, hidden // heads)),
                                   [0, 2, 1, 3])
    elif len(shape) == 4:  # (batch, heads, sequence, head size)
        x4 = x
    else:
        raise UnsupportedOperatorError(f"RotaryEmbedding of a {len(shape)}-D input "
                                       "(3-D or 4-D)")
    seq = _dims(bb.normalize(x4))[2]
    half = _dims(cos)[-1]
    rotary = int(attrs.get("rotary_embedding_dim", 0)) or 2 * half
    if positions is not None:  # cos/sin rows of each position: (batch, sequence, half)
        if len(_dims(positions)) < 2:  # one start offset: positions start..start+seq
            start = relax.op.reshape(positions, (1, 1))
            steps = relax.const([[i for i in range(seq)]], str(positions.ty.dtype))
            positions = relax.op.add(start, steps)
        # "clip": a position past the cache reads its last row instead of memory past it
        cos, sin = (relax.op.take(t, positions, axis=0, mode="clip") for t in (cos, sin))
        cos, sin = (relax.op.expand_dims(t, 1) for t in (cos, sin))
    else:  # the caches are per position already: (sequence, half) or (batch, seq, half)
        cos, sin = (relax.op.expand_dims(t, 1) if len(_dims(t)) == 3 else t
                    for t in (cos, sin))
    out = rotated(bb, x4, cos, sin, rotary, bool(int(attrs.get("interleaved", 0))))
    if len(shape) == 3:
        out = relax.op.reshape(relax.op.permute_dims(out, [0, 2, 1, 3]), shape)
    return out


def rotated(bb: Any, x4: Any, cos: Any, sin: Any, rotary: int, interleaved: bool) -> Any:
    """The first ``rotary`` channels of each head of ``x4`` (batch, heads, sequence, head
    size) rotated by the ``cos``/``sin`` rows (broadcast to (.., sequence, rotary / 2)):
    halves (x[:d/2], x[d/2:]) or interleaved pairs (x[2i], x[2i+1]); the other channels
    pass through."""
    from tvm import relax

    head = _dims(bb.normalize(x4))[3]
    rot = relax.op.strided_slice(x4, axes=[3], begin=[0], end=[rotary])
    rest = relax.op.strided_slice(x4, axes=[3], begin=[rotary], end=[head])
    if interleaved:  # pairs (x[2i], x[2i+1])
        pairs = relax.op.reshape(rot, (*_dims(bb.normalize(rot))[:3], rotary // 2, 2))
        first = relax.op.squeeze(relax.op.strided_slice(pairs, [4], [0], [1]), [4])
        second = relax.op.squeeze(relax.op.strided_slice(pairs, [4], [1], [2]), [4])
    else:  # halves (x[:d/2], x[d/2:])
        first = relax.op.strided_slice(rot, axes=[3], begin=[0], end=[rotary // 2])
        second = relax.op.strided_slice(rot, axes=[3], begin=[rotary // 2], end=[rotary])
    new_first = relax.op.subtract(relax.op.multiply(first, cos), relax.op.multiply(second, sin))
    new_second = relax.op.add(relax.op.multiply(second, cos), relax.op.multiply(first, sin))
    if interleaved:
        stacked = relax.op.stack([new_first, new_second], axis=4)
        out = relax.op.reshape(stacked, _dims(bb.normalize(rot)))
    else:
        out = relax.op.concat([new_first, new_second], axis=3)
    return relax.op.concat([out, rest], axis=3) if rotary < head else out


def _gather_block_quantized(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """com.microsoft:GatherBlockQuantized on uint8 data (4 or 8 bits, what GenAI's model
    builder writes for quantized embeddings): rows of ``data`` (vocabulary, packed codes)
    gathered first, then only those rows unpacked (low nibble first) and dequantized per
    block along the last axis, ``(code - zero_point) * scale`` (zero point 8 / 128 without
    ``zero_points``; 4-bit zero points packed two a byte)."""
    from tvm import relax

    data, indices, scales = inputs[0], inputs[1], inputs[2]
    zero_points = inputs[3] if len(inputs) > 3 else None
    bits, block = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    rank = len(_dims(data))
    if str(data.ty.dtype) != "uint8" or bits not in (4, 8):
        raise UnsupportedOperatorError(
            f"GatherBlockQuantized of {data.ty.dtype} data with bits={bits}: uint8 data of "
            "4 or 8 bits is supported")
    if int(attrs.get("gather_axis", 0)) % rank != 0 \
            or int(attrs.get("quantize_axis", 1)) % rank != rank - 1:
        raise UnsupportedOperatorError("GatherBlockQuantized: gather_axis 0 and quantize_axis "
                                       "last are supported (the only ones for uint8 data)")
    vocab, *inner, packed = _dims(data)
    per_byte = 8 // bits
    width = packed * per_byte
    blocks = -(-width // block)
    index_shape = _dims(indices)
    count = int(np.prod(index_shape)) if index_shape else 1
    n = count * int(np.prod(inner))  # rows gathered (an inner axis splits each into more)
    kind = str(indices.ty.dtype)
    flat = relax.op.reshape(indices, (count,))  # negative ids count from the end
    flat = bb.normalize(relax.op.where(relax.op.less(flat, relax.const(0, kind)),
                                       relax.op.add(flat, relax.const(vocab, kind)), flat))
    rows = bb.normalize(relax.op.reshape(relax.op.take(data, flat, axis=0, mode="clip"),
                                         (n, packed)))

    def unpacked(codes: Any, size: int) -> Any:
        """u8 bytes (r, size) as (r, size * per_byte) codes, as int32."""
        if per_byte == 1:
            return relax.op.astype(codes, "int32")
        low = bb.normalize(relax.op.bitwise_and(codes, relax.const(15, "uint8")))
        high = bb.normalize(relax.op.right_shift(codes, relax.const(4, "uint8")))
        pairs = bb.normalize(relax.op.stack([low, high], axis=2))
        return relax.op.astype(relax.op.reshape(pairs, (n, size * 2)), "int32")

    codes = unpacked(rows, packed)
    scale = relax.op.reshape(relax.op.take(scales, flat, axis=0, mode="clip"), (n, blocks))
    if zero_points is None:
        zero = relax.const(1 << (bits - 1), "int32")
    else:
        zp_bytes = _dims(zero_points)[-1]
        zero = unpacked(bb.normalize(relax.op.reshape(
            relax.op.take(zero_points, flat, axis=0, mode="clip"), (n, zp_bytes))), zp_bytes)
        if per_byte > 1 and zp_bytes * 2 != blocks:
            zero = relax.op.strided_slice(zero, axes=[1], begin=[0], end=[blocks])
        zero = relax.op.expand_dims(zero, 2)
    if blocks * block != width:
        codes = relax.op.nn.pad(codes, [0, 0, 0, blocks * block - width])
    codes = relax.op.reshape(codes, (n, blocks, block))
    values = relax.op.multiply(relax.op.astype(relax.op.subtract(codes, zero), "float32"),
                               relax.op.expand_dims(relax.op.astype(scale, "float32"), 2))
    values = relax.op.reshape(values, (n, blocks * block))
    if blocks * block != width:
        values = relax.op.strided_slice(values, axes=[1], begin=[0], end=[width])
    out = relax.op.reshape(values, (*index_shape, *inner, width))
    return relax.op.astype(out, str(scales.ty.dtype)) if str(scales.ty.dtype) != "float32" \
        else out


#: Converters by ONNX op type (for :data:`~.converters.EXTRA_CONVERTERS`).
CONVERTERS = {
    "SimplifiedLayerNormalization": _simplified_layer_norm,
    "SkipSimplifiedLayerNormalization": _skip_simplified_layer_norm,
    "RotaryEmbedding": _rotary_embedding,
    "GatherBlockQuantized": _gather_block_quantized,
}
