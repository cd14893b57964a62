"""Operand geometry of the TPPs: shapes, element addressing and buffer regions.

Descriptions (``kinds/``), TE forms (``reference.py``) and the ISA templates all declare the
same operands; this module is the one statement of their shapes and of which element of A
and B an output element meets, so a description and its implementations cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from .spec import OPERAND_STEPS, TPPSpec, equation_operands


def whole(buf: tirx.Buffer):
    """The region covering all of ``buf`` (for ``T.reads``/``T.writes``)."""
    return buf[tuple(slice(0, e) for e in buf.shape)]


def free_strides(ndim: int) -> list:
    """Symbolic strides for all but the innermost (unit-stride) dimension."""
    return [T.int32() for _ in range(ndim - 1)] + [1]


def bcast_shape(spec: TPPSpec) -> tuple[int, ...]:
    """Shape of the second operand of a binary TPP for its broadcast flag."""
    return {"none": (spec.m, spec.n), "row": (spec.n,), "col": (spec.m,), "scalar": (1,)}[
        spec.bcast
    ]


def bcast_index(bcast: str, i, j) -> tuple:
    """Index of the second operand for element (i, j) under ``bcast``."""
    return {"none": (i, j), "row": (j,), "col": (i,), "scalar": (0,)}[bcast]


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


def transform_out_shape(spec: TPPSpec) -> tuple[int, ...]:
    """Output shape of a transform TPP."""
    if spec.op == "transpose":
        return (spec.n, spec.m)
    v = 2 if spec.op == "vnni2" else 4
    return (-(-spec.m // v), spec.n, v)


def equation_operand_shapes(spec: TPPSpec) -> list[tuple[int, ...]]:
    """Shapes of an equation's extra operands, in parameter order: a bias is a row ``(N,)``,
    a residual or gate an ``(M, N)`` tile, a scale a row like a bias."""
    return [OPERAND_STEPS[k].shape(spec.m, spec.n) for k in equation_operands(spec.steps)]


def equation_operand_dtypes(spec: TPPSpec) -> list[str]:
    """Element types of an equation's extra operands, in parameter order: the equation's
    own, or u8/s8 for a quantized residual tile."""
    return [OPERAND_STEPS[k].operand_dtype(spec.dtype) for k in equation_operands(spec.steps)]
