"""The PyTorch front door: ``torch.compile(backend="tpp_tvm")`` against torch eager, inductor
(default, and ``max-autotune`` with ``freezing``), OpenVINO's ``torch.compile`` backend and
tpp_tvm's own ONNX route, on the zoo's models.

The models are the zoo's (``harness.py``: built from ``transformers`` configs with random
weights, same inputs); the ONNX route runs the zoo's compiled library of the same model.
Each runtime runs in its own process per thread count, under ``torch.no_grad()``, in fp32
(OpenVINO with ``INFERENCE_PRECISION_HINT=f32``: on AMX CPUs it would otherwise run bf16),
with denormals flushed (``torch.set_flush_denormal``; tpp_tvm's kernels flush them); compile
time is the first call's (dynamo capture + backend compile), then the median of
``--rounds`` calls. Each output is checked against eager in the same process::

    python benchmarks/torch_models.py                          # 1 and 2 threads
    python benchmarks/torch_models.py --models bert,resnet50 --threads 1 --impls tpp_tvm,eager

Writes ``results/<isa>-<cpu>/torch_models.md`` and ``.json``, naming the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import harness  # the zoo's models, exports, compiled libraries and runtimes
import numpy as np

IMPLS = ("tpp_tvm", "eager", "inductor", "inductor-max-autotune", "openvino", "tpp_tvm-onnx")
TITLES = {"tpp_tvm": "tpp_tvm (torch.compile)", "eager": "eager", "inductor": "inductor",
          "inductor-max-autotune": "inductor max-autotune + freezing",
          "openvino": "OpenVINO torch.compile", "tpp_tvm-onnx": "tpp_tvm ONNX route"}
DEFAULT_MODELS = ("bert", "distilbert", "gpt2", "llama", "vit", "swin", "convnext",
                  "resnet50", "mobilenet_v2", "efficientnet")


def _compiled(impl: str, module, threads: int):
    import torch

    if impl == "eager":
        return module
    if impl == "tpp_tvm":
        return torch.compile(module, backend="tpp_tvm", options={"threads": threads})
    if impl == "inductor":
        torch._inductor.config.freezing = True
        return torch.compile(module)
    if impl == "inductor-max-autotune":
        torch._inductor.config.freezing = True
        return torch.compile(module, mode="max-autotune")
    if impl == "openvino":
        import openvino.torch  # noqa: F401 - registers the backend

        # dynamic=False, as the shapes are fixed here. It does not avoid the failures of
        # OpenVINO 2026.4's backend under torch 2.13 on six of the ten models ("sources must
        # not be empty for symbol" from dynamo's guards on symbols the backend's own tracing
        # creates, also with aot_autograd off; "list index out of range"): those cells say so.
        return torch.compile(module, backend="openvino", dynamic=False, options={
            "device": "CPU", "config": {"INFERENCE_NUM_THREADS": str(threads),
                                        "INFERENCE_PRECISION_HINT": "f32",
                                        "CPU_DENORMALS_OPTIMIZATION": "YES"}})
    raise ValueError(impl)


def run_worker(name: str, impl: str, threads: int, rounds: int) -> dict:
    """Compile and time one runtime on one model in this process."""
    import torch

    warnings.filterwarnings("ignore")
    # The backend's own warning (a graph run in eager) counts in the table: keep it.
    warnings.filterwarnings("always", message="tpp_tvm")
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    model = harness.ALL_MODELS[name]
    feeds = model.inputs(np.random.default_rng(1))
    args = [torch.from_numpy(v) for v in feeds.values()]
    module = harness.FirstOutput(model.build())
    with torch.no_grad():
        want = module(*args)
        if impl == "tpp_tvm-onnx":
            import tpp_tvm

            compiled = tpp_tvm.load(str(harness.library_path(name, harness.PRECISIONS["float32"])),
                                    threads=threads)

            def run():
                return torch.from_numpy(compiled(**feeds)[0])
        else:
            fn = _compiled(impl, module, threads)

            def run():
                return fn(*args)
        t0 = time.perf_counter()
        got = run()
        compile_s = time.perf_counter() - t0
        run()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    err = float((got.reshape(want.shape) - want).abs().max() / (want.abs().max() or 1.0))
    row = {"model": name, "impl": impl, "threads": threads, "compile_s": round(compile_s, 1),
           "median_ms": 1e3 * float(np.median(times)), "rel_err": err}
    if impl == "tpp_tvm":
        row["fallback_warnings"] = 0  # counted by the parent from the worker's stderr
    return row


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def render(rows: list[dict], names: list[str], threads: list[int], impls: list[str],
           cpu: str, command: str) -> str:
    cell = {(r["model"], r["impl"], r["threads"]): r for r in rows}
    lines = ["# PyTorch models: torch.compile(backend=\"tpp_tvm\") vs eager, inductor, "
             "OpenVINO and tpp_tvm's ONNX route", "",
             f"CPU: {cpu}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"Command: `{command}`.",
             "Median ms per call (`torch.no_grad()`, denormals flushed), one process per "
             "runtime; ratios are peer time / tpp_tvm (torch.compile) time (> 1: tpp_tvm "
             "faster); err: max |out - eager| / max |eager|; compile s: the first call.", ""]
    peers = [i for i in impls if i != "tpp_tvm"]
    for t in threads:
        lines += [f"## {t} thread{'s' if t > 1 else ''}", "",
                  "| model | " + " | ".join(TITLES[i] for i in impls) + " | " +
                  " | ".join(f"{TITLES[p]} / tpp_tvm" for p in peers) +
                  " | tpp_tvm err | tpp_tvm compile s | fallback warnings |",
                  "|---|" + "---:|" * (len(impls) + len(peers) + 3)]
        ratios: dict[str, list[float]] = {p: [] for p in peers}
        for name in names:
            tpp = cell.get((name, "tpp_tvm", t), {})
            vals = []
            for impl in impls:
                c = cell.get((name, impl, t), {})
                vals.append(f"{c['median_ms']:.2f}" if "median_ms" in c else
                            c.get("error", "-")[:50])
            rat = []
            for p in peers:
                c = cell.get((name, p, t), {})
                if "median_ms" in c and "median_ms" in tpp:
                    ratios[p].append(c["median_ms"] / tpp["median_ms"])
                    rat.append(f"{c['median_ms'] / tpp['median_ms']:.2f}")
                else:
                    rat.append("-")
            lines.append(f"| {harness.ALL_MODELS[name].title} | " + " | ".join(vals + rat) +
                         f" | {tpp.get('rel_err', float('nan')):.1e} | "
                         f"{tpp.get('compile_s', '-')} | {tpp.get('fallback_warnings', '-')} |")
        lines += ["", "Geometric means, peer / tpp_tvm: " + ", ".join(
            f"{TITLES[p]} {g:.2f}" for p in peers if (g := _geomean(ratios[p]))), ""]
    return "\n".join(lines)


def tpp_tvm_host() -> str:
    """The CPU line of the results: its name, the LLVM CPU tpp_tvm targets, its features."""
    import tpp_tvm
    from tpp_tvm.target import host_isa
    from tpp_tvm.tuning import target_tag

    host = host_isa()
    return f"{host.model_name}, LLVM `{target_tag(tpp_tvm.target())}` ({host.summary()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(**json.loads(args.worker))))
        return 0
    names = args.models.split(",")
    impls = args.impls.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    if "tpp_tvm-onnx" in impls:
        harness.compile_parallel(names, "float32", 1)
    host = tpp_tvm_host()
    out = args.out or harness.results_dir()
    out.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/torch_models.py {' '.join(sys.argv[1:])}".strip()

    def write(rows: list[dict]) -> str:
        """The tables so far (rewritten after every cell: a long run interrupted keeps its
        rows, marked as partial until the last)."""
        (out / "torch_models.json").write_text(json.dumps(
            {"cpu": host, "command": command, "rows": rows}, indent=1))
        text = render(rows, names, threads, impls, host, command)
        expected = len(threads) * len(names) * len(impls)
        if len(rows) < expected:
            text += f"\n**Partial run: {len(rows)} of {expected} cells so far.**\n"
        (out / "torch_models.md").write_text(text)
        return text

    rows: list[dict] = []
    for t in threads:
        env = {**os.environ, "OMP_NUM_THREADS": str(t), "TVM_NUM_THREADS": str(t)}
        for name in names:
            for impl in impls:
                spec = {"name": name, "impl": impl, "threads": t, "rounds": args.rounds}
                proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                      env=env, capture_output=True, text=True)
                if proc.returncode == 0:
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                    if impl == "tpp_tvm":
                        row["fallback_warnings"] = proc.stderr.count(
                            "tpp_tvm: running a graph in eager")
                else:
                    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                    row = {"model": name, "impl": impl, "threads": t,
                           "error": (lines or ["worker died"])[-1][:200]}
                rows.append(row)
                print(f"[torch] {name} {impl} @{t}: " + (
                    f"{row['median_ms']:.2f} ms (compile {row['compile_s']} s, err "
                    f"{row['rel_err']:.1e})" if "median_ms" in row else row["error"]),
                    file=sys.stderr, flush=True)
                write(rows)
    text = write(rows)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
