"""Constant folding with numpy, the pass: a graph's nodes whose inputs are constants become
initializers, one pass at a time (``clean_model`` repeats it with shape inference until
nothing changes). What each op computes is :data:`~tpp_tvm.frontend.fold_ops.FOLDS`.

``Constant`` nodes become initializers; ``Shape``/``Size`` of any value whose inferred
shape is static become constants; a node of :data:`FOLDS` over constants is evaluated. A
node that does not fold has its outputs' shapes inferred at once
(:class:`~tpp_tvm.onnx_static.StaticTypes`), so a chain through many blocks folds in one
pass. Once folded, an export with dynamic axes has static reshapes and no shape tensors.

Results that would grow a constant past a million elements are left to TVM. An
``Identity`` of a constant, or a fold repeating an earlier one, renames instead of copying:
shared weights stay shared (ALBERT).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tpp_tvm.onnx_static import StaticTypes

from .fold_ops import FOLDS

logger = logging.getLogger(__name__)

# Folding never creates a constant larger than this (unless an input already is that large).
_MAX_FOLD_ELEMENTS = 1 << 20

#: ONNX ops whose second operand a quantized model's int8 kernels take as an int8 weight.
_WEIGHT_OPERAND_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


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


def subgraphs(node: onnx.NodeProto) -> Iterable[onnx.GraphProto]:
    """The graphs ``node``'s attributes hold (an ``If``'s branches, a ``Loop``'s body)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name read by ``graph``'s nodes (subgraphs included) or outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for sub in subgraphs(node):
            used |= used_names(sub)
    return used


def _rename_inputs(node: onnx.NodeProto, alias: Mapping[str, str]) -> None:
    """Make ``node`` (and its subgraphs) read ``alias[name]`` wherever it read ``name``."""
    for i, name in enumerate(node.input):
        if name in alias:
            node.input[i] = alias[name]
    for sub in subgraphs(node):
        for inner in sub.node:
            _rename_inputs(inner, alias)
        for output in sub.output:
            output.name = alias.get(output.name, output.name)


def fold_once(graph: onnx.GraphProto,
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
    read = used_names(graph)
    quantized: set[str] = set()  # outputs of QuantizeLinear nodes folded in this pass
    weights = {name for node in graph.node if node.op_type in _WEIGHT_OPERAND_OPS
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
    if folded:
        replace_nodes(graph, kept, cache, protos)
    return folded


def replace_nodes(graph: onnx.GraphProto, kept: list[onnx.NodeProto],
                  values: Mapping[str, np.ndarray] | None = None,
                  protos: Mapping[str, onnx.TensorProto] | None = None) -> None:
    """Make ``kept`` the graph's nodes, with the initializers they still read (subgraphs
    included): the graph's own (``protos``, where known) and the new ``values``."""
    values, protos = values or {}, protos or {}
    del graph.node[:]
    graph.node.extend(kept)
    used = used_names(graph)
    # Edited in place: rebuilding the list would copy every weight once per round.
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name not in used:
            del graph.initializer[i]
    for name, value in values.items():
        if name in used and name not in protos:
            graph.initializer.append(numpy_helper.from_array(np.array(value, order="C"), name))


def _try_fold(
    node: onnx.NodeProto,
    const: Callable[[str], np.ndarray | None],
    shapes: dict[str, tuple[int, ...]],
) -> np.ndarray | None:
    """The value of ``node``'s one read output, or None to keep the node (not foldable,
    an input not constant, a fold that failed or would be too large)."""
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
    fold = FOLDS.get(op)
    if fold is None or any(True for _ in subgraphs(node)):
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
        value = fold(inputs, _attrs(node))
    except Exception as exc:  # an attribute combination we do not model: leave it to TVM
        logger.debug("not folding %s node %r: %s", op, node.name, exc)
        return None
    if value is None or value.dtype == object:  # strings stay with the exporter's nodes
        return None
    largest = max((v.size for v in inputs if v is not None), default=0)
    if value.size > max(_MAX_FOLD_ELEMENTS, largest):
        return None
    return np.asarray(value)

