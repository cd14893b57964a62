"""AVX-512 implementations of the TPP set: 16 lanes, 32 zmm registers, k-masks for tails;
bf16 (AVX512_BF16) and u8 x s8 (AVX512_VNNI) dot products for low-precision contractions,
and s16 x s16 ones (AVX512BW ``vpmaddwd``) for int8 models on CPUs without VNNI.

Nothing here is op-specific: the templates generate every primitive from its spec; this
module only says what AVX-512 is.
"""

from __future__ import annotations

from tvm import tirx

from . import kinds
from .llvm_ir import dot_brgemm
from .spec import TPPSpec
from .vector_isa import VectorISA
from .vector_math import avx512_forms

AVX512 = VectorISA("avx512", vector_bits=512, num_vregs=32, dot_brgemm=dot_brgemm,
                   dot_dtypes=(("bfloat16", "bfloat16"), ("uint8", "int8"),
                               ("int16", "int16")))
#: The vector unit the registry reports for this ISA.
VECTOR_ISA = AVX512


def implement(spec: TPPSpec) -> tirx.PrimFunc:
    """The AVX-512 implementation PrimFunc of ``spec`` (its vector math with the AVX-512
    forms: ``vscalefps``, ``vrcp14ps``)."""
    with avx512_forms():
        return kinds.implement(spec, AVX512)
