"""Resident memory of a weight-only LLM in each runtime: what holding the model costs.

For each runtime, in a process of its own: the process's resident memory before the runtime
is imported, what importing it adds, what loading the model adds (tpp_tvm: a
``DecoderSession`` with its prompt and step builds compiled ahead, ``prepare``), then what a
generation adds (the prompt, then ``--new`` greedy tokens: activations, the KV cache, the
runtime's pools), and the process's peak. Beside: the bytes of the file's initializers (a
runtime that holds its weights once, as the file stores them, holds about that much for
them). The models are ``llm.py``'s (``decoder.py``'s Llama-style decoders quantized by
ONNX Runtime's ``MatMulNBitsQuantizer``); the measuring is ``decoder.py --memory``::

    python benchmarks/llm_memory.py                     # llama500m int4 and int8, level 4

Writes ``results/<isa>-<cpu>/llm_memory.md`` and ``llm_memory.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama500m", help="llama, llama500m or llama1b")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--impls", default="tpp_tvm,onnxruntime,openvino,openvino_llm")
    parser.add_argument("--out", help="folder for llm_memory.md/json (default: results/<cpu>)")
    args = parser.parse_args(argv)
    models = [f"{args.model}-int{bits}-b32-l4" for bits in args.bits.split(",")]
    cmd = [sys.executable, str(Path(__file__).with_name("decoder.py")), "--memory",
           "--models", ",".join(models), "--name", "llm_memory", "--prompt", str(args.prompt),
           "--new", str(args.new), "--impls", args.impls]
    cmd += ["--out", args.out] if args.out else []
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main())
