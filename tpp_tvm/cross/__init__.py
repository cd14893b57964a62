"""Running aarch64 (SVE) builds for real on an x86 host: cross tools, qemu and a C harness.

``toolchain`` finds the cross compiler and qemu and exports TVM modules as aarch64 shared
libraries; ``runner`` calls their kernels under ``qemu-aarch64`` through ``harness.c``
(which needs no TVM runtime); ``plan`` turns a model compiled by the ``tpp`` pipeline into
the sequence of kernel calls the harness runs.
"""

from .runner import Call, CrossRunError, run_calls
from .toolchain import Toolchain, missing_tools, toolchain

__all__ = [
    "Call",
    "CrossRunError",
    "Toolchain",
    "missing_tools",
    "run_calls",
    "toolchain",
]
