"""A graph's real inputs, their types, and the static shapes they get before folding.

Every graph input gets a fully static shape, from ``shape_dict`` or from the model
(:func:`static_input_shapes`). A dynamic dimension with no ``shape_dict`` entry is an error
naming the input and the dimension: TPP kernels are generated per shape, and a static shape
is what lets the folding (:mod:`.folding`) fold the exporter's shape arithmetic away.
(``compile_onnx`` serves dynamic exports with one static import per size:
``tpp_tvm.dynamic``.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from tpp_tvm.errors import UnsupportedShapeError


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs that are real inputs (old exports also list initializers as inputs)."""
    initializers = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def input_type(value: onnx.ValueInfoProto) -> onnx.TypeProto:
    """An input's type, an optional tensor's unwrapped: given, it is a tensor (TVM's
    importer reads it so)."""
    optional = value.type.optional_type.elem_type
    if value.type.HasField("optional_type") and optional.HasField("tensor_type"):
        return optional
    return value.type


def _dim_text(dim: onnx.TensorShapeProto.Dimension) -> str:
    if dim.HasField("dim_value"):
        return str(dim.dim_value)
    return repr(dim.dim_param) if dim.HasField("dim_param") else "?"


def static_input_shapes(
    model: onnx.ModelProto, shape_dict: Mapping[str, Sequence[int]] | None
) -> dict[str, tuple[int, ...]]:
    """Each real input's static shape, from ``shape_dict`` or the model; written into it."""
    shape_dict = dict(shape_dict or {})
    inputs = graph_inputs(model)
    names = [v.name for v in inputs]
    unknown = sorted(set(shape_dict) - set(names))
    if unknown:
        raise UnsupportedShapeError(
            f"shape_dict names {unknown}, which are not model inputs {names}")
    shapes: dict[str, tuple[int, ...]] = {}
    for value in inputs:
        if not value.type.HasField("tensor_type"):
            value.type.CopyFrom(input_type(value))  # an optional tensor, or left as it is
        ttype = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise UnsupportedShapeError(f"input {value.name!r} is not a tensor")
        dims = list(ttype.shape.dim) if ttype.HasField("shape") else None
        if value.name in shape_dict:
            shape = tuple(shape_dict[value.name])
            if not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
                raise UnsupportedShapeError(
                    f"shape_dict[{value.name!r}] = {shape}: dims must be non-negative integers"
                )
            if dims is not None and len(dims) != len(shape):
                raise UnsupportedShapeError(
                    f"shape_dict[{value.name!r}] = {shape} has rank {len(shape)}, but the "
                    f"model's input has rank {len(dims)} "
                    f"[{', '.join(_dim_text(d) for d in dims)}]"
                )
            for i, (dim, size) in enumerate(zip(dims or [], shape, strict=False)):
                if dim.HasField("dim_value") and dim.dim_value != size:
                    raise UnsupportedShapeError(
                        f"shape_dict[{value.name!r}] = {shape} sets dim {i} to {size}, but the "
                        f"model fixes it to {dim.dim_value}"
                    )
        elif dims is None:
            raise UnsupportedShapeError(
                f"input {value.name!r} has unknown rank; give its shape in shape_dict"
            )
        else:
            for i, dim in enumerate(dims):
                if not dim.HasField("dim_value") or dim.dim_value < 0:
                    raise UnsupportedShapeError(
                        f"input {value.name!r} dim {i} ({_dim_text(dim)}) is dynamic; give "
                        f"the input's static shape in shape_dict, e.g. "
                        f"shape_dict={{{value.name!r}: (...)}}"
                    )
            shape = tuple(d.dim_value for d in dims)
        shapes[value.name] = tuple(int(d) for d in shape)
        ttype.ClearField("shape")
        for size in shapes[value.name]:
            ttype.shape.dim.add().dim_value = size
    return shapes
