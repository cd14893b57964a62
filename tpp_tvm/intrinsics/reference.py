"""TPPs as TE computations: the form in which schedules (and tests) meet a TPP.

``te_compute(spec)`` states a TPP's math as a TE computation built from the same pieces as
its description (``OPS[op].fn``, ``bcast_index``, ``reduce_combine``/``reduce_identity``), so
a block made from it tensorizes with the TPP's intrinsic by construction. Two TPPs update
their output in place (``muladd``, and ``gemm``/``brgemm`` with beta 1), which TE cannot
express: :func:`workload` gives those as the description itself on compact buffers.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .geometry import (
    bcast_index,
    bcast_shape,
    contraction_geometry,
    pool_geometry,
    transform_out_shape,
)
from .spec import (
    OPS,
    TPPSpec,
    describe,
    dtype_of,
    equation_expr,
    equation_operands,
    quant_expr,
    reduce_combine,
    reduce_identity,
)

#: Name of the TE stage (and so of the block) that :func:`te_compute` returns.
BLOCK = "tpp"


def operand_shapes(spec: TPPSpec) -> list[tuple[int, ...]]:
    """Shapes of the description's parameters, in order (inputs first, output last)."""
    m, n, kind = spec.m, spec.n, spec.kind
    if kind == "brgemm":
        geo = contraction_geometry(spec)
        return [geo.a_shape, geo.b_shape, (m, n)]
    if kind == "zero":
        return [(m, n)]
    if kind == "unary":
        return [(m, n), (m, n)]
    if kind == "unary_bwd":
        return [(m, n), (m, n), (m, n)]
    if kind in ("binary", "muladd"):
        return [(m, n), bcast_shape(spec), (m, n)]
    if kind == "reduce":
        return [(m, n), (n,) if spec.op.endswith("_rows") else (m,)]
    if kind == "pool":
        return [pool_geometry(spec).a_shape, (m, n)]
    if kind == "quant":
        return [(m, n), (n,), (n,), (m, n)]
    if kind == "equation":
        extra = [(n,) if k == "bias" else (m, n) for k in equation_operands(spec.steps)]
        return [(m, n), *extra, (m, n)]
    return [(m, n), transform_out_shape(spec)]


def operand_dtypes(spec: TPPSpec) -> list[str]:
    """Dtypes of the description's parameters, in order."""
    if spec.kind == "brgemm":
        return [spec.dtype, spec.b_dtype or spec.dtype, spec.acc_dtype]
    if spec.kind == "quant":
        return [spec.dtype, "float32", "float32", spec.acc_dtype]
    return [spec.dtype] * (len(operand_shapes(spec)) - 1) + [spec.acc_dtype]


def in_place(spec: TPPSpec) -> bool:
    """Whether the TPP reads its output's old value (TE cannot express it)."""
    return spec.kind == "muladd" or (spec.kind == "brgemm" and spec.beta == 1)


def _reducer(op: str):
    return te.comm_reducer(
        lambda acc, val: reduce_combine(op, acc, val),
        lambda dtype: reduce_identity(op, dtype),
        name=op,
    )


def te_compute(
    spec: TPPSpec, inputs: list[te.Tensor] | None = None, name: str = BLOCK
) -> tuple[list[te.Tensor], te.Tensor]:
    """``(inputs, output)`` of a TE computation equal to ``spec``'s description.

    ``inputs`` (default: fresh placeholders of the description's shapes) may be any tensors
    of those shapes, e.g. earlier stages of a schedule. ``muladd`` and beta-1 contractions
    have no TE form (see :func:`workload`); for contractions the result is the beta-0 form
    (TE's reduction initializes C), which a schedule turns into beta 1 with
    ``decompose_reduction``.
    """
    if spec.kind == "muladd":
        raise ValueError(f"TPP {spec.op} updates its output in place: TE cannot express it")
    shapes, dtypes = operand_shapes(spec), operand_dtypes(spec)
    if inputs is None:
        inputs = [
            te.placeholder(s, d, name=f"in{i}")
            for i, (s, d) in enumerate(zip(shapes[:-1], dtypes[:-1]))
        ]
    oshape, odt, op, kind = shapes[-1], dtypes[-1], spec.op, spec.kind
    fn = OPS[op].fn
    if kind == "zero":
        out = te.compute(oshape, lambda i, j: tirx.const(0, odt), name=name)
    elif kind == "unary":
        x = inputs[0]
        out = te.compute(oshape, lambda i, j: _convert(fn(x[i, j]), odt), name=name)
    elif kind == "unary_bwd":
        dy, s = inputs
        out = te.compute(oshape, lambda i, j: fn(dy[i, j], s[i, j]), name=name)
    elif kind == "binary":
        x, y = inputs
        out = te.compute(
            oshape, lambda i, j: fn(x[i, j], y[bcast_index(spec.bcast, i, j)]), name=name
        )
    elif kind == "quant":
        x, sc, off = inputs
        out = te.compute(oshape, lambda i, j: quant_expr(op, x[i, j], sc[j], off[j], odt),
                         name=name)
    elif kind == "reduce":
        x, red = inputs[0], _reducer(op)
        if op.endswith("_rows"):
            r = te.reduce_axis((0, spec.m), "r")
            out = te.compute(oshape, lambda j: red(fn(x[r, j]), axis=r), name=name)
        else:
            r = te.reduce_axis((0, spec.n), "r")
            out = te.compute(oshape, lambda i: red(fn(x[i, r]), axis=r), name=name)
    elif kind == "pool":
        a, geo = inputs[0], pool_geometry(spec)
        rs = [te.reduce_axis((0, e), f"r{d}") for d, e in enumerate(geo.batch)]
        out = te.compute(oshape, lambda i, j: te.max(a[geo.a_index(rs, i, j)], axis=rs),
                         name=name)
    elif kind == "equation":
        x, ops = inputs[0], inputs[1:]
        kinds = equation_operands(spec.steps)
        out = te.compute(oshape, lambda i, j: equation_expr(spec.steps, x[i, j], [
            p[j] if k == "bias" else p[i, j] for p, k in zip(ops, kinds)
        ]), name=name)
    elif op == "transpose":
        x = inputs[0]
        out = te.compute(oshape, lambda j, i: x[i, j], name=name)
    elif kind == "transform":
        x, (_, _, v), m = inputs[0], oshape, spec.m
        out = te.compute(
            oshape,
            lambda ko, j, vv: tirx.if_then_else(
                ko * v + vv < m, x[tirx.min(ko * v + vv, m - 1), j], tirx.const(0, odt)
            ),
            name=name,
        )
    else:
        a, b = inputs
        geo = contraction_geometry(spec)
        rs = [te.reduce_axis((0, e), f"r{d}") for d, e in enumerate(geo.batch)]
        k = te.reduce_axis((0, geo.k), "k")

        def mac(i, j):
            av, bv = a[geo.a_index(rs, i, k)], b[geo.b_index(rs, k, j)]
            return _convert(av, odt) * _convert(bv, odt)

        out = te.compute(oshape, lambda i, j: te.sum(mac(i, j), axis=[*rs, k]), name=name)
    return list(inputs), out


def _convert(x: tirx.Expr, dtype: str) -> tirx.Expr:
    return x if dtype_of(x) == dtype else tirx.Cast(dtype, x)


def workload(spec: TPPSpec) -> tirx.PrimFunc:
    """A PrimFunc computing ``spec`` on compact buffers, its block named ``"tpp"``.

    A TE computation where one exists; for in-place TPPs, the description itself with
    compact strides (the only way to state "update C"). Tensorize the block's outermost
    loop with ``intrinsic(spec)``; for a beta-1 contraction built from TE, first
    ``decompose_reduction``.
    """
    if in_place(spec):
        desc = describe(spec)
        binds = {}
        for param, shape in zip(desc.params, operand_shapes(spec)):
            strides = [int(np.prod(shape[d + 1 :])) for d in range(len(shape))]
            # Parameters of a PrimFunc are its buffers in this TVM.
            binds[param] = tirx.decl_buffer(
                shape, param.dtype, name=str(param.name), strides=strides if param.strides else None
            )
        return desc.specialize(binds).with_attr("global_symbol", "main")
    inputs, out = te_compute(spec)
    return te.create_prim_func([*inputs, out])
