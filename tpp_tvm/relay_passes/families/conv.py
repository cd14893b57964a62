"""The convolution families: NHWC convolutions (a BRGEMM over filter taps, Winograd for
3x3 stride-1 layers, a GEMM for pointwise ones, a filter packed at run time where it is
computed), depthwise convolutions, and an expansion fused into the depthwise convolution
it feeds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import tvm
from tvm import relax

from ...intrinsics.epilogue import Epilogue
from ...kernels import numpy_dtype
from ...schedules.conv import (
    ConvShape,
    conv_input_schedule,
    conv_schedule,
    pack_filter,
    padded_input_shape,
)
from ...schedules.depthwise import depthwise_conv_schedule
from ...schedules.expand_depthwise import (
    expand_depthwise_schedule,
    pack_expand_filter,
    plan_expand_depthwise,
)
from ...schedules.gemm_plan import register_tile_isa, runs_on_tiles, vector_unit
from ...schedules.winograd import pack_winograd_filter, winograd_applies, winograd_schedule
from ..activation_dtypes import FP32_IO
from ..patterns import matched_activation
from .base import KernelFamily, Lowered, Match, as_relax_kernel, dims, kernel_name, output_args
from .gemm import emit_gemm, gemm_bf16_operand, gemm_narrow_outputs


def _pointwise(call: relax.Call, weight: np.ndarray) -> bool:
    attrs = call.attrs
    layout = str(attrs.kernel_layout)
    r, s = (weight.shape[layout.index(ax)] for ax in "HW")
    return (r, s, int(attrs.strides[0]), int(attrs.groups)) == (1, 1, 1, 1) and not any(
        int(p) for p in attrs.padding)


def lower_conv2d(bb: relax.BlockBuilder, matched: Match, name: str,
                  isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """NHWC conv2d (+bias)(+act)(+residual)(+act): BRGEMM over taps, filter packed now;
    3x3 stride-1 layers by Winograd F(2x2, 3x3) on the GEMM TPP where it applies (fp32).
    ``precision="bfloat16"``: the bf16 conv BRGEMM (on AMX tiles where its shape fills
    them), its input padded to bf16 by a kernel of its own; a filter computed at run time
    keeps fp32."""
    x, weight, call = matched["lhs"], matched["weight"], matched["root"]
    attrs = call.attrs
    n, h, w, c = dims(x)
    layout = str(attrs.kernel_layout)
    to_oihw = [layout.index(ax) for ax in "OIHW"]
    if not isinstance(weight, tvm.ir.GenericConst):
        return Lowered(_conv_runtime_weight(bb, matched, name, isa, weight, to_oihw),
                       kept_fp32=precision != "float32")
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
        return emit_gemm(bb, matched, name, isa, x, w_kn, [n, h, w, oc], precision, threads)
    if "lhs_scale" in matched:  # the pattern check admits pointwise convolutions only
        raise RuntimeError(f"{name}: a scaled input needs a pointwise convolution")
    io = matched.io
    epilogue = matched.epilogue.writing(io.writes)
    x_rows = bb.emit(relax.op.reshape(x, (n, h, w * c)))
    if precision != "float32":
        # bf16 (A and the filter; fp32 tile and epilogue): the input padded to bf16 by a
        # kernel of its own, as TVM widens a bf16 buffer allocated inside the conv kernel
        sch, plan = conv_schedule(shape, isa, epilogue=epilogue, dtype=precision,
                                  threads=threads)
        prec = plan.precision
        packed = pack_filter(w_oihw.astype(numpy_dtype(prec.b)), plan.nr, vnni=prec.vnni,
                             groups=groups)
        pad = conv_input_schedule(shape, plan, io.takes)
        hp, wp, cc = padded_input_shape(shape, plan)
        image = (n, *((groups,) if groups > 1 else ()), hp, wp * cc)
        cvt = bb.add_func(as_relax_kernel(pad.mod["main"]), kernel_name(name) + "_a_bf16")
        x_rows = bb.emit(relax.call_tir(cvt, [x_rows], relax.TensorType(image, prec.a)))
    elif register_tile_isa(isa) in ("avx512", "avx2") and winograd_applies(
            shape, epilogue, isa=isa):
        sch, plan = winograd_schedule(shape, isa, epilogue=epilogue)
        packed = pack_winograd_filter(w_oihw, plan.nr, groups)
        name = name.replace("conv2d", "conv2d_winograd", 1)  # so profiles tell them apart
    else:
        sch, plan = conv_schedule(shape, isa, epilogue=epilogue)
        packed = pack_filter(w_oihw, plan.nr, groups=groups)
    kernel = sch.mod["main"]
    gv = bb.add_func(as_relax_kernel(kernel), kernel_name(name))
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
    out = relax.call_tir(gv, output_args(args, kernel, oc, io),
                         relax.TensorType(out_shape, io.writes))
    out = relax.op.reshape(bb.emit(out), (n, shape.oh, shape.ow, oc)) if groups > 1 else out
    return Lowered(out, on_tiles=plan.amx if precision != "float32" else None)


def conv_narrow_outputs(matched: Match, precision: str, isa: str, threads: int
                        ) -> tuple[str, ...]:
    """A bf16 convolution by a constant filter writes what a bf16 GEMM does."""
    if not isinstance(matched["weight"], tvm.ir.GenericConst):
        return ()
    return gemm_narrow_outputs(matched, precision, isa, threads)


def conv_bf16_operand(matched: Match, precision: str, isa: str, threads: int) -> str | None:
    """A bf16 convolution by a constant filter takes its image in bf16 (padded by its
    input kernel) as a bf16 GEMM takes its rows."""
    if not isinstance(matched["weight"], tvm.ir.GenericConst):
        return None
    return gemm_bf16_operand(matched, precision, isa, threads)


def lower_depthwise(bb: relax.BlockBuilder, matched: Match, name: str,
                    isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """NHWC depthwise conv2d with its epilogue: channels as vector lanes, taps as FMAs. A
    channel multiplier m (FastViT's 7x7 stride-2 stem of each stage: 48 channels to 96)
    repeats each input channel m times first: then output channel k reads input k."""
    x, weight, call = matched["lhs"], matched["weight"], matched["root"]
    w_rsc = weight.value.numpy()[:, :, 0, :]  # HWIO with I = 1
    r, s, c = w_rsc.shape
    multiplier = c // dims(x)[3]
    if multiplier > 1:
        x = bb.emit(relax.op.repeat(x, multiplier, axis=3))
    shape = replace(_conv_shape(x, call.attrs, c, r, s), dilation=int(call.attrs.dilation[0]))
    io = matched.io
    epilogue = matched.epilogue.writing(io.writes)
    kernel = depthwise_conv_schedule(shape, isa, epilogue=epilogue).mod["main"]
    gv = bb.add_func(as_relax_kernel(kernel), kernel_name(name))
    args = [x, relax.const(np.ascontiguousarray(w_rsc, dtype="float32"))]
    if epilogue.bias:
        args.append(relax.const(matched["bias"].value.numpy().reshape(-1).astype("float32")))
    if epilogue.residual:
        args.append(matched["residual"])
    return Lowered(relax.call_tir(gv, output_args(args, kernel, c, io),
                                  relax.TensorType((shape.n, shape.oh, shape.ow, c), io.writes)),
                   kept_fp32=precision != "float32")


def depthwise_narrow_outputs(matched: Match, precision: str, isa: str, threads: int
                             ) -> tuple[str, ...]:
    """In a quantized model a depthwise convolution's output is the next int8 layer's
    input: the kernel writes it quantized."""
    return ("uint8", "int8")


def lower_expand_depthwise(bb: relax.BlockBuilder, matched: Match, name: str,
                            isa: str, precision: str = "float32", threads: int = 1
                            ) -> Lowered:
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
    lanes = vector_unit(isa).schedule_lanes("float32")
    if _expand_depthwise_split(matched, precision, isa, threads):
        expanded = lower_conv2d(
            bb, Match({"lhs": x, "weight": matched["expand_weight"], "root": call,
                       "bias": matched["expand_bias"]}, expansion,
                      io=replace(FP32_IO, takes=matched.io.takes)),
            name.replace("expand_depthwise_conv2d", "conv2d"), isa, precision, threads)
        depthwise = lower_depthwise(
            bb, matched.with_operands(epilogue, replace(matched.io, takes="float32"),
                                      lhs=bb.emit(expanded.expr)),
            name.replace("expand_depthwise_conv2d", "depthwise_conv2d"), register_tile_isa(isa))
        return Lowered(depthwise.expr, expanded.on_tiles, expanded.kept_fp32)
    sch, plan = expand_depthwise_schedule(
        shape, _conv_shape(x, call.attrs, c, *w_oihw.shape[2:]), register_tile_isa(isa),
        threads=threads, expansion_epilogue=expansion, epilogue=epilogue)
    kernel = f"tpp_expand_{expansion.activation}_depthwise_conv2d{epilogue.suffix}"
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel)
    args = [x, relax.const(pack_expand_filter(w_oihw, plan.vectors * lanes)),
            relax.const(matched["expand_bias"].value.numpy().reshape(-1).astype("float32")),
            relax.const(np.ascontiguousarray(w_rsc, dtype="float32")),
            relax.const(matched["bias"].value.numpy().reshape(-1).astype("float32"))]
    return Lowered(relax.call_tir(gv, args, relax.TensorType((shape.n, shape.oh, shape.ow, c),
                                                             "float32")),
                   kept_fp32=precision != "float32")


def _expand_depthwise_split(matched: Match, precision: str, isa: str, threads: int) -> bool:
    """Whether an expansion and its depthwise convolution run as two kernels: where the
    fused kernel has no efficient blocking, or the bf16 expansion runs on AMX tiles (off
    tiles, the fused fp32 kernel beats a bf16 GEMM writing the expanded tensor out:
    MobileNetV2 on Zen 5, 1 thread, 3.25 ms as a bf16 GEMM + depthwise, 2.88 fused)."""
    if precision != "float32" and runs_on_tiles(isa, precision):
        return True
    r, s, _, c = matched["weight"].value.numpy().shape  # HWIO with I = 1
    unit = vector_unit(isa)
    shape = _conv_shape(matched["lhs"], matched["root"].attrs, c, r, s)
    return plan_expand_depthwise(shape, unit.schedule_lanes("float32"), threads,
                                 unit.num_vregs) is None


def expand_depthwise_narrow_outputs(matched: Match, precision: str, isa: str, threads: int
                                    ) -> tuple[str, ...]:
    """As two kernels, the depthwise convolution's outputs (the fused kernel writes fp32)."""
    return ("uint8", "int8") if _expand_depthwise_split(matched, precision, isa, threads) \
        else ()


def expand_depthwise_bf16_operand(matched: Match, precision: str, isa: str, threads: int
                                  ) -> str | None:
    """As two kernels in bf16, the expansion takes its input as a bf16 convolution does."""
    if precision == "float32" or not _expand_depthwise_split(matched, precision, isa, threads):
        return None
    return "expand_lhs"


def _conv_shape(x: relax.Expr, attrs, oc: int, r: int, s: int) -> ConvShape:
    n, h, w, c = dims(x)
    pad = [int(p) for p in attrs.padding]
    pad = pad * 2 if len(pad) == 2 else pad
    return ConvShape(n, h, w, c, oc, r, s, int(attrs.strides[0]), tuple(pad))


def _conv_runtime_weight(bb: relax.BlockBuilder, matched: Match, name: str,
                         isa: str, weight: relax.Expr, to_oihw: list[int]) -> relax.Expr:
    """A convolution whose filter is computed at run time: the packing ``pack_filter`` does
    at compile time for constants, as Relax ops (pad O, OIHW → (O/nr, H, W·I, nr))."""
    x, call = matched["lhs"], matched["root"]
    oc, ic, r, s = (dims(weight)[i] for i in to_oihw)
    shape = _conv_shape(x, call.attrs, oc, r, s)
    sch, plan = conv_schedule(shape, isa)
    op_ = plan.np_
    w = relax.op.permute_dims(weight, to_oihw)
    if op_ != oc:
        w = relax.op.nn.pad(w, [0, op_ - oc, 0, 0, 0, 0, 0, 0])
    w = relax.op.reshape(w, (op_ // plan.nr, plan.nr, ic, r, s))
    w = relax.op.permute_dims(w, [0, 3, 4, 2, 1])
    packed = bb.emit(relax.op.reshape(w, (op_ // plan.nr, r, s * ic, plan.nr)))
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    n, h, wd, c = dims(x)
    args = [bb.emit(relax.op.reshape(x, (n, h, wd * c))), packed]
    return relax.call_tir(gv, args, relax.TensorType((n, shape.oh, shape.ow, oc), "float32"))


FAMILIES = (
    KernelFamily("conv2d", lower_conv2d, ("float32", "bfloat16"), conv_narrow_outputs,
                 conv_bf16_operand),
    KernelFamily("depthwise_conv2d", lower_depthwise, narrow_outputs=depthwise_narrow_outputs),
    KernelFamily("expand_depthwise_conv2d", lower_expand_depthwise, ("float32", "bfloat16"),
                 expand_depthwise_narrow_outputs, expand_depthwise_bf16_operand),
)
