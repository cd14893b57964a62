"""Build, tensorize and run one TPP on numpy inputs; numpy references for every primitive.

The kernel under test is the TPP's workload (``intrinsics.reference``: a TE computation of
its math, or the description itself for in-place TPPs) tensorized with the registered
intrinsic, so what runs is exactly the ISA implementation; the numpy references below state
the math independently.
"""

from __future__ import annotations

import checks
import numpy as np
import pytest
import tvm
from scipy import special
from tvm import s_tir

from tpp_tvm.intrinsics import TPPSpec, amx_emulator, intrinsic
from tpp_tvm.intrinsics.geometry import contraction_geometry, pool_geometry
from tpp_tvm.intrinsics.reference import BLOCK, operand_dtypes, operand_shapes, workload
from tpp_tvm.intrinsics.spec import OPERAND_STEPS, RESIDUAL_QUANT_OPS
from tpp_tvm.target import host_isa, target, tiles_emulated
from tpp_tvm.tir_pipeline import compile_kernels


def tensorized(spec: TPPSpec, isa: str = checks.VECTOR_ISA) -> tvm.tirx.PrimFunc:
    """The TPP's workload with its whole loop nest tensorized by the ``isa`` intrinsic."""
    sch = s_tir.Schedule(workload(spec))
    block = sch.get_sblock(BLOCK)
    sch.tensorize(sch.get_loops(block)[0], intrinsic(spec, isa))
    return sch.mod["main"]


def tile_target(num_cores: int = 1) -> tvm.target.Target:
    """The target tile kernels run on in this process: AMX where the host has it and the OS
    grants tile state, else AMX with the tiles emulated in software (the kernels around the
    tiles compiled for the host: AVX-512, or AVX2 with the AVX-512 instructions in generic
    code); skips the test on other hosts, saying why."""
    host = host_isa()
    if host.amx_tile and host.amx_permitted:
        return target("amx", num_cores=num_cores)
    if not (host.avx2 and host.fma):
        pytest.skip("running tile kernels needs an AMX host, or an x86 host with AVX2 and "
                    f"FMA to emulate the tiles ({host.summary()})")
    amx_emulator.reset()
    return target("amx", num_cores=num_cores, emulate_tiles=True)


def build(spec: TPPSpec, isa: str = checks.VECTOR_ISA, tgt: tvm.target.Target | None = None):
    """Compile the tensorized TPP (for ``tgt``, default ``isa``'s host target); returns
    (runtime module, operand shapes, dtypes)."""
    mod = tvm.IRModule({"main": tensorized(spec, isa)})
    if tiles_emulated(tgt):
        amx_emulator.library()
        built = compile_kernels(mod, tgt).jit()  # the tpp pipeline renames tile instructions
    else:
        built = tvm.compile(mod, target=tgt or target(isa, num_cores=1)).jit()
    return built, operand_shapes(spec), operand_dtypes(spec)


def _gelu(x):
    return 0.5 * x * (1 + special.erf(x / np.sqrt(2)))


UNARY = {
    "copy": lambda x: x,
    "relu": lambda x: np.maximum(x, 0),
    "relu6": lambda x: np.clip(x, 0, 6),
    "leaky_relu": lambda x: np.where(x < 0, np.float32(0.01) * x, x),
    "hardswish": lambda x: x * np.clip(x + 3, 0, 6) / 6,
    "silu": lambda x: x / (1 + np.exp(-x)),
    "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
    "gelu": _gelu,
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "tanh": np.tanh,
    "sigmoid": special.expit,
    "exp": np.exp,
    "reciprocal": lambda x: 1 / x,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "negate": np.negative,
    "square": np.square,
}
BWD = {
    "relu_inv": lambda dy, x: np.where(x > 0, dy, 0),
    "gelu_inv": lambda dy, x: dy * (0.5 * (1 + special.erf(x / np.sqrt(2)))
                                    + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)),
    "tanh_inv": lambda dy, y: dy * (1 - y * y),
    "sigmoid_inv": lambda dy, y: dy * y * (1 - y),
}
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum}


def _bcast(spec: TPPSpec, y: np.ndarray) -> np.ndarray:
    views = {"none": lambda: y, "row": lambda: y[None, :], "col": lambda: y[:, None],
             "scalar": lambda: y.reshape(1, 1)}
    return views[spec.bcast]()


def reference(spec: TPPSpec, args: list[np.ndarray]) -> np.ndarray:
    """The numpy result of ``spec`` on its inputs (the last arg is the output's old value)."""
    op = spec.op
    a = [x.astype(np.float64) for x in args]
    if spec.kind == "brgemm":
        geo = contraction_geometry(spec)
        out = a[-1].copy() if spec.beta == 1 else np.zeros((spec.m, spec.n))
        for idx in np.ndindex(*geo.batch, geo.k):
            rs, k = idx[:-1], idx[-1]
            col = np.array([a[0][geo.a_index(rs, i, k)] for i in range(spec.m)])
            out += np.outer(col, a[1][geo.b_index(rs, k, slice(None))])
        return out
    if op == "zero":
        return np.zeros((spec.m, spec.n))
    if spec.kind == "quant":
        v = a[0].astype(np.float32) * args[1] + args[2]  # fp32 math, as the TPP states it
        if op == "dequantize":
            return v
        if op in RESIDUAL_QUANT_OPS:
            v = v + args[3].astype(np.float32)
            if op.endswith("_relu"):
                v = np.maximum(v, np.float32(0))
            v = v * args[4] + args[5]
        info = np.iinfo(spec.acc_dtype)
        return np.clip(np.rint(v), info.min, info.max)
    if spec.kind == "unary":
        return UNARY[op](a[0])
    if spec.kind == "unary_bwd":
        return BWD[op](a[0], a[1])
    if spec.kind == "binary":
        return BINARY[op](a[0], _bcast(spec, a[1]))
    if spec.kind == "muladd":
        return a[0] * _bcast(spec, a[1]) + a[2]
    if spec.kind == "reduce":
        axis = 0 if op.endswith("_rows") else 1
        if "_max_" in op:
            return a[0].max(axis=axis)
        return (a[0] ** 2 if "sumsq" in op else a[0]).sum(axis=axis)
    if spec.kind == "pool":
        geo = pool_geometry(spec)
        out = np.full((spec.m, spec.n), -np.inf)
        for rs in np.ndindex(*geo.batch):
            for i in range(spec.m):
                row = [a[0][geo.a_index(rs, i, j)] for j in range(spec.n)]
                out[i] = np.maximum(out[i], row)
        return out
    if spec.kind == "equation":
        v, it = a[0], iter(a[1:])
        for step in spec.steps:
            operand = OPERAND_STEPS.get(step)
            if operand is None:
                v = UNARY[step](v)
            else:
                v = v * next(it) if operand.multiplies else v + next(it)
        return v
    if op == "transpose":
        return a[0].T
    v = 2 if op == "vnni2" else 4
    ko = -(-spec.m // v)
    padded = np.zeros((ko * v, spec.n))
    padded[: spec.m] = a[0]
    return padded.reshape(ko, v, spec.n).transpose(0, 2, 1)


def inputs_for(spec: TPPSpec, shapes, dtypes, rng: np.random.Generator) -> list[np.ndarray]:
    """Random operands in each op's domain (positive for sqrt/rsqrt, away from 0 for 1/x)."""
    out = []
    for shape, dt in zip(shapes, dtypes):
        if dt in ("uint8", "int8", "int16", "int32") and spec.kind in (
                "brgemm", "quant", "equation", "pool"):  # (u8/s8 residuals, pooling)
            # s16 operands hold u8 activations and s8 weights widened (AVX2's int8 TPPs)
            lo, hi = {"int32": (-5000, 5000), "int16": (-255, 255)}.get(
                dt, (np.iinfo(dt).min, np.iinfo(dt).max))
            out.append(rng.integers(lo, hi + 1, shape).astype(dt))
            continue
        if spec.kind == "quant" and len(out) in (1, 2, 4, 5):  # scales, offsets
            scale = {"quantize": 20.0, "requantize": 0.03, "dequantize": 0.05,
                     "requantize_add": 0.03, "requantize_add_relu": 0.03}[spec.op]
            if len(out) >= 4:  # the output's quantization after the residual
                scale = 1.3
            x = rng.uniform(0.5, 1.5, shape) * scale if len(out) in (1, 4) else (
                np.round(rng.uniform(-20, 20, shape)))
            out.append(x.astype(dt))
            continue
        x = rng.standard_normal(shape) * 2
        if spec.op in ("sqrt", "rsqrt") or (spec.op in ("reciprocal",)):
            x = np.abs(x) + 0.5
        if spec.op == "div" and len(out) == 1:
            x = np.sign(x) * (np.abs(x) + 0.5)
        if spec.op in ("tanh_inv", "sigmoid_inv") and len(out) == 1:
            x = np.tanh(x) if spec.op == "tanh_inv" else special.expit(x)
        out.append(x.astype(numpy_dtype(dt)))
    return out


def numpy_dtype(dtype: str):
    """The numpy dtype of a TVM dtype string (bfloat16 through ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def run(spec: TPPSpec, seed: int = 0, isa: str = checks.VECTOR_ISA,
        tgt: tvm.target.Target | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(TPP result, numpy reference) for random inputs."""
    mod, shapes, dtypes = build(spec, isa, tgt)
    rng = np.random.default_rng(seed)
    args = inputs_for(spec, shapes, dtypes, rng)
    tensors = [tvm.runtime.tensor(x) for x in args]
    mod(*tensors)
    if tiles_emulated(tgt):
        amx_emulator.check(spec.name(isa))
    return tensors[-1].numpy(), reference(spec, args)


def assert_matches(spec: TPPSpec, got: np.ndarray, want: np.ndarray, rtol: float = 1e-5,
                   isa: str = checks.VECTOR_ISA) -> None:
    """fp32 results within ``rtol`` (absolute ``rtol`` x the result's scale near zero, where
    sums cancel); other dtypes (conversions, data movement) bit-exact."""
    if got.dtype.name == "bfloat16" and spec.kind in ("unary", "binary") and spec.op != "copy":
        # Computed in fp32, rounded once to bf16: within one bf16 rounding (2^-8 relative)
        # of the exact value, plus the fp32 vector math's own error.
        checks.assert_close_scaled(got.astype(np.float64), want, 2.0**-7,
                                   err_msg=spec.name(isa))
        return
    if got.dtype != np.float32:
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=spec.name(isa))
        return
    checks.assert_close_scaled(got, want, rtol, err_msg=spec.name(isa))


def check(spec: TPPSpec, seed: int = 0, isa: str = checks.VECTOR_ISA,
          tgt: tvm.target.Target | None = None) -> None:
    """Run the TPP on random inputs (:func:`run`) and assert it matches numpy."""
    got, want = run(spec, seed, isa, tgt)
    assert_matches(spec, got, want, isa=isa)


def assembly(spec: TPPSpec, isa: str = checks.VECTOR_ISA) -> str:
    """The assembly of the tensorized TPP, compiled for ``isa`` (no need to run it here)."""
    return build(spec, isa)[0].inspect_source("asm")


def tile_loops(sch: s_tir.Schedule, spec: TPPSpec, big: TPPSpec):
    """Split the ``tpp`` block of ``big``'s workload into tiles of ``spec``; return the
    loop to tensorize (tiles then have a leading dimension and offset of the big tensor)."""
    loops = sch.get_loops(sch.get_sblock(BLOCK))
    if spec.kind == "reduce":  # only the kept axis is tiled; the reduction stays whole
        tile = spec.n if spec.op.endswith("_rows") else spec.m
        _, inner = sch.split(loops[0], [None, tile])
        return inner
    first, second = (spec.n, spec.m) if spec.op == "transpose" else (spec.m, spec.n)
    o0, i0 = sch.split(loops[0], [None, first])
    o1, i1 = sch.split(loops[1], [None, second])
    sch.reorder(o0, o1, i0, i1)
    return i0


def run_tiled(spec: TPPSpec, reps: tuple[int, int] = (2, 3), seed: int = 0,
              isa: str = checks.VECTOR_ISA) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`run`, on a tensor of ``reps`` tiles, each computed by the TPP in place.

    Proves the intrinsic matches sub-tiles (free leading dimension, non-zero offsets).
    Reductions tile only their kept axis.
    """
    rows, cols = reps
    if spec.kind == "reduce":
        rows, cols = (1, cols) if spec.op.endswith("_rows") else (rows, 1)
    big = spec.with_shape(spec.m * rows, spec.n * cols)
    sch = s_tir.Schedule(workload(big))
    sch.tensorize(tile_loops(sch, spec, big), intrinsic(spec, isa))
    mod = tvm.compile(sch.mod, target=target(isa, num_cores=1)).jit()
    args = inputs_for(big, operand_shapes(big), operand_dtypes(big), np.random.default_rng(seed))
    tensors = [tvm.runtime.tensor(x) for x in args]
    mod(*tensors)
    return tensors[-1].numpy(), reference(big, args)
