"""Tuning tasks: the PrimFuncs ``tune()`` searches, and how a tuned kernel is judged.

A PrimFunc (or an IRModule of them) is one task each, as given. A Relax model is tuned per
TPP subgraph (the unit the graph pass lowers: dense + bias + GELU, a convolution with its
epilogue, ...), legalized and fused into one plain PrimFunc, weighted by how often it
occurs; each carries a comparison that times the tuned kernel against the hand schedule.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from ..relay_passes.pipeline import build, partition_passes
from ..relay_passes.tuned import composite_kernel, plain_function
from ..target import isa_of
from .logs import TuneLogs, workload_key

log = logging.getLogger(__name__)


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


def extract_tasks(mod: tirx.PrimFunc | tvm.IRModule, target: tvm.target.Target,
                  params: dict | None = None) -> list[Task]:
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
    return subgraph_tasks(mod, target, params)


def has_relax(mod: object) -> bool:
    """Whether ``mod`` is a Relax model (tuned per subgraph) rather than PrimFuncs only."""
    return isinstance(mod, tvm.IRModule) and any(
        not isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items())


def _plain(func: tirx.PrimFunc) -> tirx.PrimFunc:
    return func.with_attr("global_symbol", "main")


def subgraph_tasks(mod: tvm.IRModule, target: tvm.target.Target, params: dict | None
                   ) -> list[Task]:
    """One tuning task per distinct TPP subgraph of ``mod`` (weight = occurrences), each
    with a comparison against its hand schedule."""
    if params:
        mod = relax.transform.BindParams("main", params)(mod)
    with target:
        mod = tvm.transform.Sequential(partition_passes(isa_of(target)))(mod)
    seen: dict[str, Task] = {}
    counts: Counter = Counter()
    for gv, func in mod.functions_items():
        if not (isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs):
            continue
        kernel = composite_kernel(func, target)
        if kernel is None:
            log.debug("%s: TVM fuses it into several kernels; not tuned", gv.name_hint)
            continue
        key = workload_key(kernel.func)
        counts[key] += 1
        if key not in seen:
            comp = str(func.attrs["Composite"]).replace(".", "_")
            seen[key] = Task(f"{comp}_{len(seen)}", kernel.func,
                             compare=_comparison(func, target))
    tasks = list(seen.values())
    for task in tasks:
        task.weight = counts[task.key]
    return tasks


def _random_inputs(func: relax.Function) -> list[np.ndarray]:
    """Fixed standard-normal inputs for ``func``'s parameters (timing only)."""
    rng = np.random.default_rng(0)
    return [np.asarray(rng.standard_normal([int(d) for d in p.ty.shape.values]),
                       dtype=str(p.ty.dtype)) for p in func.params]


def _comparison(func: relax.Function, target: tvm.target.Target):
    """Time the subgraph with its hand schedule and with the tuned kernel (same harness)."""

    def compare(logs: TuneLogs) -> dict:
        mod = tvm.IRModule({"main": plain_function(func)})
        inputs = _random_inputs(func)
        timers = {}
        for use, kwargs in (("hand", {}), ("tuned", {"tune_logs": logs, "force_tuned": True})):
            exe = build(mod, target, **kwargs)
            vm = relax.VirtualMachine(exe, tvm.cpu())
            args = [tvm.runtime.tensor(x) for x in inputs]
            vm["main"](*args)
            ev = vm.time_evaluator("main", tvm.cpu(), number=10, repeat=3)
            timers[use] = (ev, args)
        # Interleaved rounds, best median each: a busy machine slows both alike.
        times = {use: float("inf") for use in timers}
        for _ in range(3):
            for use, (ev, args) in timers.items():
                times[use] = min(times[use], float(np.median(ev(*args).results)) * 1e3)
        use = "tuned" if times["tuned"] < times["hand"] else "hand"
        return {"hand_ms": times["hand"], "tuned_vm_ms": times["tuned"], "use": use}

    return compare


def _model_timer(mod: tvm.IRModule, target: tvm.target.Target, params: dict | None):
    """(``evaluator(logs)``: a time evaluator of the whole model built with ``logs``, None
    for hand schedules only; the fixed random inputs to call it with)."""
    inputs = [tvm.runtime.tensor(x) for x in _random_inputs(mod["main"])]

    def evaluator(logs):
        exe = build(mod, target, params=params, tune_logs=logs)
        vm = relax.VirtualMachine(exe, tvm.cpu())
        vm["main"](*inputs)
        return vm.time_evaluator("main", tvm.cpu(), number=5, repeat=3)

    return evaluator, inputs


def confirm_in_model(mod: tvm.IRModule, target: tvm.target.Target, params: dict | None,
                     logs: TuneLogs, choices: dict) -> dict:
    """Keep a tuned kernel only if the whole model is faster with it (``choices`` updated).

    Subgraphs are compared one at a time with their weights hot in cache; in the model,
    weights arrive cold and kernels share caches, and tuned kernels that won alone made a
    BERT layer 1% and a ResNet block 4% slower than the hand schedules. Each kernel the
    isolated comparison chose is tried alone in the model, then the survivors together;
    whatever does not beat the hand-only model goes back to the hand schedule.
    """
    tuned = sorted(k for k, e in choices.items() if e.get("use") == "tuned")
    if not tuned:
        return choices

    def variant(keys) -> TuneLogs:
        picked = {k: {**e, "use": "tuned" if k in keys else "hand"}
                  for k, e in choices.items()}
        return TuneLogs(logs.path, logs.database, logs.target, picked)

    evaluator, inputs = _model_timer(mod, target, params)

    def best_ms(*variants) -> list[float]:
        evs = [evaluator(v) for v in variants]
        best = [float("inf")] * len(evs)
        for _ in range(3):  # interleaved: a busy machine slows every variant alike
            for i, ev in enumerate(evs):
                best[i] = min(best[i], 1e3 * float(np.median(ev(*inputs).results)))
        return best

    hand_ms, *alone = best_ms(None, *(variant({k}) for k in tuned))
    keep = {k for k, ms in zip(tuned, alone) if ms < hand_ms}
    if len(keep) > 1:
        hand_again, together = best_ms(None, variant(keep))
        if together >= hand_again:
            keep = {min(zip(alone, tuned))[1]} if min(alone) < hand_ms else set()
    for k, ms in zip(tuned, alone):
        choices[k]["model_hand_ms"] = hand_ms
        choices[k]["model_tuned_alone_ms"] = ms
        if k not in keep:
            choices[k]["use"] = "hand"
            log.info("tuned kernel %s: faster alone, slower in the model (%.3f vs %.3f ms): "
                     "hand schedule kept", choices[k].get("name"), ms, hand_ms)
    return choices
