"""Tests of the cross-running pieces that need no qemu: job files, assembly reading, and a
model plan executed call by call on the host (TVM's runtime) against ONNX Runtime."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import tvm

from tpp_tvm import models
from tpp_tvm.cross import asm, plan_model
from tpp_tvm.cross.runner import Call, qemu_command, write_job
from tpp_tvm.frontend import from_onnx
from tpp_tvm.onnxruntime_ref import run_onnxruntime
from tpp_tvm.target import target

AARCH64 = """\
0000000000001000 <k_compute_>:
    1000:\twhilelo\tp0.s, w8, w9
    1004:\tld1rw\t{z8.s}, p0/z, [x21]
    1008:\tfmla\tz31.s, p0/m, z8.s, z9.s
    100c:\tsubs\tx8, x8, #0x1
    1010:\tb.ne\t1004 <k_compute_+0x4>  // b.any
    1014:\tldr\tq0, [x1]
    1018:\tfadd\tv0.4s, v0.4s, v1.4s
    101c:\tcbnz\tx2, 1014 <k_compute_+0x14>
    1020:\tmovi\tv2.2d, #0x0
    1024:\tret
"""

X86 = """\
0000000000002000 <k_compute_>:
    2000:\tvbroadcastss\t(%rdi),%zmm1
    2004:\tvfmadd231ps\t(%rsi),%zmm1,%zmm0
    2008:\tvaddss\t%xmm1,%xmm2,%xmm2
    200c:\tjne\t2000 <k_compute_>
    2010:\tret
"""


def test_asm_finds_innermost_loops_and_classes() -> None:
    insns = asm.functions(AARCH64)["k_compute_"]
    inner = asm.innermost_loops(insns)
    assert [len(lp) for lp in inner] == [4, 3]
    assert asm.kinds(inner[0]) == {"sve": 2, "scalar": 2}
    assert asm.kinds(inner[1])["neon"] == 1
    assert insns[-2].kind == "zeroing"
    x86 = asm.functions(X86)["k_compute_"]
    assert asm.kinds(asm.innermost_loops(x86)[0]) == {"avx512": 2, "scalar": 2}


def test_job_file_layout(tmp_path) -> None:
    a = np.arange(6, dtype="float32").reshape(2, 3)
    b = np.zeros(4, "int8")
    write_job(tmp_path / "job.bin", [a, b], [Call("k", (1, 0))])
    data = (tmp_path / "job.bin").read_bytes()
    assert data[:8] == b"TPPJOB01"
    assert struct.unpack_from("<IBBHI2qQ", data, 8) == (2, 2, 32, 1, 2, 2, 3, 24)
    tail = struct.unpack_from("<I1sI2I", data, len(data) - 17)
    assert tail == (1, b"k", 2, 1, 0)


@pytest.mark.requires_sve_runner
def test_qemu_vector_length_is_checked() -> None:
    assert "max,sve-default-vector-length=32" in qemu_command(32)
    with pytest.raises(ValueError, match="vector length"):
        qemu_command(24)


@pytest.mark.requires_avx512  # runs the plan's kernels on this host
@pytest.mark.requires_onnxruntime
def test_model_plan_calls_reproduce_the_model() -> None:
    model = models.mlp(4, (16, 48, 8), activation="relu")
    tgt = target("avx512", num_cores=1)
    plan = plan_model(from_onnx(model), tgt)
    assert len(plan.calls) == 2 and len(plan.inputs) == 1 and len(plan.outputs) == 1
    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    arrays = [tvm.runtime.tensor(a) for a in plan.arrays([x])]
    lib = tvm.compile(plan.kernels, target=tgt).jit()
    for call in plan.calls:
        lib[call.name](*[arrays[i] for i in call.args])
    want = run_onnxruntime(model, {"input": x})[0]
    np.testing.assert_allclose(arrays[plan.outputs[0]].numpy(), want, rtol=1e-5, atol=1e-5)
