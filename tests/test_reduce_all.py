"""The whole-tensor max/min partial reduction (DynamicQuantizeLinear's range)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tpp_tvm.schedules.reduce_all import LANES, reduce_all_schedule
from tpp_tvm.target import target


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("rows", [2, 37, 1024])
def test_partials_reduce_to_numpy(op: str, rows: int) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, LANES)).astype("float32")
    lib = tvm.compile(reduce_all_schedule(rows * LANES, op).mod,
                      target=target(num_cores=1)).jit()
    out = tvm.runtime.tensor(np.zeros(LANES, "float32"))
    lib(tvm.runtime.tensor(x), out)
    fold = np.max if op == "max" else np.min
    np.testing.assert_array_equal(out.numpy(), fold(x, axis=0))
    assert fold(out.numpy()) == fold(x)


def test_rejects_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="'sum'"):
        reduce_all_schedule(64, "sum")
    with pytest.raises(ValueError, match="17 elements"):
        reduce_all_schedule(17, "max")
