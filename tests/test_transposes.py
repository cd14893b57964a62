"""Transpose sinking: NHWC kernels' transposes move through layout-agnostic ops and cancel,
values unchanged; a transpose that would have to be added stays where it is."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tpp_tvm.relay_passes.transposes import TO_NCHW, TO_NHWC, sink_transposes

NHWC = (1, 6, 5, 8)


def _ops(func: relax.Function) -> list[str]:
    return [b.value.op.name for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _run(mod: tvm.IRModule, *args: np.ndarray) -> np.ndarray:
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _check(build, *args: np.ndarray, rewrite=sink_transposes, tol: float = 1e-6
           ) -> relax.Function:
    """Build ``main`` with ``build(bb, params)``, apply ``rewrite``, and compare the two
    numerically."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(a.shape, str(a.dtype)))
              for i, a in enumerate(args)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(bb, *params))
        bb.emit_func_output(out)
    mod = bb.get()
    new = relax.transform.DeadCodeElimination()(
        tvm.IRModule({"main": rewrite(mod["main"])}))
    np.testing.assert_allclose(_run(new, *args), _run(mod, *args), rtol=tol, atol=tol)
    return new["main"]


def test_a_qdq_resnet_step_runs_without_transposes() -> None:
    """kernel out (NHWC) -> NCHW -> +residual -> ReLU -> max pool -> clip -> quantize ->
    NHWC."""
    rng = np.random.default_rng(0)
    y, res = (rng.standard_normal(NHWC).astype("float32") for _ in range(2))

    def build(bb, y, res):
        a = bb.emit(relax.op.permute_dims(y, TO_NCHW))
        b = bb.emit(relax.op.permute_dims(res, TO_NCHW))
        s = bb.emit(relax.op.nn.relu(relax.op.add(a, b)))
        p = bb.emit(relax.op.clip(relax.op.nn.max_pool2d(s, [2, 2], [2, 2]), 0.0, 6.0))
        q = bb.emit(relax.op.quantize(p, relax.const(0.05, "float32"),
                                      relax.const(3, "uint8"), axis=1, out_dtype="uint8"))
        return relax.op.permute_dims(q, TO_NHWC)

    func = _check(build, y, res)
    assert "relax.permute_dims" not in _ops(func), func


def test_full_reductions_and_a_keepdims_mean_follow() -> None:
    x = np.random.default_rng(1).standard_normal(NHWC).astype("float32")

    def build(bb, x):
        t = bb.emit(relax.op.permute_dims(x, TO_NCHW))
        lo = bb.emit(relax.op.min(t))
        m = bb.emit(relax.op.mean(t, axis=[2, 3], keepdims=True))
        return relax.op.subtract(m, lo)

    func = _check(build, x)
    # only the (1, C, 1, 1) result is transposed back, not the input
    assert _ops(func).count("relax.permute_dims") == 1


def test_a_transpose_is_never_added() -> None:
    """add(permute(a), b) with b a full-size variable: moving would need b transposed."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal(NHWC).astype("float32")
    b = rng.standard_normal((1, 8, 6, 5)).astype("float32")

    def build(bb, a, b):
        return relax.op.add(bb.emit(relax.op.permute_dims(a, TO_NCHW)), b)

    assert _ops(_check(build, a, b)) == ["relax.permute_dims", "relax.add"]




def _convnext_block() -> tuple:
    """ONNX: a stem convolution (NCHW), then a ConvNeXt block: depthwise 7x7, to NHWC,
    LayerNorm, MatMul + bias + ReLU, MatMul + bias, layer scale, back to NCHW, residual."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    c, hidden = 16, 48
    consts = {"w0": rng.standard_normal((c, 8, 1, 1)) * 0.3, "b0": rng.standard_normal(c),
              "wd": rng.standard_normal((c, 1, 7, 7)) * 0.2, "bd": rng.standard_normal(c),
              "g": rng.uniform(0.5, 1.5, c), "beta": rng.standard_normal(c) * 0.1,
              "w1": rng.standard_normal((c, hidden)) * 0.3, "b1": rng.standard_normal(hidden),
              "w2": rng.standard_normal((hidden, c)) * 0.3, "b2": rng.standard_normal(c),
              "gamma": rng.uniform(0.1, 1.0, c)}
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["s"]),
             helper.make_node("Conv", ["s", "wd", "bd"], ["d"], group=c, pads=[3] * 4),
             helper.make_node("Transpose", ["d"], ["dt"], perm=[0, 2, 3, 1]),
             helper.make_node("LayerNormalization", ["dt", "g", "beta"], ["ln"], axis=-1),
             helper.make_node("MatMul", ["ln", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["ha"]),
             helper.make_node("MatMul", ["ha", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["ob"]),
             helper.make_node("Mul", ["gamma", "ob"], ["os"]),
             helper.make_node("Transpose", ["os"], ["ot"], perm=[0, 3, 1, 2]),
             helper.make_node("Add", ["s", "ot"], ["y"])]
    graph = helper.make_graph(
        nodes, "convnext", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v, "float32"), k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": rng.standard_normal((1, 8, 9, 9)).astype("float32")}


def test_a_convnext_block_runs_nhwc_with_its_layer_scale_folded() -> None:
    """An fp32 NCHW graph: the residual add between the block's transposes runs NHWC (the
    transposes cancel), and the layer scale folds into the second GEMM, so the add joins
    its epilogue; only the graph's edge transposes are left to TVM. Against ORT."""
    import checks
    import pytest

    pytest.importorskip("onnxruntime")
    model, feeds = _convnext_block()
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    report = compiled.report_data
    assert "tpp.dense_bias_residual" in report["lowered"], report["lowered"]
    assert "tpp.eltwise_add" not in report["lowered"], report["lowered"]
    rest = report.get("default_scheduled", [])
    assert all("multiply" not in name and "add" not in name for name in rest), rest
    assert len(rest) <= 2, rest  # NCHW -> NHWC at the input, back at the output


def _views(build, *args: np.ndarray) -> relax.Function:
    """``drop_identity_views`` on what ``build`` makes, exactly the same values."""
    from tpp_tvm.relay_passes.transposes import drop_identity_views

    return _check(build, *args, rewrite=drop_identity_views, tol=0.0)


def test_view_chains_that_keep_the_element_order_are_dropped() -> None:
    """wav2vec2's 1-D convolutions: squeeze, expand_dims and a unit-dim transpose back to the
    convolution's shape are nothing; its positional conv's input (two transposes around an
    expand_dims) is a reshape."""
    rng = np.random.default_rng(3)
    y = rng.standard_normal((1, 1, 7, 8)).astype("float32")

    def unit_dims(bb, y):
        a = bb.emit(relax.op.squeeze(relax.op.nn.relu(y), axis=[1]))
        b = bb.emit(relax.op.expand_dims(a, axis=[2]))
        return relax.op.nn.relu(relax.op.permute_dims(b, [0, 2, 1, 3]))

    assert _ops(_views(unit_dims, y)) == ["relax.nn.relu", "relax.nn.relu"]
    identity = _views(lambda bb, y: relax.op.nn.relu(relax.op.permute_dims(y, [0, 1, 2, 3])), y)
    assert "relax.permute_dims" not in _ops(identity), identity
    x = rng.standard_normal((1, 5, 8)).astype("float32")

    def two_transposes(bb, x):
        a = bb.emit(relax.op.permute_dims(relax.op.nn.relu(x), [0, 2, 1]))
        b = bb.emit(relax.op.expand_dims(a, axis=[2]))
        return relax.op.permute_dims(b, TO_NHWC)

    assert _ops(_views(two_transposes, x)) == ["relax.nn.relu", "relax.reshape"]

    def a_real_transpose(bb, x):
        a = bb.emit(relax.op.expand_dims(relax.op.nn.relu(x), axis=[2]))
        return relax.op.permute_dims(a, TO_NCHW)

    assert "relax.permute_dims" in _ops(_views(a_real_transpose, x))
