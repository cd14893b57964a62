"""What every kind of TPP provides, and the pieces their descriptions share.

A *kind* is the operand structure a family of ops shares (unary ``Y = f(X)``, binary
``Z = f(X, Y)`` with a broadcast flag, reductions, BRGEMM, ...). One :class:`TPPKind` subclass
per kind states, for every op of its family, everything that follows from the datasheet
(``spec.py``): the TIR description ``tensorize`` matches, the operand shapes and dtypes, the
TE form schedules build blocks from, which ISA template implements it, and the catalogue's
representative tiles. It is the shape of a dlight rule: apart from the datasheet's own
rules (which fields a kind takes, how it is named: ``TPPSpec``), nothing tests which kind a
spec is, so a new kind is its ops in ``OPS``, one class here and one entry in
``kinds.KINDS``.

Descriptions are the math, written once per kind with the op's scalar function plugged in;
implementations stay in the per-ISA templates (``*_template.py``), to which :meth:`implement`
hands the ISA's :class:`~tpp_tvm.intrinsics.vector_isa.VectorISA`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from tvm import te, tirx
from tvm.script import tirx as T

from ..spec import Fn, TPPSpec, dtype_of
from ..vector_isa import VectorISA


class TPPKind(ABC):
    """One kind of TPP: its description, operands, TE form, implementation and examples."""

    #: The kind's key in ``OPS`` (``OpDef.kind``) and in ``kinds.KINDS``.
    name: ClassVar[str]

    @abstractmethod
    def operand_shapes(self, spec: TPPSpec) -> list[tuple[int, ...]]:
        """Shapes of the description's parameters, in order (inputs first, output last)."""

    def operand_dtypes(self, spec: TPPSpec) -> list[str]:
        """Dtypes of the description's parameters, in order."""
        return [spec.dtype] * (len(self.operand_shapes(spec)) - 1) + [spec.acc_dtype]

    def in_place(self, spec: TPPSpec) -> bool:
        """Whether the TPP reads its output's old value (TE cannot express it)."""
        return False

    @abstractmethod
    def describe(self, spec: TPPSpec) -> tirx.PrimFunc:
        """The TIR description (the math) of ``spec``, for ``TensorIntrin.register``."""

    @abstractmethod
    def te_compute(self, spec: TPPSpec, inputs: list[te.Tensor], name: str) -> te.Tensor:
        """The output of a TE computation of ``spec`` on ``inputs`` (the description's
        input shapes), its stage called ``name``."""

    @abstractmethod
    def implement(self, spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
        """The implementation PrimFunc of ``spec`` on ``isa``, from the ISA templates."""

    def examples(self, op: str, dtype: str) -> list[TPPSpec]:
        """Specs of ``op`` in the catalogue: one tile with a column tail (N = 37)."""
        return [TPPSpec(op, dtype, m=8, n=37)]

    def output(self, spec: TPPSpec) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of the output operand."""
        return self.operand_shapes(spec)[-1], self.operand_dtypes(spec)[-1]


def convert(x: tirx.Expr, dtype: str) -> tirx.Expr:
    """``x`` cast to ``dtype`` unless it already is (TE forms)."""
    return x if dtype_of(x) == dtype else tirx.Cast(dtype, x)


def describe_map(M: int, N: int, dt: str, odt: str, body: Fn) -> tirx.PrimFunc:
    """Y = body(X) element by element on an (M, N) tile (unary TPPs, operand-free equations)."""

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        Y = T.match_buffer(y, (M, N), odt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Y[vi, vj] = body(X[vi, vj])

    return desc

