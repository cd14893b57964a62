"""A per-channel or per-group norm computed channels-first, rewritten channels-last.

wav2vec2's feature extractor normalizes its first convolution's channels over time (a
GroupNorm with one group per channel, exported as InstanceNormalization); BiT's GroupNorms
normalize 32 groups of an image's channels (exported as InstanceNormalization of the image
reshaped to (1, 32, C/32 * H * W)). TVM's importer writes both as a layer norm over the
last axis of the channels-first tensor, followed by per-group and per-channel scales and
shifts and the activation. Once the convolutions run channels-last, that layer norm sits
between two layout transposes:

    permute(x (1, T, C) or (1, H, W, C)) -> reshapes -> layer_norm over each group's row
    -> (* k, + k)... -> act -> permute back

Both transposes and the element-wise passes go: the chain becomes
``act(instance_norm(x, a, b))`` (a group per channel) or ``act(group_norm(x, a, b))`` on
the channels-last tensor seen as (1, pixels, C), the scales and shifts folded into the
norm's per-channel ``a`` and ``b`` (``schedules/instance_norm.py`` runs it as column
statistics plus one equation TPP: two passes over the tensor instead of BiT's five). The
chain is matched from the transpose back to the convolution layout; anything else in it
leaves the graph as it is.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard
from tvm_ffi import structural_equal

from .exprs import bindings, const_value, static_shape, use_counts
from .patterns import PLAIN_ACTIVATIONS
from .transposes import TO_NCHW, TO_NHWC


def _per_leading_axis(value: np.ndarray, shape: list[int]) -> np.ndarray | None:
    """A constant that, broadcast to ``shape`` ((1,) A, ...: a batch-1 channels-first
    tensor), varies along A only: its (A,); A is the channels or the groups of channels."""
    lead = shape[1:] if len(shape) >= 3 else shape
    try:
        full = np.broadcast_to(value, shape).reshape(lead[0], -1)
    except ValueError:
        return None
    return full[:, 0].copy() if np.all(full == full[:, :1]) else None


def _chain(v: relax.Expr, b: dict) -> tuple | None:
    """From the tensor transposed back to channels-last, up to the layer norm: (act op,
    [(op, (A,) constant) in graph order], layer norm call), or None."""
    act, steps, e = None, [], v
    while True:
        call = b.get(e, e)
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            return None
        op = call.op.name
        if op == "relax.nn.layer_norm":
            return act, steps[::-1], call
        shape = static_shape(call)
        if shape is None or len(shape) not in (2, 3, 4) or (len(shape) > 2 and shape[0] != 1):
            return None
        if op == "relax.reshape":
            e = call.args[0]
        elif op in PLAIN_ACTIVATIONS and act is None and not steps:
            act, e = op, call.args[0]
        elif op in ("relax.multiply", "relax.add"):
            lhs, rhs = call.args
            k = const_value(rhs) if const_value(rhs) is not None else const_value(lhs)
            other = lhs if const_value(rhs) is not None else rhs
            k = None if k is None else _per_leading_axis(k, shape)
            if k is None:
                return None
            steps.append((op, k))
            e = other
        else:
            return None


#: Layout transposes from a channels-last tensor to channels-first, by its rank.
_TO_CHANNELS_FIRST = {3: [0, 2, 1], 4: TO_NCHW}


def _channels_last_source(ln: relax.Call, b: dict
                          ) -> tuple[relax.Expr, list[int], int] | None:
    """(x, its shape, groups): x ((1, T, C) or (1, H, W, C), fp32) when the layer norm's
    input is x transposed to channels-first and reshaped to one row per group of
    C / groups channels, and its gamma and beta are 1 and 0 (a plain norm of each group).
    An image that is channels-first already (BiT's first block norm reads the max
    pooling, its last one a residual sum) gives its transpose to channels-last, which the
    layout pass cancels against the transposes before it."""
    gamma, beta = const_value(ln.args[1]), const_value(ln.args[2])
    shape = static_shape(ln)
    axes = [int(a) for a in ln.attrs.axes]
    if gamma is None or beta is None or shape is None or axes not in ([-1], [len(shape) - 1]):
        return None
    if not (np.all(gamma == 1) and np.all(beta == 0)):
        return None
    e, reshaped = ln.args[0], False
    while True:
        call = b.get(e, e)
        if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) \
                and call.op.name == "relax.reshape":
            e, reshaped = call.args[0], True
            continue
        if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) \
                and call.op.name == "relax.permute_dims":
            x = call.args[0]
            xs = static_shape(x)
            if xs is None or _TO_CHANNELS_FIRST.get(len(xs)) != [int(a) for a in call.attrs.axes]:
                return None
        else:  # a channels-first image, grouped by the reshapes
            first = static_shape(e)
            if not reshaped or first is None or len(first) != 4:
                return None
            xs = [first[0], *first[2:], first[1]]
            x = relax.op.permute_dims(e, TO_NHWC)
        if xs[0] != 1 or str(e.ty.dtype) != "float32":  # (x and the view e alike)
            return None
        channels, total = xs[-1], int(np.prod(xs))
        groups = total // shape[-1]
        if groups * shape[-1] != total or channels % groups:
            return None
        return x, xs, groups


def _channels_first_value(permute: relax.Call, b: dict) -> relax.Expr | None:
    """The channels-first value ``permute`` makes channels-last again: v (1, C, H, W) of
    ``permute_dims(v, [0, 2, 3, 1])``, or v (1, C, T) of ``permute_dims(expand_dims(v, 2),
    [0, 2, 3, 1])`` (a 1-D convolution's input)."""
    if [int(a) for a in permute.attrs.axes] != [0, 2, 3, 1]:
        return None
    arg = permute.args[0]
    inner = b.get(arg, arg)
    if isinstance(inner, relax.Call) and isinstance(inner.op, tvm.ir.Op) \
            and inner.op.name == "relax.expand_dims":
        return inner.args[0] if [int(a) for a in inner.attrs.axis] == [2] else None
    shape = static_shape(arg)
    return arg if shape is not None and len(shape) == 4 else None


def _channels_last_norm(v: relax.Expr, b: dict) -> tuple[relax.Expr, list[int]] | None:
    """(``act(norm(x, a, b))`` on x seen as (1, pixels, C), x's channels-last shape) for the
    matched chain (module doc) whose channels-first result is ``v``, or None."""
    found = _chain(v, b)
    source = None if found is None else _channels_last_source(found[2], b)
    if source is None:
        return None
    act, steps, ln = found
    x, xs, groups = source
    channels = xs[-1]
    scale, shift = np.ones(channels), np.zeros(channels)
    for op, k in steps:
        if channels % len(k):
            return None
        k = np.repeat(k, channels // len(k))
        if op == "relax.multiply":
            scale, shift = scale * k, shift * k
        else:
            shift = shift + k
    rows = (1, int(np.prod(xs[1:-1])), channels)
    args = (relax.op.reshape(x, rows), relax.const(scale.astype("float32")),
            relax.const(shift.astype("float32")))
    eps = float(ln.attrs.epsilon)
    if groups == channels:
        y = relax.op.nn.instance_norm(*args, channel_axis=2, axes=[1], epsilon=eps)
    else:
        y = relax.op.nn.group_norm(*args, num_groups=groups, channel_axis=2, axes=[1],
                                   epsilon=eps)
    return (y if act is None else relax.Call(tvm.ir.Op.get(act), [y])), xs


#: Ops a chain can end in (:func:`_chain` walks back through them).
_CHAIN_OPS = ("relax.reshape", "relax.multiply", "relax.add", *PLAIN_ACTIVATIONS)


def _open_chain_ends(func: relax.Function, b: dict) -> list[relax.Expr]:
    """The values that end a matched chain and are read by something other than the
    transpose back to channels-last and than a longer chain (BiT's last norm, the model's
    output): each is rewritten as the channels-last norm transposed to channels-first,
    which the layout pass then sinks as far as it goes."""
    readers: dict[relax.Var, list[relax.Call]] = {}
    for value in b.values():
        if isinstance(value, relax.Call):
            for arg in value.args:
                if isinstance(arg, relax.Var):
                    readers.setdefault(arg, []).append(value)
    ends, reads = [], use_counts(func)
    for var, value in b.items():
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name in _CHAIN_OPS and reads[var]):
            continue
        shape = static_shape(value)
        if shape is None or len(shape) not in _TO_CHANNELS_FIRST or \
                any(_chain(r, b) is not None or (isinstance(r.op, tvm.ir.Op) and
                                                r.op.name == "relax.permute_dims")
                    for r in readers.get(var, [])):
            continue
        found = _channels_last_norm(value, b)
        # (a norm of another rank, DaViT's channel attention reshaped around one, is not
        # this chain's end)
        if found is not None and len(found[1]) == len(shape) and list(shape) == [
                found[1][i] for i in _TO_CHANNELS_FIRST[len(shape)]]:
            ends.append(value)
    return ends


def channels_last_instance_norm(func: relax.Function) -> relax.Function:
    """Rewrite each matched chain (module doc) ending in the transpose into a channels-last
    convolution (:func:`_channels_first_value`), then those read by other ops
    (:func:`_open_chain_ends`)."""
    b = bindings(func)
    pattern = is_op("relax.permute_dims")(wildcard())

    def rewriter(orig: relax.Call, m: dict) -> relax.Expr:
        v = _channels_first_value(m[pattern], b)
        found = None if v is None else _channels_last_norm(v, b)
        return orig if found is None else relax.op.reshape(found[0], static_shape(orig))

    func = rewrite_call(pattern, rewriter, func)
    b = bindings(func)
    ends = _open_chain_ends(func, b)
    if not ends:
        return func
    any_op = None
    for op in _CHAIN_OPS:
        call = is_op(op)(*(wildcard() for _ in range(1 if op in PLAIN_ACTIVATIONS else 2)))
        any_op = call if any_op is None else any_op | call

    def end_rewriter(orig: relax.Call, _m: dict) -> relax.Expr:
        if not any(structural_equal(orig, e) for e in ends):
            return orig
        y, xs = _channels_last_norm(orig, b)
        return relax.op.permute_dims(relax.op.reshape(y, xs), _TO_CHANNELS_FIRST[len(xs)])

    return rewrite_call(any_op, end_rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tpp.ChannelsLastInstanceNorm")
def ChannelsLastInstanceNorm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """:func:`channels_last_instance_norm` on every Relax function."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = channels_last_instance_norm(func)
    return mod
