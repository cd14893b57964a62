"""Channels-last instance and group norms: the statistics and equation kernels against
numpy, and the graph rewrites of wav2vec2's per-channel GroupNorm and BiT's image GroupNorm
between their layout transposes."""

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


def _norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float,
          groups: int | None = None) -> np.ndarray:
    rows, width = x.shape
    xd = x.astype(np.float64).reshape(rows, groups or width, -1)
    mean, var = xd.mean((0, 2), keepdims=True), xd.var((0, 2), keepdims=True)
    return ((xd - mean) / np.sqrt(var + eps)).reshape(rows, width) * gamma + beta


@pytest.mark.parametrize(("rows", "width", "offset", "activation", "groups"), [
    (37, 48, 0.0, None, None),       # prime rows
    (3199, 64, 5.0, "gelu", None),   # wav2vec2's frames; a mean large against the spread
    (9, 24, -3.0, "relu", None),     # channels not whole vectors
    (2, 16, 100.0, None, None),      # two rows, mean 100x the spread
    (49, 256, 0.0, "relu", 32),      # BiT's last stage: 32 groups of 8 channels
    (37, 96, 50.0, None, 4),         # channels of a group with means far apart
    (9, 24, -3.0, None, 3),          # groups not whole vectors
])
def test_instance_norm_kernels_match_numpy(rows: int, width: int, offset: float,
                                           activation: str | None, groups: int | None
                                           ) -> None:
    rng = np.random.default_rng(rows)
    # a mean per channel, so a group's channels are not alike
    x = (rng.standard_normal((rows, width)) + offset
         + 4 * rng.standard_normal(width)).astype("float32")
    gamma = rng.standard_normal(width).astype("float32")
    beta = rng.standard_normal(width).astype("float32")
    tgt = target(num_cores=2)
    stats = compile_kernels(
        instance_norm_stats_schedule(rows, width, 1e-5, checks.VECTOR_ISA, groups).mod, tgt)
    apply = compile_kernels(instance_norm_apply_schedule(rows, width, activation,
                                                         checks.VECTOR_ISA).mod, tgt)
    t = [tvm.runtime.tensor(a) for a in (x, gamma, beta)]
    scale, shift = (tvm.runtime.tensor(np.zeros(width, "float32")) for _ in range(2))
    out = tvm.runtime.tensor(np.zeros((rows, width), "float32"))
    stats["main"](*t, scale, shift)
    apply["main"](t[0], scale, shift, out)
    want = _norm(x, gamma, beta, 1e-5, groups)
    if activation == "gelu":
        want = want * 0.5 * special.erfc(-want / np.sqrt(2))
    elif activation == "relu":
        want = np.maximum(want, 0)
    checks.assert_close_scaled(out.numpy(), want, 2e-5)


def _group_norm_net_report(tmp_path, build, shape: tuple[int, ...]) -> str:
    """The report of ``build(torch.nn)`` (its second module a GroupNorm, given random
    weights and biases) exported to ONNX for an input of ``shape`` and compiled, checked
    against ONNX Runtime (seeded)."""
    import onnx
    import torch

    torch.manual_seed(0)
    net = build(torch.nn)
    with torch.no_grad():
        net[1].weight.normal_()
        net[1].bias.normal_()
    x = torch.randn(*shape)
    path = tmp_path / "group_norm.onnx"
    torch.onnx.export(net, (x,), str(path), opset_version=17, dynamo=False,
                      input_names=["x"], output_names=["y"])
    return checks.assert_runs_like_onnxruntime(onnx.load(str(path)), {"x": x.numpy()},
                                               rtol=1e-4, atol=1e-4).report()


@pytest.mark.requires_onnxruntime
def test_per_channel_group_norm_runs_channels_last(tmp_path) -> None:
    """Conv1d -> GroupNorm(one group per channel) -> GELU -> Conv1d, as wav2vec2's feature
    extractor exports it: one instance-norm kernel with the GELU, and no layout transposes
    but the one that returns the output channels-first."""
    pytest.importorskip("torch")
    report = _group_norm_net_report(tmp_path, lambda nn: nn.Sequential(
        nn.Conv1d(1, 32, 10, 5, bias=False), nn.GroupNorm(32, 32), nn.GELU(),
        nn.Conv1d(32, 32, 3, 2, bias=False), nn.GELU()), (1, 1, 1601))
    assert "tpp.instance_norm_gelu: 1" in report, report
    assert sum("transpose" in line for line in report.splitlines()) == 1, report


def test_group_norm_statistics_reject_uneven_groups() -> None:
    with pytest.raises(ValueError, match="24 channels do not split into 5 groups"):
        instance_norm_stats_schedule(9, 24, 1e-5, checks.VECTOR_ISA, 5)


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("groups", [8, 32])
def test_image_group_norm_runs_channels_last(tmp_path, groups: int) -> None:
    """Conv2d -> GroupNorm -> ReLU -> Conv2d, as BiT's blocks export it (InstanceNormalization
    of the image reshaped to one row per group, then the per-channel affine): one group
    norm kernel with the ReLU (an instance norm where each channel is a group), no layer
    norm and no layout transposes but the two at the model's edges."""
    pytest.importorskip("torch")
    report = _group_norm_net_report(tmp_path, lambda nn: nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.GroupNorm(groups, 32), nn.ReLU(),
        nn.Conv2d(32, 16, 3, padding=1, bias=False)), (1, 3, 14, 12))
    kernel = "tpp.group_norm_relu" if groups < 32 else "tpp.instance_norm_relu"
    assert f"{kernel}: 1" in report, report
    assert "layer_norm" not in report, report
    assert sum("transpose" in line for line in report.splitlines()) <= 2, report


@pytest.mark.requires_onnxruntime
def test_group_norm_of_a_channels_first_input_runs_channels_last(tmp_path) -> None:
    """A GroupNorm reading a channels-first image that no transpose made (BiT's first block
    norm reads the max pooling) and whose result nothing transposes back (its last norm is
    the model's output): still one group-norm kernel, no layer norm."""
    pytest.importorskip("torch")
    report = _group_norm_net_report(tmp_path, lambda nn: nn.Sequential(
        nn.Identity(), nn.GroupNorm(8, 32), nn.ReLU()), (1, 32, 9, 7))
    assert "tpp.group_norm_relu: 1" in report, report
    assert "layer_norm" not in report, report
