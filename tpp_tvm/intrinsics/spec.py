"""The TPP specification: what each primitive computes, independent of any ISA.

A TPP is a 2D tensor operator on a tile of M rows by N columns (row-major, each
operand with its own leading dimension). This module is the datasheet: for every
primitive it states the math, the operand shapes, the dtypes and the flags, and it
generates the TIR *description* that TVM's ``tensorize`` matches against a block.
ISA implementations (``avx512.py``, ``amx.py``, ``sve.py``) provide the other half of
each tensor intrinsic and never change what a TPP means.

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
from collections.abc import Callable
from dataclasses import dataclass, replace

from tvm import tirx
from tvm.script import tirx as T

from ..errors import UnsupportedDTypeError, UnsupportedShapeError

#: Short dtype names used in intrinsic names (``tpp.<op>.<dtype>.<isa>...``).
DTYPE_SHORT = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int8": "i8",
    "uint8": "u8",
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
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _nan_kept(x: tirx.Expr, clamped: tirx.Expr) -> tirx.Expr:
    """``clamped`` (a max/min of ``x``), but NaN where ``x`` is NaN: TVM lowers max(X, 0)
    to X > 0 ? X : 0, which turns NaN into 0 where ONNX Runtime and torch propagate it."""
    return tirx.Select(tirx.isnan(x), x, clamped)


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
    "relu": OpDef("unary", lambda x: _nan_kept(x, tirx.max(x, const(x, 0.0))),
                  "Y = max(X, 0), NaN stays NaN"),
    "relu6": OpDef("unary", lambda x: _nan_kept(
        x, tirx.min(tirx.max(x, const(x, 0.0)), const(x, 6.0))),
        "Y = min(max(X, 0), 6), NaN stays NaN"),
    "gelu": OpDef("unary", _gelu, "Y = X/2 * (1 + erf(X/sqrt 2))"),
    "gelu_tanh": OpDef("unary", _gelu_tanh, "Y = X/2 * (1 + tanh(sqrt(2/pi)(X + 0.044715 X^3)))"),
    "tanh": OpDef("unary", tirx.tanh, "Y = tanh(X)"),
    "sigmoid": OpDef("unary", _sigmoid, "Y = 1 / (1 + exp(-X))"),
    "silu": OpDef("unary", lambda x: x * _sigmoid(x), "Y = X / (1 + exp(-X)) (swish)"),
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
        "(N,)) or 'residual' (+ an (M, N) operand): e.g. a GEMM's fused epilogue",
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
#: (AVX512_VNNI ``vpdpbusd``, AMX ``tdpbusd``).
CONTRACTION_DTYPES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("uint8", "int8"))


#: (input, output) dtypes of the quantization TPPs.
QUANT_DTYPES = {
    "quantize": (("float32", "uint8"), ("float32", "int8")),
    "requantize": (("int32", "uint8"), ("int32", "int8")),
    "dequantize": (("int32", "float32"), ("uint8", "float32"), ("int8", "float32")),
}


def quant_expr(op: str, x: tirx.Expr, scale: tirx.Expr, offset: tirx.Expr,
               out_dtype: str) -> tirx.Expr:
    """The math of a quantization TPP on one element or one vector (``out_dtype`` is the
    scalar output type); descriptions, TE workloads and implementations share it."""
    lanes = dtype_of(x).partition("x")[2]
    vec = (lambda d: f"{d}x{lanes}") if lanes else (lambda d: d)
    v = tirx.Cast(vec("float32"), x) if _elem(x) != "float32" else x
    v = v * scale + offset
    if op == "dequantize":
        return v
    lo, hi = {"uint8": (0.0, 255.0), "int8": (-128.0, 127.0)}[out_dtype]
    v = tirx.max(tirx.min(tirx.round(v), const(v, hi)), const(v, lo))
    return tirx.Cast(vec(out_dtype), v)


def vnni_factor(dtype: str) -> int:
    """Elements of ``dtype`` one 32-bit dot-product lane consumes (1 for fp32 FMA)."""
    return {"bfloat16": 2, "float16": 2, "uint8": 4, "int8": 4}.get(dtype, 1)


@dataclass(frozen=True)
class TPPSpec:
    """One concrete primitive: op, dtype, tile shape and flags.

    ``m``/``n`` are the tile's rows/columns (for GEMM/BRGEMM, C's); ``k`` and ``batch``
    only for contractions. ``out_dtype`` for converting copies and for contractions'
    accumulator (defaults to ``dtype``, int32 for int8 inputs). ``b_dtype`` is a
    contraction's B dtype when it differs from A's (u8 x s8). Low-precision contractions
    (see :data:`CONTRACTION_DTYPES`) take B in VNNI layout: ``vnni`` consecutive k of one
    column are adjacent, B is ``(K / vnni, N, vnni)``, and K is a multiple of ``vnni``.
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
                f"TPP equation: at most {MAX_EQUATION_STEPS} steps, two of them bias/residual"
            )
        bad = [s for s in self.steps if s not in EQUATION_STEPS]
        if bad:
            raise UnsupportedShapeError(
                f"TPP equation: unknown steps {bad}; steps are {', '.join(EQUATION_STEPS)}"
            )

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
        if self.out_dtype:
            return self.out_dtype
        if self.kind == "brgemm":
            return "int32" if self.dtype in ("int8", "uint8") else "float32"
        return self.dtype

    def name(self, isa: str) -> str:
        """``tpp.<op>.<dtype>[<b_dtype>].<isa>.m<M>n<N>[k<K>b<batch>][.beta0][.bcast_<b>][.to_<dt>]``."""
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
            parts.append("_".join(self.steps))
        if self.out_dtype and self.out_dtype != self.dtype and self.kind != "brgemm":
            parts.append(f"to_{DTYPE_SHORT[self.out_dtype]}")
        return ".".join(parts)

    def with_shape(self, m: int, n: int) -> TPPSpec:
        return replace(self, m=m, n=n)


# ---------------------------------------------------------------------------
# Descriptions. One TVMScript template per kind; the op's math is plugged in.
# Every 2D operand has a symbolic leading dimension so the TPP matches sub-tiles.
# ---------------------------------------------------------------------------


def whole(buf: tirx.Buffer):
    """The region covering all of ``buf`` (for ``T.reads``/``T.writes``)."""
    return buf[tuple(slice(0, e) for e in buf.shape)]


def bcast_shape(spec: TPPSpec) -> tuple[int, ...]:
    """Shape of the second operand of a binary TPP for its broadcast flag."""
    return {"none": (spec.m, spec.n), "row": (spec.n,), "col": (spec.m,), "scalar": (1,)}[
        spec.bcast
    ]


def bcast_index(bcast: str, i, j) -> tuple:
    """Index of the second operand for element (i, j) under ``bcast``."""
    return {"none": (i, j), "row": (j,), "col": (i,), "scalar": (0,)}[bcast]


def _describe_map(M: int, N: int, dt: str, odt: str, body: Fn) -> tirx.PrimFunc:
    """Y = body(X) element by element on an (M, N) tile (unary TPPs, operand-free equations)."""

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        Y = T.match_buffer(y, (M, N), odt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Y[vi, vj] = body(X[vi, vj])

    return desc


def _describe_unary(spec: TPPSpec) -> tirx.PrimFunc:
    fn, odt = OPS[spec.op].fn, spec.acc_dtype

    def body(x):
        y = fn(x)
        return tirx.Cast(odt, y) if odt != spec.dtype else y

    return _describe_map(spec.m, spec.n, spec.dtype, odt, body)


def _describe_zero(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt = spec.m, spec.n, spec.dtype

    @T.prim_func(s_tir=True)
    def desc(y: T.handle):
        Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads()
            T.writes(Y[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Y[vi, vj] = tirx.const(0, dt)

    return desc


def operands_in_use_order(fn: Fn, *bufs, m: int = 0, n: int = 0) -> list:
    """Whole-tile regions of ``bufs`` in the order ``fn`` first reads them.

    Tensorize compares region lists in order, and a TE computation lists them in the order
    its expression reads them (``relu_inv`` reads S before dY), so descriptions must too.
    """
    probes = [tirx.Var(f"p{i}", "float32") for i in range(len(bufs))]
    order = []
    for var in tirx.analysis.undefined_vars(fn(*probes)):  # in order of appearance
        idx = next(i for i, p in enumerate(probes) if p.same_as(var))
        if idx not in order:
            order.append(idx)
    order += [i for i in range(len(bufs)) if i not in order]
    return [whole(bufs[i]) for i in order]


def _describe_unary_bwd(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt = spec.m, spec.n, spec.dtype
    fn = OPS[spec.op].fn

    @T.prim_func(s_tir=True)
    def desc(dy: T.handle, s: T.handle, dx: T.handle):
        DY = T.match_buffer(dy, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        S = T.match_buffer(s, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        DX = T.match_buffer(dx, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(*operands_in_use_order(fn, DY, S))
            T.writes(DX[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    DX[vi, vj] = fn(DY[vi, vj], S[vi, vj])

    return desc


def _describe_binary(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt, bc = spec.m, spec.n, spec.dtype, spec.bcast
    fn = OPS[spec.op].fn
    yshape = bcast_shape(spec)
    y_strides = [T.int32(), 1] if bc == "none" else [1]

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, y: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
        Z = T.match_buffer(z, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], whole(Y))
            T.writes(Z[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Z[vi, vj] = fn(X[vi, vj], Y[bcast_index(bc, vi, vj)])

    return desc


def _describe_muladd(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt, bc = spec.m, spec.n, spec.dtype, spec.bcast
    yshape = bcast_shape(spec)
    y_strides = [T.int32(), 1] if bc == "none" else [1]

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, y: T.handle, z: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        Y = T.match_buffer(y, yshape, dt, offset_factor=1, strides=y_strides)
        Z = T.match_buffer(z, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(
                X[0:M, 0:N], whole(Y), Z[0:M, 0:N]
            )
            T.writes(Z[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Z[vi, vj] = X[vi, vj] * Y[bcast_index(bc, vi, vj)] + Z[vi, vj]

    return desc


def reduce_identity(op: str, dtype: str) -> tirx.Expr:
    """Initial value of a reduction TPP (0, or the dtype's lowest value for max)."""
    return tirx.min_value(dtype) if "_max_" in op else tirx.const(0, dtype)


def reduce_combine(op: str, acc, val):
    """How a reduction TPP folds one mapped element into its accumulator."""
    return tirx.max(acc, val) if "_max_" in op else acc + val


def _describe_quant(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt, odt, op = spec.m, spec.n, spec.dtype, spec.acc_dtype, spec.op

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, s: T.handle, o: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        S = T.match_buffer(s, (N,), "float32", offset_factor=1)
        Off = T.match_buffer(o, (N,), "float32", offset_factor=1)
        Y = T.match_buffer(y, (M, N), odt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N], S[0:N], Off[0:N])
            T.writes(Y[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Y[vi, vj] = quant_expr(op, X[vi, vj], S[vj], Off[vj], odt)

    return desc


def _describe_reduce(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt, op = spec.m, spec.n, spec.dtype, spec.op
    fn = OPS[op].fn
    over_rows = op.endswith("_rows")
    L = N if over_rows else M
    init = reduce_identity(op, dt)

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        Y = T.match_buffer(y, (L,), dt, offset_factor=1)
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:L])
            if over_rows:
                for j, i in T.grid(N, M):
                    with T.sblock("tpp"):
                        vj, vi = T.axis.remap("SR", [j, i])
                        T.reads(Y[vj], X[vi, vj])
                        T.writes(Y[vj])
                        with T.init():
                            Y[vj] = init
                        Y[vj] = reduce_combine(op, Y[vj], fn(X[vi, vj]))
            else:
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SR", [i, j])
                        T.reads(Y[vi], X[vi, vj])
                        T.writes(Y[vi])
                        with T.init():
                            Y[vi] = init
                        Y[vi] = reduce_combine(op, Y[vi], fn(X[vi, vj]))

    return desc


def transform_out_shape(spec: TPPSpec) -> tuple[int, ...]:
    """Output shape of a transform TPP."""
    if spec.op == "transpose":
        return (spec.n, spec.m)
    v = 2 if spec.op == "vnni2" else 4
    return (-(-spec.m // v), spec.n, v)


def _describe_transform(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt = spec.m, spec.n, spec.dtype
    oshape = transform_out_shape(spec)
    zero = tirx.const(0, dt)

    if spec.op == "transpose":

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            Y = T.match_buffer(y, (N, M), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(X[0:M, 0:N])
                T.writes(Y[0:N, 0:M])
                for j, i in T.grid(N, M):
                    with T.sblock("tpp"):
                        vj, vi = T.axis.remap("SS", [j, i])
                        Y[vj, vi] = X[vi, vj]

        return desc

    KO, _, V = oshape

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        Y = T.match_buffer(y, (KO, N, V), dt, offset_factor=1, strides=[T.int32(), V, 1])
        with T.sblock("root"):
            # Rows past M are never read (the if_then_else), but region analysis of a
            # blockized workload ignores the condition and covers KO*V rows: say the same.
            T.reads(X[0 : KO * V, 0:N])
            T.writes(Y[0:KO, 0:N, 0:V])
            for ko, j, v in T.grid(KO, N, V):
                with T.sblock("tpp"):
                    vko, vj, vv = T.axis.remap("SSS", [ko, j, v])
                    T.reads(X[vko * V + vv, vj])
                    Y[vko, vj, vv] = T.if_then_else(
                        vko * V + vv < M, X[T.min(vko * V + vv, M - 1), vj], zero
                    )

    return desc


def operand_reads(beta0: bool, C, A, B) -> list:
    """Regions a contraction reads: C too unless beta is 0 (C is only written)."""
    return [whole(A), whole(B)] if beta0 else [whole(C), whole(A), whole(B)]


@dataclass(frozen=True)
class ContractionGeometry:
    """Operand shapes and addressing of a GEMM-family TPP, shared by description and impls.

    ``batch`` are the reduction dims besides the innermost ``k`` (none for GEMM, the batch
    for BRGEMM, the filter rows for a convolution's BRGEMM, none when it has one row; plus
    K / vnni for a VNNI-packed B, whose innermost reduction is then the ``vnni`` pack);
    ``a_index(rs, i, k)`` / ``b_index(rs, k, j)``
    give the element of A / B that row i / column j meets at reduction point (rs, k).
    """

    batch: tuple[int, ...]
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    a_index: Callable[..., tuple]
    b_index: Callable[..., tuple]
    k: int = 0
    b_strides: Callable[[], list] | None = None

    def b_buffer_strides(self) -> list:
        """B's strides for ``match_buffer``: free, but a VNNI pack of a column is contiguous
        with the next column's (one vector load covers lanes x vnni elements)."""
        return self.b_strides() if self.b_strides else free_strides(len(self.b_shape))


def contraction_geometry(spec: TPPSpec) -> ContractionGeometry:
    """The geometry of ``spec`` (a gemm, brgemm or conv_brgemm)."""
    M, N, K, V = spec.m, spec.n, spec.k, spec.vnni
    if V > 1:
        return _vnni_geometry(spec)
    if spec.op == "gemm":
        return ContractionGeometry((), (M, K), (K, N), lambda rs, i, k: (i, k),
                                   lambda rs, k, j: (k, j), K)
    if spec.op == "brgemm":
        R = spec.batch
        return ContractionGeometry((R,), (R, M, K), (R, K, N), lambda rs, i, k: (rs[0], i, k),
                                   lambda rs, k, j: (rs[0], k, j), K)
    R, st, span = spec.batch, spec.stride, (M - 1) * spec.stride + K
    if R == 1:  # a unit reduction loop cannot be tensorized: no batch dim at all
        return ContractionGeometry((), (span,), (K, N), lambda rs, i, k: (i * st + k,),
                                   lambda rs, k, j: (k, j), K)
    return ContractionGeometry((R,), (R, span), (R, K, N),
                               lambda rs, i, k: (rs[0], i * st + k),
                               lambda rs, k, j: (rs[0], k, j), K)


def _vnni_geometry(spec: TPPSpec) -> ContractionGeometry:
    """GEMM/BRGEMM/conv BRGEMM with B packed ``(K/V, N, V)``: k splits into (k // V, k % V),
    the first a batch-like dim, the second the innermost reduction (one dot-product lane)."""
    M, N, K, V = spec.m, spec.n, spec.k, spec.vnni
    KO = K // V
    if spec.op == "gemm":
        return ContractionGeometry(
            (KO,), (M, K), (KO, N, V), lambda rs, i, v: (i, rs[-1] * V + v),
            lambda rs, v, j: (rs[-1], j, v), V, lambda: [T.int32(), V, 1])
    if spec.op == "conv_brgemm":
        R, st, span = spec.batch, spec.stride, (M - 1) * spec.stride + K
        if R == 1:
            return ContractionGeometry(
                (KO,), (span,), (KO, N, V), lambda rs, i, v: (i * st + rs[-1] * V + v,),
                lambda rs, v, j: (rs[-1], j, v), V, lambda: [T.int32(), V, 1])
        return ContractionGeometry(
            (R, KO), (R, span), (R, KO, N, V),
            lambda rs, i, v: (rs[0], i * st + rs[-1] * V + v),
            lambda rs, v, j: (rs[0], rs[-1], j, v), V, lambda: [T.int32(), T.int32(), V, 1])
    R = spec.batch
    return ContractionGeometry(
        (R, KO), (R, M, K), (R, KO, N, V), lambda rs, i, v: (rs[0], i, rs[-1] * V + v),
        lambda rs, v, j: (rs[0], rs[-1], j, v), V, lambda: [T.int32(), T.int32(), V, 1])


def free_strides(ndim: int) -> list:
    """Symbolic strides for all but the innermost (unit-stride) dimension."""
    return [T.int32() for _ in range(ndim - 1)] + [1]


def pool_geometry(spec: TPPSpec) -> ContractionGeometry:
    """Window geometry of a pooling TPP: reduction dims (window rows, taps), A's shape and
    ``a_index(rs, i, j)``; dims of extent 1 are dropped (TVM cannot tensorize unit loops).
    ``b_*`` are unused."""
    M, N, R, S, st, tap = spec.m, spec.n, spec.batch, spec.k, spec.stride, spec.taps
    span = (M - 1) * st + (S - 1) * tap + N
    dims = tuple(e for e in (R, S) if e > 1)

    def a_index(rs, i, j):
        it = iter(rs)
        r = next(it) if R > 1 else 0
        s = next(it) if S > 1 else 0
        flat = i * st + s * tap + j
        return (r, flat) if R > 1 else (flat,)

    return ContractionGeometry(dims, (R, span) if R > 1 else (span,), (), a_index, None)


def _describe_pool(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt = spec.m, spec.n, spec.dtype
    geo = pool_geometry(spec)
    dims = (M, N, *geo.batch)
    kinds = "SS" + "R" * len(geo.batch)
    lowest = tirx.min_value(dt)

    def a_at(vs):
        return geo.a_index(vs[2:], vs[0], vs[1])

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, y: T.handle):
        A = T.match_buffer(a, geo.a_shape, dt, offset_factor=1,
                           strides=free_strides(len(geo.a_shape)))
        Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(whole(A))
            T.writes(Y[0:M, 0:N])
            for ivs in T.grid(*dims):
                with T.sblock("tpp"):
                    vs = T.meta_var(T.axis.remap(kinds, ivs))
                    T.reads(Y[vs[0], vs[1]], A[a_at(vs)])
                    T.writes(Y[vs[0], vs[1]])
                    with T.init():
                        Y[vs[0], vs[1]] = lowest
                    Y[vs[0], vs[1]] = tirx.max(Y[vs[0], vs[1]], A[a_at(vs)])

    return desc


def _describe_contraction(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt, acc = spec.m, spec.n, spec.dtype, spec.acc_dtype
    bdt = spec.b_dtype or dt
    geo = contraction_geometry(spec)
    beta0 = spec.beta == 0
    dims = (M, N, *geo.batch, geo.k)
    kinds = "SS" + "R" * (len(geo.batch) + 1)

    def mac(a, b):
        return tirx.Cast(acc, a) * tirx.Cast(acc, b) if acc != dt else a * b

    def a_at(vs):
        return geo.a_index(vs[2:-1], vs[0], vs[-1])

    def b_at(vs):
        return geo.b_index(vs[2:-1], vs[-1], vs[1])

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, geo.a_shape, dt, offset_factor=1,
                           strides=free_strides(len(geo.a_shape)))
        B = T.match_buffer(b, geo.b_shape, bdt, offset_factor=1,
                           strides=geo.b_buffer_strides())
        C = T.match_buffer(c, (M, N), acc, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(*operand_reads(beta0, C, A, B))
            T.writes(C[0:M, 0:N])
            for ivs in T.grid(*dims):
                with T.sblock("tpp"):
                    vs = T.meta_var(T.axis.remap(kinds, ivs))
                    T.reads(C[vs[0], vs[1]], A[a_at(vs)], B[b_at(vs)])
                    T.writes(C[vs[0], vs[1]])
                    if beta0:
                        with T.init():
                            C[vs[0], vs[1]] = tirx.const(0, acc)
                    C[vs[0], vs[1]] = C[vs[0], vs[1]] + mac(A[a_at(vs)], B[b_at(vs)])

    return desc


#: Longest equation (each step is one pass over registers, not memory).
MAX_EQUATION_STEPS = 4
#: Steps an equation TPP chains: the unary TPPs plus adding a bias row or a residual tile.
EQUATION_STEPS = (
    "bias",
    "residual",
    *[op for op, d in OPS.items() if d.kind == "unary" and op not in ("copy",)],
)


def equation_operands(steps: tuple[str, ...]) -> list[str]:
    """The extra operands of an equation, in parameter order (one per bias/residual step)."""
    return [s for s in steps if s in ("bias", "residual")]


def equation_step(step: str, v: tirx.Expr, operand: tirx.Expr | None) -> tirx.Expr:
    """One step of an equation on value ``v`` (``operand`` for bias/residual steps)."""
    if step in ("bias", "residual"):
        return v + operand
    return OPS[step].fn(v)


def equation_expr(steps: tuple[str, ...], x: tirx.Expr, operands: list[tirx.Expr]) -> tirx.Expr:
    """The whole equation as one expression (descriptions and TE workloads share it)."""
    it = iter(operands)
    v = x
    for step in steps:
        v = equation_step(step, v, next(it) if step in ("bias", "residual") else None)
    return v


def _describe_equation(spec: TPPSpec) -> tirx.PrimFunc:
    M, N, dt, steps = spec.m, spec.n, spec.dtype, spec.steps
    kinds = equation_operands(steps)
    shapes = [(N,) if k == "bias" else (M, N) for k in kinds]

    def body(X, ops, i, j):
        return equation_expr(steps, X[i, j], [
            P[j] if k == "bias" else P[i, j] for P, k in zip(ops, kinds)
        ])

    def strides(shape):
        return [1] if len(shape) == 1 else [T.int32(), 1]

    if len(kinds) == 0:
        return _describe_map(M, N, dt, dt, lambda x: equation_expr(steps, x, []))
    if len(kinds) == 1:

        @T.prim_func(s_tir=True)
        def desc(x: T.handle, p: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            P = T.match_buffer(p, shapes[0], dt, offset_factor=1, strides=strides(shapes[0]))
            Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
            with T.sblock("root"):
                T.reads(whole(X), whole(P))
                T.writes(Y[0:M, 0:N])
                for i, j in T.grid(M, N):
                    with T.sblock("tpp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        Y[vi, vj] = body(X, [P], vi, vj)

        return desc

    @T.prim_func(s_tir=True)
    def desc(x: T.handle, p: T.handle, q: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        P = T.match_buffer(p, shapes[0], dt, offset_factor=1, strides=strides(shapes[0]))
        Q = T.match_buffer(q, shapes[1], dt, offset_factor=1, strides=strides(shapes[1]))
        Y = T.match_buffer(y, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(whole(X), whole(P), whole(Q))
            T.writes(Y[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("tpp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Y[vi, vj] = body(X, [P, Q], vi, vj)

    return desc


_DESCRIBERS = {
    "unary": _describe_unary,
    "zero": _describe_zero,
    "unary_bwd": _describe_unary_bwd,
    "binary": _describe_binary,
    "muladd": _describe_muladd,
    "reduce": _describe_reduce,
    "transform": _describe_transform,
    "equation": _describe_equation,
    "pool": _describe_pool,
    "quant": _describe_quant,
}


def describe(spec: TPPSpec) -> tirx.PrimFunc:
    """The TIR description (the math) of ``spec``, for ``TensorIntrin.register``."""
    if spec.kind == "brgemm":
        return _describe_contraction(spec)
    return _DESCRIBERS[spec.kind](spec)
