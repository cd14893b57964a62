"""Pooling on TPPs (NHWC): max pooling windows and global average pooling.

Max pooling sees each input row flattened (W*C, as the convolution does): the window of an
output pixel is R rows of S taps, each tap a run of channels ``C`` elements after the
previous one, and consecutive output pixels start ``stride*C`` elements apart; the
``pool_max`` TPP reduces a block of output pixels x channels over the whole window. The
input is padded with the lowest value of its dtype (never selected), once. Global average
pooling is a ``reduce_add_rows`` TPP over the H*W rows of each image followed by one scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, te, tirx

from ..errors import UnsupportedShapeError
from ..intrinsics import TPPSpec
from .conv import SlidingWindow
from .tensorize import schedule_image_pad, try_tensorize


@dataclass(frozen=True)
class PoolShape(SlidingWindow):
    """An NHWC max pooling: input (n, h, w, c), window r x s, stride, padding (t, l, b, r)."""

    n: int
    h: int
    w: int
    c: int
    r: int
    s: int
    stride: int
    pad: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: int = 1


def pixel_tile(extent: int, limit: int = 8) -> tuple[int, int]:
    """(block, padded extent): the largest block in [2, ``limit``] dividing ``extent``, else
    the block that pads it least (Inception-v3's 17 output pixels: blocks of 6 over 18; the
    extra pixel is computed and dropped)."""
    even = next((b for b in range(min(limit, extent), 1, -1) if extent % b == 0), None)
    if even:
        return even, extent
    block = min(range(limit, 1, -1), key=lambda b: -(-extent // b) * b)
    return block, -(-extent // block) * block


def max_pool_schedule(shape: PoolShape, isa: str, dtype: str = "float32") -> s_tir.Schedule:
    """Max pooling kernel: input (n, h, w*c) (a free reshape of NHWC), output NHWC; fp32,
    or the u8/s8 activations of a quantized model."""
    sh = shape
    if sh.r * sh.s < 2:
        raise UnsupportedShapeError("max pooling with a 1x1 window is a copy")
    mr, owp = pixel_tile(sh.ow)
    nc = 64 if sh.c > 64 and sh.c % 64 == 0 else sh.c
    c, st = sh.c, sh.stride
    lowest = tirx.min_value(dtype)
    X = te.placeholder((sh.n, sh.h, sh.w * c), dtype, name="data")
    hp = (sh.oh - 1) * st + sh.r
    wp = max((owp - 1) * st + sh.s, sh.w)
    top, left = sh.pad[0], sh.pad[1]
    if (hp, wp) != (sh.h, sh.w) or top or left:

        def padded(n, y, z):
            iy, ix = y - top, z // c - left
            inside = tirx.all(iy >= 0, iy < sh.h, ix >= 0, ix < sh.w)
            src = (tirx.max(tirx.min(iy, sh.h - 1), 0), tirx.max(tirx.min(ix, sh.w - 1), 0))
            return tirx.if_then_else(inside, X[n, src[0], src[1] * c + z % c], lowest)

        Xp = te.compute((sh.n, hp, wp * c), padded, name="A_pad")
    else:
        Xp = X
    r = te.reduce_axis((0, sh.r), "r")
    s = te.reduce_axis((0, sh.s), "s")
    pool = te.compute(
        (sh.n, sh.oh, owp, c),
        lambda n, y, x, ch: te.max(Xp[n, y * st + r, x * (st * c) + s * c + ch], axis=[r, s]),
        name="pool",
    )
    out = pool if owp == sh.ow else te.compute(
        (sh.n, sh.oh, sh.ow, c), lambda n, y, x, ch: pool[n, y, x, ch], name="crop")
    sch = s_tir.Schedule(te.create_prim_func([X, out]))
    if owp != sh.ow:  # the padded rows' pixels that exist, copied out row by row
        n, y, x, ch = sch.get_loops(sch.get_sblock("crop"))
        sch.parallel(sch.fuse(n, y))
        sch.vectorize(sch.fuse(x, ch))
    blk = sch.get_sblock("pool")
    n, y, x, ch, rl, sl = sch.get_loops(blk)
    xo, xi = sch.split(x, [None, mr])
    co, ci = sch.split(ch, [None, nc])
    sch.reorder(n, y, xo, co, xi, ci, rl, sl)
    sch.parallel(sch.fuse(n, y, xo, co))
    schedule_image_pad(sch, c)
    spec = TPPSpec("pool_max", dtype, m=mr, n=nc, batch=sh.r, k=sh.s, stride=st * c,
                   tap_stride=c)
    if not try_tensorize(sch, xi, spec, isa, "pool tile"):
        raise RuntimeError("max pooling tile did not tensorize")  # a bug, not user input
    return sch


def global_avg_pool_schedule(n: int, pixels: int, c: int, isa: str) -> s_tir.Schedule:
    """Mean over the pixels of each image: input (n, pixels, c), output (n, c)."""
    X = te.placeholder((n, pixels, c), "float32", name="data")
    p = te.reduce_axis((0, pixels), "p")
    total = te.compute((n, c), lambda b, ch: te.sum(X[b, p, ch], axis=p), name="row_sum")
    scale = tirx.const(1.0 / pixels, "float32")
    out = te.compute((n, c), lambda b, ch: total[b, ch] * scale, name="mean")
    sch = s_tir.Schedule(te.create_prim_func([X, out]))
    mb = sch.get_sblock("mean")
    b, _ = sch.get_loops(mb)
    sch.parallel(b)
    sch.compute_at(sch.get_sblock("row_sum"), b)
    loops = sch.get_loops(sch.get_sblock("row_sum"))
    if pixels < 2 or not try_tensorize(
        sch, loops[1], TPPSpec("reduce_add_rows", m=pixels, n=c), isa, "pixel sum"
    ):
        raise UnsupportedShapeError(f"global average pooling of {pixels} x {c}: no TPP tile")
    sch.vectorize(sch.get_loops(mb)[-1])
    return sch
