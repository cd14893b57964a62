"""ONNX ``LSTM`` and ``GRU`` as Relax graphs unrolled over the (static) sequence.

TVM's ONNX converter has neither, so speech and time-series models using them did not
compile. The sequence length is static after :func:`tpp_tvm.frontend.clean_model`, so each
layer unrolls: the input projection of every step is one GEMM (``X Wᵀ + b`` for the whole
sequence, a TPP dense kernel), and each step is a small GEMM by the recurrent weights whose
result the step's input projection is added to (a dense kernel with a residual), then the
gates' element-wise math, which TVM fuses into one kernel per step. Identical steps share
their kernels. Unrolling costs compile time per step (a 2-layer LSTM over 100 steps:
66-112 s on one Zen 3 core, longer than a 12-layer BERT), and the graph grows with the
sequence.

Follows the operator specification (opset 7-22): gate order ``i, o, f, c`` (LSTM) and
``z, r, h`` (GRU), biases ``[Wb, Rb]``, ``forward``/``reverse``/``bidirectional``,
``layout`` 0 and 1, initial states, LSTM peepholes and ``input_forget``, GRU's
``linear_before_reset`` both ways, ``clip``, and the activations Sigmoid, Tanh and Relu.
What is outside that (other activations, ``sequence_lens`` shorter than the sequence) is an
:class:`~tpp_tvm.errors.UnsupportedOperatorError` naming the node and the attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .errors import UnsupportedOperatorError

#: ONNX activation names the converters apply, as Relax ops.
_RECURRENT_ACTIVATIONS: dict[str, Callable[[relax.Expr], relax.Expr]] = {
    "sigmoid": relax.op.sigmoid,
    "tanh": relax.op.tanh,
    "relu": relax.op.nn.relu,
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Recurrence:
    """What LSTM and GRU share: attributes, shapes, the per-direction operands."""

    def __init__(self, op: str, gates: int, bb: Any, inputs: list, attrs: dict) -> None:
        self.op, self.bb = op, bb
        self.node = attrs.get("tvm_custom", {}).get("name", "?")
        x, w, r = inputs[:3]
        self.layout = int(attrs.get("layout", 0))
        if self.layout:
            x = relax.op.permute_dims(x, [1, 0, 2])  # -> (seq, batch, input)
        self.x = bb.normalize(x)
        shape = [int(d) for d in self.x.ty.shape.values]
        self.seq, self.batch = shape[0], shape[1]
        self.hidden = int(w.ty.shape.values[1]) // gates
        self.gates = gates
        direction = _text(attrs.get("direction", "forward"))
        if direction not in ("forward", "reverse", "bidirectional"):
            self.unsupported(f"direction {direction!r}")
        self.reverse = {"forward": [False], "reverse": [True],
                        "bidirectional": [False, True]}[direction]
        names = [_text(a) for a in attrs.get("activations", [])]
        per_direction = 3 if op == "LSTM" else 2
        names = names or ["Sigmoid", "Tanh", "Tanh"][:per_direction] * len(self.reverse)
        for name in names:
            if name.lower() not in _RECURRENT_ACTIVATIONS:
                self.unsupported(f"activation {name!r} (supported: Sigmoid, Tanh, Relu)")
        self.activations = [[_RECURRENT_ACTIVATIONS[n.lower()] for n in names[d * per_direction:
                                                                    (d + 1) * per_direction]]
                            for d in range(len(self.reverse))]
        self.clip = float(attrs["clip"]) if "clip" in attrs else None
        self.w, self.r = w, r
        self.b = inputs[3] if len(inputs) > 3 else None
        lens = inputs[4] if len(inputs) > 4 else None
        if lens is not None:
            value = lens.value.numpy() if isinstance(lens, tvm.ir.Constant) else None
            if value is None or np.any(value != self.seq):
                self.unsupported("sequence_lens other than the full sequence")
        self.initial = [inputs[k] if len(inputs) > k else None for k in (5, 6)]

    def unsupported(self, what: str) -> None:
        raise UnsupportedOperatorError(f"{self.op} node {self.node!r}: {what} is not supported")

    def emit(self, expr: relax.Expr) -> relax.Expr:
        return self.bb.normalize(expr)

    def direction_weight(self, tensor: relax.Expr, d: int, axis: int = 0) -> relax.Expr:
        return self.emit(relax.op.take(tensor, relax.const(d, "int64"), axis=axis))

    def state(self, k: int, d: int) -> relax.Expr:
        """Initial hidden (k=0) or cell (k=1) state of direction ``d``, zeros by default."""
        given = self.initial[k]
        if given is None:
            return relax.const(np.zeros((self.batch, self.hidden), "float32"))
        return self.direction_weight(given, d, axis=1 if self.layout else 0)

    def activate(self, fn: Callable[[relax.Expr], relax.Expr], x: relax.Expr) -> relax.Expr:
        """``fn`` of ``x`` clipped to [-clip, clip] when the node clips."""
        if self.clip is not None:
            x = relax.op.minimum(relax.op.maximum(x, relax.const(-self.clip, "float32")),
                                 relax.const(self.clip, "float32"))
        return fn(x)

    def projections(self, d: int) -> tuple[relax.Expr, relax.Expr | None, relax.Expr]:
        """Every step's input projection ``X Wᵀ + Wb`` (seq, batch, gates*hidden), the
        recurrent bias ``Rb`` (or None) and ``Rᵀ`` of direction ``d``."""
        proj = relax.op.matmul(self.x, relax.op.permute_dims(self.direction_weight(self.w, d)))
        rb = None
        if self.b is not None:
            b = self.direction_weight(self.b, d)
            width = self.gates * self.hidden
            wb = relax.op.strided_slice(b, axes=[0], begin=[0], end=[width])
            rb = self.emit(relax.op.strided_slice(b, axes=[0], begin=[width], end=[2 * width]))
            proj = relax.op.add(proj, wb)
        return self.emit(proj), rb, self.emit(
            relax.op.permute_dims(self.direction_weight(self.r, d)))

    def step_inputs(self, proj: relax.Expr) -> list[relax.Expr]:
        """Each step's (batch, gates*hidden) rows of ``proj``: one split (one kernel), not
        a slice kernel per step."""
        rows = (self.batch, self.gates * self.hidden)
        if self.seq == 1:
            return [self.emit(relax.op.reshape(proj, rows))]
        parts = self.emit(relax.op.split(proj, self.seq, axis=0))
        return [self.emit(relax.op.reshape(relax.TupleGetItem(parts, t), rows))
                for t in range(self.seq)]

    def gate(self, g: relax.Expr, k: int, n: int = 1) -> relax.Expr:
        """Gates ``k .. k+n`` of a (batch, gates*hidden) tensor."""
        return relax.op.strided_slice(g, axes=[1], begin=[k * self.hidden],
                                      end=[(k + n) * self.hidden])

    def steps(self, d: int) -> list[int]:
        order = list(range(self.seq))
        return order[::-1] if self.reverse[d] else order

    def outputs(self, hs: list[list[relax.Expr]], finals: list[list[relax.Expr]]
                ) -> relax.Tuple:
        """Y (seq, dirs, batch, hidden), or (batch, seq, dirs, hidden) for layout 1, and
        each final state (dirs, batch, hidden), or (batch, dirs, hidden)."""
        # concat of expand_dims, not stack: ConvertLayout has no rule for stack.
        per_direction = [relax.op.concat([relax.op.expand_dims(h, 0) for h in steps], axis=0)
                         for steps in hs]
        y = relax.op.concat([relax.op.expand_dims(v, 1) for v in per_direction], axis=1)
        if self.layout:
            y = relax.op.permute_dims(y, [2, 0, 1, 3])
        out = [self.emit(y)]
        for states in finals:
            s = relax.op.concat([relax.op.expand_dims(v, 0) for v in states], axis=0)
            out.append(self.emit(relax.op.permute_dims(s, [1, 0, 2]) if self.layout else s))
        return relax.Tuple(out)


def lstm(bb: Any, inputs: list, attrs: dict) -> relax.Tuple:
    """ONNX LSTM: outputs ``Y, Y_h, Y_c``."""
    rec = _Recurrence("LSTM", 4, bb, inputs, attrs)
    peep = inputs[7] if len(inputs) > 7 else None
    couple = int(attrs.get("input_forget", 0))
    hs, last_h, last_c = [], [], []
    for d in range(len(rec.reverse)):
        f_act, g_act, h_act = rec.activations[d]
        proj, rb, rt = rec.projections(d)
        p = rec.direction_weight(peep, d) if peep is not None else None
        h, c = rec.state(0, d), rec.state(1, d)
        x_steps = rec.step_inputs(proj)
        outs = [None] * rec.seq
        for t in rec.steps(d):
            g = relax.op.add(relax.op.matmul(h, rt), x_steps[t])
            g = rec.emit(relax.op.add(g, rb) if rb is not None else g)
            i, o, f, cc = (rec.gate(g, k) for k in range(4))
            if p is not None:
                pi, po, pf = (relax.op.strided_slice(p, axes=[0], begin=[k * rec.hidden],
                                                     end=[(k + 1) * rec.hidden])
                              for k in range(3))
                i, f = relax.op.add(i, relax.op.multiply(pi, c)), \
                    relax.op.add(f, relax.op.multiply(pf, c))
            i = rec.activate(f_act, i)
            f = relax.op.subtract(relax.const(1.0, "float32"), i) if couple \
                else rec.activate(f_act, f)
            c = rec.emit(relax.op.add(relax.op.multiply(f, c),
                                      relax.op.multiply(i, rec.activate(g_act, cc))))
            if p is not None:
                o = relax.op.add(o, relax.op.multiply(po, c))
            h = rec.emit(relax.op.multiply(rec.activate(f_act, o), h_act(c)))
            outs[t] = h
        hs.append(outs)
        last_h.append(h)
        last_c.append(c)
    return rec.outputs(hs, [last_h, last_c])


def gru(bb: Any, inputs: list, attrs: dict) -> relax.Tuple:
    """ONNX GRU: outputs ``Y, Y_h``."""
    rec = _Recurrence("GRU", 3, bb, inputs, attrs)
    before_reset = int(attrs.get("linear_before_reset", 0))
    hs, last_h = [], []
    one = relax.const(1.0, "float32")
    for d in range(len(rec.reverse)):
        f_act, g_act = rec.activations[d]
        proj, rb, rt = rec.projections(d)
        h = rec.state(0, d)
        width = rec.hidden
        x_steps = rec.step_inputs(proj)
        outs = [None] * rec.seq
        for t in rec.steps(d):
            x_t = x_steps[t]
            if before_reset:  # h_t~ = g(Xh + r * (H Rhᵀ + Rbh))
                rec_all = relax.op.matmul(h, rt)
                rec_all = rec.emit(relax.op.add(rec_all, rb) if rb is not None else rec_all)
                zr = relax.op.add(rec.gate(x_t, 0, 2), rec.gate(rec_all, 0, 2))
                candidate_rec = None
            else:  # h_t~ = g(Xh + (r * H) Rhᵀ + Rbh)
                rt_zr = relax.op.strided_slice(rt, axes=[1], begin=[0], end=[2 * width])
                rec_zr = relax.op.matmul(h, rt_zr)
                if rb is not None:
                    rec_zr = relax.op.add(rec_zr, relax.op.strided_slice(
                        rb, axes=[0], begin=[0], end=[2 * width]))
                zr = relax.op.add(rec.gate(x_t, 0, 2), rec.emit(rec_zr))
                candidate_rec = relax.op.strided_slice(rt, axes=[1], begin=[2 * width],
                                                       end=[3 * width])
            zr = rec.emit(rec.activate(f_act, zr))
            z = relax.op.strided_slice(zr, axes=[1], begin=[0], end=[width])
            r = relax.op.strided_slice(zr, axes=[1], begin=[width], end=[2 * width])
            if candidate_rec is None:
                recurrent = relax.op.multiply(r, rec.gate(rec_all, 2))
            else:
                recurrent = relax.op.matmul(rec.emit(relax.op.multiply(r, h)), candidate_rec)
                if rb is not None:
                    recurrent = relax.op.add(recurrent, relax.op.strided_slice(
                        rb, axes=[0], begin=[2 * width], end=[3 * width]))
            n = rec.activate(g_act, relax.op.add(rec.gate(x_t, 2), recurrent))
            h = rec.emit(relax.op.add(relax.op.multiply(relax.op.subtract(one, z), n),
                                      relax.op.multiply(z, h)))
            outs[t] = h
        hs.append(outs)
        last_h.append(h)
    return rec.outputs(hs, [last_h])


#: Converters by ONNX op type (for :data:`tpp_tvm.frontend.converters.EXTRA_CONVERTERS`).
CONVERTERS: dict[str, Callable[..., Any]] = {"LSTM": lstm, "GRU": gru}
