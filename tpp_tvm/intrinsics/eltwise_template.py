"""Element-wise, reduction and pooling TPPs, written once for every vector ISA.

One template per kind of TPP (zero, unary, unary_bwd, binary, muladd, reduce, pool; the
kind's class in ``kinds/`` picks it, and each template checks the dtypes it implements;
the layout TPPs are in ``transpose_template.py``, the equation in
``equation_template.py``); the op only contributes its math, as a function of vector
expressions: the fast form from ``vector_math.FAST`` where the exact one would become
per-lane libm calls, else the description's own ``OPS[op].fn``. Rows are walked one at a
time; along a row, ``N // lanes`` full vectors use plain vector loads/stores and the
remaining ``N % lanes`` columns one masked load/store (an AVX-512 k-mask, an SVE
predicate), so every M, N is exact and no memory outside a tile is touched. Each
implementation declares exactly the description's buffers (shapes, strides, offset
factor), which ``tensorize`` requires.

Reductions over rows keep one vector accumulator per column vector; over columns, one per
row, folded at the end by log2(lanes) halving steps. On a scalable ISA (SVE) every row
loop runs ``N // lanes`` full vectors, a run-time count, then one predicated tail, and
horizontal folds use the ISA's own across-lane reductions (``VectorISA`` hooks).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .geometry import bcast_shape, free_strides, pool_geometry, whole
from .spec import POOL_DTYPES, TPPSpec, dtype_of, reduce_combine, reduce_identity
from .vector_isa import VectorISA
from .vector_math import vector_fn
from .vector_rows import COMPUTE_DTYPES, MOVE_DTYPES, VectorRow, check_supported, matrix_buffer


def _convert(value: tirx.Expr, dtype: str) -> tirx.Expr:
    """``value`` converted to ``dtype`` lane by lane (a copy TPP's ``out_dtype``)."""
    elem, _, lanes = dtype_of(value).partition("x")
    if elem == dtype:
        return value
    return tirx.Cast(f"{dtype}x{lanes}" if lanes else dtype, value)


def zero_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """``zero``: full vector stores along each row, one masked store for the tail."""
    check_supported(spec, isa, MOVE_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = VectorRow(isa, dt, N)
    zero = row.splat(tirx.const(0, dt))

    @T.prim_func(s_tir=True)
    def impl(y: T.handle):
        Y = T.match_buffer(y, (M, N), **matrix_buffer(dt))
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
    check_supported(spec, isa, MOVE_DTYPES if spec.op == "copy" else COMPUTE_DTYPES)
    M, N, dt, odt = spec.m, spec.n, spec.dtype, spec.acc_dtype
    row = VectorRow(isa, dt, N)
    fn = vector_fn(spec.op)

    def f(x):
        return _convert(fn(x), odt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        Y = T.match_buffer(y, (M, N), **matrix_buffer(odt))
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
    check_supported(spec, isa, COMPUTE_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = VectorRow(isa, dt, N)
    fn = vector_fn(spec.op)

    @T.prim_func(s_tir=True)
    def impl(dy: T.handle, s: T.handle, dx: T.handle):
        DY = T.match_buffer(dy, (M, N), **matrix_buffer(dt))
        S = T.match_buffer(s, (M, N), **matrix_buffer(dt))
        DX = T.match_buffer(dx, (M, N), **matrix_buffer(dt))
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


def _bcast_operand(spec: TPPSpec, row: VectorRow):
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
    check_supported(spec, isa, COMPUTE_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = VectorRow(isa, dt, N)
    fn = vector_fn(spec.op)
    yshape = bcast_shape(spec)
    y_vec, y_tail, y_strides = _bcast_operand(spec, row)

    def f(x, y, z):
        return fn(x, y, z) if accumulate else fn(x, y)

    def reads(X, Y, Z):
        return [whole(X), whole(Y), whole(Z)] if accumulate else [whole(X), whole(Y)]

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
        Z = T.match_buffer(z, (M, N), **matrix_buffer(dt))
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


def _horizontal(op: str, vec: tirx.Expr, row: VectorRow) -> tirx.Expr:
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
    check_supported(spec, isa, COMPUTE_DTYPES)
    M, N, dt, op = spec.m, spec.n, spec.dtype, spec.op
    fn = vector_fn(op)
    over_rows = op.endswith("_rows")
    L = N if over_rows else M
    row = VectorRow(isa, dt, N)
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
            X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
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
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
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


def pool_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Max pooling: per output pixel and vector of channels, max over the window's taps."""
    check_supported(spec, isa, POOL_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    row = VectorRow(isa, dt, N)
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
        Y = T.match_buffer(y, (M, N), **matrix_buffer(dt))
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

