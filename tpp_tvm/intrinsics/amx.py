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

from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.sym import Analyzer

from ..errors import UnsupportedISAError
from . import avx512
from .brgemm_template import brgemm_impl
from .llvm_ir import (
    AMX_GROUPS,
    AMX_ROWS,
    NO_CONFIG,
    IRFunction,
    TileBrgemm,
    amx_brgemm,
    amx_configure,
    module_text,
    tile_brgemm,
)
from .prefetch import fresh_copy, next_panel_share, substitute
from .spec import TPPSpec

AMX = replace(avx512.AVX512, name="amx", dot_brgemm=amx_brgemm)
#: The vector unit the registry reports for this ISA.
VECTOR_ISA = AMX
#: PrimFunc attribute ``[m, n]``: the C block of the kernel's tile microkernels, whose
#: configuration the TIR pipeline loads once per parallel task.
TILE_CONFIG_ATTR = "tpp.amx_tile_config"
#: Function attribute: False where a tile kernel's B panels are its own, just written and
#: cache-resident (attention's packed Kᵀ and V), so its tile steps prefetch no next panel.
PREFETCH_PANELS_ATTR = "tpp.amx_prefetch_panels"
#: Prefix of the tile microkernels' symbols (``llvm_ir.amx_brgemm``).
TILE_KERNEL_PREFIX = "tpp_amx_"

_CALL_EXTERN = tvm.ir.Op.get("tirx.call_extern")


def implement(spec: TPPSpec) -> tirx.PrimFunc:
    """The AMX implementation PrimFunc of ``spec``: tiles for bf16/int8 GEMM/BRGEMM, and
    for conv BRGEMMs whose output pixels fill tiles (16 or 32 pixels by 16 or 32 channels,
    filter rows of whole tile steps: a tile row is one pixel, the tile's row pitch the pixel
    stride); other conv BRGEMMs use the AVX-512 dot product."""
    if spec.vnni > 1 and (spec.op != "conv_brgemm" or conv_fills_tiles(spec)):
        return brgemm_impl(spec, AMX)
    return avx512.implement(spec)


def conv_fills_tiles(spec: TPPSpec) -> bool:
    """Whether a low-precision conv BRGEMM has a tile shape (see :func:`implement`)."""
    return spec.m in (AMX_ROWS, 2 * AMX_ROWS) and spec.n in (16, 32) \
        and spec.k % (AMX_GROUPS * spec.vnni) == 0


def ensure_tile_permission() -> None:
    """Raise unless this process may execute tile instructions (asks the OS once)."""
    from ..target import host_isa

    host = host_isa()  # detection requests the permission when the CPU has AMX
    if not (host.amx_tile and host.amx_permitted):
        why = "the CPU has no AMX" if not host.amx_tile else "the OS refused tile state"
        raise UnsupportedISAError(f"cannot run AMX kernels here: {why} ({host.summary()})")


def _is_tile_call(call: tvm.ir.Call, setup: tuple[str, ...] = ()) -> bool:
    """Whether ``call`` calls a tile microkernel (not one of the ``setup`` functions)."""
    return (call.op.same_as(_CALL_EXTERN) and isinstance(call.args[0], tvm.ir.StringImm)
            and call.args[0].value.startswith(TILE_KERNEL_PREFIX)
            and call.args[0].value not in setup)


def _calls_tiles(stmt: tirx.Stmt, setup: tuple[str, ...] = ()) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, [(tvm.ir.Call, lambda c: found.append(
        _is_tile_call(c, setup)))])
    return any(found)


def configure_tiles_per_task(func: tirx.PrimFunc, m: int, n: int) -> tirx.PrimFunc:
    """``func`` with its tile microkernel calls made configuration-free and the tile
    configuration of (m x n) C blocks loaded once at the start of each parallel task (or of
    the whole function, without a parallel loop) and released at its end."""
    configure, release = amx_configure(m, n)
    setup = (configure.name, release.name)
    renamed = []

    def rename(call: tvm.ir.Call) -> tvm.ir.Call:
        if not _is_tile_call(call, setup) or call.args[0].value.endswith(NO_CONFIG):
            return call
        renamed.append(call)
        return tirx.call_extern("void", call.args[0].value + NO_CONFIG, *call.args[1:])

    def configured(body: tirx.Stmt) -> tirx.Stmt:
        calls = [tirx.Evaluate(tirx.call_extern("void", fn.name)) for fn in (configure, release)]
        seq = tirx.SeqStmt([calls[0], body, calls[1]])
        return tirx.AttrStmt(tirx.const(0, "int32"), "pragma_import_llvm",
                             tvm.ir.StringImm(module_text(configure, release)), seq)

    wrapped = []

    def wrap(loop: tirx.For) -> tirx.For:
        # The parallel loop of the tile work (other stages, e.g. padding, have their own).
        if loop.kind != tirx.ForKind.PARALLEL or not _calls_tiles(loop.body, setup):
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


#: Parts a tile block's K steps are cut into; between two parts the previous block's
#: epilogue runs a slice of its rows. A slice (a few rows of AVX-512 code) must fit the
#: out-of-order window beside the part's tile instructions to run while they compute.
EPILOGUE_SLICES = 8


def _tile_call(stmt: tirx.Stmt) -> tvm.ir.Call | None:
    """The configuration-free tile microkernel call ``stmt`` is (possibly under its
    ``pragma_import_llvm``), or None."""
    while isinstance(stmt, tirx.AttrStmt):
        stmt = stmt.body
    if isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call):
        call = stmt.value
        if call.op.same_as(_CALL_EXTERN) and isinstance(call.args[0], tvm.ir.StringImm) \
                and tile_brgemm(call.args[0].value) is not None:
            return call
    return None


def _buffers(stmts: list[tirx.Stmt], kind: type) -> list[tirx.Buffer]:
    """The buffers ``stmts`` load from (``TensorLoad``) or store to (``BufferStore``)."""
    found = []
    get = (lambda n: n.source) if kind is TensorLoad else (lambda n: n.buffer)
    for stmt in stmts:
        tvm_ffi.structural_walk(stmt, [(kind, lambda n: found.append(get(n)))])
    return found


def _shared(these: list[tirx.Buffer], those: list[tirx.Buffer]) -> bool:
    return any(x.same_as(y) for x in these for y in those)


def _next_panel(b: tvm.ir.Call, v: tirx.Var, steps: int) -> tuple[tirx.PrimExpr, int] | None:
    """(pointer, lines per step) that make each block sharing B's panel prefetch its share
    of the next panel while its tiles compute (AMX Xeon, 1 thread, weights cold: bf16
    128x768x3072 686 -> 473 us), or None where ``&B[index(v)]`` does not step by panels."""
    if not (isinstance(b, tvm.ir.Call) and b.args and isinstance(b.args[0], TensorLoad)):
        return None
    load = b.args[0]
    share = next_panel_share(load, load.indices[0], v)
    if share is None:
        return None
    start, lines, _ = share
    return tirx.address_of(load.source[start]), -(-lines // steps)


def _writes_only(stmt: tirx.Stmt, buffer: tirx.Buffer) -> bool:
    """Whether every store in ``stmt`` goes to ``buffer`` and it loads nothing (a C zero
    fill)."""
    stores, loads = [], []
    tvm_ffi.structural_walk(stmt, [(tirx.BufferStore, lambda s: stores.append(
        s.buffer.same_as(buffer))), (TensorLoad, loads.append)])
    return bool(stores) and all(stores) and not loads


def _sliceable(stmt: tirx.Stmt) -> bool:
    """A serial loop of constant extent: an epilogue loop over the block's rows."""
    return isinstance(stmt, tirx.For) and isinstance(stmt.extent, tirx.IntImm) \
        and stmt.kind == tirx.ForKind.SERIAL


def _epilogue_slicing(epilogue: list[tirx.Stmt], steps: int) -> tuple[int, int, int] | None:
    """(slices, smallest loop extent, index of the last loop) for cutting ``epilogue`` into
    row slices that keep its loops in step, or None where they cannot be: extents that are
    not multiples of the smallest one, or a statement between two loops (it would run in
    one slice while the loops run in all of them).

    Slicing each loop by its own extent let a copy loop over 32 rows copy row 20 in one
    slice while the activation loop before it (16 iterations of 2 rows) computed it in the
    next: wrong rows wherever a block's K steps (3, 5, 6, 7) do not divide both extents."""
    loops = [i for i, stmt in enumerate(epilogue) if _sliceable(stmt)]
    if not loops:
        return max(1, min(EPILOGUE_SLICES, steps)), 1, -1
    if any(not _sliceable(stmt) for stmt in epilogue[loops[0]:loops[-1] + 1]):
        return None
    extents = [epilogue[i].extent.value for i in loops]
    unit = min(extents)
    if unit < 1 or any(e % unit for e in extents):
        return None
    return max(1, min(EPILOGUE_SLICES, steps, unit)), unit, loops[-1]


@dataclass(frozen=True)
class _TileBlock:
    """One iteration of a tile-block loop, read apart: the work before the microkernel
    call, the call's tile kernel and arguments (let-bound values substituted), and the
    epilogue after it."""

    parts: TileBrgemm
    args: tuple[tirx.PrimExpr, ...]  # a, b, c, lda, a_batch, b_group, b_batch, ldc
    c_buffer: tirx.Buffer
    prologue: list[tirx.Stmt]
    epilogue: list[tirx.Stmt]


def _tile_block(loop: tirx.For) -> _TileBlock | None:
    """``loop``'s body as prologue, one tile microkernel call and epilogue; None when it is
    not one (no or several tile calls, a C that is not a buffer, tiles in the epilogue)."""
    items = list(loop.body.seq) if isinstance(loop.body, tirx.SeqStmt) else [loop.body]
    calls = [i for i, s in enumerate(items) if _tile_call(s) is not None]
    if len(calls) != 1 or not isinstance(loop.extent, tirx.IntImm) or loop.extent.value < 2:
        return None
    at = calls[0]
    call = _tile_call(items[at])
    parts = tile_brgemm(call.args[0].value)
    _, a, b, c, lda, a_batch, b_group, b_batch, ldc = call.args
    if not (isinstance(c, tvm.ir.Call) and c.args and isinstance(c.args[0], TensorLoad)):
        return None
    c_buffer = c.args[0].source
    lets: list[tuple[tirx.Var, tirx.PrimExpr]] = []
    prologue, epilogue = [], []
    for i, stmt in enumerate(items):
        if isinstance(stmt, tirx.Bind):
            lets.append((stmt.var, substitute(stmt.value, lets)))
        elif i < at:
            prologue.append(substitute(stmt, lets))
        elif i > at:
            if _calls_tiles(stmt):
                return None
            epilogue.append(substitute(stmt, lets))
    args = tuple(substitute(x, lets) for x in (a, b, c, lda, a_batch, b_group, b_batch, ldc))
    return _TileBlock(parts, args, c_buffer, prologue, epilogue)


def _kept_prologue(block: _TileBlock) -> list[tirx.Stmt] | None:
    """Work before the microkernel (A's padding or column scale) stays before it, unless it
    shares a buffer the previous block's epilogue, now after it, writes or still reads
    (None: the loop cannot be pipelined); a C zero fill is dropped where the microkernel
    does not read C (beta 0)."""
    epilogue_reads = [*_buffers(block.epilogue, TensorLoad), block.c_buffer]
    epilogue_writes = _buffers(block.epilogue, tirx.BufferStore)
    kept = []
    for stmt in block.prologue:
        if block.parts.beta == 0 and _writes_only(stmt, block.c_buffer):
            continue
        if _shared(_buffers([stmt], tirx.BufferStore), epilogue_reads + epilogue_writes) \
                or _shared(_buffers([stmt], TensorLoad), epilogue_writes):
            return None
        kept.append(stmt)
    return kept


def _row_slice(i: int, stmt: tirx.Stmt, s: int, slicing: tuple[int, int, int]
               ) -> tirx.Stmt | None:
    """Slice ``s`` of epilogue statement ``i``: the same share of the block's rows in
    every loop (iterations [s u / S, (s+1) u / S) times extent / u, u the smallest
    extent), so a loop reading what an earlier loop wrote (the copy out of the block's
    epilogue buffer) reads only rows that are done; statements before the first loop
    run in slice 0, after the last one in the last slice."""
    slices, unit, last_loop = slicing
    if _sliceable(stmt):
        per = stmt.extent.value // unit
        lo, hi = s * unit // slices * per, (s + 1) * unit // slices * per
        if lo == hi:
            return None
        return fresh_copy(tirx.For(stmt.loop_var, stmt.min + lo, hi - lo, stmt.kind,
                                    stmt.body))
    return fresh_copy(stmt) if s == (0 if i < last_loop else slices - 1) else None


def _extern(fn: IRFunction, *args) -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_extern("void", fn.name, *args))


def _pipelined(loop: tirx.For, prefetch_panels: bool = True) -> tirx.Stmt | None:
    """``loop`` (one tile block per iteration: microkernel into C, then the epilogue that
    reads C, if any) rewritten so that each iteration's tile steps are interleaved with the
    previous block's epilogue and prefetch the next B panel, and the last block's epilogue
    follows the loop; None when the loop does not have that form."""
    block = _tile_block(loop)
    if block is None:
        return None
    kept = _kept_prologue(block)
    if kept is None:
        return None
    parts, epilogue = block.parts, block.epilogue
    a, b, c, lda, a_batch, b_group, b_batch, ldc = block.args
    slicing = _epilogue_slicing(epilogue, parts.steps)
    if slicing is None:
        return None
    slices = slicing[0]
    v = loop.loop_var
    prev = [(v, v - 1)]
    prefetch = (_next_panel(b, v, parts.steps) if prefetch_panels else None) or (b, 0)
    body = [*(fresh_copy(p) for p in kept), _extern(parts.begin, c, ldc)]
    for s in range(slices):
        t0, t1 = s * parts.steps // slices, (s + 1) * parts.steps // slices
        body.append(_extern(parts.run, a, b, lda, a_batch, b_group, b_batch,
                            tirx.const(t0, "int32"), tirx.const(t1, "int32"), prefetch[0],
                            tirx.const(prefetch[1], "int32")))
        work = [r for r in (_row_slice(i, e, s, slicing) for i, e in enumerate(epilogue))
                if r is not None]
        if work:
            body.append(tirx.IfThenElse(v > loop.min, substitute(tirx.SeqStmt(work)
                                                                  if len(work) > 1 else work[0],
                                                                  prev), None))
    body.append(_extern(parts.end, c, ldc))
    text = tvm.ir.StringImm(module_text(parts.begin, parts.run, parts.end))
    body = tirx.AttrStmt(tirx.const(0, "int32"), "pragma_import_llvm", text, tirx.SeqStmt(body))
    last = [(v, loop.min + loop.extent - 1)]
    tail = [fresh_copy(substitute(e, last)) for e in epilogue]
    new_loop = tirx.For(v, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                        loop.annotations)
    return tirx.SeqStmt([new_loop, *tail]) if tail else new_loop


def interleave_tile_epilogues(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Software-pipeline the output blocks of a tile GEMM (lowered TIR): block ``b``'s tile
    steps run in :data:`EPILOGUE_SLICES` parts with a slice of block ``b - 1``'s epilogue
    (bias, activation, residual, dequantization on the AVX-512 unit) between them.

    The tile unit and the vector unit then work at once; in block order each block's
    epilogue waited for its tiles and the next block's tiles for the epilogue (AMX Xeon,
    1 thread, bf16 128x3072x768 with bias: 597 -> 473 us; with bias and GELU, where the
    vector work per block outlasts the tile work, 985 -> 808 us). Splitting an epilogue
    loop's iterations into consecutive ranges keeps their order, and the tile steps touch
    only A, B and the tiles, so the result is the same. One C block buffer suffices: the
    previous block's epilogue reads it before, in program order, this block's tiles are
    stored into it. Steps prefetch the next B panel unless the function's
    :data:`PREFETCH_PANELS_ATTR` is False."""
    changed = []
    prefetch_panels = bool(func.attrs.get(PREFETCH_PANELS_ATTR, True)) if func.attrs else True

    def visit(loop: tirx.For) -> tirx.Stmt:
        if loop.kind != tirx.ForKind.SERIAL:
            return loop
        new = _pipelined(loop, prefetch_panels)
        if new is None:
            return loop
        changed.append(loop)
        return new

    body = tvm_ffi.structural_map(func.body, [(tirx.For, visit)])
    return func.with_body(body) if changed else func


#: PrimFunc attribute ``[m, k]``: the tile GEMM copies A (m rows of k, rows alone padded up
#: to whole tile blocks) into ``A_pad``; :func:`read_whole_blocks_in_place` narrows the copy.
A_ROWS_ATTR = "tpp.amx_a_rows"
#: Name of the padded copy of A a GEMM's tiles read (``schedules.gemm_te``).
A_PAD = "A_pad"


def _a_pad_copy(loop: tirx.For) -> tirx.Buffer | None:
    """A's buffer where ``loop`` (a loop over A's rows) fills ``A_pad`` from it, else None."""
    sources = []

    def store(s: tirx.BufferStore) -> None:
        if s.buffer.name == A_PAD:
            tvm_ffi.structural_walk(s.value, [(TensorLoad, lambda t: sources.append(t.source))])

    tvm_ffi.structural_walk(loop.body, [(tirx.BufferStore, store)])
    return sources[0] if sources and all(s.same_as(sources[0]) for s in sources) else None


def read_whole_blocks_in_place(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A tile GEMM whose A is padded to whole row blocks (lowered TIR, marked with
    :data:`A_ROWS_ATTR`) copies only its last, partial block's rows into ``A_pad``; the
    tiles of every whole block load A itself (same rows, same row stride).

    The copy of all of A was a quarter of ResNet-50's 784 x 128 x 512 (M x N x K) int8
    GEMM (AMX Xeon, 1 thread: 0.050 ms, 800 rows unpadded 0.031; so, 0.034)."""
    attr = func.attrs.get(A_ROWS_ATTR) if func.attrs is not None else None
    block = func.attrs.get(TILE_CONFIG_ATTR) if func.attrs is not None else None
    if attr is None or block is None:
        return func
    (m, k), mr = (int(x) for x in attr), int(block[0])
    whole = m // mr * mr
    if whole == 0:
        return func
    sources: list[tirx.Buffer] = []  # A, once its copy loop is found

    def narrow(loop: tirx.For) -> tirx.For:
        source = _a_pad_copy(loop)
        if source is None or sources or not isinstance(loop.extent, tirx.IntImm) \
                or loop.extent.value != -(-m // mr) * mr:
            return loop
        sources.append(source)
        # rows [whole, padded): a parallel loop starts at 0
        body = substitute(loop.body, [(loop.loop_var, loop.loop_var + loop.min + whole)])
        return tirx.For(loop.loop_var, loop.min, Analyzer().simplify(loop.extent - whole),
                        loop.kind, body, loop.thread_binding, loop.annotations)

    body = tvm_ffi.structural_map(func.body, [(tirx.For, narrow)], order="pre")
    if not sources:
        return func
    (source,) = sources

    def redirect(call: tvm.ir.Call) -> tvm.ir.Call:
        if not _is_tile_call(call) or len(call.args) < 3:  # not a configuration call
            return call
        a = call.args[1]
        if not (isinstance(a, tvm.ir.Call) and a.args and isinstance(a.args[0], TensorLoad)
                and a.args[0].source.name == A_PAD):
            return call
        (index,) = a.args[0].indices
        row = tirx.floordiv(index, k)  # the block's first row (whatever column it starts at)
        in_place = tirx.call_intrin("handle", "prim.if_then_else", row + mr <= whole,
                                    tirx.address_of(source[index]), a)
        return tirx.call_extern("void", call.args[0].value, in_place, *call.args[2:])

    return func.with_body(tvm_ffi.structural_map(body, [(tvm.ir.Call, redirect)]))
