"""Batched matmuls as the matmul of their operands, not of flattened views.

``torch.matmul`` of two 4-D tensors reaches the exported program decomposed: each operand
``expand``-ed to the broadcast shape (a no-op where it has it), viewed as 3-D (the batch
dims merged), ``bmm``, and the product viewed back. TVM's importer writes that as
``reshape(matmul(reshape(broadcast_to(a)), reshape(broadcast_to(b))))``. The attention
patterns look for ``matmul(q, kᵀ)`` on the 4-D operands, as the ONNX route's ``MatMul``
gives them; behind the views they saw two batched GEMMs and a softmax apart (ViT's
attention through ``torch.compile``: ``tpp.bmm`` x2 and ``tpp.softmax`` per layer where the
ONNX route runs one attention kernel). Undoing the decomposition is exact: the same
products in the same order.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .exprs import bindings, static_shape


def drop_identity_broadcasts(func: relax.Function) -> relax.Function:
    """``broadcast_to(x, shape)`` where ``x`` already has ``shape`` → ``x`` (a copy
    otherwise: ``expand`` to the shape a tensor has is how torch writes a no-op)."""
    pattern = is_op("relax.broadcast_to")(wildcard(), wildcard())

    def rewriter(orig, _m):
        shape = static_shape(orig.args[0])
        return orig.args[0] if shape is not None and shape == static_shape(orig) else orig

    return rewrite_call(pattern, rewriter, func)


def _broadcast_source(expr: relax.Expr, shape: list[int], binds: dict
                      ) -> relax.Expr | None:
    """What ``expr`` (of ``shape``) broadcasts: the operand of a ``broadcast_to`` that only
    expands batch dims (the last two kept), else ``expr`` itself."""
    value = binds.get(expr, expr) if isinstance(expr, relax.Var) else expr
    if not (isinstance(value, relax.Call) and
            getattr(value.op, "name", "") == "relax.broadcast_to"):
        return expr
    src_shape = static_shape(value.args[0])
    if src_shape is None or len(src_shape) < 2 or len(src_shape) > len(shape) or \
            src_shape[-2:] != shape[-2:] or \
            any(n not in (1, m) for n, m in zip(src_shape[::-1], shape[::-1])):
        return None
    return value.args[0]


def _unmerged(view: relax.Expr, batch: list[int], binds: dict) -> relax.Expr | None:
    """The operand ``view`` (a reshape) flattened, when it only merged ``batch`` into one
    dim (a batch-broadcast operand: what it broadcasts), else None."""
    if not (isinstance(view, relax.Call) and getattr(view.op, "name", "") == "relax.reshape"):
        return None
    shape = static_shape(view)
    if shape is None or len(shape) != 3:
        return None
    return _broadcast_source(view.args[0], [*batch, *shape[1:]], binds) \
        if static_shape(view.args[0]) == [*batch, *shape[1:]] else None


def _matmul(a: relax.Expr, b: relax.Expr, product: relax.Call, shape: list[int]
            ) -> relax.Expr | None:
    """``matmul(a, b)`` with ``product``'s out dtype, where its shape is ``shape``."""
    a_shape, b_shape = static_shape(a), static_shape(b)
    batch = np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    if [*batch, a_shape[-2], b_shape[-1]] != shape:
        return None
    return relax.op.matmul(a, b, out_dtype=product.attrs.out_dtype)


def unflatten_batched_matmuls(func: relax.Function) -> relax.Function:
    """``reshape(matmul(reshape(a), reshape(b)), batch + [m, n])`` → ``matmul(a, b)`` where
    ``a`` is ``batch + [m, k]``, ``b`` is ``batch + [k, n]`` and the inner reshapes only
    merged ``batch``."""
    lhs, rhs = is_op("relax.reshape")(wildcard(), wildcard()), \
        is_op("relax.reshape")(wildcard(), wildcard())
    product = is_op("relax.matmul")(lhs, rhs)
    pattern = is_op("relax.reshape")(product, wildcard())

    def unflatten(orig, m):
        shape = static_shape(orig)
        if shape is None or len(shape) < 3 or static_shape(m[product]) != \
                [math.prod(shape[:-2]), *shape[-2:]]:
            return orig
        a, b = (_unmerged(m[x], shape[:-2], binds) for x in (lhs, rhs))
        new = None if a is None or b is None else _matmul(a, b, m[product], shape)
        return orig if new is None else new

    binds = bindings(func)
    return rewrite_call(pattern, unflatten, func)


def drop_weight_broadcasts(func: relax.Function) -> relax.Function:
    """``matmul(x, broadcast_to(w))`` → ``matmul(x, w)`` for a broadcast over batch dims
    only (a ``Linear`` of a non-contiguous input: torch expands the weight to a batch of
    copies for ``bmm``, which the dense patterns never saw as a constant weight)."""
    binds = bindings(func)

    def unbroadcast(orig, _m):
        shapes = [static_shape(x) for x in orig.args]
        if any(s is None or len(s) < 2 for s in shapes):
            return orig
        a, b = (_broadcast_source(x, s, binds) for x, s in zip(orig.args, shapes))
        if a is None or b is None or (a.same_as(orig.args[0]) and b.same_as(orig.args[1])):
            return orig
        new = _matmul(a, b, orig, static_shape(orig))
        return orig if new is None else new

    return rewrite_call(is_op("relax.matmul")(wildcard(), wildcard()), unbroadcast, func)


@tvm.transform.module_pass(opt_level=0, name="tpp.UnflattenBatchedMatmuls")
def UnflattenBatchedMatmuls(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """:func:`drop_identity_broadcasts`, :func:`unflatten_batched_matmuls` and
    :func:`drop_weight_broadcasts` on every Relax function."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            func = unflatten_batched_matmuls(drop_identity_broadcasts(func))
            mod[gv] = drop_weight_broadcasts(func)
    return mod
