"""Loss functions appended to a model's output, as Relax expressions (torch's definitions).

Relax's ``training.loss`` classes build whole functions for ``AppendLoss``; a training step
here builds one function, so the loss is a plain expression on the model output.
"""

from __future__ import annotations

from tvm import relax

from ..errors import TPPError


class UnsupportedLossError(TPPError):
    """A loss name tpp_tvm has no definition for."""


def _mse(bb: relax.BlockBuilder, out: relax.Expr, labels: relax.Expr) -> relax.Expr:
    d = bb.emit(relax.op.subtract(out, labels))
    return bb.emit(relax.op.mean(relax.op.multiply(d, d)))


def _cross_entropy(bb: relax.BlockBuilder, out: relax.Expr, labels: relax.Expr) -> relax.Expr:
    logp = bb.emit(relax.op.nn.log_softmax(out, axis=-1))
    return bb.emit(relax.op.nn.nll_loss(logp, labels, reduction="mean"))


#: name -> (builder, labels dtype, whether labels have the output's shape).
LOSSES = {
    "mse": (_mse, "float32", True),
    "cross_entropy": (_cross_entropy, "int64", False),
}


def loss_spec(name: str):
    """The builder, label dtype and label-shape rule of loss ``name``."""
    if name not in LOSSES:
        raise UnsupportedLossError(f"loss {name!r} unsupported; one of {', '.join(LOSSES)}")
    return LOSSES[name]


def label_type(name: str, out_shape: tuple[int, ...]) -> relax.TensorType:
    """Labels for loss ``name`` on an output of ``out_shape``: targets, or class indices."""
    _, dtype, same = loss_spec(name)
    if not same and len(out_shape) != 2:
        raise UnsupportedLossError(
            f"loss {name!r} needs (batch, classes) logits, got output shape {out_shape}")
    return relax.TensorType(out_shape if same else out_shape[:1], dtype)
