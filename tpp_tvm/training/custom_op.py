"""User-defined operators from TE expressions, with derived gradients, usable in training.

``op = tpp_tvm.custom_op("swiglu", lambda a, b: te.compute(...))`` gives an operator that a
Relax model calls like any op (``op(bb, a, b)``); its forward kernel is the TE computation
and its gradient is derived from the expression (``autodiff.py``) and registered with Relax's
``call_tir_with_grad`` mechanism, so ``Gradient`` (and ``compile_training_step``) handle it.
Forward and gradient kernels are compiled by the ``tpp`` pipeline's schedules: element-wise
parts become parallel 16-wide vector loops; contractions get the reduction schedules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from tvm import relax, te
from tvm.relax.training.utils import register_te_gradient

from ..errors import UnsupportedOperatorError
from .autodiff import gradient

_ids = itertools.count()


class CustomOp:
    """An operator defined by ``fcompute(*te_tensors) -> te.Tensor``, with its gradient."""

    def __init__(self, name: str, fcompute: Callable[..., te.Tensor]) -> None:
        if not name.isidentifier():
            raise UnsupportedOperatorError(f"custom op name {name!r} must be an identifier")
        self.name = name
        self.fcompute = fcompute
        # One registration per op object: two ops may share a display name.
        self.grad_name = f"tpp_tvm.custom.{name}.{next(_ids)}"
        register_te_gradient(self.grad_name, self.gradient)

    def gradient(self, dy: te.Tensor, *inputs: te.Tensor) -> list[te.Tensor]:
        """dL/d input for each input, given dL/d output = ``dy`` (derived, not written)."""
        out = self.fcompute(*inputs)
        if not isinstance(out, te.Tensor):
            raise UnsupportedOperatorError(
                f"custom op {self.name}: fcompute must return one te.Tensor, got "
                f"{type(out).__name__}")
        return gradient(out, list(inputs), dy, self.name)

    def __call__(self, bb: relax.BlockBuilder, *args: relax.Expr) -> relax.Var:
        """Emit the operator on Relax tensors ``args`` inside ``bb``'s dataflow block."""
        args = [a if isinstance(a, relax.Var) else bb.emit(a) for a in args]
        return bb.emit(bb.call_te_with_grad(self.fcompute, *args, te_grad_name=self.grad_name,
                                            primfunc_name_hint=self.name))


def custom_op(name: str, fcompute: Callable[..., te.Tensor]) -> CustomOp:
    """A new operator from a TE expression; its gradient is derived automatically.

    ``fcompute`` takes one ``te.Tensor`` per operand and returns the output tensor built
    with ``te.compute`` (element-wise, or one ``te.sum`` reduction; intermediate element-wise
    stages are fine). Use the result inside a model: ``y = op(bb, a, b)``.
    """
    return CustomOp(name, fcompute)
