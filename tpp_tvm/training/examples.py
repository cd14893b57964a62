"""Two custom operators written as TE expressions, and small models that train with them.

* :func:`swiglu` — the gated activation of LLaMA-style FFNs, ``silu(a) * b``;
* :func:`attention_scores` — ``S[b, i, j] = scale · Σ_d Q[b, i, d] K[b, j, d]`` (Q Kᵀ
  without materialising Kᵀ), a contraction whose gradients (dQ = dS K, dK = dSᵀ Q) are
  derived.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx

from .custom_op import CustomOp, custom_op
from .models import F32, ParamBuilder, dense, trace_model
from .step import Model


def swiglu() -> CustomOp:
    """``silu(a) * b`` element-wise."""
    return custom_op("swiglu", lambda a, b: te.compute(
        a.shape, lambda *i: a[i] * tirx.sigmoid(a[i]) * b[i], name="swiglu"))


def attention_scores(scale: float) -> CustomOp:
    """``S = scale · Q Kᵀ`` per batch entry, Q (B, M, D), K (B, N, D)."""
    def fcompute(q, k):
        d = te.reduce_axis((0, q.shape[-1]), "d")
        return te.compute((q.shape[0], q.shape[1], k.shape[1]),
                          lambda b, i, j: te.sum(q[b, i, d] * k[b, j, d]
                                                 * tirx.const(scale, F32), axis=d),
                          name="scores")

    return custom_op("attention_scores", fcompute)


def swiglu_ffn(batch: int, dim: int, hidden: int, seed: int = 0) -> Model:
    """``(swiglu(x Wg + bg, x Wu + bu)) Wd + bd``: a gated FFN using :func:`swiglu`."""
    x = relax.Var("x", relax.TensorType((batch, dim), F32))
    pb = ParamBuilder(seed)
    op = swiglu()

    def body(bb):
        gate = dense(bb, x, *pb.linear("gate", dim, hidden))
        up = dense(bb, x, *pb.linear("up", dim, hidden))
        return dense(bb, op(bb, gate, up), *pb.linear("down", hidden, dim))

    return trace_model([x], pb, body)


def score_attention(batch: int, seq: int, dim: int, seed: int = 0) -> Model:
    """Single-head attention whose scores are :func:`attention_scores`, then an output
    projection: ``softmax(scores(x Wq, x Wk)) (x Wv) Wo``."""
    x = relax.Var("x", relax.TensorType((batch, seq, dim), F32))
    pb = ParamBuilder(seed)
    op = attention_scores(1.0 / np.sqrt(dim))

    def body(bb):
        q, k, v = (dense(bb, x, *pb.linear(n, dim, dim)) for n in ("q", "k", "v"))
        probs = bb.emit(relax.op.nn.softmax(op(bb, q, k), axis=-1))
        ctx = bb.emit(relax.op.matmul(probs, v))
        return dense(bb, ctx, *pb.linear("o", dim, dim))

    return trace_model([x], pb, body)
