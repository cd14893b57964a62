"""Quantized ONNX models on int8 TPPs: ONNX Runtime's dynamic quantization (MatMulInteger),
static QDQ (u8 and s8 activations) and QLinearMatMul, each against ONNX Runtime running the
same quantized model, and against the fp32 model within ONNX Runtime's own error."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tpp_harness as h
import tvm
from onnx import TensorProto, helper, numpy_helper

from tpp_tvm import models
from tpp_tvm.compiled import compile_onnx
from tpp_tvm.onnxruntime_ref import run_onnxruntime
from tpp_tvm.relay_passes.activation_dtypes import NARROWED, REQUANTIZED, REQUANTIZED_RESIDUAL
from tpp_tvm.relay_passes.fake_quant import MAX_POOL_QUANTIZED
from tpp_tvm.relay_passes.int8_kernels import QDQ_IN_FP32
from tpp_tvm.schedules.gemm_plan import int8_gemm_dtype, runs_on_tiles
from tpp_tvm.target import host_isa, isa_of, target

# The model generators export from torch; ONNX Runtime quantizes the models (and its
# CalibrationDataReader is subclassed below, so it is imported here).
pytestmark = [pytest.mark.requires_torch, pytest.mark.requires_int8_kernels]
quantization = pytest.importorskip("onnxruntime.quantization",
                                   reason="ONNX Runtime quantizes the models")
MLP = {"batch": 8, "dims": (64, 96, 32)}
#: How the report counts int8 layers writing the next layer's quantized input.
INT8_LINKS = NARROWED["uint8"]
#: How the report marks an int8 GEMM on this host's default target (tiles on AMX hosts).
#: Whether ONNX Runtime's int8 GEMMs are exact here: with AVX512_VNNI; without it MLAS
#: multiplies u8 x s8 with ``vpmaddubsw``, whose s16 pair sums saturate (our AVX2 kernels
#: widen to s16 first and stay exact).
ORT_INT8_EXACT = host_isa().avx512_vnni
INT8 = ("[int8, amx]" if runs_on_tiles(isa_of(target()), "int8") else "[int8]"
        if int8_gemm_dtype(isa_of(target())) == "int8" else "[int8 via int16]")


def _fp32_mlp(tmp_path) -> tuple[onnx.ModelProto, str]:
    model = models.mlp(**MLP)
    path = str(tmp_path / "mlp.onnx")
    onnx.save(model, path)
    return model, path


class _Calibration(quantization.CalibrationDataReader):
    """Four seeded normal batches of the model's (single) input."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.batches = iter([{"input": np.random.default_rng(i).standard_normal(shape).astype(
            "float32")} for i in range(4)])

    def get_next(self):
        return next(self.batches, None)


def _quantize(kind: str, src: str, dst: str, per_channel: bool = False) -> onnx.ModelProto:
    q = quantization
    if kind == "dynamic":
        q.quantize_dynamic(src, dst, weight_type=q.QuantType.QInt8, per_channel=per_channel)
    else:
        shape = tuple(models.example_inputs(onnx.load(src))["input"].shape)
        act = q.QuantType.QUInt8 if kind == "qdq_u8" else q.QuantType.QInt8
        q.quantize_static(src, dst, _Calibration(shape), quant_format=q.QuantFormat.QDQ,
                          activation_type=act, weight_type=q.QuantType.QInt8,
                          per_channel=per_channel)
    return onnx.load(dst)


def _qdq_u8_export(tmp_path, net, shape: tuple[int, ...]
                   ) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The torch module ``net`` exported for an input ``shape`` named ``input``, and ONNX
    Runtime's static QDQ quantization of it (u8 activations)."""
    import torch

    path = str(tmp_path / "fp32.onnx")
    torch.onnx.export(net, (torch.randn(*shape),), path, input_names=["input"],
                      opset_version=17, dynamo=False)
    return onnx.load(path), _quantize("qdq_u8", path, str(tmp_path / "qdq.onnx"))


def _compiled_like_onnxruntime(fp32: onnx.ModelProto, model: onnx.ModelProto, kind: str,
                               tgt=None):
    """Compile the quantized ``model`` (for ``tgt``, default the host's); check it is as
    close to the ``fp32`` model as ONNX Runtime's own int8 result (and, dynamic, the same
    integer math as ORT's). Returns (compiled, our output, ORT's int8 output, ORT's max
    error vs fp32)."""
    inputs = models.example_inputs(fp32)
    compiled = compile_onnx(model, target=tgt)
    got = compiled(*inputs.values())[0]
    ort_int8 = run_onnxruntime(model, inputs)[0]
    exact = run_onnxruntime(fp32, inputs)[0]
    scale = np.abs(exact).max()
    ort_err = np.abs(ort_int8 - exact).max()
    assert 0 < ort_err and np.abs(got - exact).max() <= 1.05 * ort_err + 1e-5 * scale
    if kind == "dynamic" and ORT_INT8_EXACT:  # only fp32 rounding differs
        np.testing.assert_allclose(got, ort_int8, atol=1e-4 * scale, rtol=0)
    return compiled, got, ort_int8, ort_err


@pytest.mark.parametrize(("kind", "kernel"), [("dynamic", "tpp.matmul_integer"),
                                              ("qdq_u8", "tpp.qdq_matmul"),
                                              ("qdq_s8", "tpp.qdq_matmul")])
def test_quantized_mlp_matches_onnxruntime_int8(tmp_path, kind: str, kernel: str) -> None:
    fp32, path = _fp32_mlp(tmp_path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"))
    compiled, got, ort_int8, ort_err = _compiled_like_onnxruntime(fp32, model, kind)
    if kind != "dynamic":  # the QDQ pairs between element-wise ops are dropped: fp32 there
        assert compiled.report_data["rewrites"]
        assert np.abs(got - ort_int8).max() <= 2 * ort_err
    data = compiled.report_data
    ours = {k: v for k, v in data["lowered"].items() if k.startswith(kernel)}
    assert sum(ours.values()) == len(MLP["dims"]) - 1, data
    # bias + GELU follow the matmul: one fused kernel (in QDQ form once the fake
    # quantization of the matmul's output and of each GELU step is dropped)
    assert ours == {f"{kernel}_bias_gelu {INT8}": 1, f"{kernel}_bias {INT8}": 1}, ours
    assert not data["fallbacks"], data["fallbacks"]


@pytest.mark.parametrize("kind", ["dynamic", "qdq_u8", "qdq_s8"])
def test_quantized_mlp_on_tiles_matches_onnxruntime_int8(tmp_path, kind: str) -> None:
    """The same models with their int8 GEMMs on AMX tiles (on the software tile model where
    this host has no AMX), dequantization and GELU between the tile steps."""
    fp32, path = _fp32_mlp(tmp_path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"))
    compiled, *_ = _compiled_like_onnxruntime(fp32, model, kind, h.tile_target(2))
    on_tiles = [row for row in compiled.report_data["kernels"]
                if row["precision"] == "int8" and row["unit"] == "amx"]
    assert len(on_tiles) == 2, compiled.report_data["kernels"]


def _qlinear_matmul(w_zero_point: int) -> tuple[onnx.ModelProto, np.ndarray]:
    rng = np.random.default_rng(0)
    m, k, n = 8, 40, 24
    inits = {
        "sa": np.array(0.02, np.float32), "za": np.array(120, np.uint8),
        "W": rng.integers(-128, 128, (k, n)).astype(np.int8),
        "sw": rng.uniform(1e-3, 1e-2, n).astype(np.float32),  # per output column
        "zw": np.full(n, w_zero_point, np.int8),
        "sy": np.array(0.5, np.float32), "zy": np.array(128, np.uint8),
    }
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "W", "sw", "zw", "sy", "zy"],
                            ["y"])
    graph = helper.make_graph(
        [node], "qlinear", [helper.make_tensor_value_info("a", TensorProto.UINT8, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [m, n])],
        [numpy_helper.from_array(v, name) for name, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model, rng.integers(0, 256, (m, k)).astype(np.uint8)


def _qlinear_reference(model: onnx.ModelProto, a: np.ndarray) -> np.ndarray:
    """QLinearMatMul in exact integer arithmetic, rounded once (half to even) to u8."""
    c = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    acc = (a.astype(np.int64) - int(c["za"])) @ (c["W"].astype(np.int64) - c["zw"])
    y = np.round(acc * (c["sa"] * c["sw"]).astype(np.float64) / c["sy"]) + int(c["zy"])
    return np.clip(y, 0, 255).astype(np.uint8)


def test_qlinear_matmul_is_exact() -> None:
    model, a = _qlinear_matmul(0)
    compiled = compile_onnx(model)
    got = compiled(a)[0]
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, _qlinear_reference(model, a))
    if ORT_INT8_EXACT:
        np.testing.assert_array_equal(got, run_onnxruntime(model, {"a": a})[0])
    assert compiled.report_data["lowered"] == {f"tpp.qdq_matmul {INT8}": 1}


def test_weight_zero_point_runs_in_fp32_and_stays_correct() -> None:
    """A QDQ matmul whose weight has a zero point (no int8 kernel for it) runs on the fp32
    GEMM TPP with its dequantized weight, and the report says so (not a TVM fallback)."""
    model, a = _qlinear_matmul(3)
    compiled = compile_onnx(model)
    np.testing.assert_array_equal(compiled(a)[0], _qlinear_reference(model, a))
    data = compiled.report_data
    assert data["lowered"] == {"tpp.dense": 1} and not data["fallbacks"]
    assert data["rewrites"] == {f"{QDQ_IN_FP32}: tpp.int8_matmul (weight zero point)": 1}


#: Small CNNs: 3x3 convolutions with ReLU and max pooling (``small_cnn``), and a ResNet-50
#: bottleneck (1x1 -> 3x3 -> 1x1 convolutions, residual add).
CNNS = {
    "small_cnn": lambda: models.small_cnn(batch=1, image=16, channels=(8, 16)),
    "resnet_block": lambda: models.resnet50_block(batch=1, image=8, planes=8),
}


@pytest.mark.parametrize(("cnn", "kind", "per_channel", "kernel"), [
    ("small_cnn", "dynamic", False, "tpp.conv_integer"),
    ("small_cnn", "qdq_u8", False, "tpp.qdq_conv2d"),
    ("small_cnn", "qdq_s8", True, "tpp.qdq_conv2d"),
    ("resnet_block", "dynamic", True, "tpp.conv_integer"),
    ("resnet_block", "qdq_u8", True, "tpp.qdq_conv2d"),
])
def test_quantized_cnn_matches_onnxruntime_int8(tmp_path, cnn: str, kind: str,
                                                per_channel: bool, kernel: str) -> None:
    """Every convolution runs on the int8 conv kernel (ConvInteger or QDQ Conv), as close
    to the fp32 model as ONNX Runtime's own int8 result."""
    fp32 = CNNS[cnn]()
    path = str(tmp_path / "fp32.onnx")
    onnx.save(fp32, path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"), per_channel)
    compiled = _compiled_like_onnxruntime(fp32, model, kind)[0]
    data = compiled.report_data
    convs = sum(node.op_type == "Conv" for node in fp32.graph.node)
    ours = sum(v for k, v in data["lowered"].items() if k.startswith(kernel))
    assert ours == convs, data["lowered"]
    assert not data["fallbacks"], data["fallbacks"]
    # QDQ: a convolution read only by the next one writes its quantized input (the 1x1 ->
    # 3x3 -> 1x1 links of the block; small_cnn's first layer through the max pool after
    # it, which runs on the quantized values; its second one is averaged in fp32)
    links = 0 if kind == "dynamic" else {"resnet_block": 2, "small_cnn": 1}[cnn]
    assert data.get("rewrites", {}).get(INT8_LINKS, 0) == links, data.get("rewrites")


@pytest.mark.parametrize("kind", ["qdq_u8", "qdq_s8"])
def test_qdq_resnet_adds_its_residuals_quantized(tmp_path, kind: str) -> None:
    """A QDQ ResNet (two stages; an identity block and two with downsampling shortcuts)
    keeps the residual stream quantized: each block's last convolution adds the u8/s8
    tensor the model quantizes (the block input, which the next convolution reads too, or
    the shortcut's output) in its epilogue, so block outputs and shortcuts write u8/s8 and
    no quantize kernel or fp32 copy of the stream is left. Same model as ONNX Runtime's:
    as close to the fp32 model as its int8 result, and close to that result."""
    fp32 = models.resnet50(image=32, width=8, blocks=(2, 1), classes=10)
    path = str(tmp_path / "fp32.onnx")
    onnx.save(fp32, path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"), per_channel=True)
    inputs = models.example_inputs(fp32)
    compiled = compile_onnx(model)
    got = compiled(*inputs.values())[0]
    ort_int8 = run_onnxruntime(model, inputs)[0]
    exact = run_onnxruntime(fp32, inputs)[0]
    ort_err = np.abs(ort_int8 - exact).max()
    # ORT rounds each conv's output before the add; we keep it exact (rounding only what
    # the next layer reads), so the two differ by a fraction of ORT's own error
    assert np.abs(got - ort_int8).max() <= 0.5 * ort_err
    assert np.abs(got - exact).max() <= 1.5 * ort_err
    data = compiled.report_data
    step = "_residual_u8_relu" if kind == "qdq_u8" else "_residual_s8_relu"
    adds = sum(node.op_type == "Add" for node in fp32.graph.node)
    assert sum(v for k, v in data["lowered"].items() if step in k) == adds, data["lowered"]
    assert not any("_residual_relu" in k for k in data["lowered"]), data["lowered"]
    # 1x1 -> 3x3 -> 1x1 links (2 a block), two shortcuts, two block outputs, and the stem:
    # its max pool runs on the quantized values (quantizing commutes with it), so the
    # stem convolution writes them and no ReLU or quantize kernel is left after the pool
    narrowed = NARROWED["uint8" if kind == "qdq_u8" else "int8"]
    assert data["rewrites"].get(narrowed) == 2 * 3 + 2 + 2 + 1, data["rewrites"]
    # all but the block outputs requantize in one pass; those add their residual in it
    assert data["rewrites"].get(NARROWED[REQUANTIZED]) == 2 * 3 + 2 + 1, data["rewrites"]
    assert data["rewrites"].get(NARROWED[REQUANTIZED_RESIDUAL]) == 2, data["rewrites"]
    assert data["rewrites"].get(MAX_POOL_QUANTIZED) == 1, data["rewrites"]
    assert data["lowered"].get("tpp.max_pool2d") == 1, data["lowered"]
    assert "tpp.eltwise_relu" not in data["lowered"], data["lowered"]


@pytest.mark.parametrize("kind", ["dynamic", "qdq_u8", "qdq_s8"])
def test_quantized_convolutions_on_tiles_match_onnxruntime_int8(tmp_path, kind: str) -> None:
    """A ResNet-50 bottleneck of 64 planes on AMX tiles (the software tile model where the
    host has no AMX): the 1x1 convolutions as tile GEMMs, the 3x3 one as a tile conv BRGEMM
    (10 output pixels a row as one 16-row tile, three filter rows of 3 x 64 channels),
    as close to the fp32 model as ONNX Runtime's own int8 result."""
    fp32 = models.resnet50_block(batch=1, image=10, planes=64)
    path = str(tmp_path / "fp32.onnx")
    onnx.save(fp32, path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"), per_channel=True)
    compiled = _compiled_like_onnxruntime(fp32, model, kind, h.tile_target(2))[0]
    lowered = compiled.report_data["lowered"]
    convs = sum(node.op_type == "Conv" for node in fp32.graph.node)
    on_tiles = sum(v for k, v in lowered.items() if k.endswith("[int8, amx]"))
    assert on_tiles == convs, lowered
    assert not compiled.report_data["fallbacks"], compiled.report_data["fallbacks"]
    links = compiled.report_data.get("rewrites", {}).get(INT8_LINKS, 0)
    assert links == (0 if kind == "dynamic" else 2), compiled.report_data.get("rewrites")


def test_depthwise_conv_integer_runs_in_fp32_and_stays_exact(tmp_path) -> None:
    """A depthwise ConvInteger (with its dequantizing Cast + Mul), which no int8 kernel
    takes, runs as the fp32 depthwise convolution of its dequantized input (reported with
    the reason; on TVM's integer code it was 6x slower than OpenVINO in EfficientNet), and
    its sums stay exact in fp32 (9 taps of u8 x s8)."""
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (16, 1, 3, 3)).astype(np.int8)
    nodes = [helper.make_node("ConvInteger", ["x", "W"], ["acc"], group=16, pads=[1, 1, 1, 1]),
             helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["acc_f", "scale"], ["y"])]
    graph = helper.make_graph(
        nodes, "depthwise", [helper.make_tensor_value_info("x", TensorProto.UINT8,
                                                           [1, 16, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 6, 6])],
        [numpy_helper.from_array(w, "W"),
         numpy_helper.from_array(np.array(0.5, np.float32), "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.integers(0, 256, (1, 16, 6, 6)).astype(np.uint8)
    compiled = compile_onnx(model)
    np.testing.assert_array_equal(compiled(x)[0], run_onnxruntime(model, {"x": x})[0])
    data = compiled.report_data
    assert not data["fallbacks"], data["fallbacks"]
    assert data["rewrites"] == {
        f"{QDQ_IN_FP32}: tpp.int8_conv2d (groups=16, 1 input channels per group)": 1}
    assert any(k.startswith("tpp.depthwise_conv2d") for k in data["lowered"]), data["lowered"]


def test_same_padded_conv_integer_runs_on_the_int8_kernel() -> None:
    """ConvInteger with ``auto_pad=SAME_UPPER`` (as ``quantize_dynamic`` writes
    EfficientNet's convolutions): TVM's converter padded ``x - zero point`` in a kernel of
    its own, which hid the convolution from the int8 patterns; explicit pads make it an
    int8 kernel again, exact against ONNX Runtime."""
    rng = np.random.default_rng(1)
    w1 = rng.integers(-128, 128, (16, 8, 1, 1)).astype(np.int8)
    w3 = rng.integers(-128, 128, (16, 16, 3, 3)).astype(np.int8)
    nodes = [
        helper.make_node("ConvInteger", ["x", "W1", "zp"], ["a1"], auto_pad="SAME_UPPER"),
        helper.make_node("Cast", ["a1"], ["f1"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f1", "scale"], ["y1"]),
        helper.make_node("ConvInteger", ["x2", "W3", "zp"], ["a3"], auto_pad="SAME_UPPER",
                         strides=[2, 2]),
        helper.make_node("Cast", ["a3"], ["f3"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f3", "scale"], ["y3"])]
    graph = helper.make_graph(
        nodes, "same_pad",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 8, 7, 7]),
         helper.make_tensor_value_info("x2", TensorProto.UINT8, [1, 16, 7, 7])],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1, 16, 7, 7]),
         helper.make_tensor_value_info("y3", TensorProto.FLOAT, [1, 16, 4, 4])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w3, "W3"),
         numpy_helper.from_array(np.array(3, np.uint8), "zp"),
         numpy_helper.from_array(np.array(0.25, np.float32), "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    feeds = {"x": rng.integers(0, 256, (1, 8, 7, 7)).astype(np.uint8),
             "x2": rng.integers(0, 256, (1, 16, 7, 7)).astype(np.uint8)}
    compiled = compile_onnx(model)
    for got, want in zip(compiled(**feeds), run_onnxruntime(model, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
    data = compiled.report_data
    assert sum(v for k, v in data["lowered"].items()
               if k.startswith("tpp.conv_integer")) == 2, data["lowered"]
    assert not data["fallbacks"], data["fallbacks"]


def test_dynamic_inverted_residual_runs_nhwc(tmp_path) -> None:
    """A MobileNetV2 block quantized by ``quantize_dynamic``: 1x1 expansion (int8 kernel),
    an explicitly padded stride-2 depthwise convolution (fp32 on its dequantized input: the
    pad sits before its input's run-time quantization) and the 1x1 projection. The layout
    transposes sink through the pad and the range reductions and cancel, so no transposing
    kernel is left between the layers; as close to the fp32 model as ONNX Runtime."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(16, 64, 1), nn.ReLU6(), nn.ZeroPad2d((0, 1, 0, 1)),
                        nn.Conv2d(64, 64, 3, stride=2, groups=64), nn.ReLU6(),
                        nn.Conv2d(64, 16, 1))
    path = str(tmp_path / "fp32.onnx")
    torch.onnx.export(net, (torch.randn(1, 16, 14, 14),), path, input_names=["input"],
                      opset_version=17, dynamo=False)
    fp32 = onnx.load(path)
    model = _quantize("dynamic", path, str(tmp_path / "dynamic.onnx"))
    compiled = _compiled_like_onnxruntime(fp32, model, "dynamic")[0]
    data = compiled.report_data
    assert sum(v for k, v in data["lowered"].items()
               if k.startswith("tpp.conv_integer")) == 2, data["lowered"]
    assert any(k.startswith("tpp.depthwise_conv2d") for k in data["lowered"]), data["lowered"]
    assert not data["fallbacks"], data["fallbacks"]
    # the input's layout transpose and the output's, nothing between the layers
    transposes = [k for k in data["default_scheduled"] if "transpose" in k]
    assert len(transposes) <= 2, data["default_scheduled"]


@pytest.mark.parametrize("mcpu", [None, "haswell", "skylake-avx512"])
def test_grouped_qdq_convs(tmp_path, mcpu: str | None) -> None:
    """QDQ grouped convolutions (RegNet's 3x3 of 64 channels a group) run on the int8 conv
    kernel, a dequantize row per group (the host's kernel; AVX2's and Skylake-SP's s16
    ones); depthwise and narrow groups (MobileNetV2's, 4 channels a group) run on the fp32
    depthwise/grouped TPPs with their dequantized filters, reported once per layer (every
    epilogue pattern tried them: they were counted 5 times, as TVM fallbacks). The model
    stays as close to fp32 as ONNX Runtime's int8."""
    import torch

    tgt = None
    if mcpu is not None:
        needs = {"haswell": host_isa().avx2, "skylake-avx512": host_isa().avx512bw}[mcpu]
        if not needs:
            pytest.skip(f"running {mcpu} code needs its ISA ({host_isa().summary()})")
        tgt = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "keys": ["tpp", "cpu"],
                                 "num-cores": 1})

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(8, 32, 1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1, groups=2), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1, groups=8), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1, groups=32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 8, 1)).eval()
    fp32, model = _qdq_u8_export(tmp_path, net, (1, 8, 12, 12))
    compiled = _compiled_like_onnxruntime(fp32, model, "qdq_u8", tgt)[0]
    data = compiled.report_data
    assert not data["fallbacks"], data["fallbacks"]
    in_fp32 = {k: v for k, v in data["rewrites"].items() if k.startswith(QDQ_IN_FP32)}
    label = f"{QDQ_IN_FP32}: tpp.int8_conv2d (groups={{}}, {{}} input channels per group)"
    assert in_fp32 == {label.format(8, 4): 1, label.format(32, 1): 1}, data["rewrites"]
    int8 = sum(v for k, v in data["lowered"].items() if k.startswith("tpp.qdq_"))
    fp32_convs = sum(v for k, v in data["lowered"].items()
                     if k.startswith(("tpp.conv2d", "tpp.depthwise_conv2d")))
    assert (int8, fp32_convs) == (3, 2), data["lowered"]


@pytest.mark.parametrize("tiles", [False, True], ids=["host", "tiles"])
def test_qdq_stem_of_three_channels(tmp_path, tiles: bool) -> None:
    """A ResNet stem (7x7, stride 2, 3 input channels): its channels go to a whole VNNI
    group of 4 in the input's transpose (zero weights), and on AMX tiles (the software tile
    model where the host has none) its 7 taps x 4 channels = 28-byte filter rows get zero
    taps up to one 64-byte tile step, so it runs on tiles, not the vector unit. The model
    stays as close to fp32 as ONNX Runtime's int8."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 7, stride=2, padding=3),
                              torch.nn.ReLU()).eval()
    fp32, model = _qdq_u8_export(tmp_path, net, (1, 3, 38, 38))
    tgt = h.tile_target(1) if tiles else None
    compiled = _compiled_like_onnxruntime(fp32, model, "qdq_u8", tgt)[0]
    kernel = "[int8, amx]" if tiles else INT8
    assert compiled.report_data["lowered"] == {f"tpp.qdq_conv2d_bias_relu {kernel}": 1}, \
        compiled.report_data["lowered"]


def test_qdq_silu_fuses_and_its_convolution_runs_once(tmp_path) -> None:
    """A SiLU exported as ``x * sigmoid(x)`` after a QDQ convolution (EfficientNet's): with
    the fake quantization between them dropped it is a SiLU again, fused into the int8
    kernel's epilogue; unrecognised, the convolution ran twice (once per reader of x) and
    the product on TVM's default code."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.SiLU(),
                              torch.nn.Conv2d(32, 16, 1)).eval()
    fp32, model = _qdq_u8_export(tmp_path, net, (1, 16, 10, 10))
    assert {"Sigmoid", "Mul"} <= {node.op_type for node in model.graph.node}
    compiled = _compiled_like_onnxruntime(fp32, model, "qdq_u8")[0]
    data = compiled.report_data
    assert data["lowered"] == {f"tpp.qdq_conv2d_bias_silu {INT8}": 1,
                               f"tpp.qdq_conv2d_bias {INT8}": 1}, data["lowered"]
    assert not [name for name in data["default_scheduled"] if "multiply" in name], data


def test_qdq_squeeze_excitation_needs_no_relu_kernel(tmp_path) -> None:
    """RegNetY's squeeze-excitation after a QDQ conv + ReLU: the ReLU output is quantized
    on [0, ...] (ONNX Runtime folds the ReLU into that range), and so are the pooled mean
    and the product with the sigmoid, all >= 0. No ReLU is put back in front of those
    quantizations (each was an element-wise kernel of its own, and split the sigmoid,
    product and quantize into two default-code kernels: RegNetY int8 7.7 -> 6.2 ms)."""
    import torch

    class SqueezeExcite(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)
            self.fc1, self.fc2 = torch.nn.Conv2d(32, 8, 1), torch.nn.Conv2d(8, 32, 1)
            self.out = torch.nn.Conv2d(32, 16, 1)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            s = torch.sigmoid(self.fc2(torch.relu(self.fc1(y.mean((2, 3), keepdim=True)))))
            return self.out(y * s)

    torch.manual_seed(0)
    fp32, model = _qdq_u8_export(tmp_path, SqueezeExcite().eval(), (1, 16, 10, 10))
    assert not any(node.op_type == "Relu" for node in model.graph.node)  # folded by ORT
    compiled = _compiled_like_onnxruntime(fp32, model, "qdq_u8")[0]
    data = compiled.report_data
    assert not any("eltwise" in k for k in data["lowered"]), data["lowered"]
    assert not [name for name in data["default_scheduled"] if "relu" in name], data
    product = [name for name in data["default_scheduled"] if "multiply" in name]
    assert len(product) == 1 and "sigmoid" in product[0] and "quantize" in product[0], data
    relus = [v for k, v in data["rewrites"].items() if k.startswith("quantization clipping")]
    assert relus == [2], data["rewrites"]  # the conv's and fc1's, fused into their epilogues


def test_qdq_relu6_clips_at_six_and_fuses(tmp_path) -> None:
    """MobileNetV2's ReLU6 after an expansion conv, then a TF-style pad and a depthwise
    conv: ONNX Runtime's QDQ quantizer removes the Clip(0, 6) and quantizes its output on
    [0, 6]. The clip at 6 stays (dropping the fake quantization kept values past 6, 2.7x
    further from fp32 than ONNX Runtime's int8 on MobileNetV2), once, as the int8 conv's
    and the depthwise conv's ReLU6 epilogues; the pad folds into the depthwise conv, which
    writes the last conv's u8 input itself (no quantize kernel after it)."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(8, 32, 1), torch.nn.ReLU6(), torch.nn.ZeroPad2d((0, 1, 0, 1)),
        torch.nn.Conv2d(32, 32, 3, stride=2, groups=32), torch.nn.ReLU6(),
        torch.nn.Conv2d(32, 16, 1)).eval()
    with torch.no_grad():
        net[0].weight.mul_(8.0)  # activations well past 6, so the clip matters
    fp32, model = _qdq_u8_export(tmp_path, net, (1, 8, 12, 12))
    assert not any(node.op_type == "Clip" for node in model.graph.node)  # folded by ORT
    compiled = _compiled_like_onnxruntime(fp32, model, "qdq_u8")[0]
    data = compiled.report_data
    assert data["lowered"].get(f"tpp.qdq_conv2d_bias_relu6 {INT8}") == 1, data["lowered"]
    assert data["lowered"].get("tpp.depthwise_conv2d_bias_relu6") == 1, data["lowered"]
    assert not any("eltwise" in k for k in data["lowered"]), data["lowered"]
    assert not [name for name in data["default_scheduled"] if "pad" in name], data
    assert not [name for name in data["default_scheduled"] if "quantize" in name
                and "transpose" not in name], data  # (the model input's quantize stays)
    assert data["rewrites"].get(INT8_LINKS) == 1, data["rewrites"]


@pytest.mark.parametrize("kind", ["dynamic", "qdq_u8", "qdq_s8"])
def test_quantized_conv1d_runs_on_the_int8_conv_kernel(tmp_path, kind: str) -> None:
    """wav2vec2's feature encoder quantized: Conv1d layers (1 -> 32 channels over 10 taps
    at stride 5, then 3- and 2-tap ones at stride 2, GELU between) run on the int8 conv
    kernel as convolutions over one row; they ran in fp32 (wav2vec2 QDQ 48.7 -> 19.8 ms on
    the AMX Xeon, 1 thread). As close to the fp32 model as ONNX Runtime's int8 result."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv1d(1, 32, 10, stride=5), torch.nn.GELU(),
        torch.nn.Conv1d(32, 32, 3, stride=2), torch.nn.GELU(),
        torch.nn.Conv1d(32, 16, 2, stride=2, bias=False)).eval()
    path = str(tmp_path / "fp32.onnx")
    torch.onnx.export(net, (torch.randn(1, 1, 400),), path, input_names=["input"],
                      opset_version=17, dynamo=False)
    fp32 = onnx.load(path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"))
    compiled = _compiled_like_onnxruntime(fp32, model, kind)[0]
    data = compiled.report_data
    kernel = "tpp.conv_integer" if kind == "dynamic" else "tpp.qdq_conv1d"
    assert sum(v for k, v in data["lowered"].items() if k.startswith(kernel)) == 3, data
    assert not data["fallbacks"], data["fallbacks"]


@pytest.mark.parametrize("kind", ["dynamic", "qdq_u8"])
def test_quantized_models_on_avx512_without_vnni(tmp_path, kind: str) -> None:
    """A Skylake-SP target (AVX-512, no VNNI) once refused every quantized model ("needs the
    CPU features avx512vnni"): its int8 layers now run on s16 kernels (``vpmaddwd`` zmm),
    compiled everywhere, run where the host has AVX512BW."""
    skylake = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512",
                                 "keys": ["tpp", "cpu"], "num-cores": 1})
    fp32, path = _fp32_mlp(tmp_path)
    model = _quantize(kind, path, str(tmp_path / f"{kind}.onnx"))
    if not (host_isa().avx512f and host_isa().avx512bw):
        data = compile_onnx(model, target=skylake).report_data
    else:
        data = _compiled_like_onnxruntime(fp32, model, kind, skylake)[0].report_data
    ours = [k for k in data["lowered"] if k.endswith("[int8 via int16]")]
    assert len(ours) == 2 and not data["fallbacks"], data


class _Feeds(quantization.CalibrationDataReader):
    """Calibration batches: the model's example inputs with seeded normal activations."""

    def __init__(self, model: onnx.ModelProto, batches: int = 4) -> None:
        example = models.example_inputs(model)
        self.batches = iter([
            {k: (np.random.default_rng(i).standard_normal(v.shape).astype(v.dtype)
                 if k != "attention_mask" else v) for k, v in example.items()}
            for i in range(batches)])

    def get_next(self):
        return next(self.batches, None)


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_qdq_transformer_attention_stays_one_kernel(tmp_path, precision: str) -> None:
    """A static-QDQ BERT layer: the u8 quantization of the softmax output clips at 0, which
    would otherwise be exposed as a ReLU (softmax is never negative, so none is) between
    the softmax and the second matmul and split the fused attention into two batched
    matmuls and a softmax. With ``precision="bf16"`` on a tile target the int8 layers stay
    int8 and the attention, which the QDQ model leaves in fp32, runs on bf16 tiles, as
    accurate against fp32 as ONNX Runtime's int8 run."""
    fp32 = models.GENERATORS["bert"](layers=1, hidden=64, heads=2, intermediate=128, seq=32)
    src, dst = str(tmp_path / "bert.onnx"), str(tmp_path / "bert_qdq.onnx")
    onnx.save(fp32, src)
    quantization.quantize_static(src, dst, _Feeds(fp32), quant_format=quantization.QuantFormat.QDQ,
                                 activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    model = onnx.load(dst)
    if precision == "float32":
        compiled = compile_onnx(model)
    else:
        compiled = compile_onnx(model, precision=precision, target=h.tile_target())
    lowered = compiled.report_data["lowered"]
    attention = "tpp.attention_mask" + (" [bf16, amx]" if precision == "bf16" else "")
    assert lowered.get(attention) == 1, lowered
    if precision == "bf16":
        assert sum(n for k, n in lowered.items() if k.endswith("[int8, amx]")) >= 4, lowered
    assert not any(k.startswith(("tpp.bmm", "tpp.softmax")) for k in lowered), lowered
    inputs = models.example_inputs(fp32)
    exact = run_onnxruntime(fp32, inputs)[0]
    ort_err = np.abs(run_onnxruntime(model, inputs)[0] - exact).max()
    assert np.abs(compiled(*inputs.values())[0] - exact).max() <= 1.05 * ort_err


@pytest.mark.requires_torch
def test_qdq_torch_linear_layers_fuse_their_biases(tmp_path) -> None:
    """ONNX Runtime's QDQ of an all-zero bias (both layers' biases, as in transformers'
    freshly initialised linear layers) clips at 0, so the second layer's reaches the
    rewrite as ``relu(dequantize(b))``: it still fuses into the int8 kernel's epilogue,
    not a TVM op of its own (DistilBERT: 3 of 4 FFN GELUs and every bias ran apart)."""
    import torch

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                              torch.nn.Linear(64, 64)).eval()
    for layer in (mlp[0], mlp[2]):
        torch.nn.init.zeros_(layer.bias)
    src, dst = str(tmp_path / "mlp.onnx"), str(tmp_path / "mlp_qdq.onnx")
    torch.onnx.export(mlp, (torch.randn(1, 16, 64),), src, input_names=["input"],
                      opset_version=17, dynamo=False)
    fp32 = onnx.load(src)
    quantization.quantize_static(src, dst, _Feeds(fp32), quant_format=quantization.QuantFormat.QDQ,
                                 activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    model = onnx.load(dst)
    assert sum(n.op_type == "Add" and n.input[0].endswith("bias") for n in fp32.graph.node) == 2
    compiled = compile_onnx(model)
    lowered = compiled.report_data["lowered"]
    assert lowered == {f"tpp.qdq_matmul_bias_gelu {INT8}": 1, f"tpp.qdq_matmul_bias {INT8}": 1}, \
        lowered
    inputs = models.example_inputs(fp32)
    exact = run_onnxruntime(fp32, inputs)[0]
    ort_err = np.abs(run_onnxruntime(model, inputs)[0] - exact).max()
    assert np.abs(compiled(*inputs.values())[0] - exact).max() <= 1.05 * ort_err


@pytest.mark.parametrize(("dtype", "zero"), [("uint8", 0), ("uint8", 128), ("int8", -128),
                                             ("int8", 0)])
def test_quantize_moves_before_max_pool(dtype: str, zero: int) -> None:
    """``quantize(relu(max_pool(x)))`` and ``max_pool(quantize(relu(x)))`` are equal, element
    for element, with padding, saturation and a range that does or does not clip at 0 (the
    ReLU then stays in front of the quantize)."""
    from tvm import relax

    from tpp_tvm.relay_passes.fake_quant import quantize_before_max_pool
    from tpp_tvm.relay_passes.lower import LoweringReport

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 9, 9), "float32"))
    with bb.function("main", [x]):
        pooled = bb.emit(relax.op.nn.max_pool2d(x, 3, 2, 1))
        q = relax.op.quantize(relax.op.nn.relu(pooled), relax.const(0.02, "float32"),
                              relax.const(zero, dtype), out_dtype=dtype)
        bb.emit_func_output(bb.emit(q))
    before = bb.get()
    report = LoweringReport()
    after = tvm.IRModule({"main": quantize_before_max_pool(before["main"], report)})
    assert report.rewrites[MAX_POOL_QUANTIZED] == 1
    last = after["main"].body.blocks[-1].bindings[-1].value
    assert last.op.name == "relax.nn.max_pool2d"  # the pool comes last
    data = np.random.default_rng(0).standard_normal((1, 4, 9, 9)).astype("float32") * 3
    outs = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(data)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    assert outs[0].min() < outs[0].max()
