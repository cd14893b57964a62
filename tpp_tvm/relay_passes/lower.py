"""Lower TPP composite functions to ``call_tir`` of TPP-scheduled PrimFuncs.

``FuseOpsByPattern`` groups each matched subgraph into a private function tagged
``Composite="tpp.<pattern>"``. This pass replaces every call of such a function with what
its kernel family (:mod:`.families`) builds: a call of a PrimFunc scheduled onto TPPs
(BRGEMM microkernel + epilogue TPPs), constant weights packed into the kernel's layout
once, at compile time. A composite whose family declines (shape or dtype it has no kernel
for) is inlined back as plain Relax ops, so TVM's default path computes it: never a wrong
result, and the report says why.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import tvm
from tvm import relax
from tvm.relax.analysis import get_var2val

from ..errors import UnsupportedDTypeError
from ..schedules.backward import backward_schedule
from ..schedules.gemm import gemm_schedule
from ..schedules.gemm_plan import runs_on_tiles
from .activation_dtypes import (
    FP32_IO,
    KernelIO,
    narrowed,
    plan_outputs,
    report_narrowed,
    widened,
    without_round_trips,
)
from .exprs import bindings
from .families import FAMILIES, KernelFamily, Lowered, Match, as_relax_kernel
from .patterns import TPPPattern, pattern_table
from .report import KernelRow, LoweringReport, unit_of
from .tuned import composite_kernel, emit_tuned

log = logging.getLogger(__name__)

__all__ = ["FAMILIES", "LoweringReport", "as_relax_kernel", "check_precision",
           "inline_composites", "lower_tagged_kernels", "lower_tpp_composites"]


#: Graph precisions, and the one statement of the bf16 policy. ``bfloat16``: the kernel
#: families that declare it (``KernelFamily.precisions``: dense layers, convolutions by a
#: constant filter, expansion + depthwise pairs on AMX tiles, attention on AMX tiles) run
#: bf16 operands with fp32 accumulation and fp32 epilogues; every other kernel keeps fp32
#: (its report row says so). Activations cross memory in fp32, or in bf16 from a bf16 layer
#: whose readers are all bf16 layers (:mod:`.activation_dtypes`, planned before any kernel
#: is built).
PRECISIONS = ("float32", "bfloat16")


def check_precision(precision: str) -> str:
    """The canonical precision name (``bf16`` is accepted for ``bfloat16``)."""
    name = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32"}.get(precision, precision)
    if name not in PRECISIONS:
        raise UnsupportedDTypeError(
            f"precision {precision!r} is not supported; one of {', '.join(PRECISIONS)} "
            "(bf16); int8 comes from quantized ONNX models (QDQ, MatMulInteger, QLinearMatMul)")
    return name


def _reason(err: Exception) -> str:
    """The first line of an error, for the report (its type when it has no message)."""
    return str(err).splitlines()[0][:120] if str(err) else type(err).__name__


def _match(pattern: TPPPattern, func: relax.Function, args: list[relax.Expr]) -> Match | None:
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
    operands = {}
    for key, pat in pattern.annotations.items():
        expr = found.get(pat)
        if expr is not None:
            operands[key] = params.get(expr, expr)
    return Match(operands, pattern.epilogue, pattern.scale_multiplies)


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
        self.planned: dict[relax.Var, KernelIO] = {}
        self.binding_var: relax.Var | None = None
        self.written: Counter = Counter()  # kernels built writing a narrow dtype
        self.composites: dict[relax.Call, tuple | None] = {}

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
                self.planned = plan_outputs(bindings(func), self._narrow_outputs,
                                            self._takes_bf16, self._is_view)
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def _composite(self, call: relax.Call
                   ) -> tuple[TPPPattern, KernelFamily, str, Match] | None:
        """The pattern, family, precision and match of a call of one of our composites
        (matched once per call: the plan asks of a call as a producer and as a reader)."""
        if call not in self.composites:
            self.composites[call] = self._find_composite(call)
        return self.composites[call]

    def _find_composite(self, call: relax.Call
                        ) -> tuple[TPPPattern, KernelFamily, str, Match] | None:
        if not isinstance(call.op, relax.GlobalVar):
            return None
        func = self.mod_[call.op]
        comp = str(func.attrs["Composite"]) if func.attrs and "Composite" in func.attrs else None
        pattern = self.patterns.get(comp)
        if pattern is None:
            return None
        family = FAMILIES[pattern.lowering]
        matched = _match(pattern, func, list(call.args))
        if matched is None:
            return None
        return pattern, family, family.precision(self.precision), matched

    def _narrow_outputs(self, call: relax.Call) -> tuple[str, ...]:
        found = self._composite(call)
        if found is None or (self.logs is not None and self.precision == "float32"):
            return ()  # (a tuned kernel may replace it: those write fp32)
        _, family, prec, matched = found
        return family.narrow_outputs(matched, prec, self.isa, self.threads)

    def _takes_bf16(self, call: relax.Call, var: relax.Var | None) -> bool:
        found = self._composite(call)
        if found is None or var is None:
            return False
        _, family, prec, matched = found
        key = family.bf16_operand(matched, prec, self.isa, self.threads)
        return key is not None and matched.get(key) is not None \
            and matched[key].same_as(var) \
            and sum(1 for arg in call.args if arg.same_as(var)) == 1

    def _is_view(self, call: relax.Call) -> bool:
        found = self._composite(call)
        return found is not None and found[1].is_view(found[3])

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.binding_var = binding.var
        super().visit_var_binding_(binding)

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
        family = FAMILIES[pattern.lowering]
        matched = _match(pattern, func, list(call.args))
        io = self.planned.get(self.binding_var, FP32_IO)
        try:
            if matched is None:
                raise ValueError("pattern no longer matches its composite function")
            prec = family.precision(self.precision)
            lowered = None
            if prec != "float32" or io != FP32_IO:
                lowered, io = self._planned_kernel(family, matched, comp, prec, io)
                if lowered is not None and prec != "float32" and not lowered.kept_fp32:
                    # on_tiles where the kernel's shape decided; else every prec GEMM of an
                    # AMX target runs on tiles
                    tiles = lowered.on_tiles
                    tiles = runs_on_tiles(self.isa, prec) if tiles is None else tiles
                    row = replace(row, precision=prec, unit=unit_of(tiles))
            if lowered is None:
                io = FP32_IO
                lowered = family.lower(self.builder_, matched, comp, self.isa, "float32",
                                       self.threads)
        except Exception as err:  # noqa: BLE001 - fall back to TVM, keep the model correct
            reason = _reason(err)
            log.info("TPP lowering of %s fell back to TVM: %s", comp, reason)
            self.report.fallbacks[f"{comp} ({reason})"] += 1
            return call
        self.report.kernels[row] += 1
        if io.writes != "float32":
            self.written[io.writes] += 1
        return widened(lowered.expr, io)

    def _planned_kernel(self, family: KernelFamily, matched: Match, comp: str, prec: str,
                        io: KernelIO) -> tuple[Lowered | None, KernelIO]:
        """The ``prec`` kernel built as planned (``io``), else writing fp32 (its readers
        then convert, as they would have), and the dtypes it was built for; None if
        neither builds."""
        planned = self._narrowed(family, matched, prec, io)
        lowered = self._low_precision(family, planned, comp, prec)
        if lowered is None and io.writes != "float32" and prec != "float32":
            planned = planned.with_operands(io=replace(planned.io, writes="float32",
                                                       quantization=None))
            lowered = self._low_precision(family, planned, comp, prec)
        return lowered, planned.io

    def _narrowed(self, family: KernelFamily, matched: Match, prec: str, io: KernelIO
                  ) -> Match:
        """``matched`` with its planned ``io``, and its bf16 operand (if the family takes
        one) as the bf16 tensor a bf16 producer wrote, where one did."""
        key = family.bf16_operand(matched, prec, self.isa, self.threads)
        source = None if key is None else narrowed(matched[key], self.lookup_binding)
        if source is None:
            return matched.with_operands(io=io)
        if isinstance(source, relax.Call):
            source = self.builder_.emit(source)
        return matched.with_operands(io=replace(io, takes="bfloat16"), **{key: source})

    def _low_precision(self, family: KernelFamily, matched: Match, comp: str, prec: str
                       ) -> Lowered | None:
        """The ``prec`` kernel of a composite with its planned dtypes (``matched.io``), or
        None (reported) when it cannot be built: the fp32 TPP kernel then runs it, not TVM's
        untuned code (a matmul there is 100x slower)."""
        try:
            return family.lower(self.builder_, matched, comp, self.isa, prec, self.threads)
        except Exception as err:  # noqa: BLE001 - fp32 TPPs are the next best, not TVM
            reason = _reason(err)
            kind = prec if matched.io.writes == "float32" else f"{prec} -> {matched.io.writes}"
            log.info("%s kernel of %s failed, fp32 TPP instead: %s", kind, comp, reason)
            self.report.rewrites[f"{comp}: {kind} kernel failed, ran on fp32 TPPs ({reason})"] += 1
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
    mod = without_round_trips(lowerer.transform())
    report_narrowed(report, lowerer.written)
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
