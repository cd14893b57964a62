"""Software prefetch of a GEMM's next weight panel, on lowered TIR.

A GEMM streams its packed weights panel by panel; the blocks that share a panel reuse it
from cache, but the first one waits on memory for each line when the weights are cold (in a
model, every layer's weights come from L3 or DRAM once per inference). Each block that
shares panel ``p`` therefore prefetches one share of panel ``p + 1`` into L2 while it
computes. The AMX tile GEMM does it in its microkernel's steps (``amx.py``); the vector
GEMM kernels get :func:`prefetch_next_panels` in the ``tpp`` TIR pipeline.

Here too the small TIR utilities those rewrites share (variable substitution, fresh copies
of statements).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.sym import Analyzer

#: PrimFunc attribute: the name of the packed weight buffer (``B_packed``) whose next panel
#: the kernel's reduction loop prefetches (set by the vector GEMM schedule).
PREFETCH_ATTR = "tpp.prefetch_panels"
#: Bytes of a cache line.
LINE = 64
#: How far a block's loop variable is searched for the next panel (blocks per panel).
MAX_SHARERS = 64


def substitute(node, pairs: list[tuple[tirx.Var, tirx.PrimExpr]]):
    """``node`` with each variable of ``pairs`` replaced by its expression."""
    def var(v: tirx.Var):
        return next((e for k, e in pairs if k.same_as(v)), v)

    return tvm_ffi.structural_map(node, [(tirx.Var, var)])


def fresh_copy(stmt: tirx.Stmt) -> tirx.Stmt:
    """``stmt`` with the variables it binds (loop variables, lets) renamed, so that copies
    of one statement can sit side by side (a variable is bound once per function)."""
    bound = []
    tvm_ffi.structural_walk(stmt, [(tirx.For, lambda f: bound.append(f.loop_var)),
                                   (tirx.Bind, lambda b: bound.append(b.var))])
    return substitute(stmt, [(v, tirx.Var(v.name, v.ty)) for v in bound])


def panel_step(index: tirx.PrimExpr, v: tirx.Var) -> tuple[int, int] | None:
    """(d, step): the weight index moves by ``step`` elements (one panel) every ``d``
    iterations of block loop ``v``, or None where it does not step by a constant."""
    analyzer = Analyzer()
    for d in range(1, MAX_SHARERS + 1):
        step = analyzer.simplify(substitute(index, [(v, v + d)]) - index)
        if isinstance(step, tirx.IntImm):
            return (d, step.value) if step.value > 0 else None
    return None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_panel_share(load: TensorLoad, index: tirx.PrimExpr, v: tirx.Var
                     ) -> tuple[tirx.PrimExpr, int, int] | None:
    """(start index, lines, d): the share of the next panel that block ``v`` prefetches,
    for a weight load at ``index`` (its block's first element), with d the blocks sharing
    a panel; or None."""
    found = panel_step(index, v)
    if found is None:
        return None
    d, step = found
    elem = tvm.DataType(str(load.source.dtype)).bits // 8
    share = _ceil_div(_ceil_div(step * elem, LINE), d)  # lines each of the d blocks fetches
    return index + step + tirx.floormod(v, d) * (share * LINE // elem), share, d


def prefetch_l2(address: tirx.PrimExpr) -> tirx.Stmt:
    """``prefetcht1`` of one line (``llvm.prefetch``: read, locality 2, data)."""
    return tirx.Evaluate(tirx.call_llvm_intrin(
        "void", "llvm.prefetch.p0", address, tirx.const(0, "int32"), tirx.const(2, "int32"),
        tirx.const(1, "int32")))


def _items(stmt: tirx.Stmt) -> list[tirx.Stmt]:
    return list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]


def _weight_loads(stmt: tirx.Stmt, name: str) -> list[TensorLoad]:
    found = []
    tvm_ffi.structural_walk(stmt, [(TensorLoad, lambda ld: found.append(ld)
                                    if ld.source.name.startswith(name) else None)])
    return found


def _reduction_loop(stmt: tirx.Stmt, name: str, lets: list, loops: list
                    ) -> tuple[tirx.For, list, list] | None:
    """The first innermost serial loop under ``stmt`` (through lets and attributes) that
    loads ``name``: the microkernel's reduction loop, with the lets bound before it and the
    loops enclosing it (outermost first)."""
    for item in _items(stmt):
        if isinstance(item, tirx.Bind):
            lets = [*lets, (item.var, substitute(item.value, lets))]
        elif isinstance(item, tirx.AttrStmt):
            found = _reduction_loop(item.body, name, lets, loops)
            if found is not None:
                return found
        elif isinstance(item, tirx.For) and _weight_loads(item, name):
            if item.kind == tirx.ForKind.SERIAL and \
                    not any(isinstance(s, tirx.For) for s in _items(item.body)):
                return item, lets, loops
            found = _reduction_loop(item.body, name, lets, [*loops, item])
            if found is not None:
                return found
    return None


def _walk(first: tirx.PrimExpr, block: tirx.For, loops: list[tirx.For]
          ) -> tuple[tirx.Var, int, int, list[tirx.For]] | None:
    """(v, d, step, sharers): the innermost loop ``v`` that has loops inside it and whose
    iterations move the weights by a constant ``step`` every ``d`` iterations, and those
    loops, whose iterations all use the same weights (a K-blocked kernel: the chunk loop and
    the rows under it); else the tile loop ``block``. The loop right around the reduction
    (a batch-reduce over filter rows) walks within one panel."""
    for at in range(len(loops) - 2, -1, -1):  # the innermost one walks within the panel
        found = panel_step(first, loops[at].loop_var)
        if found is not None:
            return loops[at].loop_var, *found, loops[at + 1:]
    found = panel_step(first, block.loop_var)
    return None if found is None else (block.loop_var, *found, loops)


def _with_prefetch(block: tirx.For, name: str) -> tirx.For:
    """``block`` (output tiles, one per iteration, or a panel's K chunks and their rows) with
    its reduction loop prefetching, a few bytes per step, this tile's share of the next
    panel or chunk of weights."""
    found = _reduction_loop(block.body, name, [], [])
    if found is None:
        return block
    k_loop, lets, loops = found
    if not isinstance(k_loop.extent, tirx.IntImm):
        return block
    body = _items(k_loop.body)
    for item in body:
        if isinstance(item, tirx.Bind):
            lets = [*lets, (item.var, substitute(item.value, lets))]
    load = _weight_loads(k_loop.body, name)[0]
    index = load.indices[0]
    index = substitute(index.base if isinstance(index, tirx.Ramp) else index, lets)
    k = k_loop.loop_var
    first = substitute(index, [(k, k_loop.min)])
    walk = _walk(first, block, loops)
    if walk is None or not all(isinstance(f.extent, tirx.IntImm) for f in walk[3]):
        return block
    v, d, step, sharers = walk
    row, rows = tirx.const(0, "int32"), 1  # this tile's index among the sharing loops
    for f in sharers:
        row, rows = row * f.extent.value + (f.loop_var - f.min), rows * f.extent.value
    if d * rows < 2:
        return block  # one tile per panel: the weights stay in L2 across tiles anyway
    elem = tvm.DataType(str(load.source.dtype)).bits // 8
    lines = _ceil_div(_ceil_div(step * elem, LINE), d * rows)  # this tile's share
    per_k = max(1, _ceil_div(lines * LINE // elem, k_loop.extent.value))  # elements a step
    start = first + step + (tirx.floormod(v, d) * rows + row) * (lines * LINE // elem)
    fetch = prefetch_l2(tirx.address_of(load.source[start + (k - k_loop.min) * per_k]))
    new_k = tirx.For(k, k_loop.min, k_loop.extent, k_loop.kind,
                     tirx.SeqStmt([*body, fetch]), k_loop.thread_binding, k_loop.annotations)
    return tvm_ffi.structural_map(block, [(tirx.For, lambda f: new_k if f.same_as(k_loop)
                                           else f)])


def prefetch_next_panels(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A vector GEMM kernel (lowered TIR, marked with :data:`PREFETCH_ATTR`) whose output
    tiles, the parallel loop's iterations, prefetch their share of the next weight panel in
    their reduction loop (AMX Xeon, 1 thread, fp32 with weights cold in L3: 128x3072x768
    3328 -> 3013 us, 128x768x3072 3637 -> 3259 us; hot weights unchanged)."""
    name = func.attrs.get(PREFETCH_ATTR) if func.attrs is not None else None
    if name is None:
        return func

    def visit(loop: tirx.For) -> tirx.For:
        return _with_prefetch(loop, str(name)) if loop.kind == tirx.ForKind.PARALLEL else loop

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, visit)], order="pre"))
