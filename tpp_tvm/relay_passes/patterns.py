"""The TPP pattern table: which Relax subgraphs become one TPP kernel.

Patterns are data (name, dataflow pattern, check, lowering and its parameters), as in TVM's
``relax/backend/patterns.py``: adding a fused subgraph is one entry here plus, for a new
kernel family, one ``KernelFamily`` in ``families/``. Names read
``tpp.<kernel>[_bias][_<activation>][_residual]`` and are for people (reports, kernel
names): nothing parses them back; what a lowering needs is a field of the entry. The order
of the table is the matching priority (the most fused variant first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from ..intrinsics.epilogue import Epilogue
from ..intrinsics.spec import LEAKY_RELU_SLOPE, POOL_DTYPES, QUICK_GELU_SCALE
from ..schedules.expand_depthwise import fusion_pays
from .exprs import scalar_value

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
#: (HardSwish's own keys: in :func:`_any_activation` every alternative annotates one dict.)
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


@dataclass(frozen=True)
class TPPPattern:
    """One fusable subgraph: a name, its dataflow pattern, a check on the match, and what
    lowers it (``lowering``, the name of a kernel family in ``families.FAMILIES``, with its
    parameters)."""

    name: str
    pattern: DFPattern
    annotations: dict[str, DFPattern]
    check: Callable[[relax.transform.PatternCheckContext], bool]
    lowering: str
    epilogue: Epilogue = Epilogue()  # the fused steps after the kernel's core
    scale_multiplies: bool = False  # attention: scores * c (True) or scores / c

    def as_fusion_pattern(self) -> tuple:
        check = self.check
        return (self.name, self.pattern, self.annotations,
                lambda ctx: _no_escape(ctx) and check(ctx))


def _no_escape(ctx: relax.transform.PatternCheckContext) -> bool:
    """Only the match's result is used outside it. A training graph reuses forward
    intermediates (a pre-activation, softmax probabilities) in its backward; fusing over
    them would make a multi-output composite that no single TPP kernel computes."""
    inside = set(ctx.matched_bindings.keys())
    root = ctx.value_to_bound_var.get(ctx.matched_expr)
    for var in inside:
        if root is not None and var.same_as(root):
            continue
        if any(user not in inside for user in ctx.var_usages.get(var, [])):
            return False
    return True


def _static_f32(expr: relax.Expr) -> bool:
    return _static_tensor(expr, ("float32",))


def _static_tensor(expr: relax.Expr, dtypes: tuple[str, ...]) -> bool:
    """Whether ``expr`` is a tensor of one of ``dtypes`` with a static shape."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.dtype not in dtypes:
        return False
    shape = ty.shape
    return shape is not None and all(isinstance(d, tvm.tirx.IntImm) for d in shape.values)


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
    if not _static_f32(a["lhs"]) or len(a["lhs"].ty.shape.values) != 4:
        return False
    if any(int(d) != 1 for d in attrs.dilation):
        return False
    groups = int(attrs.groups)
    if groups != 1 and not (
            isinstance(a["weight"], tvm.ir.GenericConst) and _static_f32(a["lhs"])
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
    if int(attrs.strides[0]) != int(attrs.strides[1]) or not _static_f32(a["lhs"]):
        return False
    c = int(a["lhs"].ty.shape.values[3])
    r, s, i, o = (int(d) for d in a["weight"].ty.shape.values)
    if int(attrs.groups) != c or c < 2 or i != 1 or o % c or r * s < 2:
        return False  # (one channel: groups 1, an ordinary convolution)
    return _epilogue_check(a, o)


def _epilogue_check(a: dict, n: int) -> bool:
    """Bias is a constant row of width n; the residual is fp32 shaped like the output."""
    if not (_static_f32(a["lhs"]) and _static_f32(a["weight"])) or not activation_constants_hold(a):
        return False
    if "bias" in a:
        bias = a["bias"]
        shape = [int(d) for d in bias.ty.shape.values] if _static_f32(bias) else None
        # A rank-0 bias (Gemm's scalar C) is left to TVM: the kernels take a row of n.
        if not shape or shape[-1] != n or any(d != 1 for d in shape[:-1]):
            return False
    if "gate" in a:
        out_shape = [int(d) for d in a["root"].ty.shape.values]
        if not _static_f32(a["gate"]) or [int(d) for d in a["gate"].ty.shape.values] != out_shape:
            return False
    if "residual" in a:
        if not _static_f32(a["residual"]):
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
    if not _static_f32(weight) or len(weight.ty.shape.values) != 2:
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
    if not (_conv_check(ctx) and _static_f32(scale)) or str(attrs.kernel_layout) != "HWIO":
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


def _any_activation(x: DFPattern, ann: dict, key: str) -> DFPattern:
    """Any activation of :data:`RELAX_ACTIVATIONS` applied to ``x``, annotated as ``key`` (which
    one is read back from the match: :func:`matched_activation`)."""
    alternatives = [activation_pattern(op, x, ann, key) for op in RELAX_ACTIVATIONS]
    out = alternatives[0]
    for alt in alternatives[1:]:
        out = out | alt
    ann[key] = out
    return out


def matched_activation(matched: dict, key: str) -> str:
    """The unary TPP the activation annotated ``key`` by :func:`_any_activation` computes
    (a composite one is told by which of its constants matched)."""
    for suffix, op in (("_shift", "hardswish"), ("_scale", "quick_gelu"), ("_lo", "relu6")):
        if key + suffix in matched:
            return op
    return RELAX_ACTIVATIONS[matched[key].op.name]


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
    if not (_static_f32(a["expand_lhs"]) and _static_f32(weight) and _static_f32(bias)):
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
        lhs = _any_activation(is_op("relax.add")(expand, b1), ann, "expand_act")
        weight, bias = is_const(), is_const()
        root = is_op("relax.nn.conv2d")(lhs, weight)
        ann.update(lhs=lhs, weight=weight, root=root, bias=bias)
        result = is_op("relax.add")(root, bias)
        if with_activation:
            result = _any_activation(result, ann, "act")
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
    if not (_static_f32(lhs) and _static_f32(rhs)):
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
    if not (_static_f32(lhs) and _static_f32(rhs)) or len(rhs.ty.shape.values) != 2:
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
        if not _static_f32(bias) or [int(d) for d in bias.ty.shape.values] != [n]:
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
    if not _static_f32(dy) or len(dy.ty.shape.values) < 2:
        return False
    shape = [int(d) for d in dy.ty.shape.values]
    return [int(d) for d in root.ty.shape.values] == shape[-1:]


def col_sum_pattern() -> TPPPattern:
    """The gradient of a bias add: dY summed over all rows (reduce TPPs over columns)."""
    dy = wildcard()
    out = is_op("relax.collapse_sum_to")(dy, wildcard())
    return TPPPattern("tpp.col_sum", out, {"lhs": dy, "root": out}, _col_sum_check,
                      "col_sum")


def _last_axis_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """Row-wise ops over the last axis of a static fp32 tensor (gamma/beta rows of H)."""
    a = ctx.annotated_expr
    x, call = a["lhs"], a["root"]
    if not _static_f32(x):
        return False
    ndim = len(x.ty.shape.values)
    attrs = call.attrs
    if hasattr(attrs, "axes"):  # layer norm
        if [int(ax) % ndim for ax in attrs.axes] != [ndim - 1]:
            return False
        if not (attrs.center and attrs.scale):
            return False
        width = int(x.ty.shape.values[-1])
        return all(_static_f32(a[k]) and [int(d) for d in a[k].ty.shape.values] == [width]
                   for k in ("gamma", "beta"))
    return int(attrs.axis) % ndim == ndim - 1


def _rms_norm_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """RMS norm over the last axis of a static fp32 tensor with a gamma row of H."""
    a = ctx.annotated_expr
    x = a["lhs"]
    if not (_static_f32(x) and _static_f32(a["gamma"])):
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
    if not _static_f32(x) or not isinstance(a["gamma"], tvm.ir.Constant) \
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
    if not _static_f32(x) or not activation_constants_hold(a):
        return False
    xs = [int(d) for d in x.ty.shape.values]
    if len(xs) < 2 or xs[-1] < 2 or int(np.prod(xs[:-1])) < 2:
        return False
    if "operand" in a:
        y = a["operand"]
        if not _static_f32(y):
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


def _pool_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """NHWC pooling on a static fp32 tensor: max pooling without dilation (also of u8/s8:
    a quantized model's activations; ceil mode too), or a mean over the two spatial axes."""
    a = ctx.annotated_expr
    x, call = a["lhs"], a["root"]
    attrs = call.attrs
    dtypes = POOL_DTYPES if hasattr(attrs, "pool_size") else ("float32",)
    if not _static_tensor(x, dtypes) or len(x.ty.shape.values) != 4:
        return False
    if hasattr(attrs, "pool_size"):
        return (str(attrs.layout) == "NHWC" and str(attrs.out_layout) in ("NHWC", "")
                and all(int(d) == 1 for d in attrs.dilation)
                and int(attrs.strides[0]) == int(attrs.strides[1]))
    axes = sorted(int(ax) % 4 for ax in attrs.axis) if attrs.axis is not None else []
    return axes == [1, 2]


def pool_patterns() -> list[TPPPattern]:
    """max_pool2d (NHWC) and global average pooling (mean over H, W of NHWC)."""
    x, y = wildcard(), wildcard()
    mp = is_op("relax.nn.max_pool2d")(x)
    mean = is_op("relax.mean")(y)
    return [
        TPPPattern("tpp.max_pool2d", mp, {"lhs": x, "root": mp}, _pool_check, "max_pool2d"),
        TPPPattern("tpp.global_avg_pool", mean, {"lhs": y, "root": mean}, _pool_check,
                   "global_avg_pool"),
    ]


def _grouped_check(a: dict, qs: tuple[int, ...], keys: int) -> bool:
    """K and V repeat each of their heads ``group`` times in a row (query head h reads K/V
    head h // group), only their heads, and Kᵀ swaps K's last two axes; K's head size is
    Q's, V's may differ. K and V have as many heads (the kernel reads both by one group)."""
    if [int(x) for x in a["k_permute"].attrs.axes] != [0, 1, 3, 2]:
        return False
    kv_heads = set()
    for key in ("k_grouped", "v_grouped"):
        src = a[key]
        if not _static_f32(src) or len(src.ty.shape.values) != 4:
            return False
        b, kvh, s, d = (int(x) for x in src.ty.shape.values)
        if [int(x) for x in a[key + "_expand"].attrs.axis] != [2]:
            return False
        if b != qs[0] or s != keys or (key == "k_grouped" and d != qs[-1]) or qs[1] % kvh:
            return False
        kv_heads.add(kvh)
    return len(kv_heads) == 1


def _attention_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """Q·Kᵀ·scale (+mask) → softmax(last axis) → ·V with static fp32 shapes; a mask is
    (batch or 1, heads or 1, queries or 1, keys), as padding, causal and ALiBi masks are."""
    a = ctx.annotated_expr
    q, kt, v, scale = a["q"], a["k_t"], a["v"], a["scale"]
    if not all(_static_f32(x) for x in (q, kt, v)):
        return False
    qs, ks, vs = (tuple(int(d) for d in x.ty.shape.values) for x in (q, kt, v))
    if len(qs) < 3 or not (len(qs) == len(ks) == len(vs)):
        return False
    if qs[:-2] != ks[:-2] or qs[:-2] != vs[:-2]:
        return False
    if qs[-1] != ks[-2] or ks[-1] != vs[-2]:
        return False
    if scale.value.numpy().size != 1:
        return False
    if "nan_guard" in a and scalar_value(a["nan_guard"]) != 0.0:
        return False
    if "k_grouped" in a and not _grouped_check(a, qs, ks[-1]):
        return False
    softmax = a["softmax"]
    if int(softmax.attrs.axis) % len(qs) != len(qs) - 1:
        return False
    if "mask" in a:
        mask = a["mask"]
        if not _static_f32(mask):
            return False
        ms = tuple(int(d) for d in mask.ty.shape.values)
        if len(ms) < 2 or len(ms) > len(qs) or ms[-1] != ks[-1] or ms[-2] not in (1, qs[-2]):
            return False
        if len(ms) == len(qs) and mask_rows_broadcast(ms[:-2], qs[:-2]):
            return True
        # A constant mask broadcast otherwise (Swin's relative position bias, one per head
        # for every window) is laid out per (batch·head) row at lowering, if not too big.
        lead = (1,) * (len(qs) - len(ms)) + ms[:-2]
        return (isinstance(mask, tvm.ir.Constant)
                and all(m in (1, q) for m, q in zip(lead, qs[:-2]))
                and 4 * int(np.prod(qs[:-2])) * ms[-2] * ms[-1] <= MAX_MATERIALIZED_MASK)
    return True


#: Largest attention mask (bytes) materialized per (batch·head) row from a broadcast.
MAX_MATERIALIZED_MASK = 16 * 1024 * 1024


def mask_rows_broadcast(mask_lead: tuple[int, ...], lead: tuple[int, ...]) -> bool:
    """Whether an attention mask's leading (batch, head) dims are a prefix of the scores'
    followed by ones: then (batch·head) row ``b`` reads mask row ``b // (rows / mask
    rows)`` (a mask per batch, per batch and head, or one for all)."""
    p = 0
    while p < len(lead) and mask_lead[p] == lead[p]:
        p += 1
    return all(d == 1 for d in mask_lead[p:])


def _repeated_heads(ann: dict, key: str) -> DFPattern:
    """transformers' ``repeat_kv`` of a (batch, kv heads, seq, dim) tensor annotated ``key``:
    ``reshape(broadcast_to(expand_dims(x, 2), (b, kvh, group, s, d)), (b, kvh*group, s, d))``."""
    x = wildcard()
    expand = is_op("relax.expand_dims")(x)
    ann[key], ann[key + "_expand"] = x, expand
    return is_op("relax.reshape")(is_op("relax.broadcast_to")(expand, wildcard()), wildcard())


def attention_patterns() -> list[TPPPattern]:
    """softmax(Q Kᵀ / c (+ mask)) V, with the scale as divide or multiply by a constant;
    optionally with the probabilities' NaNs zeroed (``where(isnan(p), 0, p)``: torch's SDPA
    export guards fully masked rows so), annotated ``nan_guard``; and optionally with K and V
    heads repeated for grouped-query attention (annotated ``k_grouped``/``v_grouped``: the
    kernel reads the shared heads in place)."""
    out = []
    for grouped, guarded in ((True, True), (True, False), (False, True), (False, False)):
        for scale_op in ("relax.divide", "relax.multiply"):
            for with_mask in (True, False):
                q, c = wildcard(), is_const()
                ann = {}
                if grouped:
                    kt = is_op("relax.permute_dims")(_repeated_heads(ann, "k_grouped"))
                    v = _repeated_heads(ann, "v_grouped")
                    ann["k_permute"] = kt
                else:
                    kt, v = wildcard(), wildcard()
                scores = is_op("relax.matmul")(q, kt)
                z = is_op(scale_op)(scores, c)
                ann |= {"q": q, "k_t": kt, "v": v, "scale": c, "root": scores}
                if with_mask:
                    m = wildcard()
                    z = is_op("relax.add")(z, m)
                    ann["mask"] = m
                sm = probs = is_op("relax.nn.softmax")(z)
                if guarded:
                    zero = is_const()
                    probs = is_op("relax.where")(is_op("relax.isnan")(sm), zero, sm)
                    ann["nan_guard"] = zero
                o = is_op("relax.matmul")(probs, v)
                ann.update({"softmax": sm, "out": o})
                name = "tpp.attention" + ("_mask" if with_mask else "")
                name += "" if scale_op == "relax.divide" else "_mulscale"
                name += ("_nanguard" if guarded else "") + ("_gqa" if grouped else "")
                out.append(TPPPattern(name, o, ann,
                                      _attention_check, "attention",
                                      scale_multiplies=scale_op == "relax.multiply"))
    return out


def pattern_table() -> list[TPPPattern]:
    """All TPP patterns in matching priority order."""
    table = attention_patterns()  # before bmm/softmax: it contains both
    table.extend(expand_depthwise_patterns())  # before either convolution alone
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
    table.append(runtime_weight_conv_pattern())
    table.append(bmm_pattern())
    table.extend(matmul_patterns())
    table.append(col_sum_pattern())
    table.extend(rowwise_patterns())
    table.extend(pool_patterns())
    table.extend(eltwise_patterns())  # last: contractions absorb their own epilogues first
    return table
