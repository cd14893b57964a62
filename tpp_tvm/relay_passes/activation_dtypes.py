"""The dtypes activations cross memory in between kernels, decided before any kernel is
built (TVM's ``ToMixedPrecision`` shape: a graph pass fixes the dtypes, kernels follow).

bf16: a bf16 layer converts its input to bf16 (padded, for a k x k convolution) in a small
kernel of its own (TVM widens a bf16 buffer allocated inside a kernel, so the conversion
cannot be part of the layer's kernel). Where a bf16 layer's output is read only by bf16
layers, it writes bf16 itself (its epilogue ends in a converting copy TPP on the tile): the
readers' conversions go (an unpadded GEMM operand) or only pad (a convolution image,
padded GEMM rows), and the activation crosses memory at half the bytes. Results are
bit-identical to converting afterwards: the same fp32 tile is rounded once, the same way.

int8: a layer's fp32 result that every reader quantizes alike (per tensor: the next int8
layer's input in a QDQ model) is quantized by the layer's epilogue (a quantize TPP,
x * (1/scale) + zero point, rounded half to even and saturated): u8/s8 at a quarter of
the bytes, and no quantization kernel. An int8 layer with no epilogue step between
dequantizing and quantizing requantizes its int32 tile in one pass, the output's 1/scale
and zero point folded into its dequantize rows (:func:`quantizing_args`). Against TVM's
``round(x / scale)`` the reciprocal can move a value within an ulp of a rounding boundary
by one step (ResNet-50 QDQ: 0.018 relative at the output, inside ONNX Runtime's own int8
error).

How it runs: :func:`plan_outputs` decides, from the graph alone, which kernel calls write
which dtype (a :class:`KernelIO` each); each kernel is then built once, writing that
dtype, and its call is wrapped back to fp32 (:func:`widened`: an ``astype`` or a
``dequantize``), so the graph is correct whatever a kernel ends up doing. Readers see
through the wrapper: a bf16 layer takes the narrow tensor (:func:`narrowed`), a
quantization of a dequantized tensor with the same parameters is the tensor
(:func:`without_round_trips`), and the wrappers die.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from ..schedules.gemm_te import REQUANTIZE_ROWS, RESIDUAL_REQUANTIZE_ROWS
from .exprs import scalar_value

__all__ = ["FP32_IO", "NARROWED", "REQUANTIZED", "REQUANTIZED_RESIDUAL", "KernelIO",
           "narrowed", "output_quantization", "plan_outputs", "quantizing_args",
           "readers_through_views", "report_narrowed", "widened", "without_round_trips"]

#: The quantized dtypes a kernel may write, and each one's lowest value (a zero point there:
#: the range starts at 0, so a final ReLU is the quantization's own clipping).
_LOWEST = {"uint8": 0.0, "int8": -128.0}


@dataclass(frozen=True)
class KernelIO:
    """The dtypes a kernel is built for: ``takes`` its activation input in (``bfloat16``:
    a bf16 layer's output, no conversion), ``writes`` its output in, and ``quantization``
    (scale, zero point) where it writes u8/s8."""

    takes: str = "float32"
    writes: str = "float32"
    quantization: tuple[float, float] | None = None

    @property
    def clips_at_zero(self) -> bool:
        """Whether the quantization written starts at 0 (a final ReLU may go)."""
        return self.quantization is not None and self.quantization[1] == _LOWEST[self.writes]


#: A kernel's dtypes where nothing was planned: fp32 in and out.
FP32_IO = KernelIO()

#: Ops a reader may reach a tensor through: views, and a transpose (which commutes with a
#: per-tensor quantization and with a conversion).
_VIEWS = tuple(tvm.ir.Op.get(f"relax.{op}") for op in ("reshape", "permute_dims"))
_QUANTIZE = tvm.ir.Op.get("relax.quantize")
_DEQUANTIZE = tvm.ir.Op.get("relax.dequantize")
_ASTYPE = tvm.ir.Op.get("relax.astype")


def _is(value: relax.Expr, op: tvm.ir.Op) -> bool:
    return isinstance(value, relax.Call) and value.op.same_as(op)


def _is_view(value: relax.Expr) -> bool:
    return any(_is(value, op) for op in _VIEWS)


def readers_through_views(values: dict[relax.Var, relax.Expr],
                          is_view: Callable[[relax.Call], bool] = lambda call: False
                          ) -> Callable[[relax.Var], list[relax.Var] | None]:
    """For the bindings ``values`` (var -> value, in order): a function giving the bindings
    that read a variable through views and aliases, or None if the value escapes (an
    output, or a binding outside a dataflow block). ``is_view``: calls that are views too
    (a kernel family's that lowers to one)."""
    uses: dict[relax.Var, list[relax.Var]] = {}
    for var, value in values.items():
        for arg in _args(value):
            if isinstance(arg, relax.Var):
                uses.setdefault(arg, []).append(var)

    def readers(var: relax.Var) -> list[relax.Var] | None:
        if not isinstance(var, relax.DataflowVar):
            return None
        found = []
        for user in uses.get(var, []):
            value = values[user]
            if isinstance(value, relax.Var) or _is_view(value) or is_view(value):
                more = readers(user)
                if more is None:
                    return None
                found += more
            else:
                found.append(user)
        return found

    return readers


def _args(value: relax.Expr) -> list[relax.Expr]:
    if isinstance(value, relax.Var):
        return [value]
    if not isinstance(value, relax.Call):
        return []
    return [f for a in value.args for f in (a.fields if isinstance(a, relax.Tuple) else [a])]


def output_quantization(value: relax.Expr) -> tuple[float, float, str] | None:
    """(scale, zero point, dtype) of a per-tensor ``relax.quantize`` call, else None."""
    if not _is(value, _QUANTIZE):
        return None
    scale, zero = (scalar_value(a) for a in value.args[1:3])
    if scale is None or zero is None or scale == 0:
        return None
    return scale, zero, str(value.attrs.out_dtype)


def plan_outputs(values: dict[relax.Var, relax.Expr],
                 writes: Callable[[relax.Call], tuple[str, ...]],
                 takes_bf16: Callable[[relax.Call, relax.Var], bool],
                 is_view: Callable[[relax.Call], bool] = lambda call: False
                 ) -> dict[relax.Var, KernelIO]:
    """Which kernel calls among the bindings ``values`` write a narrow dtype: bf16 where
    every reader (through views) takes that operand in bf16, u8/s8 where every reader
    quantizes it alike (per tensor). ``writes(call)``: the narrow dtypes a kernel call can
    write (empty: none, or not a kernel); ``takes_bf16(call, var)``: whether the call
    takes its operand ``var`` in bf16; ``is_view(call)``: calls that will be views."""
    readers = readers_through_views(values, is_view)
    plan = {}
    for var, value in values.items():
        dtypes = writes(value) if isinstance(value, relax.Call) else ()
        if not dtypes:
            continue
        found = readers(var) or []
        if not found:
            continue
        if "bfloat16" in dtypes and all(
                takes_bf16(values[r], _read_var(values, r, var, is_view)) for r in found):
            plan[var] = KernelIO(writes="bfloat16")
            continue
        quantizations = {output_quantization(values[r]) for r in found}
        if len(quantizations) == 1 and None not in quantizations:
            scale, zero, dtype = quantizations.pop()
            if dtype in dtypes:
                plan[var] = KernelIO(writes=dtype, quantization=(scale, zero))
    return plan


def _read_var(values: dict[relax.Var, relax.Expr], reader: relax.Var, source: relax.Var,
              is_view: Callable[[relax.Call], bool]) -> relax.Var | None:
    """The variable through which binding ``reader`` reads ``source`` (itself, or the last
    view of it)."""
    for arg in _args(values[reader]):
        var = arg
        while isinstance(var, relax.Var):
            if var.same_as(source):
                return arg
            value = values.get(var)
            var = value if isinstance(value, relax.Var) else (
                value.args[0] if value is not None and (_is_view(value) or is_view(value))
                else None)
    return None


def widened(expr: relax.Expr, io: KernelIO) -> relax.Expr:
    """A kernel's output written as ``io.writes``, back as the fp32 value the graph had."""
    if io.writes == "float32":
        return expr
    if io.quantization is None:
        return relax.op.astype(expr, "float32")
    scale, zero = io.quantization
    return relax.op.dequantize(expr, relax.const(np.float32(scale)),
                               relax.const(np.int32(zero)), axis=-1, out_dtype="float32")


def narrowed(expr: relax.Expr, lookup: Callable[[relax.Var], relax.Expr | None],
             quantization: tuple[float, float, str] | None = None) -> relax.Expr | None:
    """The narrow tensor behind ``expr``, views re-applied: the bf16 source of an
    ``astype`` to fp32 (``quantization`` None), or the u8/s8 source of a ``dequantize``
    whose parameters are ``quantization``; None where ``expr`` is not such a widening."""
    value = lookup(expr) if isinstance(expr, relax.Var) else expr
    if value is None:
        return None
    if isinstance(value, relax.Var):
        return narrowed(value, lookup, quantization)
    if _is_view(value):
        inner = narrowed(value.args[0], lookup, quantization)
        return None if inner is None else relax.Call(value.op, [inner, *value.args[1:]],
                                                     value.attrs)
    source = value.args[0] if isinstance(value, relax.Call) else None
    if quantization is None:
        if _is(value, _ASTYPE) and str(source.ty.dtype) == "bfloat16":
            return source
        return None
    if _is(value, _DEQUANTIZE) and str(source.ty.dtype) == quantization[2] \
            and _same_quantization(value, quantization):
        return source
    return None


def _same_quantization(dequantize: relax.Call, quantization: tuple[float, float, str]) -> bool:
    scale, zero = (scalar_value(a) for a in dequantize.args[1:3])
    return scale is not None and zero is not None \
        and np.float32(scale) == np.float32(quantization[0]) and zero == quantization[1]


@relax.expr_functor.mutator
class _WithoutRoundTrips(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        quantization = output_quantization(call)
        if quantization is None:
            return call
        source = narrowed(call.args[0], self.lookup_binding, quantization)
        return call if source is None else self.builder_.normalize(source)


def without_round_trips(mod: tvm.IRModule) -> tvm.IRModule:
    """``quantize(dequantize(q, s, z), s, z)`` -> ``q`` (views between kept, on ``q``): a
    kernel that wrote its readers' quantization (its call wrapped by :func:`widened`)
    feeds them directly. Exact: the codes round back to themselves."""
    pass_ = _WithoutRoundTrips(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
            pass_.builder_.update_func(gv, pass_.visit_expr(func))
    return relax.transform.DeadCodeElimination()(pass_.builder_.get())


def quantizing_args(args: list[relax.Expr], func: tirx.PrimFunc, width: int,
                    io: KernelIO) -> tuple[list[relax.Expr], str | None]:
    """The arguments of ``func``, a kernel built to quantize its output as ``io`` says,
    from those of the same kernel writing fp32 (``args``), and which one-pass kind it is
    (a :data:`NARROWED` key, or None):

    * two passes: the arguments and the quantization's rows (``width`` columns);
    * requantizing its int32 tile in one pass (:data:`REQUANTIZE_ROWS` stand where the
      dequantize rows S, O were): S, O replaced by ``S q`` and ``O q + z``;
    * adding its residual and requantizing in one pass
      (:data:`RESIDUAL_REQUANTIZE_ROWS`): the residual's scale row replaced by it times q,
      then the zero point row."""
    scale, zero = io.quantization
    inv_scale = 1.0 / scale
    names = [str(p.name) for p in func.params]
    q = relax.const(np.float32(inv_scale))
    zeros = relax.const(np.full(width, zero, np.float32))
    if RESIDUAL_REQUANTIZE_ROWS[0] in names:
        i = names.index(RESIDUAL_REQUANTIZE_ROWS[0])
        return [*args[:i], relax.op.multiply(args[i], q), zeros, *args[i + 1:]], \
            REQUANTIZED_RESIDUAL
    if REQUANTIZE_ROWS[0] not in names:
        return [*args, relax.const(np.full(width, inv_scale, np.float32)), zeros], None
    i = names.index(REQUANTIZE_ROWS[0])
    args = list(args)
    args[i:i + 2] = [relax.op.multiply(args[i], q),
                     relax.op.add(relax.op.multiply(args[i + 1], q),
                                  relax.const(np.float32(zero)))]
    return args, REQUANTIZED


#: How the report names the layers that write the next layer's dtype.
NARROWED = {"bfloat16": "bf16 activations: layers writing bf16 for the next bf16 layer",
            "uint8": "int8 activations: layers writing the next int8 layer's quantized input",
            "int8": "int8 activations: layers writing the next int8 layer's quantized input",
            "requantized": "int8 activations: of those, layers requantizing their int32 tile "
                           "in one pass (nothing between dequantizing and quantizing)",
            "requantized_residual": "int8 activations: of those, layers adding their "
                                    "quantized residual and requantizing in one pass"}
#: The :data:`NARROWED` key of the producers that requantize in one pass.
REQUANTIZED = "requantized"
#: The :data:`NARROWED` key of the producers that add a residual and requantize in one pass.
REQUANTIZED_RESIDUAL = "requantized_residual"


def report_narrowed(report, written: Counter) -> None:
    """Count in ``report.rewrites`` the kernels that write a narrow dtype (by
    :data:`NARROWED` key)."""
    for key, count in written.items():
        report.rewrites[NARROWED[key]] += count
