"""ONNX's ``TensorScatter`` (opset 24): a KV cache written where it lies.

``present = TensorScatter(past, update, write_indices, axis, mode)`` is ``past`` with
``update``'s rows written along ``axis`` from each batch row's ``write_indices[b]`` (modulo the
cache length in ``mode="circular"``). Where ``past`` is a graph input, the rows are written
into the input tensor itself (``call_tir_inplace``) and ``present`` *is* that tensor: a decode
step then writes one token's keys instead of copying the whole cache, which is what the
operator exists for (:mod:`tpp_tvm.decoding` rewrites its exports' ``Concat`` caches into
it). Anywhere else ``present`` is a new tensor (a copy with the rows written).

Rows that would land outside the cache in linear mode are not written (the ONNX spec leaves
them undefined; a store out of bounds would corrupt memory).
"""

from __future__ import annotations

from typing import Any

from tpp_tvm.errors import UnsupportedOperatorError, UnsupportedShapeError

_MODES = ("linear", "circular")


def _static_dims(expr: Any) -> list[int] | None:
    shape = getattr(expr.ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None:
        return None
    try:
        return [int(d) for d in values]
    except TypeError:  # symbolic
        return None


def _write_rows_func(cache: list[int], rows: int, axis: int, dtype: str, index_dtype: str,
                     circular: bool, copy: bool) -> Any:
    """A PrimFunc writing ``update`` (``cache`` with ``rows`` along ``axis``) into ``cache``
    at each batch row's index: in place, or (``copy``) into a fourth buffer that first gets
    a copy of the cache."""
    from tvm.script import from_source
    from tvm.script import tirx as T

    rank = len(cache)
    update = [rows if d == axis else n for d, n in enumerate(cache)]
    i = [f"i{d}" for d in range(rank)]
    pos = f"T.int64(write_indices[i0]) + {i[axis]}"
    pos = f"T.floormod({pos}, T.int64({cache[axis]}))" if circular else pos
    out = "present" if copy else "past"
    dst = ", ".join("p" if d == axis else v for d, v in enumerate(i))
    buffers = [f"past: T.Buffer({tuple(cache)}, {dtype!r})",
               f"update: T.Buffer({tuple(update)}, {dtype!r})",
               f"write_indices: T.Buffer(({cache[0]},), {index_dtype!r})"]
    lines = []
    if copy:
        buffers.append(f"present: T.Buffer({tuple(cache)}, {dtype!r})")
        c = ", ".join(f"c{d}" for d in range(rank))
        lines += [f"    for {c} in T.grid({', '.join(map(str, cache))}):",
                  f"        present[{c}] = past[{c}]"]
    lines += [f"    for {', '.join(i)} in T.grid({', '.join(map(str, update))}):",
              f"        p: T.int64 = {pos}"]
    store = f"{out}[{dst}] = update[{', '.join(i)}]"
    if circular:
        lines.append(f"        {store}")
    else:
        lines += [f"        if p >= T.int64(0) and p < T.int64({cache[axis]}):",
                  f"            {store}"]
    source = "\n".join([
        "@T.prim_func(private=True)",
        f"def tensor_scatter({', '.join(buffers)}):",
        '    T.func_attr({"tirx.noalias": True})',
        *lines]) + "\n"
    func = from_source(source, extra_vars={"T": T})
    return func.with_attrs({"op_pattern": 8, "tirx.is_scheduled": True})


def _tensor_scatter(bb: Any, inputs: Any, attrs: dict[str, Any]) -> Any:
    """``TensorScatter``: in place into a graph input, else into a copy."""
    import numpy as np
    from tvm import relax

    past, update = inputs[0], inputs[1]
    indices = inputs[2] if len(inputs) > 2 else None
    mode = attrs.get("mode", "linear")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in _MODES:
        raise UnsupportedOperatorError(f"TensorScatter mode {mode!r} (ONNX defines {_MODES})")
    cache, rows = _static_dims(past), _static_dims(update)
    if cache is None or rows is None:
        raise UnsupportedShapeError(
            "TensorScatter needs static cache and update shapes (compile the model for its "
            "sizes: a dynamic model is compiled per size)")
    axis = int(attrs.get("axis", -2)) % len(cache)
    if axis == 0 or len(rows) != len(cache) or any(
            a != b for d, (a, b) in enumerate(zip(cache, rows)) if d != axis) \
            or rows[axis] > cache[axis]:
        raise UnsupportedShapeError(
            f"TensorScatter of a {rows} update into a {cache} cache along axis {axis}: the "
            "dims other than the sequence axis (not the batch) must match, and the update "
            "must fit")
    dtype = str(past.ty.dtype)
    if indices is None:
        indices = relax.const(np.zeros(cache[0], "int64"))
    index_dtype = str(indices.ty.dtype)
    in_place = isinstance(past, relax.Var) and not isinstance(past, relax.DataflowVar)
    func = _write_rows_func(cache, rows[axis], axis, dtype, index_dtype,
                            mode == "circular", copy=not in_place)
    gv = bb.add_func(func, "tensor_scatter" + ("_inplace" if in_place else ""))
    out_ty = relax.TensorType(cache, dtype)
    if in_place:
        return bb.emit(relax.call_tir_inplace(gv, [past, update, indices], [0], out_ty))
    return bb.emit(relax.call_tir(gv, [past, update, indices], out_ty))


#: Converters by ONNX op type (for :data:`~.converters.EXTRA_CONVERTERS`).
CONVERTERS = {"TensorScatter": _tensor_scatter}
