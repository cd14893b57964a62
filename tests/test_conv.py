"""Convolution kernels (BRGEMM over filter taps) against numpy: fp32, bf16 (on the
AVX512_BF16 dot product and on AMX tiles) and int8 (u8 data x s8 filter, dequantized in the
epilogue) with channel padding to VNNI groups, zero-point padding, strides, K-blocked panels
and fused bias + activation."""

from __future__ import annotations

from dataclasses import replace

import checks
import numpy as np
import pytest
import tvm

from tpp_tvm.errors import UnsupportedDTypeError
from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.schedules.conv import (
    ConvShape,
    conv_k_block,
    conv_schedule,
    pack_filter,
    strided_pointwise,
    tile_filter_width,
)
from tpp_tvm.target import target
from tpp_tvm.tir_pipeline import compile_kernels


def _conv_ref(x: np.ndarray, w_oihw: np.ndarray, sh: ConvShape, fill: float) -> np.ndarray:
    """NHWC output of an NHWC x OIHW convolution in float64, padding with ``fill``."""
    top, left, bottom, right = sh.pad
    xp = np.pad(x.astype(np.float64), ((0, 0), (top, bottom), (left, right), (0, 0)),
                constant_values=fill)
    out = np.zeros((sh.n, sh.oh, sh.ow, sh.oc))
    for r in range(sh.r):
        for s in range(sh.s):
            win = xp[:, r:r + (sh.oh - 1) * sh.stride + 1:sh.stride,
                     s:s + (sh.ow - 1) * sh.stride + 1:sh.stride, :]
            out += np.einsum("nhwc,oc->nhwo", win, w_oihw[:, :, r, s].astype(np.float64))
    return out


def _run(sch, args: list[np.ndarray], out_shape: tuple[int, ...]) -> np.ndarray:
    lib = compile_kernels(sch.mod, target(num_cores=2))
    dev = tvm.cpu()
    tensors = [tvm.runtime.tensor(a, dev) for a in args]
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"), dev)
    lib["main"](*tensors, out)
    return out.numpy()


@pytest.mark.parametrize("sh", [
    ConvShape(1, 9, 9, 8, 24, 3, 3, 1, (1, 1, 1, 1)),
    ConvShape(1, 11, 10, 3, 16, 7, 7, 2, (3, 3, 3, 3)),  # a stem: 3 channels, stride 2
    ConvShape(2, 8, 8, 16, 40, 1, 1, 2),  # strided pointwise (a downsampling shortcut)
    ConvShape(1, 7, 11, 16, 24, 1, 1, 3),  # stride 3 on odd sizes: the last pixels unread
])
def test_fp32_conv_matches_numpy(sh: ConvShape) -> None:
    rng = np.random.default_rng(sh.c)
    x = rng.standard_normal((sh.n, sh.h, sh.w, sh.c)).astype("float32")
    w = rng.standard_normal((sh.oc, sh.cg, sh.r, sh.s)).astype("float32")
    bias = rng.standard_normal(sh.oc).astype("float32")
    sch, plan = conv_schedule(sh, checks.VECTOR_ISA,
                              epilogue=Epilogue(bias=True, activation="relu"))
    args = [x.reshape(sh.n, sh.h, -1), pack_filter(w, plan.nr),
            np.pad(bias, (0, plan.np_ - sh.oc))]
    got = _run(sch, args, (sh.n, sh.oh, sh.ow, sh.oc))
    want = np.maximum(_conv_ref(x, w, sh, 0.0) + bias, 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("sh", "blocked"), [
    (ConvShape(1, 9, 7, 24, 30, 3, 3, 1, (1, 1, 1, 1), 3), False),   # 10 outputs a group
    (ConvShape(2, 13, 11, 128, 128, 3, 3, 2, (1, 1, 1, 1), 2), False),  # RegNet-like
    (ConvShape(1, 1, 21, 96, 96, 1, 64, 1, (0, 32, 0, 31), 2), True),  # wav2vec2 positional
])
def test_grouped_conv_matches_numpy(sh: ConvShape, blocked: bool) -> None:
    """Each group's channels read in place, a bias row per group, the output NHWC as
    (n, oh, ow, group, channel); the long filter row is K-blocked like an ungrouped one."""
    from tpp_tvm.schedules.conv import conv_k_block, padded_channels, plan_conv

    rng = np.random.default_rng(sh.oc)
    x = rng.standard_normal((sh.n, sh.h, sh.w, sh.c)).astype("float32")
    w = (rng.standard_normal((sh.oc, sh.cg, sh.r, sh.s)) * 0.2).astype("float32")
    bias = rng.standard_normal(sh.oc).astype("float32")
    res = rng.standard_normal((sh.n, sh.oh, sh.ow, sh.groups, sh.og)).astype("float32")
    plan = plan_conv(sh)
    kc = conv_k_block(sh.r, sh.s * padded_channels(sh.cg, plan), plan.nr)
    assert (kc is not None) == blocked
    sch, plan = conv_schedule(sh, checks.VECTOR_ISA,
                              epilogue=Epilogue(bias=True, activation="relu", residual=True))
    bias_rows = np.pad(bias.reshape(sh.groups, sh.og), ((0, 0), (0, plan.np_ - sh.og)))
    args = [x.reshape(sh.n, sh.h, -1), pack_filter(w, plan.nr, groups=sh.groups), bias_rows,
            res]
    got = _run(sch, args, res.shape).reshape(sh.n, sh.oh, sh.ow, sh.oc)
    one = replace(sh, c=sh.cg, oc=sh.og, groups=1)
    want = np.concatenate([_conv_ref(x[..., g * sh.cg:(g + 1) * sh.cg],
                                     w[g * sh.og:(g + 1) * sh.og], one, 0.0)
                           for g in range(sh.groups)], axis=-1)
    want = np.maximum(want + bias, 0) + res.reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _int8_conv_operands(sh: ConvShape, seed: int) -> tuple[np.ndarray, ...]:
    """Seeded u8 NHWC input, s8 OIHW filter (channels per group), per-channel scale and
    bias, and the filter's per-channel sums."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (sh.n, sh.h, sh.w, sh.c)).astype(np.uint8)
    w = rng.integers(-128, 128, (sh.oc, sh.cg, sh.r, sh.s)).astype(np.int8)
    scale = rng.uniform(0.5, 1.5, sh.oc).astype("float32") * 1e-3
    bias = rng.standard_normal(sh.oc).astype("float32")
    return x, w, scale, bias, w.astype(np.int64).sum(axis=(1, 2, 3))


@pytest.mark.requires_avx512_vnni
@pytest.mark.parametrize(("sh", "blocked"), [
    (ConvShape(1, 9, 9, 8, 24, 3, 3, 1, (1, 1, 1, 1)), False),
    (ConvShape(1, 11, 10, 3, 16, 7, 7, 2, (3, 3, 3, 3)), False),  # channels padded 3 -> 4
    (ConvShape(2, 8, 8, 16, 40, 1, 1, 2), False),
    (ConvShape(1, 9, 7, 16, 40, 1, 1, 2), False),  # odd sizes: the last row and pixel unread
    (ConvShape(1, 5, 5, 512, 64, 3, 3, 1, (1, 1, 1, 1)), True),  # panel outgrows L2
])
def test_int8_conv_matches_numpy(sh: ConvShape, blocked: bool) -> None:
    """``(x - z) * w`` with x padded by its zero point z: exact in int32, then dequantized
    per output channel with bias and ReLU in the epilogue."""
    assert (conv_k_block(sh.r, sh.s * -(-sh.c // 4) * 4, 64, 1, 4) is not None) == blocked
    x, w, scale, bias, colsum = _int8_conv_operands(sh, sh.oc)
    z = 7
    sch, plan = conv_schedule(sh, "avx512", dtype="int8",
                              epilogue=Epilogue(bias=True, activation="relu"))
    assert "tpp.conv_brgemm.u8i8" in str(sch.trace)
    pad = plan.np_ - sh.oc
    args = [x.reshape(sh.n, sh.h, -1), pack_filter(w, plan.nr, vnni=4),
            np.array([z], np.uint8), np.pad(scale, (0, pad)),
            np.pad(-z * colsum * scale, (0, pad)).astype("float32"), np.pad(bias, (0, pad))]
    got = _run(sch, args, (sh.n, sh.oh, sh.ow, sh.oc))
    exact = _conv_ref(x.astype(np.int64) - z, w, sh, 0.0)  # padding x with z: (x - z) = 0
    want = np.maximum(exact * scale + bias, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_conv_rejects_other_dtypes() -> None:
    with pytest.raises(UnsupportedDTypeError, match="float16"):
        conv_schedule(ConvShape(1, 8, 8, 8, 16, 3, 3), "avx512", dtype="float16")


def _bf16_conv(sh: ConvShape, tgt, seed: int = 0) -> tuple[np.ndarray, np.ndarray, bool]:
    """(kernel output, float64 reference on bf16-rounded operands, on tiles) of a bf16
    convolution with bias and ReLU: the input padded to bf16 by ``conv_input_schedule``,
    then the conv kernel, both compiled for ``tgt``."""
    import ml_dtypes

    from tpp_tvm.intrinsics import amx_emulator
    from tpp_tvm.schedules.conv import conv_input_schedule, padded_input_shape
    from tpp_tvm.target import isa_of, tiles_emulated

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((sh.n, sh.h, sh.w, sh.c)).astype("float32")
    w = rng.standard_normal((sh.oc, sh.cg, sh.r, sh.s)).astype("float32")
    bias = rng.standard_normal(sh.oc).astype("float32")
    sch, plan = conv_schedule(sh, isa_of(tgt), dtype="bfloat16", threads=2,
                              epilogue=Epilogue(bias=True, activation="relu"))
    dev = tvm.cpu()
    pad = compile_kernels(conv_input_schedule(sh, plan).mod, tgt)
    conv = compile_kernels(sch.mod, tgt)
    xin = tvm.runtime.tensor(x.reshape(sh.n, sh.h, -1), dev)
    hp, wp, cc = padded_input_shape(sh, plan)
    groups = (sh.groups,) if sh.groups > 1 else ()
    xp = tvm.runtime.empty((sh.n, *groups, hp, wp * cc), "bfloat16", dev)
    pad["main"](xin, xp)
    packed = pack_filter(w.astype(ml_dtypes.bfloat16), plan.nr, vnni=2, groups=sh.groups)
    row = np.pad(bias.reshape(sh.groups, sh.og), ((0, 0), (0, plan.np_ - sh.og)))
    args = [xp, tvm.runtime.tensor(packed, dev),
            tvm.runtime.tensor(row if groups else row[0], dev)]
    out_shape = (sh.n, sh.oh, sh.ow, *((sh.groups, sh.og) if groups else (sh.oc,)))
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"), dev)
    conv["main"](*args, out)
    if tiles_emulated(tgt):
        amx_emulator.check("bf16 conv")
    xr, wr = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, w))
    one = replace(sh, c=sh.cg, oc=sh.og, groups=1)
    want = np.concatenate([_conv_ref(xr[..., g * sh.cg:(g + 1) * sh.cg],
                                     wr[g * sh.og:(g + 1) * sh.og], one, 0.0)
                           for g in range(sh.groups)], axis=-1)
    want = np.maximum(want + bias, 0)
    return out.numpy().reshape(want.shape), want, plan.amx


def _shape_id(sh: ConvShape) -> str:
    return f"{sh.c}x{sh.r}x{sh.s}s{sh.stride}g{sh.groups}"


BF16_SHAPES = [
    ConvShape(1, 12, 12, 64, 64, 3, 3, pad=(1, 1, 1, 1)),  # tile steps: 3 x 64 channels
    ConvShape(2, 17, 15, 32, 48, 3, 3, stride=2, pad=(1, 0, 1, 2)),  # strided, ragged
    ConvShape(1, 20, 20, 3, 32, 7, 7, stride=2, pad=(3, 3, 3, 3)),  # a stem: 3 channels
    ConvShape(1, 9, 40, 16, 16, 1, 4, stride=2),  # 1 x 4 filter, 16 channels, K 64
    ConvShape(1, 10, 10, 24, 48, 3, 3, pad=(1, 1, 1, 1), groups=3),  # RegNet's 8-wide groups
    ConvShape(1, 10, 10, 64, 64, 3, 3, pad=(1, 1, 1, 1), groups=2),  # 32 a group: tile steps
]


@pytest.mark.requires_avx512_bf16
@pytest.mark.parametrize("sh", BF16_SHAPES, ids=_shape_id)
def test_bf16_conv_matches_numpy(sh: ConvShape) -> None:
    got, want, _ = _bf16_conv(sh, target("avx512", num_cores=2))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("sh", BF16_SHAPES, ids=_shape_id)
def test_bf16_conv_on_tiles_matches_numpy(sh: ConvShape) -> None:
    """On AMX (the tile model where the host has none): filter rows of whole tile steps
    (S x channels of a group a multiple of 32, grouped too) on tiles, the stem and narrow
    groups on the AVX-512 dot product."""
    import tpp_harness as h

    got, want, on_tiles = _bf16_conv(sh, h.tile_target(2))
    assert on_tiles == (sh.s * sh.cg % 32 == 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _int8_grouped_conv(sh: ConvShape, tgt) -> tuple[np.ndarray, np.ndarray, bool]:
    """(kernel output, exact reference, on tiles) of a grouped u8 x s8 convolution padded
    by its zero point, dequantized per (group, channel) row, with bias and ReLU."""
    from tpp_tvm.intrinsics import amx_emulator
    from tpp_tvm.target import isa_of, tiles_emulated

    x, w, scale, bias, colsum = _int8_conv_operands(sh, sh.groups)
    z = 9
    sch, plan = conv_schedule(sh, isa_of(tgt), dtype="int8", threads=2,
                              epilogue=Epilogue(bias=True, activation="relu"))

    def rows(v: np.ndarray) -> np.ndarray:
        return np.pad(v.reshape(sh.groups, sh.og), ((0, 0), (0, plan.np_ - sh.og))
                      ).astype("float32")

    args = [x.reshape(sh.n, sh.h, -1), pack_filter(w, plan.nr, vnni=4, groups=sh.groups),
            np.array([z], np.uint8), rows(scale), rows(-z * colsum * scale), rows(bias)]
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((sh.n, sh.oh, sh.ow, sh.groups, sh.og), "float32"), dev)
    compile_kernels(sch.mod, tgt)["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    if tiles_emulated(tgt):
        amx_emulator.check("int8 grouped conv")
    one = replace(sh, c=sh.cg, oc=sh.og, groups=1)
    xz = x.astype(np.int64) - z  # padding x with z: (x - z) = 0
    exact = np.concatenate([_conv_ref(xz[..., g * sh.cg:(g + 1) * sh.cg],
                                      w[g * sh.og:(g + 1) * sh.og], one, 0.0)
                            for g in range(sh.groups)], axis=-1)
    want = np.maximum(exact * scale + bias, 0)
    return out.numpy().reshape(want.shape), want, plan.amx


INT8_GROUPED_SHAPES = [
    ConvShape(1, 10, 10, 128, 128, 3, 3, 1, (1, 1, 1, 1), groups=2),  # RegNet: 64 a group
    ConvShape(1, 9, 11, 48, 96, 3, 3, 2, (1, 1, 1, 1), groups=3),  # 16 in, 32 out a group
    ConvShape(1, 7, 7, 64, 64, 3, 3, 1, (1, 1, 1, 1), groups=8),  # 8 channels a group
]


@pytest.mark.requires_avx512_vnni
@pytest.mark.parametrize("sh", INT8_GROUPED_SHAPES)
def test_int8_grouped_conv_matches_numpy(sh: ConvShape) -> None:
    """Grouped int8 convolutions (RegNet's, quantized) on the VNNI conv BRGEMM: each
    group's image padded with the zero point and its filter panels, a dequantize row per
    group; exact in int32."""
    got, want, _ = _int8_grouped_conv(sh, target("avx512", num_cores=2))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("sh", INT8_GROUPED_SHAPES[:1])
def test_int8_grouped_conv_on_tiles_matches_numpy(sh: ConvShape) -> None:
    """64 channels a group fill the int8 tile steps (3 taps x 64): the grouped conv runs its
    conv BRGEMM on AMX tiles (the software tile model on hosts without AMX)."""
    import tpp_harness as h

    got, want, amx = _int8_grouped_conv(sh, h.tile_target(2))
    assert amx
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_tile_filter_width_widens_stems_only() -> None:
    """On AMX a filter whose rows are not whole 64-byte tile steps gets zero taps up to the
    next one where that costs at most 2.5x the work: an int8 7x7 stem of 3 (4) channels to
    16 taps, a 3x3 of 16 channels to 4, a bf16 stem to 8 taps (28 of 32 elements; only the
    int8 convolutions use it so far); not a 3x3 stem of 3 channels (16 taps: 5.3x), a 1x1
    convolution (a GEMM, which pads K itself), a grouped one, or off AMX."""
    def width(c: int, r: int, s: int, dtype: str = "int8", isa: str = "amx",
              groups: int = 1) -> int:
        return tile_filter_width(ConvShape(1, 32, 32, c, 32, r, s, 1, (0, 0, 0, 0), groups),
                                 dtype, isa)

    assert width(3, 7, 7) == 16 and width(16, 3, 3) == 4
    assert width(3, 3, 3) == 3 and width(32, 1, 1) == 1 and width(64, 3, 3) == 3
    assert width(32, 3, 3, groups=2) == 3 and width(3, 7, 7, isa="avx512") == 7
    assert width(3, 7, 7, dtype="bfloat16") == 8


def test_strided_pointwise_gathers_the_pixels_it_reads() -> None:
    """A strided 1x1 convolution without padding runs at stride 1 on the image of the
    pixels it reads: its input copy holds oh rows of ow pixels (tile-padded), not the
    whole padded input (0.9 MB a call for ResNet-50's second shortcut)."""
    sh = ConvShape(1, 56, 56, 64, 128, 1, 1, 2)
    assert strided_pointwise(sh) == replace(sh, h=28, w=28, stride=1)
    for other in (replace(sh, stride=1), replace(sh, pad=(0, 0, 1, 1)),
                  replace(sh, r=3, s=3, pad=(1, 1, 1, 1)), replace(sh, oc=64, groups=2)):
        assert strided_pointwise(other) is None
    for dtype in ("float32", "int8"):
        sch, plan = conv_schedule(sh, "avx512", dtype=dtype)
        image = sch.get(sch.get_sblock("A_pad")).writes[0].source
        assert [int(d) for d in image.shape] == [1, 28, plan.mp * 64]


@pytest.mark.parametrize(("dtype", "lanes"), [("float32", 16), ("int8", 64)])
def test_image_copy_is_vectorized_per_pixel(dtype: str, lanes: int) -> None:
    """The padded image copy runs one 64-byte vector of a pixel's channels at a time, so
    the padding test is per pixel (16-lane vectors straddling a border made LLVM copy a u8
    image byte by byte)."""
    sh = ConvShape(1, 12, 12, 64, 64, 3, 3, 1, (1, 1, 1, 1))
    sch, _ = conv_schedule(sh, "avx512", dtype=dtype)
    rows, *pixel = (sch.get(loop) for loop in sch.get_loops(sch.get_sblock("A_pad")))
    assert rows.kind == tvm.tirx.ForKind.PARALLEL
    assert pixel[-1].kind == tvm.tirx.ForKind.VECTORIZED and int(pixel[-1].extent) == lanes
    # (pixels, [vectors of a pixel,] lanes): the channel index is the inner loops' alone
    assert int(np.prod([int(loop.extent) for loop in pixel[1:]])) == 64
