"""Row-wise equation kernels (layer norm, RMS norm, softmax) against numpy, at any row count: one,
primes (ViT's 197 tokens) and counts with divisors."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tpp_tvm.schedules.rowwise import (
    layer_norm_schedule,
    padded_rows,
    rms_norm_schedule,
    row_block,
    softmax_schedule,
)
from tpp_tvm.target import isa_of, target

TARGET = target(num_cores=1)
ROWS = [1, 7, 16, 49, 197]


def _run(sch, *arrays):
    lib = tvm.compile(sch.mod, target=TARGET).jit()
    args = [tvm.runtime.tensor(a) for a in arrays]
    lib(*args)
    return args[-1].numpy()


@pytest.mark.parametrize("rows", ROWS)
def test_layer_norm_any_row_count(rows: int) -> None:
    width = 96
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, width)).astype("float32")
    gamma, beta = rng.standard_normal((2, width)).astype("float32")
    got = _run(layer_norm_schedule(rows, width, 1e-5, isa_of(TARGET)), x, gamma, beta,
               np.zeros_like(x))
    mean = x.mean(-1, keepdims=True)
    want = (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * gamma + beta
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_any_row_count(rows: int) -> None:
    width = 96
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, width)).astype("float32")
    gamma = rng.standard_normal(width).astype("float32")
    got = _run(rms_norm_schedule(rows, width, 1e-6, isa_of(TARGET)), x, gamma,
               np.zeros_like(x))
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * gamma
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", ROWS)
def test_softmax_any_row_count(rows: int) -> None:
    width = 77
    x = np.random.default_rng(rows).standard_normal((rows, width)).astype("float32")
    got = _run(softmax_schedule(rows, width, isa_of(TARGET)), x, np.zeros_like(x))
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_row_block_divides_and_falls_back_to_one_row() -> None:
    assert row_block(64, 768) == 8 and row_block(49, 64) == 7
    assert row_block(197, 768) == 1 and row_block(1, 16) == 1
    assert all(rows % row_block(rows, 384) == 0 for rows in range(1, 300))


def test_padded_rows_only_where_no_block_divides() -> None:
    assert padded_rows(196, 768) == 196 and padded_rows(1, 768) == 1
    assert padded_rows(197, 768) > 197 and row_block(padded_rows(197, 768), 768) > 1
    assert padded_rows(49, 4096) > 49 and row_block(padded_rows(49, 4096), 4096) > 1


def _norm_then_softmax(width: int, seed: int, tail: list, rtol: float, atol: float) -> str:
    """LayerNorm then Softmax over 197 tokens of ``width`` channels (then the ``tail``
    nodes, ending in ``y``), checked against ONNX Runtime; the compiled model's report."""
    import checks
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    shape = [1, 197, width]
    g, b = (numpy_helper.from_array(rng.standard_normal(width).astype("float32"), n)
            for n in ("g", "b"))
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1),
             helper.make_node("Softmax", ["ln"], ["sm" if tail else "y"], axis=-1), *tail]
    graph = helper.make_graph(
        nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], [g, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    feeds = {"x": rng.standard_normal(shape).astype("float32")}
    report = checks.assert_runs_like_onnxruntime(model, feeds, rtol=rtol, atol=atol).report()
    assert "tpp.layer_norm" in report and "tpp.softmax" in report, report
    return report


def test_norms_pad_prime_row_counts_inside_the_kernel() -> None:
    """ViT's 197 tokens: the layer norm and softmax kernels take and give the 197 rows and
    pad their last row block themselves, so no pad or slice kernel surrounds them."""
    report = _norm_then_softmax(768, 4, [], rtol=1e-4, atol=1e-6)
    assert "pad" not in report and "strided_slice" not in report, report


def test_prime_row_counts_run_padded_in_a_model() -> None:
    """ViT's 197 tokens: layer norm, softmax and an element-wise GELU + residual (padded by
    the graph: zero rows whose outputs are dropped) run on TPPs; results match ONNX
    Runtime."""
    from onnx import helper

    tail = [helper.make_node("Add", ["sm", "x"], ["s"]),
            helper.make_node("Gelu", ["s"], ["y"], domain="")]
    report = _norm_then_softmax(64, 3, tail, rtol=1e-4, atol=1e-5)
    assert "tpp.eltwise_add_gelu" in report, report
