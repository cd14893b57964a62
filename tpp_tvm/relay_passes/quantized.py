"""Quantized matmuls and convolutions onto the int8 (u8 x s8 -> int32) TPP kernels.

ONNX quantized models reach Relax in two shapes (TVM's converter spells out the math):

* dynamic (``onnxruntime.quantization.quantize_dynamic``: DynamicQuantizeLinear +
  MatMulInteger / ConvInteger + Cast + Mul):
  ``float(op(int32(a_q) - int32(a_zp), int32(W_q))) * s``;
* QDQ (``quantize_static`` in QDQ format, and QLinearMatMul, which ``frontend.converters`` imports
  as dequantize -> matmul -> quantize): ``op(dequantize(a_q, s_a, z_a),
  dequantize(W_q, s_w, 0))``.

For a matmul both are ``C = (A_q - z_a) @ W_q * s_a * s_w[j]`` with a constant s8 weight of
zero point 0 (symmetric, as both tools quantize weights by default). That is one int8 GEMM
kernel with its dequantize epilogue: ``Y = float(A_q @ W_q) * S[j] + O[j]``,
``S = s_a * s_w`` and ``O = -z_a * colsum(W_q)[j] * S`` (a few tiny Relax ops compute S and O
from the run-time activation scale). A convolution is the same with the column sum taken
over the filter's (C, R, S) and the spatial padding filled with z_a, on the int8 conv
BRGEMM (NHWC inside the kernel). s8 activations are shifted to u8 (``+128``, zero point
too) because the VNNI/AMX dot products take u8 x s8. Anything else (weight zero points,
non-constant weights, blocked quantization, grouped or dilated convolutions) stays as it
is: in the QDQ form its weights dequantize to constants and it runs on the fp32 TPPs (the
report says so among its rewrites), in the integer form it is left to TVM and counted as a
fallback. Either is reported once per layer.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, rewrite_call, wildcard

from ..intrinsics.epilogue import Epilogue
from ..schedules.gemm_plan import int8_gemm_dtype
from ..schedules.reduce_all import LANES, reduce_all_schedule
from .exprs import bindings, const_value, dtype_of, shape_of
from .fake_quant import (
    drop_elementwise_fake_quantization,
    drop_fake_quantization,
    expose_folded_relus,
    quantize_before_max_pool,
)
from .int8_kernels import (
    INT8_KERNELS,
    Int8Emitter,
    Int8Epilogue,
    build_declared,
    conv_unsupported,
)
from .lower import as_relax_kernel
from .patterns import RELAX_ACTIVATIONS, activation_constants_hold, epilogue_pattern
from .report import LoweringReport
from .transposes import sink_transposes


def _quantized_residual(expr: relax.Expr, bound: dict[relax.Var, relax.Expr],
                        int8_kernels: AbstractSet[str]
                        ) -> tuple[relax.Expr, tuple[float, float]] | None:
    """(the u8/s8 tensor, (scale, zero point)) where ``expr`` is a per-tensor
    ``dequantize`` of one with constant positive scale that is worth adding as it is: an
    int8 layer computes the quantized value and only int8 layers read it (a ResNet block's
    input, or its shortcut's output), so adding it quantized leaves no fp32 copy of the
    stream at all. A transformer's residual (a LayerNorm output, or a sum a LayerNorm reads
    too) stays fp32: it is written in fp32 anyway, and its 8-bit copy only loses precision
    (BERT: 2.1e-2 -> 3.6e-2 from the fp32 model, as fast). ``int8_kernels``: the names of
    the int8 kernel functions emitted so far (:attr:`Int8Emitter.int8_kernels`)."""
    value = bound.get(expr, expr)
    if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.dequantize"):
        return None
    q, s, z = value.args
    scale, zero = const_value(s), const_value(z)
    if dtype_of(q) not in ("uint8", "int8") or scale is None or zero is None \
            or scale.size != 1 or zero.size != 1 or not float(scale.reshape(-1)[0]) > 0:
        return None
    source = bound.get(q, q)
    if not (isinstance(source, relax.Call) and getattr(source.op, "name", "") == "relax.quantize"
            and _int8_result(source.args[0], bound, int8_kernels)
            and _read_by_int8_layers(q, bound, int8_kernels)):
        return None
    return q, (float(scale.reshape(-1)[0]), float(zero.reshape(-1)[0]))


def _int8_result(expr: relax.Expr, bound: dict[relax.Var, relax.Expr],
                 int8_kernels: AbstractSet[str], depth: int = 4) -> bool:
    """Whether ``expr`` is what an int8 kernel's epilogue computes: a contraction (or a
    kernel made of one), plus a bias, plus a residual, through a ReLU."""
    value = bound.get(expr, expr)
    if not isinstance(value, relax.Call) or depth == 0:
        return False
    name = getattr(value.op, "name", "")
    if name in INT8_KERNELS:
        return True
    if name == "relax.call_tir":
        return value.args[0].name_hint in int8_kernels
    if name in ("relax.nn.relu", "relax.add"):
        return any(_int8_result(arg, bound, int8_kernels, depth - 1) for arg in value.args[:2])
    return False


#: Ops that only re-index a tensor (an int8 layer reads its input through them).
_VIEWS = ("relax.reshape", "relax.permute_dims", "relax.expand_dims")


def _read_by_int8_layers(q: relax.Expr, bound: dict[relax.Var, relax.Expr],
                         int8_kernels: AbstractSet[str]) -> bool:
    """Whether every reader of the quantized ``q`` is an int8 layer: an int8 kernel, or
    its dequantized value read only by contractions and residual adds."""
    def readers(var: relax.Expr) -> list[tuple[relax.Var, relax.Call]]:
        def args(call: relax.Call) -> list[relax.Expr]:
            return [f for a in call.args
                    for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
        return [(v, c) for v, c in bound.items() if isinstance(c, relax.Call)
                and any(a.same_as(var) for a in args(c))]

    for var, call in readers(q):
        name = getattr(call.op, "name", "")
        if name in _VIEWS:
            if not _read_by_int8_layers(var, bound, int8_kernels):
                return False
        elif name == "relax.call_tir":
            if call.args[0].name_hint not in int8_kernels:
                return False
        elif name == "relax.dequantize":
            if any(getattr(c.op, "name", "") not in (*INT8_KERNELS, "relax.add")
                   for _, c in readers(var)):
                return False
        else:
            return False
    return True


def _integer_pattern(op: str):
    """``float(op(int32(a_q) - a_zp, int32(W) - w_zp)) * scale``: MatMulInteger or
    ConvInteger (``frontend.converters``) followed by the dequantizing multiply."""
    a_q, a_zp, w, w_zp, scale = wildcard(), wildcard(), is_const(), is_const(), wildcard()
    a32 = is_op("relax.astype")(a_q)
    lhs = is_op("relax.subtract")(a32, is_op("relax.astype")(a_zp)) | a32
    w32 = is_op("relax.astype")(w)
    w_zp32 = is_op("relax.astype")(w_zp)
    w_zp_rows = is_op("relax.reshape")(w_zp32, wildcard())  # ConvInteger's per-channel zp
    rhs = is_op("relax.subtract")(w32, w_zp32 | w_zp_rows) | w32
    core = is_op(op)(lhs, rhs)
    root = is_op("relax.multiply")(is_op("relax.astype")(core), scale)
    return root, core, a_q, a_zp, w, w_zp, scale


def _qdq_pattern(op: str):
    """``op(dequantize(a_q, s_a, z_a), dequantize(W, s_w, z_w))``, W constant (for a
    matmul also transposed: a Gemm with transB, a linear layer)."""
    a_q, s_a, z_a = wildcard(), wildcard(), wildcard()
    w, s_w, z_w = is_const(), is_const(), is_const()
    dq_w = is_op("relax.dequantize")(w, s_w, z_w)
    w_t = is_op("relax.permute_dims")(dq_w)
    core = is_op(op)(is_op("relax.dequantize")(a_q, s_a, z_a), dq_w | w_t)
    return core, core, a_q, s_a, z_a, w, s_w, z_w, w_t, dq_w


def _bias_value(expr: relax.Expr, n: int, conv: bool = False,
                bound: dict[relax.Var, relax.Expr] | None = None) -> np.ndarray | None:
    """A constant bias of n channels (or a dequantized constant one, as QDQ writes it): a
    row for a matmul, ``(n,)`` or ``(1, n, 1, 1)`` for an NCHW convolution. ``bound``
    resolves variables to the values bound to them."""
    bound = bound or {}
    expr = bound.get(expr, expr)
    if conv and isinstance(expr, relax.Call) and expr.op.name == "relax.reshape":
        expr = bound.get(expr.args[0], expr.args[0])  # QDQ: reshape(dequantize(b_q), 4-D)
    if isinstance(expr, relax.Call) and expr.op.name == "relax.nn.relu":
        # a static-QDQ bias whose quantization clips at 0 (``expose_folded_relus``)
        inner = _bias_value(expr.args[0], n, conv, bound)
        return None if inner is None else np.maximum(inner, 0)
    value = const_value(expr)
    if value is None and isinstance(expr, relax.Call) and expr.op.name == "relax.dequantize":
        q, sc, zp = (const_value(a) for a in expr.args)
        if q is None or sc is None or zp is None:
            return None
        value = (q.astype(np.float64) - zp.astype(np.float64)) * sc.astype(np.float64)
    if value is None or value.size != n:
        return None
    if value.shape[-1:] != (n,) and not (conv and value.shape[:2] == (1, n)
                                         and value.size == n):
        return None
    return value.reshape(n).astype(np.float32)


@dataclass(frozen=True)
class _EpiloguePattern:
    """One fused-epilogue shape around a contraction pattern: its steps and the patterns of
    their operands (``patterns.epilogue_pattern``'s annotations)."""

    pattern: DFPattern
    steps: Epilogue
    ann: dict[str, DFPattern]

    def value(self, m, call: relax.Call, w: np.ndarray, bound: dict,
              int8_kernels: AbstractSet[str]) -> Int8Epilogue | None:
        """The epilogue a match stands for; None when its operands do not fit (a bias
        that is not a constant row, a residual of another shape, clip bounds not ReLU6's)."""
        constants = {key: m[p] for key, p in self.ann.items() if key.startswith(("act_",
                                                                                 "post_act_"))}
        if not activation_constants_hold(constants):
            return None
        conv = call.op.name != "relax.matmul"
        bias = None
        if self.steps.bias:
            bias = _bias_value(m[self.ann["bias"]], _out_channels(call, w), conv, bound)
            if bias is None:
                return None
        steps = replace(self.steps, bias=False)
        if not steps.residual:
            return Int8Epilogue(steps, bias)
        residual = m[self.ann["residual"]]
        if dtype_of(residual) != "float32" or shape_of(residual) != shape_of(m[self.pattern]):
            return None
        quantized = None if steps.activation is not None \
            or steps.post_activation not in (None, "relu") \
            else _quantized_residual(residual, bound, int8_kernels)
        if quantized is not None and not _grouped(call):
            return Int8Epilogue(replace(steps, residual_dtype=dtype_of(quantized[0])), bias,
                             quantized[0], quantized[1])
        return Int8Epilogue(steps, bias, residual)


def _with_epilogues(core: DFPattern) -> list[_EpiloguePattern]:
    """The fused-epilogue variants of ``core``, biggest first: ``relu(core + bias +
    residual)`` (a ResNet block's last convolution), ``act(core + bias)``, ``core + bias``,
    ``core``. Each is rewritten in its own pass, so a contraction followed by a bias and
    an activation becomes one kernel, not three. (ReLU6 is MobileNetV2's, from a QDQ range
    of [0, 6]: ``fake_quant``.)"""
    variants = [Epilogue(bias, residual=True, post_activation=post)
                for bias in (True, False) for post in ("relu", None)]
    variants += [Epilogue(True, activation) for activation in RELAX_ACTIVATIONS.values()]
    out = []
    for steps in [*variants, Epilogue(bias=True), Epilogue()]:
        ann: dict[str, DFPattern] = {}
        pattern = epilogue_pattern(core, steps, ann, bias=wildcard(), residual_either_side=True)
        out.append(_EpiloguePattern(pattern, steps, ann))
    return out


#: Quantized contractions: Relax op -> (report name of the integer form, of the QDQ form).
_QUANTIZED_CONTRACTIONS = {
    "relax.matmul": ("tpp.matmul_integer", "tpp.qdq_matmul"),
    "relax.nn.conv2d": ("tpp.conv_integer", "tpp.qdq_conv2d"),
    "relax.nn.conv1d": ("tpp.conv_integer", "tpp.qdq_conv1d"),
}


def _emit(emitter: Int8Emitter, call: relax.Call, a_q: relax.Expr, a_zp: relax.Expr,
          w: np.ndarray, scale: relax.Expr, name: str, epi: Int8Epilogue, qdq: bool
          ) -> relax.Expr | None:
    conv = call.op.name != "relax.matmul"
    why = emitter.unsupported(a_q, a_zp, w, scale, ndim=w.ndim if conv else 2) \
        or (conv_unsupported(call.attrs, w) if conv else None)
    if why:
        emitter.decline(call, why, qdq)
        return None
    if not conv:
        return emitter.int8_matmul(a_q, a_zp, w, scale, name, epi)
    attrs = call.attrs
    pad = [int(p) for p in attrs.padding]
    if w.ndim == 3:  # conv1d (wav2vec2's feature encoder): a conv2d over one row
        left, right = pad * 2 if len(pad) == 1 else pad
        n, c, width = shape_of(a_q)
        res = None if epi.residual is None else relax.op.expand_dims(epi.residual, 2)
        out = emitter.int8_conv2d(relax.op.expand_dims(a_q, 2), a_zp, w[:, :, None, :], scale,
                                  int(attrs.strides[0]), (0, left, 0, right),
                                  int(attrs.groups), name, replace(epi, residual=res),
                                  ([n, c, 1, width], dtype_of(a_q)))
        return relax.op.squeeze(out, [2])
    return emitter.int8_conv2d(a_q, a_zp, w, scale, int(attrs.strides[0]),
                               tuple(pad * 2 if len(pad) == 2 else pad), int(attrs.groups),
                               name, epi)


def _grouped(call: relax.Call) -> bool:
    return call.op.name != "relax.matmul" and int(call.attrs.groups) != 1


def _out_channels(call: relax.Call, w: np.ndarray) -> int:
    return w.shape[1] if call.op.name == "relax.matmul" else w.shape[0]


def rewrite_quantized_contractions(func: relax.Function, emitter: Int8Emitter) -> relax.Function:
    """Replace the dynamic and QDQ quantized matmuls and convolutions in ``func`` with
    int8 TPP kernels, a following constant bias, activation and residual add fused into
    the epilogue."""
    for op, (integer_name, qdq_name) in _QUANTIZED_CONTRACTIONS.items():
        func = _rewrite_integer(func, emitter, op, integer_name)
        func = _rewrite_qdq(func, emitter, op, qdq_name)
    return func


def _rewrite_integer(func: relax.Function, emitter: Int8Emitter, op: str, name: str
                     ) -> relax.Function:
    root, core, a_q, a_zp, w, w_zp, scale = _integer_pattern(op)

    def rewrite_with(variant: _EpiloguePattern, bound: dict):
        def rewrite(orig, m):
            wz = const_value(m[w_zp]) if w_zp in m else None
            if dtype_of(m[w]) != "int8":
                return orig
            if wz is not None and np.any(wz):
                emitter.decline(m[core], "weight zero point", in_fp32=False)
                return orig
            call, weight = m[core], const_value(m[w])
            epi = variant.value(m, call, weight, bound, emitter.int8_kernels)
            if epi is None:
                return orig
            zp = m[a_zp] if a_zp in m else relax.const(0, "int32")
            out = _emit(emitter, call, m[a_q], zp, weight, m[scale], name, epi, qdq=False)
            if out is None and variant.pattern is root and op != "relax.matmul":
                out = _integer_conv_in_fp32(call, m[a_q], zp, weight, m[scale])
                if out is not None:
                    emitter.in_fp32(call)
            return orig if out is None else out
        return rewrite

    for variant in _with_epilogues(root):  # bindings read once per pass, not per match
        func = rewrite_call(variant.pattern, rewrite_with(variant, bindings(func)), func)
    return func


def _integer_conv_in_fp32(call: relax.Call, a_q: relax.Expr, a_zp: relax.Expr, w: np.ndarray,
                          scale: relax.Expr) -> relax.Expr | None:
    """``float(conv(a_q - a_zp, W)) * scale`` (a ConvInteger no int8 kernel takes: the
    depthwise convolutions of MobileNetV2, EfficientNet and ConvNeXt) as the fp32
    convolution of the dequantized input with the weights as fp32 constants, which the fp32
    depthwise and grouped TPPs run, its bias and activation fused; the same sums, rounded
    in fp32. The scale goes onto the input: one value, or one per channel of a depthwise
    convolution (each output channel reads its input channel alone). None for other
    scales (left on TVM's integer code)."""
    size, shape = int(np.prod(shape_of(scale))), shape_of(a_q)
    groups = int(call.attrs.groups)
    if size != 1 and not (size == shape[1] == groups == w.shape[0]):
        return None
    x = relax.op.subtract(relax.op.astype(a_q, "float32"), relax.op.astype(a_zp, "float32"))
    s = scale if size == 1 else relax.op.reshape(scale, [1, shape[1]] + [1] * (len(shape) - 2))
    at = call.attrs
    conv = relax.op.nn.conv2d if w.ndim == 4 else relax.op.nn.conv1d
    return conv(relax.op.multiply(x, s), relax.const(w.astype("float32")), at.strides,
                at.padding, at.dilation, groups, at.data_layout, at.kernel_layout,
                at.out_layout, "float32")


def _rewrite_qdq(func: relax.Function, emitter: Int8Emitter, op: str, name: str
                 ) -> relax.Function:
    root, core, xq, s_a, z_a, wq, s_w, z_w, w_t, dq_w = _qdq_pattern(op)
    # the axis of W's per-channel scales that is the output channel: (K, N) / (O, I, H, W)
    out_axis = 1 if op == "relax.matmul" else 0

    def rewrite_with(variant: _EpiloguePattern, bound: dict):
        def rewrite(orig, m):
            if dtype_of(m[wq]) != "int8":
                return orig
            if np.any(const_value(m[z_w])) or shape_of(m[s_a]) not in ([], [1]):
                emitter.decline(m[core], "weight zero point", in_fp32=True)
                return orig
            w = const_value(m[wq])
            transposed = w_t in m
            if transposed:
                if op != "relax.matmul" or [int(a) for a in m[w_t].attrs.axes] != [1, 0]:
                    return orig
                w = np.ascontiguousarray(w.T)
            axis = int(m[dq_w].attrs.axis) % w.ndim
            if const_value(m[s_w]).size > 1 and axis != (1 - out_axis if transposed else out_axis):
                emitter.decline(m[core], "per-input-channel weight scales", in_fp32=True)
                return orig
            call = m[core]
            epi = variant.value(m, call, w, bound, emitter.int8_kernels)
            if epi is None:
                return orig
            s = emitter.bb.normalize(relax.op.multiply(m[s_a], m[s_w]))
            out = _emit(emitter, call, m[xq], m[z_a], w, s, name, epi, qdq=True)
            return orig if out is None else out
        return rewrite

    for variant in _with_epilogues(root):  # bindings read once per pass, not per match
        func = rewrite_call(variant.pattern, rewrite_with(variant, bindings(func)), func)
    return func


def split_full_reductions(func: relax.Function, bb: relax.BlockBuilder) -> relax.Function:
    """``max(x)`` / ``min(x)`` over a whole fp32 tensor (DynamicQuantizeLinear's range)
    through the vectorized partial-reduction kernel, then a 16-element reduction."""
    if not _calls(func, "relax.quantize"):
        return func
    x = wildcard()
    pattern = is_op("relax.max")(x) | is_op("relax.min")(x)

    def rewrite(orig, m):
        if dtype_of(m[x]) != "float32" or not shape_of(m[x]):
            return orig
        rank = len(shape_of(m[x]))
        # over every axis, however written (ConvertLayout spells out axis=None)
        if orig.attrs.axis is not None and \
                sorted(int(a) % rank for a in orig.attrs.axis) != list(range(rank)):
            return orig
        size = int(np.prod(shape_of(m[x])))
        if size < 64 * LANES:
            return orig
        op = "max" if orig.op.name == "relax.max" else "min"
        gv = bb.add_func(as_relax_kernel(reduce_all_schedule(size, op).mod["main"]),
                         f"tpp_reduce_all_{op}")
        flat = relax.op.reshape(m[x], (size,))
        part = relax.call_tir(gv, [flat], relax.TensorType((LANES,), "float32"))
        final = relax.op.max if op == "max" else relax.op.min
        return final(part, keepdims=bool(orig.attrs.keepdims))

    return rewrite_call(pattern, rewrite, func)


@relax.expr_functor.mutator
class _WidenIntegerContractions(relax.PyExprMutator):
    """Integer matmuls and convolutions (MatMulInteger, ConvInteger) as fp32 ones on the
    same integer values, cast back to int32: exact while the sums stay under 2^24 (u8 x s8
    products over K <= 514), fp32-rounded past it, as the fp32 model would be."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.widened = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = getattr(call.op, "name", "")
        if name not in ("relax.matmul", "relax.nn.conv2d") or not all(
                "int" in dtype_of(arg) for arg in call.args[:2]):
            return call
        a, b = (relax.op.astype(arg, "float32") for arg in call.args[:2])
        if name == "relax.matmul":
            wide = relax.op.matmul(a, b, out_dtype="float32")
        else:
            at = call.attrs
            wide = relax.op.nn.conv2d(a, b, at.strides, at.padding, at.dilation, at.groups,
                                      at.data_layout, at.kernel_layout, at.out_layout,
                                      "float32")
        self.widened += 1
        return relax.op.astype(wide, dtype_of(call))


def _integer_contractions_in_fp32(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """``mod`` with :class:`_WidenIntegerContractions` applied; how many it widened."""
    mutator = _WidenIntegerContractions(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get(), mutator.widened


def _calls(func: relax.Function, op: str) -> bool:
    """Whether ``func`` calls the Relax operator ``op``."""
    found = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == op:
            found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="tpp.SplitFullReductions")
def SplitFullReductions(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass name
    """:func:`split_full_reductions` in every Relax function of a model that quantizes at
    run time; after the layout passes, so the layout transposes have been sunk through the
    reductions (a reshape into the reduction kernel's rows stopped them: MobileNetV2's
    dynamically quantized depthwise layers kept a transpose each)."""
    bb = relax.BlockBuilder(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            bb.update_func(gv, split_full_reductions(func, bb))
    return bb.get()


def _quantizes(mod: tvm.IRModule) -> bool:
    """Whether any Relax function of ``mod`` dequantizes (a quantized model)."""
    return any(isinstance(func, relax.Function) and _calls(func, "relax.dequantize")
               for func in mod.functions.values())


def lower_quantized(mod: tvm.IRModule, isa: str, report: LoweringReport, threads: int = 1,
                    target: tvm.target.Target | None = None) -> tvm.IRModule:
    """Apply :func:`rewrite_quantized_contractions` to every Relax function; add the
    kernels (AMX tile GEMMs: one task per thread of ``threads``; s16 kernels on AVX2 and on
    ``target`` CPUs without VNNI). On an ISA without integer dot products no int8 kernel is
    made: QDQ models' dequantized
    weights fold to constants, integer matmuls/convolutions are widened to fp32 ones, and
    all of them run on fp32 TPPs (reported)."""
    dtype = int8_gemm_dtype(isa, target)
    if dtype is None:
        mod, widened = _integer_contractions_in_fp32(mod)
        if widened or _quantizes(mod):
            report.rewrites[f"int8 layers run on fp32 TPPs (dequantized weights): the {isa} "
                            "target has no int8 dot product"] += 1
        return mod
    bb = relax.BlockBuilder(mod)
    emitter = Int8Emitter(bb, isa, report, threads, dtype)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            func = drop_elementwise_fake_quantization(expose_folded_relus(func, report),
                                                      report)
            func = rewrite_quantized_contractions(quantize_before_max_pool(func, report),
                                                  emitter)
            if emitter.kernels:  # a quantized model: its fake quantization
                func = sink_transposes(drop_fake_quantization(func, report))
            bb.update_func(gv, func)
    emitter.report_declined()
    if not emitter.kernels:
        return bb.get() if emitter.fp32_rewrites else mod
    # An int8 layer whose readers all quantize its output alike writes the quantized u8/s8.
    return build_declared(bb.get(), emitter, report)
