"""The converters tpp_tvm adds to TVM's ONNX importer, and the operator check.

:data:`EXTRA_CONVERTERS` holds converters for ONNX ops TVM's importer lacks (QLinearMatMul,
ConvInteger, LSTM, GRU) or converts into opaque ``call_tir`` kernels that no pattern or
layout pass can see through (Clip, HardSwish, HardSigmoid, Pad, InstanceNormalization,
Einsum, variadic Max/Min/Sum/Mean). Each takes ``(block builder, inputs, attributes)`` as
TVM's converters do; one returning None leaves the node to TVM's converter.

:func:`unsupported_nodes` checks a model against the converter's own op table
(``onnx_frontend._get_convert_map()``) plus this one, before any conversion: an operator TVM
cannot convert is reported with its type and node name instead of a failure deep inside TVM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx
import tvm

from tpp_tvm import onnx_recurrent
from tpp_tvm.errors import UnsupportedOperatorError

from . import cache_ops, contrib_attention, contrib_ops, weight_only
from .folding import subgraphs

# Operator domains whose ops TVM's converter knows by name (it ignores the domain, so a node of
# any other domain would silently be converted as the standard op of the same name).
_KNOWN_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})
# Ops TVM's importer converts outside its op table.
_DIRECT_OPS = frozenset({"If", "Constant"})


def _qlinear_matmul(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """QLinearMatMul as dequantize -> matmul -> quantize (what it computes, by its spec);
    ``relay_passes/quantized.py`` turns the dequantize -> matmul part into an int8 GEMM."""
    from tvm import relax

    a, sa, za, b, sb, zb, sy, zy = inputs

    def deq(x, s, z):
        per_axis = len(s.ty.shape.values) == 1 and int(s.ty.shape.values[0]) > 1
        axis = len(x.ty.shape.values) - 1 if per_axis else 0
        return relax.op.dequantize(x, s, z, axis=axis, out_dtype="float32")

    y = relax.op.matmul(deq(a, sa, za), deq(b, sb, zb))
    return relax.op.quantize(y, sy, zy, axis=0, out_dtype=str(zy.ty.dtype))


def _conv_integer(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """ConvInteger (``quantize_dynamic``'s convolution) as its spec states it: an int32
    convolution of ``x - x_zero_point`` and ``w - w_zero_point`` (padding the shifted input
    with 0 is padding x with its zero point). ``relay_passes/quantized.py`` turns it, with
    the scale multiply after it, into an int8 TPP convolution."""
    from tvm import relax
    from tvm.relax.frontend.onnx.onnx_frontend import Conv

    x, w, x_zp, w_zp = (list(inputs) + [None] * 4)[:4]
    x32 = relax.op.astype(x, "int32")
    if x_zp is not None:
        x32 = relax.op.subtract(x32, relax.op.astype(x_zp, "int32"))
    w32 = relax.op.astype(w, "int32")
    if w_zp is not None:  # scalar, or one per output channel
        zp = relax.op.astype(w_zp, "int32")
        if len(w_zp.ty.shape.values) == 1:
            zp = relax.op.reshape(zp, [-1] + [1] * (len(w.ty.shape.values) - 1))
        w32 = relax.op.subtract(w32, zp)
    return Conv._impl_v11(bb, [bb.normalize(x32), bb.normalize(w32), None], dict(attrs), {})


def _scalar(expr: Any) -> float | None:

    if isinstance(expr, tvm.ir.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def _clip(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """Clip with constant bounds as ``minimum(maximum(x, lo), hi)`` of scalar constants:
    TVM's converter emits two ``call_tir`` kernels that no pattern or layout pass can see
    through, so a ReLU6 after a convolution (MobileNet) could not fuse; ``R.clip`` itself
    has no layout rule, so ConvertLayout would wrap each one in transposes. None: TVM's
    converter does it."""
    from tvm import relax

    x = inputs[0]
    bounds = []
    for k, name, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        given = inputs[k] if len(inputs) > k else None
        value = _scalar(given) if given is not None else float(attrs.get(name, default))
        if value is None:
            return None
        bounds.append(value)
    if str(x.ty.dtype) != "float32":
        return None
    out = x
    if bounds[0] > -np.inf:
        out = bb.normalize(relax.op.maximum(out, relax.const(bounds[0], "float32")))
    if bounds[1] < np.inf:
        out = bb.normalize(relax.op.minimum(out, relax.const(bounds[1], "float32")))
    return out


def _pad(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """Constant-mode Pad with constant pads as ``R.nn.pad`` (TVM's converter emits a
    ``call_tir``), so ``relay_passes/canonical_forms.py`` can fold it into the convolution
    after it. None (TVM's converter) for other modes, computed or negative pads, axes."""
    from tvm import relax

    mode = attrs.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode != "constant" or len(inputs) < 2 or (len(inputs) > 3 and inputs[3] is not None):
        return None
    pads = inputs[1]
    if not isinstance(pads, tvm.ir.Constant):
        return None
    pads = [int(v) for v in pads.value.numpy().reshape(-1)]
    value = _scalar(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else 0.0
    rank = len(inputs[0].ty.shape.values)
    if value is None or len(pads) != 2 * rank or min(pads) < 0:
        return None
    if not any(pads):  # Hugging Face's MobileNetV2 pads even its 1x1 convolutions by 0
        return inputs[0]
    width = [v for i in range(rank) for v in (pads[i], pads[i + rank])]
    return bb.normalize(relax.op.nn.pad(inputs[0], width, "constant", value))


def _instance_norm(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """InstanceNormalization (torch's GroupNorm export; wav2vec2's feature extractor) as a
    layer norm over each (sample, channel) row, then the per-channel scale and bias: the
    row-wise layer-norm TPP instead of TVM's mean/variance reductions (7 ns an element).
    None (TVM's converter) unless x is a static fp32 tensor with constant scale and bias."""
    from tvm import relax

    x, scale, bias = inputs[:3]
    shape = [int(d) for d in x.ty.shape.values] if hasattr(x.ty, "shape") else None
    if (shape is None or len(shape) < 3 or str(x.ty.dtype) != "float32"
            or not isinstance(scale, tvm.ir.Constant) or not isinstance(bias, tvm.ir.Constant)):
        return None
    n, c, spatial = shape[0], shape[1], int(np.prod(shape[2:]))
    ones = relax.const(np.ones(spatial, "float32"))
    zeros = relax.const(np.zeros(spatial, "float32"))
    rows = bb.normalize(relax.op.reshape(x, (n * c, spatial)))
    normed = bb.normalize(relax.op.nn.layer_norm(rows, ones, zeros, axes=[-1],
                                                 epsilon=float(attrs.get("epsilon", 1e-5))))
    per_channel = (1, c) + (1,) * (len(shape) - 2)
    y = relax.op.multiply(relax.op.reshape(normed, shape),
                          relax.const(scale.value.numpy().reshape(per_channel)))
    return bb.normalize(relax.op.add(bb.normalize(y),
                                     relax.const(bias.value.numpy().reshape(per_channel))))


def _einsum(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """Einsum as ``R.einsum`` (TVM's converter emits a ``call_tir`` of TOPI's einsum), so
    ``relay_passes/canonical_forms.py`` can write a matrix product as a ``matmul``."""
    from tvm import relax

    equation = attrs.get("equation", b"")
    equation = equation.decode() if isinstance(equation, bytes) else str(equation)
    args = [x for x in inputs if x is not None]
    if not equation or not args:
        return None
    return bb.normalize(relax.op.einsum(relax.Tuple(args), equation))


def _variadic(binary: str, mean: bool = False) -> Callable[..., Any]:
    """Max/Min/Sum/Mean of N inputs as a chain of broadcasting binary ops. TVM's converter
    stacks the inputs into one tensor of rank + 1 and reduces it; ConvertLayout cannot map
    that rank onto NHWC and aborted the build (``Invalid SLayout``) whenever a convolution
    fed one (model-zoo residual adds written as ``Sum``)."""

    def convert(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
        from tvm import relax

        args = [x for x in inputs if x is not None]
        if not args:
            return None
        out = args[0]
        for x in args[1:]:
            out = bb.normalize(getattr(relax.op, binary)(out, x))
        if mean and len(args) > 1:
            dtype = str(out.ty.dtype)
            out = bb.normalize(relax.op.divide(out, relax.const(len(args), dtype)))
        return out

    return convert


def _hardswish(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """HardSwish as ``x * (min(max(x + 3, 0), 6) / 6)``: TVM's converter clips with
    ``R.clip``, an opaque kernel no epilogue pattern or layout pass sees through, so
    MobileNetV3's activations ran as kernels of their own after each convolution."""
    from tvm import relax

    x = inputs[0]
    if str(x.ty.dtype) != "float32":
        return None

    def c(value: float) -> Any:
        return relax.const(value, "float32")

    clipped = relax.op.minimum(relax.op.maximum(relax.op.add(x, c(3.0)), c(0.0)), c(6.0))
    return bb.normalize(relax.op.multiply(x, relax.op.divide(clipped, c(6.0))))


def _hardsigmoid(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """HardSigmoid as ``min(max(alpha x + beta, 0), 1)``, for the same reason as
    :func:`_hardswish` (squeeze-excite gates of mobile CNNs)."""
    from tvm import relax

    x = inputs[0]
    if str(x.ty.dtype) != "float32":
        return None
    alpha = relax.const(float(attrs.get("alpha", 0.2)), "float32")
    beta = relax.const(float(attrs.get("beta", 0.5)), "float32")
    linear = relax.op.add(relax.op.multiply(x, alpha), beta)
    return bb.normalize(relax.op.minimum(relax.op.maximum(linear, relax.const(0.0, "float32")),
                                         relax.const(1.0, "float32")))


#: Converters for ONNX ops TVM's importer lacks or converts into opaque kernels, by op
#: type; one returning None leaves the node to TVM's converter.
EXTRA_CONVERTERS: dict[str, Callable[..., Any]] = {
    "QLinearMatMul": _qlinear_matmul,
    "ConvInteger": _conv_integer,
    "Clip": _clip,
    "HardSwish": _hardswish,
    "HardSigmoid": _hardsigmoid,
    "Pad": _pad,
    "InstanceNormalization": _instance_norm,
    "Einsum": _einsum,
    **onnx_recurrent.CONVERTERS,
    **weight_only.CONVERTERS,
    **contrib_ops.CONVERTERS,
    **contrib_attention.CONVERTERS,
    **cache_ops.CONVERTERS,
    "Max": _variadic("maximum"),
    "Min": _variadic("minimum"),
    "Sum": _variadic("add"),
    "Mean": _variadic("add", mean=True),
}


def unsupported_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes (subgraphs included) that TVM's ONNX converter has no converter for."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | _DIRECT_OPS | set(EXTRA_CONVERTERS)

    def walk(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
        for node in graph.node:
            if node.domain not in _KNOWN_DOMAINS or node.op_type not in known:
                yield node
            for sub in subgraphs(node):
                yield from walk(sub)

    return list(walk(model.graph))


def check_supported(model: onnx.ModelProto) -> None:
    """Raise :class:`~tpp_tvm.errors.UnsupportedOperatorError` naming the first
    :func:`unsupported_nodes`, if there are any."""
    bad = unsupported_nodes(model)
    if not bad:
        return

    def describe(node: onnx.NodeProto) -> str:
        op = f"{node.domain}:{node.op_type}" if node.domain else node.op_type
        return f"{op} (node {node.name!r})" if node.name else f"{op} (output {node.output[0]!r})"

    shown = ", ".join(describe(n) for n in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise UnsupportedOperatorError(
        f"TVM's ONNX converter does not support {shown}{more}; supported are the ops of "
        "tvm.relax.frontend.onnx (standard and com.microsoft domains)"
    )
