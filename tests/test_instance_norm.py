"""Channels-last instance norm: the statistics and equation kernels against numpy, and the
graph rewrite of wav2vec2's per-channel GroupNorm between its layout transposes."""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm
from scipy import special

from tpp_tvm.schedules.instance_norm import (
    instance_norm_apply_schedule,
    instance_norm_stats_schedule,
)
from tpp_tvm.target import target
from tpp_tvm.tir_pipeline import compile_kernels


def _norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    xd = x.astype(np.float64)
    return (xd - xd.mean(0)) / np.sqrt(xd.var(0) + eps) * gamma + beta


@pytest.mark.parametrize(("rows", "width", "offset", "activation"), [
    (37, 48, 0.0, None),       # prime rows
    (3199, 64, 5.0, "gelu"),   # wav2vec2's frames; a mean large against the spread
    (9, 24, -3.0, "relu"),     # channels not whole vectors
    (2, 16, 100.0, None),      # two rows, mean 100x the spread
])
def test_instance_norm_kernels_match_numpy(rows: int, width: int, offset: float,
                                           activation: str | None) -> None:
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, width)) + offset).astype("float32")
    gamma = rng.standard_normal(width).astype("float32")
    beta = rng.standard_normal(width).astype("float32")
    tgt = target(num_cores=2)
    stats = compile_kernels(
        instance_norm_stats_schedule(rows, width, 1e-5, checks.VECTOR_ISA).mod, tgt)
    apply = compile_kernels(instance_norm_apply_schedule(rows, width, activation,
                                                         checks.VECTOR_ISA).mod, tgt)
    t = [tvm.runtime.tensor(a) for a in (x, gamma, beta)]
    scale, shift = (tvm.runtime.tensor(np.zeros(width, "float32")) for _ in range(2))
    out = tvm.runtime.tensor(np.zeros((rows, width), "float32"))
    stats["main"](*t, scale, shift)
    apply["main"](t[0], scale, shift, out)
    want = _norm(x, gamma, beta, 1e-5)
    if activation == "gelu":
        want = want * 0.5 * special.erfc(-want / np.sqrt(2))
    elif activation == "relu":
        want = np.maximum(want, 0)
    checks.assert_close_scaled(out.numpy(), want, 2e-5)


@pytest.mark.requires_onnxruntime
def test_per_channel_group_norm_runs_channels_last(tmp_path) -> None:
    """Conv1d -> GroupNorm(one group per channel) -> GELU -> Conv1d, as wav2vec2's feature
    extractor exports it: one instance-norm kernel with the GELU, and no layout transposes
    but the one that returns the output channels-first."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv1d(1, 32, 10, 5, bias=False), torch.nn.GroupNorm(32, 32),
        torch.nn.GELU(), torch.nn.Conv1d(32, 32, 3, 2, bias=False), torch.nn.GELU())
    with torch.no_grad():
        net[1].weight.normal_()
        net[1].bias.normal_()
    x = torch.randn(1, 1, 1601)
    path = tmp_path / "frontend.onnx"
    torch.onnx.export(net, (x,), str(path), opset_version=17, dynamo=False,
                      input_names=["x"], output_names=["y"])
    import onnx

    compiled = checks.assert_runs_like_onnxruntime(onnx.load(str(path)), {"x": x.numpy()},
                                                   rtol=1e-4, atol=1e-4)
    report = compiled.report()
    assert "tpp.instance_norm_gelu: 1" in report, report
    assert sum("transpose" in line for line in report.splitlines()) == 1, report
