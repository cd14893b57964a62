"""Weight-only quantized matmuls onto the weight-only kernel, weights kept packed.

``frontend/weight_only.py`` imports ``MatMulNBits`` as plain Relax ops on the packed bytes:
``matmul(A, permute_dims(W))`` (``+ bias``) with ``W = reshape((astype(codes) - zp) *
scales)`` (sliced to K), the codes unpacked from bytes by ``repeat``, ``right_shift`` and
``bitwise_and`` for 4 bits. This pass runs before constant folding (which would expand W to
fp32 constants), recognises that form with its constants, checks them (the shifts, mask,
zero points and shapes are exactly the import's), and emits ``call_tir`` of
``schedules/weight_only.py``'s kernel on the same bytes re-tiled (:func:`pack_weights`), the
bias, a residual tensor added after it (a transformer's skip connection) or a SwiGLU gate
(the product times ``silu`` of the gate projection) fused into its stores. Where A is
quantized to int8 per block first (accuracy level 4) and the target has ``vpdpbusd``, the
kernel takes the unquantized A and quantizes it itself, for int8 dot products; without them,
the fp32 kernel takes the unquantized A. A form it declines (a zero point that is not a
code, a scalable ISA, a non-constant operand) stays as it was: folded to fp32 weights, it
runs on the fp32 GEMM TPP, and the report lists it among the rewrites with the reason.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ..errors import TPPError
from ..schedules.gemm_plan import int8_gemm_dtype
from ..schedules.weight_only import (
    WeightOnlyShape,
    pack_weights,
    plan,
    weight_only_schedule,
)
from .exprs import const_value, dtype_of, static_shape
from .lower import as_relax_kernel
from .report import KernelRow, LoweringReport

#: The report's family of these kernels.
FAMILY = "weight_only"
#: The rewrite the report lists for a weight-only matmul left to the fp32 path.
DECLINED = "weight-only matmul dequantized to fp32 weights"


def _pattern():
    """(root with bias, root without, and the named parts) of the imported form."""
    codes, shifts, mask = is_const(), is_const(), is_const()
    repeat = is_op("relax.repeat")(codes)
    unpacked = is_op("relax.bitwise_and")(is_op("relax.right_shift")(repeat, shifts), mask)
    widened = is_op("relax.astype")(unpacked | codes)
    zp_codes = is_const()
    zp = is_op("relax.astype")(zp_codes) | is_const()
    scales = is_const()
    deq = is_op("relax.multiply")(is_op("relax.subtract")(widened, zp), scales)
    flat = is_op("relax.reshape")(deq, wildcard())
    sliced = is_op("relax.strided_slice")(flat, varg_default_wildcard=True)
    a_int8, a_source, a_tiles = _int8_activations_pattern()
    a = a_int8 | wildcard()
    mm = is_op("relax.matmul")(a, is_op("relax.permute_dims")(sliced | flat))
    bias = is_const()
    with_bias = is_op("relax.add")(mm, bias)
    residual = wildcard()
    product = with_bias | mm
    # The residual stream added after the product (either operand order: fp32 addition
    # commutes exactly).
    with_residual = is_op("relax.add")(product, residual) | \
        is_op("relax.add")(residual, product)
    # SwiGLU: the product times silu of another tensor (the gate projection).
    gate = wildcard()
    silu = is_op("relax.nn.silu")(gate)
    gated = is_op("relax.multiply")(silu, product) | is_op("relax.multiply")(product, silu)
    parts = dict(codes=codes, repeat=repeat, shifts=shifts, mask=mask, unpacked=unpacked,
                 widened=widened, zp=zp, zp_codes=zp_codes, scales=scales, flat=flat,
                 sliced=sliced, a=a, a_int8=a_int8, a_source=a_source, a_tiles=a_tiles,
                 mm=mm, bias=bias, residual=residual, gate=gate)
    return (with_residual, gated, with_bias, mm), parts


def _int8_activations_pattern():
    """(root, x): ``x`` quantized to int8 per row block and dequantized, as
    ``frontend.weight_only.int8_fake_quantized`` writes accuracy level 4."""
    x = wildcard()
    flat = is_op("relax.reshape")(x, wildcard())
    padded = is_op("relax.nn.pad")(flat, varg_default_wildcard=True) | flat
    tiles = is_op("relax.reshape")(padded, wildcard())
    amax = is_op("relax.max")(is_op("relax.abs")(tiles))
    scale = is_op("relax.divide")(amax, is_const())
    inverse = is_op("relax.where")(
        is_op("relax.greater")(amax, is_const()),
        is_op("relax.divide")(is_const(), is_op("relax.maximum")(amax, is_const())), is_const())
    deq = is_op("relax.multiply")(
        is_op("relax.round")(is_op("relax.multiply")(tiles, inverse)), scale)
    back = is_op("relax.reshape")(deq, wildcard())
    sliced = is_op("relax.strided_slice")(back, varg_default_wildcard=True) | back
    return is_op("relax.reshape")(sliced, wildcard()), x, tiles


def _int8_source(m, parts, block: int) -> relax.Expr | None:
    """The unquantized A when the match's A is it quantized to int8 in blocks of ``block``
    (accuracy level 4), else None."""
    if parts["a_int8"] not in m:
        return None
    shape = static_shape(m[parts["a_tiles"]])
    return m[parts["a_source"]] if shape is not None and shape[-1] == block else None


class _Declined(Exception):
    """The matched form is not one the kernel takes (the message says why)."""


def _read(m, parts) -> tuple[WeightOnlyShape, np.ndarray, np.ndarray, np.ndarray | None,
                            np.ndarray | None]:
    """The shape and constants of a match, checked against the import's form."""
    codes = const_value(m[parts["codes"]])
    if codes.dtype != np.uint8 or codes.ndim != 3:
        raise _Declined(f"codes {codes.dtype} {codes.shape}")
    n, blocks, blob = codes.shape
    if parts["unpacked"] in m:
        repeat = m[parts["repeat"]]
        shifts, mask = const_value(m[parts["shifts"]]), const_value(m[parts["mask"]])
        if (int(repeat.attrs.repeats) != 2 or int(repeat.attrs.axis) != 2
                or not np.array_equal(shifts.reshape(-1), np.tile([0, 4], blob))
                or mask.size != 1 or int(mask) != 15):
            raise _Declined("not the 4-bit unpacking")
        bits, block = 4, 2 * blob
    else:
        bits, block = 8, blob
    if str(m[parts["widened"]].attrs.dtype) != "float32":
        raise _Declined("codes widened to another dtype than float32")
    scales = const_value(m[parts["scales"]])
    if scales.shape != (n, blocks, 1) or scales.dtype != np.float32:
        raise _Declined(f"scales {scales.dtype} {scales.shape}")
    zero_points = _zero_points(m, parts, n, blocks, bits)
    flat = static_shape(m[parts["flat"]])
    if flat != [n, blocks * block]:
        raise _Declined(f"dequantized weights of shape {flat}")
    k = blocks * block
    if parts["sliced"] in m:
        sliced = static_shape(m[parts["sliced"]])
        if sliced is None or sliced[0] != n or not k - block < sliced[1] <= k:
            raise _Declined(f"weights sliced to {sliced}")
        k = sliced[1]
    a_shape = static_shape(m[parts["a"]])
    if a_shape is None or len(a_shape) < 2 or a_shape[-1] != k or dtype_of(m[parts["a"]]) \
            != "float32":
        raise _Declined(f"A of shape {a_shape} ({dtype_of(m[parts['a']])})")
    bias = None
    if parts["bias"] in m:
        bias = const_value(m[parts["bias"]])
        if bias.dtype != np.float32 or bias.size != n or bias.shape[-1:] != (n,):
            raise _Declined(f"bias {bias.dtype} {bias.shape}")
        bias = bias.reshape(n)
    shape = WeightOnlyShape(m=math.prod(a_shape[:-1]), k=k, n=n, bits=bits, block=block,
                            zero_points=zero_points is not None, bias=bias is not None)
    return shape, codes, scales.reshape(n, blocks), zero_points, bias


def _same_shape(m, part, root: relax.Expr) -> relax.Expr | None:
    """The matched epilogue operand ``part`` (the residual, the gate) where the kernel's
    stores can take it: fp32, the result's own shape (nothing broadcast); else None."""
    if part not in m:
        return None
    tensor = m[part]
    shape = static_shape(tensor)
    if dtype_of(tensor) != "float32" or shape is None or shape != static_shape(root):
        return None
    return tensor


def _zero_points(m, parts, n: int, blocks: int, bits: int) -> np.ndarray | None:
    """(N, blocks) uint8 zero points; None for the default ``2**(bits-1)``."""
    zp = const_value(m[parts["zp_codes"]]) if parts["zp_codes"] in m else \
        const_value(m[parts["zp"]])
    if zp.size == 1 and float(zp.reshape(())) == float(1 << (bits - 1)):
        return None
    if zp.size != n * blocks:
        raise _Declined(f"zero points of shape {zp.shape}")
    values = zp.reshape(n, blocks)
    if not np.array_equal(values, np.clip(np.rint(values), 0, (1 << bits) - 1)):
        raise _Declined("zero points that are not codes")
    return values.astype(np.uint8)


def _emit(bb: relax.BlockBuilder, a: relax.Expr, shape: WeightOnlyShape, isa: str,
          codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
          bias: np.ndarray | None, residual: relax.Expr | None = None,
          gate: relax.Expr | None = None) -> relax.Expr:
    """``call_tir`` of the kernel on A (any leading dims), padded to the plan's rows, depth
    and columns where needed and cut back after; ``residual`` added and ``silu(gate)``
    multiplied (each A's leading dims x N) by the kernel's stores."""
    shape = replace(shape, residual=residual is not None, gate=gate is not None)
    p = plan(shape, isa)
    packed, tile_scales, tile_zps = pack_weights(shape, p, codes, scales, zero_points)
    gv = bb.add_func(as_relax_kernel(weight_only_schedule(shape, isa).mod["main"]),
                     f"tpp_matmul_int{shape.bits}_weights")
    lead = static_shape(a)[:-1]
    a2 = relax.op.reshape(a, (shape.m, shape.k))
    if (p.rows, p.depth) != (shape.m, shape.k):
        a2 = relax.op.nn.pad(a2, [0, p.rows - shape.m, 0, p.depth - shape.k])
    args = [a2, relax.const(packed), relax.const(tile_scales)]
    args += [relax.const(tile_zps)] if tile_zps is not None else []
    args += [relax.const(np.pad(bias, (0, p.cols - shape.n)))] if bias is not None else []
    for tensor in (residual, gate):  # the kernel's argument order
        if tensor is not None:
            t2 = relax.op.reshape(tensor, (shape.m, shape.n))
            if (p.rows, p.cols) != (shape.m, shape.n):
                t2 = relax.op.nn.pad(t2, [0, p.rows - shape.m, 0, p.cols - shape.n])
            args.append(t2)
    y = relax.call_tir(gv, args, relax.TensorType((p.rows, p.cols), "float32"))
    if (p.rows, p.cols) != (shape.m, shape.n):
        y = relax.op.strided_slice(y, axes=[0, 1], begin=[0, 0], end=[shape.m, shape.n])
    return relax.op.reshape(y, (*lead, shape.n))


def rewrite_weight_only(func: relax.Function, bb: relax.BlockBuilder, isa: str,
                        report: LoweringReport, int8_dot: bool = False) -> relax.Function:
    """Replace each imported weight-only matmul of ``func`` by the kernel, its bias, residual
    or SwiGLU gate fused.
    ``int8_dot``: the target has ``vpdpbusd``, so a matmul whose A is quantized to int8
    (accuracy level 4) runs on it; elsewhere such a matmul takes the unquantized A to the
    fp32 kernel (more accurate than the level asks)."""
    roots, parts = _pattern()
    declined: dict[int, str] = {}  # once per matmul, however many roots tried it

    def rewrite(orig: relax.Expr, m) -> relax.Expr:
        try:
            residual = _same_shape(m, parts["residual"], orig)
            gate = _same_shape(m, parts["gate"], orig)
            if (residual is None and parts["residual"] in m) or \
                    (gate is None and parts["gate"] in m):
                return orig  # an add or product the kernel cannot take (a broadcast, a
                # bias): the roots without it match the product under it
            shape, codes, scales, zero_points, bias = _read(m, parts)
            a = m[parts["a"]]
            source = _int8_source(m, parts, shape.block)
            emit = functools.partial(_emit, bb, codes=codes, scales=scales,
                                     zero_points=zero_points, bias=bias, residual=residual,
                                     gate=gate)
            if source is not None and int8_dot:
                try:
                    int8 = replace(shape, int8_activations=True)
                    out = emit(source, int8, isa)
                    shape = int8
                except TPPError:  # no int8 kernel for this ISA or block: fp32
                    out = emit(source, shape, isa)
            else:
                out = emit(a if source is None else source, shape, isa)
        except (_Declined, TPPError) as why:
            declined[tvm_ffi.structural_hash(m[parts["mm"]])] = str(why)
            return orig
        suffix = ("_bias" if bias is not None else "") + \
            ("_residual" if residual is not None else "") + \
            ("_gate" if gate is not None else "") + \
            ("_tiles" if plan(shape, isa).on_tiles else "")
        precision = "int8" if shape.int8_activations else "float32"
        report.kernels[KernelRow(f"tpp.matmul_int{shape.bits}_weights{suffix}", FAMILY,
                                 precision)] += 1
        return out

    for root in roots:
        func = rewrite_call(root, rewrite, func)
    for why in declined.values():
        report.rewrites[f"{DECLINED} ({why})"] += 1
    return func


def lower_weight_only(mod: tvm.IRModule, isa: str, report: LoweringReport,
                      target: tvm.target.Target | None = None) -> tvm.IRModule:
    """:func:`rewrite_weight_only` over every Relax function of ``mod`` (int8 activations
    where ``isa`` and ``target``'s CPU have u8 x s8 dot products); the unpacking ops left
    without readers are removed."""
    bb = relax.BlockBuilder(mod)
    changed = False
    int8_dot = int8_gemm_dtype(isa, target) == "int8"
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            new = rewrite_weight_only(func, bb, isa, report, int8_dot)
            if not new.same_as(func):
                bb.update_func(gv, new)
                changed = True
    return relax.transform.DeadCodeElimination()(bb.get()) if changed else mod
