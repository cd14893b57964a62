"""The pooling families: NHWC max pooling (the pool_max TPP over each window) and global
average pooling (the reduce_add_rows TPP)."""

from __future__ import annotations

from tvm import relax

from ...schedules.pool import PoolShape, global_avg_pool_schedule, max_pool_schedule
from .base import KernelFamily, Lowered, Match, as_relax_kernel, dims, kernel_name


def lower_max_pool(bb: relax.BlockBuilder, matched: Match, name: str,
                   isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """NHWC max pooling: the pool_max TPP over each window. In ceil mode (SqueezeNet's) the
    last, partial windows are those of a bottom/right padding wide enough to hold them:
    the kernel pads with the dtype's lowest value, which no maximum selects."""
    x, call = matched["lhs"], matched["root"]
    n, h, w, c = dims(x)
    attrs = call.attrs
    pad = [int(p) for p in attrs.padding]
    top, left, bottom, right = pad * 2 if len(pad) == 2 else pad
    r, s, stride = int(attrs.pool_size[0]), int(attrs.pool_size[1]), int(attrs.strides[0])
    _, oh, ow, _ = dims(call)
    bottom = max(bottom, (oh - 1) * stride + r - h - top)
    right = max(right, (ow - 1) * stride + s - w - left)
    shape = PoolShape(n, h, w, c, r, s, stride, (top, left, bottom, right))
    dtype = str(x.ty.dtype)
    sch = max_pool_schedule(shape, isa, dtype)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    args = [bb.emit(relax.op.reshape(x, (n, h, w * c)))]
    return Lowered(relax.call_tir(gv, args, relax.TensorType((n, shape.oh, shape.ow, c), dtype)))


def lower_global_avg_pool(bb: relax.BlockBuilder, matched: Match, name: str,
                          isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """Global average pooling (mean over H, W of NHWC): the reduce_add_rows TPP."""
    x, call = matched["lhs"], matched["root"]
    n, h, w, c = dims(x)
    if _one_pixel(matched):  # the mean of one pixel is the pixel (VGG's 1 x 4096 head)
        return Lowered(relax.op.reshape(x, dims(call)))
    sch = global_avg_pool_schedule(n, h * w, c, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    out = bb.emit(relax.call_tir(gv, [bb.emit(relax.op.reshape(x, (n, h * w, c)))],
                                 relax.TensorType((n, c), "float32")))
    return Lowered(relax.op.reshape(out, dims(call)))


def _one_pixel(matched: Match) -> bool:
    """A global average pooling of a one-pixel map: a reshape."""
    _, h, w, _ = dims(matched["lhs"])
    return h * w == 1


FAMILIES = (
    KernelFamily("max_pool2d", lower_max_pool),
    KernelFamily("global_avg_pool", lower_global_avg_pool, is_view=_one_pixel),
)
