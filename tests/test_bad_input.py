"""Bad input gets a clear TPPError, never a crash or a TVM InternalError (issue #16, item 5).

Each case is something a user can hand tpp_tvm: a truncated or corrupt ``.onnx`` file, an
opset newer than the importer knows, missing external data, inputs of the wrong dtype,
rank or shape at call time, a model without outputs, a corrupt exported library, a tuning
log from another CPU. NaN and Inf inputs are not errors: they propagate as ONNX Runtime
propagates them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tpp_tvm
from tpp_tvm.errors import ModelLoadError, TPPError, UnsupportedShapeError
from tpp_tvm.onnxruntime_ref import run_onnxruntime
from tpp_tvm.tuning import ForeignTuningLogWarning, TuningLogError, open_logs


def _matmul_model(opset: int = 17, outputs: bool = True, ir_version: int = 8
                  ) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4) / 16, "w")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                  [2, 4])],
                              [y] if outputs else [], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


@pytest.fixture(scope="module")
def compiled() -> tpp_tvm.CompiledModel:
    return tpp_tvm.compile_onnx(_matmul_model())


@pytest.fixture(scope="module")
def exported(compiled, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("so") / "model.so"
    compiled.export(path)
    return path


# ------------------------------------------------------------------------------- ONNX files


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_truncated_onnx_file(tmp_path, cut: float) -> None:
    data = _matmul_model().SerializeToString()
    path = tmp_path / "trunc.onnx"
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ModelLoadError, match="trunc.onnx"):
        tpp_tvm.compile_onnx(str(path))


def test_corrupt_onnx_file(tmp_path) -> None:
    data = bytearray(_matmul_model().SerializeToString())
    data[8:40] = b"\xff" * 32
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt.onnx"):
        tpp_tvm.compile_onnx(str(path))


def test_opset_newer_than_the_importer_knows() -> None:
    newest = onnx.defs.onnx_opset_version()
    with pytest.raises(ModelLoadError, match=f"opset {newest + 1}, newer than the importer"):
        tpp_tvm.compile_onnx(_matmul_model(opset=newest + 1))


def test_ir_version_newer_than_onnx_reads() -> None:
    with pytest.raises(ModelLoadError, match="IR version"):
        tpp_tvm.compile_onnx(_matmul_model(ir_version=onnx.IR_VERSION + 1))


def _save_external(tmp_path: Path) -> Path:
    path = tmp_path / "ext.onnx"
    onnx.save_model(_matmul_model(), str(path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    return path


def test_external_data_loads(tmp_path) -> None:
    x = np.ones((2, 4), np.float32)
    out = tpp_tvm.compile_onnx(str(_save_external(tmp_path)))(x)
    np.testing.assert_allclose(out[0], x @ numpy_helper.to_array(
        _matmul_model().graph.initializer[0]), rtol=1e-5)


def test_missing_external_data_names_tensor_and_file(tmp_path) -> None:
    path = _save_external(tmp_path)
    os.remove(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="'w'.*weights.bin.*missing"):
        tpp_tvm.compile_onnx(str(path))


def test_truncated_external_data(tmp_path) -> None:
    path = _save_external(tmp_path)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:10])
    with pytest.raises(ModelLoadError, match="'w'.*truncated"):
        tpp_tvm.compile_onnx(str(path))


def test_zero_size_input_dim_is_named() -> None:
    """A zero-size dim (a decoder's empty past) reaches LLVM as a zero-byte stack buffer
    ("Check failed: constant_size > 0"): the error names the input instead."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "n", 4])
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedShapeError, match=r"zero-size dim \('x' \(2, 0, 4\)\)"):
        tpp_tvm.compile_onnx(model, shape_dict={"x": (2, 0, 4)})


def test_model_without_outputs() -> None:
    with pytest.raises(ModelLoadError, match="no outputs"):
        tpp_tvm.compile_onnx(_matmul_model(outputs=False))


def test_output_computed_by_nothing() -> None:
    model = _matmul_model()
    model.graph.output.append(helper.make_tensor_value_info("ghost", TensorProto.FLOAT, [1]))
    with pytest.raises(ModelLoadError, match="ghost"):
        tpp_tvm.compile_onnx(model)


# ------------------------------------------------------------------------------- call time


@pytest.mark.parametrize("value, match", [
    (np.ones((2, 4), np.complex64), "'x': dtype complex64, expected float32"),
    (np.array([["a"] * 4] * 2), "'x': dtype <U1, expected float32"),
    (np.ones((2, 4, 1), np.float32), r"'x': shape \(2, 4, 1\), the model was compiled for"),
    (np.ones((4,), np.float32), r"'x': shape \(4,\)"),
    (np.ones((3, 4), np.float32), r"'x': shape \(3, 4\), the model was compiled for \(2, 4\)"),
    (None, r"'x': shape \(\)"),
], ids=["complex", "string", "rank-up", "rank-down", "shape", "none"])
def test_wrong_input_at_call_time(compiled, value, match: str) -> None:
    with pytest.raises(UnsupportedShapeError, match=match):
        compiled(value)


def test_integer_input_that_does_not_fit_is_refused() -> None:
    graph = helper.make_graph(
        [helper.make_node("Add", ["i", "one"], ["o"])], "g",
        [helper.make_tensor_value_info("i", TensorProto.INT32, [3])],
        [helper.make_tensor_value_info("o", TensorProto.INT32, [3])],
        [numpy_helper.from_array(np.ones(3, np.int32), "one")])
    model = tpp_tvm.compile_onnx(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17)]))
    np.testing.assert_array_equal(model(np.array([1, 2, 3], np.int64))[0], [2, 3, 4])
    with pytest.raises(UnsupportedShapeError, match="'i'.*do not fit the model's int32"):
        model(np.array([1, 2, 2**40], np.int64))


# ------------------------------------------------------------------------------- libraries


def _copy_with_sidecar(src: Path, dst: Path, data: bytes | None = None) -> Path:
    dst.write_bytes(src.read_bytes() if data is None else data)
    shutil.copy(str(src) + ".tpp.json", str(dst) + ".tpp.json")
    return dst


def _load_in_subprocess(path: Path) -> subprocess.CompletedProcess:
    """load() in a fresh process: a crash in the dynamic loader must not take pytest down."""
    code = ("import sys, tpp_tvm\nfrom tpp_tvm.errors import ModelLoadError\n"
            "try:\n    tpp_tvm.load(sys.argv[1])\n"
            "except ModelLoadError as e:\n    print('ModelLoadError:', e)\n")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "flipped"])
def test_corrupt_exported_library(exported: Path, tmp_path, damage: str) -> None:
    data = exported.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 3]
    elif damage == "garbage":
        data = b"\x7fELF" + bytes(range(256)) * 4
    else:
        data = data[:4096] + bytes(b ^ 0xFF for b in data[4096:8192]) + data[8192:]
    bad = _copy_with_sidecar(exported, tmp_path / "bad.so", data)
    result = _load_in_subprocess(bad)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ModelLoadError:" in result.stdout and "corrupt" in result.stdout


def test_library_without_checksum_that_fails_to_open(exported: Path, tmp_path) -> None:
    bad = _copy_with_sidecar(exported, tmp_path / "old.so", b"not a library")
    side = Path(str(bad) + ".tpp.json")
    meta = json.loads(side.read_text())
    del meta["sha256"]  # as written before export() kept a checksum
    side.write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="not a loadable compiled model"):
        tpp_tvm.load(bad)


def test_corrupt_sidecar(exported: Path, tmp_path) -> None:
    bad = _copy_with_sidecar(exported, tmp_path / "side.so")
    Path(str(bad) + ".tpp.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt"):
        tpp_tvm.load(bad)


def test_export_load_round_trip(exported: Path) -> None:
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(tpp_tvm.load(exported)(x)[0],
                                  tpp_tvm.compile_onnx(_matmul_model())(x)[0])


# ------------------------------------------------------------------------------- tuning logs


def test_tuning_log_from_another_cpu_is_a_tpp_error_warning(tmp_path) -> None:
    log = tmp_path / "foreign"
    log.mkdir()
    for name in ("database_workload.json", "database_tuning_record.json"):
        (log / name).write_text("")
    (log / "meta.json").write_text(json.dumps({"tag": "sve-neoverse-v1"}))
    target = tpp_tvm.target()
    with pytest.warns(ForeignTuningLogWarning, match="made for sve-neoverse-v1"):
        assert open_logs(log, target) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignTuningLogWarning)
        with pytest.raises(TuningLogError, match="made for sve-neoverse-v1"):
            tpp_tvm.compile_onnx(_matmul_model(), tune_logs=log)
    assert issubclass(ForeignTuningLogWarning, TPPError)


# ------------------------------------------------------------------------------- NaN and Inf


def _single_op_model(op: str, shape: tuple[int, ...], inits: list | None = None,
                     **attrs) -> onnx.ModelProto:
    inits = inits or []
    node = helper.make_node(op, ["x", *(t.name for t in inits)], ["y"], **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, shape)], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _const(name: str, shape: tuple[int, ...]) -> TensorProto:
    rng = np.random.default_rng(1)
    return numpy_helper.from_array(rng.uniform(0.5, 1.5, shape).astype(np.float32), name)


NAN_INF_MODELS = {
    "relu": lambda: _single_op_model("Relu", (4, 16)),
    "sigmoid": lambda: _single_op_model("Sigmoid", (4, 16)),
    "tanh": lambda: _single_op_model("Tanh", (4, 16)),
    "matmul": lambda: _single_op_model("MatMul", (4, 16), [_const("w", (16, 8))]),
    "gemm": lambda: _single_op_model("Gemm", (4, 16), [_const("w", (16, 8)),
                                                       _const("b", (8,))]),
    "softmax": lambda: _single_op_model("Softmax", (4, 16), axis=-1),
    "layer_norm": lambda: _single_op_model("LayerNormalization", (4, 16),
                                           [_const("g", (16,)), _const("b", (16,))]),
    "conv": lambda: _single_op_model("Conv", (1, 3, 6, 6), [_const("w", (4, 3, 3, 3))],
                                     pads=[1, 1, 1, 1]),
    "max_pool": lambda: _single_op_model("MaxPool", (1, 3, 6, 6), kernel_shape=[2, 2],
                                         strides=[2, 2]),
    "global_avg_pool": lambda: _single_op_model("GlobalAveragePool", (1, 3, 6, 6)),
}


@pytest.mark.parametrize("name", sorted(NAN_INF_MODELS))
def test_nan_and_inf_propagate_as_in_onnxruntime(name: str) -> None:
    model = NAN_INF_MODELS[name]()
    shape = tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[1], flat[5], flat[-3] = np.nan, np.inf, -np.inf
    want = run_onnxruntime(model, {"x": x})
    got = tpp_tvm.compile_onnx(model)(x)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg="NaN positions")
        np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w), err_msg="+Inf")
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg="-Inf")
        finite = np.isfinite(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=1e-4, atol=1e-5)


def test_sub_byte_input_is_a_dtype_error() -> None:
    """An int4 input (ONNX's cast_INT4_* node tests): TVM's tensor copy raised an
    InternalError (``TensorCopyFromBytes: size mismatch``); now it names the input."""
    from tpp_tvm.errors import UnsupportedDTypeError

    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
                              "g", [helper.make_tensor_value_info("x", TensorProto.INT4, [5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    x = numpy_helper.to_array(helper.make_tensor("x", TensorProto.INT4, [5], [1, -2, 3, 0, 7]))
    with pytest.raises((UnsupportedDTypeError, ModelLoadError), match="'x'|int4"):
        tpp_tvm.compile_onnx(model)(x)
