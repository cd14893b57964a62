"""The tuning driver: ``tune()`` and ``recompare()``, local or RPC measurement, progress.

``tune(mod)`` searches schedules for every task of ``mod`` (:mod:`.tasks`) with the TPP
rules (:mod:`tpp_tvm.schedules.tuning_rules`) and TVM's XGBoost cost model, printing one
progress line per measured batch; model subgraphs are then timed against their hand
schedules so a build keeps the faster one. The result is a tuning log (:mod:`.logs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops

from ..errors import TPPError
from ..schedules.tuning_rules import space_generator
from ..target import target as tpp_target
from ..tir_pipeline import PIPELINE as TIR_PIPELINE
from .logs import (
    TuneLogs,
    TuningLogError,
    best_record,
    open_logs,
    prune_log,
    shipped_dir,
    target_tag,
)
from .tasks import Task, confirm_in_model, extract_tasks, has_relax


def _as_target(target) -> tvm.target.Target:
    tgt = target if target is not None else tpp_target()
    return tgt if isinstance(tgt, tvm.target.Target) else tvm.target.Target(tgt)


# ---------------------------------------------------------------------------
# Building and measuring candidates
# ---------------------------------------------------------------------------


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params=None):
    """MetaSchedule builder function: a runtime module without importing TVM's tensor
    intrinsic package (23 s per worker) — candidates arrive already tensorized."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    # Packed weights are timed as given packed (built once per model, not per call).
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target, pipeline=TIR_PIPELINE)


def make_runner(rpc_tracker: str | None = None, rpc_key: str | None = None,
                timeout_sec: float = 30.0) -> ms.Runner:
    """The local runner, or an ``RPCRunner`` measuring on boards behind a tracker.

    ``rpc_tracker`` is ``HOST:PORT`` of a ``python -m tvm.exec.rpc_tracker``; boards run
    ``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``.
    """
    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=50,
                                          enable_cpu_cache_flush=False)
    if rpc_tracker is None:
        return ms.runner.LocalRunner(evaluator_config=evaluator, timeout_sec=timeout_sec)
    host, _, port = rpc_tracker.rpartition(":")
    if not host or not port.isdigit() or not rpc_key:
        raise ValueError(f"RPC tracker must be HOST:PORT with a key, got {rpc_tracker!r} "
                         f"key={rpc_key!r}")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port),
                                 tracker_key=rpc_key, session_timeout_sec=timeout_sec)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator)


# ---------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------


@derived_object
class TuningProgress(ms.measure_callback.PyMeasureCallback):
    """One line per measured batch: task i of n, trials, best GFLOP/s, time left."""

    def __init__(self, names: list[str], flops: list[float], trials_per_task: int,
                 printer=print) -> None:
        self.names, self.flops, self.per_task = names, flops, trials_per_task
        self.trials = [0] * len(names)
        self.best = [float("inf")] * len(names)
        self.start = time.perf_counter()
        self.printer = printer

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        for res in runner_results:
            self.trials[task_id] += 1
            if res.error_msg is None and res.run_secs:
                secs = float(np.mean([float(s) for s in res.run_secs]))
                self.best[task_id] = min(self.best[task_id], secs)
        done, total = sum(self.trials), self.per_task * len(self.names)
        elapsed = time.perf_counter() - self.start
        left = elapsed / max(done, 1) * max(total - done, 0)
        best = self.best[task_id]
        gflops = self.flops[task_id] / best / 1e9 if best < float("inf") else 0.0
        self.printer(f"[tune] task {task_id + 1}/{len(self.names)} {self.names[task_id]}: "
                     f"{self.trials[task_id]}/{self.per_task} trials, best {gflops:.1f} GFLOP/s"
                     f" | {done}/{total} total, {elapsed:.0f}s elapsed, ~{left:.0f}s left")


# ---------------------------------------------------------------------------
# Tuning
# ---------------------------------------------------------------------------


@dataclass
class TuningResult:
    """What ``tune`` produced: the log folder and per-task outcome."""

    log_dir: Path
    tasks: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"tuning log: {self.log_dir} ({self.seconds:.0f} s)"]
        for t in self.tasks:
            hand = (f", as a subgraph {t['tuned_vm_ms']:.3f} ms vs hand {t['hand_ms']:.3f} ms"
                    if t.get("hand_ms") else "")
            if t.get("model_hand_ms"):
                hand += (f"; whole model {t['model_tuned_alone_ms']:.3f} ms with it vs "
                         f"{t['model_hand_ms']:.3f} ms hand")
            tuned = f"{t['tuned_ms']:.3f} ms" if t.get("tuned_ms") else "no valid schedule"
            lines.append(f"  {t['name']} x{t['weight']}: tuned {tuned}{hand}"
                         f" -> {t.get('use', 'tuned')}")
        return "\n".join(lines)


def _workload_dir(mod, name: str | None) -> str:
    if name:
        return name
    return "w" + hashlib.sha1(str(tvm_ffi.structural_hash(mod)).encode()).hexdigest()[:10]


def tune(mod: tirx.PrimFunc | tvm.IRModule, target: tvm.target.Target | str | None = None,
         work_dir: str | os.PathLike | None = None, *,
         trials_per_task: int = 64, trials: int | None = None, params: dict | None = None,
         runner: ms.Runner | None = None, rules: str = "tpp", name: str | None = None,
         seed: int = 0, progress: bool = True, compare: bool = True) -> TuningResult:
    """Tune ``mod`` (a PrimFunc, an IRModule of PrimFuncs, or a Relax model) on TPPs.

    ``work_dir`` defaults to ``tune_logs/<target tag>/<name or workload hash>``;
    ``trials`` caps the total over all tasks (default: ``trials_per_task`` each).
    ``rules="tvm"`` uses TVM's stock rules instead (for comparisons). ``runner`` may be
    :func:`make_runner` with an RPC tracker to measure on other machines. ``compare``
    times each tuned model subgraph against its hand schedule (``choices.json``).
    """
    tgt = _as_target(target)
    if "num-cores" not in tgt.attrs:
        raise ValueError("tuning needs a target with num-cores (use tpp_tvm.target())")
    tasks = extract_tasks(mod, tgt, params)
    if not tasks:
        raise TPPError("nothing to tune: the module has no PrimFunc or TPP subgraph")
    if rules not in ("tpp", "tvm"):
        raise ValueError(f"rules must be 'tpp' or 'tvm', got {rules!r}")
    log_dir = Path(work_dir) if work_dir is not None else (
        shipped_dir(tgt) / _workload_dir(mod, name))
    log_dir.mkdir(parents=True, exist_ok=True)
    contexts = []
    for i, task in enumerate(tasks):
        space = space_generator(tgt) if rules == "tpp" else "post-order-apply"
        contexts.append(ms.TuneContext(
            mod=tvm.IRModule({"main": task.func}), target=tgt, space_generator=space,
            search_strategy=search_strategy(trials_per_task), task_name=task.name,
            rand_state=seed + i, num_threads="physical",
            logger=ms.logging.get_logger(f"tpp_tvm.tune.{task.name}"),
        ).clone())
    names = [t.name for t in tasks]
    callbacks = [*ms.MeasureCallback.create("default")]
    if progress:
        callbacks.append(TuningProgress(
            names, [estimate_tir_flops(tvm.IRModule({"main": t.func})) for t in tasks],
            trials_per_task))
    database = ms.database.JSONDatabase(work_dir=str(log_dir))
    t0 = time.perf_counter()
    ms.tune_tasks(
        tasks=contexts, task_weights=[float(t.weight) for t in tasks], work_dir=str(log_dir),
        max_trials_global=trials or trials_per_task * len(tasks),
        max_trials_per_task=trials_per_task, num_trials_per_iter=min(64, trials_per_task),
        builder=ms.builder.LocalBuilder(f_build=build_candidate, max_workers=1,
                                        timeout_sec=60),
        runner=runner or make_runner(), database=database, cost_model="xgb",
        measure_callbacks=callbacks, task_scheduler="gradient",
    )
    result = TuningResult(log_dir, seconds=time.perf_counter() - t0)
    if not compare:
        for task in tasks:
            task.compare = None
    model = mod if isinstance(mod, tvm.IRModule) and has_relax(mod) else None
    result.tasks = _choose(tasks, TuneLogs(log_dir, database, tgt), model, params)
    if work_dir is None:  # a log kept in tune_logs/ for builds to use: its best records only
        prune_log(log_dir)
    (log_dir / "meta.json").write_text(json.dumps({
        "target": str(tgt), "tag": target_tag(tgt), "rules": rules,
        "trials_per_task": trials_per_task, "tuning_seconds": round(result.seconds, 1),
    }, indent=1))
    return result


def _choose(tasks: list[Task], logs: TuneLogs, model: tvm.IRModule | None = None,
            params: dict | None = None) -> list[dict]:
    """Per task: the best tuned time and, for model subgraphs, tuned vs hand schedule timed
    in one harness, then (given the ``model``) confirmed in the whole model; written to
    ``choices.json`` (what a build follows)."""
    choices, entries = {}, []
    for task in tasks:
        rec = best_record(logs.database, task.func, logs.target)
        entry = {"name": task.name, "weight": task.weight,
                 "tuned_ms": 1e3 * float(np.mean([float(s) for s in rec.run_secs]))
                 if rec is not None and rec.run_secs else None}
        if task.compare is not None and rec is not None:
            entry.update(task.compare(logs))
        choices[task.key] = entry
        entries.append(entry)
    if model is not None and any(t.compare is not None for t in tasks):
        confirm_in_model(model, logs.target, params, logs, choices)
    (logs.path / "choices.json").write_text(json.dumps(choices, indent=1, sort_keys=True))
    return entries


def recompare(mod: tvm.IRModule, log_dir: str | os.PathLike,
              target: tvm.target.Target | str | None = None, params: dict | None = None
              ) -> TuningResult:
    """Re-time the tuned subgraphs of ``mod`` against the hand schedules (e.g. on a quiet
    machine after tuning on a busy one) and rewrite the log's ``choices.json``."""
    tgt = _as_target(target)
    logs = open_logs(log_dir, tgt)
    if logs is None:
        raise TuningLogError(f"tuning log {log_dir} was made for another target")
    return TuningResult(Path(log_dir), _choose(extract_tasks(mod, tgt, params), logs,
                                               mod if has_relax(mod) else None, params))


def search_strategy(trials_per_task: int = 64) -> ms.search_strategy.EvolutionarySearch:
    """Evolutionary search sized for minutes, not hours: a smaller population and fewer
    genetic rounds than TVM's defaults (512, 4); the XGBoost model ranks candidates. A
    handful of trials (a smoke run) samples a population of 4 per trial, at least 16: the
    population's sampling, not the trials, is what a few trials cost (a 4-trial, 2-task
    tuning test: 210 s with 128, 99 s with 16, on a 2-vCPU Zen 5)."""
    population = min(128, max(16, 4 * trials_per_task))
    return ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=min(32, population),
        genetic_num_iters=3)
