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
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..errors import TPPError

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

    def new_states(self, p, g, states, h):
        """The new optimizer state from param p, grad g, old states and scalars h."""
        if not self.momentum:
            return []
        return [tirx.const(self.momentum, "float32") * states[0] + self._grad(p, g)]

    def new_param(self, p, g, states, h):
        """The new parameter, given the already updated ``states``."""
        return p - h[0] * (states[0] if self.momentum else self._grad(p, g))

    def _grad(self, p, g):
        return g + tirx.const(self.weight_decay, "float32") * p if self.weight_decay else g


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

    def new_states(self, p, g, states, h):
        b1, b2 = self.betas
        return [tirx.const(b1, "float32") * states[0] + tirx.const(1.0 - b1, "float32") * g,
                tirx.const(b2, "float32") * states[1] + tirx.const(1.0 - b2, "float32") * g * g]

    def new_param(self, p, g, states, h):
        denom = tirx.sqrt(states[1]) * h[3] + tirx.const(self.eps, "float32")
        return p * (tirx.const(1.0, "float32") - h[1]) - h[2] * states[0] / denom


Optimizer = SGD | AdamW


def _check_range(opt: str, name: str, value: float, low: float, high: float | None = None
                 ) -> None:
    ok = value >= low and (high is None or value < high)
    if not ok:
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise OptimizerConfigError(f"{opt}: {name}={value} out of range; must be {bound}")


def optimizer_kernel(opt: Optimizer, shapes: list[tuple[int, ...]],
                     lanes: int) -> tirx.PrimFunc:
    """The fused in-place update of all parameters: one PrimFunc, one call per step.

    Parameters in order: params, grads, states (per state kind, all params), scalars.
    Params and states are updated in place (``call_tir_inplace``): no new buffers per
    step. Each parameter is one parallel loop over its elements, vectorized ``lanes`` wide
    (the target ISA's fp32 lanes, ``VectorISA.schedule_lanes``), that writes the new
    states, then the new parameter from them, in one pass.
    """
    n_states = len(opt.state_names)
    n_scalars = len(opt.scalars(1))
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("optimizer_update")
            params = [T.arg(f"p{i}", T.buffer(s, "float32")) for i, s in enumerate(shapes)]
            grads = [T.arg(f"g{i}", T.buffer(s, "float32")) for i, s in enumerate(shapes)]
            states = [[T.arg(f"s{k}_{i}", T.buffer(s, "float32")) for i, s in enumerate(shapes)]
                      for k in range(n_states)]
            h = T.arg("scalars", T.buffer((n_scalars,), "float32"))
            hv = [h[j] for j in range(n_scalars)]
            for i, shape in enumerate(shapes):
                size = int(np.prod(shape))
                # 1-D views of the N-D buffers (same data).
                flat = [T.decl_buffer((size,), "float32", data=b.data)
                        for b in (params[i], grads[i], *(states[k][i] for k in range(n_states)))]
                _update_loop(opt, flat, hv, size, lanes)
    return ib.get()


def _update_loop(opt: Optimizer, flat: list[tirx.Buffer], h: list, size: int,
                 lanes: int) -> None:
    """Elements [0, size) of one parameter: vector body (parallel when large) + tail."""
    def body(idx) -> None:
        p, g, *states = flat
        new = opt.new_states(p[idx], g[idx], [s[idx] for s in states], h)
        for buf, value in zip(states, new):
            T.buffer_store(buf, value, [idx])
        T.buffer_store(p, opt.new_param(p[idx], g[idx], [s[idx] for s in states], h), [idx])

    vectors = size // lanes
    if vectors:
        outer = T.parallel(0, vectors) if size >= MIN_PARALLEL else T.serial(0, vectors)
        with outer as o:
            with T.vectorized(0, lanes) as v:
                body(o * lanes + v)
    if size % lanes:
        with T.serial(vectors * lanes, size) as j:
            body(j)
