"""Scheduling helpers every hand schedule shares: mapping a stage onto its TPP.

A hand schedule tiles its loops, then hands each tile-sized stage to one of these: try the
TPP and fall back (vectorized, logged at debug level) when the stage cannot take it, move
epilogue stages under a tile loop, and run padding copies in parallel. They live here, not
in one operator's module, because the GEMM, convolution, pooling, attention, row-wise and
backward schedules all use them.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.schedule import LoopRV, SBlockRV

from ..intrinsics import TPPSpec, intrinsic
from ..intrinsics.registry import vector_isa
from ..intrinsics.spec import RESIDUAL_QUANT_OPS
from .gemm_te import QUANTIZE, REQUANTIZE, TO_BF16

log = logging.getLogger(__name__)


def try_tensorize(sch: s_tir.Schedule, loop: LoopRV, spec: TPPSpec, isa: str, what: str
                  ) -> bool:
    """Tensorize the nest under ``loop`` with ``spec``'s TPP; False (logged) when it does not
    match, so the caller chooses the fallback (or raises, where a TPP is certain)."""
    try:
        sch.tensorize(loop, intrinsic(spec, isa))
        return True
    except Exception as err:  # noqa: BLE001 - TVM raises many types; we log and fall back
        log.debug("%s not tensorized with %s: %s", what, spec.op, str(err).splitlines()[-1])
        return False


def tensorize_rows(sch: s_tir.Schedule, block: SBlockRV, spec: TPPSpec, isa: str, what: str
                   ) -> bool:
    """Tensorize a spatial stage under its anchor loop as one (rows x last dim) TPP tile.

    Loops before the last are fused into rows, so a stage that covers a 4D region (a
    convolution's panel) is one 2D TPP; the spec's m becomes the row count. A stage that
    cannot be (a predicated edge tile) is vectorized instead. Returns whether it was.
    """
    loops = sch.get_loops(block)[1:]
    if len(loops) >= 2:
        rows_loop = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        rows = sch.get(rows_loop).extent
        if isinstance(rows, tirx.IntImm) and rows.value >= 2:
            if try_tensorize(sch, rows_loop, replace(spec, m=int(rows)), isa, what):
                return True
        loops = sch.get_loops(block)[1:]
    try:
        sch.vectorize(loops[-1])
    except Exception as err:  # noqa: BLE001 - e.g. a predicated tail tile
        log.debug("%s left to LLVM (%s)", what, str(err).splitlines()[-1])
    return False


def tensorize_row_block(sch: s_tir.Schedule, name: str, spec: TPPSpec, isa: str) -> None:
    """Tensorize stage ``name`` of a row-block nest (the row-block loop outermost) with
    ``spec`` as given; otherwise split its last loop into whole vectors when it divides.

    Unlike :func:`tensorize_rows` the spec is not resized and a row that is not whole
    vectors is left to LLVM: vectorizing a whole odd row made a <3199 x float> vector
    (4.5 ns an element)."""
    block = sch.get_sblock(name)
    loops = sch.get_loops(block)
    if not try_tensorize(sch, loops[1], spec, isa, name):
        # One-row blocks (a prime row count) keep TIR: whole vectors, LLVM does the tail.
        try:
            vectorize_whole_vectors(sch, block, isa)
        except Exception:  # noqa: BLE001 - a reduction loop: leave it to LLVM
            pass


def vectorize_whole_vectors(sch: s_tir.Schedule, block: SBlockRV, isa: str) -> None:
    """Split ``block``'s innermost loop into ``isa``'s fp32 vectors and vectorize them when
    it is a whole number of vectors (else LLVM keeps it: see :func:`tensorize_row_block`)."""
    inner = sch.get_loops(block)[-1]
    extent = sch.get(inner).extent
    lanes = vector_isa(isa).schedule_lanes("float32")
    if isinstance(extent, tirx.IntImm) and int(extent) % lanes == 0:
        sch.vectorize(sch.split(inner, [None, lanes])[1])


def _copy_lanes(sch: s_tir.Schedule, block: SBlockRV) -> int:
    """Elements of ``block``'s output in one 64-byte vector."""
    return 512 // tvm.DataType(sch.get(block).writes[0].source.dtype).bits


def schedule_pads(sch: s_tir.Schedule, names: tuple[str, ...]) -> None:
    """Padding copies run parallel over rows and vectorized along the contiguous dim, in
    64-byte vectors where the row is whole ones (16 lanes of u8 are 16-byte moves), else
    in 16 lanes."""
    for name in names:
        try:
            pad = sch.get_sblock(name)
        except Exception:  # noqa: BLE001 - the stage does not exist for this shape
            continue
        ploops = sch.get_loops(pad)
        if len(ploops) > 1:
            sch.parallel(sch.fuse(*ploops[:-1]))
        extent, lanes = sch.get(ploops[-1]).extent, _copy_lanes(sch, pad)
        if not isinstance(extent, tirx.IntImm) or int(extent) % lanes:
            lanes = 16
        sch.vectorize(sch.split(ploops[-1], [None, lanes])[1])


def schedule_image_pad(sch: s_tir.Schedule, pixel: int, name: str = "A_pad") -> None:
    """The zero-padded image copy ``name`` ((..., rows, pixels * ``pixel``): NHWC rows
    flattened) parallel over rows, each row split into its pixels and a pixel's elements
    vectorized in 64-byte vectors. The padding test then is one per pixel: split in
    16-lane vectors instead (:func:`schedule_pads`), a vector straddling no border still
    tested each lane, and LLVM copied the image byte by byte (AMX Xeon, 1 thread: 40% of
    ResNet-50's int8 56x56x64 3x3 convolution, 0.137 ms)."""
    try:
        pad = sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - the stage does not exist for this shape
        return
    *rows, row = sch.get_loops(pad)
    if rows:
        sch.parallel(sch.fuse(*rows))
    extent = sch.get(row).extent
    if not isinstance(extent, tirx.IntImm) or int(extent) % pixel:
        return
    _, elems = sch.split(row, [None, pixel])
    lanes = _copy_lanes(sch, pad)
    if pixel % lanes == 0 and pixel > lanes:
        elems = sch.split(elems, [None, lanes])[1]
    if pixel % lanes == 0 or (pixel < lanes and lanes % pixel == 0):
        sch.vectorize(elems)


def fuse_epilogue(sch: s_tir.Schedule, tile_loop: LoopRV, mr: int, nr: int,
                  stages: list[tuple[str, tuple[str, ...]]], copy_dtype: str = "float32"
                  ) -> list[tuple[str, TPPSpec]]:
    """Move the epilogue stages under the tile loop (before the tile is tensorized), so
    each runs on the tile while it is in L1; returns each stage's TPP.

    ``copy_dtype`` is the element type a plain unpadding copy moves (int32 for an int8
    GEMM without dequantization)."""
    epilogue = []
    for name, steps in stages:
        if steps == ("dequantize",):
            spec = TPPSpec("dequantize", "int32", m=mr, n=nr, out_dtype="float32")
        elif steps == (TO_BF16,):
            spec = TPPSpec("copy", "float32", m=mr, n=nr, out_dtype="bfloat16")
        elif steps[:1] == (QUANTIZE,):
            spec = TPPSpec("quantize", "float32", m=mr, n=nr, out_dtype=steps[1])
        elif steps[:1] == (REQUANTIZE,) or (steps and steps[0] in RESIDUAL_QUANT_OPS):
            spec = TPPSpec(steps[0], "int32", m=mr, n=nr, out_dtype=steps[1])
        elif steps:
            spec = TPPSpec("equation", m=mr, n=nr, steps=steps)
        else:
            spec = TPPSpec("copy", copy_dtype, m=mr, n=nr)
        sch.reverse_compute_at(sch.get_sblock(name), tile_loop)
        epilogue.append((name, spec))
    return epilogue


def tensorize_epilogue(sch: s_tir.Schedule, epilogue: list[tuple[str, TPPSpec]], isa: str
                       ) -> None:
    """Each fused epilogue stage becomes its TPP; a tail tile is vectorized instead."""
    for name, spec in epilogue:
        tensorize_rows(sch, sch.get_sblock(name), spec, isa, name)
