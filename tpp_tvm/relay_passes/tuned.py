"""Tuned kernels for TPP subgraphs: a composite as one plain PrimFunc, and its lowering.

The graph pass lowers each matched subgraph (a composite function) to one hand-scheduled
kernel. For tuning, the same subgraph is legalized and fused by TVM into one plain PrimFunc
(``composite_kernel``) — the workload MetaSchedule searches with the TPP rules
(``tpp_tvm.tuning.tasks``). A build with a tuning log calls the tuned kernel in its place
(``emit_tuned``) when the log has one and it beat the hand schedule when both were timed at
tuning time; everything else keeps the hand schedules. Nothing here imports tuning.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from ..schedules.elementwise import LEGALIZE_AS_TPP


@dataclass(frozen=True)
class CompositeKernel:
    """A composite legalized into one PrimFunc called with (params and constants)."""

    func: tirx.PrimFunc
    args: tuple[relax.Expr, ...]
    out: object


def plain_function(func: relax.Function) -> relax.Function:
    """``func`` as a module's ``main``, without the attributes that mark it a composite (so
    TVM legalizes and fuses it like any function)."""
    for attr in ("Composite", "Primitive", "Codegen"):
        if func.attrs and attr in func.attrs:
            func = func.without_attr(attr)
    return func.with_attr("global_symbol", "main")


def composite_kernel(func: relax.Function, target: tvm.target.Target) -> CompositeKernel | None:
    """The composite's ops legalized and fused into one PrimFunc, or None if TVM fuses them
    into more than one kernel (such subgraphs keep their hand schedule)."""
    mod = tvm.IRModule({"main": plain_function(func)})
    with target:
        mod = tvm.transform.Sequential([
            relax.transform.LegalizeOps(LEGALIZE_AS_TPP),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
        ])(mod)
    calls = []
    main = mod["main"]
    for block in main.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")):
                calls.append(value)
            elif not isinstance(value, relax.Var | relax.Tuple):
                return None
    if len(calls) != 1:
        return None
    call = calls[0]
    prim = mod[call.args[0]]
    args = tuple(call.args[1].fields)
    if not all(isinstance(a, relax.Var | tvm.ir.Constant) for a in args):
        return None
    params = list(main.params)
    if any(isinstance(a, relax.Var) and a not in params for a in args):
        return None
    prim = prim.with_attr("global_symbol", "main")
    # Constant operands (weights, biases) may be repacked once at build time (TVM's
    # convention, which the TPP rules and TVM's RewriteLayout both follow).
    weights = [i for i, a in enumerate(args) if isinstance(a, tvm.ir.Constant)]
    if weights:
        prim = prim.with_attr("layout_free_buffers", weights)
    for attr in ("op_pattern", "tirx.is_scheduled"):
        if prim.attrs and attr in prim.attrs:
            prim = prim.without_attr(attr)
    return CompositeKernel(prim, args, call.ty)


def emit_tuned(bb: relax.BlockBuilder, func: relax.Function, call_args: list[relax.Expr],
               kernel: CompositeKernel, scheduled: tirx.PrimFunc, name: str) -> relax.Expr:
    """Call the tuned kernel in place of the composite call."""
    scheduled = scheduled.without_attr("global_symbol").with_attrs(
        {"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
    gv = bb.add_func(scheduled, name)
    params = dict(zip(list(plain_function(func).params), call_args))
    args = [params.get(a, a) if isinstance(a, relax.Var) else a for a in kernel.args]
    return relax.call_tir(gv, args, kernel.out)
