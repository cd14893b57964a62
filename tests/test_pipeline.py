"""Tests of the ``tpp`` pipeline's guards around TVM passes (relay_passes/pipeline.py).

Each case is an ONNX node test that TVM's default build runs and the pipeline once failed
on with an ``InternalError`` from a TVM pass that only the pipeline runs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import tpp_tvm
from tpp_tvm.onnxruntime_ref import run_onnxruntime


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _vi(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def test_slice_with_runtime_bounds_of_a_static_tensor() -> None:
    """FoldConstant emitted a call_tir of a shape_func it never added ("There is no
    definition of shape_func"); the pipeline keeps the unfolded module then."""
    model = _model([helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])],
                   [_vi("x", TensorProto.FLOAT, [6, 5]), _vi("starts", TensorProto.INT64, [1]),
                    _vi("ends", TensorProto.INT64, [1]), _vi("axes", TensorProto.INT64, [1])],
                   [_vi("y", TensorProto.FLOAT, None)])
    feeds = {"x": np.arange(30, dtype=np.float32).reshape(6, 5),
             "starts": np.array([1]), "ends": np.array([4]), "axes": np.array([0])}
    got = tpp_tvm.compile_onnx(model)(**feeds)
    np.testing.assert_array_equal(got[0], run_onnxruntime(model, feeds)[0])


def test_tuple_valued_op_next_to_a_conv() -> None:
    """TVM's ConvertLayout rejects Unique's tuple ("Cannot convert when exactly one of the
    layouts is unknown"), with or without a convolution: the convolution stays NCHW on
    TVM's path and the report says why."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(
        (4, 3, 3, 3)).astype(np.float32), "w")
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                    helper.make_node("Unique", ["u"], ["v", "i", "inv", "n"], sorted=1)],
                   [_vi("x", TensorProto.FLOAT, [1, 3, 6, 6]), _vi("u", TensorProto.FLOAT, [7])],
                   [_vi(n, t, None) for n, t in (("c", TensorProto.FLOAT),
                                                 ("v", TensorProto.FLOAT),
                                                 ("i", TensorProto.INT64),
                                                 ("inv", TensorProto.INT64),
                                                 ("n", TensorProto.INT64))], [w])
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32),
             "u": np.array([2, 1, 1, 3, 4, 3, 0], np.float32)}
    compiled = tpp_tvm.compile_onnx(model)
    for got, want in zip(compiled(**feeds), run_onnxruntime(model, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert "NHWC layout conversion" in compiled.report()


def test_weight_minus_a_scalar_zero_point_is_a_constant() -> None:
    """TVM's FoldConstant leaves every 0-d op, so ``W - int32(zp)`` (MatMulInteger's weight
    zero point) stayed a run-time subtraction and the matmul had no constant weight to
    pack; the pipeline evaluates the scalar cast and the weight folds."""
    from tvm import relax

    from tpp_tvm.relay_passes.pipeline import fold_constants

    w = np.arange(12, dtype=np.int8).reshape(3, 4)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            zp = bb.emit(relax.op.astype(relax.const(np.int8(2)), "int32"))
            wz = bb.emit(relax.op.subtract(relax.op.astype(relax.const(w), "int32"), zp))
            half = bb.emit(relax.op.multiply(relax.const(np.float32(0.5)),
                                             relax.const(np.float32(3.0))))
            wf = bb.emit(relax.op.multiply(relax.op.astype(wz, "float32"), half))
            out = bb.emit_output(relax.op.matmul(x, wf))
        bb.emit_func_output(out)
    main = fold_constants()(bb.get())["main"]
    ops = [b.value.op.name for b in main.body.blocks[0].bindings
           if isinstance(b.value, relax.Call)]
    assert ops == ["relax.matmul"], main
    weight = main.body.blocks[0].bindings[-1].value.args[1].value.numpy()
    np.testing.assert_array_equal(weight, (w.astype(np.float32) - 2) * 1.5)
