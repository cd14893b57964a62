"""The TPP pattern table: which Relax subgraphs become one TPP kernel.

Patterns are data (name, dataflow pattern, check), as in TVM's ``relax/backend/patterns.py``:
adding a fused subgraph is one entry here plus one lowering in ``lower.py``. Names read
``tpp.<kernel>[_bias][_<activation>][_residual]``; the order of the table is the matching
priority (the most fused variant first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

#: Relax activation op -> unary TPP op it lowers onto.
ACTIVATIONS: dict[str, str] = {
    "relax.nn.relu": "relu",
    "relax.nn.gelu": "gelu",
    "relax.nn.gelu_tanh": "gelu_tanh",
    "relax.sigmoid": "sigmoid",
    "relax.tanh": "tanh",
}


@dataclass(frozen=True)
class TPPPattern:
    """One fusable subgraph: a name, its dataflow pattern and a check on the match."""

    name: str
    pattern: DFPattern
    annotations: dict[str, DFPattern]
    check: Callable[[relax.transform.PatternCheckContext], bool]
    activation: str | None = None  # the unary TPP of the epilogue, if any

    def as_fusion_pattern(self) -> tuple:
        return (self.name, self.pattern, self.annotations, self.check)


def _static_f32(expr: relax.Expr) -> bool:
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.dtype != "float32":
        return False
    shape = ty.shape
    return shape is not None and all(isinstance(d, tvm.tirx.IntImm) for d in shape.values)


def _dense_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A dense layer we have kernels for: fp32, static shapes, weight a 2D constant."""
    a = ctx.annotated_expr
    lhs, weight = a["lhs"], a["weight"]
    if not (_static_f32(lhs) and _static_f32(weight) and len(weight.ty.shape.values) == 2):
        return False
    n = int(weight.ty.shape.values[1])
    if "bias" in a:
        bias = a["bias"]
        shape = [int(d) for d in bias.ty.shape.values] if _static_f32(bias) else None
        if shape is None or shape[-1] != n or any(d != 1 for d in shape[:-1]):
            return False
    if "residual" in a and not _static_f32(a["residual"]):
        return False
    if "residual" in a:
        out_shape = [int(d) for d in a["root"].ty.shape.values]
        if [int(d) for d in a["residual"].ty.shape.values] != out_shape:
            return False
    return True


def dense_pattern(bias: bool, activation: str | None, residual: bool) -> TPPPattern:
    """``matmul(x, W const)`` (+ bias const) (+ activation) (+ residual)."""
    lhs, weight = wildcard(), is_const()
    out = is_op("relax.matmul")(lhs, weight)
    ann = {"lhs": lhs, "weight": weight, "root": out}
    name = "tpp.dense"
    if bias:
        b = is_const()
        out = is_op("relax.add")(out, b)
        ann["bias"] = b
        name += "_bias"
    if activation:
        out = is_op(activation)(out)
        name += "_" + ACTIVATIONS[activation]
    if residual:
        r = wildcard()
        out = is_op("relax.add")(out, r)
        ann["residual"] = r
        name += "_residual"
    ann["out"] = out
    return TPPPattern(name, out, ann, _dense_check, ACTIVATIONS.get(activation))


def _bmm_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A batched matmul of two activations with the same static batch dims (attention)."""
    a = ctx.annotated_expr
    lhs, rhs = a["lhs"], a["rhs"]
    if not (_static_f32(lhs) and _static_f32(rhs)):
        return False
    ls, rs = lhs.ty.shape.values, rhs.ty.shape.values
    if len(ls) < 3 or len(ls) != len(rs):
        return False
    return [int(d) for d in ls[:-2]] == [int(d) for d in rs[:-2]]


def bmm_pattern() -> TPPPattern:
    """``matmul(x, y)`` of two activations: one BRGEMM-based kernel per batch entry."""
    lhs, rhs = wildcard(), wildcard()
    out = is_op("relax.matmul")(lhs, rhs)
    return TPPPattern("tpp.bmm", out, {"lhs": lhs, "rhs": rhs, "root": out}, _bmm_check)


def pattern_table() -> list[TPPPattern]:
    """All TPP patterns in matching priority order."""
    table = []
    for residual in (True, False):
        for activation in (*ACTIVATIONS, None):
            for bias in (True, False):
                table.append(dense_pattern(bias, activation, residual))
    table.append(bmm_pattern())
    return table
