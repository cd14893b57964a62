"""The ``tpp-tvm`` command line: ``info`` (what this host and tpp_tvm offer) and ``demo``.

Errors a user can cause (:class:`~tpp_tvm.errors.TPPError`) print one line and exit with
status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tpp_tvm.errors import TPPError

DEMO_SHAPE = (512, 512, 512)


def _show(tgt: Any) -> str:
    """A target as readable JSON (TVM escapes the slash of tags as ``\\/``)."""
    return str(tgt).replace("\\/", "/")


def _cmd_info(args: argparse.Namespace) -> int:
    """Print the detected host ISA, the TPP target chosen for it and the registered TPPs."""
    from tpp_tvm.target import host_isa, isa_of, target

    host = host_isa()
    print(f"host:    {host.model_name}")
    print(f"isa:     {host.summary()}")
    tgt = target(args.isa)
    print(f"target:  {isa_of(tgt)}: {_show(tgt)}")
    try:
        from tpp_tvm.intrinsics import registered
    except ImportError as exc:
        print(f"TPPs:    not available ({exc})")
        return 0
    names = [str(name) for name in registered()]
    print(f"TPPs:    {len(names)} registered")
    for name in names:
        print(f"  {name}")
    return 0


def _median_seconds(fn: Callable[[], Any], min_total_s: float = 0.5) -> float:
    """Median seconds per call over repeats of at least ~50 ms each (after one warm-up)."""
    fn()
    t0 = time.perf_counter()
    fn()
    number = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-9)))
    samples: list[float] = []
    while not samples or (sum(samples) * number < min_total_s and len(samples) < 9):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Compile a 512x512x512 fp32 GEMM onto TPPs, check it, and time it next to numpy."""
    import numpy as np

    from tpp_tvm.target import target

    m, n, k = DEMO_SHAPE
    tgt = target(args.isa, num_cores=args.threads)
    # TVM's pool sizes itself at its first parallel call, to half the logical CPUs on x86
    # unless told (it assumes SMT): give it the target's core count (an explicit --threads
    # wins over the environment).
    threads = str(int(tgt.attrs["num-cores"]))
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = threads
    else:
        os.environ.setdefault("TVM_NUM_THREADS", threads)
    print(f"compiling {m}x{n}x{k} fp32 GEMM for {_show(tgt)} ...", flush=True)
    try:
        from tpp_tvm.schedules.gemm import build_gemm
    except ImportError as exc:
        print(f"tpp-tvm: error: the GEMM schedule is not available: {exc}", file=sys.stderr)
        return 1
    kernel = build_gemm(m, n, k, dtype="float32", target=tgt)

    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.max(np.abs(np.asarray(kernel(a, b)) - ref)) / np.max(np.abs(ref)))
    if err > 1e-4:
        print(f"tpp-tvm: error: wrong result, max relative error {err:.2e}", file=sys.stderr)
        return 1

    timer = getattr(kernel, "time", None)
    if timer is not None:
        # B is a constant weight in real models: pack it once, outside the timed loop.
        pack_b = getattr(kernel, "pack_b", None)
        tpp_s = float(timer(a, pack_b(b) if pack_b else b, number=10, repeat=5))
    else:
        tpp_s = _median_seconds(lambda: kernel(a, b))
    numpy_s = _median_seconds(lambda: a @ b)
    flop = 2 * m * n * k
    print(f"correct (max relative error {err:.1e} vs float64)")
    print(
        f"tpp_tvm: {flop / tpp_s / 1e9:8.1f} GFLOP/s on {os.environ['TVM_NUM_THREADS']} thread(s)"
    )
    print(f"numpy:   {flop / numpy_s / 1e9:8.1f} GFLOP/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of ``tpp-tvm`` (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="tpp-tvm", description="TPP (LIBXSMM Tensor Processing Primitives) backend for TVM"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show the host ISA, the TPP target and registered TPPs")
    info.add_argument("--isa", help="avx512, amx or sve (default: best for this host)")
    info.set_defaults(func=_cmd_info)
    demo = sub.add_parser("demo", help="compile, check and time a 512^3 fp32 GEMM")
    demo.add_argument("--isa", help="avx512, amx or sve (default: best for this host)")
    demo.add_argument("--threads", type=int, help="num-cores of the target (default: all)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for a :class:`TPPError`)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TPPError as exc:
        print(f"tpp-tvm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
