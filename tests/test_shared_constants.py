"""Builds of one model share their identical constants (a dynamic model's sizes, a decoder's
prompt and step builds), so weights are held once however many sizes are compiled."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from tvm import relax

import tpp_tvm
from tpp_tvm.relay_passes.shared_constants import MIN_SHARED_BYTES, SharedConstants


def _module(weight: np.ndarray, small: np.ndarray) -> relax.Function:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(weight.shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, relax.const(weight)))
            z = bb.emit(relax.op.multiply(y, relax.const(small)))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    return bb.get()


def _constants(mod) -> list:
    binds = mod["main"].body.blocks[0].bindings
    return [b.value.args[1] for b in binds[:2]]


def test_equal_constants_become_one_tensor() -> None:
    pool = SharedConstants()
    weight = np.arange(128 * 256, dtype=np.float32).reshape(128, 256)
    small = np.ones((1, 256), np.float32)
    first = pool.share(_module(weight, small))
    second = pool.share(_module(weight.copy(), small))
    (w1, s1), (w2, s2) = _constants(first), _constants(second)
    assert w1.value.same_as(w2.value)  # content, not identity, decides
    assert not s1.value.same_as(s2.value)  # under MIN_SHARED_BYTES: left alone
    assert len(pool) == 1 and pool.nbytes == weight.nbytes >= MIN_SHARED_BYTES
    third = pool.share(_module(weight + 1, small))
    assert not _constants(third)[0].value.same_as(w1.value) and len(pool) == 2


def test_dynamic_model_sizes_share_their_weights() -> None:
    """Two sizes of a dynamic MatMul: the second build adds nothing to the pool, and both
    give numpy's result."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((256, 128)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128])],
        [onnx.numpy_helper.from_array(weight, "w")])
    model = tpp_tvm.compile_onnx(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17)]))
    pool = model._compile_static.keywords["constants"]
    for rows in (3, 5):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        np.testing.assert_allclose(model(x)[0], x @ weight, rtol=1e-4, atol=1e-4)
        if rows == 3:
            pooled = (len(pool), pool.nbytes)
    assert (len(pool), pool.nbytes) == pooled and pooled[1] >= weight.nbytes
