"""What every vector template is written with: a row of N elements as full vectors and a
masked tail, the dtypes each kind of template moves or computes, the check that a spec is
one of them, and a 2D operand's buffer keywords."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ..errors import UnsupportedDTypeError
from .spec import TPPSpec
from .vector_isa import VectorISA

#: Dtypes of the templates that compute (the vector math is fp32 only for now).
COMPUTE_DTYPES = ("float32",)
#: Dtypes the vectorized data-movement TPPs (zero, copy) move. Not bfloat16: TVM's bf16
#: legalization widens bf16 vectors to fp32 but not the operands of masked loads/stores.
MOVE_DTYPES = ("float32", "float16", "int32", "int8", "uint8")
#: Dtypes the layout TPPs (transpose, VNNI packing) move: element copies, bf16 included.
TRANSFORM_DTYPES = (*MOVE_DTYPES, "bfloat16")
#: (dtype, out_dtype) conversions a copy TPP performs.
_CONVERSIONS = {
    ("float32", "float16"),
    ("float16", "float32"),
    ("float32", "int32"),
    ("int32", "float32"),
}


def check_supported(spec: TPPSpec, isa: VectorISA, allowed: tuple[str, ...]) -> None:
    """Raise ``UnsupportedDTypeError`` unless ``spec``'s dtype is one of ``allowed`` (what
    the calling template implements) and its output dtype is a conversion copy makes."""
    if spec.dtype not in allowed:
        raise UnsupportedDTypeError(
            f"TPP {spec.op} on {isa.name}: dtype {spec.dtype} is not supported; "
            f"supported: {', '.join(allowed)}"
        )
    out = spec.acc_dtype
    if out != spec.dtype and (spec.op != "copy" or (spec.dtype, out) not in _CONVERSIONS):
        supported = ", ".join(f"{a}->{b}" for a, b in sorted(_CONVERSIONS))
        raise UnsupportedDTypeError(
            f"TPP {spec.op} on {isa.name}: conversion {spec.dtype}->{out} is not supported; "
            f"copy converts {supported}"
        )


@dataclass(frozen=True)
class VectorRow:
    """How one row of ``n`` elements of ``dtype`` splits into vectors on ``isa``.

    ``full`` vectors of ``lanes`` elements, then a masked tail when ``tail`` (always for a
    scalable ISA, where the mask decides at run time how many lanes are left).
    """

    isa: VectorISA
    dtype: str
    n: int

    @property
    def lanes(self) -> int | tirx.Expr:
        return self.isa.lanes(self.dtype)

    @property
    def full(self) -> int | tirx.Expr:
        return self.n // self.lanes

    @property
    def tail(self) -> bool:
        return self.isa.scalable or self.n % self.lanes != 0

    @property
    def tail_start(self) -> int | tirx.Expr:
        return self.full * self.lanes

    def at(self, v: tirx.Expr) -> tirx.Expr:
        """Column ramp of full vector ``v``."""
        return self.isa.ramp(v * self.lanes, self.dtype)

    def mask(self) -> tirx.Expr:
        return self.isa.tail_mask(self.tail_start, self.n, self.dtype)

    def load_tail(self, first: tirx.Expr, dtype: str | None = None) -> tirx.Expr:
        """Masked load of the tail; ``first`` is the element at its first column. ``dtype``:
        the elements' type where it is not the row's (u8 lanes of an fp32 row)."""
        return self.isa.masked_load(first, self.mask(), dtype or self.dtype,
                                    lanes_of=self.dtype)

    def store_tail(self, value: tirx.Expr, first: tirx.Expr) -> tirx.Expr:
        return self.isa.masked_store(value, first, self.mask())

    def splat(self, value: tirx.Expr) -> tirx.Expr:
        return self.isa.broadcast(value, self.dtype)


def matrix_buffer(dtype: str) -> dict:
    """match_buffer keywords of a row-major 2D operand with a free leading dimension."""
    return {"dtype": dtype, "offset_factor": 1, "strides": [T.int32(), 1]}
