"""Operator forms rewritten onto forms with TPP kernels (``relay_passes/canonical_forms.py``)
and the transpose fallback schedule: ONNX graphs from ``onnx.helper`` against ONNX Runtime,
at odd sizes (1, primes)."""

from __future__ import annotations

import checks
import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import tpp_tvm

pytestmark = pytest.mark.requires_onnxruntime
RNG = np.random.default_rng(7)


def _model(node: onnx.NodeProto, x_shape: list[int], weight: np.ndarray | None = None
           ) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(weight, "w")] if weight is not None else []
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, x_shape)], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check(model: onnx.ModelProto, x_shape: list[int]) -> str:
    """Run with tpp_tvm and ORT on the same random input; return the report."""
    x = RNG.standard_normal(x_shape).astype("float32")
    return checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4).report()


@pytest.mark.parametrize("op", ["AveragePool", "MaxPool"])
@pytest.mark.parametrize("hw,window,ceil", [((7, 7), 1280, 1), ((5, 3), 5, 1), ((1, 1), 3, 1),
                                            ((13, 11), 13, 1)])
def test_pooling_over_the_whole_input_is_a_global_reduction(op, hw, window, ceil) -> None:
    """EfficientNet's final AveragePool: a 1280x1280 window with ceil_mode over 7x7."""
    shape = [1, 24, *hw]
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=[window, window],
                            strides=[window, window], ceil_mode=ceil)
    _check(_model(node, shape), shape)


def test_pooling_with_more_than_one_window_is_left_alone() -> None:
    shape = [1, 8, 9, 9]
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[5, 5], strides=[4, 4],
                            ceil_mode=1)
    _check(_model(node, shape), shape)


@pytest.mark.parametrize("c,oc,k,stride,pads,width,kernel", [
    (1, 32, 10, 5, (0, 0), 1601, "tpp.dense"),      # wav2vec2's first layer: im2col + GEMM
    (32, 24, 3, 2, (0, 0), 199, "tpp.conv2d"),      # its later layers
    (8, 16, 5, 1, (2, 2), 97, "tpp.conv2d"),        # padded
    (3, 7, 1, 1, (0, 0), 31, "tpp.dense"),          # pointwise
])
def test_conv1d_runs_on_a_tpp(c, oc, k, stride, pads, width, kernel) -> None:
    w = (RNG.standard_normal((oc, c, k)) * 0.1).astype("float32")
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[stride], pads=list(pads))
    report = _check(_model(node, [1, c, width], w), [1, c, width])
    assert kernel in report


def test_stacked_conv1d_layers_take_their_activation_and_chain_without_copies() -> None:
    """An audio front end: Conv1d + GELU twice. Each GELU joins its convolution's epilogue
    and nothing runs between the two kernels (the 1-D/2-D views cancel)."""
    w1 = (RNG.standard_normal((32, 24, 3)) * 0.2).astype("float32")
    w2 = (RNG.standard_normal((32, 32, 3)) * 0.2).astype("float32")
    inits = {"w1": w1, "w2": w2, "sq2": np.float32(np.sqrt(2)), "one": np.float32(1),
             "half": np.float32(0.5)}
    nodes = []
    for i, (src, w, stride) in enumerate((("x", "w1", 2), ("a0", "w2", 2))):
        nodes += [helper.make_node("Conv", [src, w], [f"c{i}"], strides=[stride]),
                  helper.make_node("Div", [f"c{i}", "sq2"], [f"d{i}"]),
                  helper.make_node("Erf", [f"d{i}"], [f"e{i}"]),
                  helper.make_node("Add", [f"e{i}", "one"], [f"p{i}"]),
                  helper.make_node("Mul", [f"c{i}", f"p{i}"], [f"m{i}"]),
                  helper.make_node("Mul", [f"m{i}", "half"], [f"a{i}" if i == 0 else "y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 24, 101])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [numpy_helper.from_array(np.asarray(v), k)
                                             for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = _check(model, [1, 24, 101])
    assert "tpp.conv2d_gelu: 2" in report and "eltwise" not in report, report
    assert "default schedules (no TPP): 2" in report, report  # the two edge transposes


@pytest.mark.parametrize("groups,c,oc,x_shape,k,stride", [
    (16, 64, 64, [1, 64, 49], [8], 1),         # wav2vec2's positional conv, smaller
    (3, 6, 9, [1, 6, 11, 13], [3, 3], 1),      # 2-D, prime group count
    (2, 4, 6, [2, 4, 7, 5], [1, 1], 1),        # pointwise, batch 2
    (4, 32, 40, [1, 32, 13, 11], [3, 3], 2),   # RegNet-like, strided, 10 channels a group
])
def test_grouped_convolutions_run_as_one_tpp_kernel(groups, c, oc, x_shape, k, stride
                                                    ) -> None:
    """One grouped kernel reads each group's channels in place and writes them NHWC: no
    per-group slices and no concat."""
    w = (RNG.standard_normal((oc, c // groups, *k)) * 0.1).astype("float32")
    pads = [kk // 2 for kk in k] * 2
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=groups, pads=pads,
                            strides=[stride] * len(k))
    report = _check(_model(node, x_shape, w), x_shape)
    assert "tpp.conv2d: 1" in report and "runtime_weight" not in report, report
    assert "concat" not in report and "split" not in report, report


def test_a_grouped_convolution_takes_its_epilogue() -> None:
    """Bias (a row per group), ReLU and a residual fuse into the grouped kernel."""
    c, groups = 24, 3
    w = (RNG.standard_normal((c, c // groups, 3, 3)) * 0.1).astype("float32")
    b = RNG.standard_normal(c).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], group=groups, pads=[1] * 4),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("Add", ["a", "x"], ["y"])]
    shape = [1, c, 9, 7]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, shape)], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w"),
                                             numpy_helper.from_array(b, "b")])
    report = _check(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                    shape)
    assert "tpp.conv2d_bias_relu_residual: 1" in report, report


@pytest.mark.parametrize("shape,perm", [([37, 53], [1, 0]), ([1, 144, 7, 17], [0, 2, 3, 1]),
                                        ([2, 31, 16, 48], [0, 3, 1, 2]), ([5, 3], [1, 0])])
def test_transposes_are_exact(shape, perm) -> None:
    """... and report() names them: kernels left on TVM's default schedules are listed."""
    node = helper.make_node("Transpose", ["x"], ["y"], perm=perm)
    report = _check(_model(node, shape), shape)
    assert "default schedules (no TPP): 1" in report and "transpose" in report


def test_transpose_rule_tiles_the_strided_axis() -> None:
    """Off TPP targets (plain LLVM) the rule tiles the strided axis; a tile vector is
    gathered down the input's column."""
    from tvm import te, tirx

    from tpp_tvm.schedules.default import Transpose

    x = te.placeholder((64, 48), name="x")
    y = te.compute((48, 64), lambda i, j: x[j, i], name="y")
    llvm = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 1})
    sch = Transpose().apply(te.create_prim_func([x, y]), llvm, False)
    assert sch is not None
    kinds = [sch.get(lp).kind for lp in sch.get_loops(sch.get_sblock("y"))]
    assert kinds[-1] == tirx.ForKind.VECTORIZED and kinds[0] == tirx.ForKind.PARALLEL, kinds
    # An element-wise op is not a transpose.
    z = te.compute((64, 48), lambda i, j: x[i, j] * 2, name="z")
    assert Transpose().apply(te.create_prim_func([x, z]), tpp_tvm.target(), False) is None


@pytest.mark.parametrize("rows,heads,dim,padded", [(197, 12, 64, 224), (49, 6, 32, 64),
                                                   (37, 3, 16, 37), (211, 1, 512, 211)])
def test_transposed_planes_run_on_the_transpose_tpp(rows, heads, dim, padded) -> None:
    """Attention's Kᵀ ((tokens, heads*dim) to (heads, dim, keys), keys zero padded to the
    kernel's width) and plain 2-D transposes: on a TPP target the transposed plane is a
    register-blocked transpose TPP (no gathers), a zero pad is stored apart, a single
    plane is split into chunks for the threads; exact for ragged and prime sizes."""
    from tvm import te, tirx

    from tpp_tvm.schedules.default import Transpose
    from tpp_tvm.tir_pipeline import compile_kernels

    x = te.placeholder((rows, heads * dim), name="x")
    y = te.compute((heads, dim, padded), lambda h, d, j: tirx.if_then_else(
        j < rows, x[tirx.min(j, rows - 1), h * dim + d], tirx.const(0, "float32")), name="y")
    tgt = tpp_tvm.target(num_cores=2)
    sch = Transpose().apply(te.create_prim_func([x, y]), tgt, False)
    script = sch.mod.script()
    assert "T.Shuffle" in script and "gather" not in script
    assert ("y_pad_const" in script) == (padded > rows)
    lib = compile_kernels(sch.mod, tgt)
    a = RNG.standard_normal((rows, heads * dim)).astype("float32")
    out = tvm.runtime.tensor(np.full((heads, dim, padded), np.nan, "float32"))
    lib["main"](tvm.runtime.tensor(a), out)
    want = np.zeros((heads, dim, padded), "float32")
    want[:, :, :rows] = a.reshape(rows, heads, dim).transpose(1, 2, 0)
    np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.parametrize("lo,hi,fused", [(0.0, 6.0, True), (-1.0, 1.0, False)])
def test_relu6_fuses_and_explicit_pads_fold_into_the_next_convolution(lo, hi, fused) -> None:
    """MobileNet's block: conv -> Clip(0, 6) -> Pad (TF "same") -> depthwise conv. The clip
    becomes the conv's ReLU6 epilogue and the pad the depthwise conv's own padding, so no
    transpose or pad kernel sits between the layers; other clip bounds stay exact."""
    c = 32
    rng = np.random.default_rng(5)
    w1 = (rng.standard_normal((c, 8, 1, 1)) * 0.5).astype("float32")
    w2 = rng.standard_normal((c, 1, 3, 3)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]),
             helper.make_node("Clip", ["a", "lo", "hi"], ["b"]),
             helper.make_node("Pad", ["b", "pads"], ["p"]),
             helper.make_node("Conv", ["p", "w2"], ["y"], group=c, strides=[2, 2])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(np.float32(lo), "lo"),
             numpy_helper.from_array(np.float32(hi), "hi"),
             numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64), "pads")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 15, 15])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = _check(model, [1, 8, 15, 15])
    assert ("relu6" in report) == fused
    assert "tpp.depthwise_conv2d" in report


@pytest.mark.parametrize("pads", [[0, 0, 0, 0, 0, 0, 1, 1], [0] * 8])
def test_pads_before_a_relu_and_zero_pads_reach_the_convolution(pads) -> None:
    """A static-QDQ MobileNetV2 shows its quantization's clipping at 0 as a ReLU after the
    TF "same" Pad (and pads its 1x1 convolutions by zeros): the ReLU moves before the pad,
    a zero-width pad goes, and the pad folds into the depthwise convolution's padding, so
    no pad or layout transpose runs on TVM's default code between the layers."""
    c = 32
    rng = np.random.default_rng(6)
    w1 = (rng.standard_normal((c, 8, 1, 1)) * 0.5).astype("float32")
    w2 = rng.standard_normal((c, 1, 3, 3)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]),
             helper.make_node("Pad", ["a", "pads"], ["p"]),
             helper.make_node("Relu", ["p"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], group=c, strides=[2, 2])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(np.array(pads, np.int64), "pads")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 15, 15])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = RNG.standard_normal([1, 8, 15, 15]).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-4, atol=1e-4)
    data = compiled.report_data
    assert any(k.startswith("tpp.depthwise_conv2d") for k in data["lowered"]), data
    assert not [name for name in data["default_scheduled"] if "pad" in name], data


def test_broadcast_producers_are_computed_once_not_per_element() -> None:
    """Squeeze-excite's scale: sigmoid of one value per channel times every pixel. The
    Injective rule keeps the small sigmoid block apart instead of inlining its exp into the
    pixel loop."""
    from tvm import te, tirx

    from tpp_tvm.schedules.default import Injective

    x = te.placeholder((1, 14, 14, 64), name="x")
    s = te.placeholder((1, 64), name="s")
    gate = te.compute((1, 64), lambda n, c: tirx.sigmoid(s[n, c]), name="gate")
    y = te.compute(x.shape, lambda n, h, w, c: x[n, h, w, c] * gate[n, c], name="y")
    sch = Injective().apply(te.create_prim_func([x, s, y]), tpp_tvm.target(num_cores=1), False)
    assert sch is not None
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    assert names == {"gate", "y"}
    lib = tvm.compile(sch.mod, target=tpp_tvm.target(num_cores=1)).jit()
    xs = RNG.standard_normal((1, 14, 14, 64)).astype("float32")
    ss = RNG.standard_normal((1, 64)).astype("float32")
    out = tvm.runtime.tensor(np.zeros_like(xs))
    lib(tvm.runtime.tensor(xs), tvm.runtime.tensor(ss), out)
    np.testing.assert_allclose(out.numpy(), xs / (1 + np.exp(-ss))[:, None, None, :],
                               rtol=1e-5, atol=1e-6)


def test_ragged_transpose_is_vectorized_and_partitioned() -> None:
    """3199 x 512 (wav2vec2's first conv output to NCW) off TPP targets: the ragged last
    tile is split off by loop partitioning so whole tiles vectorize; the result is the
    exact transpose."""
    import numpy as np
    import tvm
    from tvm import te, tirx

    from tpp_tvm.schedules.default import Transpose
    from tpp_tvm.tir_pipeline import compile_kernels

    x = te.placeholder((211, 512), name="x")
    y = te.compute((512, 211), lambda i, j: x[j, i], name="y")
    tgt = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 1})
    sch = Transpose().apply(te.create_prim_func([x, y]), tgt, False)
    loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("y"))]
    assert loops[-1].kind == tirx.ForKind.VECTORIZED
    assert "pragma_loop_partition_hint" in loops[1].annotations
    lib = compile_kernels(sch.mod, tgt)
    a = np.random.default_rng(0).standard_normal((211, 512)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((512, 211), "float32"))
    lib["main"](tvm.runtime.tensor(a), out)
    np.testing.assert_array_equal(out.numpy(), a.T)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_resized_logits_back_to_nchw_build_with_int64_indices(mode: str) -> None:
    """A segmentation head's logits (DeepLabV3's, LR-ASPP's: 21 classes) resized to the
    image and transposed back to NCHW in one kernel. The resize's float-to-int64 source
    index keeps the loops int64 through ``NarrowDataType``, and TVM's ``LoopPartition``
    replaced the ragged width's one-tile tail loop by an int32 0: the build failed with
    "mismatched types int32 vs int64". Against ONNX Runtime."""
    c, size, out = 21, 9, 20  # 20 pixels a row: one whole 16-wide tile and a ragged one
    weight = RNG.standard_normal((c, 5, 1, 1)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w"], ["logits"]),
             helper.make_node("Resize", ["logits", "", "", "sizes"], ["y"], mode=mode,
                              coordinate_transformation_mode="half_pixel")]
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w"),
         numpy_helper.from_array(np.array([1, c, out, out], "int64"), "sizes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": RNG.standard_normal((1, 5, size, size)).astype("float32")}
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("before", [False, True], ids=["nhwc", "rows"])
def test_grouped_transpose_keeps_the_input_axes(before: bool) -> None:
    """A GroupNorm's NHWC input transposed to NCHW and grouped to (G, C/G * H * W) in one
    kernel (BiT-R50's, possibly after a (H * W, C) view): inlined into the reshapes, the
    merged output axis indexed the input's channel too and no rule matched (4.9 ms for
    56 x 56 x 256 on the default code); the reshapes inlined into the transpose keep one
    loop per input axis, so the channel is the tiled strided axis, the rest parallel and
    the output written in vectors. The result is exact."""
    import numpy as np
    from tvm import te, tirx, topi

    from tpp_tvm.schedules.default import Transpose
    from tpp_tvm.tir_pipeline import compile_kernels

    h, w, c, groups = 12, 20, 64, 8
    x = te.placeholder((h * w, c) if before else (1, h, w, c), name="x")
    nhwc = topi.reshape(x, (1, h, w, c)) if before else x
    y = topi.reshape(topi.reshape(topi.transpose(nhwc, (0, 3, 1, 2)),
                                  (1, groups, c // groups * h * w)),
                     (groups, c // groups * h * w))
    tgt = tpp_tvm.target(num_cores=1)
    sch = Transpose().apply(te.create_prim_func([x, y]), tgt, False)
    assert sch is not None
    (block,) = sch.get_child_blocks(sch.get_sblock("root"))
    kinds = [sch.get(lp).kind for lp in sch.get_loops(block)]
    assert kinds[0] == tirx.ForKind.PARALLEL and kinds[-1] == tirx.ForKind.VECTORIZED, kinds
    lib = compile_kernels(sch.mod, tgt)
    a = np.random.default_rng(0).standard_normal([int(d) for d in x.shape]).astype("float32")
    out = tvm.runtime.tensor(np.zeros((groups, c // groups * h * w), "float32"))
    lib["main"](tvm.runtime.tensor(a), out)
    want = a.reshape(1, h, w, c).transpose(0, 3, 1, 2).reshape(groups, -1)
    np.testing.assert_array_equal(out.numpy(), want)


def test_merged_innermost_axis_is_split_back() -> None:
    """NCHW to (1, H, W*C) (a stem's input transposed and reshaped in one kernel): the
    output's innermost axis merges W and C, read back as ``j // 3`` and ``j % 3``. The rule
    splits it into (W, C) so no read is a per-element gather; the result is exact."""
    from tvm import te, topi

    from tpp_tvm.schedules.default import Injective
    from tpp_tvm.tir_pipeline import compile_kernels

    x = te.placeholder((1, 3, 20, 20), name="x")
    y = topi.reshape(topi.transpose(x, (0, 2, 3, 1)), (1, 20, 60))
    tgt = tpp_tvm.target(num_cores=1)
    sch = Injective().apply(te.create_prim_func([x, y]), tgt, False)
    block = sch.get_child_blocks(sch.get_sblock("root"))[0]
    assert [int(sch.get(lp).extent) for lp in sch.get_loops(block)][-1] == 3
    lib = compile_kernels(sch.mod, tgt)
    a = RNG.standard_normal((1, 3, 20, 20)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((1, 20, 60), "float32"))
    lib["main"](tvm.runtime.tensor(a), out)
    np.testing.assert_array_equal(out.numpy(), a.transpose(0, 2, 3, 1).reshape(1, 20, 60))


def test_merged_axis_keeps_its_pixel_loop_for_llvm_to_vectorize() -> None:
    """A QDQ model's input, quantized, made NHWC and its 3 channels padded to 4 in one
    kernel: only the image rows run in parallel, the pixel loop stays whole around the
    4 channels (unrolled), so LLVM vectorizes across pixels (ResNet-50's 224 x 224 input:
    0.130 -> 0.029 ms with every pixel its own parallel iteration before); exact."""
    from tvm import te, tirx

    from tpp_tvm.schedules.default import Injective
    from tpp_tvm.tir_pipeline import compile_kernels

    h = 64
    x = te.placeholder((1, 3, h, h), name="x")

    def quantized(n, y, j):
        c, px = j % 4, j // 4
        v = tirx.round(x[n, tirx.min(c, 2), y, px] * tirx.const(20.0, "float32")) + 100.0
        v = tirx.Cast("uint8", tirx.max(tirx.min(v, 255.0), 0.0))
        return tirx.if_then_else(c < 3, v, tirx.const(0, "uint8"))

    out_t = te.compute((1, h, 4 * h), quantized, name="q")
    tgt = tpp_tvm.target(num_cores=2)
    sch = Injective().apply(te.create_prim_func([x, out_t]), tgt, False)
    block = sch.get_child_blocks(sch.get_sblock("root"))[0]
    loops = [sch.get(lp) for lp in sch.get_loops(block)]
    assert loops[0].kind == tvm.tirx.ForKind.PARALLEL and int(loops[0].extent) == h
    assert [int(lp.extent) for lp in loops[1:]] == [h, 4]
    assert all(lp.kind == tvm.tirx.ForKind.SERIAL for lp in loops[1:])
    lib = compile_kernels(sch.mod, tgt)
    a = RNG.standard_normal((1, 3, h, h)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((1, h, 4 * h), "uint8"))
    lib["main"](tvm.runtime.tensor(a), out)
    want = np.clip(np.rint(a * np.float32(20.0)) + 100, 0, 255).astype(np.uint8)
    want = np.pad(want.transpose(0, 2, 3, 1), ((0, 0), (0, 0), (0, 0), (0, 1)))
    np.testing.assert_array_equal(out.numpy(), want.reshape(1, h, 4 * h))


@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("up_bias", [False, True])
def test_swiglu_product_is_the_up_projections_epilogue(gate_first: bool, up_bias: bool) -> None:
    """silu(x Wg) * (x Wu [+ b]) at odd sizes (13 tokens, 67 hidden units): the product is
    the up projection's epilogue (a gate step), not a kernel of its own, in either order."""
    width, hidden = 48, 67
    inits = {"wg": (RNG.standard_normal((width, hidden)) * 0.2).astype("float32"),
             "wu": (RNG.standard_normal((width, hidden)) * 0.2).astype("float32"),
             "wd": (RNG.standard_normal((hidden, width)) * 0.2).astype("float32"),
             "bu": RNG.standard_normal(hidden).astype("float32")}
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]),
             helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["act"]),
             helper.make_node("MatMul", ["x", "wu"], ["u0"])]
    if up_bias:
        nodes.append(helper.make_node("Add", ["u0", "bu"], ["u"]))
    up = "u" if up_bias else "u0"
    nodes += [helper.make_node("Mul", ["act", up] if gate_first else [up, "act"], ["h"]),
              helper.make_node("MatMul", ["h", "wd"], ["y"])]
    graph = helper.make_graph(
        nodes, "swiglu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 13, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = _check(model, [1, 13, width])
    assert ("tpp.dense_bias_gate: 1" if up_bias else "tpp.dense_gate: 1") in report, report
    assert "tpp.dense_silu: 1" in report, report
    assert "default schedules" not in report, report


@pytest.mark.parametrize("c,oc,shape,kernel,stride,pads,groups", [
    (3, 16, (4, 32, 32), (2, 16, 16), (2, 16, 16), (0,) * 6, 1),  # VideoMAE's tubelets
    (4, 8, (5, 9, 11), (3, 3, 3), (1, 1, 1), (1,) * 6, 1),        # a C3D/I3D layer
    (6, 6, (7, 8, 8), (3, 1, 1), (2, 1, 1), (1, 0, 0, 0, 0, 0), 3),  # grouped, strided in time
])
def test_conv3d_runs_as_a_conv2d_over_frames(c, oc, shape, kernel, stride, pads, groups
                                             ) -> None:
    w = (RNG.standard_normal((oc, c // groups, *kernel)) * 0.1).astype("float32")
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=list(stride), pads=list(pads),
                            group=groups)
    report = _check(_model(node, [1, c, *shape], w), [1, c, *shape])
    assert "conv3d" not in report and ("tpp.conv2d" in report or "tpp.dense" in report)


@pytest.mark.parametrize("window,stride,pads,include_pad", [
    (3, 1, 1, 0),  # PoolFormer's token mixer
    (3, 1, 1, 1),
    (3, 2, 1, 0),  # Inception-style, strided
    (2, 2, 0, 0),  # DenseNet's transitions
])
def test_average_pooling_runs_as_a_depthwise_convolution(window, stride, pads, include_pad
                                                         ) -> None:
    shape = [1, 12, 11, 9]
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[window, window],
                            strides=[stride, stride], pads=[pads] * 4,
                            count_include_pad=include_pad)
    report = _check(_model(node, shape), shape)
    assert "tpp.depthwise_conv2d" in report and "avg_pool" not in report, report


@pytest.mark.parametrize("equation,a_shape,b_shape", [
    ("bhlk,bhtk->bhlt", (1, 3, 5, 8), (1, 3, 7, 8)),   # CvT's scores
    ("bhlt,bhtv->bhlv", (1, 3, 5, 7), (1, 3, 7, 4)),   # and values
    ("ij,jk->ik", (5, 6), (6, 3)),
    ("bij,bkj->bki", (2, 5, 6), (2, 3, 6)),           # output transposed
    ("nchw,oc->nohw", (1, 6, 3, 5), (4, 6)),          # a 1x1 convolution
    ("bi,bi->b", (3, 9), (3, 9)),                     # row-wise dot products
    ("i,j->ij", (4,), (5,)),                          # outer product
])
def test_einsum_runs_as_a_matmul(equation, a_shape, b_shape) -> None:
    node = helper.make_node("Einsum", ["x", "w"], ["y"], equation=equation)
    w = RNG.standard_normal(b_shape).astype("float32")
    report = _check(_model(node, list(a_shape), w), list(a_shape))
    assert "einsum" not in report, report


@pytest.mark.parametrize("widths", [(48, 48), (24, 40, 8), (16, 32, 64, 16)])
def test_channel_concats_are_partitioned_at_their_seams(widths: tuple[int, ...]) -> None:
    """A concatenation along the channels (and the batch norm fused onto it: DenseNet,
    MixNet) runs as one loop a source: no select between the inputs is left in the built
    code, whole-vector seams vectorize, others go to LLVM; the result is exact."""
    from tvm import te, topi

    from tpp_tvm.schedules.default import Injective

    inputs = [te.placeholder((1, 5, 7, w), name=f"x{i}") for i, w in enumerate(widths)]
    scale = te.placeholder((sum(widths),), name="scale")
    cat = topi.concatenate(inputs, axis=3)
    y = te.compute(cat.shape, lambda n, h, w, c: cat[n, h, w, c] * scale[c], name="y")
    func = te.create_prim_func([*inputs, scale, y])
    tgt = tpp_tvm.target(num_cores=1)
    sch = Injective().apply(func, tgt, False)
    assert sch is not None
    lowered = tvm.tirx.transform.StmtSimplify()(
        tvm.s_tir.transform.LowerOpaqueBlock()(
            tvm.s_tir.transform.ConvertBlocksToOpaque()(sch.mod)))
    assert "if_then_else" not in lowered.script(), lowered.script()
    if all(w % 16 == 0 for w in widths):
        assert "T.vectorized" in sch.mod.script()
    lib = tvm.compile(sch.mod, target=tgt).jit()
    xs = [RNG.standard_normal((1, 5, 7, w)).astype("float32") for w in widths]
    ss = RNG.standard_normal(sum(widths)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((1, 5, 7, sum(widths)), "float32"))
    lib(*[tvm.runtime.tensor(a) for a in (*xs, ss)], out)
    np.testing.assert_array_equal(out.numpy(), np.concatenate(xs, axis=3) * ss)


@pytest.mark.requires_onnxruntime
def test_batch_norm_after_a_concat_is_one_product_and_sum() -> None:
    """MixNet's block: two depthwise convolutions, concatenated, then a batch norm the
    exporter could not fold: x * scale + shift (no division), against ORT."""
    import checks
    from onnx import helper

    c = 24
    consts = {"w1": RNG.standard_normal((c, 1, 3, 3)), "w2": RNG.standard_normal((c, 1, 5, 5)),
              "s": RNG.random(2 * c) + 0.5, "b": RNG.standard_normal(2 * c),
              "m": RNG.standard_normal(2 * c), "v": RNG.random(2 * c) + 0.5}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], group=c, pads=[1] * 4),
             helper.make_node("Conv", ["x", "w2"], ["b2"], group=c, pads=[2] * 4),
             helper.make_node("Concat", ["a", "b2"], ["cat"], axis=1),
             helper.make_node("BatchNormalization", ["cat", "s", "b", "m", "v"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["y"])]
    model = checks.onnx_model(nodes, {"x": [1, c, 15, 15]}, consts)
    feeds = {"x": RNG.standard_normal((1, c, 15, 15)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    rest = compiled.report_data.get("default_scheduled", [])
    assert rest and not [k for k in rest if "divide" in k or "subtract" in k], rest


def test_reductions_over_outer_axes_keep_the_channels_as_lanes() -> None:
    """ConvNeXt-V2's response norm: the sum of x² over H and W per channel of NHWC data is
    scheduled (channel vectors in parallel, x² inlined, no full-size intermediate); the
    mean over those sums then scales every pixel in one vectorized pass; both exact."""
    from tvm import te

    from tpp_tvm.schedules.default import BroadcastReduction, ColumnReduction

    tgt = tpp_tvm.target(num_cores=1)
    x = te.placeholder((1, 12, 10, 48), name="x")
    sq = te.compute(x.shape, lambda n, h, w, c: x[n, h, w, c] * x[n, h, w, c], name="sq")
    kh, kw = te.reduce_axis((0, 12)), te.reduce_axis((0, 10))
    g = te.compute((1, 1, 1, 48), lambda n, a, b, c: te.sum(sq[n, kh, kw, c], axis=[kh, kw]),
                   name="g")
    sch = ColumnReduction().apply(te.create_prim_func([x, g]), tgt, False)
    assert sch is not None and "T.vectorized" in sch.mod.script()
    assert "sq" not in {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    xs = RNG.standard_normal((1, 12, 10, 48)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((1, 1, 1, 48), "float32"))
    tvm.compile(sch.mod, target=tgt).jit()(tvm.runtime.tensor(xs), out)
    np.testing.assert_allclose(out.numpy(), (xs.astype("float64") ** 2).sum((1, 2), keepdims=True),
                               rtol=1e-5)

    gs = te.placeholder((1, 1, 1, 48), name="gs")
    k = te.reduce_axis((0, 48))
    total = te.compute((1, 1, 1, 1), lambda n, a, b, c: te.sum(gs[n, a, b, k], axis=k), name="t")
    nx = te.compute((1, 1, 1, 48), lambda n, a, b, c: gs[n, a, b, c] / (total[n, a, b, 0] + 1.0),
                    name="nx")
    y = te.compute(x.shape, lambda n, h, w, c: x[n, h, w, c] * nx[0, 0, 0, c] + x[n, h, w, c],
                   name="y")
    sch = BroadcastReduction().apply(te.create_prim_func([x, gs, y]), tgt, False)
    assert sch is not None
    blocks = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    assert blocks == ["t", "nx", "y"] and "T.parallel" in sch.mod.script(), blocks
    gv = RNG.random((1, 1, 1, 48)).astype("float32")
    out = tvm.runtime.tensor(np.zeros_like(xs))
    tvm.compile(sch.mod, target=tgt).jit()(tvm.runtime.tensor(xs), tvm.runtime.tensor(gv), out)
    want = xs * (gv / (gv.sum() + 1.0)) + xs
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("stride", [1, 2])
def test_a_depthwise_1x1_convolution_is_a_channel_scale(stride: int) -> None:
    """MobileOne's and FastViT's scale branch (a depthwise convolution by a 1x1 filter) is
    a per-channel product, strided first: no convolution left on TVM's code, against ORT."""
    import checks
    from onnx import helper

    c = 20
    consts = {"w": RNG.standard_normal((c, 1, 1, 1)), "b": RNG.standard_normal(c)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["s"], group=c, strides=[stride] * 2),
             helper.make_node("Relu", ["s"], ["y"])]
    model = checks.onnx_model(nodes, {"x": [1, c, 9, 9]}, consts)
    feeds = {"x": RNG.standard_normal((1, c, 9, 9)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    assert not [k for k in compiled.report_data["default_scheduled"] if "conv" in k]


@pytest.mark.parametrize("form", ["c < 48", "c <= 47", "c > 47", "c >= 48", "48 <= c",
                                  "47 < c", "48 > c", "47 >= c"])
def test_concat_seams_are_found_in_every_comparison_form(form: str) -> None:
    from tvm import tirx

    from tpp_tvm.schedules.default import _concat_boundaries

    c = tirx.Var("c", "int64")
    cond = eval(form, {"c": c})  # the literal becomes an IntImm of c's type
    body = tirx.Evaluate(tirx.Select(cond, tirx.const(1.0), tirx.const(0.0)))
    assert _concat_boundaries(type("Block", (), {"body": body}), c, 96) == [48]


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize(("dilation", "pads", "group", "stride"), [
    (2, 2, 1, 1), (4, 4, 1, 1), (2, 1, 1, 1), (3, 3, 16, 1),
    (2, 2, 1, 2), (4, 4, 1, 2), (2, 2, 1, 4),  # SKNet's stride 2 with dilation 2
    (12, 12, 1, 1), (8, 8, 1, 1),  # DeepLab's ASPP: outer taps only read padding
    (5, 5, 1, 1), (6, 6, 1, 1)])  # phases of 4-5 pixels: one 1x1 a tap, over its live window
def test_a_dilated_convolution_runs_undilated_over_its_phases(dilation: int, pads: int,
                                                               group: int, stride: int) -> None:
    """FCN's and DeepLab's atrous 3x3 convolutions (and a dilated grouped one): the phases
    of the padded input as a batch of undilated convolutions on the TPP kernels, the
    outputs interleaved back, or, where the phases are a few pixels, one 1x1 convolution a
    tap; against ORT; no convolution left on TVM's code."""
    import checks
    from onnx import helper

    c = 16
    consts = {"w": RNG.standard_normal((c, c // group, 3, 3)), "b": RNG.standard_normal(c)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], dilations=[dilation] * 2,
                              pads=[pads] * 4, group=group, strides=[stride] * 2),
             helper.make_node("Relu", ["h"], ["y"])]
    model = checks.onnx_model(nodes, {"x": [1, c, 13, 11]}, consts)
    feeds = {"x": RNG.standard_normal((1, c, 13, 11)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    lowered = compiled.report_data["lowered"]
    assert not [k for k in compiled.report_data["default_scheduled"] if "conv" in k]
    # one batched convolution over the phases, or one 1x1 a live tap where phases are tiny
    assert 1 <= sum(n for k, n in lowered.items() if "conv2d" in k) <= 9, lowered


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("axis", [1, 2, -2])
def test_a_softmax_over_another_axis_runs_on_the_softmax_tpp(axis: int) -> None:
    """CoaT's factorized attention normalizes the keys over the tokens (axis -2): the
    row-wise softmax TPP between two transposes, against ORT."""
    import checks
    from onnx import helper

    model = checks.onnx_model([helper.make_node("Softmax", ["x"], ["y"], axis=axis)],
                              {"x": [2, 24, 49, 32]})
    feeds = {"x": RNG.standard_normal((2, 24, 49, 32)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-6)
    assert compiled.report_data["lowered"].get("tpp.softmax") == 1
    assert not [k for k in compiled.report_data["default_scheduled"] if "softmax" in k]


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize(("size", "out", "mode", "separable"), [
    ((7, 9), (56, 72), "half_pixel", True),  # a segmentation head's 8x upsampling
    ((7, 9), (21, 20), "align_corners", True),
    ((5, 5), (17, 13), "asymmetric", True),
    ((6, 6), (24, 1), "pytorch_half_pixel", True),  # one output column reads position 0
    ((4, 80), (8, 160), "half_pixel", False),  # rows too wide for the W pass's GEMM
    ((16, 8), (8, 32), "half_pixel", False)])  # the H pass first is smaller: TVM's resize
def test_a_bilinear_upsampling_runs_one_axis_at_a_time(size, out, mode, separable) -> None:
    """A bilinear resize after a convolution (DeepLabV3's logits): the W pass a GEMM by the
    interpolation matrix, the H pass rows gathered by constant indices and weighted, fused
    into one kernel (``take`` counts as injective); against ORT in every coordinate mode."""
    from onnx import helper, numpy_helper

    c = 5
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"]),
             helper.make_node("Resize", ["h", "", "", "sizes"], ["y"], mode="linear",
                              coordinate_transformation_mode=mode)]
    model = checks.onnx_model(nodes, {"x": [1, 8, *size]},
                              {"w": RNG.standard_normal((c, 8, 1, 1))})
    model.graph.initializer.append(
        numpy_helper.from_array(np.array([1, c, *out], "int64"), "sizes"))
    feeds = {"x": RNG.standard_normal((1, 8, *size)).astype("float32")}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    default = compiled.report_data["default_scheduled"]
    assert any("resize" in k for k in default) != separable, default
    if separable:
        assert compiled.report_data["lowered"].get("tpp.dense") == 1, compiled.report_data
        assert [k for k in default if "take" in k] == [
            k for k in default if "take" in k and "multiply" in k], default
