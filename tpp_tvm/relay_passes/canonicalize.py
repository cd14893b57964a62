"""Recognise decomposed activations that exporters emit, so patterns see one op.

torch's ONNX export (opset < 20) writes GELU as ``x * (erf(x / sqrt 2) + 1) * 0.5`` (and
the tanh form as its polynomial); TVM's converter keeps that as five element-wise ops.
Rewriting the chain back into ``R.nn.gelu`` lets the TPP patterns fuse it into a GEMM
epilogue as one GELU TPP, and even unfused it becomes one kernel instead of five.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard


def _const_value(expr: relax.Expr) -> float | None:
    if isinstance(expr, tvm.ir.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def _erf_gelu_pattern():
    x = wildcard()
    c_div = is_const()
    c_one = is_const()
    c_half = is_const()
    erf = is_op("relax.erf")(is_op("relax.divide")(x, c_div))
    cdf = is_op("relax.add")(erf, c_one)
    pattern = is_op("relax.multiply")(is_op("relax.multiply")(x, cdf), c_half)
    return pattern, x, c_div, c_one, c_half


def rewrite_erf_gelu(func: relax.Function) -> relax.Function:
    """``x * (erf(x / sqrt2) + 1) * 0.5`` → ``R.nn.gelu(x)`` when the constants match."""
    pattern, x, c_div, c_one, c_half = _erf_gelu_pattern()

    def rewriter(orig, m):
        vals = [_const_value(m[c]) for c in (c_div, c_one, c_half)]
        if None in vals:
            return orig
        div, one, half = vals
        if abs(div - math.sqrt(2.0)) > 1e-5 or abs(one - 1.0) > 1e-7 or abs(half - 0.5) > 1e-7:
            return orig
        return relax.op.nn.gelu(m[x])

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tpp.CanonicalizeActivations")
def CanonicalizeActivations(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass name
    """Apply the activation rewrites to every Relax function of the module."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite_erf_gelu(func)
    return mod
