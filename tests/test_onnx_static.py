"""Tests of what tpp_tvm knows statically about an ONNX graph (``tpp_tvm.onnx_static``):
node-by-node shape inference over folded constants, and the sentence naming where static
knowledge stopped. Graphs from ``onnx.helper``; end-to-end folding is in test_frontend.py."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tpp_tvm.onnx_static import StaticTypes, static_dims, why_not_static


def _i64(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _graph(nodes, inits=(), shape=(1, 5, 8)) -> onnx.GraphProto:
    return helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], list(inits))


def test_slice_shape_is_learned_from_constant_bounds() -> None:
    """A Slice whose bounds a fold just made constant: its output shape is known at once,
    so the next block's ``Shape`` can fold in the same pass."""
    graph = _graph([helper.make_node("Slice", ["x", "zero", "half", "axis"], ["y"])],
                   [_i64("zero", [0]), _i64("axis", [-1])])
    known = StaticTypes(graph, [helper.make_opsetid("", 17)])
    assert "y" not in known.shapes
    half = np.array([3], np.int64)
    known.add_constant("half", half)
    known.infer(graph.node[0], lambda name: half if name == "half" else None)
    assert "y" not in known.shapes  # "zero" and "axis" are not given as values: no guess
    values = {"zero": np.array([0], np.int64), "half": half, "axis": np.array([-1], np.int64)}
    known.infer(graph.node[0], values.get)
    assert known.shapes["y"] == (1, 5, 3)
    assert static_dims(known.types["y"]) == (1, 5, 3)


def test_inference_needs_every_input_static() -> None:
    graph = _graph([helper.make_node("Relu", ["unknown"], ["y"])])
    known = StaticTypes(graph, [helper.make_opsetid("", 17)])
    known.infer(graph.node[0], lambda name: None)
    assert "y" not in known.shapes


def test_an_unfolded_op_in_pad_arithmetic_is_named() -> None:
    """Pads computed from constants through an op folding does not evaluate: the sentence
    names that node, its op and its input shapes."""
    nodes = [helper.make_node("Sign", ["raw"], ["signs"], name="pad_sign"),
             helper.make_node("Abs", ["signs"], ["pads"], name="pad_abs"),
             helper.make_node("Pad", ["x", "pads"], ["y"], name="pad")]
    graph = _graph(nodes, [_i64("raw", [0, 0, 0, 1, 0, 0, 0, -1])], shape=(1, 2, 3, 4))
    why = why_not_static(graph, "pad")
    assert "input 'pads'" in why and "Sign node 'pad_sign' (input shapes [8])" in why, why
    assert why_not_static(graph, "no such node") == ""


def test_a_lost_shape_is_traced_to_the_node_that_lost_it() -> None:
    nodes = [helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
             helper.make_node("Transpose", ["nz"], ["t"], name="transpose"),
             helper.make_node("Reshape", ["t", "flat"], ["y"], name="reshape")]
    graph = _graph(nodes, [_i64("flat", [-1])], shape=(4, 3))
    why = why_not_static(graph, "reshape")
    assert "input 't' has no static shape" in why
    assert "NonZero node 'nonzero' (input shapes [4, 3])" in why, why


def test_data_inputs_are_not_blamed() -> None:
    """An input computed from the graph input's values is data, not shape arithmetic."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Reshape", ["r", "flat"], ["y"], name="reshape")]
    graph = _graph(nodes, [_i64("flat", [-1])])
    graph.value_info.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 5, 8]))
    assert why_not_static(graph, "reshape") == ""
