"""Build, tensorize and run one TPP on numpy inputs; numpy references for every primitive.

The kernel under test is the TPP's own description specialized to contiguous buffers and
then tensorized with the registered intrinsic, so what runs is exactly the ISA
implementation, and the numpy reference below states the math independently.
"""

from __future__ import annotations

import numpy as np
import tvm
from scipy import special
from tvm import s_tir, te, tirx

from tpp_tvm.intrinsics import OPS, TPPSpec, describe, intrinsic
from tpp_tvm.intrinsics.spec import (
    bcast_index,
    bcast_shape,
    contraction_geometry,
    dtype_of,
    transform_out_shape,
)
from tpp_tvm.target import target


def operand_shapes(spec: TPPSpec) -> list[tuple[int, ...]]:
    """Shapes of the description's parameters, in order."""
    m, n = spec.m, spec.n
    kind = spec.kind
    if kind == "brgemm":
        geo = contraction_geometry(spec)
        return [geo.a_shape, geo.b_shape, (m, n)]
    if kind == "zero":
        return [(m, n)]
    if kind in ("unary",):
        return [(m, n), (m, n)]
    if kind == "unary_bwd":
        return [(m, n), (m, n), (m, n)]
    if kind in ("binary", "muladd"):
        return [(m, n), bcast_shape(spec), (m, n)]
    if kind == "reduce":
        return [(m, n), (n,) if spec.op.endswith("_rows") else (m,)]
    return [(m, n), transform_out_shape(spec)]


def _te_func(spec: TPPSpec, shapes, dtypes) -> tirx.PrimFunc | None:
    """A TE computation equal to the TPP's math (how schedules meet TPPs), or None (muladd)."""
    op, kind = spec.op, spec.kind
    ins = [te.placeholder(sh, dt, name=f"in{i}") for i, (sh, dt) in enumerate(
        zip(shapes[:-1], dtypes[:-1]))]
    oshape, odt = shapes[-1], dtypes[-1]
    if kind == "muladd":
        return None
    if kind == "zero":
        out = te.compute(oshape, lambda i, j: tirx.const(0, odt), name="tpp")
        return te.create_prim_func([out])
    if kind == "unary":
        fn = OPS[op].fn
        out = te.compute(oshape, lambda i, j: _cast(fn(ins[0][i, j]), odt), name="tpp")
    elif kind == "unary_bwd":
        fn = OPS[op].fn
        out = te.compute(oshape, lambda i, j: fn(ins[0][i, j], ins[1][i, j]), name="tpp")
    elif kind == "binary":
        fn = OPS[op].fn
        out = te.compute(
            oshape, lambda i, j: fn(ins[0][i, j], ins[1][bcast_index(spec.bcast, i, j)]),
            name="tpp",
        )
    elif kind == "reduce":
        fn = OPS[op].fn
        red = te.max if "_max_" in op else te.sum
        if op.endswith("_rows"):
            r = te.reduce_axis((0, spec.m), "r")
            out = te.compute(oshape, lambda j: red(fn(ins[0][r, j]), axis=r), name="tpp")
        else:
            r = te.reduce_axis((0, spec.n), "r")
            out = te.compute(oshape, lambda i: red(fn(ins[0][i, r]), axis=r), name="tpp")
    elif op == "transpose":
        out = te.compute(oshape, lambda j, i: ins[0][i, j], name="tpp")
    elif kind == "transform":
        v, m = oshape[2], spec.m
        out = te.compute(oshape, lambda ko, j, vv: tirx.if_then_else(
            ko * v + vv < m, ins[0][tirx.min(ko * v + vv, m - 1), j], tirx.const(0, odt)),
            name="tpp")
    else:
        geo = contraction_geometry(spec)
        rs = [te.reduce_axis((0, e), f"r{d}") for d, e in enumerate(geo.batch)]
        k = te.reduce_axis((0, spec.k), "k")
        out = te.compute(oshape, lambda i, j: te.sum(
            ins[0][geo.a_index(rs, i, k)] * ins[1][geo.b_index(rs, k, j)], axis=[*rs, k]),
            name="tpp")
    return te.create_prim_func([*ins, out])


def _cast(x, dtype):
    return x if dtype_of(x) == dtype else tirx.Cast(dtype, x)


def _desc_func(desc: tirx.PrimFunc, shapes) -> tirx.PrimFunc:
    """The description itself, on contiguous buffers (for in-place TPPs like muladd)."""
    binds = {}
    for param, shape in zip(desc.params, shapes):
        strides = [int(np.prod(shape[d + 1:])) for d in range(len(shape))]
        binds[param] = tirx.decl_buffer(shape, param.dtype, name=str(param.name),
                                        strides=strides if len(param.strides) else None)
    return desc.specialize(binds)


def build(spec: TPPSpec, isa: str = "avx512"):
    """Compile the tensorized TPP; returns (runtime module, operand shapes, dtypes)."""
    desc = describe(spec)
    shapes = operand_shapes(spec)
    dtypes = [str(p.dtype) for p in desc.params]
    func = _te_func(spec, shapes, dtypes)
    func = func if func is not None else _desc_func(desc, shapes)
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("tpp")
    loops = sch.get_loops(block)
    if spec.kind == "brgemm" and spec.beta == 1:
        sch.decompose_reduction(block, loops[0])
    sch.tensorize(loops[0], intrinsic(spec, isa))
    mod = tvm.compile(sch.mod, target=target(isa, num_cores=1)).jit()
    return mod, shapes, dtypes


def _gelu(x):
    return 0.5 * x * (1 + special.erf(x / np.sqrt(2)))


UNARY = {
    "copy": lambda x: x,
    "relu": lambda x: np.maximum(x, 0),
    "gelu": _gelu,
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "tanh": np.tanh,
    "sigmoid": special.expit,
    "exp": np.exp,
    "reciprocal": lambda x: 1 / x,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "negate": np.negative,
    "square": np.square,
}
BWD = {
    "relu_inv": lambda dy, x: np.where(x > 0, dy, 0),
    "gelu_inv": lambda dy, x: dy * (0.5 * (1 + special.erf(x / np.sqrt(2)))
                                    + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)),
    "tanh_inv": lambda dy, y: dy * (1 - y * y),
    "sigmoid_inv": lambda dy, y: dy * y * (1 - y),
}
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum}


def _bcast(spec: TPPSpec, y: np.ndarray) -> np.ndarray:
    views = {"none": lambda: y, "row": lambda: y[None, :], "col": lambda: y[:, None],
             "scalar": lambda: y.reshape(1, 1)}
    return views[spec.bcast]()


def reference(spec: TPPSpec, args: list[np.ndarray]) -> np.ndarray:
    """The numpy result of ``spec`` on its inputs (the last arg is the output's old value)."""
    op = spec.op
    a = [x.astype(np.float64) for x in args]
    if spec.kind == "brgemm":
        geo = contraction_geometry(spec)
        out = np.zeros((spec.m, spec.n))  # beta 1 accumulates onto the TE init (zeros)
        for idx in np.ndindex(*geo.batch, spec.k):
            rs, k = idx[:-1], idx[-1]
            col = np.array([a[0][geo.a_index(rs, i, k)] for i in range(spec.m)])
            out += np.outer(col, a[1][geo.b_index(rs, k, slice(None))])
        return out
    if op == "zero":
        return np.zeros((spec.m, spec.n))
    if spec.kind == "unary":
        return UNARY[op](a[0])
    if spec.kind == "unary_bwd":
        return BWD[op](a[0], a[1])
    if spec.kind == "binary":
        return BINARY[op](a[0], _bcast(spec, a[1]))
    if spec.kind == "muladd":
        return a[0] * _bcast(spec, a[1]) + a[2]
    if spec.kind == "reduce":
        axis = 0 if op.endswith("_rows") else 1
        if "_max_" in op:
            return a[0].max(axis=axis)
        return (a[0] ** 2 if "sumsq" in op else a[0]).sum(axis=axis)
    if op == "transpose":
        return a[0].T
    v = 2 if op == "vnni2" else 4
    ko = -(-spec.m // v)
    padded = np.zeros((ko * v, spec.n))
    padded[: spec.m] = a[0]
    return padded.reshape(ko, v, spec.n).transpose(0, 2, 1)


def inputs_for(spec: TPPSpec, shapes, dtypes, rng: np.random.Generator) -> list[np.ndarray]:
    """Random operands in each op's domain (positive for sqrt/rsqrt, away from 0 for 1/x)."""
    out = []
    for shape, dt in zip(shapes, dtypes):
        x = rng.standard_normal(shape) * 2
        if spec.op in ("sqrt", "rsqrt") or (spec.op in ("reciprocal",)):
            x = np.abs(x) + 0.5
        if spec.op == "div" and len(out) == 1:
            x = np.sign(x) * (np.abs(x) + 0.5)
        if spec.op in ("tanh_inv", "sigmoid_inv") and len(out) == 1:
            x = np.tanh(x) if spec.op == "tanh_inv" else special.expit(x)
        out.append(x.astype(dt))
    return out


def run(spec: TPPSpec, seed: int = 0, isa: str = "avx512") -> tuple[np.ndarray, np.ndarray]:
    """(TPP result, numpy reference) for random inputs."""
    mod, shapes, dtypes = build(spec, isa)
    rng = np.random.default_rng(seed)
    args = inputs_for(spec, shapes, dtypes, rng)
    tensors = [tvm.runtime.tensor(x) for x in args]
    mod(*tensors)
    return tensors[-1].numpy(), reference(spec, args)
