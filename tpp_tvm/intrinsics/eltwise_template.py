"""Element-wise, reduction and layout TPPs, written once for every vector ISA.

One template per kind of TPP (zero, unary, unary_bwd, binary, muladd, reduce, transpose,
VNNI packing, equation, pool; the kind's class in ``kinds/`` picks it, and each template
checks the dtypes it implements); the op only contributes its math, as a function of
vector expressions: the fast form from ``vector_math.FAST`` where the exact one would
become per-lane libm calls, else the description's own ``OPS[op].fn``. Rows are walked
one at a time; along a row, ``N // lanes``
full vectors use plain vector loads/stores and the remaining ``N % lanes`` columns one
masked load/store (an AVX-512 k-mask, an SVE predicate), so every M, N is exact and no
memory outside a tile is touched. Each implementation declares exactly the description's
buffers (shapes, strides, offset factor), which ``tensorize`` requires.

Reductions over rows keep one vector accumulator per column vector; over columns, one per
row, folded at the end by log2(lanes) halving steps. Transpose moves lanes x lanes blocks
through registers (log2(lanes) block-swap shuffle steps, masks at the edges); VNNI packing
and thin or non-32-bit transposes are plain loops that LLVM vectorises (vpermt2ps,
vpunpck*).

On a scalable ISA (SVE) every row loop runs ``N // lanes`` full vectors, a run-time count,
then one predicated tail; horizontal folds, transposes and VNNI packing use the ISA's own
across-lane reductions, gathers and interleaving stores (``VectorISA`` hooks), since a
scalable vector has no compile-time lanes to shuffle.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..errors import UnsupportedDTypeError
from .geometry import (
    bcast_shape,
    equation_operand_dtypes,
    equation_operand_shapes,
    free_strides,
    pool_geometry,
    transform_out_shape,
    whole,
)
from .spec import (
    MAX_EQUATION_STEPS,
    OPERAND_STEPS,
    POOL_DTYPES,
    TPPSpec,
    dtype_of,
    equation_operands,
    reduce_combine,
    reduce_identity,
)
from .vector_isa import VectorISA
from .vector_math import LONG_CHAINS, concat_lanes, slice_lanes, statement_slots, vector_fn

#: Dtypes of the templates that compute (the vector math is fp32 only for now).
_COMPUTE_DTYPES = ("float32",)
#: Dtypes the vectorized data-movement TPPs (zero, copy) move. Not bfloat16: TVM's bf16
#: legalization widens bf16 vectors to fp32 but not the operands of masked loads/stores.
_MOVE_DTYPES = ("float32", "float16", "int32", "int8", "uint8")
#: Dtypes the layout TPPs (transpose, VNNI packing) move: element copies, bf16 included.
_TRANSFORM_DTYPES = (*_MOVE_DTYPES, "bfloat16")
#: Bytes of a cache line (what one prefetch fetches).
CACHE_LINE = 64
#: Full vectors an equation (a GEMM epilogue) computes at once on a fixed-width ISA.
EQUATION_GROUP = 4
#: Values one step of an equation binds to statements (``vector_math.statement_slots``).
BOUND_SLOTS = 8
#: Equation operands that are whole tiles (M, N), not rows.
TILE_OPERANDS = tuple(s for s, op in OPERAND_STEPS.items() if not op.row)
#: Tiles of at most this many rows prefetch the residual rows below them (see equation_impl).
RESIDUAL_PREFETCH_ROWS = 64
#: (dtype, out_dtype) conversions a copy TPP performs.
_CONVERSIONS = {
    ("float32", "float16"),
    ("float16", "float32"),
    ("float32", "int32"),
    ("int32", "float32"),
}


def _check_supported(spec: TPPSpec, isa: VectorISA, allowed: tuple[str, ...]) -> None:
    """Raise ``UnsupportedDTypeError`` unless ``spec``'s dtype is one of ``allowed`` (what
    the calling template implements) and its output dtype is a conversion copy makes."""
    if spec.dtype not in allowed:
        raise UnsupportedDTypeError(
            f"TPP {spec.op} on {isa.name}: dtype {spec.dtype} is not supported; "
            f"supported: {', '.join(allowed)}"
        )
    out = spec.acc_dtype
    if out != spec.dtype and (spec.op != "copy" or (spec.dtype, out) not in _CONVERSIONS):
        supported = ", ".join(f"{a}->{b}" for a, b in sorted(_CONVERSIONS))
        raise UnsupportedDTypeError(
            f"TPP {spec.op} on {isa.name}: conversion {spec.dtype}->{out} is not supported; "
            f"copy converts {supported}"
        )


@dataclass(frozen=True)
class _Row:
    """How one row of ``n`` elements of ``dtype`` splits into vectors on ``isa``.

    ``full`` vectors of ``lanes`` elements, then a masked tail when ``tail`` (always for a
    scalable ISA, where the mask decides at run time how many lanes are left).
    """

    isa: VectorISA
    dtype: str
    n: int

    @property
    def lanes(self) -> int | tirx.Expr:
        return self.isa.lanes(self.dtype)

    @property
    def full(self) -> int | tirx.Expr:
        return self.n // self.lanes

    @property
    def tail(self) -> bool:
        return self.isa.scalable or self.n % self.lanes != 0

    @property
    def tail_start(self) -> int | tirx.Expr:
        return self.full * self.lanes

    def at(self, v: tirx.Expr) -> tirx.Expr:
        """Column ramp of full vector ``v``."""
        return self.isa.ramp(v * self.lanes, self.dtype)

    def mask(self) -> tirx.Expr:
        return self.isa.tail_mask(self.tail_start, self.n, self.dtype)

    def load_tail(self, first: tirx.Expr, dtype: str | None = None) -> tirx.Expr:
        """Masked load of the tail; ``first`` is the element at its first column. ``dtype``:
        the elements' type where it is not the row's (u8 lanes of an fp32 row)."""
        return self.isa.masked_load(first, self.mask(), dtype or self.dtype,
                                    lanes_of=self.dtype)

    def store_tail(self, value: tirx.Expr, first: tirx.Expr) -> tirx.Expr:
        return self.isa.masked_store(value, first, self.mask())

    def splat(self, value: tirx.Expr) -> tirx.Expr:
        return self.isa.broadcast(value, self.dtype)


def _convert(value: tirx.Expr, dtype: str) -> tirx.Expr:
    """``value`` converted to ``dtype`` lane by lane (a copy TPP's ``out_dtype``)."""
    elem, _, lanes = dtype_of(value).partition("x")
    if elem == dtype:
        return value
    return tirx.Cast(f"{dtype}x{lanes}" if lanes else dtype, value)


def _mat(dtype: str) -> dict:
    """match_buffer keywords of a row-major 2D operand with a free leading dimension."""
    return {"dtype": dtype, "offset_factor": 1, "strides": [T.int32(), 1]}


def zero_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """``zero``: full vector stores along each row, one masked store for the tail."""
    _check_supported(spec, isa, _MOVE_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = _Row(isa, dt, N)
    zero = row.splat(tirx.const(0, dt))

    @T.prim_func(s_tir=True)
    def impl(y: T.handle):
        Y = T.match_buffer(y, (M, N), **_mat(dt))
        with T.sblock("root"):
            T.reads()
            T.writes(Y[0:M, 0:N])
            for i in T.serial(M):
                for v in T.serial(row.full):
                    Y[i, row.at(v)] = zero
                if row.tail:
                    T.evaluate(row.store_tail(zero, Y[i, row.tail_start]))

    return impl


def unary_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Unary TPPs (copy also converting, see ``_CONVERSIONS``): the vector math per vector."""
    _check_supported(spec, isa, _MOVE_DTYPES if spec.op == "copy" else _COMPUTE_DTYPES)
    M, N, dt, odt = spec.m, spec.n, spec.dtype, spec.acc_dtype
    row = _Row(isa, dt, N)
    fn = vector_fn(spec.op)

    def f(x):
        return _convert(fn(x), odt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (M, N), **_mat(odt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:M, 0:N])
            for i in T.serial(M):
                for v in T.serial(row.full):
                    Y[i, row.at(v)] = f(X[i, row.at(v)])
                if row.tail:
                    T.evaluate(row.store_tail(f(row.load_tail(X[i, row.tail_start])),
                                              Y[i, row.tail_start]))

    return impl


def unary_bwd_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Backward unary TPPs: dX = f(dY, S) per vector."""
    _check_supported(spec, isa, _COMPUTE_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = _Row(isa, dt, N)
    fn = vector_fn(spec.op)

    @T.prim_func(s_tir=True)
    def impl(dy: T.handle, s: T.handle, dx: T.handle):
        DY = T.match_buffer(dy, (M, N), **_mat(dt))
        S = T.match_buffer(s, (M, N), **_mat(dt))
        DX = T.match_buffer(dx, (M, N), **_mat(dt))
        with T.sblock("root"):
            T.reads(DY[0:M, 0:N], S[0:M, 0:N])
            T.writes(DX[0:M, 0:N])
            for i in T.serial(M):
                for v in T.serial(row.full):
                    DX[i, row.at(v)] = fn(DY[i, row.at(v)], S[i, row.at(v)])
                if row.tail:
                    T.evaluate(row.store_tail(fn(row.load_tail(DY[i, row.tail_start]),
                                                 row.load_tail(S[i, row.tail_start])),
                                              DX[i, row.tail_start]))

    return impl


def _bcast_operand(spec: TPPSpec, row: _Row):
    """Loaders of the broadcast operand Y: (full vector v of row i, tail of row i)."""
    bc = spec.bcast

    def vec(Y, i, v):
        if bc == "none":
            return Y[i, row.at(v)]
        if bc == "row":
            return Y[row.at(v)]
        return row.splat(Y[i] if bc == "col" else Y[0])

    def tail(Y, i):
        if bc == "none":
            return row.load_tail(Y[i, row.tail_start])
        if bc == "row":
            return row.load_tail(Y[row.tail_start])
        return row.splat(Y[i] if bc == "col" else Y[0])

    strides = [T.int32(), 1] if bc == "none" else [1]
    return vec, tail, strides


def binary_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Binary TPPs Z = f(X, Y), Y broadcast by ``bcast``."""
    return _binary(spec, isa, accumulate=False)


def muladd_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """muladd Z = X * Y + Z, Y broadcast by ``bcast``."""
    return _binary(spec, isa, accumulate=True)


def _binary(spec: TPPSpec, isa: VectorISA, accumulate: bool) -> tirx.PrimFunc:
    """Binary ops Z = f(X, Y), or with ``accumulate`` muladd (which also reads Z)."""
    _check_supported(spec, isa, _COMPUTE_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = _Row(isa, dt, N)
    fn = vector_fn(spec.op)
    yshape = bcast_shape(spec)
    y_vec, y_tail, y_strides = _bcast_operand(spec, row)

    def f(x, y, z):
        return fn(x, y, z) if accumulate else fn(x, y)

    def reads(X, Y, Z):
        return [whole(X), whole(Y), whole(Z)] if accumulate else [whole(X), whole(Y)]

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
        Z = T.match_buffer(z, (M, N), **_mat(dt))
        with T.sblock("root"):
            T.reads(*reads(X, Y, Z))
            T.writes(Z[0:M, 0:N])
            for i in T.serial(M):
                for v in T.serial(row.full):
                    Z[i, row.at(v)] = f(X[i, row.at(v)], y_vec(Y, i, v), Z[i, row.at(v)])
                if row.tail:
                    T.evaluate(row.store_tail(f(row.load_tail(X[i, row.tail_start]),
                                                y_tail(Y, i),
                                                row.load_tail(Z[i, row.tail_start])),
                                              Z[i, row.tail_start]))

    return impl


def _horizontal(op: str, vec: tirx.Expr, row: _Row) -> tirx.Expr:
    """Fold the lanes of ``vec`` into one scalar with the reduction of ``op``."""
    kind = "max" if "_max_" in op else "add"
    if kind in row.isa.horizontal:  # the ISA's own tree reduction (SVE faddv/fmaxv)
        return row.isa.reduce_lanes(kind, vec, row.dtype)
    lanes = row.lanes
    if not isinstance(lanes, int):
        name = "llvm.vector.reduce.fmax" if kind == "max" else "llvm.vector.reduce.fadd"
        args = [vec] if kind == "max" else [tirx.const(-0.0, row.dtype), vec]
        return T.call_llvm_pure_intrin(row.dtype, name, *args)
    # Pairwise halving: log2(lanes) vector ops, and a more accurate sum than a serial one.
    while lanes > 1:
        half = lanes // 2
        lo = tirx.Shuffle([vec], [tirx.const(k, "int32") for k in range(half)])
        hi = tirx.Shuffle([vec], [tirx.const(k, "int32") for k in range(half, lanes)])
        vec, lanes = reduce_combine(op, lo, hi), half
    return vec


def reduce_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Reductions: vector accumulators in registers, over rows or along each row."""
    _check_supported(spec, isa, _COMPUTE_DTYPES)
    M, N, dt, op = spec.m, spec.n, spec.dtype, spec.op
    fn = vector_fn(op)
    over_rows = op.endswith("_rows")
    L = N if over_rows else M
    row = _Row(isa, dt, N)
    vt = isa.vtype(dt)
    ident = row.splat(reduce_identity(op, dt))

    def fold(acc, x):
        return reduce_combine(op, acc, fn(x))

    def fold_tail(acc, x):
        # Masked-off lanes must not reach the horizontal reduction: give them the identity.
        return reduce_combine(op, acc, tirx.Select(row.mask(), fn(x), ident))

    if over_rows:
        # Y[j] over M rows: vectors along N, each accumulated down the rows in a register.
        @T.prim_func(s_tir=True)
        def impl(x: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), **_mat(dt))
            Y = T.match_buffer(y, (L,), dt, offset_factor=1)
            with T.sblock("root"):
                T.reads(X[0:M, 0:N])
                T.writes(Y[0:L])
                acc = T.alloc_buffer((1,), vt, scope="local")
                for v in T.serial(row.full):
                    acc[0] = ident
                    for i in T.serial(M):
                        acc[0] = fold(acc[0], X[i, row.at(v)])
                    Y[row.at(v)] = acc[0]
                if row.tail:
                    acc[0] = ident
                    for i in T.serial(M):
                        acc[0] = fold(acc[0], row.load_tail(X[i, row.tail_start]))
                    T.evaluate(row.store_tail(acc[0], Y[row.tail_start]))

        return impl

    # Y[i] over N columns: a vector accumulator along the row, then one horizontal fold.
    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (L,), dt, offset_factor=1)
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:L])
            acc = T.alloc_buffer((1,), vt, scope="local")
            for i in T.serial(M):
                acc[0] = ident
                for v in T.serial(row.full):
                    acc[0] = fold(acc[0], X[i, row.at(v)])
                if row.tail:
                    acc[0] = fold_tail(acc[0], row.load_tail(X[i, row.tail_start]))
                Y[i] = _horizontal(op, acc[0], row)

    return impl


def _swap_lanes(b: int, lanes: int, upper: bool) -> list[tirx.Expr]:
    """Shuffle indices (over two concatenated vectors) of one block-swap transpose step.

    Rows r and r+b of an ``lanes`` x ``lanes`` block exchange their off-diagonal b-wide lane
    groups: row r keeps its lanes without bit b and takes row r+b's lanes without bit b
    in place of its own with it; ``upper`` gives row r+b.
    """
    if upper:
        idx = [c + b if not c & b else lanes + c for c in range(lanes)]
    else:
        idx = [c if not c & b else lanes + c - b for c in range(lanes)]
    return [tirx.const(i, "int32") for i in idx]


def transpose_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Transpose: register blocks, gathers or a plain loop, whichever this ISA, dtype and
    tile do best."""
    _check_supported(spec, isa, _TRANSFORM_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    L = isa.lanes(dt)
    if isa.gather and dt in ("float32", "int32"):
        return _transpose_gather(spec, isa)
    if isa.scalable or dt not in ("float32", "int32") or L not in (2, 4, 8, 16):
        return _transpose_loop(spec)
    if M <= L // 2 or N < L // 2:
        # A thin tile pays a whole block's shuffles for few elements; LLVM's vectorised
        # loop is faster there (measured on Zen 5: 8x37 25 vs 62 ns, 64x5 35 vs 80 ns;
        # 16x64: 267 vs 78 ns).
        return _transpose_loop(spec)
    return _transpose_registers(spec, isa)


def _transpose_block(isa: VectorISA, dt: str):
    """The macro transposing one block of X at (i0, j0), rows x cols of at most L x L:
    into registers (missing rows as zeros), log2(L) block-swap steps, out as cols rows of
    Y; masked loads and stores at the edges."""
    L = isa.lanes(dt)
    zero = isa.broadcast(tirx.const(0, dt), dt)
    final_in_a = (L.bit_length() - 1) % 2 == 0  # stages alternate between buffers A and B

    def mask(count):
        return isa.tail_mask(0, count, dt)

    def load_row(X, i, j0, cols):
        if cols == L:
            return X[i, isa.ramp(j0, dt)]
        return isa.masked_load(X[i, j0], mask(cols), dt)

    @T.macro
    def stage(src, dst, b):
        # Pair p is rows (r, r + b) with bit b of r clear.
        for p in T.unroll(L // 2):
            dst[p // b * 2 * b + p % b] = T.Shuffle(
                [src[p // b * 2 * b + p % b], src[p // b * 2 * b + p % b + b]],
                _swap_lanes(b, L, False))
            dst[p // b * 2 * b + p % b + b] = T.Shuffle(
                [src[p // b * 2 * b + p % b], src[p // b * 2 * b + p % b + b]],
                _swap_lanes(b, L, True))

    @T.macro
    def store_rows(Y, regs, i0, j0, rows, cols):
        for c in T.unroll(cols):
            if rows == L:
                Y[j0 + c, isa.ramp(i0, dt)] = regs[c]
            else:
                T.evaluate(isa.masked_store(regs[c], Y[j0 + c, i0], mask(rows)))

    @T.macro
    def block(X, Y, A, B, i0, j0, rows, cols):
        for r in T.unroll(rows):
            A[r] = load_row(X, i0 + r, j0, cols)
        for r in T.unroll(rows, L):
            A[r] = zero
        stage(A, B, L // 2)
        if L >= 4:
            stage(B, A, L // 4)
        if L >= 8:
            stage(A, B, L // 8)
        if L >= 16:
            stage(B, A, L // 16)
        if final_in_a:
            store_rows(Y, A, i0, j0, rows, cols)
        else:
            store_rows(Y, B, i0, j0, rows, cols)

    return block


def _transpose_registers(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Transpose in L x L register blocks; partial blocks at the bottom/right edges use
    masks."""
    M, N, dt = spec.m, spec.n, spec.dtype
    L = isa.lanes(dt)
    vt = isa.vtype(dt)
    MB, MT, NB, NT = M // L, M % L, N // L, N % L
    block = _transpose_block(isa, dt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (N, M), **_mat(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:N, 0:M])
            A = T.alloc_buffer((L,), vt, scope="local")
            B = T.alloc_buffer((L,), vt, scope="local")
            for bi in T.serial(MB):
                for bj in T.serial(NB):
                    block(X, Y, A, B, bi * L, bj * L, L, L)
                if NT > 0:
                    block(X, Y, A, B, bi * L, NB * L, L, NT)
            if MT > 0:
                for bj in T.serial(NB):
                    block(X, Y, A, B, MB * L, bj * L, MT, L)
                if NT > 0:
                    block(X, Y, A, B, MB * L, NB * L, MT, NT)

    return impl


def _transpose_gather(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Transpose by gathers: each vector of a row of Y is read down a column of X.

    For ISAs whose lane count is unknown at compile time (SVE), where the register-blocked
    shuffle transpose cannot be written; stores stay contiguous and tails predicated.
    """
    M, N, dt = spec.m, spec.n, spec.dtype
    row = _Row(isa, dt, M)  # a row of Y runs down the M rows of X

    def column(X, j, start, mask):
        ld = X.strides[0]
        index = T.ramp(start * ld, ld, row.lanes)
        return isa.gather_load(X[0, j], index, mask, dt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (N, M), **_mat(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:N, 0:M])
            for j in T.serial(N):
                for v in T.serial(row.full):
                    Y[j, row.at(v)] = column(X, j, v * row.lanes, isa.all_lanes(dt))
                if row.tail:
                    T.evaluate(row.store_tail(column(X, j, row.tail_start, row.mask()),
                                              Y[j, row.tail_start]))

    return impl


def _transpose_loop(spec: TPPSpec) -> tirx.PrimFunc:
    """Element-by-element transpose, for dtypes/ISAs without the register-blocked one."""
    M, N, dt = spec.m, spec.n, spec.dtype

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (N, M), **_mat(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:N, 0:M])
            for j in T.serial(N):
                for i in T.serial(M):
                    Y[j, i] = X[i, j]

    return impl


def vnni_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """VNNI packing: interleaving stores where the ISA has them, else a plain loop."""
    _check_supported(spec, isa, _TRANSFORM_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    KO, _, V = transform_out_shape(spec)
    if V in isa.interleaved_store and dt in _MOVE_DTYPES:
        return _vnni_interleaved(spec, isa)
    full, rem = M // V, M % V
    zero = tirx.const(0, dt)

    # VNNI: V consecutive rows interleave into one row of Y; the missing rows of the last
    # block are zeros.
    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (KO, N, V), dt, offset_factor=1, strides=[T.int32(), V, 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:KO, 0:N, 0:V])
            for ko in T.serial(full):
                for j in T.serial(N):
                    for v in T.unroll(V):
                        Y[ko, j, v] = X[ko * V + v, j]
            if rem > 0:
                for j in T.serial(N):
                    for v in T.unroll(rem):
                        Y[full, j, v] = X[full * V + v, j]
                    for v in T.unroll(rem, V):
                        Y[full, j, v] = zero

    return impl


def _vnni_interleaved(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """VNNI packing as interleaving stores: V rows of X in registers, one structured store
    (SVE ``st2w``/``st4w``) writes them element-interleaved; missing rows are zeros."""
    M, N, dt = spec.m, spec.n, spec.dtype
    KO, _, V = transform_out_shape(spec)
    full, rem = M // V, M % V
    row = _Row(isa, dt, N)
    zero = row.splat(tirx.const(0, dt))

    def rows(X, ko, rows_present, v, tail):
        if tail:
            return [row.load_tail(X[ko * V + r, row.tail_start]) if r < rows_present else zero
                    for r in range(V)]
        return [X[ko * V + r, row.at(v)] if r < rows_present else zero for r in range(V)]

    @T.macro
    def block(X, Y, ko, rows_present):
        for v in T.serial(row.full):
            T.evaluate(isa.store_interleaved(rows(X, ko, rows_present, v, False),
                                             Y[ko, v * row.lanes, 0], isa.all_lanes(dt)))
        if row.tail:
            T.evaluate(isa.store_interleaved(rows(X, ko, rows_present, 0, True),
                                             Y[ko, row.tail_start, 0], row.mask()))

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, (KO, N, V), dt, offset_factor=1, strides=[T.int32(), V, 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:KO, 0:N, 0:V])
            for ko in T.serial(full):
                block(X, Y, ko, V)
            if rem > 0:
                block(X, Y, full, rem)

    return impl


class _EquationTile:
    """What an equation's implementation computes with: the row split, the step slots,
    each operand step's operand (index, dtype), and how full vectors are grouped.

    On a fixed-width ISA the running value holds :data:`EQUATION_GROUP` full vectors of the
    tile as one wide vector (any rows) where a step is a long chain (``LONG_CHAINS``): an
    erf-GELU is ~55 dependent instructions a vector, and interleaving four chains took a
    GEMM's GELU epilogue from 2.6 to 1.8 cycles an element (gelu_tanh 1.6 -> 1.2, Zen 5).
    Bias, residual and clips gain nothing from groups and pay the group's index arithmetic
    (MobileNetV2 1.2% slower), so they run a vector at a time."""

    def __init__(self, spec: TPPSpec, isa: VectorISA) -> None:
        M, N, dt, steps = spec.m, spec.n, spec.dtype, spec.steps
        self.spec, self.steps = spec, steps
        self.row = row = _Row(isa, dt, N)
        self.vt = isa.vtype(dt)
        self.wide = self.vt if isa.scalable else f"{dt}x{row.lanes * EQUATION_GROUP}"
        self.kinds = equation_operands(steps)
        self.shapes = equation_operand_shapes(spec)
        self.pdt = equation_operand_dtypes(spec)
        self.slots = list(steps) + [None] * (MAX_EQUATION_STEPS - len(steps))
        self.operand_of = {}  # slot -> index into the operand list
        for slot, step in enumerate(steps):
            if step in OPERAND_STEPS:
                self.operand_of[slot] = len(self.operand_of)
        # (rows narrower than one vector have only their masked tails: nothing to group)
        self.group = 1 if isa.scalable or not LONG_CHAINS.intersection(steps) \
            or row.full == 0 else EQUATION_GROUP
        self.total = M * row.full
        self.groups = 0 if self.group == 1 else self.total // self.group
        # The next tile's residual (or gate) rows (the tile below: the next one when B
        # panels are outer) are prefetched into L1 while this one's epilogue and the next
        # microkernel run.
        residuals = [self.operand_of[slot] for slot, st in enumerate(steps)
                     if st in TILE_OPERANDS]
        self.prefetched = residuals if M <= RESIDUAL_PREFETCH_ROWS else []

    def gathered(self, load_at, pos):
        vecs = [load_at(i, v) for i, v in pos]
        return vecs[0] if len(vecs) == 1 else concat_lanes(vecs)

    def operand(self, ops, slot, pos, tail):
        """Operand step ``slot``'s operand at the vectors ``pos`` (or the row's tail)."""
        row = self.row
        P = ops[self.operand_of[slot]]
        bias = OPERAND_STEPS[self.steps[slot]].row
        if tail:  # a quantized tile's tail: as many u8/s8 lanes as the fp32 vector has
            ((i, _),) = pos
            return row.load_tail(P[row.tail_start] if bias else P[i, row.tail_start],
                                 self.pdt[self.operand_of[slot]])
        if bias:
            return self.gathered(lambda i, v: P[row.at(v)], pos)
        return self.gathered(lambda i, v: P[i, row.at(v)], pos)

    def apply(self, slot, value, ops, pos, tail, bound):
        """Step slot ``slot`` on ``value`` (unused slots leave it)."""
        step = self.slots[slot]
        if step is None:
            return value
        if step in OPERAND_STEPS:
            x = self.operand(ops, slot, pos, tail)
            return value * x if OPERAND_STEPS[step].multiplies else value + x
        with statement_slots(bound):
            return vector_fn(step)(value)

    def flat(self, f):
        """Full vector ``f`` of the tile, row-major: (row, vector in the row)."""
        return (f // self.row.full, f % self.row.full)

    def group_at(self, g):
        return [self.flat(g * self.group + u) for u in range(self.group)]

    def part(self, t, u):
        return slice_lanes(t[0], u * self.row.lanes, self.row.lanes)

    def per_line(self, k):
        """Elements of prefetched operand ``k`` in a cache line."""
        return CACHE_LINE * 8 // tvm.DataType(self.pdt[self.prefetched[k]]).bits

    def prefetch_below(self, ops, k, i, ln):
        P = ops[self.prefetched[k]]
        return T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                  T.address_of(P[i + self.spec.m, ln * self.per_line(k)]),
                                  T.int32(0), T.int32(3), T.int32(1))  # read, L1, data


def _equation_rows(eq: _EquationTile):
    """The macro computing the whole tile: prefetches of the next tile's operands, the
    grouped (or single) full vectors, then each row's masked tail."""
    M, N = eq.spec.m, eq.spec.n
    row, group, groups, total, prefetched = eq.row, eq.group, eq.groups, eq.total, eq.prefetched
    apply, gathered, flat, group_at, part = eq.apply, eq.gathered, eq.flat, eq.group_at, eq.part
    per_line, prefetch_below = eq.per_line, eq.prefetch_below

    # One statement per step slot (MAX_EQUATION_STEPS of them; unused slots are no-ops).
    @T.macro
    def steps_at(t, ops, pos, tail, bound):
        t[0] = apply(0, t[0], ops, pos, tail, bound)
        t[0] = apply(1, t[0], ops, pos, tail, bound)
        t[0] = apply(2, t[0], ops, pos, tail, bound)
        t[0] = apply(3, t[0], ops, pos, tail, bound)

    assert EQUATION_GROUP == 4, "store_group writes four vectors"

    @T.macro
    def store_group(Y, t, pos):
        Y[pos[0][0], row.at(pos[0][1])] = part(t, 0)
        Y[pos[1][0], row.at(pos[1][1])] = part(t, 1)
        Y[pos[2][0], row.at(pos[2][1])] = part(t, 2)
        Y[pos[3][0], row.at(pos[3][1])] = part(t, 3)

    @T.macro
    def prefetch(ops, k):
        for i in T.serial(M):
            for ln in T.serial(-(-N // per_line(k))):
                T.evaluate(prefetch_below(ops, k, i, ln))

    @T.macro
    def rows(X, Y, ops, t, tg, bound):
        if len(prefetched) > 0:  # an equation has at most two operands
            prefetch(ops, 0)
        if len(prefetched) > 1:
            prefetch(ops, 1)
        if group > 1:
            for g in T.serial(groups):
                tg[0] = gathered(lambda i, v: X[i, row.at(v)], group_at(g))
                steps_at(tg, ops, group_at(g), False, bound)
                store_group(Y, tg, group_at(g))
            for f in T.serial(groups * group, total):
                t[0] = X[f // row.full, row.at(f % row.full)]
                steps_at(t, ops, [flat(f)], False, bound)
                Y[f // row.full, row.at(f % row.full)] = t[0]
        else:
            for i in T.serial(M):
                for v in T.serial(row.full):
                    t[0] = X[i, row.at(v)]
                    steps_at(t, ops, [(i, v)], False, bound)
                    Y[i, row.at(v)] = t[0]
        if row.tail:
            for i in T.serial(M):
                t[0] = row.load_tail(X[i, row.tail_start])
                steps_at(t, ops, [(i, 0)], True, bound)
                T.evaluate(row.store_tail(t[0], Y[i, row.tail_start]))

    return rows


def equation_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Equation: each vector of X goes through every step in registers, then one store.

    The running value lives in a local buffer so each step's math (which may repeat its
    argument, e.g. gelu) reads a register, not a re-expanded expression; on a fixed-width
    ISA it holds a group of full vectors where the steps are long chains
    (:class:`_EquationTile`). Values a step would copy per zmm are bound to ``bound``
    (``statement_slots``). One PrimFunc per operand count (0, 1 or 2)."""
    _check_supported(spec, isa, _COMPUTE_DTYPES)
    eq = _EquationTile(spec, isa)
    rows = _equation_rows(eq)
    M, N, dt = spec.m, spec.n, spec.dtype
    vt, wide, shapes, pdt = eq.vt, eq.wide, eq.shapes, eq.pdt

    def strides(shape):
        return [1] if len(shape) == 1 else [T.int32(), 1]

    if not eq.kinds:

        @T.prim_func(s_tir=True)
        def impl(x: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), **_mat(dt))
            Y = T.match_buffer(y, (M, N), **_mat(dt))
            with T.sblock("root"):
                T.reads(X[0:M, 0:N])
                T.writes(Y[0:M, 0:N])
                t = T.alloc_buffer((1,), vt, scope="local")
                tg = T.alloc_buffer((1,), wide, scope="local")
                bound = T.alloc_buffer((BOUND_SLOTS,), wide, scope="local")
                rows(X, Y, [], t, tg, bound)

        return impl
    if len(eq.kinds) == 1:

        @T.prim_func(s_tir=True)
        def impl(x: T.handle, p: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), **_mat(dt))
            P = T.match_buffer(p, shapes[0], pdt[0], offset_factor=1,
                               strides=strides(shapes[0]))
            Y = T.match_buffer(y, (M, N), **_mat(dt))
            with T.sblock("root"):
                T.reads(whole(X), whole(P))
                T.writes(Y[0:M, 0:N])
                t = T.alloc_buffer((1,), vt, scope="local")
                tg = T.alloc_buffer((1,), wide, scope="local")
                bound = T.alloc_buffer((BOUND_SLOTS,), wide, scope="local")
                rows(X, Y, [P], t, tg, bound)

        return impl

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, p: T.handle, q: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        P = T.match_buffer(p, shapes[0], pdt[0], offset_factor=1, strides=strides(shapes[0]))
        Q = T.match_buffer(q, shapes[1], pdt[1], offset_factor=1, strides=strides(shapes[1]))
        Y = T.match_buffer(y, (M, N), **_mat(dt))
        with T.sblock("root"):
            T.reads(whole(X), whole(P), whole(Q))
            T.writes(Y[0:M, 0:N])
            t = T.alloc_buffer((1,), vt, scope="local")
            tg = T.alloc_buffer((1,), wide, scope="local")
            bound = T.alloc_buffer((BOUND_SLOTS,), wide, scope="local")
            rows(X, Y, [P, Q], t, tg, bound)

    return impl


def pool_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Max pooling: per output pixel and vector of channels, max over the window's taps."""
    _check_supported(spec, isa, POOL_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = _Row(isa, dt, N)
    geo = pool_geometry(spec)
    vt = isa.vtype(dt)
    lowest = row.splat(tirx.min_value(dt))

    def tap(A, ivs, i, v):
        lv = (ivs,) if isinstance(ivs, tirx.Var) else tuple(ivs)
        return A[geo.a_index(lv, i, row.at(v))]

    def tap_tail(A, ivs, i):
        lv = (ivs,) if isinstance(ivs, tirx.Var) else tuple(ivs)
        return row.load_tail(A[geo.a_index(lv, i, row.tail_start)])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, y: T.handle):
        A = T.match_buffer(a, geo.a_shape, dt, offset_factor=1,
                           strides=free_strides(len(geo.a_shape)))
        Y = T.match_buffer(y, (M, N), **_mat(dt))
        with T.sblock("root"):
            T.reads(whole(A))
            T.writes(Y[0:M, 0:N])
            acc = T.alloc_buffer((1,), vt, scope="local")
            for i in T.serial(M):
                for v in T.serial(row.full):
                    acc[0] = lowest
                    for ivs in T.grid(*geo.batch):
                        acc[0] = tirx.max(acc[0], tap(A, ivs, i, v))
                    Y[i, row.at(v)] = acc[0]
                if row.tail:
                    acc[0] = lowest
                    for ivs in T.grid(*geo.batch):
                        acc[0] = tirx.max(acc[0], tap_tail(A, ivs, i))
                    T.evaluate(row.store_tail(acc[0], Y[i, row.tail_start]))

    return impl

