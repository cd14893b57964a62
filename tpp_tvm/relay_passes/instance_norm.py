"""A per-channel norm over time computed channels-first, rewritten channels-last.

wav2vec2's feature extractor normalizes its first convolution's channels over time (a
GroupNorm with one group per channel, exported as InstanceNormalization). TVM's importer
writes it as a layer norm over the last axis of the (channels, time) tensor, followed by
per-channel scales and shifts and the GELU. Once the convolutions run channels-last, that
layer norm sits between two layout transposes:

    permute(x (1, T, C)) -> layer_norm over T -> (* k_c, + k_c)... -> act -> permute back

Both transposes and the three element-wise passes go: the chain becomes
``act(instance_norm(x, a, b))`` on the channels-last tensor, the scales and shifts folded
into the norm's per-channel ``a`` and ``b`` (``schedules/instance_norm.py`` runs it as
column statistics plus one equation TPP). The chain is matched from the transpose back to
the convolution layout; anything else in it leaves the graph as it is.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .exprs import bindings, const_value, static_shape

#: Activations that may end the chain, by Relax op (their TPP names are the patterns').
_ACTIVATIONS = ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.relu", "relax.nn.silu",
                "relax.sigmoid", "relax.tanh")


def _per_channel(value: np.ndarray, shape: list[int], channels: int) -> np.ndarray | None:
    """A constant that, broadcast to ``shape`` (.., C, T), varies along C only: its (C,)."""
    try:
        full = np.broadcast_to(value, shape).reshape(channels, -1)
    except ValueError:
        return None
    return full[:, 0].copy() if np.all(full == full[:, :1]) else None


def _chain(v: relax.Expr, b: dict) -> tuple | None:
    """From the tensor transposed back to channels-last, up to the layer norm: (act op,
    [(op, (C,) constant) in graph order], layer norm call), or None."""
    act, steps, e = None, [], v
    while True:
        call = b.get(e, e)
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            return None
        op = call.op.name
        if op == "relax.nn.layer_norm":
            return act, steps[::-1], call
        shape = static_shape(call)
        if shape is None or len(shape) not in (2, 3) or (len(shape) == 3 and shape[0] != 1):
            return None
        if op == "relax.reshape":
            e = call.args[0]
        elif op in _ACTIVATIONS and act is None and not steps:
            act, e = op, call.args[0]
        elif op in ("relax.multiply", "relax.add"):
            lhs, rhs = call.args
            k = const_value(rhs) if const_value(rhs) is not None else const_value(lhs)
            other = lhs if const_value(rhs) is not None else rhs
            k = None if k is None else _per_channel(k, shape, shape[-2])
            if k is None:
                return None
            steps.append((op, k))
            e = other
        else:
            return None


def _channels_last_source(ln: relax.Call, b: dict) -> relax.Expr | None:
    """x (1, T, C) when the layer norm's input is ``permute_dims(x, [0, 2, 1])`` reshaped to
    (C, T) or (1, C, T) and its gamma and beta are 1 and 0 (a plain per-channel norm)."""
    gamma, beta = const_value(ln.args[1]), const_value(ln.args[2])
    shape = static_shape(ln)
    axes = [int(a) for a in ln.attrs.axes]
    if gamma is None or beta is None or shape is None or axes not in ([-1], [len(shape) - 1]):
        return None
    if not (np.all(gamma == 1) and np.all(beta == 0)):
        return None
    e = ln.args[0]
    while True:
        call = b.get(e, e)
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            return None
        if call.op.name == "relax.reshape":
            e = call.args[0]
            continue
        if call.op.name != "relax.permute_dims" or [int(a) for a in call.attrs.axes] != [0, 2, 1]:
            return None
        x = call.args[0]
        xs = static_shape(x)
        if xs is None or len(xs) != 3 or xs[0] != 1 or xs[1:] != shape[-1:-3:-1] \
                or str(x.ty.dtype) != "float32":
            return None
        return x


def channels_last_instance_norm(func: relax.Function) -> relax.Function:
    """Rewrite each matched chain (module doc) ending in ``permute_dims(expand_dims(v, 2),
    [0, 2, 3, 1])``, the transpose into a channels-last convolution."""
    b = bindings(func)
    v = wildcard()
    pattern = is_op("relax.permute_dims")(is_op("relax.expand_dims")(v))

    def rewriter(orig: relax.Call, m: dict) -> relax.Expr:
        expand = m[pattern].args[0] if isinstance(m[pattern].args[0], relax.Call) \
            else b.get(m[pattern].args[0])
        if [int(a) for a in orig.attrs.axes] != [0, 2, 3, 1] or expand is None or \
                [int(a) for a in expand.attrs.axis] != [2]:
            return orig
        found = _chain(m[v], b)
        if found is None:
            return orig
        act, steps, ln = found
        x = _channels_last_source(ln, b)
        if x is None:
            return orig
        channels = static_shape(x)[2]
        scale, shift = np.ones(channels), np.zeros(channels)
        for op, k in steps:
            if op == "relax.multiply":
                scale, shift = scale * k, shift * k
            else:
                shift = shift + k
        y = relax.op.nn.instance_norm(
            x, relax.const(scale.astype("float32")), relax.const(shift.astype("float32")),
            channel_axis=2, axes=[1], epsilon=float(ln.attrs.epsilon))
        if act is not None:
            y = relax.Call(tvm.ir.Op.get(act), [y])
        return relax.op.reshape(y, static_shape(orig))

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tpp.ChannelsLastInstanceNorm")
def ChannelsLastInstanceNorm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """:func:`channels_last_instance_norm` on every Relax function."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = channels_last_instance_norm(func)
    return mod
