"""Real architectures as a new user meets them: tpp_tvm against ONNX Runtime, OpenVINO (f32)
and torch eager on models built from Hugging Face ``transformers`` configs.

Each model is built from its config with random weights (``torch.manual_seed(0)``, nothing
downloaded), exported with ``torch.onnx.export(opset_version=17, dynamo=False)`` and run by
every runtime on the same random input. Layer counts of the deep models are cut (the
``layers`` column) so the whole zoo compiles and runs on a 2-core machine in minutes; the
per-layer work, widths and operators are the real architecture's.

The parent compiles each model once with tpp_tvm (``compile_onnx``, exported to the cache
folder); one worker process per runtime and thread count then times every model (median
of the rounds). Runtimes never share a process: OpenVINO's worker threads alone, idle
between calls, made tpp_tvm and ONNX Runtime 1.5x slower at 1 thread on a 2-vCPU machine.
Correctness is the max abs error relative to max |ORT output|::

    python benchmarks/zoo.py                         # all models, 1 and 2 threads
    python benchmarks/zoo.py --models gpt2,vit --threads 1 --rounds 10
    python benchmarks/zoo.py --precision bf16 --models bert,distilbert,gpt2,vit
    python benchmarks/zoo.py --set more              # 14 more architectures: zoo_more.md
    python benchmarks/zoo.py --set breadth           # timm/torchvision: zoo_breadth.md

Every peer flushes denormals as tpp_tvm's kernels do (ONNX Runtime
``session.set_denormal_as_zero``, OpenVINO ``CPU_DENORMALS_OPTIMIZATION``,
``torch.set_flush_denormal``). An fp32 row whose tpp_tvm output is further than
``FP32_TOLERANCE`` from ONNX Runtime's is marked wrong, left out of the geometric means,
and makes the run exit non-zero.

``--precision bf16`` compiles tpp_tvm with ``precision="bf16"`` (AMX tiles on AMX hosts) and
runs OpenVINO with ``INFERENCE_PRECISION_HINT=bf16``; ONNX Runtime (fp32) stays as the
reference the errors are measured against. It writes ``zoo_bf16.md``/``zoo_bf16.json``.

``--precision int8`` quantizes each export as a user would, with ONNX Runtime's
``quantize_static`` (QDQ, u8 activations, s8 weights, calibrated on the model's input), and
runs that one file in every runtime: tpp_tvm (int8 TPPs, AMX tiles on AMX hosts), ONNX
Runtime and OpenVINO (its default precision, which keeps the int8 parts int8).
``--precision int8-dynamic`` does the same with ``quantize_dynamic`` (s8 weights, activations
quantized at run time). Errors are against ONNX Runtime fp32 on the unquantized model, for
tpp_tvm and for ONNX Runtime's own int8 run. They write ``zoo_int8.md`` /
``zoo_int8_dynamic.md``.

Writes ``results/<isa>-<cpu>/zoo.md`` and ``zoo.json`` (one folder per CPU model, named as
``tune_logs/`` are, e.g. ``amx-emeraldrapids``; ``--out`` for another folder), each naming
the CPU it ran on: a result measured on one CPU says nothing about another.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from harness import (
    ALL_MODELS,
    CALIBRATION_SAMPLES,
    FP32_TOLERANCE,
    IMPL_TITLES,
    IMPLS,
    ORT_OPTIMIZED,
    PRECISIONS,
    SETS,
    ZooPrecision,
    compile_all,
    compile_parallel,
    failure_text,
    keep_fastest,
    model_runners,
    onnx_path,
    ort_session,
    peer_alternates,
)


def run_worker(names: list[str], threads: int, rounds: int, impls: list[str],
               precision: ZooPrecision = PRECISIONS["float32"]) -> list[dict]:
    """Time ``impls`` on each model in this process (round-robin if several)."""
    rows = []
    for name in names:
        feeds = ALL_MODELS[name].inputs(np.random.default_rng(1))
        try:
            runners = model_runners(name, threads, impls, precision)
        except Exception as exc:  # noqa: BLE001 - a runtime that fails is a cell saying so
            rows += [{"model": name, "impl": impl, "threads": threads,
                      "error": failure_text(exc)} for impl in impls]
            continue
        outputs = {impl: run(feeds) for impl, run in runners.items()}  # warm-up
        times: dict[str, list[float]] = {impl: [] for impl in runners}
        for _ in range(rounds):
            for impl, run in runners.items():
                t0 = time.perf_counter()
                run(feeds)
                times[impl].append(time.perf_counter() - t0)
        ref = (outputs["onnxruntime"] if "onnxruntime" in outputs and not precision.quantization
               else ort_session(str(onnx_path(name)), 1).run(None, feeds)[0])
        scale = float(np.abs(ref).max()) or 1.0
        for impl in runners:
            err = float(np.abs(outputs[impl].reshape(ref.shape) - ref).max()) / scale
            rows.append({"model": name, "impl": impl, "threads": threads,
                         "median_ms": 1e3 * float(np.median(times[impl])), "rel_err": err})
        print(f"[zoo] {name} @{threads}: " + ", ".join(
            f"{r['impl']} {r['median_ms']:.2f}" for r in rows if r["model"] == name
            and r.get("threads") == threads and "impl" in r), file=sys.stderr, flush=True)
    return rows


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


#: Title, tpp_tvm / ORT / OpenVINO column names and what err compares, by ``--precision``.
_RENDERING = {
    "float32": ("# Model zoo: tpp_tvm vs ONNX Runtime, OpenVINO f32 and torch eager",
                ("tpp_tvm", "ORT", "OpenVINO f32"), "max |tpp_tvm - ORT| / max |ORT|"),
    "bf16": ("# Model zoo in bf16: tpp_tvm bf16 vs OpenVINO bf16 (ONNX Runtime fp32 for "
             "reference)", ("tpp_tvm bf16", "ORT", "OpenVINO bf16"),
             "max |tpp_tvm - ORT| / max |ORT|"),
    "int8": ("# Model zoo in int8 (ONNX Runtime's static QDQ quantization): tpp_tvm vs ONNX "
             "Runtime and OpenVINO on the same quantized model",
             ("tpp_tvm int8", "ORT int8", "OpenVINO int8"),
             "max |x - ORT fp32| / max |ORT fp32| (ORT fp32 on the unquantized model), x "
             "tpp_tvm's output (err) or ORT int8's (ORT err)"),
    "int8-dynamic": ("# Model zoo in int8 (ONNX Runtime's dynamic quantization): tpp_tvm vs "
                     "ONNX Runtime and OpenVINO on the same quantized model",
                     ("tpp_tvm int8", "ORT int8", "OpenVINO int8"),
                     "max |x - ORT fp32| / max |ORT fp32| (ORT fp32 on the unquantized "
                     "model), x tpp_tvm's output (err) or ORT int8's (ORT err)"),
}


def render(rows: list[dict], info: dict[str, dict], threads: list[int], cpu: str,
           precision: str = "float32") -> str:
    by = {(r["model"], r.get("impl"), r["threads"]): r for r in rows}
    title, (tpp_title, ort_title, ov_title), err_text = _RENDERING[precision]
    quantized = PRECISIONS[precision].quantization is not None
    alternates = peer_alternates(PRECISIONS[precision])
    lines = [title,
             "", f"CPU: {cpu}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"Command: `python benchmarks/zoo.py {' '.join(sys.argv[1:])}`.",
             "Median ms of the rounds, one process per runtime (with --passes, the fastest "
             "of the alternating passes); ratios are peer time / "
             f"tpp_tvm time (> 1: tpp_tvm faster); err is {err_text}."
             + (" A peer's time is the better of its int8 run and its fp32 run of the "
                "unquantized export (`x (fp32 y)`: its fp32 was faster, y counts); the "
                "quantization is ONNX Runtime's, after `quant_pre_process`"
                + (f", static QDQ calibrated on {CALIBRATION_SAMPLES} inputs."
                   if PRECISIONS[precision].quantization == "qdq" else ", dynamic.")
                if quantized else "")
             + (" ONNX Runtime's time is the better of the export and its transformer "
                "optimizer's output (`onnxruntime.transformers.optimizer`, for the "
                "architectures it knows; `x (opt y)`: the optimized was faster)."
                if alternates == ORT_OPTIMIZED else ""), ""]
    failures: list[str] = []
    wrong_rows: list[str] = []
    for t in threads:
        lines += [f"## {t} thread{'s' if t > 1 else ''}", "",
                  f"| model | layers | {tpp_title} | {ort_title} | {ov_title} | "
                  "torch | ORT/tpp | OV/tpp | err |" + (" ORT err |" if quantized else "")
                  + " compile s | fallbacks | default % |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if quantized else "")
                  + "---:|---:|---:|"]
        ort_ratios, ov_ratios = [], []
        for name, entry in info.items():
            cells = {impl: by.get((name, impl, t)) for impl in (*IMPLS, *alternates)}
            ms = {impl: (c.get("median_ms") if c else None) for impl, c in cells.items()}
            best = {peer: _best(ms[peer], *[ms[a] for a, p in alternates.items() if p == peer])
                    for peer in ("onnxruntime", "openvino")}
            failures += [f"- {entry['title']}, {IMPL_TITLES[impl]}, {t} thread"
                         f"{'s' if t > 1 else ''}: {c['error']}"
                         for impl, c in cells.items() if c and "error" in c]
            tpp = ms["tpp_tvm"]
            wrong = _wrong(cells["tpp_tvm"], precision)
            if wrong:
                wrong_rows.append(f"- {entry['title']}, {t} thread{'s' if t > 1 else ''}: "
                                  f"err {cells['tpp_tvm']['rel_err']:.1e}")
                tpp = None  # no ratio for a wrong output
            # bf16 is compared with bf16 peers only: ONNX Runtime runs fp32 there
            ratio_ort = best["onnxruntime"] / tpp if tpp and best["onnxruntime"] \
                and precision != "bf16" else None
            ratio_ov = best["openvino"] / tpp if tpp and best["openvino"] else None
            if ratio_ort:
                ort_ratios.append(ratio_ort)
            if ratio_ov:
                ov_ratios.append(ratio_ov)
            def fmt(impl: str) -> str:
                if cells[impl] and "error" in cells[impl]:
                    return "fails"
                if impl == "tpp_tvm" and wrong:
                    return f"**wrong** ({ms[impl]:.2f})"
                if impl in best and ms[impl] is not None and best[impl] != ms[impl]:
                    # its other run (fp32 / optimized) was faster: that counts
                    return f"{ms[impl]:.2f} ({'fp32' if quantized else 'opt'} {best[impl]:.2f})"
                return "–" if ms[impl] is None else f"{ms[impl]:.2f}"

            def ratio(value: float | None) -> str:
                return "–" if value is None else f"{value:.2f}"

            def err(impl: str) -> str:
                value = (cells[impl] or {}).get("rel_err")
                return "–" if value is None else f"{value:.1e}"

            title = entry["title"] + (f" — **{entry['error']}**" if "error" in entry else "")
            lines.append(f"| {title} | {entry['layers']} | {fmt('tpp_tvm')} | "
                         f"{fmt('onnxruntime')} | {fmt('openvino')} | {fmt('torch')} "
                         f"| {ratio(ratio_ort)} | {ratio(ratio_ov)} | {err('tpp_tvm')} |"
                         + (f" {err('onnxruntime')} |" if quantized else "")
                         + f" {entry.get('compile_s', '–')} | {entry.get('fallbacks', '–')} |"
                         + f" {entry.get('default_pct', '–')} |")
        g_ort, g_ov = _geomean(ort_ratios), _geomean(ov_ratios)
        lines += ["", f"Geometric mean over the models that ran: ORT/tpp_tvm "
                  f"{'–' if g_ort is None else f'{g_ort:.2f}'}, OpenVINO/tpp_tvm "
                  f"{'–' if g_ov is None else f'{g_ov:.2f}'}.", ""]
    if failures:
        lines += ["Runtimes that failed (the cell says `fails`):", "", *failures, ""]
    if wrong_rows:
        lines += [f"Wrong outputs (err above {FP32_TOLERANCE:g}; left out of the means):", "",
                  *wrong_rows, ""]
    lines += ["`default %`: share of a profiled tpp_tvm run in functions left on TVM's "
              "default code (no TPP kernel).", ""]
    return "\n".join(lines) + "\n"


def _best(*runs: float | None) -> float | None:
    """A peer's figure: the faster of its runs (int8 zoos: int8 and fp32; fp32 zoo: ORT
    on the export and on its transformer optimizer's output)."""
    times = [t for t in runs if t]
    return min(times) if times else None


def _merged(old: dict, rows: list[dict], info: dict[str, dict], order: list[str]
            ) -> tuple[list[dict], dict[str, dict]]:
    """The rows and model entries of an earlier results file, those of the models re-run
    now replaced, in the set's order."""
    kept = [r for r in old["rows"] if r["model"] not in info]
    models = {**old["models"], **info}
    return kept + rows, {name: models[name] for name in order if name in models}


def _wrong(cell: dict | None, precision: str) -> bool:
    """An fp32 tpp_tvm output further from ONNX Runtime's than :data:`FP32_TOLERANCE`."""
    return (precision == "float32" and bool(cell) and "rel_err" in cell
            and cell["rel_err"] > FP32_TOLERANCE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", default="main", choices=list(SETS),
                        help="main: the twelve architectures; more: operators and forms "
                             "beyond them (writes zoo_more.md); breadth: timm and "
                             "torchvision image architectures (zoo_breadth.md)")
    parser.add_argument("--models", help="comma-separated names (default: the whole set)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--passes", type=int, default=1,
                        help="run every runtime's worker this many times, alternating, and "
                             "keep each one's fastest pass (drift on shared machines)")
    parser.add_argument("--out", type=Path, help="results folder (default: results/<cpu>)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other models' rows of the set's existing results file "
                             "and replace only the models given (re-run a few rows)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--compile-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=1,
                        help="compile the models in this many processes (timing stays one "
                             "process at a time)")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help="runtimes to time (default: all; tpp_tvm and onnxruntime needed "
                             "for the ratios)")
    parser.add_argument("--precision", default="float32", choices=list(PRECISIONS),
                        help="bf16: tpp_tvm precision='bf16' against OpenVINO bf16; int8 / "
                             "int8-dynamic: every runtime on ONNX Runtime's static QDQ / "
                             "dynamic quantization of the export")
    args = parser.parse_args(argv)
    precision = PRECISIONS[args.precision]
    names = [n for n in (args.models or ",".join(SETS[args.set])).split(",") if n]
    unknown = [n for n in names if n not in ALL_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(ALL_MODELS)}")
    if args.worker:
        print(json.dumps(run_worker(names, args.worker, args.rounds, args.impls.split(","),
                                    precision)))
        return 0
    if args.compile_worker:
        print(json.dumps(compile_all(names, precision)))
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    info = compile_parallel(names, args.precision, args.jobs)
    ok = [n for n in names if "error" not in info[n]]
    rows: list[dict] = []
    for t in threads:
        env = {**os.environ, "TVM_NUM_THREADS": str(t), "OMP_NUM_THREADS": str(t)}
        # One process per runtime: idle worker threads of one runtime (TVM's, OpenMP's,
        # OpenVINO's spin after each call) take cores from the next one in the same
        # process (ORT ran BERT slower at 2 threads than at 1; with OpenVINO loaded,
        # tpp_tvm and ORT ran EfficientNet 1.5x slower at 1 thread).
        impls = args.impls.split(",")
        if args.impls == ",".join(IMPLS):
            impls += list(peer_alternates(precision))  # each peer's better run counts
        groups = [[impl] for impl in impls
                  if not (args.precision != "float32" and impl == "torch")]
        for _ in range(args.passes):
            for impls in groups:
                cmd = [sys.executable, __file__, "--models", ",".join(ok), "--rounds",
                       str(args.rounds), "--worker", str(t), "--impls", ",".join(impls),
                       "--precision", args.precision]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                sys.stderr.write(out.stderr[-4000:])
                if out.returncode == 0:
                    rows = keep_fastest(rows + json.loads(out.stdout.strip().splitlines()[-1]),
                                        ("model", "impl", "threads"), "median_ms")
    from harness import results_dir

    import tpp_tvm
    from tpp_tvm.target import host_isa

    host = host_isa()
    args.out = args.out or results_dir()
    from tpp_tvm.tuning import target_tag

    cpu = f"{host.model_name}, LLVM `{target_tag(tpp_tvm.target())}` ({host.summary()})"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "zoo" + ("" if args.set == "main" else f"_{args.set}") + precision.suffix
    runs = [{"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "command": f"python benchmarks/zoo.py {' '.join(sys.argv[1:])}",
             "models": list(info)}]
    if args.merge and (args.out / f"{stem}.json").exists():
        old = json.loads((args.out / f"{stem}.json").read_text())
        rows, info = _merged(old, rows, info, list(SETS[args.set]))
        runs = old.get("runs", [{"date": "earlier", "command": "the file's first run"}]) + runs
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"cpu": cpu, "precision": args.precision, "rows": rows, "models": info,
         "runs": runs}, indent=1))
    text = render(rows, info, threads, cpu, args.precision)
    if len(runs) > 1:  # say which rows came from which run
        text += "Runs merged into this table (later runs replace the rows of their models):\n\n"
        text += "".join(f"- {r['date']}: `{r['command']}`\n" for r in runs) + "\n"
    (args.out / f"{stem}.md").write_text(text)
    print((args.out / f"{stem}.md").read_text())
    wrong = [r for r in rows if r.get("impl") == "tpp_tvm" and _wrong(r, args.precision)]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
