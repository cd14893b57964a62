"""Random ONNX graphs built from the operators tpp_tvm's pattern table handles.

A hypothesis strategy (:func:`graphs`) draws a small model: a chain of MatMul/Gemm/Conv with
random shapes, strides, pads and groups, and the element-wise, normalization, pooling and
attention ops around them, with broadcasting constants and sizes that include 1 and primes.
Everything is drawn from hypothesis choices, so a failing graph shrinks to a minimal one.
Weights and inputs come from a drawn seed; values stay in a range where every op is exact
enough to compare against ONNX Runtime (no division by values near 0, no log of negatives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
#: Sizes worth covering: 1 (broadcasts, degenerate GEMMs), primes (vector tails), 8/16.
SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 17)
SMALL = (1, 2, 3, 5, 7)
UNARY = ("Relu", "Sigmoid", "Tanh", "LeakyRelu", "Clip6", "Erf", "Abs", "Neg", "Gelu",
         "GeluTanh", "Silu", "HardSigmoid", "Elu")


@dataclass
class Builder:
    """Accumulates nodes and constants; ``value`` names the chain's current tensor."""

    rng: np.random.Generator
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    outputs: list = field(default_factory=list)  # (name, shape)
    count: int = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}{self.count}"

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        name = self.name(hint)
        array = np.asarray(array)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, shape: tuple[int, ...], fan_in: int) -> str:
        w = self.rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
        return self.const(w.astype(np.float32), "w")

    def node(self, op: str, inputs: list[str], hint: str | None = None, **attrs) -> str:
        out = self.name(hint or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "_node", **attrs))
        return out


def _unary(b: Builder, op: str, x: str) -> str:
    if op == "Clip6":
        return b.node("Clip", [x, b.const(np.float32(0)), b.const(np.float32(6))])
    if op == "LeakyRelu":
        return b.node("LeakyRelu", [x], alpha=0.1)
    if op == "HardSigmoid":
        return b.node("HardSigmoid", [x], alpha=0.2, beta=0.5)
    if op == "Gelu":  # the decomposed form exporters write (opset < 20)
        e = b.node("Erf", [b.node("Div", [x, b.const(np.float32(np.sqrt(2)))])])
        one = b.node("Add", [e, b.const(np.float32(1))])
        return b.node("Mul", [b.node("Mul", [x, one]), b.const(np.float32(0.5))])
    if op == "GeluTanh":
        cube = b.node("Mul", [b.node("Mul", [x, x]), x])
        inner = b.node("Add", [x, b.node("Mul", [cube, b.const(np.float32(0.044715))])])
        t = b.node("Tanh", [b.node("Mul", [inner, b.const(np.float32(np.sqrt(2 / np.pi)))])])
        half = b.node("Mul", [x, b.const(np.float32(0.5))])
        return b.node("Mul", [half, b.node("Add", [t, b.const(np.float32(1))])])
    if op == "Silu":
        return b.node("Mul", [x, b.node("Sigmoid", [x])])
    return b.node(op, [x])


def _broadcast_shape(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape``: a suffix of it with some dims set to 1."""
    rank = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - rank:]
    return tuple(d if draw(st.booleans()) else 1 for d in tail)


def _binary(draw, b: Builder, x: str, shape: tuple[int, ...]) -> str:
    op = draw(st.sampled_from(("Add", "Mul", "Sub", "Div")))
    cshape = _broadcast_shape(draw, shape)
    c = b.rng.uniform(0.5, 1.5, cshape).astype(np.float32)
    if op != "Div":
        c *= b.rng.choice([-1.0, 1.0], cshape).astype(np.float32)
    operands = [x, b.const(c)]
    if op != "Div" and draw(st.booleans()):
        operands.reverse()
    return b.node(op, operands)


def _conv(draw, b: Builder, x: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    n, c, h, w = shape
    kind = draw(st.sampled_from(("plain", "grouped", "depthwise", "pointwise")))
    if kind == "depthwise":
        groups, m = c, c * draw(st.sampled_from((1, 1, 2)))
    elif kind == "grouped":
        groups = draw(st.sampled_from([g for g in range(1, c + 1) if c % g == 0]))
        m = groups * draw(st.sampled_from((1, 2, 3)))
    else:
        groups, m = 1, draw(st.sampled_from(SIZES))
    k = (1, 1) if kind == "pointwise" else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = draw(st.sampled_from((1, 1, 2)))
    strides = (stride, stride) if draw(st.booleans()) else (stride, draw(st.integers(1, 2)))
    dil = draw(st.sampled_from((1, 1, 1, 2)))
    pads = [draw(st.integers(0, kk // 2 + 1 if kk > 1 else 0)) for kk in k * 2]
    out_hw = []
    for i, size in enumerate((h, w)):
        span = dil * (k[i] - 1) + 1
        out_hw.append((size + pads[i] + pads[i + 2] - span) // strides[i] + 1)
    if min(out_hw) < 1:  # window larger than the padded input: use a 1x1 kernel
        k, pads, dil = (1, 1), [0, 0, 0, 0], 1
        out_hw = [(size - 1) // s + 1 for size, s in zip((h, w), strides)]
    inputs = [x, b.weight((m, c // groups, *k), c // groups * k[0] * k[1])]
    if draw(st.booleans()):
        inputs.append(b.const(b.rng.standard_normal(m).astype(np.float32)))
    y = b.node("Conv", inputs, kernel_shape=list(k), strides=list(strides), pads=pads,
               dilations=[dil, dil], group=groups)
    return y, (n, m, *out_hw)


def _pool(draw, b: Builder, x: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    n, c, h, w = shape
    op = draw(st.sampled_from(("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")))
    if op.startswith("Global"):
        return b.node(op, [x]), (n, c, 1, 1)
    k = (draw(st.integers(1, min(3, h))), draw(st.integers(1, min(3, w))))
    stride = draw(st.integers(1, 2))
    pads = [draw(st.integers(0, kk - 1)) for kk in k * 2]
    ceil = int(draw(st.booleans())) if draw(st.booleans()) else 0
    attrs = dict(kernel_shape=list(k), strides=[stride, stride], pads=pads, ceil_mode=ceil)
    if op == "AveragePool":
        attrs["count_include_pad"] = int(draw(st.booleans()))
    spans = [size + pads[i] + pads[i + 2] - k[i] for i, size in enumerate((h, w))]
    if ceil and any((-(-span // stride)) * stride >= size + pads[i]
                    for i, (span, size) in enumerate(zip(spans, (h, w)))):
        # A last window starting past the input: opsets and runtimes disagree on keeping it.
        ceil = attrs["ceil_mode"] = 0
    out_hw = [-(-span // stride) + 1 if ceil else span // stride + 1 for span in spans]
    return b.node(op, [x], **attrs), (n, c, *out_hw)


def _norm2d(draw, b: Builder, x: str, shape: tuple[int, ...]) -> str:
    c = shape[1]
    if draw(st.booleans()):
        params = [b.rng.uniform(0.5, 1.5, c), b.rng.standard_normal(c),
                  b.rng.standard_normal(c), b.rng.uniform(0.5, 2.0, c)]
        return b.node("BatchNormalization", [x, *(b.const(p.astype(np.float32))
                                                   for p in params)], epsilon=1e-5)
    scale, bias = b.rng.uniform(0.5, 1.5, c), b.rng.standard_normal(c)
    return b.node("InstanceNormalization", [x, b.const(scale.astype(np.float32)),
                                            b.const(bias.astype(np.float32))], epsilon=1e-5)


def _image_chain(draw, b: Builder, x: str, shape: tuple[int, ...]) -> tuple[str, tuple]:
    for _ in range(draw(st.integers(1, 4))):
        step = draw(st.sampled_from(("conv", "conv", "pool", "norm", "unary", "binary",
                                     "residual")))
        if step == "conv":
            x, shape = _conv(draw, b, x, shape)
        elif step == "pool":
            x, shape = _pool(draw, b, x, shape)
        elif step == "norm":
            x = _norm2d(draw, b, x, shape)
        elif step == "unary":
            x = _unary(b, draw(st.sampled_from(UNARY)), x)
        elif step == "binary":
            x = _binary(draw, b, x, shape)
        else:  # x + act(conv(x)) with a shape-preserving 3x3 or 1x1 convolution
            c = shape[1]
            k = draw(st.sampled_from((1, 3)))
            y = b.node("Conv", [x, b.weight((c, c, k, k), c * k * k)], kernel_shape=[k, k],
                       pads=[k // 2] * 4)
            y = _unary(b, draw(st.sampled_from(("Relu", "Sigmoid"))), y)
            x = b.node("Add", [y, x] if draw(st.booleans()) else [x, y])
        _maybe_expose(draw, b, x, shape)
    if draw(st.booleans()):  # classifier head: Flatten -> Gemm (-> Softmax)
        flat = int(np.prod(shape[1:]))
        x = b.node("Flatten", [x], axis=1)
        x, shape = _gemm(draw, b, x, (shape[0], flat))
        if draw(st.booleans()):
            x = b.node("Softmax", [x], axis=-1)
    return x, shape


def _gemm(draw, b: Builder, x: str, shape: tuple[int, int]) -> tuple[str, tuple[int, int]]:
    m, k = shape
    n = draw(st.sampled_from(SIZES))
    trans_b = int(draw(st.booleans()))
    w = b.weight((n, k) if trans_b else (k, n), k)
    inputs = [x, w]
    attrs = dict(transB=trans_b, alpha=draw(st.sampled_from((1.0, 1.0, 0.5))))
    if draw(st.booleans()):
        cshape = draw(st.sampled_from(((n,), (1, n), (m, n), (m, 1), ())))
        inputs.append(b.const(b.rng.standard_normal(cshape).astype(np.float32)))
        attrs["beta"] = draw(st.sampled_from((1.0, 1.0, 2.0)))
    return b.node("Gemm", inputs, **attrs), (m, n)


def _attention(draw, b: Builder, x: str, shape: tuple[int, ...]) -> str:
    """Multi-head self-attention as exporters write it (reshape/transpose per head)."""
    bsz, seq, dim = shape
    heads = draw(st.sampled_from([h for h in (1, 2, 3, 4) if dim % h == 0]))
    dh = dim // heads

    def heads_of(t: str, perm: list[int]) -> str:
        r = b.node("Reshape", [t, b.const(np.array([bsz, seq, heads, dh], np.int64))])
        return b.node("Transpose", [r], perm=perm)

    q, k, v = (b.node("MatMul", [x, b.weight((dim, dim), dim)]) for _ in range(3))
    qh, kt, vh = heads_of(q, [0, 2, 1, 3]), heads_of(k, [0, 2, 3, 1]), heads_of(v, [0, 2, 1, 3])
    scores = b.node("MatMul", [qh, kt])
    if draw(st.booleans()):
        scores = b.node("Div", [scores, b.const(np.float32(np.sqrt(dh)))])
    else:
        scores = b.node("Mul", [scores, b.const(np.float32(1 / np.sqrt(dh)))])
    if draw(st.booleans()):
        mask = np.where(b.rng.random((bsz, 1, 1, seq)) < 0.3, -1e4, 0).astype(np.float32)
        mask[..., 0] = 0
        scores = b.node("Add", [scores, b.const(mask)])
    probs = b.node("Softmax", [scores], axis=-1)
    ctx = b.node("Transpose", [b.node("MatMul", [probs, vh])], perm=[0, 2, 1, 3])
    return b.node("Reshape", [ctx, b.const(np.array([bsz, seq, dim], np.int64))])


def _sequence_chain(draw, b: Builder, x: str, shape: tuple[int, ...]) -> tuple[str, tuple]:
    for _ in range(draw(st.integers(1, 4))):
        steps = ["matmul", "matmul", "layernorm", "softmax", "unary", "binary", "reduce",
                 "bmm"]
        if len(shape) == 3:
            steps.append("attention")
        if len(shape) == 2:
            steps.append("gemm")
        step = draw(st.sampled_from(steps))
        if step == "matmul":
            n = draw(st.sampled_from(SIZES))
            x = b.node("MatMul", [x, b.weight((shape[-1], n), shape[-1])])
            shape = (*shape[:-1], n)
            if draw(st.booleans()):
                x = b.node("Add", [x, b.const(b.rng.standard_normal(n).astype(np.float32))])
        elif step == "gemm":
            x, shape = _gemm(draw, b, x, shape)
        elif step == "layernorm":
            d = shape[-1]
            x = b.node("LayerNormalization",
                       [x, b.const(b.rng.uniform(0.5, 1.5, d).astype(np.float32)),
                        b.const(b.rng.standard_normal(d).astype(np.float32))],
                       axis=-1, epsilon=1e-5)
        elif step == "softmax":
            x = b.node("Softmax", [x], axis=draw(st.sampled_from((-1, -1, 0, 1))))
        elif step == "unary":
            x = _unary(b, draw(st.sampled_from(UNARY)), x)
        elif step == "binary":
            x = _binary(draw, b, x, shape)
        elif step == "reduce":
            x = b.node("ReduceMean", [x], axes=[-1], keepdims=1)
            shape = (*shape[:-1], 1)
        elif step == "bmm":  # x @ xᵀ: a matmul of two activations
            perm = list(range(len(shape)))
            perm[-2:] = perm[-1], perm[-2]
            x = b.node("MatMul", [x, b.node("Transpose", [x], perm=perm)])
            x = b.node("Mul", [x, b.const(np.float32(1 / max(shape[-1], 1)))])
            shape = (*shape[:-1], shape[-2])
        else:
            x = _attention(draw, b, x, shape)
        _maybe_expose(draw, b, x, shape)
    return x, shape


def _maybe_expose(draw, b: Builder, x: str, shape: tuple[int, ...]) -> None:
    """Sometimes make an intermediate a graph output too: a value used inside and outside
    a fusable subgraph."""
    if draw(st.integers(0, 5)) == 0 and x not in {o[0] for o in b.outputs}:
        b.outputs.append((x, shape))


@dataclass
class Graph:
    """A drawn model and its inputs."""

    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return onnx.printer.to_text(self.model.graph)


@st.composite
def graphs(draw) -> Graph:
    """A random small ONNX model over the TPP-handled operators, with its inputs."""
    seed = draw(st.integers(0, 2**16))
    b = Builder(np.random.default_rng(seed))
    kind = draw(st.sampled_from(("image", "sequence2d", "sequence3d")))
    if kind == "image":
        shape = (draw(st.sampled_from((1, 2))), draw(st.sampled_from(SIZES)),
                 draw(st.sampled_from(SIZES[1:])), draw(st.sampled_from(SIZES[1:])))
    elif kind == "sequence2d":
        shape = (draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES)))
    else:
        shape = (draw(st.sampled_from(SMALL)), draw(st.sampled_from(SIZES)),
                 draw(st.sampled_from((2, 4, 6, 8, 12, 16))))
    x = "x"
    chain = _image_chain if kind == "image" else _sequence_chain
    y, out_shape = chain(draw, b, x, shape)
    outputs = [o for o in b.outputs if o[0] != y] + [(y, out_shape)]
    graph = helper.make_graph(
        b.nodes, "fuzz", [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name, _ in outputs],
        b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    inputs = {x: b.rng.standard_normal(shape).astype(np.float32)}
    return Graph(model, inputs)
