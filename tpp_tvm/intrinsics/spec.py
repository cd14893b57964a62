"""The TPP specification: what each primitive computes, independent of any ISA.

A TPP is a 2D tensor operator on a tile of M rows by N columns (row-major, each
operand with its own leading dimension). This module is the datasheet: for every
primitive it states the math, the operand shapes, the dtypes and the flags, and how a
concrete primitive is named. What follows from it lives beside it: operand geometry in
``geometry.py``; per kind of TPP (``kinds/``) the TIR *description* that TVM's
``tensorize`` matches against a block, the TE form and the catalogue tiles. ISA
implementations (``avx512.py``, ``amx.py``, ``sve.py``) provide the other half of each
tensor intrinsic and never change what a TPP means.

Conventions, as in LIBXSMM's TPP spec:

* Tiles are row-major ``(M, N)``; the leading dimension (row stride) of every 2D
  operand is free (symbolic in the description), so a TPP applies to any sub-tile
  of a larger tensor. Elements within a row are contiguous.
* ``beta`` (BRGEMM/GEMM): 0 overwrites C, 1 accumulates into C.
* ``bcast`` (binary ops, second operand ``Y``): ``"none"`` – Y is ``(M, N)``;
  ``"row"`` – Y is one row ``(N,)`` repeated for every row (a bias);
  ``"col"`` – Y is one column ``(M,)`` repeated across the columns;
  ``"scalar"`` – Y is ``(1,)``.
* Reductions ``*_rows`` reduce over the M rows (output ``(N,)``, LIBXSMM's
  REDUCE_ROWS); ``*_cols`` reduce over the N columns (output ``(M,)``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from tvm import tirx

from ..errors import TPPError, UnsupportedDTypeError, UnsupportedShapeError

#: Short dtype names used in intrinsic names (``tpp.<op>.<dtype>.<isa>...``).
DTYPE_SHORT = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
}

Fn = Callable[..., tirx.Expr]


def dtype_of(x: tirx.Expr) -> str:
    """The dtype string of a TIR expression (``float32``, ``float32x16``, ...)."""
    ty = getattr(x, "ty", None)
    return str(ty.dtype if ty is not None and hasattr(ty, "dtype") else x.dtype)


def _elem(x: tirx.Expr) -> str:
    return dtype_of(x).split("x")[0]


def const(x: tirx.Expr, value: float) -> tirx.Expr:
    """``value`` as a constant of ``x``'s scalar dtype; TIR broadcasts it to vectors."""
    return tirx.const(value, _elem(x))


_SQRT1_2 = 1.0 / math.sqrt(2.0)
#: The negative slope of ``leaky_relu`` (torch's and ONNX's default; CSPNet's, YOLO's).
LEAKY_RELU_SLOPE = 0.01
#: The sigmoid's input scale in ``quick_gelu`` (OpenAI CLIP's activation).
QUICK_GELU_SCALE = 1.702
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu(x):
    return const(x, 0.5) * x * (const(x, 1.0) + tirx.erf(x * const(x, _SQRT1_2)))


def _gelu_tanh(x):
    inner = const(x, _SQRT_2_PI) * (x + const(x, 0.044715) * x * x * x)
    return const(x, 0.5) * x * (const(x, 1.0) + tirx.tanh(inner))


def _gelu_inv(dy, x):
    cdf = const(x, 0.5) * (const(x, 1.0) + tirx.erf(x * const(x, _SQRT1_2)))
    pdf = const(x, _INV_SQRT_2PI) * tirx.exp(const(x, -0.5) * x * x)
    return dy * (cdf + x * pdf)


def _sigmoid(x):
    return const(x, 1.0) / (const(x, 1.0) + tirx.exp(-x))


@dataclass(frozen=True)
class OpDef:
    """One primitive of the set: its operand structure (``kind``) and its math.

    ``fn`` is the exact scalar math used by the description; implementations may use
    faster approximations with fp32-level accuracy (see ``vector_math.py``).
    """

    kind: str
    fn: Fn | None
    doc: str


#: The TPP set. Kinds: unary ``Y = f(X)``; unary_bwd ``dX = f(dY, S)`` where S is the
#: saved forward input or output (see doc); binary ``Z = f(X, Y)``; muladd
#: ``Z = X * Y + Z``; reduce (``*_rows`` / ``*_cols``); transform (layout changes);
#: brgemm/gemm.
OPS: dict[str, OpDef] = {
    # unary
    "zero": OpDef("zero", None, "Y = 0"),
    "copy": OpDef("unary", lambda x: x, "Y = X, converting to out_dtype when given"),
    "relu": OpDef("unary", lambda x: tirx.max(x, const(x, 0.0)),
                  "Y = max(X, 0), NaN stays NaN"),
    "relu6": OpDef("unary", lambda x: tirx.min(tirx.max(x, const(x, 0.0)), const(x, 6.0)),
                   "Y = min(max(X, 0), 6), NaN stays NaN"),
    "leaky_relu": OpDef("unary", lambda x: tirx.Select(x < const(x, 0.0),
                                                       x * const(x, LEAKY_RELU_SLOPE), x),
                        "Y = X where X >= 0, else 0.01 X (the default slope of torch and ONNX)"),
    "hardswish": OpDef("unary", lambda x: x * (tirx.min(tirx.max(x + const(x, 3.0),
                                                                  const(x, 0.0)),
                                                         const(x, 6.0)) / const(x, 6.0)),
                       "Y = X * min(max(X + 3, 0), 6) / 6 (MobileNetV3's)"),
    "gelu": OpDef("unary", _gelu, "Y = X/2 * (1 + erf(X/sqrt 2))"),
    "gelu_tanh": OpDef("unary", _gelu_tanh, "Y = X/2 * (1 + tanh(sqrt(2/pi)(X + 0.044715 X^3)))"),
    "tanh": OpDef("unary", tirx.tanh, "Y = tanh(X)"),
    "sigmoid": OpDef("unary", _sigmoid, "Y = 1 / (1 + exp(-X))"),
    "silu": OpDef("unary", lambda x: x * _sigmoid(x), "Y = X / (1 + exp(-X)) (swish)"),
    "quick_gelu": OpDef("unary", lambda x: x * _sigmoid(const(x, QUICK_GELU_SCALE) * x),
                        "Y = X * sigmoid(1.702 X) (CLIP's GELU approximation)"),
    "exp": OpDef("unary", tirx.exp, "Y = exp(X)"),
    "reciprocal": OpDef("unary", lambda x: const(x, 1.0) / x, "Y = 1 / X"),
    "sqrt": OpDef("unary", tirx.sqrt, "Y = sqrt(X)"),
    "rsqrt": OpDef("unary", tirx.rsqrt, "Y = 1 / sqrt(X)"),
    "negate": OpDef("unary", lambda x: -x, "Y = -X"),
    "square": OpDef("unary", lambda x: x * x, "Y = X * X"),
    # backward forms
    "relu_inv": OpDef(
        "unary_bwd",
        lambda dy, x: tirx.Select(x > const(x, 0.0), dy, const(x, 0.0)),
        "dX = dY where X > 0 else 0 (S = forward input X)",
    ),
    "gelu_inv": OpDef("unary_bwd", _gelu_inv, "dX = dY * gelu'(X) (S = forward input X)"),
    "tanh_inv": OpDef(
        "unary_bwd", lambda dy, y: dy * (const(y, 1.0) - y * y), "dX = dY * (1 - Y^2) (S = Y)"
    ),
    "sigmoid_inv": OpDef(
        "unary_bwd", lambda dy, y: dy * y * (const(y, 1.0) - y), "dX = dY * Y * (1 - Y) (S = Y)"
    ),
    # binary
    "add": OpDef("binary", lambda x, y: x + y, "Z = X + Y"),
    "sub": OpDef("binary", lambda x, y: x - y, "Z = X - Y"),
    "mul": OpDef("binary", lambda x, y: x * y, "Z = X * Y"),
    "div": OpDef("binary", lambda x, y: x / y, "Z = X / Y"),
    "max": OpDef("binary", tirx.max, "Z = max(X, Y)"),
    "min": OpDef("binary", tirx.min, "Z = min(X, Y)"),
    "muladd": OpDef("muladd", lambda x, y, z: x * y + z, "Z = X * Y + Z"),
    # precision conversions (copy converts fp32 <-> bf16 too)
    "quantize": OpDef(
        "quant",
        None,
        "Y = saturate(round_half_even(X * S[j] + O[j])); X fp32, Y u8/s8, S = 1/scale and "
        "O = zero point per column (ONNX QuantizeLinear with a per-column or repeated scale)",
    ),
    "requantize": OpDef(
        "quant",
        None,
        "Y = saturate(round_half_even(float(X) * S[j] + O[j])); X int32 (an int8 GEMM's "
        "accumulator), Y u8/s8",
    ),
    "requantize_add": OpDef(
        "quant",
        None,
        "Y = saturate(round_half_even((float(X) * S[j] + O[j] + float(R)) * A[j] + Z[j])); "
        "X int32 (an int8 GEMM's accumulator), R a u8/s8 residual tile of Y's dtype "
        "(its scale and zero point folded into S, O), A and Z the output's quantization "
        "(a residual int8 layer's whole epilogue in one pass)",
    ),
    "requantize_add_relu": OpDef(
        "quant",
        None,
        "Y = saturate(round_half_even(max(float(X) * S[j] + O[j] + float(R), 0) * A[j] + "
        "Z[j])); as requantize_add, with a ReLU after the residual (ResNet's blocks)",
    ),
    "dequantize": OpDef(
        "quant",
        None,
        "Y = float(X) * S[j] + O[j]; X int32/u8/s8, Y fp32 (S = scale, O = -zero point * "
        "scale; for an int8 GEMM, S = scale_A * scale_B[j], O folds the zero-point terms)",
    ),
    # pooling
    "pool_max": OpDef(
        "pool",
        None,
        "Y[i, j] = max_{r<batch, s<k} A[r, i*stride + s*tap_stride + j]; A (batch, span) "
        "input rows (W*C flattened): max pooling over a batch x k window, stride and "
        "tap_stride in elements (tap_stride defaults to n)",
    ),
    # equations
    "equation": OpDef(
        "equation",
        None,
        "Y = steps applied to X in order; a step is a unary TPP, 'bias' (+ a row vector "
        "(N,)), 'residual' (+ an (M, N) operand), 'residual_u8'/'residual_s8' (+ a u8/s8 "
        "(M, N) operand converted to fp32), 'gate' (x an (M, N) operand) or 'scale' "
        "(x a row vector (N,)): e.g. a GEMM's fused epilogue (a SwiGLU up projection "
        "times its activated gate), a normalization's per-channel affine",
    ),
    # reductions
    "reduce_add_rows": OpDef("reduce", lambda x: x, "Y[j] = sum_i X[i, j]"),
    "reduce_max_rows": OpDef("reduce", lambda x: x, "Y[j] = max_i X[i, j]"),
    "reduce_sumsq_rows": OpDef("reduce", lambda x: x * x, "Y[j] = sum_i X[i, j]^2"),
    "reduce_add_cols": OpDef("reduce", lambda x: x, "Y[i] = sum_j X[i, j]"),
    "reduce_max_cols": OpDef("reduce", lambda x: x, "Y[i] = max_j X[i, j]"),
    "reduce_sumsq_cols": OpDef("reduce", lambda x: x * x, "Y[i] = sum_j X[i, j]^2"),
    # transforms
    "transpose": OpDef("transform", None, "Y[j, i] = X[i, j]; Y is (N, M)"),
    "vnni2": OpDef(
        "transform", None, "Y[i//2, j, i%2] = X[i, j]; Y is (ceil(M/2), N, 2), zero padded"
    ),
    "vnni4": OpDef(
        "transform", None, "Y[i//4, j, i%4] = X[i, j]; Y is (ceil(M/4), N, 4), zero padded"
    ),
    # contractions
    "gemm": OpDef("brgemm", None, "C (+)= A @ B; A (M, K), B (K, N)"),
    "brgemm": OpDef(
        "brgemm", None, "C (+)= sum_r A[r] @ B[r]; A (batch, M, K), B (batch, K, N), stride-based"
    ),
    "conv_brgemm": OpDef(
        "brgemm",
        None,
        "C[i, j] (+)= sum_r sum_k A[r, i*stride + k] B[r, k, j]; A (batch, (M-1)*stride + K) "
        "input rows (W*C flattened), B (batch, K, N) filter rows: a convolution as BRGEMM "
        "over its filter rows, K = filter width x channels, stride in elements",
    ),
}

BCASTS = ("none", "row", "col", "scalar")

#: (A, B) dtypes a contraction TPP takes: fp32 FMA, bf16 dot products into fp32
#: (AVX512_BF16 ``vdpbf16ps``, AMX ``tdpbf16ps``), u8 x s8 dot products into int32
#: (AVX512_VNNI ``vpdpbusd``, AMX ``tdpbusd``), s16 x s16 pairs into int32 (AVX2
#: ``vpmaddwd``).
CONTRACTION_DTYPES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("uint8", "int8"),
                      ("int16", "int16"))


#: Dtypes max pooling takes: fp32, and a quantized model's u8/s8 activations (the maximum
#: commutes with quantization, so a max pool between int8 layers runs on their bytes).
POOL_DTYPES = ("float32", "uint8", "int8")


#: (input, output) dtypes of the quantization TPPs.
QUANT_DTYPES = {
    "quantize": (("float32", "uint8"), ("float32", "int8")),
    "requantize": (("int32", "uint8"), ("int32", "int8")),
    "requantize_add": (("int32", "uint8"), ("int32", "int8")),
    "requantize_add_relu": (("int32", "uint8"), ("int32", "int8")),
    "dequantize": (("int32", "float32"), ("uint8", "float32"), ("int8", "float32")),
}


def scaled_expr(x: tirx.Expr, scale: tirx.Expr, offset: tirx.Expr) -> tirx.Expr:
    """``float(x) * scale + offset`` on an element or a vector: the value a quantization
    TPP rounds and saturates (or a dequantization returns)."""
    lanes = dtype_of(x).partition("x")[2]
    v = tirx.Cast(f"float32x{lanes}" if lanes else "float32", x) if _elem(x) != "float32" else x
    return v * scale + offset


def quant_expr(op: str, x: tirx.Expr, scale: tirx.Expr, offset: tirx.Expr,
               out_dtype: str) -> tirx.Expr:
    """The math of a quantization TPP on one element or one vector (``out_dtype`` is the
    scalar output type); descriptions, TE workloads and implementations share it.

    Quantizing clamps, then rounds and converts in one step (LLVM ``lrint``, the current
    rounding mode: half to even): one ``vcvtps2dq`` on x86 where ``round`` then a conversion
    was ``vrndscaleps`` + ``vcvttps2dq``, three of a requantize epilogue's nine vector-port
    uops (AMX Xeon: 112 -> 94 ns a 32 x 32 int8 block). The values are the same: the
    bounds are integers, so rounding commutes with the clamp."""
    lanes = dtype_of(x).partition("x")[2]
    vec = (lambda d: f"{d}x{lanes}") if lanes else (lambda d: d)
    v = scaled_expr(x, scale, offset)
    if op == "dequantize":
        return v
    lo, hi = {"uint8": (0.0, 255.0), "int8": (-128.0, 127.0)}[out_dtype]
    v = tirx.max(tirx.min(v, const(v, hi)), const(v, lo))
    return tirx.Cast(vec(out_dtype), tirx.call_llvm_pure_intrin(vec("int32"), "llvm.lrint", v))


#: Quantization TPPs that add a residual tile between dequantizing and quantizing
#: (operands X, S, O, R, A, Z -> Y; see :func:`residual_quant_expr`).
RESIDUAL_QUANT_OPS = ("requantize_add", "requantize_add_relu")


def residual_quant_expr(op: str, x: tirx.Expr, scale: tirx.Expr, offset: tirx.Expr,
                        residual: tirx.Expr, out_scale: tirx.Expr, out_offset: tirx.Expr,
                        out_dtype: str) -> tirx.Expr:
    """The math of :data:`RESIDUAL_QUANT_OPS` on one element or one vector."""
    return quant_expr("quantize", residual_sum_expr(op, x, scale, offset, residual),
                      out_scale, out_offset, out_dtype)


def residual_sum_expr(op: str, x: tirx.Expr, scale: tirx.Expr, offset: tirx.Expr,
                      residual: tirx.Expr) -> tirx.Expr:
    """The fp32 sum :data:`RESIDUAL_QUANT_OPS` quantize: ``float(x) * scale + offset +
    float(residual)``, rectified for the ``_relu`` op."""
    lanes = dtype_of(x).partition("x")[2]
    f32 = f"float32x{lanes}" if lanes else "float32"
    v = tirx.Cast(f32, x) * scale + offset + tirx.Cast(f32, residual)
    if op.endswith("_relu"):
        v = tirx.max(v, const(v, 0.0))
    return v


def vnni_factor(dtype: str) -> int:
    """Elements of ``dtype`` one 32-bit dot-product lane consumes (1 for fp32 FMA)."""
    return {"bfloat16": 2, "float16": 2, "int16": 2, "uint8": 4, "int8": 4}.get(dtype, 1)


@dataclass(frozen=True)
class TPPSpec:
    """One concrete primitive: op, dtype, tile shape and flags.

    ``m``/``n`` are the tile's rows/columns (for GEMM/BRGEMM, C's); ``k`` and ``batch``
    only for contractions (the reduction and the batch) and pooling (the window's taps and
    rows). ``out_dtype`` for converting copies and quantization (defaults to ``dtype``);
    a contraction's output is its accumulator type, fp32 (int32 for int8 inputs).
    ``b_dtype`` is a contraction's B dtype when it differs from A's (u8 x s8).
    Low-precision contractions (see :data:`CONTRACTION_DTYPES`) take B in VNNI layout:
    ``vnni`` consecutive k of one column are adjacent, B is ``(K / vnni, N, vnni)``, and K
    is a multiple of ``vnni``. ``stride`` (conv_brgemm, pool_max) and ``tap_stride``
    (pool_max) are in elements.

    A spec is canonical: a field that does not apply to its kind keeps its default, and a
    value equal to its default is stored as the default (``b_dtype`` = ``dtype``,
    ``out_dtype`` = the natural output type, ``tap_stride`` = ``n``), so that
    :meth:`name` says everything about a spec and :meth:`from_name` is its exact inverse.
    """

    op: str
    dtype: str = "float32"
    m: int = 1
    n: int = 1
    k: int = 0
    batch: int = 1
    beta: int = 1
    bcast: str = "none"
    out_dtype: str | None = None
    b_dtype: str | None = None
    stride: int = 1
    steps: tuple[str, ...] = ()
    tap_stride: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise UnsupportedShapeError(
                f"unknown TPP {self.op!r}; the set is: {', '.join(sorted(OPS))}"
            )
        if self.dtype not in DTYPE_SHORT:
            raise UnsupportedDTypeError(
                f"TPP {self.op}: dtype {self.dtype!r} is not one of {sorted(DTYPE_SHORT)}"
            )
        if self.kind == "pool" and (self.batch < 1 or self.k < 1 or self.batch * self.k < 2):
            raise UnsupportedShapeError(f"TPP {self.op}: needs a window of >= 2 taps")
        if self.m < 1 or self.n < 1:
            raise UnsupportedShapeError(f"TPP {self.op}: tile {self.m}x{self.n} must be >= 1x1")
        if self.kind == "brgemm" and (self.k < 1 or self.batch < 1 or self.beta not in (0, 1)):
            raise UnsupportedShapeError(
                f"TPP {self.op}: needs k >= 1, batch >= 1, beta in (0, 1); got "
                f"k={self.k} batch={self.batch} beta={self.beta}"
            )
        if self.kind == "quant":
            self._check_quant_dtypes()
        if self.kind == "brgemm":
            self._check_contraction_dtypes()
        elif self.b_dtype is not None:
            raise UnsupportedDTypeError(f"TPP {self.op}: only contractions take a b_dtype")
        if self.op not in ("conv_brgemm", "pool_max") and self.stride != 1:
            raise UnsupportedShapeError(f"TPP {self.op}: only conv_brgemm takes a stride")
        if self.op == "gemm" and self.batch != 1:
            raise UnsupportedShapeError("TPP gemm has batch 1; use brgemm for batch-reduce")
        if self.bcast not in BCASTS:
            raise UnsupportedShapeError(f"TPP {self.op}: bcast {self.bcast!r} not in {BCASTS}")
        if self.bcast != "none" and self.kind not in ("binary", "muladd"):
            raise UnsupportedShapeError(f"TPP {self.op}: only binary TPPs take a broadcast flag")
        if (self.op == "equation") != bool(self.steps):
            raise UnsupportedShapeError("TPP equation needs steps; other TPPs take none")
        if len(equation_operands(self.steps)) > 2 or len(self.steps) > MAX_EQUATION_STEPS:
            raise UnsupportedShapeError(
                f"TPP equation: at most {MAX_EQUATION_STEPS} steps, two of them with an "
                f"operand ({'/'.join(OPERAND_STEPS)})"
            )
        bad = [s for s in self.steps if s not in EQUATION_STEPS]
        if bad:
            raise UnsupportedShapeError(
                f"TPP equation: unknown steps {bad}; steps are {', '.join(EQUATION_STEPS)}"
            )
        self._check_unused_fields()
        self._canonicalize()

    def _check_unused_fields(self) -> None:
        """Extents a kind has no use for must keep their defaults (the name omits them)."""
        unused = []
        if self.kind not in ("brgemm", "pool"):
            unused += [f"k={self.k}"] * (self.k != 0) + [f"batch={self.batch}"] * (self.batch != 1)
        if self.kind != "brgemm" and self.beta != 1:
            unused.append(f"beta={self.beta}")
        if self.kind != "pool" and self.tap_stride != 0:
            unused.append(f"tap_stride={self.tap_stride}")
        if self.kind == "brgemm" and self.out_dtype not in (None, "", self._natural_out()):
            raise UnsupportedDTypeError(
                f"TPP {self.op} {self.dtype}: accumulates in {self._natural_out()}; "
                f"out_dtype {self.out_dtype} is not supported"
            )
        if unused:
            raise UnsupportedShapeError(
                f"TPP {self.op}: takes no {', '.join(unused)} (k and batch are for "
                "contractions and pooling, beta for contractions, tap_stride for pooling)"
            )

    def _canonicalize(self) -> None:
        """Values equal to their defaults become the defaults (one spec, one name)."""
        if self.out_dtype in ("", self._natural_out()):
            object.__setattr__(self, "out_dtype", None)
        if self.b_dtype == self.dtype:
            object.__setattr__(self, "b_dtype", None)
        if self.tap_stride == self.n:
            object.__setattr__(self, "tap_stride", 0)

    def _natural_out(self) -> str:
        """The output dtype without ``out_dtype``: a contraction's accumulator, else dtype."""
        if self.kind == "brgemm":
            return "int32" if self.dtype in ("int8", "uint8", "int16") else "float32"
        return self.dtype

    def _check_contraction_dtypes(self) -> None:
        pair = (self.dtype, self.b_dtype or self.dtype)
        if pair not in CONTRACTION_DTYPES:
            supported = ", ".join(f"{a} x {b}" for a, b in CONTRACTION_DTYPES)
            raise UnsupportedDTypeError(
                f"TPP {self.op}: A x B dtypes {pair[0]} x {pair[1]} are not supported; "
                f"supported: {supported}"
            )
        if self.vnni > 1 and self.op == "conv_brgemm" and self.stride % self.vnni:
            raise UnsupportedShapeError(
                f"TPP conv_brgemm {self.dtype}: stride {self.stride} must be a multiple of "
                f"the VNNI factor {self.vnni} (pad the channels to a multiple of it)"
            )
        if self.k % self.vnni:
            raise UnsupportedShapeError(
                f"TPP {self.op} {self.dtype}: k={self.k} must be a multiple of the VNNI "
                f"factor {self.vnni} (pad K with zeros)"
            )

    def _check_quant_dtypes(self) -> None:
        pair = (self.dtype, self.out_dtype)
        if pair not in QUANT_DTYPES[self.op]:
            supported = ", ".join(f"{a}->{b}" for a, b in QUANT_DTYPES[self.op])
            raise UnsupportedDTypeError(
                f"TPP {self.op}: {pair[0]}->{pair[1]} is not supported; supported: {supported}"
            )

    @property
    def kind(self) -> str:
        return OPS[self.op].kind

    @property
    def vnni(self) -> int:
        """How many consecutive k of B a contraction packs together (1: plain layout)."""
        return vnni_factor(self.dtype) if self.kind == "brgemm" else 1

    @property
    def taps(self) -> int:
        """Elements between a pooling window's consecutive taps (default: the tile width)."""
        return self.tap_stride or self.n

    @property
    def acc_dtype(self) -> str:
        """Output dtype: ``out_dtype`` or, for contractions, the accumulator type."""
        return self.out_dtype or self._natural_out()

    def name(self, isa: str) -> str:
        """The intrinsic name of this spec on ``isa``; :meth:`from_name` inverts it.

        ``tpp.<op>.<dtype>[<b_dtype>].<isa>.m<M>n<N><extents>[.beta0][.bcast_<b>][.<steps>]
        [.to_<out_dtype>]``, dtypes short (:data:`DTYPE_SHORT`); extents are
        ``k<K>[b<batch>][s<stride>]`` for contractions (no batch for gemm, a stride for
        conv_brgemm) and ``r<batch>x<k>s<stride>t<taps>`` for pooling; equation steps are
        joined by ``_`` (``__`` where a step boundary would read as one step: gelu, tanh).
        """
        dts = DTYPE_SHORT[self.dtype]
        if self.b_dtype and self.b_dtype != self.dtype:
            dts += DTYPE_SHORT[self.b_dtype]
        parts = ["tpp", self.op, dts, isa, f"m{self.m}n{self.n}"]
        if self.kind == "brgemm":
            parts[-1] += f"k{self.k}" + (f"b{self.batch}" if self.op != "gemm" else "")
            if self.op == "conv_brgemm":
                parts[-1] += f"s{self.stride}"
            if self.beta == 0:
                parts.append("beta0")
        if self.kind == "pool":
            parts[-1] += f"r{self.batch}x{self.k}s{self.stride}t{self.taps}"
        if self.bcast != "none":
            parts.append(f"bcast_{self.bcast}")
        if self.steps:
            parts.append(_join_steps(self.steps))
        if self.out_dtype and self.out_dtype != self.dtype and self.kind != "brgemm":
            parts.append(f"to_{DTYPE_SHORT[self.out_dtype]}")
        return ".".join(parts)

    @classmethod
    def from_name(cls, name: str) -> tuple[TPPSpec, str]:
        """``(spec, isa)`` such that ``spec.name(isa) == name``; a ``ValueError`` if no spec
        has that name. Tuning records name their intrinsics; this rebuilds them."""
        try:
            spec, isa = _parse_name(name)
        except (TPPError, ValueError) as err:
            raise ValueError(f"{name!r} is not a TPP intrinsic name: {err}") from None
        if spec.name(isa) != name:
            raise ValueError(f"{name!r} is not a TPP intrinsic name; the nearest is "
                             f"{spec.name(isa)!r}")
        return spec, isa

    def with_shape(self, m: int, n: int) -> TPPSpec:
        return replace(self, m=m, n=n)


_LONG_DTYPE = {short: long for long, short in DTYPE_SHORT.items()}
#: The extents of a name's tile field, each letter followed by its value.
_TILE = re.compile(r"m(?P<m>\d+)n(?P<n>\d+)(?:k(?P<k>\d+))?(?:b(?P<batch>\d+))?"
                   r"(?:r(?P<rows>\d+)x(?P<taps>\d+))?(?:s(?P<stride>\d+))?"
                   r"(?:t(?P<tap_stride>\d+))?")


def _parse_name(name: str) -> tuple[TPPSpec, str]:
    """The spec a name spells, read field by field (:meth:`TPPSpec.name`'s grammar)."""
    parts = name.split(".")
    if len(parts) < 5 or parts[0] != "tpp":
        raise ValueError("expected tpp.<op>.<dtype>.<isa>.m<M>n<N>...")
    _, op, dts, isa, tile, *flags = parts
    if op not in OPS:
        raise ValueError(f"unknown TPP {op!r}")
    fields: dict = dict(zip(("dtype", "b_dtype"), _parse_dtypes(dts)))
    hit = _TILE.fullmatch(tile)
    if hit is None:
        raise ValueError(f"tile {tile!r} is not m<M>n<N> followed by extents")
    ext = {key: int(v) for key, v in hit.groupdict().items() if v is not None}
    fields.update(m=ext.pop("m"), n=ext.pop("n"), stride=ext.pop("stride", 1))
    if "rows" in ext:  # a pooling window of rows x taps
        fields.update(batch=ext.pop("rows"), k=ext.pop("taps"))
    fields.update(ext)
    for flag in flags:
        if flag == "beta0":
            fields["beta"] = 0
        elif flag.startswith("bcast_"):
            fields["bcast"] = flag[len("bcast_"):]
        elif flag.startswith("to_"):
            fields["out_dtype"] = _parse_dtypes(flag[len("to_"):])[0]
        elif "steps" not in fields:
            fields["steps"] = _split_steps(flag)
        else:
            raise ValueError(f"unexpected field {flag!r}")
    return TPPSpec(op, **fields), isa


def _parse_dtypes(text: str) -> tuple[str, str | None]:
    """(dtype, b_dtype) of a short dtype field: ``f32``, or ``u8i8`` for u8 x s8."""
    if text in _LONG_DTYPE:
        return _LONG_DTYPE[text], None
    for cut in range(1, len(text)):
        if text[:cut] in _LONG_DTYPE and text[cut:] in _LONG_DTYPE:
            return _LONG_DTYPE[text[:cut]], _LONG_DTYPE[text[cut:]]
    raise ValueError(f"unknown dtype {text!r}; short dtypes are {', '.join(_LONG_DTYPE)}")


def _longest_step(text: str) -> str | None:
    """The longest equation step ``text`` starts with, as a whole ``_``-separated word."""
    fits = [s for s in EQUATION_STEPS if text == s or text.startswith(s + "_")]
    return max(fits, key=len, default=None)


def _join_steps(steps: tuple[str, ...]) -> str:
    """Steps joined by ``_``, or ``__`` where the step and the rest would read as a longer
    step (``gelu``, ``tanh`` next to ``gelu_tanh``), so that :func:`_split_steps` inverts it."""
    text = steps[-1]
    for step in reversed(steps[:-1]):
        joined = f"{step}_{text}"
        text = joined if _longest_step(joined) == step else f"{step}__{text}"
    return text


def _split_steps(text: str) -> tuple[str, ...]:
    """The steps :func:`_join_steps` joined into ``text`` (longest step names first)."""
    steps = []
    while text:
        step = _longest_step(text)
        if step is None:
            raise ValueError(f"{text!r} does not start with an equation step")
        steps.append(step)
        text = text[len(step) + 1:]
        if text.startswith("_"):  # a marked boundary
            text = text[1:]
    return tuple(steps)


# ---------------------------------------------------------------------------
# The math shared by descriptions, TE forms and implementations of reductions and
# equations (descriptions themselves: ``kinds/``; operand shapes: ``geometry.py``).
# ---------------------------------------------------------------------------


def reduce_identity(op: str, dtype: str) -> tirx.Expr:
    """Initial value of a reduction TPP (0, or the dtype's lowest value for max)."""
    return tirx.min_value(dtype) if "_max_" in op else tirx.const(0, dtype)


def reduce_combine(op: str, acc, val):
    """How a reduction TPP folds one mapped element into its accumulator."""
    return tirx.max(acc, val) if "_max_" in op else acc + val


#: Longest equation (each step is one pass over registers, not memory).
MAX_EQUATION_STEPS = 4
@dataclass(frozen=True)
class OperandStep:
    """An equation step with an operand: what the operand is and what the step does with it.

    ``row``: the operand is a row (N,) broadcast over the tile's rows (a bias, a scale);
    else a tile (M, N) (a residual, a gate). ``multiplies``: the step multiplies the value
    by the operand; else it adds it. ``dtype``: the operand's element type where it is not
    the equation's: an int8 layer adds the next int8 layer's input as its residual at a
    quarter of the bytes, u8/s8 converted to fp32, the caller having folded that input's
    scale and zero point into the equation's rows (``(r - z) * s`` added before a ReLU is
    ``s * relu(x / s - z + r)``)."""

    row: bool
    multiplies: bool = False
    dtype: str | None = None

    def shape(self, m: int, n: int) -> tuple[int, ...]:
        """The operand's shape in an (m, n) equation."""
        return (n,) if self.row else (m, n)

    def operand_dtype(self, dtype: str) -> str:
        """The operand's element type in an equation on ``dtype``."""
        return self.dtype or dtype

    def apply(self, v: tirx.Expr, operand: tirx.Expr) -> tirx.Expr:
        """The step on value ``v``."""
        if self.multiplies:
            return v * operand
        if self.dtype is not None:
            return v + tirx.Cast(dtype_of(v), operand)
        return v + operand


#: Longest equation (each step is one pass over registers, not memory).
MAX_EQUATION_STEPS = 4
#: The equation steps with an operand, in the order :data:`EQUATION_STEPS` lists them.
OPERAND_STEPS: dict[str, OperandStep] = {
    "bias": OperandStep(row=True),
    "residual": OperandStep(row=False),
    "residual_u8": OperandStep(row=False, dtype="uint8"),
    "residual_s8": OperandStep(row=False, dtype="int8"),
    "gate": OperandStep(row=False, multiplies=True),
    "scale": OperandStep(row=True, multiplies=True),
}
#: The unary TPPs an equation chains as steps (every one but copy): an epilogue's
#: activations.
UNARY_STEPS = tuple(op for op, d in OPS.items() if d.kind == "unary" and op != "copy")
#: Steps an equation TPP chains: the operand steps, then the unary steps.
EQUATION_STEPS = (*OPERAND_STEPS, *UNARY_STEPS)


def equation_operands(steps: tuple[str, ...]) -> list[str]:
    """The extra operands of an equation, in parameter order (one per operand step)."""
    return [s for s in steps if s in OPERAND_STEPS]


def equation_step(step: str, v: tirx.Expr, operand: tirx.Expr | None) -> tirx.Expr:
    """One step of an equation on value ``v`` (``operand`` for operand steps)."""
    if step in OPERAND_STEPS:
        return OPERAND_STEPS[step].apply(v, operand)
    return OPS[step].fn(v)


def equation_expr(steps: tuple[str, ...], x: tirx.Expr, operands: list[tirx.Expr]) -> tirx.Expr:
    """The whole equation as one expression (descriptions and TE workloads share it)."""
    it = iter(operands)
    v = x
    for step in steps:
        v = equation_step(step, v, next(it) if step in OPERAND_STEPS else None)
    return v
