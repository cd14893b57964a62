"""The ONNX-level cleanup before conversion (:func:`clean_model`): TVM's converter
(``tvm.relax.frontend.onnx``) handles clean, statically shaped graphs well but trips over
what real exports contain, so the model is rewritten first, as an ordinary ONNX model:

1. **Checks and inlining.** Versions the installed onnx knows, outputs that something
   computes; local functions inlined (TVM's converter knows no functions).
2. **Static input shapes** (:func:`~tpp_tvm.frontend.shapes.static_input_shapes`).
3. **Constant folding with numpy** (:mod:`.folding`; what each op computes: :mod:`.fold_ops`)
   alternating with **ONNX shape inference** (``onnx.shape_inference``, with data
   propagation) until nothing folds: inference gives every value a known type and shape
   for the folding; stale ``value_info`` from the exporter (dynamic dims) is dropped first.
   It runs on a copy whose weights are typed inputs without data, as does onnx's function
   inliner: both serialize the model, and a protobuf message cannot exceed 2 GiB
   (:func:`.loading.weightless`).
4. **Rewrites of what TVM converts badly**: ``SAME`` auto-padding as explicit pads
   (:func:`explicit_auto_pad`), inference-mode ``Dropout`` as ``Identity``
   (:func:`inference_dropout_as_identity`), and matmuls by blockwise-dequantized int4/int8
   weights (opset 21) as ``MatMulNBits``
   (:func:`~.weight_only.blockwise_matmuls_as_nbits`); then the ``MatMulNBits`` reading
   the same input packed into one (:func:`~.weight_only.packed_sibling_matmuls`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx.inliner
import onnx.shape_inference
from onnx import helper, numpy_helper

from tpp_tvm.errors import ModelLoadError
from tpp_tvm.onnx_static import MAX_SHAPE_DATA, static_shapes

from .folding import fold_once, subgraphs
from .loading import ModelLike, check_versions, load_model, weightless
from .shapes import graph_inputs, static_input_shapes
from .weight_only import blockwise_matmuls_as_nbits, packed_sibling_matmuls

logger = logging.getLogger(__name__)


def _inline_functions(model: onnx.ModelProto) -> None:
    """Inline the model's local functions in place (TVM's converter knows no functions),
    on a weightless copy (:func:`.loading.weightless`): onnx's inliner serializes the model."""
    inlined = onnx.inliner.inline_local_functions(weightless(model, 0))
    for field in ("node", "value_info"):
        model.graph.ClearField(field)
        getattr(model.graph, field).extend(getattr(inlined.graph, field))
    for field in ("functions", "opset_import"):
        model.ClearField(field)
        getattr(model, field).extend(getattr(inlined, field))


def _infer_shapes(model: onnx.ModelProto) -> None:
    """Infer every value's shape afresh, in place, on a weightless copy
    (:func:`.loading.weightless`; initializers up to :data:`MAX_SHAPE_DATA` elements keep their
    values for data propagation). The previous round's ``value_info`` is dropped first:
    inference keeps an existing entry, so a dimension it could not know before a fold
    (``unk__0`` from an ``Add`` whose other input was a computed position-id gather, in
    transformers' DistilBERT) would stay unknown after the fold made it static, and the
    ``Shape`` nodes reading it would never fold."""
    del model.graph.value_info[:]
    light = weightless(model, MAX_SHAPE_DATA)
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
        if any(True for _ in subgraphs(node)):  # their value_info is inferred too
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

    This is the ONNX-level half of :func:`~tpp_tvm.frontend.importer.from_onnx` (see the
    module docstring for what it does and why); the result is an ordinary ONNX model, so
    ONNX Runtime can run it too.
    """
    model = load_model(model_or_path)
    check_versions(model)
    _check_outputs(model.graph)
    if model.functions:
        _inline_functions(model)
    static_input_shapes(model, shape_dict)
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
        done = fold_once(model.graph, model.opset_import)
        if not done:
            break
        folded += done
    if folded:
        counts = {op: folded.count(op) for op in sorted(set(folded))}
        logger.debug("folded %d nodes: %s", len(folded), counts)
    explicit_auto_pad(model.graph)
    inference_dropout_as_identity(model.graph)
    blockwise_matmuls_as_nbits(model)
    packed_sibling_matmuls(model)
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

