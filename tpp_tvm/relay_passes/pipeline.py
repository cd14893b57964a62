"""The ``tpp`` Relax pipeline and ``build``: the Relax counterpart of ``relay.build``.

``tvm.compile(mod, target=tpp_tvm.target(), relax_pipeline="tpp")`` runs:

0. quantized matmuls (ONNX dynamic / QDQ / QLinearMatMul forms) become int8 TPP GEMMs;
1. inference simplification (batch norm folded, constants folded, decomposed GELU
   recognised);
2. the TPP graph pass — ``FuseOpsByPattern`` with the TPP pattern table, then each
   composite lowered to a TPP-scheduled kernel (weights packed at compile time), or to
   its tuned kernel when a tuning log has a faster one;
3. TVM's CPU legalization and fusion for everything else, then the default schedules
   (``schedules/default.py``) so the leftovers are parallel and vectorized;
4. TVM's dataflow lowering and finalization.

Step 2 runs only for targets whose keys include ``"tpp"``; other targets get steps 1, 3, 4.
"""

from __future__ import annotations

import logging
import os
import re
import time

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic.pipeline import (
    dataflow_lower_passes,
    finalize_passes,
    legalize_passes,
    library_dispatch_passes,
)

from ..runtime import target_threads
from ..schedules.default import default_schedule_pass
from ..schedules.gemm_plan import check_low_precision
from ..target import is_tpp_target, isa_of
from ..target import target as tpp_target
from ..tir_pipeline import PIPELINE as TIR_PIPELINE
from ..tuning.logs import TuneLogs, resolve_logs
from .batched_matmul import UnflattenBatchedMatmuls
from .canonical_forms import CanonicalizeOperatorForms
from .canonicalize import CanonicalizeActivations
from .gathers import injective_gathers
from .instance_norm import ChannelsLastInstanceNorm
from .lower import (
    check_precision,
    lower_tagged_kernels,
    lower_tpp_composites,
)
from .patterns import pattern_table
from .quantized import SplitFullReductions, lower_quantized
from .report import LoweringReport
from .residual_order import OrderResidualOperands
from .scalar_constants import fold_scalar_constants
from .shared_constants import SharedConstants
from .transposes import SinkLayoutTransposes
from .weight_only import lower_weight_only

PIPELINE_NAME = "tpp"
log = logging.getLogger(__name__)


def quantized_pass(isa: str, report: LoweringReport, threads: int = 1
                   ) -> tvm.transform.Pass:
    """Quantized matmuls (dynamic and QDQ forms) onto int8 TPP GEMMs (s16 ones where the
    enclosing target's CPU has no u8 x s8 dot product)."""

    @tvm.transform.module_pass(opt_level=0, name="tpp.LowerQuantizedMatmuls")
    def _quantized(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return lower_quantized(mod, isa, report, threads,
                               tvm.target.Target.current(allow_none=True))

    return _quantized


def weight_only_pass(isa: str, report: LoweringReport) -> tvm.transform.Pass:
    """Weight-only quantized matmuls (``MatMulNBits``) onto the weight-only kernel, the
    weights kept packed."""

    @tvm.transform.module_pass(opt_level=0, name="tpp.LowerWeightOnlyMatmuls")
    def _weight_only(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return lower_weight_only(mod, isa, report, tvm.target.Target.current(allow_none=True))

    return _weight_only


def simplify_passes(isa: str | None = None, report: LoweringReport | None = None,
                    threads: int = 1) -> list[tvm.transform.Pass]:
    """Inference simplification; on a TPP ISA, quantized matmuls become int8 TPPs first."""
    # torch's bmm between views of batched operands back to their matmul (attention, a
    # Linear of a strided input), before folding makes a broadcast weight a constant.
    passes = [UnflattenBatchedMatmuls, CanonicalizeActivations]
    if isa is not None:
        # Before constant folding, which would fold the s8 weights' casts away; after
        # canonicalization, so a GELU after a quantized matmul fuses into its epilogue.
        report = report if report is not None else LoweringReport()
        passes.append(quantized_pass(isa, report, threads))
        # Before constant folding too, which would expand the packed weights to fp32.
        passes.append(weight_only_pass(isa, report))
    return passes + [
        relax.transform.DecomposeOpsForInference(),
        fold_constants(),
        CanonicalizeActivations,
    ]


def fold_constants() -> tvm.transform.Pass:
    """``FoldConstant``, undone where it leaves the module ill-formed.

    On a ``dynamic_strided_slice`` of a statically shaped tensor (ONNX Slice with starts and
    ends given at run time) TVM's FoldConstant emits a ``call_tir`` of a ``shape_func`` it
    never adds to the module; the build then fails with an ``InternalError`` ("There is no
    definition of shape_func") on a graph TVM's default build (which does not fold) runs.
    Scalar ops ``FoldConstant`` skips are evaluated first (:mod:`.scalar_constants`)."""

    @tvm.transform.module_pass(opt_level=0, name="tpp.FoldConstant")
    def _fold(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        folded, _ = fold_scalar_constants(mod)
        folded = relax.transform.FoldConstant()(folded)
        if _well_formed(folded) or not _well_formed(mod):
            return folded
        log.debug("FoldConstant left the module ill-formed; kept it unfolded")
        return mod

    return _fold


def _well_formed(mod: tvm.IRModule) -> bool:
    try:
        relax.analysis.well_formed(mod)  # raises (ValueError) when ill-formed
    except Exception:  # noqa: BLE001
        return False
    return True


def nhwc_convolutions(report: LoweringReport | None = None) -> tvm.transform.Pass:
    """Convolutions NHWC with HWIO filters (``ConvertLayout``), or left as they are where
    TVM's ConvertLayout fails: it rejects tuple-valued ops (Unique, TopK, Split chains)
    with an ``InternalError`` even in modules without a convolution. Convolutions left
    NCHW fall back to TVM (the TPP patterns match NHWC), which the report says."""
    convert = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "HWIO"]})

    @tvm.transform.module_pass(opt_level=0, name="tpp.ConvertLayoutNHWC")
    def _convert(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        try:
            return convert(mod)
        except Exception as err:  # noqa: BLE001 - correct on TVM's path, only slower
            reason = str(err).strip().splitlines()[-1][:100] if str(err).strip() else \
                type(err).__name__
            log.info("ConvertLayout failed (%s); convolutions stay NCHW", reason)
            if report is not None:
                report.fallbacks["NHWC layout conversion (TVM's ConvertLayout failed)"] += 1
            return mod

    return _convert


def partition_passes(isa: str, report: LoweringReport | None = None, threads: int = 1
                     ) -> list[tvm.transform.Pass]:
    """Simplification and TPP partitioning: each matched subgraph becomes a composite
    (quantized contractions become int8 kernels sized for ``threads``)."""
    return [
        *simplify_passes(isa, report, threads),
        # Pooling over the whole input, 1-D and grouped convolutions as forms with kernels.
        CanonicalizeOperatorForms,
        fold_constants(),
        # Convolutions run NHWC on TPPs; layout transposes are inserted only at the edges.
        # Filters HWIO: output channels innermost, so a convolution subgraph's loop nest is
        # a contraction the tuning rules tile around a TPP (OHWI has K innermost).
        nhwc_convolutions(report),
        fold_constants(),  # the filters' layout transposes: constants the passes can read
        # A per-channel norm between two layout transposes runs channels-last instead.
        ChannelsLastInstanceNorm,
        relax.transform.DeadCodeElimination(),
        SinkLayoutTransposes,
        fold_constants(),
        # DynamicQuantizeLinear's range reductions, once no transpose needs to pass them.
        SplitFullReductions,
        OrderResidualOperands,
        relax.transform.FuseOpsByPattern(
            [p.as_fusion_pattern() for p in pattern_table()],
            bind_constants=True,
            annotate_codegen=False,
        ),
    ]


def tpp_kernel_passes(target: tvm.target.Target, report: LoweringReport,
                      precision: str = "float32", logs: TuneLogs | None = None,
                      force_tuned: bool = False) -> list:
    """Steps 0-3: ``main`` becomes a dataflow of ``call_tir`` into scheduled kernels.

    Separate from the VM lowering so a model can also be run without TVM's runtime (the
    aarch64 harness in ``tpp_tvm.cross`` calls the kernels in this order itself).
    """
    if is_tpp_target(target):
        isa = isa_of(target)

        @tvm.transform.module_pass(opt_level=0, name="tpp.LowerTPPComposites")
        def lower(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
            return lower_tpp_composites(lower_tagged_kernels(mod, isa, report), isa, report,
                                        precision, logs, force_tuned, target_threads(target))

        passes = [*partition_passes(isa, report, target_threads(target)), lower]
        if logs is not None:
            # Tuned kernels that pack their weights: the packing becomes its own call,
            # folded into the constant weights at build time.
            passes += [relax.transform.SplitLayoutRewritePreproc(), fold_constants()]
    else:
        passes = simplify_passes()
    passes += library_dispatch_passes(target) + _with_injective_gathers(legalize_passes(target))
    passes += [_record_default_scheduled(report), default_schedule_pass()]
    return passes


#: Ops that only re-index memory: kernels made of nothing else are not worth listing.
_VIEW_OPS = frozenset({"reshape", "squeeze", "expand_dims"})


def _record_default_scheduled(report: LoweringReport) -> tvm.transform.Pass:
    """Name in ``report`` the kernels left for the default schedules, leaving out pure
    reshapes, and the TPP kernels: those scheduled before the default schedules run (every
    TPP lowering emits its kernel scheduled, ``as_relax_kernel``; tuned ones too)."""

    @tvm.transform.module_pass(opt_level=0, name="tpp.RecordDefaultScheduled")
    def _record(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
                report.tpp_functions.append(gv.name_hint)
                continue
            ops = {re.sub(r"\d+$", "", t) for t in gv.name_hint.split("_")} - {"fused"}
            if not ops <= _VIEW_OPS:
                report.default_scheduled.append(gv.name_hint)
        return mod

    return _record


def tpp_pipeline(report: LoweringReport | None = None, precision: str = "float32",
                 logs: TuneLogs | None = None, force_tuned: bool = False
                 ) -> tvm.transform.Pass:
    """The whole ``tpp`` pipeline; the target comes from the enclosing ``with target``.

    ``logs`` (an opened tuning log) replaces hand-scheduled subgraphs by tuned kernels
    where tuning found faster ones (``force_tuned``: wherever it has a record).
    """
    report = report if report is not None else LoweringReport()
    precision = check_precision(precision)

    @tvm.transform.module_pass(opt_level=0, name="tpp.Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current()
        if target is None:
            raise ValueError("the tpp pipeline needs a target (tvm.compile(..., target=...))")
        passes = tpp_kernel_passes(target, report, precision, logs, force_tuned)
        passes += _without_redundant_reshapes(dataflow_lower_passes(target))
        passes += finalize_passes(target)
        return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def _with_injective_gathers(passes: list) -> list:
    """``passes`` with :func:`~.gathers.injective_gathers` after ``AnnotateTIROpPattern``,
    so a gather fuses with its consumers."""
    out = []
    for p in passes:
        out.append(p)
        if p.info.name == "AnnotateTIROpPattern":
            out.append(injective_gathers)
    return out


def _without_redundant_reshapes(passes: list) -> list:
    """``passes`` with ``RemoveRedundantReshape`` after ``RewriteDataflowReshape``.

    Each TPP kernel takes and gives its own view of a tensor (a convolution's (N*H*W, C)
    rows, the 4-D image between layers), so consecutive kernels leave reshape chains and
    reshapes to the shape a tensor already has; as views they cost no copy, but each was
    a VM instruction (MobileNetV2: 70 a run; a chain collapses to one reshape, a no-op
    reshape disappears)."""
    out = []
    for p in passes:
        out.append(p)
        if p.info.name == "RewriteDataflowReshape":
            out.append(relax.transform.RemoveRedundantReshape())
    return out


def register() -> None:
    """Register the ``tpp`` pipeline with Relax (idempotent: re-import is fine)."""
    from tvm.relax.pipeline import PIPELINE_MAP

    if PIPELINE_NAME not in PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(tpp_pipeline)


def build(mod: tvm.IRModule, target: tvm.target.Target | None = None,
          params: dict | None = None, report: LoweringReport | None = None,
          precision: str = "float32",
          tune_logs: str | os.PathLike | TuneLogs | None = None, force_tuned: bool = False,
          constants: SharedConstants | None = None) -> relax.VMExecutable:
    """Compile a Relax module with the TPP pipeline (``relay.build``'s successor).

    ``params`` binds named parameters of ``main`` as constants first (so weights can be
    packed); ``report`` collects which subgraphs became TPP kernels. ``precision="bf16"``
    runs the kernel families that have bf16 kernels in bf16 (the policy:
    :data:`~.lower.PRECISIONS`).
    ``tune_logs`` (a folder made by ``tpp_tvm.tune``, or ``"shipped"`` for the logs shipped
    for this target) supplies tuned kernels where they beat the hand schedules.
    ``constants``: a pool shared with other builds of the model, which then hold each
    identical constant (a weight packed alike) once.
    """
    precision = check_precision(precision)
    tgt = target if target is not None else tpp_target()
    tgt = tgt if isinstance(tgt, tvm.target.Target) else tvm.target.Target(tgt)
    if precision != "float32" and is_tpp_target(tgt):
        # an ISA with no bf16 dot product (AVX2) is refused here, not kernel by kernel
        check_low_precision(isa_of(tgt), precision, f"precision={precision!r}")
    if params:
        mod = relax.transform.BindParams("main", params)(mod)
    logs = resolve_logs(tune_logs, tgt)
    t0 = time.perf_counter()
    with tgt:
        mod = tpp_pipeline(report, precision, logs, force_tuned)(mod)
    if constants is not None:
        mod = constants.share(mod)
    exe = tvm.compile(mod, target=tgt, relax_pipeline=None, tir_pipeline=TIR_PIPELINE)
    if report is not None:
        report.compile_seconds = time.perf_counter() - t0
    return exe

register()
