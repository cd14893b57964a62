"""Recognise element-wise blocks as TPP equations by their math, and tensorize them.

A spatial block ``Y[.., i, j] = f(X[.., i, j], bias[j], R[.., i, j])`` is an equation TPP
when ``f`` is, exactly, a chain of TPP steps (bias add, residual add, unary ops). The
chain is found by rebuilding each candidate from the block's own loads with the TPP
spec's math (``equation_expr``) and comparing structurally — the same comparison
``tensorize`` makes, done first so only the winner is registered.

TVM legalizes ``R.nn.gelu`` with a different (equal) formula than the TPP spec; tuning
tasks are legalized with :data:`LEGALIZE_AS_TPP` so such blocks carry the spec's formula.
"""

from __future__ import annotations

import itertools
import logging
from functools import cache

import tvm_ffi
from tvm import te, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import Schedule
from tvm.s_tir.schedule import SBlockRV

from ..intrinsics import OPS, TPPSpec, intrinsic
from ..intrinsics.spec import equation_expr

log = logging.getLogger(__name__)

UNARY_STEPS = tuple(op for op, d in OPS.items() if d.kind == "unary" and op != "copy")


@cache
def candidate_steps() -> tuple[tuple[str, ...], ...]:
    """Equation chains tried: [bias] [unary] [residual] [unary], at least one step."""
    opt_unary = [(), *[(u,) for u in UNARY_STEPS]]
    chains = []
    for bias, pre, res, post in itertools.product([(), ("bias",)], opt_unary,
                                                  [(), ("residual",)], opt_unary):
        steps = bias + pre + res + post
        if steps and not (pre and post and not res):
            chains.append(steps)
    chains += [(u, v) for u in UNARY_STEPS for v in UNARY_STEPS]
    return tuple(dict.fromkeys(chains))


def _loads(expr: tirx.Expr) -> list:
    """Distinct buffer loads in ``expr`` (structurally distinct: same buffer and indices)."""
    found = []

    def visit(node, visitor):
        if isinstance(node, TensorLoad):
            if not any(tvm_ffi.structural_equal(node, f) for f in found):
                found.append(node)
            return None
        return visitor.default_visit(node)

    tvm_ffi.structural_visit(expr, visit)
    return found


def match_equation(sch: Schedule, block: SBlockRV):
    """(equation steps, tile operand load) computing ``block``, or None if it is not a
    TPP chain."""
    blk = sch.get(block)
    store = blk.body
    if (not isinstance(store, tirx.BufferStore) or len(store.indices) < 2
            or any(int(iv.iter_type) != 0 for iv in blk.iter_vars)
            or store.buffer.dtype != "float32"):
        return None
    idx = list(store.indices)
    loads = _loads(store.value)
    same = [ld for ld in loads if len(ld.indices) == len(idx)
            and all(a.same_as(b) for a, b in zip(ld.indices, idx))]
    bias = [ld for ld in loads if len(ld.indices) == 1 and ld.indices[0].same_as(idx[-1])]
    if len(same) + len(bias) != len(loads) or not same or len(bias) > 1 or len(same) > 2:
        return None
    for x in same:  # the tile operand; any other same-shaped load is the residual
        others = [ld for ld in same if ld is not x]
        for steps in candidate_steps():
            if steps.count("bias") != len(bias) or steps.count("residual") != len(others):
                continue
            operands = [bias[0] if s == "bias" else others[0]
                        for s in steps if s in ("bias", "residual")]
            if tvm_ffi.structural_equal(equation_expr(steps, x, operands), store.value):
                return steps, x
    return None


def tensorize_equation(sch: Schedule, block: SBlockRV, steps: tuple[str, ...], mr: int,
                       nr: int, isa: str) -> list | None:
    """Tile the block's last two loops by (mr, nr) and make each tile one equation TPP.
    Returns the loops around the TPP calls (outer axes, row tiles, column tiles), or None."""
    loops = sch.get_loops(block)
    if len(loops) < 2:
        return None
    rows, cols = loops[-2:]
    ext = [sch.get(lp).extent for lp in (rows, cols)]
    if not all(isinstance(e, tirx.IntImm) for e in ext):
        return None
    r, c = int(ext[0]), int(ext[1])
    mr, nr = min(mr, r), min(nr, c)
    if r % mr or c % nr or mr < 2 or nr < 2:
        return None
    ro, ri = sch.split(rows, [None, mr])
    co, ci = sch.split(cols, [None, nr])
    sch.reorder(ro, co, ri, ci)
    sch.tensorize(ri, intrinsic(TPPSpec("equation", "float32", m=mr, n=nr, steps=steps), isa))
    return [*loops[:-2], ro, co]


def _gelu_as_tpp(bb, call):
    x = call.args[0]
    return bb.call_te(lambda t: te.compute(t.shape, lambda *i: OPS["gelu"].fn(t(*i)),
                                           name="gelu"), x)


def _gelu_tanh_as_tpp(bb, call):
    x = call.args[0]
    return bb.call_te(lambda t: te.compute(t.shape, lambda *i: OPS["gelu_tanh"].fn(t(*i)),
                                           name="gelu_tanh"), x)


#: Legalizations whose TIR carries the TPP spec's formula (for ``LegalizeOps``).
LEGALIZE_AS_TPP = {"relax.nn.gelu": _gelu_as_tpp, "relax.nn.gelu_tanh": _gelu_tanh_as_tpp}
