"""What every kernel family shares: the family object, the match it lowers (with the
dtypes planned for its kernel), what it returns, and the small helpers for emitting
kernels into a Relax module."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import tvm
from tvm import relax

from ...intrinsics.epilogue import Epilogue
from ..activation_dtypes import FP32_IO, KernelIO, quantizing_args


@dataclass(frozen=True)
class Match:
    """A composite's matched operands (its pattern's annotations, in the caller's terms),
    the pattern's parameters, and the dtypes planned for its kernel (``io``: where it
    takes bf16, its input operand is that bf16 tensor). Reads like the annotation dict
    (``match["lhs"]``, ``"bias" in match``)."""

    operands: Mapping[str, relax.Expr]
    epilogue: Epilogue = Epilogue()
    scale_multiplies: bool = False
    io: KernelIO = FP32_IO

    def __getitem__(self, key: str) -> relax.Expr:
        return self.operands[key]

    def __contains__(self, key: object) -> bool:
        return key in self.operands

    def __iter__(self) -> Iterator[str]:
        return iter(self.operands)

    def get(self, key: str, default: relax.Expr | None = None) -> relax.Expr | None:
        return self.operands.get(key, default)

    def with_operands(self, epilogue: Epilogue | None = None, io: KernelIO | None = None,
                      **operands: relax.Expr) -> Match:
        """This match with some operands replaced (a fused kernel lowering its parts)."""
        return replace(self, operands={**self.operands, **operands},
                       epilogue=self.epilogue if epilogue is None else epilogue,
                       io=self.io if io is None else io)


@dataclass
class Lowered:
    """What a family's lowering built and decided: the expression computing the composite
    (in ``match.io.writes``), whether its kernel runs on AMX tiles where its shape decided
    (None: every low-precision GEMM of an AMX target does), and whether it kept fp32 in a
    low-precision graph (then its report row is fp32)."""

    expr: relax.Expr
    on_tiles: bool | None = None
    kept_fp32: bool = False


#: A family's lowering: (builder, match, kernel name, ISA, precision, threads) -> Lowered.
Lowering = Callable[[relax.BlockBuilder, Match, str, str, str, int], Lowered]


#: What a family can do with a composite's activations, from the match alone:
#: (match, precision, ISA, threads) -> the narrow dtypes its kernel can write, or the
#: operand it can take in bf16 (None: none).
NarrowOutputs = Callable[[Match, str, str, int], tuple[str, ...]]
Bf16Operand = Callable[[Match, str, str, int], str | None]


def _no_narrow_outputs(match: Match, precision: str, isa: str, threads: int
                       ) -> tuple[str, ...]:
    return ()


def _no_bf16_operand(match: Match, precision: str, isa: str, threads: int) -> str | None:
    return None


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family (dlight's rule shape): its name (what ``TPPPattern.lowering``
    says), the graph precisions it has kernels for (fp32 always; ``bfloat16``: it runs a
    bf16 graph's composites in bf16 where its lowering can, else it keeps fp32 and says
    so), its lowering, and, for the dtype plan made before any kernel is built
    (:func:`~..activation_dtypes.plan_outputs`), the narrow dtypes its kernel can write,
    the operand it can take in bf16, and whether it lowers to a view."""

    name: str
    lower: Lowering
    precisions: tuple[str, ...] = ("float32",)
    narrow_outputs: NarrowOutputs = _no_narrow_outputs
    bf16_operand: Bf16Operand = _no_bf16_operand
    #: Whether its lowering of a match is a view of its input (a reshape): narrow
    #: activations pass through it.
    is_view: Callable[[Match], bool] = lambda match: False

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


def output_args(args: list[relax.Expr], kernel: tvm.tirx.PrimFunc, width: int, io: KernelIO
                ) -> list[relax.Expr]:
    """A kernel's arguments, with its output quantization's rows (``width`` columns) where
    ``io`` has it write u8/s8."""
    return args if io.quantization is None else quantizing_args(args, kernel, width, io)[0]
