"""The TPP set as TIR tensor intrinsics: a portable spec and one implementation per ISA."""

from .kinds import describe
from .registry import ISAS, intrinsic, registered, spec_of
from .spec import OPS, TPPSpec

__all__ = ["ISAS", "OPS", "TPPSpec", "describe", "intrinsic", "registered", "spec_of"]
