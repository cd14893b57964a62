"""Latency under load: the zoo's models beside other work, tpp_tvm against ONNX Runtime and
OpenVINO f32 under the same load.

Servers are shared: other processes, request threads and pre-processing run beside a model.
Each cell runs the model in its own process (one per runtime) at ``--threads`` threads, for
``--seconds`` of calls after a warm-up, and gives the median and 99th-percentile latency
under one of four loads:

- ``quiet``: nothing else runs;
- ``busy``: beside one busy process (``while True: pass``), which takes a core;
- ``2 procs``: two processes of the same runtime run the model at once (latencies of both);
- ``2 threads``: two Python threads of one process call the same model at once (tpp_tvm's
  ``CompiledModel``, one ONNX Runtime session, one OpenVINO compiled model with a request
  per thread).

``--before`` adds ``tpp_tvm (TVM pool)``: the same libraries on TVM's own thread pool
(``TPP_TVM_THREAD_POOL=tvm``), the runtime tpp_tvm had before its own pool. Models are the
zoo's (``harness.py``: same exports, same compiled libraries, same inputs); every peer flushes
denormals as tpp_tvm's kernels do::

    python benchmarks/load.py                            # the zoo's twelve models, 2 threads
    python benchmarks/load.py --models distilbert,vit --seconds 2 --before

Writes ``results/<isa>-<cpu>/load.md`` and ``load.json``, naming the CPU: a result measured
on one CPU says nothing about another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import harness  # the zoo's models, exports, compiled libraries and runtimes
import numpy as np

LOADS = ("quiet", "busy", "2 procs", "2 threads")
RUNTIMES = ("tpp_tvm", "onnxruntime", "openvino")
#: tpp_tvm's libraries on TVM's pool, the "before" of tpp_tvm's own pool.
TVM_POOL = "tpp_tvm (TVM pool)"
_BUSY = "while True: pass"


def _runner(name: str, runtime: str, threads: int):
    impl = "tpp_tvm" if runtime == TVM_POOL else runtime
    return harness.model_runners(name, threads, [impl])[impl]


def run_worker(name: str, runtime: str, threads: int, seconds: float, callers: int
               ) -> list[float]:
    """Latencies (ms) of ``callers`` Python threads each calling the model for ``seconds``,
    from when the parent says go (a line on stdin; "ready" on stdout once warmed up)."""
    feeds = harness.ALL_MODELS[name].inputs(np.random.default_rng(1))
    runners = [_runner(name, runtime, threads)]
    if runtime == "openvino" and callers > 1:  # one infer request per thread
        runners += [_runner(name, runtime, threads) for _ in range(callers - 1)]
    else:
        runners *= callers
    for run in runners:
        run(feeds)
    times: list[list[float]] = [[] for _ in range(callers)]

    def call(k: int) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times[k]) < 5:
            t0 = time.perf_counter()
            runners[k](feeds)
            times[k].append(1e3 * (time.perf_counter() - t0))

    print("ready", flush=True)
    sys.stdin.readline()
    workers = [threading.Thread(target=call, args=(k,)) for k in range(callers)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [t for ts in times for t in ts]


def _worker_cmd(name: str, runtime: str, threads: int, seconds: float, callers: int
                ) -> list[str]:
    return [sys.executable, __file__, "--worker", json.dumps(
        {"name": name, "runtime": runtime, "threads": threads, "seconds": seconds,
         "callers": callers})]


def measure(name: str, runtime: str, load: str, threads: int, seconds: float) -> dict:
    """One cell: median and p99 latency of ``runtime`` on ``name`` under ``load``."""
    env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    if runtime == TVM_POOL:
        env["TPP_TVM_THREAD_POOL"] = "tvm"
    busy = subprocess.Popen([sys.executable, "-c", _BUSY]) if load == "busy" else None
    try:
        # Every process loads and warms up first; then all start timing at once.
        procs = 2 if load == "2 procs" else 1
        callers = 2 if load == "2 threads" else 1
        workers = [subprocess.Popen(_worker_cmd(name, runtime, threads, seconds, callers),
                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for _ in range(procs)]
        for w in workers:
            w.stdout.readline()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        latencies: list[float] = []
        for w in workers:
            out, err = w.communicate()
            if w.returncode:
                return {"error": (err.strip().splitlines() or ["worker died"])[-1][:300]}
            latencies += json.loads(out.strip().splitlines()[-1])
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return {"median_ms": float(np.median(latencies)), "p99_ms": float(np.percentile(latencies, 99)),
            "calls": len(latencies)}


def render(rows: list[dict], cpu: str, threads: int, runtimes: list[str], command: str) -> str:
    names = list(dict.fromkeys(r["model"] for r in rows))
    cell = {(r["model"], r["runtime"], r["load"]): r for r in rows}
    lines = [f"# Latency under load, {threads} threads: tpp_tvm vs ONNX Runtime and OpenVINO f32",
             "", f"CPU: {cpu}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"Command: `{command}`.",
             "Median / 99th-percentile ms per call; each runtime in its own process(es). "
             "`busy`: beside one busy process; `2 procs`: two processes of the runtime at "
             "once; `2 threads`: two Python threads calling one model. `x quiet`: the "
             "median under load over the runtime's quiet median (the lost core alone "
             "predicts 2x beside a busy process).", ""]
    for load in LOADS:
        lines += [f"## {load}", "", "| model | " + " | ".join(
            f"{rt} median | {rt} p99" + (" | x quiet" if load != "quiet" else "")
            for rt in runtimes) + " | best peer / tpp_tvm (median) |",
            "|---|" + "---:|" * (len(runtimes) * (2 if load == "quiet" else 3) + 1)]
        for name in names:
            cells = []
            for rt in runtimes:
                c = cell.get((name, rt, load), {})
                q = cell.get((name, rt, "quiet"), {})
                if "median_ms" not in c:
                    cells += [c.get("error", "-")[:60], "-"] + (["-"] if load != "quiet" else [])
                    continue
                cells += [f"{c['median_ms']:.2f}", f"{c['p99_ms']:.2f}"]
                if load != "quiet":
                    cells.append(f"{c['median_ms'] / q['median_ms']:.2f}"
                                 if "median_ms" in q else "-")
            tpp = cell.get((name, "tpp_tvm", load), {}).get("median_ms")
            peers = [cell.get((name, rt, load), {}).get("median_ms")
                     for rt in ("onnxruntime", "openvino")]
            peers = [p for p in peers if p]
            cells.append(f"{min(peers) / tpp:.2f}" if tpp and peers else "-")
            lines.append(f"| {harness.ALL_MODELS[name].title} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", help="comma-separated zoo names (default: the zoo's main set)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="timed seconds per cell (after the warm-up)")
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    parser.add_argument("--before", action="store_true",
                        help=f"also time {TVM_POOL!r}: tpp_tvm's libraries on TVM's pool")
    parser.add_argument("--out", type=Path, help="results folder (default: results/<cpu>)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(run_worker(**spec)))
        return 0
    names = [n for n in (args.models or ",".join(harness.SETS["main"])).split(",") if n]
    runtimes = args.runtimes.split(",") + ([TVM_POOL] if args.before else [])
    loads = args.loads.split(",")
    info = harness.compile_parallel(names, "float32", 1)
    rows = []
    for name in names:
        if "error" in info[name]:
            continue
        for load in loads:
            for runtime in runtimes:
                cell = measure(name, runtime, load, args.threads, args.seconds)
                rows.append({"model": name, "runtime": runtime, "load": load, **cell})
                print(f"[load] {name} {load} {runtime}: " + (
                    f"{cell['median_ms']:.2f} / {cell['p99_ms']:.2f} ms"
                    if "median_ms" in cell else cell["error"]), file=sys.stderr, flush=True)
    import tpp_tvm
    from tpp_tvm.target import host_isa
    from tpp_tvm.tuning import target_tag

    host = host_isa()
    cpu = f"{host.model_name}, LLVM `{target_tag(tpp_tvm.target())}` ({host.summary()})"
    out = args.out or harness.results_dir()
    out.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/load.py {' '.join(sys.argv[1:])}".strip()
    (out / "load.json").write_text(json.dumps(
        {"cpu": cpu, "threads": args.threads, "command": command, "rows": rows}, indent=1))
    text = render(rows, cpu, args.threads, runtimes, command)
    (out / "load.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
