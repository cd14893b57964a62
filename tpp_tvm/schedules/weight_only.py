"""Weight-only quantized matmul: ``Y = A @ dequantize(W)ᵀ (+ bias)`` with W kept in 4 or 8
bits, unpacked in registers (ONNX Runtime's ``MatMulNBits``; llama.cpp's Q4/Q8 formats).

The math, per output column ``n`` and block ``b`` of ``block`` consecutive k::

    Y[m, n] = sum_b s[n, b] * (sum_{k in b} A[m, k] * q[n, k]  -  z[n, b] * sum_{k in b} A[m, k])

so the inner loop is a plain dot product of A with the unsigned codes ``q`` (0..15, or
0..255), and the zero point costs one multiply-add per block with the row's block sum of A
(computed once per call), not one subtraction per weight.

Layout (made by :func:`pack_weights` from ONNX's ``(N, blocks, blob)`` bytes, same size):
columns are grouped in tiles of ``nt`` (whole vectors); for each tile and block the bytes of
k-pair ``j`` lie side by side for the tile's ``nt`` columns. A 4-bit byte holds ``k = 2j`` in
its low nibble and ``k = 2j + 1`` in its high nibble (ONNX's order, so packing is a
transpose of bytes); an 8-bit tile stores the pair's two bytes as two rows of ``nt``. One
vector load then brings ``lanes`` columns' codes, ``and 15`` / ``>> 4`` split them, and they
widen to fp32 lanes for FMAs against A's two broadcast values: vectorized over N, each weight
byte read once per row chunk, accumulators of even and odd k apart (twice the independent
FMA chains). Tiles run in parallel; inside a tile, chunks of ``mr`` rows share every load.

Decode (a few rows) is one chunk: the weights stream once. Prefill (many rows) runs the same
kernel chunk by chunk; a tile's weights (``K/2 * nt`` bytes) stay in L2 between chunks, but
the FMAs run on widened codes at about a third of the fp32 GEMM's rate (a bf16/AMX or int8
prefill kernel is the next step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..errors import UnsupportedShapeError
from ..intrinsics.registry import vector_isa

#: Bit widths the kernel unpacks.
BITS = (4, 8)
#: Most rows one chunk holds in registers (accumulators: 3 * rows * vectors per tile).
MAX_ROWS = 4
#: Accumulator registers a chunk may use (of 32 AVX-512 vectors; the rest hold codes).
ACC_REGISTERS = 24


@dataclass(frozen=True)
class WeightOnlyShape:
    """A weight-only matmul: ``m`` rows of A, ``k`` reduced, ``n`` outputs; ``bits`` per
    code, ``block`` codes per scale (and zero point); ``zero_points``: per-block zero points
    given (else ``2**(bits-1)``); ``bias``: a per-column bias added."""

    m: int
    k: int
    n: int
    bits: int = 4
    block: int = 32
    zero_points: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise UnsupportedShapeError(
                f"weight-only matmul: {self.bits}-bit weights; supported are {BITS}")
        if self.block < 2 or self.block % 2:
            raise UnsupportedShapeError(
                f"weight-only matmul: block size {self.block}; an even size is needed")
        if min(self.m, self.k, self.n) < 1:
            raise UnsupportedShapeError(f"weight-only matmul: empty shape {self}")

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block)

    @property
    def pairs(self) -> int:
        """k-pairs per block (one byte per column for 4 bits, two for 8)."""
        return self.block // 2


@dataclass(frozen=True)
class WeightOnlyPlan:
    """Register tiling: ``mr`` rows per chunk, ``nt`` columns per tile (``lanes`` each
    vector); A is padded to ``rows`` x ``depth`` and Y computed ``rows`` x ``cols``."""

    mr: int
    nt: int
    lanes: int
    rows: int
    depth: int
    cols: int

    @property
    def tiles(self) -> int:
        return self.cols // self.nt

    @property
    def vectors(self) -> int:
        return self.nt // self.lanes


def plan(shape: WeightOnlyShape, isa: str = "avx512") -> WeightOnlyPlan:
    """The chunk rows and tile width for ``shape`` on ``isa``: as many rows as fit
    (:data:`MAX_ROWS`), then the widest tile (up to 4 vectors: a 64-byte line of 4-bit
    codes on AVX-512) whose accumulators fit :data:`ACC_REGISTERS` and that divides N
    (else N is padded to whole tiles)."""
    disa = vector_isa(isa)
    if disa.scalable:
        raise UnsupportedShapeError(
            f"weight-only matmul: no kernel for the scalable ISA {isa} yet")
    lanes = disa.schedule_lanes("float32")
    mr = min(shape.m, MAX_ROWS)
    fits = [v for v in (4, 2, 1) if 3 * mr * v <= ACC_REGISTERS]
    vectors = next((v for v in fits if shape.n % (v * lanes) == 0), fits[-1])
    nt = vectors * lanes
    return WeightOnlyPlan(mr=mr, nt=nt, lanes=lanes, rows=-(-shape.m // mr) * mr,
                          depth=shape.blocks * shape.block, cols=-(-shape.n // nt) * nt)


def pack_weights(shape: WeightOnlyShape, p: WeightOnlyPlan, codes: np.ndarray,
                 scales: np.ndarray, zero_points: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The kernel's constants from ONNX's ``codes`` (N, blocks, blob) uint8 (blob =
    block * bits / 8), ``scales`` (N, blocks) fp32 and unpacked ``zero_points`` (N, blocks)
    uint8 or None: (tiles, blocks, pairs, [2,] nt) codes, (tiles, blocks, nt) scales and
    zero points; padded columns have scale 0."""
    n, blocks = shape.n, shape.blocks
    pad = p.cols - n
    codes = np.asarray(codes, np.uint8).reshape(n, blocks, -1)
    codes = np.pad(codes, ((0, pad), (0, 0), (0, 0)))
    if shape.bits == 8:  # (N, blocks, pairs, 2)
        codes = codes.reshape(p.cols, blocks, shape.pairs, 2)
    tiled = codes.reshape(p.tiles, p.nt, *codes.shape[1:])
    order = (0, 2, 3, 1) if shape.bits == 4 else (0, 2, 3, 4, 1)
    packed = np.ascontiguousarray(tiled.transpose(order))

    def per_block(x: np.ndarray, dtype: str) -> np.ndarray:
        x = np.pad(np.asarray(x, dtype).reshape(n, blocks), ((0, pad), (0, 0)))
        return np.ascontiguousarray(x.reshape(p.tiles, p.nt, blocks).transpose(0, 2, 1))

    zp = per_block(zero_points, "uint8") if zero_points is not None else None
    return packed, per_block(scales, "float32"), zp


def weight_only_schedule(shape: WeightOnlyShape, isa: str = "avx512") -> s_tir.Schedule:
    """The kernel: A (rows, depth) fp32, packed codes, scales (tiles, blocks, nt) fp32
    [, zero points (tiles, blocks, nt) uint8][, bias (cols,) fp32] -> Y (rows, cols) fp32,
    shapes of :func:`plan` and :func:`pack_weights` (A zero-padded by the caller)."""
    sh, p = shape, plan(shape, isa)
    lanes, vec = p.lanes, f"float32x{p.lanes}"
    code_shape = ((p.tiles, sh.blocks, sh.pairs, p.nt) if sh.bits == 4
                  else (p.tiles, sh.blocks, sh.pairs, 2, p.nt))
    default_zp = float(1 << (sh.bits - 1))

    def bcast(x) -> tirx.PrimExpr:
        return tirx.Broadcast(x, lanes)

    def widen(x) -> tirx.PrimExpr:
        return tirx.Cast(vec, tirx.Cast(f"int32x{lanes}", x))

    with IRBuilder() as builder, T.prim_func():
        T.func_name("main")
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        a = T.arg("a", T.Buffer((p.rows, p.depth), "float32"))
        codes = T.arg("codes", T.Buffer(code_shape, "uint8"))
        scales = T.arg("scales", T.Buffer((p.tiles, sh.blocks, p.nt), "float32"))
        zps = (T.arg("zero_points", T.Buffer((p.tiles, sh.blocks, p.nt), "uint8"))
               if sh.zero_points else None)
        bias = T.arg("bias", T.Buffer((p.cols,), "float32")) if sh.bias else None
        y = T.arg("y", T.Buffer((p.rows, p.cols), "float32"))

        # Each row's block sums of A, for the zero points' share.
        sums = T.alloc_buffer((p.rows, sh.blocks), "float32")
        with T.serial(0, p.rows) as i, T.serial(0, sh.blocks) as b:
            T.buffer_store(sums, tirx.const(0.0, "float32"), [i, b])
            with T.serial(0, sh.block) as kk:
                T.buffer_store(sums, sums[i, b] + a[i, b * sh.block + kk], [i, b])

        with T.parallel(0, p.tiles) as tile, T.serial(0, p.rows // p.mr) as chunk:
            row0 = chunk * p.mr
            acc = T.alloc_buffer((p.mr * p.vectors,), vec, scope="local")
            part = T.alloc_buffer((2 * p.mr * p.vectors,), vec, scope="local")
            zero = bcast(tirx.const(0.0, "float32"))
            for u in range(p.mr * p.vectors):
                T.buffer_store(acc, zero, [u])
            with T.serial(0, sh.blocks) as b:
                for u in range(2 * p.mr * p.vectors):
                    T.buffer_store(part, zero, [u])
                with T.serial(0, sh.pairs) as j:
                    k0 = b * sh.block + 2 * j
                    for c in range(p.vectors):
                        lane = tirx.Ramp(c * lanes, 1, lanes)
                        if sh.bits == 4:
                            byte = codes[tile, b, j, lane]
                            halves = (byte & bcast(tirx.const(15, "uint8")),
                                      byte >> bcast(tirx.const(4, "uint8")))
                        else:
                            halves = (codes[tile, b, j, 0, lane], codes[tile, b, j, 1, lane])
                        for h, q in enumerate(halves):
                            qf = widen(q)
                            for r in range(p.mr):
                                u = 2 * (r * p.vectors + c) + h
                                T.buffer_store(part, part[u] + bcast(a[row0 + r, k0 + h]) * qf,
                                               [u])
                for c in range(p.vectors):
                    lane = tirx.Ramp(c * lanes, 1, lanes)
                    s = scales[tile, b, lane]
                    z = widen(zps[tile, b, lane]) if zps is not None else bcast(
                        tirx.const(default_zp, "float32"))
                    for r in range(p.mr):
                        u = r * p.vectors + c
                        dot = part[2 * u] + part[2 * u + 1] - z * bcast(sums[row0 + r, b])
                        T.buffer_store(acc, acc[u] + s * dot, [u])
            for r in range(p.mr):
                for c in range(p.vectors):
                    col = tirx.Ramp(tile * p.nt + c * lanes, 1, lanes)
                    out = acc[r * p.vectors + c]
                    if bias is not None:
                        out = out + bias[col]
                    T.buffer_store(y, out, [row0 + r, col])
    return s_tir.Schedule(builder.get())


def dequantize_reference(shape: WeightOnlyShape, codes: np.ndarray, scales: np.ndarray,
                         zero_points: np.ndarray | None) -> np.ndarray:
    """W (N, K) fp32 from ONNX's ``codes`` (N, blocks, blob), ``scales`` (N, blocks) and
    unpacked ``zero_points`` (N, blocks): the numpy reference of what the kernel computes."""
    n, blocks = shape.n, shape.blocks
    raw = np.asarray(codes, np.uint8).reshape(n, blocks, -1)
    if shape.bits == 4:
        q = np.stack([raw & 15, raw >> 4], axis=-1).reshape(n, blocks, shape.block)
    else:
        q = raw
    z = (np.asarray(zero_points, np.float32).reshape(n, blocks, 1)
         if zero_points is not None else np.float32(1 << (shape.bits - 1)))
    w = (q.astype(np.float32) - z) * np.asarray(scales, np.float32).reshape(n, blocks, 1)
    return w.reshape(n, blocks * shape.block)[:, :shape.k]
