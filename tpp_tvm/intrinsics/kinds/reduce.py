"""Reduction TPPs: ``*_rows`` reduce the M rows (Y is (N,), LIBXSMM's REDUCE_ROWS),
``*_cols`` the N columns (Y is (M,)); the op maps each element first (sumsq squares it)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..eltwise_template import reduce_impl
from ..spec import OPS, TPPSpec, reduce_combine, reduce_identity
from ..vector_isa import VectorISA
from .base import TPPKind


def _reducer(op: str):
    return te.comm_reducer(
        lambda acc, val: reduce_combine(op, acc, val),
        lambda dtype: reduce_identity(op, dtype),
        name=op,
    )


class Reduce(TPPKind):
    """X (M, N) -> Y (N,) over rows or Y (M,) over columns."""

    name = "reduce"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n), (spec.n,) if spec.op.endswith("_rows") else (spec.m,)]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt, op = spec.m, spec.n, spec.dtype, spec.op
        fn = OPS[op].fn
        over_rows = op.endswith("_rows")
        L = N if over_rows else M
        init = reduce_identity(op, dt)

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            Y = T.match_buffer(y, (L,), dt, offset_factor=1)
            with T.sblock("root"):
                T.reads(X[0:M, 0:N])
                T.writes(Y[0:L])
                if over_rows:
                    for j, i in T.grid(N, M):
                        with T.sblock("tpp"):
                            vj, vi = T.axis.remap("SR", [j, i])
                            T.reads(Y[vj], X[vi, vj])
                            T.writes(Y[vj])
                            with T.init():
                                Y[vj] = init
                            Y[vj] = reduce_combine(op, Y[vj], fn(X[vi, vj]))
                else:
                    for i, j in T.grid(M, N):
                        with T.sblock("tpp"):
                            vi, vj = T.axis.remap("SR", [i, j])
                            T.reads(Y[vi], X[vi, vj])
                            T.writes(Y[vi])
                            with T.init():
                                Y[vi] = init
                            Y[vi] = reduce_combine(op, Y[vi], fn(X[vi, vj]))

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        op, (oshape, _) = spec.op, self.output(spec)
        x, red, fn = inputs[0], _reducer(op), OPS[op].fn
        if op.endswith("_rows"):
            r = te.reduce_axis((0, spec.m), "r")
            return te.compute(oshape, lambda j: red(fn(x[r, j]), axis=r), name=name)
        r = te.reduce_axis((0, spec.n), "r")
        return te.compute(oshape, lambda i: red(fn(x[i, r]), axis=r), name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return reduce_impl(spec, isa)
