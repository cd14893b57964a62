"""Dynamic shapes: one tpp_tvm compile of a BERT export with dynamic batch and sequence,
run at many sizes, against the static build of each size, ONNX Runtime and OpenVINO.

The model is ``transformers.BertModel`` (BERT-base layers, ``--layers`` of them, random
weights from a fixed seed) exported with ``dynamic_axes`` on ``input_ids`` and
``attention_mask`` (batch and seq), the way real services export. Per size:

- tpp_tvm dynamic: ``compile_onnx(path)`` once (a ``DynamicModel``); its first call at a
  size compiles that size's build (the "first call s" column);
- tpp_tvm static: ``compile_onnx(path, shape_dict=...)`` for that size alone;
- ONNX Runtime and OpenVINO (``INFERENCE_PRECISION_HINT`` f32) on the same dynamic export,
  and OpenVINO reshaped to each size (its best for a known size).

The two tpp_tvm forms are timed interleaved in one process (their ratio is the design's
cost); ORT and OpenVINO each run in their own process (``--passes`` alternates all workers
and keeps each one's fastest pass). A second table measures the design not chosen: one
module with symbolic shapes, built by TVM's default pipeline, on ``tpp_tvm.models``'
dynamic BERT encoder (TVM's converter cannot import the transformers export with symbolic
shapes; the error is recorded)::

    python benchmarks/dynamic.py                      # 4 layers, all sizes, 1 thread
    python benchmarks/dynamic.py --sizes 1x16,1x128 --layers 2 --rounds 3

Writes ``results/<isa>-<cpu>/dynamic.md`` and ``dynamic.json``.
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
from harness import (
    keep_fastest,
    machine,
    results_dir,
    run_header,
    stub_torchvision_ops,
    worker_env,
    worker_rows,
    write_results,
)

SIZES = ((1, 16), (1, 32), (1, 64), (1, 128), (1, 256), (1, 384), (4, 128), (8, 128))
CACHE = Path(tempfile.gettempdir()) / "tpp_tvm_dynamic"
WORKER_TIMEOUT_S = 3600
IMPLS = ("tpp_tvm", "onnxruntime", "openvino", "openvino_static", "tvm_symbolic")


def export(layers: int) -> Path:
    """The dynamic-axes BertModel export (cached)."""
    path = CACHE / f"bert{layers}_dynamic.onnx"
    if path.exists():
        return path
    import torch

    stub_torchvision_ops()
    import transformers

    CACHE.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=layers)).eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask)[0]

    ids = torch.zeros(1, 16, dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "out": {0: "batch", 1: "seq"}}
    with torch.no_grad():
        torch.onnx.export(Encoder(), (ids, torch.ones_like(ids)), str(path), opset_version=17,
                          dynamo=False, input_names=["input_ids", "attention_mask"],
                          output_names=["out"], dynamic_axes=axes)
    return path


def feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    """Token ids and a padding mask (the last eighth of each row masked)."""
    rng = np.random.default_rng(batch * 1000 + seq)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - max(1, seq // 8):] = 0
    return {"input_ids": rng.integers(0, 30000, (batch, seq)).astype(np.int64),
            "attention_mask": mask}


def _min_ms(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def _tpp_rows(path: Path, sizes, rounds: int) -> list[dict]:
    """Dynamic and static tpp_tvm builds of every size, timed interleaved."""
    import tpp_tvm

    t0 = time.perf_counter()
    dynamic = tpp_tvm.compile_onnx(str(path))
    dynamic_compile = time.perf_counter() - t0
    rows = []
    for batch, seq in sizes:
        x = feeds(batch, seq)
        t0 = time.perf_counter()
        out = dynamic(**x)[0]
        first_call = time.perf_counter() - t0
        t0 = time.perf_counter()
        static = tpp_tvm.compile_onnx(str(path), shape_dict={k: v.shape for k, v in x.items()})
        static_compile = time.perf_counter() - t0
        np.testing.assert_array_equal(static(**x)[0], out)
        dyn_ms, static_ms = float("inf"), float("inf")
        dynamic(**x), static(**x)
        for _ in range(rounds):  # interleaved: the machine's drift hits both alike
            dyn_ms = min(dyn_ms, _min_ms(lambda: dynamic(**x), 1))
            static_ms = min(static_ms, _min_ms(lambda: static(**x), 1))
        np.save(CACHE / f"tpp_{batch}x{seq}.npy", out)
        common = {"batch": batch, "seq": seq}
        rows.append({**common, "impl": "tpp_tvm", "median_ms": dyn_ms,
                     "first_call_s": first_call, "compile_s": dynamic_compile})
        rows.append({**common, "impl": "tpp_tvm_static", "median_ms": static_ms,
                     "compile_s": static_compile})
        print(f"[dynamic] tpp {batch}x{seq}: {dyn_ms:.2f} ms (static {static_ms:.2f}), "
              f"first call {first_call:.1f} s, static compile {static_compile:.1f} s",
              file=sys.stderr, flush=True)
    return rows


def _openvino(path: Path, threads: int, shapes: dict | None = None):
    """OpenVINO f32 on the export, denormals flushed; ``shapes``: reshaped to them first
    (a static model per size, as tpp_tvm's static build is)."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    if shapes:
        model.reshape(shapes)
    compiled = core.compile_model(model, "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads,
        "CPU_DENORMALS_OPTIMIZATION": True})
    return lambda x: compiled(x)[0]


def _peer_rows(impl: str, path: Path, sizes, rounds: int, threads: int) -> list[dict]:
    if impl == "onnxruntime":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.add_session_config_entry("session.set_denormal_as_zero", "1")
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        run = lambda x: sess.run(None, x)[0]  # noqa: E731
    elif impl == "openvino":
        run = _openvino(path, threads)
    rows = []
    for batch, seq in sizes:
        x = feeds(batch, seq)
        if impl == "openvino_static":  # reshaped to this size and compiled (not timed)
            run = _openvino(path, threads, {k: list(v.shape) for k, v in x.items()})
        ms = _min_ms(lambda: run(x), rounds)
        row = {"batch": batch, "seq": seq, "impl": impl, "median_ms": ms}
        ref = CACHE / f"tpp_{batch}x{seq}.npy"
        if ref.exists():
            want = np.asarray(run(x))
            row["err_vs_tpp"] = float(np.abs(np.load(ref) - want).max() / np.abs(want).max())
        rows.append(row)
    return rows


def _symbolic_rows(layers: int, sizes, rounds: int, threads: int) -> list[dict]:
    """TVM's default build of one symbolic-shape module: the transformers export (its
    import error) and tpp_tvm.models' dynamic BERT encoder (timed), next to tpp_tvm."""
    import onnx
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    import tpp_tvm
    from tpp_tvm import models

    rows = []
    try:
        from_onnx(onnx.load(str(export(layers))), keep_params_in_input=False)
    except Exception as exc:  # noqa: BLE001 - the row records why
        rows.append({"impl": "tvm_symbolic", "model": "transformers BertModel",
                     "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"})
    encoder = models.bert_encoder(layers=layers, dynamic=True)
    target = tvm.target.Target({"kind": "llvm", "mcpu": str(tvm.target.codegen
                                                             .llvm_get_system_cpu()),
                                "num-cores": threads})
    t0 = time.perf_counter()
    exe = tvm.compile(from_onnx(encoder, keep_params_in_input=False), target=target)
    compile_s = time.perf_counter() - t0
    vm = relax.VirtualMachine(exe, tvm.cpu())
    dynamic = tpp_tvm.compile_onnx(encoder)
    for batch, seq in sizes[:3]:  # TVM's untuned code is slow: the short sizes say enough
        x = models.example_inputs(encoder, {"hidden_states": (batch, seq, 768),
                                            "attention_mask": (batch, 1, 1, seq)})
        args = [tvm.runtime.tensor(v) for v in x.values()]
        want = dynamic(**x)[0]
        got = vm["main"](*args)
        got = (got if isinstance(got, tvm.runtime.Tensor) else got[0]).numpy()
        err = float(np.abs(got - want).max() / np.abs(want).max())
        sym_ms = _min_ms(lambda: vm["main"](*args), max(1, rounds // 2))
        tpp_ms = _min_ms(lambda: dynamic(**x), rounds)
        rows.append({"impl": "tvm_symbolic", "model": "tpp_tvm.models BERT encoder",
                     "batch": batch, "seq": seq, "median_ms": sym_ms, "tpp_ms": tpp_ms,
                     "compile_s": compile_s, "err_vs_tpp": err})
    return rows


def run_worker(args: argparse.Namespace) -> list[dict]:
    sizes = [tuple(s) for s in json.loads(args.sizes_json)]
    path = export(args.layers)
    if args.impl == "tpp_tvm":
        return _tpp_rows(path, sizes, args.rounds)
    if args.impl == "tvm_symbolic":
        return _symbolic_rows(args.layers, sizes, args.rounds, args.threads)
    return _peer_rows(args.impl, path, sizes, args.rounds, args.threads)


def render(rows: list[dict], layers: int, threads: int, command: str, date: str,
           load: str) -> str:
    by = {(r.get("batch"), r.get("seq"), r["impl"]): r for r in rows
          if r["impl"] != "tvm_symbolic"}
    sizes = sorted({(r["batch"], r["seq"]) for r in rows if "batch" in r and
                    r["impl"] == "tpp_tvm"}, key=lambda s: (s[0], s[1]))
    lines = [f"# Dynamic shapes: BERT-base ({layers} layers) with dynamic batch and seq", "",
             *run_header(machine(), date, command, load),
             f"- {threads} thread(s). Min ms over the rounds; tpp_tvm dynamic and static "
             "interleaved in one process, ONNX Runtime and OpenVINO f32 each in its own "
             "process, all on the same dynamic-axes export; OpenVINO also reshaped to each "
             "size (a static model per size, as tpp_tvm builds one; its compile not timed), "
             "its better figure in the ratio; denormals flushed by every runtime. err: max "
             "|tpp_tvm - peer| / max |peer|.", "",
             "| batch x seq | tpp_tvm dynamic | tpp_tvm static | dynamic / static | ORT | "
             "OpenVINO f32 | OpenVINO f32 reshaped | ORT / tpp_tvm | OV best / tpp_tvm | "
             "first call s | static compile s | err vs ORT |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(row, key="median_ms", fmt="{:.2f}"):
        return fmt.format(row[key]) if row and row.get(key) is not None else "-"

    for batch, seq in sizes:
        dyn, st = by.get((batch, seq, "tpp_tvm")), by.get((batch, seq, "tpp_tvm_static"))
        ort_row, ov = by.get((batch, seq, "onnxruntime")), by.get((batch, seq, "openvino"))
        ov_static = by.get((batch, seq, "openvino_static"))
        ov_best = min((r for r in (ov, ov_static) if r), key=lambda r: r["median_ms"],
                      default=None)

        def ratio(peer):
            return f"{peer['median_ms'] / dyn['median_ms']:.2f}" if peer and dyn else "-"

        lines.append(
            f"| {batch}x{seq} | {cell(dyn)} | {cell(st)} | "
            f"{dyn['median_ms'] / st['median_ms']:.2f} | {cell(ort_row)} | {cell(ov)} | "
            f"{cell(ov_static)} | {ratio(ort_row)} | {ratio(ov_best)} | "
            f"{cell(dyn, 'first_call_s', '{:.1f}')} | "
            f"{cell(st, 'compile_s', '{:.1f}')} | {cell(ort_row, 'err_vs_tpp', '{:.1e}')} |")
    dyn_compile = next((r["compile_s"] for r in rows if r["impl"] == "tpp_tvm"), None)
    if dyn_compile is not None:
        lines += ["", f"`compile_onnx` of the dynamic export itself: {dyn_compile:.2f} s "
                  "(each size then compiles on its first call, as the first-call column "
                  "shows; a static compile is the same build)."]
    sym = [r for r in rows if r["impl"] == "tvm_symbolic"]
    if sym:
        lines += ["", "## The design not chosen: one module with symbolic shapes (TVM's "
                  "default build)", "",
                  "| model | batch x seq | TVM symbolic ms | tpp_tvm dynamic ms | TVM / tpp_tvm "
                  "| TVM compile s | err |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in sym:
            if "error" in r:
                lines.append(f"| {r['model']} | - | import fails: {r['error'][:160]} | - | - "
                             "| - | - |")
            else:
                lines.append(f"| {r['model']} | {r['batch']}x{r['seq']} | "
                             f"{r['median_ms']:.1f} | {r['tpp_ms']:.2f} | "
                             f"{r['median_ms'] / r['tpp_ms']:.1f} | {r['compile_s']:.1f} | "
                             f"{r['err_vs_tpp']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sizes", help="comma-separated BATCHxSEQ (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--passes", type=int, default=1,
                        help="alternate the workers this many times, keep the fastest pass")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--out", help="folder for dynamic.md/json (default: results/<cpu>)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--sizes-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    sizes = SIZES if not args.sizes else tuple(
        tuple(int(d) for d in s.split("x")) for s in args.sizes.split(","))
    export(args.layers)
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    impls = args.impls.split(",")
    for _ in range(args.passes):
        for impl in impls:
            print(f"{impl} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl,
                   "--layers", str(args.layers), "--threads", str(args.threads),
                   "--rounds", str(args.rounds), "--sizes-json", json.dumps(sizes)]
            got, why = worker_rows(cmd, worker_env(args.threads), WORKER_TIMEOUT_S)
            if got is None:
                print(f"  {impl} failed: {why}", file=sys.stderr)
                continue
            rows = keep_fastest(rows + got, ("batch", "seq", "impl", "model"), "median_ms")
    write_results(args.out or str(results_dir()), "dynamic", argv, rows, load_before,
                  lambda command, date, load: render(rows, args.layers, args.threads,
                                                     command, date, load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
