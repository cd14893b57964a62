"""AMX TPPs: bf16/int8 tile BRGEMMs compiled for ``mcpu=sapphirerapids`` and checked in the
generated assembly on any host; the same kernels run against numpy on AMX where the CPU has
it and the OS grants tile state, else on the software tile model (``h.tile_target``)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import tpp_harness as h
import tvm

from tpp_tvm.errors import TPPError, UnsupportedDTypeError
from tpp_tvm.intrinsics import TPPSpec, intrinsic
from tpp_tvm.intrinsics.amx import ensure_tile_permission
from tpp_tvm.intrinsics.epilogue import Epilogue
from tpp_tvm.intrinsics.llvm_ir import amx_tile_config
from tpp_tvm.target import host_isa, target

HOST = host_isa()
BF16 = TPPSpec("gemm", "bfloat16", m=32, n=32, k=64, beta=0)
INT8 = TPPSpec("brgemm", "uint8", b_dtype="int8", m=16, n=32, k=128, batch=2, beta=1)


def _count(asm: str, mnemonic: str) -> int:
    return len(re.findall(rf"^\s*{mnemonic}\b", asm, re.M))


@pytest.mark.parametrize(("spec", "dot", "c_tiles"), [(BF16, "tdpbf16ps", 4),
                                                       (INT8, "tdpbusd", 2)],
                         ids=["bf16", "int8"])
def test_tile_kernel_assembly(spec: TPPSpec, dot: str, c_tiles: int) -> None:
    """Config loaded once, tiles loaded and multiplied, C stored, tiles released."""
    asm = h.assembly(spec, "amx")
    assert str(target("amx").attrs["mcpu"]) in ("sapphirerapids", str(
        tvm.target.codegen.llvm_get_system_cpu()))
    assert _count(asm, "ldtilecfg") == 1
    assert _count(asm, "tilerelease") == 1
    assert _count(asm, "tileloadd") >= c_tiles  # A and B tiles per step (+ C for beta 1)
    assert _count(asm, dot) >= c_tiles and _count(asm, dot) % c_tiles == 0
    assert _count(asm, "tilestored") == c_tiles
    assert (_count(asm, "tilezero") == c_tiles) == (spec.beta == 0)
    assert re.search(rf"{dot}\s+%tmm\d, %tmm\d, %tmm\d", asm)


def test_tile_config_shapes() -> None:
    """Palette 1; C tiles 16 rows x 64 bytes; A tiles 16 x 64 bytes; B tiles 16 groups."""
    text, tiles = amx_tile_config(32, 32)
    assert tiles == [(16, 64)] * 4 + [(16, 64)] * 2 + [(16, 64)] * 2
    cfg = [int(b.split()[1]) for b in text.strip("[]").split(",")]
    assert len(cfg) == 64 and cfg[0] == 1
    assert cfg[16:32] == [64, 0] * 8 and cfg[48:56] == [16] * 8 and not any(cfg[56:])
    _, tiles = amx_tile_config(16, 32)
    assert len(tiles) == 2 + 1 + 2


@pytest.mark.parametrize("spec", [
    TPPSpec("gemm", "bfloat16", m=24, n=32, k=64),  # rows not whole tiles
    TPPSpec("gemm", "uint8", b_dtype="int8", m=16, n=16, k=32),  # K not whole tile steps
], ids=lambda s: s.name("amx"))
def test_unsupported_tiles_name_the_rule(spec: TPPSpec) -> None:
    with pytest.raises(UnsupportedDTypeError, match="16 or 32 rows"):
        intrinsic(spec, "amx")


def test_non_tile_tpps_use_the_avx512_unit() -> None:
    spec = TPPSpec("relu", m=4, n=37)
    asm = h.assembly(spec, "amx")
    assert "zmm" in asm and _count(asm, "ldtilecfg") == 0


def test_tile_permission() -> None:
    if HOST.amx_tile and HOST.amx_permitted:
        ensure_tile_permission()
    else:
        with pytest.raises(TPPError, match="cannot run AMX kernels here"):
            ensure_tile_permission()


@pytest.mark.parametrize("spec", [BF16, INT8], ids=["bf16", "int8"])
def test_tile_kernels_run_like_numpy(spec: TPPSpec) -> None:
    h.check(spec, isa="amx", tgt=h.tile_target())


@pytest.mark.parametrize(("dtype", "dot"), [("bfloat16", "tdpbf16ps"), ("int8", "tdpbusd")])
def test_amx_gemm_configures_tiles_once_per_kernel(dtype: str, dot: str) -> None:
    """Many 32 x 32 blocks, two threads: one ldtilecfg and one tilerelease in the whole
    kernel (per thread at run time), not one per microkernel call."""
    from tpp_tvm.kernels import build_gemm

    kernel = build_gemm(100, 70, 130, dtype=dtype, target=target("amx", num_cores=2))
    asm = kernel.module.inspect_source("asm")
    plan = kernel.plan
    assert (plan.mr, plan.nr, plan.kp % (16 * (2 if dtype == "bfloat16" else 4))) == (32, 32, 0)
    assert _count(asm, "ldtilecfg") == 1 and _count(asm, "tilerelease") == 1
    assert _count(asm, dot) >= 4 and _count(asm, "tilestored") >= 4


def _runnable(kernel, m: int, n: int, k: int, threads: int, options: dict):
    """``kernel`` where this host runs tiles, else the same GEMM on emulated tiles."""
    from tpp_tvm.kernels import build_gemm
    from tpp_tvm.target import tiles_emulated

    tgt = h.tile_target(threads)
    return build_gemm(m, n, k, target=tgt, **options) if tiles_emulated(tgt) else kernel


def _check_dequantize_bias_relu(kernel, rng, bias) -> None:
    """An int8 tile GEMM with dequantization, bias and ReLU against numpy (exact int64)."""
    import numpy as np

    p = kernel.plan
    a = rng.integers(0, 256, (p.m, p.k)).astype(np.uint8)
    b = rng.integers(-128, 128, (p.k, p.n)).astype(np.int8)
    scale = rng.uniform(1e-3, 2e-3, p.n).astype("float32")
    offset = rng.standard_normal(p.n).astype("float32")
    want = np.maximum((a.astype(np.int64) @ b.astype(np.int64)) * scale + offset + bias, 0)
    np.testing.assert_allclose(kernel(a, b, bias, scale=scale, offset=offset), want,
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("options", [
    {"dtype": "bfloat16", "bias": True, "activation": "gelu"},
    {"dtype": "bfloat16", "batch": 3},
    {"dtype": "int8", "dequantize": True, "bias": True, "activation": "relu"},
], ids=["bf16-bias-gelu", "bf16-batched", "int8-dequantize-bias-relu"])
def test_amx_gemm_epilogues_run_on_tiles(options: dict) -> None:
    """Epilogues (bias, activation, dequantize) and batches keep the GEMM on tiles: the
    tile products in the assembly, the configuration loaded once per task, the epilogue on
    zmm registers; run against numpy where the host has AMX."""
    import numpy as np

    from tpp_tvm.kernels import build_gemm

    dtype = options["dtype"]
    m, n, k = 50, 70, 100
    kernel = build_gemm(m, n, k, target=target("amx", num_cores=2), **options)
    asm = kernel.module.inspect_source("asm")
    dot = "tdpbf16ps" if dtype == "bfloat16" else "tdpbusd"
    assert kernel.plan.amx and _count(asm, dot) >= 4
    assert _count(asm, "ldtilecfg") == 1 and _count(asm, "tilerelease") == 1
    assert ("zmm" in asm) == ("bias" in options)  # the epilogue on the vector unit
    kernel = _runnable(kernel, m, n, k, 2, options)
    rng = np.random.default_rng(0)
    lead = (options["batch"],) if "batch" in options else ()
    bias = rng.standard_normal(n).astype("float32")
    if dtype == "int8":
        _check_dequantize_bias_relu(kernel, rng, bias)
        return
    import ml_dtypes

    a = rng.standard_normal((*lead, m, k), dtype="float32")
    b = rng.standard_normal((*lead, k, n), dtype="float32")
    want = (a.astype(ml_dtypes.bfloat16).astype(np.float32)
            @ b.astype(ml_dtypes.bfloat16).astype(np.float32))
    if options.get("bias"):
        want = want + bias
        got = kernel(a, b, bias)
    else:
        got = kernel(a, b)
    if options.get("activation") == "gelu":
        from scipy.special import erf

        want = 0.5 * want * (1 + erf(want / np.sqrt(2)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def _epilogue_between_tile_products(asm: str, dot: str) -> bool:
    """Whether vector (``v...ps``) instructions run between two tile products of one block
    (no tile store or zeroing between them): the previous block's epilogue interleaved."""
    ins = [line.split()[0] for line in asm.splitlines()
           if line.startswith("\t") and not line.startswith("\t.")]
    in_block, vector_since = False, False
    for op in ins:
        if op == dot:
            if in_block and vector_since:
                return True
            in_block, vector_since = True, False
        elif op.startswith(("tilestore", "tilezero")):
            in_block, vector_since = False, False
        elif in_block and op.startswith("v") and op.endswith("ps"):
            vector_since = True
    return False


@pytest.mark.parametrize(("dtype", "options"), [
    ("bfloat16", {"bias": True, "activation": "gelu"}),
    ("int8", {"dequantize": True, "bias": True, "activation": "relu"}),
], ids=["bf16-gelu", "int8-dequantize-relu"])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_gemm_epilogue_runs_between_tile_products(dtype: str, options: dict,
                                                      threads: int) -> None:
    """Each block's tile steps run in parts with a slice of the previous block's epilogue
    between them (``interleave_tile_epilogues``), so the vector unit works while the tiles
    compute, and the steps prefetch the next B panel; the last block's epilogue follows the
    loop. 128 x 256 x 256: 8 K steps and 8 row slices per block, 8 B panels; against numpy
    where the host has AMX."""
    import numpy as np

    from tpp_tvm.kernels import build_gemm

    m, n, k = 128, 256, 256
    kernel = build_gemm(m, n, k, dtype=dtype, target=target("amx", num_cores=threads),
                        **options)
    asm = kernel.module.inspect_source("asm")
    dot = "tdpbf16ps" if dtype == "bfloat16" else "tdpbusd"
    assert _epilogue_between_tile_products(asm, dot)
    assert _count(asm, "ldtilecfg") == 1 and _count(asm, "tilerelease") == 1
    assert _count(asm, "prefetcht1") >= 8  # the next B panel, fetched into L2 during the steps
    kernel = _runnable(kernel, m, n, k, threads, {"dtype": dtype, **options})
    rng = np.random.default_rng(1)
    bias = rng.standard_normal(n).astype("float32")
    if dtype == "int8":
        _check_dequantize_bias_relu(kernel, rng, bias)
        return
    import ml_dtypes
    from scipy.special import erf

    a = rng.standard_normal((m, k), dtype="float32")
    b = rng.standard_normal((k, n), dtype="float32")
    x = (a.astype(ml_dtypes.bfloat16).astype(np.float64)
         @ b.astype(ml_dtypes.bfloat16).astype(np.float64)) + bias
    np.testing.assert_allclose(kernel(a, b, bias), 0.5 * x * (1 + erf(x / np.sqrt(2))),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_amx_gemm_without_epilogue_prefetches_the_next_panel(dtype: str) -> None:
    """A tile GEMM whose tiles are stored straight into the output (no epilogue) still runs
    its steps in parts that prefetch the next B panel into L2 (weights cold in memory)."""
    from tpp_tvm.kernels import build_gemm

    kernel = build_gemm(128, 256, 256, dtype=dtype, target=target("amx", num_cores=1))
    asm = kernel.module.inspect_source("asm")
    assert _count(asm, "prefetcht1") >= 8 and _count(asm, "ldtilecfg") == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_amx_gemm_runs_like_numpy(dtype: str) -> None:
    import numpy as np

    from tpp_tvm.kernels import build_gemm

    rng = np.random.default_rng(0)
    m, n, k = 100, 70, 130
    kernel = build_gemm(m, n, k, dtype=dtype, target=h.tile_target(1))
    if dtype == "int8":
        a = rng.integers(0, 256, (m, k)).astype(np.uint8)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        np.testing.assert_array_equal(kernel(a, b), a.astype(np.int64) @ b.astype(np.int64))
    else:
        import ml_dtypes

        a = rng.standard_normal((m, k), dtype="float32")
        b = rng.standard_normal((k, n), dtype="float32")
        want = (a.astype(ml_dtypes.bfloat16).astype(np.float32)
                @ b.astype(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_allclose(kernel(a, b), want, rtol=1e-4, atol=1e-3)


def test_quantized_convolutions_build_for_amx_on_the_vnni_unit() -> None:
    """A ConvInteger model compiles for an AMX target: a convolution's strided rows are
    not tile rows, so its BRGEMM is the AVX-512 VNNI dot product (no tile config)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from tpp_tvm.frontend import from_onnx
    from tpp_tvm.relay_passes.lower import LoweringReport
    from tpp_tvm.relay_passes.pipeline import build

    spec = TPPSpec("conv_brgemm", "uint8", b_dtype="int8", m=4, n=32, k=24, batch=3, beta=0,
                   stride=8)
    asm = h.assembly(spec, "amx")
    assert _count(asm, "vpdpbusd") >= 4 and _count(asm, "ldtilecfg") == 0
    w = np.random.default_rng(0).integers(-128, 128, (16, 8, 3, 3)).astype(np.int8)
    nodes = [helper.make_node("ConvInteger", ["x", "W"], ["acc"], pads=[1, 1, 1, 1]),
             helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["acc_f", "scale"], ["y"])]
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 6, 6])],
        [numpy_helper.from_array(w, "W"),
         numpy_helper.from_array(np.array(1e-3, np.float32), "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    report = LoweringReport()
    build(from_onnx(model), target=target("amx"), report=report)
    assert dict(report.lowered) == {"tpp.conv_integer [int8]": 1}, report.lowered
    assert not report.fallbacks, report.fallbacks


def _run_exported_in_fresh_process(compiled, inputs: dict, tmp_path):
    """(the process, its output file) of a fresh Python that only loads ``compiled``'s
    export and runs it on ``inputs``."""
    import subprocess
    import sys

    import numpy as np

    path = compiled.export(str(tmp_path / "model.so"))
    np.savez(tmp_path / "inputs.npz", **inputs)
    script = ("import sys, numpy as np, tpp_tvm\n"
              "m = tpp_tvm.load(sys.argv[1]); x = np.load(sys.argv[2])\n"
              "np.save(sys.argv[3], m(**dict(x))[0])\n")
    out = tmp_path / "out.npy"
    proc = subprocess.run([sys.executable, "-c", script, str(path),
                           str(tmp_path / "inputs.npz"), str(out)],
                          capture_output=True, text=True, timeout=300)
    return proc, out


def test_exported_tile_model_runs_in_a_fresh_process(tmp_path) -> None:
    """A process that only loads an exported AMX model must ask Linux for tile state itself
    (else its first tile instruction is SIGILL); a host without AMX gets a clear error."""

    import numpy as np

    from tpp_tvm import models
    from tpp_tvm.compiled import compile_onnx

    model = models.GENERATORS["mlp"](**models.TINY_ARGS["mlp"])
    inputs = models.example_inputs(model)
    compiled = compile_onnx(model, target=target("amx", num_cores=1), precision="bf16")
    assert any(k.endswith(", amx]") for k in compiled.report_data["lowered"])
    proc, out = _run_exported_in_fresh_process(compiled, inputs, tmp_path)
    if HOST.amx_tile and HOST.amx_permitted:
        assert proc.returncode == 0, proc.stderr[-2000:]
        want = compiled(*inputs.values())[0]
        np.testing.assert_allclose(np.load(out), want, rtol=1e-5, atol=1e-5)
    else:
        assert proc.returncode == 1 and "runs matmuls on AMX tiles" in proc.stderr, proc.stderr


def test_row_blocks_keep_a_in_half_the_l2() -> None:
    from tpp_tvm.schedules.gemm_plan import row_block

    budget = (HOST.l2_bytes or 1024 * 1024) // 2
    assert row_block(64, 2048, 32) is None or 64 * 2048 > budget
    rows, row_bytes = 4096, 4096
    mc = row_block(rows, row_bytes, 32)
    assert mc is not None and mc % 32 == 0 and 64 <= mc < rows and mc * row_bytes <= budget
    assert rows % mc == 0
    # 7 row tiles (ViT's 197 tokens as 224 rows, K = 3072): no block divides them.
    assert row_block(224, 6144, 32) is None or 7 * 6144 * 32 <= budget


@pytest.mark.parametrize(("m", "k"), [(197, 3072), (640, 2048), (1024, 1024)])
def test_tile_gemms_tensorize_for_ragged_row_counts(m: int, k: int) -> None:
    """Compile-only (any host): whatever row blocking the L2 suggests, the tile microkernel
    still tensorizes (ViT's FFN2, 197 x 768 x 3072 with bias and residual, fell back to
    TVM's untuned code, 2.9 s a call, when a ragged row block left a predicate)."""
    from tpp_tvm.schedules.gemm import gemm_schedule

    sch, plan = gemm_schedule(m, 768, k, "amx", dtype="bfloat16", threads=2,
                              epilogue=Epilogue(bias=True, residual=True))
    assert plan.amx and "tpp.gemm.bf16.amx" in str(sch.trace)


def test_row_blocked_tile_gemm_runs_like_numpy() -> None:
    """A larger than half the L2: row blocks of A outer, every B panel over each block."""
    import ml_dtypes
    import numpy as np

    from tpp_tvm.kernels import build_gemm
    from tpp_tvm.schedules.gemm_plan import row_block

    m, n, k = 640, 96, 2048
    assert row_block(m, 2 * k, 32) is not None or m * 2 * k <= (HOST.l2_bytes or 0) // 2
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype="float32")
    b = rng.standard_normal((k, n), dtype="float32")
    kernel = build_gemm(m, n, k, dtype="bfloat16", target=h.tile_target(2))
    want = (a.astype(ml_dtypes.bfloat16).astype(np.float32)
            @ b.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_allclose(kernel(a, b), want, rtol=1e-4, atol=1e-2)


def test_tile_gemms_of_many_rows_stream_b_with_rows_outer() -> None:
    """A tile GEMM of at least 8 row tiles whose A row tile fits the L1d and B half the L2
    runs rows outer even where B is the bigger operand (it ran panels outer before), and
    still computes the exact product; with fewer row tiles (a 128-token layer's cold
    weights), a bigger row tile or a B past the L2, panels stay outer."""
    import numpy as np

    from tpp_tvm.kernels import build_gemm
    from tpp_tvm.schedules.gemm_plan import tile_rows_outer, weights_outer

    m, n, k = 256, 1024, 256  # 8 row tiles of 32 x 256 u8 (8 KiB); B 256 KiB
    assert tile_rows_outer(m // 32, 32 * k, k * n) and weights_outer(m * k // 4, k * n // 4)
    assert not tile_rows_outer(4, 32 * k, k * n)
    assert not tile_rows_outer(8, 64 * 1024, k * n)
    assert not tile_rows_outer(8, 32 * k, 64 << 20)
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    kernel = build_gemm(m, n, k, dtype="int8", target=h.tile_target(1))
    np.testing.assert_array_equal(kernel(a, b), a.astype(np.int64) @ b.astype(np.int64))


def test_exported_emulated_tile_model_runs_in_a_fresh_process(tmp_path) -> None:
    """A model exported with emulated tiles records it in its sidecar: a fresh process that
    only loads it links the tile model before the library and gets the same result."""

    import numpy as np

    from tpp_tvm import models
    from tpp_tvm.compiled import compile_onnx
    from tpp_tvm.target import tiles_emulated

    tgt = h.tile_target(1)
    if not tiles_emulated(tgt):
        pytest.skip("this host runs tiles for real (the test above covers it)")
    model = models.GENERATORS["mlp"](batch=20, dims=(64, 96, 32))
    inputs = models.example_inputs(model)
    compiled = compile_onnx(model, target=tgt, precision="bf16")
    assert compiled.report_data["tiles_emulated"]
    assert "emulated in software" in compiled.report()
    proc, out = _run_exported_in_fresh_process(compiled, inputs, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    np.testing.assert_array_equal(np.load(out), compiled(*inputs.values())[0])


def test_int8_convolutions_run_on_tiles_with_the_pixel_stride_as_row_pitch() -> None:
    """An int8 3x3 convolution of 64 channels on an AMX target: one tile configuration per
    task, tdpbusd products, the dequantizing epilogue on zmm registers; a 3-channel stem
    (3 x 4 bytes per filter row, not a tile step) stays on VNNI, as do grouped ones."""
    from tpp_tvm.schedules.conv import ConvShape, conv_schedule, tile_conv_plan
    from tpp_tvm.tir_pipeline import compile_kernels

    shape = ConvShape(1, 20, 20, 64, 64, 3, 3, stride=2, pad=(1, 1, 1, 1))
    sch, plan = conv_schedule(shape, "amx", dtype="int8", threads=2,
                              epilogue=Epilogue(bias=True, activation="relu"))
    assert plan.amx and (plan.mr, plan.nr) == (16, 32)  # 10 output pixels a row
    asm = compile_kernels(sch.mod, target("amx", num_cores=2)).jit().inspect_source("asm")
    assert _count(asm, "ldtilecfg") == 1 and _count(asm, "tilerelease") == 1
    assert _count(asm, "tdpbusd") >= 2 and _count(asm, "vpdpbusd") == 0
    assert "zmm" in asm
    stem = ConvShape(1, 32, 32, 3, 64, 3, 3, stride=2, pad=(1, 1, 1, 1))
    assert tile_conv_plan(stem, "int8", "amx") is None
    assert tile_conv_plan(replace(shape, groups=2), "int8", "amx") is None
    assert tile_conv_plan(shape, "int8", "avx512") is None
    assert tile_conv_plan(shape, "float32", "amx") is None


@pytest.mark.parametrize(("m", "threads"), [(45, 1), (80, 2), (16, 1)])
def test_row_padded_int8_gemm_reads_whole_blocks_in_place(m: int, threads: int,
                                                          monkeypatch) -> None:
    """A with rows alone padded to whole 32-row blocks: only the last block's rows are
    copied into the padded A; every whole block's tiles load A itself (one copy of A was a
    quarter of a 784 x 512 x 128 int8 GEMM). Exact against numpy on every row (on the
    software tile model where the host has no AMX)."""
    import numpy as np
    import tvm_ffi

    import tpp_tvm.tir_pipeline as pipeline
    from tpp_tvm.intrinsics.amx import read_whole_blocks_in_place
    from tpp_tvm.kernels import build_gemm

    seen = []

    def spy(func):
        seen.append(read_whole_blocks_in_place(func))
        return seen[-1]

    monkeypatch.setattr(pipeline, "read_whole_blocks_in_place", spy)
    n, k = 70, 128
    kernel = build_gemm(m, n, k, dtype="int8", target=h.tile_target(threads))
    (func,) = [f for f in seen if "A_pad" in f.script()]
    copies, selects = [], []

    def loop(node):
        stores = []
        tvm_ffi.structural_walk(node.body, [(tvm.tirx.BufferStore, lambda s: stores.append(
            s.buffer.name == "A_pad"))])
        if stores and all(stores):
            copies.append(int(node.extent))

    def call(node):
        if getattr(node.op, "name", "") == "tirx.call_extern" and "tpp_amx_" in str(
                node.args[0]) and len(node.args) > 2:
            selects.append(getattr(node.args[1].op, "name", "") == "prim.if_then_else")

    tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, loop), (tvm.ir.Call, call)])
    whole = m // 32 * 32
    assert copies and copies[-1] == -(-m // 32) * 32 - whole  # the outermost copy loop
    assert selects and all(selects) == (whole > 0)
    rng = np.random.default_rng(m)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    np.testing.assert_array_equal(kernel(a, b), a.astype(np.int64) @ b.astype(np.int64))
