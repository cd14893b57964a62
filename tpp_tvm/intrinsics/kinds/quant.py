"""Quantization TPPs: quantize, requantize, dequantize with a per-column scale and offset
(the math is ``spec.quant_expr``; the dtype pairs are ``spec.QUANT_DTYPES``)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..precision_template import quant_impl
from ..spec import QUANT_DTYPES, TPPSpec, quant_expr
from ..vector_isa import VectorISA
from .base import TPPKind


class Quant(TPPKind):
    """X (M, N), S (N,) fp32, O (N,) fp32 -> Y (M, N) of ``out_dtype``."""

    name = "quant"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n), (spec.n,), (spec.n,), (spec.m, spec.n)]

    def operand_dtypes(self, spec: TPPSpec) -> list[str]:
        return [spec.dtype, "float32", "float32", spec.acc_dtype]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt, odt, op = spec.m, spec.n, spec.dtype, spec.acc_dtype, spec.op

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, s: T.handle, o: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            S = T.match_buffer(s, (N,), "float32", offset_factor=1)
            Off = T.match_buffer(o, (N,), "float32", offset_factor=1)
            Y = T.match_buffer(y, (M, N), odt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(X[0:M, 0:N], S[0:N], Off[0:N])
                T.writes(Y[0:M, 0:N])
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Y[vi, vj] = quant_expr(op, X[vi, vj], S[vj], Off[vj], odt)

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        (x, sc, off), (oshape, odt), op = inputs, self.output(spec), spec.op
        return te.compute(oshape, lambda i, j: quant_expr(op, x[i, j], sc[j], off[j], odt),
                          name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return quant_impl(spec, isa)

    def examples(self, op: str, dtype: str) -> list[TPPSpec]:
        """Every (input, output) dtype pair of ``op``: the dtypes are part of the op."""
        return [TPPSpec(op, a, m=8, n=37, out_dtype=b) for a, b in QUANT_DTYPES[op]]
