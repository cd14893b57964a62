"""Weight-only quantized LLM decoding: a KV-cache Llama export quantized by ONNX Runtime's
``MatMulNBitsQuantizer`` (``com.microsoft:MatMulNBits``), tpp_tvm's ``DecoderSession``
against ONNX Runtime and OpenVINO on the same file.

The models are ``decoder.py``'s Llama-style decoders (random weights from a fixed seed,
vocabulary 32000, GQA): ``llama`` (8 layers, hidden 1024, 0.16B parameters), ``llama500m``
(20 layers, hidden 1280, 0.45B) and ``llama1b`` (TinyLlama-1.1B's shape), exported with
their cache; every MatMul (the LM head included) becomes ``--bits`` 4 or 8 blockwise weights
(``--block``, symmetric) at each ``accuracy_level`` of ``--levels``: 0 computes in fp32, 4
quantizes A's blocks to int8 (what ONNX Runtime GenAI's CPU models use). The runs are
``decoder.py``'s (a process per runtime, the fastest round kept, weight GB/s against the
measured read bandwidth); this script names the LLM configurations and writes their tables
as ``llm``. Peers: ONNX Runtime (IOBinding), OpenVINO reading the same file with the cache
made stateful, at f32 (``openvino``) and at its own LLM settings (``openvino_llm``: bf16
where the CPU has it, int8 dynamic quantization of activations, u8 KV cache)::

    python benchmarks/llm.py                          # llama500m int4 and int8, level 4
    python benchmarks/llm.py --model llama --levels 0,4 --prompt 128 --threads 1

Writes ``results/<isa>-<cpu>/llm.md`` and ``llm.json``.

Level-4 tokens need not match the peers' on random weights: A's int8 rounding amplifies
float differences through the layers (ONNX Runtime's own optimized and unoptimized graphs
differ by about 1% in the logits of the 8-layer model).
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
    parser.add_argument("--model", default="llama500m", help="llama, llama500m or llama1b")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--levels", default="4")
    parser.add_argument("--prompt", default="128,512")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--impls", default="tpp_tvm,onnxruntime,openvino,openvino_llm")
    parser.add_argument("--out", help="folder for llm.md/json (default: results/<cpu>)")
    args = parser.parse_args(argv)
    models = [f"{args.model}-int{bits}-b{args.block}-l{level}"
              for bits in args.bits.split(",") for level in args.levels.split(",")]
    cmd = [sys.executable, str(Path(__file__).with_name("decoder.py")),
           "--models", ",".join(models), "--name", "llm", "--title", TITLE,
           "--prompt", args.prompt, "--new", str(args.new), "--rounds", str(args.rounds),
           "--threads", args.threads, "--impls", args.impls]
    cmd += ["--out", args.out] if args.out else []
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main())
