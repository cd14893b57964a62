"""tpp_tvm's thread pool: shares any thread may claim, so a held-up worker never stalls a
kernel; concurrent calls; thread counts per model and from the CPUs the process may use."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tpp_tvm
from tpp_tvm import runtime
from tpp_tvm.target import target


def _mlp(seed: int = 0) -> onnx.ModelProto:
    """Two dense layers with a ReLU between: parallel GEMM kernels and a parallel tail."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((256, 512)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((512, 128)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"]), helper.make_node("Tanh", ["y"], ["z"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (64, 256))],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, (64, 128))], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _reference(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    w1, w2 = (numpy_helper.to_array(t) for t in model.graph.initializer)
    return np.tanh(np.maximum(x @ w1, 0) @ w2)


@pytest.fixture(scope="module", autouse=True)
def _threads_from_the_models():
    """TVM_NUM_THREADS (which wins over every model's count) unset while these run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TVM_NUM_THREADS", raising=False)
        yield


@pytest.fixture(scope="module")
def mlp() -> tuple[onnx.ModelProto, tpp_tvm.CompiledModel]:
    model = _mlp()
    return model, tpp_tvm.compile_onnx(model, target(num_cores=2))


def _inputs(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((64, 256)).astype(np.float32) * 0.05


def test_kernels_run_on_tpp_tvm_pool(mlp) -> None:
    model, compiled = mlp
    before = runtime.pool_statistics()["launches"]
    x = _inputs(1)
    np.testing.assert_allclose(compiled(x)[0], _reference(x, model), rtol=1e-4, atol=1e-5)
    assert compiled.threads == 2
    assert runtime.pool_statistics()["launches"] > before


def test_a_held_up_worker_does_not_stall_a_kernel(mlp) -> None:
    """Workers that take no share (as if the OS had descheduled them): the calling thread
    claims every share itself, so the model finishes, correct; TVM's pool would wait for
    the workers forever."""
    model, compiled = mlp
    x = _inputs(2)
    want = _reference(x, model)
    stolen = runtime.pool_statistics()["stolen"]
    runtime.pause_workers(True)
    try:
        result = compiled(x)[0]
    finally:
        runtime.pause_workers(False)
    np.testing.assert_allclose(result, want, rtol=1e-4, atol=1e-5)
    assert runtime.pool_statistics()["stolen"] > stolen
    np.testing.assert_allclose(compiled(x)[0], want, rtol=1e-4, atol=1e-5)  # workers back


def test_concurrent_calls_give_each_thread_its_own_result(mlp) -> None:
    """Four Python threads calling one model at once (TVM releases the GIL in a call): each
    thread runs its own VM; launches that find the pool busy run on their own thread."""
    model, compiled = mlp
    inputs = [_inputs(10 + k) for k in range(4)]
    wants = [_reference(x, model) for x in inputs]
    failures: list[str] = []

    def work(k: int) -> None:
        for _ in range(8):
            got = compiled(inputs[k])[0]
            if not np.allclose(got, wants[k], rtol=1e-4, atol=1e-5):
                failures.append(f"thread {k}: max error {np.abs(got - wants[k]).max()}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_threads_per_model_share_one_pool(mlp, tmp_path) -> None:
    """A model set to one thread runs serially (no launch) beside a two-thread model."""
    model, compiled = mlp
    single = tpp_tvm.load(compiled.export(tmp_path / "mlp.so"), threads=1)
    assert single.threads == 1 and compiled.threads == 2
    x = _inputs(3)
    before = runtime.pool_statistics()["launches"]
    np.testing.assert_allclose(single(x)[0], _reference(x, model), rtol=1e-4, atol=1e-5)
    assert runtime.pool_statistics()["launches"] == before
    compiled(x)
    assert runtime.pool_statistics()["launches"] > before
    with pytest.raises(ValueError, match="threads must be >= 1"):
        single.threads = 0


_CHILD = """
import os, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_runtime import _inputs, _mlp, _reference
import tpp_tvm
from tpp_tvm import runtime
from tpp_tvm.target import physical_core_count, target
{setup}
model = _mlp()
compiled = tpp_tvm.compile_onnx(model, target())
x = _inputs(4)
assert np.allclose(compiled(x)[0], _reference(x, model), rtol=1e-4, atol=1e-5)
print(physical_core_count(), compiled.threads, runtime.pool_statistics()["launches"])
"""


def _child(setup: str, **env: str) -> list[int]:
    code = _CHILD.format(tests=os.path.dirname(__file__), setup=setup)
    base = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**base, **env}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [int(v) for v in proc.stdout.split()[-3:]]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_default_threads_follow_the_affinity_mask() -> None:
    """A process allowed one CPU (taskset, a container's cpuset) compiles for one thread
    whatever the host's core count."""
    cpu = min(os.sched_getaffinity(0))
    cores, threads, launches = _child(f"os.sched_setaffinity(0, {{{cpu}}})")
    assert (cores, threads, launches) == (1, 1, 0)


def test_tvm_pool_remains_as_the_fallback() -> None:
    """TPP_TVM_THREAD_POOL=tvm (what a host without a C compiler gets) runs on TVM's pool."""
    _, threads, launches = _child("", TPP_TVM_THREAD_POOL="tvm")
    assert launches == 0 and threads >= 1


def test_training_steps_run_on_the_pool() -> None:
    """A compiled training step's kernels are linked and run on tpp_tvm's pool too."""
    from tpp_tvm.training import compile_training_step
    from tpp_tvm.training.models import mlp

    model = mlp(64, [256, 256, 16])
    step = compile_training_step(model, "mse", target=target(num_cores=2))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    y = rng.standard_normal((64, 16)).astype(np.float32)
    before = runtime.pool_statistics()["launches"]
    losses = [step.step(x, labels=y) for _ in range(3)]
    assert runtime.pool_statistics()["launches"] > before
    assert losses[-1] < losses[0]


def test_workers_that_keep_losing_their_cores_send_launches_solo(mlp) -> None:
    """Workers held up inside their shares (as when another process takes their cores) make
    the pool run launches on the calling thread alone for a while; results stay right."""
    model, compiled = mlp
    x = _inputs(5)
    want = _reference(x, model)
    before = runtime.pool_statistics()
    runtime.delay_workers(2000)
    # Past one window of launches; and where an earlier test's lost cores (test workers
    # share 2 cores) left a solo period running (up to 1 s), until it ends and a new one
    # starts: launches in a solo period run alone and start none.
    deadline = time.monotonic() + 10
    try:
        for i in itertools.count():
            np.testing.assert_allclose(compiled(x)[0], want, rtol=1e-4, atol=1e-5)
            started = runtime.pool_statistics()["solo_periods"] > before["solo_periods"]
            if i >= 40 and (started or time.monotonic() > deadline):
                break
    finally:
        runtime.delay_workers(0)
    after = runtime.pool_statistics()
    assert after["solo_periods"] > before["solo_periods"]
    assert after["solo_launches"] > before["solo_launches"]
