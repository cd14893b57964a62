"""Trainable Relax models with their parameters as function inputs.

``tpp_tvm.models`` exports ONNX graphs for inference, where weights are constants; training
needs them as parameters. These builders write the same architectures directly in Relax:
``main(x, params...)`` with weights stored (in, out) so a linear layer is ``x @ W + b``
(torch's ``nn.Linear.weight`` is the transpose). Initial values come from a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from tvm import relax

from .step import Model

F32 = "float32"


class _Builder:
    """Collects parameters (name, initial value) while a forward function is written."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vars: list[relax.Var] = []
        self.values: dict[str, np.ndarray] = {}

    def param(self, name: str, value: np.ndarray) -> relax.Var:
        var = relax.Var(name, relax.TensorType(value.shape, F32))
        self.vars.append(var)
        self.values[name] = value.astype(F32)
        return var

    def linear(self, name: str, fan_in: int, fan_out: int) -> tuple[relax.Var, relax.Var]:
        bound = 1.0 / np.sqrt(fan_in)  # torch's nn.Linear init range
        w = self.param(f"{name}.weight", self.rng.uniform(-bound, bound, (fan_in, fan_out)))
        b = self.param(f"{name}.bias", self.rng.uniform(-bound, bound, (fan_out,)))
        return w, b


def _model(inputs: list[relax.Var], builder: _Builder,
           body: Callable[[relax.BlockBuilder], relax.Expr]) -> Model:
    """Trace ``body`` (which declares parameters on ``builder``) into ``main``."""
    bb = relax.BlockBuilder()
    # Parameters are declared while the body is written, so write it into a scratch
    # function first and rebuild main with the final parameter list.
    with bb.function("scratch", inputs):
        with bb.dataflow():
            out = bb.emit_output(body(bb))
        bb.emit_func_output(out)
    scratch = bb.get()["scratch"]
    main = relax.Function([*inputs, *builder.vars], scratch.body, scratch.ret_ty)
    mod = relax.transform.Normalize()(
        __import__("tvm").IRModule({"main": main.with_attr("global_symbol", "main")}))
    return Model(mod, builder.values, num_input=len(inputs))


def dense(bb: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, b: relax.Expr) -> relax.Expr:
    return bb.emit(relax.op.add(relax.op.matmul(x, w), b))


def mlp(batch: int, sizes: Sequence[int], activation: str = "relu", seed: int = 0) -> Model:
    """A multi-layer perceptron: Linear (+activation) per layer, no activation at the end."""
    act = {"relu": relax.op.nn.relu, "gelu": relax.op.nn.gelu, "tanh": relax.op.tanh,
           "sigmoid": relax.op.sigmoid}[activation]
    x = relax.Var("x", relax.TensorType((batch, sizes[0]), F32))
    pb = _Builder(seed)

    def body(bb):
        h = x
        for i, (fi, fo) in enumerate(zip(sizes[:-1], sizes[1:])):
            w, b = pb.linear(f"fc{i}", fi, fo)
            h = dense(bb, h, w, b)
            if i < len(sizes) - 2:
                h = bb.emit(act(h))
        return h

    return _model([x], pb, body)
