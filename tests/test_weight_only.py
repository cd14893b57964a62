"""Weight-only quantized matmuls: ``com.microsoft:MatMulNBits`` imported
(``frontend/weight_only.py``), rewritten onto the packed-weight kernel
(``relay_passes/weight_only.py``) and the kernel itself (``schedules/weight_only.py``),
against ONNX Runtime and numpy."""

from __future__ import annotations

import copy
import re
from dataclasses import replace

import numpy as np
import onnx
import pytest
import tpp_harness as h
import tvm
from checks import VECTOR_ISA, assert_runs_like_onnxruntime, plain_llvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tpp_tvm
from tpp_tvm.errors import UnsupportedOperatorError, UnsupportedShapeError
from tpp_tvm.frontend import from_onnx
from tpp_tvm.frontend.cleanups import clean_model
from tpp_tvm.frontend.weight_only import unpack_zero_points
from tpp_tvm.intrinsics import amx_emulator
from tpp_tvm.onnxruntime_ref import run_onnxruntime
from tpp_tvm.relay_passes.exprs import bindings
from tpp_tvm.relay_passes.pipeline import tpp_kernel_passes
from tpp_tvm.relay_passes.report import LoweringReport
from tpp_tvm.schedules.gemm_plan import CORE_TABLES
from tpp_tvm.schedules.weight_only import (
    WeightOnlyShape,
    dequantize_reference,
    pack_weights,
    plan,
    tile_k_bytes,
    weight_only_schedule,
)
from tpp_tvm.target import tiles_emulated
from tpp_tvm.tir_pipeline import compile_kernels

requires_ort = pytest.mark.requires_onnxruntime


def _pack_zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """(N, blocks) zero points packed as the spec stores them (the inverse of
    :func:`unpack_zero_points`)."""
    if bits == 8:
        return zp.reshape(-1).astype(np.uint8)
    n, blocks = zp.shape
    padded = np.pad(zp, ((0, 0), (0, blocks % 2))).astype(np.uint8)
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)


def nbits_model(a_shape: list[int], n: int, *, bits: int = 4, block: int = 32,
                zero_points: str | None = None, bias: bool = False, seed: int = 0,
                extra_attrs: dict | None = None, g_idx: np.ndarray | None = None
                ) -> tuple[onnx.ModelProto, dict]:
    """A one-node MatMulNBits model with random codes, scales, and ``zero_points`` None,
    ``"packed"`` (uint8, the spec's packing) or ``"float"`` (one per block, fp32)."""
    rng = np.random.default_rng(seed)
    k = a_shape[-1]
    blocks = -(-k // block)
    codes = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (rng.random((n, blocks), dtype=np.float32) * 0.1 + 0.01).reshape(-1)
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")]
    inputs = ["a", "codes", "scales"]
    unpacked = rng.integers(0, 1 << bits, (n, blocks), dtype=np.uint8)
    if zero_points == "packed":
        inits.append(numpy_helper.from_array(_pack_zero_points(unpacked, bits), "zp"))
    elif zero_points == "float":
        inits.append(numpy_helper.from_array(unpacked.astype(np.float32).reshape(-1), "zp"))
    inputs.append("zp" if zero_points else "")
    if g_idx is not None:
        inits.append(numpy_helper.from_array(g_idx.astype(np.int32), "g_idx"))
    inputs.append("g_idx" if g_idx is not None else "")
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
    inputs.append("bias" if bias else "")
    while inputs[-1] == "":
        inputs.pop()
    attrs = dict(K=k, N=n, bits=bits, block_size=block) | (extra_attrs or {})
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft",
                            name="wq_proj", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*a_shape[:-1], n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32)}
    return model, feeds


# bits, block, A's shape, N, zero points, bias: odd blocks, K % block != 0, 3-D A, rows
# that pad to the chunk, N not whole tiles.
CASES = [
    (4, 16, [1, 40], 24, "packed", True),
    (4, 32, [1, 64], 64, None, False),
    (4, 64, [2, 3, 136], 48, "packed", False),
    (4, 256, [5, 256], 40, "float", True),
    (8, 16, [1, 48], 32, None, True),
    (8, 32, [3, 100], 64, "packed", False),
    (8, 128, [2, 200], 16, None, False),  # ONNX Runtime has no 8-bit fp32 zero points
    (4, 32, [1, 20, 96], 64, "packed", True),  # prefill rows: the panel kernel
]


@requires_ort
@pytest.mark.parametrize("bits, block, a_shape, n, zp, bias", CASES)
def test_matmul_nbits_runs_like_onnxruntime(bits, block, a_shape, n, zp, bias):
    model, feeds = nbits_model(a_shape, n, bits=bits, block=block, zero_points=zp, bias=bias)
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert f"tpp.matmul_int{bits}_weights{'_bias' if bias else ''}: 1" in compiled.report()


@requires_ort
@pytest.mark.parametrize("skip, fused", [("residual_first", True), ("product_first", True),
                                         ("broadcast", False)])
def test_residual_add_fuses_into_the_kernel(skip, fused):
    """``R + MatMulNBits(A)`` (either order) is one kernel adding R in its stores; an add
    that broadcasts (a per-column tensor) stays an add after the kernel."""
    model, feeds = nbits_model([2, 64], 48, bias=True)
    shape = [48] if skip == "broadcast" else [2, 48]
    model.graph.input.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, shape))
    model.graph.output[0].name = "out"
    operands = ["r", "y"] if skip == "residual_first" else ["y", "r"]
    model.graph.node.append(helper.make_node("Add", operands, ["out"]))
    feeds["r"] = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    name = "tpp.matmul_int4_weights_bias" + ("_residual" if fused else "")
    assert f"{name}: 1" in compiled.report()


@requires_ort
def _projections(a_shape: list[int], columns: dict[str, int], more_nodes: list,
                 outputs: list[str], opset: int = 17, **kwargs) -> tuple[onnx.ModelProto, dict]:
    """One model of MatMulNBits nodes reading the same A (:func:`nbits_model`'s, ``kwargs``
    theirs), one per (output name, N) of ``columns``, then ``more_nodes``; ``outputs`` are
    the graph's outputs."""
    nodes, inits, feeds = [], [], None
    for seed, (name, n) in enumerate(columns.items(), 1):
        single, single_feeds = nbits_model(a_shape, n, seed=seed, **kwargs)
        feeds = feeds or single_feeds
        node = single.graph.node[0]
        for t in single.graph.initializer:
            t.name = f"{name}_{t.name}"
        node.input[1:] = [f"{name}_{i}" if i else "" for i in node.input[1:]]
        node.output[0], node.name = name, f"{name}_proj"
        nodes.append(node)
        inits += single.graph.initializer
    graph = helper.make_graph(
        nodes + more_nodes, "projections", [single.graph.input[0]],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   helper.make_opsetid("com.microsoft", 1)]), feeds


#: SwiGLU as exporters write it: ``silu(g) * u``, silu as ``x * sigmoid(x)``; output "y".
SWIGLU = [helper.make_node("Sigmoid", ["g"], ["g_sig"]),
          helper.make_node("Mul", ["g", "g_sig"], ["g_act"]),
          helper.make_node("Mul", ["g_act", "u"], ["y"])]


@pytest.mark.parametrize("a_shape", [[1, 1, 64], [1, 12, 64]])  # a step, a prompt
def test_swiglu_gate_fuses_into_the_up_projection(a_shape):
    """``silu(A Wg) * (A Wu)`` (SwiGLU, ``x * sigmoid(x)`` as exporters write silu): the up
    projection's kernel multiplies by the activated gate in its stores."""
    model, feeds = _projections(a_shape, {"g": 48, "u": 48}, SWIGLU, ["y"])
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert "tpp.matmul_int4_weights_gate: 1" in compiled.report()
    assert "tpp.matmul_int4_weights: 1" in compiled.report()


@requires_ort
@pytest.mark.parametrize("bits, zero_points, bias, level, opset", [
    (4, None, False, 4, 17),       # a decoding step's Q, K, V at int8 activations
    (4, "float", True, 0, 17),     # zero points one per block (fp32), biases
    (8, "packed", False, 0, 11),   # Split's sizes an attribute before opset 13
])
def test_projections_of_one_input_run_as_one_kernel(bits, zero_points, bias, level, opset):
    """Q, K and V of one input (N 48, 16, 16: not whole tiles) run as one packed kernel and
    a split, like ONNX Runtime; SwiGLU's gate and up on the same input stay apart (the gate
    fused into the up projection's stores)."""
    kwargs = dict(bits=bits, zero_points=zero_points, bias=bias,
                  extra_attrs={"accuracy_level": level})
    model, feeds = _projections([1, 3, 64], {"q": 48, "k": 16, "v": 16, "g": 40, "u": 40},
                                SWIGLU, ["q", "k", "v", "y"], opset=opset, **kwargs)
    feeds = {"a": feeds["a"] / 16}  # silu(g) * u of 8-bit codes stays near 1, not 1e3
    cleaned = clean_model(copy.deepcopy(model))
    ops = [node.op_type for node in cleaned.graph.node]
    assert (ops.count("MatMulNBits"), ops.count("Split")) == (3, 1), ops
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    report = compiled.report()
    name = f"tpp.matmul_int{bits}_weights" + ("_bias" if bias else "")
    precision = " [int8]" if level == 4 else ""
    assert f"{name}{precision}: 2" in report, report  # Q, K and V packed; the gate
    assert f"{name}_gate{precision}: 1" in report, report  # the up projection


# bits, block, A's shape, N, zero points: accuracy level 4 (A quantized to int8 per block).
LEVEL4_CASES = [
    (4, 32, [1, 128], 64, None),
    (4, 16, [3, 100], 48, "packed"),
    (8, 64, [2, 200], 32, "packed"),
]


@requires_ort
@pytest.mark.requires_avx512_vnni
@pytest.mark.parametrize("bits, block, a_shape, n, zp", LEVEL4_CASES)
def test_accuracy_level_4_runs_like_onnxruntime(bits, block, a_shape, n, zp):
    """Level 4: A's blocks quantized to int8 as ONNX Runtime's CPU kernel does, the codes
    multiplied on vpdpbusd: ONNX Runtime's results, not the fp32 ones (0.5% apart)."""
    model, feeds = nbits_model(a_shape, n, bits=bits, block=block, zero_points=zp,
                               extra_attrs={"accuracy_level": 4})
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert f"tpp.matmul_int{bits}_weights [int8]: 1" in compiled.report()


def test_accuracy_level_4_on_tvms_path():
    """The imported level-4 form (A quantized and dequantized in Relax) builds on TVM's own
    path too, with the int8-rounded A."""
    model, feeds = nbits_model([2, 72], 24, zero_points="packed", bias=True,
                               extra_attrs={"accuracy_level": 4})
    want = dequantize_reference_for(model, {"a": int8_blocks(feeds["a"], 32)})
    compiled = tpp_tvm.compile_onnx(model, target=plain_llvm(num_cores=1))
    np.testing.assert_allclose(compiled(**feeds)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.requires_avx2
def test_accuracy_level_4_without_int8_dot_products_runs_in_fp32():
    """An AVX2 target has no vpdpbusd: level 4 takes the unquantized A to the fp32 kernel
    (8 lanes), more accurate than the level asks."""
    model, feeds = nbits_model([2, 72], 24, zero_points="packed", bias=True,
                               extra_attrs={"accuracy_level": 4})
    compiled = tpp_tvm.compile_onnx(model, target=tpp_tvm.target("avx2", num_cores=1))
    np.testing.assert_allclose(compiled(**feeds)[0], dequantize_reference_for(model, feeds),
                               rtol=1e-4, atol=1e-4)
    assert "tpp.matmul_int4_weights_bias: 1" in compiled.report()


@requires_ort
@pytest.mark.parametrize("level", [0, pytest.param(4, marks=pytest.mark.requires_avx512_vnni)])
def test_chained_layers(level):
    """Three MatMulNBits in a row (a layer's output is the next one's A, through the
    level-4 quantization too), each onto its own kernel call."""
    rng = np.random.default_rng(5)
    k, block, nodes, inits, x = 64, 32, [], [], "a"
    for i in range(3):
        codes = rng.integers(0, 256, (k, k // block, block // 2), dtype=np.uint8)
        scales = (rng.random(k * k // block, dtype=np.float32) * 0.05).astype(np.float32)
        inits += [numpy_helper.from_array(codes, f"c{i}"),
                  numpy_helper.from_array(scales, f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", [x, f"c{i}", f"s{i}"], [f"y{i}"],
                                      domain="com.microsoft", K=k, N=k, bits=4,
                                      block_size=block, accuracy_level=level, name=f"n{i}"))
        x = f"y{i}"
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, k])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    feeds = {"a": rng.standard_normal((2, k)).astype(np.float32)}
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert "tpp.matmul_int4_weights" in compiled.report()
    assert sum(compiled.report_data["lowered"].values()) == 3


def int8_blocks(a: np.ndarray, block: int) -> np.ndarray:
    """``a`` (M, K) quantized to int8 per row block (max|a| / 127, nearest even) and back."""
    m, k = a.shape
    blocks = -(-k // block)
    tiles = np.pad(a, ((0, 0), (0, blocks * block - k))).reshape(m, blocks, block)
    scale = np.abs(tiles).max(-1, keepdims=True) / np.float32(127)
    codes = np.rint(tiles * (np.float32(1) / np.maximum(scale, np.finfo(np.float32).tiny)))
    return (codes * scale).reshape(m, -1)[:, :k].astype(np.float32)


def _ort_quantized(block: int, symmetric: bool) -> tuple[onnx.ModelProto, dict]:
    quantizer = pytest.importorskip(
        "onnxruntime.quantization.matmul_nbits_quantizer",
        reason="ONNX Runtime's MatMulNBitsQuantizer (needs onnx_ir)")
    rng = np.random.default_rng(3)
    k, n = 96, 64
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="down")]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, k])],
        [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w1"),
         numpy_helper.from_array(rng.standard_normal((n, k)).astype(np.float32), "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    q = quantizer.MatMulNBitsQuantizer(copy.deepcopy(model), block_size=block,
                                       is_symmetric=symmetric)
    q.process()
    return q.model.model, {"x": rng.standard_normal((2, k)).astype(np.float32)}


@requires_ort
@pytest.mark.parametrize("symmetric", [True, False])
def test_onnxruntime_quantizer_output(symmetric):
    model, feeds = _ort_quantized(32, symmetric)
    assert [node.op_type for node in model.graph.node].count("MatMulNBits") == 2
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert "tpp.matmul_int4_weights: 2" in compiled.report()
    assert "tpp_matmul_int4_weights" in " ".join(compiled.report_data["tpp_functions"])


def _constants(mod: tvm.IRModule) -> list[np.ndarray]:
    """The constants the calls of ``mod``'s Relax functions take."""
    found: list[np.ndarray] = []

    def visit(expr) -> None:
        if isinstance(expr, tvm.ir.Constant):
            found.append(expr.value.numpy())
        elif isinstance(expr, relax.Call | relax.Tuple):
            for arg in expr.args if isinstance(expr, relax.Call) else expr.fields:
                visit(arg)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for value in bindings(func).values():
                visit(value)
    return found


def test_weights_stay_packed():
    """The lowered module's weights are the 4-bit bytes (N * K / 2), re-tiled, plus one
    fp32 scale a block: no fp32 copy of W."""
    k, n, block = 256, 64, 32
    model, _ = nbits_model([1, k], n, block=block, zero_points="packed")
    target = tpp_tvm.target(num_cores=1)
    report = LoweringReport()
    with target:
        mod = tvm.transform.Sequential(tpp_kernel_passes(target, report))(from_onnx(model))
    sizes = sorted((c.dtype.name, c.size) for c in _constants(mod) if c.size > 1)
    assert ("uint8", n * k // 2) in sizes, sizes
    assert ("float32", n * k // block) in sizes, sizes  # scales
    assert not any(dtype == "float32" and size >= n * k for dtype, size in sizes), sizes
    assert sum(report.kernels.values()) == 1


def test_plain_llvm_compiles_the_imported_form():
    """TVM's own path (no TPP key) builds the imported ops as they are."""
    model, feeds = nbits_model([2, 72], 24, zero_points="packed", bias=True)
    want = dequantize_reference_for(model, feeds)
    compiled = tpp_tvm.compile_onnx(model, target=plain_llvm(num_cores=1))
    np.testing.assert_allclose(compiled(**feeds)[0], want, rtol=1e-4, atol=1e-4)


def dequantize_reference_for(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """numpy's Y of a :func:`nbits_model` (4 bits, packed zero points, bias)."""
    node = model.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    shape = WeightOnlyShape(m=1, k=attrs["K"], n=attrs["N"], bits=attrs["bits"],
                            block=attrs["block_size"])
    zp = unpack_zero_points(init["zp"], shape.n, shape.blocks, shape.bits)
    w = dequantize_reference(shape, init["codes"], init["scales"].reshape(shape.n, -1), zp)
    return feeds["a"] @ w.T + init["bias"]


def test_g_idx_reordering_is_refused_by_name():
    k, block = 64, 32
    model, _ = nbits_model([1, k], 16, block=block, g_idx=np.arange(k)[::-1] // block)
    with pytest.raises(UnsupportedOperatorError, match="wq_proj.*g_idx"):
        tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))


@requires_ort
def test_default_g_idx_and_accuracy_level_are_taken():
    k, block = 64, 32
    model, feeds = nbits_model([1, k], 16, block=block, g_idx=np.arange(k) // block,
                               extra_attrs={"accuracy_level": 1})
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4)
    assert "tpp.matmul_int4_weights: 1" in compiled.report()


def test_unsupported_bits_are_refused_by_name():
    model, _ = nbits_model([1, 64], 16, bits=4, extra_attrs={"bits": 3})
    with pytest.raises(UnsupportedOperatorError, match="wq_proj.*3-bit"):
        tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))


# m, k, n, bits, block, zero points, bias: rows padded to the chunk, N not whole tiles.
KERNELS = [
    (1, 64, 64, 4, 32, False, False),
    (3, 96, 48, 4, 16, True, True),
    (5, 256, 80, 8, 64, True, False),
    (8, 128, 40, 8, 128, False, True),
    (16, 96, 64, 4, 32, True, True),  # prefill: fp32 panels (int8: more chunks)
    (33, 200, 48, 8, 64, True, False),
]


def _int8_kernel_cases():
    marks = [pytest.mark.requires_avx512_vnni]
    return [pytest.param(*case, True, marks=marks) for case in KERNELS] + \
        [(*case, False) for case in KERNELS]


@pytest.mark.parametrize("m, k, n, bits, block, zp, bias, int8", _int8_kernel_cases())
def test_kernel_against_numpy(m, k, n, bits, block, zp, bias, int8):
    # a residual added (odd rows) or a SwiGLU gate multiplied (4 of 6) in the stores, in
    # a decoding step, chunks and panels
    residual, gated = m % 2 == 1, m in (1, 8, 16, 33)
    shape = WeightOnlyShape(m, k, n, bits, block, zp, bias, int8_activations=int8,
                            residual=residual, gate=gated)
    if int8 and VECTOR_ISA != "avx512":
        pytest.skip(f"int8 activations run on AVX-512 lanes; this host's ISA is {VECTOR_ISA}")
    assert not plan(shape, VECTOR_ISA).on_tiles
    _check_kernel(shape, VECTOR_ISA, tpp_tvm.target(num_cores=1))


# m, k, n, bits, block, zero points, bias: 1, 2 and 4 column tiles; blocks of one tile step
# (16, 24, 32, 64 bytes of K) and of two (128); rows padded to whole tiles; K not whole blocks.
TILE_KERNELS = [
    (40, 256, 64, 4, 32, True, True),
    (33, 200, 48, 8, 64, True, False),
    (16, 96, 80, 4, 16, False, False),
    (70, 384, 128, 8, 128, False, True),
    (20, 72, 32, 4, 24, True, False),
]


@pytest.mark.parametrize("m, k, n, bits, block, zp, bias", TILE_KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
def test_tile_kernel_against_numpy(m, k, n, bits, block, zp, bias, threads):
    """Int8 activations on an AMX target with 16 rows or more: the tile kernel
    (``tdpbssd`` per block; real tiles on an AMX host, else the software tile model),
    against the same numpy reference as the vector kernels; one and two threads (tasks
    that load the tile configuration each)."""
    residual, gated = m % 2 == 1, m in (16, 33)
    shape = WeightOnlyShape(m, k, n, bits, block, zp, bias, int8_activations=True,
                            residual=residual, gate=gated)
    p = plan(shape, "amx")
    assert p.on_tiles and p.rows % 16 == 0 and p.nt == plan(replace(shape, m=1), "amx").nt
    tgt = h.tile_target(threads)
    products = amx_emulator.products() if tiles_emulated(tgt) else None
    _check_kernel(shape, "amx", tgt)
    if products is not None:  # every block, 16 rows and column tile: one product a step
        steps = block // tile_k_bytes(block)
        assert amx_emulator.products() - products == \
            shape.blocks * steps * (p.rows // 16) * (p.cols // 16)


def _check_kernel(shape: WeightOnlyShape, isa: str, tgt: tvm.target.Target,
                  mod: tvm.IRModule | None = None) -> None:
    """Run the kernel of ``shape`` built for ``isa`` (or ``mod``, a form of it) on ``tgt`` on
    random codes, scales, zero points, A (an all-zero block in row 0), bias, residual and
    gate; compare with numpy."""
    m, k, n, bits, block = shape.m, shape.k, shape.n, shape.bits, shape.block
    zp, bias, int8 = shape.zero_points, shape.bias, shape.int8_activations
    residual, gated = shape.residual, shape.gate
    p = plan(shape, isa)
    rng = np.random.default_rng(m * k + n)
    codes = rng.integers(0, 256, (n, shape.blocks, block * bits // 8), dtype=np.uint8)
    scales = rng.standard_normal((n, shape.blocks)).astype(np.float32)
    zps = rng.integers(0, 1 << bits, (n, shape.blocks), dtype=np.uint8) if zp else None
    b = rng.standard_normal(n).astype(np.float32)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[0, :block] = 0  # an all-zero block: scale 0 for int8 activations
    a_used = int8_blocks(a, block) if int8 else a
    r, g = rng.standard_normal((2, m, n)).astype(np.float32)
    want = a_used @ dequantize_reference(shape, codes, scales, zps).T + (b if bias else 0) \
        + (r if residual else 0)
    if gated:
        want = want * g / (1 + np.exp(-g))
    packed, tile_scales, tile_zps = pack_weights(shape, p, codes, scales, zps)
    assert packed.nbytes == p.cols * shape.blocks * block * bits // 8  # same bytes, tiled
    args = [np.pad(a, ((0, p.rows - m), (0, p.depth - k))), packed, tile_scales]
    args += [tile_zps] if zp else []
    args += [np.pad(b, (0, p.cols - n))] if bias else []
    args += [np.pad(x, ((0, p.rows - m), (0, p.cols - n)))
             for x, given in ((r, residual), (g, gated)) if given]
    out = tvm.runtime.tensor(np.zeros((p.rows, p.cols), np.float32))
    lib = compile_kernels(mod or weight_only_schedule(shape, isa).mod, tgt).jit()
    lib["main"](*[tvm.runtime.tensor(x) for x in args], out)
    if tiles_emulated(tgt):
        amx_emulator.check(f"the weight-only tile kernel {shape}")
    np.testing.assert_allclose(out.numpy()[:m, :n], want, rtol=1e-4,
                               atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.requires_avx512
def test_kernel_unpacks_in_registers():
    """AVX-512: a 64-byte line of 4-bit codes per step, widened (vpmovzxbd, vcvtdq2ps) and
    multiplied in 16-lane FMAs; no scalar loop over the codes."""
    shape = WeightOnlyShape(1, 256, 128, 4, 32)
    asm = compile_kernels(weight_only_schedule(shape, "avx512").mod,
                          tpp_tvm.target(num_cores=1)).jit().inspect_source("asm")
    # any of the three FMA operand orders (LLVM picks 213 for Zen 4, 231 for Intel)
    assert re.search(r"vfmadd(132|213|231)ps\s+%zmm", asm)
    assert "vpmovzxbd" in asm and "vcvtdq2ps" in asm


@pytest.mark.requires_avx512_vnni
def test_int8_kernel_uses_vpdpbusd():
    """Int8 activations: each 64-byte vector of codes (16 columns x 4 k, or x 8 k in
    nibbles) is one or two vpdpbusd against 4 of A's int8 codes broadcast."""
    shape = WeightOnlyShape(1, 256, 128, 4, 32, int8_activations=True)
    asm = compile_kernels(weight_only_schedule(shape, "avx512").mod,
                          tpp_tvm.target(num_cores=1)).jit().inspect_source("asm")
    assert "vpdpbusd" in asm


def test_tile_kernel_assembly():
    """Compiled for an AMX CPU (``mcpu=sapphirerapids``, on any host): the tile
    configuration loaded and released once per task, ``tdpbssd`` on the tiles (one per
    column tile and row chunk; the chunk loop unrolled), no ``vpdpbusd`` left, the int32
    tiles scaled on zmm registers; a decoding step on the same target stays on vpdpbusd."""
    shape = WeightOnlyShape(64, 1024, 1024, 4, 32, int8_activations=True)
    tgt = tpp_tvm.target("amx", num_cores=2)
    asm = compile_kernels(weight_only_schedule(shape, "amx").mod, tgt).jit().inspect_source(
        "asm")

    def count(mnemonic):
        return len(re.findall(rf"^\s*{mnemonic}\b", asm, re.M))

    assert count("ldtilecfg") == 1 and count("tilerelease") == 1
    assert count("tdpbssd") >= 4 and count("tdpbssd") % 4 == 0
    assert count("tilestored") == count("tdpbssd") and count("vpdpbusd") == 0
    assert re.search(r"tdpbssd\s+%tmm\d, %tmm\d, %tmm\d", asm)
    assert re.search(r"vcvtdq2ps\s+[^\n]*%zmm", asm)
    step = WeightOnlyShape(1, 1024, 1024, 4, 32, int8_activations=True)
    assert not plan(step, "amx").on_tiles and not plan(replace(shape, m=15), "amx").on_tiles
    step_asm = compile_kernels(weight_only_schedule(step, "amx").mod, tgt).jit()\
        .inspect_source("asm")
    assert "vpdpbusd" in step_asm and "tdpbssd" not in step_asm


@requires_ort
@pytest.mark.parametrize("bits, block, zp", [(4, 32, None), (8, 64, "packed")])
def test_accuracy_level_4_prompts_run_on_tiles_like_onnxruntime(bits, block, zp):
    """A level-4 MatMulNBits of a 40-token prompt on an AMX target runs on the tile kernel
    (real tiles on an AMX host, else the tile model) and gives ONNX Runtime's results."""
    model, feeds = nbits_model([1, 40, 256], 96, bits=bits, block=block, zero_points=zp,
                               extra_attrs={"accuracy_level": 4})
    tgt = h.tile_target(1)
    compiled = assert_runs_like_onnxruntime(model, feeds, rtol=1e-4, atol=1e-4, target=tgt)
    assert f"tpp.matmul_int{bits}_weights_tiles [int8]: 1" in compiled.report(), \
        compiled.report()
    if tiles_emulated(tgt):
        amx_emulator.check("a level-4 prompt on tiles")


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_kernel_has_an_any_cpu_form(bits):
    """The decoding step's vpdpbusd in generic form (what an emulated AMX target compiles it
    to on a host without AVX512_VNNI) computes what the instruction does: against numpy,
    on the host's vector unit."""
    import tvm_ffi

    from tpp_tvm.intrinsics import vector_math

    shape = WeightOnlyShape(3, 96, 48, bits, 32, True, True, int8_activations=True)

    def generic(call):
        form = vector_math.generic_form(call)
        return call if form is None else form

    func = weight_only_schedule(shape, "avx512").mod["main"]
    func = func.with_body(tvm_ffi.structural_map(func.body, [(tvm.ir.Call, generic)]))
    assert "vpdpbusd" not in func.script()
    _check_kernel(shape, "avx512", tpp_tvm.target(num_cores=1), tvm.IRModule({"main": func}))


@pytest.mark.requires_avx512_vnni
def test_prefetch_distance_follows_the_core_family():
    """The codes are prefetched into L2 ahead of their loads only where the core family's
    table asks for it (Intel's 8 KiB; none on Zen, whose own prefetcher streams faster)."""
    shape = WeightOnlyShape(1, 256, 128, 4, 32, int8_activations=True)

    def asm(prefetch_bytes):
        return compile_kernels(weight_only_schedule(shape, "avx512", prefetch_bytes).mod,
                               tpp_tvm.target(num_cores=1)).jit().inspect_source("asm")

    assert "prefetcht1" in asm(8192)
    assert "prefetch" not in asm(0)
    assert CORE_TABLES["intel"].stream_prefetch_bytes == 8192
    assert CORE_TABLES["zen"].stream_prefetch_bytes == 0


def test_shape_checks():
    with pytest.raises(UnsupportedShapeError, match="3-bit"):
        WeightOnlyShape(1, 64, 16, bits=3)
    with pytest.raises(UnsupportedShapeError, match="scalable"):
        plan(WeightOnlyShape(1, 64, 16), "sve")


def test_zero_point_packing_round_trips():
    rng = np.random.default_rng(0)
    for bits, blocks in ((4, 5), (4, 6), (8, 3)):
        zp = rng.integers(0, 1 << bits, (7, blocks), dtype=np.uint8)
        packed = _pack_zero_points(zp, bits)
        assert packed.size == 7 * -(-blocks * bits // 8)
        np.testing.assert_array_equal(unpack_zero_points(packed, 7, blocks, bits), zp)


@requires_ort
def test_reference_matches_onnxruntime():
    """The numpy reference the kernel test trusts is ONNX Runtime's math."""
    model, feeds = nbits_model([2, 72], 24, zero_points="packed", bias=True)
    np.testing.assert_allclose(dequantize_reference_for(model, feeds),
                               run_onnxruntime(model, feeds)[0], rtol=1e-4, atol=1e-4)


def _blockwise_model(dtype: int, k: int, n: int, block: int, zp: bool, transposed: bool
                     ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``y = x @ DequantizeLinear(W)`` in the ONNX standard form (opset 21's blocked
    DequantizeLinear), W (K, N) blocked along K, or (N, K) at axis 1 then transposed."""
    rng = np.random.default_rng(5)
    lo, hi = {TensorProto.INT4: (-8, 8), TensorProto.UINT4: (0, 16),
              TensorProto.INT8: (-128, 128), TensorProto.UINT8: (0, 256)}[dtype]
    blocks = -(-k // block)
    shape, scale_shape = ((n, k), (n, blocks)) if transposed else ((k, n), (blocks, n))
    codes = rng.integers(lo, hi, shape)
    inits = [helper.make_tensor("w", dtype, shape, codes.reshape(-1).tolist()),
             numpy_helper.from_array(
                 (rng.random(scale_shape) * 0.05 + 0.01).astype(np.float32), "s")]
    dq_inputs = ["w", "s"]
    if zp:
        inits.append(helper.make_tensor("z", dtype, scale_shape,
                                        rng.integers(lo, hi, scale_shape).reshape(-1).tolist()))
        dq_inputs.append("z")
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["wf"], axis=int(transposed),
                              block_size=block)]
    if transposed:
        nodes.append(helper.make_node("Transpose", ["wf"], ["wt"], perm=[1, 0]))
    nodes.append(helper.make_node("MatMul", ["x", "wt" if transposed else "wf"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [3, k])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return model, {"x": rng.standard_normal((3, k)).astype(np.float32)}


@requires_ort
@pytest.mark.parametrize(("dtype", "block", "zp", "transposed"), [
    (TensorProto.INT4, 32, False, False), (TensorProto.UINT4, 16, True, False),
    (TensorProto.INT4, 64, True, True), (TensorProto.INT8, 32, False, False),
    (TensorProto.UINT8, 128, True, True)])
def test_blockwise_dequantize_linear_runs_on_the_weight_only_kernel(dtype, block, zp,
                                                                     transposed):
    """The ONNX standard form of a weight-only matmul (int4/uint4/int8/uint8 W with a
    blocked scale and zero point) imports as MatMulNBits on the same codes: against ONNX
    Runtime on the original model, on the weight-only kernel (K not a whole number of
    blocks for the 64 and 128 cases)."""
    import onnxruntime as ort

    model, feeds = _blockwise_model(dtype, 200, 48, block, zp, transposed)
    # ONNX Runtime fuses the form into MatMulNBits at accuracy level 4 (A quantized to
    # int8) unless told otherwise; the standard's meaning is level 0's exact weights.
    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    want = ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    compiled = tpp_tvm.compile_onnx(model, target=tpp_tvm.target(num_cores=1))
    np.testing.assert_allclose(compiled(**feeds)[0], want, rtol=1e-4, atol=1e-4)
    bits = 4 if dtype in (TensorProto.INT4, TensorProto.UINT4) else 8
    assert f"tpp.matmul_int{bits}_weights: 1" in compiled.report(), compiled.report()


def test_per_channel_dequantize_linear_stays_a_dequantization():
    """Only blocked weights are rewritten: a per-channel int8 weight (no block_size) keeps
    its DequantizeLinear (the int8 patterns' input)."""
    from tpp_tvm.frontend.weight_only import blockwise_matmuls_as_nbits

    model, _ = _blockwise_model(TensorProto.INT8, 64, 16, 32, False, False)
    dq = model.graph.node[0]
    del dq.attribute[:]
    dq.attribute.extend([helper.make_attribute("axis", 1)])
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(
        np.full(16, 0.02, np.float32), "s"))
    assert blockwise_matmuls_as_nbits(model) == 0
    assert [node.op_type for node in model.graph.node] == ["DequantizeLinear", "MatMul"]
