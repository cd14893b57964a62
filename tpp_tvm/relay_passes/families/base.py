"""What every kernel family shares: the family object, the match it lowers, what it
returns, and the small helpers for emitting kernels into a Relax module."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import tvm
from tvm import relax

from ...intrinsics.epilogue import Epilogue
from ..lowp_activations import LowpOffers


@dataclass(frozen=True)
class Match:
    """A composite's matched operands (its pattern's annotations, in the caller's terms)
    and the pattern's parameters. Reads like the annotation dict (``match["lhs"]``,
    ``"bias" in match``)."""

    operands: Mapping[str, relax.Expr]
    epilogue: Epilogue = Epilogue()
    scale_multiplies: bool = False

    def __getitem__(self, key: str) -> relax.Expr:
        return self.operands[key]

    def __contains__(self, key: object) -> bool:
        return key in self.operands

    def __iter__(self) -> Iterator[str]:
        return iter(self.operands)

    def get(self, key: str, default: relax.Expr | None = None) -> relax.Expr | None:
        return self.operands.get(key, default)

    def with_operands(self, epilogue: Epilogue | None = None, **operands: relax.Expr) -> Match:
        """This match with some operands replaced (a fused kernel lowering its parts)."""
        return replace(self, operands={**self.operands, **operands},
                       epilogue=self.epilogue if epilogue is None else epilogue)


@dataclass
class Lowered:
    """What a family's lowering built and decided: the expression computing the composite,
    whether its kernel runs on AMX tiles where its shape decided (None: every low-precision
    GEMM of an AMX target does), whether it kept fp32 in a low-precision graph (then its
    report row is fp32), and its kernels' low-precision rebuilds for
    :func:`~..lowp_activations.lowp_activations`."""

    expr: relax.Expr
    on_tiles: bool | None = None
    kept_fp32: bool = False
    offers: LowpOffers = field(default_factory=LowpOffers)


#: A family's lowering: (builder, match, kernel name, ISA, precision, threads) -> Lowered.
Lowering = Callable[[relax.BlockBuilder, Match, str, str, str, int], Lowered]


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family (dlight's rule shape): its name (what ``TPPPattern.lowering``
    says), the graph precisions it has kernels for (fp32 always; ``bfloat16``: it runs a
    bf16 graph's composites in bf16 where its lowering can, else it keeps fp32 and says
    so), and its lowering."""

    name: str
    lower: Lowering
    precisions: tuple[str, ...] = ("float32",)

    def precision(self, graph_precision: str) -> str:
        """The precision this family first tries for a composite of a ``graph_precision``
        graph."""
        return graph_precision if graph_precision in self.precisions else "float32"


def as_relax_kernel(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """A hand-scheduled kernel ready for ``call_tir`` in a Relax module: opaque (else
    FuseOps fuses neighbours into it and FuseTIR crashes), scheduled, no-alias, and without
    TE's ``global_symbol="main"`` (a duplicate symbol fails the build). See DESIGN.md."""
    func = func.without_attr("global_symbol")
    return func.with_attrs(
        {"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True}
    )


def dims(expr: relax.Expr) -> list[int]:
    """The static shape of a tensor expression."""
    return [int(d) for d in expr.ty.shape.values]


def kernel_name(name: str) -> str:
    """A composite's name (``tpp.dense_bias``) as its kernel function's (``tpp_dense_bias``)."""
    return name.replace(".", "_")


def bf16_offers(kernel: relax.GlobalVar, writing: Callable[[str], tvm.tirx.PrimFunc],
                conversion: relax.GlobalVar,
                taking_bf16: Callable[[], tvm.tirx.PrimFunc] | None) -> LowpOffers:
    """``kernel`` rebuilt to write another dtype (``writing(dtype)``) and its input
    ``conversion`` rebuilt to take bf16 (None: not needed), offered to
    :func:`~..lowp_activations.lowp_activations`."""
    offers = LowpOffers()
    offers.producers[kernel.name_hint] = lambda dtype, _clips: as_relax_kernel(writing(dtype))
    offers.conversions[conversion.name_hint] = (
        None if taking_bf16 is None else lambda: as_relax_kernel(taking_bf16()))
    return offers


def merge_offers(*parts: LowpOffers) -> LowpOffers:
    """The offers of several kernels as one."""
    out = LowpOffers()
    for part in parts:
        out.producers.update(part.producers)
        out.conversions.update(part.conversions)
        out.producer_dtypes.update(part.producer_dtypes)
    return out
