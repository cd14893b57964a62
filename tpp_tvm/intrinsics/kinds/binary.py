"""Binary TPPs ``Z = f(X, Y)`` and ``muladd`` ``Z = X * Y + Z``, Y broadcast by ``bcast``."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..eltwise_template import binary_impl, muladd_impl
from ..geometry import bcast_index, bcast_shape, whole
from ..precision_template import bf16_map_impl, is_bf16_map
from ..spec import BCASTS, OPS, TPPSpec
from ..vector_isa import VectorISA
from ..vector_math import vector_fn
from .base import TPPKind


class Binary(TPPKind):
    """X (M, N), Y (``bcast_shape``) -> Z (M, N)."""

    name = "binary"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n), bcast_shape(spec), (spec.m, spec.n)]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt, bc = spec.m, spec.n, spec.dtype, spec.bcast
        fn = OPS[spec.op].fn
        yshape = bcast_shape(spec)
        y_strides = [T.int32(), 1] if bc == "none" else [1]

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, y: T.handle, z: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
            Z = T.match_buffer(z, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(X[0:M, 0:N], whole(Y))
                T.writes(Z[0:M, 0:N])
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Z[vi, vj] = fn(X[vi, vj], Y[bcast_index(bc, vi, vj)])

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        (x, y), (oshape, _), fn = inputs, self.output(spec), OPS[spec.op].fn
        return te.compute(
            oshape, lambda i, j: fn(x[i, j], y[bcast_index(spec.bcast, i, j)]), name=name
        )

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        if is_bf16_map(spec):  # bf16 tiles, computed in fp32 (see precision_template)
            return bf16_map_impl(spec, isa, vector_fn(spec.op), binary=True)
        return binary_impl(spec, isa)

    def examples(self, op: str, dtype: str) -> list[TPPSpec]:
        """One spec per broadcast flag."""
        return [TPPSpec(op, dtype, m=8, n=37, bcast=b) for b in BCASTS]


class MulAdd(Binary):
    """X (M, N), Y (``bcast_shape``), Z (M, N) -> Z: reads and updates Z in place."""

    name = "muladd"

    def in_place(self, spec: TPPSpec) -> bool:
        return True

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt, bc = spec.m, spec.n, spec.dtype, spec.bcast
        yshape = bcast_shape(spec)
        y_strides = [T.int32(), 1] if bc == "none" else [1]

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, y: T.handle, z: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
            Z = T.match_buffer(z, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(
                    X[0:M, 0:N], whole(Y), Z[0:M, 0:N]
                )
                T.writes(Z[0:M, 0:N])
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Z[vi, vj] = X[vi, vj] * Y[bcast_index(bc, vi, vj)] + Z[vi, vj]

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        raise ValueError(f"TPP {spec.op} updates its output in place: TE cannot express it")

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return muladd_impl(spec, isa)
