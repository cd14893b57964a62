"""Weight-only quantized matmuls from ONNX: ``com.microsoft:MatMulNBits`` (ONNX Runtime's
4/8-bit blockwise weights, what its ``MatMulNBitsQuantizer`` and GenAI's model builder
write).

The op, by ONNX Runtime's contrib-op spec: ``Y = A @ Wᵀ (+ bias)`` with W (N, K) stored as
``B`` (N, blocks, blob) uint8 codes, ``blocks = ceil(K / block_size)``, ``blob =
block_size * bits / 8`` (4 bits: two codes a byte, the low nibble first), ``scales``
(N * blocks) in A's dtype and optional ``zero_points``: uint8 packed like the codes, each
row of N padded to whole bytes, or one per block in A's dtype; without them the zero point
is ``2**(bits-1)``. ``W[n, k] = (code - zero_point) * scale`` of k's block.

The converter writes that dequantization as plain Relax ops on the packed bytes (unpack by
``repeat``, ``right_shift`` and ``bitwise_and``; ``astype``, ``subtract``, ``multiply``;
reshape to (N, blocks * block) and slice to K), then ``matmul(A, permute_dims(W))``: any
TVM target compiles it as it is (constant folding turns W into fp32 there), and on TPP
targets ``relay_passes/weight_only.py`` recognises the form before constant folding and
replaces it by the weight-only kernel on the packed bytes. Zero points packed in 4 bits are
unpacked here to one uint8 a block (N * blocks bytes: 1/16 of 4-bit codes at block 32).

``accuracy_level`` 4 (int8 compute) is written as what ONNX Runtime's CPU kernel computes:
A's row blocks quantized to int8 and dequantized before the matmul
(:func:`int8_fake_quantized`), so every target gives its results; the graph pass runs that
form on int8 dot products. Levels 0-3 compute in fp32, which meets each of them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tvm

from tpp_tvm.errors import UnsupportedOperatorError

log = logging.getLogger(__name__)

#: The bit widths imported (ONNX Runtime also defines 2 bits).
BITS = (4, 8)
#: ``accuracy_level`` values of the spec: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 for A.
ACCURACY_LEVELS = range(5)
#: The level at which A is quantized to int8 per block (ONNX Runtime's CPU kernel does so);
#: the others compute in fp32, which meets each (a level names the least precision of A).
INT8_LEVEL = 4


def _node(attrs: dict[str, Any]) -> str:
    return f"MatMulNBits node {attrs.get('tvm_custom', {}).get('name', '?')!r}"


def _const(expr: Any) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.Constant) else None


def unpack_zero_points(packed: np.ndarray, n: int, blocks: int, bits: int) -> np.ndarray:
    """(N, blocks) uint8 zero points from the spec's packing: each row of N in
    ``ceil(blocks * bits / 8)`` bytes, low bits first."""
    per_row = -(-blocks * bits // 8)
    rows = np.asarray(packed, np.uint8).reshape(n, per_row)
    if bits == 8:
        return rows[:, :blocks].copy()
    nibbles = np.stack([rows & 15, rows >> 4], axis=-1).reshape(n, 2 * per_row)
    return nibbles[:, :blocks].copy()


def int8_fake_quantized(bb: Any, x: Any, k: int, block: int) -> Any:
    """``x`` (..., K) as accuracy level 4 computes with it: each row's blocks of ``block``
    quantized to int8 (scale ``max|x| / 127``, rounded to nearest even) and dequantized, as
    ONNX Runtime's CPU kernel does before its int8 dot products (``relay_passes/weight_only``
    reads the chain back and quantizes inside the kernel instead)."""
    from tvm import relax

    shape = [int(d) for d in x.ty.shape.values]
    rows, blocks = int(np.prod(shape[:-1])), -(-k // block)
    flat = relax.op.reshape(x, (rows, k))
    if blocks * block != k:
        flat = relax.op.nn.pad(flat, [0, 0, 0, blocks * block - k])
    tiles = bb.normalize(relax.op.reshape(flat, (rows, blocks, block)))
    amax = relax.op.max(relax.op.abs(tiles), axis=[2], keepdims=True)
    scale = bb.normalize(relax.op.divide(amax, relax.const(np.float32(127))))
    inverse = relax.op.divide(relax.const(np.float32(1)), relax.op.maximum(
        scale, relax.const(np.finfo(np.float32).tiny)))  # all-zero blocks stay 0
    codes = relax.op.round(relax.op.multiply(tiles, inverse))
    out = relax.op.reshape(relax.op.multiply(codes, scale), (rows, blocks * block))
    if blocks * block != k:
        out = relax.op.strided_slice(out, axes=[1], begin=[0], end=[k])
    return bb.normalize(relax.op.reshape(out, shape))


def _check_g_idx(g_idx: Any, k: int, block: int, where: str) -> None:
    """``g_idx`` (the block of each k) is accepted only as the default ``k // block``."""
    if g_idx is None:
        return
    value = _const(g_idx)
    if value is None or not np.array_equal(value.reshape(-1), np.arange(k) // block):
        raise UnsupportedOperatorError(
            f"{where}: a g_idx input that reorders k across blocks (act-order GPTQ) is not "
            "supported; only contiguous blocks of block_size")


def matmul_nbits(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """``com.microsoft:MatMulNBits`` as Relax ops on the packed weights (module docstring)."""
    from tvm import relax

    where = _node(attrs)
    a, b, scales, zero_points, g_idx, bias = (list(inputs) + [None] * 6)[:6]
    k, n = int(attrs["K"]), int(attrs["N"])
    bits, block = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    level = int(attrs.get("accuracy_level", 0))
    if bits not in BITS:
        raise UnsupportedOperatorError(
            f"{where}: {bits}-bit weights; supported are {', '.join(map(str, BITS))} bits")
    if block < 16 or block & (block - 1):
        raise UnsupportedOperatorError(
            f"{where}: block_size {block}; the spec allows powers of 2 from 16")
    if level not in ACCURACY_LEVELS:
        raise UnsupportedOperatorError(f"{where}: accuracy_level {level}, one of 0-4")
    log.debug("%s: accuracy_level %d", where, level)
    _check_g_idx(g_idx, k, block, where)
    dtype = str(a.ty.dtype)
    if dtype not in ("float32", "float16"):
        raise UnsupportedOperatorError(f"{where}: A of dtype {dtype}; float32 or float16")
    if str(b.ty.dtype) != "uint8":
        raise UnsupportedOperatorError(f"{where}: B of dtype {b.ty.dtype}; uint8 codes only")
    blocks, blob = -(-k // block), block * bits // 8

    def f32(x: Any) -> Any:
        if _const(x) is not None:
            return relax.const(_const(x).astype(np.float32))
        return x if str(x.ty.dtype) == "float32" else bb.normalize(relax.op.astype(x, "float32"))

    def shaped(x: Any, shape: tuple[int, ...]) -> Any:
        """``x`` reshaped; a constant stays one (the graph pass reads it as it is)."""
        value = _const(x)
        return relax.const(value.reshape(shape)) if value is not None else \
            bb.normalize(relax.op.reshape(x, shape))

    codes = shaped(b, (n, blocks, blob))
    if bits == 4:  # byte j -> codes 2j (low nibble) and 2j + 1 (high nibble)
        shifts = np.tile(np.array([0, 4], np.uint8), blob)
        codes = bb.normalize(relax.op.bitwise_and(
            relax.op.right_shift(relax.op.repeat(codes, 2, axis=2), relax.const(shifts)),
            relax.const(np.uint8(15))))
    if zero_points is None:
        zp = relax.const(np.float32(1 << (bits - 1)))
    elif str(zero_points.ty.dtype) == "uint8":
        packed = _const(zero_points)
        if packed is None:
            raise UnsupportedOperatorError(f"{where}: zero points computed at run time")
        zp = relax.op.astype(
            relax.const(unpack_zero_points(packed, n, blocks, bits).reshape(n, blocks, 1)),
            "float32")
    else:  # one per block, in A's dtype
        zp = shaped(f32(zero_points), (n, blocks, 1))
    per_block = shaped(f32(scales), (n, blocks, 1))
    w = relax.op.multiply(relax.op.subtract(relax.op.astype(codes, "float32"), zp), per_block)
    w = bb.normalize(relax.op.reshape(bb.normalize(w), (n, blocks * block)))
    if blocks * block != k:
        w = bb.normalize(relax.op.strided_slice(w, axes=[1], begin=[0], end=[k]))
    x = f32(a)
    if level == INT8_LEVEL:
        x = int8_fake_quantized(bb, x, k, block)
    y = bb.normalize(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
    if bias is not None:
        y = bb.normalize(relax.op.add(y, f32(bias)))
    return y if dtype == "float32" else bb.normalize(relax.op.astype(y, dtype))


#: The converters of this module, by ONNX op type (domain ``com.microsoft``).
CONVERTERS = {"MatMulNBits": matmul_nbits}
