"""A PyTorch graph split where TVM's importer stops: the operators it takes run on TPPs in
compiled parts, the few it lacks run in eager between them.

``torch.compile``'s backend (:mod:`tpp_tvm.torch_backend`) first compiles a captured graph
whole. When an operator has no converter (``aten.digamma``, ``aten.erfinv``...), the
graph is exported to core ATen operators here, the supported operators are grouped into
connected parts (torch's ``CapabilityBasedPartitioner``, which keeps the parts free of
cycles), each part with two operators or more is compiled as its own
:class:`~tpp_tvm.torch_model.TorchModel` (the module's weights bound as constants, as in
a whole graph), and the rest runs as the exported ATen calls. A part that fails to compile
runs in eager too; a model torch can run never fails because of the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Graph nodes that are not operators: they move values, never compute.
_PLUMBING = ("placeholder", "output", "get_attr")
#: Calls that only unpack a tuple or check metadata: no work for either side.
_BOOKKEEPING = ("getitem", "_assert_tensor_metadata.default")


def bound_module(gm: Any, fixed: dict[int, Any], count: int) -> Any:
    """``gm`` with the inputs in ``fixed`` (position → a tensor bound as a buffer, or a
    value such as a size dynamo passes as an int) bound, as an ``nn.Module``
    ``torch.export`` takes: the rest, tensors the caller passes, are its inputs."""
    import torch

    class Bound(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.graph_module = gm
            for k, value in fixed.items():
                if isinstance(value, torch.Tensor):
                    self.register_buffer(f"state_{k}", value.detach(), persistent=False)

        def forward(self, *args):
            it = iter(args)
            full = [(getattr(self, f"state_{k}") if isinstance(fixed[k], torch.Tensor)
                     else fixed[k]) if k in fixed else next(it) for k in range(count)]
            return self.graph_module(*full)

    return Bound()


def _operator_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


def supported_operators() -> set[str]:
    """The ATen operator names (``addmm.default``) the import takes."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    from .torch_frontend import CONVERTERS

    return {*ExportedProgramImporter().create_convert_map(), *CONVERTERS}


@dataclass
class PartitionedGraph:
    """A graph run as compiled parts with eager operators between them: call it with the
    graph's tensors. ``eager_operators``: the ATen operators outside the parts (with how
    many nodes of each); ``parts``: the compiled parts (:class:`~.torch_model.TorchModel`)."""

    module: Any
    parts: list[Any] = field(default_factory=list)
    eager_operators: dict[str, int] = field(default_factory=dict)
    supported: set[str] = field(default_factory=set)

    @property
    def unsupported(self) -> dict[str, int]:
        """The eager operators the import has no converter for (the reason for the split;
        the others are single operators between them, views mostly)."""
        return {k: v for k, v in self.eager_operators.items() if k not in self.supported}

    def __call__(self, *tensors: Any) -> Any:
        return self.module(*tensors)

    @property
    def threads(self) -> int:
        return self.parts[0].threads

    @threads.setter
    def threads(self, count: int) -> None:
        for part in self.parts:
            part.threads = count


def _part_inputs(gm: Any, names: Sequence[str], tensors: Sequence[Any]) -> dict[str, tuple]:
    """The arguments each submodule in ``names`` receives when ``gm`` runs on ``tensors``."""
    import torch

    seen: dict[str, tuple] = {}

    class Recorder(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            if target in names and target not in seen:
                seen[target] = tuple(args)
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Recorder(gm).run(*tensors)
    return seen


def _compiled_part(gm: Any, node: Any, args: tuple, options: dict) -> Any:
    """The submodule ``node`` calls, compiled: its inputs that the parent reads from the
    module's weights (``get_attr``) are bound as constants."""
    import torch

    from .torch_model import TorchModel

    fixed = {k: a for k, (a, src) in enumerate(zip(args, node.args))
             if isinstance(src, torch.fx.Node) and src.op == "get_attr"}
    fixed.update({k: a for k, a in enumerate(args) if not isinstance(a, torch.Tensor)})
    tensors = [a for k, a in enumerate(args) if k not in fixed]
    threads = options.get("threads")
    model = TorchModel(bound_module(getattr(gm, node.target), fixed, len(args)), tensors,
                       **{k: v for k, v in options.items() if k != "threads"})
    if threads is not None:
        model.threads = int(threads)

    class OnTPPs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            out = self.model(*[a for k, a in enumerate(inputs) if k not in fixed])
            return tuple(out) if isinstance(out, list) else out

    return OnTPPs()


def partition(module: Any, tensors: Sequence[Any], options: dict) -> PartitionedGraph:
    """``module`` (called with ``tensors``) as compiled parts and eager operators; raises
    when nothing of it can be compiled."""
    import torch
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    from .errors import UnsupportedOperatorError
    from .torch_frontend import core_program, export_program

    known = supported_operators()

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules, node) -> bool:  # noqa: ARG002 - torch's API
            return node.op == "call_function" and _operator_name(node.target) in known

    gm = core_program(export_program(module, tensors)).module()
    fused = CapabilityBasedPartitioner(gm, Support()).partition_and_fuse()
    calls = [n for n in fused.graph.nodes if n.op == "call_module"
             and n.target.startswith("fused_")]
    inputs = _part_inputs(fused, [n.target for n in calls], tensors)
    graph = PartitionedGraph(fused, supported=known)
    for node in calls:
        try:
            part = _compiled_part(fused, node, inputs[node.target], options)
        except Exception:  # noqa: BLE001 - the part runs in eager, the graph stays right
            continue
        setattr(fused, node.target, part)
        graph.parts.append(part.model)
    for node in fused.graph.nodes:
        if node.op == "call_module" and isinstance(getattr(fused, node.target),
                                                   torch.fx.GraphModule):
            ops = [n for n in getattr(fused, node.target).graph.nodes if n.op not in _PLUMBING]
        else:
            ops = [node] if node.op == "call_function" else []
        for op in ops:
            name = _operator_name(op.target)
            if name not in _BOOKKEEPING:
                graph.eager_operators[name] = graph.eager_operators.get(name, 0) + 1
    if not graph.parts:
        raise UnsupportedOperatorError(
            f"no part of the graph compiles (eager operators: {', '.join(graph.eager_operators)})")
    return graph
