"""Low-precision TPPs against numpy: bf16 and u8 x s8 contractions (VNNI-packed B, AVX-512
BF16/VNNI dot products), s16 x s16 ones (AVX2 vpmaddwd), fp32 <-> bf16 conversion,
quantize/requantize/dequantize.

Inputs are exact in their dtypes and the reference multiplies them in float64, so int8
results are bit-exact and bf16 contractions differ from it only by fp32 accumulation.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tpp_harness as h
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from tpp_tvm.errors import UnsupportedDTypeError, UnsupportedShapeError
from tpp_tvm.intrinsics import TPPSpec
from tpp_tvm.intrinsics.registry import implements, low_precision_catalogue
from tpp_tvm.intrinsics.spec import QUANT_DTYPES
from tpp_tvm.target import host_isa, target

DOT_DTYPES = [("bfloat16", None), ("uint8", "int8")]


@pytest.mark.requires_avx512_bf16
@pytest.mark.requires_avx512_vnni
@pytest.mark.parametrize("spec", [s for s in low_precision_catalogue()
                                  if implements(s, "avx512")], ids=lambda s: s.name("avx512"))
def test_low_precision_catalogue_runs_like_numpy(spec: TPPSpec) -> None:
    h.check(spec, isa="avx512")


@pytest.mark.requires_avx2
@pytest.mark.parametrize("spec", [s for s in low_precision_catalogue()
                                  if implements(s, "avx2")], ids=lambda s: s.name("avx2"))
def test_avx2_low_precision_catalogue_runs_like_numpy(spec: TPPSpec) -> None:
    h.check(spec, isa="avx2")


@pytest.mark.requires_avx2
@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    op=st.sampled_from(["gemm", "brgemm", "conv_brgemm"]),
    beta=st.sampled_from([0, 1]),
    m=st.integers(2, 8),
    n=st.integers(2, 40),  # full vectors, tails and tail-only rows
    kgroups=st.integers(2, 12),
    batch=st.integers(1, 3),
    stride_groups=st.integers(1, 3),
)
def test_s16_dot_contractions_on_avx2(op, beta, m, n, kgroups, batch, stride_groups) -> None:
    """AVX2's int8 contractions: s16 pairs (vpmaddwd) summed into int32, exactly."""
    conv = op == "conv_brgemm"
    h.check(TPPSpec(op, "int16", m=m, n=n, k=kgroups * 2, beta=beta,
                    batch=1 if op == "gemm" else batch if conv else max(batch, 2),
                    stride=stride_groups * 2 if conv else 1), isa="avx2")


@pytest.mark.requires_avx512_bf16
@pytest.mark.requires_avx512_vnni
@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    dtypes=st.sampled_from(DOT_DTYPES),
    op=st.sampled_from(["gemm", "brgemm", "conv_brgemm"]),
    beta=st.sampled_from([0, 1]),
    m=st.integers(2, 12),
    n=st.integers(2, 70),  # full vectors, tails and tail-only rows
    kgroups=st.integers(2, 12),
    batch=st.integers(1, 3),
    stride_groups=st.integers(1, 3),
)
def test_dot_contractions(dtypes, op, beta, m, n, kgroups, batch, stride_groups) -> None:
    """conv_brgemm: output pixels ``stride`` elements apart in one input row (a whole
    number of VNNI groups: the channels are padded), batched over filter rows."""
    a, b = dtypes
    vnni = 2 if a == "bfloat16" else 4
    conv = op == "conv_brgemm"
    h.check(TPPSpec(op, a, b_dtype=b, m=m, n=n, k=kgroups * vnni, beta=beta,
                    batch=1 if op == "gemm" else batch if conv else max(batch, 2),
                    stride=stride_groups * vnni if conv else 1))


@pytest.mark.requires_avx512_bf16
@settings(max_examples=5, deadline=None, derandomize=True)
@given(pair=st.sampled_from([("float32", "bfloat16"), ("bfloat16", "float32")]),
       m=st.integers(2, 12), n=st.integers(2, 70))
def test_bf16_conversion(pair, m, n) -> None:
    h.check(TPPSpec("copy", pair[0], m=m, n=n, out_dtype=pair[1]))


@pytest.mark.requires_avx512_bf16
@settings(max_examples=8, deadline=None, derandomize=True)
@given(op=st.sampled_from(["relu", "gelu", "tanh", "sigmoid", "exp", "negate", "square"]),
       m=st.integers(2, 8), n=st.integers(2, 70))
def test_bf16_unary(op: str, m: int, n: int) -> None:
    """bf16 in and out, fp32 math in between (widened on load, rounded on store)."""
    h.check(TPPSpec(op, "bfloat16", m=m, n=n))


@pytest.mark.requires_avx512_bf16
@settings(max_examples=8, deadline=None, derandomize=True)
@given(op=st.sampled_from(["add", "sub", "mul", "max", "min"]),
       bcast=st.sampled_from(["none", "row", "col", "scalar"]),
       m=st.integers(2, 8), n=st.integers(2, 70))
def test_bf16_binary(op: str, bcast: str, m: int, n: int) -> None:
    h.check(TPPSpec(op, "bfloat16", m=m, n=n, bcast=bcast))


@pytest.mark.requires_avx512
@settings(max_examples=8, deadline=None, derandomize=True)
@given(case=st.sampled_from([(op, a, b) for op, pairs in QUANT_DTYPES.items()
                             for a, b in pairs]),
       m=st.integers(2, 12), n=st.integers(2, 70))
def test_quantization(case, m, n) -> None:
    op, a, b = case
    h.check(TPPSpec(op, a, m=m, n=n, out_dtype=b))


@pytest.mark.requires_avx512
def test_quantize_rounds_half_to_even_and_saturates() -> None:
    """ONNX QuantizeLinear semantics: 2.5 -> 2, 3.5 -> 4, out-of-range values saturate."""
    import numpy as np

    values = [[2.5, 3.5, -0.5, 300.0, -7.0], [0.5, 1.5, 254.5, 255.5, 128.0],
              [1e10, -1e10, 3e9, -3e9, 126.5]]  # beyond int32: still saturated
    expected = {"uint8": [[2, 4, 0, 255, 0], [0, 2, 254, 255, 128], [255, 0, 255, 0, 126]],
                "int8": [[2, 4, 0, 127, -7], [0, 2, 127, 127, 127], [127, -128, 127, -128, 126]]}
    for n in (5, 20):  # the masked tail alone; a whole vector and a tail
        for dtype, want in expected.items():
            spec = TPPSpec("quantize", "float32", m=3, n=n, out_dtype=dtype)
            mod, _, _ = h.build(spec)
            x = np.array([row * (n // 5) for row in values], "float32")
            args = [x, np.ones(n, "float32"), np.zeros(n, "float32"), np.zeros((3, n), dtype)]
            tensors = [tvm.runtime.tensor(v) for v in args]
            mod(*tensors)
            np.testing.assert_array_equal(tensors[-1].numpy(),
                                          [row * (n // 5) for row in want])


#: Values a quantization must round half to even and saturate (1e10, 3e9: beyond int32).
_EDGES = [2.5, 3.5, -0.5, 300.0, -7.0, 0.5, 1.5, 254.5, 255.5, 128.0, 1e10, -1e10, 3e9, -3e9,
          126.5, -128.5]


def _quantized(x: np.ndarray, dtype: str) -> np.ndarray:
    lo, hi = (0, 255) if dtype == "uint8" else (-128, 127)
    return np.clip(np.rint(x.astype(np.float64)), lo, hi).astype(dtype)


@pytest.mark.requires_avx512
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_rows_of_32_quantize_with_packs(dtype: str) -> None:
    """Rows of whole 32-column chunks (every int8 tile epilogue) narrow with
    ``vpackssdw`` + a byte pack + ``vpermd``, not a ``vpmovdb`` per vector, with the same
    rounding and saturation (below the range by the packs' saturation alone)."""
    spec = TPPSpec("quantize", "float32", m=3, n=64, out_dtype=dtype)
    asm = h.assembly(spec)
    assert "vpackssdw" in asm and "vpermd" in asm and "vpmovdb" not in asm
    mod, _, _ = h.build(spec)
    x = np.resize(np.array(_EDGES, "float32"), (3, 64)) * np.float32(1.0)
    x[1] = -x[1]
    args = [x, np.ones(64, "float32"), np.zeros(64, "float32"), np.zeros((3, 64), dtype)]
    tensors = [tvm.runtime.tensor(v) for v in args]
    mod(*tensors)
    np.testing.assert_array_equal(tensors[-1].numpy(), _quantized(x, dtype))


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_packs_have_an_any_cpu_form(dtype: str) -> None:
    """The packs' generic form (what an emulated tile kernel's epilogue compiles to on a
    host without AVX-512) computes what the instructions do: both against numpy, and
    against each other where the host has AVX-512."""
    import tvm_ffi

    from tpp_tvm.intrinsics import precision_template
    from tpp_tvm.intrinsics.registry import vector_isa

    spec = TPPSpec("requantize", "int32", m=2, n=32, out_dtype=dtype)
    func = precision_template.quant_impl(spec, vector_isa("avx512"))

    def generic(call):
        form = precision_template.generic_form(call)
        return call if form is None else form

    forms = {"generic": func.with_body(tvm_ffi.structural_map(func.body,
                                                              [(tvm.ir.Call, generic)]))}
    if host_isa().avx512f and host_isa().avx512bw:
        forms["avx512"] = func
    assert "packssdw" not in forms["generic"].script()
    rng = np.random.default_rng(5)
    x = rng.integers(-70000, 70000, (2, 32)).astype("int32")
    scale = rng.uniform(0.001, 0.01, 32).astype("float32")
    offset = rng.uniform(-20, 150, 32).astype("float32")
    want = _quantized(x * scale.astype(np.float64) + offset, dtype)
    for name, f in forms.items():
        built = tvm.compile(tvm.IRModule({"main": f}), target=target(num_cores=1)).jit()
        tensors = [tvm.runtime.tensor(v) for v in (x, scale, offset, np.zeros((2, 32), dtype))]
        built(*tensors)
        np.testing.assert_array_equal(tensors[-1].numpy(), want, err_msg=name)


@pytest.mark.requires_avx2
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("op", ["quantize", "requantize"])
def test_quantization_rounds_in_the_conversion(isa: str, op: str) -> None:
    """The implementations clamp, then round and convert in one ``vcvtps2dq`` (LLVM
    ``lrint``): no ``vrndscaleps``/``vroundps`` and no truncating conversion after it
    (two of a requantize epilogue's nine vector-port uops), and no scalar ``lrintf``."""
    if isa == "avx512" and not host_isa().avx512f:
        pytest.skip(f"compiling for the host's AVX-512 ({host_isa().summary()})")
    source = "float32" if op == "quantize" else "int32"
    asm = h.assembly(TPPSpec(op, source, m=2, n=40, out_dtype="uint8"), isa)
    assert "vcvtps2dq" in asm
    for slow in ("vrndscaleps", "vroundps", "vcvttps2dq", "lrint"):
        assert slow not in asm, slow


@pytest.mark.requires_avx512_bf16
@pytest.mark.requires_avx512_vnni
@pytest.mark.parametrize(("spec", "instr"), [
    (TPPSpec("gemm", "bfloat16", m=4, n=37, k=16, beta=0), "vdpbf16ps"),
    (TPPSpec("gemm", "uint8", b_dtype="int8", m=4, n=40, k=16, beta=0), "vpdpbusd"),
    (TPPSpec("copy", "float32", m=2, n=40, out_dtype="bfloat16"), "vcvtneps2bf16"),
    (TPPSpec("gelu", "bfloat16", m=2, n=40), "vcvtneps2bf16"),
], ids=lambda v: v if isinstance(v, str) else v.name("avx512"))
def test_dot_steps_are_single_instructions(spec: TPPSpec, instr: str) -> None:
    """The imported LLVM steps inline to the instruction on zmm registers (no calls left):
    the host target (mcpu) must have AVX512_BF16/VNNI to inline them into."""
    asm = h.assembly(spec)
    body = [line for line in asm.splitlines() if not line.lstrip().startswith((".", "#"))]
    assert any(instr in line and "zmm" in line for line in body), instr
    assert not [line for line in body if re.search(r"call\w*\s+\S*tpp_", line)]
    assert any("{%k" in line for line in body), "the N tail is not masked"


@pytest.mark.parametrize(("make", "error", "words"), [
    (lambda: TPPSpec("gemm", "bfloat16", m=2, n=16, k=3), UnsupportedShapeError,
     ["k=3", "VNNI factor 2"]),
    (lambda: TPPSpec("gemm", "uint8", b_dtype="int8", m=2, n=16, k=6), UnsupportedShapeError,
     ["k=6", "VNNI factor 4"]),
    (lambda: TPPSpec("gemm", "int8", m=2, n=16, k=8), UnsupportedDTypeError,
     ["int8 x int8", "uint8 x int8"]),
    (lambda: TPPSpec("conv_brgemm", "uint8", b_dtype="int8", m=2, n=16, k=8, batch=2,
                     stride=6), UnsupportedShapeError, ["conv_brgemm", "stride 6", "VNNI"]),
    (lambda: TPPSpec("quantize", "float32", m=2, n=16, out_dtype="int32"),
     UnsupportedDTypeError, ["quantize", "float32->int32", "float32->uint8"]),
    (lambda: TPPSpec("relu", m=2, n=16, b_dtype="int8"), UnsupportedDTypeError, ["relu"]),
])
def test_invalid_low_precision_specs(make, error, words) -> None:
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_names_say_both_dtypes() -> None:
    spec = TPPSpec("gemm", "uint8", b_dtype="int8", m=4, n=64, k=64, beta=0)
    assert spec.name("avx512") == "tpp.gemm.u8i8.avx512.m4n64k64.beta0"
    assert TPPSpec("brgemm", "bfloat16", m=4, n=32, k=8, batch=2).name(
        "avx512") == "tpp.brgemm.bf16.avx512.m4n32k8b2"


def test_dot_microkernel_reduction_loop_steps_pointers():
    """The dot-product microkernel walks filter rows outer and VNNI groups inner on 64-bit
    offsets: no division per step (a flat loop with udiv/urem cost AVX2 s16 convolutions a
    third of their rate); on AVX2 only a batch-reduce is kept from unrolling."""
    from tpp_tvm.intrinsics.avx2 import AVX2
    from tpp_tvm.intrinsics.llvm_ir import NO_UNROLL_LOOP, dot_brgemm

    conv = AVX2.dot_brgemm("int16", "int16", 4, 16, 96, 3, 0)
    gemm = AVX2.dot_brgemm("int16", "int16", 4, 16, 512, 1, 0)
    for fn in (conv, gemm):
        assert "udiv" not in fn.definition and "urem" not in fn.definition
        assert "getelementptr inbounds i16, ptr %par0, i64 %ga" in fn.definition
    assert NO_UNROLL_LOOP in conv.definition and any("unroll.disable" in d for d in conv.declares)
    assert NO_UNROLL_LOOP not in gemm.definition
    # the AVX-512 kernels (32 registers, not measured) keep LLVM's unrolling
    assert NO_UNROLL_LOOP not in dot_brgemm("uint8", "int8", 4, 64, 96, 3, 0).definition


def test_avx2_int16_gemms_rank_their_own_tiles():
    """AVX2's s16 GEMMs choose from their own tile table (3x24, fine in fp32, is the slowest
    s16 tile); fp32 keeps the fp32 one."""
    from tpp_tvm.schedules.gemm_plan import AVX2_INT16_TILES, core_table, plan_gemm

    table = core_table("avx2")
    assert table.tiles("int16") is AVX2_INT16_TILES
    assert table.tiles("float32") is table.tile_efficiency
    assert (plan_gemm(196, 1024, 256, "int16", "avx2").mr,
            plan_gemm(196, 1024, 256, "int16", "avx2").nr) == (4, 16)
