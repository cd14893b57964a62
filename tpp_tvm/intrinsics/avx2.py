"""AVX2 implementations of the TPP set (fp32): 8 lanes, 16 ymm registers, FMA3.

For x86 CPUs without AVX-512 (AMD Zen 2/3, Intel client cores before and after the
AVX-512 years). Partial vectors are ``llvm.masked.load``/``store`` with a lane-compare mask,
which LLVM lowers to ``vmaskmovps`` for 32-bit lanes. There are no bf16 or VNNI dot
products here (AVX2 has neither), so the low-precision TPPs stay AVX-512/AMX only. As for
the other ISAs, the templates generate every primitive; this module only says what AVX2 is.
"""

from __future__ import annotations

from tvm import tirx

from . import kinds
from .spec import TPPSpec
from .vector_isa import VectorISA

AVX2 = VectorISA("avx2", vector_bits=256, num_vregs=16)
#: The vector unit the registry reports for this ISA.
VECTOR_ISA = AVX2


def implement(spec: TPPSpec) -> tirx.PrimFunc:
    """The AVX2 implementation PrimFunc of ``spec``."""
    return kinds.implement(spec, AVX2)
