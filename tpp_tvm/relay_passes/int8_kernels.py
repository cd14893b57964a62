"""The int8 kernels' side of the quantized rewrite: what an int8 GEMM or convolution fuses
after dequantizing (:class:`Int8Epilogue`), the emitter that declares the kernel calls,
their dequantize rows and residual operands, and their report rows
(:class:`Int8Emitter`), and :func:`build_declared`, which builds each declared kernel
once the graph's dtypes are planned. ``quantized.py`` matches the graph forms and calls
them.

An int8 layer's output dtype depends on its readers (the next int8 layer's quantization,
which it can write itself), and those are only final once the fake quantization around the
layers is gone: so the emitter declares each kernel (its blocking, hence its operands'
layouts, and how to build it) and the kernels are built after that, each once, writing the
dtype :func:`~.activation_dtypes.plan_outputs` decided."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx

from ..intrinsics.epilogue import Epilogue
from ..kernels import pack_b_numpy
from ..schedules.conv import ConvShape, conv_plan, conv_schedule, pack_filter, tile_filter_width
from ..schedules.gemm import gemm_plan, gemm_schedule
from ..schedules.gemm_plan import GEMM_PRECISIONS, runs_on_tiles
from .activation_dtypes import (
    FP32_IO,
    KernelIO,
    plan_outputs,
    quantizing_args,
    report_narrowed,
    widened,
    without_round_trips,
)
from .exprs import bindings, dtype_of, shape_of
from .lower import as_relax_kernel
from .report import KernelRow, LoweringReport, unit_of
from .transposes import TO_NCHW, TO_NHWC

#: Input channels a group needs for the int8 conv kernel: fewer (depthwise, MobileNetV2's
#: and EfficientNet's) make filter rows of a few bytes, which the fp32 depthwise and
#: grouped TPPs run better.
MIN_INT8_GROUP_CHANNELS = 16


#: The kernel each contraction becomes, as fallbacks name it.
INT8_KERNELS = {"relax.matmul": "tpp.int8_matmul", "relax.nn.conv2d": "tpp.int8_conv2d",
                "relax.nn.conv1d": "tpp.int8_conv1d"}


#: How the report names int8 layers no int8 kernel takes (grouped convolutions, weight zero
#: points...): their dequantized weights fold to constants and the fp32 TPPs run them.
QDQ_IN_FP32 = "int8 layers run in fp32 on their dequantized weights"


@dataclass(frozen=True)
class Int8Epilogue:
    """An int8 kernel's fused tail: its ``steps`` after dequantizing (the bias is no step:
    it goes into the dequantize offset, :func:`_dequantize_rows`) and their operands.
    ``residual`` is in the layout of the graph's output (NCHW for a convolution).
    ``residual_quantization``: (scale, zero point) where the residual is the quantized
    tensor (u8/s8) itself, ``dequantize(residual, scale, zero point)`` being the value
    added (a ResNet block's input, which the next block's int8 convolution reads too)."""

    steps: Epilogue = Epilogue()
    bias: np.ndarray | None = None
    residual: relax.Expr | None = None
    residual_quantization: tuple[float, float] | None = None

    @property
    def suffix(self) -> str:
        """How the report names the fused steps: ``_bias_relu``, ``_bias_residual_relu``,
        ``_bias_residual_u8_relu``."""
        return ("_bias" if self.bias is not None else "") + self.steps.suffix

    def kernel(self, clips_at_zero: bool = False) -> Epilogue:
        """The kernel's epilogue. ``clips_at_zero``: the kernel writes a quantization whose
        range starts at 0 (its zero point is the dtype's lowest), which saturates what a
        final ReLU would zero, so the ReLU is left out (and with nothing else to do, the
        whole equation pass between dequantizing and quantizing)."""
        activation, post = self.steps.activation, self.steps.post_activation
        if clips_at_zero and post == "relu":
            post = None
        elif clips_at_zero and activation == "relu" and post is None and not self.steps.residual:
            activation = None
        return replace(self.steps, activation=activation, post_activation=post)


#: Builds a declared kernel writing what its :class:`~.activation_dtypes.KernelIO` says.
BuildKernel = Callable[[KernelIO], tirx.PrimFunc]


class Int8Emitter:
    """Builds int8 GEMM/convolution calls and collects the kernels they need. ``dtype``
    is the kernels' GEMM precision: ``int8`` (u8 x s8 dot products), or ``int16`` where the
    ISA's integer dot product takes s16 pairs (AVX2: the u8 activations are widened on the
    way in, the s8 weights when packed; the sums are the same int32)."""

    def __init__(self, bb: relax.BlockBuilder, isa: str, report: LoweringReport,
                 threads: int = 1, dtype: str = "int8") -> None:
        self.bb = bb
        self.isa = isa
        self.threads = threads
        self.report = report
        self.dtype = dtype
        self.prec = GEMM_PRECISIONS[dtype]
        self.kernels = 0
        self.int8_kernels: set[str] = set()  # the kernel functions' names, as emitted
        #: Declared kernels (built by :func:`build_declared`) and how to build each.
        self.declared: dict[relax.GlobalVar, BuildKernel] = {}
        self.declined: dict[int, tuple[str, bool]] = {}
        self.fp32_rewrites = 0  # integer convolutions rewritten in fp32 (no int8 kernel)

    def decline(self, call: relax.Call, why: str, in_fp32: bool) -> None:
        """Note that no int8 kernel takes the contraction ``call`` (once per layer, however
        many epilogue patterns tried it); ``in_fp32``: it runs in fp32 on its dequantized
        weights instead (a QDQ layer; a ConvInteger rewritten so), else on TVM's code."""
        label = f"{INT8_KERNELS[call.op.name]} ({why})"
        self.declined[tvm_ffi.structural_hash(call)] = (label, in_fp32)

    def in_fp32(self, call: relax.Call) -> None:
        """Note that the declined contraction ``call`` runs in fp32 after all."""
        key = tvm_ffi.structural_hash(call)
        self.declined[key] = (self.declined[key][0], True)
        self.fp32_rewrites += 1

    def report_declined(self) -> None:
        """Report the declined layers: those in fp32 on their dequantized weights (fp32
        TPPs), the others (MatMulInteger) falling back to TVM."""
        for label, in_fp32 in self.declined.values():
            if in_fp32:
                self.report.rewrites[f"{QDQ_IN_FP32}: {label}"] += 1
            else:
                self.report.fallbacks[label] += 1

    def int8_matmul(self, a_q: relax.Expr, a_zp: relax.Expr, w_q: np.ndarray,
                    scale: relax.Expr, name: str, epi: Int8Epilogue = Int8Epilogue()
                    ) -> relax.Expr:
        """``(a_q - a_zp) @ w_q * scale`` in fp32 with ``epi`` in the GEMM's epilogue
        (:func:`_emit` checks first that the kernel takes it)."""
        xs = shape_of(a_q)
        k, n = w_q.shape
        m = int(np.prod(xs[:-1])) if len(xs) > 1 else 1
        a2 = relax.op.reshape(a_q, (m, k)) if len(xs) != 2 else a_q
        res = epi.residual
        res = relax.op.reshape(res, (m, n)) if res is not None and len(xs) != 2 else res
        out = self._gemm(a2, dtype_of(a_q), m, a_zp, w_q, scale, name, epi, res)
        return relax.op.reshape(out, (*xs[:-1], n)) if len(xs) != 2 else out

    def _gemm(self, a2: relax.Expr, a_dtype: str, m: int, a_zp: relax.Expr, w_q: np.ndarray,
              scale: relax.Expr, name: str, epi: Int8Epilogue, residual: relax.Expr | None
              ) -> relax.Expr:
        """The int8 GEMM call on (m, K) rows ``a2`` of ``a_dtype`` (``residual``: (m, N)):
        (m, N) fp32."""
        k, n = w_q.shape
        plan = gemm_plan(m, n, k, self.isa, self.dtype)
        gv = self._declare("tpp_int8_matmul", lambda io: gemm_schedule(
            m, n, k, self.isa, epilogue=epi.kernel(io.clips_at_zero).writing(io.writes),
            dtype=self.dtype, dequantize=True, threads=self.threads)[0].mod["main"])
        a2, zp = self._activations(a2, a_zp, a_dtype)
        packed = relax.const(pack_b_numpy(self._weights(w_q), plan.nr, "kn", plan.kp,
                                          self.prec.vnni))
        colsum = w_q.astype(np.int64).sum(axis=0)
        args = [a2, packed, *_dequantize_rows(scale, zp, colsum, plan.np_, epi),
                *_residual_operands(residual, epi, plan.np_)]
        out = relax.call_tir(gv, args, relax.TensorType((m, n), "float32"))
        self.report.kernels[KernelRow(f"{name}{epi.suffix}", "int8_matmul", self.dtype,
                                      unit_of(runs_on_tiles(self.isa, self.dtype)))] += 1
        return out

    def _declare(self, name: str, build: BuildKernel) -> relax.GlobalVar:
        """A kernel to be built by :func:`build_declared` (``build(io)``), an empty
        placeholder function until then (each its own: the builder merges equal ones)."""
        placeholder = tirx.PrimFunc([], tirx.Evaluate(tirx.const(0, "int32")))
        gv = self.bb.add_func(placeholder.with_attr("tpp.declared", len(self.declared)), name)
        self.declared[gv] = build
        self.kernels += 1
        self.int8_kernels.add(gv.name_hint)
        return gv

    def _activations(self, a: relax.Expr, a_zp: relax.Expr, dtype: str
                     ) -> tuple[relax.Expr, relax.Expr]:
        """Activations ``a`` (u8 or s8) in the kernels' A dtype and their zero point as
        fp32: u8 for the u8 x s8 dot products (s8 shifted by 128), or widened to s16 as
        they are."""
        if self.prec.a == "uint8":
            return _as_uint8(a, a_zp, dtype)
        return relax.op.astype(a, self.prec.a), relax.op.astype(a_zp, "float32")

    def _weights(self, w_q: np.ndarray) -> np.ndarray:
        """s8 weight values in the kernels' B dtype."""
        return w_q.astype(self.prec.b)

    def int8_conv2d(self, a_q: relax.Expr, a_zp: relax.Expr, w_q: np.ndarray,
                    scale: relax.Expr, stride: int, pad: tuple[int, int, int, int],
                    groups: int, name: str, epi: Int8Epilogue = Int8Epilogue(),
                    a_type: tuple[list[int], str] | None = None) -> relax.Expr:
        """``conv2d(a_q - a_zp, w_q) * scale`` in fp32 (NCHW in and out, OIHW filter) with
        ``epi`` in the epilogue. The kernel runs NHWC: the u8 input is transposed on the way
        in, the output on the way out (consecutive convolutions' transposes cancel:
        :func:`~.transposes.sink_transposes`). ``a_type``: ``a_q``'s shape and dtype where
        it is an expression not yet normalized (a conv1d's input made 4-D)."""
        (n, c, h, w), a_dtype = a_type or (shape_of(a_q), dtype_of(a_q))
        oc, _, r, s = w_q.shape
        shape = ConvShape(n, h, w, c, oc, r, s, stride, pad, groups)
        x = relax.op.permute_dims(a_q, TO_NHWC)
        res = epi.residual
        res = relax.op.permute_dims(res, TO_NHWC) if res is not None else None
        if (r, s, stride, groups) == (1, 1, 1, 1) and not any(pad):
            # pointwise: one GEMM over all pixels (far longer M than one output row)
            rows = n * h * w
            out = self._gemm(relax.op.reshape(x, (rows, c)), a_dtype, rows, a_zp,
                             np.ascontiguousarray(w_q[:, :, 0, 0].T), scale, name, epi,
                             None if res is None else relax.op.reshape(res, (rows, oc)))
            return relax.op.permute_dims(relax.op.reshape(out, (n, h, w, oc)), TO_NCHW)
        v = self.prec.vnni
        if groups == 1 and c % v:
            # Channels to whole dot-product groups here (with zero weights, so the values
            # do not matter), where the transpose writes them anyway: the kernel's padding
            # copy then moves whole pixels instead of gathering 3 channels of 4 (a stem's
            # 0.21 of 0.71 ms).
            cp = -(-c // v) * v
            x = relax.op.nn.pad(x, [0, 0, 0, 0, 0, 0, 0, cp - c])
            w_q = np.pad(w_q, ((0, 0), (0, cp - c), (0, 0), (0, 0)))
            c, shape = cp, replace(shape, c=cp)
        taps = tile_filter_width(shape, self.dtype, self.isa)
        if taps != s:  # zero taps that make its filter rows whole tile steps (a stem)
            w_q = np.pad(w_q, ((0, 0), (0, 0), (0, 0), (0, taps - s)))
            shape = replace(shape, s=taps, pad=(*shape.pad[:3], shape.pad[3] + taps - s))
        plan = conv_plan(shape, self.isa, self.dtype)
        gv = self._declare("tpp_int8_conv2d", lambda io: conv_schedule(
            shape, self.isa, epilogue=epi.kernel(io.clips_at_zero).writing(io.writes),
            dtype=self.dtype, threads=self.threads)[0].mod["main"])
        x, zp = self._activations(relax.op.reshape(x, (n, h, w * c)), a_zp, a_dtype)
        # the padding's value: the zero point, in the kernel's A dtype
        zp_a = relax.op.astype(relax.op.reshape(zp, (1,)), self.prec.a)
        packed = relax.const(pack_filter(self._weights(w_q), plan.nr, vnni=self.prec.vnni,
                                         groups=groups))
        colsum = w_q.astype(np.int64).sum(axis=(1, 2, 3))
        args = [x, packed, zp_a, *_dequantize_rows(scale, zp, colsum, plan.np_, epi, groups)]
        # Grouped: the kernel writes (n, oh, ow, groups, channels per group).
        out_shape = (n, shape.oh, shape.ow, *((groups, shape.og) if groups > 1 else (oc,)))
        if res is not None and groups > 1:
            res = relax.op.reshape(res, out_shape)
        args += _residual_operands(res, epi, plan.np_)
        out = relax.call_tir(gv, args, relax.TensorType(out_shape, "float32"))
        if groups > 1:
            out = relax.op.reshape(out, (n, shape.oh, shape.ow, oc))
        self.report.kernels[KernelRow(f"{name}{epi.suffix}", "int8_conv2d", self.dtype,
                                      unit_of(plan.amx))] += 1
        return relax.op.permute_dims(out, TO_NCHW)

    @staticmethod
    def unsupported(a_q, a_zp, w_q, scale, ndim: int = 2) -> str | None:
        if dtype_of(a_q) not in ("uint8", "int8"):
            return f"activation dtype {dtype_of(a_q)}"
        if w_q.ndim != ndim or w_q.min() < -128 or w_q.max() > 127:
            return f"weight is not a {ndim}-D s8 constant"
        if shape_of(a_zp) not in ([], [1]):
            return "per-row activation zero points"
        channels = w_q.shape[1] if ndim == 2 else w_q.shape[0]
        if int(np.prod(shape_of(scale))) not in (1, channels):
            return f"scale of shape {shape_of(scale)}"
        return None


def conv_unsupported(attrs, w_q: np.ndarray) -> str | None:
    """Why the int8 convolution kernel cannot run a Relax conv2d or conv1d (None: it can)."""
    layouts = ("NCHW", "OIHW") if w_q.ndim == 4 else ("NCW", "OIW")
    if (str(attrs.data_layout), str(attrs.kernel_layout)) != layouts:
        return f"layout {attrs.data_layout}/{attrs.kernel_layout}"
    if int(attrs.groups) != 1 and w_q.shape[1] < MIN_INT8_GROUP_CHANNELS:
        return f"groups={int(attrs.groups)}, {w_q.shape[1]} input channels per group"
    if any(int(d) != 1 for d in attrs.dilation):
        return "dilation"
    if len({int(st) for st in attrs.strides}) != 1:
        return "unequal strides"
    return None


def _as_uint8(a: relax.Expr, a_zp: relax.Expr, dtype: str) -> tuple[relax.Expr, relax.Expr]:
    """``a`` (of ``dtype``) as u8 and its zero point as fp32: the VNNI/AMX dot products
    take u8 x s8, so s8 activations (and their zero point) are shifted by 128."""
    zp = relax.op.astype(a_zp, "float32")
    if dtype == "int8":
        a = relax.op.astype(relax.op.add(relax.op.astype(a, "int32"),
                                         relax.const(128, "int32")), "uint8")
        zp = relax.op.add(zp, relax.const(128.0, "float32"))
    return a, zp


def _dequantize_rows(scale: relax.Expr, zp: relax.Expr, colsum: np.ndarray, width: int,
                     epi: Int8Epilogue, groups: int = 1) -> list[relax.Expr]:
    """The int8 kernel's per-column dequantize rows, padded to its packed ``width``:
    ``S = scale`` and ``O = -zp * colsum(W) * S + bias`` (so ``float(A_q @ W) * S + O`` is
    ``(A_q - zp) @ W * scale + bias``: the bias costs no pass of its own); a grouped
    convolution's are ``(groups, width)``, a row per group. With a quantized residual
    (scale s_r, zero point z_r) they are ``S / s_r`` and ``O / s_r - z_r``, the residual's
    own ``- z_r`` folded in (``epilogue_te``: the kernel adds r, then multiplies by s_r)."""
    n = colsum.size
    s = relax.op.reshape(scale, (int(np.prod(shape_of(scale))),))
    s_row = relax.op.multiply(relax.const(np.ones(n, "float32")), s)
    o_row = relax.op.multiply(relax.op.multiply(relax.const(-colsum.astype("float32")), zp),
                              s_row)
    if epi.bias is not None:
        o_row = relax.op.add(o_row, relax.const(epi.bias.reshape(-1).astype("float32")))
    if epi.residual_quantization is not None:
        s_r, z_r = epi.residual_quantization
        s_row = relax.op.multiply(s_row, relax.const(np.float32(1.0 / s_r)))
        o_row = relax.op.subtract(relax.op.multiply(o_row, relax.const(np.float32(1.0 / s_r))),
                                  relax.const(np.float32(z_r)))
    per_group = n // groups
    pad = width - per_group
    if groups > 1:
        s_row, o_row = (relax.op.reshape(row, (groups, per_group)) for row in (s_row, o_row))
    if pad:
        zeros = relax.const(np.zeros((groups, pad) if groups > 1 else pad, "float32"))
        s_row, o_row = (relax.op.concat([row, zeros], axis=-1) for row in (s_row, o_row))
    return [s_row, o_row]


def _residual_operands(residual: relax.Expr | None, epi: Int8Epilogue, width: int
                       ) -> list[relax.Expr]:
    """The kernel's residual arguments: the tile, and a quantized one's scale row."""
    if residual is None:
        return []
    if epi.residual_quantization is None:
        return [residual]
    scale = np.full(width, epi.residual_quantization[0], np.float32)
    return [residual, relax.const(scale)]


@relax.expr_functor.mutator
class _BuildDeclared(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, declared: dict[relax.GlobalVar, BuildKernel],
                 int8_kernels: set[str]) -> None:
        super().__init__(mod)
        self.declared = declared
        self.int8_kernels = int8_kernels
        self.planned: dict[relax.Var, KernelIO] = {}
        self.binding_var: relax.Var | None = None
        self.written: Counter = Counter()

    def writes(self, call: relax.Call) -> tuple[str, ...]:
        return ("uint8", "int8") if _declared_callee(call, self.declared) else ()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.binding_var = binding.var
        super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        build = _declared_callee(call, self.declared)
        if build is None:
            return call
        io = self.planned.get(self.binding_var, FP32_IO)
        kernel = build(io)
        gv = self.builder_.add_func(as_relax_kernel(kernel), call.args[0].name_hint)
        self.int8_kernels.add(gv.name_hint)
        shape = [int(d) for d in call.ty_args[0].shape.values]
        args = list(call.args[1].fields)
        if io.quantization is not None:
            args, one_pass = quantizing_args(args, kernel, shape[-1], io)
            self.written[io.writes] += 1
            if one_pass is not None:
                self.written[one_pass] += 1
        return widened(relax.call_tir(gv, args, relax.TensorType(shape, io.writes)), io)


def _declared_callee(call: relax.Call, declared: dict[relax.GlobalVar, BuildKernel]
                     ) -> BuildKernel | None:
    if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
        return None
    return declared.get(call.args[0])


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def build_declared(mod: tvm.IRModule, emitter: Int8Emitter, report: LoweringReport
                   ) -> tvm.IRModule:
    """Build every kernel ``emitter`` declared, once, writing the u8/s8 quantization its
    readers all apply where they do (:func:`~.activation_dtypes.plan_outputs`), else fp32;
    the readers' quantizations go."""
    pass_ = _BuildDeclared(mod, emitter.declared, emitter.int8_kernels)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
            pass_.planned = plan_outputs(bindings(func), pass_.writes, lambda call, var: False)
            pass_.builder_.update_func(gv, pass_.visit_expr(func))
    report_narrowed(report, pass_.written)
    return without_round_trips(pass_.builder_.get())
