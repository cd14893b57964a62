"""Contraction TPPs (kind ``brgemm``): ``gemm``, batch-reduce ``brgemm`` and a convolution's
``conv_brgemm``, C (M, N) (+)= A x B over the reduction ``contraction_geometry`` states."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..brgemm_template import brgemm_impl
from ..geometry import contraction_geometry, free_strides, operand_reads
from ..spec import TPPSpec
from ..vector_isa import VectorISA
from .base import TPPKind, convert


class Contraction(TPPKind):
    """A, B (``contraction_geometry``) -> C (M, N) of ``acc_dtype``; beta 1 accumulates."""

    name = "brgemm"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        geo = contraction_geometry(spec)
        return [geo.a_shape, geo.b_shape, (spec.m, spec.n)]

    def operand_dtypes(self, spec: TPPSpec) -> list[str]:
        return [spec.dtype, spec.b_dtype or spec.dtype, spec.acc_dtype]

    def in_place(self, spec: TPPSpec) -> bool:
        return spec.beta == 1

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt, acc = spec.m, spec.n, spec.dtype, spec.acc_dtype
        bdt = spec.b_dtype or dt
        geo = contraction_geometry(spec)
        beta0 = spec.beta == 0
        dims = (M, N, *geo.batch, geo.k)
        kinds = "SS" + "R" * (len(geo.batch) + 1)

        def mac(a, b):
            return tirx.Cast(acc, a) * tirx.Cast(acc, b) if acc != dt else a * b

        def a_at(vs):
            return geo.a_index(vs[2:-1], vs[0], vs[-1])

        def b_at(vs):
            return geo.b_index(vs[2:-1], vs[-1], vs[1])

        @T.prim_func(s_tir=True)
        def desc(a: T.handle, b: T.handle, c: T.handle):
            A = T.match_buffer(a, geo.a_shape, dt, offset_factor=1,
                               strides=free_strides(len(geo.a_shape)))
            B = T.match_buffer(b, geo.b_shape, bdt, offset_factor=1,
                               strides=geo.b_buffer_strides())
            C = T.match_buffer(c, (M, N), acc, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(*operand_reads(beta0, C, A, B))
                T.writes(C[0:M, 0:N])
                for ivs in T.grid(*dims):
                    with T.sblock("tpp"):
                        vs = T.meta_var(T.axis.remap(kinds, ivs))
                        T.reads(C[vs[0], vs[1]], A[a_at(vs)], B[b_at(vs)])
                        T.writes(C[vs[0], vs[1]])
                        if beta0:
                            with T.init():
                                C[vs[0], vs[1]] = tirx.const(0, acc)
                        C[vs[0], vs[1]] = C[vs[0], vs[1]] + mac(A[a_at(vs)], B[b_at(vs)])

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        """The beta-0 form (TE's reduction initializes C); a schedule makes it beta 1 with
        ``decompose_reduction``."""
        (a, b), (oshape, odt) = inputs, self.output(spec)
        geo = contraction_geometry(spec)
        rs = [te.reduce_axis((0, e), f"r{d}") for d, e in enumerate(geo.batch)]
        k = te.reduce_axis((0, geo.k), "k")

        def mac(i, j):
            av, bv = a[geo.a_index(rs, i, k)], b[geo.b_index(rs, k, j)]
            return convert(av, odt) * convert(bv, odt)

        return te.compute(oshape, lambda i, j: te.sum(mac(i, j), axis=[*rs, k]), name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return brgemm_impl(spec, isa)

    def examples(self, op: str, dtype: str) -> list[TPPSpec]:
        """A 6x64 tile with K = 64, accumulating (beta 1) and overwriting (beta 0); batch 4
        where the op has a batch."""
        batch = 1 if op == "gemm" else 4
        return [TPPSpec(op, dtype, m=6, n=64, k=64, batch=batch),
                TPPSpec(op, dtype, m=6, n=64, k=64, beta=0, batch=batch)]
