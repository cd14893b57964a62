"""The datasheet's names: ``TPPSpec.from_name`` is the exact inverse of ``TPPSpec.name``.

Tuning records refer to intrinsics by name only, so a name must say everything about a spec
and read back to it: over the whole catalogue on every ISA, over random specs of every kind,
and for the names already in ``tune_logs/`` (which must not change).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpp_tvm.errors import UnsupportedDTypeError, UnsupportedShapeError
from tpp_tvm.intrinsics import ISAS, OPS, TPPSpec
from tpp_tvm.intrinsics.registry import catalogue, low_precision_catalogue
from tpp_tvm.intrinsics.spec import (
    BCASTS,
    CONTRACTION_DTYPES,
    EQUATION_STEPS,
    OPERAND_STEPS,
    QUANT_DTYPES,
    equation_operands,
    vnni_factor,
)

CATALOGUE = catalogue() + low_precision_catalogue()


@pytest.mark.parametrize("isa", ISAS)
def test_every_catalogue_name_reads_back_to_its_spec(isa: str) -> None:
    for spec in CATALOGUE:
        assert TPPSpec.from_name(spec.name(isa)) == (spec, isa)


def test_catalogue_names_are_distinct() -> None:
    names = [s.name("avx512") for s in CATALOGUE]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", [
    "tpp.gemm.f32.avx512.m14n32k256",
    "tpp.gemm.f32.avx512.m4n64k64.beta0",
    "tpp.equation.f32.avx512.m8n32.bias_gelu",
    "tpp.equation.f32.avx512.m8n32.bias",
    "tpp.equation.f32.avx512.m5n24.bias_gelu_tanh",
    "tpp.reduce_add_cols.f32.avx512.m8n768",
    "tpp.conv_brgemm.f32.avx512.m4n32k48b3s16.beta0",
    "tpp.gemm.u8i8.amx.m16n64k128",
    "tpp.pool_max.f32.sve.m8n37r3x3s74t37",
    "tpp.add.bf16.avx512.m8n37.bcast_row",
    "tpp.quantize.f32.avx512.m8n37.to_u8",
    "tpp.copy.bf16.avx512.m8n37.to_f32",
])
def test_names_in_use_read_back_unchanged(name: str) -> None:
    spec, isa = TPPSpec.from_name(name)
    assert spec.name(isa) == name


def test_a_step_boundary_that_reads_as_one_step_is_marked() -> None:
    """gelu then tanh is not gelu_tanh: the boundary is written ``__``."""
    chained = TPPSpec("equation", m=4, n=8, steps=("gelu", "tanh"))
    single = TPPSpec("equation", m=4, n=8, steps=("gelu_tanh",))
    assert chained.name("avx512").endswith(".gelu__tanh")
    assert single.name("avx512").endswith(".gelu_tanh")
    for spec in (chained, single):
        assert TPPSpec.from_name(spec.name("avx512"))[0] == spec


@pytest.mark.parametrize("name", [
    "tpp.dense", "tpp.nope.f32.avx512.m4n4", "tpp.gemm.q9.avx512.m4n4k4",
    "tpp.gemm.f32.avx512.m4n4",  # a gemm needs k
    "tpp.gemm.f32.avx512.m04n4k4",  # not the canonical spelling
    "tpp.relu.f32.avx512.m4n4.beta0", "tpp.relu.f32.avx512.m4n4.gelu",
    "tpp.equation.f32.avx512.m4n4.bias_nope",
])
def test_what_is_not_a_name_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="not a TPP intrinsic name"):
        TPPSpec.from_name(name)


def test_values_equal_to_defaults_are_stored_as_defaults() -> None:
    pool = dict(m=4, n=16, batch=2, k=3, stride=32)
    assert TPPSpec("pool_max", tap_stride=16, **pool) == TPPSpec("pool_max", **pool)
    assert TPPSpec("copy", m=2, n=3, out_dtype="float32") == TPPSpec("copy", m=2, n=3)
    assert (TPPSpec("gemm", "bfloat16", b_dtype="bfloat16", out_dtype="float32", m=2, n=3, k=4)
            == TPPSpec("gemm", "bfloat16", m=2, n=3, k=4))


@pytest.mark.parametrize(("make", "error"), [
    (lambda: TPPSpec("relu", m=2, n=2, k=3), UnsupportedShapeError),
    (lambda: TPPSpec("add", m=2, n=2, beta=0), UnsupportedShapeError),
    (lambda: TPPSpec("add", m=2, n=2, tap_stride=4), UnsupportedShapeError),
    (lambda: TPPSpec("gemm", "bfloat16", m=2, n=2, k=2, out_dtype="bfloat16"),
     UnsupportedDTypeError),
])
def test_fields_a_kind_does_not_take_are_refused(make, error) -> None:
    """The name omits them, so two specs would share one name (and one intrinsic)."""
    with pytest.raises(error):
        make()


@st.composite
def specs(draw) -> TPPSpec:
    """Any valid spec, its fields drawn as its kind takes them."""
    op = draw(st.sampled_from(sorted(OPS)))
    kind = OPS[op].kind
    kw: dict = {"m": draw(st.integers(1, 40)), "n": draw(st.integers(1, 80))}
    if kind == "brgemm":
        a, b = draw(st.sampled_from(CONTRACTION_DTYPES))
        v = vnni_factor(a)
        kw.update(dtype=a, b_dtype=b, k=v * draw(st.integers(1, 16)),
                  beta=draw(st.sampled_from([0, 1])),
                  batch=1 if op == "gemm" else draw(st.integers(1, 4)),
                  stride=v * draw(st.integers(1, 4)) if op == "conv_brgemm" else 1)
    elif kind == "pool":
        rows, taps = draw(st.sampled_from([(1, 2), (2, 1), (3, 3), (2, 5)]))
        kw.update(batch=rows, k=taps, stride=draw(st.integers(1, 90)),
                  tap_stride=draw(st.sampled_from([0, kw["n"], 2 * kw["n"] + 1])))
    elif kind == "quant":
        kw["dtype"], kw["out_dtype"] = draw(st.sampled_from(QUANT_DTYPES[op]))
    elif kind in ("binary", "muladd"):
        kw.update(bcast=draw(st.sampled_from(BCASTS)),
                  dtype=draw(st.sampled_from(["float32", "bfloat16"])))
    elif kind == "equation":
        steps = draw(st.lists(st.sampled_from(EQUATION_STEPS), min_size=1, max_size=4)
                     .filter(lambda s: len(equation_operands(tuple(s))) <= 2))
        kw["steps"] = tuple(steps)
    elif op == "copy":
        kw["dtype"], kw["out_dtype"] = draw(st.sampled_from(
            [("float32", None), ("float32", "bfloat16"), ("bfloat16", "float32"),
             ("float32", "float16"), ("int32", "float32")]))
    else:
        kw["dtype"] = draw(st.sampled_from(["float32", "bfloat16", "int8", "uint8"]))
    return TPPSpec(op, **kw)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(spec=specs(), isa=st.sampled_from(ISAS))
def test_random_specs_read_back(spec: TPPSpec, isa: str) -> None:
    assert TPPSpec.from_name(spec.name(isa)) == (spec, isa)


def test_operand_steps_say_shape_math_and_dtype() -> None:
    """One table says what each operand step's operand is and does; the name order of
    ``EQUATION_STEPS`` (operand steps first) is part of the name grammar."""
    assert EQUATION_STEPS[:len(OPERAND_STEPS)] == tuple(OPERAND_STEPS)
    assert [s for s, op in OPERAND_STEPS.items() if op.row] == ["bias", "scale"]
    assert [s for s, op in OPERAND_STEPS.items() if op.multiplies] == ["gate", "scale"]
    assert OPERAND_STEPS["residual_u8"].operand_dtype("float32") == "uint8"
    assert OPERAND_STEPS["residual"].operand_dtype("float32") == "float32"
    assert OPERAND_STEPS["bias"].shape(4, 8) == (8,)
    assert OPERAND_STEPS["gate"].shape(4, 8) == (4, 8)
