"""ONNX's TensorScatter (a KV cache update): written into the input tensor itself where the
cache is a graph input, into a copy elsewhere; linear and circular modes against ONNX's
reference implementation."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tpp_tvm


def _model(cache: list[int], rows: int, axis: int, mode: str, computed: bool = False
           ) -> onnx.ModelProto:
    """present = TensorScatter(past, update, write_indices) (past first doubled when
    ``computed``: not a graph input), and a sum of present read after it."""
    update = list(cache)
    update[axis] = rows
    past = "doubled" if computed else "past"
    nodes = [helper.make_node("Add", ["past", "past"], ["doubled"])] if computed else []
    nodes += [helper.make_node("TensorScatter", [past, "update", "write_indices"],
                               ["present"], axis=axis, mode=mode),
              helper.make_node("ReduceSum", ["present"], ["total"], keepdims=0)]
    graph = helper.make_graph(nodes, "scatter", [
        helper.make_tensor_value_info("past", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("update", TensorProto.FLOAT, update),
        helper.make_tensor_value_info("write_indices", TensorProto.INT64, [cache[0]])],
        [helper.make_tensor_value_info("present", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])


def _inputs(model: onnx.ModelProto, indices: list[int]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in model.graph.input}
    return {"past": rng.standard_normal(shapes["past"]).astype(np.float32),
            "update": rng.standard_normal(shapes["update"]).astype(np.float32),
            "write_indices": np.array(indices, np.int64)}


@pytest.mark.parametrize(("cache", "rows", "axis", "mode", "indices"), [
    ([2, 3, 7, 8], 1, 2, "linear", [2, 6]),  # a decoding step, (batch, heads, slots, dim)
    ([2, 3, 7, 8], 3, -2, "linear", [0, 4]),
    ([2, 7, 5], 2, 1, "linear", [5, 1]),  # (batch, slots, hidden)
    ([2, 3, 6, 4], 4, 2, "circular", [4, 5]),  # wraps around the cache
])
def test_matches_onnx_reference(cache, rows, axis, mode, indices) -> None:
    model = _model(cache, rows, axis, mode)
    feed = _inputs(model, indices)
    want = ReferenceEvaluator(model).run(None, feed)
    compiled = tpp_tvm.compile_onnx(model)
    got = compiled(**feed)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


def test_graph_input_is_written_in_place_and_returned() -> None:
    """Where the cache is a graph input, present is that tensor with the rows written: no
    copy of the cache (what a decoding step relies on)."""
    model = _model([1, 2, 9, 4], 1, 2, "linear")
    feed = _inputs(model, [3])
    compiled = tpp_tvm.compile_onnx(model)
    past = tvm.runtime.tensor(feed["past"])
    present, _ = compiled.run_tensors([past, tvm.runtime.tensor(feed["update"]),
                                       tvm.runtime.tensor(feed["write_indices"])])
    want = feed["past"].copy()
    want[:, :, 3] = feed["update"][:, :, 0]
    np.testing.assert_array_equal(past.numpy(), want)
    assert present.same_as(past)


def test_computed_cache_is_copied() -> None:
    """A cache computed in the graph is not an input to write into: present is a new tensor
    and what it was computed from is left alone."""
    model = _model([2, 2, 5, 4], 2, 2, "linear", computed=True)
    feed = _inputs(model, [1, 3])
    want = ReferenceEvaluator(model).run(None, feed)
    compiled = tpp_tvm.compile_onnx(model)
    past = tvm.runtime.tensor(feed["past"])
    present, _ = compiled.run_tensors([past, tvm.runtime.tensor(feed["update"]),
                                       tvm.runtime.tensor(feed["write_indices"])])
    np.testing.assert_array_equal(present.numpy(), want[0])
    np.testing.assert_array_equal(past.numpy(), feed["past"])


def test_rows_past_the_end_are_not_written() -> None:
    """Linear mode leaves rows beyond the cache undefined: they are dropped, never stored
    out of bounds."""
    model = _model([1, 1, 4, 2], 3, 2, "linear")
    feed = _inputs(model, [2])
    got = tpp_tvm.compile_onnx(model)(**feed)[0]
    want = feed["past"].copy()
    want[:, :, 2:] = feed["update"][:, :, :2]
    np.testing.assert_array_equal(got, want)


def test_mismatched_shapes_are_refused_by_name() -> None:
    model = _model([2, 3, 7, 8], 1, 2, "linear")
    model.graph.input[1].type.tensor_type.shape.dim[1].dim_value = 4
    with pytest.raises(tpp_tvm.errors.TPPError, match="TensorScatter of a \\[2, 4, 1, 8\\]"):
        tpp_tvm.compile_onnx(model)
