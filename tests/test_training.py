"""Training steps on TPPs against torch: same initial weights, same data, same losses.

Each model is built twice, in Relax (tpp_tvm.training.models) and in torch with the same
weights copied in; 20 optimizer steps must give the same loss at every step (fp32, 1e-4
relative) and the same final parameters.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpp_tvm.errors import TPPError
from tpp_tvm.training import SGD, AdamW, compile_training_step
from tpp_tvm.training import models as tm
from tpp_tvm.training.optim import OptimizerConfigError

torch = pytest.importorskip("torch")

STEPS = 20
RTOL = 1e-4


def _torch_opt(opt, params):
    if isinstance(opt, SGD):
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum,
                               weight_decay=opt.weight_decay)
    return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                             weight_decay=opt.weight_decay)


def _torch_losses(module, named, loss, opt, batches):
    """Train the torch twin; ``named`` maps our parameter names to torch parameters."""
    fn = {"mse": torch.nn.functional.mse_loss,
          "cross_entropy": torch.nn.functional.cross_entropy}[loss]
    topt = _torch_opt(opt, module.parameters())
    losses = []
    for inputs, labels in batches:
        topt.zero_grad()
        out = module(*[torch.tensor(x) for x in inputs])
        value = fn(out, torch.tensor(labels))
        value.backward()
        topt.step()
        losses.append(value.item())
    return losses


def _copy_in(named: dict, params: dict) -> None:
    with torch.no_grad():
        for name, (tensor, transposed) in named.items():
            value = params[name].T if transposed else params[name]
            tensor.copy_(torch.tensor(np.ascontiguousarray(value)))


def _batches(rng, input_shapes, out_dim, loss, steps=STEPS, distinct=2):
    """``steps`` batches cycling over ``distinct`` fixed ones (so the loss must fall)."""
    out = []
    for _ in range(distinct):
        inputs = [rng.standard_normal(s).astype("float32") for s in input_shapes]
        batch = input_shapes[0][0]
        if loss == "mse":
            shape = input_shapes[0] if out_dim is None else (batch, out_dim)
            labels = rng.standard_normal(shape).astype("float32")
        else:
            labels = rng.integers(0, out_dim, batch).astype("int64")
        out.append((inputs, labels))
    return [out[i % distinct] for i in range(steps)]


def _check(model, module, named, loss, opt, input_shapes, out_dim, seed=0):
    step = compile_training_step(model, loss=loss, optimizer=opt)
    _copy_in(named, model.params)
    batches = _batches(np.random.default_rng(seed), input_shapes, out_dim, loss)
    ours = [step.step(*inputs, labels=labels) for inputs, labels in batches]
    theirs = _torch_losses(module, named, loss, opt, batches)
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=1e-6)
    assert np.mean(ours[-2:]) < np.mean(ours[:2])  # it trains (2 batches cycled)
    for name, (tensor, transposed) in named.items():
        ref = tensor.detach().numpy()
        np.testing.assert_allclose(step.params[name], ref.T if transposed else ref,
                                   rtol=1e-3, atol=1e-5)
    return step


def _torch_mlp(sizes, act):
    layers = []
    for i, (fi, fo) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(fi, fo))
        if i < len(sizes) - 2:
            layers.append(act())
    seq = torch.nn.Sequential(*layers)
    linears = [m for m in seq if isinstance(m, torch.nn.Linear)]
    named = {}
    for i, lin in enumerate(linears):
        named[f"fc{i}.weight"] = (lin.weight, True)
        named[f"fc{i}.bias"] = (lin.bias, False)
    return seq, named


@pytest.mark.parametrize("loss,opt", [
    ("mse", SGD(lr=0.05, momentum=0.9)),
    ("cross_entropy", AdamW(lr=1e-3, weight_decay=0.01)),
])
def test_mlp_matches_torch(loss, opt):
    sizes = [48, 64, 32, 10]
    model = tm.mlp(16, sizes)
    module, named = _torch_mlp(sizes, torch.nn.ReLU)
    step = _check(model, module, named, loss, opt, [(16, 48)], 10)
    lowered = step.report.lowered
    # forward GEMM+bias+relu, dX = dY Wᵀ, dW = Xᵀ dY, bias gradients, relu backward
    for kernel in ("tpp.matmul_bias_relu", "tpp.matmul_tb", "tpp.matmul_ta", "tpp.col_sum",
                   "tpp.relu_inv"):
        assert lowered[kernel] >= 1, step.report.summary()


@pytest.mark.parametrize("act,torch_act", [("gelu", "GELU"), ("tanh", "Tanh"),
                                           ("sigmoid", "Sigmoid")])
def test_mlp_activation_backward_on_tpps(act, torch_act):
    sizes = [32, 48, 8]
    model = tm.mlp(8, sizes, activation=act, seed=1)
    module, named = _torch_mlp(sizes, getattr(torch.nn, torch_act))
    step = _check(model, module, named, "mse", SGD(lr=0.1), [(8, 32)], 8)
    assert step.report.lowered[f"tpp.{act}_inv"] == 1, step.report.summary()


def test_training_errors_are_tpp_errors():
    model = tm.mlp(4, [8, 4])
    with pytest.raises(TPPError, match="loss 'hinge' unsupported"):
        compile_training_step(model, loss="hinge")
    with pytest.raises(OptimizerConfigError, match="momentum=1.5"):
        SGD(lr=0.1, momentum=1.5)
    step = compile_training_step(model, loss="mse", optimizer=SGD(lr=0.1))
    with pytest.raises(TPPError, match="takes 1 inputs"):
        step.step(np.zeros((4, 8), "float32"), np.zeros((4, 8), "float32"),
                  labels=np.zeros((4, 4), "float32"))


class _TorchBert(torch.nn.Module if torch else object):
    def __init__(self, hidden, heads, intermediate, eps):
        super().__init__()
        self.heads = heads
        for name in ("q", "k", "v", "o"):
            setattr(self, name, torch.nn.Linear(hidden, hidden))
        self.ln1 = torch.nn.LayerNorm(hidden, eps=eps)
        self.ffn1 = torch.nn.Linear(hidden, intermediate)
        self.ffn2 = torch.nn.Linear(intermediate, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=eps)

    def forward(self, x):
        b, s, h = x.shape
        dh = h // self.heads

        def split(t):
            return t.view(b, s, self.heads, dh).permute(0, 2, 1, 3)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        probs = torch.softmax(q @ k.transpose(-1, -2) / np.sqrt(dh), dim=-1)
        ctx = (probs @ v).permute(0, 2, 1, 3).reshape(b, s, h)
        h1 = self.ln1(self.o(ctx) + x)
        return self.ln2(self.ffn2(torch.nn.functional.gelu(self.ffn1(h1))) + h1)


def test_bert_layer_matches_torch():
    batch, seq, hidden, heads, inter = 2, 16, 64, 4, 128
    model = tm.bert_layer(batch, seq, hidden, heads, inter)
    module = _TorchBert(hidden, heads, inter, 1e-12)
    named = {}
    for name, p in module.named_parameters():
        is_linear_w = name.endswith(".weight") and not name.startswith("ln")
        named[name] = (p, is_linear_w)
    step = _check(model, module, named, "mse", SGD(lr=0.05, momentum=0.9),
                  [(batch, seq, hidden)], None)
    lowered = step.report.lowered
    for kernel in ("tpp.layer_norm", "tpp.layer_norm_bwd", "tpp.softmax", "tpp.softmax_bwd",
                   "tpp.gelu_inv", "tpp.matmul_ta", "tpp.col_sum", "tpp.bmm"):
        assert lowered[kernel] >= 1, step.report.summary()


def test_small_cnn_matches_torch():
    model = tm.small_cnn(4, channels=3, size=8, width=4, classes=5)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 2 * 2, 5))
    named = {"conv0.weight": (module[0].weight, False), "conv1.weight": (module[3].weight, False),
             "fc.weight": (module[7].weight, True), "fc.bias": (module[7].bias, False)}
    with torch.no_grad():
        module[0].bias.copy_(torch.tensor(model.params["conv0.bias"].reshape(-1)))
        module[3].bias.copy_(torch.tensor(model.params["conv1.bias"].reshape(-1)))
    _check(model, module, named, "cross_entropy", SGD(lr=0.05, momentum=0.9),
           [(4, 3, 8, 8)], 5)
