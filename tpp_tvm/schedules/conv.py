"""2D convolution on TPPs, as the TPP paper does it: BRGEMM over the filter taps.

Layout NHWC (activations) with the filter packed as ``(ceil(OC / nr), R, S*C, nr)``. One
register tile is ``mr`` output pixels of one output row by ``nr`` output channels. Seen
with each input row flattened to W*C elements, the S taps and C channels of one filter row
are one contiguous run of S*C elements that starts ``stride*C`` elements later for each
next output pixel, so the ``conv_brgemm`` TPP reduces K = S*C per filter row and batches
over the R filter rows, with the tile in registers (beta 0); the epilogue TPPs (bias,
activation, residual) then run on it. The input is zero-padded once when the convolution
pads (spatial padding plus the row tail of the pixel tiling).

On an AMX target a bf16 or int8 convolution whose filter rows are whole tile steps (S x
channels a multiple of 64 bytes) runs the same loop nest on tiles: 16 or 32 output pixels
are the rows of an A tile (``tileloadd`` with the pixel stride, ``stride x C`` elements, as
its row pitch), the filter panel's VNNI rows are B tiles, and the filter rows are the batch
of the tile BRGEMM; the output tiles are split into one task per thread that configures the
tiles once, and the epilogue runs on the AVX-512 unit (:func:`tile_conv_plan`). A bf16
convolution takes its input already padded to bf16 (:func:`conv_input_schedule`).

A grouped convolution is the same kernel with a group loop outermost: the padding pass
gathers each group's channels into an image of its own, each group has its own filter
panels, and the epilogue writes the group's tile straight into its channels of the NHWC
output, so there are no per-group slices or concat copies (RegNet's 3x3 layers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from tvm import s_tir, te, tirx

from ..errors import UnsupportedDTypeError, UnsupportedShapeError
from ..intrinsics import TPPSpec
from ..intrinsics.amx import TILE_CONFIG_ATTR
from ..intrinsics.epilogue import Epilogue
from ..intrinsics.llvm_ir import AMX_GROUPS, AMX_ROWS
from ..intrinsics.prefetch import PREFETCH_ATTR
from .gemm import split_tasks
from .gemm_plan import (
    GEMM_PRECISIONS,
    PANEL_BLOCK_BYTES,
    PANEL_BYTES,
    GemmPlan,
    check_low_precision,
    plan_gemm,
    register_tile_isa,
    runs_on_tiles,
    weights_outer,
)
from .gemm_te import epilogue_te, int8_epilogue_te
from .tensorize import (
    fuse_epilogue,
    schedule_image_pad,
    tensorize_epilogue,
    tensorize_rows,
    try_tensorize,
)

#: Name of a convolution kernel's packed filter parameter.
FILTER = "filter_packed"


class SlidingWindow:
    """Output extent of a 2D sliding window (convolution, pooling) over NHWC input.

    Mixed into shape dataclasses that define h, w, r, s, stride, pad (t, l, b, r) and
    dilation (taps ``dilation`` pixels apart; only the depthwise kernel takes one > 1)."""

    h: int
    w: int
    r: int
    s: int
    stride: int
    pad: tuple[int, int, int, int]
    dilation: int

    @property
    def oh(self) -> int:
        return (self.h + self.pad[0] + self.pad[2] - self.dilation * (self.r - 1) - 1) \
            // self.stride + 1

    @property
    def ow(self) -> int:
        return (self.w + self.pad[1] + self.pad[3] - self.dilation * (self.s - 1) - 1) \
            // self.stride + 1


@dataclass(frozen=True)
class ConvShape(SlidingWindow):
    """An NHWC convolution: input (n, h, w, c), filter (r, s, c / groups, oc), stride,
    padding; ``groups`` convolutions side by side, each on c / groups input channels."""

    n: int
    h: int
    w: int
    c: int
    oc: int
    r: int
    s: int
    stride: int = 1
    pad: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right
    groups: int = 1
    dilation: int = 1

    @property
    def cg(self) -> int:
        """Input channels per group."""
        return self.c // self.groups

    @property
    def og(self) -> int:
        """Output channels per group."""
        return self.oc // self.groups

    @property
    def flops(self) -> int:
        return 2 * self.n * self.oh * self.ow * self.oc * self.r * self.s * self.cg


def plan_conv(shape: ConvShape, dtype: str = "float32", isa: str = "avx512") -> GemmPlan:
    """Register tile over (output pixels of a row, output channels of a group)."""
    if shape.oh < 1 or shape.ow < 1:
        raise UnsupportedShapeError(f"conv2d: empty output for {shape}")
    if shape.groups < 1 or shape.c % shape.groups or shape.oc % shape.groups:
        raise UnsupportedShapeError(
            f"conv2d: {shape.c} input and {shape.oc} output channels do not split into "
            f"{shape.groups} groups")
    return plan_gemm(shape.ow, shape.og, shape.cg * shape.r * shape.s, dtype, isa)


def tile_conv_plan(shape: ConvShape, dtype: str, isa: str) -> GemmPlan | None:
    """The AMX tile blocking of a convolution (16 or 32 output pixels of a row by 16 or 32
    output channels), or None where it stays on the vector unit: not a tile dtype on this
    ISA, or a filter row (S x channels of a group, padded to the VNNI group) that is not
    whole tile steps of 64 bytes (a 3-channel int8 stem: 7 x 4 = 28 bytes per filter row;
    RegNet's grouped 3 x 3 convolutions of 64 channels a group fill them)."""
    if not runs_on_tiles(isa, dtype):
        return None
    v = GEMM_PRECISIONS[dtype].vnni
    if shape.s * (-(-shape.cg // v) * v) % (AMX_GROUPS * v):
        return None
    mr = AMX_ROWS if shape.ow <= AMX_ROWS else 2 * AMX_ROWS
    nr = 16 if shape.og <= 16 else 32
    return GemmPlan(shape.ow, shape.og, shape.cg * shape.r * shape.s, mr, nr, dtype, amx=True)


#: How many times the multiply-adds a filter widened to whole tile steps may make
#: (:func:`tile_filter_width`): a 7-tap stem of 3 (4) int8 channels becomes 16 taps, 2.3x,
#: which the tiles still run faster than the vector unit runs its 28-byte rows (ResNet-50's
#: stem alone on the AMX Xeon: 0.50 ms on tiles from a 4-channel input, 0.60 on the vector
#: unit; in the model 0.38 ms against 0.54 before).
MAX_TAP_WIDENING = 2.5


def tile_filter_width(shape: ConvShape, dtype: str, isa: str) -> int:
    """The filter width (taps) a convolution runs with: its own, or, where its filter rows
    are not whole AMX tile steps of 64 bytes (a 3-channel stem), the next width that is,
    padded with zero taps (the input gets as many more padding columns on the right, so the
    output is the same), if that costs at most :data:`MAX_TAP_WIDENING` times the work."""
    if not runs_on_tiles(isa, dtype) or shape.groups != 1 or shape.s == 1:
        return shape.s  # (a 1x1 convolution runs as a GEMM, which pads K itself)
    v = GEMM_PRECISIONS[dtype].vnni
    row = shape.s * (-(-shape.c // v) * v)  # elements of a filter row, channels padded
    step = AMX_GROUPS * v
    if row % step == 0 or step % (row // shape.s):
        return shape.s
    width = -(-row // step) * step // (row // shape.s)
    return width if width <= MAX_TAP_WIDENING * shape.s else shape.s


def padded_channels(c: int, plan: GemmPlan) -> int:
    """Input channels rounded up to whole VNNI groups, so one filter row (S x channels) is
    a whole number of dot-product groups and each output pixel starts on a group."""
    v = plan.precision.vnni
    return -(-c // v) * v


def padded_input_shape(shape: ConvShape, plan: GemmPlan) -> tuple[int, int, int]:
    """(rows, pixels, channels) of the padded input image one group's taps read: the
    output rows' input rows, the pixel tiling's columns (at least the input's), channels
    rounded up to whole VNNI groups."""
    hp = (shape.oh - 1) * shape.stride + shape.r
    wp = max((plan.mp - 1) * shape.stride + shape.s, shape.w)
    return hp, wp, padded_channels(shape.cg, plan)


def strided_pointwise(shape: ConvShape) -> ConvShape | None:
    """The stride-1 convolution a strided 1x1 one (no padding) is on the image of the
    pixels it reads, every ``stride``-th of every ``stride``-th row, or None.

    Its input copy then gathers those pixels (a quarter of the image at stride 2) instead
    of padding the whole image for tiles striding over it: ResNet-50's int8 stage-2
    shortcut (56x56x256 -> 28x28x512) copied 0.9 MB a call."""
    if shape.r == shape.s == 1 and shape.stride > 1 and not any(shape.pad) \
            and shape.groups == 1:
        return replace(shape, h=shape.oh, w=shape.ow, stride=1)
    return None


def conv_input_te(shape: ConvShape, plan: GemmPlan, X: te.Tensor, fill, step: int = 1
                  ) -> te.Tensor:
    """The zero-padded (n, [group,] hp, wp*cc) image of NHWC input ``X`` (n, h, w*c) in
    ``X``'s dtype or the plan's A dtype; a group's channels gathered into an image of its
    own, so the taps of one filter row stay one contiguous run of S*C/groups elements.
    ``step`` > 1: ``shape`` is the :func:`strided_pointwise` image, read from every
    ``step``-th row and pixel of ``X``."""
    sh = shape
    hp, wp, cc = padded_input_shape(sh, plan)
    G, cg = sh.groups, sh.cg
    top, left = sh.pad[0], sh.pad[1]
    dtype = plan.precision.a

    def padded(n, *ix):
        g, y, z = ix if G > 1 else (0, *ix)
        iy, ix_, ch = y - top, z // cc - left, z % cc
        inside = tirx.all(iy >= 0, iy < sh.h, ix_ >= 0, ix_ < sh.w, ch < cg)
        src = tirx.max(tirx.min(iy, sh.h - 1), 0), tirx.max(tirx.min(ix_, sh.w - 1), 0)
        value = X[n, src[0] * step, src[1] * step * sh.c + g * cg + tirx.min(ch, cg - 1)]
        return tirx.if_then_else(inside, tirx.Cast(dtype, value) if X.dtype != dtype
                                 else value, fill)

    return te.compute((sh.n, *((G,) if G > 1 else ()), hp, wp * cc), padded, name="A_pad")


def conv_input_schedule(shape: ConvShape, plan: GemmPlan, in_dtype: str = "float32"
                        ) -> s_tir.Schedule:
    """NHWC input (fp32, or bf16 from a producer that wrote bf16) -> the zero-padded bf16
    image a bf16 convolution kernel takes (see :attr:`GemmPlan.a_prepadded`: TVM widens a
    bf16 buffer allocated inside a kernel), one parallel task per image row. The row is
    split into pixels of ``cc`` channels, so the innermost index is linear for grouped
    images too (a group's channels are a strided
    gather; one flat loop over pixels x channels kept LLVM from vectorising it: 10x slower)."""
    X = te.placeholder((shape.n, shape.h, shape.w * shape.c), in_dtype, name="data")
    out = conv_input_te(shape, plan, X, tirx.const(0, plan.precision.a))
    sch = s_tir.Schedule(te.create_prim_func([X, out]))
    blk = sch.get_sblock("A_pad")
    *rows, row = sch.get_loops(blk)
    sch.parallel(sch.fuse(*rows))
    sch.split(row, [None, padded_input_shape(shape, plan)[2]])
    return sch


def conv_te(shape: ConvShape, plan: GemmPlan, epilogue: Epilogue = Epilogue(),
            source: ConvShape | None = None) -> tuple[list[te.Tensor], te.Tensor, list]:
    """TE stages of the convolution; inputs: data, packed filter, [zero point, scale,
    offset (int8)], the ``epilogue``'s operands (:func:`~.gemm_te.epilogue_te`) (int8
    writing u8/s8 with no epilogue step: zero point and the requantize rows of
    :func:`~.gemm_te.int8_epilogue_te`).

    int8 (u8 data x s8 filter): the filter is VNNI-4 packed ``(OC/nr, R, S*Cp/4, nr, 4)``
    over channels padded to Cp (a multiple of 4), spatial padding holds the activation's
    zero point (so a padded tap adds nothing once the epilogue's ``-z * colsum`` offset is
    applied), and the int32 tile is dequantized per output channel before the fp32 steps.
    bf16: the data is the padded bf16 image (:func:`conv_input_schedule`), the filter
    VNNI-2 packed, the tile fp32. ``source``: the strided 1x1 convolution whose
    :func:`strided_pointwise` image ``shape`` is (its data is the source's input).
    """
    sh = shape
    X, Xp, W, zero_point = _conv_operands(sh, plan, source)
    C = _conv_contraction(sh, plan, Xp, W)
    G = sh.groups
    valid = (sh.n, sh.oh, sh.ow, *((G,) if G > 1 else ()), sh.og)
    c_axes = (0, 1, 3, 2, 4) if G > 1 else None
    if plan.precision.acc == "int32":
        extra, out, stages = int8_epilogue_te(C, valid, epilogue, c_axes,
                                              group_axis=2 if G > 1 else None)
        return [X, W, zero_point, *extra], out, stages
    extra, out, stages = epilogue_te(C, valid, epilogue, c_axes)
    return [X, W, *extra], out, stages


def _conv_operands(sh: ConvShape, plan: GemmPlan, source: ConvShape | None) -> tuple:
    """The data (as given, and padded for the kernel), the packed filter and, for int8,
    the activation's zero point, as :func:`conv_te` takes them."""
    nr, prec = plan.nr, plan.precision
    V = prec.vnni
    G, cc = sh.groups, padded_channels(sh.cg, plan)
    int8 = prec.acc == "int32"
    # Grouped: one filter panel set and one padded image per group, (group, ...) first.
    gdim = (G,) if G > 1 else ()
    if V > 1:
        W = te.placeholder((*gdim, plan.np_ // nr, sh.r, sh.s * cc // V, nr, V), prec.b,
                           name=FILTER)
    else:
        W = te.placeholder((*gdim, plan.np_ // nr, sh.r, sh.s * cc, nr), prec.b,
                           name=FILTER)
    zero_point = te.placeholder((1,), prec.a, name="a_zero_point") if int8 else None
    hp, wp, _ = padded_input_shape(sh, plan)
    if plan.a_prepadded:  # bf16: the image comes padded (conv_input_schedule)
        X = Xp = te.placeholder((sh.n, *gdim, hp, wp * cc), prec.a, name="data")
    else:  # rows flattened (W*C): (n, h, w*c), a free reshape of NHWC
        src = source or sh
        X = Xp = te.placeholder((sh.n, src.h, src.w * sh.c), prec.a, name="data")
        if (hp, wp) != (sh.h, sh.w) or sh.pad[0] or sh.pad[1] or cc != sh.c or source:
            Xp = conv_input_te(sh, plan, X, zero_point[0] if int8 else tirx.const(0, prec.a),
                               source.stride if source else 1)
    return X, Xp, W, zero_point


def _conv_contraction(sh: ConvShape, plan: GemmPlan, Xp: te.Tensor, W: te.Tensor
                      ) -> te.Tensor:
    """C: the convolution as a sum over filter rows and (filter column, channel) taps of
    the padded image ``Xp`` and the packed filter ``W``, before the epilogue."""
    nr, prec = plan.nr, plan.precision
    V = prec.vnni
    st = sh.stride
    G, cc = sh.groups, padded_channels(sh.cg, plan)
    gdim = (G,) if G > 1 else ()

    def mac(a, b):
        return a * b if prec.acc == prec.a else tirx.Cast(prec.acc, a) * tirx.Cast(prec.acc, b)

    def a_at(n, g, row, col):
        return Xp[(n, g, row, col) if G > 1 else (n, row, col)]

    def w_at(g, *ix):
        return W[(g, *ix) if G > 1 else ix]

    if V > 1:
        ko = te.reduce_axis((0, sh.s * cc // V), name="ko")
        kv = te.reduce_axis((0, V), name="kv")
        red = [ko, kv]

        def tap(n, y, x, g, o, r):
            return mac(a_at(n, g, y * st + r, x * (st * cc) + ko * V + kv),
                       w_at(g, o // nr, r, ko, o % nr, kv))
    else:
        k = te.reduce_axis((0, sh.s * cc), name="k")
        red = [k]

        def tap(n, y, x, g, o, r):
            return mac(a_at(n, g, y * st + r, x * (st * cc) + k), w_at(g, o // nr, r, k, o % nr))

    def contraction(n, y, *gxo):
        g, x, o = gxo if G > 1 else (0, *gxo)
        if sh.r > 1:
            return te.sum(tap(n, y, x, g, o, r), axis=[r, *red])
        # a unit reduction loop cannot be tensorized: no filter-row axis at all
        return te.sum(tap(n, y, x, g, o, 0), axis=red)

    r = te.reduce_axis((0, sh.r), name="r") if sh.r > 1 else None
    # Grouped: C is (n, oh, group, ow, channel), a register tile in its two trailing dims
    # as the microkernel needs; the epilogue writes it NHWC as (n, oh, ow, group, channel).
    return te.compute((sh.n, sh.oh, *gdim, plan.mp, plan.np_), contraction, name="C")


def conv_plan(shape: ConvShape, isa: str, dtype: str = "float32") -> GemmPlan:
    """The blocking :func:`conv_schedule` uses (AMX tiles where the shape fills them),
    known before the kernel is built: it fixes the packed filter's layout."""
    return tile_conv_plan(shape, dtype, isa) or plan_conv(shape, dtype, register_tile_isa(isa))


def conv_schedule(shape: ConvShape, isa: str, *, epilogue: Epilogue = Epilogue(),
                  dtype: str = "float32", threads: int = 1) -> tuple[s_tir.Schedule, GemmPlan]:
    """The scheduled (tensorized) convolution PrimFunc and its blocking. ``dtype`` is
    ``"float32"``, ``"bfloat16"`` (bf16 data, already padded, and filter; fp32
    accumulation and epilogue) or ``"int8"`` (u8 data x s8 filter, dequantized to fp32 in
    the epilogue: parameters as :func:`conv_te` lists them; ``"int16"``: the same values
    widened to s16, for AVX2's ``vpmaddwd``). ``threads``: the parallel tasks of a
    convolution on AMX tiles (each configures the tiles once). ``epilogue``: as
    :func:`~.gemm.gemm_schedule`'s (writing bf16 or u8/s8 for the next layer)."""
    if dtype not in ("float32", "bfloat16", "int8", "int16"):
        raise UnsupportedDTypeError(
            f"conv2d: dtype {dtype!r} unsupported; float32, bfloat16 (data padded to bf16 "
            "by conv_input_schedule), int8 (u8 data x s8 filter) or int16 (both widened)")
    check_low_precision(isa, dtype, "conv2d")
    tiles = tile_conv_plan(shape, dtype, isa)
    plan = conv_plan(shape, isa, dtype)
    isa = register_tile_isa(isa)
    prec = plan.precision
    source = None if plan.a_prepadded else strided_pointwise(shape)
    if source is not None:  # computed on the gathered pixels' image
        shape, source = source, shape
    inputs, out, stages = conv_te(shape, plan, epilogue, source)
    func = te.create_prim_func([*inputs, out])
    if tiles is not None:
        func = func.with_attr(TILE_CONFIG_ATTR, [plan.mr, plan.nr])
    # The rows sharing a filter panel (or K chunk) prefetch the next one (intrinsics.prefetch).
    sch = s_tir.Schedule(func.with_attr(PREFETCH_ATTR, FILTER))
    blk = sch.get_sblock("C")
    loops = sch.get_loops(blk)
    spatial = 4 + (shape.groups > 1)  # n, oh, [group,] ow, channel
    (n, y, *go, x, o), red = loops[:spatial], loops[spatial:]
    xo, xi = sch.split(x, [None, plan.mr])
    oo, oi = sch.split(o, [None, plan.nr])
    cc = padded_channels(shape.cg, plan)
    elem = 4 // prec.vnni  # bytes per element
    b_dtype = prec.b if prec.b != prec.a else None
    tile = TPPSpec("conv_brgemm", prec.a, b_dtype=b_dtype, m=plan.mr, n=plan.nr,
                   k=shape.s * cc, beta=0, batch=shape.r, stride=shape.stride * cc)
    kc = None if tiles else conv_k_block(shape.r, shape.s * cc, plan.nr, elem, prec.vnni,
                                         row_tiles=shape.n * shape.oh * (plan.mp // plan.mr))
    if kc is not None:
        # the innermost reduction is the VNNI pack for int8: block the group axis above it
        *rs, k, kv = red if prec.vnni > 1 else (*red, None)
        ko, ki = sch.split(k, [None, kc // prec.vnni])
        sch.reorder(*go, oo, *rs, ko, n, y, xo, xi, oi, ki, *([kv] if kv is not None else []))
        panels = sch.fuse(*go, oo) if go else oo
        sch.parallel(panels)
        schedule_image_pad(sch, cc)
        epilogue_blocks = fuse_epilogue(sch, panels, plan.mr, plan.nr, stages)
        init = sch.decompose_reduction(blk, rs[0] if rs else ko)
        tensorize_rows(sch, init, TPPSpec("zero", prec.acc, m=plan.mr, n=plan.nr), isa,
                       "C panel init")
        if not try_tensorize(sch, xi, replace(tile, k=kc, beta=1, batch=1), isa,
                             "conv tile"):
            raise RuntimeError("K-blocked conv microkernel did not tensorize")  # a bug
        tensorize_epilogue(sch, epilogue_blocks, isa)
        return sch, plan
    # Per group: its panels outer or its image outer (groups outermost either way).
    if weights_outer(shape.n * shape.h * shape.w * cc * elem // 4,
                     shape.r * shape.s * cc * plan.np_ * elem // 4):
        sch.reorder(*go, oo, n, y, xo, xi, oi, *red)
        tile_loop = sch.fuse(*go, oo, n, y, xo)
    else:
        sch.reorder(n, *go, y, xo, oo, xi, oi, *red)
        tile_loop = sch.fuse(n, *go, y, xo, oo)
    if tiles is None:
        sch.parallel(tile_loop)
    schedule_image_pad(sch, cc)
    epilogue_blocks = fuse_epilogue(sch, tile_loop, plan.mr, plan.nr, stages)
    if not try_tensorize(sch, xi, tile, "amx" if tiles else isa, "conv tile"):
        raise RuntimeError("conv microkernel did not tensorize")  # a bug, not user input
    tensorize_epilogue(sch, epilogue_blocks, isa)
    if tiles is not None:  # after tensorizing: a split fused loop blocks blockize
        blocks = shape.n * shape.groups * shape.oh * (plan.mp // plan.mr) * (plan.np_ // plan.nr)
        split_tasks(sch, tile_loop, blocks, threads)
    return sch, plan


def conv_k_block(r: int, sc: int, nr: int, elem: int = 4, vnni: int = 1,
                 row_tiles: int | None = None) -> int | None:
    """Reduction block (a divisor of S*C, whole VNNI groups) when a filter panel
    (R x S*C x nr elements of ``elem`` bytes) outgrows L2: the panel is then reduced one
    filter row and ``kc`` elements at a time over all output pixels. None when it fits,
    or when one row tile reads it (``row_tiles`` 1: a classifier head's 1x1 convolution
    over a 1x1 map streams its filter once, as a GEMV its panel, see
    :func:`~.gemm_plan.k_block`)."""
    if row_tiles == 1 or elem * r * sc * nr <= PANEL_BYTES:
        return None
    best = None
    for kc in range(64, sc + 1):
        if sc % kc == 0 and kc % vnni == 0 and elem * kc * nr <= PANEL_BLOCK_BYTES:
            best = kc
    return best


def pack_filter(w_oihw: np.ndarray, nr: int, vnni: int = 1, groups: int = 1) -> np.ndarray:
    """OIHW filter → zero-padded (ceil(O/nr), H, W*Ip, nr) panels for the conv TPP, or with
    ``vnni`` > 1 (int8: 4) the VNNI panels (ceil(O/nr), H, W*Ip/vnni, nr, vnni); Ip is I
    rounded up to a multiple of ``vnni`` (the padded channels' weights are zero). Grouped
    (I = channels per group): the groups' panels stacked, ``(groups, ...)``."""
    if groups > 1:
        og = w_oihw.shape[0] // groups
        return np.stack([pack_filter(w_oihw[g * og:(g + 1) * og], nr, vnni)
                         for g in range(groups)])
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
