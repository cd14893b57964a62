"""Call kernels of an aarch64 library under qemu through the C harness (``harness.c``).

Many calls go into one job file and one qemu process, so a test of dozens of kernels costs
one emulator start per vector length. The harness writes every tensor back; the caller
compares with its reference.
"""

from __future__ import annotations

import re
import signal
import struct
import subprocess
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TPPError
from . import asm
from .toolchain import disassemble, harness, toolchain

#: DLPack type codes by numpy kind.
_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 1}
_TRACE = re.compile(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/")
_TB_INSN = re.compile(r"^0x([0-9a-f]+):\s")
#: qemu accepts these SVE vector lengths (bytes): powers of two from 128 to 2048 bits.
SVE_VL_BYTES = (16, 32, 64, 128, 256)


class CrossRunError(TPPError):
    """A cross-compiled kernel run failed: the harness exited non-zero or died of a signal."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode

    @property
    def signal(self) -> signal.Signals | None:
        return signal.Signals(-self.returncode) if self.returncode < 0 else None


@dataclass(frozen=True)
class Call:
    """One kernel call: the function name (``__tvm_ffi_<name>`` in the library), tensor ids."""

    name: str
    args: tuple[int, ...]


def _dl_dtype(array: np.ndarray) -> tuple[int, int]:
    if array.dtype.kind not in _DL_CODES:
        raise TypeError(f"no DLPack type for numpy dtype {array.dtype}")
    bits = 1 if array.dtype.kind == "b" else array.dtype.itemsize * 8
    return _DL_CODES[array.dtype.kind], bits


def write_job(path: Path, tensors: Sequence[np.ndarray], calls: Sequence[Call]) -> None:
    """The job file ``harness.c`` reads (format in its header comment)."""
    with open(path, "wb") as f:
        f.write(b"TPPJOB01")
        f.write(struct.pack("<I", len(tensors)))
        for t in tensors:
            t = np.ascontiguousarray(t)
            code, bits = _dl_dtype(t)
            f.write(struct.pack("<BBHI", code, bits, 1, t.ndim))
            f.write(struct.pack(f"<{t.ndim}q", *t.shape))
            f.write(struct.pack("<Q", t.nbytes))
            f.write(t.tobytes())
        f.write(struct.pack("<I", len(calls)))
        for call in calls:
            name = call.name.encode()
            f.write(struct.pack("<I", len(name)) + name)
            f.write(struct.pack(f"<I{len(call.args)}I", len(call.args), *call.args))


def qemu_command(vl_bytes: int | None = None, cpu: str | None = None) -> list[str]:
    """``qemu-aarch64`` with the aarch64 libc, and either an SVE vector length or a CPU model."""
    tools = toolchain()
    if cpu is None:
        if vl_bytes not in SVE_VL_BYTES:
            raise ValueError(f"SVE vector length {vl_bytes} bytes; qemu takes {SVE_VL_BYTES}")
        cpu = f"max,sve-default-vector-length={vl_bytes}"
    return [tools.qemu, "-L", str(tools.sysroot), "-cpu", cpu]


def run_calls(library: str | Path, tensors: Sequence[np.ndarray], calls: Sequence[Call],
              vl_bytes: int | None = 16, cpu: str | None = None,
              timeout: float = 300.0) -> list[np.ndarray]:
    """Run ``calls`` on copies of ``tensors`` under qemu; return every tensor afterwards.

    ``vl_bytes`` sets the SVE vector length of qemu's ``max`` CPU; ``cpu`` names another
    CPU model instead (``cortex-a72`` has no SVE: SVE code dies there with SIGILL).
    """
    with tempfile.TemporaryDirectory(prefix="tpp_cross_") as tmp:
        job, out = Path(tmp) / "job.bin", Path(tmp) / "out.bin"
        write_job(job, tensors, calls)
        cmd = [*qemu_command(vl_bytes, cpu), str(harness()), str(Path(library).resolve()),
               str(job), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            what = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                    else f"exit status {proc.returncode}")
            raise CrossRunError(f"{' '.join(cmd[:5])} harness died with {what}: "
                                f"{proc.stderr.strip()[-2000:]}", proc.returncode)
        data = out.read_bytes()
    results, offset = [], 0
    for t in tensors:
        t = np.ascontiguousarray(t)
        results.append(np.frombuffer(data, t.dtype, t.size, offset).reshape(t.shape).copy())
        offset += t.nbytes
    return results


def executed_instructions(library: str | Path, tensors: Sequence[np.ndarray],
                          calls: Sequence[Call], vl_bytes: int = 16) -> Counter:
    """Guest instructions executed per function of ``library`` while running ``calls``.

    From qemu's ``-d in_asm,exec,nochain`` log: each executed translation block counts its
    instructions, attributed to the library function its address falls in (the harness
    prints where the library was loaded).
    """
    starts = sorted((insns[0].address, name)
                    for name, insns in asm.functions(disassemble(library)).items() if insns)
    with tempfile.TemporaryDirectory(prefix="tpp_cross_") as tmp:
        job, log = Path(tmp) / "job.bin", Path(tmp) / "qemu.log"
        write_job(job, tensors, calls)
        proc = subprocess.run(
            [*qemu_command(vl_bytes), "-d", "in_asm,exec,nochain", "-D", str(log),
             str(harness()), str(Path(library).resolve()), str(job), str(Path(tmp) / "out")],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise CrossRunError(f"traced harness run failed: {proc.stderr[-2000:]}",
                                proc.returncode)
        base = int(proc.stdout.split(" loaded at ")[1].split()[0], 16)
        tb_size: dict[int, int] = {}
        executed: Counter = Counter()
        block = None
        with open(log) as lines:
            for line in lines:
                if line.startswith("IN:"):
                    block = None
                elif m := _TB_INSN.match(line):
                    if block is None:
                        block = int(m.group(1), 16)
                        tb_size[block] = 0
                    tb_size[block] += 1
                elif m := _TRACE.match(line):
                    executed[int(m.group(1), 16)] += 1
    addresses = [a for a, _ in starts]
    per_function: Counter = Counter()
    for pc, times in executed.items():
        k = int(np.searchsorted(addresses, pc - base, side="right")) - 1
        if k >= 0:
            per_function[starts[k][1]] += times * tb_size.get(pc, 0)
    return per_function
