"""Low-precision GEMM on AMX tiles, the tile configuration loaded once per thread.

AMX needs its tile configuration (``ldtilecfg``) before the first tile instruction and
gives the tile state back with ``tilerelease``; configuring per microkernel call would
repeat both for every 32 x 32 output block. This kernel is written directly (not tensorized
from TE) so its structure says it: one parallel task per thread, which configures the
tiles, runs its share of output blocks through the tile BRGEMM microkernel built without
configuration (``llvm_ir.amx_brgemm(configure=False)``), and releases the tiles.

C = A @ B with A (mp, kp) pre-padded, B VNNI-packed panels of 32 columns, C (mp, np) padded
(bf16 -> fp32, u8 x s8 -> int32); no epilogue yet.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..intrinsics.llvm_ir import AMX_GROUPS, AMX_ROWS, amx_brgemm, amx_configure, module_text

#: Output block of one microkernel call: 2 x 2 tiles of 16 x 16 accumulators.
MR = 2 * AMX_ROWS
NR = 32


def amx_gemm_func(mp: int, np_: int, kp: int, a_dtype: str, b_dtype: str, acc_dtype: str,
                  vnni: int, threads: int) -> tirx.PrimFunc:
    """The AMX GEMM PrimFunc for padded extents (mp, np_ multiples of 32, kp of 16 groups)."""
    if mp % MR or np_ % NR or kp % (AMX_GROUPS * vnni):
        raise ValueError(f"AMX GEMM extents {mp}x{np_}x{kp} are not padded to whole blocks")
    tiles_m, tiles_n = mp // MR, np_ // NR
    tiles = tiles_m * tiles_n
    tasks = max(1, min(threads, tiles))
    chunk = -(-tiles // tasks)
    kernel = amx_brgemm(a_dtype, b_dtype, MR, NR, kp // vnni, 1, 0, configure=False)
    configure, release = amx_configure(MR, NR)
    ir_text = module_text(kernel, configure, release)

    @T.prim_func(s_tir=True)
    def gemm(A: T.Buffer((mp, kp), a_dtype),
             B: T.Buffer((np_ // NR, kp // vnni, NR, vnni), b_dtype),
             C: T.Buffer((mp, np_), acc_dtype)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        with T.attr(0, "pragma_import_llvm", ir_text):
            for task in T.parallel(tasks):
                T.evaluate(T.call_extern("void", configure.name))
                for t in range(chunk):
                    if task * chunk + t < tiles:
                        # Column panels outer: consecutive blocks of a task share B's panel.
                        T.evaluate(T.call_extern(
                            "void", kernel.name,
                            T.address_of(A[(task * chunk + t) % tiles_m * MR, 0]),
                            T.address_of(B[(task * chunk + t) // tiles_m, 0, 0, 0]),
                            T.address_of(C[(task * chunk + t) % tiles_m * MR,
                                           (task * chunk + t) // tiles_m * NR]),
                            kp, 0, NR * vnni, 0, np_))
                T.evaluate(T.call_extern("void", release.name))

    return gemm
