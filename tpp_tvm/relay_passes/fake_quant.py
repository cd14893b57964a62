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

from .canonicalize import rewrite_erf_gelu, rewrite_silu
from .exprs import bindings, const_value, dtype_of
from .report import LoweringReport

#: The Relax ops of contractions whose quantized input an int8 kernel takes.
CONTRACTION_OPS = frozenset({"relax.matmul", "relax.nn.conv2d", "relax.nn.conv1d"})


_FAKE_QUANT_DROPPED = "QDQ pair between fp32 ops dropped (fp32 value kept)"
_FAKE_QUANT_RELU = "quantization clipping at 0 shown as a ReLU (ONNX Runtime folds ReLU into it)"
_FAKE_QUANT_RELU6 = ("quantization clipping at 0 and 6 shown as a ReLU6 (ONNX Runtime folds "
                     "Clip(0, 6) into it)")


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
    products and sums of non-negative values, non-negative constants, a fake quantization
    that clips at 0: RegNetY's squeeze-excitation product of a ReLU output, so quantized,
    and a sigmoid took a ReLU kernel of its own before its quantize, 0.5 ms of 7.6)."""
    if _clipped_at_zero(expr, bound):
        return True
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


def _clipped_at_zero(expr: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> bool:
    """Whether ``expr`` is a fake quantization (``dequantize(quantize(x))``, possibly
    several) one of whose quantizations clips at 0: its values are then >= 0."""
    expr = bound.get(expr, expr)
    while isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
            and expr.op.name == "relax.dequantize":
        inner = bound.get(expr.args[0], expr.args[0])
        if not (isinstance(inner, relax.Call) and inner.op.name == "relax.quantize"):
            return False
        if _clips_at_zero(inner):
            return True
        expr = bound.get(inner.args[0], inner.args[0])
    return False


def _clips_at_zero(quantize: relax.Call) -> bool:
    """Whether a quantize's zero point is its dtype's minimum: its range starts at 0."""
    zp = const_value(quantize.args[2])
    lowest = {"uint8": 0, "int8": -128}.get(dtype_of(quantize))
    return zp is not None and lowest is not None and zp.size > 0 and bool(np.all(zp == lowest))


def _within_relu6(expr: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> bool:
    """Whether ``expr`` is ``min(max(x, 0), 6)``, or reads one (or a [0, 6] quantization,
    which this pass clips) through fake-quantization pairs and zero pads (MobileNetV2
    quantizes a ReLU6 output, then its padded copy)."""
    expr = bound.get(expr, expr)
    while isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        name = expr.op.name
        if name == "relax.nn.pad" and float(expr.attrs.pad_value) == 0.0:
            expr = bound.get(expr.args[0], expr.args[0])
        elif name == "relax.dequantize":
            inner = bound.get(expr.args[0], expr.args[0])
            if not (isinstance(inner, relax.Call) and inner.op.name == "relax.quantize"):
                return False
            if _clips_at_zero(inner) and _clips_at_six(inner):
                return True
            expr = bound.get(inner.args[0], inner.args[0])
        else:
            break
    if not (isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.minimum"):
        return False
    top = const_value(expr.args[1])
    if top is None or top.size != 1 or float(top.reshape(-1)[0]) > 6.0:
        return False
    inner = bound.get(expr.args[0], expr.args[0])
    if isinstance(inner, relax.Var):
        # bound by rewrite_call's normalization of this pass's own min(max(x, 0), 6): the
        # pattern matches its output again, with the nested call now a new variable
        return inner not in bound
    low = None
    if isinstance(inner, relax.Call) and getattr(inner.op, "name", "") == "relax.maximum":
        low = const_value(inner.args[1])
    return low is not None and low.size == 1 and float(low.reshape(-1)[0]) >= 0.0


def _clips_at_six(quantize: relax.Call) -> bool:
    """Whether a quantize's range (which starts at 0) ends at 6: a ReLU6 (Clip(0, 6))
    ONNX Runtime folded into it, whose bounds set the scale (MobileNetV2: 35 of them); a
    calibrated range ends anywhere."""
    scale, zp = const_value(quantize.args[1]), const_value(quantize.args[2])
    highest = {"uint8": 255, "int8": 127}.get(dtype_of(quantize))
    if scale is None or zp is None or scale.size != 1 or zp.size != 1 or highest is None:
        return False
    top = (highest - float(zp.reshape(-1)[0])) * float(scale.reshape(-1)[0])
    return abs(top - 6.0) <= 1e-6 * 6.0


def expose_folded_relus(func: relax.Function, report: LoweringReport) -> relax.Function:
    """``quantize(x)`` -> ``quantize(relu(x))`` where the quantization clips at 0 and x
    may be negative (``relu6``, ``min(max(x, 0), 6)``, where it also clips at 6): the same
    values (quantize saturates), with the ReLU or ReLU6 that ONNX Runtime folded into the
    range visible again, so it fuses into the epilogue of the contraction that produces x
    (and the residual add's ReLU of a ResNet block with it), and stays when the pair is
    dropped (MobileNetV2's activations past 6 made its output 2.7x further from fp32 than
    ONNX Runtime's int8 result)."""
    bound = bindings(func)
    x = wildcard()
    pattern = is_op("relax.quantize")(x, wildcard(), wildcard())

    def rewrite(orig, m):
        if dtype_of(m[x]) != "float32" or not _clips_at_zero(orig):
            return orig
        if _clips_at_six(orig):
            if _within_relu6(m[x], bound):  # its own output, matched again, or a pad of one
                return orig
            report.rewrites[_FAKE_QUANT_RELU6] += 1
            clipped = relax.op.minimum(relax.op.maximum(m[x], relax.const(0.0, "float32")),
                                       relax.const(6.0, "float32"))
        elif _non_negative(m[x], bound):
            return orig
        else:
            report.rewrites[_FAKE_QUANT_RELU] += 1
            clipped = relax.op.nn.relu(m[x])
        return relax.op.quantize(clipped, orig.args[1], orig.args[2],
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
    bound = bindings(func)

    def rewrite(orig, m):
        if dtype_of(m[x]) != "float32" or dtype_of(orig) != "float32":
            return orig
        report.rewrites[_FAKE_QUANT_DROPPED] += 1
        return _rounded_value(orig, bound)

    return rewrite_call(pattern, rewrite, func)


def _rounded_value(dequantize: relax.Call, bound: dict[relax.Var, relax.Expr]) -> relax.Expr:
    """The value ``dequantize(quantize(x))`` rounds, as the quantize names it (the variable
    bound to x): the matched expression itself, returned for each pair reading x, would
    compute x once per reader (EfficientNet's SiLU, ``x * sigmoid(x)``, ran its
    convolution twice)."""
    q = dequantize.args[0]
    q = bound.get(q, q)
    return q.args[0]


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
    kept = _quantized_residuals(bound)
    found = []
    for var, value in bound.items():
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name == "relax.dequantize" and isinstance(value.args[0], relax.Var)):
            continue
        source = bound.get(value.args[0])
        if not (isinstance(source, relax.Call) and source.op.name == "relax.quantize"):
            continue
        if consumers.get(var) and consumers[var] <= _ELEMENTWISE and var not in kept:
            found.append(value)
    return found


def _contraction_output(expr: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> bool:
    """Whether ``expr`` is a contraction's result, or it plus something (the bias, which
    QDQ quantizes too)."""
    value = bound.get(expr, expr)
    if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.add":
        value = bound.get(value.args[0], value.args[0])
    return isinstance(value, relax.Call) and getattr(value.op, "name", "") in CONTRACTION_OPS


def _quantized_residuals(bound: dict[relax.Var, relax.Expr]) -> set[relax.Var]:
    """The second operand of each ``add(dq(q(conv1)), dq(q(conv2)))``: a ResNet stage's
    first block adds its downsampling shortcut's quantized output to its last convolution's.
    That pair stays, so the last convolution's int8 kernel adds the shortcut's u8/s8 output
    as its residual (``quantized.py``) and the shortcut writes u8/s8 (a quarter of the
    bytes); the first pair goes, so the kernel's own result is the fp32 value."""
    kept = set()
    for value in bound.values():
        if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.add"):
            continue
        pairs = [bound.get(a) for a in value.args]
        if all(isinstance(p, relax.Call) and p.op.name == "relax.dequantize"
               and isinstance(bound.get(p.args[0]), relax.Call)
               and bound[p.args[0]].op.name == "relax.quantize"
               and _contraction_output(bound[p.args[0]].args[0], bound) for p in pairs):
            kept.add(value.args[1])
    return kept


def drop_elementwise_fake_quantization(func: relax.Function, report: LoweringReport
                                       ) -> relax.Function:
    """Before the matmul rewrite: drop the QDQ pairs that only element-wise ops consume.

    Static QDQ rounds a matmul's output, and each step of the GELU after it, to the int8
    grid; with those pairs in place the GELU is not recognised and cannot fuse into the
    int8 GEMM's epilogue (it ran as a separate kernel: 0.43 ms of a 4.4 ms MLP). Likewise
    a SiLU written ``x * sigmoid(x)`` (EfficientNet's): unrecognised, its convolution ran
    twice, once per reader of x, then a multiply on TVM's default code. The pairs
    in front of a matmul stay: they are the int8 kernel's input.
    """
    if not isinstance(func.body, relax.SeqExpr):
        return func
    drop = _elementwise_only_dequantizes(func)
    if not drop:
        return func
    x = wildcard()
    pattern = _fake_quantized(x)

    bound = bindings(func)

    def rewrite(orig, m):
        if dtype_of(m[x]) != "float32" or not any(orig.same_as(d) for d in drop):
            return orig
        report.rewrites[_FAKE_QUANT_DROPPED] += 1
        return _rounded_value(orig, bound)

    return rewrite_silu(rewrite_erf_gelu(rewrite_call(pattern, rewrite, func)))


MAX_POOL_QUANTIZED = "max pooling runs on the quantized values (quantizing commutes with it)"


def quantize_before_max_pool(func: relax.Function, report: LoweringReport) -> relax.Function:
    """``quantize(max_pool(x))`` -> ``max_pool(quantize(x))`` (a ReLU between goes in front
    of the quantize), per tensor with a positive scale: quantizing is monotone and
    saturates the padding's lowest value to the dtype's, so the two are equal. The layer
    producing x (ResNet's stem convolution) then writes u8/s8 itself and the pooling reads
    a quarter of the bytes (1.0 of ResNet-50's 10 ms int8 run was its fp32 max pool, the
    ReLU after it and the quantize kernel)."""
    x = wildcard()
    pool = is_op("relax.nn.max_pool2d")(x)
    relu = is_op("relax.nn.relu")(pool)
    pattern = is_op("relax.quantize")(pool | relu, wildcard(), wildcard())

    def rewrite(orig, m):
        scale, zero = (const_value(a) for a in orig.args[1:3])
        if dtype_of(m[x]) != "float32" or scale is None or zero is None or scale.size != 1 \
                or zero.size != 1 or not float(scale.reshape(-1)[0]) > 0:
            return orig
        inner = m[x]
        if relu in m and not _clips_at_zero(orig):  # else the quantize clips at 0 itself
            inner = relax.op.nn.relu(inner)
        q = relax.op.quantize(inner, orig.args[1], orig.args[2], axis=int(orig.attrs.axis),
                              out_dtype=dtype_of(orig))
        at = m[pool].attrs
        report.rewrites[MAX_POOL_QUANTIZED] += 1
        return relax.op.nn.max_pool2d(q, at.pool_size, at.strides, at.padding, at.dilation,
                                      bool(at.ceil_mode), bool(at.count_include_pad),
                                      str(at.layout), str(at.out_layout))

    return rewrite_call(pattern, rewrite, func)
