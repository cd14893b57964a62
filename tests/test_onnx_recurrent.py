"""ONNX LSTM and GRU unrolled into Relax (``onnx_recurrent.py``), against ONNX Runtime:
torch exports (stacked, bidirectional, batch-first) and ``onnx.helper`` nodes for the
attributes torch never writes (peepholes, coupled gates, clip, GRU's reset before the
linear map, reverse direction, initial states)."""

from __future__ import annotations

import io

import checks
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tpp_tvm
from tpp_tvm.errors import UnsupportedOperatorError

pytestmark = pytest.mark.requires_onnxruntime
RNG = np.random.default_rng(11)


def _torch_export(kind: str, bidirectional: bool, batch_first: bool) -> onnx.ModelProto:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    rnn = getattr(torch.nn, kind)(12, 16, num_layers=2, batch_first=batch_first,
                                  bidirectional=bidirectional).eval()
    x = torch.randn(2, 4, 12) if batch_first else torch.randn(4, 2, 12)
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(rnn, (x,), buffer, opset_version=17, dynamo=False,
                          input_names=["x"], output_names=["y", "h"])
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.requires_torch
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("bidirectional,batch_first", [
    pytest.param(False, True, marks=pytest.mark.slow), (True, False)])
def test_torch_rnn_layers_match_onnxruntime(kind, bidirectional, batch_first) -> None:
    model = _torch_export(kind, bidirectional, batch_first)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = RNG.standard_normal(shape).astype("float32")
    report = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4,
                                                 atol=1e-5).report()
    assert "tpp.dense" in report, report


def _node_model(op: str, hidden: int, gates: int, attrs: dict, peepholes: bool = False,
                initial: bool = False, layout: int = 0, seed: int = 0
                ) -> tuple[onnx.ModelProto, dict]:
    rng = np.random.default_rng(seed)
    seq, batch, size = 3, 3, 4
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    inits = {"W": rng.standard_normal((dirs, gates * hidden, size)) * 0.5,
             "R": rng.standard_normal((dirs, gates * hidden, hidden)) * 0.5,
             "B": rng.standard_normal((dirs, 2 * gates * hidden)) * 0.5}
    names = ["x", "W", "R", "B", "", "", "", ""]
    if initial:
        def state() -> np.ndarray:  # (dirs, batch, hidden), batch first for layout 1
            value = rng.standard_normal((dirs, batch, hidden))
            return value.transpose(1, 0, 2) if layout else value
        inits["h0"] = state()
        names[5] = "h0"
        if op == "LSTM":
            inits["c0"] = state()
            names[6] = "c0"
    if peepholes:
        inits["P"] = rng.standard_normal((dirs, 3 * hidden)) * 0.5
        names[7] = "P"
    names = names[:8 if op == "LSTM" else 6]
    while names[-1] == "":
        names.pop()
    outputs = ["y", "yh", "yc"] if op == "LSTM" else ["y", "yh"]
    node = helper.make_node(op, names, outputs, hidden_size=hidden, layout=layout, **attrs)
    x_shape = [batch, seq, size] if layout else [seq, batch, size]
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(v.astype("float32"), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    x = rng.standard_normal([seq, batch, size]).astype("float32")
    return model, {"x": x.transpose(1, 0, 2).copy() if layout else x}


@pytest.mark.parametrize("attrs,peepholes,initial,layout", [
    ({"direction": "reverse"}, True, True, 0),
    ({"input_forget": 1, "clip": 0.7}, False, False, 0),
    ({"direction": "bidirectional", "activations": ["Relu", "Tanh", "Sigmoid"] * 2},
     False, True, 0),
])
def test_lstm_attributes_match_onnxruntime(attrs, peepholes, initial, layout) -> None:
    model, feeds = _node_model("LSTM", 6, 4, attrs, peepholes, initial, layout)
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attrs,initial", [
    ({"linear_before_reset": 0}, True),
    ({"linear_before_reset": 1, "direction": "bidirectional", "clip": 0.5}, False),
])
def test_gru_attributes_match_onnxruntime(attrs, initial) -> None:
    model, feeds = _node_model("GRU", 5, 3, attrs, initial=initial)
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op,gates", [("LSTM", 4), ("GRU", 3)])
def test_batch_major_layout_is_the_sequence_major_result_transposed(op, gates) -> None:
    """``layout=1`` (batch first; ONNX Runtime has no kernel for it) gives the layout-0
    results with batch and sequence axes swapped."""
    from tpp_tvm.onnxruntime_ref import run_onnxruntime

    attrs = {"direction": "bidirectional"}
    seq_major, feeds = _node_model(op, 6, gates, attrs, initial=True, seed=3)
    batch_major, batch_feeds = _node_model(op, 6, gates, attrs, initial=True, layout=1, seed=3)
    want = run_onnxruntime(seq_major, feeds)
    got = tpp_tvm.compile_onnx(batch_major, target=tpp_tvm.target(num_cores=1))(**batch_feeds)
    np.testing.assert_allclose(got[0], want[0].transpose(2, 0, 1, 3), rtol=1e-4, atol=1e-5)
    for state_got, state_want in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(state_got, state_want.transpose(1, 0, 2), rtol=1e-4,
                                   atol=1e-5)


def test_unsupported_activation_names_the_node() -> None:
    model, _ = _node_model("GRU", 5, 3, {"activations": ["HardSigmoid", "Tanh"]})
    with pytest.raises(UnsupportedOperatorError, match="GRU node .*HardSigmoid"):
        tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))
