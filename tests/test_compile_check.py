"""The compile matrix: every TPP, schedule and demo model builds to machine code for every
x86 CPU family and for the AMX target, each CPU in its own subprocess so an LLVM abort is a
failed test naming the item and the CPU, never a dead suite."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tpp_tvm.compile_check import X86_CPUS, check_target
from tpp_tvm.errors import UnsupportedISAError

#: Every AVX-512 CPU, the AMX target, and the oldest AVX2 CPU on its own ISA.
CHECKS = [(cpu, "tpp/avx512") for cpu in X86_CPUS] + [(None, "tpp/amx"), ("haswell", "tpp/avx2")]
#: Checked by default (each check compiles everything, 40-60 s on a 2-core machine): one
#: AVX-512 CPU without BF16 (Ice Lake-SP, whose bf16 tails once aborted LLVM), Zen 5 (BF16
#: dot products on the vector unit), the AMX target (Sapphire Rapids: BF16, FP16 and the
#: tiles, its AVX-512 code as the avx512 tag's there) and AVX2; the other CPUs run with
#: ``-m slow``.
DEFAULT_CHECKS = {"icelake-server", "znver5", "tpp/amx", "haswell"}


def _command(mcpu: str | None, tag: str) -> list[str]:
    cmd = [sys.executable, "-m", "tpp_tvm.compile_check", "--tag", tag]
    return cmd + (["--mcpu", mcpu] if mcpu else [])


def _is_default(check: tuple[str | None, str]) -> bool:
    return (check[0] or check[1]) in DEFAULT_CHECKS


@functools.cache
def _results(default: bool) -> dict[tuple[str | None, str], subprocess.CompletedProcess]:
    """The default (or the slow) checks, two subprocesses at a time (the CI machine has two
    cores)."""
    checks = [c for c in CHECKS if _is_default(c) == default]
    env = {**os.environ, "TVM_NUM_THREADS": "1"}

    def one(check):
        return subprocess.run(_command(*check), capture_output=True, text=True, env=env,
                              timeout=900)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(checks, pool.map(one, checks)))


def _verdicts(stdout: str) -> tuple[dict[str, str], str | None]:
    """item -> 'ok' / 'refused: why' / 'error: why', and the item running when it died."""
    verdicts: dict[str, str] = {}
    running = None
    for line in stdout.splitlines():
        status, _, rest = line.partition(" ")
        label, _, why = rest.partition(": ")
        if status == "start":
            running = rest
        elif status in ("ok", "refused", "error"):
            verdicts[label] = status + (f": {why}" if why else "")
            running = None
    return verdicts, running


@pytest.mark.parametrize("check", [
    pytest.param(c, id=c[0] or c[1], marks=() if _is_default(c) else pytest.mark.slow)
    for c in CHECKS])
def test_everything_compiles_for(check) -> None:
    mcpu, tag = check
    result = _results(_is_default(check))[check]
    verdicts, died_in = _verdicts(result.stdout)
    where = f"{mcpu or tag}"
    assert died_in is None, (
        f"{where}: the process died (exit {result.returncode}) compiling {died_in}:\n"
        + result.stderr[-2000:])
    errors = {k: v for k, v in verdicts.items() if v.startswith("error")}
    assert not errors, f"{where}: " + "\n".join(f"{k}: {v}" for k, v in errors.items())
    assert result.returncode == 0, result.stderr[-2000:]
    # Every fp32 item builds on every CPU; only features the CPU lacks may refuse (on AVX2:
    # the bf16/int8 dot products, which that ISA has no TPPs for).
    tgt = check_target(mcpu, tag)
    lacking = ("needs the CPU features", "dot-product")
    for label, verdict in verdicts.items():
        if verdict.startswith("refused"):
            assert any(w in verdict for w in lacking), f"{where}: {label}: {verdict}"
    assert all(verdicts[k] == "ok" for k in verdicts if k.startswith("model")), verdicts
    has_bf16 = not any("avx512bf16" in v for v in verdicts.values())
    assert has_bf16 == (mcpu not in ("skylake-avx512", "cascadelake", "icelake-server",
                                     "haswell")), tgt


def test_a_bf16_kernel_for_a_cpu_without_bf16_is_refused_before_llvm() -> None:
    """The crash that once killed the suite: a bf16 GEMM tail built for ``icelake-server``
    (and a host LLVM names ``rocketlake``) aborted inside LLVM; now a clear error."""
    from tpp_tvm.kernels import build_gemm

    for cpu in ("icelake-server", "rocketlake"):
        with pytest.raises(UnsupportedISAError, match=f"avx512bf16.*{cpu}"):
            build_gemm(6, 37, 64, dtype="bfloat16", target=check_target(cpu))
    with pytest.raises(UnsupportedISAError, match="avx512vnni.*skylake-avx512"):
        build_gemm(6, 37, 64, dtype="int8", target=check_target("skylake-avx512"))
