"""ONNX import: a cleaned-up ONNX model becomes a Relax IRModule with weights as constants.

TVM's converter (``tvm.relax.frontend.onnx``) handles clean, statically shaped graphs well but
trips over what real exports contain, so :func:`from_onnx` first rewrites the model at the
ONNX level (:func:`clean_model`):

1. **Static input shapes.** Every graph input gets a fully static shape, from ``shape_dict``
   or from the model. A dynamic dimension with no ``shape_dict`` entry is an error naming the
   input and the dimension: TPP kernels are generated per shape, and a static shape is what
   lets the next step fold the exporter's shape arithmetic away. (``compile_onnx`` serves
   dynamic exports with one static import per size: ``tpp_tvm.dynamic``.)
2. **Constant folding with numpy** (repeated with shape inference until nothing changes):
   ``Constant`` nodes become initializers; ``Shape``/``Size`` of any value whose inferred
   shape is static become constants; ``ConstantOfShape``, ``Gather``, ``Unsqueeze``,
   ``Squeeze``, ``Concat``, ``Cast``, ``Reshape``, ``Slice``, ``Transpose``, ``Expand``,
   ``Range``, ``Identity``, ``ReduceMean``, ``BatchNormalization`` (BiT's weight
   standardization: training mode over the weights, extra outputs unread) and elementwise
   arithmetic (``Ceil``, ``Floor``, ``Sqrt``, ``Pow``, ``Clip`` too)/comparison over
   constants are evaluated; a node that does not fold has its outputs' shapes inferred at
   once (``tpp_tvm.onnx_static``), so a chain through many blocks folds in one pass.
   Exports with dynamic axes compute
   every ``Reshape`` target from ``Shape -> Gather -> Unsqueeze -> Concat`` chains (MobileViT
   with ``Cast``s to float and ``Ceil`` in between); once folded, the Relax module has
   static reshapes and no shape tensors. It also removes the ``ConstantOfShape`` with an empty
   (scalar) shape tensor found in transformers' BERT exports, which TVM's converter rejects.
   Results that would grow a constant past a million elements are left to TVM. An
   ``Identity`` of a constant, or a fold repeating an earlier one, renames instead of
   copying: shared weights stay shared (ALBERT).
3. **ONNX shape inference** (``onnx.shape_inference``, with data propagation), so every value
   has a known type and shape for the folding above; stale ``value_info`` from the exporter
   (dynamic dims) is dropped first. It runs on a copy whose weights are typed inputs without
   data, as does onnx's function inliner: both serialize the model, and a protobuf message
   cannot exceed 2 GiB (a 1B-parameter fp32 LLM is 4 GB). Such a model is read with its
   external data and written with it (:func:`save_model`); nothing serializes it whole.
4. **An operator check** against the converter's own op table
   (``onnx_frontend._get_convert_map()``), before any conversion: an operator TVM cannot
   convert is reported with its type and node name instead of a failure deep inside TVM.

Weights stay in the module as ``relax.Constant`` (``keep_params_in_input=False``), where the
graph passes can pack them ahead of time. Errors a user can cause are
:class:`~tpp_tvm.errors.TPPError` subclasses naming the path, input, dimension or node.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import onnx.shape_inference
import tvm
from google.protobuf.message import EncodeError
from onnx import helper, numpy_helper

from tpp_tvm import onnx_recurrent
from tpp_tvm.errors import (
    ModelLoadError,
    TPPError,
    UnsupportedOperatorError,
    UnsupportedShapeError,
    describe_tvm_error,
)
from tpp_tvm.onnx_static import MAX_SHAPE_DATA, StaticTypes, static_shapes, why_not_static

logger = logging.getLogger(__name__)

ModelLike = onnx.ModelProto | str | os.PathLike | bytes

# Operator domains whose ops TVM's converter knows by name (it ignores the domain, so a node of
# any other domain would silently be converted as the standard op of the same name).
_KNOWN_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})
# Ops TVM's importer converts outside its op table.
_DIRECT_OPS = frozenset({"If", "Constant"})
# Folding never creates a constant larger than this (unless an input already is that large).
_MAX_FOLD_ELEMENTS = 1 << 20
_PROTOBUF_LIMIT = 2**31 - 1


# --------------------------------------------------------------------------------------------
# Loading


def load_model(model_or_path: ModelLike) -> onnx.ModelProto:
    """An ONNX ModelProto from a ModelProto (copied, never modified), a path or bytes."""
    if isinstance(model_or_path, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(model_or_path)
        return model
    if isinstance(model_or_path, bytes | bytearray | memoryview):
        return _parse(bytes(model_or_path), "the given bytes")
    if isinstance(model_or_path, str | os.PathLike):
        path = Path(model_or_path)
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise ModelLoadError(f"cannot load ONNX model: {path} {what}")
        model = _parse(path.read_bytes(), str(path))
        if any(_uses_external_data(t) for t in model.graph.initializer):
            _load_external_data(model, path)
        return model
    raise TypeError(
        f"expected an onnx.ModelProto, a path or bytes, got {type(model_or_path).__name__}"
    )


def _uses_external_data(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read the initializers kept in files beside the model; a missing or short file is a
    :class:`ModelLoadError` naming the tensor and the file (onnx raises a checker error, or
    reads garbage past the end of a short file)."""
    for tensor in model.graph.initializer:
        if not _uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        where = path.parent / location
        if not location or not where.is_file():
            raise ModelLoadError(
                f"{path}: initializer {tensor.name!r} keeps its data in "
                f"{location or '(no location)'!r}, which is missing (expected {where})"
            )
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if end > where.stat().st_size:
            raise ModelLoadError(
                f"{path}: initializer {tensor.name!r} needs bytes up to {end} of {where}, "
                f"which has only {where.stat().st_size}: truncated external data"
            )
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # onnx's checker errors (a location outside the folder, ...)
        raise ModelLoadError(f"{path}: cannot load its external data: {exc}") from exc


def _parse(data: bytes, source: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError (or RuntimeWarning-ish) variants
        raise ModelLoadError(f"{source} is not an ONNX model (protobuf parse failed)") from exc
    # Protobuf accepts many non-ONNX byte strings as a message of unknown fields.
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError(f"{source} is not an ONNX model (no IR version or no graph)")
    if model.ir_version < 3:
        raise ModelLoadError(f"{source}: ONNX IR version {model.ir_version} is too old (< 3)")
    check_versions(model, source)
    return model


def check_versions(model: onnx.ModelProto, source: str = "the model") -> None:
    """Refuse a model newer than the installed onnx knows: TVM's converter picks the newest
    converter at or below the model's opset, so an unknown opset would silently get an older
    version's semantics."""
    if model.ir_version > onnx.IR_VERSION:
        raise ModelLoadError(
            f"{source}: ONNX IR version {model.ir_version} is newer than this onnx "
            f"{onnx.__version__} reads (up to {onnx.IR_VERSION}); upgrade onnx"
        )
    newest = onnx.defs.onnx_opset_version()
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx") and entry.version > newest:
            raise ModelLoadError(
                f"{source} imports ONNX opset {entry.version}, newer than the importer "
                f"knows (onnx {onnx.__version__}: opsets up to {newest}); re-export it "
                f"with opset <= {newest}"
            )


# --------------------------------------------------------------------------------------------
# Static input shapes


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs that are real inputs (old exports also list initializers as inputs)."""
    initializers = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def input_type(value: onnx.ValueInfoProto) -> onnx.TypeProto:
    """An input's type, an optional tensor's unwrapped: given, it is a tensor (TVM's
    importer reads it so)."""
    optional = value.type.optional_type.elem_type
    if value.type.HasField("optional_type") and optional.HasField("tensor_type"):
        return optional
    return value.type


def _dim_text(dim: onnx.TensorShapeProto.Dimension) -> str:
    if dim.HasField("dim_value"):
        return str(dim.dim_value)
    return repr(dim.dim_param) if dim.HasField("dim_param") else "?"


def _static_input_shapes(
    model: onnx.ModelProto, shape_dict: Mapping[str, Sequence[int]] | None
) -> dict[str, tuple[int, ...]]:
    """Each real input's static shape, from ``shape_dict`` or the model; written into it."""
    shape_dict = dict(shape_dict or {})
    inputs = graph_inputs(model)
    names = [v.name for v in inputs]
    unknown = sorted(set(shape_dict) - set(names))
    if unknown:
        raise UnsupportedShapeError(
            f"shape_dict names {unknown}, which are not model inputs {names}")
    shapes: dict[str, tuple[int, ...]] = {}
    for value in inputs:
        if not value.type.HasField("tensor_type"):
            value.type.CopyFrom(input_type(value))  # an optional tensor, or left as it is
        ttype = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise UnsupportedShapeError(f"input {value.name!r} is not a tensor")
        dims = list(ttype.shape.dim) if ttype.HasField("shape") else None
        if value.name in shape_dict:
            shape = tuple(shape_dict[value.name])
            if not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
                raise UnsupportedShapeError(
                    f"shape_dict[{value.name!r}] = {shape}: dims must be non-negative integers"
                )
            if dims is not None and len(dims) != len(shape):
                raise UnsupportedShapeError(
                    f"shape_dict[{value.name!r}] = {shape} has rank {len(shape)}, but the "
                    f"model's input has rank {len(dims)} "
                    f"[{', '.join(_dim_text(d) for d in dims)}]"
                )
            for i, (dim, size) in enumerate(zip(dims or [], shape, strict=False)):
                if dim.HasField("dim_value") and dim.dim_value != size:
                    raise UnsupportedShapeError(
                        f"shape_dict[{value.name!r}] = {shape} sets dim {i} to {size}, but the "
                        f"model fixes it to {dim.dim_value}"
                    )
        elif dims is None:
            raise UnsupportedShapeError(
                f"input {value.name!r} has unknown rank; give its shape in shape_dict"
            )
        else:
            for i, dim in enumerate(dims):
                if not dim.HasField("dim_value") or dim.dim_value < 0:
                    raise UnsupportedShapeError(
                        f"input {value.name!r} dim {i} ({_dim_text(dim)}) is dynamic; give "
                        f"the input's static shape in shape_dict, e.g. "
                        f"shape_dict={{{value.name!r}: (...)}}"
                    )
            shape = tuple(d.dim_value for d in dims)
        shapes[value.name] = tuple(int(d) for d in shape)
        ttype.ClearField("shape")
        for size in shapes[value.name]:
            ttype.shape.dim.add().dim_value = size
    return shapes


# --------------------------------------------------------------------------------------------
# Constant folding


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _axes(node_attrs: dict[str, Any], inputs: list[np.ndarray | None], index: int) -> list[int]:
    """Axes given as an input (newer opsets) or an attribute (older ones)."""
    if len(inputs) > index and inputs[index] is not None:
        return [int(a) for a in inputs[index].reshape(-1)]
    return [int(a) for a in node_attrs.get("axes", [])]


def _reshape(x: np.ndarray, shape: np.ndarray, allowzero: int) -> np.ndarray:
    target = [int(d) for d in shape.reshape(-1)]
    if not allowzero:
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return x.reshape(target)


def _slice(x: np.ndarray, inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> np.ndarray:
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


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer division truncates
    return (a / b).astype(a.dtype)


def _same_type(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda a, b: np.asarray(fn(a, b)).astype(a.dtype)


_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "Add": _same_type(np.add),
    "Sub": _same_type(np.subtract),
    "Mul": _same_type(np.multiply),
    "Div": _div,
    "Min": lambda *xs: np.minimum.reduce(np.broadcast_arrays(*xs)),
    "Max": lambda *xs: np.maximum.reduce(np.broadcast_arrays(*xs)),
    "Neg": np.negative,
    "Abs": np.abs,
    # Float maths in exporters' shape arithmetic: MobileViT's patch grid is
    # int(ceil(size / patch) * patch), attention scales are 1 / sqrt(head size).
    "Ceil": np.ceil,
    "Floor": np.floor,
    "Round": np.round,  # half to even, as ONNX's Round
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Pow": _same_type(np.power),
    "Equal": np.equal,
    "Less": np.less,
    "Greater": np.greater,
    "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal,
    "Not": np.logical_not,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Where": np.where,
}


def _fold_node(
    op: str, attrs: dict[str, Any], inputs: list[np.ndarray | None]
) -> np.ndarray | None:
    """The value of a single-output node over constant ``inputs``, or None to keep the node."""
    x = inputs[0] if inputs else None
    if op in _ELEMENTWISE:
        return np.asarray(_ELEMENTWISE[op](*inputs))
    if op == "Identity":
        return x
    if op == "Mod":  # window padding in Swin-style models: (-size) % window
        mod = np.fmod if int(attrs.get("fmod", 0)) else np.mod
        return np.asarray(mod(x, inputs[1])).astype(x.dtype)
    if op == "Cast":
        return x.astype(helper.tensor_dtype_to_np_dtype(attrs["to"]))
    if op == "Clip":
        return _clip_constant(x, inputs[1:], attrs)
    if op == "ConstantOfShape":
        value = attrs.get("value")
        fill = numpy_helper.to_array(value).reshape(-1) if value is not None else None
        dtype = fill.dtype if fill is not None else np.float32
        return np.full([int(d) for d in x.reshape(-1)], fill[0] if fill is not None else 0, dtype)
    if op == "Gather":
        return np.take(x, inputs[1].astype(np.int64), axis=int(attrs.get("axis", 0)))
    if op == "Unsqueeze":
        return np.expand_dims(x, tuple(_axes(attrs, inputs, 1)))
    if op == "Squeeze":
        axes = _axes(attrs, inputs, 1)
        return np.squeeze(x, tuple(axes)) if axes else np.squeeze(x)
    if op == "Concat":
        return np.concatenate(inputs, axis=int(attrs["axis"]))
    if op == "Reshape":
        shape = inputs[1] if len(inputs) > 1 else np.array(attrs["shape"])
        return _reshape(x, shape, int(attrs.get("allowzero", 0)))
    if op == "Slice":
        return _slice(x, inputs, attrs)
    if op == "Transpose":
        return np.transpose(x, attrs.get("perm"))
    if op == "Expand":
        shape = np.broadcast_shapes(x.shape, tuple(int(d) for d in inputs[1].reshape(-1)))
        return np.broadcast_to(x, shape).copy()
    if op == "Range":
        return np.arange(x.item(), inputs[1].item(), inputs[2].item(), dtype=x.dtype)
    if op == "ReduceMean":
        axes = _axes(attrs, inputs, 1)
        if not axes and int(attrs.get("noop_with_empty_axes", 0)):
            return x
        mean = np.mean(x.astype(np.float64), axis=tuple(axes) if axes else None,
                       keepdims=bool(int(attrs.get("keepdims", 1))))
        return np.asarray(mean).astype(x.dtype)
    if op == "BatchNormalization":
        return _batch_norm(x, inputs[1:5], attrs)
    if op in ("QuantizeLinear", "DequantizeLinear"):
        return _quantize_constant(op, inputs)
    return None


def _clip_constant(x: np.ndarray, bounds: list[np.ndarray | None], attrs: dict[str, Any]
                   ) -> np.ndarray:
    """Clip of a constant; a bound is an optional input (opset 11+) or attribute (older).
    TF-style "same" padding (timm's ``pad_same``: MaxViT-TF, EfficientNet-TF) takes
    ``max(total, 0)`` of the pad as a Clip with no upper bound."""
    lo = bounds[0] if bounds and bounds[0] is not None else attrs.get("min")
    hi = bounds[1] if len(bounds) > 1 and bounds[1] is not None else attrs.get("max")
    if lo is not None:
        x = np.maximum(x, np.asarray(lo, x.dtype))
    if hi is not None:
        x = np.minimum(x, np.asarray(hi, x.dtype))
    return np.asarray(x)


def _quantize_constant(op: str, inputs: list[np.ndarray | None]) -> np.ndarray | None:
    """A QuantizeLinear / DequantizeLinear of a constant with a per-tensor scale, as ONNX
    Runtime computes it (:func:`_fold_once` folds a DequantizeLinear only of a scalar or
    of a QuantizeLinear it folded, and not a weight's: that is the int8 kernel's input,
    kept for ``relay_passes/quantized.py``).

    ``quantize_static`` also quantizes constants that are not weights: a Pad's fill value
    (MobileNetV2, EfficientNet), attention's scale and mask constants, a norm's scale
    (wav2vec2's InstanceNormalization); TVM's converter needs a Pad's fill as a constant
    (it failed on the quantized one), and the norm's converter its scale."""
    x, scale = inputs[0], inputs[1]
    zero = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    if scale.size != 1 or (zero is not None and zero.size != 1):
        return None
    if op == "DequantizeLinear":
        shift = 0.0 if zero is None else float(zero.reshape(-1)[0])
        value = (x.astype(np.float64) - shift) * float(scale.reshape(-1)[0])
        return value.astype(scale.dtype)
    dtype = np.dtype(zero.dtype) if zero is not None else np.dtype(np.uint8)
    if dtype.kind not in "iu":  # float8 / 4-bit zero points: not modelled here
        return None
    info = np.iinfo(dtype)
    q = np.rint(x.astype(np.float64) / float(scale.reshape(-1)[0]))
    q = q + (0 if zero is None else int(zero.reshape(-1)[0]))
    return np.clip(q, info.min, info.max).astype(dtype)


def _batch_norm(x: np.ndarray, params: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """BatchNormalization over constants (in float64): with ``training_mode`` the batch's
    own statistics, as BiT's weight standardization computes them from the weights."""
    scale, bias, mean, var = (p.astype(np.float64) for p in params)
    axes = tuple(i for i in range(x.ndim) if i != 1)
    data = x.astype(np.float64)
    if int(attrs.get("training_mode", 0)):
        mean, var = data.mean(axis=axes), data.var(axis=axes)
    channel = (1, -1) + (1,) * (x.ndim - 2)
    y = (data - mean.reshape(channel)) / np.sqrt(var.reshape(channel) +
                                                 float(attrs.get("epsilon", 1e-5)))
    return (y * scale.reshape(channel) + bias.reshape(channel)).astype(x.dtype)


#: ONNX ops whose second operand a quantized model's int8 kernels take as an int8 weight.
_CONTRACTIONS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})

_FOLDABLE = frozenset(
    {
        "Identity",
        "Cast",
        "Clip",
        "ConstantOfShape",
        "Gather",
        "Unsqueeze",
        "Squeeze",
        "Concat",
        "Reshape",
        "Slice",
        "Transpose",
        "Expand",
        "Range",
        "Mod",
        "ReduceMean",
        "BatchNormalization",
        "QuantizeLinear",
        "DequantizeLinear",
        *_ELEMENTWISE,
    }
)


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a ``Constant`` node (None for string or sparse constants)."""
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if attr.name == "value":
            return numpy_helper.to_array(value)
        if attr.name in ("value_float", "value_floats"):
            return np.array(value, dtype=np.float32)
        if attr.name in ("value_int", "value_ints"):
            return np.array(value, dtype=np.int64)
    return None


def _subgraphs(node: onnx.NodeProto) -> Iterable[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name read by ``graph``'s nodes (subgraphs included) or outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for sub in _subgraphs(node):
            used |= _used_names(sub)
    return used


def _rename_inputs(node: onnx.NodeProto, alias: Mapping[str, str]) -> None:
    """Make ``node`` (and its subgraphs) read ``alias[name]`` wherever it read ``name``."""
    for i, name in enumerate(node.input):
        if name in alias:
            node.input[i] = alias[name]
    for sub in _subgraphs(node):
        for inner in sub.node:
            _rename_inputs(inner, alias)
        for output in sub.output:
            output.name = alias.get(output.name, output.name)


def _fold_once(graph: onnx.GraphProto,
               opset_imports: Iterable[onnx.OperatorSetIdProto] = ()) -> list[str]:
    """Fold what can be folded in one pass; returns the op types folded.

    A node that does not fold gets its outputs' shapes inferred from what this pass knows
    (:class:`~tpp_tvm.onnx_static.StaticTypes`), so a ``Shape`` downstream of a fold folds
    in the same pass.

    A folded ``Identity`` of a constant, or a fold that repeats an earlier one (same op,
    attributes and inputs), becomes another name for the existing constant rather than a
    copy: ALBERT's export reads its one shared layer through an ``Identity`` per layer, and
    copying the weights per layer took ALBERT-xxlarge from 0.8 GB past protobuf's 2 GiB."""
    protos = {t.name: t for t in graph.initializer}
    cache: dict[str, np.ndarray] = {}
    known = StaticTypes(graph, opset_imports)
    outputs = {o.name for o in graph.output}
    alias: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}

    def const(name: str) -> np.ndarray | None:
        if name not in cache and name in protos:
            cache[name] = numpy_helper.to_array(protos[name])
        return cache.get(name)

    folded: list[str] = []
    kept: list[onnx.NodeProto] = []
    read = _used_names(graph)
    quantized: set[str] = set()  # outputs of QuantizeLinear nodes folded in this pass
    weights = {name for node in graph.node if node.op_type in _CONTRACTIONS
               for name in node.input[1:2]}  # a contraction's second operand
    for node in graph.node:
        if alias:
            _rename_inputs(node, alias)
        # One output read (a training-mode BatchNormalization's running statistics are not)
        out = node.output[0] if not any(o in read for o in node.output[1:]) else ""
        if node.domain not in ("", "ai.onnx") or not out:
            kept.append(node)
            known.infer(node, const)  # a Split's outputs too
            continue
        if (node.op_type == "Identity" and out not in outputs
                and (node.input[0] in protos or node.input[0] in cache)):
            alias[out] = node.input[0]
            folded.append(node.op_type)
            continue
        value = _try_fold(node, const, known.shapes)
        if value is not None and node.op_type == "DequantizeLinear" and value.size > 1 \
                and (node.input[0] not in quantized or out in weights):
            value = None  # a weight's dequantization: the int8 kernel's input
        if value is None:
            kept.append(node)
            known.infer(node, const)
            continue
        if node.op_type == "QuantizeLinear":
            quantized.add(out)
        folded.append(node.op_type)
        key = (node.op_type, tuple(node.input),
               tuple(a.SerializeToString() for a in node.attribute)) if node.input else None
        if key is not None and key in seen and out not in outputs:
            alias[out] = seen[key]
            continue
        if key is not None:
            seen[key] = out
        cache[out] = value
        known.add_constant(out, value)
    if not folded:
        return folded

    del graph.node[:]
    graph.node.extend(kept)
    used = _used_names(graph)
    # Edited in place: rebuilding the list would copy every weight once per round.
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name not in used:
            del graph.initializer[i]
    for name, value in cache.items():
        if name in used and name not in protos:
            graph.initializer.append(numpy_helper.from_array(np.array(value, order="C"), name))
    return folded


def _try_fold(
    node: onnx.NodeProto,
    const: Callable[[str], np.ndarray | None],
    shapes: dict[str, tuple[int, ...]],
) -> np.ndarray | None:
    op = node.op_type
    if op == "Constant":
        return _constant_node_value(node)
    if op in ("Shape", "Size"):
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        if op == "Size":
            return np.array(int(np.prod(shape)), dtype=np.int64)
        attrs = _attrs(node)
        return np.array(shape[attrs.get("start", 0) : attrs.get("end")], dtype=np.int64)
    if op not in _FOLDABLE or any(True for _ in _subgraphs(node)):
        return None
    inputs = [const(name) if name else None for name in node.input]
    if any(v is None for name, v in zip(node.input, inputs, strict=True) if name):
        return None
    # Output size is known for ConstantOfShape/Expand before computing: refuse huge ones.
    if op in ("ConstantOfShape", "Expand"):
        target = inputs[1] if op == "Expand" else inputs[0]
        size = int(np.prod([max(int(d), 1) for d in target.reshape(-1)]))
        largest = max((v.size for v in inputs if v is not None), default=0)
        if size > max(_MAX_FOLD_ELEMENTS, largest):
            return None
    try:
        value = _fold_node(op, _attrs(node), inputs)
    except Exception as exc:  # an attribute combination we do not model: leave it to TVM
        logger.debug("not folding %s node %r: %s", op, node.name, exc)
        return None
    if value is None or value.dtype == object:  # strings stay with the exporter's nodes
        return None
    largest = max((v.size for v in inputs if v is not None), default=0)
    if value.size > max(_MAX_FOLD_ELEMENTS, largest):
        return None
    return np.asarray(value)


def _split_weights(
    model: onnx.ModelProto, keep_elements: int
) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A copy of ``model`` without its initializers over ``keep_elements`` elements, and
    those initializers (the model's own, not copies)."""
    graph = model.graph
    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                            functions=model.functions)
    light.graph.name = graph.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(light.graph, field).extend(getattr(graph, field))
    weights = []
    for tensor in graph.initializer:
        if int(np.prod(tensor.dims)) <= keep_elements:
            light.graph.initializer.add().CopyFrom(tensor)
        else:
            weights.append(tensor)
    return light, weights


def _weightless(model: onnx.ModelProto, keep_elements: int) -> onnx.ModelProto:
    """A copy of ``model`` for the onnx passes that serialize it (shape inference, the
    function inliner): every initializer over ``keep_elements`` elements becomes a typed
    graph input without data. Those passes need weights' types and shapes, never their
    values (only shape-sized tensors are read), and a protobuf message cannot exceed 2 GiB:
    a 1B-parameter fp32 model (4 GB) could not go through them whole, and ALBERT-xxlarge
    went over once its shared weights had been copied per use."""
    light, weights = _split_weights(model, keep_elements)
    inputs = {v.name for v in light.graph.input}
    for tensor in weights:
        if tensor.name not in inputs:  # old exports list initializers as inputs too
            light.graph.input.append(
                helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return light


def fits_protobuf(model: onnx.ModelProto) -> bool:
    """Whether ``model`` serializes as one protobuf message (at most 2 GiB)."""
    try:
        return model.ByteSize() <= _PROTOBUF_LIMIT
    except EncodeError:  # upb refuses to even size a message over the limit
        return False


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Write ``model`` to ``path``; one over protobuf's 2 GiB limit keeps its larger
    initializers in ``<name>.data`` beside it (ONNX external data, which
    :func:`load_model`, ``onnx.load`` and ONNX Runtime read). Unlike ``onnx.save`` with
    ``save_as_external_data``, the model in memory keeps its weights."""
    path = Path(path)
    if fits_protobuf(model):
        path.write_bytes(model.SerializeToString())
        return path
    light, weights = _split_weights(model, MAX_SHAPE_DATA)
    data = path.with_name(path.name + ".data")
    with data.open("wb") as out:
        for tensor in weights:
            if tensor.data_type == onnx.TensorProto.STRING:  # no fixed-size bytes to write
                light.graph.initializer.add().CopyFrom(tensor)
                continue
            raw = tensor.raw_data if tensor.HasField("raw_data") else \
                numpy_helper.to_array(tensor).tobytes()
            ref = light.graph.initializer.add(name=tensor.name, data_type=tensor.data_type,
                                              dims=tensor.dims)
            ref.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", out.tell()),
                               ("length", len(raw))):
                ref.external_data.add(key=key, value=str(value))
            out.write(raw)
    path.write_bytes(light.SerializeToString())
    return path


def _inline_functions(model: onnx.ModelProto) -> None:
    """Inline the model's local functions in place (TVM's converter knows no functions),
    on a weightless copy (:func:`_weightless`): onnx's inliner serializes the model."""
    inlined = onnx.inliner.inline_local_functions(_weightless(model, 0))
    for field in ("node", "value_info"):
        model.graph.ClearField(field)
        getattr(model.graph, field).extend(getattr(inlined.graph, field))
    for field in ("functions", "opset_import"):
        model.ClearField(field)
        getattr(model, field).extend(getattr(inlined, field))


def _infer_shapes(model: onnx.ModelProto) -> None:
    """Infer every value's shape afresh, in place, on a weightless copy
    (:func:`_weightless`; initializers up to :data:`MAX_SHAPE_DATA` elements keep their
    values for data propagation). The previous round's ``value_info`` is dropped first:
    inference keeps an existing entry, so a dimension it could not know before a fold
    (``unk__0`` from an ``Add`` whose other input was a computed position-id gather, in
    transformers' DistilBERT) would stay unknown after the fold made it static, and the
    ``Shape`` nodes reading it would never fold."""
    del model.graph.value_info[:]
    light = _weightless(model, MAX_SHAPE_DATA)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except Exception as exc:  # inference is an aid to folding, not a requirement
        warnings.warn(f"ONNX shape inference failed ({exc}); folding less", stacklevel=3)
        return
    graph = inferred.graph
    model.graph.value_info.extend(graph.value_info)
    for output, typed in zip(model.graph.output, graph.output, strict=True):
        output.type.CopyFrom(typed.type)
    for node, typed in zip(model.graph.node, graph.node, strict=True):
        if any(True for _ in _subgraphs(node)):  # their value_info is inferred too
            node.CopyFrom(typed)


def _check_outputs(graph: onnx.GraphProto) -> None:
    """A graph must have outputs, each computed by a node or given as an input/constant:
    TVM's importer builds an empty function or fails with a ``KeyError`` otherwise."""
    if not graph.output:
        raise ModelLoadError("the model has no outputs: nothing to compute")
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    known |= {name for node in graph.node for name in node.output}
    missing = [o.name for o in graph.output if o.name not in known]
    if missing:
        raise ModelLoadError(
            f"model output(s) {missing} are computed by no node and are no input or constant"
        )


def clean_model(
    model_or_path: ModelLike, shape_dict: Mapping[str, Sequence[int]] | None = None
) -> onnx.ModelProto:
    """The model with static input shapes, constants folded and shapes inferred.

    This is the ONNX-level half of :func:`from_onnx` (see the module docstring for what it
    does and why); the result is an ordinary ONNX model, so ONNX Runtime can run it too.
    """
    model = load_model(model_or_path)
    check_versions(model)
    _check_outputs(model.graph)
    if model.functions:
        _inline_functions(model)
    _static_input_shapes(model, shape_dict)
    # The exporter's output shapes may carry the old dynamic dims (its value_info goes in
    # every _infer_shapes round).
    for output in model.graph.output:
        output.type.tensor_type.ClearField("shape")
    # Initializers are constants here: drop them from the graph's inputs.
    real = graph_inputs(model)
    del model.graph.input[:]
    model.graph.input.extend(real)

    # Until nothing folds (each round removes nodes, so this ends): a cap on the rounds
    # left deep models' later blocks unfolded.
    folded: list[str] = []
    while True:
        _infer_shapes(model)
        done = _fold_once(model.graph, model.opset_import)
        if not done:
            break
        folded += done
    if folded:
        counts = {op: folded.count(op) for op in sorted(set(folded))}
        logger.debug("folded %d nodes: %s", len(folded), counts)
    explicit_auto_pad(model.graph)
    inference_dropout_as_identity(model.graph)
    return model


def inference_dropout_as_identity(graph: onnx.GraphProto) -> int:
    """Replace inference-mode ``Dropout`` nodes by ``Identity`` (and their mask, where
    something reads it and the input's shape is static, by a constant of ``True``s: the
    inference mask by the spec); the number replaced.

    Old exports (opset 9 model-zoo CNNs) leave Dropout in the inference graph; TVM converts
    it into a tuple (output, mask) that its ConvertLayout rejects with an ``InternalError``
    ("Expected nested to match tuple"). In inference Dropout is the identity."""
    used = {name for node in graph.node for name in node.input}
    used |= {out.name for out in graph.output}
    consts = {t.name for t in graph.initializer}
    shapes = static_shapes(graph)
    replaced = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        mask = node.output[1] if len(node.output) > 1 and node.output[1] in used else None
        if mask is not None and node.input[0] not in shapes:
            continue
        training = node.input[2] if len(node.input) > 2 else ""
        if training and training not in consts:
            continue  # a training_mode computed at run time: leave it to TVM
        if training and numpy_helper.to_array(
                next(t for t in graph.initializer if t.name == training)).any():
            continue
        nodes[-1] = helper.make_node("Identity", [node.input[0]], [node.output[0]],
                                     name=node.name)
        if mask is not None:
            ones = numpy_helper.from_array(np.ones(shapes[node.input[0]], bool))
            nodes.append(helper.make_node("Constant", [], [mask], value=ones,
                                          name=f"{node.name}_mask"))
        replaced += 1
    if replaced:
        del graph.node[:]
        graph.node.extend(nodes)
    return replaced


def explicit_auto_pad(graph: onnx.GraphProto) -> int:
    """Replace ``auto_pad="SAME_UPPER"/"SAME_LOWER"`` by explicit ``pads`` on convolutions
    and poolings with static input shapes; the number of nodes changed.

    TVM's converter emits a separate pad kernel (an opaque ``call_tir``) for ``SAME``
    padding, in front of every such convolution (EfficientNet's depthwise convolutions),
    where explicit pads are the convolution's own padding and run on its TPP kernel. The
    pad of a ``ConvInteger`` (``quantize_dynamic``'s, on ``x - zero point`` in int32) also
    hid the convolution from the int8 kernel patterns: they ran on TVM's default code."""
    shapes = static_shapes(graph)
    changed = 0
    for node in graph.node:
        if node.op_type not in ("Conv", "ConvInteger", "MaxPool", "AveragePool"):
            continue
        attrs = {a.name: a for a in node.attribute}
        mode = attrs.get("auto_pad")
        if mode is None or mode.s not in (b"SAME_UPPER", b"SAME_LOWER"):
            continue
        shape = shapes.get(node.input[0])
        kernel = list(attrs["kernel_shape"].ints) if "kernel_shape" in attrs else None
        if kernel is None and node.op_type in ("Conv", "ConvInteger"):
            weight = shapes.get(node.input[1])
            kernel = list(weight[2:]) if weight is not None else None
        if shape is None or kernel is None:
            continue
        spatial = list(shape[2:])
        strides = list(attrs["strides"].ints) if "strides" in attrs else [1] * len(spatial)
        dilations = list(attrs["dilations"].ints) if "dilations" in attrs else [1] * len(spatial)
        begin, end = [], []
        for size, k, st, d in zip(spatial, kernel, strides, dilations, strict=True):
            out = -(-size // st)
            total = max((out - 1) * st + (k - 1) * d + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if mode.s == b"SAME_UPPER" else large)
            end.append(large if mode.s == b"SAME_UPPER" else small)
        keep = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend(keep + [helper.make_attribute("pads", begin + end)])
        changed += 1
    return changed


# --------------------------------------------------------------------------------------------
# Operator check and conversion


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 1


def unsupported_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes (subgraphs included) that TVM's ONNX converter has no converter for."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | _DIRECT_OPS | set(_EXTRA_CONVERTERS)

    def walk(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
        for node in graph.node:
            if node.domain not in _KNOWN_DOMAINS or node.op_type not in known:
                yield node
            for sub in _subgraphs(node):
                yield from walk(sub)

    return list(walk(model.graph))


def _check_supported(model: onnx.ModelProto) -> None:
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
_EXTRA_CONVERTERS: dict[str, Callable[..., Any]] = {
    "QLinearMatMul": _qlinear_matmul,
    "ConvInteger": _conv_integer,
    "Clip": _clip,
    "HardSwish": _hardswish,
    "HardSigmoid": _hardsigmoid,
    "Pad": _pad,
    "InstanceNormalization": _instance_norm,
    "Einsum": _einsum,
    **onnx_recurrent.CONVERTERS,
    "Max": _variadic("maximum"),
    "Min": _variadic("minimum"),
    "Sum": _variadic("add"),
    "Mean": _variadic("add", mean=True),
}


@functools.cache
def _importer_class() -> type:
    from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter

    class Importer(ONNXGraphImporter):
        """TVM's importer, with conversion failures naming the node that failed (and where
        static shapes stopped, when that is why), and the converters of
        :data:`_EXTRA_CONVERTERS`."""

        #: The cleaned graph being converted, for :func:`~tpp_tvm.onnx_static.why_not_static`.
        onnx_graph: onnx.GraphProto | None = None

        def _check_for_unsupported_ops(self, graph: onnx.GraphProto) -> None:
            pass  # from_onnx checked the model against TVM's table plus ours already

        def _convert_operator(
            self, op_name: str, inputs: Any, attrs: dict[str, Any], opset: int
        ) -> Any:
            try:
                if op_name in _EXTRA_CONVERTERS:
                    out = _EXTRA_CONVERTERS[op_name](self.bb, inputs, attrs)
                    if out is not None:
                        return out
                return super()._convert_operator(op_name, inputs, attrs, opset)
            except TPPError:  # ours, naming the node already
                raise
            except Exception as exc:
                node = attrs.get("tvm_custom", {}).get("name", "?")
                why = why_not_static(self.onnx_graph, node) \
                    if self.onnx_graph is not None else ""
                raise ModelLoadError(
                    f"TVM's ONNX converter failed on {op_name} node {node!r}: "
                    f"{describe_tvm_error(exc)}" + (f" ({why})" if why else "")
                ) from exc

    return Importer


#: ``main``'s attribute holding the ONNX input names, in parameter order.
ONNX_INPUT_NAMES = "tpp.onnx_input_names"


def from_onnx(
    model_or_path: ModelLike, shape_dict: Mapping[str, Sequence[int]] | None = None
) -> tvm.IRModule:
    """Import an ONNX model (ModelProto, path or bytes) as a Relax ``tvm.IRModule``.

    ``shape_dict`` maps input names to static shapes; it is needed for every input with a
    dynamic dimension. The model is cleaned first (:func:`clean_model`), checked against the
    converter's op table, then converted with weights as ``relax.Constant``. Returns a module
    whose ``main`` takes the graph inputs (parameter names sanitized by TVM: ``.`` becomes
    ``_``; the ONNX names are kept in ``main``'s ``ONNX_INPUT_NAMES`` attribute).
    """
    model = clean_model(model_or_path, shape_dict)
    _check_supported(model)
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input
    }
    importer = _importer_class()(shapes, "float32", keep_params_in_input=False, sanitize=True)
    importer.onnx_graph = model.graph
    # TVM's importer prints every input of a failing node to stdout; our error names the node.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Renaming name")
        try:
            mod = importer.from_onnx(model.graph, _default_opset(model))
        except TPPError:
            raise
        except Exception as exc:  # outside a converter: graph inputs, outputs, constants
            raise ModelLoadError(f"TVM's ONNX importer failed: {describe_tvm_error(exc)}"
                                 ) from exc
    # The model's own input names, which callers use: TVM's sanitized ones (``.`` → ``_``)
    # only name the Relax parameters (clean_model left the real inputs, in order).
    names = [v.name for v in model.graph.input]
    if len(names) == len(mod["main"].params):
        mod["main"] = mod["main"].with_attr(ONNX_INPUT_NAMES, names)
    return mod
