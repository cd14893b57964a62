"""Activations and epilogues as Relax writes them: the activations the patterns match
(one Relax op, or a composite's name) with the unary TPP each lowers onto, their patterns
and constants, and the one builder of every contraction's fused tail."""

from __future__ import annotations

import numpy as np
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from ...intrinsics.epilogue import Epilogue
from ...intrinsics.spec import LEAKY_RELU_SLOPE, QUICK_GELU_SCALE
from ..exprs import scalar_value

#: The Relax activations the patterns match (one Relax op, or a composite's name), each with
#: the unary TPP it lowers onto.
RELAX_ACTIVATIONS: dict[str, str] = {
    "relax.nn.relu": "relu",
    "relax.nn.gelu": "gelu",
    "relax.nn.gelu_tanh": "gelu_tanh",
    "relax.sigmoid": "sigmoid",
    "relax.nn.silu": "silu",
    "relax.tanh": "tanh",
    # ReLU6 as the importer writes a Clip (frontend.converters): minimum(maximum(x, 0), 6),
    # bounds checked by activation_constants_hold.
    "relu6": "relu6",
    # CLIP's x * sigmoid(1.702 x), scale checked by activation_constants_hold.
    "quick_gelu": "quick_gelu",
    # x * (min(max(x + 3, 0), 6) / 6) as the importer writes HardSwish (frontend's
    # converter), constants checked by activation_constants_hold.
    "hardswish": "hardswish",
    # the default slope only (the pattern checks it: activation_pattern)
    "relax.nn.leakyrelu": "leaky_relu",
}

#: Activations written as several Relax ops (not one op with that name).
COMPOSITE_ACTIVATIONS = ("relu6", "quick_gelu", "hardswish")
#: Activations whose one Relax op carries an attribute the pattern checks (leaky ReLU's
#: slope).
ATTRIBUTE_ACTIVATIONS = ("relax.nn.leakyrelu",)
#: Activations that are one Relax op of the operand alone, with no attribute: a graph pass
#: may rebuild one as ``Call(op, [x])`` (``instance_norm``'s folded activation).
PLAIN_ACTIVATIONS = tuple(op for op in RELAX_ACTIVATIONS
                          if op not in COMPOSITE_ACTIVATIONS + ATTRIBUTE_ACTIVATIONS)
#: The constants of a composite activation's pattern, by annotation suffix, as float32.
#: (HardSwish's own keys: in :func:`any_activation` every alternative annotates one dict.)
_ACTIVATION_CONSTANTS = {"_lo": 0.0, "_hi": 6.0, "_scale": float(np.float32(QUICK_GELU_SCALE)),
                         "_hs_lo": 0.0, "_hs_hi": 6.0, "_shift": 3.0, "_div": 6.0}


def activation_pattern(op: str, x: DFPattern, ann: dict | None = None, key: str = "act"
                ) -> DFPattern:
    """The activation ``op`` applied to ``x``; ReLU6's bounds are annotated in ``ann`` as
    ``<key>_lo``/``<key>_hi`` for :func:`activation_constants_hold`."""
    if op == "relu6":
        lo, hi = is_const(), is_const()
        if ann is not None:
            ann[key + "_lo"], ann[key + "_hi"] = lo, hi
        return is_op("relax.minimum")(is_op("relax.maximum")(x, lo), hi)
    if op == "hardswish":
        lo, hi, shift, div = is_const(), is_const(), is_const(), is_const()
        if ann is not None:
            ann.update({key + "_hs_lo": lo, key + "_hs_hi": hi, key + "_shift": shift,
                        key + "_div": div})
        gate = is_op("relax.divide")(
            is_op("relax.minimum")(is_op("relax.maximum")(is_op("relax.add")(x, shift), lo),
                                   hi), div)
        return is_op("relax.multiply")(x, gate) | is_op("relax.multiply")(gate, x)
    if op == "quick_gelu":
        scale = is_const()
        if ann is not None:
            ann[key + "_scale"] = scale
        scaled = is_op("relax.multiply")(x, scale) | is_op("relax.multiply")(scale, x)
        gate = is_op("relax.sigmoid")(scaled)
        return is_op("relax.multiply")(x, gate) | is_op("relax.multiply")(gate, x)
    if op == "relax.nn.leakyrelu":  # its slope as ONNX (float32) or torch (double) gives it
        return (is_op(op)(x).has_attr({"alpha": LEAKY_RELU_SLOPE})
                | is_op(op)(x).has_attr({"alpha": float(np.float32(LEAKY_RELU_SLOPE))}))
    return is_op(op)(x)


def activation_constants_hold(a: dict) -> bool:
    """Every composite activation's constants are its own: ReLU6 clips at exactly [0, 6],
    HardSwish shifts by 3, clips at [0, 6] and divides by 6, quick GELU scales by 1.702 (as
    float32 writes it)."""
    return all(scalar_value(a[key + suffix]) == value
               for key in ("act", "post_act")
               for suffix, value in _ACTIVATION_CONSTANTS.items() if key + suffix in a)


#: Unary TPP -> the Relax activation (:data:`RELAX_ACTIVATIONS` key) whose pattern
#: computes it.
RELAX_ACTIVATION_OF_TPP = {tpp: op for op, tpp in RELAX_ACTIVATIONS.items()}


def epilogue_pattern(core: DFPattern, epilogue: Epilogue, ann: dict,
                     bias: DFPattern | None = None, residual_either_side: bool = False
                     ) -> DFPattern:
    """``epilogue``'s steps applied to ``core`` as Relax writes them, its operands annotated
    in ``ann`` (``bias``, ``gate``, ``residual``; a composite activation's constants under
    ``act_*``/``post_act_*``): the one builder of every fused tail, fp32 and int8. ``bias``:
    the bias operand's pattern (a constant by default); ``residual_either_side``: the
    residual may be either operand of its add."""
    out = core
    if epilogue.bias:
        ann["bias"] = bias if bias is not None else is_const()
        out = is_op("relax.add")(out, ann["bias"])
    if epilogue.activation:
        out = activation_pattern(RELAX_ACTIVATION_OF_TPP[epilogue.activation], out, ann)
    if epilogue.gate:
        g = ann["gate"] = wildcard()
        out = is_op("relax.multiply")(out, g) | is_op("relax.multiply")(g, out)
    if epilogue.residual:
        r = ann["residual"] = wildcard()
        added = is_op("relax.add")(out, r)
        out = added | is_op("relax.add")(r, out) if residual_either_side else added
    if epilogue.post_activation:
        out = activation_pattern(RELAX_ACTIVATION_OF_TPP[epilogue.post_activation], out, ann,
                                 "post_act")
    return out


def any_activation(x: DFPattern, ann: dict, key: str) -> DFPattern:
    """Any activation of :data:`RELAX_ACTIVATIONS` applied to ``x``, annotated as ``key`` (which
    one is read back from the match: :func:`matched_activation`)."""
    alternatives = [activation_pattern(op, x, ann, key) for op in RELAX_ACTIVATIONS]
    out = alternatives[0]
    for alt in alternatives[1:]:
        out = out | alt
    ann[key] = out
    return out


def matched_activation(matched: dict, key: str) -> str:
    """The unary TPP the activation annotated ``key`` by :func:`any_activation` computes
    (a composite one is told by which of its constants matched)."""
    for suffix, op in (("_shift", "hardswish"), ("_scale", "quick_gelu"), ("_lo", "relu6")):
        if key + suffix in matched:
            return op
    return RELAX_ACTIVATIONS[matched[key].op.name]
