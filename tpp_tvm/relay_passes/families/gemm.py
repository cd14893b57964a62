"""The GEMM families: dense layers (a constant weight, packed now), matmuls and batched
matmuls of two activations, and the column sums of a bias gradient."""

from __future__ import annotations

import numpy as np
from tvm import relax

from ...kernels import numpy_dtype, pack_b_numpy
from ...schedules.backward import col_sum_schedule
from ...schedules.gemm import bf16_a_schedule, gemm_schedule
from .base import (
    KernelFamily,
    Lowered,
    Match,
    as_relax_kernel,
    dims,
    kernel_name,
    output_args,
)


def emit_gemm(bb: relax.BlockBuilder, matched: Match, name: str, isa: str,
              x: relax.Expr, w_kn: np.ndarray, out_shape: list[int],
              precision: str = "float32", threads: int = 1) -> Lowered:
    """One GEMM kernel over x flattened to rows: (+bias)(+act)(x gate)(+residual)(+act),
    reshaped.

    In bf16 the weight is packed as bf16 VNNI panels now, and x is converted (and padded)
    to bf16 by a small kernel before the GEMM, or arrives in bf16 (``matched.io``); the
    epilogue is fp32, and the output is what ``matched.io`` planned. On an AMX target the
    bf16 GEMM runs on tiles, one task per thread of ``threads``."""
    io = matched.io
    xs = dims(x)
    k, n = w_kn.shape
    m = int(np.prod(xs[:-1])) if len(xs) > 1 else 1
    col_scale = matched.get("lhs_scale")
    if col_scale is not None and precision != "float32":  # scaled rows are fp32 only
        x, col_scale = bb.emit(relax.op.multiply(x, col_scale)), None
    epilogue = matched.epilogue.writing(io.writes)
    sch, plan = gemm_schedule(m, n, k, isa, epilogue=epilogue, dtype=precision,
                              a_col_scale=col_scale is not None, threads=threads)
    kernel = sch.mod["main"]
    gv = bb.add_func(as_relax_kernel(kernel), kernel_name(name))
    a2 = bb.emit(relax.op.reshape(x, (m, k))) if len(xs) != 2 else x
    prec = plan.precision
    if plan.a_prepadded and (io.takes != prec.a or (plan.mp, plan.kp) != (m, k)):
        cvt = bf16_a_schedule(m, k, plan.mp, plan.kp, isa, in_dtype=io.takes)
        cvt = bb.add_func(as_relax_kernel(cvt.mod["main"]), kernel_name(name) + "_a_bf16")
        a2 = bb.emit(relax.call_tir(cvt, [a2], relax.TensorType((plan.mp, plan.kp), prec.a)))
    w_packed = pack_b_numpy(w_kn.astype(numpy_dtype(prec.b)), plan.nr, "kn", plan.kp, prec.vnni)
    args = [a2, relax.const(w_packed)]
    if col_scale is not None:
        args.append(bb.emit(relax.op.reshape(col_scale, (k,))))
    if epilogue.bias:
        bias = matched["bias"].value.numpy().reshape(-1)
        args.append(relax.const(np.pad(bias, (0, plan.np_ - n)).astype("float32")))
    for operand in ("gate", "residual"):
        if getattr(epilogue, operand):
            t = matched[operand]
            args.append(bb.emit(relax.op.reshape(t, (m, n))) if len(out_shape) != 2 else t)
    out = bb.emit(relax.call_tir(gv, output_args(args, kernel, n, io),
                                 relax.TensorType((m, n), io.writes)))
    return Lowered(relax.op.reshape(out, out_shape) if len(out_shape) != 2 else out)


def gemm_narrow_outputs(matched: Match, precision: str, isa: str, threads: int
                        ) -> tuple[str, ...]:
    """A bf16 GEMM writes bf16 for the next bf16 layer, or the quantized input of the
    next int8 one."""
    return ("bfloat16", "uint8", "int8") if precision == "bfloat16" else ()


def gemm_bf16_operand(matched: Match, precision: str, isa: str, threads: int) -> str | None:
    """A bf16 GEMM takes its rows in bf16 (not scaled ones: those are scaled in fp32)."""
    return "lhs" if precision == "bfloat16" and "lhs_scale" not in matched else None


def lower_dense(bb: relax.BlockBuilder, matched: Match, name: str,
                 isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """Dense (+bias)(+act)(+residual): flatten to 2D, one GEMM kernel, reshape back."""
    x, weight = matched["lhs"], matched["weight"]
    w = weight.value.numpy()
    return emit_gemm(bb, matched, name, isa, x, w, [*dims(x)[:-1], w.shape[1]], precision,
                      threads)


def lower_bmm(bb: relax.BlockBuilder, matched: Match, name: str,
              isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """Batched matmul of activations: batch dims flattened, B used in place (not packed)."""
    x, y = matched["lhs"], matched["rhs"]
    xs, ys = dims(x), dims(y)
    batch = int(np.prod(xs[:-2]))
    m, k, n = xs[-2], xs[-1], ys[-1]
    sch, _ = gemm_schedule(m, n, k, isa, batch=batch, b_packed=False)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    a3 = bb.emit(relax.op.reshape(x, (batch, m, k))) if len(xs) != 3 else x
    b3 = bb.emit(relax.op.reshape(y, (batch, k, n))) if len(ys) != 3 else y
    out = bb.emit(relax.call_tir(gv, [a3, b3], relax.TensorType((batch, m, n), "float32")))
    return Lowered(relax.op.reshape(out, [*xs[:-2], m, n]) if len(xs) != 3 else out)


def lower_matmul(bb: relax.BlockBuilder, matched: Match, name: str,
                 isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """matmul(A or Aᵀ, B or Bᵀ) (+bias)(+act) of activations: one GEMM kernel, B read in
    place (plain) or packed inside the kernel (transposed), Aᵀ copied to rows."""
    x, y = matched["lhs"], matched["rhs"]
    ta, tb = "lhs_t" in matched, "rhs_t" in matched
    xs, ys = dims(x), dims(y)
    if ta:
        k, m = xs
    else:
        m, k = int(np.prod(xs[:-1])), xs[-1]
    n = ys[0] if tb else ys[1]
    epilogue = matched.epilogue
    if tb and not epilogue.steps and len(xs) == 2 and m * k + 2 * m * n < n * k:
        # dX = dY Wᵀ with few rows: packing Wᵀ (n x k) would cost more than the product.
        # Cᵀ = W dYᵀ reads W in place as rows; only dY (m x k) is packed, C transposed back.
        sch, _ = gemm_schedule(n, m, k, isa, b_packed=False, b_transposed=True)
        gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name) + "_swapped")
        ct = bb.emit(relax.call_tir(gv, [y, x], relax.TensorType((n, m), "float32")))
        return Lowered(relax.op.permute_dims(ct, [1, 0]))
    sch, plan = gemm_schedule(m, n, k, isa, epilogue=epilogue, b_packed=False,
                              a_transposed=ta, b_transposed=tb)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    args = [bb.emit(relax.op.reshape(x, (m, k))) if len(xs) != 2 else x, y]
    if epilogue.bias:
        bias = matched["bias"]
        if plan.np_ != n:
            bias = bb.emit(relax.op.nn.pad(bias, [0, plan.np_ - n]))
        args.append(bias)
    out = bb.emit(relax.call_tir(gv, args, relax.TensorType((m, n), "float32")))
    out_shape = [*xs[:-1], n] if not ta else [m, n]
    return Lowered(relax.op.reshape(out, out_shape) if len(out_shape) != 2 else out)


def lower_col_sum(bb: relax.BlockBuilder, matched: Match, name: str,
                  isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """A bias gradient: column sums of dY flattened to rows, reduce TPPs per panel."""
    dy = matched["lhs"]
    shape = dims(dy)
    rows, width = int(np.prod(shape[:-1])), shape[-1]
    sch = col_sum_schedule(rows, width, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    dy2 = bb.emit(relax.op.reshape(dy, (rows, width))) if len(shape) != 2 else dy
    return Lowered(relax.call_tir(gv, [dy2], relax.TensorType((width,), "float32")))


FAMILIES = (
    KernelFamily("dense", lower_dense, ("float32", "bfloat16"), gemm_narrow_outputs,
                 gemm_bf16_operand),
    KernelFamily("bmm", lower_bmm),
    KernelFamily("matmul", lower_matmul),
    KernelFamily("col_sum", lower_col_sum),
)
