"""AMX implementations of the TPP set: bf16 (``tdpbf16ps``) and u8 x s8 (``tdpbusd``)
contractions on tiles; everything else on the AVX-512 unit every AMX CPU also has.

The AMX ISA is the AVX-512 :class:`VectorISA` with the tile BRGEMM microkernel
(``llvm_ir.amx_brgemm``) as its dot-product kernel, so the contraction template is the one
AVX-512 uses. A process must be granted tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``) before the first tile instruction: :func:`ensure_tile_permission`
asks, and :func:`tpp_tvm.target.best_isa` picks AMX only where the OS granted it.

The tile configuration (``ldtilecfg``) and its release cost 13-30% of a whole bf16 GEMM
when every 32 x 32 output block repeats them, as a self-contained microkernel TPP does
(measured on an AMX Xeon, 128x768x{256,768,3072}). So a kernel that marks itself with
:data:`TILE_CONFIG_ATTR` (a GEMM schedule whose output blocks run as one parallel task per
thread) gets :func:`configure_tiles_per_task` in the ``tpp`` TIR pipeline: each task loads
the configuration once, runs its blocks through the microkernels' configuration-free body
(``<name>_nocfg``, always in the same LLVM module text) and releases the tiles. The
AVX-512 epilogue TPPs between the tile calls leave the tile state alone.
"""

from __future__ import annotations

from dataclasses import replace

import tvm
import tvm_ffi
from tvm import tirx

from ..errors import UnsupportedISAError
from . import avx512
from .brgemm_template import brgemm_impl
from .llvm_ir import NO_CONFIG, amx_brgemm, amx_configure, module_text
from .spec import TPPSpec

AMX = replace(avx512.AVX512, name="amx", dot_brgemm=amx_brgemm)
#: The vector unit the registry reports for this ISA.
VECTOR_ISA = AMX
#: PrimFunc attribute ``[m, n]``: the C block of the kernel's tile microkernels, whose
#: configuration the TIR pipeline loads once per parallel task.
TILE_CONFIG_ATTR = "tpp.amx_tile_config"
#: Prefix of the tile microkernels' symbols (``llvm_ir.amx_brgemm``).
TILE_KERNEL_PREFIX = "tpp_amx_"

_CALL_EXTERN = tvm.ir.Op.get("tirx.call_extern")


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


def configure_tiles_per_task(func: tirx.PrimFunc, m: int, n: int) -> tirx.PrimFunc:
    """``func`` with its tile microkernel calls made configuration-free and the tile
    configuration of (m x n) C blocks loaded once at the start of each parallel task (or of
    the whole function, without a parallel loop) and released at its end."""
    configure, release = amx_configure(m, n)
    renamed = []

    def is_tile_call(call: tvm.ir.Call) -> bool:
        return (call.op.same_as(_CALL_EXTERN) and isinstance(call.args[0], tvm.ir.StringImm)
                and call.args[0].value.startswith(TILE_KERNEL_PREFIX)
                and call.args[0].value not in (configure.name, release.name))

    def rename(call: tvm.ir.Call) -> tvm.ir.Call:
        if not is_tile_call(call) or call.args[0].value.endswith(NO_CONFIG):
            return call
        renamed.append(call)
        return tirx.call_extern("void", call.args[0].value + NO_CONFIG, *call.args[1:])

    def calls_tiles(stmt: tirx.Stmt) -> bool:
        found = []
        tvm_ffi.structural_walk(stmt, [(tvm.ir.Call, lambda c: found.append(is_tile_call(c)))])
        return any(found)

    def configured(body: tirx.Stmt) -> tirx.Stmt:
        calls = [tirx.Evaluate(tirx.call_extern("void", fn.name)) for fn in (configure, release)]
        seq = tirx.SeqStmt([calls[0], body, calls[1]])
        return tirx.AttrStmt(tirx.const(0, "int32"), "pragma_import_llvm",
                             tvm.ir.StringImm(module_text(configure, release)), seq)

    wrapped = []

    def wrap(loop: tirx.For) -> tirx.For:
        # The parallel loop of the tile work (other stages, e.g. padding, have their own).
        if loop.kind != tirx.ForKind.PARALLEL or not calls_tiles(loop.body):
            return loop
        wrapped.append(loop)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                        configured(loop.body), loop.thread_binding, loop.annotations)

    body = tvm_ffi.structural_map(func.body, [(tvm.ir.Call, rename)])
    if not renamed:
        raise ValueError("configure_tiles_per_task: the kernel calls no AMX tile microkernel")
    body = tvm_ffi.structural_map(body, [(tirx.For, wrap)], order="pre")
    if not wrapped:
        body = configured(body)
    return func.with_body(body)
