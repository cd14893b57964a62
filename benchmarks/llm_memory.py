"""Resident memory of a weight-only LLM in each runtime: what holding the model costs.

For each runtime, in a process of its own: the process's resident memory before the runtime
is imported, what importing it adds, what loading the model adds (tpp_tvm: a
``DecoderSession`` with its prompt and step builds compiled ahead, ``prepare``), then what a
generation adds (the prompt, then ``--new`` greedy tokens: activations, the KV cache, the
runtime's pools), and the process's peak. Beside: the bytes of the file's initializers (a
runtime that holds its weights once, as the file stores them, holds about that much for
them). The models are ``llm.py``'s (``decoder.py``'s Llama-style decoders quantized by
ONNX Runtime's ``MatMulNBitsQuantizer``)::

    python benchmarks/llm_memory.py                     # llama500m int4 and int8, level 4

Writes ``results/<isa>-<cpu>/llm_memory.md`` and ``llm_memory.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys

import numpy as np
from decoder import PeerLoop, export, initializer_bytes, resident_mb
from harness import machine, results_dir, run_header, write_results

TITLE = "Weight-only quantized LLM: resident memory per runtime"
#: The module each runtime is imported as.
_MODULES = {"tpp_tvm": "tpp_tvm.decoding", "onnxruntime": "onnxruntime",
            "openvino": "openvino", "openvino_llm": "openvino"}


def measure(name: str, impl: str, prompt_len: int, new: int) -> dict:
    """One runtime's memory (MB) holding the export ``name`` and generating from it."""
    path = export(name)
    prompt = np.random.default_rng(0).integers(0, 1000, (1, prompt_len)).astype(np.int64)
    before = resident_mb()
    importlib.import_module(_MODULES[impl])
    imported = resident_mb()
    if impl == "tpp_tvm":
        from tpp_tvm.decoding import DecoderSession

        session = DecoderSession(str(path))
        session.prepare(prompt_len, prompt_len + new)
        loaded = resident_mb()
        session.generate(prompt, new)
    else:
        loop = PeerLoop(impl, path, int(os.environ.get("TVM_NUM_THREADS", "1")))
        loaded = resident_mb()
        loop.generate(prompt, new)
    after = resident_mb()
    return {"model": name, "impl": impl, "prompt": prompt_len, "new": new,
            "before_mb": before, "import_mb": imported - before, "loaded_mb": loaded - imported,
            "generated_mb": after - loaded,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
            "initializer_mb": initializer_bytes(path) / 1e6}


def render(rows: list[dict], command: str, date: str, load: str) -> str:
    lines = [f"# {TITLE}", "", *run_header(machine(), date, command, load),
             "- A process per runtime (1 thread). MB of resident memory: the process before "
             "the runtime is imported; what importing it adds; what loading the model adds "
             "(tpp_tvm: the session with its prompt and step builds compiled); what "
             "generating adds; the process's peak (tpp_tvm's while compiling). \"x file\" "
             "divides the loaded model's MB by the file's initializer MB.", "",
             "| model | runtime | process before | + import | + model | x file | "
             "+ generating | peak | file initializers |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['prompt']}+{r['new']}) | {r['impl']} | {r['before_mb']:.0f} | "
            f"{r['import_mb']:.0f} | {r['loaded_mb']:.0f} | "
            f"{r['loaded_mb'] / r['initializer_mb']:.2f} | "
            f"{r['generated_mb']:.0f} | {r['peak_mb']:.0f} | {r['initializer_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama500m", help="llama, llama500m or llama1b")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--impls", default="tpp_tvm,onnxruntime,openvino,openvino_llm")
    parser.add_argument("--out", help="folder for llm_memory.md/json (default: results/<cpu>)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [f"{args.model}-int{bits}-b32-l4" for bits in args.bits.split(",")]
    if args.worker:
        name, impl = args.worker.split(":")
        print(json.dumps(measure(name, impl, args.prompt, args.new)))
        return 0
    load_before = os.getloadavg()[0]
    rows = []
    for name in models:
        export(name)  # once, before the workers
        for impl in args.impls.split(","):
            cmd = [sys.executable, __file__, "--worker", f"{name}:{impl}", "--prompt",
                   str(args.prompt), "--new", str(args.new)]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 env={**os.environ, "TVM_NUM_THREADS": "1"})
            if out.returncode != 0:
                raise RuntimeError(f"{impl} on {name} failed: {out.stderr[-800:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[llm_memory] {rows[-1]}", file=sys.stderr, flush=True)
    write_results(args.out or str(results_dir()), "llm_memory", argv, rows, load_before,
                  lambda command, date, load: render(rows, command, date, load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
