"""Tuning benchmark: MetaSchedule with the TPP rules against TVM's default rules.

For each workload — GEMM shapes (PrimFuncs), a BERT-base layer and a ResNet-50 bottleneck
block (Relax models, tuned per TPP subgraph) — both rule sets are tuned once to their largest
trial budget with the same search strategy and XGBoost cost model; the speed after N trials
per task is read back from the log cut to its first N records per task, built and timed in
one harness. The hand schedules (no tuning) are the reference line; for the models "tuned +
hand" is what a build with the log does (per subgraph the faster of the two).

    python benchmarks/tuning.py                         # the default run (about 40 min)
    python benchmarks/tuning.py --quick                 # a 256^3 GEMM, few trials
    python benchmarks/tuning.py --workloads gemm --trials 16,64,256 --tvm-trials 16,64,512
    python benchmarks/tuning.py --retime /tmp/tpp_tuning_bench_XXXX   # time its logs again

Writes ``benchmarks/results/<cpu>/tuning.{json,md}`` and ``tuning.png`` (speed against trials).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import results_dir, write_results

GEMMS = ((512, 512, 512), (128, 3072, 768))


def _median_seconds(fn, repeat: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def truncated_log(src: Path, n: int, dst: Path) -> Path:
    """A copy of the log holding only the first ``n`` records of each task (trial order)."""
    dst.mkdir(parents=True, exist_ok=True)
    kept, lines = {}, []
    for line in (src / "database_tuning_record.json").read_text().splitlines():
        if not line.strip():
            continue
        task = json.loads(line)[0]
        kept[task] = kept.get(task, 0) + 1
        if kept[task] <= n:
            lines.append(line)
    (dst / "database_tuning_record.json").write_text("\n".join(lines) + "\n")
    for name in ("database_workload.json", "meta.json", "choices.json"):
        if (src / name).is_file():
            (dst / name).write_text((src / name).read_text())
    return dst


# -- GEMM (PrimFunc) workloads ------------------------------------------------------------


def gemm_func(m: int, n: int, k: int):
    from tvm import te

    A = te.placeholder((m, k), name="A")
    B = te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), "k")
    C = te.compute((m, n), lambda i, j: te.sum(A[i, r] * B[r, j], axis=r), name="C")
    # B is a weight, as in the hand schedule's timing (packed once, outside the timed loop):
    # both rule sets may repack it (TPP rules into panels, TVM's RewriteLayout postproc).
    return te.create_prim_func([A, B, C]).with_attrs(
        {"global_symbol": "main", "layout_free_buffers": [1]})


def time_gemm_log(func, log: Path, target, shape) -> float | None:
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    from tpp_tvm.tir_pipeline import compile_kernels
    from tpp_tvm.tuning import open_logs

    sched = open_logs(log, target).schedule(func)
    if sched is None:
        return None
    # As tuning measured it and as a model runs it: a packed weight arrives packed.
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(tvm.IRModule({"main": sched}))
    rt = compile_kernels(mod, target).jit()
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.ty.shape])
                               .astype("float32")) for p in mod["main"].params]
    ev = rt.time_evaluator("main", tvm.cpu(), number=10, repeat=7)
    return float(np.median(ev(*args).results))


def time_gemm_hand(shape, target) -> float:
    import tpp_tvm

    m, n, k = shape
    kernel = tpp_tvm.build_gemm(m, n, k, target=target)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), "float32"), rng.standard_normal((k, n), "float32")
    return kernel.time(a, kernel.pack_b(b))


# -- Model workloads ----------------------------------------------------------------------


def model_of(name: str):
    import tpp_tvm
    from tpp_tvm import models

    onnx_model = models.bert_encoder(layers=1) if name == "bert_layer" else (
        models.resnet50_block())
    return onnx_model, tpp_tvm.from_onnx(onnx_model)


def time_model(mod, onnx_model, target, **build_kwargs) -> tuple[float, int]:
    """Median latency of the model built with ``build_kwargs``, and its tuned subgraphs."""
    import tvm

    import tpp_tvm
    from tpp_tvm import models
    from tpp_tvm.relay_passes.report import LoweringReport

    report = LoweringReport()
    exe = tpp_tvm.build(mod, target, report=report, **build_kwargs)
    vm = tvm.relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in models.example_inputs(onnx_model).values()]
    ev = vm.time_evaluator("main", tvm.cpu(), number=5, repeat=7)
    tuned = sum(n for row, n in report.kernels.items() if row.tuned)
    return float(np.median(ev(*args).results)), tuned


# -- driver -------------------------------------------------------------------------------


def run(args) -> list[dict]:
    import tpp_tvm
    from tpp_tvm.tuning import driver as tuning

    target = tpp_tvm.target(num_cores=args.threads)
    rows = []
    scratch = Path(args.retime) if args.retime else Path(
        tempfile.mkdtemp(prefix="tpp_tuning_bench_"))
    previous = {}
    if args.retime:  # tuning times come from the run that made the logs
        for r in json.loads((Path(args.out) / "tuning.json").read_text()):
            if r.get("tune_seconds_total"):
                previous[(r["workload"], r["rules"])] = r["tune_seconds_total"]
    workloads = []
    if "gemm" in args.workloads:
        workloads += [("gemm", s) for s in ((256, 256, 256),) if args.quick] or [
            ("gemm", s) for s in GEMMS]
    workloads += [(w, None) for w in args.workloads if w in ("bert_layer", "resnet_block")]
    for kind, shape in workloads:
        label = "x".join(map(str, shape)) if shape else kind
        print(f"== {label}", flush=True)
        if kind == "gemm":
            func = gemm_func(*shape)
            flops = 2.0 * shape[0] * shape[1] * shape[2]
            hand_s = time_gemm_hand(shape, target)
            rows.append({"workload": label, "rules": "hand", "trials": 0, "seconds": hand_s,
                         "tune_seconds": 0.0, "gflops": flops / hand_s / 1e9})
        else:
            onnx_model, mod = model_of(kind)
            hand_s, _ = time_model(mod, onnx_model, target)
            rows.append({"workload": label, "rules": "hand", "trials": 0, "seconds": hand_s,
                         "tune_seconds": 0.0})
        print(f"   hand schedules: {hand_s * 1e3:.3f} ms", flush=True)
        plans = {"tpp": args.trials, "tvm": args.tvm_trials} if kind == "gemm" else {
            "tpp": args.model_trials, "tvm": args.model_tvm_trials}
        for rules, budgets in plans.items():
            log = scratch / f"{label}-{rules}"
            t0 = time.perf_counter()
            if args.retime:
                tune_s = previous[(label, rules)]
                if rules == "tpp" and kind != "gemm":
                    tuning.recompare(mod, log, target)  # hand vs tuned, timed again
            else:
                tuning.tune(func if kind == "gemm" else mod, target, log,
                            trials_per_task=max(budgets), rules=rules, progress=args.verbose,
                            compare=(rules == "tpp" and kind != "gemm"))
                tune_s = time.perf_counter() - t0
            for n in budgets:
                cut = truncated_log(log, n, scratch / f"{label}-{rules}-{n}")
                row = {"workload": label, "rules": rules, "trials": n,
                       "tune_seconds_total": tune_s}
                if kind == "gemm":
                    secs = time_gemm_log(func, cut, target, shape)
                    row.update(seconds=secs, gflops=flops / secs / 1e9 if secs else None)
                else:
                    secs, tuned = time_model(mod, onnx_model, target, tune_logs=cut,
                                             force_tuned=True)
                    row.update(seconds=secs, tuned_subgraphs=tuned)
                rows.append(row)
                shown = f"{secs * 1e3:.3f} ms" if secs else "no valid schedule"
                print(f"   {rules} rules, {n} trials/task: {shown}", flush=True)
            if rules == "tpp" and kind != "gemm":
                secs, tuned = time_model(mod, onnx_model, target, tune_logs=log)
                rows.append({"workload": label, "rules": "tpp+hand", "trials": max(budgets),
                             "seconds": secs, "tuned_subgraphs": tuned,
                             "tune_seconds_total": tune_s})
                print(f"   tuned + hand (faster per subgraph): {secs * 1e3:.3f} ms", flush=True)
    return rows


def render(rows: list[dict], command: str, date: str, load: str, threads: int) -> str:
    lines = [
        "# Tuning: TPP rules vs TVM's default rules",
        "",
        f"`{command}` — {date}, load before/after {load}, {threads} thread(s) per kernel.",
        "Speed is relative to the hand schedules (no tuning); N trials = trials per task "
        "(the log cut to its first N records). Same search strategy and XGBoost cost model "
        "for both rule sets; tune time is the whole run to the largest N. With `--retime` the "
        "logs of an earlier run are built and timed again (tune times are that run's).",
        "",
        "| workload | rules | trials/task | ms | GFLOP/s | × hand | tune time (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    hand = {r["workload"]: r["seconds"] for r in rows if r["rules"] == "hand"}
    for r in rows:
        secs = r.get("seconds")
        ms = f"{secs * 1e3:.3f}" if secs else "—"
        gf = f"{r['gflops']:.1f}" if r.get("gflops") else ""
        ratio = f"{hand[r['workload']] / secs:.2f}" if secs else "—"
        tune = f"{r['tune_seconds_total']:.0f}" if r.get("tune_seconds_total") else ""
        lines.append(f"| {r['workload']} | {r['rules']} | {r['trials']} | {ms} | {gf} | "
                     f"{ratio} | {tune} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        hand = next(r["seconds"] for r in rows if r["workload"] == name and r["rules"] == "hand")
        for rules, style in (("tpp", "o-"), ("tvm", "s--")):
            pts = [(r["trials"], hand / r["seconds"]) for r in rows
                   if r["workload"] == name and r["rules"] == rules and r.get("seconds")]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{rules} rules")
        ax.axhline(1.0, color="gray", lw=1, label="hand schedule")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("trials per task")
        ax.set_ylabel("speed vs hand schedule")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="gemm,bert_layer,resnet_block")
    parser.add_argument("--trials", default="16,64,256", help="TPP rules: trials per task")
    parser.add_argument("--tvm-trials", default="16,64,512", help="TVM rules: trials per task")
    parser.add_argument("--model-trials", default="16,64",
                        help="TPP rules on the models: trials per task")
    parser.add_argument("--model-tvm-trials", default="16,64,128",
                        help="TVM rules on the models: trials per task (each task of a model "
                             "costs about a second per trial here)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a 256^3 GEMM, 8/16 trials")
    parser.add_argument("--verbose", action="store_true", help="tuning progress lines")
    parser.add_argument("--out", help="results folder (default: results/<cpu>)")
    parser.add_argument("--retime", metavar="DIR",
                        help="re-time the logs a previous run left in DIR (no tuning)")
    args = parser.parse_args(argv)
    if args.out is None and not getattr(args, "worker", None):
        args.out = str(results_dir())
    if args.quick:
        args.workloads, args.trials, args.tvm_trials = "gemm", "8", "8,16"
    args.workloads = args.workloads.split(",")
    for opt in ("trials", "tvm_trials", "model_trials", "model_tvm_trials"):
        setattr(args, opt, sorted(int(t) for t in getattr(args, opt).split(",")))
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    load = os.getloadavg()[0]
    rows = run(args)
    write_results(args.out, "tuning", argv, rows, load,
                  lambda cmd, date, ld: render(rows, cmd, date, ld, args.threads))
    plot(rows, Path(args.out) / "tuning.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
