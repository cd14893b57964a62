"""AVX2 implementations of the TPP set: 8 lanes, 16 ymm registers, FMA3; s16 x s16 dot
products for int8 models.

For x86 CPUs without AVX-512 (AMD Zen 2/3, Intel client cores before and after the
AVX-512 years). Partial vectors are ``llvm.masked.load``/``store`` with a lane-compare mask,
which LLVM lowers to ``vmaskmovps`` for 32-bit lanes. AVX2 has no bf16 or u8 x s8 dot
product into int32; its ``vpmaddwd`` (pairs of s16 products summed into s32) is exact for
u8 activations and s8 weights widened to s16, and runs 16 multiply-adds where an FMA runs 8
(measured on Zen 3 in a register loop: 1.6x the FMA's multiply-adds per second), so int8
layers run on it. (``vpmaddubsw`` takes u8 x s8 directly but saturates its s16 pair sums,
which ONNX Runtime's AVX2 kernels accept; these do not.) As for the other ISAs, the
templates generate every primitive; this module only says what AVX2 is.
"""

from __future__ import annotations

import functools

from tvm import tirx

from . import kinds
from .llvm_ir import dot_brgemm
from .spec import TPPSpec
from .vector_isa import VectorISA

AVX2 = VectorISA("avx2", vector_bits=256, num_vregs=16,
                 dot_brgemm=functools.partial(dot_brgemm, lanes=8, unroll_batch_reduce=False),
                 dot_dtypes=(("int16", "int16"),))
#: The vector unit the registry reports for this ISA.
VECTOR_ISA = AVX2


def implement(spec: TPPSpec) -> tirx.PrimFunc:
    """The AVX2 implementation PrimFunc of ``spec``."""
    return kinds.implement(spec, AVX2)
