"""The kinds of TPP, one class each, in one table.

``KINDS[OPS[op].kind]`` is everything the package derives from an op's datasheet entry:
its description, operands, TE form, ISA template and catalogue examples (see
:class:`~.base.TPPKind`). The functions below are the entry points the registry and the
schedules use; a new kind is one module here and one entry in :data:`KINDS`.
"""

from __future__ import annotations

from tvm import tirx

from ..spec import OPS, TPPSpec
from ..vector_isa import VectorISA
from .base import TPPKind
from .binary import Binary, MulAdd
from .contraction import Contraction
from .equation import EXAMPLE_EQUATIONS, Equation
from .pool import Pool
from .quant import Quant
from .reduce import Reduce
from .transform import Transform
from .unary import Unary
from .unary_bwd import UnaryBwd
from .zero import Zero

#: Every kind, keyed by ``OpDef.kind``.
KINDS: dict[str, TPPKind] = {
    k.name: k
    for k in (Zero(), Unary(), UnaryBwd(), Binary(), MulAdd(), Quant(), Pool(), Equation(),
              Reduce(), Transform(), Contraction())
}


def kind_of(spec: TPPSpec) -> TPPKind:
    """The kind object of ``spec``."""
    return KINDS[spec.kind]


def describe(spec: TPPSpec) -> tirx.PrimFunc:
    """The TIR description (the math) of ``spec``, for ``TensorIntrin.register``."""
    return kind_of(spec).describe(spec)


def implement(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """The implementation of ``spec`` on the vector unit ``isa`` (its kind's template)."""
    return kind_of(spec).implement(spec, isa)


def examples(dtype: str = "float32") -> list[TPPSpec]:
    """Every op of the set at its kind's representative tiles, in ``OPS`` order."""
    return [spec for op, d in OPS.items() for spec in KINDS[d.kind].examples(op, dtype)]


__all__ = ["EXAMPLE_EQUATIONS", "KINDS", "TPPKind", "describe", "examples", "implement",
           "kind_of"]
