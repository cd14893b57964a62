"""Tests of the MetaSchedule TPP rules: contraction recognition, element-wise matching, and
the design spaces they generate (built and checked against numpy, no measuring)."""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms

import tpp_tvm
from tpp_tvm.intrinsics import TPPSpec
from tpp_tvm.schedules.contraction import contraction_roles
from tpp_tvm.schedules.elementwise import LEGALIZE_AS_TPP, candidate_steps, match_equation
from tpp_tvm.schedules.tuning_rules import (
    default_postprocs,
    k_blocks,
    register_tiles,
    register_trace_intrinsics,
    space_generator,
)
from tpp_tvm.target import isa_of

TARGET = tpp_tvm.target(num_cores=1)


def _matmul(m, n, k, batch=None):
    lead = (batch,) if batch else ()
    A = te.placeholder((*lead, m, k), name="A")
    B = te.placeholder((*lead, k, n), name="B")
    r = te.reduce_axis((0, k), "k")
    C = te.compute((*lead, m, n), lambda *ix: te.sum(
        A[(*ix[:-2], ix[-2], r)] * B[(*ix[:-2], r, ix[-1])], axis=r), name="C")
    return [A, B], C


def _conv_nhwc(h, w, c, oc, r, s, stride=1):
    """A stride-``stride`` NHWC convolution on an already padded input, as users write it."""
    X = te.placeholder((1, h, w, c), name="X")
    W = te.placeholder((r, s, c, oc), name="W")
    kr, ks, kc = te.reduce_axis((0, r), "kr"), te.reduce_axis((0, s), "ks"), te.reduce_axis(
        (0, c), "kc")
    oh, ow = (h - r) // stride + 1, (w - s) // stride + 1
    Y = te.compute((1, oh, ow, oc), lambda n, y, x, o: te.sum(
        X[n, y * stride + kr, x * stride + ks, kc] * W[kr, ks, kc, o], axis=[kr, ks, kc]),
        name="conv")
    return [X, W], Y


def _roles(tensors, out, name):
    sch = Schedule(te.create_prim_func([*tensors, out]))
    return contraction_roles(sch, sch.get_sblock(name))


def test_roles_of_matmul_batched_matmul_conv_and_user_contraction():
    roles = _roles(*_matmul(64, 96, 128), "C")
    assert (roles.m, roles.n, roles.k, roles.batch) == ((0,), (1,), (2,), ())
    roles = _roles(*_matmul(32, 48, 64, batch=3), "C")
    assert (roles.batch, roles.inner_m, roles.inner_n, roles.inner_k) == ((0,), 1, 2, 3)
    roles = _roles(*_conv_nhwc(10, 10, 16, 32, 3, 3), "conv")
    assert roles.inner_m == 2 and roles.inner_n == 3 and roles.k == (4, 5, 6)
    assert roles.inner_k == 6 and roles.m == (0, 1, 2)  # batch n, rows y, columns x
    # A user's contraction over two axes: C[i, j] = sum_{a,b} A[i, a, b] * B[a, b, j].
    A = te.placeholder((16, 4, 8), name="A")
    B = te.placeholder((4, 8, 32), name="B")
    a, b = te.reduce_axis((0, 4), "a"), te.reduce_axis((0, 8), "b")
    C = te.compute((16, 32), lambda i, j: te.sum(A[i, a, b] * B[a, b, j], axis=[a, b]),
                   name="user")
    roles = _roles([A, B], C, "user")
    assert roles.k == (2, 3) and roles.inner_k == 3


def test_non_contractions_are_not_matched():
    A = te.placeholder((16, 32), name="A")
    relu = te.compute((16, 32), lambda i, j: tirx.max(A[i, j], 0.0), name="relu")
    assert _roles([A], relu, "relu") is None
    r = te.reduce_axis((0, 32), "r")
    sums = te.compute((16,), lambda i: te.sum(A[i, r], axis=r), name="sum")
    assert _roles([A], sums, "sum") is None
    # A transposed operand (B indexed [n, k]) has no unit-stride N: not for the BRGEMM TPP.
    B = te.placeholder((48, 32), name="B")
    k = te.reduce_axis((0, 32), "k")
    C = te.compute((16, 48), lambda i, j: te.sum(A[i, k] * B[j, k], axis=k), name="nt")
    assert _roles([A, B], C, "nt") is None


def test_register_tiles_and_k_blocks():
    tiles = register_tiles(512, 512)
    assert tiles[0] == (4, 64)  # the best measured tile that divides 512 x 512
    for mr, nr in register_tiles(49, 1000, limit=10):
        assert 49 % mr == 0 and 1000 % nr == 0 and (mr + 1) * -(-nr // 16) <= 32
    assert k_blocks(64) == [64] and k_blocks(768)[0] == 256 and k_blocks(1) == []


def _designs(func):
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target=TARGET, space_generator=space_generator(TARGET),
                         search_strategy="replay-trace", task_name="t")
    return ctx.generate_design_space()


def _tensorized(sch) -> list[str]:
    return [str(i.attrs[0]) for i in sch.trace.insts if i.kind.name == "Tensorize"]


def _run(sch, arrays):
    for post in default_postprocs():
        assert post.apply(sch)
    rt = tvm.compile(sch.mod, target=TARGET).jit()
    args = [tvm.runtime.tensor(a) for a in arrays]
    rt(*args)
    return args[-1].numpy()


def test_matmul_designs_tensorize_and_compute_the_product():
    rng = np.random.default_rng(0)
    tensors, C = _matmul(48, 96, 512)
    bias = te.placeholder((96,), name="bias")
    out = te.compute(C.shape, lambda i, j: tirx.max(C[i, j] + bias[j], 0.0), name="epi")
    spaces = _designs(te.create_prim_func([*tensors, bias, out]))
    assert spaces and all(any(n.startswith("tpp.gemm.f32") for n in _tensorized(s))
                          for s in spaces)
    # The bias + relu epilogue became one equation TPP per tile.
    assert any(f"tpp.equation.f32.{isa_of(TARGET)}" in n and n.endswith("bias_relu")
               for n in _tensorized(spaces[0]))
    a, b = rng.standard_normal((48, 512), "float32"), rng.standard_normal((512, 96), "float32")
    bb = rng.standard_normal(96).astype("float32")
    ref = np.maximum(a @ b + bb, 0)
    for sch in spaces[:: max(1, len(spaces) // 4)]:  # a spread of tiles and loop orders
        got = _run(sch, [a, b, bb, np.zeros((48, 96), "float32")])
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


def _packing_blocks(sch) -> list[str]:
    return [str(i.kind.name) for i in sch.trace.insts
            if i.kind.name == "Annotate" and "layout_rewrite_preproc" in str(i.attrs)]


def test_weights_are_packed_into_panels_only_when_layout_free():
    rng = np.random.default_rng(1)
    tensors, C = _matmul(32, 96, 128)
    func = te.create_prim_func([*tensors, C])
    assert not any(_packing_blocks(s) for s in _designs(func))  # B may be an activation
    packed = _designs(func.with_attr("layout_free_buffers", [1]))
    assert packed and all(_packing_blocks(s) for s in packed)
    a, b = rng.standard_normal((32, 128), "float32"), rng.standard_normal((128, 96), "float32")
    for sch in packed[:: max(1, len(packed) // 3)]:
        # With the packing block in place the kernel still computes A @ B from unpacked B...
        got = _run(sch.copy(), [a, b, np.zeros((32, 96), "float32")])
        np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-3)
        # ...and as tuning times it, B arrives in (N/nr, K, nr) panels.
        for post in default_postprocs():
            assert post.apply(sch)
        mod = tvm.s_tir.transform.RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(
            sch.mod)
        shape = [int(d) for d in mod["main"].params[1].ty.shape]
        nr = shape[-1]
        panels = b.reshape(128, 96 // nr, nr).transpose(1, 0, 2).copy()
        assert shape == list(panels.shape)
        rt = tvm.compile(mod, target=TARGET).jit()
        args = [tvm.runtime.tensor(x) for x in (a, panels, np.zeros((32, 96), "float32"))]
        rt(*args)
        np.testing.assert_allclose(args[-1].numpy(), a @ b, rtol=1e-4, atol=1e-3)


def test_narrow_output_rows_also_get_the_stock_tiling():
    """N = 28 (an NCHW convolution's pixel row) fills no whole vector: the stock tiling's
    designs compete with the TPP ones; with N = 96 only TPP designs are offered."""
    def designs(n):
        tensors, out = _matmul(64, n, 64)
        return _designs(te.create_prim_func([*tensors, out]))

    kinds = {any(n.startswith("tpp.gemm") for n in _tensorized(s)) for s in designs(28)}
    assert kinds == {True, False}
    assert all(any(n.startswith("tpp.gemm") for n in _tensorized(s)) for s in designs(96))


def test_conv_design_tensorizes_filter_taps_as_gemm_calls():
    rng = np.random.default_rng(1)
    tensors, Y = _conv_nhwc(10, 10, 16, 32, 3, 3)
    spaces = _designs(te.create_prim_func([*tensors, Y]))
    assert spaces and _tensorized(spaces[0])
    x = rng.standard_normal((1, 10, 10, 16), "float32")
    w = rng.standard_normal((3, 3, 16, 32), "float32")
    ref = np.zeros((1, 8, 8, 32), "float32")
    for r in range(3):
        for s in range(3):
            ref[0] += x[0, r:r + 8, s:s + 8, :] @ w[r, s]
    got = _run(spaces[-1], [x, w, np.zeros_like(ref)])
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.requires_torch  # the model generator exports from torch
def test_a_models_convolution_tasks_get_tpp_designs():
    """The pipeline lays filters out HWIO (N innermost), so the convolution subgraphs a
    model is tuned on are contractions for the TPP rule, not left to the stock tiling."""
    from tpp_tvm import models
    from tpp_tvm.tuning.tasks import subgraph_tasks

    mod = tpp_tvm.from_onnx(models.small_cnn(batch=1, image=16, channels=(16, 32)))
    tasks = [t for t in subgraph_tasks(mod, tpp_tvm.target(num_cores=1), None)
             if "conv2d" in t.name]
    assert tasks
    for task in tasks:
        assert any(n.startswith("tpp.gemm") for s in _designs(task.func)
                   for n in _tensorized(s)), task.name


def test_padded_conv_gets_brgemm_over_filter_rows_designs():
    """A 3x3 convolution on a padded copy of its input, filter layout-free: designs with
    the hand schedule's kernel (conv BRGEMM over filter rows, K = taps x channels, the tile
    in registers) join the GEMM-per-tap ones, and all compute the convolution + ReLU."""
    from tvm import topi

    rng = np.random.default_rng(3)
    X = te.placeholder((1, 10, 12, 16), name="X")
    W = te.placeholder((3, 3, 16, 32), name="W")
    conv = topi.nn.conv2d_nhwc(X, W, 1, 1, 1)
    Y = te.compute(conv.shape, lambda *i: tirx.max(conv(*i), 0.0), name="relu")
    func = te.create_prim_func([X, W, Y]).with_attr("layout_free_buffers", [1])
    spaces = _designs(func)
    taps = [s for s in spaces if any(n.startswith("tpp.conv_brgemm.f32")
                                     for n in _tensorized(s))]
    assert taps and len(taps) < len(spaces)
    x = rng.standard_normal((1, 10, 12, 16), "float32")
    w = rng.standard_normal((3, 3, 16, 32), "float32")
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    ref = np.zeros((1, 10, 12, 32), "float32")
    for r in range(3):
        for s_ in range(3):
            ref[0] += xp[0, r:r + 10, s_:s_ + 12, :] @ w[r, s_]
    ref = np.maximum(ref, 0)
    for space in (taps[0], taps[-1], spaces[0]):
        got = _run(space, [x, w, np.zeros_like(ref)])
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


def test_strided_conv_falls_back_to_stock_tiling():
    tensors, Y = _conv_nhwc(11, 11, 8, 16, 3, 3, stride=2)
    spaces = _designs(te.create_prim_func([*tensors, Y]))
    assert spaces and not any(_tensorized(s) for s in spaces)


def _block_steps(expr_fn, extra):
    X = te.placeholder((8, 32), name="X")
    out = te.compute((8, 32), lambda i, j: expr_fn(X, *extra, i, j), name="eq")
    sch = Schedule(te.create_prim_func([X, *extra, out]))
    found = match_equation(sch, sch.get_sblock("eq"))
    return None if found is None else found[0]


def test_elementwise_blocks_match_tpp_equations():
    bias = te.placeholder((32,), name="bias")
    res = te.placeholder((8, 32), name="res")
    assert _block_steps(lambda X, b, i, j: tirx.max(X[i, j] + b[j], 0.0), [bias]) == (
        "bias", "relu")
    assert _block_steps(lambda X, b, r, i, j: X[i, j] + b[j] + r[i, j], [bias, res]) == (
        "bias", "residual")
    assert _block_steps(lambda X, i, j: tirx.tanh(X[i, j]), []) == ("tanh",)
    assert _block_steps(lambda X, i, j: X[i, j] * X[i, j] + 1.0, []) is None
    assert ("bias", "gelu", "residual", "relu") in candidate_steps()


def test_gelu_is_legalized_with_the_tpp_formula():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 32), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.nn.gelu(x)))
    mod = relax.transform.LegalizeOps(LEGALIZE_AS_TPP)(bb.get())
    func = next(f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))
    sch = Schedule(func)
    blk = next(b for b in sch.get_child_blocks(sch.get_sblock("root")))
    assert match_equation(sch, blk)[0] == ("gelu",)


def test_trace_intrinsic_names_register_from_the_name():
    from tpp_tvm.intrinsics.registry import _names

    specs = [TPPSpec("gemm", m=7, n=48, k=96, beta=1), TPPSpec("gemm", m=3, n=40, k=64, beta=0),
             TPPSpec("equation", m=5, n=24, steps=("bias", "gelu_tanh"))]
    names = [s.name(checks.VECTOR_ISA) for s in specs]
    for n in names:
        _names.pop(n, None)
    register_trace_intrinsics(names)
    assert all(n in _names for n in names)
    assert tvm.s_tir.TensorIntrin.get(names[2]) is not None


def test_trace_intrinsics_of_any_tpp_and_dtype_register_from_the_name():
    """Names are read back with ``TPPSpec.from_name``: low precision, layout TPPs and the
    chain gelu then tanh (not gelu_tanh) come back as exactly their specs."""
    from tpp_tvm.intrinsics.registry import _names

    specs = [TPPSpec("gemm", "bfloat16", m=6, n=32, k=64, beta=0),
             TPPSpec("gemm", "uint8", b_dtype="int8", m=4, n=32, k=64),
             TPPSpec("transpose", m=8, n=16),
             TPPSpec("equation", m=4, n=16, steps=("gelu", "tanh"))]
    names = [s.name("avx512") for s in specs]  # registered, never run: any host
    for n in names:
        _names.pop(n, None)
    register_trace_intrinsics([*names, "tpp.dense", "tpp.gemm.f32.avx512"])
    assert [_names[n][0] for n in names] == specs


def test_row_reductions_become_reduce_tpps():
    X = te.placeholder((6, 4, 96), name="X")
    j = te.reduce_axis((0, 96), "j")
    S = te.compute((6, 4), lambda a, b: te.sum(X[a, b, j] * X[a, b, j], axis=j), name="sumsq")
    spaces = _designs(te.create_prim_func([X, S]))
    assert any("reduce_sumsq_cols" in n for n in _tensorized(spaces[0]))
    x = np.random.default_rng(2).standard_normal((6, 4, 96)).astype("float32")
    got = _run(spaces[0], [x, np.zeros((6, 4), "float32")])
    np.testing.assert_allclose(got, (x * x).sum(-1), rtol=1e-5)


def test_standalone_elementwise_block_becomes_an_equation_tpp():
    X = te.placeholder((4, 16, 96), name="X")
    bias = te.placeholder((96,), name="bias")
    Y = te.compute((4, 16, 96), lambda a, i, j: tirx.max(X[a, i, j] + bias[j], 0.0), name="act")
    spaces = _designs(te.create_prim_func([X, bias, Y]))
    assert any(n.endswith("bias_relu") for n in _tensorized(spaces[0]))
    rng = np.random.default_rng(3)
    x, b = rng.standard_normal((4, 16, 96), "float32"), rng.standard_normal(96).astype("float32")
    got = _run(spaces[0], [x, b, np.zeros_like(x)])
    np.testing.assert_allclose(got, np.maximum(x + b, 0), rtol=1e-6)
