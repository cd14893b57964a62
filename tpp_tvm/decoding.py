"""Token-by-token decoding of a causal LM exported with its KV cache.

A decoder exported with ``past_key_values`` inputs and ``present`` outputs (see
:mod:`tpp_tvm.cache_export`) grows its past by one token per step. TPP kernels are built per
static size (:mod:`tpp_tvm.dynamic`), so a build per past length would mean a compile per
token. :class:`DecoderSession` instead keeps the cache in **capacity buckets**: the past is
left-padded to a bucket's length and the padding masked out through the model's own
``attention_mask`` — exactly how batched generation pads prompts, so the outputs are the
unpadded model's (masked keys get zero softmax weight). Each step appends one token and drops
one leading pad slot; the cache moves to the next bucket only when it is full. Prompts are
left-padded to prompt buckets the same way. So generating 128 tokens after a 128-token prompt
compiles two sizes (the prompt and one cache bucket), not 129.

Requires ``attention_mask`` and ``position_ids`` inputs (positions must not be derived from
the padded past length). Decode buckets are ``2^k - 1`` slots so the keys of a step (past +
the new token) are a power of two: the attention kernels' key blocks need no padding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .errors import ModelLoadError, UnsupportedShapeError

#: Slots of the KV-cache buckets (the past length one decode build serves).
DECODE_BUCKETS = tuple(2**k - 1 for k in range(5, 15))
#: Prompt lengths one prefill build serves (shorter prompts are left-padded).
PROMPT_BUCKETS = tuple(2**k for k in range(4, 15))


@dataclass(frozen=True)
class CacheLayout:
    """Which inputs and outputs of the export carry what; ``axis``: the past-length axis."""

    tokens: str
    mask: str
    positions: str
    past: tuple[str, ...]
    present: tuple[str, ...]
    logits: str
    axis: int
    cache_shapes: tuple[tuple[int | str, ...], ...]
    cache_dtype: str
    mask_dtype: str


def _dims(value: onnx.ValueInfoProto) -> tuple[int | str, ...]:
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                 for d in value.type.tensor_type.shape.dim)


def _dtype(value: onnx.ValueInfoProto) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name


def cache_layout(model: onnx.ModelProto) -> CacheLayout:
    """Read the cache layout off the export's names: ``input_ids``, ``attention_mask``,
    ``position_ids``, inputs with ``past`` in their name and the outputs named like them
    with ``present``; errors name what is missing."""
    init = {t.name for t in model.graph.initializer}
    inputs = {v.name: v for v in model.graph.input if v.name not in init}
    outputs = [v.name for v in model.graph.output]
    need = {"tokens": "input_ids", "mask": "attention_mask", "positions": "position_ids"}
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
    token_dims = set(_dims(inputs["input_ids"]))
    shapes = tuple(_dims(inputs[n]) for n in past)
    axes = {tuple(i for i, d in enumerate(s) if isinstance(d, str) and d not in token_dims)
            for s in shapes}
    if len(axes) != 1 or len(next(iter(axes))) != 1:
        raise ModelLoadError(
            f"cache inputs must have one dynamic past-length axis besides the batch; their "
            f"dims are {dict(zip(past, shapes))}")
    return CacheLayout("input_ids", "attention_mask", "position_ids", tuple(past),
                       tuple(present), logits, next(iter(axes))[0], shapes,
                       _dtype(inputs[past[0]]), _dtype(inputs["attention_mask"]))


def bucket_for(length: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket holding ``length``; an error beyond the largest."""
    for b in sorted(buckets):
        if b >= length:
            return b
    raise UnsupportedShapeError(f"{what} of {length} exceeds the largest bucket "
                                f"{max(buckets)}")


@dataclass
class Generation:
    """Generated tokens (batch, new) and where the time went (compiles excluded)."""

    tokens: np.ndarray
    prefill_seconds: float
    decode_seconds: float
    step_seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first per second, per sequence."""
        steps = len(self.step_seconds)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


class DecoderSession:
    """Greedy or step-by-step decoding of a KV-cache export on TPP kernels.

    ``prefill(prompts)`` runs prompts (a (batch, length) array, or a list of token lists of
    different lengths) and returns each one's next-token logits; ``decode(tokens)`` appends
    one token per sequence and returns the next logits; ``generate`` loops greedily.
    """

    def __init__(self, model: str | Path | onnx.ModelProto, target: Any = None,
                 precision: str = "float32", tune_logs: Any = None,
                 decode_buckets: Sequence[int] = DECODE_BUCKETS,
                 prompt_buckets: Sequence[int] = PROMPT_BUCKETS,
                 max_cached: int = 8) -> None:
        from .compiled import compile_onnx
        from .dynamic import DynamicModel
        from .frontend import load_model

        proto = load_model(model)
        self.layout = cache_layout(proto)
        self.decode_buckets = tuple(sorted(decode_buckets))
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self.model = compile_onnx(proto, target, precision=precision, tune_logs=tune_logs,
                                  max_cached=max_cached)
        if not isinstance(self.model, DynamicModel):
            raise ModelLoadError("the export's past length is static: a KV-cache decoder "
                                 "needs it dynamic (dynamic_axes on the past inputs)")
        self._outputs = [v.name for v in proto.graph.output]
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Forget the cache (a new batch of prompts follows)."""
        self._cache: list[np.ndarray] = []
        self._valid = np.zeros((0, 0), bool)  # (batch, slots): real tokens, not padding

    @property
    def lengths(self) -> np.ndarray:
        """Tokens in each sequence's cache."""
        return self._valid.sum(axis=1)

    def _cache_shape(self, batch: int, slots: int, i: int) -> tuple[int, ...]:
        dims = list(self.layout.cache_shapes[i])
        dims[self.layout.axis] = slots
        shape = [batch if isinstance(d, str) else d for d in dims]
        shape[0] = batch
        return tuple(shape)

    def _fit(self, slots: int) -> None:
        """Left-pad or trim the cache to ``slots``; only leading padding is trimmed."""
        have = self._valid.shape[1]
        if slots == have:
            return
        ax = self.layout.axis
        if slots > have:
            self._cache = [np.concatenate([np.zeros(self._cache_shape(c.shape[0], slots - have,
                                                                      i), c.dtype), c], ax)
                           for i, c in enumerate(self._cache)]
            pad = np.zeros((self._valid.shape[0], slots - have), bool)
            self._valid = np.concatenate([pad, self._valid], 1)
            return
        drop = have - slots
        assert not self._valid[:, :drop].any(), "only padding is dropped"
        index = (slice(None),) * ax + (slice(drop, None),)
        self._cache = [np.ascontiguousarray(c[index]) for c in self._cache]
        self._valid = self._valid[:, drop:]

    def _run(self, tokens: np.ndarray, new_valid: np.ndarray) -> np.ndarray:
        """One call: ``tokens`` (batch, new) after the cache; returns the last logits."""
        lay = self.layout
        valid = np.concatenate([self._valid, new_valid], 1)
        positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)[:, -tokens.shape[1]:]
        feed = {lay.tokens: tokens.astype(np.int64), lay.positions: positions.astype(np.int64),
                lay.mask: valid.astype(lay.mask_dtype)}
        feed |= dict(zip(lay.past, self._cache))
        out = dict(zip(self._outputs, self.model(**feed)))
        self._cache = [out[name] for name in lay.present]
        self._valid = valid
        return out[lay.logits][:, -1]

    # ------------------------------------------------------------------ steps

    def prefill(self, prompts: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
        """Start sequences from ``prompts``; returns (batch, vocab) next-token logits."""
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        if not rows or min(len(r) for r in rows) == 0:
            raise UnsupportedShapeError("prefill needs at least one token per prompt")
        width = bucket_for(max(len(r) for r in rows), self.prompt_buckets, "a prompt")
        tokens = np.zeros((len(rows), width), np.int64)
        new_valid = np.zeros((len(rows), width), bool)
        for b, r in enumerate(rows):
            tokens[b, width - len(r):] = r
            new_valid[b, width - len(r):] = True
        # One masked past slot: a zero-length past would be a zero-size tensor.
        self._valid = np.zeros((len(rows), 1), bool)
        self._cache = [np.zeros(self._cache_shape(len(rows), 1, i), self.layout.cache_dtype)
                       for i in range(len(self.layout.past))]
        return self._run(tokens, new_valid)

    def decode(self, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        """Append one token per sequence; returns (batch, vocab) next-token logits."""
        if not self._cache:
            raise UnsupportedShapeError("decode() before prefill(): no sequences to extend")
        step = np.asarray(tokens, np.int64).reshape(-1, 1)
        if step.shape[0] != self._valid.shape[0]:
            raise UnsupportedShapeError(f"decode() got {step.shape[0]} tokens for a batch of "
                                        f"{self._valid.shape[0]} sequences")
        lead = int(np.argmax(self._valid.any(axis=0))) if self._valid.any() else 0
        used = self._valid.shape[1] - lead  # slots from the first real token on
        self._fit(bucket_for(used + 1, self.decode_buckets, "a KV cache"))
        logits = self._run(step, np.ones((step.shape[0], 1), bool))
        self._fit(self._valid.shape[1] - 1)  # the step's extra slot: drop one leading pad
        return logits

    def prepare(self, prompt_length: int, max_length: int, batch: int = 1) -> None:
        """Compile ahead the prompt bucket and the cache buckets a generation up to
        ``max_length`` tokens in total needs (otherwise each compiles on first use)."""
        lay = self.layout
        width = bucket_for(prompt_length, self.prompt_buckets, "a prompt")
        used = prompt_length + 1
        sizes = [(width, 1)]
        slots = set()
        while used <= max_length:
            slots.add(bucket_for(used, self.decode_buckets, "a KV cache"))
            used += 1
        sizes += [(1, s) for s in sorted(slots)]
        for seq, past in sizes:
            arrays = {lay.tokens: np.empty((batch, seq)), lay.positions: np.empty((batch, seq)),
                      lay.mask: np.empty((batch, past + seq))}
            arrays |= {n: np.empty(self._cache_shape(batch, past, i))
                       for i, n in enumerate(lay.past)}
            self.model.specialization(self.model.size_of(arrays))

    def generate(self, prompts: np.ndarray | Sequence[Sequence[int]], max_new_tokens: int
                 ) -> Generation:
        """Greedy decoding: ``max_new_tokens`` per prompt (the first from the prefill)."""
        t0 = time.perf_counter()
        logits = self.prefill(prompts)
        prefill = time.perf_counter() - t0
        out = [logits.argmax(-1)]
        steps = []
        for _ in range(max_new_tokens - 1):
            t = time.perf_counter()
            logits = self.decode(out[-1])
            steps.append(time.perf_counter() - t)
            out.append(logits.argmax(-1))
        return Generation(np.stack(out, 1), prefill, float(sum(steps)), steps)

    def report(self) -> str:
        """The cache layout, the buckets and the dynamic model's report."""
        lay = self.layout
        lines = [f"KV-cache decoder: {len(lay.past)} cache tensors (past axis {lay.axis}), "
                 f"decode buckets {self.decode_buckets[:6]}..., prompt buckets "
                 f"{self.prompt_buckets[:6]}...", self.model.report()]
        return "\n".join(lines)
