"""What a TPP implementation template needs to know about an ISA's vector unit.

Templates (``brgemm_template.py``, ``eltwise_template.py``, ...) are written once against this
interface; ``avx512.py`` and ``sve.py`` each provide one instance. That is how one template
serves every ISA: the only differences are the vector length (fixed or scalable), how a
partial vector is loaded/stored (an AVX-512 mask register or an SVE predicate) and how many
vector registers the register-blocking may use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tvm import tirx
from tvm.script import tirx as T


@dataclass(frozen=True)
class VectorISA:
    """A SIMD unit: ``vector_bits`` wide (None when scalable, e.g. SVE), ``num_vregs`` registers.

    ``min_vector_bits`` is the width used to size register blocking for a scalable ISA;
    ``schedule_vector_bits`` the fixed width its schedules vectorize plain loops to (see
    :meth:`schedule_lanes`).
    ``dot_brgemm(a_dtype, b_dtype, m, n, kgroups, batch, beta)`` gives the ISA's
    low-precision (VNNI dot-product) BRGEMM microkernel as an LLVM IR function
    (``llvm_ir.IRFunction``); None when this package has none for the ISA.
    ``dot_dtypes`` are the (A, B) dtype pairs it takes.
    The optional LLVM intrinsic names below are instructions the templates use when the ISA
    has them and generic code cannot reach them (a scalable vector has no compile-time lane
    indices to shuffle): ``horizontal`` maps ``"add"``/``"max"`` to a predicated across-lane
    reduction, ``gather`` loads 32-bit elements at a vector of indices, ``interleaved_store``
    maps a factor V to a store of V vectors interleaved element by element.
    """

    name: str
    vector_bits: int | None
    num_vregs: int
    min_vector_bits: int = 128
    schedule_vector_bits: int | None = None
    dot_brgemm: Callable | None = None
    dot_dtypes: tuple[tuple[str, str], ...] = ()
    horizontal: Mapping[str, str] = field(default_factory=dict)
    gather: str | None = None
    interleaved_store: Mapping[int, str] = field(default_factory=dict)

    @property
    def scalable(self) -> bool:
        return self.vector_bits is None

    def lanes(self, dtype: str) -> int | tirx.Expr:
        """Elements of ``dtype`` per vector register (a ``vscale`` expression if scalable)."""
        bits = _bits(dtype)
        if self.scalable:
            return (self.min_vector_bits // bits) * T.vscale()
        return self.vector_bits // bits

    def static_lanes(self, dtype: str) -> int:
        """Lanes at the (minimum) vector length, for sizing register blocks."""
        return (self.vector_bits or self.min_vector_bits) // _bits(dtype)

    def schedule_lanes(self, dtype: str) -> int:
        """Lanes of ``dtype`` that schedules work in: the length of the loops they vectorize
        outside TPPs and the column unit of the register tiles they size.

        One register on a fixed-width ISA. TIR vectorizes a loop only to a fixed length (a
        scalable loop with a tail is scalarised), so a scalable ISA states the fixed width
        its schedules use instead (``schedule_vector_bits``), which LLVM splits into its
        registers.
        """
        bits = self.vector_bits or self.schedule_vector_bits or self.min_vector_bits
        return bits // _bits(dtype)

    def vtype(self, dtype: str, lanes_of: str | None = None) -> str:
        """The TIR vector dtype string (``float32x16``, ``float32xvscalex4``): one register
        of ``dtype``, or as many lanes of it as one register of ``lanes_of`` has."""
        bits = _bits(lanes_of or dtype)
        if self.scalable:
            return f"{dtype}xvscalex{self.min_vector_bits // bits}"
        return f"{dtype}x{self.vector_bits // bits}"

    def ramp(self, base: tirx.Expr | int, dtype: str) -> tirx.Expr:
        """Index ramp ``base, base+1, ...`` covering one vector of ``dtype``."""
        return T.ramp(base, 1, self.lanes(dtype))

    def broadcast(self, value: tirx.Expr, dtype: str) -> tirx.Expr:
        return T.broadcast(value, self.lanes(dtype))

    def tail_mask(self, start: tirx.Expr | int, limit: tirx.Expr | int, dtype: str) -> tirx.Expr:
        """Predicate selecting lanes ``start + l < limit`` of one vector of ``dtype``."""
        if self.scalable:
            return T.get_active_lane_mask(f"boolxvscalex{self.min_vector_bits // _bits(dtype)}",
                                          start, limit)
        n = self.lanes(dtype)
        return T.ramp(start, 1, n) < T.broadcast(limit, n)

    def masked_load(self, load: tirx.Expr, mask: tirx.Expr, dtype: str,
                    lanes_of: str | None = None) -> tirx.Expr:
        """Load one vector of ``dtype`` starting at the scalar element ``load`` under ``mask``
        (``lanes_of``: as many lanes as one vector of that dtype, e.g. u8 for an fp32 row).

        Masked-off lanes read as zero and touch no memory, so tails never read past a tile.
        """
        return T.call_llvm_pure_intrin(
            self.vtype(dtype, lanes_of),
            "llvm.masked.load",
            T.address_of(load),
            mask,
            T.broadcast(tirx.const(0, dtype), self.lanes(lanes_of or dtype)),
        )

    def masked_store(self, value: tirx.Expr, load: tirx.Expr, mask: tirx.Expr) -> tirx.Expr:
        """Store the lanes of ``value`` selected by ``mask`` at the scalar element ``load``."""
        return T.call_llvm_intrin("void", "llvm.masked.store", value, T.address_of(load), mask)

    def all_lanes(self, dtype: str) -> tirx.Expr:
        """A predicate with every lane of one vector of ``dtype`` active."""
        return self.tail_mask(0, self.lanes(dtype), dtype)

    def reduce_lanes(self, kind: str, vec: tirx.Expr, dtype: str) -> tirx.Expr:
        """Fold the lanes of ``vec`` with ``kind`` (``add``/``max``) using ``horizontal``."""
        return T.call_llvm_pure_intrin(dtype, self.horizontal[kind], self.all_lanes(dtype), vec)

    def gather_load(self, base: tirx.Expr, index: tirx.Expr, mask: tirx.Expr,
                    dtype: str) -> tirx.Expr:
        """One vector of ``dtype``: lane l is the element ``index[l]`` elements after ``base``
        (a scalar buffer element), where ``mask`` is set; zero elsewhere."""
        return T.call_llvm_pure_intrin(self.vtype(dtype), self.gather, mask,
                                       T.address_of(base), index)

    def store_interleaved(self, values: list[tirx.Expr], first: tirx.Expr,
                          mask: tirx.Expr) -> tirx.Expr:
        """Store ``values[v][l]`` at element ``l * V + v`` after ``first`` where ``mask[l]``."""
        return T.call_llvm_intrin("void", self.interleaved_store[len(values)], *values, mask,
                                  T.address_of(first))


def _bits(dtype: str) -> int:
    digits = "".join(c for c in dtype.split("x")[0] if c.isdigit())
    return int(digits) if digits else 8
