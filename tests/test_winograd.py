"""Winograd F(2x2, 3x3) convolution: the transforms, the kernel against numpy, the choice."""

from __future__ import annotations

from dataclasses import replace

import checks
import numpy as np
import onnx
import pytest
from checks import assert_runs_like_onnxruntime
from onnx import TensorProto, helper, numpy_helper
from test_conv import _conv_ref, _run

from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.schedules import winograd
from tpp_tvm.schedules.conv import ConvShape
from tpp_tvm.schedules.winograd import (
    FILTER_TRANSFORM,
    INPUT_TRANSFORM,
    OUTPUT_TRANSFORM,
    pack_winograd_filter,
    plan_winograd,
    whole_image,
    winograd_applies,
    winograd_schedule,
)


def test_transforms_compute_a_correlation() -> None:
    """Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A is the 2x2 valid correlation of a 4x4 patch with g."""
    rng = np.random.default_rng(0)
    d, g = rng.standard_normal((4, 4)), rng.standard_normal((3, 3))
    u = FILTER_TRANSFORM @ g @ FILTER_TRANSFORM.T
    v = INPUT_TRANSFORM @ d @ INPUT_TRANSFORM.T
    y = OUTPUT_TRANSFORM @ (u * v) @ OUTPUT_TRANSFORM.T
    want = [[np.sum(d[i:i + 3, j:j + 3] * g) for j in range(2)] for i in range(2)]
    np.testing.assert_allclose(y, want, rtol=1e-12)


@pytest.mark.parametrize(("sh", "steps"), [
    (ConvShape(1, 9, 9, 16, 24, 3, 3, 1, (1, 1, 1, 1)), ("bias", "relu")),  # odd: tile tails
    (ConvShape(2, 10, 13, 32, 40, 3, 3, 1, (0, 1, 2, 1)), ("bias",)),  # batch, uneven pads
    (ConvShape(1, 12, 11, 48, 48, 3, 3, 1, (1, 1, 1, 1), 3), ("bias", "relu", "residual")),
    (ConvShape(1, 16, 16, 64, 128, 3, 3, 1, (1, 1, 1, 1), 2), ("residual", "relu6")),
    (ConvShape(1, 14, 14, 256, 256, 3, 3, 1, (1, 1, 1, 1)), ("bias", "relu")),  # ResNet
    (ConvShape(1, 7, 7, 512, 64, 3, 3, 1, (1, 1, 1, 1)), ("bias", "relu")),  # whole image
])
def test_winograd_conv_matches_numpy(sh: ConvShape, steps: tuple[str, ...]) -> None:
    """Each schedule: blocks outer over a group's panels, panels outer after an input
    transform pass, and one block per panel holding the whole image (512 channels)."""
    rng = np.random.default_rng(sh.oc + sh.h)
    x = rng.standard_normal((sh.n, sh.h, sh.w, sh.c)).astype("float32")
    w = (rng.standard_normal((sh.oc, sh.cg, 3, 3)) / np.sqrt(9 * sh.cg)).astype("float32")
    bias = rng.standard_normal(sh.oc).astype("float32")
    grouped = sh.groups > 1
    out_shape = (sh.n, sh.oh, sh.ow, *((sh.groups, sh.og) if grouped else (sh.oc,)))
    res = rng.standard_normal(out_shape).astype("float32")
    post = "relu6" if "relu6" in steps else None
    if sh.cg == 512:
        assert whole_image(sh, plan_winograd(sh, checks.VECTOR_ISA))
    sch, plan = winograd_schedule(sh, checks.VECTOR_ISA,
                                  epilogue=Epilogue(bias="bias" in steps,
                                                    activation="relu" if "relu" in steps else None,
                                                    residual="residual" in steps,
                                                    post_activation=post))
    args = [x.reshape(sh.n, sh.h, -1), pack_winograd_filter(w, plan.nr, sh.groups)]
    if "bias" in steps:
        rows = np.pad(bias.reshape(sh.groups, sh.og), ((0, 0), (0, plan.np_ - sh.og)))
        args.append(rows if grouped else rows[0])
    if "residual" in steps:
        args.append(res)
    got = _run(sch, args, out_shape).reshape(sh.n, sh.oh, sh.ow, sh.oc)
    one = replace(sh, c=sh.cg, oc=sh.og, groups=1)
    want = np.concatenate([_conv_ref(x[..., g * sh.cg:(g + 1) * sh.cg],
                                     w[g * sh.og:(g + 1) * sh.og], one, 0.0)
                           for g in range(sh.groups)], axis=-1)
    if "bias" in steps:
        want = want + bias
    if "relu" in steps:
        want = np.maximum(want, 0)
    if "residual" in steps:
        want = want + res.reshape(want.shape)
    if post:
        want = np.clip(want, 0, 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(("sh", "activation", "applies"), [
    (ConvShape(1, 14, 14, 64, 64, 3, 3, 1, (1, 1, 1, 1)), "relu", True),
    (ConvShape(1, 14, 14, 64, 64, 3, 3, 2, (1, 1, 1, 1)), "relu", False),  # strided
    (ConvShape(1, 14, 14, 64, 64, 5, 5, 1, (2, 2, 2, 2)), "relu", False),  # 5x5
    (ConvShape(1, 14, 14, 24, 24, 3, 3, 1, (1, 1, 1, 1)), "relu", False),  # 24 channels
    (ConvShape(1, 7, 7, 1088, 1088, 3, 3, 1, (1, 1, 1, 1), 17), "relu", True),  # RegNet
    (ConvShape(1, 3, 3, 64, 64, 3, 3, 1, (1, 1, 1, 1)), "relu", False),  # 3x3 output
    (ConvShape(1, 7, 7, 512, 512, 3, 3, 1, (1, 1, 1, 1)), "relu", True),  # image per panel
    (ConvShape(1, 16, 16, 4096, 64, 3, 3, 1, (1, 1, 1, 1)), "relu", False),  # panel > L2
    (ConvShape(1, 14, 14, 64, 64, 3, 3, 1, (1, 1, 1, 1)), "sigmoid", False),
])
def test_winograd_applies_to_3x3_stride1_layers(sh: ConvShape, activation: str,
                                                 applies: bool, monkeypatch) -> None:
    # the choice follows the host's L2 (half of it for a panel): these cases are a 1 MiB one
    host = winograd.host_isa()
    monkeypatch.setattr(winograd, "host_isa", lambda: replace(host, l2_bytes=1 << 20))
    assert winograd_applies(sh, Epilogue(activation=activation)) is applies


def test_resnet_block_compiles_to_winograd_and_runs_like_onnxruntime() -> None:
    """An NCHW ONNX 3x3 conv + ReLU and its residual block: the lowering picks the
    Winograd kernel (named so in profiles) and the model matches ONNX Runtime."""
    rng = np.random.default_rng(3)
    c = 32
    w1 = numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.1).astype("float32"),
                                 "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.1).astype("float32"),
                                 "w2")
    b1 = numpy_helper.from_array(rng.standard_normal(c).astype("float32"), "b1")
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 17, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 17, 12])],
        initializer=[w1, w2, b1])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    x = rng.standard_normal((1, c, 17, 12)).astype("float32")
    compiled = assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    kernels = [name for name, _, _ in compiled.profile(x=x, repeat=1)]
    assert sum("winograd" in k for k in kernels) == 2, kernels
