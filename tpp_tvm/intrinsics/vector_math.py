"""Vector transcendental math for TPP implementations, written once for every ISA.

LLVM scalarises ``llvm.exp``/``tanh``/``erf`` on vectors into per-lane libm calls, which
would make a gelu TPP sixteen function calls per vector. These functions build the math
from vector arithmetic, integer shifts and bit casts instead, so they lower to plain SIMD
code on any lane count (fixed ``float32x16`` or scalable ``float32xvscalex4``), and they work
on scalars too. Every function takes and returns fp32 TIR expressions of one shape.

Accuracy target: fp32 level (a few ulp, ~1e-6 relative) over the whole float range,
including the under/overflow ends and denormal results; no NaN for any finite input. The
exception is the forward ``gelu``, absolutely accurate (see below).
Polynomials are evaluated by Horner's rule, except erfc's degree-9 one, by Estrin's scheme
(4 dependent multiply-adds instead of 9: these functions run as GEMM epilogues, where their
latency, not their operation count, limits the speed; GELU after a GEMM 3.3 -> 2.4 cycles an
element on Zen 5). Estrin everywhere was no faster and made a GELU GEMM compile 3x longer
(TIR trees copy the polynomial's argument; erfc's alone: 1.1 -> 2.0 s).
Methods:

* ``exp``: Cody-Waite range reduction ``x = n ln2 + r``, Cephes' degree-7 polynomial for
  ``e^r``, and ``2^n`` applied as two exponent-field products so that results that are
  denormal or overflow to inf come out right.
* ``erfc``: Numerical Recipes' Chebyshev fit ``t exp(-z^2 + P(t))``, ``t = 1/(1 + z/2)``
  (1.2e-7 relative for every z >= 0); ``-z^2`` is carried as an exact (hi, lo) pair so that
  the exponent's rounding does not grow with z.
* ``erf``: ``x P(x^2)`` (minimax-weighted fit, 1.3e-9 relative) for ``|x| < 1``, else
  ``1 - erfc(|x|)``.
* ``tanh``: Cephes' odd polynomial for ``|x| < 0.625``, else ``(1 - e)/(1 + e)`` with
  ``e = exp(-2|x|)``.
* ``sigmoid`` from ``e = exp(-|x|)``; ``gelu`` as ``x/2 (1 + erf(x/sqrt 2))`` with that erf a
  (5, 5) rational function of x^2: 2.5e-7 max(1, |x|) absolute, 2e-6 relative from x = -1.5
  up, 0 below -5.66 (after a GEMM on Zen 5: 1.68 -> 0.62 cycles an element; GELU epilogues
  were ~9% of ConvNeXt-T's time). ``gelu_inv`` (training) keeps the normal CDF from ``erfc``
  on the side where it is small, relatively accurate for negative x;
  ``gelu_tanh`` as ``x sigmoid(2u)``, which is the same function as ``x (1 + tanh u) / 2``
  without the cancellation.

Measured over 0.6 M inputs spanning every exponent (``tests/test_vector_math.py``), max
relative error: exp 8.1e-8, tanh 2.2e-7, erf 1.7e-7, erfc 4.7e-7, sigmoid 2.1e-7, gelu
2e-7 max(1, |x|) absolute, gelu_inv 1.7e-6 from 0.1 off its root at x = -0.75 (2.1e-7
absolute everywhere); gelu_tanh 2.8e-7 for |x| < 1 but up to 1.2e-5 on the far negative tail, where
the fp32 rounding of u itself is amplified by |2u| (the exact fp32 formula returns 0
there). Denormal results are within 100 denormal units (exp: correctly rounded). NaN in
gives NaN out; +-inf give the limits.

sqrt, rsqrt, reciprocal and division are not here: IEEE vector instructions do them.

TIR expressions are trees: each function repeats its argument several times (LLVM merges
the copies), so pass loads or variables, not large expressions. Let-bindings do not help:
TVM's simplifier inlines pure lets, and nested copies then grow exponentially.

Inside :func:`avx512_forms` (the AVX-512 TPP implementations and the ``tpp`` pipeline's
lowering for x86 AVX-512 targets set it), 16-lane fp32 vectors use two AVX-512 instructions
the portable forms spell out: ``vscalefps`` applies exp's ``2^n`` (under/overflow rounded
once, as the two exponent-field factors do) and ``vrcp14ps`` plus one Newton step replaces
the divisions of sigmoid and erfc (1.1e-7 relative). With 512-bit vectors only two ports do
floating-point work, so each micro-op counts: the portable sigmoid was ~40 per vector plus a
``vdivps`` whose divider is not pipelined. Wider fp32 vectors (16 k lanes, an equation's
group of k registers) use them per zmm (:func:`per_zmm`); while a template builds a
statement, :func:`statement_slots` binds the sliced arguments to local slots by statements
of their own, so the k slices do not copy the argument's tree.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import tvm
from tvm import tirx
from tvm.ir.expr import TensorLoad

from .llvm_ir import intrinsic_id
from .spec import LEAKY_RELU_SLOPE, OPS, QUICK_GELU_SCALE, const, dtype_of

Expr = tirx.Expr

_LOG2E = 1.0 / math.log(2.0)
# ln 2 = _LN2_HI + _LN2_LO; _LN2_HI has 9 significant bits so n * _LN2_HI is exact.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
# exp's input range: below, the result rounds to 0; above, it is inf.
_EXP_LO, _EXP_HI = -104.0, 89.0
# After range reduction |r| <= ln2/2 (+ rounding); clamping r keeps the polynomial in range
# when the input was clamped.
_R_MAX = 0.35
_EXP_POLY = (  # Cephes expf: e^r ~ 1 + r + r^2 P(r)
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
_TANH_POLY = (  # Cephes tanhf, |x| < 0.625: tanh x ~ x + x^3 P(x^2)
    -5.70498872745e-3,
    2.06390887954e-2,
    -5.37397155531e-2,
    1.33314422036e-1,
    -3.33332819422e-1,
)
_TANH_SMALL = 0.625
_ERF_POLY = (  # erf x ~ x P(x^2) on |x| <= 1, fitted here (max rel. error 1.3e-9 in fp64)
    7.8490262042528385e-05,
    -8.0087305430825246e-04,
    5.1881613329628606e-03,
    -2.6853724512731599e-02,
    1.1283583063385376e-01,
    -3.7612625641162672e-01,
    1.1283791657003779e00,
)
# erf(x / sqrt 2) ~ x N(x^2) / D(x^2) for |x| <= _GELU_ERF_X_MAX (highest degree first):
# a (5, 5) rational fitted here by weighted least squares (Lawson iterations) on [0, 4] in
# x / sqrt 2, max abs. error 2.1e-8 in fp64, 4.1e-7 evaluated in fp32.
_GELU_ERF_NUM = (4.3638983981963975e-08, 1.2729712580039632e-05, 0.0003538655291777104,
                 0.009451743215322495, 0.06938346475362778, 0.7978844046592712)
_GELU_ERF_DEN = (1.1712900231941603e-06, 7.602094410685822e-05, 0.0019305241294205189,
                 0.029118815436959267, 0.2536248564720154, 1.0)
_GELU_ERF_X_MAX = 4.0 * math.sqrt(2.0)
_ERF_SMALL = 1.0
_ERFC_SMALL = 0.5
_ERFC_POLY = (  # Numerical Recipes erfcc: erfc z ~ t exp(-z^2 + P(t)), t = 1/(1 + z/2)
    0.17087277,
    -0.82215223,
    1.48851587,
    -1.13520398,
    0.27886807,
    -0.18628806,
    0.09678418,
    0.37409196,
    1.00002368,
    -1.26551223,
)
# Beyond these |x|, erfc (of z) / erf / tanh are 0 / +-1 / +-1 in fp32.
_ERFC_Z_MAX = 10.5
_ERF_X_MAX = 4.5
_TANH_X_MAX = 9.0
# gelu: |x| beyond which Phi(x) is 0 or 1 in fp32.
_GELU_X_MAX = 15.0
_GELU_TANH_X_MAX = 20.0
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715
# Clearing the low 12 mantissa bits leaves 12 significant bits: the square is exact in fp32.
_SPLIT_MASK = -4096
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000  # NaNs are the bit patterns above inf's (ignoring the sign)


class ThreadFlag:
    """A per-thread, re-entrant switch: ``with flag.on():`` sets it for this thread only
    (a build on another thread is not affected); ``flag.active`` reads it."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def active(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextmanager
    def on(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth


_AVX512_FORMS = ThreadFlag()
#: While active, 16-lane fp32 math uses AVX-512 instructions (see the module doc). Only for
#: code compiled for an AVX-512 x86 target.
avx512_forms = _AVX512_FORMS.on


def _avx512(x: Expr) -> bool:
    """fp32 vectors of whole zmm registers (16 lanes, or a group of them, see
    :func:`per_zmm`) under :func:`avx512_forms`."""
    t = tvm.DataType(dtype_of(x))
    return _AVX512_FORMS.active and t.type_code == tvm.DataTypeCode.FLOAT and t.bits == 32 \
        and t.lanes > 0 and t.lanes % 16 == 0


class _Slots(threading.local):
    buffer: tirx.Buffer | None = None
    used = 0


_SLOTS = _Slots()


@contextmanager
def statement_slots(buffer: tirx.Buffer) -> Iterator[None]:
    """While a TVMScript template builds one statement, values that would otherwise be
    copied into several subtrees (see :func:`per_zmm`) are stored to ``buffer`` (a local
    buffer of vectors, one slot each) by statements emitted just before it."""
    saved = _SLOTS.buffer, _SLOTS.used
    _SLOTS.buffer, _SLOTS.used = buffer, 0
    try:
        yield
    finally:
        _SLOTS.buffer, _SLOTS.used = saved


def _bound(x: Expr) -> Expr:
    """``x`` stored to the next statement slot (a load of it), if slots are open."""
    buf = _SLOTS.buffer
    if buf is None or isinstance(x, (tirx.Var, TensorLoad)) or dtype_of(x) != buf.dtype:
        return x
    k = _SLOTS.used
    if k >= int(buf.shape[0]):
        raise ValueError(f"vector_math: more than {k} bound values in one statement")
    from tvm.script.ir_builder import tirx as irb  # only reached while a script is built

    irb.buffer_store(buf, x, [k])
    _SLOTS.used = k + 1
    return tirx.BufferLoad(buf, [tirx.const(k, "int32")])


def per_zmm(fn: Callable[..., Expr], *args: Expr) -> Expr:
    """``fn`` (a 16-lane fp32 intrinsic) on each zmm of ``args``, which are vectors of
    ``16 k`` lanes; the pieces are concatenated back. LLVM folds the shuffles away. Each
    argument is sliced k times: under :func:`statement_slots` it is bound once first, else
    its expression tree is copied k times (slow to compile)."""
    lanes = tvm.DataType(dtype_of(args[0])).lanes
    if lanes == 16:
        return fn(*args)
    args = tuple(_bound(a) for a in args)
    pieces = [fn(*(slice_lanes(a, z * 16, 16) for a in args)) for z in range(lanes // 16)]
    return concat_lanes(pieces)


def slice_lanes(x: Expr, first: int, lanes: int) -> Expr:
    """Lanes ``[first, first + lanes)`` of vector ``x``."""
    return tirx.Shuffle([x], [tirx.const(first + j, "int32") for j in range(lanes)])


def concat_lanes(pieces: list[Expr]) -> Expr:
    """The vectors ``pieces`` side by side, as one vector."""
    lanes = sum(tvm.DataType(dtype_of(p)).lanes for p in pieces)
    return tirx.Shuffle(list(pieces), [tirx.const(j, "int32") for j in range(lanes)])


def _all_lanes() -> Expr:
    return tirx.const(-1, "int16")


def _reciprocal(d: Expr) -> Expr:
    """``1 / d`` for finite ``d`` of normal magnitude (the callers' denominators are in
    [1, 6.3]): ``vrcp14ps`` and one Newton step under :func:`avx512_forms`, else a division."""
    if not _avx512(d):
        return const(d, 1.0) / d
    zero = tirx.Broadcast(tirx.const(0.0, "float32"), 16)
    r = per_zmm(lambda v: tirx.call_llvm_pure_intrin(
        "float32x16", _RCP14, v, zero, _all_lanes()), d)
    return r * (const(d, 2.0) - d * r)


def _int_type(x: Expr) -> str:
    return dtype_of(x).replace("float32", "int32")


def _check_f32(x: Expr, fn: str) -> None:
    if not dtype_of(x).startswith("float32"):
        raise TypeError(f"vector_math.{fn} is fp32-only, got {dtype_of(x)}")


def splat(like: Expr, value: float) -> Expr:
    """``value`` in ``like``'s type: a scalar, or a (fixed or scalable) vector broadcast."""
    c = const(like, value)
    lanes = tvm.DataType(dtype_of(like)).lanes
    if lanes == 1:
        return c
    # Scalable vector types report -(vscale multiplier) lanes.
    return tirx.Broadcast(c, lanes if lanes > 0 else -lanes * tirx.vscale())


def _poly(x: Expr, coeffs: tuple[float, ...]) -> Expr:
    """Horner evaluation of ``coeffs`` (highest degree first)."""
    acc = const(x, coeffs[0])
    for c in coeffs[1:]:
        acc = acc * x + const(x, c)
    return acc


def _poly_estrin(x: Expr, coeffs: tuple[float, ...]) -> Expr:
    """``coeffs`` (highest degree first) at ``x`` by Estrin's scheme: pairs ``c1 x + c0``
    combined with ``x^2``, ``x^4``, ... A degree-9 polynomial is then 4 dependent
    multiply-adds deep instead of Horner's 9. It mentions ``x`` about twice as often, and
    TIR expressions are trees (see the module doc): used only where that copy stays small."""
    terms = [const(x, c) for c in reversed(coeffs)]  # lowest degree first
    power = x
    while len(terms) > 1:
        pairs = [terms[i] + terms[i + 1] * power if i + 1 < len(terms) else terms[i]
                 for i in range(0, len(terms), 2)]
        terms, power = pairs, power * power
    return terms[0]


def _clamp(x: Expr, lo: float, hi: float) -> Expr:
    # min/max mention x once; a compare-select clamp would copy it (see the module doc).
    return tirx.min(tirx.max(x, const(x, lo)), const(x, hi))


def _keep_nan(x: Expr, result: Expr) -> Expr:
    """``result``, or NaN where ``x`` is NaN (the clamps above drop NaN)."""
    # On the bits: tirx.isnan cannot take scalable vectors.
    magnitude = tirx.bitwise_and(tirx.reinterpret(_int_type(x), x), tirx.const(_ABS_MASK, "int32"))
    return tirx.Select(magnitude > tirx.const(_INF_BITS, "int32"), x, result)


def _copysign(mag: Expr, sign: Expr) -> Expr:
    # tirx.copysign has no LLVM lowering in this TVM.
    return tirx.Select(sign < const(sign, 0.0), -mag, mag)


def _pow2(n: Expr, like: Expr) -> Expr:
    """``2^n`` for int ``n`` in the normal exponent range, built in the exponent field."""
    bits = tirx.shift_left(n + tirx.const(127, "int32"), tirx.const(23, "int32"))
    return tirx.reinterpret(dtype_of(like), bits)


def _exp_parts(hi: Expr, lo: Expr | None = None, nonpositive: bool = False) -> Expr:
    """``exp(hi + lo)`` where ``hi`` may be large and exact and ``lo`` is a small correction.

    Range reduction subtracts ``n ln2`` from ``hi`` first (exactly, Sterbenz), so the
    rounding of ``hi + lo`` never enters the result; ``r`` is clamped because ``hi`` is
    not. Without ``lo`` the clamped argument itself is reduced, already in range, and
    ``nonpositive`` (sigmoid's and tanh's ``-|x|``) drops the upper clamp: two or
    three operations fewer on a ~20-operation exponential (after a GEMM on Zen 5, cycles an
    element: SiLU 0.83 -> 0.73, sigmoid 0.82 -> 0.65, tanh-GELU 1.14 -> 0.96).
    """
    if lo is None:
        s = tirx.max(hi, const(hi, _EXP_LO)) if nonpositive else _clamp(hi, _EXP_LO, _EXP_HI)
        nf = tirx.floor(s * const(s, _LOG2E) + const(s, 0.5))
        r = (s - nf * const(s, _LN2_HI)) - nf * const(s, _LN2_LO)
    else:
        s = _clamp(hi + lo, _EXP_LO, _EXP_HI)
        nf = tirx.floor(s * const(s, _LOG2E) + const(s, 0.5))
        r = _clamp((hi - nf * const(s, _LN2_HI)) - nf * const(s, _LN2_LO) + lo, -_R_MAX,
                   _R_MAX)
    p = _poly(r, _EXP_POLY) * r * r + r + const(r, 1.0)
    if _avx512(p):  # p * 2^nf, rounded once (denormal, normal or inf)
        return per_zmm(lambda v, e: tirx.call_llvm_pure_intrin(
            "float32x16", _SCALEF, v, e, v, _all_lanes(), tirx.const(4, "int32")), p, nf)
    return _times_pow2(p, nf)


def _times_pow2(p: Expr, nf: Expr) -> Expr:
    """``p * 2^nf`` for integral ``nf`` in [-150, 128]: two factors 2^(n//2) and
    2^(n - n//2) are both normal, and the final product rounds once, to a denormal, a
    normal or inf."""
    n = tirx.Cast(_int_type(p), nf)
    n1 = tirx.shift_right(n, tirx.const(1, "int32"))
    return p * _pow2(n1, p) * _pow2(n - n1, p)


_SCALEF = "llvm.x86.avx512.mask.scalef.ps.512"
_RCP14 = "llvm.x86.avx512.rcp14.ps.512"


#: AVX512_VNNI's u8 x s8 dot product as the weight-only kernels call it from TIR.
VPDPBUSD = "llvm.x86.avx512.vpdpbusd.512"


def generic_form(call: tirx.Call) -> Expr | None:
    """The any-CPU form of an AVX-512 instruction :func:`avx512_forms` put in ``call``
    (``vrcp14ps``: a division; ``vscalefps``: two exponent-field factors) or a kernel called
    directly (``vpdpbusd``: widened products summed four to a lane), None for other calls:
    kernels built with AVX-512 forms then compile for a host without AVX-512 (the AMX
    kernels beside emulated tiles on an AVX2 CPU)."""
    if call.op.name != "tirx.call_llvm_pure_intrin":
        return None
    intrinsic = int(call.args[0].value)
    if intrinsic == intrinsic_id(_RCP14):
        return const(call.args[1], 1.0) / call.args[1]
    if intrinsic == intrinsic_id(_SCALEF):
        return _times_pow2(call.args[1], call.args[2])
    if intrinsic == intrinsic_id(VPDPBUSD):
        return _dot_u8_s8(*call.args[1:4])
    return None


def _dot_u8_s8(acc: Expr, a: Expr, b: Expr) -> Expr:
    """``vpdpbusd``: ``acc`` plus, per int32 lane, the four products of ``a``'s bytes read
    unsigned and ``b``'s read signed (int8 vectors of 4 x acc's lanes)."""
    lanes = tvm.DataType(dtype_of(acc)).lanes
    total = acc
    for t in range(4):
        picks = [tirx.const(4 * i + t, "int32") for i in range(lanes)]
        a_t = tirx.reinterpret(f"uint8x{lanes}", tirx.Shuffle([a], picks))
        b_t = tirx.Shuffle([b], picks)
        total = total + tirx.Cast(f"int32x{lanes}", a_t) * tirx.Cast(f"int32x{lanes}", b_t)
    return total


def exp(x: Expr) -> Expr:
    """``e^x`` (fp32, ~1 ulp; 0 below -103.98, inf above 88.72)."""
    _check_f32(x, "exp")
    return _keep_nan(x, _exp_parts(x))


def _neg_square(a: Expr, scale: float) -> tuple[Expr, Expr]:
    """``-scale * a^2`` as a (hi, lo) pair with hi exact; ``scale`` a power of two."""
    bits = tirx.bitwise_and(tirx.reinterpret(_int_type(a), a), tirx.const(_SPLIT_MASK, "int32"))
    ah = tirx.reinterpret(dtype_of(a), bits)
    return const(a, -scale) * ah * ah, const(a, -scale) * (a - ah) * (a + ah)


def _erfc_core(z: Expr, hi: Expr, lo: Expr) -> Expr:
    """``erfc(z)`` for ``0 <= z`` with ``-z^2 = hi + lo`` given exactly."""
    t = _reciprocal(const(z, 1.0) + const(z, 0.5) * z)
    return t * _exp_parts(hi, lo + _poly_estrin(t, _ERFC_POLY))


def _erfc_abs(a: Expr) -> Expr:
    """``erfc(a)`` for ``a >= 0``, relatively accurate (0 once it underflows)."""
    a = tirx.min(a, const(a, _ERFC_Z_MAX))
    hi, lo = _neg_square(a, 1.0)
    return _erfc_core(a, hi, lo)


def _erf_small(x: Expr) -> Expr:
    """``erf`` for ``|x| <= 1`` (other x are clamped)."""
    xs = _clamp(x, -_ERF_SMALL, _ERF_SMALL)
    return xs * _poly(xs * xs, _ERF_POLY)


def erfc(x: Expr) -> Expr:
    """Complementary error function (fp32, ~4e-7 relative, also where erfc is tiny)."""
    _check_f32(x, "erfc")
    e = _erfc_abs(tirx.abs(x))
    large = tirx.Select(x < const(x, 0.0), const(x, 2.0) - e, e)
    # Near 0, 1 - erf is more accurate than the erfc fit (no cancellation below 0.5).
    small = const(x, 1.0) - _erf_small(x)
    return _keep_nan(x, tirx.Select(tirx.abs(x) < const(x, _ERFC_SMALL), small, large))


def erf(x: Expr) -> Expr:
    """Error function (fp32, ~2e-7 absolute and relative)."""
    _check_f32(x, "erf")
    large = const(x, 1.0) - _erfc_abs(tirx.min(tirx.abs(x), const(x, _ERF_X_MAX)))
    result = tirx.Select(tirx.abs(x) < const(x, _ERF_SMALL), _erf_small(x), _copysign(large, x))
    return _keep_nan(x, result)


def tanh(x: Expr) -> Expr:
    """Hyperbolic tangent (fp32, ~2 ulp; exactly +-1 for large |x|)."""
    _check_f32(x, "tanh")
    xs = _clamp(x, -_TANH_SMALL, _TANH_SMALL)
    s = xs * xs
    small = _poly(s, _TANH_POLY) * s * xs + xs
    e = _exp_parts(const(x, -2.0) * tirx.min(tirx.abs(x), const(x, _TANH_X_MAX)),
                   nonpositive=True)
    large = _copysign((const(x, 1.0) - e) * _reciprocal(const(x, 1.0) + e), x)
    return _keep_nan(x, tirx.Select(tirx.abs(x) < const(x, _TANH_SMALL), small, large))


def _sigmoid(x: Expr) -> Expr:
    e = _exp_parts(-tirx.abs(x), nonpositive=True)
    s = _reciprocal(const(x, 1.0) + e)
    return tirx.Select(x >= const(x, 0.0), s, e * s)


def sigmoid(x: Expr) -> Expr:
    """``1 / (1 + e^-x)`` (fp32, relatively accurate on both tails, incl. denormals)."""
    _check_f32(x, "sigmoid")
    return _keep_nan(x, _sigmoid(x))


def _phi_parts(x: Expr) -> tuple[Expr, Expr, Expr, Expr]:
    """(h, hi, lo, xc): ``h = Phi(-|x|)`` (the small side of the normal CDF),
    ``-x^2/2 = hi + lo`` and ``xc``, x clamped to where Phi is not yet 0 or 1 in fp32."""
    xc = _clamp(x, -_GELU_X_MAX, _GELU_X_MAX)
    a = tirx.abs(xc)
    hi, lo = _neg_square(a, 0.5)
    h = const(x, 0.5) * _erfc_core(a * const(x, _SQRT1_2), hi, lo)
    return h, hi, lo, xc


def gelu(x: Expr) -> Expr:
    """``x Phi(x)`` = ``x/2 (1 + erf(x/sqrt 2))`` (fp32) with erf as one rational function:
    ~22 operations where the relatively accurate form (``_phi_parts``: erfc's exponential
    with a split square) took ~50, and GELU epilogues were ~9% of ConvNeXt-T's time (Zen 5).
    Absolute error <= 2.5e-7 max(1, |x|); relative error <= 2e-6 for x >= -1.5, growing on
    the far negative tail where GELU is ~0 (x < -5.66 gives exactly 0). A NaN passes the
    ``max(-c, x)`` (NaN-keeping operand order) and multiplies through."""
    _check_f32(x, "gelu")
    xc = _clamp(x, -_GELU_ERF_X_MAX, _GELU_ERF_X_MAX)
    s = xc * xc
    erf = tirx.max(const(x, -1.0),
                   xc * _poly(s, _GELU_ERF_NUM) * _reciprocal(_poly(s, _GELU_ERF_DEN)))
    half = const(x, 0.5) * tirx.max(const(x, -_GELU_ERF_X_MAX), x)
    return half * erf + half


def gelu_inv(dy: Expr, x: Expr) -> Expr:
    """``dy gelu'(x)`` = ``dy (Phi(x) + x phi(x))`` (fp32)."""
    _check_f32(x, "gelu_inv")
    h, hi, lo, xc = _phi_parts(x)
    cdf = tirx.Select(x < const(x, 0.0), h, const(x, 1.0) - h)
    pdf = const(x, _INV_SQRT_2PI) * _exp_parts(hi, lo)
    return dy * _keep_nan(x, cdf + xc * pdf)


def gelu_tanh(x: Expr) -> Expr:
    """``x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))``, computed as ``x sigmoid(2u)``."""
    _check_f32(x, "gelu_tanh")
    xc = _clamp(x, -_GELU_TANH_X_MAX, _GELU_TANH_X_MAX)
    u2 = const(x, 2.0 * _SQRT_2_PI) * (xc + const(x, _GELU_TANH_C) * xc * xc * xc)
    # A NaN fails x < 0 and multiplies through itself.
    return tirx.Select(x < const(x, 0.0), xc, x) * _sigmoid(u2)


def silu(x: Expr) -> Expr:
    """``x sigmoid(x)`` (swish), on the same SIMD sigmoid. The product carries a NaN input
    through by itself (no NaN test: a compare and blend fewer in every GEMM epilogue); an
    input below exp's range gives 0, not -inf * 0."""
    _check_f32(x, "silu")
    return tirx.Select(x < const(x, _EXP_LO), splat(x, 0.0), x) * _sigmoid(x)


def quick_gelu(x: Expr) -> Expr:
    """``x sigmoid(1.702 x)``: :func:`silu` of the scaled input, times the input."""
    _check_f32(x, "quick_gelu")
    scaled = const(x, QUICK_GELU_SCALE) * x
    return tirx.Select(scaled < const(x, _EXP_LO), splat(x, 0.0), x) * _sigmoid(scaled)


def _relu_inv(dy: Expr, x: Expr) -> Expr:
    # The spec's Select needs both arms of one type: splat the zero.
    return tirx.Select(x > const(x, 0.0), dy, splat(dy, 0.0))


def _relu(x: Expr) -> Expr:
    # TVM lowers max(X, 0) to X > 0 ? X : 0, which makes NaN 0 where ONNX Runtime keeps it;
    # X < 0 ? 0 : X keeps it (and needs no isnan, which scalable vectors and bf16 lack).
    return tirx.Select(x < splat(x, 0.0), splat(x, 0.0), x)


def _relu6(x: Expr) -> Expr:
    return tirx.Select(x > splat(x, 6.0), splat(x, 6.0), _relu(x))


def _leaky_relu(x: Expr) -> Expr:
    return tirx.Select(x < splat(x, 0.0), x * splat(x, LEAKY_RELU_SLOPE), x)


def _hardswish(x: Expr) -> Expr:
    # times 1/6 rather than a division: within an ulp of ONNX Runtime's / 6
    return x * _relu6(x + splat(x, 3.0)) * splat(x, 1.0 / 6.0)


#: Vector forms the templates use instead of ``OPS[op].fn``: ops whose exact form would lower
#: to per-lane libm calls (exp, tanh, erf) or does not type-check on vectors (relu_inv).
FAST: dict[str, Callable[..., Expr]] = {
    "exp": exp,
    "tanh": tanh,
    "sigmoid": sigmoid,
    "silu": silu,
    "quick_gelu": quick_gelu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "gelu_inv": gelu_inv,
    "relu_inv": _relu_inv,
    "relu": _relu,
    "relu6": _relu6,
    "leaky_relu": _leaky_relu,
    "hardswish": _hardswish,
}


#: Ops whose vector math is a long dependent chain (tens of instructions): several vectors
#: computed side by side interleave them (see ``equation_template.equation_impl``).
LONG_CHAINS = frozenset({"exp", "tanh", "sigmoid", "silu", "quick_gelu", "gelu", "gelu_tanh",
                         "gelu_inv"})


def vector_fn(op: str) -> Callable[..., Expr]:
    """The math of ``op`` as the TPP implementations compute it: its vector form if it has
    one (NaN-keeping ReLU, the accurate sigmoid tails), else the spec's. A TE stage applying
    a TPP op outside a TPP (an epilogue that stays TIR) uses this so it agrees with the TPPs;
    speed alone would not need it (the tpp TIR pipeline lowers exp/tanh/erf to SIMD)."""
    return FAST.get(op) or OPS[op].fn
