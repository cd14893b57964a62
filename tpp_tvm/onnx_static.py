"""What is statically known about an ONNX graph's values: their types and shapes while the
frontend folds constants, and, when TVM's converter fails, where static knowledge stopped.

The frontend's folding (``frontend.folding``) turns an exporter's shape arithmetic into
constants, which needs each value's shape. ONNX shape inference gives them between folding
rounds; :class:`StaticTypes` also infers, node by node, the outputs of a node whose inputs
a fold just made constant. Without it each block of a deep model needed its own round: a
chunk ``x[..., :n // 2]`` computed from ``Shape(x)`` gives its slice a static shape only once
the bounds are constants, and the next block's ``Shape`` of that slice folds only then
(timm's gMLP and EVA-02: 30 and 12 such blocks; folding stopped after 8 rounds and TVM's
converter failed on the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import onnx
import onnx.shape_inference
from onnx import helper, numpy_helper

#: Constant inputs up to this many elements are passed to a node's shape inference as
#: data (shape vectors, pads, axes, sizes); larger ones, weights, by type only.
MAX_SHAPE_DATA = 1 << 12


def static_dims(ttype: onnx.TypeProto) -> tuple[int, ...] | None:
    """The shape of a tensor type if every dimension is a number, else None."""
    if not ttype.HasField("tensor_type") or not ttype.tensor_type.HasField("shape"):
        return None
    dims = ttype.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return tuple(d.dim_value for d in dims)


def static_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """Shapes of all values of ``graph`` whose inferred shape is fully static."""
    return dict(StaticTypes(graph).shapes)


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute)


class StaticTypes:
    """The statically shaped values of a graph, by name: ``shapes`` (what folding reads)
    and their tensor types, extended with constants (:meth:`add_constant`) and with the
    outputs of nodes inferred one at a time (:meth:`infer`)."""

    def __init__(self, graph: onnx.GraphProto,
                 opset_imports: Iterable[onnx.OperatorSetIdProto] = ()) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.types: dict[str, onnx.TypeProto] = {}
        self.opset_imports = list(opset_imports)
        self._opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version
                        for o in self.opset_imports}
        for value in [*graph.input, *graph.value_info, *graph.output]:
            dims = static_dims(value.type)
            if dims is not None:
                self.shapes[value.name], self.types[value.name] = dims, value.type
        for tensor in graph.initializer:
            self.shapes[tensor.name] = tuple(tensor.dims)
            self.types[tensor.name] = helper.make_tensor_type_proto(tensor.data_type,
                                                                    tensor.dims)

    def add_constant(self, name: str, value: np.ndarray) -> None:
        """Record a constant computed by folding."""
        self.shapes[name] = tuple(value.shape)
        self.types[name] = helper.make_tensor_type_proto(
            helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)

    def infer(self, node: onnx.NodeProto, const: Callable[[str], np.ndarray | None]) -> None:
        """Learn the static shapes of ``node``'s outputs from its inputs' types and the
        values of its small constant inputs (``const``), with the op's own ONNX shape
        inference; nothing is learned where that fails or an input is not static."""
        if all(o in self.shapes for o in node.output if o) or _has_subgraph(node):
            return
        if node.domain not in ("", "ai.onnx") or "" not in self._opsets:
            return
        inputs, data = {}, {}
        for name in node.input:
            if not name:
                continue
            if name not in self.types:
                return
            inputs[name] = self.types[name]
            if np.prod(self.shapes[name], dtype=np.int64) <= MAX_SHAPE_DATA:
                value = const(name)
                if value is not None:
                    data[name] = numpy_helper.from_array(np.ascontiguousarray(value), name)
        try:
            schema = onnx.defs.get_schema(node.op_type, self._opsets[""], "")
            outputs = onnx.shape_inference.infer_node_outputs(
                schema, node, inputs, data, opset_imports=self.opset_imports)
        except Exception:  # noqa: BLE001 - an aid to folding: the next round tries again
            return
        for name, ttype in outputs.items():
            dims = static_dims(ttype)
            if name and dims is not None:
                self.shapes[name], self.types[name] = dims, ttype


def why_not_static(graph: onnx.GraphProto, node_name: str) -> str:
    """For a node of ``graph`` that TVM's converter failed on, where static knowledge about
    its inputs stopped, as a sentence naming a node, its op and its input shapes: an input
    with no static shape (and the first node upstream that lost it), or an input computed
    from constants and shapes alone (pads, a reshape target) that is no constant (and the
    node that was not folded). Empty where neither applies."""
    producers = {out: n for n in graph.node for out in n.output if out}
    order = {out: k for k, n in enumerate(graph.node) for out in n.output}
    node = next((n for n in graph.node if n.name == node_name), None)
    if node is None:
        return ""
    known = StaticTypes(graph)
    constants = {t.name for t in graph.initializer}

    def describe(n: onnx.NodeProto) -> str:
        shapes = ", ".join(str(list(known.shapes[i])) if i in known.shapes else "unknown"
                           for i in n.input if i)
        return f"{n.op_type} node {n.name or n.output[0]!r} (input shapes {shapes})"

    def shape_origin(name: str) -> onnx.NodeProto | None:
        """The first node upstream of ``name`` whose output shape is unknown though its
        inputs' shapes are known."""
        n = producers.get(name)
        while n is not None:
            unknown = next((i for i in n.input if i and i not in known.shapes), None)
            if unknown is None or unknown not in producers:
                return n
            n = producers[unknown]
        return None

    def shape_arithmetic(name: str) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]] | None:
        """The nodes computing ``name`` and the Shape/Size nodes they read, or None when it
        reads a graph input's values (data, not shape arithmetic)."""
        stack, seen, nodes, reads = [name], set(), [], []
        while stack:
            value = stack.pop()
            if value in seen or value in constants:
                continue
            seen.add(value)
            n = producers.get(value)
            if n is None:
                return None
            if n.op_type in ("Shape", "Size"):
                reads.append(n)
                continue
            nodes.append(n)
            stack.extend(i for i in n.input if i)
        return nodes, reads

    for name in node.input:
        if not name or name in constants:
            continue
        if name not in known.shapes:
            origin = shape_origin(name)
            if origin is not None:
                return (f"input {name!r} has no static shape; static shape inference stops "
                        f"at {describe(origin)}")
            continue
        computed = shape_arithmetic(name)
        if computed is None:
            continue
        nodes, reads = computed
        for read in reads:
            if read.input[0] not in known.shapes:
                origin = shape_origin(read.input[0])
                where = f"; static shape inference stops at {describe(origin)}" if origin else ""
                return (f"input {name!r} is computed from the shape of {read.input[0]!r}, "
                        f"which is not static{where}")
        stuck = [n for n in nodes if all(not i or i in constants for i in n.input)]
        if stuck:
            first = min(stuck, key=lambda n: order[n.output[0]])
            return (f"input {name!r} is computed from constants and static shapes, but "
                    f"{describe(first)} was not folded into a constant")
    return ""
