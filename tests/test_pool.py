"""Pooling kernels on TPPs against numpy: max pooling windows, padding, global average."""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm

from tpp_tvm.errors import UnsupportedShapeError
from tpp_tvm.schedules.pool import PoolShape, global_avg_pool_schedule, max_pool_schedule
from tpp_tvm.target import target


def _max_pool_ref(x: np.ndarray, sh: PoolShape) -> np.ndarray:
    xp = np.pad(x, ((0, 0), (sh.pad[0], sh.pad[2]), (sh.pad[1], sh.pad[3]), (0, 0)),
                constant_values=-np.inf)
    out = np.full((sh.n, sh.oh, sh.ow, sh.c), -np.inf, dtype=np.float32)
    for r in range(sh.r):
        for s in range(sh.s):
            win = xp[:, r:r + (sh.oh - 1) * sh.stride + 1:sh.stride,
                     s:s + (sh.ow - 1) * sh.stride + 1:sh.stride, :]
            out = np.maximum(out, win)
    return out


@pytest.mark.parametrize(
    "sh",
    [
        PoolShape(1, 112, 112, 64, 3, 3, 2, (1, 1, 1, 1)),  # ResNet-50's
        PoolShape(2, 9, 10, 5, 2, 2, 2),
        PoolShape(1, 8, 8, 130, 3, 3, 1, (1, 1, 1, 1)),
    ],
)
def test_max_pool_matches_numpy(sh: PoolShape) -> None:
    sch = max_pool_schedule(sh, checks.VECTOR_ISA)
    assert "tpp.pool_max" in str(sch.trace)
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    x = np.random.default_rng(sh.c).standard_normal((sh.n, sh.h, sh.w, sh.c)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((sh.n, sh.oh, sh.ow, sh.c), "float32"))
    lib(tvm.runtime.tensor(x.reshape(sh.n, sh.h, -1)), out)
    np.testing.assert_array_equal(out.numpy(), _max_pool_ref(x, sh))


def test_global_avg_pool_matches_numpy() -> None:
    sch = global_avg_pool_schedule(2, 49, 40, checks.VECTOR_ISA)
    assert "tpp.reduce_add_rows" in str(sch.trace)
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    x = np.random.default_rng(0).standard_normal((2, 49, 40)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((2, 40), "float32"))
    lib(tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), x.mean(axis=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sh", [
    PoolShape(1, 26, 26, 8, 2, 2, 2),                # 13 output pixels: prime
    PoolShape(1, 35, 35, 7, 3, 3, 2),                # Inception-v3's 17, odd channels
    PoolShape(1, 3, 3, 5, 3, 3, 1),                  # one output pixel
    PoolShape(2, 23, 23, 3, 3, 3, 2, (1, 1, 1, 1)),  # 12 pixels after padding, batch 2
])
def test_max_pool_takes_any_output_width(sh: PoolShape) -> None:
    """A width no block divides is padded to whole blocks; the extra pixels are dropped."""
    test_max_pool_matches_numpy(sh)


def test_global_avg_pool_of_one_channel_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedShapeError, match="49 x 1"):
        global_avg_pool_schedule(1, 49, 1, checks.VECTOR_ISA)


@pytest.mark.requires_onnxruntime
def test_onnx_pools_of_any_size_run_on_tpp_kernels() -> None:
    """Inception-v3's 3x3 stride-2 max pooling to 17 pixels a row and a global average
    pooling of a 1x1 image (VGG's head) run without a fallback."""
    from onnx import helper

    w = np.random.default_rng(3).standard_normal((24, 24, 1, 1)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["g"]),
             helper.make_node("MaxPool", ["x"], ["m"], kernel_shape=[35, 35]),
             helper.make_node("GlobalAveragePool", ["m"], ["y"])]
    model = checks.onnx_model(nodes, {"x": [1, 24, 35, 35]}, {"w": w}, ("g", "y"))
    x = np.random.default_rng(4).standard_normal((1, 24, 35, 35)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-5, atol=1e-5)
    assert "Fallbacks to TVM: none" in compiled.report()
    assert "tpp.max_pool2d" in compiled.report()


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("side", [55, 13, 8])
def test_ceil_mode_max_pooling_runs_on_the_tpp_kernel(side: int) -> None:
    """SqueezeNet's 3x3 stride-2 max pooling in ceil mode: the partial last windows are
    padded with the lowest value, against ORT."""
    from onnx import helper

    w = np.random.default_rng(1).standard_normal((24, 24, 1, 1)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),  # NHWC, as in a model
             helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                              ceil_mode=1)]
    model = checks.onnx_model(nodes, {"x": [1, 24, side, side]}, {"w": w})
    x = np.random.default_rng(side).standard_normal((1, 24, side, side)).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, {"x": x}, rtol=1e-5, atol=1e-5)
    assert compiled.report_data["lowered"].get("tpp.max_pool2d") == 1
