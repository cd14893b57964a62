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
from dataclasses import replace

import tvm
from tvm import relax
from tvm.relax.analysis import get_var2val

from ..errors import UnsupportedDTypeError
from ..schedules.backward import backward_schedule
from ..schedules.gemm import gemm_schedule
from ..schedules.gemm_plan import runs_on_tiles
from .families import FAMILIES, KernelFamily, Lowered, Match, as_relax_kernel
from .lowp_activations import LowpOffers, lowp_activations, report_narrowed
from .patterns import TPPPattern, pattern_table
from .report import KernelRow, LoweringReport, unit_of
from .tuned import composite_kernel, emit_tuned

log = logging.getLogger(__name__)

__all__ = ["FAMILIES", "LoweringReport", "as_relax_kernel", "check_precision",
           "inline_composites", "lower_tagged_kernels", "lower_tpp_composites"]


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
        family = FAMILIES[pattern.lowering]
        matched = _match(pattern, func, list(call.args))
        try:
            if matched is None:
                raise ValueError("pattern no longer matches its composite function")
            prec = family.precision(self.precision)
            lowered = None
            if prec != "float32":
                lowered = self._low_precision(family, matched, comp, prec)
                if lowered is not None and not lowered.kept_fp32:
                    # on_tiles where the kernel's shape decided; else every prec GEMM of an
                    # AMX target runs on tiles
                    tiles = lowered.on_tiles
                    tiles = runs_on_tiles(self.isa, prec) if tiles is None else tiles
                    row = replace(row, precision=prec, unit=unit_of(tiles))
            if lowered is None:
                lowered = family.lower(self.builder_, matched, comp, self.isa, "float32",
                                       self.threads)
        except Exception as err:  # noqa: BLE001 - fall back to TVM, keep the model correct
            reason = _reason(err)
            log.info("TPP lowering of %s fell back to TVM: %s", comp, reason)
            self.report.fallbacks[f"{comp} ({reason})"] += 1
            return call
        self.report.kernels[row] += 1
        self.lowp_offers.producers.update(lowered.offers.producers)
        self.lowp_offers.conversions.update(lowered.offers.conversions)
        self.lowp_offers.producer_dtypes.update(lowered.offers.producer_dtypes)
        return lowered.expr

    def _low_precision(self, family: KernelFamily, matched: Match, comp: str, prec: str
                       ) -> Lowered | None:
        """The ``prec`` kernel of a composite, or None (reported) when it cannot be built:
        the fp32 TPP kernel then runs it, not TVM's untuned code (a matmul there is 100x
        slower)."""
        try:
            return family.lower(self.builder_, matched, comp, self.isa, prec, self.threads)
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
