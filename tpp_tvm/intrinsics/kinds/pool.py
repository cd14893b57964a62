"""Pooling TPPs: ``pool_max`` takes the maximum over a window of input rows (see OPS)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..eltwise_template import pool_impl
from ..geometry import free_strides, pool_geometry, whole
from ..spec import TPPSpec
from ..vector_isa import VectorISA
from .base import TPPKind


class Pool(TPPKind):
    """A (``pool_geometry``: window rows x flattened W*C) -> Y (M, N)."""

    name = "pool"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [pool_geometry(spec).a_shape, (spec.m, spec.n)]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt = spec.m, spec.n, spec.dtype
        geo = pool_geometry(spec)
        dims = (M, N, *geo.batch)
        kinds = "SS" + "R" * len(geo.batch)
        lowest = tirx.min_value(dt)

        def a_at(vs):
            return geo.a_index(vs[2:], vs[0], vs[1])

        @T.prim_func(s_tir=True)
        def desc(a: T.handle, y: T.handle):
            A = T.match_buffer(a, geo.a_shape, dt, offset_factor=1,
                               strides=free_strides(len(geo.a_shape)))
            Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(whole(A))
                T.writes(Y[0:M, 0:N])
                for ivs in T.grid(*dims):
                    with T.sblock("tpp"):
                        vs = T.meta_var(T.axis.remap(kinds, ivs))
                        T.reads(Y[vs[0], vs[1]], A[a_at(vs)])
                        T.writes(Y[vs[0], vs[1]])
                        with T.init():
                            Y[vs[0], vs[1]] = lowest
                        Y[vs[0], vs[1]] = tirx.max(Y[vs[0], vs[1]], A[a_at(vs)])

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        a, geo, (oshape, _) = inputs[0], pool_geometry(spec), self.output(spec)
        rs = [te.reduce_axis((0, e), f"r{d}") for d, e in enumerate(geo.batch)]
        return te.compute(oshape, lambda i, j: te.max(a[geo.a_index(rs, i, j)], axis=rs),
                          name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return pool_impl(spec, isa)

    def examples(self, op: str, dtype: str) -> list[TPPSpec]:
        """A 3x3 stride-2 window over rows of 37 channels."""
        return [TPPSpec(op, dtype, m=8, n=37, batch=3, k=3, stride=74)]
