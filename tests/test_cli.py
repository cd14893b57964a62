"""Tests of the ``tpp-tvm`` command line (tpp_tvm.cli).

Commands run in-process through ``main`` (fast, output via capsys) on a tiny MLP written to
``tmp_path``; one test runs the real console entry point to check the exit status and the
one-line error. The model demo takes minutes here, so its test is ``slow``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from tpp_tvm import cli, models

pytestmark = pytest.mark.requires_torch  # the model generators export from torch


@pytest.fixture(autouse=True)
def _restore_thread_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--threads`` sets TVM_NUM_THREADS for the process: undo it after each test."""
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "mlp.onnx"
    onnx.save(models.mlp(**models.TINY_ARGS["mlp"]), path)
    return path


@pytest.fixture(scope="module")
def mlp_library(mlp_path: Path) -> Path:
    """The tiny MLP compiled by ``tpp-tvm compile`` (once per module)."""
    out = mlp_path.with_suffix(".so")
    assert cli.main(["compile", str(mlp_path), "-o", str(out), "--threads", "1"]) == 0
    return out


def test_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^target:\s+\w+: \{", out, re.M)
    assert "TPPs:" in out


def test_compile_writes_library_and_prints_report(
    mlp_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.so"
    assert cli.main(["compile", str(mlp_path), "-o", str(out), "--shape", "input=4x16"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"compiling mlp\.onnx\.\.\. done in \d+\.\d s", text)
    assert "tpp.dense_bias_gelu: 1" in text and "Fallbacks to TVM: none" in text
    assert out.exists() and Path(str(out) + ".tpp.json").exists()


@pytest.mark.requires_avx512_bf16
def test_compile_in_bf16_says_so(mlp_path: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model_bf16.so"
    assert cli.main(["compile", str(mlp_path), "-o", str(out), "--precision", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "Precision: bfloat16" in text
    assert re.search(r"tpp\.dense_bias_gelu \[bf16(, amx)?\]: 1", text), text


def test_run_library_with_bench(mlp_library: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", str(mlp_library), "--bench"]) == 0
    text = capsys.readouterr().out
    assert "output 0: float32 (4, 8)" in text
    assert re.search(r"tpp_tvm:\s+\d+\.\d+ ms on \d thread\(s\) \(median\)", text)


@pytest.mark.requires_onnxruntime
def test_run_onnx_compare_onnxruntime(
    mlp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", str(mlp_path), "--compare", "onnxruntime", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "output 0: float32 (4, 8)" in text
    # TVM's pool is sized once per process (by the first test here): ORT gets the same count.
    threads = re.search(r"tpp_tvm:.* on (\d+) thread\(s\)", text).group(1)
    assert re.search(rf"onnxruntime:\s+\d+\.\d+ ms on {threads} thread\(s\)", text)
    assert re.search(r"speed-up:\s+\d+\.\d+ x", text)
    abs_err = float(re.search(r"max error:\s+(\S+) abs", text).group(1))
    assert abs_err < 1e-4


@pytest.mark.requires_onnxruntime
def test_run_library_compare_uses_its_onnx_model(
    mlp_library: Path, mlp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", str(mlp_library), "--compare", "onnxruntime", "--onnx", str(mlp_path)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert float(re.search(r"max error:\s+(\S+) abs", text).group(1)) < 1e-4


@pytest.mark.requires_onnxruntime
def test_run_amx_build_on_emulated_tiles(mlp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`run --isa amx --emulate-tiles` checks an AMX bf16 build against ONNX Runtime on any
    x86 host with AVX2 or AVX-512; without --isa amx it is a one-line error."""
    from tpp_tvm.target import host_isa

    if not (host_isa().avx2 and host_isa().fma):
        pytest.skip(f"the tile model runs beside AVX2 or AVX-512 code ({host_isa().summary()})")
    from tpp_tvm.intrinsics import amx_emulator

    argv = ["run", str(mlp_path), "--isa", "amx", "--emulate-tiles", "--precision", "bf16",
            "--compare", "onnxruntime", "--threads", "1"]
    amx_emulator.reset()
    assert cli.main(argv) == 0
    assert amx_emulator.products() > 0  # the matmuls ran on (emulated) tiles
    text = capsys.readouterr().out
    assert float(re.search(r"max error:\s+(\S+) abs", text).group(1)) < 1e-2
    assert cli.main(["run", str(mlp_path), "--isa", "avx512", "--emulate-tiles"]) == 2
    assert "emulated AMX tiles need target 'amx'" in capsys.readouterr().err


def test_run_library_compare_without_onnx_is_a_one_line_error(
    mlp_library: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", str(mlp_library), "--compare", "onnxruntime"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tpp-tvm: error:") and "--onnx" in err and "\n" not in err


def test_run_dynamic_model_with_shape_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bert_dynamic.onnx"
    onnx.save(models.bert_encoder(**models.TINY_ARGS["bert"], dynamic=True), path)
    assert cli.main(["run", str(path)]) == 2
    assert "--shape" in capsys.readouterr().err
    shapes = "hidden_states=2x8x64,attention_mask=2x1x1x8"
    assert cli.main(["run", str(path), "--shape", shapes]) == 0
    assert "output 0: float32 (2, 8, 64)" in capsys.readouterr().out


def test_bad_shape_option_is_a_usage_error(mlp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", str(mlp_path), "--shape", "input=4xa"])
    assert info.value.code == 2


def test_missing_model_file_exits_2_with_one_line(tmp_path: Path) -> None:
    """Through the real entry point: status 2, one ``tpp-tvm: error:`` line, no traceback."""
    missing = tmp_path / "no_such_model.onnx"
    proc = subprocess.run(
        [sys.executable, "-m", "tpp_tvm.cli", "run", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tpp-tvm: error:") and str(missing) in lines[0]
    assert proc.stdout == ""


def test_threads_option_sizes_the_pool(mlp_path: Path) -> None:
    """In a fresh process (as users run it) ``--threads`` is the thread count that runs."""
    proc = subprocess.run(
        [sys.executable, "-m", "tpp_tvm.cli", "run", str(mlp_path), "--bench", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"tpp_tvm:\s+\d+\.\d+ ms on 1 thread\(s\)", proc.stdout)


def test_missing_library_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", str(tmp_path / "gone.so")]) == 2
    assert capsys.readouterr().err.startswith("tpp-tvm: error: no compiled model")


@pytest.mark.slow
def test_demo_compiles_runs_and_compares(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"compiling bert_encoder \(2 layers.*\)\.\.\. done in \d+\.\d s", text)
    assert re.search(r"compiling resnet .*\.\.\. done in \d+\.\d s", text)
    assert text.count("Fallbacks to TVM: none") == 2
    assert "tpp.attention_mask" in text and "tpp.conv2d" in text
    for err in re.findall(r"max error:\s+(\S+) abs", text):
        assert float(err) < 1e-3


@pytest.mark.slow
def test_demo_gemm(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--gemm", "--threads", "1"]) == 0
    assert "correct" in capsys.readouterr().out
