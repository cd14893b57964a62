"""Residual adds with the operand a contraction epilogue can absorb first.

``FuseOpsByPattern`` tries an ``add``'s operands in their written order before swapping
them, and stops at the first assignment that matches. In ``add(a, b)`` where both ``a``
and ``b`` are convolution outputs (MobileNetV2's first residual of a stage adds two
projection convolutions), ``a`` was taken as the contraction and ``b`` as the residual; but
``a`` feeds the next block too, so that fusion is refused and no other is tried: the add
ran as its own kernel. Putting the operand used only by this add first lets the pattern
find the fusion that exists. Swapping the operands of a floating-point add is exact.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .exprs import static_shape


@relax.expr_functor.mutator
class _SingleUseFirst(relax.PyExprMutator):
    _uses: dict = {}  # noqa: RUF012 - replaced (not mutated) per dataflow block

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self._uses = relax.analysis.udchain(block)
        return super().visit_dataflow_block_(block)

    def _only_here(self, var: relax.Expr) -> bool:
        return isinstance(var, relax.DataflowVar) and len(self._uses.get(var, [])) == 1

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", None) != "relax.add" or len(call.args) != 2:
            return call
        a, b = call.args
        if self._only_here(b) and not self._only_here(a) and static_shape(a) is not None \
                and static_shape(a) == static_shape(b):
            return relax.op.add(b, a)
        return call


@tvm.transform.module_pass(opt_level=0, name="tpp.OrderResidualOperands")
def OrderResidualOperands(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass name
    """In every dataflow block, ``add(a, b)`` of equal shapes becomes ``add(b, a)`` when
    ``b`` is used only there and ``a`` is not."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = _SingleUseFirst(mod).visit_expr(func)
    return relax.transform.Normalize()(mod)
