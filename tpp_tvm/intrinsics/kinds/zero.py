"""``zero``: Y = 0 on an (M, N) tile (a GEMM's C panel before beta-1 accumulation)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..eltwise_template import zero_impl
from ..spec import TPPSpec
from ..vector_isa import VectorISA
from .base import TPPKind


class Zero(TPPKind):
    """Y (M, N) = 0; no inputs."""

    name = "zero"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n)]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt = spec.m, spec.n, spec.dtype

        @T.prim_func(s_tir=True)
        def desc(y: T.handle):
            Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads()
                T.writes(Y[0:M, 0:N])
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Y[vi, vj] = tirx.const(0, dt)

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        oshape, odt = self.output(spec)
        return te.compute(oshape, lambda i, j: tirx.const(0, odt), name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return zero_impl(spec, isa)
