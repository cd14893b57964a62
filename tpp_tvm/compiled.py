"""The user-facing compiled model: call it with numpy arrays, ask what went to TPPs, cache it.

``compile_onnx`` imports an ONNX model, compiles it with the ``tpp`` pipeline and returns a
:class:`CompiledModel`. ``export`` writes the shared library plus a small JSON sidecar
(input names, shapes, dtypes, the lowering report as data: kernel rows, format
:data:`~tpp_tvm.relay_passes.report.SIDECAR_FORMAT`) so :func:`load` restores an identical
model without compiling again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import relax

from .dynamic import DynamicModel, is_dynamic_export, load_dynamic
from .errors import (
    CompileError,
    ExecutionError,
    ModelLoadError,
    TPPError,
    UnsupportedDTypeError,
    UnsupportedISAError,
    UnsupportedShapeError,
    describe_tvm_error,
)
from .inputs import bind_inputs
from .intrinsics import amx_emulator
from .profiling import peak_rss, profile_vm, release_freed_memory
from .relay_passes.pipeline import build
from .relay_passes.report import (
    SIDECAR_FORMAT,
    LoweringReport,
    labels,
    rows_from_json,
    rows_from_labels,
    rows_to_json,
)
from .relay_passes.shared_constants import SharedConstants
from .runtime import configure_threads, install, target_threads, use_threads
from .target import target as tpp_target
from .target import tiles_emulated

_SIDECAR = ".tpp.json"


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


def _inputs_of(mod: tvm.IRModule) -> list[InputSpec]:
    """``main``'s inputs, named as the ONNX model names them where it came from one."""
    from .frontend import ONNX_INPUT_NAMES

    main = mod["main"]
    onnx_names = (main.attrs or {}).get(ONNX_INPUT_NAMES)
    names = [str(n) for n in onnx_names] if onnx_names else [str(p.name) for p in main.params]
    specs = []
    for name, p in zip(names, main.params):
        ty = p.ty
        shape = tuple(int(d) for d in ty.shape.values)
        specs.append(InputSpec(name, shape, str(ty.dtype)))
    return specs


def _require_tiles() -> None:
    """Ask Linux for AMX tile state before a model with tile kernels runs (a process that
    only loads an exported model never asked: its first tile instruction would be SIGILL);
    a clear error where this host cannot run tiles at all."""
    from .intrinsics.amx import ensure_tile_permission

    try:
        ensure_tile_permission()
    except UnsupportedISAError as err:
        raise UnsupportedISAError(
            f"this model runs matmuls on AMX tiles (compiled for an AMX target): {err}"
        ) from None


_LOG = logging.getLogger(__name__)


def linked_kernels(exe: relax.VMExecutable, target: tvm.target.Target
                    ) -> tuple[tvm.runtime.Module, tempfile.TemporaryDirectory] | None:
    """``exe``'s kernels linked into a shared library as :meth:`CompiledModel.export` links
    them, and loaded: the code a model runs in the process that compiled it is the code it
    runs exported (the weights stay in ``exe``; only the kernels are written).

    TVM's in-process LLVM JIT generates different machine code from the same IR at its
    default optimization level: wav2vec2's 3-tap convolutions with a GELU epilogue spilled
    an accumulator inside the reduction loop and ran 3.3x slower than the exported library
    (89 vs 27 ms, Zen 3). None where the target is not this host's architecture (a
    cross-compiled model is only exported) or the host cannot link (the JIT runs it)."""
    triple = str(target.attrs.get("mtriple", "")) or platform.machine()
    imports = list(exe.mod.imports)
    if str(target.kind.name) != "llvm" or not triple.startswith(platform.machine()) \
            or len(imports) != 1 or imports[0].kind != "llvm":
        return None
    folder = tempfile.TemporaryDirectory(prefix="tpp_tvm_")
    path = Path(folder.name) / "kernels.so"
    try:
        imports[0].export_library(str(path))
        return tvm.runtime.load_module(str(path)), folder
    except Exception as exc:  # noqa: BLE001 - the JIT still runs the model
        _LOG.debug("running the JIT-compiled kernels: linking them failed: %s", exc)
        folder.cleanup()
        return None


def virtual_machine(exe: relax.VMExecutable | tvm.runtime.Module,
                     kernels: tvm.runtime.Module | None) -> relax.VirtualMachine:
    """A VM running ``exe`` with its kernels from ``kernels`` where given (the VM resolves
    them when it is made; ``exe`` keeps its own for :meth:`CompiledModel.export`)."""
    if kernels is None:
        return relax.VirtualMachine(exe, tvm.cpu())
    own = list(exe.mod.imports)
    exe.mod.clear_imports()
    exe.mod.import_module(kernels)
    try:
        return relax.VirtualMachine(exe, tvm.cpu())
    finally:
        exe.mod.clear_imports()
        for module in own:
            exe.mod.import_module(module)


class CompiledModel:
    """A model compiled onto TPPs. ``model(x, ...)`` or ``model(input_name=x)`` → outputs."""

    def __init__(self, module: tvm.runtime.Module | relax.VMExecutable,
                 inputs: list[InputSpec], report: dict, threads: int = 1,
                 linked: tuple[tvm.runtime.Module, tempfile.TemporaryDirectory] | None = None
                 ) -> None:
        self._module = module
        # The kernels linked at compile time (see linked_kernels) and their folder, removed
        # with the model.
        self._linked = linked
        self.inputs = inputs
        self._report = report
        self._kernels = rows_from_json(report.get("kernels", []))
        # Checked at the first run, not here: a model compiled for an AMX target on a host
        # without AMX must still export (cross-compilation); only running it needs tiles.
        self._tiles_unchecked = any(row.on_tiles for row in self._kernels)
        # Tiles on the software model (tests on hosts without AMX): its symbols must be in
        # the process before the VM links the kernels, and its faults are checked per run.
        self._tiles_emulated = bool(report.get("tiles_emulated"))
        if self._tiles_emulated:
            amx_emulator.library()
            self._tiles_unchecked = False
        self._profile: list[tuple[str, float, int]] = []
        self.threads = threads
        # A VM keeps its registers between instructions, so two Python threads must not run
        # one VM at once (TVM releases the GIL inside a call): each thread gets its own,
        # made on its first call; all share the executable's weights and the kernels.
        self._vms = threading.local()
        self._vm_lock = threading.Lock()
        self._vms.vm = self._new_vm()

    @property
    def threads(self) -> int:
        """Threads this model's kernels run on (default: its target's ``num-cores``).
        Settable per model; models of different counts share one pool."""
        return self._threads

    @threads.setter
    def threads(self, count: int) -> None:
        if int(count) < 1:
            raise ValueError(f"threads must be >= 1, got {count}")
        self._threads = configure_threads(int(count))

    def _new_vm(self) -> relax.VirtualMachine:
        with self._vm_lock:  # _virtual_machine swaps the executable's imports meanwhile
            vm = virtual_machine(self._module, self._linked[0] if self._linked else None)
        install()
        return vm

    @property
    def _vm(self) -> relax.VirtualMachine:
        """This thread's VM."""
        vm = getattr(self._vms, "vm", None)
        if vm is None:
            vm = self._vms.vm = self._new_vm()
        return vm

    def _convert(self, args: tuple, kwargs: dict, staged: list | None = None
                 ) -> list[tvm.runtime.Tensor]:
        """The inputs as TVM tensors, checked against the compiled shapes and dtypes: new
        tensors, or with ``staged`` copied into those (this thread's, reused every call)."""
        values = bind_inputs([i.name for i in self.inputs], args, kwargs)
        out = []
        for i, (spec, value) in enumerate(zip(self.inputs, values)):
            arr = self._checked(spec, value)
            try:
                if staged is not None:
                    staged[i].copyfrom(arr)
                    out.append(staged[i])
                else:
                    out.append(tvm.runtime.tensor(np.ascontiguousarray(arr), tvm.cpu()))
            except Exception as exc:  # sub-byte types (int4, float4) TVM cannot copy in
                raise UnsupportedDTypeError(
                    f"input {spec.name!r}: TVM cannot take a {spec.dtype} tensor "
                    f"({describe_tvm_error(exc)})") from exc
        return out

    @staticmethod
    def _checked(spec, value) -> np.ndarray:
        """``value`` as an array of ``spec``'s shape and dtype (cast where it is safe)."""
        arr = np.asarray(value)
        if arr.shape != spec.shape:
            raise UnsupportedShapeError(
                f"input {spec.name!r}: shape {arr.shape}, the model was compiled for "
                f"{spec.shape}"
            )
        if arr.dtype == np.dtype(spec.dtype):
            return arr
        if not np.can_cast(arr.dtype, spec.dtype, "same_kind"):
            raise UnsupportedShapeError(
                f"input {spec.name!r}: dtype {arr.dtype}, expected {spec.dtype}"
            )
        want = np.dtype(spec.dtype)
        if want.kind in "iu" and arr.size and arr.dtype.kind in "iu" and (
                arr.min() < np.iinfo(want).min or arr.max() > np.iinfo(want).max):
            raise UnsupportedShapeError(
                f"input {spec.name!r}: {arr.dtype} values in [{arr.min()}, "
                f"{arr.max()}] do not fit the model's {spec.dtype}"
            )
        return arr.astype(spec.dtype)

    def _staged_inputs(self) -> list[tvm.runtime.Tensor] | None:
        """This thread's input tensors, allocated on its first call and reused: a fresh
        tensor per call cost 50-70 us of allocation and page faults (MobileNetV3-Small, 1.4
        ms a call, Xeon). None where TVM cannot allocate an input's dtype."""
        staged = getattr(self._vms, "inputs", None)
        if staged is None:
            try:
                staged = [tvm.runtime.empty(spec.shape, spec.dtype, tvm.cpu())
                          for spec in self.inputs]
            except Exception:  # noqa: BLE001 - sub-byte dtypes: _convert names the input
                staged = []
            self._vms.inputs = staged
        return staged or None

    def _main(self):
        """The VM's entry function, once this process may run the model's tile kernels."""
        if self._tiles_unchecked:
            _require_tiles()
            self._tiles_unchecked = False
        use_threads(self.threads)
        return self._vm["main"]

    def __call__(self, *args, **kwargs) -> list[np.ndarray]:
        tensors = self._convert(args, dict(kwargs), self._staged_inputs())
        return [r.numpy() for r in self.run_tensors(tensors)]

    def run_tensors(self, tensors: list[tvm.runtime.Tensor], output: int | None = None
                    ) -> list[tvm.runtime.Tensor] | tvm.runtime.Tensor:
        """Run on TVM tensors in :attr:`inputs` order and return TVM tensors: no conversion
        and no copies, for callers that keep data on TVM tensors between calls (a decoder's
        KV cache, :mod:`tpp_tvm.decoding`). Shapes and dtypes are checked by TVM only.
        ``output``: return that output only (a decoder's logits beside 40 cache outputs:
        listing them all cost 30 us a step)."""
        fn = self._main()
        try:
            result = fn(*tensors)
        except Exception as exc:  # anything here is TVM's failure
            raise ExecutionError(f"the compiled model failed while running: "
                                 f"{describe_tvm_error(exc)}") from exc
        if self._tiles_emulated:
            amx_emulator.check("the compiled model")
        if isinstance(result, tvm.runtime.Tensor):
            result = [result]
        return result[output] if output is not None else list(result)

    def benchmark(self, *args, repeat: int = 10, **kwargs) -> float:
        """Median seconds per call with inputs already converted."""
        tensors = self._convert(args, dict(kwargs))
        fn = self._main()
        fn(*tensors)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn(*tensors)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def profile(self, *args, repeat: int = 5, **kwargs) -> list[tuple[str, float, int]]:
        """Time every kernel over ``repeat`` calls on these inputs: (symbol, ms per call,
        calls per call), slowest first. Kept, so :meth:`report` then gives the measured share
        of the run of TPP kernels, of what is left on TVM's default code, and of the VM."""
        tensors = self._convert(args, dict(kwargs))
        self._main()  # tile permission, before the first kernel runs
        self._profile = profile_vm(self._vm, tensors, repeat)
        return list(self._profile)

    def _default_code_lines(self, rest: list[str]) -> tuple[list[str], list[str]]:
        """The functions left on TVM's default code (slowest first, each with its time and
        share once :meth:`profile` ran) and the profile's summary line (none without one)."""
        if not self._profile:
            return list(rest), []
        times = {name: ms for name, ms, _ in self._profile}
        total = sum(times.values()) or 1.0
        ms = {name: times.get(name, 0.0) for name in rest}
        named = [f"{name}: {ms[name]:.3f} ms ({100 * ms[name] / total:.1f}%)"
                 for name in sorted(rest, key=lambda name: -ms[name])]
        on_tvm = sum(ms.values())
        if "tpp_functions" not in self._report:  # a format-1 sidecar did not record them
            return named, [f"Measured ({total:.2f} ms per run, profiled): TVM's default code "
                           f"{100 * on_tvm / total:.1f}%, TPP kernels, VM and layout views "
                           f"{100 * (total - on_tvm) / total:.1f}% (this export does not name "
                           "its TPP kernels: export the model again for their share)"]
        kernels = set(self._report["tpp_functions"])
        tpp = sum(t for name, t in times.items() if name in kernels)
        summary = (f"Measured ({total:.2f} ms per run, profiled): TPP kernels "
                   f"{100 * tpp / total:.1f}%, TVM's default code {100 * on_tvm / total:.1f}%, "
                   f"VM and layout views {100 * (total - tpp - on_tvm) / total:.1f}%")
        return named, [summary]

    def report(self) -> str:
        """Which subgraphs went to TPP kernels and which fell back, counted by pattern."""
        precision = self._report.get("precision", "float32")
        lines = []
        if precision != "float32":
            lines.append(f"Precision: {precision} for kernels marked [bf16] (bf16 operands, "
                         "fp32 accumulation and outputs; [bf16, amx]: on AMX tiles); all "
                         "other ops fp32")
            if any(row.precision == "bfloat16" and not row.on_tiles for row in self._kernels):
                lines.append(bf16_without_tiles_note(self._report.get("target_cpu", "")))
        if self._tiles_emulated:
            lines.append("AMX tiles: emulated in software (target('amx', emulate_tiles="
                         "True)): results as on AMX, speed not (for tests only)")
        lines.append("TPP kernels:")
        lines += [f"  {k}: {v}" for k, v in sorted(labels(self._kernels).items())]
        falls = self._report.get("fallbacks", {})
        lines.append("Fallbacks to TVM:" if falls else "Fallbacks to TVM: none")
        lines += [f"  {k}: {v}" for k, v in sorted(falls.items())]
        rest = self._report.get("default_scheduled", [])
        named, measured = self._default_code_lines(rest)
        if rest:
            lines.append(f"On TVM's fused ops with default schedules (no TPP): {len(rest)}")
            shown = named if len(named) <= 12 else named[:12] + [f"... {len(named) - 12} more"]
            lines += [f"  {name}" for name in shown]
        lines += measured
        rewrites = self._report.get("rewrites", {})
        if rewrites:
            lines.append("Graph rewrites:")
            lines += [f"  {k}: {v}" for k, v in sorted(rewrites.items())]
        if "compile_seconds" in self._report:
            line = f"compile time: {self._report['compile_seconds']:.1f} s"
            if "compile_peak_mib" in self._report:
                line += f", peak memory {self._report['compile_peak_mib']:.0f} MiB (process RSS)"
            lines.append(line)
        return "\n".join(lines)

    @property
    def report_data(self) -> dict:
        """The report as data: ``kernels`` (the kernel rows: pattern, family, precision,
        unit, tuned, count), ``lowered`` (the same as report text, label -> count),
        ``fallbacks``, ``rewrites``, ``default_scheduled``, ``tpp_functions`` and the
        compile's figures."""
        return dict(self._report) | {"lowered": dict(labels(self._kernels))}

    def export(self, path: str | Path) -> Path:
        """Write the compiled library (and its sidecar) so :func:`load` can skip compiling."""
        path = Path(path)
        if not isinstance(self._module, relax.VMExecutable):
            raise ModelLoadError("this model was loaded from a library; export the original")
        self._module.export_library(str(path))
        meta = {"format": SIDECAR_FORMAT,
                "inputs": [vars(i) | {"shape": list(i.shape)} for i in self.inputs],
                "report": self._report, "threads": self.threads,
                "sha256": _sha256(path)}
        Path(str(path) + _SIDECAR).write_text(json.dumps(meta, indent=1))
        return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load(path: str | Path, threads: int | None = None) -> CompiledModel | DynamicModel:
    """Load a model written by :meth:`CompiledModel.export` (or a folder written by
    :meth:`DynamicModel.export <tpp_tvm.dynamic.DynamicModel.export>`); ``threads``
    overrides the thread count a static model was compiled for.

    The library's checksum (kept in the sidecar) is checked before it is opened: the
    dynamic loader dies of SIGBUS or SIGSEGV on a truncated or overwritten library, which
    no exception could report."""
    path = Path(path)
    if is_dynamic_export(path):
        return load_dynamic(path, load, functools.partial(_compile_size,
                                                          constants=SharedConstants()))
    side = Path(str(path) + _SIDECAR)
    if not path.is_file():
        raise ModelLoadError(f"no compiled model at {path}")
    if not side.exists():
        raise ModelLoadError(f"{path} has no {_SIDECAR} sidecar: was it written by export()?")
    try:
        meta = json.loads(side.read_text())
        inputs = [InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in meta["inputs"]]
        version = meta.get("format", 1)
        if version > SIDECAR_FORMAT:
            raise ModelLoadError(f"{side} is of format {version}, written by a newer tpp_tvm "
                                 f"(this one reads formats 1 to {SIDECAR_FORMAT})")
        report = meta["report"] if version > 1 else _format1_report(meta["report"])
        rows_from_json(report.get("kernels", []))  # rows this version can read
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{side} is corrupt ({type(exc).__name__}: {exc})") from exc
    if "sha256" in meta and _sha256(path) != meta["sha256"]:
        raise ModelLoadError(f"{path} is corrupt: its checksum differs from the one export() "
                             f"wrote in {side.name} (truncated or overwritten?)")
    if report.get("tiles_emulated"):
        amx_emulator.library()  # the library's tile calls link against the tile model
    try:
        module = tvm.runtime.load_module(str(path))
        return CompiledModel(module, inputs, report, threads or meta.get("threads", 1))
    except Exception as exc:  # a library of another machine, or one without a checksum
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path} is not a loadable compiled model: {first}") from exc


def _format1_report(report: dict) -> dict:
    """A format-1 sidecar's report in today's form: its kernels were stored as the report's
    labels (``lowered``), read back into rows here, once. It named no TPP kernel functions
    (``tpp_functions``), so a profile cannot give their share."""
    report = dict(report)
    report["kernels"] = rows_to_json(rows_from_labels(report.pop("lowered", {})))
    return report


#: What ``report()`` says when bf16 GEMMs run on the AVX-512 unit instead of AMX tiles.
BF16_WITHOUT_TILES = (
    "Note: these bf16 matmuls run on AVX512_BF16 vdpbf16ps, not AMX tiles (the target has "
    "no AMX): on a core whose vdpbf16ps issues at half the FMA rate they are no faster than "
    "fp32 (measured: DistilBERT bf16 108 ms vs fp32 76 ms on a Sapphire Rapids core run "
    "without tiles). Compile for an AMX target (tpp_tvm.target('amx')) or keep fp32.")
#: The same for target CPUs (LLVM ``mcpu``) whose ``vdpbf16ps`` was measured to do twice
#: the fp32 FMA's work per cycle, where bf16 does pay without tiles.
BF16_FULL_RATE_CPUS: dict[str, str] = {
    "znver5": "AMD Zen 5: 510 vs 256 GFLOP/s on one core (benchmarks/peak.py); BERT-base "
              "4 layers 20.3 ms in bf16 vs 32.0 in fp32 (benchmarks/zoo.py, 1 thread)",
}


def bf16_without_tiles_note(target_cpu: str) -> str:
    """What ``report()`` says of bf16 matmuls on ``vdpbf16ps``: the warning above, unless
    the target CPU's dot product was measured at twice the FMA rate (``target_cpu``: its
    LLVM ``mcpu``; empty for models exported before it was recorded)."""
    measured = BF16_FULL_RATE_CPUS.get(target_cpu)
    if measured is None:
        return BF16_WITHOUT_TILES
    return ("Note: these bf16 matmuls run on AVX512_BF16 vdpbf16ps (the target has no AMX), "
            f"which does twice the fp32 FMA's work per cycle on this CPU ({measured}).")


def compile_relax(mod: tvm.IRModule, target=None, precision: str = "float32",
                  tune_logs=None, constants: SharedConstants | None = None) -> CompiledModel:
    """Compile a Relax module (static input shapes) into a :class:`CompiledModel`.

    ``precision="bf16"``: the bf16 policy of ``relay_passes.lower.PRECISIONS``.
    ``tune_logs``: a folder made by ``tpp_tvm.tune``, ``"shipped"`` (the logs in
    ``tune_logs/`` for this CPU) or None (default: hand schedules only — per-subgraph wins
    measured in isolation did not hold in a whole BERT-base model, see docs/guide.md, Tuning).
    ``constants``: a pool shared with the model's other builds (each weight held once).
    """
    tgt = target if target is not None else tpp_target()
    tgt = tgt if isinstance(tgt, tvm.target.Target) else tvm.target.Target(tgt)
    report = LoweringReport()
    if tiles_emulated(tgt):
        amx_emulator.library()
    try:
        with peak_rss() as memory:
            exe = build(mod, tgt, report=report, precision=precision, tune_logs=tune_logs,
                        constants=constants)
    except TPPError:
        raise
    except Exception as exc:  # TVM's checks and LLVM: one clear error, the cause chained
        empty = [f"{i.name!r} {i.shape}" for i in _inputs_of(mod) if 0 in i.shape]
        if empty and "constant_size > 0" in str(exc):
            raise UnsupportedShapeError(
                f"inputs with a zero-size dim ({', '.join(empty)}) give kernels zero-byte "
                "buffers, which TVM's LLVM codegen rejects; a decoder's empty past: "
                "tpp_tvm.DecoderSession starts its cache with one masked slot") from exc
        raise CompileError(f"TVM's build failed on this model: {describe_tvm_error(exc)}"
                           ) from exc
    data = {"kernels": rows_to_json(report.kernels), "fallbacks": dict(report.fallbacks),
            "compile_seconds": getattr(report, "compile_seconds", 0.0),
            "compile_peak_mib": round(memory["peak_mib"], 1)}
    if report.precision != "float32":
        data["precision"] = report.precision
    if report.rewrites:
        data["rewrites"] = dict(report.rewrites)
    data["default_scheduled"] = sorted(report.default_scheduled)
    data["tpp_functions"] = sorted(report.tpp_functions)
    if tiles_emulated(tgt):
        data["tiles_emulated"] = True
    data["target_cpu"] = str(tgt.attrs.get("mcpu", ""))
    return CompiledModel(exe, _inputs_of(mod), data, target_threads(tgt),
                         linked=linked_kernels(exe, tgt))


def compile_onnx(model_or_path, target=None, shape_dict: dict | None = None,
                 precision: str = "float32", tune_logs=None, *,
                 dynamic: dict | None = None, max_cached: int | None = None,
                 constants: SharedConstants | None = None,
                 reload: Callable[[], onnx.ModelProto] | None = None
                 ) -> CompiledModel | DynamicModel:
    """Import an ONNX model (proto, path or bytes) and compile it onto TPPs.

    ``precision="bf16"`` runs it under the bf16 policy (see :func:`compile_relax`); ``tune_logs``
    supplies tuned kernels where they are faster (see :func:`compile_relax`).

    A model whose inputs keep dynamic dims (named by the export, or marked ``None`` in
    ``shape_dict``: ``{"input_ids": (1, None)}``) gives a :class:`~tpp_tvm.dynamic.
    DynamicModel`, which compiles one static build per size on first use; ``dynamic``
    bounds its dims (``{"seq": (1, 512)}``), ``max_cached`` caps the builds kept; its builds
    share their identical constants (``constants``: a pool to share them with other models
    too, as a decoder's prompt and step models do). ``reload`` gives the model again: the
    dynamic model then calls it for each new size instead of holding the model (weights
    included) in memory meanwhile."""
    from .dynamic import MAX_CACHED, check_bounds, dynamic_dims, input_patterns
    from .frontend import from_onnx, load_model

    model = load_model(model_or_path)
    patterns = input_patterns(model, shape_dict)
    names = dynamic_dims(patterns)
    if not names:
        if dynamic:
            check_bounds(dynamic, names)  # names what is not dynamic
        if shape_dict and patterns is not None:  # None marks left where the model is static
            shape_dict = {p.name: p.dims for p in patterns if p.name in shape_dict}
        compiled = compile_relax(from_onnx(model, shape_dict), target, precision, tune_logs,
                                 constants)
        release_freed_memory()  # the import's and the build's temporaries, garbage now
        return compiled
    constants = constants if constants is not None else SharedConstants()
    return DynamicModel(reload or model, patterns, check_bounds(dynamic, names),
                        functools.partial(_compile_size, constants=constants), target,
                        precision, tune_logs, max_cached or MAX_CACHED)


def _compile_size(model, shape_dict: dict, target, precision: str, tune_logs,
                  constants: SharedConstants) -> CompiledModel:
    """One static size of a :class:`DynamicModel`, its constants shared with the others."""
    return compile_onnx(model, target, shape_dict, precision, tune_logs, constants=constants)
