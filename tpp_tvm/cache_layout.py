"""How a KV-cache export carries its cache, and the rewrites of the export a decoder runs.

:func:`cache_layout` reads which inputs and outputs are the tokens, mask, positions, past and
present caches and logits off the export's names; :func:`with_cache_written_in_place` makes
a step write its token's keys and values into the past tensors themselves (ONNX's
``TensorScatter``), and :func:`with_last_logits_only` has the LM head compute the last
position only. :mod:`tpp_tvm.decoding` runs the rewritten exports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper

from .errors import ModelLoadError

#: The input a step's build takes the slot to write its token's keys and values at from.
CACHE_WRITE_INDEX = "cache_write_index"


@dataclass(frozen=True)
class CacheLayout:
    """Which inputs and outputs of the export carry what; ``axis``: the past-length axis;
    ``right_padded``: the model places each sequence's new rows after its own past length,
    read off the mask (ONNX Runtime's GroupQueryAttention, which takes no positions):
    sequences then fill the first slots of the cache, each to its own length."""

    tokens: str
    mask: str
    positions: str | None
    past: tuple[str, ...]
    present: tuple[str, ...]
    logits: str
    axis: int
    cache_shapes: tuple[tuple[int | str, ...], ...]
    cache_dtype: str
    mask_dtype: str
    right_padded: bool = False


def cache_layout(model: onnx.ModelProto) -> CacheLayout:
    """Read the cache layout off the export's names: ``input_ids``, ``attention_mask``,
    ``position_ids`` (none where GroupQueryAttention places the rows: ONNX Runtime GenAI's
    model builder's files), inputs with ``past`` in their name and the outputs named like
    them with ``present``; errors name what is missing."""
    from .dynamic import input_patterns

    patterns = input_patterns(model)
    if patterns is None:
        raise ModelLoadError("the model's inputs are not all tensors of known rank")
    inputs = {p.name: p for p in patterns}
    outputs = [v.name for v in model.graph.output]
    right_padded = "position_ids" not in inputs and any(
        node.op_type == "GroupQueryAttention" for node in model.graph.node)
    need = {"tokens": "input_ids", "mask": "attention_mask"} | (
        {} if right_padded else {"positions": "position_ids"})
    missing = [n for n in need.values() if n not in inputs]
    if missing:
        raise ModelLoadError(
            f"a decoder with a KV cache needs inputs {sorted(need.values())}; the model lacks "
            f"{missing} (inputs: {sorted(inputs)}). Export it with "
            "tpp_tvm.cache_export.export_causal_lm_with_cache")
    past = [n for n in inputs if "past" in n.lower()]
    if not past:
        raise ModelLoadError(f"no past_key_values inputs among {sorted(inputs)}")
    present = []
    for name in past:
        candidates = [name.replace("past_key_values", "present"),
                      name.replace("past_key_values", "present_key_values"),
                      name.replace("past", "present")]
        found = next((c for c in candidates if c in outputs), None)
        if found is None:
            raise ModelLoadError(f"cache input {name!r} has no output among {candidates}")
        present.append(found)
    logits = next((o for o in outputs if o not in present), None)
    if logits is None:
        raise ModelLoadError(f"no logits output among {outputs}")
    token_dims = set(inputs["input_ids"].dims)
    shapes = tuple(inputs[n].dims for n in past)

    def past_axes(dims: tuple) -> tuple[int, ...]:
        """The dynamic axes besides the batch (axis 0); of several (the model builder's
        head size is a symbol too), the one named as a sequence's."""
        axes = tuple(i for i, d in enumerate(dims) if i and isinstance(d, str)
                     and d not in token_dims)
        named = tuple(i for i in axes if "past" in dims[i].lower() or "seq" in dims[i].lower())
        return named if len(axes) > 1 and len(named) == 1 else axes

    axes = {past_axes(s) for s in shapes}
    if len(axes) != 1 or len(next(iter(axes))) != 1:
        raise ModelLoadError(
            f"cache inputs must have one dynamic past-length axis besides the batch; their "
            f"dims are {dict(zip(past, shapes))}")
    return CacheLayout("input_ids", "attention_mask", None if right_padded else "position_ids",
                       tuple(past), tuple(present), logits, next(iter(axes))[0], shapes,
                       inputs[past[0]].dtype, inputs["attention_mask"].dtype, right_padded)


def with_cache_written_in_place(model: onnx.ModelProto, layout: CacheLayout
                                ) -> onnx.ModelProto | None:
    """The export with its cache written in place: each ``present = Concat(past, new)`` (on
    the past axis) becomes ``TensorScatter(past, new, cache_write_index)`` — the ``past``
    input then holds the new token's slot too, written from the slot a new
    ``cache_write_index`` input (one per batch row) gives, and ``present`` is that input
    itself. Everything that read the concatenation reads it, with the same shape. Shapes of
    ``past`` read elsewhere (the past length the masks are built from) are taken one slot
    shorter, as they were. None where the cache is used otherwise (nothing is rewritten)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    rewrites = {}  # id(concat node) -> the cache input it extends
    for past, present, dims in zip(layout.past, layout.present, layout.cache_shapes):
        node = producer.get(present)
        axis = next((a.i for a in node.attribute if a.name == "axis"), None) \
            if node is not None and node.op_type == "Concat" else None
        if axis is None or len(node.input) != 2 or axis % len(dims) != layout.axis \
                or _through_copies(node.input[0], producer) != past:
            return None
        rewrites[id(node)] = past
    copies = {n for n in producer if n not in layout.past
              and _through_copies(n, producer) in layout.past}
    cache_tensors = set(layout.past) | copies
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for node, original in zip(out.graph.node, model.graph.node):
        reads = [n for n in node.input if n in cache_tensors]
        if id(original) in rewrites:
            nodes.append(onnx.helper.make_node(
                "TensorScatter", [rewrites[id(original)], node.input[1], CACHE_WRITE_INDEX],
                list(node.output), name=f"{node.output[0]}/written_in_place",
                axis=layout.axis))
        elif not reads or node.output[0] in copies:
            nodes.append(node)
        elif node.op_type == "Shape":
            nodes += _shorter_by_one_slot(node, layout.axis, len(layout.cache_shapes[0]))
        else:
            return None  # the cache is read some other way
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    inputs = {v.name: v for v in out.graph.input}
    batch = inputs[layout.tokens].type.tensor_type.shape.dim[0]
    out.graph.input.append(onnx.helper.make_tensor_value_info(
        CACHE_WRITE_INDEX, onnx.TensorProto.INT64, [batch.dim_param or batch.dim_value]))
    for output in out.graph.output:
        if output.name in layout.present:  # the cache input's shape now
            output.type.CopyFrom(inputs[layout.past[layout.present.index(output.name)]].type)
    return out


def _shorter_by_one_slot(shape: onnx.NodeProto, axis: int, rank: int) -> list[onnx.NodeProto]:
    """``shape`` (a Shape of the cache) followed by one less slot on ``axis``: the cache input
    holds the step's new slot too, and what reads its shape expects the past alone."""
    attrs = {a.name: a.i for a in shape.attribute}
    start, end = (min(max(v + rank if v < 0 else v, 0), rank)
                  for v in (attrs.get("start", 0), attrs.get("end", rank)))
    delta = np.array([int(d == axis) for d in range(rank)][start:end], np.int64)
    full = f"{shape.output[0]}/with_new_slot"
    measured = onnx.NodeProto()
    measured.CopyFrom(shape)
    measured.output[:] = [full]
    constant = onnx.helper.make_node(
        "Constant", [], [f"{full}/one_slot"],
        value=onnx.numpy_helper.from_array(delta, f"{full}/one_slot"))
    return [measured, constant,
            onnx.helper.make_node("Sub", [full, f"{full}/one_slot"], list(shape.output))]


def _through_copies(name: str, producer: dict[str, onnx.NodeProto]) -> str:
    """The tensor ``name`` copies (through Identity and one-input Concat nodes, which the
    torch exporter puts between a cache input and its concatenation)."""
    node = producer.get(name)
    while node is not None and len(node.input) == 1 and node.op_type in ("Identity", "Concat"):
        name = node.input[0]
        node = producer.get(name)
    return name


#: Ops between the LM head's product and the logits that act on each position alone (with
#: a constant per vocabulary entry at most: a bias, a scale, a cast, a soft cap).
_PER_POSITION = frozenset({"Add", "Sub", "Mul", "Div", "Cast", "Identity", "Tanh"})
#: Products an LM head is written as (their first input: the hidden states).
_LM_HEADS = frozenset({"MatMul", "MatMulNBits"})


def with_last_logits_only(model: onnx.ModelProto, layout: CacheLayout
                          ) -> onnx.ModelProto | None:
    """The export computing the logits of each sequence's last position only: the LM head
    takes the hidden states' last position (a ``Slice`` on the sequence axis), and what
    follows it acts per position. A prompt needs no other logits (prompts are left-padded,
    so the last position is every row's last token), and the head is the widest product of
    the model: a 512-token prompt of a 32k-token vocabulary wrote 64 MB of logits and spent
    33 GFLOP on them. None where the logits are not (batch, sequence, vocab) products of an
    LM head (nothing is rewritten)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    constants = {t.name: len(t.dims) for t in model.graph.initializer} | {
        node.output[0]: len(next((a.t.dims for a in node.attribute if a.name == "value"), []))
        for node in model.graph.node if node.op_type == "Constant"}
    shapes = {v.name: v.type.tensor_type.shape.dim for v in (*model.graph.input,
                                                              *model.graph.output)}
    logits, tokens = shapes[layout.logits], shapes[layout.tokens]
    if len(logits) != 3 or not tokens[1].dim_param or \
            logits[1].dim_param != tokens[1].dim_param:
        return None
    node = producer.get(layout.logits)
    while node is not None and node.op_type in _PER_POSITION:
        computed = [n for n in node.input if n not in constants]
        if len(computed) != 1 or any(constants[n] > 1 for n in node.input if n in constants):
            return None
        node = producer.get(computed[0])
    if node is None or node.op_type not in _LM_HEADS or node.input[0] in constants:
        return None
    index = next(i for i, n in enumerate(model.graph.node) if n is node)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    head = nodes[index]
    last = f"{head.input[0]}/last_position"
    bounds = {"starts": -1, "ends": np.iinfo(np.int64).max, "axes": 1}
    out.graph.initializer.extend(onnx.numpy_helper.from_array(
        np.array([v], np.int64), f"{last}/{k}") for k, v in bounds.items())
    nodes.insert(index, onnx.helper.make_node(
        "Slice", [head.input[0], *(f"{last}/{k}" for k in bounds)], [last], name=last))
    head.input[0] = last
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    dim = next(v for v in out.graph.output if v.name == layout.logits) \
        .type.tensor_type.shape.dim[1]
    dim.Clear()
    dim.dim_value = 1
    return out
