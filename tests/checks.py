"""Checks the test modules share: tolerances, "runs like ONNX Runtime", small fp32 ONNX
graphs, a plain LLVM target, free ports.

TPP-level helpers (one TPP built and run, its numpy reference) are in ``tpp_harness.py``;
what a test needs from the machine is a ``requires_*`` marker (``conftest.py``).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from contextlib import ExitStack

import numpy as np
import onnx
import tvm
from tvm.target import codegen

import tpp_tvm
from tpp_tvm.compiled import CompiledModel
from tpp_tvm.onnxruntime_ref import run_onnxruntime
from tpp_tvm.schedules.gemm_plan import register_tile_isa
from tpp_tvm.target import isa_of


def assert_close_scaled(got: np.ndarray, want: np.ndarray, rtol: float, err_msg: str = ""
                        ) -> None:
    """Within ``rtol`` relative, and ``rtol`` x the result's magnitude (at least 1) absolute:
    near zero, where sums cancel, a relative bound alone is too strict."""
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=err_msg)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The error's norm relative to the result's (one number for a whole tensor)."""
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_runs_like_onnxruntime(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *,
                                 rtol: float, atol: float,
                                 target: tvm.target.Target | None = None) -> CompiledModel:
    """Compile ``model`` onto TPPs for ``target`` (default: the host's, one core), run it on
    ``feeds`` and check every output against ONNX Runtime's (same shape, within
    ``rtol``/``atol``); returns the compiled model for its report."""
    want = run_onnxruntime(model, feeds)
    compiled = tpp_tvm.compile_onnx(model, target=target or tpp_tvm.target(num_cores=1))
    got = compiled(**feeds)
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return compiled


#: The vector ISA this host's default target runs TPP kernels on: ``avx512`` on AVX-512 and
#: AMX hosts (AMX targets run their vector kernels there), ``avx2`` on AVX2-only x86 CPUs,
#: ``sve`` on SVE hosts. Tests that build a vector kernel for the host target name it.
VECTOR_ISA = register_tile_isa(isa_of(tpp_tvm.target()))


def onnx_model(nodes: list[onnx.NodeProto], inputs: Mapping[str, list[int]],
               consts: Mapping[str, np.ndarray] | None = None,
               outputs: tuple[str, ...] = ("y",)) -> onnx.ModelProto:
    """An opset-17 model of ``nodes``: fp32 ``inputs`` (name -> shape), ``consts`` as fp32
    initializers, ``outputs`` of inferred shape."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v)
                     for k, v in inputs.items()],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, None) for k in outputs],
        [numpy_helper.from_array(np.asarray(v, "float32"), k)
         for k, v in (consts or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def plain_llvm(num_cores: int | None = None) -> tvm.target.Target:
    """An LLVM target for this CPU without the "tpp" key: TVM's own path, no TPP offload."""
    config = {"kind": "llvm", "mcpu": str(codegen.llvm_get_system_cpu())}
    if num_cores is not None:
        config["num-cores"] = num_cores
    return tvm.target.Target(config)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free on ``host`` now, chosen by the kernel
    (binding port 0), so that test runs in parallel never share a fixed port number."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:  # all held until every port is chosen: no duplicates
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
