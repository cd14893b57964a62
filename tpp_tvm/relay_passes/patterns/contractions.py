"""Contractions: dense layers, convolutions (plain, grouped, depthwise, with a squeeze-excite
input scale, with a filter computed at run time), an expansion fused into the depthwise
convolution it feeds, matmuls and batched matmuls of activations, and a bias gradient's
column sums; each with its epilogue variants and the checks on a match."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from ...intrinsics.epilogue import Epilogue
from ...schedules.expand_depthwise import fusion_pays
from ..exprs import scalar_value
from .activations import (
    RELAX_ACTIVATIONS,
    activation_constants_hold,
    any_activation,
    epilogue_pattern,
)
from .base import TPPPattern, static_f32


def _conv_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """An NHWC 2D convolution we have kernels for (no dilation, square stride; grouped with
    more than one channel per group when the filter is a constant, fp32)."""
    a = ctx.annotated_expr
    call = a["root"]
    attrs = call.attrs
    if str(attrs.data_layout) != "NHWC" or str(attrs.out_layout) not in ("NHWC", ""):
        return False
    # The scaled-input entry's multiply matches either operand order, so ``lhs`` may be the
    # other factor, a scalar (MaxViT: a tensor times a scalar constant before a convolution).
    if not static_f32(a["lhs"]) or len(a["lhs"].ty.shape.values) != 4:
        return False
    if any(int(d) != 1 for d in attrs.dilation):
        return False
    groups = int(attrs.groups)
    if groups != 1 and not (
            isinstance(a["weight"], tvm.ir.GenericConst) and static_f32(a["lhs"])
            and int(a["lhs"].ty.shape.values[3]) // groups > 1):
        return False
    if int(attrs.strides[0]) != int(attrs.strides[1]):
        return False
    if str(attrs.kernel_layout) not in ("OIHW", "OHWI", "HWIO"):
        return False
    return _epilogue_check(a, int(a["weight"].ty.shape.values[str(attrs.kernel_layout).index("O")]))


def _depthwise_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """An NHWC depthwise convolution (one input channel a group, HWIO filters, any channel
    multiplier, the same dilation and stride on both axes, a window of 2 taps or more)."""
    a = ctx.annotated_expr
    attrs = a["root"].attrs
    if str(attrs.data_layout) != "NHWC" or str(attrs.out_layout) not in ("NHWC", ""):
        return False
    if str(attrs.kernel_layout) != "HWIO" or int(attrs.dilation[0]) != int(attrs.dilation[1]):
        return False
    if int(attrs.strides[0]) != int(attrs.strides[1]) or not static_f32(a["lhs"]):
        return False
    c = int(a["lhs"].ty.shape.values[3])
    r, s, i, o = (int(d) for d in a["weight"].ty.shape.values)
    if int(attrs.groups) != c or c < 2 or i != 1 or o % c or r * s < 2:
        return False  # (one channel: groups 1, an ordinary convolution)
    return _epilogue_check(a, o)


def _epilogue_check(a: dict, n: int) -> bool:
    """Bias is a constant row of width n; the residual is fp32 shaped like the output."""
    if not (static_f32(a["lhs"]) and static_f32(a["weight"])) or not activation_constants_hold(a):
        return False
    if "bias" in a:
        bias = a["bias"]
        shape = [int(d) for d in bias.ty.shape.values] if static_f32(bias) else None
        # A rank-0 bias (Gemm's scalar C) is left to TVM: the kernels take a row of n.
        if not shape or shape[-1] != n or any(d != 1 for d in shape[:-1]):
            return False
    if "gate" in a:
        out_shape = [int(d) for d in a["root"].ty.shape.values]
        if not static_f32(a["gate"]) or [int(d) for d in a["gate"].ty.shape.values] != out_shape:
            return False
    if "residual" in a:
        if not static_f32(a["residual"]):
            return False
        if "bias" not in a and isinstance(a["residual"], tvm.ir.Constant):
            # A constant shaped like a 1x1 output (squeeze-excite's convolutions) is the
            # bias: as a "residual" it blocked the bias + activation entries that follow.
            return False
        out_shape = [int(d) for d in a["root"].ty.shape.values]
        if [int(d) for d in a["residual"].ty.shape.values] != out_shape:
            return False
    return True


def _dense_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A dense layer we have kernels for: fp32, static shapes, weight a 2D constant."""
    a = ctx.annotated_expr
    weight = a["weight"]
    if not static_f32(weight) or len(weight.ty.shape.values) != 2:
        return False
    return _epilogue_check(a, int(weight.ty.shape.values[1]))


_ROOTS = {
    "tpp.dense": ("relax.matmul", _dense_check),
    "tpp.conv2d": ("relax.nn.conv2d", _conv_check),
    "tpp.depthwise_conv2d": ("relax.nn.conv2d", _depthwise_check),
}


def _scaled_input_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A pointwise NHWC convolution of ``x * s``, s a channel row (1, 1, 1, C): the
    squeeze-excite scale the GEMM applies to its rows of A as it reads them."""
    a = ctx.annotated_expr
    attrs, scale = a["root"].attrs, a["lhs_scale"]
    if not (_conv_check(ctx) and static_f32(scale)) or str(attrs.kernel_layout) != "HWIO":
        return False
    r, s_, c, _ = (int(d) for d in a["weight"].ty.shape.values)
    if (r, s_, int(attrs.strides[0])) != (1, 1, 1) or any(int(p) for p in attrs.padding):
        return False
    shape = [int(d) for d in scale.ty.shape.values]
    return len(shape) == 4 and shape[-1] == c and all(d == 1 for d in shape[:-1])


def contraction_pattern(kind: str, bias: bool, activation: str | None, residual: bool,
                        post_activation: str | None = None, scaled_input: bool = False,
                        gate: bool = False) -> TPPPattern:
    """``<contraction>(x, W const)`` (+ bias const) (+ act) (x gate) (+ residual) (+ act);
    with ``scaled_input`` (pointwise convolutions) the contraction reads ``x * s``, s a
    channel row annotated ``lhs_scale``. A gate is a tensor shaped like the output that the
    result multiplies: SwiGLU's up projection times the activated gate projection."""
    op, check = _ROOTS[kind]
    lhs, weight = wildcard(), is_const()
    ann = {"lhs": lhs, "weight": weight}
    name = kind
    if scaled_input:
        scale = ann["lhs_scale"] = wildcard()
        out = is_op(op)(is_op("relax.multiply")(lhs, scale)
                        | is_op("relax.multiply")(scale, lhs), weight)
        name += "_scaled_input"
        check = _scaled_input_check
    else:
        out = is_op(op)(lhs, weight)
    ann["root"] = out
    epilogue = Epilogue(bias, RELAX_ACTIVATIONS.get(activation), gate, residual,
                        RELAX_ACTIVATIONS.get(post_activation))
    out = ann["out"] = epilogue_pattern(out, epilogue, ann)
    return TPPPattern(name + epilogue.suffix, out, ann, check, kind.removeprefix("tpp."),
                      epilogue)


def _expansion_check(a: dict, out_channels: int) -> bool:
    """The expansion of :func:`expand_depthwise_patterns`: an NHWC convolution (1x1, or any
    window with a square stride: a stem) of fp32 activations by a constant filter into
    ``out_channels``, not grouped or dilated, its bias a constant row and its activation's
    bounds (ReLU6) exact."""
    call, weight, bias = a["expand_root"], a["expand_weight"], a["expand_bias"]
    attrs = call.attrs
    layout = str(attrs.kernel_layout)
    if str(attrs.data_layout) != "NHWC" or str(attrs.out_layout) not in ("NHWC", ""):
        return False
    if layout not in ("OIHW", "OHWI", "HWIO") or int(attrs.groups) != 1:
        return False
    if not (static_f32(a["expand_lhs"]) and static_f32(weight) and static_f32(bias)):
        return False
    if [int(d) for d in weight.ty.shape.values][layout.index("O")] != out_channels:
        return False
    if any(int(d) != 1 for d in attrs.dilation) or int(attrs.strides[0]) != int(
            attrs.strides[1]):
        return False
    *lead, width = [int(d) for d in bias.ty.shape.values] or [0]
    if width != out_channels or any(d != 1 for d in lead):
        return False
    lo, hi = a.get("expand_act_lo"), a.get("expand_act_hi")
    return lo is None or [scalar_value(lo), scalar_value(hi)] == [0.0, 6.0]


def _expand_depthwise_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A depthwise convolution whose input is an expansion, fused where the expanded tensor
    would leave the L2 (``fusion_pays``); elsewhere the two kernels take the pair."""
    a = ctx.annotated_expr
    if not _depthwise_check(ctx) or int(a["root"].attrs.dilation[0]) != 1:
        return False  # (the fused kernel's ring of expanded rows takes no dilation)
    n, h, w, c = (int(d) for d in a["lhs"].ty.shape.values)
    return _expansion_check(a, c) and fusion_pays(n, h, w, c)


def expand_depthwise_patterns() -> list[TPPPattern]:
    """An inverted residual block's expansion (or a stem) and depthwise convolution, one
    kernel (``schedules/expand_depthwise.py``): ``act(conv(x, W) + b)`` into ``conv_dw(·,
    Wd) + bd``, then an activation or none. Both convolutions carry their (batch-norm folded)
    bias; the activations are any of :data:`RELAX_ACTIVATIONS`, read back from the match."""
    out = []
    for with_activation in (True, False):
        x, w1, b1 = wildcard(), is_const(), is_const()
        ann = {"expand_lhs": x, "expand_weight": w1, "expand_bias": b1}
        expand = ann["expand_root"] = is_op("relax.nn.conv2d")(x, w1)
        lhs = any_activation(is_op("relax.add")(expand, b1), ann, "expand_act")
        weight, bias = is_const(), is_const()
        root = is_op("relax.nn.conv2d")(lhs, weight)
        ann.update(lhs=lhs, weight=weight, root=root, bias=bias)
        result = is_op("relax.add")(root, bias)
        if with_activation:
            result = any_activation(result, ann, "act")
        ann["out"] = result
        name = "tpp.expand_depthwise_conv2d_bias" + ("_act" if with_activation else "")
        out.append(TPPPattern(name, result, ann, _expand_depthwise_check,
                              "expand_depthwise_conv2d"))
    return out


def runtime_weight_conv_pattern() -> TPPPattern:
    """``conv2d(x, W)`` with W computed at run time: a trained filter, or a weight-gradient
    convolution whose "filter" is dY. The filter is packed per call (``families/conv.py``)."""
    lhs, weight = wildcard(), wildcard()
    out = is_op("relax.nn.conv2d")(lhs, weight)
    return TPPPattern("tpp.conv2d_runtime_weight", out,
                      {"lhs": lhs, "weight": weight, "root": out, "out": out}, _conv_check,
                      "conv2d")


def _bmm_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A batched matmul of two activations with the same static batch dims (attention)."""
    a = ctx.annotated_expr
    lhs, rhs = a["lhs"], a["rhs"]
    if not (static_f32(lhs) and static_f32(rhs)):
        return False
    ls, rs = lhs.ty.shape.values, rhs.ty.shape.values
    if len(ls) < 3 or len(ls) != len(rs):
        return False
    return [int(d) for d in ls[:-2]] == [int(d) for d in rs[:-2]]


def bmm_pattern() -> TPPPattern:
    """``matmul(x, y)`` of two activations: one BRGEMM-based kernel per batch entry."""
    lhs, rhs = wildcard(), wildcard()
    out = is_op("relax.matmul")(lhs, rhs)
    return TPPPattern("tpp.bmm", out, {"lhs": lhs, "rhs": rhs, "root": out}, _bmm_check, "bmm")


def _matmul_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """A matmul of two activations (a training step's weights are inputs): fp32, static, B
    2D; a transposed operand is a 2D ``permute_dims(.., [1, 0])``; a bias is a row of N."""
    a = ctx.annotated_expr
    lhs, rhs = a["lhs"], a["rhs"]
    if not (static_f32(lhs) and static_f32(rhs)) or len(rhs.ty.shape.values) != 2:
        return False
    if not activation_constants_hold(a):
        return False
    for key in ("lhs_t", "rhs_t"):
        if key in a:
            t = a[key]
            if len(t.ty.shape.values) != 2 or [int(x) for x in t.attrs.axes] != [1, 0]:
                return False
    if len(lhs.ty.shape.values) < 2:
        return False
    n = int(a["root"].ty.shape.values[-1])
    if "bias" in a:
        bias = a["bias"]
        if not static_f32(bias) or [int(d) for d in bias.ty.shape.values] != [n]:
            return False
    return True


def matmul_patterns() -> list[TPPPattern]:
    """``matmul(A or Aᵀ, B or Bᵀ)`` (+ bias row) (+ act) of activations: the forward and
    backward GEMMs of training (dX = dY Wᵀ, dW = Xᵀ dY)."""
    table = []
    for ta, tb in ((True, False), (False, True), (False, False)):  # transposes first
        for bias, activation in [(True, act) for act in (*RELAX_ACTIVATIONS, None)] \
                + [(False, None)]:
            lhs, rhs = wildcard(), wildcard()
            ann = {"lhs": lhs, "rhs": rhs}
            a, b = lhs, rhs
            if ta:
                a = ann["lhs_t"] = is_op("relax.permute_dims")(lhs)
            if tb:
                b = ann["rhs_t"] = is_op("relax.permute_dims")(rhs)
            out = ann["root"] = is_op("relax.matmul")(a, b)
            name = "tpp.matmul" + ("_ta" if ta else "") + ("_tb" if tb else "")
            epilogue = Epilogue(bias, RELAX_ACTIVATIONS.get(activation))
            out = ann["out"] = epilogue_pattern(out, epilogue, ann, bias=wildcard())
            table.append(TPPPattern(name + epilogue.suffix, out, ann, _matmul_check, "matmul",
                                    epilogue))
    return table


def _col_sum_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """``collapse_sum_to(dY, (N,))`` of a static fp32 dY (..., N): a bias gradient."""
    a = ctx.annotated_expr
    dy, root = a["lhs"], a["root"]
    if not static_f32(dy) or len(dy.ty.shape.values) < 2:
        return False
    shape = [int(d) for d in dy.ty.shape.values]
    return [int(d) for d in root.ty.shape.values] == shape[-1:]


def col_sum_pattern() -> TPPPattern:
    """The gradient of a bias add: dY summed over all rows (reduce TPPs over columns)."""
    dy = wildcard()
    out = is_op("relax.collapse_sum_to")(dy, wildcard())
    return TPPPattern("tpp.col_sum", out, {"lhs": dy, "root": out}, _col_sum_check,
                      "col_sum")


def contraction_patterns() -> list[TPPPattern]:
    """Dense layers and convolutions with every epilogue, the most fused variant first:
    pointwise convolutions of a squeeze-excite scaled input, gated dense layers, then each
    contraction with a residual and ReLU after it, and with bias, activation and residual."""
    table = []
    # Squeeze-excite's channel scale read into the pointwise convolution after it (the
    # same variants, in the same order, as the plain contractions below).
    for bias in (True, False):
        table.append(contraction_pattern("tpp.conv2d", bias, None, True, "relax.nn.relu",
                                         scaled_input=True))
    for residual in (True, False):
        for activation in (*RELAX_ACTIVATIONS, None):
            for bias in (True, False):
                table.append(contraction_pattern("tpp.conv2d", bias, activation, residual,
                                                 scaled_input=True))
    for bias in (True, False):  # a gated dense layer (SwiGLU's up projection)
        table.append(contraction_pattern("tpp.dense", bias, None, False, gate=True))
    for kind in _ROOTS:
        for bias in (True, False):
            table.append(contraction_pattern(kind, bias, None, True, "relax.nn.relu"))
        for residual in (True, False):
            for activation in (*RELAX_ACTIVATIONS, None):
                for bias in (True, False):
                    table.append(contraction_pattern(kind, bias, activation, residual))
    return table
