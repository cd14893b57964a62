"""bf16 activations between bf16 layers: no fp32 round trip through memory.

A bf16 layer takes its input as bf16 (padded, for a k x k convolution) from a small
conversion kernel of its own (TVM widens a bf16 buffer allocated inside a kernel, so the
conversion cannot be part of the layer's kernel). Where that input is the output of
another bf16 layer and only bf16 layers read it, the producer writes bf16 itself (its
epilogue ends in a converting copy TPP on the tile, ``epilogue_te(out_dtype=...)``): the
conversion kernel goes (unpadded GEMM operand) or only pads (convolution image, padded
GEMM rows), and the activation crosses memory at half the bytes. Results are bit-identical
to converting afterwards: the same fp32 tile is rounded once, the same way.

The lowering (``lower.py``) offers, per kernel it emits, how to rebuild it: a producer
writing bf16, a conversion kernel taking bf16 (or none needed). This pass rewrites the
call sites of a producer whose readers (through reshapes and aliases: views) are all such
conversions: one, or several (a ResNet stage's first block and its downsampling shortcut
both read the previous block's output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

#: Rebuilds a kernel: the producer writing bf16, or the conversion taking bf16 (a
#: conversion offered as None is not needed once its input is bf16).
Rebuild = Callable[[], tirx.PrimFunc]


@dataclass
class Bf16Offers:
    """What the lowering can rebuild, by kernel (GlobalVar) name."""

    producers: dict[str, Rebuild] = field(default_factory=dict)
    conversions: dict[str, Rebuild | None] = field(default_factory=dict)


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_RESHAPE = tvm.ir.Op.get("relax.reshape")


def _tir_callee(value: relax.Expr) -> str | None:
    if isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR):
        return value.args[0].name_hint
    return None


@relax.expr_functor.mutator
class _Bf16Activations(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, offers: Bf16Offers) -> None:
        super().__init__(mod)
        self.offers = offers
        self.producer_calls: dict = {}  # producer call -> its bf16 rebuild
        self.conversion_calls: dict = {}  # conversion call -> its bf16-input rebuild or None
        self.rewritten = 0

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        uses = relax.analysis.udchain(block)
        values = {b.var: b.value for b in block.bindings}

        def readers(var: relax.Var) -> list[relax.Var] | None:
            """The bindings reading ``var``, through reshapes and aliases (views); None if
            one is not in this dataflow block (an output)."""
            found = []
            for user in uses.get(var, []):
                if not isinstance(user, relax.DataflowVar):
                    return None
                value = values[user]
                if isinstance(value, relax.Var) or (
                        isinstance(value, relax.Call) and value.op.same_as(_RESHAPE)):
                    more = readers(user)
                    if more is None:
                        return None
                    found += more
                else:
                    found.append(user)
            return found

        for var, value in values.items():
            producer = _tir_callee(value)
            if producer not in self.offers.producers or not isinstance(var, relax.DataflowVar):
                continue
            found = readers(var)
            if not found or any(_tir_callee(values[r]) not in self.offers.conversions
                                for r in found):
                continue
            self.producer_calls[value] = self.offers.producers[producer]
            for r in found:
                self.conversion_calls[values[r]] = self.offers.conversions[_tir_callee(values[r])]
        return super().visit_dataflow_block_(block)

    def _rebuilt(self, call: relax.Call, rebuild: Rebuild, suffix: str) -> relax.Call:
        gv = self.builder_.add_func(rebuild(), call.args[0].name_hint + suffix)
        shape = [int(d) for d in call.ty_args[0].shape.values]
        return relax.call_tir(gv, call.args[1], relax.TensorType(shape, "bfloat16"))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        rebuild_producer = self.producer_calls.get(call)
        has_conversion = call in self.conversion_calls
        rebuild_conversion = self.conversion_calls.get(call)
        new = super().visit_call_(call)
        if rebuild_producer is not None:
            self.rewritten += 1
            return self._rebuilt(new, rebuild_producer, "_out_bf16")
        if has_conversion:
            if rebuild_conversion is None:  # the producer's bf16 is the operand as it is
                return new.args[1].fields[0]
            return self._rebuilt(new, rebuild_conversion, "_from_bf16")
        return new


def bf16_activations(mod: tvm.IRModule, offers: Bf16Offers) -> tuple[tvm.IRModule, int]:
    """``mod`` with producers writing bf16 where their only reader converts to bf16;
    returns it and how many producers now write bf16. Unused fp32 kernels are left for
    dead-code elimination."""
    if not offers.producers or not offers.conversions:
        return mod, 0
    pass_ = _Bf16Activations(mod, offers)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
            pass_.builder_.update_func(gv, pass_.visit_expr(func))
    return pass_.builder_.get(), pass_.rewritten
