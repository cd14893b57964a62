"""ONNX Runtime's contrib operators of LLM exports (tpp_tvm.frontend.contrib_ops), each
against ONNX Runtime on small graphs from ``onnx.helper``."""

from __future__ import annotations

import checks
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(11)
B, S = 2, 5


def _model(nodes: list, inputs: dict[str, tuple[int, list[int]]], inits: dict[str, np.ndarray],
           opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_and_simplified_layer_norms_run_on_the_rms_norm_kernel(with_bias) -> None:
    """SkipSimplifiedLayerNormalization's normed output and residual sum (its 4th output,
    which the next layer reads), then SimplifiedLayerNormalization: both RMS-norm TPPs."""
    h = 64
    inits = {"g": RNG.standard_normal(h).astype("float32"),
             "g2": RNG.standard_normal(h).astype("float32")}
    skip_inputs = ["x", "skip", "g"]
    if with_bias:
        inits["bias"] = RNG.standard_normal(h).astype("float32")
        skip_inputs += ["bias"]
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", skip_inputs,
                              ["y", "", "", "sum"], domain="com.microsoft", epsilon=1e-6),
             helper.make_node("SimplifiedLayerNormalization", ["sum", "g2"], ["z"],
                              axis=-1, epsilon=1e-5),
             helper.make_node("Add", ["y", "z"], ["out"])]
    shape = [B, S, h]
    model = _model(nodes, {"x": (TensorProto.FLOAT, shape), "skip": (TensorProto.FLOAT, shape)},
                   inits)
    feeds = {k: RNG.standard_normal(shape).astype("float32") for k in ("x", "skip")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert compiled.report_data["lowered"].get("tpp.rms_norm") == 2, compiled.report_data


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rank,rotary", [(3, 16), (4, 16), (4, 8)])
def test_rotary_embedding_of_microsoft_domain(interleaved, rank, rotary) -> None:
    """Halves or interleaved pairs, (batch, sequence, heads x size) or (batch, heads,
    sequence, size) inputs, the whole head or its first channels rotated."""
    heads, head = 4, 16
    inits = {"cos": RNG.standard_normal((32, rotary // 2)).astype("float32"),
             "sin": RNG.standard_normal((32, rotary // 2)).astype("float32")}
    shape = [B, S, heads * head] if rank == 3 else [B, heads, S, head]
    attrs = {"interleaved": interleaved, "num_heads": heads}
    if rotary != head:
        attrs["rotary_embedding_dim"] = rotary
    nodes = [helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"],
                              domain="com.microsoft", **attrs)]
    model = _model(nodes, {"x": (TensorProto.FLOAT, shape), "pos": (TensorProto.INT64, [B, S])},
                   inits)
    feeds = {"x": RNG.standard_normal(shape).astype("float32"),
             "pos": np.stack([np.arange(3, 3 + S), np.arange(9, 9 + S)]).astype("int64")}
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)


def test_rotary_embedding_from_one_start_position() -> None:
    """A decode step's position ids as one start offset (shape (1,)): positions start,
    start + 1, ... for every batch row."""
    heads, head = 2, 8
    inits = {"cos": RNG.standard_normal((16, head // 2)).astype("float32"),
             "sin": RNG.standard_normal((16, head // 2)).astype("float32")}
    shape = [1, S, heads * head]
    nodes = [helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"],
                              domain="com.microsoft", num_heads=heads)]
    model = _model(nodes, {"x": (TensorProto.FLOAT, shape), "pos": (TensorProto.INT64, [1])},
                   inits)
    feeds = {"x": RNG.standard_normal(shape).astype("float32"),
             "pos": np.array([4], dtype="int64")}
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)


def test_rotary_embedding_refuses_packed_batches_naming_them() -> None:
    import tpp_tvm
    from tpp_tvm.errors import TPPError

    nodes = [helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"],
                              domain="com.microsoft", num_heads=2, is_packed_batching=1)]
    inits = {"cos": np.ones((8, 4), "float32"), "sin": np.ones((8, 4), "float32")}
    model = _model(nodes, {"x": (TensorProto.FLOAT, [1, S, 16]),
                           "pos": (TensorProto.INT64, [1, S])}, inits)
    with pytest.raises(TPPError, match="is_packed_batching"):
        tpp_tvm.compile_onnx(model)


def test_rotary_embedding_of_onnx_opset_23() -> None:
    """The standard operator's input order (X, cos_cache, sin_cache, position_ids), 4-D."""
    heads, head = 2, 8
    inits = {"cos": RNG.standard_normal((16, head // 2)).astype("float32"),
             "sin": RNG.standard_normal((16, head // 2)).astype("float32")}
    shape = [B, heads, S, head]
    nodes = [helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"])]
    model = _model(nodes, {"x": (TensorProto.FLOAT, shape), "pos": (TensorProto.INT64, [B, S])},
                   inits, opset=23)
    feeds = {"x": RNG.standard_normal(shape).astype("float32"),
             "pos": np.stack([np.arange(S), np.arange(2, 2 + S)]).astype("int64")}
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,zero_points", [(4, False), (4, True), (8, False), (8, True)])
def test_gather_block_quantized_embeddings(bits, zero_points) -> None:
    """Quantized embedding rows (GenAI's model builder): u8 codes (two 4-bit codes a byte,
    low nibble first), per-block scales over a width the block does not divide (80 = 2.5
    blocks of 32), zero points packed like the codes or the default."""
    vocab, width, block = 50, 80, 32
    blocks = -(-width // block)
    per_byte = 8 // bits
    inits = {"data": RNG.integers(0, 256, (vocab, width // per_byte)).astype("uint8"),
             "scales": RNG.uniform(0.01, 0.1, (vocab, blocks)).astype("float32")}
    node_inputs = ["data", "ids", "scales"]
    if zero_points:
        inits["zp"] = RNG.integers(0, 256, (vocab, -(-blocks // per_byte))).astype("uint8")
        node_inputs.append("zp")
    nodes = [helper.make_node("GatherBlockQuantized", node_inputs, ["y"], domain="com.microsoft",
                              bits=bits, block_size=block, gather_axis=0, quantize_axis=1)]
    model = _model(nodes, {"ids": (TensorProto.INT64, [2, 5])}, inits)
    feeds = {"ids": np.array([[0, 3, 49, 7, 7], [12, 1, 0, 48, 25]], dtype="int64")}
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-6, atol=1e-6)
