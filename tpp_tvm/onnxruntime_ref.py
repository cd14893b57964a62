"""ONNX Runtime as the reference: expected outputs for tests, the peer in CLI demos and benchmarks.

onnxruntime is a test/benchmark extra, never a run-time dependency, so it is imported lazily
and its absence is a clear error rather than an ImportError at ``import tpp_tvm``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tpp_tvm.frontend import fits_protobuf, save_model


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            "onnxruntime is needed for reference runs (pip install 'tpp_tvm[test]' or "
            "pip install onnxruntime)"
        ) from exc
    return onnxruntime


def onnxruntime_session(
    model: onnx.ModelProto | str | os.PathLike | bytes, threads: int = 1
) -> Any:
    """An ``onnxruntime.InferenceSession`` on the CPU EP with ``threads`` intra-op threads.

    Kept separate from :func:`run_onnxruntime` so benchmarks time runs, not session setup.
    Inter-op parallelism is off so ``threads`` is the whole thread budget, as for TVM.
    """
    ort = _ort()
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(threads)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3  # warnings about unused initializers etc. are noise here
    if isinstance(model, onnx.ModelProto) and not fits_protobuf(model):
        # Over protobuf's 2 GiB: ORT reads it from a model file and its external data.
        with tempfile.TemporaryDirectory() as folder:
            path = save_model(model, Path(folder) / "model.onnx")
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    if isinstance(model, onnx.ModelProto):
        source: Any = model.SerializeToString()
    elif isinstance(model, bytes):
        source = model
    else:
        source = str(Path(model))
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run_onnxruntime(
    model: onnx.ModelProto | str | os.PathLike | bytes,
    inputs: Mapping[str, np.ndarray],
    threads: int = 1,
) -> list[np.ndarray]:
    """Run ``model`` once on ONNX Runtime's CPU EP; returns the outputs in graph order."""
    session = onnxruntime_session(model, threads)
    return list(session.run(None, dict(inputs)))
