"""Gradients of activations, softmax and layer norm as TPP-backed kernels.

Relax's ``Gradient`` pass writes each backward as Relax ops; for these operators TVM's forms
are chains of element-wise ops (relu: ``where(x < 0, 0, dy)``; softmax: four ops; layer norm
and GELU have none). Here each gradient is one kernel, the backward TPP's own computation
(``schedules/backward.py``) emitted with ``call_te`` on the tensor flattened to rows and
tagged ``tpp.backward``; the ``tpp`` pipeline swaps in its TPP schedule.

relu, tanh and sigmoid take S = the forward output (as torch does: relu's mask is Y > 0,
which equals X > 0 except at exactly 0); GELU takes the forward input. Importing this module
registers the gradients (relu/tanh/sigmoid/softmax at a level above TVM's own). A stride-1
convolution's input gradient becomes a convolution with the flipped filter, which the TPP
conv kernel runs (TVM's is a ``conv2d_transpose``, left to TVM's default path).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.op import _op_gradient
from tvm.relax.op.base import register_gradient

from ..errors import UnsupportedOperatorError
from ..schedules.backward import layer_norm_bwd_te, softmax_bwd_te, unary_bwd_te

#: forward op -> (backward TPP, whether S is the forward input (else the output)).
ACTIVATION_GRADIENTS = {
    "relax.nn.relu": ("relu_inv", False),
    "relax.nn.gelu": ("gelu_inv", True),
    "relax.tanh": ("tanh_inv", False),
    "relax.sigmoid": ("sigmoid_inv", False),
}


def _shape(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def _rows(expr: relax.Expr) -> tuple[int, int]:
    shape = _shape(expr)
    return int(np.prod(shape[:-1])), shape[-1]


def _flat(ctx: relax.BlockBuilder, expr: relax.Expr) -> relax.Expr:
    """``expr`` as (rows, width), bound to a variable (``call_te`` takes variables)."""
    shape = _shape(expr)
    if len(shape) == 2 and isinstance(expr, relax.Var):
        return expr
    return ctx.emit(relax.op.reshape(expr, _rows(expr)))


def _unary_gradient(op: str, use_input: bool):
    def gradient(orig_var, orig_call, output_grad, ctx):
        x = orig_call.args[0]
        s = x if use_input else orig_var
        out = ctx.call_te(lambda dy, sv: unary_bwd_te(dy, sv, op), _flat(ctx, output_grad),
                          _flat(ctx, s), primfunc_name_hint=op,
                          primfunc_attrs={"tpp.backward": op})
        return [relax.op.reshape(out, _shape(x))]

    return gradient


def _softmax_gradient(orig_var, orig_call, output_grad, ctx):
    ndim = len(_shape(orig_var))
    if int(orig_call.attrs.axis) % ndim != ndim - 1:
        return _op_gradient.softmax_grad(orig_var, orig_call, output_grad, ctx)
    out = ctx.call_te(softmax_bwd_te, _flat(ctx, orig_var), _flat(ctx, output_grad),
                      primfunc_name_hint="softmax_bwd",
                      primfunc_attrs={"tpp.backward": "softmax_bwd"})
    return [relax.op.reshape(out, _shape(orig_var))]


def _layer_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, gamma, _beta = orig_call.args
    attrs = orig_call.attrs
    ndim = len(_shape(x))
    if [int(a) % ndim for a in attrs.axes] != [ndim - 1] or not (attrs.center and attrs.scale):
        raise UnsupportedOperatorError(
            f"layer_norm gradient: normalising axes {list(attrs.axes)} of a {ndim}-D tensor "
            "(center/scale {attrs.center}/{attrs.scale}); supported: the last axis, with "
            "gamma and beta")
    eps = float(attrs.epsilon)
    call = ctx.emit(ctx.call_te(
        lambda xv, g, dy: layer_norm_bwd_te(xv, g, dy, eps), _flat(ctx, x), gamma,
        _flat(ctx, output_grad),
        primfunc_name_hint="layer_norm_bwd",
        primfunc_attrs={"tpp.backward": "layer_norm_bwd", "tpp.eps": eps}))
    return [relax.op.reshape(relax.TupleGetItem(call, 0), _shape(x)),
            relax.TupleGetItem(call, 1), relax.TupleGetItem(call, 2)]


def _conv2d_gradient(orig_var, orig_call, output_grad, ctx):
    """Stride-1 convolutions: dX as a convolution of dY with the flipped, transposed filter
    (which the TPP conv kernel runs), not ``conv2d_transpose``; dW as TVM's."""
    attrs = orig_call.attrs
    _, weight = orig_call.args
    data_grad, weight_grad = _op_gradient.conv2d_grad(orig_var, orig_call, output_grad, ctx)
    simple = (str(attrs.data_layout) == "NCHW" and str(attrs.kernel_layout) == "OIHW"
              and int(attrs.groups) == 1 and all(int(v) == 1 for v in attrs.strides)
              and all(int(v) == 1 for v in attrs.dilation))
    _, _, r, s = _shape(weight)
    top, left, bottom, right = (int(p) for p in attrs.padding)
    if not simple or max(top, bottom) > r - 1 or max(left, right) > s - 1:
        return [data_grad, weight_grad]
    flipped = relax.op.permute_dims(relax.op.flip(relax.op.flip(weight, 2), 3), [1, 0, 2, 3])
    data_grad = relax.op.nn.conv2d(output_grad, ctx.emit(flipped), strides=[1, 1],
                                   padding=[r - 1 - top, s - 1 - left, r - 1 - bottom,
                                            s - 1 - right])
    return [data_grad, weight_grad]


def _register() -> None:
    for op, (bwd, use_input) in ACTIVATION_GRADIENTS.items():
        register_gradient(op, _unary_gradient(bwd, use_input), level=11)
    register_gradient("relax.nn.softmax", _softmax_gradient, level=11)
    register_gradient("relax.nn.layer_norm", _layer_norm_gradient, level=11)
    register_gradient("relax.nn.conv2d", _conv2d_gradient, level=11)


_register()
