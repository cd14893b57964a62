"""SVE TPPs and an SVE model, cross-compiled for aarch64 and run for real under qemu.

Every catalogue TPP (plus shapes whose rows cross a 2048-bit vector) is built into one
aarch64 library by the SVE templates and called by ``tpp_tvm/cross/harness.c`` under
``qemu-aarch64`` at 128-, 256-, 512- and 2048-bit vector lengths, one qemu process per
length; an MLP goes through the ``tpp`` graph pass and schedules the same way. A CPU
without SVE (cortex-a72) must die with SIGILL on the same library: proof SVE code ran.
Those tests skip where the cross tools are missing (``.ci/run`` installs them); TVM's own
LLVM still shows, without them, that every kind of TPP compiles to SVE code.
"""

from __future__ import annotations

import re
import signal

import numpy as np
import pytest
import tpp_harness as h
import tvm
from tvm.script import tirx as T

from tpp_tvm import build, models
from tpp_tvm.cross import CrossRunError, asm, plan_model, run_calls
from tpp_tvm.cross.runner import Call, executed_instructions
from tpp_tvm.cross.toolchain import disassemble, export_library
from tpp_tvm.frontend import from_onnx
from tpp_tvm.intrinsics import TPPSpec
from tpp_tvm.intrinsics.reference import operand_dtypes, operand_shapes
from tpp_tvm.intrinsics.registry import catalogue, portable
from tpp_tvm.onnxruntime_ref import run_onnxruntime
from tpp_tvm.target import target

#: qemu vector lengths in bytes: 128, 256, 512 and 2048 bits.
VECTOR_BYTES = (16, 32, 64, 256)

#: Beyond the catalogue: rows longer than a 2048-bit vector (64 fp32 lanes), so full
#: vectors and tails both run at every length, and odd tiles for the panel/gather paths.
EXTRA = [
    TPPSpec("gemm", m=3, n=70, k=5),
    TPPSpec("brgemm", m=7, n=130, k=3, batch=2, beta=0),
    TPPSpec("gelu", m=3, n=133),
    TPPSpec("add", m=2, n=130, bcast="row"),
    TPPSpec("reduce_add_cols", m=3, n=131),
    TPPSpec("reduce_max_rows", m=5, n=70),
    TPPSpec("transpose", m=70, n=3),
    TPPSpec("vnni2", m=5, n=70),
    TPPSpec("vnni4", m=7, n=66),
    TPPSpec("equation", m=2, n=129, steps=("bias", "residual", "relu")),
    TPPSpec("zero", m=2, n=65),
    TPPSpec("relu_inv", m=2, n=67),
    TPPSpec("muladd", m=3, n=70, bcast="col"),
    TPPSpec("pool_max", m=3, n=70, batch=2, k=3, stride=140),
    TPPSpec("reduce_sumsq_rows", m=9, n=68),
    # Data movement in other dtypes (st4b/st2h VNNI packing, int32 gathers).
    TPPSpec("vnni4", "int8", m=7, n=70),
    TPPSpec("vnni4", "uint8", m=9, n=131),
    TPPSpec("vnni2", "float16", m=5, n=70),
    TPPSpec("transpose", "int32", m=70, n=3),
    TPPSpec("copy", "int8", m=3, n=130),
    TPPSpec("zero", "float16", m=3, n=70),
    TPPSpec("pool_max", "uint8", m=4, n=130, batch=3, k=3, stride=260),
    TPPSpec("pool_max", "int8", m=3, n=37, batch=2, k=3, stride=37),
]


def _one_per_kind() -> list[TPPSpec]:
    seen, specs = set(), []
    for spec in filter(portable, catalogue()):
        key = spec.op if spec.kind in ("transform", "reduce") else spec.kind
        if key not in seen:
            seen.add(key)
            specs.append(spec)
    return specs


@pytest.mark.parametrize("spec", _one_per_kind(), ids=lambda s: s.name("sve"))
def test_every_kind_compiles_to_sve(spec: TPPSpec) -> None:
    """No cross tools needed: LLVM's own assembly of the SVE kernel is predicated SVE code."""
    exe = tvm.compile(tvm.IRModule({"main": h.tensorized(spec, "sve")}),
                      target=target("sve", num_cores=1))
    text = exe.mod.inspect_source("asm")
    assert re.search(r"\n\s+whilelo\s+p\d+\.s", text), spec
    assert re.search(r"\n\s+(ld1w|st1w|st[24]w)\s+\{\s*z\d+\.s", text), spec
    assert not re.search(r"\n\s+bl\s+(exp|tanh|erf|expf|tanhf|erff)\b", text), spec
    if spec.kind == "brgemm":
        assert re.search(r"\n\s+fml[a]\s+z\d+\.s", text), spec


@pytest.fixture(scope="module")
def tpp_library(tmp_path_factory):
    """(library, tensors, calls, [(spec, output id, inputs)]) for every TPP on SVE."""
    rng = np.random.default_rng(0)
    funcs, tensors, calls, cases = {}, [], [], []
    for i, spec in enumerate([*filter(portable, catalogue()), *EXTRA]):
        name = f"tpp{i}"
        funcs[name] = h.tensorized(spec, "sve").with_attr("global_symbol", name)
        args = h.inputs_for(spec, operand_shapes(spec), operand_dtypes(spec), rng)
        ids = tuple(range(len(tensors), len(tensors) + len(args)))
        tensors += args
        calls.append(Call(name, ids))
        cases.append((spec, ids[-1], args))
    exe = tvm.compile(tvm.IRModule(funcs), target=target("sve", num_cores=1))
    lib = export_library(exe, tmp_path_factory.mktemp("sve") / "tpps.so")
    return lib, tensors, calls, cases


@pytest.mark.requires_sve_runner
@pytest.mark.parametrize("vl_bytes", VECTOR_BYTES, ids=lambda b: f"{8 * b}bit")
def test_every_tpp_runs_like_numpy(tpp_library, vl_bytes: int) -> None:
    lib, tensors, calls, cases = tpp_library
    out = run_calls(lib, tensors, calls, vl_bytes=vl_bytes)
    failures = []
    for spec, out_id, args in cases:
        try:
            h.assert_matches(spec, out[out_id], h.reference(spec, args), isa="sve")
        except AssertionError as err:
            failures.append(f"{spec.name('sve')}: {str(err).splitlines()[3:5]}")
    assert not failures, "\n".join(failures)


@pytest.mark.requires_sve_runner
def test_cpu_without_sve_dies_with_sigill(tpp_library) -> None:
    lib, tensors, calls, _ = tpp_library
    with pytest.raises(CrossRunError) as err:
        run_calls(lib, tensors, calls, vl_bytes=None, cpu="cortex-a72")
    assert err.value.signal == signal.SIGILL


@pytest.mark.requires_sve_runner
def test_harness_catches_writes_outside_a_tensor(tmp_path) -> None:
    """The guard bytes around every tensor are what makes the passes above also mean
    "no TPP writes outside its tile"."""

    @T.prim_func(s_tir=True)
    def fill(x: T.Buffer((8,), "float32"), n: T.Buffer((1,), "int32")):
        for i in range(n[0]):
            x[i] = T.float32(1)

    exe = tvm.compile(tvm.IRModule({"fill": fill.with_attr("global_symbol", "fill")}),
                      target=target("sve", num_cores=1))
    lib = export_library(exe, tmp_path / "fill.so")
    x = np.zeros(8, "float32")
    out = run_calls(lib, [x, np.array([8], "int32")], [Call("fill", (0, 1))])
    assert (out[0] == 1).all()
    with pytest.raises(CrossRunError, match="wrote outside tensor 0") as err:
        run_calls(lib, [x, np.array([9], "int32")], [Call("fill", (0, 1))])
    assert err.value.returncode == 5


@pytest.mark.requires_sve_runner
def test_longer_vectors_execute_fewer_instructions(tpp_library) -> None:
    """The same binary adapts to the vector length: a 2048-bit gelu call executes several
    times fewer instructions than a 128-bit one (counted in qemu's execution trace)."""
    lib, tensors, calls, cases = tpp_library
    i = next(i for i, (spec, _, _) in enumerate(cases) if spec.op == "gelu" and spec.n > 100)
    counts = [executed_instructions(lib, tensors, [calls[i]], vl)[f"tpp{i}_compute_"]
              for vl in (16, 64, 256)]
    assert counts[0] > 2 * counts[1] > 0 and counts[1] > 2 * counts[2] > 0, counts


def _kernels(library) -> dict[str, list[asm.Insn]]:
    return {name: insns for name, insns in asm.functions(disassemble(library)).items()
            if name.endswith("_compute_")}


@pytest.mark.requires_sve_runner
def test_tpp_hot_loops_are_sve_not_neon(tpp_library) -> None:
    lib, _, _, cases = tpp_library
    kernels = _kernels(lib)
    assert len(kernels) == len(cases)
    for i, (spec, _, _) in enumerate(cases):
        insns = kernels[f"tpp{i}_compute_"]
        name = spec.name("sve")
        assert any(x.mnemonic in ("whilelo", "ptrue") for x in insns), name
        calls = [x.operands for x in insns if x.mnemonic == "bl"]
        assert all("memset" in c for c in calls), f"{name} calls {calls}"
        inner = asm.innermost_loops(insns)
        assert inner, f"{name} has no loop"
        for loop in inner:
            kinds = asm.kinds(loop)
            assert kinds["neon"] == 0 and kinds["sve"] > 0, f"{name}: {loop}"


@pytest.mark.requires_sve_runner
def test_brgemm_inner_loop_is_predicated_fmla(tpp_library) -> None:
    lib, _, _, cases = tpp_library
    kernels = _kernels(lib)
    for i, (spec, _, _) in enumerate(cases):
        if spec.kind != "brgemm":
            continue
        hottest = max(asm.innermost_loops(kernels[f"tpp{i}_compute_"]),
                      key=lambda lp: asm.mnemonics(lp)["fmla"])
        ops = asm.mnemonics(hottest)
        fmas = [x for x in hottest if x.mnemonic in ("fmla", "fmad")]
        # One FMA per accumulator per (unrolled) k step: m rows x the panel's vectors.
        assert len(fmas) >= spec.m and len(fmas) % spec.m == 0, (spec, ops)
        assert all(x.kind == "sve" for x in fmas) and ops["ld1w"] >= 1, (spec, ops)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """An MLP through the tpp graph pass and schedules, as one aarch64 library.

    Two cores: the kernels' parallel loops go through the harness's (serial) parallel hook.
    """
    model = models.mlp(8, (64, 96, 96, 40), activation="gelu")
    tgt = target("sve", num_cores=2)
    plan = plan_model(from_onnx(model), tgt)
    lib = plan.build(tgt, tmp_path_factory.mktemp("sve") / "mlp.so")
    x = np.random.default_rng(1).standard_normal((8, 64)).astype("float32")
    want = run_onnxruntime(model, {"input": x})[0]
    return plan, lib, x, want


@pytest.mark.requires_sve_runner
@pytest.mark.requires_onnxruntime  # the mlp fixture's reference
def test_mlp_is_all_tpp_kernels(mlp) -> None:
    plan, lib, _, _ = mlp
    assert not plan.report.fallbacks
    assert sum(plan.report.lowered.values()) == len(plan.calls) == 3
    for name, insns in _kernels(lib).items():
        assert asm.mnemonics(insns)["fmla"] > 0 and asm.kinds(insns)["sve"] > 0, name


@pytest.mark.requires_sve_runner
@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("vl_bytes", VECTOR_BYTES, ids=lambda b: f"{8 * b}bit")
def test_mlp_runs_like_onnxruntime(mlp, vl_bytes: int) -> None:
    plan, lib, x, want = mlp
    (got,) = plan.run(lib, [x], vl_bytes=vl_bytes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.requires_sve_runner
def test_tpp_build_for_sve_exports_an_aarch64_library(tmp_path) -> None:
    """``tpp_tvm.build`` with the SVE target gives a Relax VM executable for aarch64 (to load
    with TVM's runtime on an SVE machine)."""
    exe = build(from_onnx(models.mlp(4, (16, 32, 8))), target("sve", num_cores=1))
    lib = export_library(exe, tmp_path / "mlp_vm.so")
    header = lib.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # aarch64
    assert any(x.kind == "sve" for insns in asm.functions(disassemble(lib)).values()
               for x in insns)


@pytest.mark.requires_sve_runner
@pytest.mark.requires_onnxruntime
@pytest.mark.parametrize("name", ["small_cnn", "bert"])
def test_tiny_models_run_like_onnxruntime(name: str, tmp_path) -> None:
    """Convolutions, pooling, attention and layer norm too: the tiny CNN and BERT encoder,
    whole, at the shortest and the longest vector."""
    generator = {"small_cnn": models.small_cnn, "bert": models.bert_encoder}[name]
    model = generator(**models.TINY_ARGS[name])
    tgt = target("sve", num_cores=1)
    plan = plan_model(from_onnx(model), tgt)
    assert not plan.report.fallbacks and sum(plan.report.lowered.values()) >= 4
    lib = plan.build(tgt, tmp_path / f"{name}.so")
    rng = np.random.default_rng(2)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
             .astype("float32") for i in model.graph.input}
    want = run_onnxruntime(model, feeds)
    for vl_bytes in (16, 256):
        got = plan.run(lib, list(feeds.values()), vl_bytes=vl_bytes)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
