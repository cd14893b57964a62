"""2D convolution on TPPs, as the TPP paper does it: BRGEMM over the filter taps.

Layout NHWC (activations) with the filter packed as ``(ceil(OC / nr), R, S*C, nr)``. One
register tile is ``mr`` output pixels of one output row by ``nr`` output channels. Seen
with each input row flattened to W*C elements, the S taps and C channels of one filter row
are one contiguous run of S*C elements that starts ``stride*C`` elements later for each
next output pixel, so the ``conv_brgemm`` TPP reduces K = S*C per filter row and batches
over the R filter rows, with the tile in registers (beta 0); the epilogue TPPs (bias,
activation, residual) then run on it. The input is zero-padded once when the convolution
pads (spatial padding plus the row tail of the pixel tiling).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import s_tir, te, tirx

from ..errors import UnsupportedShapeError
from ..intrinsics import TPPSpec
from .gemm import (
    PANEL_BLOCK_BYTES,
    PANEL_BYTES,
    GemmPlan,
    _try_tensorize,
    epilogue_te,
    fuse_epilogue,
    plan_gemm,
    schedule_pads,
    tensorize_epilogue,
    tensorize_rows,
    weights_outer,
)


class SlidingWindow:
    """Output extent of a 2D sliding window (convolution, pooling) over NHWC input.

    Mixed into shape dataclasses that define h, w, r, s, stride and pad (t, l, b, r)."""

    h: int
    w: int
    r: int
    s: int
    stride: int
    pad: tuple[int, int, int, int]

    @property
    def oh(self) -> int:
        return (self.h + self.pad[0] + self.pad[2] - self.r) // self.stride + 1

    @property
    def ow(self) -> int:
        return (self.w + self.pad[1] + self.pad[3] - self.s) // self.stride + 1


@dataclass(frozen=True)
class ConvShape(SlidingWindow):
    """An NHWC convolution: input (n, h, w, c), filter (r, s, c, oc), stride, padding."""

    n: int
    h: int
    w: int
    c: int
    oc: int
    r: int
    s: int
    stride: int = 1
    pad: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right

    @property
    def flops(self) -> int:
        return 2 * self.n * self.oh * self.ow * self.oc * self.r * self.s * self.c


def plan_conv(shape: ConvShape) -> GemmPlan:
    """Register tile over (output pixels of a row, output channels)."""
    if shape.oh < 1 or shape.ow < 1:
        raise UnsupportedShapeError(f"conv2d: empty output for {shape}")
    return plan_gemm(shape.ow, shape.oc, shape.c * shape.r * shape.s)


def conv_te(shape: ConvShape, plan: GemmPlan, bias: bool, activation: str | None,
            residual: bool, post_activation: str | None = None
            ) -> tuple[list[te.Tensor], te.Tensor, list]:
    """TE stages of the convolution; inputs: data, packed filter, [bias], [residual]."""
    sh, nr = shape, plan.nr
    owp, ocp = plan.mp, plan.np_
    st = sh.stride
    # Rows are flattened (W*C): the input arrives as (n, h, w*c), a free reshape of NHWC.
    X = te.placeholder((sh.n, sh.h, sh.w * sh.c), "float32", name="data")
    W = te.placeholder((ocp // nr, sh.r, sh.s * sh.c, nr), "float32", name="filter_packed")
    hp = (sh.oh - 1) * st + sh.r
    wp = max((owp - 1) * st + sh.s, sh.w)
    top, left = sh.pad[0], sh.pad[1]
    needs_pad = (hp, wp) != (sh.h, sh.w) or top or left
    cc = sh.c

    def padded(n, y, z):
        iy, ix = y - top, z // cc - left
        inside = tirx.all(iy >= 0, iy < sh.h, ix >= 0, ix < sh.w)
        src = tirx.max(tirx.min(iy, sh.h - 1), 0), tirx.max(tirx.min(ix, sh.w - 1), 0)
        return tirx.if_then_else(
            inside, X[n, src[0], src[1] * cc + z % cc], tirx.const(0, "float32")
        )

    Xp = te.compute((sh.n, hp, wp * cc), padded, name="A_pad") if needs_pad else X
    k = te.reduce_axis((0, sh.s * cc), name="k")
    if sh.r > 1:
        r = te.reduce_axis((0, sh.r), name="r")
        C = te.compute(
            (sh.n, sh.oh, owp, ocp),
            lambda n, y, x, o: te.sum(
                Xp[n, y * st + r, x * (st * cc) + k] * W[o // nr, r, k, o % nr], axis=[r, k]
            ),
            name="C",
        )
    else:  # a unit reduction loop cannot be tensorized: no filter-row axis at all
        C = te.compute(
            (sh.n, sh.oh, owp, ocp),
            lambda n, y, x, o: te.sum(
                Xp[n, y * st, x * (st * cc) + k] * W[o // nr, 0, k, o % nr], axis=[k]
            ),
            name="C",
        )
    extra, out, stages = epilogue_te(C, (sh.n, sh.oh, sh.ow, sh.oc), bias, activation,
                                     residual, post_activation)
    return [X, W, *extra], out, stages


def conv_schedule(shape: ConvShape, isa: str, *, bias: bool = False,
                  activation: str | None = None, residual: bool = False,
                  post_activation: str | None = None) -> tuple[s_tir.Schedule, GemmPlan]:
    """The scheduled (tensorized) convolution PrimFunc and its blocking."""
    plan = plan_conv(shape)
    inputs, out, stages = conv_te(shape, plan, bias, activation, residual, post_activation)
    sch = s_tir.Schedule(te.create_prim_func([*inputs, out]))
    blk = sch.get_sblock("C")
    n, y, x, o, *red = sch.get_loops(blk)
    xo, xi = sch.split(x, [None, plan.mr])
    oo, oi = sch.split(o, [None, plan.nr])
    kc = conv_k_block(shape.r, shape.s * shape.c, plan.nr)
    if kc is not None:
        *rs, k = red
        ko, ki = sch.split(k, [None, kc])
        sch.reorder(oo, *rs, ko, n, y, xo, xi, oi, ki)
        sch.parallel(oo)
        schedule_pads(sch, ("A_pad",))
        epilogue = fuse_epilogue(sch, oo, plan.mr, plan.nr, stages)
        init = sch.decompose_reduction(blk, rs[0] if rs else ko)
        tensorize_rows(sch, init, TPPSpec("zero", m=plan.mr, n=plan.nr), isa, "C panel init")
        spec = TPPSpec("conv_brgemm", m=plan.mr, n=plan.nr, k=kc, beta=1, batch=1,
                       stride=shape.stride * shape.c)
        if not _try_tensorize(sch, xi, spec, isa, "conv tile"):
            raise RuntimeError("K-blocked conv microkernel did not tensorize")  # a bug
        tensorize_epilogue(sch, epilogue, isa)
        return sch, plan
    if weights_outer(shape.n * shape.h * shape.w * shape.c,
                     shape.r * shape.s * shape.c * plan.np_):
        sch.reorder(oo, n, y, xo, xi, oi, *red)
        tile_loop = sch.fuse(oo, n, y, xo)
    else:
        sch.reorder(n, y, xo, oo, xi, oi, *red)
        tile_loop = sch.fuse(n, y, xo, oo)
    sch.parallel(tile_loop)
    schedule_pads(sch, ("A_pad",))
    epilogue = fuse_epilogue(sch, tile_loop, plan.mr, plan.nr, stages)
    spec = TPPSpec("conv_brgemm", m=plan.mr, n=plan.nr, k=shape.s * shape.c, beta=0,
                   batch=shape.r, stride=shape.stride * shape.c)
    if not _try_tensorize(sch, xi, spec, isa, "conv tile"):
        raise RuntimeError("conv microkernel did not tensorize")  # a bug, not user input
    tensorize_epilogue(sch, epilogue, isa)
    return sch, plan


def conv_k_block(r: int, sc: int, nr: int) -> int | None:
    """Reduction block (a divisor of S*C) when a filter panel (R x S*C x nr) outgrows L2:
    the panel is then reduced one filter row and ``kc`` elements at a time over all output
    pixels. None when the panel fits."""
    if 4 * r * sc * nr <= PANEL_BYTES:
        return None
    best = None
    for kc in range(64, sc + 1):
        if sc % kc == 0 and 4 * kc * nr <= PANEL_BLOCK_BYTES:
            best = kc
    return best


def pack_filter(w_oihw: np.ndarray, nr: int) -> np.ndarray:
    """OIHW filter → zero-padded (ceil(O/nr), H, W*I, nr) panels for the conv TPP."""
    o, i, h, w = w_oihw.shape
    op = -(-o // nr) * nr
    padded = np.zeros((op, i, h, w), dtype=w_oihw.dtype)
    padded[:o] = w_oihw
    # (op/nr, nr, i, h, w) -> (op/nr, h, w, i, nr)
    panels = padded.reshape(op // nr, nr, i, h, w).transpose(0, 3, 4, 2, 1)
    return np.ascontiguousarray(panels).reshape(op // nr, h, w * i, nr)
