"""The ``tpp`` Relax pipeline and ``build``: the Relax counterpart of ``relay.build``.

``tvm.compile(mod, target=tpp_tvm.target(), relax_pipeline="tpp")`` runs:

1. inference simplification (batch norm folded, constants folded, decomposed GELU
   recognised);
2. the TPP graph pass — ``FuseOpsByPattern`` with the TPP pattern table, then each
   composite lowered to a TPP-scheduled kernel (weights packed at compile time);
3. TVM's CPU legalization and fusion for everything else, then the default schedules
   (``schedules/default.py``) so the leftovers are parallel and vectorized;
4. TVM's dataflow lowering and finalization.

Step 2 runs only for targets whose keys include ``"tpp"``; other targets get steps 1, 3, 4.
"""

from __future__ import annotations

import time

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic.pipeline import (
    dataflow_lower_passes,
    finalize_passes,
    legalize_passes,
    library_dispatch_passes,
)

from ..schedules.default import default_schedule_pass
from ..target import is_tpp_target, isa_of
from ..target import target as tpp_target
from .canonicalize import CanonicalizeActivations
from .lower import LoweringReport, lower_tagged_kernels, lower_tpp_composites
from .patterns import pattern_table

PIPELINE_NAME = "tpp"


def tpp_graph_passes(isa: str, report: LoweringReport) -> list[tvm.transform.Pass]:
    """Partition TPP subgraphs and lower them onto TPP kernels."""

    @tvm.transform.module_pass(opt_level=0, name="tpp.LowerTPPComposites")
    def lower(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return lower_tpp_composites(lower_tagged_kernels(mod, isa, report), isa, report)

    return [
        # Convolutions run NHWC on TPPs; layout transposes are inserted only at the edges.
        relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]}),
        relax.transform.FoldConstant(),
        relax.transform.FuseOpsByPattern(
            [p.as_fusion_pattern() for p in pattern_table()],
            bind_constants=True,
            annotate_codegen=False,
        ),
        lower,
    ]


def tpp_pipeline(report: LoweringReport | None = None) -> tvm.transform.Pass:
    """The whole ``tpp`` pipeline; the target comes from the enclosing ``with target``."""
    report = report if report is not None else LoweringReport()

    @tvm.transform.module_pass(opt_level=0, name="tpp.Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current()
        if target is None:
            raise ValueError("the tpp pipeline needs a target (tvm.compile(..., target=...))")
        passes = [
            relax.transform.DecomposeOpsForInference(),
            relax.transform.FoldConstant(),
            CanonicalizeActivations,
        ]
        if is_tpp_target(target):
            passes += tpp_graph_passes(isa_of(target), report)
        passes += library_dispatch_passes(target) + legalize_passes(target)
        passes.append(default_schedule_pass())
        passes += dataflow_lower_passes(target) + finalize_passes(target)
        return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def register() -> None:
    """Register the ``tpp`` pipeline with Relax (idempotent: re-import is fine)."""
    from tvm.relax.pipeline import PIPELINE_MAP

    if PIPELINE_NAME not in PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(tpp_pipeline)


def build(mod: tvm.IRModule, target: tvm.target.Target | None = None,
          params: dict | None = None, report: LoweringReport | None = None
          ) -> relax.VMExecutable:
    """Compile a Relax module with the TPP pipeline (``relay.build``'s successor).

    ``params`` binds named parameters of ``main`` as constants first (so weights can be
    packed); ``report`` collects which subgraphs became TPP kernels.
    """
    tgt = target if target is not None else tpp_target()
    tgt = tgt if isinstance(tgt, tvm.target.Target) else tvm.target.Target(tgt)
    if params:
        mod = relax.transform.BindParams("main", params)(mod)
    t0 = time.perf_counter()
    with tgt:
        mod = tpp_pipeline(report)(mod)
    exe = tvm.compile(mod, target=tgt, relax_pipeline=None)
    if report is not None:
        report.compile_seconds = time.perf_counter() - t0
    return exe


register()
