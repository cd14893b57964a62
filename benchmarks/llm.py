"""Weight-only quantized LLM decoding: a KV-cache Llama export quantized by ONNX Runtime's
``MatMulNBitsQuantizer`` (``com.microsoft:MatMulNBits``), tpp_tvm's ``DecoderSession``
against ONNX Runtime on the same file.

The model is ``decoder.py``'s ``llama`` (8 layers, hidden 1024, GQA 16/4 heads, SwiGLU 2816,
vocabulary 32000, random weights from a fixed seed), exported with its cache; every MatMul
(56 of them, the LM head included) becomes 4-bit (or ``--bits 8``) blockwise weights
(``--block``, symmetric), once per ``accuracy_level`` in ``--levels``: 0 computes in fp32, 4
quantizes A's blocks to int8 (what ONNX Runtime GenAI's CPU models use). The runs are
``decoder.py``'s (its ``llama-int4-b32-l4`` style models: a process per runtime, the fastest
round kept, weight GB/s against the measured read bandwidth); this script names the LLM
configurations and writes their tables as ``llm``. OpenVINO is left out: it does not read
``MatMulNBits``::

    python benchmarks/llm.py                          # int4 block 32, levels 0 and 4, 1 thread
    python benchmarks/llm.py --levels 4 --rounds 2 --new 64

Writes ``results/<isa>-<cpu>/llm.md`` and ``llm.json``.

Level-4 tokens need not match ONNX Runtime's on random weights: A's int8 rounding amplifies
float differences through the layers (ONNX Runtime's own optimized and unoptimized graphs
differ by about 1% in the logits of this model).

Still to come (issue 53): a 0.5B and a 1B model, 512-token prefill on AMX tiles, 2 threads,
OpenVINO's own int4 compression as a peer, logits error columns.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

TITLE = "Weight-only quantized LLM decoding (MatMulNBits): tokens per second"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--levels", default="0,4")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--impls", default="tpp_tvm,onnxruntime")
    parser.add_argument("--out", help="folder for llm.md/json (default: results/<cpu>)")
    args = parser.parse_args(argv)
    models = [f"llama-int{args.bits}-b{args.block}-l{level}"
              for level in args.levels.split(",")]
    cmd = [sys.executable, str(Path(__file__).with_name("decoder.py")),
           "--models", ",".join(models), "--name", "llm", "--title", TITLE,
           "--prompt", str(args.prompt), "--new", str(args.new), "--rounds", str(args.rounds),
           "--threads", str(args.threads), "--impls", args.impls]
    cmd += ["--out", args.out] if args.out else []
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main())
