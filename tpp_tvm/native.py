"""C helpers tpp_tvm ships as source and builds with the host's C compiler on first use
(the thread pool, the AMX tile model): one build per source version, cached under
``$XDG_CACHE_HOME/tpp_tvm`` (the temporary directory where home is read-only), so installing
needs no compiler step and every process after the first loads the cached library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class NativeBuildError(RuntimeError):
    """No C compiler, or the compiler rejected the source (its message included)."""


def compiler() -> str:
    """The host's C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang``."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise NativeBuildError("no C compiler found (cc, gcc or clang; or set $CC)")


def _cache() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tpp_tvm"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "tpp_tvm"
        cache.mkdir(parents=True, exist_ok=True)
    return cache


def load_library(source: Path, flags: tuple[str, ...] = (), mode: int = ctypes.RTLD_LOCAL
                 ) -> ctypes.CDLL:
    """``source`` built into a shared library (once per source text and flags) and loaded."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    cache = _cache()
    path = cache / f"{source.stem}-{digest}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / path.name
            proc = subprocess.run([compiler(), "-O2", "-shared", "-fPIC", *flags, "-o",
                                   str(out), str(source)], capture_output=True, text=True)
            if proc.returncode:
                raise NativeBuildError(f"building {source.name} failed: "
                                       f"{proc.stderr.strip()[-500:]}")
            out.replace(path)  # atomic: concurrent builders each write a complete file
    return ctypes.CDLL(str(path), mode=mode)
