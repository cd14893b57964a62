"""What constant folding computes, op by op: :data:`FOLDS` maps an ONNX op type to the numpy
function that evaluates a node of that type over constant inputs. Its keys are the ops that
fold (besides ``Constant``, ``Shape`` and ``Size``, which fold from the node itself and from
inferred shapes: :func:`~tpp_tvm.frontend.folding.fold_once`).

What is here is what exporters' shape arithmetic and constant subgraphs use: the
``Shape -> Gather -> Unsqueeze -> Concat`` chains that compute every ``Reshape`` target in
an export with dynamic axes (MobileViT with ``Cast``s to float and ``Ceil`` in between), the
empty-shape ``ConstantOfShape`` of transformers' BERT exports (which TVM's converter
rejects), BiT's weight standardization (a training-mode ``BatchNormalization`` over the
weights), and quantize/dequantize of constants that are not weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import helper, numpy_helper

#: A fold: the value of a single-output node from its inputs (each a constant, or None for
#: an absent optional input) and its attributes, or None to keep the node.
Fold = Callable[[list[np.ndarray | None], dict[str, Any]], np.ndarray | None]


def _elementwise(fn: Callable[..., Any]) -> Fold:
    """The fold of an elementwise op: ``fn`` over the inputs (numpy broadcasts as ONNX)."""
    return lambda inputs, attrs: np.asarray(fn(*inputs))


def _same_type(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda a, b: np.asarray(fn(a, b)).astype(a.dtype)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer division truncates
    return (a / b).astype(a.dtype)


def _axes(node_attrs: dict[str, Any], inputs: list[np.ndarray | None], index: int) -> list[int]:
    """Axes given as an input (newer opsets) or an attribute (older ones)."""
    if len(inputs) > index and inputs[index] is not None:
        return [int(a) for a in inputs[index].reshape(-1)]
    return [int(a) for a in node_attrs.get("axes", [])]


def _mod(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    """Window padding in Swin-style models: ``(-size) % window``."""
    x = inputs[0]
    mod = np.fmod if int(attrs.get("fmod", 0)) else np.mod
    return np.asarray(mod(x, inputs[1])).astype(x.dtype)


def _cast(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    return inputs[0].astype(helper.tensor_dtype_to_np_dtype(attrs["to"]))


def _clip(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    """Clip of a constant; a bound is an optional input (opset 11+) or attribute (older).
    TF-style "same" padding (timm's ``pad_same``: MaxViT-TF, EfficientNet-TF) takes
    ``max(total, 0)`` of the pad as a Clip with no upper bound."""
    x, bounds = inputs[0], inputs[1:]
    lo = bounds[0] if bounds and bounds[0] is not None else attrs.get("min")
    hi = bounds[1] if len(bounds) > 1 and bounds[1] is not None else attrs.get("max")
    if lo is not None:
        x = np.maximum(x, np.asarray(lo, x.dtype))
    if hi is not None:
        x = np.minimum(x, np.asarray(hi, x.dtype))
    return np.asarray(x)


def _constant_of_shape(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    value = attrs.get("value")
    fill = numpy_helper.to_array(value).reshape(-1) if value is not None else None
    dtype = fill.dtype if fill is not None else np.float32
    shape = [int(d) for d in inputs[0].reshape(-1)]
    return np.full(shape, fill[0] if fill is not None else 0, dtype)


def _gather(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    return np.take(inputs[0], inputs[1].astype(np.int64), axis=int(attrs.get("axis", 0)))


def _squeeze(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    axes = _axes(attrs, inputs, 1)
    return np.squeeze(inputs[0], tuple(axes)) if axes else np.squeeze(inputs[0])


def _reshape(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    x = inputs[0]
    shape = inputs[1] if len(inputs) > 1 else np.array(attrs["shape"])
    target = [int(d) for d in shape.reshape(-1)]
    if not int(attrs.get("allowzero", 0)):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return x.reshape(target)


def _slice(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    x = inputs[0]
    if len(inputs) > 1:
        starts, ends = inputs[1].reshape(-1), inputs[2].reshape(-1)
        axes = inputs[3] if len(inputs) > 3 and inputs[3] is not None else None
        steps = inputs[4] if len(inputs) > 4 and inputs[4] is not None else None
    else:
        starts, ends = np.array(attrs["starts"]), np.array(attrs["ends"])
        axes = np.array(attrs["axes"]) if "axes" in attrs else None
        steps = None
    axes = range(len(starts)) if axes is None else axes.reshape(-1)
    steps = [1] * len(starts) if steps is None else steps.reshape(-1)
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        index[int(axis)] = slice(int(start), int(end), int(step))
    return x[tuple(index)]


def _expand(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    x = inputs[0]
    shape = np.broadcast_shapes(x.shape, tuple(int(d) for d in inputs[1].reshape(-1)))
    return np.broadcast_to(x, shape).copy()


def _range(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    start, limit, delta = inputs[:3]
    return np.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


def _reduce_mean(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    x, axes = inputs[0], _axes(attrs, inputs, 1)
    if not axes and int(attrs.get("noop_with_empty_axes", 0)):
        return x
    mean = np.mean(x.astype(np.float64), axis=tuple(axes) if axes else None,
                   keepdims=bool(int(attrs.get("keepdims", 1))))
    return np.asarray(mean).astype(x.dtype)


def _batch_norm(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
    """BatchNormalization over constants (in float64): with ``training_mode`` the batch's
    own statistics, as BiT's weight standardization computes them from the weights."""
    x = inputs[0]
    scale, bias, mean, var = (p.astype(np.float64) for p in inputs[1:5])
    axes = tuple(i for i in range(x.ndim) if i != 1)
    data = x.astype(np.float64)
    if int(attrs.get("training_mode", 0)):
        mean, var = data.mean(axis=axes), data.var(axis=axes)
    channel = (1, -1) + (1,) * (x.ndim - 2)
    y = (data - mean.reshape(channel)) / np.sqrt(var.reshape(channel) +
                                                 float(attrs.get("epsilon", 1e-5)))
    return (y * scale.reshape(channel) + bias.reshape(channel)).astype(x.dtype)


def _per_tensor(inputs: list[np.ndarray | None]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(x, scale, zero point or None) of a QuantizeLinear / DequantizeLinear with a
    per-tensor scale and zero point; None for a per-axis one (not folded).

    ``quantize_static`` also quantizes constants that are not weights: a Pad's fill value
    (MobileNetV2, EfficientNet), attention's scale and mask constants, a norm's scale
    (wav2vec2's InstanceNormalization); TVM's converter needs a Pad's fill as a constant
    (it failed on the quantized one), and the norm's converter its scale. Folding computes
    them as ONNX Runtime does. (:func:`~tpp_tvm.frontend.folding.fold_once` folds a
    DequantizeLinear only of a scalar or of a QuantizeLinear it folded, and not a weight's:
    that is the int8 kernel's input, kept for ``relay_passes/quantized.py``.)"""
    x, scale = inputs[0], inputs[1]
    zero = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    if scale.size != 1 or (zero is not None and zero.size != 1):
        return None
    return x, scale, zero


def _dequantize(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray | None:
    if (given := _per_tensor(inputs)) is None:
        return None
    x, scale, zero = given
    shift = 0.0 if zero is None else float(zero.reshape(-1)[0])
    value = (x.astype(np.float64) - shift) * float(scale.reshape(-1)[0])
    return value.astype(scale.dtype)


def _quantize(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray | None:
    if (given := _per_tensor(inputs)) is None:
        return None
    x, scale, zero = given
    dtype = np.dtype(zero.dtype) if zero is not None else np.dtype(np.uint8)
    if dtype.kind not in "iu":  # float8 / 4-bit zero points: not modelled here
        return None
    info = np.iinfo(dtype)
    q = np.rint(x.astype(np.float64) / float(scale.reshape(-1)[0]))
    q = q + (0 if zero is None else int(zero.reshape(-1)[0]))
    return np.clip(q, info.min, info.max).astype(dtype)


#: ONNX op type -> its fold; the ops constant folding evaluates.
FOLDS: dict[str, Fold] = {
    # Elementwise arithmetic and comparison.
    "Add": _elementwise(_same_type(np.add)),
    "Sub": _elementwise(_same_type(np.subtract)),
    "Mul": _elementwise(_same_type(np.multiply)),
    "Div": _elementwise(_div),
    "Min": _elementwise(lambda *xs: np.minimum.reduce(np.broadcast_arrays(*xs))),
    "Max": _elementwise(lambda *xs: np.maximum.reduce(np.broadcast_arrays(*xs))),
    "Neg": _elementwise(np.negative),
    "Abs": _elementwise(np.abs),
    # Float maths in exporters' shape arithmetic: MobileViT's patch grid is
    # int(ceil(size / patch) * patch), attention scales are 1 / sqrt(head size).
    "Ceil": _elementwise(np.ceil),
    "Floor": _elementwise(np.floor),
    "Round": _elementwise(np.round),  # half to even, as ONNX's Round
    "Sqrt": _elementwise(np.sqrt),
    "Reciprocal": _elementwise(np.reciprocal),
    "Pow": _elementwise(_same_type(np.power)),
    "Mod": _mod,
    "Equal": _elementwise(np.equal),
    "Less": _elementwise(np.less),
    "Greater": _elementwise(np.greater),
    "LessOrEqual": _elementwise(np.less_equal),
    "GreaterOrEqual": _elementwise(np.greater_equal),
    "Not": _elementwise(np.logical_not),
    "And": _elementwise(np.logical_and),
    "Or": _elementwise(np.logical_or),
    "Where": _elementwise(np.where),
    "Clip": _clip,
    # Shapes, indices and layouts.
    "Identity": lambda inputs, attrs: inputs[0],
    "Cast": _cast,
    "ConstantOfShape": _constant_of_shape,
    "Gather": _gather,
    "Unsqueeze": lambda inputs, attrs: np.expand_dims(inputs[0], tuple(_axes(attrs, inputs, 1))),
    "Squeeze": _squeeze,
    "Concat": lambda inputs, attrs: np.concatenate(inputs, axis=int(attrs["axis"])),
    "Reshape": _reshape,
    "Slice": _slice,
    "Transpose": lambda inputs, attrs: np.transpose(inputs[0], attrs.get("perm")),
    "Expand": _expand,
    "Range": _range,
    # Reductions and normalization over constants.
    "ReduceMean": _reduce_mean,
    "BatchNormalization": _batch_norm,
    # Quantization of constants that are not weights.
    "QuantizeLinear": _quantize,
    "DequantizeLinear": _dequantize,
}
