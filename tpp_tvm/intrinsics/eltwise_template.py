"""Element-wise, reduction and layout TPPs, written once for every vector ISA.

One template per kind of TPP (zero, unary, unary_bwd, binary, muladd, reduce, transform);
the op only contributes its math, as a function of vector expressions: the fast form from
``vector_math.FAST`` where the exact one would become per-lane libm calls, else the
description's own ``OPS[op].fn``. Rows are walked one at a time; along a row, ``N // lanes``
full vectors use plain vector loads/stores and the remaining ``N % lanes`` columns one
masked load/store (an AVX-512 k-mask, an SVE predicate), so every M, N is exact and no
memory outside a tile is touched. Each implementation declares exactly the description's
buffers (shapes, strides, offset factor), which ``tensorize`` requires.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ..errors import UnsupportedDTypeError
from .spec import (
    OPS,
    TPPSpec,
    bcast_shape,
    reduce_combine,
    reduce_identity,
    transform_out_shape,
    whole,
)
from .vector_isa import VectorISA
from .vector_math import FAST

#: Kinds whose math is arithmetic: fp32 only for now (the vector math is fp32).
_COMPUTE_DTYPES = ("float32",)
#: Dtypes the data-movement TPPs (zero, copy, transform) move.
_MOVE_DTYPES = ("float32", "float16", "bfloat16", "int32", "int8", "uint8")
#: (dtype, out_dtype) conversions a copy TPP performs.
_CONVERSIONS = {
    ("float32", "float16"),
    ("float16", "float32"),
    ("float32", "int32"),
    ("int32", "float32"),
}


def check_supported(spec: TPPSpec, isa: VectorISA) -> None:
    """Raise ``UnsupportedDTypeError`` unless the templates implement ``spec``'s dtypes."""
    moves = spec.kind in ("zero", "transform") or spec.op == "copy"
    allowed = _MOVE_DTYPES if moves else _COMPUTE_DTYPES
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


def vector_fn(op: str) -> Callable[..., tirx.Expr]:
    """The math of ``op`` on vectors: its fast vector form if it has one, else the spec's."""
    return FAST.get(op) or OPS[op].fn


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

    def load_tail(self, first: tirx.Expr) -> tirx.Expr:
        """Masked load of the tail; ``first`` is the element at its first column."""
        return self.isa.masked_load(first, self.mask(), self.dtype)

    def store_tail(self, value: tirx.Expr, first: tirx.Expr) -> tirx.Expr:
        return self.isa.masked_store(value, first, self.mask())

    def splat(self, value: tirx.Expr) -> tirx.Expr:
        return self.isa.broadcast(value, self.dtype)


def _mat(dtype: str) -> dict:
    """match_buffer keywords of a row-major 2D operand with a free leading dimension."""
    return {"dtype": dtype, "offset_factor": 1, "strides": [T.int32(), 1]}


def _zero(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
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


def _unary(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    M, N, dt, odt = spec.m, spec.n, spec.dtype, spec.acc_dtype
    row = _Row(isa, dt, N)
    fn = vector_fn(spec.op)

    def f(x):
        y = fn(x)
        return tirx.Cast(tirx_vector_type(odt, y), y) if odt != dt else y

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


def tirx_vector_type(dtype: str, like: tirx.Expr) -> str:
    """``dtype`` with the lanes of ``like``'s (vector) type, for conversions."""
    from .spec import dtype_of

    shape = dtype_of(like).split("x", 1)
    return dtype if len(shape) == 1 else f"{dtype}x{shape[1]}"


def _unary_bwd(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
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


def _binary(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    M, N, dt = spec.m, spec.n, spec.dtype
    row = _Row(isa, dt, N)
    fn = vector_fn(spec.op)
    yshape = bcast_shape(spec)
    y_vec, y_tail, y_strides = _bcast_operand(spec, row)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
        Z = T.match_buffer(z, (M, N), **_mat(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], whole(Y))
            T.writes(Z[0:M, 0:N])
            for i in T.serial(M):
                for v in T.serial(row.full):
                    Z[i, row.at(v)] = fn(X[i, row.at(v)], y_vec(Y, i, v))
                if row.tail:
                    T.evaluate(row.store_tail(fn(row.load_tail(X[i, row.tail_start]),
                                                 y_tail(Y, i)),
                                              Z[i, row.tail_start]))

    return impl


def _muladd(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    M, N, dt = spec.m, spec.n, spec.dtype
    row = _Row(isa, dt, N)
    fn = vector_fn(spec.op)
    yshape = bcast_shape(spec)
    y_vec, y_tail, y_strides = _bcast_operand(spec, row)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), **_mat(dt))
        Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
        Z = T.match_buffer(z, (M, N), **_mat(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], whole(Y), Z[0:M, 0:N])
            T.writes(Z[0:M, 0:N])
            for i in T.serial(M):
                for v in T.serial(row.full):
                    Z[i, row.at(v)] = fn(X[i, row.at(v)], y_vec(Y, i, v), Z[i, row.at(v)])
                if row.tail:
                    T.evaluate(row.store_tail(fn(row.load_tail(X[i, row.tail_start]),
                                                 y_tail(Y, i),
                                                 row.load_tail(Z[i, row.tail_start])),
                                              Z[i, row.tail_start]))

    return impl


def _horizontal(op: str, vec: tirx.Expr, row: _Row) -> tirx.Expr:
    """Fold the lanes of ``vec`` into one scalar with the reduction of ``op``."""
    lanes = row.lanes
    if not isinstance(lanes, int):
        name = "llvm.vector.reduce.fmax" if "_max_" in op else "llvm.vector.reduce.fadd"
        args = [vec] if "_max_" in op else [tirx.const(-0.0, row.dtype), vec]
        return T.call_llvm_pure_intrin(row.dtype, name, *args)
    # Pairwise halving: log2(lanes) vector ops, and a more accurate sum than a serial one.
    while lanes > 1:
        half = lanes // 2
        lo = tirx.Shuffle([vec], [tirx.const(k, "int32") for k in range(half)])
        hi = tirx.Shuffle([vec], [tirx.const(k, "int32") for k in range(half, lanes)])
        vec, lanes = reduce_combine(op, lo, hi), half
    return vec


def _reduce(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
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


def _transform(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    M, N, dt = spec.m, spec.n, spec.dtype

    if spec.op == "transpose":
        # Rows of Y are written contiguously; LLVM vectorises the strided reads.
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

    KO, _, V = transform_out_shape(spec)
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


_TEMPLATES = {
    "zero": _zero,
    "unary": _unary,
    "unary_bwd": _unary_bwd,
    "binary": _binary,
    "muladd": _muladd,
    "reduce": _reduce,
    "transform": _transform,
}


def eltwise_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """The implementation PrimFunc of a non-contraction TPP on ``isa``."""
    if spec.kind not in _TEMPLATES:
        raise ValueError(f"TPP {spec.op} (kind {spec.kind}) has no element-wise template")
    check_supported(spec, isa)
    return _TEMPLATES[spec.kind](spec, isa)
