"""Optimizers as one fused element-wise kernel over every parameter.

A training step ends with the update of all parameters and their optimizer state. Here that
is a single PrimFunc (one kernel call per step): one block per parameter computes the new
parameter and its new state in one pass over (param, grad, state), the way LIBXSMM fuses an
optimizer into one TPP equation per tensor. Step-dependent scalars (learning rate, Adam's
bias corrections) come in as a small tensor, so a learning-rate schedule needs no recompile.

The math follows ``torch.optim`` exactly (same order of operations where it matters for
fp32), so losses can be compared step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tvm import s_tir, te, tirx

from ..errors import TPPError

#: Inner vector width of the update loops (fp32 AVX-512 lanes).
VECTOR = 16
#: Below this many elements a parameter's update stays on one thread.
MIN_PARALLEL = 16384


class OptimizerConfigError(TPPError):
    """An optimizer hyper-parameter out of range (the message names it and the range)."""


@dataclass(frozen=True)
class SGD:
    """SGD with optional momentum and L2 weight decay (``torch.optim.SGD``, dampening 0)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_range("SGD", "lr", self.lr, 0.0)
        _check_range("SGD", "momentum", self.momentum, 0.0, 1.0)
        _check_range("SGD", "weight_decay", self.weight_decay, 0.0)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def scalars(self, step: int) -> np.ndarray:
        """Per-step scalars: [lr]."""
        return np.array([self.lr], dtype="float32")

    def update(self, p, g, states, h):
        """New (param, *states) element expressions from param p, grad g, states, scalars h."""
        lr = h[0]
        if self.weight_decay:
            g = g + tirx.const(self.weight_decay, "float32") * p
        if not self.momentum:
            return (p - lr * g,)
        buf = tirx.const(self.momentum, "float32") * states[0] + g
        return (p - lr * buf, buf)


@dataclass(frozen=True)
class AdamW:
    """Adam with decoupled weight decay (``torch.optim.AdamW``, amsgrad off)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        _check_range("AdamW", "lr", self.lr, 0.0)
        _check_range("AdamW", "betas[0]", self.betas[0], 0.0, 1.0)
        _check_range("AdamW", "betas[1]", self.betas[1], 0.0, 1.0)
        _check_range("AdamW", "eps", self.eps, 0.0)
        _check_range("AdamW", "weight_decay", self.weight_decay, 0.0)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def scalars(self, step: int) -> np.ndarray:
        """Per-step scalars, as torch computes them: [lr, lr * wd, lr / bc1, 1 / sqrt(bc2)]."""
        bc1 = 1.0 - self.betas[0] ** step
        bc2 = 1.0 - self.betas[1] ** step
        return np.array([self.lr, self.lr * self.weight_decay, self.lr / bc1,
                         1.0 / math.sqrt(bc2)], dtype="float32")

    def update(self, p, g, states, h):
        b1, b2 = self.betas
        one = tirx.const(1.0, "float32")
        p = p * (one - h[1])
        m = tirx.const(b1, "float32") * states[0] + tirx.const(1.0 - b1, "float32") * g
        v = tirx.const(b2, "float32") * states[1] + tirx.const(1.0 - b2, "float32") * g * g
        denom = tirx.sqrt(v) * h[3] + tirx.const(self.eps, "float32")
        return (p - h[2] * m / denom, m, v)


Optimizer = SGD | AdamW


def _check_range(opt: str, name: str, value: float, low: float, high: float | None = None
                 ) -> None:
    ok = value >= low and (high is None or value < high)
    if not ok:
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise OptimizerConfigError(f"{opt}: {name}={value} out of range; must be {bound}")


def optimizer_kernel(opt: Optimizer, shapes: list[tuple[int, ...]]) -> tirx.PrimFunc:
    """The fused update of all parameters: one scheduled PrimFunc.

    Parameters in order: params, grads, states (per state kind, all params), scalars;
    then outputs: new params, new states (same order).
    """
    n_states = len(opt.state_names)
    n_scalars = len(opt.scalars(1))
    params = [te.placeholder(s, "float32", name=f"p{i}") for i, s in enumerate(shapes)]
    grads = [te.placeholder(s, "float32", name=f"g{i}") for i, s in enumerate(shapes)]
    states = [[te.placeholder(s, "float32", name=f"s{k}_{i}") for i, s in enumerate(shapes)]
              for k in range(n_states)]
    h = te.placeholder((n_scalars,), "float32", name="scalars")
    new_params, new_states = [], [[] for _ in range(n_states)]
    def updater(i: int):
        return lambda *ix: opt.update(params[i][ix], grads[i][ix],
                                      [states[k][i][ix] for k in range(n_states)], h)

    for i, shape in enumerate(shapes):
        outs = te.compute(shape, updater(i), name=f"update{i}")
        outs = outs if isinstance(outs, list | tuple) else [outs]
        new_params.append(outs[0])
        for k in range(n_states):
            new_states[k].append(outs[1 + k])
    outs_per_param = [None] * (1 + n_states)
    args = [*params, *grads, *(s for per in states for s in per), h,
            *new_params, *(s for per in new_states for s in per)]
    func = te.create_prim_func(args)
    sch = s_tir.Schedule(func)
    for i, shape in enumerate(shapes):
        # A multi-output update is one loop nest with a block per output.
        block = sch.get_sblock(f"update{i}" if len(outs_per_param) == 1 else f"update{i}_v0")
        loops = sch.get_loops(block)
        flat = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        size = int(np.prod(shape))
        if size % VECTOR == 0:
            outer, inner = sch.split(flat, [None, VECTOR])
            sch.vectorize(inner)
            if size >= MIN_PARALLEL:
                sch.parallel(outer)
        elif size >= MIN_PARALLEL:
            sch.parallel(flat)
    return sch.mod["main"]
