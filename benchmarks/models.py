"""Whole-model fp32 inference: tpp_tvm against ONNX Runtime, torch, torch.compile and plain TVM.

The question this answers is the project's promise: does ``compile_onnx`` with the TPP target
run real models at ONNX Runtime speed or better, with the same answer? Models come from
``tpp_tvm.models`` (random weights from a fixed seed; ONNX files cached under ``--cache-dir``,
never committed): the default MLP (64x1024 -> 4096 -> 4096 -> 1024, GELU), BERT-base (12
layers, seq 128, batch 1) and ResNet-50 (1x3x224x224).

Each (implementation, thread count) runs in its own worker process, since thread pools are
sized once per process (TVM's from ``TVM_NUM_THREADS`` at first use, OpenMP's at load); the
parent merges their JSON (timing, workers and result files: ``benchmarks/harness.py``)::

    python benchmarks/models.py                        # full size, 1 and 2 threads
    python benchmarks/models.py --quick                # BERT 2 layers, a smaller ResNet
    python benchmarks/models.py --tiny --threads 1 --out /tmp/res   # harness check
    python benchmarks/models.py --passes 3   # alternate the workers 3 times, keep the fastest

Reported per model: median latency (ms), compile time (s) of tpp_tvm and TVM-default, max abs
error against ONNX Runtime, tpp_tvm's speed relative to ONNX Runtime, the model's FLOPs
(GEMM/MatMul/Conv multiply-adds x 2) and GFLOP/s as % of the measured fp32 peak
(``benchmarks/peak.py``). Writes ``models.json`` (rows) and ``models.md`` (tables).

Low-precision rows (their own table): bf16 (``compile_onnx(precision="bf16")`` against
torch eager under bf16 autocast) on the MLP and BERT, and int8 on the MLP and ResNet-50
(the model quantized by ONNX Runtime, dynamic and static QDQ, run by tpp_tvm and by ONNX
Runtime)::

    python benchmarks/models.py --quick --models mlp,bert \
        --impls tpp_tvm_bf16,torch_bf16,tpp_tvm_int8_dynamic,onnxruntime_int8_dynamic
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from harness import (
    CALIBRATION_SAMPLES,
    FP32_TOLERANCE,
    Skipped,
    keep_fastest,
    machine,
    measure_peaks,
    median_time,
    results_dir,
    run_header,
    untuned_tvm_matmul,
    use_quick_timing,
    worker_env,
    worker_rows,
    write_results,
)

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "tpp_tvm_models"

IMPLS: tuple[str, ...] = ("tpp_tvm", "onnxruntime", "openvino", "torch", "torch_compile",
                          "tvm_default")
IMPL_TITLES = {
    "tpp_tvm": "tpp_tvm",
    "onnxruntime": "ONNX Runtime",
    "openvino": "OpenVINO f32",
    "torch": "torch eager",
    "torch_compile": "torch.compile",
    "tvm_default": "TVM-default",
}

LOWP_IMPLS: tuple[str, ...] = (
    "tpp_tvm_bf16", "openvino_bf16", "torch_bf16", "tpp_tvm_int8_dynamic",
    "onnxruntime_int8_dynamic", "openvino_int8_dynamic", "tpp_tvm_int8_qdq",
    "onnxruntime_int8_qdq", "openvino_int8_qdq",
)
IMPL_TITLES.update({
    "tpp_tvm_bf16": "tpp_tvm bf16",
    "openvino_bf16": "OpenVINO bf16",
    "torch_bf16": "torch bf16 autocast",
    "tpp_tvm_int8_dynamic": "tpp_tvm int8 dynamic",
    "onnxruntime_int8_dynamic": "ORT int8 dynamic",
    "openvino_int8_dynamic": "OpenVINO int8 dynamic",
    "tpp_tvm_int8_qdq": "tpp_tvm int8 QDQ",
    "onnxruntime_int8_qdq": "ORT int8 QDQ",
    "openvino_int8_qdq": "OpenVINO int8 QDQ",
})
#: Models each low-precision implementation runs on (int8: the MLP, BERT and ResNet-50, in
#: BERT the dense layers int8 and the fused attention fp32 as in ONNX Runtime's and
#: OpenVINO's quantized models; bf16: the MLP and BERT, where matmuls dominate).
LOWP_MODELS = {impl: ("mlp", "bert", "resnet50") if "int8" in impl else ("mlp", "bert")
               for impl in LOWP_IMPLS}

TVM_DEFAULT_MAX_S = 60.0
"""TVM without tpp_tvm runs ~100x slower: a model whose one run would take longer is skipped."""

WORKER_TIMEOUT_S = 3600


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: a ``tpp_tvm.models`` generator and its arguments per size."""

    generator: str
    full: dict[str, Any]
    quick: dict[str, Any]

    def kwargs(self, size: str) -> dict[str, Any]:
        """Generator arguments for ``size`` (``full``, ``quick`` or ``tiny``)."""
        from tpp_tvm.models import TINY_ARGS

        return {"full": self.full, "quick": self.quick, "tiny": TINY_ARGS[self.generator]}[size]


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", {}, {}),
    "bert": ModelSpec("bert", {"layers": 12}, {"layers": 2}),
    # --quick: ResNet-50's stem, widths and stages with one bottleneck block per stage.
    "resnet50": ModelSpec("resnet50", {}, {"blocks": (1, 1, 1, 1)}),
}


def _arguments(spec: ModelSpec, size: str) -> dict[str, Any]:
    """All generator arguments, defaults included (for titles and torch rebuilds)."""
    from tpp_tvm.models import GENERATORS

    bound = inspect.signature(GENERATORS[spec.generator]).bind(**spec.kwargs(size))
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "cache_dir"}


def model_title(name: str, size: str) -> str:
    """What the model is, in the words of the table."""
    a = _arguments(MODELS[name], size)
    if name == "mlp":
        dims = " → ".join(map(str, a["dims"]))
        return f"MLP {a['batch']}×{dims} ({a['activation']})"
    if name == "bert":
        base = " (BERT-base)" if (a["layers"], a["hidden"]) == (12, 768) else ""
        layers = f"{a['layers']} layer" + ("s" if a["layers"] != 1 else "")
        shape = f"hidden {a['hidden']}, seq {a['seq']}, batch {a['batch']}"
        return f"BERT encoder{base}: {layers}, {shape}"
    blocks = "-".join(map(str, a["blocks"]))
    kind = "ResNet-50" if tuple(a["blocks"]) == (3, 4, 6, 3) and a["width"] == 64 else "ResNet"
    return f"{kind} (blocks {blocks}, width {a['width']}), {a['batch']}×3×{a['image']}²"


def example_inputs(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The same deterministic inputs in every worker (``tpp_tvm.models.example_inputs``)."""
    from tpp_tvm.models import example_inputs as make

    return make(model)


def load_model(name: str, size: str, cache_dir: Path) -> onnx.ModelProto:
    """The model's ONNX export (from the cache after the first call)."""
    from tpp_tvm.models import GENERATORS

    spec = MODELS[name]
    return GENERATORS[spec.generator](**spec.kwargs(size), cache_dir=cache_dir)


def model_flops(model: onnx.ModelProto) -> int:
    """2 x multiply-adds of the model's MatMul, Gemm and Conv nodes (static shapes)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes: dict[str, list[int]] = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        shapes[value.name] = [d.dim_value for d in value.type.tensor_type.shape.dim]
    for init in inferred.graph.initializer:
        shapes[init.name] = list(init.dims)
    flops = 0
    for node in inferred.graph.node:
        if node.op_type not in ("MatMul", "Gemm", "Conv"):
            continue
        out = shapes.get(node.output[0])
        a, b = shapes.get(node.input[0]), shapes.get(node.input[1])
        if not out or not a or not b:
            raise ValueError(f"no static shape for {node.op_type} node {node.name!r}")
        attrs = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        if node.op_type == "MatMul":
            k = a[-1]
        elif node.op_type == "Gemm":
            k = a[0] if attrs.get("transA", 0) else a[1]
        else:  # Conv: weight [O, I/groups, kh, kw]
            k = math.prod(b[1:])
        flops += 2 * math.prod(out) * k
    return flops


def _reference_path(model: onnx.ModelProto, name: str, size: str, cache_dir: Path) -> Path:
    digest = hashlib.sha256(model.SerializeToString()).hexdigest()[:12]
    return cache_dir / f"ref_{name}_{size}_{digest}.npz"


def write_reference(model: onnx.ModelProto, name: str, size: str, cache_dir: Path) -> Path | None:
    """ONNX Runtime's outputs on the example inputs, once, for every worker's error column."""
    path = _reference_path(model, name, size, cache_dir)
    if path.exists():
        return path
    try:
        from tpp_tvm.onnxruntime_ref import run_onnxruntime

        outputs = run_onnxruntime(model, example_inputs(model), threads=1)
    except ImportError:
        return None
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, *outputs)
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------- adapters
# Each adapter measures one model in a process whose thread count is already fixed, and
# returns its outputs on the example inputs (for the error column).


@dataclass
class Case:
    """One model to measure: its name and size, the ONNX model and the example inputs."""

    name: str
    size: str
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    threads: int
    cache_dir: Path


@dataclass
class Measured:
    """What an adapter returns for one model."""

    median_s: float
    outputs: list[np.ndarray]
    compile_s: float | None = None
    note: str = ""


Adapter = Callable[[Case], Measured]


def _calibration(inputs: dict[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]]:
    """``count`` inputs like ``inputs``: the example, then normal draws of its spread for
    float inputs (integer ones, token ids or masks, kept)."""
    rng = np.random.default_rng(0)
    samples = [inputs]
    for _ in range(count - 1):
        samples.append({k: (rng.standard_normal(v.shape) * (v.std() or 1.0) + v.mean())
                        .astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v
                        for k, v in inputs.items()})
    return samples


def _quantized(case: Case, kind: str) -> onnx.ModelProto:
    """The model quantized by ONNX Runtime as its documentation advises, cached next to the
    fp32 export: ``quant_pre_process`` first, then ``dynamic`` or static ``qdq`` (u8
    activations, s8 weights; QDQ calibrated on :data:`CALIBRATION_SAMPLES` inputs)."""
    digest = hashlib.sha256(case.model.SerializeToString()).hexdigest()[:12]
    path = case.cache_dir / f"{case.name}_{case.size}_{kind}_pre_{digest}.onnx"
    if not path.exists():
        from onnxruntime import quantization as q
        from onnxruntime.quantization.shape_inference import quant_pre_process

        src = case.cache_dir / f"{case.name}_{case.size}_fp32_{digest}.onnx"
        onnx.save(case.model, src)
        pre = path.with_suffix(f".{os.getpid()}.pre.onnx")
        quant_pre_process(str(src), str(pre))
        tmp = path.with_suffix(f".{os.getpid()}.tmp.onnx")
        if kind == "dynamic":
            q.quantize_dynamic(str(pre), str(tmp), weight_type=q.QuantType.QInt8)
        else:
            class Reader(q.CalibrationDataReader):
                def __init__(self) -> None:
                    self.batches = iter(_calibration(case.inputs, CALIBRATION_SAMPLES))

                def get_next(self):
                    return next(self.batches, None)

            q.quantize_static(str(pre), str(tmp), Reader(), quant_format=q.QuantFormat.QDQ,
                              activation_type=q.QuantType.QUInt8,
                              weight_type=q.QuantType.QInt8)
        pre.unlink()
        tmp.replace(path)
    return onnx.load(str(path))


def _tpp_tvm(case: Case, model: onnx.ModelProto, precision: str = "float32") -> Measured:
    """``compile_onnx`` (``precision``) with the host's TPP target sized to ``threads``."""
    from tpp_tvm import compile_onnx, target

    t0 = time.perf_counter()
    compiled = compile_onnx(model, target=target(num_cores=case.threads), precision=precision)
    compile_s = time.perf_counter() - t0
    values = list(case.inputs.values())
    outputs = compiled(*values)
    fallbacks = compiled.report_data.get("fallbacks", {})
    note = f"{_FALLBACKS}{dict(fallbacks)}" if fallbacks else ""
    seconds = median_time(lambda: compiled(*values))
    return Measured(seconds, outputs, compile_s, note)


def _ort(case: Case, model: onnx.ModelProto) -> Measured:
    import onnxruntime

    from tpp_tvm.onnxruntime_ref import onnxruntime_session

    session = onnxruntime_session(model, case.threads)
    outputs = session.run(None, case.inputs)
    seconds = median_time(lambda: session.run(None, case.inputs))
    return Measured(seconds, list(outputs), note=f"onnxruntime {onnxruntime.__version__}")


def _openvino(case: Case, model: onnx.ModelProto, precision: str | None) -> Measured:
    """OpenVINO's CPU plugin on ``threads`` threads; ``precision`` is its
    ``INFERENCE_PRECISION_HINT`` (``f32`` forces fp32 on CPUs where OpenVINO would pick bf16;
    None leaves it to OpenVINO, which runs a quantized model's int8 parts in int8)."""
    import openvino

    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": case.threads}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    with tempfile.TemporaryDirectory() as tmp:  # OpenVINO reads models from files
        path = Path(tmp) / "model.onnx"
        onnx.save(model, path)
        request = openvino.Core().compile_model(str(path), "CPU", config).create_infer_request()
    feeds = dict(case.inputs)
    result = request.infer(feeds)
    outputs = [np.asarray(result[out]) for out in request.model_outputs]
    seconds = median_time(lambda: request.infer(feeds))
    return Measured(seconds, outputs, note=f"openvino {openvino.__version__}, "
                    f"INFERENCE_PRECISION_HINT={precision or 'default'}")


def _run_onnxruntime(case: Case) -> Measured:
    """ONNX Runtime's CPU EP, ``threads`` intra-op threads, sequential execution."""
    import onnxruntime

    from tpp_tvm.onnxruntime_ref import onnxruntime_session

    session = onnxruntime_session(case.model, case.threads)
    outputs = session.run(None, case.inputs)
    seconds = median_time(lambda: session.run(None, case.inputs))
    return Measured(seconds, list(outputs), note=f"onnxruntime {onnxruntime.__version__}")


def torch_module(name: str, size: str) -> Any:
    """The generator's torch module with the generator's weights (``tpp_tvm.models`` builds
    both from one function), which the error column against ONNX Runtime checks."""
    from tpp_tvm import models as zoo

    a = _arguments(MODELS[name], size)
    if name == "bert":
        module = zoo.bert_encoder_torch(a["layers"], a["hidden"], a["heads"], a["intermediate"])
    elif name == "resnet50":
        module = zoo.resnet50_torch(a["image"], a["width"], a["blocks"], a["classes"])
    else:
        module = zoo.mlp_torch(a["dims"], a["activation"])
    return module.eval()


def _torch_call(case: Case, compile_: bool) -> Measured:
    import torch

    torch.set_num_threads(case.threads)
    module = torch_module(case.name, case.size)
    tensors = [torch.from_numpy(v) for v in case.inputs.values()]
    note = f"torch {torch.__version__}"
    with torch.inference_mode():
        fn = torch.compile(module) if compile_ else module
        t0 = time.perf_counter()
        out = fn(*tensors)
        first_s = time.perf_counter() - t0
        outputs = [o.numpy() for o in (out if isinstance(out, tuple | list) else [out])]
        seconds = median_time(lambda: fn(*tensors))
    if compile_:
        note += ", inductor; compile = first call, caches off"
        return Measured(seconds, outputs, first_s, note)
    return Measured(seconds, outputs, note=note)


def _run_torch(case: Case) -> Measured:
    """torch eager under ``inference_mode``, ``torch.set_num_threads(threads)``."""
    return _torch_call(case, compile_=False)


def _run_torch_bf16(case: Case) -> Measured:
    """torch eager under ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    import torch

    torch.set_num_threads(case.threads)
    module = torch_module(case.name, case.size)
    tensors = [torch.from_numpy(v) for v in case.inputs.values()]
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(*tensors)
        outputs = [o.float().numpy() for o in (out if isinstance(out, tuple | list) else [out])]
        seconds = median_time(lambda: module(*tensors))
    return Measured(seconds, outputs, note=f"torch {torch.__version__}, bf16 autocast")


def _run_torch_compile(case: Case) -> Measured:
    """``torch.compile`` (default inductor backend) of the same module."""
    return _torch_call(case, compile_=True)


_FALLBACKS = "fallbacks to TVM: "


def _tvm_default_once(model: onnx.ModelProto, threads: int) -> tuple[float, float, list]:
    """(compile s, seconds of one run, outputs) of TVM's default Relax pipeline."""
    import tvm
    from tvm import relax
    from tvm.target import codegen

    from tpp_tvm import from_onnx

    mcpu = str(codegen.llvm_get_system_cpu())
    # A Target, not the dict: tvm.compile's Relax path reads ``target.keys`` (a dict method).
    tgt = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": threads})
    t0 = time.perf_counter()
    exe = tvm.compile(from_onnx(model), target=tgt, relax_pipeline="default")
    compile_s = time.perf_counter() - t0
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in example_inputs(model).values()]
    t0 = time.perf_counter()
    out = vm["main"](*args)
    seconds = time.perf_counter() - t0
    outputs = [out.numpy()] if isinstance(out, tvm.runtime.Tensor) else [o.numpy() for o in out]
    return compile_s, seconds, outputs


_TVM_DEFAULT_RATE: list[float] = []  # GFLOP/s of an untuned matmul, measured once


def _tvm_default_rate(case: Case) -> tuple[float, str]:
    """Untuned TVM's GFLOP/s on this model, estimated without running it.

    Its speed differs by model (large GEMMs thrash the cache; convolutions do better), so
    full-size models are calibrated on their quick variant (same layers, fewer of them);
    others on an untuned BERT-sized matmul.
    """
    spec = MODELS[case.name]
    if case.size == "full" and spec.quick != spec.full:
        small = load_model(case.name, "quick", case.cache_dir)
        _, seconds, _ = _tvm_default_once(small, case.threads)
        gflop = model_flops(small) / 1e9
        return gflop / seconds, f"its --quick variant ({gflop:.1f} GFLOP in {seconds:.1f} s)"
    if not _TVM_DEFAULT_RATE:
        m, n, k = 128, 3072, 768
        rng = np.random.default_rng([m, n, k])
        a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
        _TVM_DEFAULT_RATE.append(2 * m * n * k / 1e9 / untuned_tvm_matmul(a, b)[1])
    return _TVM_DEFAULT_RATE[0], "an untuned 128×3072×768 matmul"


def _run_tvm_default(case: Case) -> Measured:
    """TVM without tpp_tvm: ``tvm.compile`` with Relax's default pipeline, run once."""
    from tvm.target import codegen

    gflop = model_flops(case.model) / 1e9
    if gflop >= 1.0:  # below that, one run takes seconds at worst
        rate, source = _tvm_default_rate(case)
        if gflop / rate > TVM_DEFAULT_MAX_S:
            raise Skipped(
                f"skipped: one run est. {gflop / rate:.0f} s > {TVM_DEFAULT_MAX_S:.0f} s "
                f"({gflop:.1f} GFLOP at {rate:.2f} GFLOP/s, measured on {source})"
            )
    compile_s, seconds, outputs = _tvm_default_once(case.model, case.threads)
    mcpu = str(codegen.llvm_get_system_cpu())
    return Measured(seconds, outputs, compile_s, f"default pipeline, llvm mcpu={mcpu}; 1 run")


ADAPTERS: dict[str, Adapter] = {
    "tpp_tvm_bf16": lambda case: _tpp_tvm(case, case.model, "bfloat16"),
    "torch_bf16": _run_torch_bf16,
    "tpp_tvm_int8_dynamic": lambda case: _tpp_tvm(case, _quantized(case, "dynamic")),
    "onnxruntime_int8_dynamic": lambda case: _ort(case, _quantized(case, "dynamic")),
    "tpp_tvm_int8_qdq": lambda case: _tpp_tvm(case, _quantized(case, "qdq")),
    "onnxruntime_int8_qdq": lambda case: _ort(case, _quantized(case, "qdq")),
    "openvino_bf16": lambda case: _openvino(case, case.model, "bf16"),
    "openvino_int8_dynamic": lambda case: _openvino(case, _quantized(case, "dynamic"), None),
    "openvino_int8_qdq": lambda case: _openvino(case, _quantized(case, "qdq"), None),
    "openvino": lambda case: _openvino(case, case.model, "f32"),
    "tpp_tvm": lambda case: _tpp_tvm(case, case.model),
    "onnxruntime": _run_onnxruntime,
    "torch": _run_torch,
    "torch_compile": _run_torch_compile,
    "tvm_default": _run_tvm_default,
}


def _row(model: str, impl: str, threads: int, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model, "impl": impl, "threads": threads}
    row.update({"status": None, "median_ms": None, "compile_s": None, "max_abs_err": None})
    row.update({"gflops": None, "pct_peak": None, "note": ""})
    row.update(extra)
    return row


def _max_abs_err(outputs: list[np.ndarray], ref_path: str | None) -> float | None:
    if not ref_path:
        return None
    with np.load(ref_path) as ref:
        refs = [ref[k] for k in sorted(ref.files, key=lambda k: int(k.split("_")[1]))]
    if len(refs) != len(outputs) or any(o.shape != r.shape for o, r in zip(outputs, refs)):
        return math.inf
    return max(float(np.max(np.abs(np.asarray(o) - r))) for o, r in zip(outputs, refs))


def run_worker(
    impl: str, threads: int, names: list[str], size: str, cache_dir: Path, refs: dict[str, str]
) -> list[dict]:
    """Measure ``impl`` on each model in this process; a failing model becomes an error row."""
    rows = []
    for name in names:
        try:
            model = load_model(name, size, cache_dir)
            case = Case(name, size, model, example_inputs(model), threads, cache_dir)
            res = ADAPTERS[impl](case)
        except ImportError as exc:
            rows.append(_row(name, impl, threads, status="missing", note=f"missing: {exc}"))
            continue
        except Skipped as exc:
            rows.append(_row(name, impl, threads, status="skipped", note=str(exc)))
            continue
        except Exception as exc:  # a benchmark row records any failure
            text = str(exc).strip().splitlines()
            msg = f"error: {type(exc).__name__}: {text[0] if text else ''}"
            rows.append(_row(name, impl, threads, status="error", note=msg[:300]))
            continue
        rows.append(
            _row(
                name,
                impl,
                threads,
                status="ok",
                median_ms=1e3 * res.median_s,
                compile_s=res.compile_s,
                max_abs_err=_max_abs_err(res.outputs, refs.get(name)),
                note=res.note,
            )
        )
    return rows


# ----------------------------------------------------------------------------- parent


def _spawn_worker(impl: str, threads: int, names: list[str], args: argparse.Namespace,
                  refs: dict[str, str]) -> list[dict]:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl,
        "--threads", str(threads), "--models", ",".join(names), "--size", args.size,
        "--cache-dir", str(args.cache_dir), "--refs", json.dumps(refs),
    ] + (["--quick"] if args.quick else [])
    env = worker_env(threads)
    if impl == "torch_compile":
        # Compile time means a cold compile, not a hit in inductor's on-disk cache.
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    rows, why = worker_rows(cmd, env, WORKER_TIMEOUT_S)
    if rows is not None:
        return rows
    return [_row(n, impl, threads, status="error", note=why[:300]) for n in names]


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _cell(row: dict | None, field: str = "median_ms") -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    value = row.get(field)
    if value is None:
        return "-"
    if field == "max_abs_err":
        return f"{value:.1e}"
    if field == "compile_s":
        return f"{value:.1f}"
    return _ms(value)


def render_markdown(rows: list[dict], info: dict[str, dict], peaks: dict[int, float],
                    command: str, machine_line: str, date: str, load: str) -> str:
    """models.md: latency table, compile/accuracy table, and notes (skips, errors)."""
    by_key = {(r["model"], r["impl"], r["threads"]): r for r in rows}
    threads = sorted(peaks)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    peak_text = ", ".join(f"{peaks[t]:.1f} GFLOP/s on {t} thread(s)" for t in threads)
    lines = [
        "# Model inference, fp32: median latency (ms)",
        "",
        *run_header(machine_line, date, command, load),
        f"- Measured fp32 FMA peak (`benchmarks/peak.py`, best of before and after): "
        f"{peak_text}.",
        "- Implementations: tpp_tvm = `compile_onnx` with the host's TPP target; ONNX Runtime "
        "= CPU EP, intra-op threads = threads, sequential; OpenVINO f32 = CPU plugin, "
        "`INFERENCE_PRECISION_HINT=f32`, `INFERENCE_NUM_THREADS` = threads; torch eager = "
        "`inference_mode`, "
        "`torch.set_num_threads`; torch.compile = default (inductor) backend; TVM-default = "
        "`tvm.compile(from_onnx(...), relax_pipeline=\"default\")`, run once. Each implementation "
        "and thread count runs in its own process (with `--passes`, alternating passes: the "
        "fastest is kept).",
        "- GFLOP counts MatMul/Gemm/Conv (2 × multiply-adds); % peak = GFLOP / latency / peak. "
        "Max abs error is against ONNX Runtime's output on the same inputs.",
        "",
        "Models:",
        "",
    ]
    for name, i in info.items():
        scale = i.get("output_max_abs")
        scale_text = f", max |output| {scale:.3g} (scale of the errors)" if scale else ""
        lines.append(f"- `{name}`: {i['title']}, {i['gflop']:.3g} GFLOP{scale_text}")
    lines += [
        "",
        "| model | threads | " + " | ".join(IMPL_TITLES[i] for i in impls)
        + " | tpp_tvm % peak | ORT % peak | tpp_tvm speed / ORT | tpp_tvm speed / OpenVINO |",
        "|---|---:|" + "---:|" * len(impls) + "---:|---:|---:|---:|",
    ]
    for name in info:
        for t in threads:
            cells = [_cell(by_key.get((name, i, t))) for i in impls]
            tpp, ort = by_key.get((name, "tpp_tvm", t)), by_key.get((name, "onnxruntime", t))

            def pct(row: dict | None) -> str:
                return f"{row['pct_peak']:.0f}%" if row and row["pct_peak"] is not None else "-"

            def speed(peer: dict | None) -> str:
                if tpp and tpp.get("wrong"):
                    return "**wrong output**"
                if tpp and peer and tpp["median_ms"] and peer["median_ms"]:
                    return f"{peer['median_ms'] / tpp['median_ms']:.2f}×"
                return "-"

            ov = by_key.get((name, "openvino", t))
            lines.append(f"| {name} | {t} | " + " | ".join(cells)
                         + f" | {pct(tpp)} | {pct(ort)} | {speed(ort)} | {speed(ov)} |")
    lines += [
        "",
        "tpp_tvm speed / ORT > 1 means tpp_tvm is faster.",
        "",
        "## Compile time (s) and max abs error vs ONNX Runtime",
        "",
        "| model | threads | tpp_tvm compile | TVM-default compile | torch.compile compile | "
        + " | ".join(f"{IMPL_TITLES[i]} error" for i in impls if i != "onnxruntime")
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * sum(i != "onnxruntime" for i in impls),
    ]
    for name in info:
        for t in threads:
            compiles = [
                _cell(by_key.get((name, i, t)), "compile_s")
                for i in ("tpp_tvm", "tvm_default", "torch_compile")
            ]
            errs = [
                _cell(by_key.get((name, i, t)), "max_abs_err") for i in impls if i != "onnxruntime"
            ]
            lines.append(f"| {name} | {t} | " + " | ".join(compiles + errs) + " |")
    lines += _lowp_table(by_key, info, threads)
    notes = _notes(rows)
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _lowp_table(by_key: dict, info: dict[str, dict], threads: list[int]) -> list[str]:
    """Low precision: latency (ms) and max abs error vs fp32 ONNX Runtime, with speed ratios
    against the peer in the same precision."""
    present = [i for i in LOWP_IMPLS if any(k[1] == i for k in by_key)]
    if not present:
        return []
    pairs = [("tpp_tvm_bf16", "openvino_bf16"), ("tpp_tvm_bf16", "torch_bf16"),
             ("tpp_tvm_int8_dynamic", "onnxruntime_int8_dynamic"),
             ("tpp_tvm_int8_dynamic", "openvino_int8_dynamic"),
             ("tpp_tvm_int8_qdq", "onnxruntime_int8_qdq"),
             ("tpp_tvm_int8_qdq", "openvino_int8_qdq")]
    pairs = [p for p in pairs if p[0] in present and p[1] in present]
    lines = [
        "",
        "## Low precision: median latency (ms) / max abs error vs fp32 ONNX Runtime",
        "",
        "bf16: matmuls in bf16 with fp32 accumulation (tpp_tvm `precision=\"bf16\"`, on AMX "
        "tiles where the host has them; OpenVINO `INFERENCE_PRECISION_HINT=bf16`; torch "
        "eager under bf16 autocast). int8: the model quantized by ONNX Runtime "
        "after `quant_pre_process` (`quantize_dynamic`, or `quantize_static` QDQ calibrated "
        f"on {CALIBRATION_SAMPLES} inputs; u8 activations, s8 weights), run by tpp_tvm, ONNX "
        "Runtime and OpenVINO. Ratios > 1: "
        "tpp_tvm is faster than the peer in the same precision.",
        "",
        "| model | threads | " + " | ".join(IMPL_TITLES[i] for i in present)
        + "".join(f" | {IMPL_TITLES[a]} speed / {IMPL_TITLES[b]}" for a, b in pairs) + " |",
        "|---|---:|" + "---:|" * (len(present) + len(pairs)),
    ]
    for name in info:
        for t in threads:
            rows = {i: by_key.get((name, i, t)) for i in present}
            if not any(rows.values()):
                continue
            cells = [f"{_cell(r)} / {_cell(r, 'max_abs_err')}" if r else "-"
                     for r in rows.values()]
            ratios = []
            for a, b in pairs:
                ra, rb = rows[a], rows[b]
                ok = ra and rb and ra["median_ms"] and rb["median_ms"]
                ratios.append(f"{rb['median_ms'] / ra['median_ms']:.2f}×" if ok else "-")
            lines.append(f"| {name} | {t} | " + " | ".join(cells + ratios) + " |")
    return lines


def _notes(rows: list[dict]) -> list[str]:
    """Why a cell is not a number (per row), version notes (per implementation), fallbacks."""
    notes: set[str] = set()
    for r in rows:
        if r["impl"] not in IMPL_TITLES or not r.get("note"):
            continue
        title = IMPL_TITLES[r["impl"]]
        if r["status"] != "ok" or r["note"].startswith(_FALLBACKS):
            notes.add(f"{title}, {r['model']}, {r['threads']} thread(s): {r['note']}")
        else:
            notes.add(f"{title}: {r['note']}")
    return sorted(notes)


def run_parent(args: argparse.Namespace, argv: list[str]) -> int:
    """Generate models and references, run every (impl, threads) worker, write the results."""
    names = args.models.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    impls = args.impls.split(",") if args.impls else list(IMPLS + LOWP_IMPLS)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    info: dict[str, dict] = {}
    refs: dict[str, str] = {}
    for name in names:
        print(f"generating {name} ({args.size}) ...", file=sys.stderr)
        model = load_model(name, args.size, args.cache_dir)
        flops = model_flops(model)
        info[name] = {"title": model_title(name, args.size), "gflop": flops / 1e9}
        ref = write_reference(model, name, args.size, args.cache_dir)
        if ref is not None:
            refs[name] = str(ref)
            with np.load(ref) as outputs:
                info[name]["output_max_abs"] = max(float(np.abs(outputs[k]).max()) for k in outputs)
    load_before = os.getloadavg()[0]
    print(f"measuring fp32 peak on {threads} thread(s) ...", file=sys.stderr)
    peaks = measure_peaks(threads)
    rows: list[dict] = []
    for _ in range(args.passes):
        for t in threads:
            for impl in impls:
                run = [n for n in names if n in LOWP_MODELS.get(impl, names)]
                if not run:
                    continue
                print(f"{impl}, {t} thread(s) ...", file=sys.stderr)
                rows = keep_fastest(rows + _spawn_worker(impl, t, run, args, refs),
                                    ("model", "impl", "threads"), "median_ms")
    # A peak is what the hardware can do and other load only subtracts: keep the better one.
    after = measure_peaks(threads)
    peaks = {t: max(p, after[t]) for t, p in peaks.items()}
    for row in rows:
        gflop = info[row["model"]]["gflop"]
        row["gflop"] = gflop
        row["size"] = args.size
        if row["median_ms"]:
            row["gflops"] = gflop / (row["median_ms"] / 1e3)
            row["pct_peak"] = 100.0 * row["gflops"] / peaks[row["threads"]]
    wrong = _mark_wrong(rows, info)
    rows += [
        _row(None, "peak", t, status="ok", gflops=p, pct_peak=100.0) for t, p in peaks.items()
    ]
    write_results(args.out, "models", argv, rows, load_before,
                  lambda command, date, load: render_markdown(
                      rows, info, peaks, command, machine(), date, load))
    for row in wrong:
        print(f"wrong output: {row['model']}, {row['threads']} thread(s): max abs err "
              f"{row['max_abs_err']:.3g}", file=sys.stderr)
    return 1 if wrong else 0


def _mark_wrong(rows: list[dict], info: dict[str, dict]) -> list[dict]:
    """fp32 tpp_tvm rows further from ONNX Runtime than ``FP32_TOLERANCE`` of the output's
    scale: marked ``wrong`` (no speed ratio), and the run exits non-zero."""
    wrong = []
    for row in rows:
        scale = info[row["model"]].get("output_max_abs")
        err = row.get("max_abs_err")
        if row["impl"] == "tpp_tvm" and scale and err is not None \
                and err / scale > FP32_TOLERANCE:
            row["wrong"] = True
            wrong.append(row)
    return wrong


def main(argv: list[str] | None = None) -> int:
    """Parent by default; ``--worker`` measures one implementation and prints JSON rows."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--impls",
                        help=f"comma-separated subset of {','.join(IMPLS + LOWP_IMPLS)}")
    parser.add_argument("--quick", action="store_true",
                        help="BERT 2 layers, a smaller ResNet, shorter timing")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models (implies --quick): checks the harness end to end")
    parser.add_argument("--out", help="folder for models.json/models.md (default: results/<cpu>)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run every worker this many times, alternating, and keep each "
                             "one's fastest pass (drift on shared machines)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help="where generated ONNX models and references are kept")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS + LOWP_IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=("full", "quick", "tiny"), help=argparse.SUPPRESS)
    parser.add_argument("--refs", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None and not getattr(args, "worker", None):
        args.out = str(results_dir())
    if args.impls and not set(args.impls.split(",")) <= set(IMPLS + LOWP_IMPLS):
        parser.error(f"--impls must be a subset of {','.join(IMPLS + LOWP_IMPLS)}")
    if not set(args.models.split(",")) <= set(MODELS):
        parser.error(f"--models must be a subset of {','.join(MODELS)}")
    args.quick = args.quick or args.tiny
    if args.size is None:
        args.size = "tiny" if args.tiny else "quick" if args.quick else "full"
    if not args.worker:
        return run_parent(args, argv)
    if args.quick:
        use_quick_timing()
    rows = run_worker(
        args.impl, int(args.threads), args.models.split(","), args.size, args.cache_dir,
        json.loads(args.refs),
    )
    print(json.dumps(rows))  # the parent reads the last line of stdout
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
