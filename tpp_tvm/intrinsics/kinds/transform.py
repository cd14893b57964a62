"""Layout TPPs: ``transpose`` (Y is (N, M)) and VNNI packing ``vnni2``/``vnni4`` (Y is
(ceil(M/V), N, V), the missing rows of the last block zero)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..geometry import transform_out_shape
from ..spec import TPPSpec
from ..transpose_template import transpose_impl, vnni_impl
from ..vector_isa import VectorISA
from .base import TPPKind


class Transform(TPPKind):
    """X (M, N) -> Y (``transform_out_shape``), elements moved, never computed."""

    name = "transform"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n), transform_out_shape(spec)]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt = spec.m, spec.n, spec.dtype
        oshape = transform_out_shape(spec)
        zero = tirx.const(0, dt)

        if spec.op == "transpose":

            @T.prim_func(s_tir=True)
            def desc(x: T.handle, y: T.handle):
                X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
                Y = T.match_buffer(y, (N, M), dt, offset_factor=1, strides=[T.int32(), 1])
                with T.sblock("root"):
                    T.reads(X[0:M, 0:N])
                    T.writes(Y[0:N, 0:M])
                    for j, i in T.grid(N, M):
                        with T.sblock("tpp"):
                            vj, vi = T.axis.remap("SS", [j, i])
                            Y[vj, vi] = X[vi, vj]

            return desc

        KO, _, V = oshape

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            Y = T.match_buffer(y, (KO, N, V), dt, offset_factor=1, strides=[T.int32(), V, 1])
            with T.sblock("root"):
                # Rows past M are never read (the if_then_else), but region analysis of a
                # blockized workload ignores the condition and covers KO*V rows: say the same.
                T.reads(X[0 : KO * V, 0:N])
                T.writes(Y[0:KO, 0:N, 0:V])
                for ko, j, v in T.grid(KO, N, V):
                    with T.sblock("tpp"):
                        vko, vj, vv = T.axis.remap("SSS", [ko, j, v])
                        T.reads(X[vko * V + vv, vj])
                        Y[vko, vj, vv] = T.if_then_else(
                            vko * V + vv < M, X[T.min(vko * V + vv, M - 1), vj], zero
                        )

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        x, (oshape, odt) = inputs[0], self.output(spec)
        if spec.op == "transpose":
            return te.compute(oshape, lambda j, i: x[i, j], name=name)
        (_, _, v), m = oshape, spec.m
        return te.compute(
            oshape,
            lambda ko, j, vv: tirx.if_then_else(
                ko * v + vv < m, x[tirx.min(ko * v + vv, m - 1), j], tirx.const(0, odt)
            ),
            name=name,
        )

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return transpose_impl(spec, isa) if spec.op == "transpose" else vnni_impl(spec, isa)
