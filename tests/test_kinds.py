"""The kinds table: every kind the datasheet names has one class, and its pieces agree."""

from __future__ import annotations

import pytest

from tpp_tvm.intrinsics import OPS, TPPSpec
from tpp_tvm.intrinsics.kinds import KINDS, TPPKind, kind_of
from tpp_tvm.intrinsics.registry import catalogue, low_precision_catalogue


def test_every_kind_of_the_datasheet_has_a_class() -> None:
    assert {d.kind for d in OPS.values()} == set(KINDS)
    assert all(isinstance(k, TPPKind) and k.name == name for name, k in KINDS.items())


def test_every_op_has_catalogue_examples_of_its_own_kind() -> None:
    specs = catalogue()
    assert {s.op for s in specs} == set(OPS)
    assert all(kind_of(s).name == OPS[s.op].kind for s in specs)


@pytest.mark.parametrize("spec", catalogue() + low_precision_catalogue(),
                         ids=lambda s: s.name("avx512"))
def test_description_declares_the_kinds_operands(spec: TPPSpec) -> None:
    kind = kind_of(spec)
    desc = kind.describe(spec)
    shapes = [tuple(int(e) for e in p.shape) for p in desc.params]  # params are buffers
    dtypes = [str(p.dtype) for p in desc.params]
    assert shapes == kind.operand_shapes(spec)
    assert dtypes == kind.operand_dtypes(spec)
