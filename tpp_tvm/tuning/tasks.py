"""Tuning tasks: the PrimFuncs ``tune()`` searches, and how a tuned kernel is judged.

A PrimFunc (or an IRModule of them) is one task each, as given. A Relax model is tuned per
TPP subgraph (the unit the graph pass lowers: dense + bias + GELU, a convolution with its
epilogue, ...), legalized and fused into one plain PrimFunc, weighted by how often it
occurs; each carries a comparison that times the tuned kernel against the hand schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx

from .logs import workload_key


@dataclass
class Task:
    """One tunable PrimFunc; ``compare`` times tuned vs hand schedule when there is one."""

    name: str
    func: tirx.PrimFunc
    weight: int = 1
    compare: object = None

    @property
    def key(self) -> str:
        return workload_key(self.func)


def extract_tasks(mod, target: tvm.target.Target, params: dict | None = None) -> list[Task]:
    """Tasks of a PrimFunc / IRModule of PrimFuncs (as given) or a Relax model (one per
    distinct TPP subgraph, weighted by how often it occurs)."""
    if isinstance(mod, tirx.PrimFunc):
        return [Task("main", _plain(mod))]
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"tune() takes a PrimFunc or an IRModule, got {type(mod).__name__}")
    prims = [(gv.name_hint, f) for gv, f in mod.functions_items()
             if isinstance(f, tirx.PrimFunc)]
    if not has_relax(mod):
        return [Task(n, _plain(f)) for n, f in sorted(prims, key=lambda x: x[0])]
    from ..relay_passes.tuned import subgraph_tasks

    return subgraph_tasks(mod, target, params)


def has_relax(mod) -> bool:
    """Whether ``mod`` is a Relax model (tuned per subgraph) rather than PrimFuncs only."""
    return isinstance(mod, tvm.IRModule) and any(
        not isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items())


def _plain(func: tirx.PrimFunc) -> tirx.PrimFunc:
    return func.with_attr("global_symbol", "main")
