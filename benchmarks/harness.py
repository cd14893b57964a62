"""What the benchmarks share: timing, worker processes, the machine line and result files.

Every benchmark measures each (implementation, thread count) in a worker process of its own
(thread pools are sized once per process: TVM's from ``TVM_NUM_THREADS`` at its first
parallel call, OpenMP's and OpenBLAS's at load), times calls the same way, and writes
``<name>.json`` and ``<name>.md`` with the same header. Those parts live here; each
benchmark keeps its workloads, adapters and tables.

A result measured on one CPU says nothing about another, so each CPU model gets its own
folder under ``benchmarks/results/``, named as its tuning logs are (``<isa>-<mcpu>``:
``avx512-znver5``, ``amx-emeraldrapids``); a run on another machine adds a folder instead of
overwriting this one's tables.

Benchmarks import ``tpp_tvm`` as installed (``pip install -e .`` in a checkout, or
``PYTHONPATH`` to measure another tree; workers inherit the environment) and this module as
a sibling: run them as scripts (``python benchmarks/gemm.py``), which puts this folder on
``sys.path``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def keep_fastest(rows: list[dict], keys: tuple[str, ...], time_field: str) -> list[dict]:
    """One row per ``keys`` value: the pass with the lowest ``time_field``. Benchmarks with
    ``--passes`` alternate their workers and keep each one's fastest pass, because this
    machine's speed drifts by tens of percent over minutes (a row that failed in one pass
    and ran in another keeps the run)."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = tuple(row.get(k) for k in keys)
        old = best.get(key)
        if old is None or (row.get(time_field) or math.inf) < (old.get(time_field) or math.inf):
            best[key] = row
    return list(best.values())


def results_dir() -> Path:
    """``benchmarks/results/<isa>-<mcpu>`` of this host's default TPP target."""
    import tpp_tvm
    from tpp_tvm.tuning import target_tag

    return RESULTS / target_tag(tpp_tvm.target())


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """How hard to time: each repeat lasts >= min_repeat_s; at most max_total_s per case."""

    repeat: int = 7
    min_repeat_s: float = 0.1
    max_total_s: float = 3.0


TIMING = Timing()
QUICK_TIMING = Timing(repeat=3, min_repeat_s=0.02, max_total_s=1.0)


def use_quick_timing() -> None:
    """Time with :data:`QUICK_TIMING` from now on in this process (``--quick`` runs)."""
    TIMING.__dict__.update(QUICK_TIMING.__dict__)


def timing_plan(call_s: float) -> tuple[int, int]:
    """(number, repeat) for a call taking about ``call_s`` seconds, within :data:`TIMING`."""
    number = max(1, math.ceil(TIMING.min_repeat_s / max(call_s, 1e-9)))
    repeat = max(1, min(TIMING.repeat, int(TIMING.max_total_s / max(call_s * number, 1e-9))))
    return number, repeat


def median_time(fn: Callable[[], Any]) -> float:
    """Median seconds per call of ``fn`` (already warmed up by the caller): a median of
    repeats, since other work on a shared machine only ever adds time."""
    t0 = time.perf_counter()
    fn()
    number, repeat = timing_plan(time.perf_counter() - t0)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


class Skipped(Exception):
    """An adapter declines a case on purpose (the message says why)."""


def untuned_tvm_matmul(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float, str]:
    """``a @ b`` as a TE matmul compiled by TVM with no schedule (what TVM does without
    tpp_tvm; serial code): (result, median seconds per call, the LLVM mcpu used)."""
    import tvm
    from tvm import te
    from tvm.target import codegen

    (m, k), n = a.shape, b.shape[1]
    a_ph = te.placeholder((m, k), "float32", name="A")
    b_ph = te.placeholder((k, n), "float32", name="B")
    r = te.reduce_axis((0, k), name="k")
    c_ph = te.compute((m, n), lambda i, j: te.sum(a_ph[i, r] * b_ph[r, j], axis=r), name="C")
    mcpu = str(codegen.llvm_get_system_cpu())
    lib = tvm.compile(
        te.create_prim_func([a_ph, b_ph, c_ph]), target={"kind": "llvm", "mcpu": mcpu}
    )
    dev = tvm.cpu()
    a_t, b_t = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)
    c_t = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
    lib(a_t, b_t, c_t)
    c = c_t.numpy()
    return c, median_time(lambda: lib(a_t, b_t, c_t)), mcpu


# ----------------------------------------------------------------------------- workers


def worker_env(threads: int, *, native_openblas: bool = False) -> dict[str, str]:
    """The environment of a worker running ``threads`` threads in every runtime.

    ``native_openblas``: drop site-wide overrides that pin OpenBLAS to Haswell kernels, so
    a numpy peer runs its best."""
    env = dict(os.environ)
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    if native_openblas:
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
    return env


def worker_rows(cmd: list[str], env: dict, timeout: float) -> tuple[list | None, str]:
    """Run a benchmark worker process; (its JSON rows, "") or (None, why it gave none)."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1]), ""
        why = f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    except subprocess.TimeoutExpired:
        why = f"worker timed out after {timeout} s"
    except (json.JSONDecodeError, IndexError) as exc:
        why = f"worker printed no JSON: {exc}"
    return None, why


# ----------------------------------------------------------------------------- results


def measure_peaks(threads: list[int], instr: str = "fp32_fma") -> dict[int, float]:
    """The measured peak of ``instr`` (``benchmarks/peak.py``) per thread count."""
    from peak import measure_peak

    return {t: measure_peak(instr, t) for t in threads}


def measure_read_bandwidth(threads: int, repeats: int = 2) -> float:
    """The measured memory read bandwidth in GB/s (``benchmarks/peak.py --stream read``)."""
    from peak import measure_bandwidth

    return measure_bandwidth("read", threads, repeats=repeats)


def machine() -> str:
    """lscpu's model name plus what tpp_tvm detects (ISA, caches, cores)."""
    name = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        from tpp_tvm.target import host_isa

        return f"{name} ({host_isa().summary()})"
    except Exception as exc:  # the header must not kill the benchmark
        return f"{name} (ISA detection failed: {exc})"


def run_header(machine_line: str, date: str, command: str, load: str) -> list[str]:
    """The markdown bullet lines every results table starts with."""
    return [
        f"- Machine: {machine_line}",
        f"- Date: {date}",
        f"- Command: `{command}`",
        f"- 1-minute load average before / after the run: {load} (other work on this machine "
        "depresses the numbers, the multi-threaded ones most)",
    ]


def write_results(out_dir: str, name: str, argv: list[str], rows: list[dict],
                  load_before: float, render: Callable[[str, str, str], str],
                  script: str | None = None) -> None:
    """Write ``<name>.json`` and ``<name>.md`` (header: command, date, load) and print the md.

    ``script`` names the benchmark file when it is not ``<name>.py``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    command = shlex.join(["python", f"benchmarks/{script or name}.py", *argv])
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load = f"{load_before:.2f} / {os.getloadavg()[0]:.2f}"
    md = render(command, date, load)
    (out / f"{name}.md").write_text(md)
    print(md)
