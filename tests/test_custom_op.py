"""Custom operators from TE expressions: derived gradients against torch autograd, and
models using them that train step for step like their torch twins."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from tpp_tvm.errors import UnsupportedOperatorError
from tpp_tvm.training import SGD, compile_training_step
from tpp_tvm.training import examples as ex
from tpp_tvm.training.custom_op import custom_op

torch = pytest.importorskip("torch")


def _run_gradient(op, shapes, seed=0):
    """The derived gradient kernel of ``op`` on random operands, and torch's."""
    rng = np.random.default_rng(seed)
    ins = [te.placeholder(s, "float32", name=f"x{i}") for i, s in enumerate(shapes)]
    out_shape = [int(d) for d in op.fcompute(*ins).shape]
    dy = te.placeholder(out_shape, "float32", name="dy")
    grads = op.gradient(dy, *ins)
    f = tvm.compile(te.create_prim_func([*ins, dy, *grads]), target="llvm")
    vals = [rng.standard_normal(s).astype("float32") for s in shapes]
    dyv = rng.standard_normal(out_shape).astype("float32")
    outs = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in shapes]
    f(*[tvm.runtime.tensor(v) for v in (*vals, dyv)], *outs)
    return [o.numpy() for o in outs], [torch.tensor(v, requires_grad=True) for v in vals], dyv


def test_swiglu_gradient_matches_autograd():
    ours, tv, dy = _run_gradient(ex.swiglu(), [(8, 32), (8, 32)])
    (torch.nn.functional.silu(tv[0]) * tv[1]).backward(torch.tensor(dy))
    for a, t in zip(ours, tv):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_attention_scores_gradient_is_a_contraction():
    ours, tv, dy = _run_gradient(ex.attention_scores(0.25), [(2, 8, 16), (2, 12, 16)])
    (tv[0] @ tv[1].transpose(-1, -2) * 0.25).backward(torch.tensor(dy))
    for a, t in zip(ours, tv):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_math_calls_and_intermediate_stages_differentiate():
    def fcompute(a, b):
        t = te.compute(a.shape, lambda i, j: tirx.tanh(a[i, j]) / (b[j] * b[j] + 1.0), name="t")
        return te.compute(a.shape, lambda i, j: tirx.exp(t[i, j]) + tirx.max(a[i, j], 0.0),
                          name="y")

    op = custom_op("tanh_exp", fcompute)
    ours, tv, dy = _run_gradient(op, [(6, 10), (10,)])
    t = torch.tanh(tv[0]) / (tv[1] * tv[1] + 1.0)
    (torch.exp(t) + torch.relu(tv[0])).backward(torch.tensor(dy))
    for a, tt in zip(ours, tv):
        np.testing.assert_allclose(a, tt.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_unsupported_expressions_say_why():
    shifted = custom_op("shifted", lambda a: te.compute(
        (7,), lambda i: a[i + 1] * 2.0, name="shifted"))
    x = te.placeholder((8,), "float32", name="x")
    dy = te.placeholder((7,), "float32", name="dy")
    with pytest.raises(UnsupportedOperatorError, match="indices must be plain"):
        shifted.gradient(dy, x)
    with pytest.raises(UnsupportedOperatorError, match="identifier"):
        custom_op("not a name", lambda a: a)


def _torch_twin_check(model, module, named, input_shape, steps=20):
    step = compile_training_step(model, loss="mse", optimizer=SGD(lr=0.05, momentum=0.9))
    with torch.no_grad():
        for name, (p, transposed) in named.items():
            v = model.params[name]
            p.copy_(torch.tensor(np.ascontiguousarray(v.T if transposed else v)))
    rng = np.random.default_rng(3)
    data = [(rng.standard_normal(input_shape).astype("float32"),
             rng.standard_normal(input_shape).astype("float32")) for _ in range(2)]
    topt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    ours, theirs = [], []
    for i in range(steps):
        x, y = data[i % 2]
        ours.append(step.step(x, labels=y))
        topt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        topt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
    assert np.mean(ours[-2:]) < np.mean(ours[:2])
    return step


def _linears(module, names):
    named = {}
    for n in names:
        lin = getattr(module, n)
        named[f"{n}.weight"] = (lin.weight, True)
        named[f"{n}.bias"] = (lin.bias, False)
    return named


class _SwiGLU(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(dim, hidden), torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class _ScoreAttention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.scale = 1.0 / np.sqrt(dim)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) * self.scale
        return self.o(torch.softmax(s, dim=-1) @ self.v(x))


def test_swiglu_ffn_trains_like_torch():
    module = _SwiGLU(32, 64)
    step = _torch_twin_check(ex.swiglu_ffn(16, 32, 64), module,
                             _linears(module, ("gate", "up", "down")), (16, 32))
    assert step.report.lowered["tpp.matmul_ta"] >= 3  # the dense layers around it


def test_custom_score_attention_trains_like_torch():
    module = _ScoreAttention(32)
    step = _torch_twin_check(ex.score_attention(2, 16, 32), module,
                             _linears(module, ("q", "k", "v", "o")), (2, 16, 32))
    # forward Q Kᵀ, and both derived gradients (dS K, dSᵀ Q) run as TPP GEMMs
    assert step.report.lowered["tpp.contraction"] == 3, step.report.summary()
