"""Weight-only quantized matmul: ``Y = A @ dequantize(W)ᵀ (+ bias) (+ R)`` with W kept in 4 or 8
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

With int8 activations (ONNX Runtime's ``accuracy_level`` 4, which quantizes A's blocks to
int8 before its dot products), each row's blocks are quantized once per call and the codes
go to ``vpdpbusd`` as they are: a 64-byte vector holds 16 columns x 4 consecutive k (for 4
bits, the next 4 k in the high nibbles), so one load, a mask and a shift feed 128 u8 x s8
products into int32 lanes; per block, ``s_w * s_a * (dot - z * sum(A codes))``. No widening:
on one Xeon core this path streams 4-bit weights about twice as fast as the fp32 one.

Decode (a few rows) is one chunk: the weights stream once. Prefill (more than
:data:`PANEL_ROWS` rows) in fp32 dequantizes each tile's block once into an fp32 panel that
every chunk of a band of rows multiplies, a GEMM microkernel on exact weights (4096 x 4096,
128 rows, one core: 31 ms against 39 ms re-widening per chunk; about 55% of the FMA peak).
The int8 path runs prefill chunk by chunk (its dot products need no widening), or, on an AMX
target, on the tiles: per tile of columns and band of rows, each block's codes are unpacked
once into s8 B tiles (4-bit codes 0..15 as they are, 8-bit ones re-centred by 128, which
moves the zero point by 128), and ``tdpbssd`` multiplies them with 16 rows of A's int8 codes
at a time (:func:`~tpp_tvm.intrinsics.llvm_ir.amx_block_dots`); the int32 tile is scaled
per block on the vector unit as in the chunked kernel. The tile product does 8192 multiply-
adds where ``vpdpbusd`` does 64; the per-block scaling, the same for both, is then most of
the work at blocks of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..errors import UnsupportedShapeError
from ..intrinsics.llvm_ir import AMX_ROWS, TILE_BYTES, amx_block_dots, module_text
from ..intrinsics.prefetch import LINE, prefetch_l2
from ..intrinsics.registry import vector_isa
from ..intrinsics.vector_math import VPDPBUSD
from .gemm_plan import core_table

#: Bit widths the kernel unpacks.
BITS = (4, 8)
#: Most rows one chunk holds in registers (accumulators: 3 * rows * vectors per tile).
MAX_ROWS = 4
#: Above this many rows the fp32 kernel dequantizes a panel per block (prefill) instead of
#: widening the codes again for every chunk of rows.
PANEL_ROWS = 8
#: Rows whose totals a prefill tile keeps (contiguous, in L1) while it walks the blocks.
PANEL_BAND = 32
#: Accumulator registers a chunk may use (of 32 AVX-512 vectors; the rest hold codes).
ACC_REGISTERS = 24
#: int32 lanes of the int8 kernel's dot product (``vpdpbusd`` on 512 bits: 64 u8 x s8).
DOT_LANES = 16
#: Rows of A a band of the tile kernel keeps the fp32 totals of (band x tile columns, in L1).
TILE_BAND = 64


@dataclass(frozen=True)
class WeightOnlyShape:
    """A weight-only matmul: ``m`` rows of A, ``k`` reduced, ``n`` outputs; ``bits`` per
    code, ``block`` codes per scale (and zero point); ``zero_points``: per-block zero points
    given (else ``2**(bits-1)``); ``bias``: a per-column bias added; ``residual``: an (m,
    n) tensor added after it (a transformer's residual stream), in the same order as the
    unfused ``(A W + bias) + R``; ``gate``: the result multiplied by ``silu(G)`` of an (m,
    n) tensor G (SwiGLU: the up projection times the activated gate projection)."""

    m: int
    k: int
    n: int
    bits: int = 4
    block: int = 32
    zero_points: bool = False
    bias: bool = False
    int8_activations: bool = False
    residual: bool = False
    gate: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise UnsupportedShapeError(
                f"weight-only matmul: {self.bits}-bit weights; supported are {BITS}")
        step = 8 if self.int8_activations else 2
        if self.block < step or self.block % step:
            raise UnsupportedShapeError(
                f"weight-only matmul: block size {self.block}; a multiple of {step} is "
                "needed")
        if min(self.m, self.k, self.n) < 1:
            raise UnsupportedShapeError(f"weight-only matmul: empty shape {self}")

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block)

    @property
    def pairs(self) -> int:
        """k-pairs per block (one byte per column for 4 bits, two for 8)."""
        return self.block // 2

    @property
    def panel(self) -> bool:
        """Many rows in fp32 (prefill): each tile's block of codes is dequantized once into
        an fp32 panel that every chunk of rows multiplies (:func:`weight_only_schedule`)."""
        return self.m > PANEL_ROWS and not self.int8_activations

    @property
    def groups(self) -> int:
        """Steps per block of the int8 kernel: 8 k (two quads in the nibbles of 4 bytes)
        for 4 bits, 4 k (one quad) for 8."""
        return self.block // (8 if self.bits == 4 else 4)


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
    on_tiles: bool = False

    @property
    def tiles(self) -> int:
        return self.cols // self.nt

    @property
    def vectors(self) -> int:
        return self.nt // self.lanes


def plan(shape: WeightOnlyShape, isa: str = "avx512") -> WeightOnlyPlan:
    """The tile width and chunk rows for ``shape`` on ``isa``: the widest tile (up to 4
    vectors: a 64-byte line of 4-bit codes on AVX-512) whose accumulators for one row fit
    :data:`ACC_REGISTERS` and that divides N (else N is padded to whole tiles), then as many
    rows as fit beside it (up to :data:`MAX_ROWS`)."""
    disa = vector_isa(isa)
    if disa.scalable:
        raise UnsupportedShapeError(
            f"weight-only matmul: no kernel for the scalable ISA {isa} yet")
    lanes = disa.schedule_lanes("float32")
    if shape.int8_activations and lanes != DOT_LANES:
        raise UnsupportedShapeError(
            f"weight-only matmul: int8 activations need {DOT_LANES} int32 lanes "
            f"(AVX512_VNNI); {isa} has {lanes}")
    # fp32: two partial sums and one total per vector; int8: one of each; panel: the
    # totals only. Wider than 4 vectors measured no faster (4096 x 4096, one core).
    per_vector = 1 if shape.panel else 2 if shape.int8_activations else 3
    # The tile is as wide as one row's accumulators allow, whatever the rows: the packed
    # weights are then the same for a decoding step and a prompt, and a decoder's builds
    # share them (:mod:`~tpp_tvm.relay_passes.shared_constants`); the rows a chunk takes
    # are what fits beside that width.
    fits = [v for v in (4, 2, 1) if per_vector * v <= ACC_REGISTERS]
    vectors = next((v for v in fits if shape.n % (v * lanes) == 0), fits[-1])
    mr = max(1, min(shape.m, MAX_ROWS, ACC_REGISTERS // (per_vector * vectors)))
    # Int8 activations on an AMX target: whole tiles of 16 rows once a prompt fills one
    # (same packed codes: the tile kernel unpacks them itself).
    on_tiles = isa == "amx" and shape.int8_activations and shape.m >= AMX_ROWS
    if on_tiles:
        mr = AMX_ROWS
    nt = vectors * lanes
    return WeightOnlyPlan(mr=mr, nt=nt, lanes=lanes, rows=-(-shape.m // mr) * mr,
                          depth=shape.blocks * shape.block, cols=-(-shape.n // nt) * nt,
                          on_tiles=on_tiles)


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
    if shape.int8_activations:
        packed = _dot_layout(shape, p, codes)
    else:
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


def _dot_layout(shape: WeightOnlyShape, p: WeightOnlyPlan, codes: np.ndarray) -> np.ndarray:
    """(tiles, blocks, groups, nt * 4) bytes for ``vpdpbusd``: per column, 4 consecutive
    k's codes in 4 bytes (one int32 lane); for 4 bits the next 4 k in their high nibbles."""
    cols, blocks = codes.shape[:2]
    if shape.bits == 4:
        q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(cols, blocks, shape.groups,
                                                                  2, 4)
        codes = q[..., 0, :] | (q[..., 1, :] << 4)
    quads = codes.reshape(p.tiles, p.nt, blocks, shape.groups, 4)
    return np.ascontiguousarray(quads.transpose(0, 2, 3, 1, 4)).reshape(
        p.tiles, blocks, shape.groups, p.nt * 4)


def weight_only_schedule(shape: WeightOnlyShape, isa: str = "avx512",
                         prefetch_bytes: int | None = None) -> s_tir.Schedule:
    """The kernel: A (rows, depth) fp32, packed codes, scales (tiles, blocks, nt) fp32
    [, zero points (tiles, blocks, nt) uint8][, bias (cols,) fp32][, residual (rows, cols)
    fp32][, gate (rows, cols) fp32] -> Y (rows, cols) fp32,
    shapes of :func:`plan` and :func:`pack_weights` (A zero-padded by the caller).

    With ``int8_activations`` (ONNX Runtime's accuracy level 4), each row's blocks of A are
    first quantized to int8 (scale ``max|a| / 127``, nearest even) and the codes multiply
    them on ``vpdpbusd`` (64 u8 x s8 products a step) into int32, scaled per block.

    ``prefetch_bytes``: how far ahead of its loads a tile prefetches its codes into L2 (0:
    not at all); by default the host cores' :attr:`~.gemm_plan.CoreTable.stream_prefetch_bytes`."""
    sh, p = shape, plan(shape, isa)
    if prefetch_bytes is None:
        prefetch_bytes = core_table(isa).stream_prefetch_bytes
    if sh.int8_activations:
        code_shape = (p.tiles, sh.blocks, sh.groups, p.nt * 4)
    elif sh.bits == 4:
        code_shape = (p.tiles, sh.blocks, sh.pairs, p.nt)
    else:
        code_shape = (p.tiles, sh.blocks, sh.pairs, 2, p.nt)

    with IRBuilder() as builder, T.prim_func():
        T.func_name("main")
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        a = T.arg("a", T.Buffer((p.rows, p.depth), "float32"))
        codes = T.arg("codes", T.Buffer(code_shape, "uint8"))
        scales = T.arg("scales", T.Buffer((p.tiles, sh.blocks, p.nt), "float32"))
        zps = (T.arg("zero_points", T.Buffer((p.tiles, sh.blocks, p.nt), "uint8"))
               if sh.zero_points else None)
        bias = T.arg("bias", T.Buffer((p.cols,), "float32")) if sh.bias else None
        residual = T.arg("residual", T.Buffer((p.rows, p.cols), "float32")) \
            if sh.residual else None
        gate = T.arg("gate", T.Buffer((p.rows, p.cols), "float32")) if sh.gate else None
        y = T.arg("y", T.Buffer((p.rows, p.cols), "float32"))
        out = _Output(y, bias, residual, gate)

        if p.on_tiles:
            _amx_bands(sh, p, a, codes, scales, zps, out)
        elif sh.panel:
            _panel_tiles(sh, p, a, codes, scales, zps, out)
        else:
            _chunk_tiles(sh, p, a, codes, scales, zps, out, prefetch_bytes)
    return s_tir.Schedule(builder.get())


class _Output:
    """Y and the epilogue of its stores: the bias, the residual and the SwiGLU gate, each
    where given, in the graph's order."""

    def __init__(self, y, bias, residual, gate) -> None:
        self.y, self.bias, self.residual, self.gate = y, bias, residual, gate

    def store(self, value: tirx.PrimExpr, row: tirx.PrimExpr, col: tirx.Ramp) -> None:
        if self.bias is not None:
            value = value + self.bias[col]
        if self.residual is not None:
            value = value + self.residual[row, col]
        if self.gate is not None:  # silu(g) = g / (1 + exp(-g)), as TVM's sigmoid
            g = self.gate[row, col]
            one = _bcast(tirx.const(1.0, "float32"), col.lanes)
            value = g / (one + tirx.exp(-g)) * value
        T.buffer_store(self.y, value, [row, col])


def _chunk_tiles(sh: WeightOnlyShape, p: WeightOnlyPlan, a, codes, scales, zps,
                 out: _Output, prefetch_bytes: int) -> None:
    """Few rows: per tile and chunk of rows, each block's dot products on the codes as
    they are (fp32 FMAs on widened codes, or vpdpbusd), scaled per block into the totals."""
    lanes, vec = p.lanes, f"float32x{p.lanes}"
    # Per row and block: the sum of A's values (or of its int8 codes), for the zero
    # points' share, and with int8 activations A's scale and codes, 4 to a word.
    sums = T.alloc_buffer((p.rows, sh.blocks), "float32")
    if sh.int8_activations:
        a_scale = T.alloc_buffer((p.rows, sh.blocks), "float32")
        a_words = T.alloc_buffer((p.rows, p.depth // 4), "int32")
        _quantize_rows(sh, p, a, sums, a_scale, a_words, parallel=p.rows > MAX_ROWS)
        block_dots = _DotBlock(sh, p, codes, a_words, prefetch_bytes)
    else:
        a_scale = None
        with T.serial(0, p.rows) as i, T.serial(0, sh.blocks) as b:
            T.buffer_store(sums, tirx.const(0.0, "float32"), [i, b])
            with T.serial(0, sh.block) as kk:
                T.buffer_store(sums, sums[i, b] + a[i, b * sh.block + kk], [i, b])
        block_dots = _FmaBlock(sh, p, codes, a, prefetch_bytes)

    with T.parallel(0, p.tiles) as tile, T.serial(0, p.rows // p.mr) as chunk:
        row0 = chunk * p.mr
        acc = T.alloc_buffer((p.mr * p.vectors,), vec, scope="local")
        zero = tirx.Broadcast(tirx.const(0.0, "float32"), lanes)
        for u in range(p.mr * p.vectors):
            T.buffer_store(acc, zero, [u])
        with T.serial(0, sh.blocks) as b:
            dot = block_dots.emit(tile, row0, b)
            for c in range(p.vectors):
                lane = tirx.Ramp(c * lanes, 1, lanes)
                s = scales[tile, b, lane]
                z = _zero_point(sh, zps, tile, b, lane, lanes)
                for r in range(p.mr):
                    u = r * p.vectors + c
                    scale = s if a_scale is None else \
                        s * _bcast(a_scale[row0 + r, b], lanes)
                    value = dot(r, c) - z * _bcast(sums[row0 + r, b], lanes)
                    T.buffer_store(acc, acc[u] + scale * value, [u])
        for r in range(p.mr):
            for c in range(p.vectors):
                out.store(acc[r * p.vectors + c], row0 + r,
                          tirx.Ramp(tile * p.nt + c * lanes, 1, lanes))


def _zero_point(sh: WeightOnlyShape, zps, tile, b, lane, lanes: int) -> tirx.PrimExpr:
    """Block ``b``'s zero points of a tile's columns as fp32 lanes: the packed row's, or
    the default ``2**(bits-1)`` without them."""
    if zps is None:
        return _bcast(tirx.const(float(1 << (sh.bits - 1)), "float32"), lanes)
    return tirx.Cast(f"float32x{lanes}", tirx.Cast(f"int32x{lanes}", zps[tile, b, lane]))


def _panel_tiles(sh: WeightOnlyShape, p: WeightOnlyPlan, a, codes, scales, zps,
                 out: _Output) -> None:
    """Many rows (prefill, fp32): per tile and band of up to :data:`PANEL_BAND` rows, each
    block's codes are dequantized once, ``(q - z) * s``, into an fp32 panel (block x nt);
    every chunk of the band's rows multiplies it as a GEMM microkernel would (A broadcast,
    panel vectors, register totals) into the band's totals, kept contiguous (Y's rows are
    N floats apart: reading them back every block thrashed L1's sets, 2.5x slower)."""
    lanes, vec = p.lanes, f"float32x{p.lanes}"
    band = next(r for r in range(min(PANEL_BAND, p.rows), 0, -1)
                if p.rows % r == 0 and r % p.mr == 0)
    with T.parallel(0, p.tiles) as tile, T.serial(0, p.rows // band) as rb:
        panel = T.alloc_buffer((sh.block * p.vectors,), vec, scope="local")
        totals = T.alloc_buffer((band * p.vectors,), vec, scope="local")
        with T.serial(0, band * p.vectors) as u:
            T.buffer_store(totals, _bcast(tirx.const(0.0, "float32"), lanes), [u])
        with T.serial(0, sh.blocks) as b:
            with T.serial(0, sh.pairs) as j:
                for c in range(p.vectors):
                    lane = tirx.Ramp(c * lanes, 1, lanes)
                    s = scales[tile, b, lane]
                    z = _zero_point(sh, zps, tile, b, lane, lanes)
                    for h, q in enumerate(_fp32_halves(sh, codes, tile, b, j, lane, lanes)):
                        w = (tirx.Cast(vec, tirx.Cast(f"int32x{lanes}", q)) - z) * s
                        T.buffer_store(panel, w, [(2 * j + h) * p.vectors + c])
            with T.serial(0, band // p.mr) as chunk:
                first = chunk * p.mr  # within the band
                row0 = rb * band + first
                acc = T.alloc_buffer((p.mr * p.vectors,), vec, scope="local")
                for u in range(p.mr * p.vectors):
                    T.buffer_store(acc, totals[first * p.vectors + u], [u])
                with T.serial(0, sh.block) as kk:
                    for c in range(p.vectors):
                        w = panel[kk * p.vectors + c]
                        for r in range(p.mr):
                            u = r * p.vectors + c
                            T.buffer_store(acc, acc[u] + _bcast(
                                a[row0 + r, b * sh.block + kk], lanes) * w, [u])
                for u in range(p.mr * p.vectors):
                    T.buffer_store(totals, acc[u], [first * p.vectors + u])
        with T.serial(0, band) as r:
            for c in range(p.vectors):
                out.store(totals[r * p.vectors + c], rb * band + r,
                          tirx.Ramp(tile * p.nt + c * lanes, 1, lanes))


def _fp32_halves(sh: WeightOnlyShape, codes, tile, b, j, lane, lanes: int) -> tuple:
    """The codes of k = 2j and 2j + 1 of block ``b`` for the tile's columns ``lane``
    (uint8 lanes), from the fp32 kernels' layout."""
    if sh.bits == 4:
        byte = codes[tile, b, j, lane]
        return (byte & _bcast(tirx.const(15, "uint8"), lanes),
                byte >> _bcast(tirx.const(4, "uint8"), lanes))
    return codes[tile, b, j, 0, lane], codes[tile, b, j, 1, lane]


def _bcast(x, lanes: int) -> tirx.PrimExpr:
    return tirx.Broadcast(x, lanes)


class _FmaBlock:
    """One block's dot products in fp32: codes split from their bytes, widened to fp32
    lanes, FMAs against A's broadcast values; even and odd k in separate accumulators."""

    def __init__(self, sh: WeightOnlyShape, p: WeightOnlyPlan, codes, a,
                 prefetch_bytes: int) -> None:
        self.sh, self.p, self.codes, self.a = sh, p, codes, a
        self.prefetch_bytes = prefetch_bytes

    def emit(self, tile, row0, b):
        """Emit the block's loop; returns ``dot(r, c)``, the fp32 vector of row ``r``,
        column vector ``c``."""
        sh, p, codes, lanes = self.sh, self.p, self.codes, self.p.lanes
        vec = f"float32x{lanes}"
        part = T.alloc_buffer((2 * p.mr * p.vectors,), vec, scope="local")
        for u in range(2 * p.mr * p.vectors):
            T.buffer_store(part, _bcast(tirx.const(0.0, "float32"), lanes), [u])
        with T.serial(0, sh.pairs) as j:
            k0 = b * sh.block + 2 * j
            for c in range(p.vectors):
                lane = tirx.Ramp(c * lanes, 1, lanes)
                step = lanes * sh.bits // 4  # bytes of codes per vector and pair
                if self.prefetch_bytes and (c * step) % LINE == 0:  # one a cache line
                    ahead = c * lanes + self.prefetch_bytes
                    T.evaluate(prefetch_l2(tirx.address_of(
                        codes[tile, b, j, ahead] if sh.bits == 4 else
                        codes[tile, b, j, 0, ahead])).value)
                for h, q in enumerate(_fp32_halves(sh, codes, tile, b, j, lane, lanes)):
                    qf = tirx.Cast(vec, tirx.Cast(f"int32x{lanes}", q))
                    for r in range(p.mr):
                        u = 2 * (r * p.vectors + c) + h
                        T.buffer_store(part, part[u] + _bcast(self.a[row0 + r, k0 + h],
                                                              lanes) * qf, [u])
        return lambda r, c: part[2 * (r * p.vectors + c)] + part[2 * (r * p.vectors + c) + 1]


class _DotBlock:
    """One block's dot products on ``vpdpbusd``: 64 code bytes (16 columns x 4 k) against
    4 int8 codes of A broadcast, into int32 lanes; 4-bit codes as two quads a byte."""

    def __init__(self, sh: WeightOnlyShape, p: WeightOnlyPlan, codes, a_words,
                 prefetch_bytes: int) -> None:
        self.sh, self.p, self.codes, self.a_words = sh, p, codes, a_words
        self.prefetch_bytes = prefetch_bytes

    def emit(self, tile, row0, b):
        sh, p = self.sh, self.p
        wide, ivec = DOT_LANES * 4, f"int32x{DOT_LANES}"
        part = T.alloc_buffer((p.mr * p.vectors,), ivec, scope="local")
        for u in range(p.mr * p.vectors):
            T.buffer_store(part, _bcast(tirx.const(0, "int32"), DOT_LANES), [u])
        quads = 2 if sh.bits == 4 else 1
        with T.serial(0, sh.groups) as g:
            word0 = (b * sh.block) // 4 + quads * g
            for c in range(p.vectors):
                if self.prefetch_bytes:
                    T.evaluate(prefetch_l2(tirx.address_of(
                        self.codes[tile, b, g, c * wide + self.prefetch_bytes])).value)
                v = self.codes[tile, b, g, tirx.Ramp(c * wide, 1, wide)]
                if sh.bits == 4:
                    halves = (v & _bcast(tirx.const(15, "uint8"), wide),
                              v >> _bcast(tirx.const(4, "uint8"), wide))
                else:
                    halves = (v,)
                for h, q in enumerate(halves):
                    q8 = T.reinterpret(f"int8x{wide}", q)
                    for r in range(p.mr):
                        u = r * p.vectors + c
                        a4 = T.reinterpret(f"int8x{wide}", _bcast(
                            self.a_words[row0 + r, word0 + h], DOT_LANES))
                        T.buffer_store(part, T.call_llvm_pure_intrin(ivec, VPDPBUSD, part[u], q8,
                                                                     a4), [u])
        vec = f"float32x{DOT_LANES}"
        return lambda r, c: tirx.Cast(vec, part[r * p.vectors + c])


def _quantize_rows(sh: WeightOnlyShape, p: WeightOnlyPlan, a, sums, a_scale, a_words,
                   parallel: bool = False) -> None:
    """A's blocks as int8 codes (4 to an int32 word, k ascending from the low byte), their
    scales and the sums of their codes; ``parallel``: rows spread over the threads (a
    prompt's rows). Vectorized over up to 64 k of a block: its max|a| and code sums as
    lane-wise partials reduced once a block, the codes narrowed to bytes (``vpmovdb``) and
    stored 4 to a word (scalar code was 3 cycles a value: 8% of a 512-row matmul)."""
    lanes = next(w for w in (64, 32, 16, 8) if sh.block % w == 0)
    chunks, ivec = sh.block // lanes, f"int32x{lanes}"
    every = tirx.Ramp(0, 1, lanes)
    rows = T.parallel(0, p.rows) if parallel else T.serial(0, p.rows)
    with rows as i, T.serial(0, sh.blocks) as b:
        top = T.alloc_buffer((lanes,), "float32", scope="local")
        total = T.alloc_buffer((lanes,), "int32", scope="local")

        def values(c):
            return a[i, tirx.Ramp(b * sh.block + c * lanes, 1, lanes)]

        T.buffer_store(top, _bcast(tirx.const(0.0, "float32"), lanes), [every])
        with T.serial(0, chunks) as c:
            T.buffer_store(top, tirx.max(top[every], tirx.abs(values(c))), [every])
        _fold_lanes(top, lanes, tirx.max)
        peak = top[0]
        T.buffer_store(a_scale, peak / tirx.const(127.0, "float32"), [i, b])
        # 127 / max|a| as ONNX Runtime's MLAS computes it (not 1 / scale: an ulp apart,
        # which moves a code on a rounding tie); an all-zero block keeps codes 0
        inverse = tirx.Select(peak > tirx.const(0.0, "float32"),
                              tirx.const(127.0, "float32") / peak,
                              tirx.const(0.0, "float32"))
        T.buffer_store(total, _bcast(tirx.const(0, "int32"), lanes), [every])
        with T.serial(0, chunks) as c:
            q = tirx.Cast(ivec, tirx.nearbyint(values(c) * _bcast(inverse, lanes)))
            words = T.reinterpret(f"int32x{lanes // 4}", tirx.Cast(f"int8x{lanes}", q))
            T.buffer_store(a_words, words, [i, tirx.Ramp(
                (b * sh.block + c * lanes) // 4, 1, lanes // 4)])
            T.buffer_store(total, total[every] + q, [every])
        _fold_lanes(total, lanes, lambda x, y: x + y)
        T.buffer_store(sums, tirx.Cast("float32", total[0]), [i, b])


def _fold_lanes(buf, lanes: int, op) -> None:
    """``buf[0] = op`` over ``buf``'s ``lanes`` values, halving the vector each step (log2
    steps of vector ops, not a scalar loop over the lanes)."""
    while lanes > 1:
        lanes //= 2
        low, high = (tirx.Ramp(0, 1, lanes), tirx.Ramp(lanes, 1, lanes)) if lanes > 1 \
            else (0, 1)
        T.buffer_store(buf, op(buf[low], buf[high]), [low])


def tile_k_bytes(block: int) -> int:
    """Bytes of K one tile product of a block takes: the largest multiple of 4 up to 64 that
    divides the block (blocks are multiples of 8: 32 -> 32, 48 -> 48, 128 -> 64 twice)."""
    return max(d for d in range(4, 65, 4) if block % d == 0)


def _amx_bands(sh: WeightOnlyShape, p: WeightOnlyPlan, a, codes, scales, zps,
               out: _Output) -> None:
    """Int8 activations on AMX tiles: A's blocks quantized (rows in parallel); then per tile
    of columns and band of rows (parallel tasks), per block: the tile's codes unpacked into
    s8 B tiles, and for each 16 rows the tile products (:func:`amx_block_dots`: one C tile
    per 16 columns) scaled into the band's fp32 totals,
    ``s_a * (s_w * dot - s_w * (z - shift) * sum(A codes))``, ``shift`` the 128 an 8-bit
    code was moved by. The tile configuration is loaded once per task."""
    lanes, vec = p.lanes, f"float32x{p.lanes}"
    columns, k_bytes = p.vectors, tile_k_bytes(sh.block)
    quads = sh.block // 4  # B rows of a block per column tile
    configure, release, dots = amx_block_dots(columns, k_bytes, sh.block // k_bytes)
    sums = T.alloc_buffer((p.rows, sh.blocks), "float32")
    a_scale = T.alloc_buffer((p.rows, sh.blocks), "float32")
    a_words = T.alloc_buffer((p.rows, p.depth // 4), "int32")
    _quantize_rows(sh, p, a, sums, a_scale, a_words, parallel=True)
    band = next(r for r in range(min(TILE_BAND, p.rows), 0, -AMX_ROWS) if p.rows % r == 0)
    bands = p.rows // band
    shift = 0.0 if sh.bits == 4 else 128.0
    with T.parallel(0, p.tiles * bands) as task:
        tile, rb = task // bands, task % bands
        b_rows = T.alloc_buffer((columns * quads * 64,), "uint8")
        c_tiles = T.alloc_buffer((columns * TILE_BYTES // 4,), "int32")
        per_block = T.alloc_buffer((2 * columns,), vec, scope="local")
        totals = T.alloc_buffer((band * columns,), vec, scope="local")
        with T.serial(0, band * columns) as u:
            T.buffer_store(totals, _bcast(tirx.const(0.0, "float32"), lanes), [u])
        with T.attr(0, "pragma_import_llvm", module_text(configure, release, dots)):
            T.evaluate(T.call_extern("void", configure.name))
            with T.serial(0, sh.blocks) as b:
                _unpack_tile_block(sh, codes, b_rows, tile, b, columns, quads)
                for c in range(columns):
                    lane = tirx.Ramp(c * lanes, 1, lanes)
                    s = scales[tile, b, lane]
                    z = _zero_point(sh, zps, tile, b, lane, lanes) - _bcast(
                        tirx.const(shift, "float32"), lanes)
                    T.buffer_store(per_block, s, [2 * c])
                    T.buffer_store(per_block, s * z, [2 * c + 1])
                with T.serial(0, band // AMX_ROWS) as chunk:
                    row0 = rb * band + chunk * AMX_ROWS
                    T.evaluate(T.call_extern(
                        "void", dots.name, tirx.address_of(a_words[row0, b * sh.block // 4]),
                        tirx.const(p.depth, "int64"), tirx.address_of(b_rows[0]),
                        tirx.address_of(c_tiles[0])))
                    with T.serial(0, AMX_ROWS) as r:
                        row = row0 + r
                        for c in range(columns):
                            dot = tirx.Cast(vec, c_tiles[tirx.Ramp(
                                c * (TILE_BYTES // 4) + r * lanes, 1, lanes)])
                            value = per_block[2 * c] * dot - per_block[2 * c + 1] * _bcast(
                                sums[row, b], lanes)
                            u = (chunk * AMX_ROWS + r) * columns + c
                            T.buffer_store(totals, totals[u] + _bcast(a_scale[row, b], lanes)
                                           * value, [u])
            T.evaluate(T.call_extern("void", release.name))
        with T.serial(0, band) as r:
            for c in range(columns):
                out.store(totals[r * columns + c], rb * band + r,
                          tirx.Ramp(tile * p.nt + c * lanes, 1, lanes))


def _unpack_tile_block(sh: WeightOnlyShape, codes, b_rows, tile, b, columns: int,
                       quads: int) -> None:
    """Block ``b``'s codes of a tile as s8 B tiles: per column tile, ``quads`` VNNI rows
    of 64 bytes (16 columns x 4 k); a 4-bit group's low nibbles are quad ``2g``, its high
    ones ``2g + 1``; an 8-bit code is moved to s8 by flipping its top bit (``q - 128``)."""
    wide = DOT_LANES * 4
    with T.serial(0, sh.groups) as g:
        for c in range(columns):
            v = codes[tile, b, g, tirx.Ramp(c * wide, 1, wide)]
            if sh.bits == 4:
                rows = [(2 * g, v & _bcast(tirx.const(15, "uint8"), wide)),
                        (2 * g + 1, v >> _bcast(tirx.const(4, "uint8"), wide))]
            else:
                rows = [(g, v ^ _bcast(tirx.const(128, "uint8"), wide))]
            for q, value in rows:
                T.buffer_store(b_rows, value, [tirx.Ramp((c * quads + q) * wide, 1, wide)])


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
