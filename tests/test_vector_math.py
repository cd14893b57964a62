"""Accuracy of the vector math behind the transcendental TPPs, over the whole fp32 range.

Each function is compiled once into a 16-lane AVX-512 loop and run on ~0.6 M inputs: a
dense grid over [-120, 120] (both under/overflow ends of exp), a fine grid near 0 and
random finite bit patterns (every exponent). References are scipy in float64. Bounds are
about 2x the errors measured when the functions were written.
"""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm
from scipy import special
from tvm import tirx
from tvm.script import tirx as T

from tpp_tvm.intrinsics import vector_math as vm
from tpp_tvm.target import host_isa, target

#: The AVX-512 forms (vscalefps, vrcp14ps) run on AVX-512 hosts; the portable ones anywhere.
FORMS = ["portable", pytest.param("avx512", marks=pytest.mark.requires_avx512)]

TINY = float(np.finfo(np.float32).tiny)
DENORMAL = 2.0**-149


def _build(fn, nargs: int, isa: str):
    if nargs == 1:

        @T.prim_func(s_tir=True)
        def kernel(x: T.handle, y: T.handle, n: T.int32):
            X = T.match_buffer(x, (n,), "float32")
            Y = T.match_buffer(y, (n,), "float32")
            for v in range(n // 16):
                Y[T.ramp(v * 16, 1, 16)] = fn(X[T.ramp(v * 16, 1, 16)])

    else:

        @T.prim_func(s_tir=True)
        def kernel(d: T.handle, x: T.handle, y: T.handle, n: T.int32):
            D = T.match_buffer(d, (n,), "float32")
            X = T.match_buffer(x, (n,), "float32")
            Y = T.match_buffer(y, (n,), "float32")
            for v in range(n // 16):
                Y[T.ramp(v * 16, 1, 16)] = fn(D[T.ramp(v * 16, 1, 16)], X[T.ramp(v * 16, 1, 16)])

    return tvm.compile(kernel, target=target(isa, num_cores=1)).jit()


def _run(fn, x: np.ndarray, avx512_forms: bool = False) -> np.ndarray:
    """fn over x (for gelu_inv: with dy = 1); ``avx512_forms``: built the way the AVX-512
    TPPs build it (``vscalefps``, ``vrcp14ps``)."""
    nargs = 2 if fn is vm.gelu_inv else 1
    if avx512_forms:
        with vm.avx512_forms():
            mod = _build(fn, nargs, "avx512")
    else:
        mod = _build(fn, nargs, checks.VECTOR_ISA)
    n = -(-len(x) // 16) * 16
    args = [np.pad(x, (0, n - len(x)))]
    if nargs == 2:
        args.insert(0, np.ones(n, np.float32))
    out = tvm.runtime.tensor(np.zeros(n, np.float32))
    mod(*[tvm.runtime.tensor(a) for a in args], out, n)
    return out.numpy()[: len(x)]


@pytest.fixture(scope="module")
def inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([
        bits[np.isfinite(bits)],
        np.linspace(-120, 120, 300_001, dtype=np.float32),
        np.linspace(-2, 2, 100_001, dtype=np.float32),
        np.float32([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38]),
    ])


def _gelu(x):
    return x * 0.5 * special.erfc(-x / np.sqrt(2))


def _gelu_tanh(x):
    u = np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)
    return x * special.expit(2 * u)


def _gelu_inv(x):
    return 0.5 * special.erfc(-x / np.sqrt(2)) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)


# (function, float64 reference, max relative error where the result is a normal float)
CASES = {
    "exp": (vm.exp, np.exp, 2e-7),
    "tanh": (vm.tanh, np.tanh, 3e-7),
    "erf": (vm.erf, special.erf, 3.5e-7),
    "erfc": (vm.erfc, special.erfc, 8e-7),
    "sigmoid": (vm.sigmoid, special.expit, 4e-7),
    # x e^x: below x = -87 the factor e^x is a denormal, its precision the error's bound.
    "silu": (vm.silu, lambda x: x * special.expit(x), 6e-6),
    # x sigmoid(1.702 x), the scale as float32 rounds it; the product 1.702 x is rounded
    # once more than the reference's (|1.702 x| up to ~104 on the tail: ~6e-6).
    "quick_gelu": (vm.quick_gelu, lambda x: x * special.expit(float(np.float32(1.702)) * x),
                   1e-5),
    # x sigmoid(2u): the rounding of u (|2u| up to ~90) sets the relative error on the
    # negative tail; the exact fp32 formula 1 + tanh(u) cancels to 0 there.
    "gelu_tanh": (vm.gelu_tanh, _gelu_tanh, 3e-5),
    "gelu_inv": (vm.gelu_inv, _gelu_inv, 2e-6),
}


@pytest.mark.parametrize("forms", FORMS)
@pytest.mark.parametrize("name", list(CASES))
def test_accuracy_over_the_fp32_range(name: str, forms: str, inputs: np.ndarray) -> None:
    fn, ref, max_rel = CASES[name]
    got = _run(fn, inputs, forms == "avx512").astype(np.float64)
    x = inputs.astype(np.float64)
    with np.errstate(all="ignore"):
        want = ref(x)
        want32 = want.astype(np.float32)
    assert not np.isnan(got).any(), f"{name}: NaN for finite input"
    assert np.array_equal(np.isinf(got), np.isinf(want32)), f"{name}: overflow differs"
    normal = np.isfinite(want32) & (np.abs(want) >= TINY)
    if name == "gelu_inv":  # gelu' crosses 0 at x = -0.7518: only absolute accuracy there
        root = np.abs(x + 0.7518) <= 0.1
        assert np.abs(got[root] - want[root]).max() <= 4e-7
        normal &= ~root
    rel = np.abs(got[normal] - want[normal]) / np.abs(want[normal])
    worst = int(np.argmax(rel))
    assert rel[worst] <= max_rel, f"{name}({inputs[normal][worst]!r}): rel. error {rel[worst]:.3g}"
    small = np.isfinite(want32) & (np.abs(want) < TINY)
    err = np.abs(got[small] - want[small]).max(initial=0.0)
    assert err <= 100 * DENORMAL, f"{name}: error {err / DENORMAL:.3g} denormals near 0"


@pytest.mark.parametrize("forms", FORMS)
def test_gelu_is_absolutely_accurate(forms: str, inputs: np.ndarray) -> None:
    """GELU's erf is one rational function (a third of the relatively accurate form's
    operations): absolute error <= 2.5e-7 max(1, |x|) over the whole fp32 range, relative
    error <= 2e-6 from x = -1.5 up (1e-4 from -3), exactly 0 below -5.66."""
    got = _run(vm.gelu, inputs, forms == "avx512").astype(np.float64)
    x = inputs.astype(np.float64)
    with np.errstate(all="ignore"):
        want = _gelu(x)
    assert not np.isnan(got).any()
    finite = np.isfinite(want)
    assert np.array_equal(np.isinf(got), ~finite)
    err = np.abs(got - want)[finite]
    assert (err / np.maximum(1.0, np.abs(x[finite]))).max() <= 2.5e-7
    for lo, bound in ((-1.5, 2e-6), (-3.0, 1e-4)):
        near = finite & (x >= lo) & (np.abs(want) >= TINY)
        assert (np.abs(got - want)[near] / np.abs(want[near])).max() <= bound, lo
    assert np.all(got[x < -5.66] == 0.0)


@pytest.mark.parametrize("forms", FORMS)
def test_exp_denormals_are_correctly_rounded(forms: str) -> None:
    x = np.linspace(-104, -87, 20_001, dtype=np.float32)
    got = _run(vm.exp, x, forms == "avx512").astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.abs(got - want).max() <= DENORMAL


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("exp", [np.inf, 0.0, np.nan]),
        ("tanh", [1.0, -1.0, np.nan]),
        ("erf", [1.0, -1.0, np.nan]),
        ("erfc", [0.0, 2.0, np.nan]),
        ("sigmoid", [1.0, 0.0, np.nan]),
        ("silu", [np.inf, 0.0, np.nan]),
        ("quick_gelu", [np.inf, 0.0, np.nan]),
        ("gelu", [np.inf, 0.0, np.nan]),
        ("gelu_tanh", [np.inf, 0.0, np.nan]),
        ("gelu_inv", [1.0, 0.0, np.nan]),
    ],
)
def test_infinities_and_nan(name: str, expected: list[float]) -> None:
    fn = vm.gelu if name == "gelu" else CASES[name][0]
    for forms in (False, True) if host_isa().avx512f else (False,):
        got = _run(fn, np.float32([np.inf, -np.inf, np.nan]), forms)
        np.testing.assert_array_equal(got, np.float32(expected))


def test_avx512_forms_use_scalef_and_rcp14() -> None:
    """The AVX-512 forms are what the AVX-512 TPPs compile to: no divider, one vscalefps per
    exp; outside the context (and for other lane counts) the portable forms."""
    import tpp_harness as h

    from tpp_tvm.intrinsics import TPPSpec

    asm = h.assembly(TPPSpec("sigmoid", m=2, n=32), "avx512")
    assert "vscalefps" in asm and "vrcp14ps" in asm and "vdivps" not in asm
    x = tirx.Var("x", "float32x8")
    with vm.avx512_forms():
        assert "llvm.x86" not in str(vm.sigmoid(x))
    assert "llvm.x86" not in str(vm.sigmoid(tirx.Var("y", "float32x16")))


def test_works_on_scalars_and_scalable_vectors() -> None:
    """The same functions build scalar and SVE-style (vscale) expressions."""
    for dtype in ("float32", "float32xvscalex4"):
        x = tirx.Var("x", dtype)
        for fn in (*(case[0] for case in CASES.values()), vm.gelu):
            y = fn(x, x) if fn is vm.gelu_inv else fn(x)
            assert str(y.ty.dtype) == dtype


def test_rejects_other_dtypes() -> None:
    with pytest.raises(TypeError, match="fp32-only"):
        vm.exp(tirx.Var("x", "float16x32"))
