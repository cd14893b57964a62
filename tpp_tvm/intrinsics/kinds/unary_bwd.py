"""Backward unary TPPs ``dX = f(dY, S)``, S the saved forward input or output (see OPS)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ..eltwise_template import unary_bwd_impl
from ..geometry import whole
from ..spec import OPS, Fn, TPPSpec
from ..vector_isa import VectorISA
from .base import TPPKind


def operands_in_use_order(fn: Fn, *bufs) -> list:
    """Whole-tile regions of ``bufs`` in the order ``fn`` first reads them.

    Tensorize compares region lists in order, and a TE computation lists them in the order
    its expression reads them (``relu_inv`` reads S before dY), so descriptions must too.
    """
    probes = [tirx.Var(f"p{i}", "float32") for i in range(len(bufs))]
    order = []
    for var in tirx.analysis.undefined_vars(fn(*probes)):  # in order of appearance
        idx = next(i for i, p in enumerate(probes) if p.same_as(var))
        if idx not in order:
            order.append(idx)
    order += [i for i in range(len(bufs)) if i not in order]
    return [whole(bufs[i]) for i in order]


class UnaryBwd(TPPKind):
    """dY (M, N), S (M, N) -> dX (M, N)."""

    name = "unary_bwd"

    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        return [(spec.m, spec.n)] * 3

    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        M, N, dt = spec.m, spec.n, spec.dtype
        fn = OPS[spec.op].fn

        @T.prim_func(s_tir=True)
        def desc(dy: T.handle, s: T.handle, dx: T.handle):
            DY = T.match_buffer(dy, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            S = T.match_buffer(s, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            DX = T.match_buffer(dx, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(*operands_in_use_order(fn, DY, S))
                T.writes(DX[0:M, 0:N])
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        DX[vi, vj] = fn(DY[vi, vj], S[vi, vj])

        return desc

    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        (dy, s), (oshape, _), fn = inputs, self.output(spec), OPS[spec.op].fn
        return te.compute(oshape, lambda i, j: fn(dy[i, j], s[i, j]), name=name)

    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        return unary_bwd_impl(spec, isa)
