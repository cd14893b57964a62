"""KV-cache decoding (tpp_tvm.decoding): a transformers causal LM exported with its cache
(``tpp_tvm.cache_export``) decodes token by token on TPP kernels with the cache in capacity
buckets, giving the logits of the unpadded model (ONNX Runtime on the export, the cache
growing by one each step) and torch's greedy tokens, for ragged batches too.

A tiny Llama-style config (grouped-query attention, rotary positions, SwiGLU) with random
weights from a fixed seed, exported once per module.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tpp_harness as h

from tpp_tvm.decoding import DecoderSession, bucket_for, cache_layout
from tpp_tvm.errors import ModelLoadError, UnsupportedShapeError

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tpp_tvm.cache_export import export_causal_lm_with_cache

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).eval()
    path = export_causal_lm_with_cache(model, tmp_path_factory.mktemp("llm") / "llama.onnx")
    return model, str(path)


@pytest.fixture(scope="module")
def session(llama) -> DecoderSession:
    # Small buckets: the 12 steps below cross from the 15-slot bucket into the 31-slot one.
    return DecoderSession(llama[1], decode_buckets=(15, 31, 63), prompt_buckets=(8, 16))


def _ort_logits(path: str, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """ONNX Runtime's next-token logits after the prompt and after each of ``tokens``,
    the cache growing by one per step (no padding anywhere)."""
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    layout = cache_layout(onnx.load(path))
    shapes = [[d if isinstance(d, int) else 1 for d in s] for s in layout.cache_shapes]
    for s in shapes:
        s[layout.axis] = 0
    cache = [np.zeros(s, np.float32) for s in shapes]
    ids, out, total = np.array([prompt]), [], len(prompt)
    for step in [None, *tokens]:
        if step is not None:
            ids, total = np.array([[step]]), total + 1
        feed = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.arange(total - ids.shape[1], total)[None]}
        got = sess.run(None, feed | dict(zip(layout.past, cache)))
        out.append(got[0][0, -1])
        cache = got[1:]
    return out


def _greedy(session: DecoderSession, prompts: list[list[int]], steps: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """The logits of a new batch's prompts and ``steps`` greedy steps (steps + 1, batch,
    vocab), and the tokens chosen (batch, steps + 1)."""
    session.reset()
    logits = [session.prefill(prompts)]
    tokens = [logits[0].argmax(-1)]
    for _ in range(steps):
        logits.append(session.decode(tokens[-1]))
        tokens.append(logits[-1].argmax(-1))
    return np.stack(logits), np.stack(tokens, 1)


@pytest.fixture(scope="module")
def copying_session(llama) -> DecoderSession:
    """The cache copied back from the export's own outputs, not written in place."""
    return DecoderSession(llama[1], decode_buckets=(15, 31, 63), prompt_buckets=(8, 16),
                          write_in_place=False)


@pytest.mark.parametrize("in_place", [True, False])
def test_cache_buckets_give_the_unpadded_models_logits(llama, session, copying_session,
                                                       in_place) -> None:
    """Two prompts of different lengths in one batch: every step's logits match ONNX
    Runtime's unpadded run of each prompt alone, and the greedy tokens match torch's, with
    the cache written in place by the steps or copied back from their outputs."""
    model, path = llama
    session = session if in_place else copying_session
    assert session.writes_in_place is in_place
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]
    steps, tokens = _greedy(session, prompts, 11)
    assert list(session.lengths) == [7 + 11, 3 + 11]
    for b, prompt in enumerate(prompts):
        want = _ort_logits(path, prompt, list(tokens[b, :-1]))
        for i, (got, ref) in enumerate(zip([s[b] for s in steps], want, strict=True)):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=f"step {i}")
        with torch.no_grad():
            ref_tokens = model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                        do_sample=False, pad_token_id=0)[0, len(prompt):]
        np.testing.assert_array_equal(tokens[b], ref_tokens.numpy())
    # 8-token prompt bucket, then the 15- and 31-slot cache buckets: three builds, not 12
    # (written in place, the cache holds the step's new slot too).
    steps = sorted((s["seq"], s["past"]) for s in session.step_model.compiled_sizes)
    if in_place:
        assert [(s["seq"], s["past"]) for s in session.model.compiled_sizes] == [(8, 1)]
        assert steps == [(1, 16), (1, 32)]
    else:
        assert steps == [(1, 15), (1, 31), (8, 1)]
    # RMS norms, and attention reading the shared K/V heads in place (no repeat).
    report = session.report()
    assert "tpp.rms_norm: 5" in report
    assert "tpp.attention_mask_mulscale_nanguard_gqa: 2" in report


def test_steps_run_on_a_build_bound_once_per_bucket(session, monkeypatch) -> None:
    """A step does not look its build up or convert its inputs anew (that was 10% of a
    0.45B model's step): the build is bound once per cache bucket, again after a reset."""
    lookups = []
    build = session._build
    monkeypatch.setattr(session, "_build", lambda *a, **k: lookups.append(a) or build(*a, **k))
    steps, _ = _greedy(session, [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]], 11)
    # the prompt, then the 16- and 32-slot buckets (the 11 steps cross from one to the other)
    assert [a[:3] for a in lookups] == [(2, 8, 1), (2, 1, 16), (2, 1, 32)]
    again, _ = _greedy(session, [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]], 11)
    assert len(lookups) == 6
    np.testing.assert_array_equal(steps, again)


def test_generate_and_prepare(session) -> None:
    session.prepare(prompt_length=4, max_length=20, batch=2)  # compiled above: nothing new
    assert len(session.model.compiled_sizes) + len(session.step_model.compiled_sizes) == 3
    out = session.generate([[4, 3, 2, 1], [7, 7]], max_new_tokens=6)
    assert out.tokens.shape == (2, 6) and len(out.step_seconds) == 5
    assert out.tokens_per_second > 0
    assert "KV-cache decoder: 4 cache tensors (past axis 2, written in place, last " \
        "position's logits only)" in session.report()


def test_concurrent_generations_on_one_session_serialize(session) -> None:
    """A session is one batch's cache: generations from two threads run one after the
    other, each giving what it gives alone."""
    import threading

    alone = session.generate([[4, 3, 2, 1]], max_new_tokens=5).tokens
    results: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: results.append(
        session.generate([[4, 3, 2, 1]], max_new_tokens=5).tokens)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    for tokens in results:
        np.testing.assert_array_equal(tokens, alone)


def test_clear_errors(llama, session) -> None:
    session.reset()
    with pytest.raises(UnsupportedShapeError, match="decode\\(\\) before prefill"):
        session.decode([1])
    session.prefill([[1, 2]])
    with pytest.raises(UnsupportedShapeError, match="got 2 tokens for a batch of 1"):
        session.decode([1, 2])
    with pytest.raises(UnsupportedShapeError, match="a prompt of 17 exceeds the largest "
                                                    "bucket 16"):
        session.prefill([list(range(17))])
    assert bucket_for(16, (8, 16), "x") == 16
    model = onnx.load(llama[1])
    positions = next(v for v in model.graph.input if v.name == "position_ids")
    model.graph.input.remove(positions)
    with pytest.raises(ModelLoadError, match=r"lacks \['position_ids'\]"):
        cache_layout(model)


def test_cli_generates_the_sessions_tokens(llama, session, capsys) -> None:
    from tpp_tvm import cli

    assert cli.main(["generate", llama[1], "--prompt", "4,3,2,1", "--new", "5"]) == 0
    printed = capsys.readouterr().out
    want = session.generate([[4, 3, 2, 1]], max_new_tokens=5).tokens[0]
    assert "tokens: " + ",".join(str(int(t)) for t in want) in printed
    assert "4 steps at" in printed
    assert cli.main(["generate", llama[1], "--prompt", "a,b"]) == 2


@pytest.fixture(scope="module")
def int8_session(llama) -> DecoderSession:
    return DecoderSession(llama[1], decode_buckets=(15, 31, 63), prompt_buckets=(8, 16),
                          cache_dtype="int8")


def test_int8_cache_decodes_like_the_fp32_cache(session, int8_session) -> None:
    """The int8 KV cache (rows with a scale each): a ragged batch's logits stay within 1%
    of the fp32 cache's through a bucket change, the greedy tokens equal; the cache holds
    int8 rows (at head size 16, 0.31x the bytes) and the attention kernels read them."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]
    runs = []
    for s in (session, int8_session):
        logits, tokens = _greedy(s, prompts, 11)
        runs.append((logits, tokens, sum(t.numpy().nbytes for t in s._cache)))
    (want, want_tokens, fp32_bytes), (got, tokens, int8_bytes) = runs
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max())
    np.testing.assert_array_equal(tokens, want_tokens)
    assert [str(t.dtype) for t in int8_session._cache] == ["int8"] * 4 + ["float32"] * 4
    assert int8_bytes / fp32_bytes == pytest.approx((16 + 4) / 64)
    assert "tpp.attention_mask_mulscale_nanguard_gqa_int8kv: 2" in int8_session.report()


def test_cli_passes_the_kv_cache_dtype(llama, int8_session, monkeypatch, capsys) -> None:
    """``--kv-cache int8`` makes the int8 session (the session's int8 path is tested
    above: here only what the flag reaches, without a second compile)."""
    from tpp_tvm import cli, decoding

    made = []

    def session(*args, **kwargs):
        made.append(kwargs)
        return int8_session

    monkeypatch.setattr(decoding, "DecoderSession", session)
    monkeypatch.setattr(int8_session, "prepare", lambda *a, **k: None)
    assert cli.main(["generate", llama[1], "--prompt", "4,3,2,1", "--new", "3",
                     "--kv-cache", "int8"]) == 0
    assert made[0]["cache_dtype"] == "int8"
    want = int8_session.generate([[4, 3, 2, 1]], max_new_tokens=3).tokens[0]
    assert "tokens: " + ",".join(str(int(t)) for t in want) in capsys.readouterr().out


def test_int8_cache_needs_the_cache_written_in_place(llama) -> None:
    from tpp_tvm.errors import UnsupportedDTypeError

    with pytest.raises(ModelLoadError, match="int8 KV cache needs write_in_place=True"):
        DecoderSession(llama[1], write_in_place=False, cache_dtype="int8")
    with pytest.raises(UnsupportedDTypeError, match="cache_dtype 'float16'"):
        DecoderSession(llama[1], cache_dtype="float16")


def _int4_llama(tmp_path, seed: int, layers: int, positions: int,
                accuracy_level: int = 0) -> str:
    """A tiny Llama-style model with random weights, exported with its cache and its MatMul
    weights quantized to int4 (MatMulNBits, accuracy level 0 unless given)."""
    from tpp_tvm.cache_export import export_causal_lm_with_cache

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
        max_position_embeddings=positions)
    return str(export_causal_lm_with_cache(transformers.LlamaForCausalLM(config).eval(),
                                           tmp_path / "int4.onnx", weights="int4",
                                           accuracy_level=accuracy_level))


def _prefill_and_step_like_onnxruntime(session: DecoderSession, path: str,
                                       prompt: list[int], tol: float) -> None:
    """The session's prompt logits and its first step's match ONNX Runtime's on the same
    file, and the step build packs the weights as the prompt build did: it holds no copy of
    its own (a few small constants of its own shape only)."""
    first = session.prefill([prompt])
    pooled = session.constants.nbytes
    second = session.decode(first.argmax(-1))
    assert pooled > 0 and session.constants.nbytes - pooled < pooled / 10
    want = _ort_logits(path, prompt, [int(first.argmax(-1)[0])])
    for got, ref in zip([first[0], second[0]], want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_int4_export_generates_like_onnxruntime(tmp_path, monkeypatch) -> None:
    """Two calls from a transformers model to int4 generation: the export quantizes the
    MatMul weights (ONNX Runtime's MatMulNBits), the session runs them on the weight-only
    kernels, and its logits match ONNX Runtime's on the same file."""
    from tpp_tvm.cache_export import export_causal_lm_with_cache

    path = _int4_llama(tmp_path, seed=1, layers=1, positions=64)
    ops = [node.op_type for node in onnx.load(path).graph.node]
    assert ops.count("MatMulNBits") == 7 + 1, ops  # q, k, v, o, gate, up, down; lm head
    from tpp_tvm.relay_passes import shared_constants

    monkeypatch.setattr(shared_constants, "MIN_SHARED_BYTES", 0)  # a tiny model's weights
    session = DecoderSession(path, decode_buckets=(15,), prompt_buckets=(8,))
    _prefill_and_step_like_onnxruntime(session, path, [3, 1, 4, 1, 5], 1e-4)
    assert "tpp.matmul_int4_weights" in session.report(), session.report()
    with pytest.raises(ValueError, match="int4"):
        export_causal_lm_with_cache(None, tmp_path / "x.onnx", weights="int2")


def test_in_place_rewrite_only_where_the_cache_is_only_concatenated(llama) -> None:
    """The step model writes each cache with TensorScatter and reads the past length one
    slot shorter; a cache input read any other way leaves the export as it is."""
    from tpp_tvm.decoding import CACHE_WRITE_INDEX, with_cache_written_in_place

    model = onnx.load(llama[1])
    layout = cache_layout(model)
    written = with_cache_written_in_place(model, layout)
    ops = [n.op_type for n in written.graph.node]
    assert ops.count("TensorScatter") == len(layout.past)
    scatters = [n for n in written.graph.node if n.op_type == "TensorScatter"]
    assert sorted(n.output[0] for n in scatters) == sorted(layout.present)
    assert all(n.input[0] in layout.past and n.input[2] == CACHE_WRITE_INDEX for n in scatters)
    assert CACHE_WRITE_INDEX in [v.name for v in written.graph.input]
    assert ops.count("Sub") > [n.op_type for n in model.graph.node].count("Sub")

    model.graph.node.append(onnx.helper.make_node(
        "ReduceSum", [layout.past[0]], ["cache_total"], keepdims=0))
    model.graph.output.append(onnx.helper.make_tensor_value_info(
        "cache_total", onnx.TensorProto.FLOAT, None))
    assert with_cache_written_in_place(model, layout) is None


def test_prompts_compute_the_last_positions_logits_only(llama, session) -> None:
    """The LM head takes the hidden states' last position (a Slice before it): ONNX Runtime
    runs the rewritten export to the original's last logits; a logits output that is not
    an LM head's product per position leaves the export as it is."""
    from tpp_tvm.decoding import with_last_logits_only

    model = onnx.load(llama[1])
    layout = cache_layout(model)
    sliced = with_last_logits_only(model, layout)
    assert [n.op_type for n in sliced.graph.node].count("Slice") == \
        [n.op_type for n in model.graph.node].count("Slice") + 1
    assert session.last_logits_only and "last position's logits only" in session.report()
    rng = np.random.default_rng(0)
    shapes = [[2 if isinstance(d, str) else d for d in s] for s in layout.cache_shapes]
    feed = {"input_ids": rng.integers(0, 100, (2, 5)), "attention_mask": np.ones((2, 8), "int64"),
            "position_ids": np.tile(np.arange(3, 8), (2, 1))}
    for name, shape in zip(layout.past, shapes):
        shape[layout.axis] = 3
        feed[name] = rng.standard_normal(shape).astype(np.float32)
    want = ort.InferenceSession(llama[1], providers=["CPUExecutionProvider"]).run(None, feed)
    got = ort.InferenceSession(sliced.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feed)
    assert got[0].shape == (2, 1, 100)
    np.testing.assert_allclose(got[0][:, 0], want[0][:, -1], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(g, w)

    softmax = onnx.ModelProto()
    softmax.CopyFrom(model)
    head = next(n for n in softmax.graph.node if layout.logits in n.output)
    head.output[0] = "raw_logits"
    softmax.graph.node.append(onnx.helper.make_node("Softmax", ["raw_logits"],
                                                    [layout.logits], axis=-1))
    assert with_last_logits_only(softmax, layout) is None


def test_level4_prompts_run_on_tiles_like_onnxruntime(tmp_path, monkeypatch) -> None:
    """An int4 export at accuracy level 4 on an AMX target (real tiles on an AMX host, else
    the tile model): the prompt's weight-only matmuls (16 rows) run on the tile kernel, the
    step's on vpdpbusd, both sharing one packed copy of the weights; the logits are ONNX
    Runtime's on the same file, which quantizes A to int8 the same way."""
    from tpp_tvm.relay_passes import shared_constants

    path = _int4_llama(tmp_path, seed=3, layers=1, positions=64, accuracy_level=4)
    monkeypatch.setattr(shared_constants, "MIN_SHARED_BYTES", 0)  # a tiny model's weights
    session = DecoderSession(path, target=h.tile_target(1), decode_buckets=(31,),
                             prompt_buckets=(16,))
    _prefill_and_step_like_onnxruntime(
        session, path, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], 1e-3)
    report = session.report()
    assert "tpp.matmul_int4_weights_tiles [int8]" in report, report
    assert "tpp.matmul_int4_weights [int8]" in report, report


def test_int4_greedy_tokens_equal_onnxruntime_for_64_steps(tmp_path) -> None:
    """The issue's generation check: on the same int4 file (accuracy level 0), 64 greedy
    steps of the session, crossing three cache buckets, give ONNX Runtime's tokens."""
    path = _int4_llama(tmp_path, seed=2, layers=2, positions=128)
    session = DecoderSession(path, decode_buckets=(15, 31, 63, 127), prompt_buckets=(8,))
    prompt = [3, 1, 4, 1, 5, 9]
    got = session.generate([prompt], max_new_tokens=65).tokens[0]
    # ONNX Runtime after the prompt and after each of the session's tokens picks that token
    # next: the two greedy sequences are the same.
    want = [int(logits.argmax()) for logits in _ort_logits(path, prompt, list(got[:-1]))]
    np.testing.assert_array_equal(got, want)
