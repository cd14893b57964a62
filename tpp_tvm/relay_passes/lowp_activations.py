"""Low-precision activations between low-precision layers: no fp32 round trip.

bf16: a bf16 layer takes its input as bf16 (padded, for a k x k convolution) from a small
conversion kernel of its own (TVM widens a bf16 buffer allocated inside a kernel, so the
conversion cannot be part of the layer's kernel). Where that input is the output of
another bf16 layer and only bf16 layers read it, the producer writes bf16 itself (its
epilogue ends in a converting copy TPP on the tile, ``epilogue_te(out_dtype=...)``): the
conversion kernel goes (unpadded GEMM operand) or only pads (convolution image, padded
GEMM rows), and the activation crosses memory at half the bytes. Results are bit-identical
to converting afterwards: the same fp32 tile is rounded once, the same way.

int8: an int8 layer's fp32 result that every reader quantizes alike (per tensor: the next
int8 layer's input in a QDQ model) is quantized by the producer's epilogue (a quantize
TPP, x * (1/scale) + zero point, rounded half to even and saturated), which writes u8/s8
at a quarter of the bytes and leaves out the quantization kernel; with no epilogue step
between (a final ReLU the quantization's range already clips, or none), the producer
requantizes its int32 tile in one pass, the output's 1/scale and zero point folded into its
dequantize rows here (``_quantizing_args``). Against TVM's
``round(x / scale)`` the reciprocal can move a value that lies within an ulp of a rounding
boundary by one step (ResNet-50 QDQ: 0.018 relative at the output, inside ONNX Runtime's
own int8 error).

The lowerings (``lower.py``, ``quantized.py``) offer, per kernel they emit, how to rebuild
it: a producer writing another dtype, a bf16 conversion kernel taking bf16 (or none
needed). This pass rewrites the call sites of a producer whose readers (through reshapes,
aliases and transposes) are all such conversions, or all the same quantization: one
reader, or several (a ResNet stage's first block and its downsampling shortcut both read
the previous block's output).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax, tirx

from ..schedules.gemm_te import REQUANTIZE_ROWS, RESIDUAL_REQUANTIZE_ROWS

#: Rebuilds a producer to write the given dtype (bfloat16, uint8, int8); the flag says
#: that the quantization it writes clips at 0 (its zero point is the dtype's lowest), so a
#: final ReLU of the producer's may go.
RebuildProducer = Callable[[str, bool], tirx.PrimFunc]
#: Rebuilds a conversion kernel to take bf16 (offered as None: not needed then).
Rebuild = Callable[[], tirx.PrimFunc]


@dataclass
class LowpOffers:
    """What the lowering can rebuild, by kernel (GlobalVar) name."""

    producers: dict[str, RebuildProducer] = field(default_factory=dict)
    conversions: dict[str, Rebuild | None] = field(default_factory=dict)
    #: The dtypes a producer can write, where not all of them (a depthwise convolution
    #: quantizes its output, but writes no bf16).
    producer_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def writes(self, producer: str, dtype: str) -> bool:
        """Whether ``producer`` can be rebuilt to write ``dtype``."""
        return dtype in self.producer_dtypes.get(producer, (dtype,))


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
#: Ops a reader may reach the producer through: views, and a transpose (which commutes
#: with a per-tensor quantization and with a conversion).
_PASS_THROUGH = tuple(tvm.ir.Op.get(f"relax.{op}") for op in ("reshape", "permute_dims"))
_QUANTIZE = tvm.ir.Op.get("relax.quantize")
#: The lowest value of each quantized dtype (a zero point there: the range starts at 0).
_LOWEST = {"uint8": 0.0, "int8": -128.0}


def _scalar_constant(expr: relax.Expr) -> float | None:
    value = getattr(expr, "value", None)
    if not hasattr(value, "numpy"):
        return None
    array = value.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _quantization(value: relax.Expr) -> tuple[float, float, str] | None:
    """(scale, zero point, dtype) of a per-tensor ``relax.quantize`` call, else None."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_QUANTIZE)):
        return None
    scale, zero = (_scalar_constant(a) for a in value.args[1:3])
    if scale is None or zero is None or scale == 0:
        return None
    return scale, zero, str(value.attrs.out_dtype)


def _tir_callee(value: relax.Expr) -> str | None:
    if isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR):
        return value.args[0].name_hint
    return None


@relax.expr_functor.mutator
class _LowpActivations(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, offers: LowpOffers) -> None:
        super().__init__(mod)
        self.offers = offers
        self.producer_calls: dict = {}  # producer call -> (rebuild, dtype, extra arguments)
        # reader call -> its bf16-input rebuild, or None: the producer's output replaces it
        self.conversion_calls: dict = {}
        self.rewritten: Counter = Counter()

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        uses = relax.analysis.udchain(block)
        values = {b.var: b.value for b in block.bindings}

        def readers(var: relax.Var) -> list[relax.Var] | None:
            """The bindings reading ``var``, through views, aliases and transposes; None
            if one is not in this dataflow block (an output)."""
            found = []
            for user in uses.get(var, []):
                if not isinstance(user, relax.DataflowVar):
                    return None
                value = values[user]
                if isinstance(value, relax.Var) or (
                        isinstance(value, relax.Call)
                        and any(value.op.same_as(op) for op in _PASS_THROUGH)):
                    more = readers(user)
                    if more is None:
                        return None
                    found += more
                else:
                    found.append(user)
            return found

        for var, value in values.items():
            producer = _tir_callee(value)
            if producer not in self.offers.producers or not isinstance(var, relax.DataflowVar):
                continue
            found = [values[r] for r in readers(var) or []]
            rebuild = self.offers.producers[producer]
            if found and all(_tir_callee(r) in self.offers.conversions for r in found) \
                    and self.offers.writes(producer, "bfloat16"):
                self.producer_calls[value] = (rebuild, "bfloat16", False, None)
                for r in found:
                    self.conversion_calls[r] = self.offers.conversions[_tir_callee(r)]
                continue
            quantizations = {_quantization(r) for r in found}
            if len(quantizations) == 1 and None not in quantizations \
                    and self.offers.writes(producer, next(iter(quantizations))[2]):
                scale, zero, dtype = quantizations.pop()
                clips = zero == _LOWEST[dtype]
                self.producer_calls[value] = (rebuild, dtype, clips, (1.0 / scale, zero))
                for r in found:
                    self.conversion_calls[r] = None  # the producer's output is the result
        return super().visit_dataflow_block_(block)

    def _call(self, call: relax.Call, func: tirx.PrimFunc, suffix: str, dtype: str,
              quantization: tuple[float, float] | None = None) -> relax.Call:
        gv = self.builder_.add_func(func, call.args[0].name_hint + suffix)
        shape = [int(d) for d in call.ty_args[0].shape.values]
        args = list(call.args[1].fields)
        if quantization is not None:
            args, one_pass = _quantizing_args(args, func, shape[-1], *quantization)
            if one_pass is not None:  # (no report line where none does)
                self.rewritten[one_pass] += 1
        return relax.call_tir(gv, args, relax.TensorType(shape, dtype))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        producer = self.producer_calls.get(call)
        is_reader = call in self.conversion_calls
        rebuild_reader = self.conversion_calls.get(call)
        if is_reader and call.op.same_as(_QUANTIZE):  # u8/s8 already: the quantization goes
            return self.visit_expr(call.args[0])
        new = super().visit_call_(call)
        if producer is not None:
            rebuild, dtype, clips, quantization = producer
            self.rewritten[dtype] += 1
            return self._call(new, rebuild(dtype, clips), f"_out_{_SHORT[dtype]}", dtype,
                              quantization)
        if is_reader:
            if rebuild_reader is None:  # the producer's output is the operand as it is
                return new.args[1].fields[0]
            return self._call(new, rebuild_reader(), "_from_bf16", "bfloat16")
        return new


_SHORT = {"bfloat16": "bf16", "uint8": "u8", "int8": "s8"}


def _quantizing_args(args: list[relax.Expr], func: tirx.PrimFunc, width: int, inv_scale: float,
                     zero: float) -> tuple[list[relax.Expr], str | None]:
    """The arguments of ``func``, a producer rebuilt to quantize its output (1/scale
    ``inv_scale``, zero point ``zero``), from the fp32 producer's ``args``, and which
    one-pass kind ``func`` is (a :data:`NARROWED` key, or None):

    * two passes: the arguments and the quantization's rows (``width`` columns);
    * requantizing its int32 tile in one pass (:data:`REQUANTIZE_ROWS` stand where the
      dequantize rows S, O were): S, O replaced by ``S q`` and ``O q + z``;
    * adding its residual and requantizing in one pass
      (:data:`RESIDUAL_REQUANTIZE_ROWS`): the residual's scale row replaced by it times q,
      then the zero point row."""
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
    args[i:i + 2] = [relax.op.multiply(args[i], q),
                     relax.op.add(relax.op.multiply(args[i + 1], q),
                                  relax.const(np.float32(zero)))]
    return args, REQUANTIZED


def lowp_activations(mod: tvm.IRModule, offers: LowpOffers) -> tuple[tvm.IRModule, Counter]:
    """``mod`` with producers writing bf16 where all their readers convert to bf16, and
    u8/s8 where all their readers quantize alike; returns it and how many producers now
    write each dtype. Unused fp32 kernels are left for dead-code elimination."""
    if not offers.producers:
        return mod, Counter()
    pass_ = _LowpActivations(mod, offers)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
            pass_.builder_.update_func(gv, pass_.visit_expr(func))
    return pass_.builder_.get(), pass_.rewritten


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
    """Count in ``report.rewrites`` the producers :func:`lowp_activations` rebuilt."""
    for dtype, count in written.items():
        report.rewrites[NARROWED[dtype]] += count
