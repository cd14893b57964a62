"""Models with dynamic dimensions: one compile call serves every size within the bounds.

TPP kernels are generated per shape (register tiles, cache blocks and tails are all decided
from static extents), so a :class:`DynamicModel` keeps the ONNX model and builds one static
specialization per size it is called with: compiled on first use (or ahead of time with
:meth:`DynamicModel.prepare`), cached (least recently used beyond ``max_cached``), exported
and loaded together. Every size then runs exactly the code a static build of that size runs.

Why not one module with symbolic shapes: TVM's CPU code for symbolic extents is its untuned
default schedule, measured in ``benchmarks/dynamic.py`` (the "TVM symbolic" row) far slower
than the TPP kernels. The price of this design is a compile per new size.

A dimension is named by the model (``dim_param``, e.g. ``seq``) or, when the export left it
unnamed, ``<input>[<axis>]``; inputs sharing a name must agree at run time.
"""

from __future__ import annotations

import gc
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .errors import ModelLoadError, UnsupportedShapeError
from .frontend import load_model, save_model
from .inputs import bind_inputs
from .profiling import release_freed_memory

#: Compiles one static size: (model, shape_dict, target, precision, tune_logs) -> a
#: CompiledModel (``compiled.compile_onnx``, passed in so data flows one way).
CompileStatic = Callable[[onnx.ModelProto, dict, Any, str, Any], Any]

#: Specializations kept compiled by default (each holds its own packed weights).
MAX_CACHED = 8
_META = "dynamic.json"
_ONNX = "model.onnx"


@dataclass(frozen=True)
class InputPattern:
    """An input's dims: an int for a static dim, a dimension name for a dynamic one."""

    name: str
    dims: tuple[int | str, ...]
    dtype: str


def input_patterns(model: onnx.ModelProto,
                   shape_dict: Mapping[str, Sequence[int | None]] | None = None
                   ) -> list[InputPattern] | None:
    """The model's real inputs with their dynamic dims named; ``shape_dict`` may fix dims
    (an int) or mark them dynamic (``None``) per input. None when an input cannot be read
    so (not a tensor, unknown rank, a rank or name ``shape_dict`` gets wrong): the static
    import then names the problem."""
    from .frontend import graph_inputs, input_type

    shape_dict = dict(shape_dict or {})
    inputs = graph_inputs(model)
    if set(shape_dict) - {v.name for v in inputs}:
        return None
    patterns = []
    for value in inputs:
        vtype = input_type(value)
        tensor, given = vtype.tensor_type, shape_dict.get(value.name)
        if not vtype.HasField("tensor_type"):
            return None
        if tensor.HasField("shape"):
            model_dims = list(tensor.shape.dim)
        elif given is not None:
            model_dims = [None] * len(given)
        else:
            return None
        if given is not None and len(given) != len(model_dims):
            return None
        dims: list[int | str] = []
        for axis, dim in enumerate(model_dims):
            fixed = given[axis] if given is not None else None
            if fixed is not None:
                dims.append(int(fixed))
            elif dim is not None and dim.HasField("dim_value") and dim.dim_value >= 0:
                dims.append(int(dim.dim_value))
            else:
                dims.append((dim.dim_param if dim is not None else "")
                            or f"{value.name}[{axis}]")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        patterns.append(InputPattern(value.name, tuple(dims), dtype))
    return patterns


def dynamic_dims(patterns: Sequence[InputPattern] | None) -> list[str]:
    """Names of the dynamic dimensions, in order of first use."""
    seen: list[str] = []
    for p in patterns or ():
        seen += [d for d in p.dims if isinstance(d, str) and d not in seen]
    return seen


def check_bounds(bounds: Mapping[str, Sequence[int]] | None, names: Sequence[str]
                 ) -> dict[str, tuple[int, float]]:
    """Every dynamic dim's (low, high) bounds: given ones checked, the rest [1, inf)."""
    bounds = dict(bounds or {})
    unknown = sorted(set(bounds) - set(names))
    if unknown:
        raise UnsupportedShapeError(
            f"dynamic= names {unknown}, which are not dynamic dimensions of the model "
            f"({', '.join(names) or 'it has none'})")
    out: dict[str, tuple[int, float]] = {}
    for name in names:
        low, high = bounds.get(name, (1, math.inf))
        if not (isinstance(low, int) and low >= 1 and (high == math.inf or
                                                        (isinstance(high, int) and high >= low))):
            raise UnsupportedShapeError(
                f"dynamic[{name!r}] = ({low}, {high}): bounds are integers 1 <= low <= high")
        out[name] = (low, high)
    return out


def _bound_text(low: int, high: float) -> str:
    return f"[{low}, inf)" if high == math.inf else f"[{low}, {int(high)}]"


def _size_text(size: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{n}={v}" for n, v in size)


class DynamicModel:
    """An ONNX model with dynamic dims, compiled per size on first use.

    ``model(x, ...)`` / ``model(name=x)`` like :class:`~tpp_tvm.compiled.CompiledModel`;
    sizes are checked against the bounds before anything is compiled.
    """

    def __init__(self, model: onnx.ModelProto | Callable[[], onnx.ModelProto],
                 patterns: list[InputPattern],
                 bounds: dict[str, tuple[int, float]], compile_static: CompileStatic,
                 target: Any = None, precision: str = "float32", tune_logs: Any = None,
                 max_cached: int = MAX_CACHED) -> None:
        if max_cached < 1:
            raise UnsupportedShapeError(f"max_cached must be >= 1, got {max_cached}")
        self._model = model  # or what gives it anew: a large model is not held meanwhile
        self._compile_static = compile_static
        self.patterns = patterns
        self.bounds = bounds
        self._target = target
        self._precision = precision
        self._tune_logs = tune_logs
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._compile_seconds: dict[tuple, float] = {}
        self._last: tuple | None = None
        # Calls from several threads run concurrently on the compiled sizes (each
        # CompiledModel gives each thread its own VM); compiling a size and the cache
        # serialize, so two threads needing a new size compile it once.
        self._lock = threading.Lock()

    @property
    def model(self) -> onnx.ModelProto:
        """The ONNX model (read again where the model was given as what reads it)."""
        return self._model() if callable(self._model) else self._model

    @property
    def dims(self) -> list[str]:
        return list(self.bounds)

    @property
    def threads(self) -> int:
        """Threads the builds run on (the target's cores, or ``TVM_NUM_THREADS``)."""
        from .runtime import configure_threads, target_threads
        from .target import target as tpp_target

        return configure_threads(target_threads(_as_target(self._target or tpp_target())))

    @property
    def compiled_sizes(self) -> list[dict[str, int]]:
        """The sizes compiled and cached now, least recently used first."""
        return [dict(size) for size in self._cache]

    # ------------------------------------------------------------------ sizes

    def size_of(self, arrays: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        """The dynamic dims' values these inputs give, checked against the patterns and
        the bounds (an error names the input, the dim and what was expected)."""
        values: dict[str, tuple[int, str]] = {}
        for p in self.patterns:
            shape = np.shape(arrays[p.name])
            if len(shape) != len(p.dims):
                raise UnsupportedShapeError(
                    f"input {p.name!r}: shape {shape} has rank {len(shape)}, the model's "
                    f"input is {self._pattern_text(p)}")
            for axis, (want, got) in enumerate(zip(p.dims, shape)):
                if isinstance(want, int):
                    if want != got:
                        raise UnsupportedShapeError(
                            f"input {p.name!r} dim {axis}: {got}, the model fixes it to "
                            f"{want} (input {self._pattern_text(p)})")
                    continue
                if want in values and values[want][0] != got:
                    first, where = values[want]
                    raise UnsupportedShapeError(
                        f"dimension {want!r} is {first} in {where} but {got} in input "
                        f"{p.name!r} dim {axis}")
                values.setdefault(want, (int(got), f"input {p.name!r} dim {axis}"))
        for name, (value, where) in values.items():
            low, high = self.bounds[name]
            if not low <= value <= high:
                raise UnsupportedShapeError(
                    f"dimension {name!r} = {value} ({where}) is outside its bounds "
                    f"{_bound_text(low, high)}")
        return tuple((name, values[name][0]) for name in self.dims)

    def _pattern_text(self, p: InputPattern) -> str:
        return "(" + ", ".join(str(d) for d in p.dims) + ")"

    def _shape_dict(self, size: tuple[tuple[str, int], ...]) -> dict[str, tuple[int, ...]]:
        value = dict(size)
        return {p.name: tuple(d if isinstance(d, int) else value[d] for d in p.dims)
                for p in self.patterns}

    # ------------------------------------------------------------------ compile / run

    def specialization(self, size: tuple[tuple[str, int], ...]) -> Any:
        """The static build for ``size``, compiled now if it is not cached."""
        with self._lock:
            return self._specialization(size)

    def _specialization(self, size: tuple[tuple[str, int], ...]) -> Any:
        if size in self._cache:
            self._cache.move_to_end(size)
            return self._cache[size]
        t0 = time.perf_counter()
        compiled = self._compile_static(self.model, self._shape_dict(size), self._target,
                                        self._precision, self._tune_logs)
        self._compile_seconds[size] = time.perf_counter() - t0
        # The compile's temporaries (the model read again, its import, the build's IR) are
        # garbage only now: give their pages back (a 0.45B decoder's build otherwise left
        # 1.6 GB resident where it holds 0.4).
        gc.collect()
        release_freed_memory()
        self._cache[size] = compiled
        while len(self._cache) > self.max_cached:
            dropped, _ = self._cache.popitem(last=False)
            self._compile_seconds.pop(dropped, None)
        return compiled

    def prepare(self, **dims: int) -> Any:
        """Compile the size ``dims`` give ahead of time (e.g. ``prepare(batch=1, seq=128)``);
        every dynamic dim must be named."""
        missing = [d for d in self.dims if d not in dims]
        extra = [d for d in dims if d not in self.dims]
        if missing or extra:
            raise UnsupportedShapeError(
                f"prepare() needs every dynamic dimension ({', '.join(self.dims)}); "
                f"missing {missing}, unknown {extra}")
        arrays = {p.name: np.empty(tuple(d if isinstance(d, int) else dims[d]
                                         for d in p.dims), dtype=np.uint8)
                  for p in self.patterns}
        return self.specialization(self.size_of(arrays))

    def _named(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = [p.name for p in self.patterns]
        return dict(zip(names, bind_inputs(names, args, kwargs)))

    def __call__(self, *args, **kwargs) -> list[np.ndarray]:
        named = self._named(args, kwargs)
        size = self.size_of(named)
        compiled = self.specialization(size)
        self._last = size
        return compiled(**named)

    # ------------------------------------------------------------------ report / export

    def report(self) -> str:
        """The dynamic dims and their bounds, the sizes compiled, and the lowering report of
        the size run last."""
        uses: dict[str, list[str]] = {d: [] for d in self.dims}
        for p in self.patterns:
            for axis, d in enumerate(p.dims):
                if isinstance(d, str):
                    uses[d].append(f"{p.name}[{axis}]")
        lines = ["Dynamic dimensions (one static build per size, compiled on first use):"]
        lines += [f"  {d} in {_bound_text(*self.bounds[d])}: {', '.join(uses[d])}"
                  for d in self.dims]
        if not self._cache:
            lines.append("Compiled sizes: none yet")
        else:
            lines.append(f"Compiled sizes ({len(self._cache)} cached, at most "
                         f"{self.max_cached}):")
            lines += [f"  {_size_text(s)}: {self._compile_seconds.get(s, 0.0):.1f} s"
                      for s in self._cache]
        shown = self._last if self._last in self._cache else next(reversed(self._cache), None)
        if shown is not None:
            lines.append(f"Size {_size_text(shown)}:")
            lines += ["  " + line for line in self._cache[shown].report().splitlines()]
        return "\n".join(lines)

    def export(self, path: str | Path) -> Path:
        """Write a folder :func:`load_dynamic` restores: the ONNX model (to compile new
        sizes), the bounds and options, and every cached size's library."""
        from .target import target as tpp_target

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_model(self.model, path / _ONNX)  # an LLM's weights go past protobuf's 2 GiB
        libraries = []
        for i, (size, compiled) in enumerate(self._cache.items()):
            name = f"size{i}.so"
            compiled.export(path / name)
            libraries.append({"size": dict(size), "library": name,
                              "compile_seconds": self._compile_seconds.get(size)})
        tgt = self._target if self._target is not None else tpp_target()
        logs = self._tune_logs if isinstance(self._tune_logs, (str, type(None))) else \
            str(self._tune_logs)
        meta = {"patterns": [{"name": p.name, "dims": list(p.dims), "dtype": p.dtype}
                             for p in self.patterns],
                "bounds": {d: [lo, None if hi == math.inf else hi]
                           for d, (lo, hi) in self.bounds.items()},
                "target": str(_as_target(tgt)), "precision": self._precision,
                "tune_logs": logs, "max_cached": self.max_cached, "sizes": libraries}
        (path / _META).write_text(json.dumps(meta, indent=1))
        return path


def _as_target(tgt: Any) -> Any:
    import tvm

    return tgt if isinstance(tgt, tvm.target.Target) else tvm.target.Target(tgt)


def is_dynamic_export(path: str | Path) -> bool:
    return (Path(path) / _META).is_file()


def load_dynamic(path: str | Path, load_static: Callable[[Path], Any],
                 compile_static: CompileStatic) -> DynamicModel:
    """Restore a folder written by :meth:`DynamicModel.export`: its sizes load without
    compiling (``load_static``, ``compiled.load``); new sizes compile from the saved ONNX
    model for the saved target."""
    import tvm

    path = Path(path)
    try:
        meta = json.loads((path / _META).read_text())
        patterns = [InputPattern(p["name"], tuple(p["dims"]), p["dtype"])
                    for p in meta["patterns"]]
        bounds = {d: (lo, math.inf if hi is None else hi)
                  for d, (lo, hi) in meta["bounds"].items()}
        model = load_model(path / _ONNX)
        target = tvm.target.Target(json.loads(meta["target"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path} is not a dynamic model export "
                             f"({type(exc).__name__}: {exc})") from exc
    dyn = DynamicModel(model, patterns, bounds, compile_static, target,
                       meta.get("precision", "float32"), meta.get("tune_logs"),
                       meta.get("max_cached", MAX_CACHED))
    for entry in meta.get("sizes", []):
        size = tuple((d, int(entry["size"][d])) for d in dyn.dims)
        dyn._cache[size] = load_static(path / entry["library"])
        dyn._compile_seconds[size] = entry.get("compile_seconds") or 0.0
    return dyn
