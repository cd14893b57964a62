"""Decomposed activations that exporters emit, recognised as one op (``canonicalize.py``):
GPT-2's tanh-GELU after a MatMul fuses into the GEMM epilogue, with ORT's result; Llama's
RMS norm in the forms exporters write becomes one row-wise kernel."""

from __future__ import annotations

import math

import checks
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm_ffi import structural_equal

import tpp_tvm


def _tanh_gelu_model(half_first: bool, coef: float = 0.044715):
    rng = np.random.default_rng(3)
    consts = {"w": (rng.standard_normal((64, 48)) * 0.2).astype("float32"),
              "three": np.float32(3.0), "coef": np.float32(coef),
              "scale": np.float32(math.sqrt(2 / math.pi)), "one": np.float32(1.0),
              "half": np.float32(0.5)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Pow", ["h", "three"], ["cube"]),
             helper.make_node("Mul", ["cube", "coef"], ["c3"]),
             helper.make_node("Add", ["h", "c3"], ["inner"]),
             helper.make_node("Mul", ["inner", "scale"], ["arg"]),
             helper.make_node("Tanh", ["arg"], ["th"]),
             helper.make_node("Add", ["th", "one"], ["cdf"])]
    if half_first:  # torch: 0.5 * x * (1 + tanh(...))
        nodes += [helper.make_node("Mul", ["h", "half"], ["hh"]),
                  helper.make_node("Mul", ["hh", "cdf"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["h", "cdf"], ["hc"]),
                  helper.make_node("Mul", ["hc", "half"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [37, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("half_first", [True, False])
def test_tanh_gelu_fuses_into_the_gemm(half_first: bool) -> None:
    model = _tanh_gelu_model(half_first)
    x = np.random.default_rng(0).standard_normal((37, 64)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    assert "gelu_tanh" in compiled.report()


def test_other_constants_are_not_tanh_gelu() -> None:
    compiled = tpp_tvm.compile_onnx(_tanh_gelu_model(True, coef=0.05),
                                    target=tpp_tvm.target(num_cores=1))
    assert "gelu_tanh" not in compiled.report()


def test_silu_in_either_order_is_one_activation() -> None:
    """EfficientNet's x * sigmoid(x) becomes R.nn.silu, fused into a GEMM epilogue."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((24, 40)) * 0.3).astype("float32")
    for first in ("h", "s"):
        nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
                 helper.make_node("Sigmoid", ["h"], ["s"]),
                 helper.make_node("Mul", [first, "s" if first == "h" else "h"], ["y"])]
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [13, 24])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(w, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        x = rng.standard_normal((13, 24)).astype("float32")
        compiled = tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))
        h = x @ w
        np.testing.assert_allclose(compiled(x=x)[0], h / (1 + np.exp(-h)), rtol=1e-4, atol=1e-5)
        assert "silu" in compiled.report()


def test_identity_casts_do_not_break_attention() -> None:
    """HF's ``softmax(...).to(float32)`` between softmax and the second matmul (two no-op
    Casts in the export) still matches as one attention kernel; a real cast stays."""
    from tpp_tvm.relay_passes.canonicalize import drop_identity_casts

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 13, 8)).astype("float32") for _ in range(3))
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "c"], ["z"]),
             helper.make_node("Softmax", ["z"], ["p"], axis=-1),
             helper.make_node("Cast", ["p"], ["p1"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["p1"], ["p2"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["p2", "v"], ["o"])]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 13, 8])
            for n in ("q", "k", "v")]
    graph = helper.make_graph(nodes, "attn", info,
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT,
                                                             [1, 2, 13, 8])],
                              [numpy_helper.from_array(np.array(0.35, "float32"), "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = checks.assert_runs_like_onnxruntime(model, {"q": q, "k": k, "v": v},
                                                   rtol=1e-5, atol=1e-6)
    assert "tpp.attention_mulscale: 1" in compiled.report()

    from tvm import relax
    from tvm.script import relax as R

    @R.function
    def f(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float16"):
        a = R.astype(x, "float32")
        b = R.astype(a, "float16")
        return b

    ops = [b.value.op.name for b in drop_identity_casts(f).body.blocks[0].bindings
           if isinstance(b.value, relax.Call)]
    assert ops == ["relax.astype"]  # the fp16 cast stays, the fp32 one is gone


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("mask", [False, True])
def test_a_scaled_query_moves_onto_the_scores(mask: bool) -> None:
    """timm's attention, ``softmax((q * c) @ kᵀ (+ mask)) @ v``, runs as one attention
    kernel: the scale moves from Q onto the scores."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 3, 19, 16)).astype("float32") for _ in range(3))
    nodes = [helper.make_node("Mul", ["q", "c"], ["qc"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qc", "kt"], ["s"]),
             *([helper.make_node("Add", ["s", "m"], ["sm"])] if mask else []),
             helper.make_node("Softmax", ["sm" if mask else "s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    consts = [numpy_helper.from_array(np.array(0.25, "float32"), "c"),
              numpy_helper.from_array(rng.standard_normal((1, 1, 19, 19)).astype("float32"),
                                      "m")]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 19, 16])
            for n in ("q", "k", "v")]
    graph = helper.make_graph(nodes, "attn", info,
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT,
                                                             [1, 3, 19, 16])],
                              consts[:2 if mask else 1])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = checks.assert_runs_like_onnxruntime(model, {"q": q, "k": k, "v": v},
                                                   rtol=1e-5, atol=1e-5)
    name = "tpp.attention_mask_mulscale" if mask else "tpp.attention_mulscale"
    assert f"{name}: 1" in compiled.report(), compiled.report()


def test_a_scaled_operand_of_another_matmul_stays() -> None:
    """Only attention scores take the scale after the product: a dense layer's scaled
    input stays as it is (after it, it would be a pass over the wider output)."""
    from tvm.script import relax as R

    from tpp_tvm.relay_passes.canonicalize import merge_operand_scales

    @R.function
    def f(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 32), "float32")
          ) -> R.Tensor((4, 32), "float32"):
        a = R.multiply(x, R.const(0.5, "float32"))
        y = R.matmul(a, w)
        z = R.nn.relu(y)
        return z

    assert structural_equal(merge_operand_scales(f), f)


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("form", ["pow_square", "mul_square", "div_sqrt"])
def test_rms_norm_forms_are_one_kernel(form: str) -> None:
    """``gamma * x / sqrt(mean(x^2) + eps)`` as torch exports ``x * torch.rsqrt(..)`` (Pow,
    ReduceMean, Sqrt, Div(1, .)), with ``x * x`` and gamma first, or as ``x / sqrt(..)``;
    a single row (a decoder step) included."""
    rng = np.random.default_rng(5)
    consts = {"two": np.float32(2.0), "eps": np.float32(1e-6), "one": np.float32(1.0),
              "gamma": rng.standard_normal(96).astype("float32")}
    square = (helper.make_node("Pow", ["x", "two"], ["sq"]) if form == "pow_square" else
              helper.make_node("Mul", ["x", "x"], ["sq"]))
    nodes = [square, helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["s"])]
    if form == "div_sqrt":
        nodes += [helper.make_node("Div", ["x", "s"], ["n"]),
                  helper.make_node("Mul", ["n", "gamma"], ["y"])]
    else:
        nodes += [helper.make_node("Div", ["one", "s"], ["r"]),
                  helper.make_node("Mul", ["x", "r"], ["n"]),
                  helper.make_node("Mul", ["gamma", "n"], ["y"])]
    for rows in (1, 6):
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 96])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        x = rng.standard_normal((rows, 96)).astype("float32")
        compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-5, atol=1e-5)
        assert "tpp.rms_norm: 1" in compiled.report()


@pytest.mark.requires_onnxruntime
def test_epilogues_behind_a_row_reshape_fuse_into_the_gemm() -> None:
    """GPT-2's Conv1D flattens rows around each GEMM (MatMul + Add on 2-D rows, then a
    Reshape to (batch, seq, n)): the activation and the residual add after the reshape
    still fuse into the GEMMs' epilogues (the reshape sinks below them), against ORT."""
    rng = np.random.default_rng(8)
    consts = {"w1": rng.standard_normal((64, 48)) * 0.2, "b1": rng.standard_normal(48),
              "w2": rng.standard_normal((48, 64)) * 0.2, "b2": rng.standard_normal(64),
              "s3": np.array([1, 37, 48]), "s2": np.array([37, 48]),
              "so": np.array([1, 37, 64])}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Reshape", ["hb", "s3"], ["h3"]),
             helper.make_node("Tanh", ["h3"], ["a3"]),
             helper.make_node("Reshape", ["a3", "s2"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["ob"]),
             helper.make_node("Reshape", ["ob", "so"], ["o3"]),
             helper.make_node("Add", ["r", "o3"], ["y"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f, [37, 64]),
                     helper.make_tensor_value_info("r", f, [1, 37, 64])],
        [helper.make_tensor_value_info("y", f, None)],
        [numpy_helper.from_array(np.asarray(v, "int64" if k.startswith("s") else "float32"), k)
         for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal((37, 64)).astype("float32"),
             "r": rng.standard_normal((1, 37, 64)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    lowered = compiled.report_data["lowered"]
    assert set(lowered) == {"tpp.dense_bias_tanh", "tpp.dense_bias_residual"}, lowered


def test_single_input_concats_are_dropped() -> None:
    """``concat((x,))`` (a decoder export's cache concat with no past) is ``x`` itself; a
    concat of two tensors stays."""
    from tvm import relax

    from tpp_tvm.relay_passes.canonicalize import drop_single_concats

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            one = bb.emit(relax.op.concat([x], axis=0))
            two = bb.emit(relax.op.concat([one, x], axis=0))
            out = bb.emit_output(relax.op.nn.relu(two))
        bb.emit_func_output(out)
    text = str(drop_single_concats(bb.get()["main"]))
    assert text.count("R.concat(") == 1 and "R.concat((x, x)" in text, text


@pytest.mark.parametrize("scale_shape, folds", [((48,), True), ((1, 1, 48), True), ((), True),
                                                ((37, 1), False)])
def test_a_constant_output_scale_folds_into_the_weights(scale_shape, folds) -> None:
    """``(x @ W + b) * c`` with ``c`` per output column (ConvNeXt's layer scale) becomes
    ``x @ (W c) + b c``, same values; a scale per row stays a multiply."""
    import tvm
    from tvm import relax

    from tpp_tvm.relay_passes.canonicalize import fold_output_scales

    rng = np.random.default_rng(4)
    w, b = rng.standard_normal((64, 48)).astype("float32"), rng.standard_normal(48)
    c = rng.uniform(0.5, 2.0, scale_shape).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 37, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.add(relax.op.matmul(x, relax.const(w)),
                                     relax.const(b.astype("float32"))))
            out = bb.emit_output(relax.op.multiply(relax.const(c), h))
        bb.emit_func_output(out)
    mod = bb.get()
    folded = tvm.IRModule({"main": fold_output_scales(mod["main"])})
    assert ("R.multiply" not in str(folded["main"])) == folds, folded["main"]
    xs = rng.standard_normal((1, 37, 64)).astype("float32")
    runs = []
    for m in (mod, folded):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        runs.append(vm["main"](tvm.runtime.tensor(xs)).numpy())
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5, atol=1e-5)


def test_a_scaled_product_read_elsewhere_too_is_not_folded() -> None:
    """``h * c`` where ``h = x @ W + b`` is also read unscaled: folding ``c`` into a copy of
    the weights would run the GEMM twice (CLIP's ``h * sigmoid(1.702 h)`` did)."""
    from tvm import relax

    from tpp_tvm.relay_passes.canonicalize import fold_output_scales

    rng = np.random.default_rng(5)
    w, b = rng.standard_normal((16, 8)).astype("float32"), rng.standard_normal(8)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.add(relax.op.matmul(x, relax.const(w)),
                                     relax.const(b.astype("float32"))))
            s = bb.emit(relax.op.sigmoid(relax.op.multiply(h, relax.const(np.float32(1.5)))))
            out = bb.emit_output(relax.op.multiply(h, s))
        bb.emit_func_output(out)
    text = str(fold_output_scales(bb.get()["main"]))
    assert text.count("R.matmul(") == 1, text


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("order", ["xs", "sx"])
def test_quick_gelu_fuses_into_the_gemm(order: str) -> None:
    """CLIP's ``h * sigmoid(1.702 h)`` after a MatMul + bias is one GEMM epilogue
    (``dense_bias_quick_gelu``), either operand order; another scale is not quick GELU."""
    rng = np.random.default_rng(6)
    consts = {"w": (rng.standard_normal((40, 24)) * 0.3).astype("float32"),
              "b": rng.standard_normal(24).astype("float32"), "c": np.float32(1.702)}
    for scale, fused in ((1.702, True), (1.5, False)):
        consts["c"] = np.float32(scale)
        pair = ["h", "s"] if order == "xs" else ["s", "h"]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]),
                 helper.make_node("Add", ["p", "b"], ["h"]),
                 helper.make_node("Mul", ["c", "h"] if order == "xs" else ["h", "c"], ["hc"]),
                 helper.make_node("Sigmoid", ["hc"], ["s"]),
                 helper.make_node("Mul", pair, ["y"])]
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [11, 40])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        x = (rng.standard_normal((11, 40)) * 3).astype("float32")
        report = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-5,
                                                     atol=1e-5).report()
        assert ("tpp.dense_bias_quick_gelu: 1" in report) == fused, report
        assert report.count("tpp.dense") == 1, report


@pytest.mark.requires_onnxruntime
def test_parallel_convolutions_of_one_input_merge_into_one() -> None:
    """A re-parameterisable block's branches (two 3x3 and a 1x1 convolution of the same
    input, summed, MobileOne's and RepVGG's): one convolution with the summed filters,
    zero-padded to 3x3, and the summed biases, against ORT."""
    import checks
    from onnx import helper

    rng = np.random.default_rng(0)
    c = 16
    consts = {"w3": rng.standard_normal((c, c, 3, 3)) * 0.2, "b3": rng.standard_normal(c),
              "w1": rng.standard_normal((c, c, 1, 1)) * 0.2, "b1": rng.standard_normal(c),
              "v3": rng.standard_normal((c, c, 3, 3)) * 0.2, "c3": rng.standard_normal(c)}
    nodes = [helper.make_node("Conv", ["x", "w3", "b3"], ["a"], pads=[1] * 4),
             helper.make_node("Conv", ["x", "v3", "c3"], ["a2"], pads=[1] * 4),
             helper.make_node("Conv", ["x", "w1", "b1"], ["b"]),
             helper.make_node("Add", ["a", "a2"], ["s1"]),
             helper.make_node("Add", ["s1", "b"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = checks.onnx_model(nodes, {"x": [1, c, 12, 12]}, consts)
    feeds = {"x": rng.standard_normal((1, c, 12, 12)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert compiled.report_data["lowered"] == {"tpp.conv2d_bias_relu": 1}
