"""benchmarks/peak.py, the denominator of every "% of peak" and bandwidth figure: its C loops
must build and run on every x86 CPU we support (AVX-512 or AVX2 only), not just the one it
was written on (the stream kernels were AVX-512 only and died with SIGILL on a Zen 3)."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not (shutil.which("gcc") or shutil.which("cc")),
    reason="peak.py's loops are x86 C compiled with the host's gcc")


def _peak():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "peak.py"
    spec = importlib.util.spec_from_file_location("peak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("peak", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["read", "triad"])
def test_stream_bandwidth_runs_on_this_cpu(kind: str) -> None:
    bandwidth = _peak().measure_bandwidth(kind, threads=1, megabytes=16, repeats=1)
    assert 0.1 < bandwidth < 10_000  # GB/s: ran to the end and timed something real


def test_fp32_peak_runs_on_this_cpu() -> None:
    gflops = _peak().measure_peak("fp32_fma", threads=1, seconds=0.02)
    assert 1 < gflops < 100_000


@pytest.mark.parametrize("name", ["amx_bf16_l1", "amx_int8_l2"])
def test_tile_loops_with_loads_build_everywhere(name: str) -> None:
    """The loaded tile loops (a GEMM step's four tile loads before its four products) load
    every operand tile each step, from the next 4 KiB of their buffer, and compile on any
    x86 host; they run where the CPU has AMX."""
    peak = _peak()
    instr = peak.INSTRUCTIONS[name]
    source = peak._c_source(instr)
    for tile in range(4, 8):
        assert source.count(f"_tile_loadd({tile}, p + {1024 * (tile - 4)}, 64);") == peak.UNROLL
    assert f"#define TILE_BUFFER {instr.tile_buffer}" in source
    assert instr.tile_buffer == (peak.TILE_STEP_BYTES if name.endswith("l1")
                                 else peak.TILE_L2_BUFFER)
    assert peak._binary(name).exists()
    if not peak._has_amx():
        pytest.skip("this CPU has no AMX (amx_tile): the loop was built, not run")
    ops = peak.measure_peak(name, threads=1, seconds=0.02)
    assert 1 < ops < 1_000_000  # G(FL)OP/s: ran to the end and timed something real
