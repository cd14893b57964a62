"""The graph side of tpp_tvm (Relax passes; the folder name is the user's, from Relay days)."""

from .pipeline import build, tpp_pipeline
from .report import LoweringReport

__all__ = ["LoweringReport", "build", "tpp_pipeline"]
