"""Small readers of Relax expressions shared by the graph passes: static shape, dtype,
constant value, what each variable of a function is bound to and how often it is read."""

from __future__ import annotations

from collections import Counter

import numpy as np
import tvm
from tvm import relax


def shape_of(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def static_shape(expr: relax.Expr) -> list[int] | None:
    """The static shape of a tensor-typed expression; None if dynamic or not a tensor."""
    ty = getattr(expr, "ty", None)
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(d, tvm.tirx.IntImm) for d in values):
        return None
    return [int(d) for d in values]


def dtype_of(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def const_value(expr: relax.Expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.Constant) else None


def scalar_value(expr: relax.Expr) -> float | None:
    """The value of a one-element constant; None for anything else."""
    value = const_value(expr)
    return float(value.reshape(())) if value is not None and value.size == 1 else None


def bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """Each variable of ``func``'s body and the value bound to it."""
    if not isinstance(func.body, relax.SeqExpr):
        return {}
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}


def use_counts(func: relax.Function) -> Counter:
    """How many times each variable of ``func`` is read (bindings and the result)."""
    counts: Counter = Counter()

    @relax.expr_functor.visitor
    class _Reads(relax.PyExprVisitor):
        def visit_var_(self, var: relax.Var) -> None:
            counts[var] += 1

        def visit_dataflow_var_(self, var: relax.DataflowVar) -> None:
            counts[var] += 1

    _Reads().visit_expr(func)
    return counts


def ints(values) -> list[int]:
    """An attribute's integer array as Python ints."""
    return [int(v) for v in values]


def out_dtype(attrs) -> str | None:
    """An operator's ``out_dtype`` attribute, None where it is unset."""
    dtype = str(attrs.out_dtype)
    return None if dtype in ("", "None", "void") else dtype


def conv_layouts(attrs, data: str, kernel: str) -> bool:
    """A convolution in ``data``/``kernel`` layouts whose output keeps ``data``'s."""
    return str(attrs.data_layout) == data and str(attrs.kernel_layout) == kernel \
        and str(attrs.out_layout) in ("", data)
