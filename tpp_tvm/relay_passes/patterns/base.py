"""What every pattern module builds with: the ``TPPPattern`` entry and the type checks
its checks share (a static tensor of given dtypes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern

from ...intrinsics.epilogue import Epilogue


@dataclass(frozen=True)
class TPPPattern:
    """One fusable subgraph: a name, its dataflow pattern, a check on the match, and what
    lowers it (``lowering``, the name of a kernel family in ``families.FAMILIES``, with its
    parameters)."""

    name: str
    pattern: DFPattern
    annotations: dict[str, DFPattern]
    check: Callable[[relax.transform.PatternCheckContext], bool]
    lowering: str
    epilogue: Epilogue = Epilogue()  # the fused steps after the kernel's core
    scale_multiplies: bool = False  # attention: scores * c (True) or scores / c

    def as_fusion_pattern(self) -> tuple:
        check = self.check
        return (self.name, self.pattern, self.annotations,
                lambda ctx: _no_escape(ctx) and check(ctx))


def _no_escape(ctx: relax.transform.PatternCheckContext) -> bool:
    """Only the match's result is used outside it. A training graph reuses forward
    intermediates (a pre-activation, softmax probabilities) in its backward; fusing over
    them would make a multi-output composite that no single TPP kernel computes."""
    inside = set(ctx.matched_bindings.keys())
    root = ctx.value_to_bound_var.get(ctx.matched_expr)
    for var in inside:
        if root is not None and var.same_as(root):
            continue
        if any(user not in inside for user in ctx.var_usages.get(var, [])):
            return False
    return True


def static_f32(expr: relax.Expr) -> bool:
    """Whether ``expr`` is an fp32 tensor with a static shape."""
    return static_tensor(expr, ("float32",))


def static_tensor(expr: relax.Expr, dtypes: tuple[str, ...]) -> bool:
    """Whether ``expr`` is a tensor of one of ``dtypes`` with a static shape."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.dtype not in dtypes:
        return False
    shape = ty.shape
    return shape is not None and all(isinstance(d, tvm.tirx.IntImm) for d in shape.values)
