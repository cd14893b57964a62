"""Quantization TPPs: quantize, requantize, dequantize with a per-column scale and offset
(the math is ``spec.quant_expr``; the dtype pairs are ``spec.QUANT_DTYPES``); and
requantize with a residual tile added (``spec.RESIDUAL_QUANT_OPS``: an int8 layer's whole
residual epilogue in one pass)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..precision_template import quant_impl, residual_quant_impl
from ..spec import QUANT_DTYPES, RESIDUAL_QUANT_OPS, TPPSpec, quant_expr, residual_quant_expr
from ..vector_isa import VectorISA
from .base import TPPKind


class Quant(TPPKind):
    """X (M, N), S (N,) fp32, O (N,) fp32 -> Y (M, N) of ``out_dtype``; the residual ops
    take R (M, N) of ``out_dtype``, A (N,) and Z (N,) fp32 after O."""

    name = "quant"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        tile, row = (spec.m, spec.n), (spec.n,)
        if spec.op in RESIDUAL_QUANT_OPS:
            return [tile, row, row, tile, row, row, tile]
        return [tile, row, row, tile]

    def operand_dtypes(self, spec: TPPSpec) -> list[str]:
        if spec.op in RESIDUAL_QUANT_OPS:
            return [spec.dtype, "float32", "float32", spec.acc_dtype, "float32", "float32",
                    spec.acc_dtype]
        return [spec.dtype, "float32", "float32", spec.acc_dtype]

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt, odt, op = spec.m, spec.n, spec.dtype, spec.acc_dtype, spec.op
        if op in RESIDUAL_QUANT_OPS:
            return _describe_residual(spec)

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
        (oshape, odt), op = self.output(spec), spec.op
        if op in RESIDUAL_QUANT_OPS:
            x, sc, off, r, a, z = inputs
            return te.compute(oshape, lambda i, j: residual_quant_expr(
                op, x[i, j], sc[j], off[j], r[i, j], a[j], z[j], odt), name=name)
        x, sc, off = inputs
        return te.compute(oshape, lambda i, j: quant_expr(op, x[i, j], sc[j], off[j], odt),
                          name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        if spec.op in RESIDUAL_QUANT_OPS:
            return residual_quant_impl(spec, isa)
        return quant_impl(spec, isa)

    def examples(self, op: str, dtype: str) -> list[TPPSpec]:
        """Every (input, output) dtype pair of ``op``: the dtypes are part of the op."""
        return [TPPSpec(op, a, m=8, n=37, out_dtype=b) for a, b in QUANT_DTYPES[op]]


def _describe_residual(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt, odt, op = spec.m, spec.n, spec.dtype, spec.acc_dtype, spec.op

    def tile(dtype: str) -> dict:
        return {"dtype": dtype, "offset_factor": 1, "strides": [T.int32(), 1]}

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, s: T.handle, o: T.handle, r: T.handle, a: T.handle, z: T.handle,
             y: T.handle):
        X = T.match_buffer(x, (M, N), **tile(dt))
        S = T.match_buffer(s, (N,), "float32", offset_factor=1)
        Off = T.match_buffer(o, (N,), "float32", offset_factor=1)
        R = T.match_buffer(r, (M, N), **tile(odt))
        A = T.match_buffer(a, (N,), "float32", offset_factor=1)
        Z = T.match_buffer(z, (N,), "float32", offset_factor=1)
        Y = T.match_buffer(y, (M, N), **tile(odt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], S[0:N], Off[0:N], R[0:M, 0:N], A[0:N], Z[0:N])
            T.writes(Y[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Y[vi, vj] = residual_quant_expr(op, X[vi, vj], S[vj], Off[vj], R[vi, vj],
                                                    A[vj], Z[vj], odt)

    return desc
