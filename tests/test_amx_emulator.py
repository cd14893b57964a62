"""The software model of the AMX tile unit (``intrinsics/amx_emulator``): its instructions
against numpy, the faults AMX would raise, and what it caught: tile GEMMs whose epilogue
slices fell out of step with each other (wrong rows for K of 3, 5, 6 or 7 tile steps), and
whole bf16 models on tiles against ONNX Runtime."""

from __future__ import annotations

import ctypes
import re

import ml_dtypes
import numpy as np
import pytest
import tpp_harness as h
from scipy.special import erf

from tpp_tvm.errors import ExecutionError, UnsupportedISAError
from tpp_tvm.intrinsics import amx_emulator
from tpp_tvm.intrinsics.llvm_ir import amx_brgemm, amx_tile_config, module_text
from tpp_tvm.target import host_isa, target, tiles_emulated

HOST = host_isa()
pytestmark = pytest.mark.skipif(
    not (HOST.avx2 and HOST.fma),
    reason=f"the tile model runs beside AVX-512 or AVX2 kernels ({HOST.summary()})")


def _config(m: int, n: int) -> ctypes.Array:
    text, _ = amx_tile_config(m, n)
    return (ctypes.c_uint8 * 64)(*(int(b.split()[1]) for b in text.strip("[]").split(",")))


def _tile_product(instruction: str, a: np.ndarray, b_vnni: np.ndarray) -> np.ndarray:
    """One 16 x 16 C tile: tilezero, A and B tile loads, the product, the store."""
    lib = amx_emulator.library()
    c = np.zeros((16, 16), np.float32 if instruction == "tdpbf16ps" else np.int32)
    lib.tpp_amx_emu_ldtilecfg(_config(16, 16))
    lib.tpp_amx_emu_tilezero(0)
    lib.tpp_amx_emu_tileloadd64(1, a.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(64))
    lib.tpp_amx_emu_tileloadd64(2, b_vnni.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(64))
    getattr(lib, f"tpp_amx_emu_{instruction}")(0, 1, 2)
    lib.tpp_amx_emu_tilestored64(0, c.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(64))
    lib.tpp_amx_emu_tilerelease()
    amx_emulator.check(instruction)
    return c


def _vnni(b: np.ndarray, v: int) -> np.ndarray:
    """B (K x N) in VNNI rows: row g holds B[g v : g v + v, j] for each column j in turn."""
    k, n = b.shape
    return np.ascontiguousarray(b.reshape(k // v, v, n).transpose(0, 2, 1).reshape(k // v, n * v))


def test_tile_products_match_numpy() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 32)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(_tile_product("tdpbf16ps", a, _vnni(b, 2)), want,
                               rtol=1e-5, atol=1e-5)
    a8 = rng.integers(0, 256, (16, 64)).astype(np.uint8)
    b8 = rng.integers(-128, 128, (64, 16)).astype(np.int8)
    np.testing.assert_array_equal(_tile_product("tdpbusd", a8, _vnni(b8, 4)),
                                  a8.astype(np.int64) @ b8.astype(np.int64))
    s8 = rng.integers(-128, 128, (16, 64)).astype(np.int8)  # both signed (tdpbssd)
    np.testing.assert_array_equal(_tile_product("tdpbssd", s8, _vnni(b8, 4)),
                                  s8.astype(np.int64) @ b8.astype(np.int64))


def test_faults_are_reported_as_amx_would_raise_them() -> None:
    lib = amx_emulator.library()
    amx_emulator.reset()
    lib.tpp_amx_emu_tilerelease()
    lib.tpp_amx_emu_tdpbf16ps(0, 1, 2)
    with pytest.raises(ExecutionError, match="no tile configuration loaded"):
        amx_emulator.check("a product before ldtilecfg")
    lib.tpp_amx_emu_ldtilecfg(_config(16, 16))  # tiles 0 (C), 1 (A), 2 (B)
    lib.tpp_amx_emu_tdpbf16ps(1, 0, 7)
    with pytest.raises(ExecutionError, match="tile 7 is not in the loaded configuration"):
        amx_emulator.check("a product on an unconfigured tile")
    bad = _config(16, 16)
    bad[48] = 17  # 17 rows in tile 0
    lib.tpp_amx_emu_ldtilecfg(bad)
    with pytest.raises(ExecutionError, match="tile 0 has 17 rows"):
        amx_emulator.check("a configuration of 17 rows")
    lib.tpp_amx_emu_tilerelease()
    amx_emulator.check("nothing")  # reported faults are cleared


def test_tile_instructions_are_renamed_and_nothing_else() -> None:
    text = module_text(amx_brgemm("bfloat16", "bfloat16", 32, 32, 32, 1, 0))
    emulated = amx_emulator.emulate_tile_instructions(text)
    assert "@llvm.x86.tdpbf16ps" in text and "@llvm.x86.t" not in emulated
    assert "@llvm.x86.ldtilecfg" not in emulated and "@tpp_amx_emu_ldtilecfg" in emulated
    assert "@llvm.prefetch.p0" in emulated  # not a tile instruction
    renamed = [line for line in emulated.splitlines()
               if line.startswith("declare") and "tpp_amx_emu_" in line]
    assert len(renamed) == 6 and not any("immarg" in line for line in renamed)  # no tdpbusd


def test_avx512_dot_products_become_generic_code_for_hosts_without_avx512() -> None:
    """On an AVX2 host the kernels around the tiles lose their AVX-512 instructions: the dot
    products become calls of generic-IR definitions in the text, the functions' features
    lose AVX-512 and AMX, and an AVX-512 intrinsic without a generic form is refused by
    name (LLVM would abort the process on it)."""
    from tpp_tvm.intrinsics.llvm_ir import dot_brgemm

    for a, b, name in (("bfloat16", "bfloat16", "dpbf16ps"), ("uint8", "int8", "vpdpbusd")):
        text = module_text(dot_brgemm(a, b, 2, 32, 4, 1, 0), amx_brgemm(a, b, 32, 32, 32, 1, 0))
        kept = amx_emulator.emulate_tile_instructions(text)
        assert "@llvm.x86.avx512" in kept and "+avx512f" in kept  # AVX-512 hosts run them
        generic = amx_emulator.emulate_tile_instructions(text, vector_instructions=True)
        features = ",".join(re.findall(r'"target-features"="([^"]*)"', generic))
        assert "@llvm.x86." not in generic and "avx512" not in features and "amx" not in features
        assert generic.count("define linkonce_odr <16 x ") == 1  # defined once, called 2x2
        assert generic.count(f"call <16 x float> @tpp_amx_emu_{name}(") + generic.count(
            f"call <16 x i32> @tpp_amx_emu_{name}(") == 4
    int16 = module_text(dot_brgemm("int16", "int16", 2, 16, 4, 1, 0))
    with pytest.raises(UnsupportedISAError, match=r"llvm\.x86\.avx512\.pmaddw\.d\.512"):
        amx_emulator.emulate_tile_instructions(int16, vector_instructions=True)


def test_bf16_rounding_routine_rounds_to_nearest_even() -> None:
    """``__truncsfbf2``, which LLVM calls for fp32 -> bf16 without AVX512_BF16: ties to
    even, overflow to inf, NaN quiet, as ``ml_dtypes`` (and ``vcvtneps2bf16``) round."""
    fn = amx_emulator.library().__truncsfbf2
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x80008000,
                     0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000], np.uint32)
    rng = np.random.default_rng(0)
    values = np.concatenate([bits.view(np.float32),
                             rng.standard_normal(200).astype(np.float32) * 1e3])
    got = np.array([np.float32(fn(float(v))).view(np.uint32) & 0xFFFF for v in values],
                   np.uint16)
    with np.errstate(invalid="ignore"):  # numpy warns casting NaN
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(got[~finite].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert (got[~finite] & 0x40).all()  # quiet


def test_emulated_tiles_need_the_amx_target() -> None:
    with pytest.raises(UnsupportedISAError, match="emulated AMX tiles need target 'amx'"):
        target("avx512", emulate_tiles=True)
    assert tiles_emulated(target("amx", emulate_tiles=True))
    assert not tiles_emulated(target("amx")) and not tiles_emulated(None)


def _activation(name: str, x: np.ndarray) -> np.ndarray:
    return {"gelu": lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))), "tanh": np.tanh,
            "sigmoid": lambda v: 1 / (1 + np.exp(-v))}[name](x)


@pytest.mark.parametrize(("k", "activation"), [(32, "gelu"), (96, "tanh"), (160, "sigmoid"),
                                               (192, "gelu"), (224, "tanh"), (256, "gelu")])
def test_epilogue_slices_stay_in_step_for_any_k(k: int, activation: str) -> None:
    """1, 3, 5, 6, 7 and 8 tile steps per block: the previous block's epilogue runs in
    slices between them, and its copy-out loop (32 rows) must not copy a row before the
    activation loop (16 iterations of 2 rows) wrote it. Row 20 of every block was wrong for
    K = 96 on AMX before the slices were cut by a shared row share."""
    from tpp_tvm.kernels import build_gemm

    m, n = 40, 64
    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k), dtype="float32")
    b = rng.standard_normal((k, n), dtype="float32")
    bias = rng.standard_normal(n).astype("float32")
    kernel = build_gemm(m, n, k, dtype="bfloat16", target=h.tile_target(1), bias=True,
                        activation=activation)
    x = (a.astype(ml_dtypes.bfloat16).astype(np.float64)
         @ b.astype(ml_dtypes.bfloat16).astype(np.float64)) + bias
    np.testing.assert_allclose(kernel(a, b, bias), _activation(activation, x),
                               rtol=1e-4, atol=1e-3)


def test_int8_epilogue_slices_stay_in_step() -> None:
    """u8 x s8 with dequantization, bias and GELU, 3 tile steps (K = 192)."""
    from tpp_tvm.kernels import build_gemm

    m, n, k = 40, 64, 192
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    scale = rng.uniform(1e-4, 2e-4, n).astype("float32")
    offset = rng.standard_normal(n).astype("float32")
    bias = rng.standard_normal(n).astype("float32")
    kernel = build_gemm(m, n, k, dtype="int8", target=h.tile_target(2), dequantize=True,
                        bias=True, activation="gelu")
    x = (a.astype(np.int64) @ b.astype(np.int64)) * scale + offset + bias
    np.testing.assert_allclose(kernel(a, b, bias, scale=scale, offset=offset),
                               _activation("gelu", x), rtol=1e-5, atol=1e-4)


@pytest.mark.requires_torch
@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize(("name", "args", "rtol"), [
    ("bert", {"layers": 1, "hidden": 96, "heads": 2, "intermediate": 192, "seq": 40}, 1e-2),
    # head size 64: the attention's two products on tiles too (40 queries as 64, keys 64)
    ("bert", {"layers": 1, "hidden": 128, "heads": 2, "intermediate": 256, "seq": 40}, 1e-2),
    ("mlp", {"batch": 40, "dims": (96, 130, 64)}, 1e-2),
    # 1x1 convolutions (with residual epilogues) as tile GEMMs; eleven layers of bf16
    # activations: 8e-3 measured, as much as OpenVINO's bf16 ResNet-50 (1e-2)
    ("resnet50", {"image": 32, "width": 16, "blocks": (1, 1, 1, 1), "classes": 10}, 2e-2),
], ids=["bert", "bert-attention", "mlp", "resnet"])
def test_bf16_models_on_tiles_match_onnxruntime(name: str, args: dict, rtol: float) -> None:
    """Whole bf16 models with every dense layer on tiles (K = 96 and 192: 3 and 6 steps),
    and attention where the head size is whole 32s, within bf16's error of ONNX Runtime's
    fp32 result."""
    from tpp_tvm import models
    from tpp_tvm.compiled import compile_onnx
    from tpp_tvm.onnxruntime_ref import run_onnxruntime

    model = models.GENERATORS[name](**args)
    inputs = models.example_inputs(model)
    compiled = compile_onnx(model, target=h.tile_target(2), precision="bf16")
    lowered = compiled.report_data["lowered"]
    assert any(key.endswith("[bf16, amx]") for key in lowered), lowered
    attention = [key for key in lowered if key.startswith("tpp.attention")]
    assert all(key.endswith("[bf16, amx]") == (args.get("hidden", 0) // args.get("heads", 1)
                                                % 32 == 0) for key in attention), lowered
    before = amx_emulator.products() if compiled.report_data.get("tiles_emulated") else 0
    got = compiled(*inputs.values())[0]
    want = run_onnxruntime(model, inputs)[0]
    assert np.abs(got - want).max() <= rtol * np.abs(want).max()
    if compiled.report_data.get("tiles_emulated"):
        assert amx_emulator.products() > before


@pytest.mark.requires_torch
@pytest.mark.requires_onnxruntime
def test_llama_attention_on_tiles_matches_onnxruntime(tmp_path) -> None:
    """A transformers Llama layer (grouped-query attention 4/2, head size 32, a causal mask
    per query, RoPE) in bf16: its attention on tiles, 40 queries run as 64, within bf16's
    error of ONNX Runtime's fp32 result."""
    import onnx
    import torch
    import transformers

    from tpp_tvm.compiled import compile_onnx
    from tpp_tvm.onnxruntime_ref import run_onnxruntime

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    config._attn_implementation = "eager"
    llama = transformers.LlamaModel(config).eval()

    class FirstOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = llama

        def forward(self, ids, mask):
            return self.inner(ids, mask)[0]

    feeds = {"input_ids": np.random.default_rng(0).integers(0, 100, (1, 40)),
             "attention_mask": np.ones((1, 40), np.int64)}
    path = tmp_path / "llama.onnx"
    with torch.no_grad():
        torch.onnx.export(FirstOutput(), tuple(torch.from_numpy(v) for v in feeds.values()),
                          str(path), input_names=list(feeds), opset_version=17, dynamo=False)
    model = onnx.load(str(path))
    compiled = compile_onnx(model, target=h.tile_target(2), precision="bf16")
    lowered = compiled.report_data["lowered"]
    assert lowered.get("tpp.attention_mask_mulscale_gqa [bf16, amx]") == 1, lowered
    got = compiled(**feeds)[0]
    if compiled.report_data.get("tiles_emulated"):
        amx_emulator.check("Llama layer")
    want = run_onnxruntime(model, feeds)[0]
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
