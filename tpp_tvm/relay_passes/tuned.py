"""Tuned kernels for TPP subgraphs: the tuning unit of a Relax model and its lowering.

The graph pass lowers each matched subgraph (a composite function) to one hand-scheduled
kernel. For tuning, the same subgraph is legalized and fused by TVM into one plain PrimFunc
(``composite_kernel``) — the workload MetaSchedule searches with the TPP rules. A build
with a tuning log uses the tuned kernel for a subgraph when the log has one and it beat
the hand schedule when both were timed at tuning time; everything else keeps the hand
schedules.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from ..schedules.elementwise import LEGALIZE_AS_TPP
from ..target import isa_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompositeKernel:
    """A composite legalized into one PrimFunc called with (params and constants)."""

    func: tirx.PrimFunc
    args: tuple[relax.Expr, ...]
    out: object


def _plain_function(func: relax.Function) -> relax.Function:
    for attr in ("Composite", "Primitive", "Codegen"):
        if func.attrs and attr in func.attrs:
            func = func.without_attr(attr)
    return func.with_attr("global_symbol", "main")


def composite_kernel(func: relax.Function, target: tvm.target.Target) -> CompositeKernel | None:
    """The composite's ops legalized and fused into one PrimFunc, or None if TVM fuses them
    into more than one kernel (such subgraphs keep their hand schedule)."""
    mod = tvm.IRModule({"main": _plain_function(func)})
    with target:
        mod = tvm.transform.Sequential([
            relax.transform.LegalizeOps(LEGALIZE_AS_TPP),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
        ])(mod)
    calls = []
    main = mod["main"]
    for block in main.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")):
                calls.append(value)
            elif not isinstance(value, relax.Var | relax.Tuple):
                return None
    if len(calls) != 1:
        return None
    call = calls[0]
    prim = mod[call.args[0]]
    args = tuple(call.args[1].fields)
    if not all(isinstance(a, relax.Var | tvm.ir.Constant) for a in args):
        return None
    params = list(main.params)
    if any(isinstance(a, relax.Var) and a not in params for a in args):
        return None
    prim = prim.with_attr("global_symbol", "main")
    # Constant operands (weights, biases) may be repacked once at build time (TVM's
    # convention, which the TPP rules and TVM's RewriteLayout both follow).
    weights = [i for i, a in enumerate(args) if isinstance(a, tvm.ir.Constant)]
    if weights:
        prim = prim.with_attr("layout_free_buffers", weights)
    for attr in ("op_pattern", "tirx.is_scheduled"):
        if prim.attrs and attr in prim.attrs:
            prim = prim.without_attr(attr)
    return CompositeKernel(prim, args, call.ty)


def emit_tuned(bb: relax.BlockBuilder, func: relax.Function, call_args: list[relax.Expr],
               kernel: CompositeKernel, scheduled: tirx.PrimFunc, name: str) -> relax.Expr:
    """Call the tuned kernel in place of the composite call."""
    scheduled = scheduled.without_attr("global_symbol").with_attrs(
        {"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
    gv = bb.add_func(scheduled, name)
    params = dict(zip(list(_plain_function(func).params), call_args))
    args = [params.get(a, a) if isinstance(a, relax.Var) else a for a in kernel.args]
    return relax.call_tir(gv, args, kernel.out)


def subgraph_tasks(mod: tvm.IRModule, target: tvm.target.Target, params: dict | None):
    """One tuning task per distinct TPP subgraph of ``mod`` (weight = occurrences), each
    with a comparison against its hand schedule."""
    from ..tuning.logs import workload_key
    from ..tuning.tasks import Task
    from .pipeline import partition_passes

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

    def compare(logs) -> dict:
        from .pipeline import build

        mod = tvm.IRModule({"main": _plain_function(func)})
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
    from .pipeline import build

    inputs = [tvm.runtime.tensor(x) for x in _random_inputs(mod["main"])]

    def evaluator(logs):
        exe = build(mod, target, params=params, tune_logs=logs)
        vm = relax.VirtualMachine(exe, tvm.cpu())
        vm["main"](*inputs)
        return vm.time_evaluator("main", tvm.cpu(), number=5, repeat=3)

    return evaluator, inputs


def confirm_in_model(mod: tvm.IRModule, target: tvm.target.Target, params: dict | None,
                     logs, choices: dict) -> dict:
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
    from ..tuning.logs import TuneLogs

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
