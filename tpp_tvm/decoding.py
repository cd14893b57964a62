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

import functools
import threading
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


def cache_layout(model: onnx.ModelProto) -> CacheLayout:
    """Read the cache layout off the export's names: ``input_ids``, ``attention_mask``,
    ``position_ids``, inputs with ``past`` in their name and the outputs named like them
    with ``present``; errors name what is missing."""
    from .dynamic import input_patterns

    patterns = input_patterns(model)
    if patterns is None:
        raise ModelLoadError("the model's inputs are not all tensors of known rank")
    inputs = {p.name: p for p in patterns}
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
    token_dims = set(inputs["input_ids"].dims)
    shapes = tuple(inputs[n].dims for n in past)
    axes = {tuple(i for i, d in enumerate(s) if i and isinstance(d, str) and d not in token_dims)
            for s in shapes}  # axis 0 is the batch
    if len(axes) != 1 or len(next(iter(axes))) != 1:
        raise ModelLoadError(
            f"cache inputs must have one dynamic past-length axis besides the batch; their "
            f"dims are {dict(zip(past, shapes))}")
    return CacheLayout("input_ids", "attention_mask", "position_ids", tuple(past),
                       tuple(present), logits, next(iter(axes))[0], shapes,
                       inputs[past[0]].dtype, inputs["attention_mask"].dtype)


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


def _serialized(method):
    """``method`` run holding the session's lock."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class DecoderSession:
    """Greedy or step-by-step decoding of a KV-cache export on TPP kernels.

    ``prefill(prompts)`` runs prompts (a (batch, length) array, or a list of token lists of
    different lengths) and returns each one's next-token logits; ``decode(tokens)`` appends
    one token per sequence and returns the next logits; ``generate`` loops greedily.

    A session is one batch's KV cache: calls from several Python threads serialize (each
    step sees the cache the previous one left); a session per thread generates concurrently.
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
        self._lock = threading.RLock()
        self.reset()

    # ------------------------------------------------------------------ state

    @_serialized
    def reset(self) -> None:
        """Forget the cache (a new batch of prompts follows)."""
        self._cache: list[Any] = []  # TVM tensors: the past the next call reads
        self._valid = np.zeros((0, 0), bool)  # (batch, slots): real tokens, not padding
        self._buffers: dict[tuple[int, int], list[Any]] = {}

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

    def _buffers_for(self, batch: int, slots: int) -> list[Any]:
        """The cache tensors of one bucket, allocated once and refilled every step: fresh
        arrays per step cost GPT-2's 255-slot step 15 ms of copies and page faults."""
        import tvm

        key = (batch, slots)
        if key not in self._buffers:
            self._buffers[key] = [tvm.runtime.empty(self._cache_shape(batch, slots, i),
                                                    self.layout.cache_dtype)
                                  for i in range(len(self.layout.past))]
        return self._buffers[key]

    def _fit(self, slots: int) -> None:
        """Copy the cache into the ``slots``-slot bucket's tensors: left-padded with zeros,
        or its leading slots dropped (only padding is dropped)."""
        have = self._valid.shape[1]
        batch = self._valid.shape[0]
        dest = self._buffers_for(batch, slots)
        if self._cache is dest:
            return
        ax = self.layout.axis
        keep = min(have, slots)
        assert not self._valid[:, :have - keep].any(), "only padding is dropped"
        src_index = (slice(None),) * ax + (slice(have - keep, None),)
        dst_index = (slice(None),) * ax + (slice(slots - keep, None),)
        pad_index = (slice(None),) * ax + (slice(0, slots - keep),)
        for src, dst in zip(self._cache, dest):
            out = np.from_dlpack(dst)
            out[pad_index] = 0
            out[dst_index] = np.from_dlpack(src)[src_index]
        self._cache = dest
        pad = np.zeros((batch, slots - keep), bool)
        self._valid = np.concatenate([pad, self._valid[:, have - keep:]], 1)

    def _build(self, batch: int, seq: int, slots: int) -> Any:
        """The static build for ``seq`` new tokens after a ``slots``-slot cache (compiled on
        first use); shapes are given as zero-byte broadcast views."""
        lay = self.layout

        def shaped(*shape: int) -> np.ndarray:
            return np.broadcast_to(np.uint8(0), shape)

        arrays = {lay.tokens: shaped(batch, seq), lay.positions: shaped(batch, seq),
                  lay.mask: shaped(batch, slots + seq)}
        arrays |= {n: shaped(*self._cache_shape(batch, slots, i))
                   for i, n in enumerate(lay.past)}
        return self.model.specialization(self.model.size_of(arrays))

    def _run(self, tokens: np.ndarray, new_valid: np.ndarray) -> np.ndarray:
        """One call: ``tokens`` (batch, new) after the cache; returns the last logits."""
        import tvm

        lay = self.layout
        valid = np.concatenate([self._valid, new_valid], 1)
        positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)[:, -tokens.shape[1]:]
        small = {lay.tokens: tokens.astype(np.int64), lay.positions: positions.astype(np.int64),
                 lay.mask: valid.astype(lay.mask_dtype)}
        compiled = self._build(*tokens.shape, self._valid.shape[1])
        feed = {name: tvm.runtime.tensor(value) for name, value in small.items()}
        feed |= dict(zip(lay.past, self._cache))
        out = dict(zip(self._outputs, compiled.run_tensors([feed[i.name]
                                                            for i in compiled.inputs])))
        self._cache = [out[name] for name in lay.present]
        self._valid = valid
        return np.from_dlpack(out[lay.logits])[:, -1].copy()

    # ------------------------------------------------------------------ steps

    @_serialized
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
        self._cache = self._buffers_for(len(rows), 1)
        for c in self._cache:
            np.from_dlpack(c)[...] = 0
        return self._run(tokens, new_valid)

    @_serialized
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

    @_serialized
    def prepare(self, prompt_length: int, max_length: int, batch: int = 1) -> None:
        """Compile ahead the prompt bucket and the cache buckets a generation up to
        ``max_length`` tokens in total needs (otherwise each compiles on first use)."""
        self._build(batch, bucket_for(prompt_length, self.prompt_buckets, "a prompt"), 1)
        for slots in sorted({bucket_for(used, self.decode_buckets, "a KV cache")
                             for used in range(prompt_length + 1, max_length + 1)}):
            self._build(batch, 1, slots)

    @_serialized
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
