"""GEMM schedules: correctness against numpy over shapes/epilogues, tensorization, errors."""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm
import tvm_ffi
from hypothesis import given, settings
from hypothesis import strategies as st

from tpp_tvm.errors import TPPError, UnsupportedDTypeError, UnsupportedShapeError
from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.kernels import build_gemm, pack_b_numpy
from tpp_tvm.schedules.gemm_plan import check_low_precision, plan_gemm
from tpp_tvm.target import host_isa

ACT_REF = {
    None: lambda x: x,
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "tanh": np.tanh,
}


def _reference(a, b, bias, activation, b_layout="kn"):
    out = a @ (b if b_layout == "kn" else np.swapaxes(b, -1, -2))
    if bias is not None:
        out = out + bias
    return ACT_REF[activation](out)


def _check(m, n, k, *, batch=None, bias=False, activation=None, b_layout="kn", seed=0):
    rng = np.random.default_rng(seed)
    lead = (batch,) if batch else ()
    a = rng.standard_normal((*lead, m, k), dtype="float32")
    b_shape = (*lead, k, n) if b_layout == "kn" else (*lead, n, k)
    b = rng.standard_normal(b_shape, dtype="float32")
    bv = rng.standard_normal(n, dtype="float32") if bias else None
    kernel = build_gemm(m, n, k, batch=batch, bias=bias, activation=activation,
                        b_layout=b_layout)
    got = kernel(a, b, bv)
    want = _reference(a, b, bv, activation, b_layout)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    return kernel


@pytest.mark.parametrize(
    "m,n,k",
    [(64, 128, 64), (127, 771, 513), (33, 1000, 257), (1, 1, 1), (7, 17, 3), (2, 300, 5)],
)
def test_gemm_matches_numpy(m, n, k):
    _check(m, n, k)


@pytest.mark.parametrize("activation", [None, "relu", "sigmoid", "tanh"])
def test_gemm_bias_activation_epilogue(activation):
    _check(48, 96, 40, bias=True, activation=activation)


def test_gemm_epilogue_with_tails():
    _check(13, 70, 9, bias=True, activation="relu")


@pytest.mark.parametrize("m,n,k", [(12544, 16, 32), (196, 80, 48), (29, 16, 7)])
def test_one_vector_wide_gemms_match_numpy(m, n, k):
    """16 columns, or an odd number of 16-column panels: one-vector tiles where the host's
    core table has them (Zen 5), the wider tiles padded elsewhere."""
    _check(m, n, k, bias=True, activation="relu")


def test_batched_and_transposed_b():
    _check(20, 50, 30, batch=3)
    _check(50, 40, 30, b_layout="nk")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(m=st.integers(1, 40), n=st.integers(1, 140), k=st.integers(1, 70))
def test_gemm_random_shapes(m, n, k):
    _check(m, n, k, seed=m * 10007 + n * 101 + k)


def test_microkernel_is_tensorized():
    """The C tile goes through the BRGEMM TPP and the epilogue through one equation TPP."""
    kernel = build_gemm(48, 128, 32, bias=True, activation="relu")
    trace = str(kernel.schedule.trace)
    plan = kernel.plan
    assert f"tpp.gemm.f32.{checks.VECTOR_ISA}.m{plan.mr}n{plan.nr}k32.beta0" in trace
    assert f"tpp.equation.f32.{checks.VECTOR_ISA}.m{plan.mr}n{plan.nr}.bias_relu" in trace


def test_padded_epilogue_splits_at_the_padding():
    """Bias/activation run on padded tiles; the residual joins the unpadding copy."""
    rng = np.random.default_rng(3)
    m, n, k = 13, 70, 9
    a = rng.standard_normal((m, k), dtype="float32")
    b = rng.standard_normal((k, n), dtype="float32")
    bias = rng.standard_normal(n, dtype="float32")
    res = rng.standard_normal((m, n), dtype="float32")
    import tvm

    from tpp_tvm.schedules.gemm import gemm_schedule
    from tpp_tvm.target import target
    sch, plan = gemm_schedule(m, n, k, checks.VECTOR_ISA,
                              epilogue=Epilogue(bias=True, activation="tanh", residual=True,
                                                post_activation="relu"))
    assert (plan.mp, plan.np_) != (m, n)
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    out = np.zeros((m, n), "float32")
    args = [tvm.runtime.tensor(x) for x in (
        a, pack_b_numpy(b, plan.nr, "kn", plan.kp), np.pad(bias, (0, plan.np_ - n)), res, out)]
    lib(*args)
    want = np.maximum(np.tanh(a @ b + bias) + res, 0)
    np.testing.assert_allclose(args[-1].numpy(), want, rtol=1e-4, atol=1e-4)


def test_plan_pads_little():
    for m, n in [(127, 771), (33, 1000), (128, 768)]:
        plan = plan_gemm(m, n, 64)
        assert plan.mp * plan.np_ <= 1.15 * m * n, plan
        assert plan.mr * -(-plan.nr // 16) <= 28  # accumulators fit the register file


def test_pack_b_layouts():
    b = np.arange(12, dtype="float32").reshape(3, 4)  # K=3, N=4
    packed = pack_b_numpy(b, nr=3)
    assert packed.shape == (2, 3, 3)
    np.testing.assert_array_equal(packed[0], b[:, :3])
    np.testing.assert_array_equal(packed[1][:, 0], b[:, 3])
    assert not packed[1][:, 1:].any()  # zero padding
    np.testing.assert_array_equal(pack_b_numpy(b.T.copy(), 3, "nk"), packed)


@pytest.mark.parametrize("k,n,layout", [(64, 128, "kn"), (64, 128, "nk"), (7, 50, "kn"),
                                        (1, 19, "nk")])
def test_pack_kernel_matches_numpy_layout(k, n, layout):
    """The packing TPP kernel writes exactly the layout pack_b_numpy defines."""
    kernel = build_gemm(8, n, k, b_layout=layout)
    rng = np.random.default_rng(k + n)
    b = rng.standard_normal((k, n) if layout == "kn" else (n, k), dtype="float32")
    want = pack_b_numpy(b, kernel.plan.nr, layout, kernel.plan.kp)
    np.testing.assert_array_equal(kernel.pack_b(b), want)
    if n % kernel.plan.nr == 0:  # full panels: one copy/transpose TPP per panel
        from tpp_tvm.schedules.gemm import pack_b_schedule

        trace = str(pack_b_schedule(k, n, kernel.plan.nr, kernel.plan.kp, layout,
                                    checks.VECTOR_ISA).trace)
        assert ("tpp.copy" if layout == "kn" else "tpp.transpose") in trace


def test_errors_name_the_problem():
    with pytest.raises(UnsupportedDTypeError, match="'float16'.*bfloat16, int8"):
        build_gemm(8, 8, 8, dtype="float16")
    with pytest.raises(UnsupportedShapeError, match="activation 'swish'"):
        build_gemm(8, 8, 8, activation="swish")
    with pytest.raises(UnsupportedShapeError, match="must be >= 1"):
        build_gemm(0, 8, 8)
    kernel = build_gemm(8, 8, 8)
    with pytest.raises(TPPError, match="A has shape"):
        kernel(np.zeros((8, 9), "float32"), np.zeros((9, 8), "float32"))


# -- low precision -----------------------------------------------------------------------

def _bf16(x):
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype("float32")


@pytest.mark.requires_avx512_bf16
@pytest.mark.requires_avx512_vnni
@pytest.mark.parametrize("m,n,k,batch,layout", [
    (64, 128, 64, None, "kn"), (13, 70, 9, None, "kn"), (33, 100, 257, None, "nk"),
    (20, 50, 30, 3, "kn"), (1, 1, 1, None, "kn"),
])
def test_bf16_gemm_matches_numpy_on_rounded_inputs(m, n, k, batch, layout):
    """bf16 operands, fp32 accumulation: exact up to fp32 summation order."""
    rng = np.random.default_rng(m + n + k)
    lead = (batch,) if batch else ()
    a = rng.standard_normal((*lead, m, k), dtype="float32")
    b = rng.standard_normal((*lead, k, n) if layout == "kn" else (*lead, n, k), dtype="float32")
    kernel = build_gemm(m, n, k, dtype="bfloat16", batch=batch, b_layout=layout)
    want = _reference(_bf16(a), _bf16(b), None, None, layout)
    np.testing.assert_allclose(kernel(a, b), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.requires_avx512_bf16
@pytest.mark.requires_avx512_vnni
def test_bf16_gemm_epilogue_and_accuracy_against_fp32():
    rng = np.random.default_rng(1)
    m, n, k = 48, 96, 200
    a = rng.standard_normal((m, k), dtype="float32")
    b = rng.standard_normal((k, n), dtype="float32")
    bias = rng.standard_normal(n, dtype="float32")
    got = build_gemm(m, n, k, dtype="bfloat16", bias=True, activation="tanh")(a, b, bias)
    np.testing.assert_allclose(got, np.tanh(_bf16(a) @ _bf16(b) + bias), rtol=1e-4, atol=1e-4)
    # Against fp32 math, bf16 rounding of the operands costs about 2^-9 relative per
    # product: the result stays within 1e-2 relative (the bf16 accuracy goal).
    exact = np.tanh(a @ b + bias)
    assert checks.relative_error(got, exact) <= 1e-2


@pytest.mark.requires_avx512_bf16
@pytest.mark.requires_avx512_vnni
@pytest.mark.parametrize("m,n,k,layout", [(64, 128, 64, "kn"), (13, 70, 9, "nk"),
                                          (7, 300, 130, "kn")])
def test_int8_gemm_is_exact(m, n, k, layout):
    rng = np.random.default_rng(m * n + k)
    a = rng.integers(0, 256, (m, k)).astype("uint8")
    b = rng.integers(-128, 128, (k, n) if layout == "kn" else (n, k)).astype("int8")
    got = build_gemm(m, n, k, dtype="int8", b_layout=layout)(a, b)
    assert got.dtype == np.int32
    bk = b if layout == "kn" else b.T
    np.testing.assert_array_equal(got, a.astype(np.int64) @ bk.astype(np.int64))


@pytest.mark.requires_avx512_bf16
@pytest.mark.requires_avx512_vnni
def test_int8_gemm_dequantize_bias_activation():
    rng = np.random.default_rng(5)
    m, n, k = 21, 77, 45
    a = rng.integers(0, 256, (m, k)).astype("uint8")
    b = rng.integers(-128, 128, (n, k)).astype("int8")
    scale = rng.uniform(1e-3, 1e-2, n).astype("float32")
    offset = rng.standard_normal(n).astype("float32")
    bias = rng.standard_normal(n).astype("float32")
    kernel = build_gemm(m, n, k, dtype="int8", b_layout="nk", dequantize=True, bias=True,
                        activation="relu")
    got = kernel(a, b, bias, scale=scale, offset=offset)
    acc = a.astype(np.int64) @ b.T.astype(np.int64)
    np.testing.assert_allclose(got, np.maximum(acc * scale + offset + bias, 0), rtol=1e-5,
                               atol=1e-4)
    trace = str(kernel.schedule.trace)
    p = kernel.plan
    tiles = "amx" if p.amx else "avx512"  # an AMX host's default target runs it on tiles
    assert f"tpp.gemm.u8i8.{tiles}.m{p.mr}n{p.nr}k{p.kp}.beta0" in trace
    assert f"tpp.dequantize.i32.avx512.m{p.mr}n{p.nr}.to_f32" in trace


def test_low_precision_errors():
    if host_isa().avx512f:  # elsewhere int8 GEMMs are refused as such (below)
        with pytest.raises(UnsupportedDTypeError, match="pass dequantize=True"):
            build_gemm(8, 16, 8, dtype="int8", bias=True)
    else:
        with pytest.raises(UnsupportedDTypeError, match="no int8 dot-product TPP on the avx2"):
            build_gemm(8, 16, 8, dtype="int8", bias=True)
    # SVE has no integer dot-product TPP: refused, naming the ISAs that have one
    with pytest.raises(UnsupportedDTypeError, match="int16 ones for AVX2; the sve target"):
        check_low_precision("sve", "int16")
    kernel_plan = plan_gemm(8, 16, 8, "int8")
    assert kernel_plan.kp % 4 == 0 and kernel_plan.b_packed_shape()[-1] == 4
    # a quantized residual's scale and zero point fold into the dequantize rows: nothing
    # that does not commute with them may stand between (a bias, an activation before it)
    for options in ({"bias": True}, {"activation": "relu"}, {"post_activation": "gelu"}):
        with pytest.raises(UnsupportedShapeError, match="a uint8 residual takes no bias"):
            Epilogue(residual=True, residual_dtype="uint8", **options)
    if host_isa().avx512_vnni:
        kernel = build_gemm(8, 16, 8, dtype="int8")
        with pytest.raises(UnsupportedDTypeError, match="A must be uint8"):
            kernel(np.zeros((8, 8), "float32"), np.zeros((8, 16), "int8"))


def test_vnni_packing_layout():
    b = np.arange(5 * 3, dtype="int8").reshape(5, 3)  # K=5, N=3
    packed = pack_b_numpy(b, nr=2, vnni=4)
    assert packed.shape == (2, 2, 2, 4)  # N/nr, K/4 (padded to 8), nr, 4
    np.testing.assert_array_equal(packed[0, 0, 1], b[0:4, 1])
    np.testing.assert_array_equal(packed[1, 1, 0], [b[4, 2], 0, 0, 0])
    assert not packed[1, :, 1].any()  # N padding


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_low_precision_tiles_fit_the_register_file(dtype):
    """Accumulators + B vectors + one broadcast A group per row within 31 zmm registers."""
    for m, n in [(128, 768), (127, 771), (33, 1000), (1024, 1024), (7, 300)]:
        plan = plan_gemm(m, n, 64, dtype)
        nv = -(-plan.nr // 16)
        assert plan.mr * nv + nv + plan.mr <= 31, plan


def test_core_tables_rank_the_same_tiles():
    """Each core family has a measured efficiency for every register tile, and for the
    one-vector tiles only where they were measured (Zen 5); the host's table is Intel's on
    Intel cores and Zen 5's elsewhere."""
    from tpp_tvm.schedules.gemm_plan import (
        CORE_TABLES,
        ONE_VECTOR_TILES,
        REGISTER_TILES,
        core_family,
        core_table,
    )

    for table in (CORE_TABLES["zen"], CORE_TABLES["intel"]):
        tiles = tuple(table.tile_efficiency)
        assert tiles[:len(REGISTER_TILES)] == REGISTER_TILES
        assert set(tiles[len(REGISTER_TILES):]) <= set(ONE_VECTOR_TILES)
        assert all(0 < e <= 1 for e in table.tile_efficiency.values())
    assert set(ONE_VECTOR_TILES) <= set(CORE_TABLES["zen"].tile_efficiency)
    assert not set(ONE_VECTOR_TILES) & set(CORE_TABLES["intel"].tile_efficiency)
    assert core_family("Intel(R) Xeon(R) Platinum 8480+") == "intel"
    assert core_family("AMD EPYC 9R45 64-Core Processor") == "zen"
    assert core_family("unknown") == "zen"
    assert core_table() is CORE_TABLES[core_family(host_isa().model_name)]
    assert core_table("avx2") is CORE_TABLES["avx2"]  # AVX2's own register file's tiles
    lanes = 8
    for mr, nr in CORE_TABLES["avx2"].tile_efficiency:  # accumulators, B row, broadcast
        assert mr * (nr // lanes) + nr // lanes + 1 <= 16, (mr, nr)


def test_small_gemms_k_block_earlier_where_the_core_table_says():
    """A few-row GEMM whose panel is a quarter of the L2 or more is K-blocked on a core
    table with ``small_gemm_rows`` (Intel); past half the L2 every GEMM is."""
    from tpp_tvm.schedules.gemm_plan import core_table, k_block

    l2 = host_isa().l2_bytes or 1024 * 1024
    nr = 64
    k = 3 * l2 // (8 * 4 * nr) // 64 * 64  # an fp32 panel of about 3/8 of the L2
    assert l2 // 4 < 4 * k * nr <= l2 // 2
    assert k_block(k, nr, rows=10**6) is None
    kc = k_block(k, nr, rows=1)
    assert (kc is not None) == (core_table().small_gemm_rows > 0)
    assert kc is None or (k % kc == 0 and kc >= 64)
    assert k_block(4 * k, nr, rows=10**6) is not None  # past half the L2: always


def test_k_blocked_small_gemm_matches_numpy():
    """32 rows with K = 4096: K-blocked on every host (a 1 MiB panel), bias and GELU."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((32, 4096)).astype("float32")
    b = rng.standard_normal((4096, 130)).astype("float32")
    bias = rng.standard_normal(130).astype("float32")
    kern = build_gemm(32, 130, 4096, bias=True, activation="relu")
    np.testing.assert_allclose(kern(a, b, bias), np.maximum(a @ b + bias, 0), rtol=1e-4,
                               atol=1e-3)


def _has_block(sch, name: str) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # TVM's ScheduleError: no block of that name
        return False
    return True


@pytest.mark.parametrize(("m", "n", "k"), [(49, 320, 1152), (3136, 24, 144), (13, 70, 9)])
def test_column_scaled_a(m: int, n: int, k: int) -> None:
    """(A diag(s)) B + bias: the squeeze-excite channel scale applied once to an A that
    several B panels re-read from the L2 (49 x 1152 over 5 panels, 13 x 9 over 2), as
    each row tile is read otherwise (one panel: ``A_colscale`` under the tile loop, never
    a pass of its own over a large A); against numpy."""
    import tvm

    from tpp_tvm.schedules.gemm import gemm_schedule
    from tpp_tvm.schedules.gemm_plan import col_scale_once
    from tpp_tvm.target import target

    sch, plan = gemm_schedule(m, n, k, checks.VECTOR_ISA, a_col_scale=True,
                              epilogue=Epilogue(bias=True))
    once = col_scale_once(plan)
    assert once == (plan.np_ > plan.nr), (m, n, k, plan)
    # the block under the tile loop that ends each tile: the unpadding copy, the epilogue,
    # or (unpadded, the epilogue fused into it) the tensorized GEMM block itself
    last = next(n for n in ("out", "epilogue", "C_o") if _has_block(sch, n))
    tile_loop = sch.get(sch.get_loops(sch.get_sblock(last))[0])
    scale_loop = sch.get(sch.get_loops(sch.get_sblock("A_colscale"))[0])
    assert scale_loop.same_as(tile_loop) != once, \
        "the scaled rows are computed once before the tiles or under the tile loop"
    lib = tvm.compile(sch.mod, target=target(num_cores=1)).jit()
    rng = np.random.default_rng(m)
    a = rng.standard_normal((m, k), dtype="float32")
    b = rng.standard_normal((k, n), dtype="float32")
    s = rng.random(k, dtype="float32")
    bias = rng.standard_normal(n, dtype="float32")
    args = [a, pack_b_numpy(b, plan.nr, "kn", plan.kp), s,
            np.pad(bias, (0, plan.np_ - n)), np.zeros((m, n), "float32")]
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(x)) for x in args]
    lib(*tensors)
    want = (a * s) @ b + bias
    np.testing.assert_allclose(tensors[-1].numpy(), want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_output_tiles_prefetch_the_next_weight_panel() -> None:
    """A GEMM with packed weights: each output tile's reduction loop prefetches (into L2)
    its share of the next weight panel, so the first tile of a panel does not wait on
    memory for cold weights; a K-blocked GEMM's rows likewise fetch the next K chunk.
    Results are unchanged."""
    from tvm import tirx

    from tpp_tvm.intrinsics.prefetch import panel_step

    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 256)).astype("float32")
    b = rng.standard_normal((256, 384)).astype("float32")
    kernel = build_gemm(128, 384, 256, bias=True)
    assert "prefetcht1" in kernel.module.inspect_source("asm")
    bias = rng.standard_normal(384).astype("float32")
    np.testing.assert_allclose(kernel(a, b, bias), a @ b + bias, rtol=1e-4, atol=1e-4)
    blocked = build_gemm(64, 2048, 4096)
    assert blocked.plan.k == 4096 and "prefetcht1" in blocked.module.inspect_source("asm")
    a = rng.standard_normal((64, 4096)).astype("float32")
    b = rng.standard_normal((4096, 2048)).astype("float32")
    want = a.astype(np.float64) @ b
    assert np.abs(blocked(a, b) - want).max() <= 1e-5 * np.abs(want).max()
    v = tirx.Var("v", "int32")
    assert panel_step(tirx.floordiv(v, 32) * 49152 + 7, v) == (32, 49152)
    assert panel_step(tirx.floormod(v, 4) * 64, v) is None  # rows, not panels


def test_int16_gemm_on_avx512_without_vnni():
    """AVX-512 CPUs before Cascade Lake (Skylake-SP) have no VNNI: their int8 layers run on
    s16 pairs (AVX512BW ``vpmaddwd`` on zmm), exact; run where the host has AVX512BW."""
    skylake = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512",
                                 "keys": ["tpp", "cpu"], "num-cores": 1})
    kernel = build_gemm(13, 70, 30, dtype="int16", target=skylake)
    asm = kernel.module.inspect_source("asm")
    assert "vpmaddwd" in asm and "%zmm" in asm and "vpdpbusd" not in asm
    if not (host_isa().avx512f and host_isa().avx512bw):
        return  # compiled and checked above; running it needs AVX512BW
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (13, 30)).astype(np.int16)
    b = rng.integers(-128, 128, (30, 70)).astype(np.int16)
    got = kernel.run_packed(a, kernel.pack_b(b))
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


def test_row_padding_tests_rows_only() -> None:
    """A's zero padding tests only the dims it pads: a test on the unpadded K, true for
    every element, stayed in the copy's vector code (784 x 128 x 512 int8 GEMM, int32 out:
    47 -> 40 us on the AMX Xeon)."""
    from tpp_tvm.schedules.gemm import gemm_schedule

    sch, plan = gemm_schedule(45, 64, 64, "amx", dtype="int8", dequantize=True)
    assert plan.mp > 40 and plan.kp == 64
    block = sch.get(sch.get_sblock("A_pad"))
    row, col = (iv.var for iv in block.iter_vars)
    tested = []
    tvm_ffi.structural_walk(block.body, [(tvm.tirx.LT, lambda node: tested.append(node.a))])
    assert tested and all(t.same_as(row) for t in tested), tested
