"""The row-wise families: layer norm, RMS norm and softmax over the last axis, element-wise
chains as one equation TPP, and channels-last instance / group norm."""

from __future__ import annotations

import numpy as np
from tvm import relax

from ...schedules.instance_norm import instance_norm_apply_schedule, instance_norm_stats_schedule
from ...schedules.rowwise import (
    equation_schedule,
    layer_norm_schedule,
    padded_rows,
    rms_norm_schedule,
    softmax_schedule,
)
from .base import KernelFamily, Lowered, Match, as_relax_kernel, dims, kernel_name


def _rows_in(bb: relax.BlockBuilder, x2: relax.Expr, rows: int, padded: int) -> relax.Expr:
    """(rows, width) ``x2`` with zero rows appended up to ``padded``."""
    return x2 if padded == rows else bb.emit(relax.op.nn.pad(x2, [0, padded - rows, 0, 0]))


def _rows_out(bb: relax.BlockBuilder, out: relax.Expr, rows: int, padded: int) -> relax.Expr:
    """The first ``rows`` rows of a padded kernel output."""
    return out if padded == rows else bb.emit(
        relax.op.strided_slice(out, axes=[0], begin=[0], end=[rows]))


def _rowwise_kernel(bb: relax.BlockBuilder, x: relax.Expr, name: str, schedule, args: list
                    ) -> relax.Expr:
    """A row-wise kernel over ``x`` flattened to rows (the first of ``args``), reshaped back
    (a row count no block size divides is padded inside the kernel)."""
    xs = dims(x)
    rows, width = int(np.prod(xs[:-1])), xs[-1]
    gv = bb.add_func(as_relax_kernel(schedule(rows, width).mod["main"]),
                     kernel_name(name))
    x2 = bb.emit(relax.op.reshape(x, (rows, width))) if len(xs) != 2 else x
    out = bb.emit(relax.call_tir(gv, [x2, *args], relax.TensorType((rows, width), "float32")))
    return relax.op.reshape(out, xs) if len(xs) != 2 else out


def lower_layer_norm(bb: relax.BlockBuilder, matched: Match, name: str,
                     isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """Layer norm over the last axis: rows flattened, one TPP-equation kernel."""
    eps = float(matched["root"].attrs.epsilon)
    return _rowwise(bb, matched["lhs"], name,
                           lambda rows, width: layer_norm_schedule(rows, width, eps, isa),
                           [matched["gamma"], matched["beta"]])


def lower_rms_norm(bb: relax.BlockBuilder, matched: Match, name: str,
                   isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """RMS norm over the last axis: rows flattened, one TPP-equation kernel."""
    eps = float(matched["root"].attrs.epsilon)
    return _rowwise(bb, matched["lhs"], name,
                           lambda rows, width: rms_norm_schedule(rows, width, eps, isa),
                           [matched["gamma"]])


def lower_softmax(bb: relax.BlockBuilder, matched: Match, name: str,
                  isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """Softmax over the last axis: rows flattened, one TPP-equation kernel."""
    return _rowwise(bb, matched["lhs"], name,
                           lambda rows, width: softmax_schedule(rows, width, isa), [])


def lower_eltwise(bb: relax.BlockBuilder, matched: Match, name: str,
                  isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """An element-wise chain (act(x), x + y, act(x + y)) as one equation TPP kernel."""
    x = matched["lhs"]
    xs = dims(x)
    width, rows = xs[-1], int(np.prod(xs[:-1]))
    padded = padded_rows(rows, width)
    steps: list[str] = []
    kinds: list[str] = []
    args = [_rows_in(bb, bb.emit(relax.op.reshape(x, (rows, width))), rows, padded)]
    if "operand" in matched:
        y = matched["operand"]
        kind = "residual" if dims(y) == xs else "bias"
        steps.append(kind)
        kinds.append(kind)
        args.append(_rows_in(bb, bb.emit(relax.op.reshape(y, (rows, width))), rows, padded)
                    if kind == "residual" else bb.emit(relax.op.reshape(y, (width,))))
    if matched.epilogue.activation:
        steps.append(matched.epilogue.activation)
    sch = equation_schedule(padded, width, tuple(steps), kinds, isa)
    gv = bb.add_func(as_relax_kernel(sch.mod["main"]), kernel_name(name))
    out = bb.emit(relax.call_tir(gv, args, relax.TensorType((padded, width), "float32")))
    return Lowered(relax.op.reshape(_rows_out(bb, out, rows, padded), xs))


def lower_instance_norm(bb: relax.BlockBuilder, matched: Match, name: str,
                        isa: str, precision: str = "float32", threads: int = 1) -> Lowered:
    """Channels-last instance or group norm (+ act): per-channel scale and shift from
    column statistics, then one equation TPP pass (``scale``, ``bias``, act)."""
    x, root = matched["lhs"], matched["root"]
    _, rows, width = dims(x)
    groups = int(root.attrs.num_groups) if hasattr(root.attrs, "num_groups") else width
    stats = instance_norm_stats_schedule(rows, width, float(root.attrs.epsilon), isa, groups)
    stats_gv = bb.add_func(as_relax_kernel(stats.mod["main"]),
                           kernel_name(name) + "_stats")
    x2 = bb.emit(relax.op.reshape(x, (rows, width)))
    row = relax.TensorType((width,), "float32")
    scale_shift = bb.emit(relax.call_tir(stats_gv, [x2, matched["gamma"], matched["beta"]],
                                         [row, row]))
    apply = instance_norm_apply_schedule(rows, width, matched.epilogue.activation, isa)
    gv = bb.add_func(as_relax_kernel(apply.mod["main"]), kernel_name(name))
    out = bb.emit(relax.call_tir(gv, [x2, bb.emit(relax.TupleGetItem(scale_shift, 0)),
                                      bb.emit(relax.TupleGetItem(scale_shift, 1))],
                                 relax.TensorType((rows, width), "float32")))
    return Lowered(relax.op.reshape(out, (1, rows, width)))


def _rowwise(bb: relax.BlockBuilder, x: relax.Expr, name: str, schedule, args: list
             ) -> Lowered:
    return Lowered(_rowwise_kernel(bb, x, name, schedule, args))


FAMILIES = (
    KernelFamily("layer_norm", lower_layer_norm),
    KernelFamily("rms_norm", lower_rms_norm),
    KernelFamily("softmax", lower_softmax),
    KernelFamily("eltwise", lower_eltwise),
    KernelFamily("instance_norm", lower_instance_norm),
)
