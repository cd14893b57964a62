"""Arm SVE implementations of the TPP set (fp32): scalable vectors, predicated tails.

Vector-length agnostic: a vector holds ``4 * vscale`` fp32 lanes, known only at run time,
so the same code runs on 128- to 2048-bit SVE. Every partial vector is a ``whilelo``
predicate (``T.get_active_lane_mask``). Where TIR has no scalable construct the
templates use SVE's own instructions through ``llvm.aarch64.sve.*``: ``faddv``/``fmaxv`` for
horizontal reductions, gathers for transposes, ``st2w``/``st4w`` for VNNI packing. Register
blocking is sized for the minimum (128-bit) vector and SVE's 32 z registers. As for
AVX-512, the templates generate every primitive; this module only says what SVE is.
"""

from __future__ import annotations

from tvm import tirx

from . import kinds
from .spec import TPPSpec
from .vector_isa import VectorISA

SVE = VectorISA(
    "sve",
    vector_bits=None,
    num_vregs=32,
    min_vector_bits=128,
    # Schedules' plain loops and tuning tiles: 16 fp32 lanes, four registers at the
    # minimum length (the width they used on SVE before this model said it; not tuned).
    schedule_vector_bits=512,
    horizontal={"add": "llvm.aarch64.sve.faddv", "max": "llvm.aarch64.sve.fmaxv"},
    gather="llvm.aarch64.sve.ld1.gather.sxtw.index",
    interleaved_store={2: "llvm.aarch64.sve.st2", 3: "llvm.aarch64.sve.st3",
                       4: "llvm.aarch64.sve.st4"},
)
#: The vector unit the registry reports for this ISA.
VECTOR_ISA = SVE


def implement(spec: TPPSpec) -> tirx.PrimFunc:
    """The SVE implementation PrimFunc of ``spec``."""
    return kinds.implement(spec, SVE)
