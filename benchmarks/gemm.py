"""GEMM benchmark: tpp_tvm against torch, numpy (OpenBLAS), untuned TVM and the peak.

fp32, plus low-precision rows: bf16 (bf16 operands, fp32 accumulation; tpp_tvm and torch
bf16 matmul) and int8 (u8 x s8 -> int32 for tpp_tvm, s8 x s8 -> int32 for torch's
``_int_mm``, GOP/s). Their % of peak refers to the unit the host's default target runs them
on: the measured ``vdpbf16ps``/``vpdpbusd`` peaks on AVX-512 hosts, the measured
``tdpbf16ps``/``tdpbusd`` tile peaks on AMX hosts (``peak.py``; oneDNN uses the tiles too).

Convention: ``C[M, N] = A[M, K] @ B[K, N]``, row-major fp32; a shape is written ``MxNxK``.
GFLOP/s = 2*M*N*K / median seconds per call. Every implementation is checked once per shape
against a float64 numpy product (normwise max relative error).

Thread counts are fixed per process (TVM's pool reads ``TVM_NUM_THREADS`` at its first
parallel call; OpenBLAS and OpenMP read their variables at load), so the parent runs one
worker process per (implementation, thread count) and merges their JSON::

    python benchmarks/gemm.py                         # all shapes, 1 and 2 threads
    python benchmarks/gemm.py --quick --shapes 512x512x512 --threads 1
    python benchmarks/gemm.py --quick --impls tpp_tvm,tpp_tvm_bf16,torch_bf16,tpp_tvm_int8
    python benchmarks/gemm.py --quick --threads 1 --passes 3  # alternate, keep the fastest
    python benchmarks/gemm.py --worker --impl torch --threads 2 --shapes 512x512x512

Writes ``benchmarks/results/<cpu>/gemm.json`` (a list of rows) and ``gemm.md`` (a table).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness import (
    Skipped,
    keep_fastest,
    machine,
    measure_peaks,
    median_time,
    results_dir,
    run_header,
    timing_plan,
    untuned_tvm_matmul,
    use_quick_timing,
    worker_env,
    worker_rows,
    write_results,
)

HERE = Path(__file__).resolve().parent

SHAPES: tuple[tuple[int, int, int], ...] = (
    (512, 512, 512),
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (128, 768, 768),
    (128, 3072, 768),
    (128, 768, 3072),
    (127, 771, 513),
    (33, 1000, 257),
    (64, 4096, 4096),
)
IMPLS: tuple[str, ...] = ("tpp_tvm", "torch", "numpy", "tvm_default")
LOWP_IMPLS: tuple[str, ...] = ("tpp_tvm_bf16", "torch_bf16", "tpp_tvm_int8", "torch_int8")
IMPL_TITLES = {
    "tpp_tvm": "tpp_tvm",
    "torch": "torch",
    "numpy": "numpy",
    "tvm_default": "TVM-default",
    "tpp_tvm_bf16": "tpp_tvm bf16",
    "torch_bf16": "torch bf16",
    "tpp_tvm_int8": "tpp_tvm int8",
    "torch_int8": "torch int8",
}


def peak_of(impl: str, amx: bool) -> str:
    """The peak (``benchmarks/peak.py`` instruction) ``impl``'s % of peak refers to: the
    tile products on an AMX host, the AVX-512 dot products elsewhere, else fp32 FMA."""
    low = {"tpp_tvm_bf16": "bf16", "torch_bf16": "bf16", "tpp_tvm_int8": "int8",
           "torch_int8": "int8"}.get(impl)
    if low is None:
        return "fp32_fma"
    return f"amx_{low}" if amx else f"{low}_dp"


#: The loaded tile loops (``peak.py``'s ``amx_*_l1`` and ``amx_*_l2``), by where the operand
#: tiles come from.
TILE_LOAD_LOOPS = {"l1": "L1", "l2": "L2"}


def _loaded_tile_text(instr: str, unit: str, all_peaks: dict[str, dict[int, float]]) -> str:
    """What ``instr``'s tile loop sustains with its four tile loads a step, from each cache
    level, as a share of the no-load peak (1 thread, or the fewest measured)."""
    parts = []
    for suffix, level in TILE_LOAD_LOOPS.items():
        got, peak = all_peaks.get(f"{instr}_{suffix}", {}), all_peaks.get(instr, {})
        if got and peak:
            t = min(got)
            parts.append(f"from {level} {got[t]:.0f} {unit} ({100 * got[t] / peak[t]:.0f}% of "
                         f"the peak, {t} thread(s))")
    return "" if not parts else (
        " The same loop loading its two A and two B tiles every step (a 2 x 2-tile GEMM "
        "step's loads) sustains " + ", ".join(parts) + ": the ceiling of a tile kernel whose "
        "operands stream from that level.")


def _host_has_amx() -> bool:
    from tpp_tvm.target import best_isa

    return best_isa() == "amx"

TOLERANCE = 1e-4
"""Normwise relative error above which a result is marked wrong (fp32, K <= 3072)."""

TVM_DEFAULT_MAX_GFLOP = 1.0
"""Untuned TVM runs at ~1 GFLOP/s: shapes above this many GFLOP are skipped, with an estimate."""

WORKER_TIMEOUT_S = 1800


@dataclass
class Measured:
    """What an implementation adapter returns for one shape."""

    median_s: float
    max_rel_err: float
    note: str = ""


def shape_name(shape: tuple[int, int, int]) -> str:
    """``MxNxK`` spelling of a shape."""
    return "x".join(map(str, shape))


def parse_shapes(text: str | None) -> list[tuple[int, int, int]]:
    """Parse ``512x512x512,128x768x768`` (default: all of :data:`SHAPES`)."""
    if not text:
        return list(SHAPES)
    shapes = []
    for item in text.split(","):
        dims = tuple(int(d) for d in item.lower().replace("*", "x").split("x"))
        if len(dims) != 3 or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not MxNxK")
        shapes.append(dims)
    return shapes


# ----------------------------------------------------------------------------- measuring


_INPUTS: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _inputs(m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic fp32 A[M,K], B[K,N] in [-1, 1) for a shape (same in every worker)."""
    if (m, n, k) not in _INPUTS:
        rng = np.random.default_rng([m, n, k])
        a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        _INPUTS[(m, n, k)] = (a, b, ref)
    a, b, _ = _INPUTS[(m, n, k)]
    return a, b


def _rel_err(c: Any, m: int, n: int, k: int, ref: np.ndarray | None = None) -> float:
    """Normwise max relative error of ``c`` against the float64 product (or ``ref``)."""
    _inputs(m, n, k)
    ref = _INPUTS[(m, n, k)][2] if ref is None else ref
    c = np.asarray(c, dtype=np.float64)
    if c.shape != ref.shape:
        return math.inf
    return float(np.max(np.abs(c - ref)) / max(np.max(np.abs(ref)), 1e-30))


# ----------------------------------------------------------------------------- adapters
# Each adapter measures one shape in a process whose thread count is already fixed.


def _run_tpp_tvm(m: int, n: int, k: int, threads: int) -> Measured:
    """tpp_tvm's hand-scheduled GEMM, built for the host's TPP target.

    Expects ``build_gemm(m, n, k, dtype="float32", target=Target) -> kernel`` where
    ``kernel(a, b) -> c`` takes and returns numpy arrays, and optionally
    ``kernel.pack_b(b) -> b_packed`` and ``kernel.time(a, b_packed, number=, repeat=) ->
    float`` (median seconds per call, operands resident). B is packed once, outside the timed
    loop, as for constant weights; without ``time`` the numpy-level call is timed.
    """
    from tpp_tvm.kernels import build_gemm
    from tpp_tvm.target import target

    a, b = _inputs(m, n, k)
    kernel = build_gemm(m, n, k, dtype="float32", target=target(num_cores=threads))
    err = _rel_err(kernel(a, b), m, n, k)
    timer = getattr(kernel, "time", None)
    if timer is None:
        return Measured(median_time(lambda: kernel(a, b)), err)
    pack_b = getattr(kernel, "pack_b", None)
    b_arg = pack_b(b) if pack_b is not None else b
    t0 = time.perf_counter()
    kernel(a, b)
    number, repeat = timing_plan(time.perf_counter() - t0)
    seconds = float(timer(a, b_arg, number=number, repeat=repeat))
    note = "B packed once, outside the timed loop" if pack_b is not None else ""
    return Measured(seconds, err, note=note)


def _bf16_inputs(m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fp32 inputs rounded to bf16 (as fp32 arrays) and their float64 product: a bf16
    GEMM is checked against the exact product of what it multiplies."""
    import ml_dtypes

    a, b = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in _inputs(m, n, k))
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _int8_inputs(m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic u8 A, s8 B and their exact product."""
    rng = np.random.default_rng([m, n, k, 8])
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    return a, b, a.astype(np.int64) @ b.astype(np.int64)


def _time_kernel(kernel, a: np.ndarray, b_packed: np.ndarray) -> float:
    t0 = time.perf_counter()
    kernel.run_packed(a, b_packed)
    number, repeat = timing_plan(time.perf_counter() - t0)
    return float(kernel.time(a, b_packed, number=number, repeat=repeat))


def _run_tpp_tvm_lowp(dtype: str, m: int, n: int, k: int, threads: int) -> Measured:
    """tpp_tvm low-precision GEMM: bf16 (fp32 accumulation and output) or u8 x s8 -> int32,
    on AMX tiles (``tdpbf16ps``/``tdpbusd``) where the host's default target is AMX, else
    on the AVX-512 dot products (``vdpbf16ps``/``vpdpbusd``)."""
    from tpp_tvm.kernels import build_gemm
    from tpp_tvm.target import target

    a, b, ref = (_bf16_inputs if dtype == "bfloat16" else _int8_inputs)(m, n, k)
    kernel = build_gemm(m, n, k, dtype=dtype, target=target(num_cores=threads))
    b_packed = kernel.pack_b(b)
    err = _rel_err(kernel.run_packed(a, b_packed), m, n, k, ref)
    note = ("bf16 in, fp32 out; B packed (VNNI-2)" if dtype == "bfloat16"
            else "u8 x s8 -> int32; B packed (VNNI-4)")
    note = ("AMX tiles; " if kernel.plan.amx else "AVX-512; ") + note
    return Measured(_time_kernel(kernel, a, b_packed), err,
                    note=note + " once, outside the timed loop")


def _run_torch_bf16(m: int, n: int, k: int, threads: int) -> Measured:
    """torch.matmul on bf16 tensors (oneDNN; bf16 out)."""
    import torch

    torch.set_num_threads(threads)
    a_np, b_np, ref = _bf16_inputs(m, n, k)
    a, b = (torch.from_numpy(x).to(torch.bfloat16) for x in (a_np, b_np))
    with torch.inference_mode():
        err = _rel_err(torch.matmul(a, b).float().numpy(), m, n, k, ref)
        c = torch.empty(m, n, dtype=torch.bfloat16)
        seconds, how = _torch_best(
            lambda: torch.matmul(a, b, out=c),
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, m),
            lambda w, packed: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [],
                                                                 ""), b)
    return Measured(seconds, max(0.0, err - 2.0**-8),
                    note=f"torch bf16 ({how}); it rounds its output to bf16 (error checked "
                         "net of that 2^-8)")


def _run_torch_int8(m: int, n: int, k: int, threads: int) -> Measured:
    """``torch._int_mm`` (s8 x s8 -> int32; oneDNN, AMX tiles where the CPU has them). Its
    A is the u8 operand shifted to s8 (A - 128), checked against that exact product."""
    import torch

    if m <= 16 or n % 8 or k % 8:
        raise Skipped("skipped (torch._int_mm needs M > 16 and N, K multiples of 8)")
    torch.set_num_threads(threads)
    a_u8, b_np, _ = _int8_inputs(m, n, k)
    a_np = (a_u8.astype(np.int16) - 128).astype(np.int8)
    ref = a_np.astype(np.int64) @ b_np.astype(np.int64)
    a, b = torch.from_numpy(a_np), torch.from_numpy(b_np)
    with torch.inference_mode():
        err = _rel_err(torch._int_mm(a, b).numpy(), m, n, k, ref)
        c = torch.empty(m, n, dtype=torch.int32)
        seconds = median_time(lambda: torch._int_mm(a, b, out=c))
    return Measured(seconds, err, note=f"torch {torch.__version__} _int_mm (s8 x s8; C "
                                       "preallocated, no packed-B form exists)")


def _run_torch(m: int, n: int, k: int, threads: int) -> Measured:
    """torch.matmul (oneDNN/MKL) on CPU tensors sharing the numpy inputs' memory."""
    import torch

    torch.set_num_threads(threads)
    a, b = (torch.from_numpy(x) for x in _inputs(m, n, k))
    with torch.inference_mode():
        err = _rel_err(torch.matmul(a, b).numpy(), m, n, k)
        c = torch.empty(m, n)
        seconds, how = _torch_best(
            lambda: torch.matmul(a, b, out=c),
            lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, m),
            lambda w, packed: torch.ops.mkl._mkl_linear(a, packed, w, None, m), b)
    return Measured(seconds, err, note=f"torch {torch.__version__} fp32 ({how})")


def _torch_best(matmul, pack, packed_linear, b) -> tuple[float, str]:
    """torch at its best on a GEMM with a constant B: ``matmul`` into a preallocated C, or
    B packed once by oneDNN/MKL and the packed linear op inductor's freezing emits; the
    faster, and which it was."""
    plain = median_time(matmul)
    try:
        w = b.t().contiguous()  # a linear layer's weight, (N, K)
        packed = pack(w)
        prepacked = median_time(lambda: packed_linear(w, packed))
    except (RuntimeError, AttributeError):  # no MKL / oneDNN packed form in this build
        return plain, "matmul, C preallocated"
    if prepacked < plain:
        return prepacked, "B packed once, as inductor's freezing packs weights"
    return plain, "matmul, C preallocated; its packed-B linear was slower"


def _openblas_corename() -> str:
    """The OpenBLAS kernel set numpy picked at run time (e.g. SkylakeX), if it says."""
    libdir = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for path in glob.glob(str(libdir / "*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("scipy_openblas_get_corename64_", "openblas_get_corename"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "unknown core"


def _run_numpy(m: int, n: int, k: int, threads: int) -> Measured:
    """numpy.matmul (OpenBLAS, its own CPU detection: OPENBLAS_CORETYPE unset by the parent)."""
    a, b = _inputs(m, n, k)
    err = _rel_err(a @ b, m, n, k)
    c = np.empty((m, n), np.float32)
    note = f"numpy {np.__version__}, OpenBLAS {_openblas_corename()}, C preallocated"
    return Measured(median_time(lambda: np.matmul(a, b, out=c)), err, note=note)


_TVM_DEFAULT_RATE: list[float] = []  # GFLOP/s measured on earlier shapes, for skip estimates


def _run_tvm_default(m: int, n: int, k: int, threads: int) -> Measured:
    """A TE matmul compiled by TVM with no schedule: what TVM does without tpp_tvm.

    The code is serial (nothing parallelizes it), so ``threads`` does not change it.
    """
    gflop = 2 * m * n * k / 1e9
    if gflop > TVM_DEFAULT_MAX_GFLOP:
        if not _TVM_DEFAULT_RATE:
            _run_tvm_default(256, 256, 256, threads)  # a probe, to estimate honestly
        rate = min(_TVM_DEFAULT_RATE)  # big shapes run slower still: stay conservative
        raise Skipped(f"skipped (too slow, est. {gflop / rate:.0f} s/call at {rate:.1f} GFLOP/s)")
    c, seconds, mcpu = untuned_tvm_matmul(*_inputs(m, n, k))
    err = _rel_err(c, m, n, k)
    _TVM_DEFAULT_RATE.append(gflop / seconds)
    return Measured(seconds, err, note=f"llvm mcpu={mcpu}, no schedule (serial)")


ADAPTERS: dict[str, Callable[[int, int, int, int], Measured]] = {
    "tpp_tvm": _run_tpp_tvm,
    "torch": _run_torch,
    "numpy": _run_numpy,
    "tvm_default": _run_tvm_default,
    "tpp_tvm_bf16": lambda m, n, k, threads: _run_tpp_tvm_lowp("bfloat16", m, n, k, threads),
    "torch_bf16": _run_torch_bf16,
    "tpp_tvm_int8": lambda m, n, k, threads: _run_tpp_tvm_lowp("int8", m, n, k, threads),
    "torch_int8": _run_torch_int8,
}


def _row(
    m: int | None, n: int | None, k: int | None, impl: str, threads: int, **extra: Any
) -> dict[str, Any]:
    row: dict[str, Any] = {"m": m, "n": n, "k": k, "impl": impl, "threads": threads}
    row.update({"gflops": None, "median_s": None, "pct_peak": None, "max_rel_err": None})
    row.update(extra)
    return row


def run_worker(impl: str, threads: int, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Measure ``impl`` on ``shapes`` in this process; never raises for a failing shape."""
    rows = []
    for m, n, k in shapes:
        try:
            res = ADAPTERS[impl](m, n, k, threads)
        except ImportError as exc:
            rows.append(_row(m, n, k, impl, threads, status="missing", note=f"missing: {exc}"))
            continue
        except Skipped as exc:
            rows.append(_row(m, n, k, impl, threads, status="skipped", note=str(exc)))
            continue
        except Exception as exc:  # a benchmark row records any failure
            msg = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rows.append(_row(m, n, k, impl, threads, status="error", note=msg[:300]))
            continue
        ok = res.max_rel_err <= TOLERANCE
        rows.append(
            _row(
                m,
                n,
                k,
                impl,
                threads,
                status="ok" if ok else "wrong",
                gflops=2 * m * n * k / res.median_s / 1e9,
                median_s=res.median_s,
                max_rel_err=res.max_rel_err,
                note=res.note if ok else f"WRONG (max rel err {res.max_rel_err:.2e}) {res.note}",
            )
        )
    return rows


# ----------------------------------------------------------------------------- parent


def _spawn_worker(
    impl: str, threads: int, shapes: list[tuple[int, int, int]], quick: bool
) -> list[dict]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--impl",
        impl,
        "--threads",
        str(threads),
        "--shapes",
        ",".join(map(shape_name, shapes)),
    ] + (["--quick"] if quick else [])
    env = worker_env(threads, native_openblas=impl == "numpy")
    rows, why = worker_rows(cmd, env, WORKER_TIMEOUT_S)
    if rows is not None:
        return rows
    return [_row(m, n, k, impl, threads, status="error", note=why[:300]) for m, n, k in shapes]


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] == "ok":
        return f"{row['gflops']:.1f}"
    if row["status"] == "wrong":
        return f"{row['gflops']:.1f} WRONG"
    if row["status"] == "skipped":
        return row["note"]
    return row["status"]


def render_markdown(
    rows: list[dict],
    all_peaks: dict[str, dict[int, float]],
    command: str,
    machine_line: str,
    date: str,
    load: str = "",
) -> str:
    """The gemm.md tables: one line per (shape, threads), G(FL)OP/s per implementation."""
    peaks = all_peaks["fp32_fma"]
    by_key = {(r["m"], r["n"], r["k"], r["impl"], r["threads"]): r for r in rows}
    shapes = list(dict.fromkeys(
        (r["m"], r["n"], r["k"]) for r in rows if r["impl"] not in ("peak", "tpp_microkernel")
    ))
    threads = sorted(peaks)
    peak_text = ", ".join(
        f"{peaks[t]:.1f} GFLOP/s on {t} thread(s)"
        + (
            f" ({peaks[t] / (t * peaks[1]):.2f} of {t}× the 1-thread peak)"
            if t > 1 and 1 in peaks
            else ""
        )
        for t in threads
    )
    lines = [
        "# fp32 GEMM, GFLOP/s",
        "",
        *run_header(machine_line, date, command, load),
        "- Shapes are M×N×K: C[M,N] = A[M,K] · B[K,N], row-major fp32; "
        "GFLOP/s = 2·M·N·K / median time per call; each result is checked against a float64 "
        f"product (normwise rel. error ≤ {TOLERANCE:g}).",
        f"- Measured fp32 FMA peak (`benchmarks/peak.py`, best of before and after the run): "
        f"{peak_text}.",
        "- TVM-default is a TE matmul compiled with no schedule (serial code); numpy runs "
        "OpenBLAS with its own CPU detection (OPENBLAS_CORETYPE unset).",
        "- One harness for all: C preallocated; B packed once, outside the timed loop, where "
        "the library has a packed form (tpp_tvm; torch fp32/bf16: the MKL/oneDNN packed "
        "linear inductor's freezing emits, or matmul into C where that is faster: the notes "
        "say which); numpy and torch `_int_mm` have none. tpp_tvm is timed by TVM's "
        "`time_evaluator`, the others by a Python loop (about a microsecond a call more).",
        "",
        "| M×N×K | threads | "
        + " | ".join(IMPL_TITLES[i] for i in IMPLS)
        + " | tpp_tvm % peak | tpp_tvm / torch |",
        "|---|---:|" + "---:|" * len(IMPLS) + "---:|---:|",
    ]
    fp32_shapes = [sh for sh in shapes if any((*sh, i, t) in by_key for i in IMPLS
                                              for t in threads)]
    lowp_shapes = [sh for sh in shapes if any((*sh, i, t) in by_key for i in LOWP_IMPLS
                                              for t in threads)]
    shapes = fp32_shapes
    for m, n, k in shapes:
        for t in threads:
            cells = [_cell(by_key.get((m, n, k, impl, t))) for impl in IMPLS]
            tpp = by_key.get((m, n, k, "tpp_tvm", t))
            torch_row = by_key.get((m, n, k, "torch", t))
            pct = f"{tpp['pct_peak']:.0f}%" if tpp and tpp["pct_peak"] is not None else "-"
            ratio = "-"
            if tpp and torch_row and tpp["gflops"] and torch_row["gflops"]:
                ratio = f"{tpp['gflops'] / torch_row['gflops']:.2f}"
            lines.append(f"| {m}×{n}×{k} | {t} | " + " | ".join(cells) + f" | {pct} | {ratio} |")
    if lowp_shapes:
        lines += _lowp_table(by_key, lowp_shapes, threads, all_peaks)
    micro = [r for r in rows if r["impl"] == "tpp_microkernel"]
    if micro:
        lines += [
            "",
            "BRGEMM microkernel (`benchmarks/microkernel.py`), A/B/C resident in L1, 1 thread, "
            "batch-reduce of 2 blocks of K=64:",
            "",
            "| register tile (mr×nr) | GFLOP/s | % of 1-thread peak |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {r['mr']}×{r['nr']} | {r['gflops']:.1f} | {r['pct_peak']:.0f}% |" for r in micro
        ]
    notes = sorted(
        {
            f"{IMPL_TITLES.get(r['impl'], r['impl'])}: {r['note']}"
            for r in rows
            if r.get("note") and r["status"] != "skipped"
        }
    )
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _lowp_table(by_key: dict, shapes: list, threads: list[int],
                all_peaks: dict[str, dict[int, float]]) -> list[str]:
    """Low-precision rows: bf16 GFLOP/s and int8 GOP/s with % of their own measured peaks."""
    def peak_text(instr: str, unit: str) -> str:
        got = all_peaks.get(instr, {})
        return ", ".join(f"{got[t]:.0f} {unit} on {t} thread(s)" for t in sorted(got)) or "-"

    def pct(row):
        return f"{row['pct_peak']:.0f}%" if row and row.get("pct_peak") is not None else "-"

    amx = any(instr.startswith("amx_") for instr in all_peaks)
    bf16_peak, int8_peak = ("amx_bf16", "amx_int8") if amx else ("bf16_dp", "int8_dp")
    unit = "the AMX tiles" if amx else "the AVX-512 dot products"
    lines = [
        "",
        "## Low precision",
        "",
        f"On this host both tpp_tvm and torch run low precision on {unit}; % of peak refers "
        "to that unit's measured peak (`benchmarks/peak.py`; tile peaks with random tile "
        "data and no loads).",
        "",
        f"- bf16 (bf16 × bf16, fp32 accumulation and output), GFLOP/s; measured "
        f"`{'tdpbf16ps' if amx else 'vdpbf16ps'}` peak {peak_text(bf16_peak, 'GFLOP/s')}."
        f"{_loaded_tile_text(bf16_peak, 'GFLOP/s', all_peaks)} "
        "Checked against the float64 product of the bf16-rounded inputs.",
        f"- int8, GOP/s (tpp_tvm u8 × s8 → int32, torch `_int_mm` s8 × s8 → int32); measured "
        f"`{'tdpbusd' if amx else 'vpdpbusd'}` peak {peak_text(int8_peak, 'GOP/s')}."
        f"{_loaded_tile_text(int8_peak, 'GOP/s', all_peaks)} Checked exactly.",
        "",
        "| M×N×K | threads | tpp_tvm bf16 | % bf16 peak | torch bf16 | tpp_tvm bf16 / torch "
        "bf16 | tpp_tvm bf16 / tpp_tvm fp32 | tpp_tvm int8 | % int8 peak | torch int8 | "
        "tpp_tvm int8 / torch int8 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, n, k in shapes:
        for t in threads:
            bf, tb, i8, f32, ti8 = (by_key.get((m, n, k, impl, t)) for impl in
                                    ("tpp_tvm_bf16", "torch_bf16", "tpp_tvm_int8", "tpp_tvm",
                                     "torch_int8"))

            def ratio(x, y):
                return f"{x['gflops'] / y['gflops']:.2f}" if x and y and x["gflops"] and \
                    y["gflops"] else "-"

            lines.append(f"| {m}×{n}×{k} | {t} | {_cell(bf)} | {pct(bf)} | {_cell(tb)} | "
                         f"{ratio(bf, tb)} | {ratio(bf, f32)} | {_cell(i8)} | {pct(i8)} | "
                         f"{_cell(ti8)} | {ratio(i8, ti8)} |")
    return lines


def _measure_microkernel() -> list[dict]:
    """The BRGEMM microkernel with operands in L1 (one thread, its own process)."""
    env = dict(os.environ, TVM_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "microkernel.py")],
        capture_output=True, text=True, env=env, check=False,
    )
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line) | {"threads": 1, "m": None, "n": None, "k": None,
                                           "status": "ok"})
    if not rows:
        print(f"microkernel benchmark failed: {proc.stderr[-500:]}", file=sys.stderr)
    return rows


def run_parent(args: argparse.Namespace, argv: list[str]) -> int:
    """Run every (impl, threads) worker, attach % of peak, write gemm.json and gemm.md."""
    shapes = parse_shapes(args.shapes)
    threads = [int(t) for t in args.threads.split(",")]
    impls = args.impls.split(",") if args.impls else list(IMPLS + LOWP_IMPLS)
    amx = _host_has_amx()
    instrs = ["fp32_fma"] + sorted({peak_of(i, amx) for i in impls} - {"fp32_fma"})
    # on AMX hosts, the tile loops with their operand loads: what a tile kernel can reach
    instrs += [f"{i}_{at}" for i in instrs if i.startswith("amx_") for at in TILE_LOAD_LOOPS]
    load_before = os.getloadavg()[0]
    print(f"measuring {', '.join(instrs)} peaks on {threads} thread(s) ...", file=sys.stderr)
    all_peaks = {instr: measure_peaks(threads, instr) for instr in instrs}
    rows: list[dict] = []
    for t in threads:
        for instr in instrs:
            rows.append(_row(None, None, None, "peak", t, status="ok", instr=instr,
                             pct_peak=100.0))
    measured: list[dict] = []
    for _ in range(args.passes):
        for t in threads:
            for impl in impls:
                print(f"{impl}, {t} thread(s) ...", file=sys.stderr)
                measured = keep_fastest(measured + _spawn_worker(impl, t, shapes, args.quick),
                                        ("m", "n", "k", "impl", "threads"), "median_s")
    rows.extend(measured)
    print("BRGEMM microkernel in L1 ...", file=sys.stderr)
    rows.extend(_measure_microkernel())
    # A peak is what the hardware can do and other load only subtracts: keep the better one.
    for instr in instrs:
        again = measure_peaks(threads, instr)
        all_peaks[instr] = {t: max(p, again[t]) for t, p in all_peaks[instr].items()}
    for row in rows:
        if row["impl"] == "peak":
            row["gflops"] = row["peak_gflops"] = all_peaks[row["instr"]][row["threads"]]
        elif row["gflops"] is not None:
            peak = all_peaks[peak_of(row["impl"], amx)][row["threads"]]
            row["pct_peak"] = 100.0 * row["gflops"] / peak
    write_results(args.out, "gemm", argv, rows, load_before,
                  lambda command, date, load: render_markdown(rows, all_peaks, command,
                                                              machine(), date, load))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parent by default; ``--worker`` measures one implementation and prints JSON rows."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated MxNxK (default: all)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--impls",
                        help=f"comma-separated subset of {','.join(IMPLS + LOWP_IMPLS)}")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repeats")
    parser.add_argument("--passes", type=int, default=1,
                        help="alternate the workers this many times and keep each one's "
                             "fastest pass (drift on shared machines)")
    parser.add_argument("--out", help="folder for gemm.json/gemm.md (default: results/<cpu>)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS + LOWP_IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None and not getattr(args, "worker", None):
        args.out = str(results_dir())
    if args.impls and not set(args.impls.split(",")) <= set(IMPLS + LOWP_IMPLS):
        parser.error(f"--impls must be a subset of {','.join(IMPLS + LOWP_IMPLS)}")
    if not args.worker:
        return run_parent(args, argv)
    if args.quick:
        use_quick_timing()
    rows = run_worker(args.impl, int(args.threads), parse_shapes(args.shapes))
    print(json.dumps(rows))  # the parent reads the last line of stdout
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
