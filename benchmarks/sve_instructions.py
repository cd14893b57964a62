"""Instruction counts of every TPP kernel on SVE next to AVX-512 (speed under qemu is moot).

Every catalogue TPP is tensorized by its SVE and its AVX-512 intrinsic and compiled into
one library per ISA. From the disassembly: each kernel's hot loop (its innermost loop with
the most vector instructions) and what it issues per iteration. Under qemu at 128-, 512-
and 2048-bit vectors: the instructions one call of the SVE kernel executes (``-d in_asm,
exec`` trace, attributed by address), which shows the same binary doing less work as the
vector grows. Run: ``python benchmarks/sve_instructions.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import tvm
from harness import RESULTS, machine, write_results
from tvm import s_tir

from tpp_tvm.cross import asm
from tpp_tvm.cross.runner import Call, executed_instructions
from tpp_tvm.cross.toolchain import disassemble, export_library
from tpp_tvm.intrinsics import TPPSpec, intrinsic
from tpp_tvm.intrinsics.reference import (
    BLOCK,
    operand_dtypes,
    operand_shapes,
    workload,
)
from tpp_tvm.intrinsics.registry import catalogue, portable
from tpp_tvm.target import target

DYNAMIC_VL_BYTES = (16, 64, 256)


def build(specs: list[TPPSpec], isa: str, path: Path) -> Path:
    """One library with kernel ``tpp<i>`` = spec i tensorized by its ``isa`` intrinsic."""
    funcs = {}
    for i, spec in enumerate(specs):
        sch = s_tir.Schedule(workload(spec))
        sch.tensorize(sch.get_loops(sch.get_sblock(BLOCK))[0], intrinsic(spec, isa))
        funcs[f"tpp{i}"] = sch.mod["main"].with_attr("global_symbol", f"tpp{i}")
    exe = tvm.compile(tvm.IRModule(funcs), target=target(isa, num_cores=1))
    if isa == "sve":
        return export_library(exe, path)
    exe.export_library(str(path))
    return path


def static_counts(objdump: str, n: int) -> list[dict]:
    """Per kernel: instructions of the whole kernel and of its hot loop, by class."""
    funcs = asm.functions(objdump)
    rows = []
    for i in range(n):
        insns = funcs[f"tpp{i}_compute_"]
        loop = asm.hot_loop(insns)
        rows.append({
            "kernel_insns": len(insns),
            "kernel_vector": sum(map(asm.is_vector, insns)),
            "loop_insns": len(loop),
            "loop_vector": sum(map(asm.is_vector, loop)),
            "loop_fma": sum(map(asm.is_fma, loop)),
            "loop_loads": sum(map(asm.is_load, loop)),
            "loop_stores": sum(map(asm.is_store, loop)),
            "loop_neon": asm.kinds(loop)["neon"],
        })
    return rows


def _inputs(spec: TPPSpec, rng: np.random.Generator) -> list[np.ndarray]:
    # Positive and away from zero: in every op's domain (sqrt, 1/x); counts are data-blind.
    return [(np.abs(rng.standard_normal(shape)) + 0.5).astype(dt)
            for shape, dt in zip(operand_shapes(spec), operand_dtypes(spec), strict=True)]


def dynamic_counts(lib: Path, specs: list[TPPSpec], vl_bytes: int) -> list[int]:
    """Instructions each kernel's ``_compute_`` function executes in one call, under qemu."""
    rng = np.random.default_rng(0)
    tensors, calls = [], []
    for i, spec in enumerate(specs):
        args = _inputs(spec, rng)
        calls.append(Call(f"tpp{i}", tuple(range(len(tensors), len(tensors) + len(args)))))
        tensors += args
    counts = executed_instructions(lib, tensors, calls, vl_bytes)
    return [counts[f"tpp{i}_compute_"] for i in range(len(specs))]


def render(rows: list[dict], command: str, date: str, load: str) -> str:
    head = ["TPP", "SVE loop: insns / vec / fma / ld / st",
            "AVX-512 loop: insns / vec / fma / ld / st", "SVE kernel: insns (vec)",
            "AVX-512 kernel: insns (vec)", *[f"SVE run @{8 * b}b" for b in DYNAMIC_VL_BYTES]]
    lines = [
        "# TPP kernels: SVE vs AVX-512 instruction counts",
        "",
        f"`{command}` — {date}, load {load}. Host: {machine()}.",
        "",
        "Both columns come from the same templates (`intrinsics/brgemm_template.py`,",
        "`eltwise_template.py`, `equation_template.py`, `transpose_template.py`) with the",
        "ISA's `VectorISA`. *Loop* is the kernel's hot loop",
        "(innermost loop with the most vector instructions) per iteration: all, vector, FMA,",
        "load and store instructions; one iteration moves one vector per operand (16 fp32 lanes",
        "on AVX-512, 4 x vscale on SVE: the SVE loop is the same at every vector length).",
        "AVX-512 knows N at compile time, so short rows are fully unrolled (no loop; see the",
        "kernel column). *Kernel* is the static size of the whole kernel function (its vector",
        "instructions in parentheses). *SVE run* is what one call",
        "executes under `qemu-aarch64` at that vector length (`-d in_asm,exec` trace);",
        "the tiles are the catalogue's (8x37, 6x64x64), so long vectors mostly run the",
        "predicated tail. Emulated time says nothing about speed and is not reported.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def loop(r: dict) -> str:
        if not r["loop_insns"]:
            return "unrolled"
        return (f"{r['loop_insns']} / {r['loop_vector']} / {r['loop_fma']} / "
                f"{r['loop_loads']} / {r['loop_stores']}")

    def kernel(r: dict) -> str:
        return f"{r['kernel_insns']} ({r['kernel_vector']})"

    for r in rows:
        lines.append("| " + " | ".join([
            f"`{r['tpp']}`", loop(r["sve"]), loop(r["avx512"]),
            kernel(r["sve"]), kernel(r["avx512"]),
            *[str(r["sve_executed"][str(b)]) for b in DYNAMIC_VL_BYTES],
        ]) + " |")
    neon = sum(r["sve"]["loop_neon"] for r in rows)
    lines += ["", f"NEON instructions in SVE hot loops: {neon}.", ""]
    gemm_row = next(r for r in rows if ".gemm." in r["tpp"])
    per_fma = {isa: gemm_row[isa]["loop_insns"] / gemm_row[isa]["loop_fma"]
               for isa in ("sve", "avx512")}
    lines += [
        f"GEMM microkernel hot loop: {per_fma['sve']:.2f} instructions per FMA on SVE, "
        f"{per_fma['avx512']:.2f} on AVX-512. Both issue one FMA per accumulator per k step",
        "(6 rows x 4 vectors); AVX-512 folds the broadcast of A into the FMA's memory operand,",
        "SVE loads it with `ld1rw` first (the indexed `fmla z, z, z[i]` form would share one",
        "`ld1rqw` among four rows: not done yet).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS), help="folder for sve.json/sve.md")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    specs = [s for s in catalogue() if portable(s)]
    with tempfile.TemporaryDirectory() as tmp:
        sve_lib = build(specs, "sve", Path(tmp) / "sve.so")
        avx_lib = build(specs, "avx512", Path(tmp) / "avx512.so")
        sve = static_counts(disassemble(sve_lib), len(specs))
        x86_asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(avx_lib)],
                                 check=True, capture_output=True, text=True).stdout
        avx = static_counts(x86_asm, len(specs))
        executed = {b: dynamic_counts(sve_lib, specs, b) for b in DYNAMIC_VL_BYTES}
    rows = [{"tpp": spec.name("sve"), "sve": s, "avx512": a,
             "sve_executed": {str(b): executed[b][i] for b in DYNAMIC_VL_BYTES}}
            for i, (spec, s, a) in enumerate(zip(specs, sve, avx, strict=True))]
    write_results(args.out, "sve", argv, rows, load_before,
                  lambda command, date, load: render(rows, command, date, load),
                  script="sve_instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
