"""Tuning with MetaSchedule around TPPs, beside the ``tpp`` pipeline.

* :mod:`.logs` — tuning logs (``TuneLogs``, ``open_logs``, ``shipped_logs``,
  ``resolve_logs``): what a build applies. A leaf: the pipeline imports it.
* :mod:`.tasks` — what is tuned (one task per PrimFunc, or per TPP subgraph of a Relax
  model) and how a tuned kernel is judged against the hand schedule (in the subgraph, then
  in the whole model). It builds with the pipeline.
* :mod:`.driver` — ``tune()``, ``recompare()``, the search strategy, local or RPC runners,
  progress lines.

The result of ``tune`` is a *tuning log*: a folder ``tune_logs/<target tag>/<workload>/``
holding MetaSchedule's JSON database, ``choices.json`` (hand vs tuned times per subgraph)
and ``meta.json`` (the target it was measured on). ``build(..., tune_logs=PATH)`` applies
it.

Only the logs' names are re-exported here. Importing the pipeline runs this ``__init__``
(the pipeline imports ``.logs``), and the tasks import the pipeline: re-exporting the
driver or the tasks here would make the pipeline import itself. ``tpp_tvm.tune`` is the
public entry point; ``tpp_tvm.tuning.driver`` has the rest.
"""

from .logs import (
    ForeignTuningLogWarning,
    TuneLogs,
    TuningLogError,
    open_logs,
    prune_log,
    resolve_logs,
    shipped_logs,
    target_tag,
)

__all__ = [
    "ForeignTuningLogWarning",
    "TuneLogs",
    "TuningLogError",
    "open_logs",
    "prune_log",
    "resolve_logs",
    "shipped_logs",
    "target_tag",
]
