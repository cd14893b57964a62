"""The "tpp" TIR pipeline keeps a tile's intermediates on the stack.

A GEMM with a fused epilogue allocates its C tile (and, for int8, the dequantized tile)
inside the parallel tile loop. TVM's default lowering turns each into a workspace
allocation per tile; the "tpp" pipeline must leave none in the tile loop, and the kernel
must still compute the same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tpp_tvm.kernels import build_gemm
from tpp_tvm.target import host_isa, target
from tpp_tvm.tir_pipeline import PIPELINE, STACK_LIMIT_BYTES, compile_kernels

#: An AVX-512 target with BF16 and VNNI: the host's where it has them, else one for a CPU
#: that does (Cooper Lake), whose kernels are compiled and inspected here, never run.
TGT = (target("avx512", num_cores=2) if host_isa().avx512_bf16 and host_isa().avx512_vnni
       else tvm.target.Target({"tag": "tpp/avx512", "mcpu": "cooperlake", "num-cores": 2}))


def _workspace_uses(mod: tvm.IRModule, **kwargs) -> int:
    """References to TVM's workspace allocator in the LLVM IR (calls, plus its declaration)."""
    ll = tvm.compile(mod, target=TGT, **kwargs).mod.inspect_source("ll")
    return ll.count("@__TVMBackendAllocWorkspace")


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_tile_buffers_leave_the_workspace_allocator(dtype: str) -> None:
    kw = {"dequantize": True} if dtype == "int8" else {}
    gemm = build_gemm(64, 256, 128, dtype, target=TGT, bias=True, activation="gelu", **kw)
    # The default lowering allocates the per-tile buffers from the workspace pool...
    assert _workspace_uses(gemm.schedule.mod) > 0
    # ...the tpp pipeline keeps every one of them on the stack.
    assert _workspace_uses(gemm.schedule.mod, tir_pipeline=PIPELINE) == 0


@pytest.mark.requires_avx512_vnni
def test_gemm_with_epilogue_matches_numpy_through_the_pipeline() -> None:
    rng = np.random.default_rng(0)
    m, n, k = 37, 200, 96
    gemm = build_gemm(m, n, k, "int8", target=TGT, bias=True, activation="relu",
                      dequantize=True)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    bias = rng.standard_normal(n).astype(np.float32)
    scale = np.full(n, 1e-4, np.float32)
    got = gemm(a, b, bias, scale=scale, offset=np.zeros(n, np.float32))
    want = np.maximum((a.astype(np.int64) @ b.astype(np.int64)) * 1e-4 + bias, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_large_buffers_still_use_the_workspace() -> None:
    """A buffer above the stack limit is left to TVM (a worker's stack is finite)."""
    from tvm import te

    n = STACK_LIMIT_BYTES // 4 + 16
    x = te.placeholder((n,), "float32", name="x")
    tmp = te.compute((n,), lambda i: x[i] * 2.0, name="tmp")
    y = te.compute((n,), lambda i: tmp[n - 1 - i] + 1.0, name="y")
    exe = compile_kernels(te.create_prim_func([x, y]), target(num_cores=2))
    assert "TVMBackendAllocWorkspace@GOTPCREL" in exe.mod.inspect_source("asm")
    lib = exe.jit()
    xs = np.arange(n, dtype=np.float32)
    out = tvm.runtime.tensor(np.zeros(n, np.float32))
    lib["main"](tvm.runtime.tensor(xs), out)
    np.testing.assert_allclose(out.numpy(), xs[::-1] * 2 + 1)


def test_bf16_gemm_keeps_its_vector_temporary_with_tvm() -> None:
    """The measured exception: with the bf16 dot kernel inlined, a promoted one-vector
    temporary made LLVM rotate every hoisted constant through registers (3x slower GELU
    epilogue), so there it stays where TVM puts it; the C tile still leaves the pool."""
    gemm = build_gemm(64, 256, 128, "bfloat16", target=TGT, bias=True, activation="gelu")
    default = _workspace_uses(gemm.schedule.mod)
    tpp = _workspace_uses(gemm.schedule.mod, tir_pipeline=PIPELINE)
    assert 0 < tpp < default


def _vectorized_map(fn):
    from tvm import s_tir, te

    x = te.placeholder((8, 256), "float32", name="x")
    y = te.compute(x.shape, lambda i, j: fn(x[i, j] - 0.5), name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    _, j = sch.get_loops(sch.get_sblock("y"))
    sch.vectorize(sch.split(j, [None, 16])[1])
    return sch.mod


@pytest.mark.parametrize("name", ["exp", "tanh", "erf", "sigmoid"])
def test_transcendentals_lower_to_simd_not_libm(name: str) -> None:
    """Vectorized exp/tanh/erf outside a TPP become vector_math SIMD in the tpp pipeline
    (no per-lane libm call), accurate to fp32; TVM's own pipeline keeps its lowering."""
    import math
    import re

    fn = getattr(tvm.tirx, name)
    ref = {"exp": np.exp, "tanh": np.tanh, "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
           "erf": np.vectorize(math.erf)}[name]
    tgt = target(num_cores=1)
    lib = compile_kernels(_vectorized_map(fn), tgt)
    a = np.random.default_rng(0).standard_normal((8, 256)).astype("float32") * 6
    out = tvm.runtime.tensor(np.zeros_like(a))
    lib["main"](tvm.runtime.tensor(a), out)
    expected = ref(a.astype("float64") - 0.5)
    assert np.abs(out.numpy() - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())
    libm = re.compile(r"call\w*\s+(expf|tanhf|erff)\b")
    assert not libm.search(lib.mod.inspect_source("asm"))
    plain = tvm.compile(_vectorized_map(fn), target=tgt)
    assert libm.search(plain.mod.inspect_source("asm")), "TVM's own build changed too"


def _halve(rows: int, width: int, parallel: bool = True) -> tvm.IRModule:
    """y = x / 2 as a (parallel) loop over rows: a result below 2^-126 is denormal."""
    from tvm import te

    x = te.placeholder((rows, width), "float32", name="x")
    y = te.compute((rows, width), lambda i, j: x[i, j] * tvm.tirx.const(0.5, "float32"), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    i, _ = sch.get_loops(sch.get_sblock("y"))
    if parallel:
        sch.parallel(i)
    return sch.mod


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_flush_denormals_and_restore_the_callers_mode(threads: int) -> None:
    """A tpp kernel runs with FTZ/DAZ (a denormal operand costs a microcode assist: a Swin
    window-attention matmul on softmax outputs of a -100 mask ran 80x slower); the calling
    thread gets its own floating-point mode back. One thread: the kernel's body on the
    calling thread; two: also every parallel iteration on the worker that runs it."""
    lib = compile_kernels(_halve(37, 64, parallel=threads > 1), target(num_cores=threads))
    tiny = np.float32(2.0**-130)  # denormal in, denormal (halved) out under IEEE rules
    x = np.full((37, 64), tiny, "float32")
    x[::2] = 3.0  # rows of normal numbers stay exact
    out = tvm.runtime.tensor(np.ones_like(x))
    lib["main"](tvm.runtime.tensor(x), out)
    y = out.numpy()
    assert np.all(y[1::2] == 0), "a denormal survived in some task"
    assert np.all(y[::2] == 1.5)
    # The caller's IEEE mode is back: numpy still computes the denormal.
    assert (np.array([tiny]) * np.float32(0.5))[0] == np.float32(2.0**-131)
    if threads > 1:
        asm = lib.mod.inspect_source("asm")
        assert asm.count("ldmxcsr") >= 3  # set and restore per call, kept set per iteration


def test_non_x86_kernels_keep_ieee_denormals() -> None:
    """The flush is x86's MXCSR: an AArch64 kernel is left as it is."""
    from tpp_tvm.tir_pipeline import flush_denormals

    mod = _halve(4, 16)
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "num-cores": 2})
    mod = tvm.IRModule({"main": mod["main"].with_attr("target", arm)})
    tvm.ir.assert_structural_equal(flush_denormals(mod)["main"], mod["main"])


def test_only_arithmetic_loops_check_the_mode_per_iteration() -> None:
    """A copy moves denormals without an assist: its parallel iterations skip the check
    (measured: MobileNetV2's pads and layout copies made it cost 3.7% at 2 threads)."""
    from tvm import te

    from tpp_tvm.tir_pipeline import with_denormals_flushed

    x = te.placeholder((37, 64), "float32", name="x")
    y = te.compute((37, 64), lambda i, j: x[i, j], name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    sch.parallel(sch.get_loops(sch.get_sblock("y"))[0])
    copy = with_denormals_flushed(sch.mod["main"], 2).script()
    halve = with_denormals_flushed(_halve(37, 64)["main"], 2).script()
    assert "tpp_denormals_keep_flushed" not in copy and "tpp_denormals_flush" in copy
    assert "tpp_denormals_keep_flushed" in halve
