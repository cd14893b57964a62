"""``torch.compile(model, backend="tpp_tvm")``: every graph dynamo captures, compiled onto
TPPs through :mod:`tpp_tvm.torch_model`.

Registered through the ``torch_dynamo_backends`` entry point, so the name works after
``pip install`` with no import. Options (``torch.compile(..., options={...})``):
``precision`` ("float32" or "bf16"), ``threads``, ``target``, ``tune_logs``.

What each graph becomes:

- The module's parameters and buffers, which dynamo passes to the graph as inputs, are bound
  as constants (as inductor's ``freezing`` does): the kernels pack the weights once. A model
  whose weights change after compiling (training) needs recompiling, as with freezing.
- A graph is compiled per input shape on its first call (dynamo's ``dynamic=True`` graphs
  too: their symbolic sizes take each call's values), and cached.
- A graph with operators TVM's importer lacks runs as compiled parts with those operators
  in eager between them (:mod:`tpp_tvm.torch_partition`), with a one-line warning naming
  them. A graph tpp_tvm cannot take at all (no part compiles, or it needs gradients: call
  the model under ``torch.no_grad()``) runs in eager, with a one-line warning naming why:
  a model torch can run never fails because of the backend.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

#: The options the backend reads; anything else is an error naming it.
OPTIONS = ("precision", "threads", "target", "tune_logs")


def _state_inputs(gm: Any, example_inputs: list[Any]) -> list[bool]:
    """For each graph input: is it the module's state (a parameter or buffer dynamo lifted),
    not a tensor the caller passes?"""
    import torch

    flags = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", "")
        name = name() if callable(name) else str(name)  # a method before torch 2.10
        flags.append(isinstance(value, torch.nn.Parameter) or
                     (isinstance(value, torch.Tensor) and name.startswith(("L['self']",
                                                                          "G[", "L['fn']"))))
    return flags


class CompiledGraph:
    """The callable dynamo runs in place of one graph: compiled per input shape."""

    def __init__(self, gm: Any, example_inputs: list[Any], options: dict) -> None:
        self._gm = gm
        flags = _state_inputs(gm, example_inputs)
        self._state = {k: v for k, (v, f) in enumerate(zip(example_inputs, flags)) if f}
        self._count = len(example_inputs)
        self._options = options
        self._models: dict[tuple, Any] = {}
        self._eager_reason: str | None = None

    def _eager(self, reason: str) -> None:
        self._eager_reason = reason
        warnings.warn(f"tpp_tvm: running a graph in eager: {reason}", stacklevel=3)

    def _model(self, args: tuple) -> tuple[Any, list[Any]]:
        """The compiled model for these arguments and the tensors it takes."""
        import torch

        from .errors import UnsupportedOperatorError
        from .torch_model import TorchModel
        from .torch_partition import bound_module

        fixed = dict(self._state)
        tensors = []
        for k, a in enumerate(args):
            if k in self._state:
                continue
            if isinstance(a, torch.Tensor):
                tensors.append(a)
            else:  # a size of a dynamic graph: this build's value
                fixed[k] = a
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                    for k, a in enumerate(args) if k not in self._state)
        model = self._models.get(key)
        if model is None:
            module = bound_module(self._gm, fixed, self._count)
            options = {k: v for k, v in self._options.items() if k != "threads"}
            try:
                model = TorchModel(module, tensors, **options)
            except UnsupportedOperatorError as whole:
                model = self._split(module, tensors, whole)
            if "threads" in self._options:
                model.threads = int(self._options["threads"])
            self._models[key] = model
        return model, tensors

    def _split(self, module: Any, tensors: list[Any], whole: Exception) -> Any:
        """The graph as compiled parts with the operators the import lacks in eager
        between them (warned once, naming them); raises ``whole`` if no part compiles."""
        from .torch_partition import partition

        try:
            graph = partition(module, tensors, self._options)
        except Exception as exc:
            raise whole from exc
        lacking = ", ".join(f"{name} x{count}" if count > 1 else name
                            for name, count in graph.unsupported.items())
        warnings.warn(f"tpp_tvm: {len(graph.parts)} part(s) of a graph on TPPs, operators "
                      f"TVM's importer lacks in eager between them: {lacking}", stacklevel=4)
        return graph

    def __call__(self, *args: Any) -> Any:
        import torch

        if self._eager_reason is None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self._eager("the graph needs gradients (the backend compiles inference: call "
                        "the model under torch.no_grad() or torch.inference_mode(); "
                        "training steps: tpp_tvm.training)")
        if self._eager_reason is None:
            try:
                model, tensors = self._model(args)
            except Exception as exc:  # noqa: BLE001 - eager runs what tpp_tvm cannot
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                self._eager(f"{type(exc).__name__}: {first}")
            else:
                out = model(*tensors)
                return out if isinstance(out, (tuple, list)) else (out,)
        return self._gm(*args)


def tpp_tvm_backend(gm: Any, example_inputs: list[Any], options: dict | None = None,
                    **kwargs: Any) -> Callable[..., Any]:
    """The ``torch.compile`` backend: ``gm`` (a dynamo graph) → a callable on TPPs."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS)) + sorted(k for k in kwargs if k != "mode")
    if unknown:
        raise ValueError(f"tpp_tvm backend: unknown options {unknown}; it takes {OPTIONS}")
    try:
        return CompiledGraph(gm, list(example_inputs), options)
    except Exception as exc:  # noqa: BLE001 - eager runs what tpp_tvm cannot
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        warnings.warn(f"tpp_tvm: running a graph in eager: {type(exc).__name__}: {first}",
                      stacklevel=2)
        return gm.forward
