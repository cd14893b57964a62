"""Running aarch64 (SVE) builds for real on an x86 host: cross tools, qemu and a C harness.

``toolchain`` finds the cross compiler and qemu and exports TVM modules as aarch64 shared
libraries; ``runner`` calls their kernels under ``qemu-aarch64`` through ``harness.c``
(which needs no TVM runtime); ``plan`` turns a model compiled by the ``tpp`` pipeline into
the sequence of kernel calls the harness runs; ``asm`` reads the kernels' inner loops.
"""

from .plan import ModelPlan, plan_model
from .runner import Call, CrossRunError, run_calls
from .toolchain import CrossToolsMissing, Toolchain, missing_tools, toolchain

__all__ = [
    "Call",
    "CrossRunError",
    "CrossToolsMissing",
    "ModelPlan",
    "Toolchain",
    "missing_tools",
    "plan_model",
    "run_calls",
    "toolchain",
]
