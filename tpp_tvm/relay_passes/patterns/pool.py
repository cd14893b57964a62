"""Pooling: NHWC max pooling (fp32, u8, s8) and global average pooling."""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from ...intrinsics.spec import POOL_DTYPES
from .base import TPPPattern, static_tensor


def _pool_check(ctx: relax.transform.PatternCheckContext) -> bool:
    """NHWC pooling on a static fp32 tensor: max pooling without dilation (also of u8/s8:
    a quantized model's activations; ceil mode too), or a mean over the two spatial axes."""
    a = ctx.annotated_expr
    x, call = a["lhs"], a["root"]
    attrs = call.attrs
    dtypes = POOL_DTYPES if hasattr(attrs, "pool_size") else ("float32",)
    if not static_tensor(x, dtypes) or len(x.ty.shape.values) != 4:
        return False
    if hasattr(attrs, "pool_size"):
        return (str(attrs.layout) == "NHWC" and str(attrs.out_layout) in ("NHWC", "")
                and all(int(d) == 1 for d in attrs.dilation)
                and int(attrs.strides[0]) == int(attrs.strides[1]))
    axes = sorted(int(ax) % 4 for ax in attrs.axis) if attrs.axis is not None else []
    return axes == [1, 2]


def pool_patterns() -> list[TPPPattern]:
    """max_pool2d (NHWC) and global average pooling (mean over H, W of NHWC)."""
    x, y = wildcard(), wildcard()
    mp = is_op("relax.nn.max_pool2d")(x)
    mean = is_op("relax.mean")(y)
    return [
        TPPPattern("tpp.max_pool2d", mp, {"lhs": x, "root": mp}, _pool_check, "max_pool2d"),
        TPPPattern("tpp.global_avg_pool", mean, {"lhs": y, "root": mean}, _pool_check,
                   "global_avg_pool"),
    ]
