"""What the benchmarks share: where a CPU's results go.

A result measured on one CPU says nothing about another, so each CPU model gets its own
folder under ``benchmarks/results/``, named as its tuning logs are (``<isa>-<mcpu>``:
``avx512-znver5``, ``amx-emeraldrapids``); a run on another machine adds a folder instead of
overwriting this one's tables.
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """``benchmarks/results/<isa>-<mcpu>`` of this host's default TPP target."""
    import tpp_tvm
    from tpp_tvm.tuning import target_tag

    return RESULTS / target_tag(tpp_tvm.target())
