"""Low-precision activations between layers: a producer writes bf16 where only bf16 layers
read it, and nothing changes in the result (the same fp32 tile rounded once, the same
way); an int8 layer writes u8/s8 where its readers quantize it, exactly as its quantize TPP
would; on the AVX-512 kernels and on AMX tiles."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from test_conv import BF16_SHAPES, _conv_ref
from tpp_harness import tile_target

from tpp_tvm import models
from tpp_tvm.compiled import compile_onnx
from tpp_tvm.intrinsics import amx_emulator
from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.kernels import pack_b_numpy
from tpp_tvm.schedules.conv import (
    ConvShape,
    conv_input_schedule,
    conv_schedule,
    pack_filter,
    padded_input_shape,
)
from tpp_tvm.schedules.gemm import gemm_schedule
from tpp_tvm.target import isa_of, target, tiles_emulated
from tpp_tvm.tir_pipeline import compile_kernels

REWRITE = "bf16 activations: layers writing bf16 for the next bf16 layer"


def _targets() -> list:
    """The AVX-512 kernels (on AVX512_BF16 hosts, which all have VNNI too) and the tiles
    (AMX, else the tile model, which :func:`tile_target` runs on any AVX2 or AVX-512 host)."""
    return [pytest.param(lambda: target("avx512", num_cores=2), id="avx512",
                         marks=pytest.mark.requires_avx512_bf16),
            pytest.param(lambda: tile_target(num_cores=2), id="tiles")]


def _as_bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16)


def _run_both(build, args: list[np.ndarray], out_shape: tuple, tgt) -> dict[str, np.ndarray]:
    """The kernel built by ``build(out_dtype)`` run on ``args`` writing fp32 and bf16."""
    outs = {}
    for out_dtype in ("float32", "bfloat16"):
        kernel = compile_kernels(build(out_dtype).mod, tgt).jit()
        out = tvm.runtime.empty(out_shape, out_dtype)
        kernel["main"](*(tvm.runtime.tensor(a) for a in args), out)
        if tiles_emulated(tgt):
            amx_emulator.check("bf16-output kernel")
        outs[out_dtype] = out.numpy()
    return outs


@pytest.mark.parametrize("make_target", _targets())
@pytest.mark.parametrize(("m", "n", "k", "activation", "residual"), [
    (64, 128, 64, "relu", False),  # whole tiles
    (49, 130, 96, "gelu", True),  # padded rows and columns: the tail tiles convert too
    (300, 64, 256, None, True),  # many row tiles, residual only
])
def test_gemm_writes_bf16_as_its_fp32_result_rounded(make_target, m, n, k, activation,
                                                     residual) -> None:
    tgt = make_target()
    isa = isa_of(tgt)
    rng = np.random.default_rng(0)
    _, plan = gemm_schedule(m, n, k, isa, dtype="bfloat16")
    a = np.zeros((plan.mp, plan.kp), np.float32)
    a[:m, :k] = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n)).astype(np.float32)
    args = [_as_bf16(a), pack_b_numpy(_as_bf16(b), plan.nr, "kn", plan.kp, 2),
            np.pad(rng.standard_normal(n).astype(np.float32), (0, plan.np_ - n))]
    if residual:
        args.append(rng.standard_normal((m, n)).astype(np.float32))
    outs = _run_both(lambda out_dtype: gemm_schedule(m, n, k, isa, dtype="bfloat16", threads=2,
                                                     epilogue=Epilogue(bias=True,
                                                                       activation=activation,
                                                                       residual=residual,
                                                                       out_dtype=out_dtype)
                                                     )[0], args, (m, n), tgt)
    assert outs["bfloat16"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(outs["bfloat16"], _as_bf16(outs["float32"]))


@pytest.mark.parametrize("make_target", _targets())
@pytest.mark.parametrize("sh", [*BF16_SHAPES[:2], BF16_SHAPES[-1]],
                         ids=lambda s: f"{s.c}x{s.r}x{s.s}s{s.stride}g{s.groups}")
def test_conv_writes_bf16_as_its_fp32_result_rounded(make_target, sh: ConvShape) -> None:
    """Convolutions too, grouped ones (whose epilogue also transposes) included; and the
    image of a bf16 input pads exactly as the image of its fp32 original converts."""
    tgt = make_target()
    isa = isa_of(tgt)
    rng = np.random.default_rng(1)
    _, plan = conv_schedule(sh, isa, dtype="bfloat16")
    x = _as_bf16(rng.standard_normal((sh.n, sh.h, sh.w * sh.c)).astype(np.float32))
    hp, wp, cc = padded_input_shape(sh, plan)
    groups = (sh.groups,) if sh.groups > 1 else ()
    images = []
    for source in (x.astype(np.float32), x):
        pad = compile_kernels(conv_input_schedule(sh, plan, str(source.dtype)).mod, tgt).jit()
        image = tvm.runtime.empty((sh.n, *groups, hp, wp * cc), "bfloat16")
        pad["main"](tvm.runtime.tensor(source), image)
        images.append(image.numpy())
    np.testing.assert_array_equal(images[0], images[1])
    w = rng.standard_normal((sh.oc, sh.cg, sh.r, sh.s)).astype(np.float32)
    bias = np.pad(rng.standard_normal((sh.groups, sh.og)).astype(np.float32),
                  ((0, 0), (0, plan.np_ - sh.og)))
    out_shape = (sh.n, sh.oh, sh.ow, *((sh.groups, sh.og) if groups else (sh.oc,)))
    args = [images[1], pack_filter(_as_bf16(w), plan.nr, vnni=2, groups=sh.groups),
            bias if groups else bias[0], rng.standard_normal(out_shape).astype(np.float32)]
    epilogue = Epilogue(bias=True, activation="relu", residual=True)
    outs = _run_both(lambda out_dtype: conv_schedule(
        sh, isa, dtype="bfloat16", threads=2, epilogue=epilogue.writing(out_dtype))[0],
        args, out_shape, tgt)
    np.testing.assert_array_equal(outs["bfloat16"], _as_bf16(outs["float32"]))


@pytest.mark.requires_torch
@pytest.mark.parametrize("make_target", _targets())
@pytest.mark.parametrize(("name", "links"), [
    # 1x1 -> 3x3 -> 1x1 in 4 blocks; 3 stage inputs read by 2 convolutions; the last
    # convolution for the head (its global average pooling of one pixel is a reshape)
    ("resnet50", 12),
    ("bert", 1),  # the MLP's up-projection -> down-projection
    ("mlp", 1),  # 2-D input: the layers' outputs are aliases, not reshapes
])
def test_models_pass_bf16_between_layers_and_give_the_same_result(
        make_target, name: str, links: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer whose readers are all bf16 layers hands bf16 on; the outputs are
    bit-identical to converting each activation in a kernel of its own."""
    from tpp_tvm.relay_passes import lower

    tgt = make_target()
    model = models.GENERATORS[name](**models.TINY_ARGS[name])
    inputs = models.example_inputs(model)
    passing = compile_onnx(model, target=tgt, precision="bf16")
    assert passing.report_data["rewrites"].get(REWRITE, 0) == links
    assert REWRITE in passing.report()
    monkeypatch.setattr(lower, "plan_outputs", lambda *args: {})
    converting = compile_onnx(model, target=tgt, precision="bf16")
    assert REWRITE not in converting.report_data.get("rewrites", {})
    for got, want in zip(passing(**inputs), converting(**inputs), strict=True):
        np.testing.assert_array_equal(got, want)
    if tiles_emulated(tgt):
        amx_emulator.check(name)


@pytest.mark.requires_torch
@pytest.mark.requires_avx512_bf16
def test_a_layer_that_cannot_write_its_planned_dtype_writes_fp32_and_stays_right(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is made before any kernel exists; a bf16 GEMM that cannot then write bf16
    writes fp32 (reported), and its reader converts as it would without a plan: the same
    bits."""
    from tpp_tvm.relay_passes import lower
    from tpp_tvm.relay_passes.families import gemm as gemm_family

    tgt = target("avx512", num_cores=2)
    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])
    inputs = models.example_inputs(model)
    real = gemm_family.gemm_schedule

    def no_bf16_output(*args, epilogue: Epilogue = Epilogue(), **kwargs):
        if epilogue.out_dtype == "bfloat16":
            raise ValueError("no bf16 output here")
        return real(*args, epilogue=epilogue, **kwargs)

    monkeypatch.setattr(gemm_family, "gemm_schedule", no_bf16_output)
    refused = compile_onnx(model, target=tgt, precision="bf16")
    rewrites = refused.report_data["rewrites"]
    assert REWRITE not in rewrites
    assert any("bfloat16 -> bfloat16 kernel failed" in line for line in rewrites), rewrites
    assert not refused.report_data.get("fallbacks")
    monkeypatch.setattr(lower, "plan_outputs", lambda *args: {})
    unplanned = compile_onnx(model, target=tgt, precision="bf16")
    for got, want in zip(refused(**inputs), unplanned(**inputs), strict=True):
        np.testing.assert_array_equal(got, want)


def _quantized(x: np.ndarray, inv_scale: float, zero: float, dtype: str) -> np.ndarray:
    """The quantize TPP's math: fp32 x * (1/scale) + zero point, half to even, saturated."""
    lo, hi = (0, 255) if dtype == "uint8" else (-128, 127)
    v = x.astype(np.float32) * np.float32(inv_scale) + np.float32(zero)
    return np.clip(np.rint(v), lo, hi).astype(dtype)


@pytest.mark.parametrize("make_target", _targets())
@pytest.mark.parametrize(("m", "n", "k", "out_dtype"), [
    (64, 128, 64, "uint8"), (49, 130, 96, "int8"), (300, 64, 256, "uint8")])
def test_int8_gemm_writes_its_result_quantized(make_target, m, n, k, out_dtype) -> None:
    tgt = make_target()
    isa = isa_of(tgt)
    rng = np.random.default_rng(2)
    _, plan = gemm_schedule(m, n, k, isa, dtype="int8", dequantize=True)
    a = np.zeros(plan.a_shape(()), np.uint8)  # int8 A is padded inside the kernel, or not
    a[:m, :k] = rng.integers(0, 256, (m, k))
    b = rng.integers(-127, 128, (k, n)).astype(np.int8)
    width = plan.np_
    args = [a, pack_b_numpy(b, plan.nr, "kn", plan.kp, 4), np.full(width, 1e-3, np.float32),
            np.full(width, -0.5, np.float32),
            np.pad(rng.standard_normal(n).astype(np.float32), (0, width - n)),
            rng.standard_normal((m, n)).astype(np.float32)]
    inv_scale, zero = 1 / 0.03, 3.0 if out_dtype == "uint8" else -2.0
    outs = {}
    for dtype, extra in (("float32", []), (out_dtype, [np.full(n, inv_scale, np.float32),
                                                       np.full(n, zero, np.float32)])):
        sch, _ = gemm_schedule(m, n, k, isa, dtype="int8", dequantize=True, threads=2,
                               epilogue=Epilogue(bias=True, activation="relu", residual=True,
                                                 out_dtype=dtype))
        kernel = compile_kernels(sch.mod, tgt).jit()
        out = tvm.runtime.empty((m, n), dtype)
        kernel["main"](*(tvm.runtime.tensor(x) for x in args + extra), out)
        if tiles_emulated(tgt):
            amx_emulator.check("int8 GEMM writing u8/s8")
        outs[dtype] = out.numpy()
    want = _quantized(outs["float32"], inv_scale, zero, out_dtype)
    assert len(np.unique(want)) > 100  # not all saturated
    np.testing.assert_array_equal(outs[out_dtype], want)


@pytest.mark.parametrize("make_target", _targets())
def test_int8_conv_writes_its_result_quantized(make_target) -> None:
    tgt = make_target()
    isa = isa_of(tgt)
    sh = ConvShape(1, 12, 12, 64, 64, 3, 3, pad=(1, 1, 1, 1))
    rng = np.random.default_rng(3)
    _, plan = conv_schedule(sh, isa, dtype="int8")
    x = rng.integers(0, 256, (sh.n, sh.h, sh.w * sh.c)).astype(np.uint8)
    w = rng.integers(-127, 128, (sh.oc, sh.c, sh.r, sh.s)).astype(np.int8)
    args = [x, pack_filter(w, plan.nr, vnni=4), np.array([128], np.uint8),
            np.full(plan.np_, 1e-4, np.float32), np.zeros(plan.np_, np.float32),
            np.zeros(plan.np_, np.float32)]
    out_shape = (sh.n, sh.oh, sh.ow, sh.oc)
    outs = {}
    for dtype, extra in (("float32", []), ("uint8", [np.full(sh.oc, 20.0, np.float32),
                                                     np.full(sh.oc, 128.0, np.float32)])):
        sch, _ = conv_schedule(sh, isa, dtype="int8", threads=2,
                               epilogue=Epilogue(bias=True, out_dtype=dtype))
        kernel = compile_kernels(sch.mod, tgt).jit()
        out = tvm.runtime.empty(out_shape, dtype)
        kernel["main"](*(tvm.runtime.tensor(a) for a in args + extra), out)
        if tiles_emulated(tgt):
            amx_emulator.check("int8 conv writing u8")
        outs[dtype] = out.numpy()
    want = _quantized(outs["float32"], 20.0, 128.0, "uint8")
    assert len(np.unique(want)) > 100
    np.testing.assert_array_equal(outs["uint8"], want)


@pytest.mark.parametrize("make_target", _targets())
@pytest.mark.parametrize("out_dtype", ["uint8", "int8"])
def test_int8_layers_without_steps_requantize_in_one_pass(make_target, out_dtype) -> None:
    """A GEMM and a convolution with nothing between dequantizing and quantizing take the
    folded rows (``rq_scale``, ``rq_offset``) in place of the dequantize rows and no
    quantization rows: one requantize TPP per tile, saturate(round(C * S + O)) exactly."""
    from tpp_tvm.schedules.gemm_te import REQUANTIZE_ROWS

    tgt = make_target()
    isa = isa_of(tgt)
    rng = np.random.default_rng(5)
    m, n, k = 64, 64, 128  # whole tiles: tensorized (a padded edge tile is vectorized)
    sh = ConvShape(1, 6, 16, 64, 64, 3, 3, pad=(1, 1, 1, 1))
    gemm, plan = gemm_schedule(m, n, k, isa, dtype="int8", dequantize=True, threads=2,
                               epilogue=Epilogue(out_dtype=out_dtype))
    conv, cplan = conv_schedule(sh, isa, dtype="int8", threads=2,
                                epilogue=Epilogue(out_dtype=out_dtype))
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-127, 128, (k, n)).astype(np.int8)
    x = rng.integers(0, 256, (sh.n, sh.h, sh.w * sh.c)).astype(np.uint8)
    w = rng.integers(-127, 128, (sh.oc, sh.c, sh.r, sh.s)).astype(np.int8)
    cases = [(gemm, plan, [a, pack_b_numpy(b, plan.nr, "kn", plan.kp, 4)], (m, n),
              a.astype(np.int64) @ b.astype(np.int64)),
             (conv, cplan, [x, pack_filter(w, cplan.nr, vnni=4), np.array([0], np.uint8)],
              (sh.n, sh.oh, sh.ow, sh.oc),
              _conv_ref(x.reshape(sh.n, sh.h, sh.w, sh.c), w, sh, 0.0))]
    for sch, p, args, out_shape, exact in cases:
        names = [str(param.name) for param in sch.mod["main"].params]
        assert REQUANTIZE_ROWS[0] in names and "q_scale" not in names, names
        if (p.mp, p.np_) == (p.m, p.n):
            assert "requantize" in str(sch.trace)
        scale = rng.uniform(0.5, 2, p.np_).astype(np.float32) * 1e-3
        offset = rng.uniform(-50, 50, p.np_).astype(np.float32)
        kernel = compile_kernels(sch.mod, tgt).jit()
        out = tvm.runtime.empty(out_shape, out_dtype)
        kernel["main"](*(tvm.runtime.tensor(v) for v in [*args, scale, offset]), out)
        if tiles_emulated(tgt):
            amx_emulator.check("int8 layer requantizing in one pass")
        want = _quantized(exact.astype(np.float32) * scale[:out_shape[-1]]
                          + offset[:out_shape[-1]], 1.0, 0.0, out_dtype)
        assert len(np.unique(want)) > 100
        np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.parametrize("make_target", _targets())
@pytest.mark.parametrize(("out_dtype", "relu", "m"), [
    ("uint8", True, 64), ("int8", False, 64), ("uint8", True, 49)])
def test_int8_layers_with_a_residual_requantize_in_one_pass(make_target, out_dtype: str,
                                                            relu: bool, m: int) -> None:
    """A GEMM and a convolution adding a residual of their output's dtype (at most a ReLU
    after it) run one requantize_add[_relu] pass per tile: rows dequantize S, O, the
    residual, then the residual's scale times 1/scale (``rq_residual_scale``) and the zero
    point; q(act(C S + O + r) A + Z) exactly. 49 rows: the padded edge tile's pass is
    vectorized, the same math."""
    from tpp_tvm.schedules.gemm_te import RESIDUAL_REQUANTIZE_ROWS

    tgt = make_target()
    isa = isa_of(tgt)
    rng = np.random.default_rng(6)
    n, k = 64, 128
    sh = ConvShape(1, 4, 16, 64, 64, 1, 1)
    post = "relu" if relu else None
    kw = dict(epilogue=Epilogue(residual=True, residual_dtype=out_dtype, out_dtype=out_dtype,
                                post_activation=post), threads=2)
    gemm, plan = gemm_schedule(m, n, k, isa, dtype="int8", dequantize=True, **kw)
    conv, cplan = conv_schedule(sh, isa, dtype="int8", **kw)
    a = np.zeros(plan.a_shape(()), np.uint8)
    a[:m, :k] = rng.integers(0, 256, (m, k))
    b = rng.integers(-127, 128, (k, n)).astype(np.int8)
    x = rng.integers(0, 256, (sh.n, sh.h, sh.w * sh.c)).astype(np.uint8)
    w = rng.integers(-127, 128, (sh.oc, sh.c, sh.r, sh.s)).astype(np.int8)
    cases = [(gemm, plan, [a, pack_b_numpy(b, plan.nr, "kn", plan.kp, 4)], (m, n),
              a[:m, :k].astype(np.int64) @ b.astype(np.int64)),
             (conv, cplan, [x, pack_filter(w, cplan.nr, vnni=4), np.array([0], np.uint8)],
              (sh.n, sh.oh, sh.ow, sh.oc),
              _conv_ref(x.reshape(sh.n, sh.h, sh.w, sh.c), w, sh, 0.0))]
    info = np.iinfo(out_dtype)
    for sch, p, args, out_shape, exact in cases:
        names = [str(param.name) for param in sch.mod["main"].params]
        assert RESIDUAL_REQUANTIZE_ROWS[0] in names and "q_scale" not in names, names
        op = "requantize_add_relu" if relu else "requantize_add"
        assert (op in str(sch.trace)) == ((p.mp, p.np_) == (p.m, p.n))
        scale = rng.uniform(0.5, 2, p.np_).astype(np.float32) * 1e-3
        offset = rng.uniform(-50, 50, p.np_).astype(np.float32)
        residual = rng.integers(info.min, info.max + 1, out_shape).astype(out_dtype)
        out_scale = rng.uniform(0.5, 1.5, p.np_).astype(np.float32)
        zero = np.full(out_shape[-1], 3.0 if out_dtype == "uint8" else -2.0, np.float32)
        kernel = compile_kernels(sch.mod, tgt).jit()
        out = tvm.runtime.empty(out_shape, out_dtype)
        kernel["main"](*(tvm.runtime.tensor(v) for v in [*args, scale, offset, residual,
                                                         out_scale, zero]), out)
        if tiles_emulated(tgt):
            amx_emulator.check("int8 layer adding its residual and requantizing in one pass")
        cols = out_shape[-1]
        v = exact.astype(np.float32) * scale[:cols] + offset[:cols] + residual.astype(np.float32)
        if relu:
            v = np.maximum(v, np.float32(0))
        want = _quantized(v * out_scale[:cols] + zero, 1.0, 0.0, out_dtype)
        assert len(np.unique(want)) > 100
        np.testing.assert_array_equal(out.numpy(), want)
