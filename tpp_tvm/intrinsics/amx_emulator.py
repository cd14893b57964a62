"""AMX tile kernels run without AMX: a software model of the tile unit (``amx_emulator.c``)
that kernels compiled for an *emulated* AMX target call in place of the tile instructions.

Why: most machines that build and test tpp_tvm have no AMX, and there the tile kernels were
only compiled and read as assembly, which cannot catch a tile stride, a K step or a block
offset that is wrong but well formed. With the model, the very kernels an AMX CPU runs (the
same LLVM IR, with ``llvm.x86.tdpbf16ps`` and friends renamed to the model's functions, and
the rest compiled for the host) compute real results that tests compare with numpy and ONNX
Runtime, whole bf16 and int8 models included. It is for checking, not speed: one emulated
tile product costs about a microsecond.

:func:`tpp_tvm.target.target` ``("amx", emulate_tiles=True)`` makes such a target; the
``tpp`` TIR pipeline rewrites its kernels' imported IR with :func:`emulate_tile_instructions`;
:func:`library` builds the model with the host's C compiler once (cached by its source's
hash) and loads it into the process's global symbol scope, where both JIT-compiled kernels
and exported libraries find it. Misuse the hardware would fault on (no configuration, a tile
outside it, shapes that do not chain) is recorded, not executed: :func:`check` raises it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import ExecutionError, UnsupportedISAError

#: The tile instructions the model implements, as LLVM names them (``llvm.x86.<name>``).
TILE_INSTRUCTIONS: tuple[str, ...] = ("ldtilecfg", "tilerelease", "tilezero", "tileloadd64",
                                      "tilestored64", "tdpbf16ps", "tdpbusd")
#: Prefix of the model's functions (``tpp_amx_emu_<name>``).
SYMBOL_PREFIX = "tpp_amx_emu_"
_SOURCE = Path(__file__).with_name("amx_emulator.c")
_INTRINSIC = re.compile(r"@llvm\.x86\.(" + "|".join(TILE_INSTRUCTIONS) + r")\b")


def emulate_tile_instructions(text: str) -> str:
    """LLVM IR ``text`` with every tile instruction a call of the model's function (their
    declarations lose ``immarg``, which only intrinsics may carry)."""
    lines = []
    for line in text.split("\n"):
        renamed = _INTRINSIC.sub("@" + SYMBOL_PREFIX + r"\1", line)
        if renamed != line and renamed.startswith("declare "):
            renamed = renamed.replace(" immarg", "")
        lines.append(renamed)
    return "\n".join(lines)


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise UnsupportedISAError("emulating AMX tiles needs a C compiler (cc, gcc or clang; "
                              "or $CC) to build the tile model")


@functools.cache
def library() -> ctypes.CDLL:
    """The tile model, built once per source version and loaded with ``RTLD_GLOBAL``."""
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tpp_tvm"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the temporary directory instead
        cache = Path(tempfile.gettempdir()) / "tpp_tvm"
        cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"amx_emulator-{digest}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / path.name
            proc = subprocess.run([_compiler(), "-O2", "-shared", "-fPIC", "-o", str(out),
                                   str(_SOURCE)], capture_output=True, text=True)
            if proc.returncode:
                raise UnsupportedISAError(f"building the AMX tile model failed: "
                                          f"{proc.stderr.strip()[-500:]}")
            out.replace(path)  # atomic: concurrent builders each write a complete file
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    lib.tpp_amx_emu_fault.restype = ctypes.c_char_p
    lib.tpp_amx_emu_products.restype = ctypes.c_ulonglong
    return lib


def reset() -> None:
    """Forget a recorded fault and zero the product count."""
    library().tpp_amx_emu_reset()


def products() -> int:
    """Tile products (``tdpbf16ps``/``tdpbusd``) run since the last :func:`reset`."""
    return int(library().tpp_amx_emu_products())


def check(what: str) -> None:
    """Raise :class:`ExecutionError` if an emulated tile instruction faulted (where AMX
    hardware would raise #UD), naming ``what`` ran and the instruction's shapes."""
    fault = library().tpp_amx_emu_fault()
    if fault:
        reset()
        raise ExecutionError(f"{what}: an emulated AMX tile instruction faulted (AMX "
                             f"hardware would raise #UD): {fault.decode()}")
