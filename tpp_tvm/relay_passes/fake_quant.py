"""Static QDQ's fake quantization between fp32 ops: what it stands for, and dropping it.

``quantize_static`` (QDQ format) wraps every op in ``dequantize(quantize(x))``. In front of
a matmul or convolution the pair is the int8 kernel's input (``quantized.py`` takes it);
everywhere else it only rounds an fp32 value to the int8 grid, except that a pair whose
range starts at 0 also stands for a ReLU ONNX Runtime folded into it. These passes keep that
ReLU and drop the rounding, so element-wise chains fuse into TPP kernels.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .canonicalize import rewrite_erf_gelu
from .exprs import bindings, const_value, dtype_of
from .lower import LoweringReport

#: The Relax ops of contractions whose quantized input an int8 kernel takes.
CONTRACTION_OPS = frozenset({"relax.matmul", "relax.nn.conv2d", "relax.nn.conv1d"})


_FAKE_QUANT_DROPPED = "QDQ pair between fp32 ops dropped (fp32 value kept)"
_FAKE_QUANT_RELU = "quantization clipping at 0 shown as a ReLU (ONNX Runtime folds ReLU into it)"


def _fake_quantized(x):
    """``dequantize(quantize(x))``: static QDQ rounding an fp32 value to the int8 grid."""
    q = is_op("relax.quantize")(x, wildcard(), wildcard())
    return is_op("relax.dequantize")(q, wildcard(), wildcard())


#: Ops whose result is never negative, and ops bounded to [-1, 1].
_NON_NEGATIVE = frozenset({"relax.nn.relu", "relax.sigmoid", "relax.exp", "relax.sqrt",
                           "relax.nn.softmax"})
_UNIT_BOUNDED = frozenset({"relax.erf", "relax.tanh"})


def _unwrapped(expr: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> relax.Expr:
    """The value behind ``expr``: variables resolved, fake-quantization pairs skipped."""
    expr = bound.get(expr, expr)
    while isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
            and expr.op.name == "relax.dequantize":
        inner = bound.get(expr.args[0], expr.args[0])
        if not (isinstance(inner, relax.Call) and inner.op.name == "relax.quantize"):
            break
        expr = bound.get(inner.args[0], inner.args[0])
    return expr


def _non_negative(expr: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> bool:
    """Whether ``expr`` is provably >= 0 (a small syntactic check: GELU's ``1 + erf(.)``,
    products and sums of non-negative values, non-negative constants)."""
    expr = _unwrapped(expr, bound)
    value = const_value(expr)
    if value is not None:
        return bool(np.all(value >= 0))
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return False
    op, args = expr.op.name, expr.args
    if op in _NON_NEGATIVE:
        return True
    if op in ("relax.multiply", "relax.add", "relax.nn.max_pool2d", "relax.mean"):
        if all(_non_negative(a, bound) for a in args):
            return True
    if op == "relax.add":  # c + erf(.) with c >= 1
        for a, b in (args, args[::-1]):
            c, other = const_value(_unwrapped(a, bound)), _unwrapped(b, bound)
            if c is not None and np.all(c >= 1) and isinstance(other, relax.Call) \
                    and isinstance(other.op, tvm.ir.Op) and other.op.name in _UNIT_BOUNDED:
                return True
    return False


def _clips_at_zero(quantize: relax.Call) -> bool:
    """Whether a quantize's zero point is its dtype's minimum: its range starts at 0."""
    zp = const_value(quantize.args[2])
    lowest = {"uint8": 0, "int8": -128}.get(dtype_of(quantize))
    return zp is not None and lowest is not None and zp.size > 0 and bool(np.all(zp == lowest))


def expose_folded_relus(func: relax.Function, report: LoweringReport) -> relax.Function:
    """``quantize(x)`` -> ``quantize(relu(x))`` where the quantization clips at 0 and x
    may be negative: the same values (quantize saturates), with the ReLU that ONNX
    Runtime folded into the range visible again, so it fuses into the epilogue of the
    contraction that produces x (and the residual add's ReLU of a ResNet block with it)."""
    bound = bindings(func)
    x = wildcard()
    pattern = is_op("relax.quantize")(x, wildcard(), wildcard())

    def rewrite(orig, m):
        if dtype_of(m[x]) != "float32" or not _clips_at_zero(orig) or _non_negative(m[x], bound):
            return orig
        report.rewrites[_FAKE_QUANT_RELU] += 1
        return relax.op.quantize(relax.op.nn.relu(m[x]), orig.args[1], orig.args[2],
                                 axis=int(orig.attrs.axis), out_dtype=dtype_of(orig))

    return rewrite_call(pattern, rewrite, func)


def drop_fake_quantization(func: relax.Function, report: LoweringReport) -> relax.Function:
    """``dequantize(quantize(x, s, z), s, z)`` -> ``x`` where no int8 kernel consumes it.

    Static QDQ models wrap every op (GELU's Div, Erf, Add, Mul...) in fake quantization;
    run after the matmul rewrite (which takes the quantized tensors it needs), the pairs
    left only round an fp32 value to the int8 grid and back. Dropping them keeps the exact
    fp32 value (closer to the fp32 model than ONNX Runtime's int8 result) and lets the
    element-wise chain fuse into TPP kernels instead of running per element in TVM. A pair
    that clips at 0 stands for a ReLU, which :func:`expose_folded_relus` has put in front
    of its quantize already.
    """
    x = wildcard()
    pattern = _fake_quantized(x)

    def rewrite(orig, m):
        if dtype_of(m[x]) != "float32" or dtype_of(orig) != "float32":
            return orig
        report.rewrites[_FAKE_QUANT_DROPPED] += 1
        return m[x]

    return rewrite_call(pattern, rewrite, func)


#: Ops a fake-quantized value may feed and still be dropped before the matmul rewrite:
#: element-wise math (GELU's Div, Erf, Add, Mul...), never a matmul or convolution, whose
#: quantized input an int8 kernel (or TVM's QDQ lowering) consumes.
_ELEMENTWISE = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.erf",
    "relax.tanh", "relax.sigmoid", "relax.exp", "relax.sqrt", "relax.power",
    "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh",
    # pooling commutes with the ReLU a pair may stand for, which then fuses before it
    "relax.nn.max_pool2d", "relax.mean",
})


def _elementwise_only_dequantizes(func: relax.Function) -> list[relax.Call]:
    """The ``dequantize(quantize(x))`` calls whose every consumer is element-wise, if the
    function has a quantized matmul at all (else none: nothing to fuse into)."""
    bound: dict[relax.Var, relax.Expr] = {}
    consumers: dict[relax.Var, set[str]] = {}
    has_qdq_contraction = False
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            bound[binding.var] = value
            if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
                continue
            for arg in value.args:
                if isinstance(arg, relax.Var):
                    consumers.setdefault(arg, set()).add(value.op.name)
            if value.op.name in CONTRACTION_OPS and isinstance(value.args[0], relax.Var):
                lhs = bound.get(value.args[0])
                has_qdq_contraction |= isinstance(lhs, relax.Call) and \
                    lhs.op.name == "relax.dequantize"
    if not has_qdq_contraction:
        return []
    found = []
    for var, value in bound.items():
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name == "relax.dequantize" and isinstance(value.args[0], relax.Var)):
            continue
        source = bound.get(value.args[0])
        if not (isinstance(source, relax.Call) and source.op.name == "relax.quantize"):
            continue
        if consumers.get(var) and consumers[var] <= _ELEMENTWISE:
            found.append(value)
    return found


def drop_elementwise_fake_quantization(func: relax.Function, report: LoweringReport
                                       ) -> relax.Function:
    """Before the matmul rewrite: drop the QDQ pairs that only element-wise ops consume.

    Static QDQ rounds a matmul's output, and each step of the GELU after it, to the int8
    grid; with those pairs in place the GELU is not recognised and cannot fuse into the
    int8 GEMM's epilogue (it ran as a separate kernel: 0.43 ms of a 4.4 ms MLP). The pairs
    in front of a matmul stay: they are the int8 kernel's input.
    """
    if not isinstance(func.body, relax.SeqExpr):
        return func
    drop = _elementwise_only_dequantizes(func)
    if not drop:
        return func
    x = wildcard()
    pattern = _fake_quantized(x)

    def rewrite(orig, m):
        if dtype_of(m[x]) != "float32" or not any(orig.same_as(d) for d in drop):
            return orig
        report.rewrites[_FAKE_QUANT_DROPPED] += 1
        return m[x]

    return rewrite_erf_gelu(rewrite_call(pattern, rewrite, func))
