"""Weight-only quantized LLM decoding: a KV-cache Llama export quantized by ONNX Runtime's
``MatMulNBitsQuantizer`` (``com.microsoft:MatMulNBits``), tpp_tvm's ``DecoderSession``
against ONNX Runtime on the same file.

The model is ``decoder.py``'s ``llama`` (8 layers, hidden 1024, GQA 16/4 heads, SwiGLU 2816,
vocabulary 32000, random weights from a fixed seed), exported with its cache; every MatMul
(56 of them, the LM head included) becomes 4-bit (or ``--bits 8``) blockwise weights
(``--block``, symmetric), once per ``accuracy_level`` in ``--levels``: 0 computes in fp32, 4
quantizes A's blocks to int8 (what ONNX Runtime GenAI's CPU models use). Each run: a
``--prompt``-token prompt, then ``--new`` greedy tokens, rounds interleaved in one process,
the fastest round of each runtime kept (``decoder.py``'s loop). Weight GB/s is the bytes of
the quantized weights a step reads over the step time, against the measured read bandwidth.
OpenVINO is left out: it does not read ``MatMulNBits``::

    python benchmarks/llm.py                          # int4 block 32, levels 0 and 4, 1 thread
    python benchmarks/llm.py --levels 4 --rounds 2 --new 64

Writes ``results/<isa>-<cpu>/llm.md`` and ``llm.json``.

Still to come (issue 53): a 0.5B and a 1B model, 512-token prefill on AMX tiles, 2 threads,
OpenVINO's own int4 compression as a peer, logits error columns.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from decoder import CACHE, export, render, run_export
from harness import results_dir, stub_torchvision_ops, write_results


def quantized(bits: int, block: int, level: int) -> Path:
    """``decoder.py``'s llama export with MatMulNBits weights (cached)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    path = CACHE / f"llama_cache_int{bits}_b{block}_level{level}.onnx"
    if path.exists():
        return path
    stub_torchvision_ops()
    model = onnx.load(str(export("llama")))
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=True,
                                     accuracy_level=level)
    quantizer.process()
    onnx.save(quantizer.model.model, str(path))
    return path


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
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    for level in (int(v) for v in args.levels.split(",")):
        path = quantized(args.bits, args.block, level)
        name = f"llama int{args.bits} block {args.block} level {level}"
        rows += run_export(name, path, args.prompt, args.new, args.rounds, args.threads,
                           args.impls.split(","))

    def text(command: str, date: str, load: str) -> str:
        body = render(rows, args.threads, command, date, load).split("\n", 1)[1]
        return "# Weight-only quantized LLM decoding (MatMulNBits): tokens per second\n" + body

    write_results(args.out or str(results_dir()), "llm", argv, rows, load_before, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
