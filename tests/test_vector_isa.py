"""The vector-unit model: the one source of lane and register counts, schedules included."""

from __future__ import annotations

import pytest

from tpp_tvm.intrinsics import ISAS
from tpp_tvm.intrinsics.registry import target_vector_isa, vector_isa
from tpp_tvm.target import target


@pytest.mark.parametrize("isa", ISAS)
def test_schedules_work_in_the_lanes_they_always_used(isa: str) -> None:
    """16 fp32 lanes and 32 registers on every ISA but AVX2 (8 lanes, 16 ymm registers),
    and a fixed-width ISA's schedule lanes are its register's."""
    unit = vector_isa(isa)
    lanes, vregs = (8, 16) if isa == "avx2" else (16, 32)
    assert (unit.schedule_lanes("float32"), unit.num_vregs) == (lanes, vregs)
    assert unit.schedule_lanes("bfloat16") == 2 * lanes
    if not unit.scalable:
        assert unit.schedule_lanes("float32") == unit.static_lanes("float32")


@pytest.mark.parametrize("isa", ISAS)
def test_a_target_reports_its_isas_unit(isa: str) -> None:
    assert target_vector_isa(target(isa, num_cores=1)).name == isa


@pytest.mark.parametrize("tgt", [None, "c", {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}])
def test_targets_without_a_tpp_isa_get_avx512s_unit(tgt) -> None:
    assert target_vector_isa(tgt).name == "avx512"
