"""The ``tpp-tvm`` command line: ``info``, ``compile``, ``run`` and ``demo``.

``compile`` and ``run`` are the one-command route from an ONNX file to a TPP-compiled model;
``demo`` shows the point of the project on models a user recognises (a BERT encoder and a
ResNet), next to ONNX Runtime when it is installed. Errors a user can cause
(:class:`~tpp_tvm.errors.TPPError`, e.g. a missing model file) print one line and exit with
status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpp_tvm.errors import TPPError, UnsupportedShapeError

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from tpp_tvm.compiled import CompiledModel

DEMO_SHAPE = (512, 512, 512)
DEMO_CACHE = Path(tempfile.gettempdir()) / "tpp_tvm_models"
"""Where ``demo`` keeps its generated ONNX models, so a second demo does not re-export."""

_LIBRARY_SUFFIXES = (".so", ".dylib", ".dll")


class CLIError(TPPError):
    """A command line that cannot work (e.g. ``--compare`` on a library with no ONNX model)."""


def _show(tgt: Any) -> str:
    """A target as readable JSON (TVM escapes the slash of tags as ``\\/``)."""
    return str(tgt).replace("\\/", "/")


def _cmd_info(args: argparse.Namespace) -> int:
    """Print the detected host ISA, the TPP target chosen for it, the core table its GEMMs are
    blocked by and the registered TPPs."""
    from tpp_tvm.target import host_isa, isa_of, target

    host = host_isa()
    print(f"host:    {host.model_name}")
    print(f"isa:     {host.summary()}")
    tgt = target(args.isa)
    print(f"target:  {isa_of(tgt)}: {_show(tgt)}")
    from tpp_tvm.schedules.gemm_plan import core_table

    print(f"tiles:   {core_table(isa_of(tgt)).summary()}")
    try:
        from tpp_tvm.intrinsics.registry import catalogue_names

        # The per-ISA templates are imported lazily: a broken one is reported here rather
        # than hiding what was detected above.
        names = catalogue_names()
    except ImportError as exc:
        print(f"TPPs:    not available ({exc})")
        return 0
    print(f"TPPs:    {len(names)} in the catalogue (built on first use)")
    for name in names:
        print(f"  {name}")
    return 0


def _median_seconds(fn: Callable[[], Any], min_total_s: float = 0.5) -> float:
    """Median seconds per call over repeats of at least ~50 ms each (after one warm-up)."""
    fn()
    t0 = time.perf_counter()
    fn()
    number = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-9)))
    samples: list[float] = []
    while not samples or (sum(samples) * number < min_total_s and len(samples) < 9):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


# --------------------------------------------------------------------------------------------
# Shared by compile, run and demo


def _parse_shapes(text: str) -> dict[str, tuple[int | None, ...]]:
    """``name=1x128,mask=1x1x1x128`` -> ``{"name": (1, 128), "mask": (1, 1, 1, 128)}``;
    a ``?`` dim is dynamic (``ids=1x?`` -> ``(1, None)``)."""
    shapes: dict[str, tuple[int | None, ...]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, dims = item.rpartition("=")
        try:
            shape = tuple(None if d == "?" else int(d) for d in dims.lower().split("x"))
        except ValueError:
            shape = ()
        if not sep or not name or not shape or min((d for d in shape if d is not None),
                                                    default=0) < 0:
            raise argparse.ArgumentTypeError(
                f"--shape item {item!r} is not NAME=DIMxDIM... (e.g. input=1x128, or "
                "input=1x? for a dynamic dim)"
            )
        shapes[name] = shape
    return shapes


def _parse_bounds(text: str) -> dict[str, tuple[int, int]]:
    """``seq=1:512,batch=1:8`` -> ``{"seq": (1, 512), "batch": (1, 8)}``."""
    bounds: dict[str, tuple[int, int]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, span = item.rpartition("=")
        low, colon, high = span.partition(":")
        try:
            bounds[name] = (int(low), int(high))
        except ValueError:
            name = ""
        if not sep or not name or not colon:
            raise argparse.ArgumentTypeError(
                f"--dynamic item {item!r} is not NAME=LOW:HIGH (e.g. seq=1:512)")
    return bounds


def _concrete(shapes: dict) -> bool:
    return all(d is not None for shape in shapes.values() for d in shape)


def _fix_threads(threads: int | None) -> None:
    """Make ``--threads`` win over ``TVM_NUM_THREADS`` and over a compiled model's own count.

    TVM sizes its pool once per process, from the variable, at first use: so it is set here,
    before any model is compiled or loaded. Printed thread counts are what the pool runs.
    """
    if threads:
        os.environ["TVM_NUM_THREADS"] = str(threads)


def _target(args: argparse.Namespace) -> Any:
    from tpp_tvm.target import target

    return target(args.isa, num_cores=args.threads,
                  emulate_tiles=getattr(args, "emulate_tiles", False))


def _tune_logs_arg(args: argparse.Namespace) -> str | None:
    logs = getattr(args, "tune_logs", "none")
    return None if logs == "none" else logs


def _compile(
    model: onnx.ModelProto, label: str, args: argparse.Namespace, shapes: dict | None = None
) -> CompiledModel:
    """Compile with a progress line: ``compiling <label>... done in 4.1 s``."""
    from tpp_tvm.compiled import compile_onnx

    print(f"compiling {label}... ", end="", flush=True)
    t0 = time.perf_counter()
    try:
        compiled = compile_onnx(model, _target(args), shapes or None,
                                precision=getattr(args, "precision", None) or "float32",
                                tune_logs=_tune_logs_arg(args),
                                dynamic=getattr(args, "dynamic", None) or None)
    except BaseException as exc:
        print("failed", flush=True)
        if isinstance(exc, UnsupportedShapeError) and "shape_dict" in str(exc):
            raise CLIError(f"{exc} (on the command line: --shape NAME=1x128,...)") from exc
        raise
    seconds = time.perf_counter() - t0
    dims = getattr(compiled, "dims", None)
    if dims:
        print(f"dynamic ({', '.join(dims)}): each size compiles when first run", flush=True)
    else:
        print(f"done in {seconds:.1f} s", flush=True)
    return compiled


def _is_library(path: Path) -> bool:
    from tpp_tvm.dynamic import is_dynamic_export

    return (path.suffix in _LIBRARY_SUFFIXES or Path(str(path) + ".tpp.json").exists()
            or is_dynamic_export(path))


def _inputs_for(compiled: CompiledModel) -> dict[str, np.ndarray]:
    """Deterministic inputs for a loaded library with no ONNX model at hand.

    A stand-in ONNX graph with the same input names, shapes and dtypes goes through
    :func:`~tpp_tvm.models.example_inputs`, so the arrays equal those of the original model
    (except attention masks, which the library does not record: they get normal values).
    """
    import numpy as np
    from onnx import helper

    from tpp_tvm.models import example_inputs

    values = [
        helper.make_tensor_value_info(
            spec.name, helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype)), list(spec.shape)
        )
        for spec in compiled.inputs
    ]
    graph = helper.make_graph([], "inputs", values, [])
    return example_inputs(helper.make_model(graph))


def _run_once(compiled: CompiledModel, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    # Positional, in graph order: TVM sanitizes names (``input.1`` -> ``input_1``).
    return compiled(*inputs.values())


def _time_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:9.1f} ms" if ms >= 100 else f"{ms:9.3f} ms"


def _compare(
    model: onnx.ModelProto,
    inputs: dict[str, np.ndarray],
    outputs: list[np.ndarray],
    threads: int,
    tpp_s: float,
    indent: str = "",
) -> None:
    """Run ONNX Runtime on the same inputs and threads; print latency, speed-up and error."""
    import numpy as np

    try:
        from tpp_tvm.onnxruntime_ref import onnxruntime_session

        session = onnxruntime_session(model, threads)
    except ImportError as exc:
        raise CLIError(str(exc)) from exc
    ref = session.run(None, inputs)
    ort_s = _median_seconds(lambda: session.run(None, inputs))
    abs_err = max(float(np.max(np.abs(o - r))) for o, r in zip(outputs, ref, strict=True))
    scale = max(float(np.max(np.abs(r))) for r in ref)
    print(f"{indent}onnxruntime: {_time_ms(ort_s)} on {threads} thread(s)")
    print(f"{indent}speed-up:    {ort_s / tpp_s:9.2f} x  (onnxruntime time / tpp_tvm time)")
    print(
        f"{indent}max error:   {abs_err:9.1e} abs, {abs_err / max(scale, 1e-30):.1e} rel "
        f"(to max |output| {scale:.3g}), vs onnxruntime"
    )


# --------------------------------------------------------------------------------------------
# compile


def _load_onnx(path: str) -> onnx.ModelProto:
    from tpp_tvm.frontend import load_model

    return load_model(path)


def _compile_size(model: Any, inputs: dict[str, np.ndarray]) -> None:
    """Compile a dynamic model's build for the size of ``inputs`` (with a progress line;
    nothing to do when it is compiled already)."""
    size = model.size_of(inputs)
    if dict(size) in model.compiled_sizes:
        return
    label = ", ".join(f"{n}={v}" for n, v in size)
    print(f"compiling size {label}... ", end="", flush=True)
    t0 = time.perf_counter()
    model.specialization(size)
    print(f"done in {time.perf_counter() - t0:.1f} s", flush=True)


def _cmd_compile(args: argparse.Namespace) -> int:
    """Compile an ONNX model onto TPPs and export it as a library ``run``/``load`` accept."""
    from tpp_tvm.dynamic import DynamicModel
    from tpp_tvm.models import example_inputs

    model = _load_onnx(args.model)
    compiled = _compile(model, Path(args.model).name, args, args.shape)
    if args.prepare and not isinstance(compiled, DynamicModel):
        raise CLIError("--prepare is for dynamic models (mark dims with --shape NAME=1x? "
                       "or --dynamic NAME=LOW:HIGH)")
    for shapes in args.prepare:  # sizes compiled now and exported with the model
        _compile_size(compiled, example_inputs(model, shapes))
    out = compiled.export(args.output)
    if isinstance(compiled, DynamicModel):
        print(f"wrote {out}/ (a dynamic model with {len(compiled.compiled_sizes)} size(s) "
              f"compiled; others compile on first use: `tpp-tvm run {out} --shape ...`)")
    else:
        print(f"wrote {out} (and {out.name}.tpp.json)")
    print(compiled.report())
    return 0


# --------------------------------------------------------------------------------------------
# tune


def _cmd_tune(args: argparse.Namespace) -> int:
    """Tune an ONNX model's TPP subgraphs with MetaSchedule; write a tuning log."""
    from tpp_tvm.frontend import from_onnx
    from tpp_tvm.tuning.driver import make_runner, tune

    model = _load_onnx(args.model)
    mod = from_onnx(model, args.shape or None)
    runner = make_runner(args.rpc_tracker, args.rpc_key) if args.rpc_tracker else None
    if args.rpc_key and not args.rpc_tracker:
        raise CLIError("--rpc-key needs --rpc-tracker HOST:PORT")
    result = tune(mod, _target(args), args.work_dir, trials_per_task=args.trials,
                  runner=runner, name=args.name or Path(args.model).stem)
    print(result.summary())
    print(f"use it: tpp-tvm run {args.model} --tune-logs {result.log_dir}")
    return 0


# --------------------------------------------------------------------------------------------
# run


def _cmd_run(args: argparse.Namespace) -> int:
    """Run an ONNX model (compiled now) or an exported library on deterministic inputs."""
    from tpp_tvm.compiled import load
    from tpp_tvm.dynamic import DynamicModel, is_dynamic_export
    from tpp_tvm.models import example_inputs

    path = Path(args.model)
    library = _is_library(path)
    dynamic_library = is_dynamic_export(path)
    if library and args.shape and not dynamic_library:
        raise CLIError(f"{path} is compiled: its input shapes were fixed by `compile`")
    if not _concrete(args.shape):
        raise CLIError("run needs every dim of --shape (a size to run at); mark dims "
                       "dynamic with --dynamic NAME=LOW:HIGH or in `compile --shape`")
    if library and args.compare and not args.onnx and not dynamic_library:
        raise CLIError(
            f"--compare {args.compare} needs the ONNX model {path} was compiled from: add --onnx"
        )
    if not library and args.onnx:
        raise CLIError("--onnx is for compiled libraries; MODEL is already ONNX")
    _fix_threads(args.threads)
    if dynamic_library:
        onnx_model = _load_onnx(args.onnx or str(path / "model.onnx"))
        compiled = load(path)
        print(f"loaded {path} (dynamic: {', '.join(compiled.dims)}; "
              f"{len(compiled.compiled_sizes)} size(s) compiled)")
    elif library:
        onnx_model = _load_onnx(args.onnx) if args.onnx else None
        compiled = load(path)
        print(f"loaded {path} ({compiled.threads} thread(s))")
    else:
        onnx_model = _load_onnx(args.model)
        shapes = args.shape
        if args.dynamic:  # dims named in --dynamic stay dynamic; run at --shape's size
            shapes = {}
        compiled = _compile(onnx_model, path.name, args, shapes)
    if isinstance(compiled, DynamicModel) and not args.shape:
        raise CLIError(f"{path.name} has dynamic dims ({', '.join(compiled.dims)}): give "
                       "the size to run at with --shape NAME=1x128,...")
    if onnx_model is not None:
        inputs = example_inputs(onnx_model, args.shape or None)
    else:
        inputs = _inputs_for(compiled)
    if isinstance(compiled, DynamicModel):
        _compile_size(compiled, inputs)
    outputs = _run_once(compiled, inputs)
    for i, out in enumerate(outputs):
        print(f"output {i}: {out.dtype} {tuple(out.shape)}")
    if args.profile:
        if isinstance(compiled, DynamicModel):
            raise CLIError("--profile times a static build: compile the size with "
                           "`compile --shape` (all dims fixed) and profile that")
        compiled.profile(*inputs.values())
        print(compiled.report())
    if args.bench or args.compare:
        tpp_s = _median_seconds(lambda: _run_once(compiled, inputs))
        print(f"tpp_tvm:     {_time_ms(tpp_s)} on {compiled.threads} thread(s) (median)")
        if args.compare:
            _compare(onnx_model, inputs, outputs, compiled.threads, tpp_s)
    return 0


# --------------------------------------------------------------------------------------------
# demo


def demo_models(full: bool) -> list[tuple[str, Callable[[], onnx.ModelProto]]]:
    """(label, generator) of the demo's BERT encoder and ResNet, small unless ``full``."""
    from tpp_tvm import models

    layers = 12 if full else 2
    # ResNet-50 proper with --full; else the same stem, stages and widths with one
    # bottleneck block per stage, which compiles in seconds here.
    blocks = (3, 4, 6, 3) if full else (1, 1, 1, 1)
    resnet = "ResNet-50" if full else "ResNet, 1 bottleneck block per stage"
    return [
        (
            f"bert_encoder ({layers} layers, hidden 768, seq 128)",
            lambda: models.bert_encoder(layers=layers, cache_dir=DEMO_CACHE),
        ),
        (
            f"resnet ({resnet}, 1x3x224x224)",
            lambda: models.resnet50(blocks=blocks, cache_dir=DEMO_CACHE),
        ),
    ]


def _have_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def _cmd_generate(args: argparse.Namespace) -> int:
    """Greedy decoding of a causal LM exported with its KV cache (``tpp_tvm.cache_export``)."""
    from tpp_tvm.decoding import DecoderSession

    try:
        prompt = [int(t) for t in args.prompt.split(",")]
    except ValueError:
        raise CLIError(f"--prompt {args.prompt!r}: give token ids separated by commas") from None
    if args.new < 1:
        raise CLIError(f"--new {args.new}: generate at least one token")
    _fix_threads(args.threads)
    print(f"compiling {Path(args.model).name} for {len(prompt)} + {args.new} tokens... ",
          end="", flush=True)
    t0 = time.perf_counter()
    session = DecoderSession(args.model, _target(args), precision=args.precision,
                             tune_logs=_tune_logs_arg(args), cache_dtype=args.kv_cache)
    session.prepare(len(prompt), len(prompt) + args.new)
    print(f"done in {time.perf_counter() - t0:.1f} s", flush=True)
    out = session.generate([prompt], args.new)
    print("tokens: " + ",".join(str(int(t)) for t in out.tokens[0]))
    print(f"prefill {1e3 * out.prefill_seconds:.1f} ms; {len(out.step_seconds)} steps at "
          f"{out.tokens_per_second:.1f} tokens/s")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Compile a BERT encoder and a ResNet onto TPPs, run them, compare with ONNX Runtime."""
    if args.gemm:
        return _demo_gemm(args)
    from tpp_tvm.models import example_inputs

    _fix_threads(args.threads)
    print(f"target: {_show(_target(args))}")
    compare = _have_onnxruntime()
    if not compare:
        print("onnxruntime is not installed: no comparison (pip install onnxruntime)")
    for label, generate in demo_models(args.full):
        try:
            model = generate()
        except ImportError as exc:
            raise CLIError(f"the demo generates its models with torch: {exc}") from exc
        compiled = _compile(model, label, args)
        inputs = example_inputs(model)
        outputs = _run_once(compiled, inputs)
        tpp_s = _median_seconds(lambda: _run_once(compiled, inputs))
        shapes = ", ".join(str(tuple(o.shape)) for o in outputs)
        print(f"  output:      {shapes}")
        print(f"  tpp_tvm:     {_time_ms(tpp_s)} on {compiled.threads} thread(s) (median)")
        if compare:
            _compare(model, inputs, outputs, compiled.threads, tpp_s, indent="  ")
        print("  " + compiled.report().replace("\n", "\n  "))
    return 0


def _demo_gemm(args: argparse.Namespace) -> int:
    """Compile a 512x512x512 fp32 GEMM onto TPPs, check it, and time it next to numpy."""
    import numpy as np

    from tpp_tvm.target import target

    m, n, k = DEMO_SHAPE
    tgt = target(args.isa, num_cores=args.threads)
    # TVM's pool sizes itself at its first parallel call, to half the logical CPUs on x86
    # unless told (it assumes SMT): give it the target's core count (an explicit --threads
    # wins over the environment).
    threads = str(int(tgt.attrs["num-cores"]))
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = threads
    else:
        os.environ.setdefault("TVM_NUM_THREADS", threads)
    print(f"compiling {m}x{n}x{k} fp32 GEMM for {_show(tgt)} ...", flush=True)
    try:
        from tpp_tvm.kernels import build_gemm
    except ImportError as exc:
        print(f"tpp-tvm: error: the GEMM schedule is not available: {exc}", file=sys.stderr)
        return 1
    kernel = build_gemm(m, n, k, dtype="float32", target=tgt)

    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.max(np.abs(np.asarray(kernel(a, b)) - ref)) / np.max(np.abs(ref)))
    if err > 1e-4:
        print(f"tpp-tvm: error: wrong result, max relative error {err:.2e}", file=sys.stderr)
        return 1

    timer = getattr(kernel, "time", None)
    if timer is not None:
        # B is a constant weight in real models: pack it once, outside the timed loop.
        pack_b = getattr(kernel, "pack_b", None)
        tpp_s = float(timer(a, pack_b(b) if pack_b else b, number=10, repeat=5))
    else:
        tpp_s = _median_seconds(lambda: kernel(a, b))
    numpy_s = _median_seconds(lambda: a @ b)
    flop = 2 * m * n * k
    print(f"correct (max relative error {err:.1e} vs float64)")
    print(
        f"tpp_tvm: {flop / tpp_s / 1e9:8.1f} GFLOP/s on {os.environ['TVM_NUM_THREADS']} thread(s)"
    )
    print(f"numpy:   {flop / numpy_s / 1e9:8.1f} GFLOP/s")
    return 0


# --------------------------------------------------------------------------------------------
# argparse


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--isa", help="amx, avx512, avx2 or sve (default: best for this host)")
    parser.add_argument(
        "--threads", type=int, help="threads to compile and run for (default: all cores)"
    )
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32",
        help="bf16: matmuls in bf16 with fp32 accumulation (quantized models run int8 anyway)",
    )
    parser.add_argument(
        "--emulate-tiles", action="store_true",
        help="with --isa amx: run the AMX tile instructions on a software model of the tile "
             "unit, to check an AMX build's results on a CPU without AMX (slow; not for "
             "timing)")


def _add_tune_logs_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tune-logs", default="none", metavar="PATH",
        help="tuning log folder from `tune`, 'shipped' (the logs in tune_logs/ for this "
             "CPU) or 'none' (default: hand schedules only)")


_SHAPE_HELP = "static input shapes, e.g. input_ids=1x128,attention_mask=1x128"
_DYNAMIC_HELP = ("bounds of dynamic dims, e.g. seq=1:512,batch=1:8 (the model's dim "
                 "names; `compile` writes a folder, one build per size on first use)")


def _add_compile_command(sub) -> None:
    """``tpp-tvm compile``: an ONNX model onto TPPs, exported."""
    comp = sub.add_parser("compile", help="compile an ONNX model onto TPPs and export it")
    comp.add_argument("model", metavar="MODEL.onnx")
    comp.add_argument("-o", "--output", required=True, metavar="OUT.so",
                      help="library to write (a folder for a dynamic model)")
    _add_target_options(comp)
    comp.add_argument("--shape", type=_parse_shapes, default={},
                      help=_SHAPE_HELP + "; a ? dim stays dynamic (input_ids=1x?)")
    comp.add_argument("--dynamic", type=_parse_bounds, default={}, help=_DYNAMIC_HELP)
    comp.add_argument("--prepare", type=_parse_shapes, action="append", default=[],
                      metavar="SHAPES", help="a dynamic model's size to compile now and "
                      "export with it, e.g. input_ids=1x128,attention_mask=1x128 (repeat it)")
    _add_tune_logs_option(comp)
    comp.set_defaults(func=_cmd_compile)


def _add_tune_command(sub) -> None:
    """``tpp-tvm tune``: MetaSchedule tuning of a model's TPP kernels."""
    tune = sub.add_parser("tune", help="tune an ONNX model's TPP kernels (MetaSchedule)")
    tune.add_argument("model", metavar="MODEL.onnx")
    _add_target_options(tune)
    tune.add_argument("--shape", type=_parse_shapes, default={}, help=_SHAPE_HELP)
    tune.add_argument("--trials", type=int, default=64, help="trials per task (default 64)")
    tune.add_argument("--work-dir", help="log folder (default tune_logs/<target>/<model>)")
    tune.add_argument("--name", help="log name under tune_logs/<target>/ (default: file stem)")
    tune.add_argument("--rpc-tracker", metavar="HOST:PORT",
                      help="measure on boards registered with this RPC tracker")
    tune.add_argument("--rpc-key", metavar="KEY", help="device key of those boards")
    tune.set_defaults(func=_cmd_tune)


def _add_run_command(sub) -> None:
    """``tpp-tvm run``: a model or a compiled library on example inputs."""
    run = sub.add_parser("run", help="run an ONNX model or a compiled .so on example inputs")
    run.add_argument("model", metavar="MODEL", help="an ONNX model, or a .so from `compile`")
    _add_target_options(run)
    run.add_argument("--shape", type=_parse_shapes, default={}, help=_SHAPE_HELP)
    run.add_argument("--dynamic", type=_parse_bounds, default={},
                     help=_DYNAMIC_HELP + "; the model then runs at --shape's size")
    run.add_argument("--bench", action="store_true", help="print the median latency")
    run.add_argument("--profile", action="store_true",
                     help="time every kernel and print the report with each part's share "
                          "(TPP kernels, what is left on TVM's default code, the VM)")
    _add_tune_logs_option(run)
    run.add_argument(
        "--compare",
        choices=["onnxruntime"],
        help="also run ONNX Runtime (same threads): latency, speed-up, max error",
    )
    run.add_argument(
        "--onnx", metavar="MODEL.onnx", help="the ONNX model a .so came from (for --compare)"
    )
    run.set_defaults(func=_cmd_run)


def _add_generate_command(sub) -> None:
    """``tpp-tvm generate``: greedy decoding of a causal LM exported with its KV cache."""
    gen = sub.add_parser("generate", help="greedy decoding of an ONNX causal LM exported "
                         "with its KV cache (tpp_tvm.cache_export)")
    gen.add_argument("model", metavar="MODEL", help="the ONNX export with past/present")
    _add_target_options(gen)
    gen.add_argument("--prompt", required=True, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--new", type=int, default=16, help="tokens to generate (default 16)")
    gen.add_argument("--kv-cache", choices=("float32", "int8"), default="float32",
                     help="how the KV cache is held: float32 (default), or int8 rows with a "
                     "scale each (0.27x the memory at head size 64)")
    _add_tune_logs_option(gen)
    gen.set_defaults(func=_cmd_generate)


def _add_demo_command(sub) -> None:
    """``tpp-tvm demo``: compile, run and compare demo models."""
    demo = sub.add_parser(
        "demo", help="compile, run and compare a BERT encoder and a ResNet (or a GEMM)"
    )
    _add_target_options(demo)
    demo.add_argument(
        "--full", action="store_true", help="BERT-base (12 layers) and ResNet-50 at full size"
    )
    demo.add_argument(
        "--gemm", action="store_true", help="the 512^3 fp32 GEMM demo, next to numpy"
    )
    demo.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of ``tpp-tvm`` (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="tpp-tvm", description="TPP (LIBXSMM Tensor Processing Primitives) backend for TVM"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show the host ISA, the TPP target and registered TPPs")
    info.add_argument("--isa", help="amx, avx512, avx2 or sve (default: best for this host)")
    info.set_defaults(func=_cmd_info)
    _add_compile_command(sub)
    _add_tune_command(sub)
    _add_run_command(sub)
    _add_generate_command(sub)
    _add_demo_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for a :class:`TPPError`)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TPPError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the exception holds
        print(f"tpp-tvm: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
