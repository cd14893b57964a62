"""Backward kernels on TPPs (schedules/backward.py) and GEMMs with transposed operands
(schedules/gemm.py) against numpy / torch autograd."""

from __future__ import annotations

import logging

import checks
import numpy as np
import pytest
import tvm
from scipy.special import erf

from tpp_tvm.schedules import backward as bwd
from tpp_tvm.schedules.gemm import gemm_schedule
from tpp_tvm.target import target


def _run(sch, *inputs, outs):
    f = tvm.compile(sch.mod, target=target()).jit()
    args = [tvm.runtime.tensor(np.ascontiguousarray(x, dtype="float32")) for x in inputs]
    args += [tvm.runtime.tensor(np.zeros(s, "float32")) for s in outs]
    f(*args)
    return [a.numpy() for a in args[len(inputs):]]


@pytest.fixture
def untensorized(caplog):
    """Stages that fell back from their TPP (the schedules log each at debug level)."""
    caplog.set_level(logging.DEBUG, logger="tpp_tvm.schedules")
    return lambda: [r.getMessage() for r in caplog.records if "not tensorized" in r.getMessage()]


RNG = np.random.default_rng(0)
ROWS, WIDTH = 32, 80
DY = RNG.standard_normal((ROWS, WIDTH)).astype("float32")
X = RNG.standard_normal((ROWS, WIDTH)).astype("float32")


@pytest.mark.parametrize("op,ref", [
    ("relu_inv", lambda dy, s: dy * (s > 0)),
    ("tanh_inv", lambda dy, s: dy * (1 - s * s)),
    ("sigmoid_inv", lambda dy, s: dy * s * (1 - s)),
    ("gelu_inv", lambda dy, s: dy * (0.5 * (1 + erf(s / np.sqrt(2)))
                                     + s * np.exp(-s * s / 2) / np.sqrt(2 * np.pi))),
])
def test_unary_backward(op, ref, untensorized):
    sch = bwd.unary_bwd_schedule(ROWS, WIDTH, op, checks.VECTOR_ISA)
    assert not untensorized()
    (out,) = _run(sch, DY, X, outs=[(ROWS, WIDTH)])
    np.testing.assert_allclose(out, ref(DY, X), rtol=1e-5, atol=1e-5)


def test_softmax_backward(untensorized):
    y = np.exp(X) / np.exp(X).sum(-1, keepdims=True)
    sch = bwd.softmax_bwd_schedule(ROWS, WIDTH, checks.VECTOR_ISA)
    assert not untensorized()
    (out,) = _run(sch, y, DY, outs=[(ROWS, WIDTH)])
    np.testing.assert_allclose(out, y * (DY - (DY * y).sum(-1, keepdims=True)), atol=1e-6)


@pytest.mark.parametrize("width", [64, 80])
def test_column_sum(width, untensorized):
    sch = bwd.col_sum_schedule(ROWS, width, checks.VECTOR_ISA)
    assert not untensorized()
    (out,) = _run(sch, DY[:, :width], outs=[(width,)])
    np.testing.assert_allclose(out, DY[:, :width].sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.requires_torch
def test_layer_norm_backward_matches_autograd(untensorized):
    import torch

    gamma = RNG.standard_normal(WIDTH).astype("float32")
    xt = torch.tensor(X, requires_grad=True)
    gt = torch.tensor(gamma, requires_grad=True)
    bt = torch.zeros(WIDTH, requires_grad=True)
    torch.nn.functional.layer_norm(xt, (WIDTH,), gt, bt, 1e-5).backward(torch.tensor(DY))
    sch = bwd.layer_norm_bwd_schedule(ROWS, WIDTH, 1e-5, checks.VECTOR_ISA)
    assert not untensorized()
    outs = _run(sch, X, gamma, DY, outs=[(ROWS, WIDTH), (WIDTH,), (WIDTH,)])
    for ours, ref in zip(outs, (xt, gt, bt)):
        np.testing.assert_allclose(ours, ref.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_backward_kernels_reject_tiny_tiles():
    with pytest.raises(Exception, match="no TPP tile"):
        bwd.col_sum_schedule(1, 64, checks.VECTOR_ISA)


@pytest.mark.parametrize("m,n,k,ta,tb", [
    (64, 96, 48, True, False),    # dW = Xᵀ dY
    (64, 96, 48, False, True),    # dX = dY Wᵀ
    (30, 10, 7, True, False),     # padded tiles
    (30, 10, 7, False, True),
    (128, 768, 128, True, False),
])
def test_gemm_with_transposed_operand(m, n, k, ta, tb, untensorized):
    sch, plan = gemm_schedule(m, n, k, checks.VECTOR_ISA, b_packed=False, a_transposed=ta,
                              b_transposed=tb)
    if (plan.mp, plan.np_) == (m, n) and m % 16 == 0:  # unpadded: transposes are TPPs too
        assert not untensorized()
    a = RNG.standard_normal((k, m) if ta else (m, k)).astype("float32")
    b = RNG.standard_normal((n, k) if tb else (k, n)).astype("float32")
    (c,) = _run(sch, a, b, outs=[(m, n)])
    ref = (a.T if ta else a) @ (b.T if tb else b)
    np.testing.assert_allclose(c, ref, rtol=1e-4, atol=1e-4)
