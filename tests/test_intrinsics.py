"""Tests of the TPP intrinsics: registration, tensorize, build and run against numpy.

Every kernel here is a TPP workload tensorized with its registered intrinsic
(``tpp_harness.build``), so what runs is exactly the AVX-512 implementation. Each example
compiles a kernel (~0.1-0.7 s), so the property tests draw few, deterministic examples.

Tiles are drawn with m, n >= 2, and contractions with k >= 2 and batch >= 2 (batch-reduce
over one block is a gemm): tensorize cannot match a tile with a unit-extent loop, because
blockizing the workload drops unit loops while the description keeps their iterators.
"""

from __future__ import annotations

import re

import checks
import pytest
import tpp_harness as h
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import s_tir

from tpp_tvm.errors import (
    TPPError,
    UnsupportedDTypeError,
    UnsupportedISAError,
    UnsupportedShapeError,
)
from tpp_tvm.intrinsics import OPS, TPPSpec, intrinsic, registered
from tpp_tvm.intrinsics.reference import BLOCK, workload
from tpp_tvm.intrinsics.registry import catalogue
from tpp_tvm.intrinsics.spec import BCASTS

few = settings(max_examples=5, deadline=None, derandomize=True)

M = st.integers(2, 20)
N = st.integers(2, 70)  # crosses 16-lane vectors: full vectors, tails and tail-only rows


def _ops(kind: str) -> list[str]:
    return sorted(op for op, d in OPS.items() if d.kind == kind)


# -- every primitive of the set --------------------------------------------------------


@pytest.mark.parametrize("spec", catalogue(), ids=lambda s: s.name(checks.VECTOR_ISA))
def test_catalogue_runs_like_numpy(spec: TPPSpec) -> None:
    h.check(spec)


# -- properties over shapes, per kind --------------------------------------------------


@few
@given(op=st.sampled_from(_ops("unary")), m=M, n=N)
def test_unary(op: str, m: int, n: int) -> None:
    h.check(TPPSpec(op, m=m, n=n))


@few
@given(op=st.sampled_from(_ops("unary_bwd")), m=M, n=N)
def test_unary_bwd(op: str, m: int, n: int) -> None:
    h.check(TPPSpec(op, m=m, n=n))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(op=st.sampled_from(_ops("binary")), bcast=st.sampled_from(BCASTS), m=M, n=N)
def test_binary(op: str, bcast: str, m: int, n: int) -> None:
    h.check(TPPSpec(op, m=m, n=n, bcast=bcast))


@few
@given(bcast=st.sampled_from(BCASTS), m=M, n=N)
def test_muladd(bcast: str, m: int, n: int) -> None:
    h.check(TPPSpec("muladd", m=m, n=n, bcast=bcast))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(op=st.sampled_from(_ops("reduce")), m=M, n=N)
def test_reduce(op: str, m: int, n: int) -> None:
    h.check(TPPSpec(op, m=m, n=n))


@few
@given(
    op=st.sampled_from(_ops("transform")),
    dtype=st.sampled_from(["float32", "bfloat16", "int8"]),
    m=M,
    n=N,
)
def test_transform(op: str, dtype: str, m: int, n: int) -> None:
    h.check(TPPSpec(op, dtype, m=m, n=n))


@pytest.mark.parametrize(
    ("dtype", "m", "n"),
    [
        ("float32", 16, 16),  # one register block
        ("float32", 16, 37),  # blocks and a right edge
        ("float32", 33, 20),  # bottom and corner edges
        ("int32", 20, 70),
        ("float32", 8, 37),  # thin tiles take the loop
        ("float32", 64, 5),
    ],
)
def test_transpose_blocks_edges_and_thin_tiles(dtype: str, m: int, n: int) -> None:
    h.check(TPPSpec("transpose", dtype, m=m, n=n))


@few
@given(
    case=st.sampled_from(
        [
            ("float32", "float16"),
            ("float16", "float32"),
            ("float32", "int32"),
            ("int32", "float32"),
            ("int8", None),
            ("uint8", None),
        ]
    ),
    m=M,
    n=N,
)
def test_copy_converts_and_moves(case: tuple[str, str | None], m: int, n: int) -> None:
    dtype, out_dtype = case
    h.check(TPPSpec("copy", dtype, m=m, n=n, out_dtype=out_dtype))


@few
@given(dtype=st.sampled_from(["float32", "float16", "int8", "int32"]), m=M, n=N)
def test_zero(dtype: str, m: int, n: int) -> None:
    h.check(TPPSpec("zero", dtype, m=m, n=n))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    op=st.sampled_from(["gemm", "brgemm", "conv_brgemm"]),
    beta=st.sampled_from([0, 1]),
    m=st.integers(2, 12),
    n=N,
    k=st.integers(2, 40),
    batch=st.integers(2, 3),
    stride=st.integers(1, 2),
)
def test_contractions(op: str, beta: int, m: int, n: int, k: int, batch: int,
                      stride: int) -> None:
    h.check(TPPSpec(op, m=m, n=n, k=k, beta=beta, batch=1 if op == "gemm" else batch,
                    stride=stride if op == "conv_brgemm" else 1))


@pytest.mark.parametrize(
    "spec",
    [
        TPPSpec("gelu", m=3, n=21),
        TPPSpec("relu_inv", m=4, n=17),
        TPPSpec("add", m=3, n=21, bcast="row"),
        TPPSpec("mul", m=3, n=21, bcast="col"),
        TPPSpec("muladd", m=2, n=33, bcast="none"),
        TPPSpec("reduce_max_cols", m=3, n=21),
        TPPSpec("reduce_sumsq_rows", m=5, n=19),
        TPPSpec("transpose", m=3, n=21),
        TPPSpec("zero", m=2, n=5),
    ],
    ids=lambda s: s.name(checks.VECTOR_ISA),
)
def test_tiles_of_a_larger_tensor(spec: TPPSpec) -> None:
    """The TPP applied to every tile of a bigger tensor: leading dimensions and offsets."""
    got, want = h.run_tiled(spec)
    h.assert_matches(spec, got, want)


# -- what the user sees when asking for something unsupported --------------------------


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda: TPPSpec("softmax"), TPPError, ["'softmax'", "the set is"]),
        (lambda: TPPSpec("gelu", "float64"), UnsupportedDTypeError, ["gelu", "float64"]),
        (lambda: TPPSpec("relu", m=0, n=4), UnsupportedShapeError, ["relu", "0x4"]),
        (lambda: TPPSpec("relu", m=2, n=4, bcast="row"), UnsupportedShapeError, ["relu"]),
        (lambda: TPPSpec("add", m=2, n=4, bcast="diag"), UnsupportedShapeError, ["'diag'"]),
        (lambda: TPPSpec("gemm", m=2, n=4, k=0), UnsupportedShapeError, ["gemm", "k=0"]),
        (lambda: TPPSpec("gemm", m=2, n=4, k=3, batch=2), UnsupportedShapeError, ["brgemm"]),
    ],
)
def test_invalid_specs_are_rejected(make, error: type, words: list[str]) -> None:
    with pytest.raises(error) as info:
        make()
    assert isinstance(info.value, TPPError)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (TPPSpec("gelu", "float16", m=2, n=4), ["gelu", "float16", "float32"]),
        (TPPSpec("add", "int8", m=2, n=4), ["add", "int8", "float32"]),
        (TPPSpec("copy", m=2, n=4, out_dtype="int8"), ["copy", "float32->int8"]),
        (TPPSpec("zero", "bfloat16", m=2, n=4), ["zero", "bfloat16"]),
    ],
    ids=lambda v: v.name("avx512") if isinstance(v, TPPSpec) else "",
)
def test_unsupported_dtypes_name_the_problem(spec: TPPSpec, words: list[str]) -> None:
    with pytest.raises(UnsupportedDTypeError) as info:
        intrinsic(spec)
    for word in words:
        assert word in str(info.value)


def test_unknown_isa() -> None:
    with pytest.raises(UnsupportedISAError, match="'neon'"):
        intrinsic(TPPSpec("relu", m=2, n=16), "neon")


# -- registry ---------------------------------------------------------------------------


def test_registered_lists_every_op_for_avx512_and_sve() -> None:
    names = registered()
    for op, d in OPS.items():
        if d.kind == "quant":  # integer quantization TPPs: AVX-512 only so far
            assert any(n.startswith(f"tpp.{op}.") and ".avx512." in n for n in names), op
            continue
        assert any(name.startswith(f"tpp.{op}.f32.avx512.") for name in names), op
        assert any(name.startswith(f"tpp.{op}.f32.sve.") for name in names), op
    assert registered(isa="avx512") == [n for n in names if ".avx512." in n]
    assert registered(dtype="f32") == registered(dtype="float32")
    assert registered(isa="avx512", dtype="float32")
    assert registered(isa="sve") == [n for n in names if ".sve." in n]
    assert all(".bf16." in name for name in registered(dtype="bfloat16"))
    # what `tpp-tvm info` lists without building them
    from tpp_tvm.intrinsics.registry import catalogue_names

    assert set(catalogue_names()) <= set(names)
    assert catalogue_names("sve") == [n for n in catalogue_names() if ".sve." in n]


def test_intrinsic_is_registered_once_and_reused() -> None:
    spec = TPPSpec("exp", m=3, n=20)
    assert intrinsic(spec) == intrinsic(spec) == "tpp.exp.f32.avx512.m3n20"
    assert "tpp.exp.f32.avx512.m3n20" in registered(isa="avx512")


# -- regressions -------------------------------------------------------------------------


def test_tensorized_module_round_trips_through_json() -> None:
    """apache-tvm-ffi 0.1.15.post2 segfaulted in save_json of a tensorized module."""
    spec = TPPSpec("gelu", m=4, n=20)
    sch = s_tir.Schedule(workload(spec))
    sch.tensorize(sch.get_loops(sch.get_sblock(BLOCK))[0], intrinsic(spec))
    text = tvm.ir.save_json(sch.mod)
    tvm.ir.assert_structural_equal(tvm.ir.load_json(text), sch.mod)


@pytest.mark.parametrize("steps", [("bias", "gelu"), ("residual", "silu"),
                                   ("bias", "residual", "gelu_tanh")], ids="_".join)
@pytest.mark.parametrize("m, n", [(2, 16), (5, 48), (3, 64), (7, 37), (3, 5)])
def test_equation_vector_groups_remainders_and_tails(steps: tuple[str, ...], m: int,
                                                     n: int) -> None:
    """Equations take EQUATION_GROUP full vectors at a time, across row ends: fewer full
    vectors than a group (2x16), a remainder after the groups (5x48: 15 vectors), whole
    groups (3x64), groups plus a masked tail per row (7x37), and rows narrower than one
    vector, only tails (3x5: building it divided by zero full vectors)."""
    h.check(TPPSpec("equation", m=m, n=n, steps=steps))


def test_grouped_equations_use_the_avx512_forms() -> None:
    """A group's wide vector still gets vrcp14ps and vscalefps, per zmm (a division or the
    exponent-field form would mean the wide path fell back to the portable math), with its
    values bound to statements so the intrinsic's zmm slices do not copy the whole tree
    (SiLU: exp and a reciprocal; GELU: its rational erf's reciprocal)."""
    for act, instructions in (("silu", ("vrcp14ps", "vscalefps")), ("gelu", ("vrcp14ps",))):
        asm = h.assembly(TPPSpec("equation", m=4, n=64, steps=("bias", act)), "avx512")
        body = [line.split()[0] for line in asm.splitlines()
                if line.strip() and not line.lstrip().startswith((".", "#"))]
        assert "vdivps" not in body
        # 16 vectors, all in groups of 4: one of each per zmm of a group (the group loop
        # may be unrolled; a per-vector loop would have one).
        for instruction in instructions:
            assert body.count(instruction) % 4 == 0 and body.count(instruction) > 0, asm


def test_residual_equations_prefetch_the_next_tile() -> None:
    """A GEMM tile's residual epilogue prefetches the rows below it into L1 (the next tile's
    residual); a whole-panel epilogue (more rows than RESIDUAL_PREFETCH_ROWS) does not."""
    from tpp_tvm.intrinsics.equation_template import RESIDUAL_PREFETCH_ROWS

    def prefetches(m: int) -> int:
        asm = h.assembly(TPPSpec("equation", m=m, n=64, steps=("residual", "relu")))
        return sum(line.split()[0] == "prefetcht0" for line in asm.splitlines()
                   if line.strip() and not line.lstrip().startswith((".", "#")))

    assert prefetches(8) > 0
    assert prefetches(RESIDUAL_PREFETCH_ROWS + 1) == 0


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize(("steps", "widen"), [(("residual_u8", "relu", "scale"), "vpmovzxbd"),
                                              (("residual_s8", "scale"), "vpmovsxbd")],
                         ids=lambda v: "_".join(v) if isinstance(v, tuple) else v)
def test_quantized_residual_equations(isa: str, steps: tuple[str, ...], widen: str) -> None:
    """An int8 layer's epilogue adds the next layer's u8/s8 input as its residual: the
    bytes are widened to int32 lanes in registers (``vpmovzxbd``/``vpmovsxbd``) and
    converted, full vectors and masked tails (n = 37, 19) alike, and a tile of u8 rows
    prefetches one line a row below it, not four."""
    for m, n in ((5, 37), (3, 19), (4, 64)):
        h.check(TPPSpec("equation", m=m, n=n, steps=steps), isa=isa)
    asm = h.assembly(TPPSpec("equation", m=4, n=64, steps=steps), isa)
    body = [line.split()[0] for line in asm.splitlines()
            if line.strip() and not line.lstrip().startswith((".", "#"))]
    assert widen in body and "vcvtdq2ps" in body, asm
    assert body.count("prefetcht0") == 4, body.count("prefetcht0")


LIBM_CALL = re.compile(r"call\w*\s+(exp|tanh|erf|log|pow|sigmoid)")


@pytest.mark.parametrize(("isa", "register", "masked"),
                         [("avx512", "zmm", "{%k"), ("avx2", "ymm", "vmaskmovps")])
@pytest.mark.parametrize("op", ["exp", "gelu", "gelu_tanh", "tanh", "sigmoid", "quick_gelu"])
def test_transcendentals_stay_in_vector_registers(op: str, isa: str, register: str,
                                                  masked: str) -> None:
    """No per-lane libm calls (LLVM scalarises llvm.exp/tanh/erf); the tail is a masked
    load/store (k-mask on AVX-512, vmaskmovps on AVX2). Compiled for each ISA on any host."""
    asm = h.assembly(TPPSpec(op, m=2, n=21), isa)
    body = [line for line in asm.splitlines() if not line.lstrip().startswith((".", "#"))]
    libm = [line for line in body if LIBM_CALL.search(line)]
    assert not libm, libm
    assert any(register in line for line in body)
    assert any(masked in line for line in body), "tail is not a masked store/load"
