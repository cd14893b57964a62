"""The pattern table is complete data: every entry names a lowering that exists, and the
parameters a lowering needs are fields of the entry, not read back out of its name."""

import pytest

from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.relay_passes.families import FAMILIES
from tpp_tvm.relay_passes.patterns import pattern_table


def test_every_pattern_has_a_lowering():
    table = pattern_table()
    assert {p.lowering for p in table} == set(FAMILIES)
    names = [p.name for p in table]
    assert len(names) == len(set(names)), "pattern names must be unique (they key the table)"


def test_lowering_parameters_are_fields():
    table = {p.name: p for p in pattern_table()}
    assert table["tpp.attention_mask_mulscale"].scale_multiplies
    assert not table["tpp.attention_mask"].scale_multiplies
    assert table["tpp.conv2d_runtime_weight"].lowering == "conv2d"
    relu_dense = table["tpp.dense_bias_relu_residual"]
    assert relu_dense.lowering == "dense"
    assert relu_dense.epilogue == Epilogue(bias=True, activation="relu", residual=True)
    assert table["tpp.dense_bias_residual_relu"].epilogue.post_activation == "relu"


@pytest.mark.requires_onnxruntime
def test_squeeze_excite_convolutions_take_their_bias_and_activation():
    """Squeeze-excite's 1x1 convolutions on the pooled (1, 1, 1, C) map: their bias is shaped
    like the output, and it is matched as the bias (so the SiLU and the sigmoid fuse into
    the kernels), not as a residual (the sigmoid then ran inside the channel-scale multiply,
    once per pixel: EfficientNet-B0 spent 1.3 ms there), and the channel scale is read
    into the projection's GEMM (no pass of its own over the activation), against ORT."""
    import checks
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(9)
    c, r = 16, 4
    consts = {"w0": rng.standard_normal((c, 3, 3, 3)) * 0.3,
              "w1": rng.standard_normal((r, c, 1, 1)) * 0.3, "b1": rng.standard_normal(r),
              "w2": rng.standard_normal((c, r, 1, 1)) * 0.3, "b2": rng.standard_normal(c),
              "w3": rng.standard_normal((c, c, 1, 1)) * 0.3, "b3": rng.standard_normal(c)}
    nodes = [helper.make_node("Conv", ["image", "w0"], ["x"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["x"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["h"]),
             helper.make_node("Sigmoid", ["h"], ["hs"]),
             helper.make_node("Mul", ["h", "hs"], ["a"]),  # SiLU
             helper.make_node("Conv", ["a", "w2", "b2"], ["g"]),
             helper.make_node("Sigmoid", ["g"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Conv", ["xs", "w3", "b3"], ["o"]),  # the block's projection
             helper.make_node("Add", ["o", "x"], ["o_res"]),
             helper.make_node("Relu", ["o_res"], ["y"])]  # RegNetY's block output
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "se", [helper.make_tensor_value_info("image", f, [1, 3, 9, 9])],
        [helper.make_tensor_value_info("y", f, None)],
        [numpy_helper.from_array(np.asarray(v, "float32"), k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"image": rng.standard_normal((1, 3, 9, 9)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    lowered = compiled.report_data["lowered"]
    assert lowered.get("tpp.conv2d_bias_silu") == 1, lowered
    assert lowered.get("tpp.conv2d_bias_sigmoid") == 1, lowered
    assert lowered.get("tpp.conv2d_scaled_input_bias_residual_relu") == 1, lowered
    rest = compiled.report_data.get("default_scheduled", [])
    assert not [k for k in rest if "multiply" in k or "sigmoid" in k], rest  # edge transposes


def test_residual_of_two_convolutions_fuses_into_the_single_use_one():
    """MobileNetV2's first residual of a stage adds two projection convolutions, and the
    first operand also feeds the next block: the add still fuses, into the second
    convolution's epilogue (it ran as its own kernel), against ORT."""
    import checks
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    c = 16
    consts = {f"w{i}": rng.standard_normal((c, c, 1, 1)) * 0.3 for i in range(3)}
    consts |= {f"b{i}": rng.standard_normal(c) for i in range(3)}
    nodes = [helper.make_node("Conv", ["image", "w0", "b0"], ["a"]),
             helper.make_node("Conv", ["a", "w1", "b1"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["s"]),  # a first: a is used twice
             helper.make_node("Conv", ["a", "w2", "b2"], ["t"]),
             helper.make_node("Mul", ["s", "t"], ["y"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "res", [helper.make_tensor_value_info("image", f, [1, c, 8, 8])],
        [helper.make_tensor_value_info("y", f, None)],
        [numpy_helper.from_array(np.asarray(v, "float32"), k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"image": rng.standard_normal((1, c, 8, 8)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    lowered = compiled.report_data["lowered"]
    assert lowered.get("tpp.conv2d_bias_residual") == 1, lowered
    assert not [k for k in lowered if "eltwise_add" in k], lowered


def test_hardswish_is_an_epilogue_of_every_contraction_family():
    """MobileNetV3's HardSwish (and its squeeze-excite HardSigmoid, as min/max) after a
    convolution, a depthwise convolution and a dense layer: one kernel each, no
    activation pass of its own, against ORT."""
    import checks
    import numpy as np
    from onnx import helper

    rng = np.random.default_rng(5)
    c = 40
    consts = {"w": rng.standard_normal((c, c, 1, 1)) * 0.5, "b": rng.standard_normal(c),
              "wd": rng.standard_normal((c, 1, 3, 3)), "wm": rng.standard_normal((c, 24)),
              "bm": rng.standard_normal(24)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"]),
             helper.make_node("HardSwish", ["h"], ["a"]),
             helper.make_node("Conv", ["a", "wd", "b"], ["d"], group=c, pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["d"], ["e"]),
             helper.make_node("HardSigmoid", ["e"], ["g"], alpha=1 / 6),
             helper.make_node("Mul", ["e", "g"], ["eg"]),
             helper.make_node("GlobalAveragePool", ["eg"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "wm"], ["mm"]),
             helper.make_node("Add", ["mm", "bm"], ["mb"]),
             helper.make_node("HardSwish", ["mb"], ["y"])]
    model = checks.onnx_model(nodes, {"x": [1, c, 14, 14]}, consts)
    feeds = {"x": rng.standard_normal((1, c, 14, 14)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    lowered = compiled.report_data["lowered"]
    for kernel in ("conv2d_bias_hardswish", "depthwise_conv2d_bias_hardswish",
                   "dense_bias_hardswish"):
        assert lowered.get(f"tpp.{kernel}") == 1, lowered


@pytest.mark.parametrize("slope,fused", [(0.01, True), (0.1, False)])
def test_leaky_relu_is_an_epilogue_of_every_contraction_family(slope, fused):
    """CSPDarknet's LeakyReLU (slope 0.01, torch's default) after a convolution, a
    depthwise convolution and a dense layer: one kernel each; another slope is no such
    step, and stays exact as an op of its own."""
    import checks
    import numpy as np
    from onnx import helper

    rng = np.random.default_rng(6)
    c = 24
    consts = {"w": rng.standard_normal((c, c, 3, 3)) * 0.2, "b": rng.standard_normal(c),
              "wd": rng.standard_normal((c, 1, 3, 3)), "wm": rng.standard_normal((c, 16)),
              "bm": rng.standard_normal(16)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("LeakyRelu", ["h"], ["a"], alpha=slope),
             helper.make_node("Conv", ["a", "wd", "b"], ["d"], group=c, pads=[1, 1, 1, 1]),
             helper.make_node("LeakyRelu", ["d"], ["e"], alpha=slope),
             helper.make_node("GlobalAveragePool", ["e"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "wm"], ["mm"]),
             helper.make_node("Add", ["mm", "bm"], ["mb"]),
             helper.make_node("LeakyRelu", ["mb"], ["y"], alpha=slope)]
    model = checks.onnx_model(nodes, {"x": [1, c, 10, 10]}, consts)
    feeds = {"x": rng.standard_normal((1, c, 10, 10)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    lowered = compiled.report_data["lowered"]
    for kernel in ("conv2d_bias", "depthwise_conv2d_bias", "dense_bias"):
        assert (lowered.get(f"tpp.{kernel}_leaky_relu") == 1) == fused, lowered


def test_leaky_relu_is_an_int8_epilogue(tmp_path):
    """The same step after an int8 GEMM (ONNX Runtime's dynamic quantization: a
    MatMulInteger whose result the LeakyReLU reads): one kernel, as close to fp32 as ONNX
    Runtime's own int8 result. (ORT's static QDQ quantizes the LeakyReLU's input on its
    own, so there the step runs as an equation TPP after the int8 convolution.)"""
    import onnx
    import torch
    from test_quantized import _compiled_like_onnxruntime, _quantize

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LeakyReLU(),
                              torch.nn.Linear(96, 32)).eval()
    path = str(tmp_path / "fp32.onnx")
    torch.onnx.export(net, (torch.randn(4, 64),), path, input_names=["input"],
                      opset_version=17, dynamo=False)
    model = _quantize("dynamic", path, str(tmp_path / "int8.onnx"))
    compiled = _compiled_like_onnxruntime(onnx.load(path), model, "dynamic")[0]
    rows = compiled.report_data["kernels"]
    fused = [r for r in rows if r["pattern"] == "tpp.matmul_integer_bias_leaky_relu"]
    # int8 dot products (AVX-512 VNNI, AMX), or the same sums as s16 pairs on AVX2
    assert len(fused) == 1 and fused[0]["precision"] in ("int8", "int16"), rows
