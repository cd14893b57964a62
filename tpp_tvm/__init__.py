"""tpp_tvm: LIBXSMM's Tensor Processing Primitives as TVM tensor intrinsics, for fast CPU DL.

The public API is small: :func:`target` (the TPP target for this host or a named ISA),
:func:`build_gemm` (a GEMM with optional bias/activation compiled onto TPPs),
:func:`registered` (the TPP intrinsics) and the :class:`TPPError` family.
"""

from .errors import TPPError
from .intrinsics import registered
from .schedules.gemm import build_gemm
from .target import host_isa, target

__all__ = ["TPPError", "build_gemm", "host_isa", "registered", "target"]
__version__ = "0.1.0"
