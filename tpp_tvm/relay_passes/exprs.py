"""Small readers of Relax expressions shared by the graph passes: static shape, dtype,
constant value, and what each variable of a function is bound to."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def shape_of(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def dtype_of(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def const_value(expr: relax.Expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.Constant) else None


def bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """Each variable of ``func``'s body and the value bound to it."""
    if not isinstance(func.body, relax.SeqExpr):
        return {}
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}
