"""Tests of tuning (tpp_tvm.tuning: logs, tasks, driver): tune a PrimFunc and a tiny
model for a few trials, apply the log in a build, measure over RPC on loopback, and the
errors of bad logs. Trials are few: these check the machinery, the benchmark checks speed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import checks
import numpy as np
import pytest
import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms

import tpp_tvm
from tpp_tvm import cli, models
from tpp_tvm.relay_passes.lower import LoweringReport
from tpp_tvm.tuning import TuningLogError, driver, open_logs, resolve_logs, target_tag

TARGET = tpp_tvm.target(num_cores=1)


def _matmul(m=64, n=64, k=128):
    A = te.placeholder((m, k), name="A")
    B = te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), "k")
    C = te.compute((m, n), lambda i, j: te.sum(A[i, r] * B[r, j], axis=r), name="C")
    return te.create_prim_func([A, B, C])


@pytest.fixture(scope="module")
def tuned_matmul(tmp_path_factory):
    out = tmp_path_factory.mktemp("mm")
    result = driver.tune(_matmul(), TARGET, out, trials_per_task=8)
    return result, out


def test_tune_primfunc_writes_a_log_that_compiles_correctly(tuned_matmul, capsys):
    result, out = tuned_matmul
    assert (out / "database_tuning_record.json").is_file()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tag"] == target_tag(TARGET) and meta["rules"] == "tpp"
    assert result.tasks[0]["tuned_ms"] > 0
    logs = open_logs(out, TARGET)
    func = logs.schedule(_matmul().with_attr("global_symbol", "main"))
    assert func is not None
    rt = tvm.compile(tvm.IRModule({"main": func}), target=TARGET).jit()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 128), "float32"), rng.standard_normal((128, 64), "float32")
    c = tvm.runtime.tensor(np.zeros((64, 64), "float32"))
    rt(tvm.runtime.tensor(a), tvm.runtime.tensor(b), c)
    np.testing.assert_allclose(c.numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_a_log_opens_in_a_fresh_process(tuned_matmul):
    """Loading a database replays its traces: the TPP intrinsics they name must be registered
    from the names alone (a new process has generated none)."""
    _, out = tuned_matmul
    code = (
        "import tpp_tvm, sys; sys.path.insert(0, 'tests'); from test_tuning import _matmul\n"
        "from tpp_tvm.tuning import open_logs\n"
        f"logs = open_logs({str(out)!r}, tpp_tvm.target(num_cores=1))\n"
        "print(logs.schedule(_matmul().with_attr('global_symbol', 'main')) is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("True")


def test_shipped_logs_merge_every_log_for_the_target(tuned_matmul, tmp_path, monkeypatch):
    import shutil

    _, out = tuned_matmul
    for name in ("one", "two"):
        shutil.copytree(out, tmp_path / target_tag(TARGET) / name)
    monkeypatch.setattr("tpp_tvm.tuning.logs.SHIPPED_LOGS", tmp_path)
    logs = resolve_logs("shipped", TARGET)
    assert logs is not None and logs.schedule(_matmul().with_attr("global_symbol", "main"))
    monkeypatch.setattr("tpp_tvm.tuning.logs.SHIPPED_LOGS", tmp_path / "none")
    assert resolve_logs("shipped", TARGET) is None


def test_progress_lines_say_task_trials_best_and_time_left():
    lines = []
    progress = driver.TuningProgress(["mm"], [2e6], 8, printer=lines.append)

    ok = ms.runner.RunnerResult(run_secs=[1e-3], error_msg=None)
    failed = ms.runner.RunnerResult(run_secs=None, error_msg="build failed")
    progress._inst.apply(None, 0, [], [], [ok, ok, failed])  # the Python side, no scheduler
    assert lines and "task 1/1 mm: 3/8 trials, best 2.0 GFLOP/s" in lines[-1]
    assert "left" in lines[-1]


def test_tiny_model_tuned_from_the_cli_and_applied_in_a_build(tmp_path, capsys):
    model = models.mlp(batch=8, dims=(32, 64, 16))
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model.SerializeToString())
    logs = tmp_path / "logs"
    assert cli.main(["tune", str(path), "--trials", "4", "--threads", "1",
                     "--work-dir", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "[tune] task 1/2" in out and "tpp_dense_bias" in out
    choices = json.loads((logs / "choices.json").read_text())
    assert len(choices) == 2 and all(c["use"] in ("hand", "tuned") for c in choices.values())
    assert all(c["hand_ms"] > 0 and c["tuned_vm_ms"] > 0 for c in choices.values())
    # Forcing the tuned kernels: every subgraph runs tuned code and gives the same answer.
    mod = tpp_tvm.from_onnx(model)
    report = LoweringReport()
    exe = tpp_tvm.build(mod, TARGET, report=report, tune_logs=logs, force_tuned=True)
    assert sum(n for row, n in report.kernels.items() if row.tuned) == 2, report.summary()
    inputs = models.example_inputs(model)
    vm = tvm.relax.VirtualMachine(exe, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(v) for v in inputs.values()]).numpy()
    hand = tpp_tvm.compile_onnx(model, TARGET, tune_logs=None)(*inputs.values())[0]
    np.testing.assert_allclose(got, hand, rtol=1e-4, atol=1e-5)
    # Without forcing, the build takes whichever the log measured faster.
    compiled = tpp_tvm.compile_onnx(model, TARGET, tune_logs=logs)
    n_tuned = sum(c["use"] == "tuned" for c in choices.values())
    assert compiled.report().count("(tuned)") == min(n_tuned, 2)
    # In the model: a kernel chosen alone stays tuned only if the whole model got faster.
    from tpp_tvm.tuning.tasks import confirm_in_model

    forced = {k: {**c, "use": "tuned"} for k, c in choices.items()}
    confirmed = confirm_in_model(mod, TARGET, None, open_logs(logs, TARGET), forced)
    for c in confirmed.values():
        assert c["model_hand_ms"] > 0 and c["model_tuned_alone_ms"] > 0
        if c["use"] == "tuned":
            assert c["model_tuned_alone_ms"] < c["model_hand_ms"]


@pytest.mark.slow  # 20 s: two RPC servers measuring; the local runner covers the rest
def test_rpc_tracker_and_two_servers_on_loopback(tmp_path):
    pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado")
    from tvm import rpc
    from tvm.rpc.tracker import Tracker

    # Ports the kernel says are free now (each range is that one port), not fixed numbers
    # that a second run of the suite, or anything else on the machine, may hold.
    tracker_port, *server_ports = checks.free_ports(3)
    tracker = Tracker("127.0.0.1", port=tracker_port, port_end=tracker_port + 1, silent=True)
    servers = [rpc.Server("127.0.0.1", port=port, port_end=port + 1, key="tpp-test",
                          tracker_addr=("127.0.0.1", tracker.port), silent=True)
               for port in server_ports]
    try:
        for _ in range(50):  # the servers register with the tracker asynchronously
            summary = rpc.connect_tracker("127.0.0.1", tracker.port).summary()
            if sum(1 for s in summary["server_info"] if "tpp-test" in s["key"]) == 2:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"RPC servers did not register with the tracker: {summary}")
        runner = driver.make_runner(f"127.0.0.1:{tracker.port}", "tpp-test")
        result = driver.tune(_matmul(32, 32, 64), TARGET, tmp_path, trials_per_task=4,
                             runner=runner, progress=False)
        assert result.tasks[0]["tuned_ms"] is not None  # measured on the RPC servers
    finally:
        for s in servers:
            s.terminate()
        tracker.terminate()


def test_bad_logs_are_clear_errors_and_foreign_logs_are_skipped(tuned_matmul, tmp_path):
    _, out = tuned_matmul
    with pytest.raises(TuningLogError, match="does not exist"):
        open_logs(tmp_path / "nope", TARGET)
    with pytest.raises(TuningLogError, match="not a tuning log"):
        open_logs(tmp_path, TARGET)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("database_workload.json", "database_tuning_record.json"):
        (bad / f).write_text((out / f).read_text())
    (bad / "database_tuning_record.json").write_text("{not json\n")
    with pytest.raises(TuningLogError, match="corrupt"):
        open_logs(bad, TARGET)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in ("database_workload.json", "database_tuning_record.json"):
        (foreign / f).write_text((out / f).read_text())
    (foreign / "meta.json").write_text(json.dumps({"tag": "sve-neoverse-v1"}))
    with pytest.warns(UserWarning, match="made for sve-neoverse-v1"):
        assert open_logs(foreign, TARGET) is None
    with pytest.raises(TuningLogError):
        tpp_tvm.build(tpp_tvm.from_onnx(models.mlp(**models.TINY_ARGS["mlp"])), TARGET,
                      tune_logs=tmp_path / "missing")
