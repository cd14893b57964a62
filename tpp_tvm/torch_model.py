"""``compile_torch``: a PyTorch module compiled onto TPPs, called with ``torch.Tensor``s.

The module is captured with ``torch.export`` and imported by :mod:`tpp_tvm.torch_frontend`;
the Relax that comes out goes through the same ``tpp`` pipeline as an ONNX model, so it runs
on the same kernels. Tensors cross in both directions through DLPack, without copies where
the input is contiguous. Dynamic dims (``torch.export.Dim`` in ``dynamic_shapes``) work as
the ONNX route's do: one static build per size, compiled on first use, within the Dims'
bounds, the least recently used dropped past ``max_cached``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compiled import CompiledModel, compile_relax, load
from .errors import ModelLoadError, UnsupportedShapeError
from .torch_frontend import export_program, from_torch

#: Sizes a dynamic model keeps compiled.
MAX_CACHED = 8
_SPEC = ".torch.json"
_ALIGNMENT = 64


def _aligned(t: Any) -> Any:
    """A 64-byte aligned TVM copy of ``t`` (TVM takes aligned data only; a view into another
    tensor, or numpy's 16-byte aligned arrays, are not), copied by TVM on this thread. A
    torch copy would run on torch's OpenMP pool, whose workers then spin for a while after
    it, on the cores tpp_tvm's threads run on: MobileNetV2 through ``torch.compile`` at 2
    threads spent 5.0 ms a call in its kernels behind such a copy, 2.9 without."""
    import tvm

    try:
        return tvm.runtime.tensor(t.numpy())
    except TypeError:  # a dtype numpy lacks (bf16): torch copies it
        return tvm.runtime.from_dlpack(t.clone())


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class TorchModel:
    """``model(*tensors)`` → the module's outputs as ``torch.Tensor``s, in its structure."""

    def __init__(self, module: Any, example_inputs: Sequence[Any], *,
                 dynamic_shapes: Any = None, precision: str = "float32", target: Any = None,
                 tune_logs: Any = None, max_cached: int = MAX_CACHED,
                 compiled: CompiledModel | None = None, out_spec: Any = None) -> None:
        self._module = module
        self._options = {"target": target, "precision": precision, "tune_logs": tune_logs}
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple, CompiledModel] = OrderedDict()
        self._lock = threading.Lock()
        self.bounds: dict[str, tuple[int, float]] = {}
        self._dims: list[list[str | int]] = []
        if compiled is not None:  # a loaded export: one static size
            self._out_spec = out_spec
            self._cache[tuple(tuple(i.shape) for i in compiled.inputs)] = compiled
            return
        program = export_program(module, example_inputs, dynamic_shapes)
        self._out_spec = program.call_spec.out_spec
        if dynamic_shapes is not None:
            self._dims, self.bounds = _symbolic_dims(program, _dim_names(module,
                                                                         dynamic_shapes))
        self._specialization(list(example_inputs), program if dynamic_shapes is None else None)

    # ------------------------------------------------------------------ sizes

    @property
    def compiled_sizes(self) -> list[tuple[tuple[int, ...], ...]]:
        """Input shapes of the builds cached, least recently used first."""
        return list(self._cache)

    def _check_size(self, tensors: list[Any]) -> None:
        values: dict[str, int] = {}
        for k, (t, dims) in enumerate(zip(tensors, self._dims)):
            if len(dims) != t.dim():
                raise UnsupportedShapeError(f"input {k}: rank {t.dim()}, the module was "
                                            f"exported with rank {len(dims)}")
            for axis, (want, got) in enumerate(zip(dims, t.shape)):
                if isinstance(want, int):
                    if want != got:
                        raise UnsupportedShapeError(
                            f"input {k} dim {axis}: {got}, the export fixes it to {want}")
                    continue
                if values.setdefault(want, int(got)) != got:
                    raise UnsupportedShapeError(f"dimension {want!r} is {values[want]} in "
                                                f"one input but {got} in input {k}")
                low, high = self.bounds.get(want, (0, float("inf")))
                if not low <= got <= high:
                    raise UnsupportedShapeError(f"dimension {want!r} = {got} (input {k} dim "
                                                f"{axis}) is outside its bounds [{low}, {high}]")

    def _specialization(self, tensors: list[Any], program: Any = None) -> CompiledModel:
        key = tuple(tuple(t.shape) for t in tensors)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._module is None:
                raise UnsupportedShapeError(
                    f"inputs of shapes {list(key)}: this loaded model was compiled for "
                    f"{list(next(iter(self._cache)))} only")
            if self._dims:
                self._check_size(tensors)
            if program is None:
                mod, _ = from_torch(self._module, tensors)
            else:
                from .torch_frontend import from_program

                mod = from_program(program)
            compiled = compile_relax(mod, **self._options)
            self._cache[key] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return compiled

    # ------------------------------------------------------------------ run

    def __call__(self, *args: Any) -> Any:
        import torch
        import tvm

        tensors = list(args)
        for k, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise UnsupportedShapeError(f"input {k}: a {type(t).__name__}, expected a "
                                            "torch.Tensor")
            if t.device.type != "cpu":
                raise UnsupportedShapeError(f"input {k} is on {t.device}; tpp_tvm runs on "
                                            "the CPU")
        compiled = self._specialization(tensors)
        if len(tensors) != len(compiled.inputs):
            raise UnsupportedShapeError(f"{len(tensors)} inputs given, the module takes "
                                        f"{len(compiled.inputs)}")
        feeds = []
        for spec, t in zip(compiled.inputs, tensors):
            if _dtype_name(t.dtype) != spec.dtype:
                raise UnsupportedShapeError(f"input {spec.name!r}: dtype {t.dtype}, the "
                                            f"module was exported with {spec.dtype}")
            t = t.detach().contiguous()
            feeds.append(_aligned(t) if t.data_ptr() % _ALIGNMENT else
                         tvm.runtime.from_dlpack(t))
        flat = [torch.from_dlpack(out) for out in compiled.run_tensors(feeds)]
        if self._out_spec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        return self._out_spec.unflatten(flat)

    # ------------------------------------------------------------------ report / export

    def _last(self) -> CompiledModel:
        return self._cache[next(reversed(self._cache))]

    @property
    def threads(self) -> int:
        """Threads the kernels run on (settable, as :attr:`CompiledModel.threads`)."""
        return self._last().threads

    @threads.setter
    def threads(self, count: int) -> None:
        for compiled in self._cache.values():
            compiled.threads = count

    @property
    def report_data(self) -> dict:
        return self._last().report_data

    def report(self) -> str:
        """The lowering report of the size compiled or run last."""
        return self._last().report()

    def profile(self, *args: Any, repeat: int = 5) -> list[tuple[str, float, int]]:
        """Per-kernel times of the build these inputs run (see CompiledModel.profile)."""
        import numpy as np

        compiled = self._specialization(list(args))
        return compiled.profile(*[np.asarray(t.detach()) for t in args], repeat=repeat)

    def export(self, path: str | Path) -> Path:
        """Write the compiled library of a static model (as :meth:`CompiledModel.export`)
        and the outputs' structure beside it; :func:`load_torch` reads both."""
        from torch.utils._pytree import treespec_dumps

        if self._dims or len(self._cache) != 1:
            raise UnsupportedShapeError("export() writes one static build; this model has "
                                        "dynamic dims (compile_torch without dynamic_shapes "
                                        "for the size to export)")
        path = self._last().export(path)
        spec = treespec_dumps(self._out_spec) if self._out_spec is not None else None
        Path(str(path) + _SPEC).write_text(json.dumps({"out_spec": spec}))
        return path


def compile_torch(module: Any, example_inputs: Sequence[Any], *, dynamic_shapes: Any = None,
                  precision: str = "float32", target: Any = None, tune_logs: Any = None,
                  max_cached: int = MAX_CACHED) -> TorchModel:
    """Compile a PyTorch module (eval mode, no autograd) onto TPPs.

    ``example_inputs`` fix the shapes (and dtypes) the module is captured with;
    ``dynamic_shapes`` (``torch.export``'s: ``{"x": {0: Dim("batch", max=8)}}``) marks dims
    that vary, compiled per size on first use. ``precision``, ``target`` and ``tune_logs``
    are :func:`~tpp_tvm.compile_onnx`'s."""
    return TorchModel(module, example_inputs, dynamic_shapes=dynamic_shapes,
                      precision=precision, target=target, tune_logs=tune_logs,
                      max_cached=max_cached)


def load_torch(path: str | Path, threads: int | None = None) -> TorchModel:
    """A model written by :meth:`TorchModel.export`."""
    from torch.utils._pytree import treespec_loads

    compiled = load(path, threads=threads)
    if not isinstance(compiled, CompiledModel):
        raise ModelLoadError(f"{path} is not a static compiled model")
    side = Path(str(path) + _SPEC)
    spec = json.loads(side.read_text()).get("out_spec") if side.exists() else None
    return TorchModel(None, [], compiled=compiled,
                      out_spec=treespec_loads(spec) if spec else None)


def _dim_names(module: Any, dynamic_shapes: Any) -> dict[tuple[int, int], str]:
    """(input position, axis) → the name of the ``torch.export.Dim`` given for it."""
    import inspect

    if isinstance(dynamic_shapes, dict):
        params = list(inspect.signature(module.forward).parameters)
        entries = [(params.index(k) if k in params else None, v)
                   for k, v in dynamic_shapes.items()]
    else:
        entries = list(enumerate(dynamic_shapes))
    names = {}
    for position, spec in entries:
        if position is None or spec is None:
            continue
        axes = spec.items() if isinstance(spec, dict) else enumerate(spec)
        for axis, dim in axes:
            if dim is not None and hasattr(dim, "__name__"):
                names[(position, int(axis))] = dim.__name__
    return names


def _symbolic_dims(program: Any, dim_names: dict[tuple[int, int], str]
                   ) -> tuple[list[list[str | int]], dict[str, tuple[int, float]]]:
    """Each user input's dims (an int, or its Dim's name) and each Dim's bounds."""
    user = set(program.graph_signature.user_inputs)
    symbols: dict[str, str] = {}  # torch's symbol (s77) → the Dim's name
    dims: list[list[str | int]] = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in user:
            row: list[str | int] = []
            for axis, d in enumerate(node.meta["val"].shape):
                if str(d).lstrip("-").isdigit():
                    row.append(int(d))
                    continue
                name = symbols.setdefault(str(d), dim_names.get((len(dims), axis), str(d)))
                row.append(name)
            dims.append(row)
    bounds = {}
    for symbol, ranges in program.range_constraints.items():
        upper = ranges.upper
        bounds[symbols.get(str(symbol), str(symbol))] = (
            int(ranges.lower), float("inf") if not upper.is_finite else int(upper))
    return dims, bounds
