"""Unary TPPs ``Y = f(X)`` on an (M, N) tile; ``copy`` also converts to ``out_dtype``."""

from __future__ import annotations

from tvm import te, tirx

from ..eltwise_template import unary_impl
from ..precision_template import bf16_map_impl, convert_impl, is_bf16_map, is_llvm_conversion
from ..spec import OPS, TPPSpec
from ..vector_isa import VectorISA
from ..vector_math import vector_fn
from .base import TPPKind, convert, describe_map


class Unary(TPPKind):
    """X (M, N) -> Y (M, N) of ``acc_dtype``, element by element with ``OPS[op].fn``."""

    name = "unary"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n), (spec.m, spec.n)]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        fn, odt = OPS[spec.op].fn, spec.acc_dtype

        def body(x):
            y = fn(x)
            return tirx.Cast(odt, y) if odt != spec.dtype else y

        return describe_map(spec.m, spec.n, spec.dtype, odt, body)

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        (x,), (oshape, odt), fn = inputs, self.output(spec), OPS[spec.op].fn
        return te.compute(oshape, lambda i, j: convert(fn(x[i, j]), odt), name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        # bf16 math and fp32 <-> bf16 copies need LLVM IR steps (TIR's bf16 legalisation
        # rewrites typed bf16 vectors); everything else is the vector template.
        if is_bf16_map(spec):
            return bf16_map_impl(spec, isa, vector_fn(spec.op), binary=False)
        if is_llvm_conversion(spec):
            return convert_impl(spec, isa)
        return unary_impl(spec, isa)
