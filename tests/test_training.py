"""Training steps on TPPs against torch: same initial weights, same data, same losses.

Each model is built in Relax (``training.models``) and as its torch twin
(``training.reference``) with the same weights; 20 optimizer steps must give the same loss
at every step (fp32, 1e-4 relative) and the same final parameters, and the backward
operators must have become TPP kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpp_tvm.errors import TPPError
from tpp_tvm.training import SGD, AdamW, compile_training_step
from tpp_tvm.training import models as tm
from tpp_tvm.training import reference as twin
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


def _batches(rng, input_shape, label_shape, loss, classes=None, distinct=2):
    """``STEPS`` batches cycling over ``distinct`` fixed ones (so the loss must fall)."""
    fixed = []
    for _ in range(distinct):
        x = rng.standard_normal(input_shape).astype("float32")
        if loss == "mse":
            y = rng.standard_normal(label_shape).astype("float32")
        else:
            y = rng.integers(0, classes, label_shape).astype("int64")
        fixed.append((x, y))
    return [fixed[i % distinct] for i in range(STEPS)]


def _check(model, module, loss, opt, input_shape, label_shape, classes=None, param_tol=1e-5):
    step = compile_training_step(model, loss=loss, optimizer=opt)
    twin.load_params(module, model)
    batches = _batches(np.random.default_rng(0), input_shape, label_shape, loss, classes)
    ours = [step.step(x, labels=y) for x, y in batches]
    fn = {"mse": torch.nn.functional.mse_loss,
          "cross_entropy": torch.nn.functional.cross_entropy}[loss]
    topt = _torch_opt(opt, module.parameters())
    theirs = []
    for x, y in batches:
        topt.zero_grad()
        value = fn(module(torch.tensor(x)), torch.tensor(y))
        value.backward()
        topt.step()
        theirs.append(value.item())
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=1e-6)
    assert np.mean(ours[-2:]) < np.mean(ours[:2])  # it trains
    ref = twin.read_params(module)
    for name, value in step.params.items():
        np.testing.assert_allclose(value.reshape(ref[name].shape), ref[name], rtol=1e-3,
                                   atol=param_tol, err_msg=name)
    return step


@pytest.mark.parametrize("loss,opt", [
    ("mse", SGD(lr=0.05, momentum=0.9)),
    ("cross_entropy", AdamW(lr=1e-3, weight_decay=0.01)),
])
def test_mlp_matches_torch(loss, opt):
    sizes = [48, 64, 32, 10]
    label = (16, 10) if loss == "mse" else (16,)
    step = _check(tm.mlp(16, sizes), twin.mlp(sizes), loss, opt, (16, 48), label, classes=10)
    lowered = step.report.lowered
    # forward GEMM+bias+relu, dX = dY Wᵀ, dW = Xᵀ dY, bias gradients, relu backward
    for kernel in ("tpp.matmul_bias_relu", "tpp.matmul_tb", "tpp.matmul_ta", "tpp.col_sum",
                   "tpp.relu_inv"):
        assert lowered[kernel] >= 1, step.report.summary()


def test_small_batch_dx_runs_as_the_transposed_product():
    # batch 4, 256 wide: dX = dY Wᵀ is computed as (W dYᵀ)ᵀ, so Wᵀ is never packed
    sizes = [64, 256, 256, 8]
    step = _check(tm.mlp(4, sizes), twin.mlp(sizes), "mse", SGD(lr=0.05, momentum=0.9),
                  (4, 64), (4, 8))
    x = np.zeros((4, 64), "float32")
    kernels = [name for name, _, _ in step.profile(x, labels=np.zeros((4, 8), "float32"))]
    assert any(k.startswith("tpp_matmul_tb_swapped") for k in kernels), kernels


@pytest.mark.parametrize("act", ["gelu", "tanh", "sigmoid"])
def test_mlp_activation_backward_on_tpps(act):
    sizes = [32, 48, 8]
    step = _check(tm.mlp(8, sizes, activation=act, seed=1), twin.mlp(sizes, act), "mse",
                  SGD(lr=0.1), (8, 32), (8, 8))
    assert step.report.lowered[f"tpp.{act}_inv"] == 1, step.report.summary()


def test_bert_layer_matches_torch():
    batch, seq, hidden, heads, inter = 2, 16, 64, 4, 128
    step = _check(tm.bert_layer(batch, seq, hidden, heads, inter),
                  twin.bert_layer(hidden, heads, inter), "mse", SGD(lr=0.05, momentum=0.9),
                  (batch, seq, hidden), (batch, seq, hidden))
    lowered = step.report.lowered
    for kernel in ("tpp.layer_norm", "tpp.layer_norm_bwd", "tpp.softmax", "tpp.softmax_bwd",
                   "tpp.gelu_inv", "tpp.matmul_ta", "tpp.matmul_tb", "tpp.col_sum", "tpp.bmm"):
        assert lowered[kernel] >= 1, step.report.summary()


@pytest.mark.slow
def test_bert_layer_adamw_losses_match_torch():
    # Adam's normalised step turns float noise in parameters whose gradient is zero in
    # exact arithmetic (the key bias: softmax ignores a per-row shift) into lr-sized moves,
    # so parameters are compared at lr scale; the losses still match to 1e-4.
    batch, seq, hidden, heads, inter = 1, 8, 32, 2, 64
    _check(tm.bert_layer(batch, seq, hidden, heads, inter),
           twin.bert_layer(hidden, heads, inter), "mse", AdamW(lr=1e-3),
           (batch, seq, hidden), (batch, seq, hidden), param_tol=5e-3)  # 5 lr


def test_small_cnn_matches_torch():
    step = _check(tm.small_cnn(4, channels=3, size=8, width=4, classes=5),
                  twin.small_cnn(3, 8, 4, 5), "cross_entropy", SGD(lr=0.05, momentum=0.9),
                  (4, 3, 8, 8), (4,), classes=5)
    lowered = step.report.lowered
    assert lowered["tpp.matmul_ta"] >= 1, step.report.summary()
    # 2 forward convolutions, 2 weight gradients (dY as the filter) and the second
    # layer's input gradient (dY with the flipped filter; the first needs none)
    assert lowered["tpp.conv2d_runtime_weight"] == 5, step.report.summary()


def test_plain_llvm_target_computes_the_same_step():
    # Without the TPP target the tagged backward kernels keep their TE form and TVM's
    # default path compiles everything: same losses as the TPP kernels.
    import tvm

    model = tm.mlp(8, [16, 32, 4], activation="gelu")
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    y = np.zeros((8, 4), "float32")
    plain = compile_training_step(model, "mse", SGD(lr=0.1),
                                  target=tvm.target.Target({"kind": "llvm"}))
    tpp = compile_training_step(model, "mse", SGD(lr=0.1))
    assert not plain.report.lowered and tpp.report.lowered["tpp.gelu_inv"] == 1
    np.testing.assert_allclose([plain.step(x, labels=y) for _ in range(3)],
                               [tpp.step(x, labels=y) for _ in range(3)], rtol=1e-5)


def test_training_errors_are_tpp_errors():
    model = tm.mlp(4, [8, 4])
    with pytest.raises(TPPError, match="loss 'hinge' unsupported"):
        compile_training_step(model, loss="hinge")
    with pytest.raises(OptimizerConfigError, match="momentum=1.5"):
        SGD(lr=0.1, momentum=1.5)
    with pytest.raises(TypeError, match="SGD or AdamW"):
        compile_training_step(model, optimizer=torch.optim.SGD)
    step = compile_training_step(model, loss="mse", optimizer=SGD(lr=0.1))
    with pytest.raises(TPPError, match="takes 1 inputs"):
        step.step(np.zeros((4, 8), "float32"), np.zeros((4, 8), "float32"),
                  labels=np.zeros((4, 4), "float32"))
