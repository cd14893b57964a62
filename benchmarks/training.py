"""Training-step time: tpp_tvm against torch eager and torch.compile, 1 and 2 threads.

One step = forward, MSE loss, backward, AdamW update of every parameter, on the MLP
(64x1024 -> 4096 -> 4096 -> 1024, GELU) and one BERT-base encoder layer (batch 1, seq 128,
hidden 768, 12 heads, FFN 3072). All implementations start from the same weights
(``tpp_tvm.training.models`` / ``.reference``) and train on the same batch; the first steps'
losses are compared across implementations (column "loss Δ": max relative difference
against torch eager over the timed run's first ``CHECK_STEPS`` steps). torch at its best:
eager with the fused AdamW kernel (``fused=True``); torch.compile of the whole step
(forward, loss, backward and the optimizer update in one compiled function).

Each (implementation, threads) runs in its own worker process (thread pools are sized once
per process; timing, workers and result files: ``benchmarks/harness.py``)::

    python benchmarks/training.py            # full size, 1 and 2 threads
    python benchmarks/training.py --quick    # small models, fewer repeats (harness check)

Reported: median step time (ms), compile time (s; torch.compile: its first step), the
tpp_tvm / torch-eager and tpp_tvm / torch.compile time ratios (goal: <= 0.8 and <= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import (
    machine,
    median_time,
    results_dir,
    use_quick_timing,
    worker_env,
    worker_rows,
    write_results,
)

IMPLS = ("tpp_tvm", "torch", "torch_compile")
TITLES = {"tpp_tvm": "tpp_tvm", "torch": "torch eager", "torch_compile": "torch.compile"}
CHECK_STEPS = 3
LR = 1e-4
WORKER_TIMEOUT_S = 1800

#: name -> (full-size arguments, --quick arguments)
MODELS: dict[str, tuple[dict, dict]] = {
    "mlp": ({"batch": 64, "sizes": [1024, 4096, 4096, 1024]},
            {"batch": 32, "sizes": [256, 512, 512, 256]}),
    "bert_layer": ({"batch": 1, "seq": 128, "hidden": 768, "heads": 12, "intermediate": 3072},
                   {"batch": 1, "seq": 64, "hidden": 256, "heads": 4, "intermediate": 1024}),
}


def title(name: str, a: dict) -> str:
    if name == "mlp":
        return f"MLP {a['batch']}×{'→'.join(map(str, a['sizes']))} (GELU)"
    return (f"BERT layer (seq {a['seq']}, hidden {a['hidden']}, {a['heads']} heads, "
            f"FFN {a['intermediate']}, batch {a['batch']})")


def build(name: str, a: dict) -> tuple[Any, tuple[int, ...]]:
    """The Relax model and its input shape (labels have the output's shape)."""
    from tpp_tvm.training import models as tm

    if name == "mlp":
        return tm.mlp(a["batch"], a["sizes"], activation="gelu"), (a["batch"], a["sizes"][0])
    return (tm.bert_layer(a["batch"], a["seq"], a["hidden"], a["heads"], a["intermediate"]),
            (a["batch"], a["seq"], a["hidden"]))


def torch_twin(name: str, a: dict) -> Any:
    from tpp_tvm.training import reference

    if name == "mlp":
        return reference.mlp(a["sizes"], "gelu")
    return reference.bert_layer(a["hidden"], a["heads"], a["intermediate"])


def data(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal(shape).astype("float32"),
            rng.standard_normal(out_shape).astype("float32"))


def _losses_then_time(step_fn) -> tuple[list[float], float]:
    losses = [step_fn() for _ in range(CHECK_STEPS)]
    return losses, median_time(step_fn)


def run_tpp_tvm(name: str, a: dict, threads: int) -> dict:
    from tpp_tvm import target
    from tpp_tvm.training import AdamW, compile_training_step

    model, shape = build(name, a)
    t0 = time.perf_counter()
    step = compile_training_step(model, "mse", AdamW(lr=LR), target=target(num_cores=threads))
    compile_s = time.perf_counter() - t0
    x, y = data(shape, shape)
    losses, seconds = _losses_then_time(lambda: step.step(x, labels=y))
    top = step.profile(x, labels=y, repeat=2)[:4]
    note = "top kernels: " + ", ".join(f"{k} {ms:.1f} ms" for k, ms, _ in top)
    return {"median_s": seconds, "compile_s": compile_s, "losses": losses, "note": note}


def run_torch(name: str, a: dict, threads: int, compile_: bool) -> dict:
    import torch

    from tpp_tvm.training import reference

    torch.set_num_threads(threads)
    model, shape = build(name, a)
    module = reference.load_params(torch_twin(name, a), model)
    # Each at its best: eager with the fused AdamW kernel; compiled as a whole step
    # (forward, loss, backward, update), inductor generating the update (its own fusion of
    # the foreach AdamW), as torch's optimizer-compile recipe does.
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01,
                            **({} if compile_ else {"fused": True}))
    x, y = (torch.from_numpy(v) for v in data(shape, shape))

    def train_step() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(train_step) if compile_ else train_step

    def step() -> float:
        return compiled().item()

    t0 = time.perf_counter()
    first = step()
    compile_s = time.perf_counter() - t0 if compile_ else None
    losses, seconds = _losses_then_time(step)
    note = f"torch {torch.__version__}" + (", inductor; compile = first step, caches off"
                                           if compile_ else "")
    return {"median_s": seconds, "compile_s": compile_s, "losses": [first, *losses][:CHECK_STEPS],
            "note": note}


def run_worker(impl: str, threads: int, quick: bool) -> list[dict]:
    if quick:
        use_quick_timing()
    rows = []
    for name, sizes in MODELS.items():
        a = sizes[1] if quick else sizes[0]
        row = {"model": name, "title": title(name, a), "impl": impl, "threads": threads}
        try:
            if impl == "tpp_tvm":
                res = run_tpp_tvm(name, a, threads)
            else:
                res = run_torch(name, a, threads, impl == "torch_compile")
            row |= {"status": "ok", **res}
        except Exception as exc:  # a benchmark row records any failure
            row |= {"status": "error", "note": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
    return rows


def spawn(impl: str, threads: int, quick: bool) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl,
           "--threads", str(threads)] + (["--quick"] if quick else [])
    env = worker_env(threads)
    if impl == "torch_compile":
        # Compile time means a cold compile, not a hit in inductor's on-disk cache.
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    rows, why = worker_rows(cmd, env, WORKER_TIMEOUT_S)
    if rows is not None:
        return rows
    return [{"model": m, "title": m, "impl": impl, "threads": threads, "status": "error",
             "note": why[:300]} for m in MODELS]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def render(rows: list[dict], command: str, date: str, load: str) -> str:
    lines = ["# Training step: tpp_tvm vs torch eager vs torch.compile", "",
             f"`{command}` — {date}, load before/after {load}", "",
             f"Machine: {machine()}", "",
             "One step = forward + MSE loss + backward + AdamW update (fp32). Times are "
             "medians in ms; compile in s. Ratios are tpp_tvm time / peer time (goal: ≤ 0.8 "
             "vs eager, ≤ 1 vs torch.compile). loss Δ: max relative difference of the first "
             f"{CHECK_STEPS} losses against torch eager.", ""]
    by = {(r["model"], r["impl"], r["threads"]): r for r in rows}
    threads = sorted({r["threads"] for r in rows})
    for name in MODELS:
        some = next((r for r in rows if r["model"] == name), None)
        lines += [f"## {some['title'] if some else name}", "",
                  "| threads | " + " | ".join(f"{TITLES[i]} ms" for i in IMPLS)
                  + " | tpp_tvm compile s | torch.compile compile s | vs eager | "
                  "vs torch.compile | loss Δ |",
                  "|" + "---|" * (len(IMPLS) + 6)]
        for t in threads:
            cells = []
            for impl in IMPLS:
                r = by.get((name, impl, t))
                ok = r and r["status"] == "ok"
                cells.append(f"{1e3 * r['median_s']:.1f}" if ok else
                             (r["status"] if r else "-"))
            tpp, eager, comp = (by.get((name, i, t)) for i in IMPLS)

            def ok(r: dict | None) -> bool:
                return bool(r) and r["status"] == "ok"

            ratio_e = f"{tpp['median_s'] / eager['median_s']:.2f}" if ok(tpp) and ok(eager) \
                else "-"
            ratio_c = f"{tpp['median_s'] / comp['median_s']:.2f}" if ok(tpp) and ok(comp) \
                else "-"
            delta = f"{_rel(tpp['losses'], eager['losses']):.1e}" if ok(tpp) and ok(eager) \
                else "-"
            ccomp = f"{comp['compile_s']:.1f}" if ok(comp) else "-"
            ctpp = f"{tpp['compile_s']:.1f}" if ok(tpp) else "-"
            lines.append(f"| {t} | " + " | ".join(cells)
                         + f" | {ctpp} | {ccomp} | {ratio_e} | {ratio_c} | {delta} |")
        lines.append("")
        for r in rows:
            if r["model"] == name and r.get("note"):
                lines.append(f"- {TITLES[r['impl']]}, {r['threads']} thread(s): {r['note']}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--impls", help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--quick", action="store_true", help="small models, short timing")
    parser.add_argument("--out", help="folder for training.md/json (default: results/<cpu>)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None and not getattr(args, "worker", None):
        args.out = str(results_dir())
    if args.worker:
        print(json.dumps(run_worker(args.impl, int(args.threads), args.quick)))
        return 0
    impls = args.impls.split(",") if args.impls else list(IMPLS)
    load_before = os.getloadavg()[0]
    rows = []
    for t in (int(x) for x in args.threads.split(",")):
        for impl in impls:
            print(f"{impl}, {t} thread(s) ...", file=sys.stderr)
            rows.extend(spawn(impl, t, args.quick))
    write_results(args.out, "training", argv, rows, load_before,
                  lambda command, date, load: render(rows, command, date, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
