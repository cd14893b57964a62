"""The GEMM as TE stages, before scheduling: C = A @ B (+ bias) (+ activation).

B is packed as ``(ceil(N / nr), K, nr)`` panels (zero padded), or for low precision
(``bfloat16``: bf16 x bf16 -> fp32; ``int8``: u8 x s8 -> int32) VNNI-packed as
``(ceil(N / nr), K / V, nr, V)`` with V = 2 or 4 consecutive k of a column adjacent and K
padded to a multiple of V; an int8 GEMM's int32 result is dequantized to fp32
(``Y = float(C) * scale[j] + offset[j]``) before the fp32 epilogue steps. Shapes that are
not multiples of the tile are padded in stages of their own (``A_pad``, ``B_pad``, ``out``),
which the schedule fuses, so the kernel never reads or writes out of bounds. The stage
names here are the ones ``schedules/gemm.py`` and ``schedules/conv.py`` schedule by.
"""

from __future__ import annotations

from tvm import te, tirx

from ..errors import UnsupportedDTypeError, UnsupportedShapeError
from ..intrinsics.epilogue import Epilogue
from ..intrinsics.spec import (
    OPERAND_STEPS,
    equation_expr,
    equation_operands,
    quant_expr,
    residual_quant_expr,
)
from .gemm_plan import GemmPlan

#: Name of a GEMM kernel's packed weight parameter.
WEIGHTS = "B_packed"


def gemm_te(plan: GemmPlan, batch: int | None, epilogue: Epilogue = Epilogue(),
            b_packed: bool = True, dequantize: bool = False,
            a_transposed: bool = False, b_transposed: bool = False, a_scale: float = 1.0,
            a_col_scale: bool = False
            ) -> tuple[list[te.Tensor], te.Tensor, list[tuple[str, tuple[str, ...]]]]:
    """TE stages of the GEMM; returns (inputs, output, epilogue stages).

    Inputs in order: A ((M, K), or (K, M) when ``a_transposed``), B (packed panels, or an
    activation operand when ``b_packed`` is False: (K, N), or (N, K) when ``b_transposed``),
    then for int8 with ``dequantize`` the per-column scale and offset (padded to the packed
    width), then the ``epilogue``'s operands (:func:`epilogue_te`). A transposed A is
    copied into (M, K) rows and a transposed B into packed panels inside the kernel
    (``A_transpose``, ``B_pack``, transpose TPPs where unpadded), so backward GEMMs
    (dY Wᵀ, Xᵀ dY) run the same microkernel. ``a_scale`` multiplies A on its way in
    (C = s·A·B, as a custom contraction's constant factor). ``a_col_scale`` adds an input
    S (K,) right after B and computes (A diag(S)) B: a squeeze-excite channel scale
    applied to A's rows as each row tile is read (``A_colscale``), never as a pass of its
    own over the activation.
    Transposed or scaled operands are fp32 only.
    """
    m, n, prec = plan.m, plan.n, plan.precision
    lead = (batch,) if batch else ()
    if prec.vnni > 1 and (a_transposed or b_transposed or a_scale != 1.0 or a_col_scale):
        raise UnsupportedDTypeError(
            f"GEMM {plan.dtype}: transposed or scaled operands are supported in fp32 only")
    inputs, A, B, b_packed = _gemm_operands(plan, lead, b_packed, a_transposed, b_transposed,
                                            a_col_scale)
    A_in = _a_rows(plan, lead, A, inputs[-1] if a_col_scale else None, a_transposed, a_scale)
    C = _gemm_product(plan, lead, A_in, B, b_packed)
    if dequantize:
        if prec.acc != "int32":
            raise UnsupportedDTypeError(f"GEMM {plan.dtype}: only int8 GEMMs dequantize")
        epilogue_inputs, out, stages = int8_epilogue_te(C, (*lead, m, n), epilogue)
        return inputs + epilogue_inputs, out, stages
    if prec.acc != "float32" and epilogue.steps:
        raise UnsupportedDTypeError(
            f"GEMM {plan.dtype}: an epilogue needs fp32; pass dequantize=True")
    epilogue_inputs, out, stages = epilogue_te(C, (*lead, m, n), epilogue)
    return inputs + epilogue_inputs, out, stages


def _gemm_operands(plan: GemmPlan, lead: tuple, b_packed: bool, a_transposed: bool,
                   b_transposed: bool, a_col_scale: bool) -> tuple:
    """:func:`gemm_te`'s inputs before the epilogue's (A, B [, A's column scale]), and A
    and B as the product reads them: a transposed B packed into panels inside the kernel
    (then ``b_packed`` is True)."""
    m, n, k, nr = plan.m, plan.n, plan.k, plan.nr
    np_, kp = plan.np_, plan.kp
    prec = plan.precision
    V = prec.vnni
    if a_transposed:
        A = te.placeholder((*lead, k, m), prec.a, name="A")
    else:
        A = te.placeholder(plan.a_shape(lead), prec.a, name="A")
    if b_packed:
        B = te.placeholder(plan.b_packed_shape(lead), prec.b, name=WEIGHTS)
    elif V > 1:
        raise UnsupportedDTypeError(
            f"GEMM {plan.dtype}: B must be a packed constant (VNNI layout); a {plan.dtype} "
            "matmul of two activations is not supported")
    elif b_transposed:
        B = te.placeholder((*lead, n, k), prec.b, name="B")
        B = te.compute((*lead, np_ // nr, kp, nr), _pack_transposed(B, n, k, nr), name="B_pack")
        b_packed = True
    else:
        B = te.placeholder((*lead, k, n), prec.b, name="B")
    inputs = [A, B.op.input_tensors[0] if B.op.name == "B_pack" else B]
    if a_col_scale:
        inputs.append(te.placeholder((*lead, k), "float32", name="a_col_scale"))
    return inputs, A, B, b_packed


def _a_rows(plan: GemmPlan, lead: tuple, A: te.Tensor, col_scale: te.Tensor | None,
            a_transposed: bool, a_scale: float) -> te.Tensor:
    """A as the product reads it: (M, K) rows, padded to the tile, transposed, scaled by
    ``a_scale`` and by ``col_scale`` (A diag(S)) on the way in where asked."""
    m, k, mp, kp = plan.m, plan.k, plan.mp, plan.kp
    if a_transposed:
        A_in = _transposed_in(A, (*lead, mp, kp), (m, k), "A_transpose")
    else:
        padded_a = (mp, kp) != (m, k) and not plan.a_prepadded
        A_in = _padded(A, (*lead, mp, kp), (m, k), "A_pad") if padded_a else A
    if a_scale != 1.0:
        src = A_in
        A_in = te.compute(tuple(src.shape), lambda *ix: src[ix] * tirx.const(a_scale, "float32"),
                          name="A_scale")
    if col_scale is not None:
        src, S = A_in, col_scale
        A_in = te.compute(tuple(src.shape), lambda *ix: src[ix] * S[
            (*ix[:-2], tirx.min(ix[-1], k - 1))], name="A_colscale")
    return A_in


def _gemm_product(plan: GemmPlan, lead: tuple, A_in: te.Tensor, B: te.Tensor,
                  b_packed: bool) -> te.Tensor:
    """C = A_in B over the padded tile: B as VNNI-packed panels, fp32 panels, or an
    activation operand (padded in a stage of its own)."""
    n, k, nr = plan.n, plan.k, plan.nr
    mp, np_, kp = plan.mp, plan.np_, plan.kp
    prec = plan.precision
    V = prec.vnni

    def mac(a, b):
        if prec.acc == prec.a:
            return a * b
        return tirx.Cast(prec.acc, a) * tirx.Cast(prec.acc, b)

    if V > 1:
        ko = te.reduce_axis((0, kp // V), name="ko")
        kv = te.reduce_axis((0, V), name="kv")
        return te.compute(
            (*lead, mp, np_),
            lambda *ix: te.sum(mac(A_in[(*ix[:-2], ix[-2], ko * V + kv)],
                                   B[(*ix[:-2], ix[-1] // nr, ko, ix[-1] % nr, kv)]),
                               axis=[ko, kv]),
            name="C",
        )
    elif b_packed:
        r = te.reduce_axis((0, kp), name="k")
        return te.compute(
            (*lead, mp, np_),
            lambda *ix: te.sum(
                A_in[(*ix[:-2], ix[-2], r)] * B[(*ix[:-2], ix[-1] // nr, r, ix[-1] % nr)], axis=r
            ),
            name="C",
        )
    else:
        r = te.reduce_axis((0, kp), name="k")
        B_in = _padded(B, (*lead, kp, np_), (k, n), "B_pad") if (kp, np_) != (k, n) else B
        return te.compute(
            (*lead, mp, np_),
            lambda *ix: te.sum(A_in[(*ix[:-2], ix[-2], r)] * B_in[(*ix[:-2], r, ix[-1])], axis=r),
            name="C",
        )


def int8_epilogue_te(C: te.Tensor, valid: tuple[int, ...], epilogue: Epilogue,
                     c_axes: tuple[int, ...] | None = None, group_axis: int | None = None
                     ) -> tuple[list[te.Tensor], te.Tensor, list[tuple[str, tuple[str, ...]]]]:
    """An int32 contraction C's :func:`dequantize_te` then :func:`epilogue_te` (inputs: the
    dequantize rows, then the epilogue's). With no step between dequantizing and a u8/s8
    output, one requantize pass over each tile instead of two: its inputs are only the rows
    :data:`REQUANTIZE_ROWS`, ``S q`` and ``O q + z``, the caller having folded the output's
    quantization (1/scale q, zero point z) into the dequantize rows S, O.

    Likewise a residual of the output's own dtype with at most a ReLU after it: one
    ``requantize_add[_relu]`` pass, its inputs the dequantize rows, the residual, then
    :data:`RESIDUAL_REQUANTIZE_ROWS`: the residual's scale row times q (the caller folds
    it) and the zero point row."""
    out_dtype = epilogue.out_dtype
    plain = c_axes is None and group_axis is None
    if out_dtype in ("uint8", "int8") and not epilogue.steps and plain:
        scale, offset = (te.placeholder((int(C.shape[-1]),), "float32", name=name)
                         for name in REQUANTIZE_ROWS)
        out = te.compute(valid, lambda *ix: quant_expr(
            "requantize", C[ix], scale[ix[-1]], offset[ix[-1]], out_dtype), name="out_q")
        return [scale, offset], out, [("out_q", (REQUANTIZE, out_dtype))]
    if out_dtype in ("uint8", "int8") and epilogue.residual \
            and epilogue.residual_dtype == out_dtype and plain \
            and epilogue.pre_steps == () and not epilogue.gate \
            and epilogue.post_activation in (None, "relu"):
        return _requantize_add_te(C, valid, epilogue.post_activation == "relu", out_dtype)
    deq_inputs, C, deq_stages = dequantize_te(C, group_axis)
    inputs, out, stages = epilogue_te(C, valid, epilogue, c_axes)
    return deq_inputs + inputs, out, deq_stages + stages


def _requantize_add_te(C: te.Tensor, valid: tuple[int, ...], relu: bool, out_dtype: str
                       ) -> tuple[list[te.Tensor], te.Tensor, list[tuple[str, tuple[str, ...]]]]:
    """The one-pass residual epilogue of :func:`int8_epilogue_te`."""
    width = int(C.shape[-1])
    scale, offset = (te.placeholder((width,), "float32", name=name) for name in DEQUANTIZE_ROWS)
    res = te.placeholder(valid, out_dtype, name="residual")
    out_scale = te.placeholder((width,), "float32", name=RESIDUAL_REQUANTIZE_ROWS[0])
    out_offset = te.placeholder((valid[-1],), "float32", name=RESIDUAL_REQUANTIZE_ROWS[1])
    op = "requantize_add_relu" if relu else "requantize_add"
    out = te.compute(valid, lambda *ix: residual_quant_expr(
        op, C[ix], scale[ix[-1]], offset[ix[-1]], res[ix], out_scale[ix[-1]],
        out_offset[ix[-1]], out_dtype), name="out_q")
    return [scale, offset, res, out_scale, out_offset], out, [("out_q", (op, out_dtype))]


def epilogue_te(C: te.Tensor, valid: tuple[int, ...], epilogue: Epilogue,
                c_axes: tuple[int, ...] | None = None
                ) -> tuple[list[te.Tensor], te.Tensor, list[tuple[str, tuple[str, ...]]]]:
    """The fused epilogue after a contraction C (padded in its last two dims), as equation
    TPPs: Y = post(act(C + bias) [* gate] + residual), one pass over each register tile.

    Unpadded, that is one stage (``epilogue``). Padded, the steps that work on the padded
    tile (bias, act) form ``epilogue`` and the rest go with dropping the padding (``out``),
    whose edge tiles cannot be tensorized. Returns (extra inputs, output tensor, stages as
    (name, equation steps; none for a plain copy)).

    ``c_axes`` (a grouped convolution: C is (n, oh, group, ow, channel), the output
    (n, oh, ow, group, channel)) gives, for each dim of C, the output dim it is: all steps
    then run in one ``out`` stage that also transposes, with a bias row per group.

    ``epilogue.out_dtype="bfloat16"``: a last stage (``out_bf16``, a converting copy TPP on the
    tile) writes the result as bf16, for a consumer that takes bf16 (the next layer of a
    bf16 model), so the activation never makes an fp32 round trip through memory. It
    reads a padded tile itself, in place of the plain copy that drops the padding (one
    pass over the tile fewer).
    ``"uint8"``/``"int8"``: the last stage (``out_q``) is a quantize TPP instead, with two
    more inputs, per output column: 1/scale and the zero point (the next int8 layer's
    input quantization).

    A quantized residual (``epilogue.residual_dtype`` u8/s8, see :class:`Epilogue`) comes
    with its ``scale`` row input after it; the caller has folded the residual's
    quantization into C (C / s_r - z_r): with s_r > 0, Y = relu(C + r) * s_r is
    ``relu(C + (r - z_r) * s_r)``.
    """
    if epilogue.quantized_residual and c_axes is not None:
        raise UnsupportedShapeError(
            f"epilogue: a {epilogue.residual_dtype} residual in a grouped convolution")
    inputs, out, stages = _epilogue_te(C, valid, epilogue, c_axes)
    out_dtype = epilogue.out_dtype
    if out_dtype == "float32":
        return inputs, out, stages
    src = out
    if stages and stages[-1] == ("out", ()):
        # the conversion drops the padding itself: no plain copy pass before it
        src, stages = out.op.input_tensors[0], stages[:-1]
    if out_dtype in ("uint8", "int8"):
        scale = te.placeholder((valid[-1],), "float32", name="q_scale")
        offset = te.placeholder((valid[-1],), "float32", name="q_offset")
        out = te.compute(valid, lambda *ix: quant_expr(
            "quantize", src[ix], scale[ix[-1]], offset[ix[-1]], out_dtype), name="out_q")
        return [*inputs, scale, offset], out, [*stages, ("out_q", (QUANTIZE, out_dtype))]
    out = te.compute(valid, lambda *ix: tirx.Cast("bfloat16", src[ix]), name="out_bf16")
    return inputs, out, [*stages, ("out_bf16", (TO_BF16,))]


#: The epilogue step that converts the finished fp32 tile to bf16 (see ``epilogue_te``).
TO_BF16 = "to_bf16"
#: The epilogue step that quantizes the finished fp32 tile, followed by the int8 dtype.
QUANTIZE = "quantize"
#: The epilogue step that requantizes an int32 tile (``int8_epilogue_te``), followed by the
#: int8 dtype.
REQUANTIZE = "requantize"
#: An int8 kernel's dequantize rows, scale and offset per output column (``dequantize_te``).
DEQUANTIZE_ROWS = ("dq_scale", "dq_offset")
#: A requantizing kernel's row inputs, in place of the dequantize rows (``int8_epilogue_te``).
REQUANTIZE_ROWS = ("rq_scale", "rq_offset")
#: A kernel requantizing with its residual in one pass: its rows after the residual, in
#: place of the residual's scale row and the output's 1/scale and zero point rows.
RESIDUAL_REQUANTIZE_ROWS = ("rq_residual_scale", "q_offset")


def _epilogue_te(C: te.Tensor, valid: tuple[int, ...], epilogue: Epilogue,
                 c_axes: tuple[int, ...] | None
                 ) -> tuple[list[te.Tensor], te.Tensor, list[tuple[str, tuple[str, ...]]]]:
    """:func:`epilogue_te` in fp32."""
    pre, post = epilogue.pre_steps, epilogue.post_steps
    bias, gate, residual = epilogue.bias, epilogue.gate, epilogue.residual
    gate_t = te.placeholder(valid, "float32", name="gate") if gate else None
    res_t = te.placeholder(valid, epilogue.residual_dtype, name="residual") if residual \
        else None
    # a quantized residual's scale: a row like the bias (padded width)
    rescale_t = te.placeholder((int(C.shape[-1]),), "float32", name="residual_scale") \
        if epilogue.quantized_residual else None
    post_operands = [t for t in (gate_t, res_t, rescale_t) if t is not None]
    if c_axes is not None:
        bias_t = te.placeholder((valid[-2], int(C.shape[-1])), "float32",
                                name="bias_packed") if bias else None
        inputs = [t for t in (bias_t, *post_operands) if t is not None]
        return inputs, _equation_stage(C, valid, pre + post, inputs, "out", c_axes), \
            [("out", pre + post)]
    padded = tuple(int(d) for d in C.shape) != tuple(valid)
    bias_t = te.placeholder((int(C.shape[-1]),), "float32", name="bias_packed") if bias else None
    inputs = [t for t in (bias_t, *post_operands) if t is not None]
    if not padded:
        steps = pre + post
        if not steps:
            return inputs, C, []
        return inputs, _equation_stage(C, valid, steps, inputs, "epilogue"), [("epilogue", steps)]
    out, stages = C, []
    if pre:
        out = _equation_stage(C, tuple(C.shape), pre, [bias_t] if bias else [], "epilogue")
        stages.append(("epilogue", pre))
    src = out
    stages.append(("out", post))
    if post:
        out = _equation_stage(src, valid, post, post_operands, "out")
    else:
        out = te.compute(valid, lambda *ix: src[ix], name="out")
    return inputs, out, stages


def dequantize_te(C: te.Tensor, group_axis: int | None = None
                  ) -> tuple[list[te.Tensor], te.Tensor, list]:
    """An int32 contraction's fp32 value, ``C * scale[j] + offset[j]`` per output column
    (both padded to C's width): inputs, output and its epilogue stage. A grouped
    convolution's C has its group at ``group_axis``: a row of both per group."""
    width = int(C.shape[-1])
    rows = (int(C.shape[group_axis]),) if group_axis is not None else ()
    scale, offset = (te.placeholder((*rows, width), "float32", name=name)
                     for name in DEQUANTIZE_ROWS)

    def at(row: te.Tensor, ix: tuple) -> tirx.PrimExpr:
        return row[(ix[group_axis], ix[-1]) if rows else (ix[-1],)]

    out = te.compute(tuple(C.shape), lambda *ix: quant_expr(
        "dequantize", C[ix], at(scale, ix), at(offset, ix), "float32"), name="dequant")
    return [scale, offset], out, [("dequant", ("dequantize",))]


def _equation_stage(src: te.Tensor, shape: tuple[int, ...], steps: tuple[str, ...],
                    operands: list[te.Tensor], name: str,
                    src_axes: tuple[int, ...] | None = None) -> te.Tensor:
    """``steps`` on ``src`` (read at the output index permuted by ``src_axes``); a bias
    spans the output's trailing dims (a row, or a row per group)."""
    kinds = equation_operands(steps)

    def at(ix: tuple) -> tirx.PrimExpr:
        return src[tuple(ix[a] for a in src_axes)] if src_axes else src[ix]

    return te.compute(shape, lambda *ix: equation_expr(steps, at(ix), [
        p[ix[-len(p.shape):]] if OPERAND_STEPS[k].row else p[ix]
        for p, k in zip(operands, kinds)
    ]), name=name)


def _padded(src: te.Tensor, shape: tuple, valid: tuple, name: str) -> te.Tensor:
    """``src`` zero-padded to ``shape`` (its trailing dims ``valid`` are the real extents)."""
    nd = len(valid)
    # Only padded dims are tested: a test on the vectorized dim, though it always holds,
    # stayed in the copy's vector code (AMX Xeon, 784x128x512 int8 GEMM with A padded to
    # 800 rows, int32 out: 47 -> 40 us).
    padded = [d for d in range(nd) if int(shape[len(shape) - nd + d]) != valid[d]]

    def at(*ix):
        inside = tirx.all(*[ix[-nd + d] < valid[d] for d in padded])
        clamped = [tirx.min(ix[-nd + d], valid[d] - 1) if d in padded else ix[-nd + d]
                   for d in range(nd)]
        return tirx.if_then_else(inside, src[(*ix[:-nd], *clamped)], tirx.const(0, src.dtype))

    return te.compute(shape, at, name=name)


def _transposed_in(src: te.Tensor, shape: tuple, valid: tuple, name: str) -> te.Tensor:
    """``src`` (..., cols, rows) transposed to (..., rows, cols), zero-padded to ``shape``:
    a transposed operand (a backward pass's Xᵀ) copied into the layout the microkernel reads."""
    rows, cols = valid
    if tuple(shape[-2:]) == tuple(valid):  # no padding: a plain transpose (TPP-matchable)
        return te.compute(shape, lambda *ix: src[(*ix[:-2], ix[-1], ix[-2])], name=name)

    def at(*ix):
        *lead, i, j = ix
        inside = tirx.all(i < rows, j < cols)
        return tirx.if_then_else(inside, src[(*lead, tirx.min(j, cols - 1),
                                              tirx.min(i, rows - 1))],
                                 tirx.const(0, src.dtype))

    return te.compute(shape, at, name=name)


def _pack_transposed(B: te.Tensor, n: int, k: int, nr: int):
    """Element (jb, kk, jj) of packed panels from B given as (N, K), zero-padded."""
    if n % nr == 0 and int(B.shape[-1]) == k and k >= 2:
        return lambda *ix: B[(*ix[:-3], ix[-3] * nr + ix[-1], ix[-2])]

    def at(*ix):
        *lead, jb, kk, jj = ix
        j = jb * nr + jj
        inside = tirx.all(kk < k, j < n)
        return tirx.if_then_else(inside, B[(*lead, tirx.min(j, n - 1), tirx.min(kk, k - 1))],
                                 tirx.const(0, "float32"))

    return at
