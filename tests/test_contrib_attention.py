"""ONNX Runtime's attention contrib operators (tpp_tvm.frontend.contrib_attention) against
ONNX Runtime on small graphs from ``onnx.helper``: prompts and decode steps with a past,
right-padded pasts, rotary embedding, grouped heads, and the softmax variants."""

from __future__ import annotations

import subprocess
import sys

import checks
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tpp_tvm.errors import UnsupportedOperatorError

RNG = np.random.default_rng(5)
N, KV, H = 4, 2, 32


def _model(node: onnx.NodeProto, inputs: dict[str, tuple[int, list[int]]]) -> onnx.ModelProto:
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
               for name in node.output if name]
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
        outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _normal(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype("float32")


def _gqa(b: int, s: int, past: int, seqlens: list[int], *, packed: bool = False,
         rotary: bool = False, **attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A GroupQueryAttention node and its feeds: ``past`` rows of past K/V (none if 0),
    ``seqlens``: each sequence's total length."""
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = {}
    feeds = {}
    if packed:
        inputs["qkv"] = (f, [b, s, (N + 2 * KV) * H])
        names = ["qkv", "", ""]
    else:
        inputs |= {"q": (f, [b, s, N * H]), "k": (f, [b, s, KV * H]), "v": (f, [b, s, KV * H])}
        names = ["q", "k", "v"]
    if past:
        inputs |= {"past_k": (f, [b, KV, past, H]), "past_v": (f, [b, KV, past, H])}
        names += ["past_k", "past_v"]
    else:
        names += ["", ""]
    inputs |= {"seqlens_k": (i32, [b]), "total": (i32, [])}
    names += ["seqlens_k", "total"]
    if rotary:
        inputs |= {"cos": (f, [64, H // 2]), "sin": (f, [64, H // 2])}
        names += ["cos", "sin"]
        angles = np.arange(64)[:, None] / (10000 ** (np.arange(H // 2) / (H // 2)))
        feeds |= {"cos": np.cos(angles).astype("float32"), "sin": np.sin(angles).astype("float32")}
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"],
                            domain="com.microsoft", num_heads=N, kv_num_heads=KV,
                            do_rotary=int(rotary), **attrs)
    for name, (dtype, shape) in inputs.items():
        if dtype == f and name not in feeds:
            feeds[name] = _normal(*shape)
    feeds["seqlens_k"] = np.array(seqlens, "int32") - 1
    feeds["total"] = np.array(max(seqlens), "int32")
    return _model(node, inputs), feeds


def test_group_query_attention_prompt_runs_on_the_attention_kernel() -> None:
    """A first prompt (no past): causal, K/V heads shared by two query heads each, on the
    fused attention kernel reading the shared heads in place."""
    model, feeds = _gqa(2, 8, 0, [8, 8])
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)
    lowered = compiled.report_data["lowered"]
    assert any(name.startswith("tpp.attention") and name.endswith("_gqa") for name in lowered), \
        lowered
    assert not compiled.report_data.get("fallbacks")


@pytest.mark.parametrize("seqlens", [[7, 7], [7, 4]], ids=["full", "right_padded"])
@pytest.mark.parametrize("rotary", [False, True])
def test_group_query_attention_decode_step_with_a_past(seqlens, rotary) -> None:
    """One new token after 6 rows of past: present is the past then the token (at each
    sequence's own past length when its past is right-padded), rotary at that position."""
    model, feeds = _gqa(2, 1, 6, seqlens, rotary=rotary)
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attrs", [
    {"rotary_interleaved": 1}, {"local_window_size": 3}, {"softcap": 2.0},
    {"smooth_softmax": 1}], ids=["interleaved", "window", "softcap", "smooth_softmax"])
def test_group_query_attention_variants(attrs) -> None:
    """Packed QKV, a 3-token prompt after 4 rows of past, and each variant of the softmax
    or the rotation."""
    model, feeds = _gqa(1, 3, 4, [7], packed=True, rotary=True, **attrs)
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask", [None, "lengths", "flags"])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_multi_head_attention_with_past_bias_and_masks(mask, unidirectional) -> None:
    """Q/K/V with their bias, 4 rows of past concatenated in front, key padding as lengths
    (B) or flags (B, T), causal or not, an attention bias (1, N, S, T)."""
    b, s, past, d = 2, 3, 4, N * H
    t = past + s
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = {"q": (f, [b, s, d]), "k": (f, [b, s, d]), "v": (f, [b, s, d]),
              "bias": (f, [3 * d])}
    names = ["q", "k", "v", "bias"]
    feeds = {}
    if mask == "lengths":
        inputs["mask"] = (i32, [b])
        feeds["mask"] = np.array([t, t - 2], "int32")
    elif mask == "flags":
        inputs["mask"] = (i32, [b, t])
        feeds["mask"] = (RNG.random((b, t)) > 0.3).astype("int32")
        feeds["mask"][:, 0] = 1
    names.append("mask" if mask else "")
    inputs |= {"attn_bias": (f, [1, N, s, t]), "past_k": (f, [b, N, past, H]),
               "past_v": (f, [b, N, past, H])}
    names += ["attn_bias", "past_k", "past_v"]
    node = helper.make_node("MultiHeadAttention", names, ["out", "present_k", "present_v"],
                            domain="com.microsoft", num_heads=N,
                            unidirectional=unidirectional)
    for name, (dtype, shape) in inputs.items():
        if dtype == f:
            feeds[name] = _normal(*shape)
    checks.assert_runs_like_onnxruntime(_model(node, inputs), feeds, rtol=1e-4, atol=1e-5)


def test_multi_head_attention_refuses_packed_kv_naming_it() -> None:
    import tpp_tvm

    b, s, d = 1, 2, N * H
    f = TensorProto.FLOAT
    node = helper.make_node("MultiHeadAttention", ["q", "kv"], ["out"], domain="com.microsoft",
                            num_heads=N)
    model = _model(node, {"q": (f, [b, s, d]), "kv": (f, [b, s, N, 2, H])})
    with pytest.raises(UnsupportedOperatorError, match="packed"):
        tpp_tvm.compile_onnx(model)


def test_group_query_attention_with_positions_bias_and_sinks() -> None:
    """position_ids for the rotation, an attention bias (B, N, S, T) and one sink logit
    per head in the softmax's denominator."""
    b, s, past = 2, 1, 3
    model, feeds = _gqa(b, s, past, [past + s, past + s], rotary=True)
    node = model.graph.node[0]
    f = TensorProto.FLOAT
    node.input.extend(["positions", "attn_bias", "sinks"])
    model.graph.input.extend([
        helper.make_tensor_value_info("positions", TensorProto.INT64, [b, s]),
        helper.make_tensor_value_info("attn_bias", f, [b, N, s, past + s]),
        helper.make_tensor_value_info("sinks", f, [N])])
    feeds |= {"positions": np.array([[3], [7]], "int64"),
              "attn_bias": _normal(b, N, s, past + s), "sinks": _normal(N)}
    checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-5)


def test_group_query_attention_decode_step_stays_on_the_attention_kernel() -> None:
    import tpp_tvm

    model, _ = _gqa(1, 1, 15, [16])
    lowered = tpp_tvm.compile_onnx(model).report_data["lowered"]
    assert any(name.startswith("tpp.attention") for name in lowered), lowered


@pytest.fixture(scope="module")
def builder_llama(tmp_path_factory) -> str:
    """The builder's file, made once for the module (the builder runs for ~10 s)."""
    return _builder_llama(tmp_path_factory.mktemp("builder"))


def _builder_llama(tmp_path) -> str:
    """ONNX Runtime GenAI's model builder's int4 CPU export of a 2-layer Llama (GQA 8/2,
    random weights, a word-level tokenizer): its MatMulNBits, GroupQueryAttention with
    rotary, SkipSimplifiedLayerNormalization, as the builder writes them."""
    builder = pytest.importorskip("onnxruntime_genai.models.builder")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(tmp_path / "hf")
    # its command line (the API needs its own option parsing first), in a process whose
    # torchvision stubs are in place (transformers imports torchvision where installed)
    run = ("import runpy, sys, types\n"
           "for name in ('torchvision._meta_registrations',\n"
           "             'torchvision._autograd_registrations'):\n"
           "    sys.modules.setdefault(name, types.ModuleType(name))\n"
           f"sys.argv = ['builder', '-i', {str(tmp_path / 'hf')!r}, '-o', "
           f"{str(tmp_path / 'onnx')!r}, '-p', 'int4', '-e', 'cpu', '-c', "
           f"{str(tmp_path / 'cache')!r}]\n"
           f"runpy.run_module({builder.__name__!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", run], check=True, capture_output=True)
    return str(tmp_path / "onnx" / "model.onnx")


@pytest.mark.requires_torch
def test_model_builder_int4_llama_runs_like_onnxruntime(builder_llama) -> None:
    """The builder's file as it is: a prompt after one cached token, then decode steps at
    batch 1 and 2, weights on the int4 kernels, attention on the fused kernel. The builder
    sets accuracy level 4 (activations quantized to int8 per block, as ONNX Runtime's MLAS
    does): an activation an ulp away from ONNX Runtime's, on a rounding tie, moves one
    code, so the logits are checked to the issue's 1e-3 of their range and the cached K/V
    (read by every later step) to 1e-2."""
    import onnxruntime as ort

    import tpp_tvm

    path = builder_llama
    model = onnx.load(path)
    ops = {node.op_type for node in model.graph.node}
    assert {"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization"} <= ops
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    compiled = tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))
    for b, past, s in [(1, 1, 8), (1, 5, 1), (2, 7, 1)]:
        feeds = {"input_ids": RNG.integers(0, 512, (b, s)),
                 "attention_mask": np.ones((b, past + s), "int64")}
        for layer in range(2):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{layer}.{kind}"] = _normal(b, 2, past, 32)
        got, want = compiled(**feeds), session.run(None, feeds)
        assert len(got) == len(want) == 5
        np.testing.assert_allclose(got[0], want[0], rtol=0,
                                   atol=1e-3 * float(np.abs(want[0]).max()))
        for g, w in zip(got[1:], want[1:], strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-2)
    report = compiled.specialization(compiled.size_of(feeds)).report_data["lowered"]
    assert any(name.startswith("tpp.matmul_int4_weights") for name in report), report
    assert any(name.startswith("tpp.attention") for name in report), report


@pytest.mark.requires_torch
def test_decoder_session_generates_from_a_model_builder_file(builder_llama) -> None:
    """`DecoderSession` drives the builder's file (no position_ids: GroupQueryAttention
    places each sequence's rows after its own length): a ragged batch, right-padded, through
    a cache bucket change; every step's logits are ONNX Runtime's on each prompt alone, the
    cache growing unpadded, fed the session's own tokens."""
    import onnxruntime as ort

    from tpp_tvm.decoding import DecoderSession

    path = builder_llama
    session = DecoderSession(path, decode_buckets=(15, 31), prompt_buckets=(8, 16))
    assert session.layout.right_padded and session.layout.positions is None
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]
    steps = [session.prefill(prompts)]
    tokens = [steps[0].argmax(-1)]
    for _ in range(10):  # 7 + 10 tokens: past the 15-slot bucket
        steps.append(session.decode(tokens[-1]))
        tokens.append(steps[-1].argmax(-1))
    assert list(session.lengths) == [7 + 10, 3 + 10]
    reference = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for b, prompt in enumerate(prompts):
        ids = np.array([prompt])
        past = {f"past_key_values.{i}.{kind}": np.zeros((1, 2, 0, 32), np.float32)
                for i in range(2) for kind in ("key", "value")}
        for i, got in enumerate(s[b] for s in steps):
            total = len(prompt) + i
            out = reference.run(None, {"input_ids": ids,
                                       "attention_mask": np.ones((1, total), np.int64)} | past)
            want = out[0][0, -1]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * float(np.abs(want).max()),
                                       err_msg=f"sequence {b}, step {i}")
            past = {o.name.replace("present", "past_key_values"): value
                    for o, value in zip(reference.get_outputs()[1:], out[1:])}
            ids = np.array([[tokens[i][b]]])
    assert "sequences right-padded" in session.report()
    # the head size, a symbol in the builder's cache inputs, came from its genai_config.json
    from tpp_tvm.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"\['kv_cache_dim'\] are symbolic.*cache_dims="):
        DecoderSession(onnx.load(path))
