"""Tests of ONNX import (tpp_tvm.frontend) over the local model generators (tpp_tvm.models).

Every generator exports at tiny size and imports; the MLP and BERT modules also build with
plain TVM and match ONNX Runtime. The error cases check the message names the problem.
"""

from __future__ import annotations

import sys

import checks
import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tpp_tvm import frontend, models
from tpp_tvm import onnxruntime_ref as ort_ref
from tpp_tvm.errors import (
    ModelLoadError,
    TPPError,
    UnsupportedOperatorError,
    UnsupportedShapeError,
)

# The model generators export from torch; ONNX Runtime is the reference.
pytestmark = [pytest.mark.requires_torch, pytest.mark.requires_onnxruntime]

TINY_BERT = models.TINY_ARGS["bert"]
TINY = {
    name: (lambda name=name: models.GENERATORS[name](**models.TINY_ARGS[name]))
    for name in models.GENERATORS
}


def _ops(mod: tvm.IRModule) -> set[str]:
    """Names of the Relax ops called in ``main``."""
    ops: set[str] = set()

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            ops.add(expr.op.name)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return ops


def _run_tvm(mod: tvm.IRModule, inputs: dict[str, np.ndarray]) -> np.ndarray:
    executable = tvm.compile(mod, target=checks.plain_llvm())
    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(v) for v in inputs.values()])
    return out.numpy()


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ------------------------------------------------------------------------------- generators


@pytest.mark.parametrize("name", sorted(TINY))
def test_generator_imports_with_constant_weights(name: str) -> None:
    model = TINY[name]()
    inputs = models.example_inputs(model)
    mod = frontend.from_onnx(model)
    params = mod["main"].params
    assert [p.name for p in params] == list(inputs)  # weights are not parameters
    for param, array in zip(params, inputs.values(), strict=True):
        assert tuple(int(d) for d in param.ty.shape) == array.shape
    relax.analysis.well_formed(mod)  # raises on the first violation
    assert "relax.matmul" in _ops(mod)


@pytest.mark.parametrize("name", ["small_cnn", "resnet50"])
def test_cnn_imports_as_conv2d(name: str) -> None:
    ops = _ops(frontend.from_onnx(TINY[name]()))
    assert {"relax.nn.conv2d", "relax.nn.relu", "relax.nn.max_pool2d"} <= ops


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_import_matches_onnxruntime(name: str) -> None:
    model = TINY[name]()
    inputs = models.example_inputs(model)
    expected = ort_ref.run_onnxruntime(model, inputs)[0]
    got = _run_tvm(frontend.from_onnx(model), inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_generators_are_deterministic_and_cached(tmp_path) -> None:
    first = models.mlp(batch=2, dims=(8, 8), cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.onnx"))) == 1
    again = models.mlp(batch=2, dims=(8, 8), cache_dir=tmp_path)
    fresh = models.mlp(batch=2, dims=(8, 8))
    for a, b in [(first, again), (first, fresh)]:
        for x, y in zip(a.graph.initializer, b.graph.initializer, strict=True):
            np.testing.assert_array_equal(numpy_helper.to_array(x), numpy_helper.to_array(y))
    ins_a, ins_b = models.example_inputs(first), models.example_inputs(fresh)
    np.testing.assert_array_equal(ins_a["input"], ins_b["input"])


def test_bert_mask_input_masks_the_tail() -> None:
    mask = models.example_inputs(models.bert_encoder(**TINY_BERT))["attention_mask"]
    assert mask.shape == (1, 1, 1, 16)
    assert (mask[..., :12] == 0).all() and (mask[..., 12:] == -10000).all()


# ------------------------------------------------------------------------------- cleanup


def test_dynamic_export_folds_shape_chains_with_shape_dict() -> None:
    model = models.bert_encoder(**TINY_BERT, dynamic=True)
    assert "Shape" in {n.op_type for n in model.graph.node}
    shapes = {"hidden_states": (2, 16, 64), "attention_mask": (2, 1, 1, 16)}
    cleaned = frontend.clean_model(model, shapes)
    left = {n.op_type for n in cleaned.graph.node}
    assert not left & {"Shape", "Gather", "Unsqueeze", "Concat", "Constant"}, left
    inputs = models.example_inputs(model, shapes)
    expected = ort_ref.run_onnxruntime(model, inputs)[0]
    np.testing.assert_allclose(ort_ref.run_onnxruntime(cleaned, inputs)[0], expected, atol=1e-5)
    mod = frontend.from_onnx(model, shapes)
    assert tuple(int(d) for d in mod["main"].params[0].ty.shape) == (2, 16, 64)


def _i64(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def test_shape_arithmetic_over_constants_folds_exactly() -> None:
    """Shape of an intermediate, Gather (negative index too), Unsqueeze, Concat, Cast, Slice,
    Squeeze, Mul, Range, Equal/Where, ConstantOfShape, Expand, Transpose: all become constants."""
    n = helper.make_node
    nodes = [
        n("Relu", ["x"], ["r"]),
        n("Shape", ["r"], ["s"]),  # [2, 3, 4], static only after shape inference
        n("Gather", ["s", "zero"], ["b"], axis=0),
        n("Gather", ["s", "minus_one"], ["last"], axis=0),
        n("Slice", ["s", "one_v", "two"], ["mid"]),
        n("Squeeze", ["mid", "zero_axis"], ["mid0"]),
        n("Mul", ["mid0", "last"], ["rest"]),
        n("Unsqueeze", ["b", "zero_axis"], ["b1"]),
        n("Unsqueeze", ["rest", "zero_axis"], ["rest1"]),
        n("Concat", ["b1", "rest1"], ["target"], axis=0),
        n("Cast", ["target"], ["target64"], to=TensorProto.INT64),
        n("Reshape", ["x", "target64"], ["flat"]),  # [2, 12]
        n("Range", ["zero", "rest", "one"], ["pos"]),
        n("Equal", ["pos", "last"], ["is4"]),
        n("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT),
        n("Where", ["is4", "posf", "halfs"], ["w"]),
        n("ConstantOfShape", ["target64"], ["fill"], value=helper.make_tensor("v", 1, [1], [0.5])),
        n("Expand", ["row", "target64"], ["wide"]),
        n("Transpose", ["col"], ["colT"], perm=[1, 0]),
        n("Sum", ["flat", "w", "fill", "wide", "colT"], ["y"]),
    ]
    inits = [
        _i64("zero", 0),
        _i64("one", 1),
        _i64("one_v", [1]),
        _i64("two", [2]),
        _i64("minus_one", -1),
        _i64("zero_axis", [0]),
        numpy_helper.from_array(np.full(12, 0.25, np.float32), "halfs"),
        numpy_helper.from_array(np.arange(12, dtype=np.float32)[None], "row"),
        numpy_helper.from_array(np.ones((12, 2), np.float32), "col"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    cleaned = frontend.clean_model(model)
    assert sorted(n.op_type for n in cleaned.graph.node) == ["Relu", "Reshape", "Sum"]
    x = {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)}
    expected = ort_ref.run_onnxruntime(model, x)[0]
    np.testing.assert_array_equal(ort_ref.run_onnxruntime(cleaned, x)[0], expected)
    np.testing.assert_allclose(_run_tvm(frontend.from_onnx(model), x), expected, rtol=1e-6)


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("training_mode", [1, 0])
def test_weight_standardization_folds_into_a_constant_filter(training_mode: int) -> None:
    """BiT's standardized convolution: its filter is a BatchNormalization (training mode:
    the weights' own statistics, with ReduceMean-computed running-statistic inputs and
    unread extra outputs) of the constant weights. Folded, the convolution gets a constant
    filter (it ran as a convolution with a run-time filter, re-standardized every call)."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((6, 4, 3, 3)).astype("float32")
    inits = {"w": w.reshape(1, 6, 36), "scale": np.ones(6, "float32"),
             "bias": np.zeros(6, "float32"), "axes": np.array([0, 2], np.int64),
             "shape": np.array(w.shape, np.int64)}
    nodes = [helper.make_node("ReduceMean", ["w", "axes"], ["mean"], keepdims=0),
             helper.make_node("ReduceMean", ["w", "axes"], ["var"], keepdims=0),
             helper.make_node("BatchNormalization", ["w", "scale", "bias", "mean", "var"],
                              ["std", "run_mean", "run_var"] if training_mode else ["std"],
                              epsilon=1e-8, training_mode=training_mode),
             helper.make_node("Reshape", ["std", "shape"], ["filter"]),
             helper.make_node("Conv", ["x", "filter"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    cleaned = frontend.clean_model(model)
    assert [n.op_type for n in cleaned.graph.node] == ["Conv"]
    x = rng.standard_normal((1, 4, 9, 9)).astype("float32")
    report = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4,
                                                 atol=1e-4).report()
    assert "runtime_weight" not in report, report


@pytest.mark.parametrize("op", ["Ceil", "Floor", "Round", "Sqrt"])
def test_float_shape_arithmetic_folds_into_the_reshape(op: str) -> None:
    """MobileViT unfolds patches with a target computed in floats from the static shape,
    ``int(ceil(h / patch) * patch) // patch``; with ``Ceil`` left unfolded, TVM's converter
    refused the Reshape ("requires the input new shape to be Shape")."""
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["s"]),
        n("Gather", ["s", "two"], ["h"], axis=0),  # 10
        n("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
        n("Div", ["hf", "patch_f"], ["q"]),  # 2.5
        n(op, ["q"], ["r"]),
        n("Mul", ["r", "patch_f"], ["grid_f"]),
        n("Cast", ["grid_f"], ["grid"], to=TensorProto.INT64),
        n("Div", ["grid", "patch"], ["patches"]),
        n("Unsqueeze", ["patches", "zero_axis"], ["patches1"]),
        n("Concat", ["patches1", "minus_one"], ["target"], axis=0),
        n("Reshape", ["x", "target"], ["y"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 10, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [_i64("two", 2), _i64("patch", 4), _i64("zero_axis", [0]), _i64("minus_one", [-1]),
         numpy_helper.from_array(np.array(4.0, np.float32), "patch_f")],
    )
    assert [n.op_type for n in frontend.clean_model(model).graph.node] == ["Reshape"]
    x = {"x": np.random.default_rng(0).standard_normal((1, 6, 10, 4)).astype(np.float32)}
    expected = ort_ref.run_onnxruntime(model, x)[0]
    assert expected.shape[0] == {"Ceil": 3, "Floor": 2, "Round": 2, "Sqrt": 1}[op]
    np.testing.assert_array_equal(_run_tvm(frontend.from_onnx(model), x), expected)


def test_empty_shape_constant_of_shape_imports() -> None:
    # Transformers' BERT export fills a scalar this way; TVM's converter rejects it.
    shape = helper.make_node(
        "Constant", [], ["shape"], value=numpy_helper.from_array(np.zeros((0,), np.int64))
    )
    fill = helper.make_node(
        "ConstantOfShape",
        ["shape"],
        ["c"],
        name="scalar_fill",
        value=numpy_helper.from_array(np.array([2.5], np.float32)),
    )
    mul = helper.make_node("Mul", ["x", "c"], ["y"])
    model = _model(
        [shape, fill, mul],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    mod = frontend.from_onnx(model)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(_run_tvm(mod, {"x": x}), 2.5 * x)


def test_loads_path_and_bytes_without_touching_the_caller_model(tmp_path) -> None:
    model = TINY["mlp"]()
    before = model.SerializeToString()
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    for source in (model, path, str(path), before):
        assert frontend.from_onnx(source)["main"].params[0].name == "input"
    assert model.SerializeToString() == before


# ------------------------------------------------------------------------------- big models


def _shared_weight_model(n: int = 96) -> onnx.ModelProto:
    """ALBERT's export: one layer's weight read through an ``Identity`` per layer, and the
    output reshaped to a target computed from its shape (folded only if shape inference saw
    through the weight, by its type)."""
    h = helper.make_node
    nodes = [h("Identity", ["w"], [f"w{i}"]) for i in range(3)]
    nodes += [h("MatMul", ["x" if i == 0 else f"y{i - 1}", f"w{i}"], [f"y{i}"])
              for i in range(3)]
    nodes += [h("Shape", ["y2"], ["s"], start=0, end=1),
              h("Concat", ["s", "rest"], ["target"], axis=0),
              h("Reshape", ["y2", "target"], ["out"])]
    w = (np.random.default_rng(0).standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, n])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                  [numpy_helper.from_array(w, "w"), _i64("rest", [n // 8, 8])])


def test_shared_weight_is_not_copied_per_reader() -> None:
    """Folding an ``Identity`` of a weight copied it per layer: ALBERT-xxlarge (0.8 GB,
    one shared layer read by 4) grew past protobuf's 2 GiB and failed to serialize."""
    model = _shared_weight_model()
    cleaned = frontend.clean_model(model)
    assert sorted(tuple(t.dims) for t in cleaned.graph.initializer) == [(3,), (96, 96)]
    assert sorted(n.op_type for n in cleaned.graph.node) == ["MatMul"] * 3 + ["Reshape"]
    x = {"x": np.random.default_rng(1).standard_normal((2, 96)).astype(np.float32)}
    expected = ort_ref.run_onnxruntime(model, x)[0]
    np.testing.assert_allclose(_run_tvm(frontend.from_onnx(model), x), expected,
                               rtol=1e-5, atol=1e-5)


def test_shape_inference_sees_weights_by_type_only(monkeypatch) -> None:
    """Shape inference serializes the model it is given, so it gets a copy with the
    weights as typed inputs: the shapes still fold, and no weight bytes go in."""
    seen: list[onnx.ModelProto] = []
    infer = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes",
                        lambda m, *a, **k: seen.append(m) or infer(m, *a, **k))
    cleaned = frontend.clean_model(_shared_weight_model())
    assert "Shape" not in {n.op_type for n in cleaned.graph.node}  # the target folded
    assert seen and all("w" not in {t.name for t in m.graph.initializer} for m in seen)
    assert max(m.ByteSize() for m in seen) < 96 * 96 * 4 / 4


def test_model_over_the_protobuf_limit_saves_and_runs_with_external_data(
        tmp_path, monkeypatch) -> None:
    """Over 2 GiB (here: over a limit lowered to 1 kB), ``save_model`` keeps the weights
    in a file beside the model without stripping the model in memory; ONNX Runtime gets it
    through such files, and the saved model compiles from its path."""
    import tpp_tvm

    monkeypatch.setattr(frontend.loading, "_PROTOBUF_LIMIT", 1000)
    model = _shared_weight_model()
    before = model.SerializeToString()
    assert not frontend.fits_protobuf(model)
    path = frontend.save_model(model, tmp_path / "big.onnx")
    assert (tmp_path / "big.onnx.data").stat().st_size == 96 * 96 * 4
    assert path.stat().st_size < 1000 and model.SerializeToString() == before
    x = np.random.default_rng(2).standard_normal((2, 96)).astype(np.float32)
    w = numpy_helper.to_array(model.graph.initializer[0])
    expected = (x @ w @ w @ w).reshape(2, 12, 8)
    ort = ort_ref.run_onnxruntime(model, {"x": x})[0]  # through a saved copy
    np.testing.assert_allclose(ort, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tpp_tvm.compile_onnx(path)(x)[0], ort, rtol=1e-5, atol=1e-5)


def test_local_functions_are_inlined_around_the_weights() -> None:
    """onnx's inliner serializes the model too: it runs on the weightless copy, and the
    inlined nodes come back to the model with its weights."""
    silu = helper.make_function("custom", "Silu", ["a"], ["b"],
                                [helper.make_node("Sigmoid", ["a"], ["s"]),
                                 helper.make_node("Mul", ["a", "s"], ["b"])],
                                [helper.make_opsetid("", 17)])
    w = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["m"]),
                    helper.make_node("Silu", ["m"], ["y"], domain="custom")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(w, "w")])
    model.opset_import.append(helper.make_opsetid("custom", 1))
    model.functions.append(silu)
    cleaned = frontend.clean_model(model)
    assert not cleaned.functions
    assert sorted(n.op_type for n in cleaned.graph.node) == ["MatMul", "Mul", "Sigmoid"]
    x = {"x": np.random.default_rng(4).standard_normal((2, 8)).astype(np.float32)}
    np.testing.assert_allclose(_run_tvm(frontend.from_onnx(model), x),
                               ort_ref.run_onnxruntime(model, x)[0], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- errors


def test_missing_file_names_the_path(tmp_path) -> None:
    path = tmp_path / "nope.onnx"
    with pytest.raises(ModelLoadError, match="nope.onnx.*does not exist"):
        frontend.from_onnx(path)


@pytest.mark.parametrize("data", [b"this is not an onnx model", b"\x00\xff" * 64, b""])
def test_non_onnx_bytes_say_so(data: bytes, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="not an ONNX model"):
        frontend.from_onnx(data)
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"model\.onnx is not an ONNX model"):
        frontend.from_onnx(path)


@pytest.mark.parametrize(
    ("op", "domain", "expected"),
    [
        ("MadeUpOp", "", "MadeUpOp"),
        ("Det", "", "Det"),  # a real ONNX op that TVM has no converter for
        ("Relu", "my.custom", "my.custom:Relu"),  # a custom domain must not pass as ai.onnx
    ],
)
def test_unsupported_op_names_op_and_node(op: str, domain: str, expected: str) -> None:
    node = helper.make_node(op, ["x"], ["y"], name="the_node", domain=domain)
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    with pytest.raises(UnsupportedOperatorError, match=f"{expected} \\(node 'the_node'\\)"):
        frontend.from_onnx(model)


def test_dynamic_dim_without_shape_dict_names_input_and_dim() -> None:
    model = models.bert_encoder(**TINY_BERT, dynamic=True)
    with pytest.raises(UnsupportedShapeError, match="input 'hidden_states' dim 0 \\('batch'\\)"):
        frontend.from_onnx(model)
    with pytest.raises(UnsupportedShapeError, match="input 'attention_mask' dim 0"):
        frontend.from_onnx(model, {"hidden_states": (1, 16, 64)})


def test_bad_shape_dict_entries() -> None:
    model = TINY["mlp"]()
    with pytest.raises(UnsupportedShapeError, match="not model inputs"):
        frontend.from_onnx(model, {"inptu": (4, 16)})
    with pytest.raises(UnsupportedShapeError, match="rank 3"):
        frontend.from_onnx(model, {"input": (1, 4, 16)})
    with pytest.raises(UnsupportedShapeError, match="model fixes it to 16"):
        frontend.from_onnx(model, {"input": (4, 17)})


def test_converter_failure_names_the_node() -> None:
    # An empty shape that only becomes known at run time cannot be folded; TVM's
    # ConstantOfShape then fails, and the error must say which node.
    fill = helper.make_node(
        "ConstantOfShape",
        ["shape"],
        ["c"],
        name="runtime_fill",
        value=numpy_helper.from_array(np.array([1.0], np.float32)),
    )
    model = _model(
        [fill],
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [0])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
    )
    with pytest.raises(ModelLoadError, match="ConstantOfShape node 'runtime_fill'"):
        frontend.from_onnx(model)


def test_errors_are_tpp_errors() -> None:
    assert issubclass(ModelLoadError, TPPError)
    assert issubclass(UnsupportedOperatorError, TPPError)


def test_missing_onnxruntime_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match="onnxruntime is needed"):
        ort_ref.run_onnxruntime(TINY["mlp"](), {})


@pytest.mark.parametrize("fmod", [0, 1])
def test_window_padding_computed_with_mod_folds(fmod: int) -> None:
    """Swin's window attention pads to a multiple of the window: pads = (-size) % window,
    computed from static shapes. TVM's converter refused it ("Dynamic pads")."""
    n = helper.make_node
    size = "neg" if fmod == 0 else "shape"  # fmod=1 (C's fmod) on a positive size
    nodes = [
        n("Shape", ["x"], ["shape"], start=3, end=4),  # W = 10
        n("Neg", ["shape"], ["neg"]),
        n("Mod", [size, "window"], ["right"], fmod=fmod),
        n("Concat", ["zeros", "right"], ["pads"], axis=0),
        n("Pad", ["x", "pads"], ["y"]),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 10])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [_i64("window", [7]), _i64("zeros", [0] * 7)])
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 10)).astype("float32")
    got = _run_tvm(frontend.from_onnx(model), {"x": x})
    right = (-10) % 7 if fmod == 0 else 10 % 7
    np.testing.assert_array_equal(got, np.pad(x, [(0, 0)] * 3 + [(0, right)]))


def _f32(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.float32), name)


def _chunked_blocks(blocks: int) -> onnx.ModelProto:
    """``blocks`` times ``u, v = x.chunk(2, -1); x = cat(u + v, u)`` as torch exports it:
    the halves' bounds computed from ``Shape(x)`` (gMLP's gating unit, EVA-02's SwiGLU)."""
    n = helper.make_node
    nodes, x = [], "x"
    for b in range(blocks):
        nodes += [n("Shape", [x], [f"s{b}"]),
                  n("Gather", [f"s{b}", "last"], [f"d{b}"], axis=0),
                  n("Add", [f"d{b}", "one"], [f"e{b}"]),
                  n("Div", [f"e{b}", "two"], [f"h{b}"]),  # (d + 1) // 2, torch's chunk
                  n("Slice", [x, "zero", f"h{b}", "axis"], [f"u{b}"]),
                  n("Slice", [x, f"h{b}", f"d{b}", "axis"], [f"v{b}"]),
                  n("Add", [f"u{b}", f"v{b}"], [f"a{b}"]),
                  n("Concat", [f"a{b}", f"u{b}"], [f"x{b}"], axis=-1)]
        x = f"x{b}"
    nodes.append(n("Relu", [x], ["y"]))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                  [_i64("last", [-1]), _i64("one", [1]), _i64("two", [2]), _i64("zero", [0]),
                   _i64("axis", [-1])])


def test_shape_chains_fold_through_every_block() -> None:
    """Each block's chunk bounds come from the previous block's sliced output, whose shape
    is known only once the bounds are constants. Folding stopped after 8 rounds of shape
    inference, one block a round, and TVM's converter failed on the ninth block's
    ``Gather`` of a shape (timm's gMLP-S16, EVA-02-Tiny). Now one round folds them all."""
    model = _chunked_blocks(12)
    cleaned = frontend.clean_model(model)
    left = {n.op_type for n in cleaned.graph.node}
    assert not left & {"Shape", "Gather", "Div"}, left
    x = {"x": np.random.default_rng(0).standard_normal((1, 5, 8)).astype(np.float32)}
    expected = ort_ref.run_onnxruntime(model, x)[0]
    np.testing.assert_allclose(_run_tvm(frontend.from_onnx(model), x), expected, rtol=1e-6)


@pytest.mark.parametrize("size,kernel", [(10, 3), (9, 3), (10, 1)])
def test_same_padding_computed_with_clip_folds(size: int, kernel: int) -> None:
    """TF-style "same" padding (timm's ``pad_same``, MaxViT-TF) computed from the static
    input size: ``max((ceil(x / s) - 1) * s + k - x, 0)`` exported with a ``Clip`` for the
    max, split into ``total // 2`` before and the rest after. ``Clip`` did not fold and TVM's
    converter refused the pads ("Dynamic pads are not supported yet")."""
    n = helper.make_node
    stride = 2
    nodes = [n("Shape", ["x"], ["s"], start=2, end=3),
             n("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
             n("Div", ["sf", "stride"], ["q"]),
             n("Ceil", ["q"], ["qc"]),
             n("Sub", ["qc", "one"], ["q1"]),
             n("Mul", ["q1", "stride"], ["span"]),
             n("Add", ["span", "k"], ["need"]),
             n("Sub", ["need", "sf"], ["total_raw"]),
             n("Clip", ["total_raw", "zero_f", ""], ["total"]),  # max(., 0): no upper bound
             n("Div", ["total", "two"], ["half"]),
             n("Floor", ["half"], ["before_f"]),
             n("Sub", ["total", "before_f"], ["after_f"]),
             n("Cast", ["before_f"], ["before"], to=TensorProto.INT64),
             n("Cast", ["after_f"], ["after"], to=TensorProto.INT64),
             n("Concat", ["zeros", "before", "before", "zeros", "after", "after"], ["pads"],
               axis=0),
             n("Pad", ["x", "pads"], ["padded"]),
             n("Conv", ["padded", "w"], ["y"], strides=[stride, stride])]
    weight = np.random.default_rng(1).standard_normal((4, 3, kernel, kernel)).astype("float32")
    model = _model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [_f32("stride", [float(stride)]), _f32("one", [1.0]), _f32("k", [float(kernel)]),
         _f32("zero_f", 0.0), _f32("two", [2.0]), _i64("zeros", [0, 0]),
         numpy_helper.from_array(weight, "w")])
    assert [n.op_type for n in frontend.clean_model(model).graph.node] == ["Pad", "Conv"]
    x = {"x": np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32)}
    expected = ort_ref.run_onnxruntime(model, x)[0]
    np.testing.assert_allclose(_run_tvm(frontend.from_onnx(model), x), expected, rtol=1e-5,
                               atol=1e-5)


def test_unfoldable_shape_names_where_static_shapes_stop() -> None:
    """A shape that is known only at run time (``NonZero``'s count) cannot be folded; the
    error names the failing node and where static shape inference stopped: the op, its
    node name and its input shapes, not only TVM's "shape_of expects a tensor input"."""
    n = helper.make_node
    nodes = [n("NonZero", ["x"], ["nz"], name="where_positive"),
             n("Shape", ["nz"], ["s"], name="count_shape"),
             n("Gather", ["s", "last"], ["count"], axis=0, name="count"),
             n("Reshape", ["x", "count"], ["y"], name="flat")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [_i64("last", [-1])])
    with pytest.raises(ModelLoadError) as info:
        frontend.from_onnx(model)
    message = str(info.value)
    assert "NonZero node 'where_positive' (input shapes [6])" in message, message


@pytest.mark.parametrize("shape", [[1, 16, 197], [2, 8, 5, 7]])
def test_instance_norm_imports_as_a_row_wise_layer_norm(shape) -> None:
    """torch's GroupNorm export (wav2vec2): InstanceNormalization becomes a layer norm over
    each (sample, channel) row plus a per-channel affine, same numbers as the spec."""
    rng = np.random.default_rng(len(shape))
    c = shape[1]
    scale, bias = rng.standard_normal((2, c)).astype("float32")
    model = _model([helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"],
                                     epsilon=1e-5)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(bias, "b")])
    mod = frontend.from_onnx(model)
    assert "relax.nn.layer_norm" in _ops(mod)
    x = rng.standard_normal(shape).astype("float32")
    axes = tuple(range(2, len(shape)))
    mean, var = x.mean(axes, keepdims=True), x.var(axes, keepdims=True)
    per_channel = (1, c) + (1,) * (len(shape) - 2)
    want = (x - mean) / np.sqrt(var + 1e-5) * scale.reshape(per_channel) + bias.reshape(per_channel)
    np.testing.assert_allclose(_run_tvm(mod, {"x": x}), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("stride", [1, 2])
def test_same_auto_pad_becomes_explicit_pads(mode: str, stride: int) -> None:
    """TVM's converter puts an opaque pad kernel in front of an ``auto_pad=SAME`` conv;
    explicit pads keep it one convolution (EfficientNet's depthwise convs)."""
    rng = np.random.default_rng(stride)
    w = rng.standard_normal((4, 1, 3, 3)).astype("float32")
    model = _model([helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=mode, group=4,
                                     strides=[stride, stride])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 7])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(w, "w")])
    cleaned = frontend.clean_model(model)
    conv = cleaned.graph.node[0]
    assert {a.name for a in conv.attribute} >= {"pads"} and "auto_pad" not in {
        a.name for a in conv.attribute}
    x = rng.standard_normal((1, 4, 8, 7)).astype("float32")
    want = ort_ref.run_onnxruntime(model, {"x": x})[0]
    np.testing.assert_allclose(_run_tvm(frontend.from_onnx(model), {"x": x}), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,inputs", [("Max", 2), ("Min", 2), ("Sum", 3), ("Mean", 3),
                                       ("Sum", 1)])
def test_variadic_elementwise_after_a_conv_builds(op: str, inputs: int) -> None:
    """Max/Min/Sum/Mean of several inputs next to a convolution (model-zoo residual adds as
    ``Sum``): TVM's converter stacked them into a rank-5 tensor and the layout conversion
    died with ``Invalid SLayout``; as binary ops they follow the convolution's NHWC. One
    operand broadcasts (1, C, 1, 1)."""
    rng = np.random.default_rng(inputs)
    w = rng.standard_normal((4, 3, 3, 3)).astype("float32")
    others = [f"y{i}" for i in range(inputs - 1)]
    shapes = {name: [1, 4, 8, 8] if i % 2 == 0 else [1, 4, 1, 1] for i, name in enumerate(others)}
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                    helper.make_node(op, ["c", *others], ["o"]),
                    helper.make_node("Relu", ["o"], ["z"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
                   + [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                      for n, s in shapes.items()],
                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(w, "w")])
    feeds = {"x": rng.standard_normal((1, 3, 8, 8)).astype("float32")}
    feeds.update({n: rng.standard_normal(s).astype("float32") for n, s in shapes.items()})
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset,outputs", [(9, 2), (9, 1), (13, 1)])
def test_inference_dropout_after_a_conv_builds(opset: int, outputs: int) -> None:
    """Old model-zoo graphs keep Dropout in inference; TVM's tuple (output, mask) made the
    layout conversion fail ("Expected nested to match tuple"). It is the identity."""
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype("float32")
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                    helper.make_node("Dropout", ["c"], ["d", "mask"][:outputs]),
                    helper.make_node("Relu", ["d"], ["z"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(w, "w")])
    model.opset_import[0].version = opset
    assert frontend.inference_dropout_as_identity(frontend.clean_model(model).graph) == 0
    assert "Dropout" not in [n.op_type for n in frontend.clean_model(model).graph.node]
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype("float32")
    checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-5, atol=1e-5)


def test_inference_dropout_mask_output_is_all_true() -> None:
    """A Dropout whose mask is a graph output (ONNX's test_dropout_default_mask): the mask
    of inference is all True by the spec; TVM's (output, mask) tuple made ConvertLayout
    fail with an InternalError even without a convolution."""
    import tpp_tvm

    model = _model([helper.make_node("Dropout", ["x"], ["y", "mask"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 5])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info("mask", TensorProto.BOOL, None)])
    model.opset_import[0].version = 13
    assert "Dropout" not in [n.op_type for n in frontend.clean_model(model).graph.node]
    x = np.random.default_rng(1).standard_normal((3, 4, 5)).astype("float32")
    y, mask = tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))(x)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == bool and mask.shape == x.shape and mask.all()


def test_optional_tensor_input_is_a_tensor() -> None:
    """An ``optional(tensor)`` graph input that is given is read as the tensor (TVM's
    importer does); it was refused as "not a tensor" (ONNX's optional_* node tests)."""
    import tpp_tvm

    opt = helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3])
    model = _model([helper.make_node("OptionalGetElement", ["x"], ["t"]),
                    helper.make_node("Relu", ["t"], ["y"])],
                   [helper.make_value_info("x", helper.make_optional_type_proto(opt))],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model.opset_import[0].version = 18
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    np.testing.assert_array_equal(tpp_tvm.compile_onnx(model)(x)[0], np.maximum(x, 0))


@pytest.mark.parametrize(("fill", "scale", "zero", "dtype"), [
    (0.0, 0.02, 128, np.uint8),     # MobileNetV2's zero padding: the zero point
    (0.5, 0.013, 3, np.int8),       # rounds to the int8 grid (38 steps: 0.494)
    (9.0, 0.01, 100, np.uint8),     # saturates at 255
])
def test_quantized_scalar_constants_fold(fill: float, scale: float, zero: int, dtype) -> None:
    """``quantize_static`` quantizes a Pad's constant fill (a DequantizeLinear of a
    QuantizeLinear of a constant): TVM's converter needed the fill as a constant and failed
    on MobileNetV2 and EfficientNet ('Call' object has no attribute 'value'); the pair
    folds to the value ONNX Runtime computes, round-half-even and saturated."""
    consts = [numpy_helper.from_array(np.array(fill, np.float32), "fill"),
              numpy_helper.from_array(np.array(scale, np.float32), "s"),
              numpy_helper.from_array(np.array(zero, dtype), "z"),
              numpy_helper.from_array(np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64), "pads")]
    nodes = [helper.make_node("QuantizeLinear", ["fill", "s", "z"], ["fill_q"]),
             helper.make_node("DequantizeLinear", ["fill_q", "s", "z"], ["fill_dq"]),
             helper.make_node("Pad", ["x", "pads", "fill_dq"], ["y"], mode="constant")]
    graph = helper.make_graph(
        nodes, "qpad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 7, 7])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)
    want = ort_ref.run_onnxruntime(model, {"x": x})[0]
    from tpp_tvm.compiled import compile_onnx

    np.testing.assert_array_equal(compile_onnx(model)(x)[0], want)


def test_quantized_constants_fold_but_weights_stay_quantized() -> None:
    """A QuantizeLinear -> DequantizeLinear pair over a constant (wav2vec2's quantized
    InstanceNormalization scale) folds to its rounded value, so converters that need a
    constant get one; a weight's DequantizeLinear stays, as the int8 kernels take it: of an
    int8 initializer (ONNX Runtime's QDQ) or of a folded QuantizeLinear of fp32 weights (a
    fake-quantized export)."""
    scale = np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    w = np.arange(-8, 8, dtype=np.int8).reshape(4, 4)
    w2 = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    consts = [numpy_helper.from_array(scale, "gamma"),
              numpy_helper.from_array(np.array(0.02, np.float32), "s"),
              numpy_helper.from_array(np.array(0, np.uint8), "z"),
              numpy_helper.from_array(w, "w_q"), numpy_helper.from_array(w2, "w2"),
              numpy_helper.from_array(np.array(0.1, np.float32), "w_s"),
              numpy_helper.from_array(np.array(0, np.int8), "w_z")]
    nodes = [helper.make_node("QuantizeLinear", ["gamma", "s", "z"], ["gamma_q"]),
             helper.make_node("DequantizeLinear", ["gamma_q", "s", "z"], ["gamma_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]),
             helper.make_node("QuantizeLinear", ["w2", "w_s", "w_z"], ["w2_q"]),
             helper.make_node("DequantizeLinear", ["w2_q", "w_s", "w_z"], ["w2_dq"]),
             helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Mul", ["h", "gamma_dq"], ["g"]),
             helper.make_node("MatMul", ["x", "w2_dq"], ["h2"]),
             helper.make_node("Add", ["g", "h2"], ["y"])]
    graph = helper.make_graph(
        nodes, "qconst", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    calls: list[str] = []
    relax.analysis.post_order_visit(frontend.from_onnx(model)["main"].body, lambda e: calls.append(
        e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    assert "relax.quantize" not in calls and calls.count("relax.dequantize") == 2, calls
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    from tpp_tvm.compiled import compile_onnx

    # numpy, not ONNX Runtime: its optimizer runs a MatMul after DequantizeLinear on
    # dynamically quantized activations (1% off the math the graph states)
    w2_dq = np.clip(np.rint(w2 / np.float32(0.1)), -128, 127) * np.float32(0.1)
    want = (x @ (w.astype(np.float32) * np.float32(0.1))) * scale + x @ w2_dq
    np.testing.assert_allclose(compile_onnx(model)(x)[0], want, rtol=1e-5, atol=1e-6)


#: Real exports that failed to import or build (issue 49): (source, name, input pixels).
REAL_EXPORTS = [("timm", "gmlp_s16_224", 224), ("timm", "eva02_tiny_patch14_224", 224),
                ("timm", "maxvit_tiny_tf_224", 224),
                # a channel attention's norm of another rank beside a group norm's chain
                ("timm", "davit_tiny", 224),
                ("segmentation", "deeplabv3_mobilenet_v3_large", 224),
                ("segmentation", "lraspp_mobilenet_v3_large", 224)]


@pytest.mark.slow
@pytest.mark.parametrize("source,name,size", REAL_EXPORTS, ids=[e[1] for e in REAL_EXPORTS])
def test_real_exports_compile_and_match_onnxruntime(source: str, name: str, size: int,
                                                    tmp_path, monkeypatch) -> None:
    """timm's gMLP-S16 and EVA-02-Tiny (chunks computed from shapes in every block),
    MaxViT-T-TF ("same" pads computed with Clip), torchvision's DeepLabV3 and LR-ASPP
    (logits resized and transposed to NCHW in one int64-indexed kernel): random weights,
    exported by torch at batch 1, compiled and run against ONNX Runtime."""
    import types

    torch = pytest.importorskip("torch")
    for stub in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        # the registry's torchvision is a CUDA build: skip registering its C ops' fakes
        monkeypatch.setitem(sys.modules, stub, sys.modules.get(stub, types.ModuleType(stub)))
    timm = pytest.importorskip("timm")
    torchvision = pytest.importorskip("torchvision")
    from tpp_tvm.compiled import compile_onnx

    torch.manual_seed(0)
    if source == "timm":
        # the exporter fails on scaled_dot_product_attention's traced is_causal
        monkeypatch.setattr(timm.layers.config, "_USE_FUSED_ATTN", 0)
        model = timm.create_model(name, pretrained=False).eval()
    else:
        model = getattr(torchvision.models.segmentation, name)(
            weights=None, weights_backbone=None).eval()
    with torch.no_grad():  # timm zero-initializes heads: give them weights to compare
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0, 0.02)
    x = torch.randn(1, 3, size, size)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, x, str(path), opset_version=17, dynamo=False,
                      input_names=["x"])
    feeds = {"x": x.numpy()}
    want = ort_ref.run_onnxruntime(onnx.load(str(path)), feeds)
    compiled = compile_onnx(path)
    got = compiled(**feeds)
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max(), name
    assert not compiled.report_data.get("fallbacks"), compiled.report()
