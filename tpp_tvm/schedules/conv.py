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

from dataclasses import dataclass, replace

import numpy as np
from tvm import s_tir, te, tirx

from ..errors import UnsupportedDTypeError, UnsupportedShapeError
from ..intrinsics import TPPSpec
from .gemm_plan import (
    PANEL_BLOCK_BYTES,
    PANEL_BYTES,
    GemmPlan,
    plan_gemm,
    register_tile_isa,
    weights_outer,
)
from .gemm_te import dequantize_te, epilogue_te
from .tensorize import (
    fuse_epilogue,
    schedule_pads,
    tensorize_epilogue,
    tensorize_rows,
    try_tensorize,
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


def plan_conv(shape: ConvShape, dtype: str = "float32") -> GemmPlan:
    """Register tile over (output pixels of a row, output channels)."""
    if shape.oh < 1 or shape.ow < 1:
        raise UnsupportedShapeError(f"conv2d: empty output for {shape}")
    return plan_gemm(shape.ow, shape.oc, shape.c * shape.r * shape.s, dtype)


def padded_channels(c: int, plan: GemmPlan) -> int:
    """Input channels rounded up to whole VNNI groups, so one filter row (S x channels) is
    a whole number of dot-product groups and each output pixel starts on a group."""
    v = plan.precision.vnni
    return -(-c // v) * v


def conv_te(shape: ConvShape, plan: GemmPlan, bias: bool, activation: str | None,
            residual: bool, post_activation: str | None = None
            ) -> tuple[list[te.Tensor], te.Tensor, list]:
    """TE stages of the convolution; inputs: data, packed filter, [zero point, scale,
    offset (int8)], [bias], [residual].

    int8 (u8 data x s8 filter): the filter is VNNI-4 packed ``(OC/nr, R, S*Cp/4, nr, 4)``
    over channels padded to Cp (a multiple of 4), spatial padding holds the activation's
    zero point (so a padded tap adds nothing once the epilogue's ``-z * colsum`` offset is
    applied), and the int32 tile is dequantized per output channel before the fp32 steps.
    """
    sh, nr = shape, plan.nr
    prec = plan.precision
    V = prec.vnni
    owp, ocp = plan.mp, plan.np_
    st = sh.stride
    cc = padded_channels(sh.c, plan)
    int8 = prec.acc == "int32"
    # Rows are flattened (W*C): the input arrives as (n, h, w*c), a free reshape of NHWC.
    X = te.placeholder((sh.n, sh.h, sh.w * sh.c), prec.a, name="data")
    if V > 1:
        W = te.placeholder((ocp // nr, sh.r, sh.s * cc // V, nr, V), prec.b, name="filter_packed")
    else:
        W = te.placeholder((ocp // nr, sh.r, sh.s * cc, nr), prec.b, name="filter_packed")
    zero_point = te.placeholder((1,), prec.a, name="a_zero_point") if int8 else None
    hp = (sh.oh - 1) * st + sh.r
    wp = max((owp - 1) * st + sh.s, sh.w)
    top, left = sh.pad[0], sh.pad[1]
    needs_pad = (hp, wp) != (sh.h, sh.w) or top or left or cc != sh.c
    fill = zero_point[0] if int8 else tirx.const(0, prec.a)

    def padded(n, y, z):
        iy, ix, ch = y - top, z // cc - left, z % cc
        inside = tirx.all(iy >= 0, iy < sh.h, ix >= 0, ix < sh.w, ch < sh.c)
        src = tirx.max(tirx.min(iy, sh.h - 1), 0), tirx.max(tirx.min(ix, sh.w - 1), 0)
        return tirx.if_then_else(
            inside, X[n, src[0], src[1] * sh.c + tirx.min(ch, sh.c - 1)], fill)

    Xp = te.compute((sh.n, hp, wp * cc), padded, name="A_pad") if needs_pad else X

    def mac(a, b):
        return a * b if prec.acc == prec.a else tirx.Cast(prec.acc, a) * tirx.Cast(prec.acc, b)

    if V > 1:
        ko = te.reduce_axis((0, sh.s * cc // V), name="ko")
        kv = te.reduce_axis((0, V), name="kv")
        red = [ko, kv]

        def tap(n, y, x, o, r):
            return mac(Xp[n, y * st + r, x * (st * cc) + ko * V + kv],
                       W[o // nr, r, ko, o % nr, kv])
    else:
        k = te.reduce_axis((0, sh.s * cc), name="k")
        red = [k]

        def tap(n, y, x, o, r):
            return mac(Xp[n, y * st + r, x * (st * cc) + k], W[o // nr, r, k, o % nr])

    if sh.r > 1:
        r = te.reduce_axis((0, sh.r), name="r")
        C = te.compute((sh.n, sh.oh, owp, ocp),
                       lambda n, y, x, o: te.sum(tap(n, y, x, o, r), axis=[r, *red]), name="C")
    else:  # a unit reduction loop cannot be tensorized: no filter-row axis at all
        C = te.compute((sh.n, sh.oh, owp, ocp),
                       lambda n, y, x, o: te.sum(tap(n, y, x, o, 0), axis=red), name="C")
    quant_inputs, stages = [], []
    if int8:
        deq_inputs, C, stages = dequantize_te(C)
        quant_inputs = [zero_point, *deq_inputs]
    extra, out, epilogue = epilogue_te(C, (sh.n, sh.oh, sh.ow, sh.oc), bias, activation,
                                       residual, post_activation)
    return [X, W, *quant_inputs, *extra], out, stages + epilogue


def conv_schedule(shape: ConvShape, isa: str, *, bias: bool = False,
                  activation: str | None = None, residual: bool = False,
                  post_activation: str | None = None, dtype: str = "float32"
                  ) -> tuple[s_tir.Schedule, GemmPlan]:
    """The scheduled (tensorized) convolution PrimFunc and its blocking. ``dtype`` is
    ``"float32"`` or ``"int8"`` (u8 data x s8 filter, dequantized to fp32 in the epilogue:
    parameters as :func:`conv_te` lists them)."""
    if dtype not in ("float32", "int8"):
        raise UnsupportedDTypeError(
            f"conv2d: dtype {dtype!r} unsupported; float32 or int8 (u8 data x s8 filter)")
    isa = register_tile_isa(isa)
    plan = plan_conv(shape, dtype)
    prec = plan.precision
    inputs, out, stages = conv_te(shape, plan, bias, activation, residual, post_activation)
    sch = s_tir.Schedule(te.create_prim_func([*inputs, out]))
    blk = sch.get_sblock("C")
    n, y, x, o, *red = sch.get_loops(blk)
    xo, xi = sch.split(x, [None, plan.mr])
    oo, oi = sch.split(o, [None, plan.nr])
    cc = padded_channels(shape.c, plan)
    elem = 4 // prec.vnni  # bytes per element
    b_dtype = prec.b if prec.b != prec.a else None
    tile = TPPSpec("conv_brgemm", prec.a, b_dtype=b_dtype, m=plan.mr, n=plan.nr,
                   k=shape.s * cc, beta=0, batch=shape.r, stride=shape.stride * cc)
    kc = conv_k_block(shape.r, shape.s * cc, plan.nr, elem, prec.vnni)
    if kc is not None:
        # the innermost reduction is the VNNI pack for int8: block the group axis above it
        *rs, k, kv = red if prec.vnni > 1 else (*red, None)
        ko, ki = sch.split(k, [None, kc // prec.vnni])
        sch.reorder(oo, *rs, ko, n, y, xo, xi, oi, ki, *([kv] if kv is not None else []))
        sch.parallel(oo)
        schedule_pads(sch, ("A_pad",))
        epilogue = fuse_epilogue(sch, oo, plan.mr, plan.nr, stages)
        init = sch.decompose_reduction(blk, rs[0] if rs else ko)
        tensorize_rows(sch, init, TPPSpec("zero", prec.acc, m=plan.mr, n=plan.nr), isa,
                       "C panel init")
        if not try_tensorize(sch, xi, replace(tile, k=kc, beta=1, batch=1), isa,
                             "conv tile"):
            raise RuntimeError("K-blocked conv microkernel did not tensorize")  # a bug
        tensorize_epilogue(sch, epilogue, isa)
        return sch, plan
    if weights_outer(shape.n * shape.h * shape.w * cc * elem // 4,
                     shape.r * shape.s * cc * plan.np_ * elem // 4):
        sch.reorder(oo, n, y, xo, xi, oi, *red)
        tile_loop = sch.fuse(oo, n, y, xo)
    else:
        sch.reorder(n, y, xo, oo, xi, oi, *red)
        tile_loop = sch.fuse(n, y, xo, oo)
    sch.parallel(tile_loop)
    schedule_pads(sch, ("A_pad",))
    epilogue = fuse_epilogue(sch, tile_loop, plan.mr, plan.nr, stages)
    if not try_tensorize(sch, xi, tile, isa, "conv tile"):
        raise RuntimeError("conv microkernel did not tensorize")  # a bug, not user input
    tensorize_epilogue(sch, epilogue, isa)
    return sch, plan


def conv_k_block(r: int, sc: int, nr: int, elem: int = 4, vnni: int = 1) -> int | None:
    """Reduction block (a divisor of S*C, whole VNNI groups) when a filter panel
    (R x S*C x nr elements of ``elem`` bytes) outgrows L2: the panel is then reduced one
    filter row and ``kc`` elements at a time over all output pixels. None when it fits."""
    if elem * r * sc * nr <= PANEL_BYTES:
        return None
    best = None
    for kc in range(64, sc + 1):
        if sc % kc == 0 and kc % vnni == 0 and elem * kc * nr <= PANEL_BLOCK_BYTES:
            best = kc
    return best


def pack_filter(w_oihw: np.ndarray, nr: int, vnni: int = 1) -> np.ndarray:
    """OIHW filter → zero-padded (ceil(O/nr), H, W*Ip, nr) panels for the conv TPP, or with
    ``vnni`` > 1 (int8: 4) the VNNI panels (ceil(O/nr), H, W*Ip/vnni, nr, vnni); Ip is I
    rounded up to a multiple of ``vnni`` (the padded channels' weights are zero)."""
    o, i, h, w = w_oihw.shape
    op, ip = -(-o // nr) * nr, -(-i // vnni) * vnni
    padded = np.zeros((op, ip, h, w), dtype=w_oihw.dtype)
    padded[:o, :i] = w_oihw
    # (op/nr, nr, ip, h, w) -> (op/nr, h, w, ip, nr)
    panels = padded.reshape(op // nr, nr, ip, h, w).transpose(0, 3, 4, 2, 1)
    panels = np.ascontiguousarray(panels).reshape(op // nr, h, w * ip, nr)
    if vnni == 1:
        return panels
    grouped = panels.reshape(op // nr, h, w * ip // vnni, vnni, nr)
    return np.ascontiguousarray(np.swapaxes(grouped, -1, -2))
