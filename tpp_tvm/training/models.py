"""Trainable Relax models with their parameters as function inputs.

``tpp_tvm.models`` exports ONNX graphs for inference, where weights are constants; training
needs them as parameters. These builders write the same architectures directly in Relax:
``main(x, params...)`` with weights stored (in, out) so a linear layer is ``x @ W + b``
(torch's ``nn.Linear.weight`` is the transpose). Initial values come from a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from .step import Model

F32 = "float32"


class ParamBuilder:
    """Collects parameters (name, initial value) while a forward function is written."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vars: list[relax.Var] = []
        self.values: dict[str, np.ndarray] = {}

    def param(self, name: str, value: np.ndarray) -> relax.Var:
        """A new parameter input of ``main``, starting at ``value``."""
        var = relax.Var(name, relax.TensorType(value.shape, F32))
        self.vars.append(var)
        self.values[name] = value.astype(F32)
        return var

    def linear(self, name: str, fan_in: int, fan_out: int) -> tuple[relax.Var, relax.Var]:
        """Weight (in, out) and bias of a linear layer, initialised as torch's."""
        bound = 1.0 / np.sqrt(fan_in)  # torch's nn.Linear init range
        w = self.param(f"{name}.weight", self.rng.uniform(-bound, bound, (fan_in, fan_out)))
        b = self.param(f"{name}.bias", self.rng.uniform(-bound, bound, (fan_out,)))
        return w, b


def trace_model(inputs: list[relax.Var], builder: ParamBuilder,
                body: Callable[[relax.BlockBuilder], relax.Expr]) -> Model:
    """Trace ``body`` (which declares parameters on ``builder``) into ``main(inputs...,
    params...)``: the model builders here and in ``examples.py`` share it."""
    bb = relax.BlockBuilder()
    # Parameters are declared while the body is written, so write it into a scratch
    # function first and rebuild main with the final parameter list.
    with bb.function("scratch", inputs):
        with bb.dataflow():
            out = bb.emit_output(body(bb))
        bb.emit_func_output(out)
    built = bb.get()
    scratch = built["scratch"]
    main = relax.Function([*inputs, *builder.vars], scratch.body, scratch.ret_ty)
    # Keep the kernels the body added (custom operators' PrimFuncs).
    funcs = {gv: f for gv, f in built.functions.items() if gv.name_hint != "scratch"}
    mod = tvm.IRModule(funcs)
    mod["main"] = main.with_attr("global_symbol", "main")
    mod = relax.transform.Normalize()(mod)
    return Model(mod, builder.values, num_input=len(inputs))


def dense(bb: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, b: relax.Expr) -> relax.Expr:
    """x @ W + b over x's rows: an N-D x is flattened first, so the weight gradient is one
    GEMM Xᵀ dY over all rows (not a batched product summed afterwards)."""
    shape = [int(d) for d in x.ty.shape.values]
    if len(shape) > 2:
        x = bb.emit(relax.op.reshape(x, (int(np.prod(shape[:-1])), shape[-1])))
    y = bb.emit(relax.op.add(relax.op.matmul(x, w), b))
    if len(shape) > 2:
        y = bb.emit(relax.op.reshape(y, (*shape[:-1], int(w.ty.shape.values[1]))))
    return y


def mlp(batch: int, sizes: Sequence[int], activation: str = "relu", seed: int = 0) -> Model:
    """A multi-layer perceptron: Linear (+activation) per layer, no activation at the end."""
    act = {"relu": relax.op.nn.relu, "gelu": relax.op.nn.gelu, "tanh": relax.op.tanh,
           "sigmoid": relax.op.sigmoid}[activation]
    x = relax.Var("x", relax.TensorType((batch, sizes[0]), F32))
    pb = ParamBuilder(seed)

    def body(bb):
        h = x
        for i, (fi, fo) in enumerate(zip(sizes[:-1], sizes[1:])):
            w, b = pb.linear(f"fc{i}", fi, fo)
            h = dense(bb, h, w, b)
            if i < len(sizes) - 2:
                h = bb.emit(act(h))
        return h

    return trace_model([x], pb, body)


def bert_layer(batch: int, seq: int, hidden: int, heads: int, intermediate: int,
               seed: int = 0, eps: float = 1e-12) -> Model:
    """One BERT encoder layer (post-LN): self-attention, add & norm, GELU FFN, add & norm.

    Parameters: ``{q,k,v,o}.weight/bias``, ``ln1.*``, ``ffn1.*``, ``ffn2.*``, ``ln2.*``.
    """
    if hidden % heads:
        raise ValueError(f"bert_layer: hidden {hidden} is not a multiple of heads {heads}")
    dh = hidden // heads
    x = relax.Var("x", relax.TensorType((batch, seq, hidden), F32))
    pb = ParamBuilder(seed)
    op = relax.op

    def heads_first(bb, t):
        t = bb.emit(op.reshape(t, (batch, seq, heads, dh)))
        return bb.emit(op.permute_dims(t, [0, 2, 1, 3]))

    def norm(bb, name, t):
        g = pb.param(f"{name}.weight", np.ones(hidden) + 0.1 * pb.rng.standard_normal(hidden))
        b = pb.param(f"{name}.bias", 0.1 * pb.rng.standard_normal(hidden))
        return bb.emit(op.nn.layer_norm(t, g, b, axes=[-1], epsilon=eps))

    def body(bb):
        q, k, v = (heads_first(bb, dense(bb, x, *pb.linear(n, hidden, hidden)))
                   for n in ("q", "k", "v"))
        kt = bb.emit(op.permute_dims(k, [0, 1, 3, 2]))
        scores = bb.emit(op.divide(op.matmul(q, kt), relax.const(np.sqrt(dh), F32)))
        probs = bb.emit(op.nn.softmax(scores, axis=-1))
        ctx = bb.emit(op.permute_dims(op.matmul(probs, v), [0, 2, 1, 3]))
        ctx = bb.emit(op.reshape(ctx, (batch, seq, hidden)))
        attn = dense(bb, ctx, *pb.linear("o", hidden, hidden))
        h1 = norm(bb, "ln1", bb.emit(op.add(attn, x)))
        ff = bb.emit(op.nn.gelu(dense(bb, h1, *pb.linear("ffn1", hidden, intermediate))))
        ff = dense(bb, ff, *pb.linear("ffn2", intermediate, hidden))
        return norm(bb, "ln2", bb.emit(op.add(ff, h1)))

    return trace_model([x], pb, body)


def small_cnn(batch: int, channels: int = 3, size: int = 16, width: int = 8,
              classes: int = 10, seed: int = 0) -> Model:
    """conv3x3-relu-maxpool, conv3x3-relu-maxpool, flatten, linear (NCHW, OIHW filters).

    Parameters: ``conv{0,1}.weight/bias`` (bias as (C, 1, 1)), ``fc.weight/bias``.
    """
    x = relax.Var("x", relax.TensorType((batch, channels, size, size), F32))
    pb = ParamBuilder(seed)
    op = relax.op

    def conv(bb, name, t, c_in, c_out):
        bound = 1.0 / np.sqrt(c_in * 9)
        w = pb.param(f"{name}.weight", pb.rng.uniform(-bound, bound, (c_out, c_in, 3, 3)))
        b = pb.param(f"{name}.bias", pb.rng.uniform(-bound, bound, (c_out, 1, 1)))
        t = bb.emit(op.add(op.nn.conv2d(t, w, padding=[1, 1]), b))
        t = bb.emit(op.nn.relu(t))
        return bb.emit(op.nn.max_pool2d(t, pool_size=[2, 2], strides=[2, 2]))

    def body(bb):
        h = conv(bb, "conv0", x, channels, width)
        h = conv(bb, "conv1", h, width, 2 * width)
        flat = 2 * width * (size // 4) ** 2
        h = bb.emit(op.reshape(h, (batch, flat)))
        return dense(bb, h, *pb.linear("fc", flat, classes))

    return trace_model([x], pb, body)
