"""Lower TPP composite functions to ``call_tir`` of TPP-scheduled PrimFuncs.

``FuseOpsByPattern`` groups each matched subgraph into a private function tagged
``Composite="tpp.<pattern>"``. This pass replaces every call of such a function with a
call of a PrimFunc scheduled onto TPPs (BRGEMM microkernel + epilogue TPPs), packing
constant weights into the kernel's layout once, at compile time. A composite whose
lowering declines (shape or dtype it has no kernel for) is inlined back as plain Relax
ops, so TVM's default path computes it: never a wrong result, and the report says why.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import tvm
from tvm import relax
from tvm.relax.analysis import get_var2val

from ..errors import UnsupportedDTypeError
from ..intrinsics.epilogue import Epilogue
from ..kernels import numpy_dtype, pack_b_numpy
from ..schedules.attention import (
    AttentionShape,
    attention_schedule,
    attention_tile_schedule,
    padded_keys,
    padded_query_rows,
    query_block_rows,
    tile_query_rows,
)
from ..schedules.backward import backward_schedule, col_sum_schedule
from ..schedules.conv import (
    ConvShape,
    conv_input_schedule,
    conv_schedule,
    pack_filter,
    padded_input_shape,
)
from ..schedules.depthwise import depthwise_conv_schedule
from ..schedules.expand_depthwise import (
    expand_depthwise_schedule,
    pack_expand_filter,
    plan_expand_depthwise,
)
from ..schedules.gemm import bf16_a_schedule, gemm_schedule
from ..schedules.gemm_plan import register_tile_isa, runs_on_tiles, vector_unit
from ..schedules.instance_norm import instance_norm_apply_schedule, instance_norm_stats_schedule
from ..schedules.pool import PoolShape, global_avg_pool_schedule, max_pool_schedule
from ..schedules.rowwise import (
    equation_schedule,
    layer_norm_schedule,
    padded_rows,
    rms_norm_schedule,
    softmax_schedule,
)
from ..schedules.winograd import pack_winograd_filter, winograd_applies, winograd_schedule
from .lowp_activations import LowpOffers, lowp_activations, report_narrowed
from .patterns import TPPPattern, mask_rows_broadcast, matched_activation, pattern_table
from .report import KernelRow, LoweringReport, unit_of
from .tuned import composite_kernel, emit_tuned

log = logging.getLogger(__name__)


#: Graph precisions: ``float32``, or ``bfloat16`` for matmuls (bf16 operands, fp32
#: accumulation; activations fp32 between ops, bf16 from one bf16 layer to the next).
PRECISIONS = ("float32", "bfloat16")


def check_precision(precision: str) -> str:
    """The canonical precision name (``bf16`` is accepted for ``bfloat16``)."""
    name = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32"}.get(precision, precision)
    if name not in PRECISIONS:
        raise UnsupportedDTypeError(
            f"precision {precision!r} is not supported; one of {', '.join(PRECISIONS)} "
            "(bf16); int8 comes from quantized ONNX models (QDQ, MatMulInteger, QLinearMatMul)")
    return name


#: Key a lowering sets in its ``matched`` dict when its kernel's shape decided whether it
#: runs on AMX tiles (a convolution: only filter rows of whole tile steps do).
ON_TILES = "tpp.on_tiles"
#: Key a low-precision lowering sets in its ``matched`` dict when it chose an fp32 kernel
#: after all (an expansion fused into its depthwise convolution beats a bf16 GEMM + the
#: depthwise kernel off tiles): its report row is then fp32.
KEPT_FP32 = "tpp.kept_fp32"


def _reason(err: Exception) -> str:
    """The first line of an error, for the report (its type when it has no message)."""
    return str(err).splitlines()[0][:120] if str(err) else type(err).__name__


def as_relax_kernel(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """A hand-scheduled kernel ready for ``call_tir`` in a Relax module: opaque (else
    FuseOps fuses neighbours into it and FuseTIR crashes), scheduled, no-alias, and without
    TE's ``global_symbol="main"`` (a duplicate symbol fails the build). See DESIGN.md."""
    func = func.without_attr("global_symbol")
    return func.with_attrs(
        {"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True}
    )


def _shape(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


#: ``matched`` key under which a lowering offers low-precision rebuilds of its kernels
#: (:class:`~.lowp_activations.LowpOffers`): writing bf16 or the next int8 layer's input.
LOWP_OFFERS = "tpp.lowp_offers"


def _offer_bf16(matched: dict, kernel: relax.GlobalVar, writing, conversion: relax.GlobalVar,
                taking_bf16) -> None:
    """Offer ``kernel`` rebuilt to write another dtype (``writing(dtype)``) and its input
    ``conversion`` rebuilt to take bf16 (None: not needed), for
    :func:`~.lowp_activations.lowp_activations`."""
    offers = matched.setdefault(LOWP_OFFERS, LowpOffers())
    offers.producers[kernel.name_hint] = lambda dtype, _clips: as_relax_kernel(writing(dtype))
    offers.conversions[conversion.name_hint] = (
        None if taking_bf16 is None else lambda: as_relax_kernel(taking_bf16()))


def _emit_gemm(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str, isa: str,
               x: relax.Expr, w_kn: np.ndarray, out_shape: list[int],
               precision: str = "float32", threads: int = 1) -> relax.Expr:
    """One GEMM kernel over x flattened to rows: (+bias)(+act)(x gate)(+residual)(+act),
    reshaped.

    In bf16 the weight is packed as bf16 VNNI panels now, and x is converted (and padded)
    to bf16 by a small kernel before the GEMM; the epilogue is fp32, and so is the output
    unless ``lowp_activations`` finds that the next bf16 layer is its only reader. On
    an AMX target the bf16 GEMM runs on tiles, one task per thread of ``threads``."""
    xs = _shape(x)
    k, n = w_kn.shape
    m = int(np.prod(xs[:-1])) if len(xs) > 1 else 1
    col_scale = matched.get("lhs_scale")
    if col_scale is not None and precision != "float32":  # scaled rows are fp32 only
        x, col_scale = bb.emit(relax.op.multiply(x, col_scale)), None
    epilogue = matched["epilogue"]
    sch, plan = gemm_schedule(m, n, k, isa, epilogue=epilogue, dtype=precision,
                              a_col_scale=col_scale is not None, threads=threads)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    a2 = bb.emit(relax.op.reshape(x, (m, k))) if len(xs) != 2 else x
    prec = plan.precision
    if plan.a_prepadded:
        cvt = bb.add_func(as_relax_kernel(bf16_a_schedule(m, k, plan.mp, plan.kp, isa).mod["main"]),
                          name.replace(".", "_") + "_a_bf16")
        a2 = bb.emit(relax.call_tir(cvt, [a2], relax.TensorType((plan.mp, plan.kp), prec.a)))
        unpadded = (plan.mp, plan.kp) == (m, k)
        _offer_bf16(matched, gv, lambda dtype: gemm_schedule(
            m, n, k, isa, epilogue=epilogue.writing(dtype), dtype=precision,
            threads=threads)[0].mod["main"],
            cvt, None if unpadded else lambda: bf16_a_schedule(
                m, k, plan.mp, plan.kp, isa, in_dtype="bfloat16").mod["main"])
    w_packed = pack_b_numpy(w_kn.astype(numpy_dtype(prec.b)), plan.nr, "kn", plan.kp, prec.vnni)
    args = [a2, relax.const(w_packed)]
    if col_scale is not None:
        args.append(bb.emit(relax.op.reshape(col_scale, (k,))))
    if epilogue.bias:
        bias = matched["bias"].value.numpy().reshape(-1)
        args.append(relax.const(np.pad(bias, (0, plan.np_ - n)).astype("float32")))
    for operand in ("gate", "residual"):
        if getattr(epilogue, operand):
            t = matched[operand]
            args.append(bb.emit(relax.op.reshape(t, (m, n))) if len(out_shape) != 2 else t)
    out = bb.emit(relax.call_tir(gv, args, relax.TensorType((m, n), "float32")))
    return relax.op.reshape(out, out_shape) if len(out_shape) != 2 else out


def _lower_dense(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                 isa: str, precision: str = "float32", threads: int = 1) -> relax.Expr:
    """Dense (+bias)(+act)(+residual): flatten to 2D, one GEMM kernel, reshape back."""
    x, weight = matched["lhs"], matched["weight"]
    w = weight.value.numpy()
    return _emit_gemm(bb, matched, name, isa, x, w, [*_shape(x)[:-1], w.shape[1]], precision,
                      threads)


def _lower_bmm(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
               isa: str) -> relax.Expr:
    """Batched matmul of activations: batch dims flattened, B used in place (not packed)."""
    x, y = matched["lhs"], matched["rhs"]
    xs, ys = _shape(x), _shape(y)
    batch = int(np.prod(xs[:-2]))
    m, k, n = xs[-2], xs[-1], ys[-1]
    sch, _ = gemm_schedule(m, n, k, isa, batch=batch, b_packed=False)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    a3 = bb.emit(relax.op.reshape(x, (batch, m, k))) if len(xs) != 3 else x
    b3 = bb.emit(relax.op.reshape(y, (batch, k, n))) if len(ys) != 3 else y
    out = bb.emit(relax.call_tir(gv, [a3, b3], relax.TensorType((batch, m, n), "float32")))
    return relax.op.reshape(out, [*xs[:-2], m, n]) if len(xs) != 3 else out


def _pointwise(call: relax.Call, weight: np.ndarray) -> bool:
    attrs = call.attrs
    layout = str(attrs.kernel_layout)
    r, s = (weight.shape[layout.index(ax)] for ax in "HW")
    return (r, s, int(attrs.strides[0]), int(attrs.groups)) == (1, 1, 1, 1) and not any(
        int(p) for p in attrs.padding)


def _lower_matmul(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                  isa: str) -> relax.Expr:
    """matmul(A or Aᵀ, B or Bᵀ) (+bias)(+act) of activations: one GEMM kernel, B read in
    place (plain) or packed inside the kernel (transposed), Aᵀ copied to rows."""
    x, y = matched["lhs"], matched["rhs"]
    ta, tb = "lhs_t" in matched, "rhs_t" in matched
    xs, ys = _shape(x), _shape(y)
    if ta:
        k, m = xs
    else:
        m, k = int(np.prod(xs[:-1])), xs[-1]
    n = ys[0] if tb else ys[1]
    epilogue = matched["epilogue"]
    if tb and not epilogue.steps and len(xs) == 2 and m * k + 2 * m * n < n * k:
        # dX = dY Wᵀ with few rows: packing Wᵀ (n x k) would cost more than the product.
        # Cᵀ = W dYᵀ reads W in place as rows; only dY (m x k) is packed, C transposed back.
        sch, _ = gemm_schedule(n, m, k, isa, b_packed=False, b_transposed=True)
        gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_") + "_swapped")
        ct = bb.emit(relax.call_tir(gv, [y, x], relax.TensorType((n, m), "float32")))
        return relax.op.permute_dims(ct, [1, 0])
    sch, plan = gemm_schedule(m, n, k, isa, epilogue=epilogue, b_packed=False,
                              a_transposed=ta, b_transposed=tb)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    args = [bb.emit(relax.op.reshape(x, (m, k))) if len(xs) != 2 else x, y]
    if epilogue.bias:
        bias = matched["bias"]
        if plan.np_ != n:
            bias = bb.emit(relax.op.nn.pad(bias, [0, plan.np_ - n]))
        args.append(bias)
    out = bb.emit(relax.call_tir(gv, args, relax.TensorType((m, n), "float32")))
    out_shape = [*xs[:-1], n] if not ta else [m, n]
    return relax.op.reshape(out, out_shape) if len(out_shape) != 2 else out


def _lower_col_sum(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                   isa: str) -> relax.Expr:
    """A bias gradient: column sums of dY flattened to rows, reduce TPPs per panel."""
    dy = matched["lhs"]
    shape = _shape(dy)
    rows, width = int(np.prod(shape[:-1])), shape[-1]
    sch = col_sum_schedule(rows, width, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    dy2 = bb.emit(relax.op.reshape(dy, (rows, width))) if len(shape) != 2 else dy
    return relax.call_tir(gv, [dy2], relax.TensorType((width,), "float32"))


def _lower_conv2d(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                  isa: str, precision: str = "float32", threads: int = 1) -> relax.Expr:
    """NHWC conv2d (+bias)(+act)(+residual)(+act): BRGEMM over taps, filter packed now;
    3x3 stride-1 layers by Winograd F(2x2, 3x3) on the GEMM TPP where it applies (fp32).
    ``precision="bfloat16"``: the bf16 conv BRGEMM (on AMX tiles where its shape fills
    them), its input padded to bf16 by a kernel of its own."""
    x, weight, call = matched["lhs"], matched["weight"], matched["root"]
    attrs = call.attrs
    n, h, w, c = _shape(x)
    layout = str(attrs.kernel_layout)
    to_oihw = [layout.index(ax) for ax in "OIHW"]
    if not isinstance(weight, tvm.ir.GenericConst):
        return _conv_runtime_weight(bb, matched, name, isa, weight, to_oihw)
    w_np = weight.value.numpy()
    w_oihw = np.transpose(w_np, to_oihw)
    oc, _, r, s = w_oihw.shape
    pad = [int(p) for p in attrs.padding]
    pad = pad * 2 if len(pad) == 2 else pad
    groups = int(attrs.groups)
    shape = ConvShape(n, h, w, c, oc, r, s, int(attrs.strides[0]), tuple(pad), groups)
    if _pointwise(call, w_np):
        # A pointwise convolution is a GEMM over all pixels: far longer M than one row.
        w_kn = np.ascontiguousarray(w_oihw[:, :, 0, 0].T)
        return _emit_gemm(bb, matched, name, isa, x, w_kn, [n, h, w, oc], precision, threads)
    if "lhs_scale" in matched:  # the pattern check admits pointwise convolutions only
        raise RuntimeError(f"{name}: a scaled input needs a pointwise convolution")
    epilogue = matched["epilogue"]
    x_rows = bb.emit(relax.op.reshape(x, (n, h, w * c)))
    if precision != "float32":
        # bf16 (A and the filter; fp32 tile and epilogue): the input padded to bf16 by a
        # kernel of its own, as TVM widens a bf16 buffer allocated inside the conv kernel
        sch, plan = conv_schedule(shape, isa, epilogue=epilogue, dtype=precision,
                                  threads=threads)
        matched[ON_TILES] = plan.amx
        prec = plan.precision
        packed = pack_filter(w_oihw.astype(numpy_dtype(prec.b)), plan.nr, vnni=prec.vnni,
                             groups=groups)
        pad = conv_input_schedule(shape, plan)
        hp, wp, cc = padded_input_shape(shape, plan)
        image = (n, *((groups,) if groups > 1 else ()), hp, wp * cc)
        cvt = bb.add_func(as_relax_kernel(pad.mod["main"]), name.replace(".", "_") + "_a_bf16")
        x_rows = bb.emit(relax.call_tir(cvt, [x_rows], relax.TensorType(image, prec.a)))
    elif register_tile_isa(isa) in ("avx512", "avx2") and winograd_applies(
            shape, epilogue, isa=isa):
        sch, plan = winograd_schedule(shape, isa, epilogue=epilogue)
        packed = pack_winograd_filter(w_oihw, plan.nr, groups)
        name = name.replace("conv2d", "conv2d_winograd", 1)  # so profiles tell them apart
    else:
        sch, plan = conv_schedule(shape, isa, epilogue=epilogue)
        packed = pack_filter(w_oihw, plan.nr, groups=groups)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    if precision != "float32":
        _offer_bf16(matched, gv, lambda dtype: conv_schedule(
            shape, isa, epilogue=epilogue.writing(dtype), dtype=precision,
            threads=threads)[0].mod["main"],
            cvt, lambda: conv_input_schedule(shape, plan, "bfloat16").mod["main"])
    args = [x_rows, relax.const(packed)]
    # Grouped: the kernel writes (n, oh, ow, groups, channels per group), NHWC once reshaped.
    out_shape = (n, shape.oh, shape.ow, *((groups, shape.og) if groups > 1 else (oc,)))
    if epilogue.bias:
        bias = matched["bias"].value.numpy().reshape(groups, shape.og)
        bias = np.pad(bias, ((0, 0), (0, plan.np_ - shape.og))).astype("float32")
        args.append(relax.const(bias if groups > 1 else bias[0]))  # a row per group
    if epilogue.residual:
        res = matched["residual"]
        args.append(bb.emit(relax.op.reshape(res, out_shape)) if groups > 1 else res)
    out = relax.call_tir(gv, args, relax.TensorType(out_shape, "float32"))
    return relax.op.reshape(bb.emit(out), (n, shape.oh, shape.ow, oc)) if groups > 1 else out


def _lower_depthwise(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                     isa: str) -> relax.Expr:
    """NHWC depthwise conv2d with its epilogue: channels as vector lanes, taps as FMAs. A
    channel multiplier m (FastViT's 7x7 stride-2 stem of each stage: 48 channels to 96)
    repeats each input channel m times first: then output channel k reads input k."""
    x, weight, call = matched["lhs"], matched["weight"], matched["root"]
    w_rsc = weight.value.numpy()[:, :, 0, :]  # HWIO with I = 1
    r, s, c = w_rsc.shape
    multiplier = c // _shape(x)[3]
    if multiplier > 1:
        x = bb.emit(relax.op.repeat(x, multiplier, axis=3))
    shape = replace(_conv_shape(x, call.attrs, c, r, s), dilation=int(call.attrs.dilation[0]))
    epilogue = matched["epilogue"]
    sch = depthwise_conv_schedule(shape, isa, epilogue=epilogue)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    # In a quantized model the next int8 layer's input: the kernel can write it quantized.
    offers = matched.setdefault(LOWP_OFFERS, LowpOffers())
    offers.producers[gv.name_hint] = lambda dtype, _clips: as_relax_kernel(
        depthwise_conv_schedule(shape, isa, epilogue=epilogue.writing(dtype)).mod["main"])
    offers.producer_dtypes[gv.name_hint] = ("uint8", "int8")
    args = [x, relax.const(np.ascontiguousarray(w_rsc, dtype="float32"))]
    if epilogue.bias:
        args.append(relax.const(matched["bias"].value.numpy().reshape(-1).astype("float32")))
    if epilogue.residual:
        args.append(matched["residual"])
    return relax.call_tir(gv, args, relax.TensorType((shape.n, shape.oh, shape.ow, c),
                                                     "float32"))


def _lower_expand_depthwise(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                            isa: str, precision: str = "float32", threads: int = 1
                            ) -> relax.Expr:
    """An expansion (a convolution + bias + activation: 1x1, or a stem's window) and the
    depthwise convolution it feeds, as one kernel whose expanded rows never leave the cache;
    as the two kernels where that has no efficient blocking, or where a bf16 expansion runs
    on AMX tiles (off tiles, bf16 precision keeps the fused fp32 kernel: faster than a bf16
    GEMM that writes the expanded tensor out)."""
    x, call = matched["expand_lhs"], matched["expand_root"]
    layout = str(call.attrs.kernel_layout)
    w_oihw = np.transpose(matched["expand_weight"].value.numpy(),
                          [layout.index(ax) for ax in "OIHW"])
    w_rsc = matched["weight"].value.numpy()[:, :, 0, :]  # HWIO with I = 1
    r, s, c = w_rsc.shape
    shape = _conv_shape(matched["lhs"], matched["root"].attrs, c, r, s)
    expansion = Epilogue(bias=True, activation=matched_activation(matched, "expand_act"))
    epilogue = Epilogue(bias=True, activation=matched_activation(matched, "act")
                        if "act" in matched else None)
    unit = vector_unit(isa)
    lanes = unit.schedule_lanes("float32")
    # bf16 off tiles: the fused fp32 kernel (MobileNetV2 on Zen 5, 1 thread: 3.25 ms as a
    # bf16 GEMM + depthwise, 2.88 fused); on tiles the bf16 expansion GEMM.
    if (precision != "float32" and runs_on_tiles(isa, precision)) \
            or plan_expand_depthwise(shape, lanes, threads, unit.num_vregs) is None:
        expanded = _lower_conv2d(
            bb, {"lhs": x, "weight": matched["expand_weight"], "root": call,
                 "bias": matched["expand_bias"], "epilogue": expansion},
            name.replace("expand_depthwise_conv2d", "conv2d"), isa, precision, threads)
        return _lower_depthwise(
            bb, {**matched, "lhs": bb.emit(expanded), "epilogue": epilogue},
            name.replace("expand_depthwise_conv2d", "depthwise_conv2d"), register_tile_isa(isa))
    matched[KEPT_FP32] = precision != "float32"
    sch, plan = expand_depthwise_schedule(
        shape, _conv_shape(x, call.attrs, c, *w_oihw.shape[2:]), register_tile_isa(isa),
        threads=threads, expansion_epilogue=expansion, epilogue=epilogue)
    kernel = f"tpp_expand_{expansion.activation}_depthwise_conv2d{epilogue.suffix}"
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel)
    args = [x, relax.const(pack_expand_filter(w_oihw, plan.vectors * lanes)),
            relax.const(matched["expand_bias"].value.numpy().reshape(-1).astype("float32")),
            relax.const(np.ascontiguousarray(w_rsc, dtype="float32")),
            relax.const(matched["bias"].value.numpy().reshape(-1).astype("float32"))]
    return relax.call_tir(gv, args, relax.TensorType((shape.n, shape.oh, shape.ow, c),
                                                     "float32"))


def _conv_shape(x: relax.Expr, attrs, oc: int, r: int, s: int) -> ConvShape:
    n, h, w, c = _shape(x)
    pad = [int(p) for p in attrs.padding]
    pad = pad * 2 if len(pad) == 2 else pad
    return ConvShape(n, h, w, c, oc, r, s, int(attrs.strides[0]), tuple(pad))


def _conv_runtime_weight(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                         isa: str, weight: relax.Expr, to_oihw: list[int]) -> relax.Expr:
    """A convolution whose filter is computed at run time: the packing ``pack_filter`` does
    at compile time for constants, as Relax ops (pad O, OIHW → (O/nr, H, W·I, nr))."""
    x, call = matched["lhs"], matched["root"]
    oc, ic, r, s = (_shape(weight)[i] for i in to_oihw)
    shape = _conv_shape(x, call.attrs, oc, r, s)
    sch, plan = conv_schedule(shape, isa)
    op_ = plan.np_
    w = relax.op.permute_dims(weight, to_oihw)
    if op_ != oc:
        w = relax.op.nn.pad(w, [0, op_ - oc, 0, 0, 0, 0, 0, 0])
    w = relax.op.reshape(w, (op_ // plan.nr, plan.nr, ic, r, s))
    w = relax.op.permute_dims(w, [0, 3, 4, 2, 1])
    packed = bb.emit(relax.op.reshape(w, (op_ // plan.nr, r, s * ic, plan.nr)))
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    n, h, wd, c = _shape(x)
    args = [bb.emit(relax.op.reshape(x, (n, h, wd * c))), packed]
    return relax.call_tir(gv, args, relax.TensorType((n, shape.oh, shape.ow, oc), "float32"))


def _rows_in(bb: relax.BlockBuilder, x2: relax.Expr, rows: int, padded: int) -> relax.Expr:
    """(rows, width) ``x2`` with zero rows appended up to ``padded``."""
    return x2 if padded == rows else bb.emit(relax.op.nn.pad(x2, [0, padded - rows, 0, 0]))


def _rows_out(bb: relax.BlockBuilder, out: relax.Expr, rows: int, padded: int) -> relax.Expr:
    """The first ``rows`` rows of a padded kernel output."""
    return out if padded == rows else bb.emit(
        relax.op.strided_slice(out, axes=[0], begin=[0], end=[rows]))


def _rowwise_kernel(bb: relax.BlockBuilder, x: relax.Expr, name: str, schedule, args: list
                    ) -> relax.Expr:
    """A row-wise kernel over ``x`` flattened to rows (the first of ``args``), reshaped back
    (a row count no block size divides is padded inside the kernel)."""
    xs = _shape(x)
    rows, width = int(np.prod(xs[:-1])), xs[-1]
    gv = bb.add_func(as_relax_kernel(schedule(rows, width).mod["main"]),
                     name.replace(".", "_"))
    x2 = bb.emit(relax.op.reshape(x, (rows, width))) if len(xs) != 2 else x
    out = bb.emit(relax.call_tir(gv, [x2, *args], relax.TensorType((rows, width), "float32")))
    return relax.op.reshape(out, xs) if len(xs) != 2 else out


def _lower_layer_norm(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                      isa: str) -> relax.Expr:
    """Layer norm over the last axis: rows flattened, one TPP-equation kernel."""
    eps = float(matched["root"].attrs.epsilon)
    return _rowwise_kernel(bb, matched["lhs"], name,
                           lambda rows, width: layer_norm_schedule(rows, width, eps, isa),
                           [matched["gamma"], matched["beta"]])


def _lower_rms_norm(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                    isa: str) -> relax.Expr:
    """RMS norm over the last axis: rows flattened, one TPP-equation kernel."""
    eps = float(matched["root"].attrs.epsilon)
    return _rowwise_kernel(bb, matched["lhs"], name,
                           lambda rows, width: rms_norm_schedule(rows, width, eps, isa),
                           [matched["gamma"]])


def _lower_softmax(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                   isa: str) -> relax.Expr:
    """Softmax over the last axis: rows flattened, one TPP-equation kernel."""
    return _rowwise_kernel(bb, matched["lhs"], name,
                           lambda rows, width: softmax_schedule(rows, width, isa), [])


def _lower_attention(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                     isa: str, precision: str = "float32", threads: int = 1) -> relax.Expr:
    """One fused attention kernel over the flattened (batch·head) dimension. In bf16 on an
    AMX target its two products run on tiles (queries padded to blocks of 32) where the
    head size is whole 32s and there are 16 queries or more; elsewhere it stays fp32.
    Queries and keys may differ in number, and V's head size (the output's) from Q's and
    K's (LeViT's subsampling attention: 49 queries over 196 keys, values 4x wider)."""
    q, kt, v = matched["q"], matched["k_t"], matched["v"]
    qs, ks = _shape(q), _shape(kt)
    dv = _shape(v)[-1]
    tile_rows = (tile_query_rows(qs[-2], qs[-1], dv)
                 if precision != "float32" and runs_on_tiles(isa, precision) else None)
    tiles = tile_rows is not None
    matched[KEPT_FP32] = precision != "float32" and not tiles
    bh = int(np.prod(qs[:-2]))
    group = 1
    if "k_grouped" in matched:  # shared K/V heads read in place, not repeated
        k = matched["k_grouped"]
        group = qs[1] // _shape(k)[1]
        kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
        v = matched["v_grouped"]
    c = float(matched["scale"].value.numpy().reshape(()))
    scale = c if matched["scale_multiplies"] else 1.0 / c
    rows = tile_rows or padded_query_rows(qs[-2], query_block_rows(isa))
    keys = padded_keys(ks[-1])
    q3 = bb.emit(relax.op.reshape(q, (bh, qs[-2], qs[-1])))
    if rows != qs[-2]:  # a prime query count: zero rows as the tail, dropped afterwards
        q3 = bb.emit(relax.op.nn.pad(q3, [0, 0, 0, rows - qs[-2], 0, 0]))
    kt3 = bb.emit(relax.op.reshape(kt, (bh // group, ks[-2], ks[-1])))
    v3 = bb.emit(relax.op.reshape(v, (bh // group, ks[-1], dv)))
    if keys != ks[-1]:  # zero keys and values, masked out below
        kt3 = bb.emit(relax.op.nn.pad(kt3, [0, 0, 0, 0, 0, keys - ks[-1]]))
        v3 = bb.emit(relax.op.nn.pad(v3, [0, 0, 0, keys - ks[-1], 0, 0]))
    args = [q3, kt3]
    heads = bh
    masked = "mask" in matched or keys != ks[-1]
    per_query = False
    if "mask" in matched:
        mask = matched["mask"]
        ms = _shape(mask)
        if len(ms) != len(qs) or not mask_rows_broadcast(tuple(ms[:-2]), tuple(qs[:-2])):
            # a constant broadcast over inner dims (a bias per head): one row per (b, h)
            full = np.broadcast_to(mask.value.numpy(), (*qs[:-2], *ms[-2:]))
            mask = relax.const(np.ascontiguousarray(full))
            ms = _shape(mask)
        mask_rows = int(np.prod(ms[:-2]))
        heads = bh // mask_rows
        per_query = ms[-2] > 1
        mask3 = bb.emit(relax.op.reshape(mask, (mask_rows, ms[-2], ms[-1])))
        if keys != ks[-1]:
            mask3 = bb.emit(relax.op.nn.pad(mask3, [0, 0, 0, 0, 0, keys - ks[-1]],
                                            pad_value=float("-inf")))
        if per_query and rows != qs[-2]:  # the padded query rows' outputs are dropped
            mask3 = bb.emit(relax.op.nn.pad(mask3, [0, 0, 0, rows - qs[-2], 0, 0]))
        args.append(mask3)
    elif masked:
        pad_mask = np.zeros((1, 1, keys), "float32")
        pad_mask[..., ks[-1]:] = -np.inf
        args.append(relax.const(pad_mask))
    args.append(v3)
    shape = AttentionShape(bh, rows, keys, qs[-1], heads, scale, masked,
                           zero_masked_rows="nan_guard" in matched, group=group,
                           mask_per_query=per_query, dim_v=dv)
    sch = attention_tile_schedule(shape, threads) if tiles else attention_schedule(shape, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    out = bb.emit(relax.call_tir(gv, args, relax.TensorType((bh, rows, dv), "float32")))
    if rows != qs[-2]:
        out = bb.emit(relax.op.strided_slice(out, axes=[1], begin=[0], end=[qs[-2]]))
    return relax.op.reshape(out, (*qs[:-1], dv))


def _lower_eltwise(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                   isa: str) -> relax.Expr:
    """An element-wise chain (act(x), x + y, act(x + y)) as one equation TPP kernel."""
    x = matched["lhs"]
    xs = _shape(x)
    width, rows = xs[-1], int(np.prod(xs[:-1]))
    padded = padded_rows(rows, width)
    steps: list[str] = []
    kinds: list[str] = []
    args = [_rows_in(bb, bb.emit(relax.op.reshape(x, (rows, width))), rows, padded)]
    if "operand" in matched:
        y = matched["operand"]
        kind = "residual" if _shape(y) == xs else "bias"
        steps.append(kind)
        kinds.append(kind)
        args.append(_rows_in(bb, bb.emit(relax.op.reshape(y, (rows, width))), rows, padded)
                    if kind == "residual" else bb.emit(relax.op.reshape(y, (width,))))
    if matched["epilogue"].activation:
        steps.append(matched["epilogue"].activation)
    sch = equation_schedule(padded, width, tuple(steps), kinds, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    out = bb.emit(relax.call_tir(gv, args, relax.TensorType((padded, width), "float32")))
    return relax.op.reshape(_rows_out(bb, out, rows, padded), xs)


def _lower_instance_norm(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                         isa: str) -> relax.Expr:
    """Channels-last instance or group norm (+ act): per-channel scale and shift from
    column statistics, then one equation TPP pass (``scale``, ``bias``, act)."""
    x, root = matched["lhs"], matched["root"]
    _, rows, width = _shape(x)
    groups = int(root.attrs.num_groups) if hasattr(root.attrs, "num_groups") else width
    stats = instance_norm_stats_schedule(rows, width, float(root.attrs.epsilon), isa, groups)
    stats_gv = bb.add_func(as_relax_kernel(stats.mod["main"]),
                           name.replace(".", "_") + "_stats")
    x2 = bb.emit(relax.op.reshape(x, (rows, width)))
    row = relax.TensorType((width,), "float32")
    scale_shift = bb.emit(relax.call_tir(stats_gv, [x2, matched["gamma"], matched["beta"]],
                                         [row, row]))
    apply = instance_norm_apply_schedule(rows, width, matched["epilogue"].activation, isa)
    gv = bb.add_func(as_relax_kernel(apply.mod["main"]), name.replace(".", "_"))
    out = bb.emit(relax.call_tir(gv, [x2, bb.emit(relax.TupleGetItem(scale_shift, 0)),
                                      bb.emit(relax.TupleGetItem(scale_shift, 1))],
                                 relax.TensorType((rows, width), "float32")))
    return relax.op.reshape(out, (1, rows, width))


def _lower_max_pool(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                    isa: str) -> relax.Expr:
    """NHWC max pooling: the pool_max TPP over each window. In ceil mode (SqueezeNet's) the
    last, partial windows are those of a bottom/right padding wide enough to hold them:
    the kernel pads with the dtype's lowest value, which no maximum selects."""
    x, call = matched["lhs"], matched["root"]
    n, h, w, c = _shape(x)
    attrs = call.attrs
    pad = [int(p) for p in attrs.padding]
    top, left, bottom, right = pad * 2 if len(pad) == 2 else pad
    r, s, stride = int(attrs.pool_size[0]), int(attrs.pool_size[1]), int(attrs.strides[0])
    _, oh, ow, _ = _shape(call)
    bottom = max(bottom, (oh - 1) * stride + r - h - top)
    right = max(right, (ow - 1) * stride + s - w - left)
    shape = PoolShape(n, h, w, c, r, s, stride, (top, left, bottom, right))
    dtype = str(x.ty.dtype)
    sch = max_pool_schedule(shape, isa, dtype)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    args = [bb.emit(relax.op.reshape(x, (n, h, w * c)))]
    return relax.call_tir(gv, args, relax.TensorType((n, shape.oh, shape.ow, c), dtype))


def _lower_global_avg_pool(bb: relax.BlockBuilder, matched: dict[str, relax.Expr], name: str,
                           isa: str) -> relax.Expr:
    """Global average pooling (mean over H, W of NHWC): the reduce_add_rows TPP."""
    x, call = matched["lhs"], matched["root"]
    n, h, w, c = _shape(x)
    if h * w == 1:  # the mean of one pixel is the pixel (VGG's 1 x 4096 head)
        return relax.op.reshape(x, _shape(call))
    sch = global_avg_pool_schedule(n, h * w, c, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), name.replace(".", "_"))
    out = bb.emit(relax.call_tir(gv, [bb.emit(relax.op.reshape(x, (n, h * w, c)))],
                                 relax.TensorType((n, c), "float32")))
    return relax.op.reshape(out, _shape(call))


#: Kernel family (``TPPPattern.lowering``) -> the function that emits its kernels.
LOWERINGS = {
    "max_pool2d": _lower_max_pool,
    "global_avg_pool": _lower_global_avg_pool,
    "eltwise": _lower_eltwise,
    "attention": _lower_attention,
    "dense": _lower_dense,
    "conv2d": _lower_conv2d,
    "depthwise_conv2d": _lower_depthwise,
    "expand_depthwise_conv2d": _lower_expand_depthwise,
    "bmm": _lower_bmm,
    "matmul": _lower_matmul,
    "col_sum": _lower_col_sum,
    "layer_norm": _lower_layer_norm,
    "instance_norm": _lower_instance_norm,
    "rms_norm": _lower_rms_norm,
    "softmax": _lower_softmax,
}


#: Lowerings whose fp32 kernels are blocked for the target's thread count.
THREADED_LOWERINGS = frozenset({"expand_depthwise_conv2d"})


def _lowered_precision(lowering: str, matched: dict[str, relax.Expr], precision: str) -> str:
    """The precision a composite runs in: ``precision`` for dense layers, attention (whose
    lowering keeps fp32 off tiles) and convolutions with constant weights, fp32 for
    everything else."""
    if precision == "float32" or lowering in ("dense", "expand_depthwise_conv2d",
                                              "attention"):
        return precision
    weight = matched.get("weight")
    if lowering == "conv2d" and isinstance(weight, tvm.ir.GenericConst):
        return precision  # pointwise: a GEMM; k x k (grouped too): the conv BRGEMM in bf16
    return "float32"


def _match(pattern: TPPPattern, func: relax.Function, args: list[relax.Expr]
           ) -> dict[str, relax.Expr] | None:
    """Annotated expressions of ``pattern`` in a composite ``func``, in the caller's terms."""
    body = func.body
    out = body.body
    var2val = get_var2val(func)
    while isinstance(out, relax.Var) and out in var2val and not isinstance(
        var2val[out], relax.Call
    ):
        out = var2val[out]
    found = pattern.pattern.extract_matched_expr(out, var2val)
    if found is None:
        return None
    params = {p: a for p, a in zip(func.params, args)}
    matched = {}
    for key, pat in pattern.annotations.items():
        expr = found.get(pat)
        if expr is None:
            continue
        matched[key] = params.get(expr, expr)
    matched["epilogue"] = pattern.epilogue
    matched["scale_multiplies"] = pattern.scale_multiplies
    return matched


@relax.expr_functor.mutator
class _Lowerer(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, isa: str, report: LoweringReport,
                 precision: str = "float32", logs=None, force_tuned: bool = False,
                 threads: int = 1) -> None:
        super().__init__(mod)
        self.threads = threads
        self.mod_ = mod
        self.isa = isa
        self.report = report
        self.precision = precision
        self.logs, self.force_tuned = logs, force_tuned
        self.patterns = {p.name: p for p in pattern_table()}
        self.lowp_offers = LowpOffers()

    def _contraction(self, call: relax.Call) -> relax.Expr:
        func = self.mod_[call.args[0]]
        if not func.attrs or "tpp.contraction" not in func.attrs:
            return call
        try:
            out = _lower_contraction(self.builder_, call, func.attrs["tpp.contraction"],
                                     self.isa)
        except Exception as err:  # noqa: BLE001 - the TE kernel stays, TVM schedules it
            reason = _reason(err)
            log.info("TPP contraction fell back to TVM: %s", reason)
            self.report.fallbacks[f"tpp.contraction ({reason})"] += 1
            return call
        self.report.kernels[KernelRow("tpp.contraction", "contraction")] += 1
        return out

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod_.functions.items():
            if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op in _CALL_TIR and isinstance(self.mod_[call.args[0]], tvm.tirx.PrimFunc):
            return self._contraction(call)
        if not isinstance(call.op, relax.GlobalVar):
            return call
        func = self.mod_[call.op]
        comp = str(func.attrs["Composite"]) if func.attrs and "Composite" in func.attrs else None
        pattern = self.patterns.get(comp)
        if pattern is None:  # not one of ours (another codegen's composite)
            return call
        row = KernelRow(comp, pattern.lowering)
        if self.logs is not None and self.precision == "float32":  # logs hold fp32 kernels
            tuned = self._tuned(func, call, row)
            if tuned is not None:
                return tuned
        lowering = LOWERINGS[pattern.lowering]
        matched = _match(pattern, func, list(call.args))
        try:
            if matched is None:
                raise ValueError("pattern no longer matches its composite function")
            prec = _lowered_precision(pattern.lowering, matched, self.precision)
            out = None
            if prec != "float32":
                out = self._low_precision(lowering, matched, comp, prec)
                if out is not None and not matched.get(KEPT_FP32):
                    # ON_TILES where the kernel's shape decided; else every prec GEMM of an
                    # AMX target runs on tiles
                    tiles = matched.get(ON_TILES)
                    tiles = runs_on_tiles(self.isa, prec) if tiles is None else tiles
                    row = replace(row, precision=prec, unit=unit_of(tiles))
            if out is None:
                out = lowering(self.builder_, matched, comp, self.isa,
                               **({"threads": self.threads}
                                  if pattern.lowering in THREADED_LOWERINGS else {}))
        except Exception as err:  # noqa: BLE001 - fall back to TVM, keep the model correct
            reason = _reason(err)
            log.info("TPP lowering of %s fell back to TVM: %s", comp, reason)
            self.report.fallbacks[f"{comp} ({reason})"] += 1
            return call
        self.report.kernels[row] += 1
        offers = matched.get(LOWP_OFFERS)
        if offers is not None:
            self.lowp_offers.producers.update(offers.producers)
            self.lowp_offers.conversions.update(offers.conversions)
            self.lowp_offers.producer_dtypes.update(offers.producer_dtypes)
        return out

    def _low_precision(self, lowering, matched: dict[str, relax.Expr], comp: str, prec: str
                       ) -> relax.Expr | None:
        """The ``prec`` kernel of a composite, or None (reported) when it cannot be built:
        the fp32 TPP kernel then runs it, not TVM's untuned code (a matmul there is 100x
        slower)."""
        try:
            return lowering(self.builder_, matched, comp, self.isa, prec, threads=self.threads)
        except Exception as err:  # noqa: BLE001 - fp32 TPPs are the next best, not TVM
            reason = _reason(err)
            log.info("%s kernel of %s failed, fp32 TPP instead: %s", prec, comp, reason)
            self.report.rewrites[f"{comp}: {prec} kernel failed, ran on fp32 TPPs ({reason})"] += 1
            return None

    def _tuned(self, func: relax.Function, call: relax.Call, row: KernelRow
               ) -> relax.Expr | None:
        kernel = composite_kernel(func, self.logs.target)
        scheduled = None if kernel is None else self.logs.schedule(kernel.func,
                                                                   self.force_tuned)
        if scheduled is None:
            return None
        self.report.kernels[replace(row, tuned=True)] += 1
        return emit_tuned(self.builder_, func, list(call.args), kernel, scheduled,
                          row.pattern.replace(".", "_") + "_tuned")

_CALL_TIR = (tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_tir_with_grad"))


def _lower_contraction(bb: relax.BlockBuilder, call: relax.Call, info, isa: str) -> relax.Expr:
    """A kernel tagged ``tpp.contraction`` (a custom op's GEMM-shaped TE computation) as a
    TPP GEMM on the same operands: batched or not, either operand transposed, scaled."""
    args = list(call.args[1].fields)
    m, n, k, batch = (int(info[key]) for key in ("m", "n", "k", "batch"))
    sch, _ = gemm_schedule(m, n, k, isa, batch=batch or None, b_packed=False,
                           a_transposed=bool(info["a_t"]), b_transposed=bool(info["b_t"]),
                           a_scale=float(info["scale"]))
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), "tpp_contraction")
    shape = (batch, m, n) if batch else (m, n)
    return relax.call_tir(gv, [args[int(info["a"])], args[int(info["b"])]],
                          relax.TensorType(shape, "float32"))


def lower_tpp_composites(mod: tvm.IRModule, isa: str, report: LoweringReport,
                         precision: str = "float32", logs=None, force_tuned: bool = False,
                         threads: int = 1) -> tvm.IRModule:
    """Replace calls of ``tpp.*`` composites with TPP kernels (tuned ones from ``logs``
    where faster); inline the rest back.

    ``precision="bfloat16"`` runs dense layers and pointwise convolutions on bf16 TPPs (on
    AMX tiles on an AMX target, one task per thread of ``threads``)."""
    report.precision = precision
    lowerer = _Lowerer(mod, isa, report, precision, logs, force_tuned, threads)
    mod = lowerer.transform()
    mod, written = lowp_activations(mod, lowerer.lowp_offers)
    report_narrowed(report, written)
    mod = relax.transform.DeadCodeElimination()(mod)
    # Composites that fell back are still calls of private functions: inline them so the
    # normal legalize/fuse path compiles their ops.
    return inline_composites(mod)


def lower_tagged_kernels(mod: tvm.IRModule, isa: str, report: LoweringReport) -> tvm.IRModule:
    """Swap kernels tagged ``tpp.backward`` (emitted by training gradients as plain TE)
    for their TPP schedules; one that has no TPP tile keeps its TE form for TVM."""
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tvm.tirx.PrimFunc) or not func.attrs or \
                "tpp.backward" not in func.attrs:
            continue
        op = str(func.attrs["tpp.backward"])
        try:
            sch = backward_schedule(func, isa)
        except Exception as err:  # noqa: BLE001 - keep the TE kernel, TVM schedules it
            reason = _reason(err)
            log.info("TPP backward kernel %s fell back to TVM: %s", op, reason)
            report.fallbacks[f"tpp.{op} ({reason})"] += 1
            continue
        mod[gv] = as_relax_kernel(sch.mod["main"])
        report.kernels[KernelRow(f"tpp.{op}", "backward")] += 1
    return mod


def inline_composites(mod: tvm.IRModule) -> tvm.IRModule:
    """Inline the remaining (fallen-back) composite functions into their callers."""
    comps = [gv for gv, f in mod.functions.items()
             if isinstance(f, relax.Function) and f.attrs and "Composite" in f.attrs]
    if not comps:
        return mod
    for gv in comps:
        func = mod[gv]
        mod[gv] = func.without_attr("Composite").without_attr("Primitive")
    return relax.transform.DeadCodeElimination()(relax.transform.InlinePrivateFunctions()(mod))
