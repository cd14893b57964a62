"""Tests of the user-facing compiled model (tpp_tvm.compiled) on tiny generated models.

The point of ``compile_onnx`` is "ONNX in, a fast model that gives ONNX Runtime's answer out",
so each tiny model is compiled once per module and checked against ONNX Runtime, against its
lowering report (the TPP kernels we expect, no fallbacks), through export/load, and for the
errors a caller can make with inputs. The end-to-end BERT test runs by default.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import checks
import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

import tpp_tvm
from tpp_tvm import models
from tpp_tvm.compiled import CompiledModel, compile_onnx, load
from tpp_tvm.errors import ModelLoadError, UnsupportedShapeError
from tpp_tvm.onnxruntime_ref import run_onnxruntime

# The model generators export from torch; ONNX Runtime is the reference.
pytestmark = [pytest.mark.requires_torch, pytest.mark.requires_onnxruntime]

RTOL = 1e-4
"""fp32 with a different summation order than ONNX Runtime: ~1e-6 relative in practice."""

# Each tiny model and the TPP kernels its report must list.
EXPECTED_KERNELS = {
    "mlp": {"tpp.dense_bias_gelu", "tpp.dense_bias"},
    "bert": {"tpp.attention_mask", "tpp.dense_bias_gelu", "tpp.dense_bias",
             "tpp.dense_bias_residual", "tpp.layer_norm"},
    "small_cnn": {"tpp.conv2d_bias_relu", "tpp.dense_bias"},
}


def _tiny(name: str) -> onnx.ModelProto:
    return models.GENERATORS[name](**models.TINY_ARGS[name])


def _assert_matches(outputs: list[np.ndarray], reference: list[np.ndarray]) -> None:
    """Close to the reference in a relative sense; atol scaled to the output's magnitude."""
    assert len(outputs) == len(reference)
    for out, ref in zip(outputs, reference, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        checks.assert_close_scaled(out, ref, RTOL)


class Tiny:
    """A tiny model, its example inputs, ONNX Runtime's outputs, and the TPP-compiled model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = _tiny(name)
        self.inputs = models.example_inputs(self.model)
        self.reference = run_onnxruntime(self.model, self.inputs)
        self.compiled = compile_onnx(self.model)

    def run(self, compiled: CompiledModel | None = None) -> list[np.ndarray]:
        return (compiled or self.compiled)(*self.inputs.values())


@pytest.fixture(scope="module")
def tiny() -> Callable[[str], Tiny]:
    """``tiny(name)``: the tiny model compiled once per module, on first use."""
    return functools.cache(Tiny)


# ------------------------------------------------------------------------------- correctness


def test_end_to_end_tiny_bert(tiny: Callable[[str], Tiny]) -> None:
    """The default-run end-to-end model: ONNX BERT layer -> TPP kernels -> ORT's answer."""
    bert = tiny("bert")
    _assert_matches(bert.run(), bert.reference)
    by_name = {spec.name: bert.inputs[spec.name] for spec in bert.compiled.inputs}
    _assert_matches(bert.compiled(**by_name), bert.reference)
    data = bert.compiled.report_data
    assert EXPECTED_KERNELS["bert"] <= set(data["lowered"])
    assert not data["fallbacks"]


@pytest.mark.parametrize("name", ["mlp", "small_cnn"])
def test_matches_onnxruntime(tiny: Callable[[str], Tiny], name: str) -> None:
    _assert_matches(tiny(name).run(), tiny(name).reference)


@pytest.mark.parametrize("name", sorted(EXPECTED_KERNELS))
def test_report_lists_tpp_kernels_and_no_fallbacks(tiny: Callable[[str], Tiny], name: str) -> None:
    compiled = tiny(name).compiled
    data = compiled.report_data
    assert EXPECTED_KERNELS[name] <= set(data["lowered"]), data
    assert all(count > 0 for count in data["lowered"].values())
    assert data["fallbacks"] == {}, f"unexpected fallbacks: {data['fallbacks']}"
    text = compiled.report()
    for kernel in EXPECTED_KERNELS[name]:
        assert f"  {kernel}: " in text
    assert "Fallbacks to TVM: none" in text


def test_conv_model_uses_conv_kernels(tiny: Callable[[str], Tiny]) -> None:
    lowered = tiny("small_cnn").compiled.report_data["lowered"]
    assert any(name.startswith("tpp.conv2d") for name in lowered)


# ------------------------------------------------------------------------------- export/load


def test_export_load_round_trip_is_identical(tiny: Callable[[str], Tiny], tmp_path) -> None:
    bert = tiny("bert")
    path = bert.compiled.export(tmp_path / "bert.so")
    assert path.exists() and (tmp_path / "bert.so.tpp.json").exists()
    loaded = load(path)
    assert loaded.inputs == bert.compiled.inputs
    assert loaded.report() == bert.compiled.report()
    for got, want in zip(bert.run(loaded), bert.run(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_compiling_process_runs_the_linked_kernels(tiny: Callable[[str], Tiny],
                                                       tmp_path) -> None:
    """The kernels run where a model was compiled come from a linked shared library, as an
    exported model's do (TVM's JIT made different machine code from the same IR: a conv
    with a GELU epilogue ran 3.3x slower in process), and give the exported model's bits."""
    cnn = tiny("small_cnn")
    kernels = cnn.compiled._linked[0]
    assert kernels.kind == "library" and kernels.is_runnable(), kernels.kind
    loaded = load(cnn.compiled.export(tmp_path / "cnn.so"))
    for got, want in zip(cnn.run(loaded), cnn.run(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_load_errors(tiny: Callable[[str], Tiny], tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no compiled model"):
        load(tmp_path / "missing.so")
    path = tiny("mlp").compiled.export(tmp_path / "mlp.so")
    (tmp_path / "mlp.so.tpp.json").unlink()
    with pytest.raises(ModelLoadError, match="sidecar"):
        load(path)


def test_export_of_loaded_model_is_a_clear_error(tiny: Callable[[str], Tiny], tmp_path) -> None:
    path = tiny("mlp").compiled.export(tmp_path / "mlp.so")
    with pytest.raises(ModelLoadError, match="export the original"):
        load(path).export(tmp_path / "again.so")


# ------------------------------------------------------------------------------- input errors


def test_wrong_shape_names_the_input(tiny: Callable[[str], Tiny]) -> None:
    bert = tiny("bert")
    x, mask = bert.inputs.values()
    with pytest.raises(UnsupportedShapeError, match="hidden_states"):
        bert.compiled(x[:, :-1], mask)
    with pytest.raises(UnsupportedShapeError, match="attention_mask"):
        bert.compiled(x, mask[..., :-1])


def test_wrong_dtype_names_the_input(tiny: Callable[[str], Tiny]) -> None:
    bert = tiny("bert")
    x, mask = bert.inputs.values()
    with pytest.raises(UnsupportedShapeError, match="attention_mask.*complex64"):
        bert.compiled(x, mask.astype(np.complex64))


def test_safe_dtype_is_converted(tiny: Callable[[str], Tiny]) -> None:
    bert = tiny("bert")
    x, mask = bert.inputs.values()
    _assert_matches(bert.compiled(x.astype(np.float64), mask), bert.reference)


def test_missing_input_names_it(tiny: Callable[[str], Tiny]) -> None:
    bert = tiny("bert")
    x, _ = bert.inputs.values()
    with pytest.raises(UnsupportedShapeError, match="attention_mask"):
        bert.compiled(hidden_states=x)
    with pytest.raises(UnsupportedShapeError, match="attention_mask"):
        bert.compiled(x)


@pytest.mark.parametrize("extra", [True, False], ids=["unknown-extra", "unknown-instead"])
def test_unknown_input_name_is_named(tiny: Callable[[str], Tiny], extra: bool) -> None:
    bert = tiny("bert")
    x, mask = bert.inputs.values()
    kwargs = {"hidden_states": x, "bogus_input": mask}
    if extra:
        kwargs["attention_mask"] = mask
    with pytest.raises(UnsupportedShapeError) as info:
        bert.compiled(**kwargs)
    assert "bogus_input" in str(info.value)


# ------------------------------------------------------------------------------- targets


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_non_tpp_target_offloads_nothing_and_matches(
    tiny: Callable[[str], Tiny], name: str
) -> None:
    """Offload is keyed on the target's "tpp" key: a plain llvm target gets TVM's path."""
    model = tiny(name)
    plain = compile_onnx(model.model, target=checks.plain_llvm(num_cores=1))
    data = plain.report_data
    assert data["lowered"] == {} and data["fallbacks"] == {}
    assert "TPP kernels:\nFallbacks to TVM: none" in plain.report()
    _assert_matches(model.run(plain), model.reference)


def test_tvm_compile_with_registered_tpp_pipeline(tiny: Callable[[str], Tiny]) -> None:
    """``tvm.compile(..., relax_pipeline="tpp")`` is the same pipeline, reachable by name."""
    from tvm.relax.pipeline import PIPELINE_MAP

    assert "tpp" in PIPELINE_MAP
    bert = tiny("bert")
    mod = tpp_tvm.from_onnx(bert.model)
    exe = tvm.compile(mod, target=tpp_tvm.target(), relax_pipeline="tpp")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(v) for v in bert.inputs.values()])
    _assert_matches([out.numpy()], bert.reference)
    # The VM calls the TPP kernels, named after their patterns.
    assert "call  tpp_attention_mask" in exe.as_text()


def test_elementwise_chains_become_equation_tpps() -> None:
    """Standalone element-wise chains (x + y, act(x + y), act(x), bias rows) run as
    equation TPPs and match ONNX Runtime."""
    import io

    import onnx
    import torch

    from tpp_tvm.onnxruntime_ref import run_onnxruntime

    class Chain(torch.nn.Module):
        def forward(self, x, y, b):
            return torch.sigmoid(torch.relu(x + y) + b) + torch.tanh(x)

    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4, 33, 40, generator=gen) for _ in range(2))
    b = torch.randn(40, generator=gen)
    buf = io.BytesIO()
    torch.onnx.export(Chain(), (x, y, b), buf, opset_version=17, dynamo=False,
                      input_names=["x", "y", "b"])
    model = onnx.load_from_string(buf.getvalue())
    compiled = tpp_tvm.compile_onnx(model)
    report = compiled.report()
    for kernel in ("tpp.eltwise_add_relu", "tpp.eltwise_add_sigmoid", "tpp.eltwise_tanh"):
        assert kernel in report, report
    assert "Fallbacks to TVM: none" in report
    inputs = {"x": x.numpy(), "y": y.numpy(), "b": b.numpy()}
    _assert_matches(compiled(**inputs), run_onnxruntime(model, inputs))


def test_calls_do_not_leak(tiny: Callable[[str], Tiny]) -> None:
    """1,000 calls of a compiled model leave its resident memory where the first 100 did
    (inputs converted and outputs allocated per call are all freed)."""
    import gc

    import psutil

    t = tiny("bert")
    proc = psutil.Process()
    for _ in range(100):
        t.run()
    gc.collect()
    before = proc.memory_info().rss
    for _ in range(1000):
        t.run()
    gc.collect()
    grown_mib = (proc.memory_info().rss - before) / 2**20
    assert grown_mib < 8, f"RSS grew {grown_mib:.1f} MiB over 1,000 calls"


#: Run in a process of its own whose TVM libraries are private copies: Linux pages out
#: only pages no other process maps, and every parallel test worker maps the installed
#: compiler library. Prints the library's resident KiB after a plain TVM compile and after
#: tpp_tvm's build.
_PAGES_SCRIPT = """
import onnx.helper as h
import tvm
from onnx import TensorProto
from tvm import te
from tpp_tvm.compiled import compile_onnx

def resident_kib():
    kib, ours = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                ours = len(fields) > 5 and "libtvm_compiler" in fields[5]
            elif ours and fields[0] == "Rss:":
                kib += int(fields[1])
    return kib

x = te.placeholder((8,), "float32", name="x")
tvm.compile(te.create_prim_func([x, te.compute((8,), lambda i: x[i] + 1.0, name="y")]),
            target="llvm")  # the compiler, run without tpp_tvm's build
touched = resident_kib()
io = [h.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "xy"]
compile_onnx(h.make_model(h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", io[:1],
                                       io[1:]), opset_imports=[h.make_opsetid("", 17)]))
print(touched, resident_kib())
"""


def _compiler_library() -> Path:
    """The compiler library this process loaded."""
    with open("/proc/self/maps") as maps:
        return next(Path(line.split()[-1]) for line in maps if "libtvm_compiler" in line)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc only")
def test_a_build_hands_back_the_compilers_pages(tmp_path) -> None:
    """After a build, the compiler library's code pages it touched are no longer resident
    (a compiled model never runs them); writable data stays."""
    for lib in _compiler_library().parent.glob("libtvm*.so"):
        shutil.copy(lib, tmp_path)
    done = subprocess.run([sys.executable, "-c", _PAGES_SCRIPT], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "TVM_LIBRARY_PATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    touched, after = (int(x) for x in done.stdout.split()[-2:])
    assert after < touched / 2, (after, touched)


def test_report_gives_compile_peak_memory(tiny: Callable[[str], Tiny]) -> None:
    t = tiny("bert")
    assert t.compiled.report_data["compile_peak_mib"] > 0
    assert "peak memory" in t.compiled.report()


def _relu_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_export_writes_kernel_rows_and_loads_a_format1_sidecar(tmp_path) -> None:
    """The sidecar stores the report's kernel rows (format 2); one written before (format
    1: no ``format``, the report's labels) still loads, its labels read back into rows."""
    import json

    path = compile_onnx(_relu_model()).export(tmp_path / "relu.so")
    side = tmp_path / "relu.so.tpp.json"
    meta = json.loads(side.read_text())
    assert meta["format"] == 2 and "lowered" not in meta["report"]
    assert all({"pattern", "family", "precision", "unit", "tuned", "count"} <= set(row)
               for row in meta["report"]["kernels"]), meta["report"]
    labels = {"tpp.dense_bias": 2, "tpp.dense_bias_gelu [bf16]": 1,
              "tpp.conv2d_bias_relu [bf16, amx]": 3, "tpp.qdq_matmul_bias [int8 via int16]": 1,
              "tpp.layer_norm (tuned)": 1}
    side.write_text(json.dumps({
        "inputs": [{"name": "x", "shape": [2, 3], "dtype": "float32"}],
        "report": {"lowered": labels, "fallbacks": {"tpp.softmax (odd shape)": 1},
                   "precision": "bfloat16", "default_scheduled": [], "target_cpu": ""},
        "threads": 1}))
    loaded = load(path)
    data = loaded.report_data
    assert data["lowered"] == labels
    rows = {(r["pattern"], r["precision"], r["unit"], r["tuned"]): r["count"]
            for r in data["kernels"]}
    assert rows == {("tpp.dense_bias", "float32", "vector", False): 2,
                    ("tpp.dense_bias_gelu", "bfloat16", "vector", False): 1,
                    ("tpp.conv2d_bias_relu", "bfloat16", "amx", False): 3,
                    ("tpp.qdq_matmul_bias", "int16", "vector", False): 1,
                    ("tpp.layer_norm", "float32", "vector", True): 1}
    text = loaded.report()
    assert "TPP kernels:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(labels.items())) \
        + "\nFallbacks to TVM:\n  tpp.softmax (odd shape): 1" in text, text
    assert "bf16 matmuls run on AVX512_BF16" in text  # a [bf16] row off tiles
    meta["format"] = 3
    side.write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="format 3"):
        load(path)


def test_inputs_keep_their_onnx_names(tmp_path) -> None:
    """Inputs are called by the model's own names, dots included (``past_key_values.0.key``,
    as every transformers export with a cache has), not TVM's sanitized parameter names:
    statically, through export/load, and in a dynamic model's per-size builds."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("past.0.key", TensorProto.FLOAT, [2, "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "n"])
    graph = helper.make_graph([helper.make_node("Relu", ["past.0.key"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    value = np.array([[-1.0, 2.0, 3.0], [4.0, -5.0, 6.0]], "float32")
    static = compile_onnx(model, shape_dict={"past.0.key": (2, 3)})
    assert [i.name for i in static.inputs] == ["past.0.key"]
    np.testing.assert_array_equal(static(**{"past.0.key": value})[0], np.maximum(value, 0))
    path = static.export(tmp_path / "relu.so")
    np.testing.assert_array_equal(load(path)(**{"past.0.key": value})[0], np.maximum(value, 0))
    dynamic = compile_onnx(model)
    np.testing.assert_array_equal(dynamic(**{"past.0.key": value})[0], np.maximum(value, 0))


def test_profile_gives_each_parts_share_of_the_run() -> None:
    """After ``profile``, report() gives what is left on TVM's default code with its measured
    time and share, and the split between TPP kernels, default code and the VM."""
    import re

    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((32, 48)).astype("float32"), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0])]  # no TPP: TVM's code
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [64, 32])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))
    assert "Measured" not in compiled.report()
    x = rng.standard_normal((64, 32)).astype("float32")
    rows = compiled.profile(x, repeat=2)
    assert rows and all(ms >= 0 and calls >= 1 for _, ms, calls in rows)
    assert any(name.startswith("tpp_dense_relu") for name, _, _ in rows), rows
    report = compiled.report()
    assert re.search(r"  \w*transpose\w*: \d+\.\d{3} ms \(\d+\.\d%\)", report), report
    shares = re.search(r"TPP kernels ([\d.]+)%, TVM's default code ([\d.]+)%, VM and layout "
                       r"views ([\d.]+)%", report)
    assert shares and abs(sum(float(v) for v in shares.groups()) - 100) < 0.5, report
    # the TPP kernels' share is of the functions the lowering recorded, by name
    assert {name for name, _, _ in rows} & set(compiled.report_data["tpp_functions"]), rows
    assert float(shares.group(1)) > 0, report
