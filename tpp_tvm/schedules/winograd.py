"""3x3 stride-1 convolution by Winograd's minimal filtering F(2x2, 3x3), on the GEMM TPP.

A direct 3x3 convolution spends 9 multiply-adds per output pixel, input channel and output
channel; F(2x2, 3x3) computes a 2x2 output tile from a 4x4 input tile with 16, a 2.25x
cut in the work that dominates ResNet's and RegNet's 3x3 layers (both already run at
90% of the FMA peak directly, so only less work makes them faster). Per 4x4 input tile d
and 3x3 filter g (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks"):

    Y = Aᵀ [ (G g Gᵀ) ⊙ (Bᵀ d B) ] A

``G g Gᵀ`` (16 values per filter) is computed when the filter is packed, so the kernel
does three things per block of ``mr`` tiles of one tile row and one ``nr``-channel panel:
the input transform ``V = Bᵀ d B`` (adds only, channels as vector lanes), sixteen
``mr x nr x C`` GEMM TPP tiles (one per tile position, the transformed filter as packed
panels), and the output transform ``Aᵀ M A`` with the bias, activation and residual
applied as the 2x2 outputs are written. All three stay in L1/L2 per block; the input
transform is recomputed for each output panel (a few percent of the GEMM work) so no
transformed image goes through memory. Transforms with F(2, 3)'s small constants keep
fp32 rounding close to the direct convolution's (1e-6 relative on unit-scale data).
"""

from __future__ import annotations

import numpy as np
from tvm import s_tir, te, tirx

from ..errors import UnsupportedShapeError
from ..intrinsics import TPPSpec
from ..intrinsics.epilogue import Epilogue
from ..intrinsics.spec import OPERAND_STEPS, equation_expr, equation_operands
from ..target import host_isa
from .conv import FILTER, ConvShape
from .gemm_plan import GemmPlan, core_table, register_tile_isa, vector_unit, weights_outer
from .tensorize import schedule_pads, try_tensorize

#: Bᵀ, G and Aᵀ of F(2x2, 3x3).
INPUT_TRANSFORM = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
FILTER_TRANSFORM = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
OUTPUT_TRANSFORM = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])

#: Fewest accumulator vectors a register tile may hold: the FMA pipes need a dozen
#: independent ones (7x7 outputs, 256 channels: 4x32 tiles ran at 0.94x the direct conv).
MIN_TILE_VECTORS = 12
#: ... except on ISAs whose register file holds fewer: AVX2's 16 registers fit at most 12
#: accumulators, and its 8-accumulator tiles sustain 0.93-0.94 of the FMA peak (Zen 3,
#: AVX2_TILES). Allowing them there keeps tile rows and panels unpadded: ResNet's 14x14x256
#: layer 2.64 -> 1.92 ms (4x16 instead of 6x16 over 7 tiles), 28x28x128 1.88 -> 1.64 ms.
MIN_TILE_VECTORS_BY_ISA = {"avx2": 8}

#: Fewest blocks of tiles that run in parallel when blocks are the outer loop (else the
#: panels are parallel too: ResNet's 14x14 layer has 7 blocks for 2 threads).
MIN_PARALLEL_BLOCKS = 16

#: Activations the output transform applies (piecewise-linear ones LLVM vectorizes as is;
#: CSPDarknet-53 at 1 thread, AMX Xeon: 96.7 ms with its LeakyReLU a pass of its own after
#: Winograd, 101.6 fused into direct convolutions, 89.4 fused into Winograd).
WINOGRAD_ACTIVATIONS = (None, "relu", "relu6", "leaky_relu")


def winograd_applies(shape: ConvShape, epilogue: Epilogue = Epilogue(),
                     dtype: str = "float32", isa: str = "avx512") -> bool:
    """Whether F(2x2, 3x3) takes this convolution: 3x3, stride 1, fp32, channels per group
    whole vectors, an output of at least 4x4 (smaller ones are mostly tile padding), a
    transformed filter panel that fits in half the L2 (:func:`plan_winograd`), and an
    epilogue the output transform applies (bias, ReLU or ReLU6, an fp32 residual; fp32
    out)."""
    return (shape.r == 3 and shape.s == 3 and shape.stride == 1 and dtype == "float32"
            and shape.cg % _lanes(isa) == 0 and shape.oh >= 4 and shape.ow >= 4
            and _takes(epilogue) and plan_winograd(shape, isa) is not None)


def _takes(epilogue: Epilogue) -> bool:
    return (epilogue.activation in WINOGRAD_ACTIVATIONS
            and epilogue.post_activation in WINOGRAD_ACTIVATIONS and not epilogue.gate
            and not epilogue.quantized_residual and epilogue.out_dtype == "float32")


def _lanes(isa: str) -> int:
    return vector_unit(isa).static_lanes("float32")


def plan_winograd(shape: ConvShape, isa: str = "avx512") -> GemmPlan | None:
    """The GEMM of one tile position: rows are the tiles of a tile row, K the input
    channels of a group, N its output channels; None when no panel fits.

    Each block of tiles reads the 16 positions' filter panels (16 x K x nr), so a panel
    should stay in half the L2 (ResNet's 14x14x256 layer: 4x64 tiles with 1 MiB panels ran
    1.32x the direct convolution on a 1 MiB-L2 Zen 5, 7x32 with 512 KiB 1.86x). Where none
    does, a panel's whole image is one block (:func:`whole_image`): then each position's
    K x nr part must fit an eighth of the L2 and the image's 16 products half of it. A tile
    row shorter than a register tile's rows takes a tile of that many rows (7 tiles of a
    14-wide output: 7x32), so the tile row is not padded, if it keeps enough accumulators
    (:data:`MIN_TILE_VECTORS`, per ISA). Tiles and lanes are ``isa``'s."""
    tw, th = -(-shape.ow // 2), -(-shape.oh // 2)
    budget = (host_isa().l2_bytes or 1024 * 1024) // 2
    best: dict[bool, tuple[float, GemmPlan]] = {}
    lanes = _lanes(isa)
    min_vectors = MIN_TILE_VECTORS_BY_ISA.get(register_tile_isa(isa), MIN_TILE_VECTORS)
    for (mr, nr), efficiency in core_table(isa).tile_efficiency.items():
        rows = min(mr, tw)
        if rows * nr < min_vectors * lanes:
            continue
        plan = GemmPlan(tw, shape.og, shape.cg, rows, nr, "float32")
        image = whole_image(shape, plan)
        if image and (shape.cg * nr * 4 > budget // 4 or 16 * th * plan.mp * nr * 4 > budget):
            continue
        # a shortened tile is costed as if padded: measured slower than a whole tile
        # (RegNet's 14x14 groups of 64: 7x32 0.43 ms against 4x64's 0.36, in the model)
        cost = plan.mp * plan.np_ * mr / rows / efficiency
        if image not in best or cost < best[image][0]:
            best[image] = (cost, plan)
    chosen = best.get(False) or best.get(True)
    return None if chosen is None else chosen[1]


def whole_image(shape: ConvShape, plan: GemmPlan) -> bool:
    """Whether one block holds all tiles of the image (per filter panel): when the 16
    positions' panels do not fit in half the L2, each position's part is then read once
    per panel and used by every tile before the next position's (ResNet's 7x7x512 layer:
    a 2 MiB panel per block would stream from L3)."""
    budget = (host_isa().l2_bytes or 1024 * 1024) // 2
    return 16 * shape.cg * plan.nr * 4 > budget


def pack_winograd_filter(w_oihw: np.ndarray, nr: int, groups: int = 1) -> np.ndarray:
    """OIHW 3x3 filter → transformed panels ``(4, 4, ceil(O / nr), I, nr)`` (``G g Gᵀ`` per
    output and input channel, output channels zero-padded to panels); grouped (I = channels
    per group), the groups' panels stacked, ``(groups, 4, 4, ceil(Og / nr), I, nr)``."""
    o, i, _, _ = w_oihw.shape
    og = o // groups
    ogp = -(-og // nr) * nr
    u = np.einsum("ar,oirs,bs->oiab", FILTER_TRANSFORM, w_oihw.astype(np.float64),
                  FILTER_TRANSFORM)
    u = u.reshape(groups, og, i, 4, 4)
    u = np.pad(u, ((0, 0), (0, ogp - og), (0, 0), (0, 0), (0, 0)))
    # (g, ogp/nr, nr, i, a, b) -> (g, a, b, ogp/nr, i, nr)
    u = u.reshape(groups, ogp // nr, nr, i, 4, 4).transpose(0, 4, 5, 1, 3, 2)
    return np.ascontiguousarray(u if groups > 1 else u[0], dtype="float32")


def _combination(coefs: np.ndarray, terms: list) -> tirx.PrimExpr:
    """sum(c * t) for the non-zero constant coefficients, with ±1 as adds and subtracts."""
    out = None
    for c, t in zip(coefs.flat, terms):
        if c == 0:
            continue
        v = t if abs(c) == 1 else t * tirx.const(float(abs(c)), "float32")
        if out is None:
            out = v if c > 0 else tirx.const(0.0, "float32") - v
        else:
            out = out + v if c > 0 else out - v
    return out


def _pick(index: tirx.PrimExpr, values: list) -> tirx.PrimExpr:
    """values[index] for a loop index the schedule unrolls (the selects then fold)."""
    out = values[-1]
    for k in range(len(values) - 2, -1, -1):
        out = tirx.Select(index == k, values[k], out)
    return out


def filters_stay(shape: ConvShape, plan: GemmPlan) -> bool:
    """Whether a group's transformed filter (all its panels) fits in half the L2, so blocks
    of tiles can be outer and pass over every panel with one input transform."""
    budget = (host_isa().l2_bytes or 1024 * 1024) // 2
    return 16 * shape.cg * plan.np_ * 4 <= budget


def winograd_te(shape: ConvShape, plan: GemmPlan, epilogue: Epilogue = Epilogue()
                ) -> tuple[list[te.Tensor], te.Tensor]:
    """TE stages; inputs: data (n, h, w*c), transformed filter, [bias], [residual]; output
    NHWC (n, oh, ow, oc), grouped (n, oh, ow, groups, og) like ``conv_te``."""
    sh, nr = shape, plan.nr
    G, cg, og = sh.groups, sh.cg, sh.og
    th, twp, ocp = -(-sh.oh // 2), plan.mp, plan.np_
    X = te.placeholder((sh.n, sh.h, sh.w * sh.c), "float32", name="data")
    gdim = (G,) if G > 1 else ()
    U = te.placeholder((*gdim, 4, 4, ocp // nr, cg, nr), "float32", name=FILTER)
    hp, wp = 2 * th + 2, 2 * twp + 2
    top, left = sh.pad[0], sh.pad[1]

    def padded(n, *ix):
        g, y, z = ix if G > 1 else (0, *ix)
        iy, ix_, ch = y - top, z // cg - left, z % cg
        inside = tirx.all(iy >= 0, iy < sh.h, ix_ >= 0, ix_ < sh.w)
        src = tirx.max(tirx.min(iy, sh.h - 1), 0), tirx.max(tirx.min(ix_, sh.w - 1), 0)
        return tirx.if_then_else(inside, X[n, src[0], src[1] * sh.c + g * cg + ch],
                                 tirx.const(0.0, "float32"))

    Xp = te.compute((sh.n, *gdim, hp, wp * cg), padded, name="A_pad")

    def xp(n, g, y, z):
        return Xp[(n, g, y, z) if G > 1 else (n, y, z)]

    def input_tile(n, *ix):
        g, ty, a, b, tx, c = ix if G > 1 else (0, *ix)
        d = [[xp(n, g, 2 * ty + i, (2 * tx + j) * cg + c) for j in range(4)] for i in range(4)]
        rows = [[_combination(INPUT_TRANSFORM[a_][:, None] * INPUT_TRANSFORM[b_][None, :],
                              [d[i][j] for i in range(4) for j in range(4)])
                 for b_ in range(4)] for a_ in range(4)]
        return _pick(a, [_pick(b, row) for row in rows])

    V = te.compute((sh.n, *gdim, th, 4, 4, twp, cg), input_tile, name="V")
    k = te.reduce_axis((0, cg), name="k")

    def product(n, *ix):
        g, ty, a, b, tx, o = ix if G > 1 else (0, *ix)
        v = V[(n, g, ty, a, b, tx, k) if G > 1 else (n, ty, a, b, tx, k)]
        u = U[(g, a, b, o // nr, k, o % nr) if G > 1 else (a, b, o // nr, k, o % nr)]
        return te.sum(v * u, axis=k)

    M = te.compute((sh.n, *gdim, th, 4, 4, twp, ocp), product, name="M")
    if not _takes(epilogue):
        raise UnsupportedShapeError(
            f"Winograd conv2d: epilogue {epilogue.suffix} writing {epilogue.out_dtype}; bias, "
            "ReLU or ReLU6 and an fp32 residual, written as float32")
    steps = epilogue.steps
    valid = (sh.n, sh.oh, sh.ow, *gdim, og)
    bias_t = te.placeholder((*gdim, ocp), "float32", name="bias_packed") \
        if epilogue.bias else None
    res_t = te.placeholder(valid, "float32", name="residual") if epilogue.residual else None
    operands = [t for t in (bias_t, res_t) if t is not None]
    kinds = equation_operands(steps)

    def output(n, y, x, *go):
        g, o = go if G > 1 else (0, *go)
        m = [[M[(n, g, y // 2, a, b, x // 2, o) if G > 1 else (n, y // 2, a, b, x // 2, o)]
              for b in range(4)] for a in range(4)]
        flat = [m[a][b] for a in range(4) for b in range(4)]
        ys = [[_combination(OUTPUT_TRANSFORM[p][:, None] * OUTPUT_TRANSFORM[q][None, :], flat)
               for q in range(2)] for p in range(2)]
        value = _pick(y % 2, [_pick(x % 2, row) for row in ys])
        ix = (n, y, x, *go)
        return equation_expr(steps, value, [
            p[ix[-len(p.shape):]] if OPERAND_STEPS[kd].row else p[ix]
            for p, kd in zip(operands, kinds)])

    out = te.compute(valid, output, name="out")
    return [X, U, *operands], out


def winograd_schedule(shape: ConvShape, isa: str, *, epilogue: Epilogue = Epilogue()
                      ) -> tuple[s_tir.Schedule, GemmPlan]:
    """The scheduled F(2x2, 3x3) convolution and its GEMM blocking (``plan.nr`` packs the
    filter: :func:`pack_winograd_filter`)."""
    isa = register_tile_isa(isa)
    plan = plan_winograd(shape, isa)
    lanes = _lanes(isa)
    if plan is None:
        raise UnsupportedShapeError(
            f"Winograd conv2d: no filter panel of {shape.cg} channels fits half the L2")
    inputs, out = winograd_te(shape, plan, epilogue)
    sch = s_tir.Schedule(te.create_prim_func([*inputs, out]))
    # The output's loops lead: per block of mr tiles of a tile row and one nr-channel
    # panel, the input transform, the 16 GEMM tiles and the output transform run in turn.
    ob = sch.get_sblock("out")
    n, y, x, *go, o = sch.get_loops(ob)
    ty, dy = sch.split(y, [None, 2])
    tx, dx = sch.split(x, [None, 2])
    txo, txi = sch.split(tx, [None, plan.mr])
    oo, oi = sch.split(o, [None, plan.nr])
    oi, ov = sch.split(oi, [None, lanes])
    blocks = shape.n * shape.groups * -(-shape.oh // 2) * (plan.mp // plan.mr)
    if filters_stay(shape, plan) and blocks >= MIN_PARALLEL_BLOCKS:
        # One input transform per block, shared by all of the group's panels.
        sch.reorder(n, *go, ty, txo, oo, txi, oi, dy, dx, ov)
        block_loop = sch.fuse(n, *go, ty, txo)
        panel_loop = oo
    else:
        # Panels outer, each passing over all blocks: the input is transformed once, in a
        # pass of its own before them (per block and panel it cost ResNet's 14x14x256
        # layer, 8 panels, 16% of its GEMM work).
        if whole_image(shape, plan):
            outer, inner = [*go, oo, n], [ty, txo]
        elif weights_outer(shape.n * shape.h * shape.w * shape.cg, 16 * shape.cg * plan.np_):
            outer, inner = [*go, oo, n, ty, txo], []
        else:
            outer, inner = [n, *go, ty, txo, oo], []
        sch.reorder(*outer, *inner, txi, oi, dy, dx, ov)
        block_loop = panel_loop = sch.fuse(*outer)
    sch.parallel(block_loop)
    sch.unroll(dy)
    sch.unroll(dx)
    sch.vectorize(ov)
    m = sch.get_sblock("M")
    sch.compute_at(m, panel_loop)
    v = sch.get_sblock("V")
    if panel_loop != block_loop:
        sch.compute_at(v, block_loop)
    schedule_pads(sch, ("A_pad",))
    # Input transform: per tile and vector of channels, the 16 values of one 4x4 patch
    # (a, b unrolled: the selects fold and the 16 loads are shared).
    *vouter, va, vb, vtx, vc = sch.get_loops(v)
    vco, vci = sch.split(vc, [None, lanes])
    sch.reorder(vtx, vco, va, vb, vci)
    sch.unroll(va)
    sch.unroll(vb)
    sch.vectorize(vci)
    if panel_loop == block_loop:
        sch.parallel(sch.fuse(*vouter))  # (n, [group,] tile row)
    if whole_image(shape, plan):
        # position by position over all tiles: each position's filter part is read once
        *_, mty, ma, mb, mtx, mo, mk = sch.get_loops(m)
        mtxo, mtx = sch.split(mtx, [None, plan.mr])
        sch.reorder(ma, mb, mty, mtxo, mtx)
    else:
        *_, ma, mb, mtx, mo, mk = sch.get_loops(m)
    gemm = TPPSpec("gemm", "float32", m=plan.mr, n=plan.nr, k=shape.cg, beta=0)
    if not try_tensorize(sch, mtx, gemm, isa, "winograd tile"):
        raise RuntimeError("Winograd GEMM tile did not tensorize")  # a bug, not user input
    return sch, plan
