"""Precision-changing TPPs, written once for every vector ISA: quantize, requantize,
dequantize, and fp32 <-> bf16 copies.

Their operands have different element sizes (u8 in, fp32 math, int32 out...), so a row is
walked in vectors of the *fp32* lane count: every operand is loaded at that many lanes
(``uint8x16`` for a u8 row on AVX-512), converted to fp32, scaled, rounded half to even,
clamped and converted to the output type. Tails are masked at the same lane count.

fp32 <-> bf16 copies cannot be written in TIR (its bf16 legalisation rewrites the typed
vectors), so each vector is one LLVM IR conversion step (``llvm_ir.convert_step``:
``vcvtneps2bf16`` / a shift), imported into the kernel like the dot-product steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ..errors import UnsupportedDTypeError
from .geometry import whole
from .llvm_ir import CONVERSIONS, convert_step, intrinsic_id, module_text
from .spec import (
    TPPSpec,
    const,
    dtype_of,
    quant_expr,
    residual_quant_expr,
    residual_sum_expr,
    scaled_expr,
)
from .vector_isa import VectorISA


def _mat(dtype: str) -> dict:
    return {"dtype": dtype, "offset_factor": 1, "strides": [T.int32(), 1]}


def _fixed_lanes(isa: VectorISA, spec: TPPSpec) -> int:
    if isa.scalable:
        raise UnsupportedDTypeError(
            f"TPP {spec.op} {spec.dtype}->{spec.acc_dtype}: no {isa.name} implementation "
            "(fixed-length vector ISAs only)")
    return isa.static_lanes("float32")


@dataclass(frozen=True)
class _Lanes:
    """A row of ``n`` elements walked in vectors of ``lanes`` (the fp32 lane count, see
    the module doc): ``full`` whole vectors, then a masked tail of ``tail`` elements."""

    n: int
    lanes: int

    @property
    def full(self) -> int:
        return self.n // self.lanes

    @property
    def tail(self) -> int:
        return self.n % self.lanes

    def at(self, v: tirx.Expr) -> tirx.Expr:
        return T.ramp(v * self.lanes, 1, self.lanes)

    def mask(self) -> tirx.Expr:
        return T.ramp(self.full * self.lanes, 1, self.lanes) < T.broadcast(self.n, self.lanes)

    def load(self, elem: tirx.Expr, dtype: str) -> tirx.Expr:
        """Masked load of the tail's lanes of ``dtype`` from ``elem`` on."""
        return T.call_llvm_pure_intrin(f"{dtype}x{self.lanes}", "llvm.masked.load",
                                       T.address_of(elem), self.mask(),
                                       T.broadcast(tirx.const(0, dtype), self.lanes))


#: The AVX-512 packs :func:`_packed_row` uses, by LLVM name: saturation bounds and
#: narrowed lanes per 128-bit lane (their any-CPU form, see :func:`generic_form`).
_PACKS = {"llvm.x86.avx512.packssdw.512": (-32768, 32767, 4),
          "llvm.x86.avx512.packuswb.512": (0, 255, 8),
          "llvm.x86.avx512.packsswb.512": (-128, 127, 8)}
_WORD_PACK, _U8_PACK, _S8_PACK = _PACKS
#: The byte pack after the word pack by output type (saturating to u8 or s8).
_BYTE_PACKS = {"uint8": _U8_PACK, "int8": _S8_PACK}
#: Dword order that undoes the packs' interleave of 128-bit lanes (lane k holds 4 bytes of
#: the first vector, then 4 of the second, twice): the row's 32 bytes in order.
_PACK_ORDER = [0, 4, 8, 12, 1, 5, 9, 13]


def _half_chunk(c: tirx.Expr, h: int) -> tirx.Expr:
    """Columns of vector ``h`` (0, 1) of 32-column chunk ``c``: one fp32x16 operand."""
    return T.ramp(c * 32 + h * 16, 1, 16)


def _packs_rows(spec: TPPSpec, isa: VectorISA) -> bool:
    """Whether a quantizing TPP narrows its rows 32 values at a time with AVX-512 packs:
    u8/s8 out and whole 32-column chunks (every int8 tile epilogue)."""
    return isa.name == "avx512" and spec.acc_dtype in _BYTE_PACKS and spec.n % 32 == 0


def _packed_row(values: tuple[tirx.Expr, tirx.Expr], out_dtype: str) -> tirx.Expr:
    """Two fp32x16 vectors (32 values of a row) rounded to nearest even and saturated to
    ``out_dtype`` as 32 bytes: clamped from above, converted (``vcvtps2dq``), narrowed by
    ``packssdw`` and a byte pack, whose saturation is the clamp from below, and put in
    order by one ``vpermd``.

    Against a clamp on both sides and a ``vpmovdb`` per vector, this saves a quarter of
    the vector-port uops after the scaling (7 -> 5.5 a vector); those uops do not overlap
    the tile products. (Packing two rows with one byte pack would save more, but LLVM
    splits the pack per stored row again.)"""
    hi = 255.0 if out_dtype == "uint8" else 127.0
    a, b = (tirx.call_llvm_pure_intrin("int32x16", "llvm.lrint", tirx.min(v, const(v, hi)))
            for v in values)
    words = tirx.call_llvm_pure_intrin("int16x32", _WORD_PACK, a, b)
    packed = tirx.call_llvm_pure_intrin(f"{out_dtype}x64", _BYTE_PACKS[out_dtype], words,
                                        words)
    return T.reinterpret(f"{out_dtype}x32",
                         tirx.Shuffle([T.reinterpret("int32x16", packed)], _PACK_ORDER))


def _lane_pairs(width: int, lanes: int = 4) -> list[int]:
    """Shuffle indices of an x86 pack: per 128-bit lane, ``width`` narrowed elements of the
    first operand, then ``width`` of the second (concatenated after the first)."""
    return [half * width * lanes + lane * width + i
            for lane in range(lanes) for half in (0, 1) for i in range(width)]


def generic_form(call: tirx.Call) -> tirx.Expr | None:
    """The any-CPU form of an AVX-512 pack a quantizing TPP put in ``call`` (saturate,
    narrow, interleave per 128-bit lane as the instruction does), None for other calls:
    the int8 tile epilogues beside emulated tiles then compile for an AVX2 host."""
    if call.op.name != "tirx.call_llvm_pure_intrin":
        return None
    pack = next((p for name, p in _PACKS.items()
                 if int(call.args[0].value) == intrinsic_id(name)), None)
    if pack is None:
        return None
    lo, hi, width = pack
    narrow = dtype_of(call).partition("x")[0]
    halves = [tirx.Cast(f"{narrow}x{4 * width}",
                        tirx.max(tirx.min(v, const(v, hi)), const(v, lo)))
              for v in call.args[1:]]
    return tirx.Shuffle(halves, _lane_pairs(width))


def quant_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """quantize / requantize / dequantize: Y = [saturate(round(]X * S[j] + O[j][))]."""
    M, N, dt, odt, op = spec.m, spec.n, spec.dtype, spec.acc_dtype, spec.op
    row = _Lanes(N, _fixed_lanes(isa, spec))
    full, tail, L, at, load, mask = row.full, row.tail, row.lanes, row.at, row.load, row.mask

    def f(x, s, o):
        return quant_expr(op, x, s, o, odt)

    packs = op != "dequantize" and _packs_rows(spec, isa)

    def chunk(X, S, Off, i, c):
        cols = [_half_chunk(c, h) for h in (0, 1)]
        return _packed_row(tuple(scaled_expr(X[i, j], S[j], Off[j]) for j in cols), odt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, s: T.handle, o: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        S = T.match_buffer(s, (N,), "float32", offset_factor=1)
        Off = T.match_buffer(o, (N,), "float32", offset_factor=1)
        Y = T.match_buffer(y, (M, N), **_mat(odt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], S[0:N], Off[0:N])
            T.writes(Y[0:M, 0:N])
            for i in T.serial(M):
                if packs:  # decided while parsing: the packed rows or the vectors and tail
                    for c in T.serial(N // 32):
                        Y[i, T.ramp(c * 32, 1, 32)] = chunk(X, S, Off, i, c)
                else:
                    for v in T.serial(full):
                        Y[i, at(v)] = f(X[i, at(v)], S[at(v)], Off[at(v)])
                    if tail > 0:
                        T.evaluate(T.call_llvm_intrin(
                            "void", "llvm.masked.store",
                            f(load(X[i, full * L], dt), load(S[full * L], "float32"),
                              load(Off[full * L], "float32")),
                            T.address_of(Y[i, full * L]), mask()))

    return impl


def residual_quant_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """requantize_add[_relu]: Y = q((float(X) S[j] + O[j] + float(R)) [relu]), q the
    quantization by A, Z; every vector dequantized, added, rectified and requantized in
    registers. As three passes (dequantize, equation, quantize) over the tile in L1, the
    epilogue of ResNet-50's int8 3136 x 256 x 64 GEMM took 163 ns a 32 x 32 block (AMX
    Xeon, 1 thread), more than twice its tile work."""
    M, N, dt, odt, op = spec.m, spec.n, spec.dtype, spec.acc_dtype, spec.op
    row = _Lanes(N, _fixed_lanes(isa, spec))
    full, tail, L, at, load, mask = row.full, row.tail, row.lanes, row.at, row.load, row.mask

    def f(x, s, o, r, a, z):
        return residual_quant_expr(op, x, s, o, r, a, z, odt)

    packs = _packs_rows(spec, isa)

    def chunk(X, S, Off, R, A, Z, i, c):
        cols = [_half_chunk(c, h) for h in (0, 1)]
        return _packed_row(tuple(
            scaled_expr(residual_sum_expr(op, X[i, j], S[j], Off[j], R[i, j]), A[j], Z[j])
            for j in cols), odt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, s: T.handle, o: T.handle, r: T.handle, a: T.handle, z: T.handle,
             y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        S = T.match_buffer(s, (N,), "float32", offset_factor=1)
        Off = T.match_buffer(o, (N,), "float32", offset_factor=1)
        R = T.match_buffer(r, (M, N), **_mat(odt))
        A = T.match_buffer(a, (N,), "float32", offset_factor=1)
        Z = T.match_buffer(z, (N,), "float32", offset_factor=1)
        Y = T.match_buffer(y, (M, N), **_mat(odt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], S[0:N], Off[0:N], R[0:M, 0:N], A[0:N], Z[0:N])
            T.writes(Y[0:M, 0:N])
            for i in T.serial(M):
                if packs:  # decided while parsing, as in quant_impl
                    for c in T.serial(N // 32):
                        Y[i, T.ramp(c * 32, 1, 32)] = chunk(X, S, Off, R, A, Z, i, c)
                else:
                    for v in T.serial(full):
                        Y[i, at(v)] = f(X[i, at(v)], S[at(v)], Off[at(v)], R[i, at(v)],
                                        A[at(v)], Z[at(v)])
                    if tail > 0:
                        T.evaluate(T.call_llvm_intrin(
                            "void", "llvm.masked.store",
                            f(load(X[i, full * L], dt), load(S[full * L], "float32"),
                              load(Off[full * L], "float32"), load(R[i, full * L], odt),
                              load(A[full * L], "float32"), load(Z[full * L], "float32")),
                            T.address_of(Y[i, full * L]), mask()))

    return impl


def convert_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """copy with fp32 <-> bf16 conversion, one LLVM IR step per vector."""
    M, N, dt, odt = spec.m, spec.n, spec.dtype, spec.acc_dtype
    L = _fixed_lanes(isa, spec)
    full, tail = N // L, N % L
    step = convert_step(dt, odt, L, L)
    step_tail = convert_step(dt, odt, L, tail) if tail else None
    ir_text = module_text(*(s for s in (step, step_tail) if s is not None))

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (M, N), **_mat(odt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:M, 0:N])
            with T.attr(0, "pragma_import_llvm", ir_text):
                for i in T.serial(M):
                    for v in T.serial(full):
                        T.evaluate(T.call_extern("void", step.name, T.address_of(X[i, v * L]),
                                                 T.address_of(Y[i, v * L])))
                    if tail > 0:
                        T.evaluate(T.call_extern("void", step_tail.name,
                                                 T.address_of(X[i, full * L]),
                                                 T.address_of(Y[i, full * L])))

    return impl


def is_llvm_conversion(spec: TPPSpec) -> bool:
    """Whether ``spec`` is a copy this module converts (fp32 <-> bf16)."""
    return spec.op == "copy" and (spec.dtype, spec.acc_dtype) in CONVERSIONS


def bf16_map_impl(spec: TPPSpec, isa: VectorISA, fn, binary: bool) -> tirx.PrimFunc:
    """Unary and (``binary``) binary TPPs on bf16 tiles: each vector is widened to fp32 on
    load (an LLVM conversion step into a one-vector fp32 scratch), computed with the fp32
    vector math ``fn(x)`` / ``fn(x, y)``, and rounded back to bf16 on store. Binary ops take
    their second operand (any broadcast) the same way; a column or scalar one is one bf16
    value, widened in TIR and splatted."""
    M, N, bc = spec.m, spec.n, spec.bcast
    L = _fixed_lanes(isa, spec)
    full, tail = N // L, N % L
    widths = [L] + ([tail] if tail else [])
    up = {w: convert_step("bfloat16", "float32", L, w) for w in widths}
    down = {w: convert_step("float32", "bfloat16", L, w) for w in widths}
    ir_text = module_text(*up.values(), *down.values())
    yshape = {"none": (M, N), "row": (N,), "col": (M,), "scalar": (1,)}[bc] if binary else (1,)
    y_strides = [T.int32(), 1] if bc == "none" else [1]

    def widen(w, src, tmp):
        return T.call_extern("void", up[w].name, T.address_of(src), T.address_of(tmp[0]))

    def narrow(w, tmp, dst):
        return T.call_extern("void", down[w].name, T.address_of(tmp[0]), T.address_of(dst))

    def y_value(Y, ty, i):
        if bc in ("col", "scalar"):
            return T.broadcast(T.Cast("float32", Y[i] if bc == "col" else Y[0]), L)
        return ty[T.ramp(0, 1, L)]

    def y_first(Y, i, col):
        return Y[i, col] if bc == "none" else Y[col]

    def value(tx, ty, Y, i):
        x = tx[T.ramp(0, 1, L)]
        return fn(x, y_value(Y, ty, i)) if binary else fn(x)

    @T.macro
    def body(X, Y, Z, tx, ty, i, col, w):
        T.evaluate(widen(w, X[i, col], tx))
        if binary and bc in ("none", "row"):
            T.evaluate(widen(w, y_first(Y, i, col), ty))
        tx[T.ramp(0, 1, L)] = value(tx, ty, Y, i)
        T.evaluate(narrow(w, tx, Z[i, col]))

    if binary:
        return _bf16_binary(M, N, L, full, tail, yshape, y_strides, ir_text, body)

    @T.prim_func(s_tir=True)
    def impl_unary(x: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), **_mat("bfloat16"))
        Z = T.match_buffer(z, (M, N), **_mat("bfloat16"))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Z[0:M, 0:N])
            tx = T.alloc_buffer((L,), "float32", scope="local")
            with T.attr(0, "pragma_import_llvm", ir_text):
                for i in T.serial(M):
                    for v in T.serial(full):
                        body(X, None, Z, tx, None, i, v * L, L)
                    if tail > 0:
                        body(X, None, Z, tx, None, i, full * L, tail)

    return impl_unary


def _bf16_binary(M, N, L, full, tail, yshape, y_strides, ir_text, body) -> tirx.PrimFunc:
    @T.prim_func(s_tir=True)
    def impl_binary(x: T.handle, y: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), **_mat("bfloat16"))
        Y = T.match_buffer(y, yshape, "bfloat16", offset_factor=1, strides=y_strides)
        Z = T.match_buffer(z, (M, N), **_mat("bfloat16"))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], whole(Y))
            T.writes(Z[0:M, 0:N])
            tx = T.alloc_buffer((L,), "float32", scope="local")
            ty = T.alloc_buffer((L,), "float32", scope="local")
            with T.attr(0, "pragma_import_llvm", ir_text):
                for i in T.serial(M):
                    for v in T.serial(full):
                        body(X, Y, Z, tx, ty, i, v * L, L)
                    if tail > 0:
                        body(X, Y, Z, tx, ty, i, full * L, tail)

    return impl_binary


def is_bf16_map(spec: TPPSpec) -> bool:
    """Whether a unary or binary ``spec`` computes bf16 -> bf16 (in fp32, by
    :func:`bf16_map_impl`); copies move bits instead."""
    return spec.dtype == "bfloat16" and spec.acc_dtype == "bfloat16" and spec.op != "copy"
