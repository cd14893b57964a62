"""The fused attention kernel against numpy: masks, scale, shapes, and its TPP tiles."""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm

from tpp_tvm.errors import UnsupportedShapeError
from tpp_tvm.schedules.attention import AttentionShape, attention_schedule, copies_key_rows
from tpp_tvm.target import target


def _reference(q, kt, mask, v, shape: AttentionShape):
    kt, v = np.repeat(kt, shape.group, 0), np.repeat(v, shape.group, 0)  # shared K/V heads
    z = q.astype(np.float64) @ kt * shape.scale
    if mask is not None:  # (bh / heads, 1 or seq_q, seq)
        z = z + np.repeat(mask, shape.heads, 0)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v


def _inputs(shape: AttentionShape, seed: int) -> tuple:
    """Q, Kᵀ, V and (masked shapes) a mask of -1e4 at a quarter of the keys."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((shape.bh, shape.seq_q, shape.dim), dtype="float32")
    kt = rng.standard_normal((shape.bh // shape.group, shape.dim, shape.seq), dtype="float32")
    v = rng.standard_normal((shape.bh // shape.group, shape.seq, shape.value_dim),
                            dtype="float32")
    mask = None
    if shape.mask:
        mq = shape.seq_q if shape.mask_per_query else 1
        mask = np.where(rng.random((shape.bh // shape.heads, mq, shape.seq)) < 0.25, -1e4, 0)
        mask = mask.astype("float32")
    return q, kt, v, mask


@pytest.mark.parametrize(
    "shape",
    [
        AttentionShape(bh=4, seq_q=16, seq=24, dim=16, heads=2, scale=0.25, mask=True),
        AttentionShape(bh=3, seq_q=6, seq=10, dim=12, heads=3, scale=1.0, mask=False),
        AttentionShape(bh=2, seq_q=8, seq=32, dim=40, heads=1, scale=0.1, mask=True),
        AttentionShape(bh=8, seq_q=8, seq=32, dim=16, heads=4, scale=0.25, mask=True,
                       group=4),
        AttentionShape(bh=6, seq_q=14, seq=32, dim=16, heads=3, scale=0.25, mask=True,
                       mask_per_query=True),
        # LeViT: values wider than keys, fewer queries than keys, a bias per query
        AttentionShape(bh=4, seq_q=9, seq=64, dim=16, heads=1, scale=0.25, mask=True,
                       mask_per_query=True, dim_v=48),
        AttentionShape(bh=8, seq_q=8, seq=32, dim=32, heads=4, scale=0.25, mask=False,
                       group=4, dim_v=16),
    ],
)
def test_attention_matches_numpy(shape):
    sch = attention_schedule(shape, checks.VECTOR_ISA)
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    q, kt, v, mask = _inputs(shape, shape.seq)
    out = np.zeros((shape.bh, shape.seq_q, shape.value_dim), "float32")
    args = [tvm.runtime.tensor(x) for x in (q, kt, *([mask] if shape.mask else []), v, out)]
    lib(*args)
    np.testing.assert_allclose(args[-1].numpy(), _reference(q, kt, mask, v, shape),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [
    # a grouped decoding step (5 query heads folded as rows over one K/V head), 2 key blocks
    AttentionShape(bh=2, seq_q=5, seq=64, dim=64, heads=2, scale=0.125, mask=True,
                   zero_masked_rows=True, keys_as_rows=True),
    AttentionShape(bh=3, seq_q=2, seq=32, dim=32, heads=3, scale=0.25, mask=False,
                   keys_as_rows=True),
    # a decoding step's cache (1024 slots x 64 a head): key blocks copied into L1 first
    AttentionShape(bh=2, seq_q=5, seq=1024, dim=64, heads=2, scale=0.125, mask=True,
                   zero_masked_rows=True, keys_as_rows=True),
])
def test_keys_read_as_rows_match_numpy(shape):
    """K given as rows, its key blocks transposed in the kernel (transpose TPPs), gives
    what Kᵀ gives; a K as large as a decoding step's cache is copied a key block at a time
    into L1 before the transpose, a smaller one is not."""
    sch = attention_schedule(shape, checks.VECTOR_ISA)
    assert "tpp.transpose" in str(sch.trace)
    assert ("k_rows_block" in sch.mod.script()) == (shape.seq == 1024) \
        == copies_key_rows(shape)
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    q, kt, v, mask = _inputs(shape, shape.seq)
    k = np.ascontiguousarray(kt.transpose(0, 2, 1))
    out = np.zeros((shape.bh, shape.seq_q, shape.value_dim), "float32")
    args = [tvm.runtime.tensor(x) for x in (q, k, *([mask] if shape.mask else []), v, out)]
    lib(*args)
    np.testing.assert_allclose(args[-1].numpy(), _reference(q, kt, mask, v, shape),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fill", ["finfo_min", "-inf"])
def test_decoding_step_skips_masked_key_blocks_exactly(fill):
    """A decoding step (keys as rows, one mask row per head) skips the key blocks its mask
    masks whole: the output is the unskipped kernel's, also where a left-padded block, a
    ragged block and a whole masked row (a sequence with no tokens yet) are masked."""
    shape = AttentionShape(bh=6, seq_q=4, seq=256, dim=64, heads=2, scale=0.125, mask=True,
                           zero_masked_rows=True, keys_as_rows=True)
    sch = attention_schedule(shape, checks.VECTOR_ISA)
    assert "llvm.vector.reduce.or" in sch.mod.script()  # a block tested by mask, not max
    q, kt, v, _ = _inputs(shape, 7)
    masked = np.float32(np.finfo(np.float32).min if fill == "finfo_min" else -np.inf)
    mask = np.zeros((3, 1, 256), "float32")
    mask[0, :, 160:] = masked  # the cache's unused slots: 3 whole blocks
    mask[1, :, :40] = masked   # left padding: a whole block and part of the next
    mask[1, :, 200:] = masked
    mask[2] = masked           # nothing to attend to
    k = np.ascontiguousarray(kt.transpose(0, 2, 1))
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    out = np.zeros((6, 4, 64), "float32")
    args = [tvm.runtime.tensor(x) for x in (q, k, mask, v, out)]
    lib(*args)
    got = args[-1].numpy()
    np.testing.assert_allclose(got[:4], _reference(q, kt, mask, v, shape)[:4],
                               rtol=1e-5, atol=1e-5)
    # The masked row: ONNX's fp32 softmax of equal logits (finfo.min) averages V; -inf
    # rows are zero (the NaN guard).
    want = v[4:].mean(1, keepdims=True) if fill == "finfo_min" else 0.0
    np.testing.assert_allclose(got[4:], np.broadcast_to(want, got[4:].shape), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("fill", ["finfo_min", "-inf"])
def test_causal_prompt_skips_masked_key_blocks_exactly(fill):
    """A prompt's causal mask (per query, an input) masks whole key blocks for the early
    query blocks: the kernel skips them and gives the unskipped result, with left padding
    and rows that see no key at all (padding queries)."""
    seq = 128
    shape = AttentionShape(bh=4, seq_q=seq, seq=seq, dim=64, heads=2, scale=0.125, mask=True,
                           zero_masked_rows=True, mask_per_query=True,
                           skip_masked_blocks=True)
    sch = attention_schedule(shape, checks.VECTOR_ISA)
    assert "llvm.vector.reduce.or" in sch.mod.script()  # a block tested by mask, not max
    q, kt, v, _ = _inputs(shape, 11)
    masked = np.float32(np.finfo(np.float32).min if fill == "finfo_min" else -np.inf)
    causal = np.triu(np.ones((seq, seq), bool), 1)
    mask = np.where(causal, masked, np.float32(0))[None].repeat(2, 0)
    mask[1, :, :40] = masked  # a left-padded sequence: its first 40 keys ...
    mask[1, :40] = masked      # ... and its padding queries see nothing
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    out = np.zeros((4, seq, 64), "float32")
    args = [tvm.runtime.tensor(x) for x in (q, kt, mask, v, out)]
    lib(*args)
    got, want = args[-1].numpy(), _reference(q, kt, mask, v, shape)
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2:, 40:], want[2:, 40:], rtol=1e-5, atol=1e-5)
    dead = v[2:].mean(1, keepdims=True) if fill == "finfo_min" else 0.0
    np.testing.assert_allclose(got[2:, :40], np.broadcast_to(dead, got[2:, :40].shape),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [
    # a decoding step skipping masked key blocks: V read a key block at a time
    AttentionShape(bh=6, seq_q=4, seq=256, dim=64, heads=2, scale=0.125, mask=True,
                   zero_masked_rows=True, keys_as_rows=True, kv_int8=True),
    # no mask: V dequantized whole per query block; values narrower than keys
    AttentionShape(bh=3, seq_q=2, seq=64, dim=32, heads=3, scale=0.25, mask=False,
                   keys_as_rows=True, kv_int8=True, dim_v=16),
])
def test_int8_keys_and_values_match_numpy(shape):
    """K and V as int8 rows with a scale each (an int8 KV cache) give what their
    dequantized fp32 values give."""
    rng = np.random.default_rng(3)
    kv = shape.bh // shape.group
    q, _, _, mask = _inputs(shape, 3)
    k = rng.integers(-127, 128, (kv, shape.seq, shape.dim), dtype=np.int8)
    v = rng.integers(-127, 128, (kv, shape.seq, shape.value_dim), dtype=np.int8)
    k_scale, v_scale = (rng.random((kv, shape.seq), dtype="float32") / 50 for _ in "kv")
    if shape.mask:
        mask[0, :, 100:] = np.finfo(np.float32).min  # whole key blocks skipped
    sch = attention_schedule(shape, checks.VECTOR_ISA)
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    out = np.zeros((shape.bh, shape.seq_q, shape.value_dim), "float32")
    args = [tvm.runtime.tensor(x) for x in (q, k, k_scale, *([mask] if shape.mask else []),
                                            v, v_scale, out)]
    lib(*args)
    kt = (k * k_scale[..., None]).transpose(0, 2, 1)
    want = _reference(q, kt, mask, v * v_scale[..., None], shape)
    np.testing.assert_allclose(args[-1].numpy(), want, rtol=1e-5, atol=1e-6)


def test_int8_keys_and_values_need_keys_as_rows():
    with pytest.raises(UnsupportedShapeError, match="keys_as_rows"):
        AttentionShape(bh=2, seq_q=2, seq=32, dim=32, heads=2, scale=1.0, mask=False,
                       kv_int8=True)


def test_attention_tiles_are_tpps():
    shape = AttentionShape(bh=2, seq_q=16, seq=64, dim=32, heads=2, scale=0.5, mask=True)
    trace = str(attention_schedule(shape, checks.VECTOR_ISA).trace)
    for name in ("tpp.gemm.f32", "tpp.reduce_max_cols", "tpp.exp", "tpp.reduce_add_cols",
                 f"tpp.mul.f32.{checks.VECTOR_ISA}"):
        assert name in trace, name


def test_attention_needs_a_row_block():
    with pytest.raises(UnsupportedShapeError, match="query rows"):
        attention_schedule(AttentionShape(1, 13, 8, 8, 1, 1.0, False), checks.VECTOR_ISA)


def _attention_nodes(scale_op: str, masked: bool) -> list:
    """ONNX nodes of softmax(Q Kᵀ (scale_op) c (+ m)) V over inputs q, k, v (and m), as
    exporters write attention."""
    from onnx import helper

    z = "zm" if masked else "z"
    return [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "kt"], ["s"]),
            helper.make_node(scale_op, ["s", "c"], ["z"]),
            *([helper.make_node("Add", ["z", "m"], ["zm"])] if masked else []),
            helper.make_node("Softmax", [z], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"])]


@pytest.mark.requires_onnxruntime
def test_prime_query_counts_run_padded_through_the_fused_kernel():
    """ViT's 197 tokens have no row block: the queries are padded with zero rows to the next
    multiple of 8 and the padded rows' outputs dropped (compile_onnx against ORT)."""
    from onnx import TensorProto, helper

    from tpp_tvm.schedules.attention import padded_query_rows

    assert padded_query_rows(197) == 200 and padded_query_rows(64) == 64
    heads, seq, dim = 2, 13, 16
    f = TensorProto.FLOAT
    nodes = _attention_nodes("Mul", masked=False)
    shape = [1, heads, seq, dim]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, f, shape) for n in "qkv"],
        [helper.make_tensor_value_info("y", f, None)],
        [helper.make_tensor("c", f, [], [0.25])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(13)
    feeds = {n: rng.standard_normal(shape).astype("float32") for n in "qkv"}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    assert "tpp.attention" in compiled.report()


def test_ragged_keys_with_a_mask_run_padded():
    """13 keys with an additive padding mask: keys and values are zero-padded to 32, the
    mask padded with -inf, so the padded keys get zero weight (against ORT)."""
    from onnx import TensorProto, helper

    from tpp_tvm.schedules.attention import padded_keys

    assert padded_keys(197) == 224 and padded_keys(128) == 128
    heads, seq, dim = 2, 13, 16
    f = TensorProto.FLOAT
    nodes = _attention_nodes("Div", masked=True)
    shape = [1, heads, seq, dim]
    inputs = [helper.make_tensor_value_info(n, f, shape) for n in "qkv"]
    inputs.append(helper.make_tensor_value_info("m", f, [1, 1, 1, seq]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", f, None)],
                              [helper.make_tensor("c", f, [], [4.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(14)
    feeds = {n: rng.standard_normal(shape).astype("float32") for n in "qkv"}
    mask = np.zeros((1, 1, 1, seq), "float32")
    mask[..., -3:] = -1e9  # the last three keys are padding
    feeds["m"] = mask
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    assert "tpp.attention_mask: 1" in compiled.report()


@pytest.mark.requires_onnxruntime
def test_a_decoding_step_reads_k_as_rows():
    """One query over 40 keys (a decoding step of multi-head attention): the graph's Kᵀ is
    not materialized, the kernel reads K's rows (ragged keys zero-padded along K's rows);
    against ORT."""
    from onnx import TensorProto, helper

    heads, keys, dim = 2, 40, 16
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, [1, heads, 1, dim])]
    inputs += [helper.make_tensor_value_info(n, f, [1, heads, keys, dim]) for n in "kv"]
    inputs.append(helper.make_tensor_value_info("m", f, [1, 1, 1, keys]))
    graph = helper.make_graph(_attention_nodes("Div", masked=True), "g", inputs,
                              [helper.make_tensor_value_info("y", f, None)],
                              [helper.make_tensor("c", f, [], [4.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(15)
    feeds = {n: rng.standard_normal([1, heads, 1 if n == "q" else keys, dim]).astype(
        "float32") for n in "qkv"}
    feeds["m"] = np.where(rng.random((1, 1, 1, keys)) < 0.25, -1e9, 0).astype("float32")
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    report = compiled.report()
    assert "tpp.attention_mask_krows: 1" in report and "transpose" not in report, report


@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize(("batch", "mask_shape"), [
    (1, (1, 1, 13, 13)),  # the constant causal mask of the GPT-2 and Llama exports
    (2, (2, 1, 13, 13)),  # causal and padding folded together, per sequence
    (2, (2, 3, 13, 13)),  # per head too (ALiBi-style biases)
    (2, (1, 3, 1, 13)),   # per head, one bias for both sequences: laid out per row
    (2, (3, 13, 13)),     # Swin's relative position bias: per head, rank 3
])
def test_masks_per_query_row_are_one_kernel(batch: int, mask_shape: tuple) -> None:
    """An additive mask with a query axis (causal masks, per-head biases) runs inside the
    attention kernel for 13 queries (padded to 16 rows) and keys (padded to 32), against
    ORT; a constant mask whose rows do not map onto (batch·head) rows as a prefix (a bias
    per head shared by the batch) is laid out per row at compile time."""
    from onnx import TensorProto, helper

    heads, seq, dim = 3, 13, 16
    f = TensorProto.FLOAT
    nodes = _attention_nodes("Mul", masked=True)
    shape = [batch, heads, seq, dim]
    rng = np.random.default_rng(16)
    mask = np.triu(np.full((seq, seq), -1e9, "float32"), 1)
    mask = (mask + rng.standard_normal(mask_shape).astype("float32")).astype("float32")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, f, shape) for n in "qkv"],
        [helper.make_tensor_value_info("y", f, None)],
        [helper.make_tensor("c", f, [], [0.25]),
         helper.make_tensor("m", f, mask.shape, mask.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {n: rng.standard_normal(shape).astype("float32") for n in "qkv"}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    assert "tpp.attention_mask_mulscale: 1" in compiled.report(), compiled.report()


@pytest.mark.requires_onnxruntime
def test_values_wider_than_keys_and_fewer_queries_than_keys_are_one_kernel() -> None:
    """LeViT's subsampling attention: 9 queries (a strided 3 x 3 grid) over 36 keys, Q and K
    of head size 16 but V of 48, a learned bias per head and query added to the scores: one
    attention kernel (no fallback), its output as wide as V, against ORT."""
    from onnx import TensorProto, helper

    heads, queries, keys, dk, dv = 2, 9, 36, 16, 48
    f = TensorProto.FLOAT
    rng = np.random.default_rng(17)
    bias = rng.standard_normal((heads, queries, keys)).astype("float32")
    shapes = {"q": [1, heads, queries, dk], "k": [1, heads, keys, dk], "v": [1, heads, keys, dv]}
    graph = helper.make_graph(
        _attention_nodes("Mul", masked=True), "g",
        [helper.make_tensor_value_info(n, f, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info("y", f, None)],
        [helper.make_tensor("c", f, [], [0.25]),
         helper.make_tensor("m", f, bias.shape, bias.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {n: rng.standard_normal(s).astype("float32") for n, s in shapes.items()}
    compiled = checks.assert_runs_like_onnxruntime(model, feeds, rtol=1e-5, atol=1e-5)
    assert compiled(**feeds)[0].shape == (1, heads, queries, dv)
    assert compiled.report_data["lowered"] == {"tpp.attention_mask_mulscale": 1}
    assert not compiled.report_data.get("fallbacks"), compiled.report()


@pytest.mark.requires_torch
@pytest.mark.requires_onnxruntime
def test_sdpa_export_is_one_kernel_and_zeroes_fully_masked_rows(tmp_path):
    """torch's export of ``scaled_dot_product_attention`` (transformers' default attention)
    with a boolean mask scales Q and Kᵀ by the scale's square root each, masks with -inf and
    zeroes the probabilities' NaNs: it still becomes one attention kernel, and a sequence
    whose keys are all masked gives zeros, as ONNX Runtime does, not NaN."""
    import onnx
    import torch

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    batch, heads, seq, dim = 2, 2, 32, 16
    rng = np.random.default_rng(15)
    feeds = {n: rng.standard_normal((batch, heads, seq, dim)).astype("float32")
             for n in "qkv"}
    mask = np.ones((batch, 1, 1, seq), bool)  # a boolean mask, as transformers passes
    mask[0, ..., -5:] = False  # padding keys
    mask[1] = False  # nothing to attend to
    feeds["mask"] = mask
    path = tmp_path / "sdpa.onnx"
    torch.onnx.export(Sdpa(), tuple(torch.from_numpy(feeds[n]) for n in ("q", "k", "v", "mask")),
                      str(path), input_names=["q", "k", "v", "mask"], opset_version=17,
                      dynamo=False)
    compiled = checks.assert_runs_like_onnxruntime(onnx.load(str(path)), feeds, rtol=1e-5,
                                                   atol=1e-5)
    assert "tpp.attention_mask_mulscale_nanguard: 1" in compiled.report()
    assert not compiled(**feeds)[0][1].any()


def test_query_blocks_fit_the_register_file() -> None:
    """8-row blocks on AVX-512's 32 registers, 6 on AVX2's 16: Swin's 49 query rows (7 x 7)
    run as 56 there rather than falling back to TVM."""
    from tpp_tvm.schedules.attention import padded_query_rows, query_block_rows

    assert (query_block_rows("avx512"), query_block_rows("amx"), query_block_rows("avx2")) \
        == (8, 8, 6)
    assert padded_query_rows(49, query_block_rows("avx512")) == 49
    assert padded_query_rows(49, query_block_rows("avx2")) == 56
    assert padded_query_rows(197, 6) == 200
    # A long sequence only 2-row blocks divide (AST's 1214 = 2 x 607) runs whole blocks.
    assert padded_query_rows(1214, 6) == 1218 and padded_query_rows(1214, 8) == 1216
    assert padded_query_rows(1568, 6) == 1568 and padded_query_rows(10, 6) == 10
    sch = attention_schedule(AttentionShape(bh=2, seq_q=56, seq=64, dim=32, heads=2,
                                            scale=0.5, mask=False), "avx2")
    assert "tpp.gemm.f32.avx2.m4n16" in str(sch.trace)  # 4-row blocks of 56 on AVX2


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _tile_reference(q, kt, mask, v, shape: AttentionShape) -> np.ndarray:
    """The tile kernel's math: bf16 products with fp32 (here fp64) accumulation, the
    softmax in full precision, the probabilities rounded to bf16 for the second product."""
    kt, v = np.repeat(kt, shape.group, 0), np.repeat(v, shape.group, 0)
    z = _bf16(q) @ _bf16(kt) * shape.scale
    if mask is not None:
        z = z + np.repeat(mask, shape.heads, 0)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return _bf16(p) @ _bf16(v)


@pytest.mark.parametrize("shape", [
    AttentionShape(bh=4, seq_q=64, seq=96, dim=64, heads=2, scale=0.125, mask=True),
    AttentionShape(bh=8, seq_q=32, seq=64, dim=128, heads=4, scale=0.09, mask=True, group=4,
                   mask_per_query=True),  # grouped-query, causal-style mask, 128 head size
    AttentionShape(bh=3, seq_q=32, seq=32, dim=32, heads=3, scale=1.0, mask=False),
    AttentionShape(bh=2, seq_q=32, seq=64, dim=32, heads=2, scale=0.25, mask=True,
                   dim_v=64),  # LeViT: V's head size twice K's
], ids=["masked", "gqa-per-query-d128", "one-block", "dv-wider"])
def test_attention_on_tiles_matches_bf16_math(shape: AttentionShape) -> None:
    """Both products on AMX tiles (the tile model where the host has none): Kᵀ and V
    packed into bf16 VNNI panels, 32-row query blocks, two threads; every tile product
    runs (2 x 2 tiles per 32 x 32 block and 32 of K)."""
    import tpp_harness as h

    from tpp_tvm.intrinsics import amx_emulator
    from tpp_tvm.schedules.attention import attention_tile_schedule
    from tpp_tvm.target import tiles_emulated
    from tpp_tvm.tir_pipeline import compile_kernels

    tgt = h.tile_target(2)
    lib = compile_kernels(attention_tile_schedule(shape, threads=2).mod, tgt).jit()
    q, kt, v, mask = _inputs(shape, shape.dim)
    args = [tvm.runtime.tensor(x) for x in (q, kt, *([mask] if shape.mask else []), v)]
    out = tvm.runtime.empty((shape.bh, shape.seq_q, shape.value_dim), "float32")
    before = amx_emulator.products() if tiles_emulated(tgt) else 0
    lib["main"](*args, out)
    if tiles_emulated(tgt):
        amx_emulator.check("attention on tiles")
        blocks = shape.bh * shape.seq_q // 32
        assert amx_emulator.products() - before == blocks * 4 * (
            shape.seq // 32 * (shape.dim + shape.value_dim) // 32)
    # a probability on a bf16 rounding boundary may round either way: 1e-3, not 1e-5
    np.testing.assert_allclose(out.numpy(), _tile_reference(q, kt, mask, v, shape),
                               rtol=1e-3, atol=1e-3)


def test_attention_on_tiles_assembly() -> None:
    """For an AMX CPU: tdpbf16ps products, the tiles configured once per thread's task
    (not per block), Q and the probabilities converted by vcvtneps2bf16, no prefetching
    of the kernel's own panels."""
    import re

    from tpp_tvm.schedules.attention import attention_tile_schedule
    from tpp_tvm.tir_pipeline import compile_kernels

    shape = AttentionShape(bh=4, seq_q=64, seq=64, dim=64, heads=2, scale=0.125, mask=True)
    asm = compile_kernels(attention_tile_schedule(shape, threads=2).mod,
                          target("amx", num_cores=2)).mod.inspect_source("asm")

    def count(mnemonic: str) -> int:
        return len(re.findall(rf"^\s*{mnemonic}\b", asm, re.M))

    assert count("ldtilecfg") == 1 and count("tilerelease") == 1
    assert count("tdpbf16ps") >= 8 and count("tilestored") >= 4
    assert re.search(r"tdpbf16ps\s+%tmm\d, %tmm\d, %tmm\d", asm)
    assert count("vcvtneps2bf16") >= 2
    assert count("prefetcht1") == 0  # the packed panels are in cache (PREFETCH_PANELS_ATTR)


def test_attention_on_tiles_needs_whole_blocks() -> None:
    """Queries padded to 32s (ViT's 197 as 224), fp32 for other head sizes and for fewer
    than 16 queries; the schedule itself refuses what does not fit."""
    from tpp_tvm.schedules.attention import attention_tile_schedule, tile_query_rows

    assert [tile_query_rows(r, d) for r, d in ((40, 64), (197, 64), (8, 64), (128, 48))] \
        == [64, 224, None, None]
    assert tile_query_rows(49, 32, 64) == 64 and tile_query_rows(49, 16, 64) is None
    assert tile_query_rows(49, 32, 48) is None

    with pytest.raises(UnsupportedShapeError, match="multiples of 32"):
        attention_tile_schedule(AttentionShape(bh=2, seq_q=32, seq=64, dim=48, heads=2,
                                               scale=0.1, mask=False), threads=1)
