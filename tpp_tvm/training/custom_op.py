"""User-defined operators from TE expressions, with derived gradients, usable in training.

``op = tpp_tvm.custom_op("swiglu", lambda a, b: te.compute(...))`` gives an operator that a
Relax model calls like any op (``op(bb, a, b)``); its forward kernel is the TE computation
and its gradient is derived from the expression (``autodiff.py``) and registered with Relax's
``call_tir_with_grad`` mechanism, so ``Gradient`` (and ``compile_training_step``) handle it.
Contractions (``Σ_k c·U·V`` of two operands, batched or not, either operand transposed) are
tagged and become TPP GEMM kernels in the ``tpp`` pipeline (``relay_passes/lower.py``); each
input gradient is its own kernel so dQ = dS K and dK = dSᵀ Q are GEMMs too; element-wise
parts get the default parallel, vectorized schedules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import tvm_ffi
from tvm import relax, te

from ..errors import UnsupportedOperatorError
from .autodiff import contraction_of, gradient

#: Where Relax's Gradient pass looks up ``call_tir_with_grad`` gradients.
_GRAD_PREFIX = "tvm.relax.te_grad._register."


def _contraction_attrs(out: te.Tensor, inputs: list[te.Tensor]) -> dict | None:
    """PrimFunc attributes marking a (batched) GEMM for the ``tpp`` pipeline (or None)."""
    found = contraction_of(out, inputs)
    return {"tpp.contraction": found} if found else None

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
        tvm_ffi.register_global_func(_GRAD_PREFIX + self.grad_name, self._emit_gradient)

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
        ins = [te.placeholder([int(d) for d in a.ty.shape.values], a.ty.dtype, name=f"in{i}")
               for i, a in enumerate(args)]
        return bb.emit(bb.call_te_with_grad(
            self.fcompute, *args, te_grad_name=self.grad_name, primfunc_name_hint=self.name,
            primfunc_attrs=_contraction_attrs(self.fcompute(*ins), ins)))

    def _emit_gradient(self, orig_var, call, output_grad, ctx: relax.BlockBuilder):
        """Relax's hook for ``call_tir_with_grad``: one kernel per input gradient, so each
        contraction among them can become its own GEMM (tagged ``tpp.contraction``)."""
        args = [output_grad, *call.args[1]]
        outs = []
        for i in range(len(call.args[1])):
            def one(dy, *inputs, i=i):
                return self.gradient(dy, *inputs)[i]

            ins = [te.placeholder([int(d) for d in a.ty.shape.values], a.ty.dtype,
                                  name=f"in{j}") for j, a in enumerate(args)]
            attrs = _contraction_attrs(one(*ins), ins)
            outs.append(ctx.emit(ctx.call_te(one, *args, primfunc_attrs=attrs,
                                             primfunc_name_hint=f"{self.name}_grad{i}")))
        return ctx.emit(relax.Tuple(outs))


def custom_op(name: str, fcompute: Callable[..., te.Tensor]) -> CustomOp:
    """A new operator from a TE expression; its gradient is derived automatically.

    ``fcompute`` takes one ``te.Tensor`` per operand and returns the output tensor built
    with ``te.compute`` (element-wise, or one ``te.sum`` reduction; intermediate element-wise
    stages are fine). Use the result inside a model: ``y = op(bb, a, b)``.
    """
    return CustomOp(name, fcompute)
