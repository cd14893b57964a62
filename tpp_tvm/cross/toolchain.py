"""The aarch64 cross tools: find them, export a TVM module with them, build the harness."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tvm
from tvm.support import cc

from ..errors import TPPError

#: Debian packages providing the tools (what ``.ci/run`` installs).
PACKAGES = ("qemu-user", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross")
_CC = "aarch64-linux-gnu-gcc"
_QEMU = "qemu-aarch64"
_OBJDUMP = "aarch64-linux-gnu-objdump"
_SYSROOT = Path("/usr/aarch64-linux-gnu")
_HARNESS_SRC = Path(__file__).with_name("harness.c")


class CrossToolsMissing(TPPError):
    """Raised when the aarch64 cross compiler, qemu or the aarch64 libc is not installed."""


@dataclass(frozen=True)
class Toolchain:
    """Paths of the cross compiler, qemu, objdump and the aarch64 sysroot qemu loads from."""

    cc: str
    qemu: str
    objdump: str
    sysroot: Path


def missing_tools() -> list[str]:
    """What is missing for cross-running aarch64 code here (empty when all is present)."""
    missing = [tool for tool in (_CC, _QEMU, _OBJDUMP) if shutil.which(tool) is None]
    if not (_SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists():
        missing.append(f"aarch64 libc in {_SYSROOT}")
    return missing


def toolchain() -> Toolchain:
    """The installed cross tools; raises :class:`CrossToolsMissing` naming what is absent."""
    missing = missing_tools()
    if missing:
        raise CrossToolsMissing(
            f"cannot cross-run aarch64 code: missing {', '.join(missing)} "
            f"(Debian packages: {' '.join(PACKAGES)})"
        )
    return Toolchain(shutil.which(_CC), shutil.which(_QEMU), shutil.which(_OBJDUMP), _SYSROOT)


def export_library(module: tvm.runtime.Module, path: str | Path) -> Path:
    """Write ``module`` (built for an aarch64 target) as an aarch64 shared library."""
    tools = toolchain()
    path = Path(path)
    module.export_library(str(path), fcompile=cc.cross_compiler(tools.cc))
    return path


@functools.cache
def harness() -> Path:
    """The aarch64 harness executable, compiled once per source version into a cache dir."""
    tools = toolchain()
    import tvm_ffi.libinfo

    flags = ["-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Werror", "-rdynamic",
             f"-I{tvm_ffi.libinfo.find_include_path()}"]
    # -rdynamic: the kernels resolve TVMFFIErrorSetRaisedFromCStrParts in the executable.
    key = _HARNESS_SRC.read_bytes() + " ".join([tools.cc, *flags]).encode()
    out = Path(tempfile.gettempdir()) / f"tpp_tvm_harness_{hashlib.sha256(key).hexdigest()[:16]}"
    if not out.exists():
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        subprocess.run([tools.cc, *flags, "-o", str(tmp), str(_HARNESS_SRC), "-ldl"],
                       check=True, capture_output=True, text=True)
        tmp.replace(out)
    return out


def disassemble(library: str | Path) -> str:
    """``objdump -d`` of an aarch64 library (for instruction checks and counts)."""
    tools = toolchain()
    return subprocess.run([tools.objdump, "-d", "--no-show-raw-insn", str(library)],
                          check=True, capture_output=True, text=True).stdout
