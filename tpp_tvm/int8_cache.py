"""An int8 KV cache: each cached key and value row stored as int8 with one fp32 scale.

A decode step reads the whole cache (every layer's keys and values for every past token);
at long contexts that rivals the weights an int4 model streams, and the cache's memory
grows with every sequence of a batch. Stored as int8 with a scale per (head, slot) row —
symmetric, ``scale = max|row| / 127`` as llama.cpp's and vLLM's int8 caches do — it takes
a quarter of the bytes plus 4 bytes a row (at head size 64: 0.27x).

:func:`with_int8_cache` rewrites a step model whose cache is written in place
(:func:`~tpp_tvm.cache_layout.with_cache_written_in_place`): each cache input becomes int8 with
a ``<name>.scale`` input (batch, heads, slots, 1) beside it; the step's new row is
quantized (ONNX ``Abs``/``ReduceMax``/``Round``/``Clip``) and written into both; what read
the cache reads it dequantized (``Cast(int8) * scale``), which the attention kernel takes
in its int8 form (``schedules/attention.py``: a key block dequantized in L1 where it is
read). :func:`quantized_rows` is the same quantization in numpy, for the rows a prompt
wrote in fp32.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import TensorProto, helper

#: Largest int8 magnitude a row is scaled to (symmetric: -127..127).
QMAX = 127.0
#: Smallest scale (a row of zeros quantizes to zeros, not NaN).
MIN_SCALE = 1e-30


def scale_input(past: str) -> str:
    """The name of the scales input beside int8 cache input ``past``."""
    return f"{past}.scale"


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (..., d) fp32 as int8 rows and their fp32 scales (..., 1), as a step's graph
    quantizes its new row (round half to even, as ONNX ``Round``)."""
    x = np.asarray(x, np.float32)
    scale = np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(QMAX),
                       np.float32(MIN_SCALE)).astype(np.float32)
    q = np.clip(np.round(x / scale), -QMAX, QMAX).astype(np.int8)
    return q, scale


def _quantize_nodes(new: str, opset: int) -> tuple[list[onnx.NodeProto], str, str]:
    """Nodes quantizing ``new`` (..., d) per row: (nodes, int8 rows, scales (..., 1))."""
    p = f"{new}/int8"
    nodes = [helper.make_node("Abs", [new], [f"{p}/abs"])]
    if opset >= 18:  # axes became an input
        nodes.append(helper.make_node("Constant", [], [f"{p}/axes"], value=onnx.numpy_helper
                                      .from_array(np.array([-1], np.int64), f"{p}/axes")))
        nodes.append(helper.make_node("ReduceMax", [f"{p}/abs", f"{p}/axes"], [f"{p}/amax"],
                                      keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMax", [f"{p}/abs"], [f"{p}/amax"], axes=[-1],
                                      keepdims=1))

    def constant(name: str, value: float) -> str:
        nodes.append(helper.make_node("Constant", [], [f"{p}/{name}"], value=onnx.numpy_helper
                                      .from_array(np.array(value, np.float32), f"{p}/{name}")))
        return f"{p}/{name}"

    qmax, lowest = constant("qmax", QMAX), constant("qmin", -QMAX)
    nodes += [
        helper.make_node("Div", [f"{p}/amax", qmax], [f"{p}/ratio"]),
        helper.make_node("Max", [f"{p}/ratio", constant("min_scale", MIN_SCALE)],
                         [f"{p}/scale"]),
        helper.make_node("Div", [new, f"{p}/scale"], [f"{p}/scaled"]),
        helper.make_node("Round", [f"{p}/scaled"], [f"{p}/rounded"]),
        helper.make_node("Clip", [f"{p}/rounded", lowest, qmax], [f"{p}/clipped"]),
        helper.make_node("Cast", [f"{p}/clipped"], [f"{p}/rows"], to=TensorProto.INT8),
    ]
    return nodes, f"{p}/rows", f"{p}/scale"


def with_int8_cache(model: onnx.ModelProto, past: tuple[str, ...]) -> onnx.ModelProto:
    """A step model writing its cache in place (``TensorScatter`` of each input in
    ``past``), rewritten to hold the cache as int8 rows with a ``<name>.scale`` input of
    one fp32 scale per row (see the module docstring). Its ``present`` outputs are the
    int8 caches."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes, dequantized = [], {}  # present -> its dequantized name
    for node in out.graph.node:
        node.input[:] = [dequantized.get(n, n) for n in node.input]
        if node.op_type != "TensorScatter" or node.input[0] not in past:
            nodes.append(node)
            continue
        cache, new, *index = node.input
        present = node.output[0]
        quantize, rows, scales = _quantize_nodes(new, opset)
        axis = [a for a in node.attribute if a.name == "axis"]
        nodes += quantize
        nodes.append(helper.make_node("TensorScatter", [cache, rows, *index], [present],
                                      name=node.name))
        nodes.append(helper.make_node("TensorScatter", [scale_input(cache), scales, *index],
                                      [f"{present}/scale"], name=f"{node.name}/scale"))
        for n in nodes[-2:]:
            n.attribute.extend(axis)
        dequantized[present] = f"{present}/dequantized"
        nodes += [helper.make_node("Cast", [present], [f"{present}/float"],
                                   to=TensorProto.FLOAT),
                  helper.make_node("Mul", [f"{present}/float", f"{present}/scale"],
                                   [dequantized[present]])]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    inputs = list(out.graph.input)
    for value in inputs:
        if value.name in past:
            value.type.tensor_type.elem_type = TensorProto.INT8
            scale = onnx.ValueInfoProto()
            scale.CopyFrom(value)
            scale.name = scale_input(value.name)
            scale.type.tensor_type.elem_type = TensorProto.FLOAT
            last = scale.type.tensor_type.shape.dim[-1]
            last.Clear()
            last.dim_value = 1
            out.graph.input.append(scale)
    for value in out.graph.output:
        if value.name in dequantized:
            value.type.tensor_type.elem_type = TensorProto.INT8
    return out
