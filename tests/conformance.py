"""ONNX backend conformance: every case of ONNX's backend test data through TVM and tpp_tvm.

Issue #16's promise is "never worse than TVM": on any ONNX graph that TVM's own default build
runs correctly, tpp_tvm must run it correctly too. The ONNX package ships the backend test
cases (one model plus inputs and expected outputs each); this module runs each case twice,
through TVM's default Relax build and through :func:`tpp_tvm.compile_onnx`, and compares
both with the expected outputs (``rtol`` 1e-3, ``atol`` 1e-4, NaN equals NaN).

Sources (``SUITES``):

- ``node``: the per-operator cases. The onnx wheel ships their generators, not their data,
  so :func:`node_data_dir` writes them once into a cache folder under
  ``tempfile.gettempdir()`` with ONNX's own writer (``onnx.backend.test.cmd_tools``).
- ``pytorch-converted``, ``pytorch-operator``, ``simple``: shipped with their data.
- ``light``: model-zoo CNNs with generated weights; inputs are ONNX's dummy inputs
  (``arange(n) / n``), expected outputs are shipped. Only the small ones (``LIGHT_MODELS``).

Cases run in a worker process (``python tests/conformance.py --worker``) that reads case
names on stdin and answers one JSON line per case: an abort or segfault inside LLVM, or a
case past its timeout, is reported as a failure of that case and the worker restarts.

``python tests/conformance.py [-o results.json] [CASE ...]`` runs all cases (or the named
ones) and prints the counts: tpp_tvm pass, TVM pass, both, and every case where TVM passes
and tpp_tvm does not. ``conformance_known.json`` beside this file lists TVM's own failures
(so a TVM fix shows up) and the known tpp_tvm gaps with their reasons.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

RTOL = 1e-3
ATOL = 1e-4
SUITES = ("node", "pytorch-converted", "pytorch-operator", "simple", "light")
#: The light model-zoo CNNs small enough for TVM's untuned default build (the others,
#: VGG-19, ZFNet, AlexNet, take minutes each there).
LIGHT_MODELS = ("squeezenet", "shufflenet", "inception_v1", "resnet50", "densenet121",
                "inception_v2")
KNOWN = Path(__file__).with_name("conformance_known.json")
_ONNX_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
_PASS = "pass"


@dataclass(frozen=True)
class Case:
    """One backend test case: ``name`` is ``suite/case``."""

    name: str
    model: Path
    data: Path  # test_data_set_0 (inputs and outputs); for light models the output file

    @property
    def suite(self) -> str:
        return self.name.split("/", 1)[0]


@dataclass
class Result:
    """Outcome of one case on both builds: ``"pass"`` or a one-line reason."""

    name: str
    tvm: str
    tpp: str
    seconds: float = 0.0

    @property
    def regression(self) -> bool:
        """TVM's default build is right and tpp_tvm is not: what must never happen."""
        return self.tvm == _PASS and self.tpp != _PASS


# --------------------------------------------------------------------------------------------
# Cases


def node_data_dir() -> Path:
    """The folder holding ``node/<case>/``, generated once per onnx version.

    Written to a private folder first and renamed into place, so concurrent runs (another
    engineer's tests) never see half a suite."""
    root = Path(tempfile.gettempdir()) / f"tpp_tvm_onnx_backend_{onnx.__version__}"
    if (root / "node").is_dir():
        return root
    import onnx.backend.test.case.node as node_cases
    import onnx.backend.test.cmd_tools as cmd_tools

    staging = Path(tempfile.mkdtemp(prefix="tpp_tvm_onnx_backend_", dir=tempfile.gettempdir()))

    class _NodeCases:  # cmd_tools writes the cases this returns: give it the node ones
        collect_testcases = staticmethod(node_cases.collect_testcases)

    saved = cmd_tools.model_test
    cmd_tools.model_test = _NodeCases
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cmd_tools.generate_data(argparse.Namespace(output=str(staging)))
    finally:
        cmd_tools.model_test = saved
    root.mkdir(exist_ok=True)
    try:
        os.rename(staging / "node", root / "node")
    except OSError:  # someone else finished first
        pass
    return root


def all_cases(suites: tuple[str, ...] = SUITES) -> list[Case]:
    """Every case of ``suites``."""
    cases = []
    for suite in suites:  # in SUITES order: the slow light models last
        if suite == "light":
            for model in LIGHT_MODELS:
                path = _ONNX_DATA / "light" / f"light_{model}.onnx"
                cases.append(Case(f"light/{model}", path,
                                  path.with_name(f"light_{model}_output_0.pb")))
            continue
        base = (node_data_dir() / "node") if suite == "node" else _ONNX_DATA / suite
        for folder in sorted(base.iterdir()):
            if (folder / "model.onnx").is_file():
                cases.append(Case(f"{suite}/{folder.name}", folder / "model.onnx",
                                  folder / "test_data_set_0"))
    return cases


def case_by_name(name: str) -> Case:
    suite, case = name.split("/", 1)
    if suite == "light":
        path = _ONNX_DATA / "light" / f"light_{case}.onnx"
        return Case(name, path, path.with_name(f"light_{case}_output_0.pb"))
    base = (node_data_dir() / "node") if suite == "node" else _ONNX_DATA / suite
    return Case(name, base / case / "model.onnx", base / case / "test_data_set_0")


def _read_pb(path: Path, type_proto: onnx.TypeProto | None) -> Any:
    if type_proto is not None and type_proto.HasField("sequence_type"):
        seq = onnx.SequenceProto()
        seq.ParseFromString(path.read_bytes())
        return numpy_helper.to_list(seq)
    if type_proto is not None and type_proto.HasField("optional_type"):
        opt = onnx.OptionalProto()
        opt.ParseFromString(path.read_bytes())
        return numpy_helper.to_optional(opt)
    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(tensor)


def load_case(case: Case) -> tuple[onnx.ModelProto, list[Any], list[Any]]:
    """The model, its inputs in graph-input order and its expected outputs."""
    model = onnx.load(str(case.model), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    real_inputs = [v for v in model.graph.input if v.name not in inits]
    if case.suite == "light":
        inputs = []
        for v in real_inputs:
            shape = tuple(d.dim_value if d.HasField("dim_value") else 1
                          for d in v.type.tensor_type.shape.dim)
            n = int(np.prod(shape))
            inputs.append((np.arange(n).reshape(shape) / n).astype(np.float32))
        return model, inputs, [_read_pb(case.data, None)]
    inputs = [_read_pb(case.data / f"input_{i}.pb", v.type) for i, v in enumerate(real_inputs)
              if (case.data / f"input_{i}.pb").is_file()]
    outputs = [_read_pb(case.data / f"output_{i}.pb", v.type)
               for i, v in enumerate(model.graph.output)]
    return model, inputs, outputs


# --------------------------------------------------------------------------------------------
# Running and comparing


def _flatten(value: Any) -> list[np.ndarray]:
    import tvm

    if isinstance(value, tvm.runtime.Tensor):
        return [value.numpy()]
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, tvm.runtime.ShapeTuple):
        return [np.array(list(value), dtype=np.int64)]
    if isinstance(value, list | tuple) or type(value).__name__ == "Array":
        return [x for item in value for x in _flatten(item)]
    return [np.asarray(value)]


def _tensor_inputs(model: onnx.ModelProto, inputs: list[Any]) -> list[np.ndarray]:
    if len(inputs) != len([v for v in model.graph.input
                           if v.name not in {t.name for t in model.graph.initializer}]):
        raise ValueError("case leaves optional graph inputs unset")
    if not all(isinstance(x, np.ndarray) for x in inputs):
        raise ValueError("non-tensor (sequence/optional/map) input")
    return inputs


def run_tvm(model: onnx.ModelProto, inputs: list[Any]) -> list[np.ndarray]:
    """TVM's own path: its ONNX importer (weights as constants, as tpp_tvm imports them),
    ``tvm.compile(relax_pipeline="default")`` for ``llvm`` and the Relax VM."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    arrays = _tensor_inputs(model, inputs)
    mod = from_onnx(model, keep_params_in_input=False)
    ex = tvm.compile(mod, target="llvm", relax_pipeline="default")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu()) for a in arrays]
    return _flatten(vm["main"](*args))


def run_tpp(model: onnx.ModelProto, inputs: list[Any]) -> list[np.ndarray]:
    """tpp_tvm's path, as a user calls it: ``compile_onnx`` and a call."""
    import tpp_tvm

    arrays = _tensor_inputs(model, inputs)
    compiled = tpp_tvm.compile_onnx(model)
    return compiled(*arrays)


def compare(expected: list[Any], got: list[np.ndarray], rtol: float = RTOL,
            atol: float = ATOL) -> str:
    """``"pass"``, or what differs first (count, shape, value), NaN equal to NaN."""
    want = [np.asarray(x) for x in expected]
    if len(want) != len(got):
        return f"mismatch: {len(got)} outputs, expected {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        g = np.asarray(g)
        if w.shape != g.shape:
            return f"mismatch: output {i} shape {g.shape}, expected {w.shape}"
        if w.dtype.kind in "USO" or g.dtype.kind in "USO":
            if not np.array_equal(w, g):
                return f"mismatch: output {i} strings differ"
            continue
        if w.dtype == bool or g.dtype == bool:
            w, g = w.astype(np.int64), g.astype(np.int64)
        wf, gf = w.astype(np.float64), g.astype(np.float64)
        close = np.isclose(gf, wf, rtol=rtol, atol=atol, equal_nan=True)
        if not close.all():
            bad = int((~close).sum())
            idx = np.unravel_index(int(np.argmax(~close)), close.shape) if close.ndim else ()
            return (f"mismatch: output {i}: {bad}/{close.size} differ, e.g. at {idx} got "
                    f"{gf[idx]!r}, expected {wf[idx]!r}")
    return _PASS


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # TVM errors put the message last, after a traceback.
    line = next((t for t in reversed(text) if t.strip() and not t.startswith(" ")), "")
    return f"error: {type(exc).__name__}: {line[:300]}"


def _attempt(fn: Any, model: onnx.ModelProto, inputs: list[Any], expected: list[Any]) -> str:
    try:
        got = fn(model, inputs)
    except Exception as exc:  # noqa: BLE001 - every failure is a result here
        return _reason(exc)
    return compare(expected, got)


def check_case(case: Case, builds: tuple[str, ...] = ("tvm", "tpp"),
               progress: Any = None) -> Result:
    """Run one case in this process on the named builds; unnamed builds read ``"skipped"``."""
    t0 = time.perf_counter()
    try:
        model, inputs, expected = load_case(case)
    except Exception as exc:  # noqa: BLE001
        reason = _reason(exc)
        return Result(case.name, reason, reason)
    outcome: dict[str, str] = {}
    for build, fn in (("tvm", run_tvm), ("tpp", run_tpp)):
        if progress is not None:
            progress(build, dict(outcome))
        outcome[build] = _attempt(fn, model, inputs, expected) if build in builds \
            else "skipped"
    return Result(case.name, outcome["tvm"], outcome["tpp"], time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# Worker processes


def _worker() -> None:
    """Answer one JSON line per case name read on stdin; ``{"phase": ...}`` lines say which
    build is running, so a crash is charged to the right one."""
    out = sys.stdout
    sys.stdout = sys.stderr  # converters print; keep the protocol channel clean
    for line in sys.stdin:
        request = json.loads(line)

        def progress(build: str, done: dict[str, str]) -> None:
            out.write(json.dumps({"phase": build, "done": done}) + "\n")
            out.flush()

        if os.environ.get("TPP_CONFORMANCE_ABORT") == request["name"]:
            progress(request["builds"][0], {})
            os.abort()  # the tests' stand-in for LLVM aborting the process
        try:
            result = asdict(check_case(case_by_name(request["name"]),
                                       tuple(request["builds"]), progress))
        except Exception:  # noqa: BLE001
            msg = traceback.format_exc().strip().splitlines()[-1]
            result = asdict(Result(request["name"], f"error: {msg}", f"error: {msg}"))
        out.write(json.dumps(result) + "\n")
        out.flush()


def _pump(stream: Any, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put("")  # end of stream: the worker died


class Runner:
    """Runs cases in a worker process, restarting it after a crash or a timeout."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("TVM_NUM_THREADS", "1")
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        return subprocess.Popen([sys.executable, "-u", __file__, "--worker"], cwd=root,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)

    def _read(self, deadline: float) -> dict | None:
        """The worker's next message; None when it died or the deadline passed."""
        try:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return None
        return json.loads(line) if line else None

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdout.close()
            self._proc = None

    def run(self, name: str, builds: tuple[str, ...] = ("tvm", "tpp")) -> Result:
        """One case; a dead or stuck worker makes the build it was in fail."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
            self._lines = queue.Queue()
            threading.Thread(target=_pump, args=(self._proc.stdout, self._lines),
                             daemon=True).start()
        proc = self._proc
        proc.stdin.write(json.dumps({"name": name, "builds": list(builds)}) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        outcome = {"tvm": "not run", "tpp": "not run"}
        t0 = time.perf_counter()
        while True:
            msg = self._read(deadline)
            if msg is not None and "phase" in msg:
                outcome.update(msg["done"])
                outcome[msg["phase"]] = "running"
                continue
            if msg is not None:
                return Result(**msg)
            timed_out = time.monotonic() >= deadline
            self._stop()
            if timed_out:
                why = f"timeout: over {self.timeout:.0f} s"
            elif proc.returncode is not None and proc.returncode < 0:
                why = f"crash: worker died of signal {-proc.returncode}"
            else:
                why = f"crash: worker exited with {proc.returncode}"
            for build in ("tvm", "tpp"):
                if build not in builds:
                    outcome[build] = "skipped"
                elif outcome[build] == "running":
                    outcome[build] = why
            if outcome["tpp"] == "not run" and "tpp" in builds:
                # A hard crash in TVM's build says nothing about tpp_tvm's: run it alone.
                tpp = self.run(name, ("tpp",)).tpp if outcome["tvm"] != "not run" else why
                outcome["tpp"] = tpp
            return Result(name, outcome["tvm"], outcome["tpp"], time.perf_counter() - t0)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._stop()
            self._proc = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def known() -> dict[str, dict[str, str]]:
    """``{"tvm_failures": {case: reason}, "tpp_gaps": {case: reason}}``."""
    return json.loads(KNOWN.read_text())


def update_known(results: list[Result]) -> None:
    """Rewrite ``tvm_failures`` from a full run (reasons cut to one short line); the
    ``tpp_gaps`` section is kept as written by hand."""
    data = known() if KNOWN.exists() else {"tpp_gaps": {}}
    data["tvm_failures"] = {r.name: r.tvm[:120] for r in sorted(results, key=lambda r: r.name)
                            if r.tvm != _PASS}
    KNOWN.write_text(json.dumps({"tvm_failures": data["tvm_failures"],
                                 "tpp_gaps": data.get("tpp_gaps", {})}, indent=1) + "\n")


def summarize(results: list[Result]) -> dict[str, Any]:
    """Counts over ``results`` and the cases that break the promise."""
    tpp = sum(r.tpp == _PASS for r in results)
    tvm = sum(r.tvm == _PASS for r in results)
    both = sum(r.tpp == _PASS and r.tvm == _PASS for r in results)
    return {"cases": len(results), "tpp_pass": tpp, "tvm_pass": tvm, "both_pass": both,
            "regressions": {r.name: r.tpp for r in results if r.regression},
            "tpp_only": sorted(r.name for r in results if r.tpp == _PASS and r.tvm != _PASS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="suite/case names (default: all)")
    parser.add_argument("-o", "--output", help="write every result and the counts here")
    parser.add_argument("--suite", action="append", choices=SUITES)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    parser.add_argument("--update-known", metavar="RESULTS",
                        help="rewrite tvm_failures in conformance_known.json from a results "
                             "file of a full run, and exit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return 0
    if args.update_known:
        data = json.loads(Path(args.update_known).read_text())
        update_known([Result(**r) for r in data["results"]])
        return 0
    names = args.cases or [c.name for c in all_cases(tuple(args.suite or SUITES))]
    results = []
    with Runner(args.timeout) as runner:
        for i, name in enumerate(names):
            r = runner.run(name)
            results.append(r)
            flag = "REGRESSION" if r.regression else ""
            print(f"[{i + 1}/{len(names)}] {name}: tvm={r.tvm[:60]} tpp={r.tpp[:60]} "
                  f"{r.seconds:.1f}s {flag}", flush=True)
            if args.output and (i % 25 == 0 or i == len(names) - 1):
                Path(args.output).write_text(json.dumps(
                    {"summary": summarize(results), "results": [asdict(x) for x in results]},
                    indent=1))
    summary = summarize(results)
    print(json.dumps({k: v for k, v in summary.items() if k != "tpp_only"}, indent=1))
    return 1 if summary["regressions"] else 0


if __name__ == "__main__":
    sys.exit(main())
