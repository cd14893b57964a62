"""Tuning logs: open, check and look up the folders ``tune()`` writes.

A tuning log is a folder ``tune_logs/<target tag>/<workload>/`` holding MetaSchedule's JSON
database, ``choices.json`` (hand vs tuned times per subgraph, keyed by
:func:`workload_key`) and ``meta.json`` (the target it was measured on). Records for
another target are not applied (a warning says so); a corrupt log is a
:class:`TuningLogError` naming the file.

The ``tpp`` pipeline imports this module to apply logs, so it imports nothing of the graph
side (``relay_passes``) nor of the tuning driver: data flows from here to the pipeline only.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import meta_schedule as ms

from ..errors import TPPError
from ..schedules.tuning_rules import register_trace_intrinsics
from ..target import isa_of

#: Where the shipped logs live (``tune_logs/`` at the repository root).
SHIPPED_LOGS = Path(__file__).resolve().parent.parent.parent / "tune_logs"


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


def shipped_dir(target: tvm.target.Target) -> Path:
    """``tune_logs/<target tag>/``: where ``tune()`` keeps a target's logs by default and
    where builds with ``tune_logs="shipped"`` look for them."""
    return SHIPPED_LOGS / target_tag(target)


def workload_key(func: tirx.PrimFunc) -> str:
    """The key of a kernel in ``choices.json``: its structural hash (shapes and loop nest,
    not weights), so any model with the same subgraph shape finds the choice."""
    return f"{tvm_ffi.structural_hash(func) & 0xFFFFFFFFFFFF:012x}"


def best_record(database: ms.Database, func: tirx.PrimFunc, target: tvm.target.Target
                ) -> ms.database.TuningRecord | None:
    """The fastest valid record for ``func`` (any database kind, unions included)."""
    return database.query_tuning_record(tvm.IRModule({"main": func}), target,
                                        workload_name="main")


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
        rec = best_record(self.database, func, self.target)
        if rec is None:
            return None
        register_trace_intrinsics(inst.attrs[0] for inst in rec.trace.insts
                                  if inst.kind.name == "Tensorize")
        sch = self.database.query_schedule(mod, self.target, workload_name="main")
        return None if sch is None else sch.mod["main"]


def shipped_logs(target: tvm.target.Target) -> TuneLogs | None:
    """All logs shipped in ``tune_logs/<target tag>/`` as one, or None if there are none.

    Records are keyed by the kernel's loop nest (shapes, not weights), so any model with a
    tuned subgraph shape (e.g. any BERT-base layer) uses them.
    """
    folder = shipped_dir(target)
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


def resolve_logs(tune_logs: str | os.PathLike | TuneLogs | None, target: tvm.target.Target
                 ) -> TuneLogs | None:
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
    register_trace_intrinsics(set(re.findall(r'"(tpp\.[\w.]+)"', files[1].read_text())))
    try:
        database = ms.database.JSONDatabase(work_dir=str(path), allow_missing=False)
    except Exception as err:  # noqa: BLE001 - TVM's loader raises TVMError subclasses
        raise TuningLogError(f"tuning log {path} could not be loaded: "
                             f"{str(err).splitlines()[-1]}") from err
    return TuneLogs(path, database, target, choices)


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
