"""AMX implementations of the TPP set: bf16 (``tdpbf16ps``) and u8 x s8 (``tdpbusd``)
contractions on tiles; everything else on the AVX-512 unit every AMX CPU also has.

The AMX ISA is the AVX-512 :class:`VectorISA` with the tile BRGEMM microkernel
(``llvm_ir.amx_brgemm``) as its dot-product kernel, so the contraction template is the one
AVX-512 uses. A process must be granted tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``) before the first tile instruction: :func:`ensure_tile_permission`
asks, and :func:`tpp_tvm.target.best_isa` picks AMX only where the OS granted it.
"""

from __future__ import annotations

from dataclasses import replace

from tvm import tirx

from ..errors import UnsupportedISAError
from . import avx512
from .brgemm_template import brgemm_impl
from .llvm_ir import amx_brgemm
from .spec import TPPSpec

AMX = replace(avx512.AVX512, name="amx", dot_brgemm=amx_brgemm)
#: The vector unit the registry reports for this ISA.
VECTOR_ISA = AMX


def implement(spec: TPPSpec) -> tirx.PrimFunc:
    """The AMX implementation PrimFunc of ``spec`` (tiles for bf16/int8 GEMM/BRGEMM; a
    convolution's strided rows are not tile rows, so conv BRGEMMs use the AVX-512 dot
    product)."""
    if spec.vnni > 1 and spec.op != "conv_brgemm":  # VNNI-packed B: a low-precision GEMM
        return brgemm_impl(spec, AMX)
    return avx512.implement(spec)


def ensure_tile_permission() -> None:
    """Raise unless this process may execute tile instructions (asks the OS once)."""
    from ..target import host_isa

    host = host_isa()  # detection requests the permission when the CPU has AMX
    if not (host.amx_tile and host.amx_permitted):
        why = "the CPU has no AMX" if not host.amx_tile else "the OS refused tile state"
        raise UnsupportedISAError(f"cannot run AMX kernels here: {why} ({host.summary()})")
