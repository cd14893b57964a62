"""Tuning with MetaSchedule around TPPs: ``tune()``, tuning logs, local or RPC measurement.

``tune(mod)`` searches schedules for every task of ``mod`` with the TPP rules
(:mod:`tpp_tvm.schedules.tuning_rules`) and TVM's XGBoost cost model, printing one
progress line per measured batch. A PrimFunc (or IRModule of them) is tuned as is; a
Relax model is tuned per TPP subgraph (the unit the graph pass lowers: dense + bias +
GELU, a convolution with its epilogue, ...), and each tuned kernel is timed against the
hand schedule in the same harness so a build keeps the faster one.

The result is a *tuning log*: a folder ``tune_logs/<target tag>/<workload>/`` holding
MetaSchedule's JSON database, ``choices.json`` (hand vs tuned times per subgraph) and
``meta.json`` (the target it was measured on). ``build(..., tune_logs=PATH)`` applies it.
Records for another target are not applied (a warning says so); a corrupt log is a
:class:`TuningLogError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops

from .errors import TPPError
from .target import isa_of
from .target import target as tpp_target
from .tir_pipeline import PIPELINE as TIR_PIPELINE

log = logging.getLogger(__name__)

#: Where the shipped logs live (``tune_logs/`` at the repository root).
SHIPPED_LOGS = Path(__file__).resolve().parent.parent / "tune_logs"


class TuningLogError(TPPError):
    """A tuning log that is missing, unreadable or not a tuning log."""


class ForeignTuningLogWarning(TuningLogError, UserWarning):
    """A tuning log measured on another CPU: warned about and not applied (its records would
    be looked up by loop nest alone, whatever CPU they were tuned for). It is a
    :class:`TuningLogError` too, so ``warnings.simplefilter("error",
    ForeignTuningLogWarning)`` turns it into a TPPError the CLI reports in one line."""


def target_tag(target: tvm.target.Target) -> str:
    """Folder name of a target's logs: ISA and CPU model (``avx512-znver5``). Thread count
    is not part of it: a tuned kernel's parallel loop serves any number of threads."""
    attrs = target.attrs
    mcpu = str(attrs["mcpu"]) if "mcpu" in attrs else "generic"
    return f"{isa_of(target)}-{mcpu}"


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


def tune(mod, target=None, work_dir: str | os.PathLike | None = None, *,
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
    from .schedules.tuning_rules import space_generator

    tgt = _as_target(target)
    if "num-cores" not in tgt.attrs:
        raise ValueError("tuning needs a target with num-cores (use tpp_tvm.target())")
    tasks = extract_tasks(mod, tgt, params)
    if not tasks:
        raise TPPError("nothing to tune: the module has no PrimFunc or TPP subgraph")
    if rules not in ("tpp", "tvm"):
        raise ValueError(f"rules must be 'tpp' or 'tvm', got {rules!r}")
    log_dir = Path(work_dir) if work_dir is not None else (
        SHIPPED_LOGS / target_tag(tgt) / _workload_dir(mod, name))
    log_dir.mkdir(parents=True, exist_ok=True)
    contexts = []
    for i, task in enumerate(tasks):
        space = space_generator(tgt) if rules == "tpp" else "post-order-apply"
        contexts.append(ms.TuneContext(
            mod=tvm.IRModule({"main": task.func}), target=tgt, space_generator=space,
            search_strategy=search_strategy(), task_name=task.name,
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
    model = mod if isinstance(mod, tvm.IRModule) and _has_relax(mod) else None
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
        rec = _best_record(logs.database, task.func, logs.target)
        entry = {"name": task.name, "weight": task.weight,
                 "tuned_ms": 1e3 * float(np.mean([float(s) for s in rec.run_secs]))
                 if rec is not None and rec.run_secs else None}
        if task.compare is not None and rec is not None:
            entry.update(task.compare(logs))
        choices[task.key] = entry
        entries.append(entry)
    if model is not None and any(t.compare is not None for t in tasks):
        from .relay_passes.tuned import confirm_in_model

        confirm_in_model(model, logs.target, params, logs, choices)
    (logs.path / "choices.json").write_text(json.dumps(choices, indent=1, sort_keys=True))
    return entries


def recompare(mod, log_dir: str | os.PathLike, target=None, params: dict | None = None
              ) -> TuningResult:
    """Re-time the tuned subgraphs of ``mod`` against the hand schedules (e.g. on a quiet
    machine after tuning on a busy one) and rewrite the log's ``choices.json``."""
    tgt = _as_target(target)
    logs = open_logs(log_dir, tgt)
    if logs is None:
        raise TuningLogError(f"tuning log {log_dir} was made for another target")
    return TuningResult(Path(log_dir), _choose(extract_tasks(mod, tgt, params), logs,
                                               mod if _has_relax(mod) else None, params))


def prune_log(path: str | os.PathLike, keep: int = 3) -> int:
    """Keep only each task's ``keep`` fastest valid records (a shipped log needs the best;
    every build that applies it parses all of them). Returns the records kept."""
    records = Path(path) / "database_tuning_record.json"
    by_task: dict[int, list] = {}
    for line in records.read_text().splitlines():
        if not line.strip():
            continue
        task, rec = json.loads(line)
        secs = rec[1] if rec[1] else None
        if secs:
            by_task.setdefault(task, []).append((float(np.mean(secs)), line))
    kept = [line for entries in by_task.values()
            for _, line in sorted(entries, key=lambda e: e[0])[:keep]]
    records.write_text("\n".join(kept) + "\n")
    return len(kept)


def search_strategy() -> ms.search_strategy.EvolutionarySearch:
    """Evolutionary search sized for minutes, not hours: a smaller population and fewer
    genetic rounds than TVM's defaults (512, 4); the XGBoost model ranks candidates."""
    return ms.search_strategy.EvolutionarySearch(
        population_size=128, init_min_unmeasured=32, genetic_num_iters=3)


def _best_record(database: ms.Database, func: tirx.PrimFunc, target):
    """The fastest valid record for ``func`` (any database kind, unions included)."""
    return database.query_tuning_record(tvm.IRModule({"main": func}), target,
                                        workload_name="main")


# ---------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------


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


def workload_key(func: tirx.PrimFunc) -> str:
    return f"{tvm_ffi.structural_hash(func) & 0xFFFFFFFFFFFF:012x}"


def extract_tasks(mod, target: tvm.target.Target, params: dict | None = None) -> list[Task]:
    """Tasks of a PrimFunc / IRModule of PrimFuncs (as given) or a Relax model (one per
    distinct TPP subgraph, weighted by how often it occurs)."""
    if isinstance(mod, tirx.PrimFunc):
        return [Task("main", _plain(mod))]
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"tune() takes a PrimFunc or an IRModule, got {type(mod).__name__}")
    prims = [(gv.name_hint, f) for gv, f in mod.functions_items()
             if isinstance(f, tirx.PrimFunc)]
    if not _has_relax(mod):
        return [Task(n, _plain(f)) for n, f in sorted(prims, key=lambda x: x[0])]
    from .relay_passes.tuned import subgraph_tasks

    return subgraph_tasks(mod, target, params)


def _has_relax(mod) -> bool:
    return isinstance(mod, tvm.IRModule) and any(
        not isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items())


def _plain(func: tirx.PrimFunc) -> tirx.PrimFunc:
    return func.with_attr("global_symbol", "main")


# ---------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------


class TuneLogs:
    """An opened tuning log: the database plus the hand-vs-tuned choices."""

    def __init__(self, path: Path, database: ms.Database, target: tvm.target.Target,
                 choices: dict | None = None) -> None:
        self.path, self.database, self.target = path, database, target
        self.choices = choices or {}

    def schedule(self, func: tirx.PrimFunc, force: bool = False) -> tirx.PrimFunc | None:
        """The tuned PrimFunc for ``func``, or None (no record, or the hand schedule won)."""
        key = workload_key(func)
        choice = self.choices.get(key)
        if not force and choice is not None and choice.get("use") == "hand":
            return None
        mod = tvm.IRModule({"main": func})
        rec = _best_record(self.database, func, self.target)
        if rec is None:
            return None
        from .schedules.tuning_rules import register_trace_intrinsics

        register_trace_intrinsics(inst.attrs[0] for inst in rec.trace.insts
                                  if inst.kind.name == "Tensorize")
        sch = self.database.query_schedule(mod, self.target, workload_name="main")
        return None if sch is None else sch.mod["main"]


def shipped_logs(target: tvm.target.Target) -> TuneLogs | None:
    """All logs shipped in ``tune_logs/<target tag>/`` as one, or None if there are none.

    Records are keyed by the kernel's loop nest (shapes, not weights), so any model with a
    tuned subgraph shape (e.g. any BERT-base layer) uses them.
    """
    folder = SHIPPED_LOGS / target_tag(target)
    if not folder.is_dir():
        return None
    stamp = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(folder.glob("*/*.json")))
    key = (str(folder), str(target), stamp)
    if key not in _SHIPPED:
        _SHIPPED.clear()
        _SHIPPED[key] = _load_shipped(folder, target)
    return _SHIPPED[key]


_SHIPPED: dict[tuple, TuneLogs | None] = {}


def _load_shipped(folder: Path, target: tvm.target.Target) -> TuneLogs | None:
    logs = [open_logs(d, target) for d in sorted(folder.iterdir())
            if (d / "database_tuning_record.json").is_file()]
    logs = [lg for lg in logs if lg is not None]
    if not logs:
        return None
    if len(logs) == 1:
        return logs[0]
    choices: dict = {}
    for lg in logs:
        choices.update(lg.choices)
    union = ms.database.UnionDatabase(*[lg.database for lg in logs])
    return TuneLogs(folder, union, target, choices)


def resolve_logs(tune_logs, target: tvm.target.Target) -> TuneLogs | None:
    """``"shipped"`` (the logs shipped for this target, if any), a folder, an opened log or
    None (hand schedules only)."""
    if tune_logs is None or isinstance(tune_logs, TuneLogs):
        return tune_logs
    if str(tune_logs) == "shipped":
        return shipped_logs(target)
    return open_logs(tune_logs, target)


def open_logs(path: str | os.PathLike, target: tvm.target.Target) -> TuneLogs | None:
    """Open the tuning log at ``path`` for ``target``; None (with a warning) if it was made
    for another target. Raises :class:`TuningLogError` if missing or corrupt."""
    path = Path(path)
    if not path.is_dir():
        raise TuningLogError(f"tuning log {path} does not exist (expected a folder made by "
                             "tpp_tvm.tune / tpp-tvm tune)")
    files = [path / "database_workload.json", path / "database_tuning_record.json"]
    for f in files:
        if not f.is_file():
            raise TuningLogError(f"tuning log {path} has no {f.name}: not a tuning log")
    meta, choices = {}, {}
    try:
        if (path / "meta.json").is_file():
            meta = json.loads((path / "meta.json").read_text())
        if (path / "choices.json").is_file():
            choices = json.loads((path / "choices.json").read_text())
        for f in files:  # every line must be JSON: JSONDatabase aborts on a bad one
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if line.strip():
                    json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TuningLogError(f"tuning log {path} is corrupt ({err})") from err
    tag = meta.get("tag")
    if tag is not None and tag != target_tag(target):
        warnings.warn(ForeignTuningLogWarning(
            f"tuning log {path} was made for {tag}, not {target_tag(target)}: not applied "
            "(hand schedules used)"), stacklevel=2)
        return None
    # Loading parses every record's trace, so the TPP intrinsics the traces name must be
    # registered first.
    from .schedules.tuning_rules import register_trace_intrinsics

    register_trace_intrinsics(set(re.findall(r'"(tpp\.[\w.]+)"', files[1].read_text())))
    try:
        database = ms.database.JSONDatabase(work_dir=str(path), allow_missing=False)
    except Exception as err:  # noqa: BLE001 - TVM's loader raises TVMError subclasses
        raise TuningLogError(f"tuning log {path} could not be loaded: "
                             f"{str(err).splitlines()[-1]}") from err
    return TuneLogs(path, database, target, choices)
