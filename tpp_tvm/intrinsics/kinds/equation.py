"""Equation TPPs: X through a chain of steps in registers (unary TPPs, + bias row,
+ residual tile, x gate tile), e.g. a GEMM's fused epilogue (LIBXSMM's TPP equations)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..equation_template import equation_impl
from ..geometry import equation_operand_dtypes, equation_operand_shapes, whole
from ..spec import OPERAND_STEPS, TPPSpec, equation_expr, equation_operands
from ..vector_isa import VectorISA
from .base import TPPKind, describe_map

#: Equations in the catalogue: the GEMM/convolution epilogues the graph pass emits.
EXAMPLE_EQUATIONS = (
    ("bias", "gelu"),
    ("bias", "residual"),
    ("bias", "residual", "relu"),
    ("residual", "relu"),
    ("bias", "gate"),
    ("scale", "bias", "gelu"),
    ("tanh", "square"),
    ("residual_u8", "relu", "scale"),
)


class Equation(TPPKind):
    """X (M, N), one operand per bias (N,) / residual or gate (M, N) step -> Y (M, N)."""

    name = "equation"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n), *equation_operand_shapes(spec), (spec.m, spec.n)]

    def operand_dtypes(self, spec: TPPSpec) -> list[str]:
        return [spec.dtype, *equation_operand_dtypes(spec), spec.dtype]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt, steps = spec.m, spec.n, spec.dtype, spec.steps
        kinds = equation_operands(steps)
        shapes = equation_operand_shapes(spec)
        pdt = equation_operand_dtypes(spec)

        def body(X, ops, i, j):
            return equation_expr(steps, X[i, j], [
                P[j] if OPERAND_STEPS[k].row else P[i, j] for P, k in zip(ops, kinds)
            ])

        def strides(shape):
            return [1] if len(shape) == 1 else [T.int32(), 1]

        if len(kinds) == 0:
            return describe_map(M, N, dt, dt, lambda x: equation_expr(steps, x, []))
        if len(kinds) == 1:

            @T.prim_func(s_tir=True)
            def desc(x: T.handle, p: T.handle, y: T.handle):
                X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
                P = T.match_buffer(p, shapes[0], pdt[0], offset_factor=1,
                                   strides=strides(shapes[0]))
                Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
                with T.sblock("root"):
                    T.reads(whole(X), whole(P))
                    T.writes(Y[0:M, 0:N])
                    for i, j in T.grid(M, N):
                        with T.sblock("tpp"):
                            vi, vj = T.axis.remap("SS", [i, j])
                            Y[vi, vj] = body(X, [P], vi, vj)

            return desc

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, p: T.handle, q: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            P = T.match_buffer(p, shapes[0], pdt[0], offset_factor=1,
                               strides=strides(shapes[0]))
            Q = T.match_buffer(q, shapes[1], pdt[1], offset_factor=1,
                               strides=strides(shapes[1]))
            Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(whole(X), whole(P), whole(Q))
                T.writes(Y[0:M, 0:N])
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Y[vi, vj] = body(X, [P, Q], vi, vj)

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        x, ops, (oshape, _) = inputs[0], inputs[1:], self.output(spec)
        kinds = equation_operands(spec.steps)
        return te.compute(oshape, lambda i, j: equation_expr(spec.steps, x[i, j], [
            p[j] if OPERAND_STEPS[k].row else p[i, j] for p, k in zip(ops, kinds)
        ]), name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return equation_impl(spec, isa)

    def examples(self, op: str, dtype: str) -> list[TPPSpec]:
        """One spec per :data:`EXAMPLE_EQUATIONS` chain."""
        return [TPPSpec(op, dtype, m=8, n=37, steps=steps) for steps in EXAMPLE_EQUATIONS]
