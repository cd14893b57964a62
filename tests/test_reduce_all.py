"""The whole-tensor max/min partial reduction (DynamicQuantizeLinear's range)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tpp_tvm.schedules.reduce_all import LANES, reduce_all_schedule
from tpp_tvm.target import target


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize(("rows", "tail"), [(2, 0), (37, 0), (1024, 0), (2, 15),
                                            (9492, 3)])  # (3 x 225 x 225 = 151875)
def test_partials_reduce_to_numpy(op: str, rows: int, tail: int) -> None:
    x = np.random.default_rng(rows).standard_normal(rows * LANES + tail).astype("float32")
    if tail:  # the extreme in the tail, which only the first lane sees
        x[-1] = 100.0 if op == "max" else -100.0
    lib = tvm.compile(reduce_all_schedule(x.size, op).mod, target=target(num_cores=1)).jit()
    out = tvm.runtime.tensor(np.zeros(LANES, "float32"))
    lib(tvm.runtime.tensor(x), out)
    fold = np.max if op == "max" else np.min
    want = fold(x[:rows * LANES].reshape(rows, LANES), axis=0)
    want[0] = fold(np.concatenate([want[:1], x[rows * LANES:]]))
    np.testing.assert_array_equal(out.numpy(), want)
    assert fold(out.numpy()) == fold(x)


def test_rejects_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="'sum'"):
        reduce_all_schedule(64, "sum")
    with pytest.raises(ValueError, match="17 elements"):
        reduce_all_schedule(17, "max")
