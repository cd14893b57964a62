"""Compiled TPP kernels called from numpy: :func:`build_gemm` and its :class:`GemmKernel`.

``schedules/`` turns an operator into a scheduled PrimFunc and stops there; this module is
where one is compiled for a target, sized to its thread count and run in this process. The
numpy helpers that lay operands out the way a compiled GEMM reads them (packed B panels,
pre-padded A, bf16 arrays) live here too: graph lowering uses them to pack constant
weights once at build time.
"""

from __future__ import annotations

import time

import numpy as np
import tvm
from tvm import s_tir

from .errors import UnsupportedDTypeError, UnsupportedISAError, UnsupportedShapeError
from .intrinsics import amx_emulator
from .intrinsics.epilogue import Epilogue
from .runtime import configure_threads, target_threads
from .schedules.gemm import gemm_schedule, pack_b_schedule
from .schedules.gemm_plan import GemmPlan, check_gemm, runs_on_tiles
from .target import host_isa, isa_of, tiles_emulated
from .target import target as tpp_target
from .tir_pipeline import compile_kernels


def pack_b_numpy(b: np.ndarray, nr: int, b_layout: str = "kn", kp: int | None = None,
                 vnni: int = 1) -> np.ndarray:
    """Pack B ((..., K, N), or (..., N, K) for ``nk``) into zero-padded (..., N/nr, kp, nr),
    or with ``vnni`` > 1 into (..., N/nr, kp/vnni, nr, vnni) (kp a multiple of vnni)."""
    if b_layout == "nk":
        b = np.swapaxes(b, -1, -2)
    *lead, k, n = b.shape
    kp = kp or -(-k // vnni) * vnni
    np_ = -(-n // nr) * nr
    padded = np.zeros((*lead, kp, np_), dtype=b.dtype)
    padded[..., :k, :n] = b
    panels = np.moveaxis(padded.reshape(*lead, kp, np_ // nr, nr), -2, -3)
    if vnni > 1:
        panels = np.swapaxes(panels.reshape(*lead, np_ // nr, kp // vnni, vnni, nr), -1, -2)
    return np.ascontiguousarray(panels)


def pad_a(a: np.ndarray, plan: GemmPlan) -> np.ndarray:
    """A zero-padded to the plan's (mp, kp), for kernels that take it pre-padded."""
    pad = [(0, 0)] * (a.ndim - 2) + [(0, plan.mp - plan.m), (0, plan.kp - plan.k)]
    return np.ascontiguousarray(np.pad(a, pad)) if any(p[1] for p in pad) else a


def numpy_dtype(dtype: str) -> np.dtype:
    """numpy's dtype for a TVM dtype (bf16 through ml_dtypes, which TVM depends on)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


class GemmKernel:
    """A compiled TPP GEMM. Call with numpy arrays; B may be given packed (``pack_b``).

    A bf16 kernel takes fp32 (or bf16) A and B and rounds them to bf16; an int8 kernel
    takes u8 A and s8 B as they are, and returns int32 unless built with ``dequantize``
    (then ``scale``/``offset`` per output column turn the int32 result into fp32).
    """

    def __init__(self, plan: GemmPlan, batch: int | None, bias: bool, activation: str | None,
                 b_layout: str, rt_mod: tvm.runtime.Module, sch: s_tir.Schedule,
                 compile_seconds: float, threads: int = 1, isa: str = "avx512",
                 target: tvm.target.Target | None = None, dequantize: bool = False) -> None:
        self.plan = plan
        self.batch = batch
        self.bias = bias
        self.activation = activation
        self.b_layout = b_layout
        self.dequantize = dequantize
        self.module = rt_mod
        self.schedule = sch
        self.compile_seconds = compile_seconds
        self._dev = tvm.cpu()
        self.threads = configure_threads(threads)
        self.isa, self.target = isa, target
        self._pack = None

    @property
    def flops(self) -> int:
        return 2 * self.plan.m * self.plan.n * self.plan.k * (self.batch or 1)

    @property
    def out_dtype(self) -> str:
        return "float32" if self.dequantize else self.plan.precision.acc

    def pack_b(self, b: np.ndarray) -> np.ndarray:
        """B in the kernel's packed panel layout (do this once for constant weights)."""
        p = self.plan
        prec = p.precision
        lead = (self.batch,) if self.batch else ()
        want = (*lead, p.k, p.n) if self.b_layout == "kn" else (*lead, p.n, p.k)
        if np.shape(b) != want:
            raise UnsupportedShapeError(
                f"GEMM: B has shape {np.shape(b)}, expected {want} ({self.b_layout} layout)"
            )
        if prec.vnni > 1:  # VNNI panels: a one-off numpy reshuffle of constant weights
            return pack_b_numpy(self._as(b, prec.b, "B"), p.nr, self.b_layout, p.kp, prec.vnni)
        if self.batch:  # batched B: per-entry panels, the same layout as the TPP kernel's
            return pack_b_numpy(np.asarray(b, dtype="float32"), p.nr, self.b_layout, p.kp)
        if self._pack is None:
            sch = pack_b_schedule(p.k, p.n, p.nr, p.kp, self.b_layout, self.isa)
            self._pack = compile_kernels(sch.mod, self.target).jit()
        src = tvm.runtime.tensor(np.ascontiguousarray(b, dtype="float32"), self._dev)
        out = tvm.runtime.tensor(np.empty((p.np_ // p.nr, p.kp, p.nr), "float32"), self._dev)
        self._pack(src, out)
        return out.numpy()

    def _as(self, x: np.ndarray, dtype: str, what: str) -> np.ndarray:
        """``x`` as ``dtype``: floats round to bf16; integer operands must already be it."""
        x = np.asarray(x)
        want = numpy_dtype(dtype)
        if dtype in ("uint8", "int8", "int16") and x.dtype != want:
            raise UnsupportedDTypeError(
                f"GEMM {self.plan.dtype}: {what} must be {dtype} (quantized), got {x.dtype}")
        return np.ascontiguousarray(x.astype(want, copy=False))

    def _check_a(self, a: np.ndarray) -> None:
        p = self.plan
        lead = (self.batch,) if self.batch else ()
        if np.shape(a) != (*lead, p.m, p.k):
            raise UnsupportedShapeError(
                f"GEMM: A has shape {np.shape(a)}, expected {(*lead, p.m, p.k)}"
            )

    def _row(self, v: np.ndarray | None, what: str) -> np.ndarray:
        p = self.plan
        if v is None or np.shape(v) != (p.n,):
            raise UnsupportedShapeError(f"GEMM: {what} must have shape ({p.n},)")
        return np.pad(np.asarray(v, "float32"), (0, p.np_ - p.n))

    def _args(self, a: np.ndarray, b_packed: np.ndarray, bias: np.ndarray | None,
              scale: np.ndarray | None = None, offset: np.ndarray | None = None):
        p = self.plan
        prec = p.precision
        lead = (self.batch,) if self.batch else ()
        self._check_a(a)
        a = self._as(a, prec.a, "A")
        if p.a_prepadded:
            a = pad_a(a, p)
        args = [a, self._as(b_packed, prec.b, "packed B")]
        if self.dequantize:
            args += [self._row(scale, "scale"), self._row(offset, "offset")]
        if self.bias:
            args.append(self._row(bias, "bias"))
        out = np.empty((*lead, p.m, p.n), dtype=self.out_dtype)
        return [tvm.runtime.tensor(x, self._dev) for x in (*args, out)]

    def run_packed(self, a: np.ndarray, b_packed: np.ndarray,
                   bias: np.ndarray | None = None, *, scale: np.ndarray | None = None,
                   offset: np.ndarray | None = None) -> np.ndarray:
        """C for B already in the packed layout (:meth:`pack_b`), as for constant weights."""
        args = self._args(a, b_packed, bias, scale, offset)
        self.module(*args)
        if tiles_emulated(self.target):
            amx_emulator.check(f"GEMM {self.plan.m}x{self.plan.n}x{self.plan.k}")
        return args[-1].numpy()[..., : self.plan.m, : self.plan.n]

    def __call__(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None, *,
                 scale: np.ndarray | None = None, offset: np.ndarray | None = None
                 ) -> np.ndarray:
        self._check_a(a)
        return self.run_packed(a, self.pack_b(b), bias, scale=scale, offset=offset)

    def time(self, a: np.ndarray, b_packed: np.ndarray, bias: np.ndarray | None = None,
             number: int = 10, repeat: int = 7, *, scale: np.ndarray | None = None,
             offset: np.ndarray | None = None) -> float:
        """Median seconds per call (operands already packed and resident)."""
        args = self._args(a, b_packed, bias, scale, offset)
        ev = self.module.time_evaluator("main", self._dev, number=number, repeat=repeat)
        return float(np.median(ev(*args).results))


def build_gemm(m: int, n: int, k: int, dtype: str = "float32",
               target: tvm.target.Target | str | dict | None = None, *,
               batch: int | None = None, bias: bool = False, activation: str | None = None,
               b_layout: str = "kn", dequantize: bool = False) -> GemmKernel:
    """Compile C = A @ B (+ bias) (+ activation) onto TPPs for ``target`` (default: host).

    ``dtype``: ``float32``; ``bfloat16`` (bf16 operands, fp32 accumulation and output);
    ``int8`` (u8 A x s8 B into int32; with ``dequantize``, fp32 out = int32 * scale[j] +
    offset[j], then bias/activation). ``batch`` makes it a batched matmul (A (batch, M, K),
    B (batch, K, N)); ``b_layout`` says how unpacked B is given to ``__call__``/``pack_b``:
    ``"kn"`` (K, N) or ``"nk"`` (N, K, a linear layer's weight).
    """
    epilogue = Epilogue(bias=bias, activation=activation)
    check_gemm(m, n, k, dtype)
    if b_layout not in ("kn", "nk"):
        raise UnsupportedShapeError(f"GEMM: b_layout {b_layout!r} must be 'kn' or 'nk'")
    tgt = target if target is not None else tpp_target()
    tgt = tgt if isinstance(tgt, tvm.target.Target) else tvm.target.Target(tgt)
    isa = isa_of(tgt)
    if isa == "sve":
        raise UnsupportedISAError(
            "GEMM: build_gemm runs its kernel in this process; SVE kernels cross-compile for "
            "aarch64: use tpp_tvm.cross (plan_model, export_library) and run them there")
    if runs_on_tiles(isa, dtype) and tiles_emulated(tgt):
        amx_emulator.library()  # the tile model's symbols, before the kernel is linked
    elif runs_on_tiles(isa, dtype) and host_isa().amx_tile:
        from .intrinsics.amx import ensure_tile_permission

        ensure_tile_permission()  # before the first tile instruction, as Linux requires
    t0 = time.perf_counter()
    sch, plan = gemm_schedule(m, n, k, isa, epilogue=epilogue, batch=batch, dtype=dtype,
                              dequantize=dequantize, threads=target_threads(tgt))
    rt = compile_kernels(sch.mod, tgt).jit()
    return GemmKernel(plan, batch, bias, activation, b_layout, rt, sch,
                      time.perf_counter() - t0, threads=target_threads(tgt), isa=isa,
                      target=tgt, dequantize=dequantize)
