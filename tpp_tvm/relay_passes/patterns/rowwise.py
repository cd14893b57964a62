"""Row-wise kernels: layer norm, RMS norm and softmax over the last axis, channels-last
instance and group norm, and element-wise chains as equation TPPs."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from ...intrinsics.epilogue import Epilogue
from .activations import (
    COMPOSITE_ACTIVATIONS,
    RELAX_ACTIVATIONS,
    activation_constants_hold,
    activation_pattern,
)
from .base import TPPPattern, static_f32


def _last_axis_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """Row-wise ops over the last axis of a static fp32 tensor (gamma/beta rows of H)."""
    a = ctx.annotated_expr
    x, call = a["lhs"], a["root"]
    if not static_f32(x):
        return False
    ndim = len(x.ty.shape.values)
    attrs = call.attrs
    if hasattr(attrs, "axes"):  # layer norm
        if [int(ax) % ndim for ax in attrs.axes] != [ndim - 1]:
            return False
        if not (attrs.center and attrs.scale):
            return False
        width = int(x.ty.shape.values[-1])
        return all(static_f32(a[k]) and [int(d) for d in a[k].ty.shape.values] == [width]
                   for k in ("gamma", "beta"))
    return int(attrs.axis) % ndim == ndim - 1


def _rms_norm_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """RMS norm over the last axis of a static fp32 tensor with a gamma row of H."""
    a = ctx.annotated_expr
    x = a["lhs"]
    if not (static_f32(x) and static_f32(a["gamma"])):
        return False
    ndim = len(x.ty.shape.values)
    if [int(ax) % ndim for ax in a["root"].attrs.axes] != [ndim - 1]:
        return False
    return [int(d) for d in a["gamma"].ty.shape.values] == [int(x.ty.shape.values[-1])]


def _instance_norm_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A channels-last instance or group norm of one fp32 sample (1, rows, C) over its
    rows, with constant per-channel gamma and beta."""
    a = ctx.annotated_expr
    x, root = a["lhs"], a["root"]
    if not static_f32(x) or not isinstance(a["gamma"], tvm.ir.Constant) \
            or not isinstance(a["beta"], tvm.ir.Constant):
        return False
    shape = [int(d) for d in x.ty.shape.values]
    return (len(shape) == 3 and shape[0] == 1 and shape[1] >= 2
            and int(root.attrs.channel_axis) == 2
            and [int(d) for d in root.attrs.axes] == [1])


def instance_norm_patterns() -> list[TPPPattern]:
    """``act(instance_norm(x, gamma, beta))`` and ``act(group_norm(...))`` channels-last
    (``relay_passes/instance_norm.py`` writes them): column statistics and one equation
    TPP."""
    table = []
    for norm_op in ("instance_norm", "group_norm"):
        for activation in (*[a for a in RELAX_ACTIVATIONS if a not in COMPOSITE_ACTIVATIONS], None):
            x, gamma, beta = wildcard(), is_const(), is_const()
            norm = is_op(f"relax.nn.{norm_op}")(x, gamma, beta)
            out = activation_pattern(activation, norm) if activation else norm
            name = f"tpp.{norm_op}" + (f"_{RELAX_ACTIVATIONS[activation]}" if activation else "")
            table.append(TPPPattern(name, out, {"lhs": x, "gamma": gamma, "beta": beta,
                                                "root": norm, "out": out},
                                    _instance_norm_check, "instance_norm",
                                    Epilogue(activation=RELAX_ACTIVATIONS.get(activation))))
    return table


def rowwise_patterns() -> list[TPPPattern]:
    """Layer norm, RMS norm and softmax over the last axis: row-wise TPP equations."""
    x, gamma, beta = wildcard(), wildcard(), wildcard()  # constants, or trained params
    ln = is_op("relax.nn.layer_norm")(x, gamma, beta)
    x2 = wildcard()
    sm = is_op("relax.nn.softmax")(x2)
    x3, gamma3 = wildcard(), wildcard()
    rms = is_op("relax.nn.rms_norm")(x3, gamma3)
    return [
        *instance_norm_patterns(),
        TPPPattern("tpp.layer_norm", ln, {"lhs": x, "gamma": gamma, "beta": beta, "root": ln},
                   _last_axis_check, "layer_norm"),
        TPPPattern("tpp.rms_norm", rms, {"lhs": x3, "gamma": gamma3, "root": rms},
                   _rms_norm_check, "rms_norm"),
        TPPPattern("tpp.softmax", sm, {"lhs": x2, "root": sm}, _last_axis_check, "softmax"),
    ]


def _eltwise_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """An element-wise chain on a static fp32 tensor of at least 2 x 2 elements; its second
    operand is the same shape (residual) or a row over the last axis (bias)."""
    a = ctx.annotated_expr
    x = a["lhs"]
    if not static_f32(x) or not activation_constants_hold(a):
        return False
    xs = [int(d) for d in x.ty.shape.values]
    if len(xs) < 2 or xs[-1] < 2 or int(np.prod(xs[:-1])) < 2:
        return False
    if "operand" in a:
        y = a["operand"]
        if not static_f32(y):
            return False
        ys = [int(d) for d in y.ty.shape.values]
        if ys != xs and not (ys and ys[-1] == xs[-1] and all(d == 1 for d in ys[:-1])):
            return False
    return True


def eltwise_patterns() -> list[TPPPattern]:
    """Element-wise chains as equation TPPs: act(x), x + y, act(x + y)."""
    table = []
    for activation in (*RELAX_ACTIVATIONS, None):
        for with_add in (True, False):
            if activation is None:
                # A lone add TVM fuses with its element-wise producers and consumers
                # (RoPE's x*cos + rotate(x)*sin becomes one kernel, not three); an equation
                # TPP would only cut that chain.
                continue
            x = wildcard()
            out, ann, name = x, {"lhs": x}, "tpp.eltwise"
            if with_add:
                y = wildcard()
                out = is_op("relax.add")(x, y)
                ann["operand"] = y
                name += "_add"
            if activation:
                out = activation_pattern(activation, out, ann)
                name += "_" + RELAX_ACTIVATIONS[activation]
            ann["root"] = out
            table.append(TPPPattern(name, out, ann, _eltwise_check, "eltwise",
                                    Epilogue(activation=RELAX_ACTIVATIONS.get(activation))))
    return table
