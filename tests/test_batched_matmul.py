"""torch's flattened batched matmuls back to the matmul of their operands."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm_ffi import structural_equal

from tpp_tvm.relay_passes.batched_matmul import UnflattenBatchedMatmuls
from tpp_tvm.relay_passes.canonicalize import drop_zero_adds


def _module(a_shape, b_shape, flat_a, flat_b, out_shape, broadcast=True):
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            x = bb.emit(relax.op.broadcast_to(a, a_shape)) if broadcast else a
            y = bb.emit(relax.op.broadcast_to(b, b_shape)) if broadcast else b
            mm = bb.emit(relax.op.matmul(bb.emit(relax.op.reshape(x, flat_a)),
                                         bb.emit(relax.op.reshape(y, flat_b))))
            out = bb.emit_output(relax.op.reshape(mm, out_shape))
        bb.emit_func_output(out)
    return bb.get()


def _expected(a_shape, b_shape):
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(a, b))
        bb.emit_func_output(out)
    return bb.get()


def test_views_around_a_bmm_become_the_4d_matmul() -> None:
    mod = _module((2, 3, 5, 4), (2, 3, 4, 7), (6, 5, 4), (6, 4, 7), (2, 3, 5, 7))
    got = relax.transform.DeadCodeElimination()(UnflattenBatchedMatmuls(mod))
    assert structural_equal(got["main"].body.blocks[0].bindings[-1].value,
                            _expected((2, 3, 5, 4), (2, 3, 4, 7))["main"].body.blocks[0]
                            .bindings[-1].value, map_free_vars=True)


def test_reshapes_that_mix_rows_into_the_batch_stay() -> None:
    # (2, 3, 5, 4) viewed as (2, 15, 4): rows merged into the batch, not a batched matmul.
    mod = _module((2, 3, 5, 4), (2, 4, 7), (2, 15, 4), (2, 4, 7), (2, 3, 5, 7), broadcast=False)
    got = UnflattenBatchedMatmuls(mod)
    assert any(getattr(b.value.op, "name", "") == "relax.reshape"
               for b in got["main"].body.blocks[0].bindings[:1])


def test_adding_zeros_is_dropped_only_where_it_widens_nothing() -> None:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 3, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            same = bb.emit(relax.op.add(x, relax.const(np.zeros((1, 1, 3, 3), "float32"))))
            wider = bb.emit(relax.op.add(same, relax.const(np.zeros((2, 1, 1, 1), "float32"))))
            bias = bb.emit(relax.op.add(wider, relax.const(np.zeros((3,), "float32"))))
            out = bb.emit_output(relax.op.add(bias, relax.const(np.ones((3,), "float32"))))
        bb.emit_func_output(out)
    func = drop_zero_adds(bb.get()["main"])
    adds = [b for b in func.body.blocks[0].bindings
            if getattr(b.value, "op", None) == tvm.ir.Op.get("relax.add")]
    # the zeros that widen (1, ...) to (2, ...), a zero bias vector and the ones stay
    assert len(adds) == 3


def test_a_weight_broadcast_over_the_batch_is_the_weight() -> None:
    """A ``Linear`` of a strided input: torch expands the (k, n) weight to (1, k, n) and
    runs ``bmm``; the matmul takes the weight itself (a constant the dense patterns see)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 6, 4), "float32"))
    w = relax.const(np.ones((4, 5), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.broadcast_to(w, (1, 4, 5)))
            out = bb.emit_output(relax.op.matmul(x, wide))
        bb.emit_func_output(out)
    got = relax.transform.DeadCodeElimination()(UnflattenBatchedMatmuls(bb.get()))
    ops = [b.value.op.name for b in got["main"].body.blocks[0].bindings]
    assert ops == ["relax.matmul"]
    assert isinstance(got["main"].body.blocks[0].bindings[0].value.args[1], tvm.ir.Constant)
