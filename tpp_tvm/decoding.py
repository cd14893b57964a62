"""Token-by-token decoding of a causal LM exported with its KV cache.

A decoder exported with ``past_key_values`` inputs and ``present`` outputs (see
:mod:`tpp_tvm.cache_export`) grows its past by one token per step. TPP kernels are built per
static size (:mod:`tpp_tvm.dynamic`), so a build per past length would mean a compile per
token. :class:`DecoderSession` instead keeps the cache in **capacity buckets**: a bucket's
tensors hold the tokens so far in their first slots and unused slots after them, masked out
through the model's own ``attention_mask`` — exactly how batched generation pads prompts, so
the outputs are the unpadded model's (masked keys get zero softmax weight; attention does not
depend on the order of the keys, whose positions are already rotated in). Each step writes
one token into the next free slot; the cache moves to the next bucket only when it is full.
Prompts are left-padded to prompt buckets the same way. So generating 128 tokens after a
128-token prompt compiles two sizes (the prompt and one cache bucket), not 129.

**The cache is written where it lies.** A step's build is the export with each
``present = Concat(past, new)`` output rewritten into ONNX's ``TensorScatter(past, new,
cache_write_index)`` (:func:`with_cache_written_in_place`), which the importer compiles into
a write into the input tensor itself: a step writes one token's keys and values instead of
copying the whole cache twice (the concatenation out, then back into the bucket). The
concatenation the attention reads stays; the slot being written is masked in that step, so
the attention gives the same result whether it sees the slot before or after the write. An
export whose cache outputs are not such concatenations decodes with its own outputs, the new
slot copied back from them.

**A prompt computes one position's logits.** The builds take the LM head's input at the
last position only (:func:`with_last_logits_only`): the next token needs no other logits,
and the head is the model's widest product.

Requires ``attention_mask`` and ``position_ids`` inputs (positions must not be derived from
the padded past length), or a model whose GroupQueryAttention places each sequence's rows
itself (ONNX Runtime GenAI's model builder: no ``position_ids``; the session then
right-pads, each sequence filling the cache's first slots to its own length). Decode
buckets are ``2^k - 1`` slots so the keys of a step (past + the new token) are a power of
two: the attention kernels' key blocks need no padding.
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
import onnx.numpy_helper

from .cache_layout import (  # noqa: F401 - the layout and rewrites are decoding's API too
    CACHE_WRITE_INDEX,
    CacheLayout,
    cache_layout,
    with_cache_written_in_place,
    with_last_logits_only,
)
from .errors import ModelLoadError, UnsupportedDTypeError, UnsupportedShapeError
from .int8_cache import quantized_rows, scale_input, with_int8_cache

#: Slots of the KV-cache buckets (the past length one decode build serves).
DECODE_BUCKETS = tuple(2**k - 1 for k in range(5, 15))
#: Prompt lengths one prefill build serves (shorter prompts are left-padded).
PROMPT_BUCKETS = tuple(2**k for k in range(4, 15))


def _loaded(path: str | Path, layout: CacheLayout, last_logits_only: bool
            ) -> onnx.ModelProto:
    """The export at ``path``, computing the last position's logits only if asked."""
    from .frontend import load_model

    model = load_model(path)
    return (with_last_logits_only(model, layout) or model) if last_logits_only else model


def _rewritten(source: Any, layout: CacheLayout, int8: bool = False) -> onnx.ModelProto:
    """The model ``source()`` gives, its cache written in place (as int8 rows if asked)."""
    model = with_cache_written_in_place(source(), layout)
    assert model is not None, "the rewrite applied to this model before"
    return with_int8_cache(model, layout.past) if int8 else model


def _cache_dims(layout: CacheLayout, source: Any, given: dict[str, int]) -> dict[str, int]:
    """Sizes of the cache's symbolic dims other than the batch and the past: ``given``, else
    the head size in the ``genai_config.json`` ONNX Runtime GenAI's model builder writes
    beside its model (its ``kv_cache_dim``); an error names what is missing."""
    free = {d for dims in layout.cache_shapes for i, d in enumerate(dims)
            if i and i != layout.axis and isinstance(d, str)}
    missing = sorted(free - set(given))
    if missing and isinstance(source, (str, Path)):
        config = Path(source).with_name("genai_config.json")
        if config.exists() and len(missing) == 1:
            import json

            head = json.loads(config.read_text()).get("model", {}).get("decoder", {}) \
                .get("head_size")
            if isinstance(head, int):
                given = {**given, missing[0]: head}
                missing = []
    if missing:
        raise ModelLoadError(
            f"the cache inputs' dims {missing} are symbolic: give their sizes, "
            f"DecoderSession(..., cache_dims={{{missing[0]!r}: <size>}})")
    return {d: int(given[d]) for d in free}


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


class _BoundStep:
    """One cache bucket's step build with its inputs bound once: the bucket's cache tensors
    and staged tensors for the small inputs (tokens, mask, positions, write slot), which a
    step overwrites in place. Looking the build up, converting the small inputs and listing
    the outputs cost 1.1-1.3 ms of Python a step on a 2-vCPU Zen 4 (0.45B int4 Llama, an
    11 ms step), so a step bound once costs the VM call and a few writes."""

    def __init__(self, compiled: Any, cache: list[Any], cache_inputs: list[str],
                 inputs: dict[str, np.ndarray], logits: int) -> None:
        import tvm

        self.compiled, self.cache = compiled, cache
        staged = {name: tvm.runtime.tensor(np.ascontiguousarray(value))
                  for name, value in inputs.items()}
        #: Writable numpy views of the staged small inputs.
        self.inputs = {name: np.from_dlpack(t) for name, t in staged.items()}
        bound = staged | dict(zip(cache_inputs, cache))
        self._args = [bound[i.name] for i in compiled.inputs]
        self._logits = logits

    def __call__(self) -> np.ndarray:
        """The step's (batch, new, vocab) logits, a view of the build's output."""
        return np.from_dlpack(self.compiled.run_tensors(self._args, output=self._logits))


class DecoderSession:
    """Greedy or step-by-step decoding of a KV-cache export on TPP kernels.

    ``prefill(prompts)`` runs prompts (a (batch, length) array, or a list of token lists of
    different lengths) and returns each one's next-token logits; ``decode(tokens)`` appends
    one token per sequence and returns the next logits; ``generate`` loops greedily.

    ``model`` runs the prompts; ``step_model`` the steps: the export with its cache written
    in place, or the export itself where that rewrite does not apply or ``write_in_place``
    is False (``writes_in_place`` says which).

    ``cache_dtype="int8"`` holds the cache as int8 rows with a scale each
    (:mod:`tpp_tvm.int8_cache`: 0.27x the bytes at head size 64); prompts still attend in
    fp32, their rows quantized as they enter the cache. It needs the cache written in place.

    ``cache_dims`` gives sizes to symbolic cache dims other than the batch and the past
    (the model builder's ``kv_cache_dim``, the head size: read from the ``genai_config.json``
    beside its file when not given).

    A session is one batch's KV cache: calls from several Python threads serialize (each
    step sees the cache the previous one left); a session per thread generates concurrently.
    """

    def __init__(self, model: str | Path | onnx.ModelProto, target: Any = None,
                 precision: str = "float32", tune_logs: Any = None,
                 decode_buckets: Sequence[int] = DECODE_BUCKETS,
                 prompt_buckets: Sequence[int] = PROMPT_BUCKETS,
                 max_cached: int = 8, write_in_place: bool = True,
                 cache_dtype: str = "float32", cache_dims: dict[str, int] | None = None
                 ) -> None:
        from .compiled import compile_onnx
        from .dynamic import DynamicModel
        from .frontend import load_model
        from .relay_passes.shared_constants import SharedConstants

        proto = load_model(model)
        self.layout = cache_layout(proto)
        self._cache_dims = _cache_dims(self.layout, model, cache_dims or {})
        # Right-padded prompts end at different positions: their logits are picked per row.
        sliced = None if self.layout.right_padded else with_last_logits_only(proto, self.layout)
        #: Whether the builds compute the last position's logits only (a prompt's others
        #: are never read; see :func:`with_last_logits_only`).
        self.last_logits_only = sliced is not None
        proto = sliced or proto
        self.decode_buckets = tuple(sorted(decode_buckets))
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        in_place = with_cache_written_in_place(proto, self.layout) if write_in_place else None
        self.writes_in_place = in_place is not None
        if cache_dtype not in ("float32", "int8"):
            raise UnsupportedDTypeError(f"cache_dtype {cache_dtype!r}: 'float32' or 'int8'")
        if cache_dtype == "int8" and in_place is None:
            raise ModelLoadError(
                "an int8 KV cache needs the cache written in place: the export's cache "
                "outputs are not Concat(past, new) of its inputs" if write_in_place else
                "an int8 KV cache needs write_in_place=True")
        #: How the steps hold the cache: "float32", or "int8" rows with a scale each.
        self.cache_dtype = cache_dtype
        if cache_dtype == "int8":
            in_place = with_int8_cache(in_place, self.layout.past)
        #: The constants every build of the session shares: the prompt and step builds
        #: hold each weight once (packed alike for any row count, they are alike).
        self.constants = SharedConstants()
        options = {"target": target, "precision": precision, "tune_logs": tune_logs,
                   "max_cached": max_cached, "constants": self.constants}
        # Neither model is held for the sizes compiled later: read again from the file (or
        # rewritten again from the one proto), so the weights are not in memory twice.
        prompts = functools.partial(_loaded, model, self.layout, self.last_logits_only) \
            if isinstance(model, (str, Path)) else None  # else the proto itself, held
        self.model = compile_onnx(proto, reload=prompts, **options)
        if not isinstance(self.model, DynamicModel):
            raise ModelLoadError("the export's past length is static: a KV-cache decoder "
                                 "needs it dynamic (dynamic_axes on the past inputs)")
        steps = functools.partial(_rewritten, prompts or (lambda: proto), self.layout,
                                  cache_dtype == "int8")
        self.step_model = compile_onnx(in_place, reload=steps, **options) \
            if in_place is not None else self.model
        self._outputs = [v.name for v in proto.graph.output]
        self._lock = threading.RLock()
        self.reset()

    # ------------------------------------------------------------------ state

    @_serialized
    def reset(self) -> None:
        """Forget the cache (a new batch of prompts follows)."""
        self._cache: list[Any] = []  # TVM tensors: the bucket's cache
        self._valid = np.zeros((0, 0), bool)  # (batch, slots): real tokens, not padding
        self._used = 0  # slots written; the next step writes slot _used
        self._buffers: dict[tuple[int, int, str], list[Any]] = {}
        self._bound: _BoundStep | None = None  # the current bucket's step

    @property
    def lengths(self) -> np.ndarray:
        """Tokens in each sequence's cache."""
        return self._valid.sum(axis=1)

    def _cache_shape(self, batch: int, slots: int, i: int) -> tuple[int, ...]:
        dims = list(self.layout.cache_shapes[i])
        dims[0], dims[self.layout.axis] = batch, slots
        return tuple(self._cache_dims[d] if isinstance(d, str) else d for d in dims)

    @property
    def _cache_inputs(self) -> list[str]:
        """The step model's cache inputs, in the order of the session's cache tensors: the
        caches, then (int8) their scales."""
        past = list(self.layout.past)
        return past + [scale_input(n) for n in past] if self.cache_dtype == "int8" else past

    def _buffers_for(self, batch: int, slots: int, dtype: str | None = None) -> list[Any]:
        """The cache tensors of one bucket (:attr:`_cache_inputs`; ``dtype``: fp32 caches
        only, as prompts read them), allocated (zeroed: unused slots are masked, and must
        hold no NaN) once and reused."""
        import tvm

        dtype = dtype or self.cache_dtype
        key = (batch, slots, dtype)
        if key not in self._buffers:
            shapes = [self._cache_shape(batch, slots, i) for i in range(len(self.layout.past))]
            cache = self.layout.cache_dtype if dtype == "float32" else dtype
            self._buffers[key] = [tvm.runtime.tensor(np.zeros(s, cache)) for s in shapes]
            if dtype == "int8":
                self._buffers[key] += [tvm.runtime.tensor(np.zeros((*s[:-1], 1), np.float32))
                                       for s in shapes]
        return self._buffers[key]

    def _capacity(self, tokens: int) -> int:
        """Slots of the cache tensors a step after ``tokens`` cached ones runs with: its
        decode bucket (the past the step's attention reads besides the new token), plus
        the new token's slot where the cache is written in place."""
        if self.writes_in_place:
            return bucket_for(tokens, self.decode_buckets, "a KV cache") + 1
        return bucket_for(tokens + 1, self.decode_buckets, "a KV cache")

    def _slots(self, start: int, stop: int) -> tuple[slice, ...]:
        return (slice(None),) * self.layout.axis + (slice(start, stop),)

    def _move(self, sources: list[Any], first: int, valid: np.ndarray, slots: int) -> None:
        """Make the ``slots``-slot bucket the cache: its first slots get ``sources``' slots
        from ``first`` on (``valid`` says which hold tokens), the rest are masked. Sources
        in fp32 (a prompt's) go into an int8 cache quantized."""
        used = valid.shape[1]
        dest = self._buffers_for(valid.shape[0], slots)
        src_slots, dst_slots = self._slots(first, first + used), self._slots(0, used)
        if len(sources) < len(dest):  # a prompt's fp32 rows into the int8 cache
            n = len(sources)
            for src, dst, scale in zip(sources, dest[:n], dest[n:]):
                q, s = quantized_rows(np.from_dlpack(src)[src_slots])
                np.from_dlpack(dst)[dst_slots], np.from_dlpack(scale)[dst_slots] = q, s
        else:
            for src, dst in zip(sources, dest):
                np.from_dlpack(dst)[dst_slots] = np.from_dlpack(src)[src_slots]
        self._cache = dest
        self._valid = np.concatenate([valid, np.zeros((valid.shape[0], slots - used), bool)], 1)
        self._used = used

    def _build(self, batch: int, seq: int, slots: int, step: bool = False) -> Any:
        """The static build for ``seq`` new tokens after a ``slots``-slot cache (compiled on
        first use; of the step model for a ``step``); shapes are given as zero-byte views."""
        lay = self.layout

        def shaped(*shape: int) -> np.ndarray:
            return np.broadcast_to(np.uint8(0), shape)

        in_place = step and self.writes_in_place  # the new slot is one of the cache's
        arrays = {lay.tokens: shaped(batch, seq),
                  lay.mask: shaped(batch, slots if in_place else slots + seq)}
        if lay.positions:
            arrays[lay.positions] = shaped(batch, seq)
        arrays |= {n: shaped(*self._cache_shape(batch, slots, i))
                   for i, n in enumerate(lay.past)}
        model = self.step_model if step else self.model
        if in_place:
            arrays[CACHE_WRITE_INDEX] = shaped(batch)
        if step and self.cache_dtype == "int8":
            arrays |= {scale_input(n): shaped(*self._cache_shape(batch, slots, i)[:-1], 1)
                       for i, n in enumerate(lay.past)}
        return model.specialization(model.size_of(arrays))

    def _run(self, tokens: np.ndarray, mask: np.ndarray, past: list[Any],
             extra: dict[str, np.ndarray] | None = None, last: np.ndarray | None = None
             ) -> tuple[np.ndarray, list[Any]]:
        """One call: ``tokens`` (batch, new) after ``past`` under ``mask`` (past slots then
        the new tokens); returns the logits at each row's ``last`` position (default: the
        last) and the cache outputs."""
        import tvm

        lay = self.layout
        small = {lay.tokens: tokens.astype(np.int64), lay.mask: mask.astype(lay.mask_dtype)}
        if lay.positions:
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -tokens.shape[1]:]
            small[lay.positions] = positions.astype(np.int64)
        small |= extra or {}
        compiled = self._build(*tokens.shape, past[0].shape[lay.axis], step=extra is not None)
        feed = {name: tvm.runtime.tensor(value) for name, value in small.items()}
        feed |= dict(zip(self._cache_inputs if extra is not None else lay.past, past))
        out = dict(zip(self._outputs, compiled.run_tensors([feed[i.name]
                                                            for i in compiled.inputs])))
        logits = np.from_dlpack(out[lay.logits])
        rows = logits[:, -1] if last is None else logits[np.arange(len(last)), last]
        return rows.copy(), [out[n] for n in lay.present]

    # ------------------------------------------------------------------ steps

    @_serialized
    def prefill(self, prompts: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
        """Start sequences from ``prompts``; returns (batch, vocab) next-token logits."""
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        if not rows or min(len(r) for r in rows) == 0:
            raise UnsupportedShapeError("prefill needs at least one token per prompt")
        width = bucket_for(max(len(r) for r in rows), self.prompt_buckets, "a prompt")
        if self.layout.right_padded:
            return self._prefill_right_padded(rows, width)
        tokens = np.zeros((len(rows), width), np.int64)
        valid = np.zeros((len(rows), width), bool)
        for b, r in enumerate(rows):
            tokens[b, width - len(r):] = r
            valid[b, width - len(r):] = True
        # One masked past slot: a zero-length past would be a zero-size tensor.
        empty = self._buffers_for(len(rows), 1, "float32")
        mask = np.concatenate([np.zeros((len(rows), 1), bool), valid], 1)
        logits, present = self._run(tokens, mask, empty)
        first = width - max(len(r) for r in rows)  # pad columns no prompt reaches
        used = width - first
        self._move(present, 1 + first, valid[:, first:], self._capacity(used))
        return logits

    def _prefill_right_padded(self, rows: list[np.ndarray], width: int) -> np.ndarray:
        """Prompts for a model that places rows itself (GroupQueryAttention): each row's
        tokens first, padding after. Every row runs as ``width`` tokens from position 0
        (a past of one masked slot, the mask counting ``width`` tokens: GroupQueryAttention's
        past length 0): the causal mask keeps a prompt's tokens from seeing the padding
        after them, so each row's logits at its last token are the unpadded prompt's, and
        the padding's cache rows lie beyond the row's length, where its steps overwrite
        them."""
        batch = len(rows)
        tokens = np.zeros((batch, width), np.int64)
        lengths = np.array([len(r) for r in rows])
        for b, r in enumerate(rows):
            tokens[b, :len(r)] = r
        mask = np.concatenate([np.zeros((batch, 1), bool), np.ones((batch, width), bool)], 1)
        logits, present = self._run(tokens, mask, self._buffers_for(batch, 1, "float32"),
                                    last=lengths - 1)
        used = int(lengths.max())
        valid = np.arange(used)[None] < lengths[:, None]
        self._move(present, 0, valid, self._capacity(used))
        return logits

    def _decode_right_padded(self, step: np.ndarray) -> np.ndarray:
        """One step for a model that places rows itself: the mask counts each row's tokens
        and the new one (GroupQueryAttention's ``seqlens_k``), the model writes the new
        row at the row's length in its outputs, copied back into the cache there."""
        batch, slots = self._valid.shape
        lengths = self.lengths
        if lengths.max() == slots:  # a row is full: the next bucket
            self._move(self._cache, 0, self._valid, self._capacity(slots))
            slots = self._valid.shape[1]
        mask = np.arange(slots + 1)[None] <= lengths[:, None]
        logits, present = self._run(step, mask, self._cache, {})
        axis = self.layout.axis
        for src, dst in zip(present, self._cache):
            src, dst = np.from_dlpack(src), np.from_dlpack(dst)
            for b, n in enumerate(lengths):
                at = (b,) + (slice(None),) * (axis - 1) + (n,)
                dst[at] = src[at]
        self._valid[np.arange(batch), lengths] = True
        return logits

    @_serialized
    def decode(self, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        """Append one token per sequence; returns (batch, vocab) next-token logits."""
        if not self._cache:
            raise UnsupportedShapeError("decode() before prefill(): no sequences to extend")
        step = np.asarray(tokens, np.int64).reshape(-1, 1)
        batch, slots = self._valid.shape
        if step.shape[0] != batch:
            raise UnsupportedShapeError(f"decode() got {step.shape[0]} tokens for a batch of "
                                        f"{batch} sequences")
        if self.layout.right_padded:
            return self._decode_right_padded(step)
        if self._used == slots:  # full: the next bucket
            self._move(self._cache, 0, self._valid, self._capacity(slots))
            slots = self._valid.shape[1]
        write = self._used
        if self.writes_in_place:  # the new token's slot is the one written
            logits = self._step_in_place(step, write)
        else:
            mask = np.concatenate([self._valid, np.ones((batch, 1), bool)], 1)
            logits, present = self._run(step, mask, self._cache, {})
            for src, dst in zip(present, self._cache):  # the new slot, from the outputs
                np.from_dlpack(dst)[self._slots(write, write + 1)] = \
                    np.from_dlpack(src)[self._slots(slots, slots + 1)]
        self._valid[:, write] = True
        self._used += 1
        return logits

    def _step_in_place(self, step: np.ndarray, write: int) -> np.ndarray:
        """One step that writes its token's keys and values at slot ``write`` of the
        cache, on the bucket's bound build (:class:`_BoundStep`, bound at the bucket's
        first step); returns (batch, vocab) logits."""
        lay = self.layout
        batch, slots = self._valid.shape
        bound = self._bound
        if bound is None or bound.cache is not self._cache:
            inputs = {lay.tokens: step, lay.mask: np.zeros((batch, slots), lay.mask_dtype),
                      CACHE_WRITE_INDEX: np.zeros(batch, np.int64)}
            if lay.positions:
                inputs[lay.positions] = np.zeros((batch, 1), np.int64)
            bound = self._bound = _BoundStep(
                self._build(batch, 1, slots, step=True), self._cache, self._cache_inputs,
                inputs, self._outputs.index(lay.logits))
        mask = bound.inputs[lay.mask]
        mask[:] = self._valid
        mask[:, write] = True
        bound.inputs[lay.tokens][:] = step
        bound.inputs[CACHE_WRITE_INDEX][:] = write
        if lay.positions:  # each row's position: its tokens before this one
            bound.inputs[lay.positions][:, 0] = self._valid.sum(axis=1)
        return bound()[:, -1].copy()

    @_serialized
    def prepare(self, prompt_length: int, max_length: int, batch: int = 1) -> None:
        """Compile ahead the prompt bucket and the cache buckets a generation up to
        ``max_length`` tokens in total needs (otherwise each compiles on first use)."""
        self._build(batch, bucket_for(prompt_length, self.prompt_buckets, "a prompt"), 1)
        for slots in sorted({self._capacity(used)
                             for used in range(prompt_length, max_length)}):
            self._build(batch, 1, slots, step=True)

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
        """The cache layout, the buckets and the prompt and step models' reports."""
        lay = self.layout
        written = "written in place" if self.writes_in_place else \
            "copied from the export's concatenated outputs"
        logits = ", last position's logits only" if self.last_logits_only else ""
        logits += ", sequences right-padded (the model places rows)" \
            if lay.right_padded else ""
        lines = [f"KV-cache decoder: {len(lay.past)} cache tensors (past axis {lay.axis}, "
                 f"{written}{logits}), decode buckets {self.decode_buckets[:6]}..., prompt buckets "
                 f"{self.prompt_buckets[:6]}...", "Prompts:", self.model.report()]
        if self.step_model is not self.model:
            lines += ["Steps:", self.step_model.report()]
        return "\n".join(lines)
