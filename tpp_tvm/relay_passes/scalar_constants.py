"""Fold what TVM's ``FoldConstant`` leaves: casts of constants and arithmetic on scalars.

Relax's ``FoldConstant`` (TVM 0.27) never folds an op whose result is 0-d, so a chain that
starts from a scalar constant stays in the graph: ONNX's ``MatMulInteger`` with a weight
zero point of 0 imports as ``W_q - int32(0)``, and because ``int32(0)`` is never folded the
weight is not a constant when the TPP patterns look for one (a dynamically quantized MLP's
4096x4096 layer ran as a matmul of activations, its weight re-read unpacked on every call:
2.3x slower than the same layer in fp32). Nor does it fold ``arange`` (its bounds are
immediates, not tensors), from which a traced model computes position ids and masks at
run time (transformers' ViT through ``torch.export``: an attention mask of zeros, built
from ``arange >= 0`` on every call). These ops are evaluated here with numpy instead;
``FoldConstant`` then folds what depended on them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from .exprs import dtype_of

#: Longest ``arange`` made a constant (a longer one is cheaper to compute than to store).
MAX_ARANGE = 1 << 16

#: Elementwise ops evaluated on constants, with numpy's meaning equal to Relax's.
_NUMPY_OPS: dict[str, Callable[..., np.ndarray]] = {
    "relax.add": np.add,
    "relax.subtract": np.subtract,
    "relax.multiply": np.multiply,
    "relax.maximum": np.maximum,
    "relax.minimum": np.minimum,
    "relax.negative": np.negative,
}


@relax.expr_functor.mutator
class _ScalarConstantFolder(relax.PyExprMutator):
    """Casts of constants (any shape) and :data:`_NUMPY_OPS`/float division on 0-d
    constants, evaluated; everything else left alone."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.folded = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        value = self._evaluate(call)
        if value is None:
            return call
        self.folded += 1
        return relax.const(value, dtype_of(call))

    def _evaluate(self, call: relax.Call) -> np.ndarray | None:
        name = getattr(call.op, "name", "")
        if name == "relax.arange":
            return _arange(call)
        if name not in _NUMPY_OPS and name not in ("relax.astype", "relax.divide"):
            return None
        values = [_tensor_value(self.lookup(arg)) for arg in call.args]
        if not values or any(v is None for v in values):
            return None
        out_dtype = dtype_of(call)
        if name == "relax.astype":
            return np.asarray(values[0]).astype(out_dtype)
        if any(v.ndim for v in values):  # shaped arithmetic: FoldConstant's job
            return None
        if name == "relax.divide" and "float" in out_dtype:
            return np.asarray(np.divide(*values)).astype(out_dtype)
        op = _NUMPY_OPS.get(name)
        return None if op is None else np.asarray(op(*values)).astype(out_dtype)

    def lookup(self, expr: relax.Expr) -> relax.Expr:
        """A variable's bound value (a folded scalar is a constant bound to a variable)."""
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            return bound if bound is not None else expr
        return expr


def _arange(call: relax.Call) -> np.ndarray | None:
    """``arange(start, end, step)`` with static bounds, evaluated (at most MAX_ARANGE)."""
    bounds = []
    for arg in call.args:
        if not isinstance(arg, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
            return None
        bounds.append(arg.value)
    if len(bounds) != 3 or bounds[2] == 0:
        return None
    values = np.arange(*bounds).astype(dtype_of(call))
    return values if values.size <= MAX_ARANGE and list(values.shape) == \
        [int(n) for n in call.ty.shape] else None


def _tensor_value(expr: relax.Expr) -> np.ndarray | None:
    """A tensor constant's value (not a PrimValue's or a shape's)."""
    value = expr.value if isinstance(expr, tvm.ir.Constant) else None
    return value.numpy() if hasattr(value, "numpy") else None


def fold_scalar_constants(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """``mod`` with casts of constants and scalar constant arithmetic evaluated; how many
    ops were folded."""
    folder = _ScalarConstantFolder(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            folder.builder_.update_func(gv, folder.visit_expr(func))
    return folder.builder_.get(), folder.folded
