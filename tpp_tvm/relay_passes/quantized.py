"""Quantized matmuls onto the int8 (u8 x s8 -> int32) TPP GEMM.

ONNX quantized models reach Relax in two shapes (TVM's converter spells out the math):

* dynamic (``onnxruntime.quantization.quantize_dynamic``: DynamicQuantizeLinear +
  MatMulInteger + Cast + Mul): ``float(matmul(int32(a_q) - int32(a_zp), int32(W_q))) * s``;
* QDQ (``quantize_static`` in QDQ format, and QLinearMatMul, which ``frontend.py`` imports
  as dequantize -> matmul -> quantize): ``matmul(dequantize(a_q, s_a, z_a),
  dequantize(W_q, s_w, 0))``.

Both are ``C = (A_q - z_a) @ W_q * s_a * s_w[j]`` with a constant s8 weight of zero point 0
(symmetric, as both tools quantize weights by default). That is one int8 GEMM kernel with
its dequantize epilogue: ``Y = float(A_q @ W_q) * S[j] + O[j]``, ``S = s_a * s_w`` and
``O = -z_a * colsum(W_q)[j] * S`` (a few tiny Relax ops compute S and O from the run-time
activation scale). s8 activations are shifted to u8 (``+128``, zero point too) because the
VNNI/AMX dot products take u8 x s8. Anything else (weight zero points, non-constant weights,
blocked quantization) is left to TVM and counted as a fallback in the report.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ..schedules.gemm import gemm_schedule, pack_b_numpy
from ..schedules.reduce_all import LANES, reduce_all_schedule
from .canonicalize import rewrite_erf_gelu
from .lower import LoweringReport, _kernel_attrs
from .patterns import ACTIVATIONS


def _shape(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def _const(expr: relax.Expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.Constant) else None


class _Emitter:
    """Builds int8 GEMM calls and collects the kernels they need (added to the module)."""

    def __init__(self, bb: relax.BlockBuilder, isa: str, report: LoweringReport) -> None:
        self.bb = bb
        self.isa = isa
        self.report = report
        self.kernels = 0

    def int8_matmul(self, a_q: relax.Expr, a_zp: relax.Expr, w_q: np.ndarray,
                    scale: relax.Expr, name: str, bias: np.ndarray | None = None,
                    activation: str | None = None) -> relax.Expr | None:
        """``act((a_q - a_zp) @ w_q * scale + bias)`` in fp32, or None (with a reported
        reason); bias and activation run in the GEMM's epilogue."""
        why = self._unsupported(a_q, a_zp, w_q, scale)
        if why:
            self.report.fallbacks[f"tpp.int8_matmul ({why})"] += 1
            return None
        xs = _shape(a_q)
        k, n = w_q.shape
        m = int(np.prod(xs[:-1])) if len(xs) > 1 else 1
        sch, plan = gemm_schedule(m, n, k, self.isa, dtype="int8", dequantize=True,
                                  bias=bias is not None, activation=activation)
        gv = self.bb.add_func(_kernel_attrs(sch.mod["main"]), "tpp_int8_matmul")
        self.kernels += 1
        a2 = relax.op.reshape(a_q, (m, k)) if len(xs) != 2 else a_q
        zp = relax.op.astype(a_zp, "float32")
        if _dtype(a_q) == "int8":  # u8 x s8 only: shift A (and its zero point) by 128
            a2 = relax.op.astype(relax.op.add(relax.op.astype(a2, "int32"),
                                              relax.const(128, "int32")), "uint8")
            zp = relax.op.add(zp, relax.const(128.0, "float32"))
        pad = plan.np_ - n
        s = relax.op.reshape(scale, (1,)) if not _shape(scale) else scale
        s_row = relax.op.multiply(relax.const(np.ones(n, "float32")), s)
        colsum = w_q.astype(np.int64).sum(axis=0).astype("float32")
        o_row = relax.op.multiply(relax.op.multiply(relax.const(-colsum), zp), s_row)
        if pad:
            s_row = relax.op.concat([s_row, relax.const(np.zeros(pad, "float32"))])
            o_row = relax.op.concat([o_row, relax.const(np.zeros(pad, "float32"))])
        packed = relax.const(pack_b_numpy(w_q.astype(np.int8), plan.nr, "kn", plan.kp, 4))
        args = [a2, packed, s_row, o_row]
        if bias is not None:
            args.append(relax.const(np.pad(bias.reshape(-1).astype("float32"), (0, pad))))
        out = relax.call_tir(gv, args, relax.TensorType((m, n), "float32"))
        epilogue = "_bias" if bias is not None else ""
        epilogue += f"_{activation}" if activation else ""
        self.report.lowered[f"{name}{epilogue} [int8]"] += 1
        return relax.op.reshape(out, (*xs[:-1], n)) if len(xs) != 2 else out

    @staticmethod
    def _unsupported(a_q, a_zp, w_q, scale) -> str | None:
        if _dtype(a_q) not in ("uint8", "int8"):
            return f"activation dtype {_dtype(a_q)}"
        if w_q.ndim != 2 or w_q.min() < -128 or w_q.max() > 127:
            return "weight is not a 2-D s8 constant"
        if _shape(a_zp) not in ([], [1]):
            return "per-row activation zero points"
        if _shape(scale) not in ([], [1], [w_q.shape[1]]):
            return f"scale of shape {_shape(scale)}"
        return None


def _matmul_integer_pattern():
    a_q, a_zp, w, w_zp, scale = wildcard(), wildcard(), is_const(), is_const(), wildcard()
    a32 = is_op("relax.astype")(a_q)
    lhs = is_op("relax.subtract")(a32, is_op("relax.astype")(a_zp)) | a32
    w32 = is_op("relax.astype")(w)
    rhs = is_op("relax.subtract")(w32, is_op("relax.astype")(w_zp)) | w32
    mm = is_op("relax.matmul")(lhs, rhs)
    root = is_op("relax.multiply")(is_op("relax.astype")(mm), scale)
    return root, a_q, a_zp, w, w_zp, scale


def _qdq_pattern():
    a_q, s_a, z_a = wildcard(), wildcard(), wildcard()
    w, s_w, z_w = is_const(), is_const(), is_const()
    dq_w = is_op("relax.dequantize")(w, s_w, z_w)
    w_t = is_op("relax.permute_dims")(dq_w)  # a Gemm with transB (a linear layer)
    root = is_op("relax.matmul")(is_op("relax.dequantize")(a_q, s_a, z_a), dq_w | w_t)
    return root, a_q, s_a, z_a, w, s_w, z_w, w_t, dq_w


def _bias_value(expr: relax.Expr, n: int) -> np.ndarray | None:
    """A constant bias row of width n (or a dequantized constant one, as QDQ writes it)."""
    value = _const(expr)
    if value is None and isinstance(expr, relax.Call) and expr.op.name == "relax.dequantize":
        q, sc, zp = (_const(a) for a in expr.args)
        if q is None or sc is None or zp is None:
            return None
        value = (q.astype(np.float64) - zp.astype(np.float64)) * sc.astype(np.float64)
    if value is None or value.shape[-1:] != (n,) or value.size != n:
        return None
    return value.reshape(n).astype(np.float32)


def _with_epilogues(core):
    """(pattern, bias, activation patterns) variants of ``core``, biggest first: act(core +
    bias), core + bias, core. Each is rewritten in its own pass, so a matmul whose output
    feeds a bias and an activation becomes one kernel, not three."""
    bias = wildcard()
    with_bias = is_op("relax.add")(core, bias)
    variants = [(is_op(op)(with_bias), bias, ACTIVATIONS[op]) for op in ACTIVATIONS]
    return [*variants, (with_bias, bias, None), (core, None, None)]


def rewrite_quantized_matmuls(func: relax.Function, emitter: _Emitter) -> relax.Function:
    """Replace the dynamic and QDQ quantized matmul forms in ``func`` with int8 GEMMs,
    with a following constant bias and activation fused into the GEMM's epilogue."""
    core, a_q, a_zp, w, w_zp, scale = _matmul_integer_pattern()

    def dynamic(bias, act):
        def rewrite(orig, m):
            wz = _const(m[w_zp]) if w_zp in m else None
            if _dtype(m[w]) != "int8":
                return orig
            if wz is not None and np.any(wz):
                emitter.report.fallbacks["tpp.int8_matmul (weight zero point)"] += 1
                return orig
            b = _bias_value(m[bias], _const(m[w]).shape[1]) if bias is not None else None
            if bias is not None and b is None:
                return orig
            zp = m[a_zp] if a_zp in m else relax.const(0, "int32")
            out = emitter.int8_matmul(m[a_q], zp, _const(m[w]), m[scale],
                                      "tpp.matmul_integer", b, act)
            return orig if out is None else out
        return rewrite

    for pattern, bias, act in _with_epilogues(core):
        func = rewrite_call(pattern, dynamic(bias, act), func)
    core, xq, s_a, z_a, wq, s_w, z_w, w_t, dq_w = _qdq_pattern()

    def qdq(bias, act):
        def rewrite(orig, m):
            if _dtype(m[wq]) != "int8":
                return orig
            if np.any(_const(m[z_w])) or _shape(m[s_a]) not in ([], [1]):
                emitter.report.fallbacks["tpp.int8_matmul (weight zero point)"] += 1
                return orig
            w = _const(m[wq])
            transposed = w_t in m
            if transposed:
                if [int(a) for a in m[w_t].attrs.axes] != [1, 0]:
                    return orig
                w = np.ascontiguousarray(w.T)
            if _const(m[s_w]).size > 1 and \
                    int(m[dq_w].attrs.axis) % 2 != (0 if transposed else 1):
                emitter.report.fallbacks["tpp.int8_matmul (per-row weight scales)"] += 1
                return orig
            b = _bias_value(m[bias], w.shape[1]) if bias is not None else None
            if bias is not None and b is None:
                return orig
            s = emitter.bb.normalize(relax.op.multiply(m[s_a], m[s_w]))
            out = emitter.int8_matmul(m[xq], m[z_a], w, s, "tpp.qdq_matmul", b, act)
            return orig if out is None else out
        return rewrite

    for pattern, bias, act in _with_epilogues(core):
        func = rewrite_call(pattern, qdq(bias, act), func)
    return func


def split_full_reductions(func: relax.Function, bb: relax.BlockBuilder) -> relax.Function:
    """``max(x)`` / ``min(x)`` over a whole fp32 tensor (DynamicQuantizeLinear's range)
    through the vectorized partial-reduction kernel, then a 16-element reduction."""
    x = wildcard()
    pattern = is_op("relax.max")(x) | is_op("relax.min")(x)

    def rewrite(orig, m):
        if orig.attrs.axis is not None or _dtype(m[x]) != "float32" or not _shape(m[x]):
            return orig
        size = int(np.prod(_shape(m[x])))
        if size % LANES or size < 64 * LANES:
            return orig
        op = "max" if orig.op.name == "relax.max" else "min"
        gv = bb.add_func(_kernel_attrs(reduce_all_schedule(size, op).mod["main"]),
                         f"tpp_reduce_all_{op}")
        rows = relax.op.reshape(m[x], (size // LANES, LANES))
        part = relax.call_tir(gv, [rows], relax.TensorType((LANES,), "float32"))
        final = relax.op.max if op == "max" else relax.op.min
        return final(part, keepdims=bool(orig.attrs.keepdims))

    return rewrite_call(pattern, rewrite, func)


_FAKE_QUANT_DROPPED = "QDQ pair between fp32 ops dropped (fp32 value kept)"


def _fake_quantized(x):
    """``dequantize(quantize(x))``: static QDQ rounding an fp32 value to the int8 grid."""
    q = is_op("relax.quantize")(x, wildcard(), wildcard())
    return is_op("relax.dequantize")(q, wildcard(), wildcard())


def drop_fake_quantization(func: relax.Function, report: LoweringReport) -> relax.Function:
    """``dequantize(quantize(x, s, z), s, z)`` -> ``x`` where no int8 kernel consumes it.

    Static QDQ models wrap every op (GELU's Div, Erf, Add, Mul...) in fake quantization;
    run after the matmul rewrite (which takes the quantized tensors it needs), the pairs
    left only round an fp32 value to the int8 grid and back. Dropping them keeps the exact
    fp32 value (closer to the fp32 model than ONNX Runtime's int8 result) and lets the
    element-wise chain fuse into TPP kernels instead of running per element in TVM.
    """
    x = wildcard()
    pattern = _fake_quantized(x)

    def rewrite(orig, m):
        if _dtype(m[x]) != "float32" or _dtype(orig) != "float32":
            return orig
        report.rewrites[_FAKE_QUANT_DROPPED] += 1
        return m[x]

    return rewrite_call(pattern, rewrite, func)


#: Ops a fake-quantized value may feed and still be dropped before the matmul rewrite:
#: element-wise math (GELU's Div, Erf, Add, Mul...), never a matmul or convolution, whose
#: quantized input an int8 kernel (or TVM's QDQ lowering) consumes.
_ELEMENTWISE = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.erf",
    "relax.tanh", "relax.sigmoid", "relax.exp", "relax.sqrt", "relax.power",
    "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh",
})


def _elementwise_only_dequantizes(func: relax.Function) -> list[relax.Call]:
    """The ``dequantize(quantize(x))`` calls whose every consumer is element-wise, if the
    function has a quantized matmul at all (else none: nothing to fuse into)."""
    bound: dict[relax.Var, relax.Expr] = {}
    consumers: dict[relax.Var, set[str]] = {}
    has_qdq_matmul = False
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            bound[binding.var] = value
            if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
                continue
            for arg in value.args:
                if isinstance(arg, relax.Var):
                    consumers.setdefault(arg, set()).add(value.op.name)
            if value.op.name == "relax.matmul" and isinstance(value.args[0], relax.Var):
                lhs = bound.get(value.args[0])
                has_qdq_matmul |= isinstance(lhs, relax.Call) and \
                    lhs.op.name == "relax.dequantize"
    if not has_qdq_matmul:
        return []
    found = []
    for var, value in bound.items():
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name == "relax.dequantize" and isinstance(value.args[0], relax.Var)):
            continue
        source = bound.get(value.args[0])
        if not (isinstance(source, relax.Call) and source.op.name == "relax.quantize"):
            continue
        if consumers.get(var) and consumers[var] <= _ELEMENTWISE:
            found.append(value)
    return found


def drop_elementwise_fake_quantization(func: relax.Function, report: LoweringReport
                                       ) -> relax.Function:
    """Before the matmul rewrite: drop the QDQ pairs that only element-wise ops consume.

    Static QDQ rounds a matmul's output, and each step of the GELU after it, to the int8
    grid; with those pairs in place the GELU is not recognised and cannot fuse into the
    int8 GEMM's epilogue (it ran as a separate kernel: 0.43 ms of a 4.4 ms MLP). The pairs
    in front of a matmul stay: they are the int8 kernel's input.
    """
    if not isinstance(func.body, relax.SeqExpr):
        return func
    drop = _elementwise_only_dequantizes(func)
    if not drop:
        return func
    x = wildcard()
    pattern = _fake_quantized(x)

    def rewrite(orig, m):
        if _dtype(m[x]) != "float32" or not any(orig.same_as(d) for d in drop):
            return orig
        report.rewrites[_FAKE_QUANT_DROPPED] += 1
        return m[x]

    return rewrite_erf_gelu(rewrite_call(pattern, rewrite, func))


def lower_quantized(mod: tvm.IRModule, isa: str, report: LoweringReport) -> tvm.IRModule:
    """Apply :func:`rewrite_quantized_matmuls` to every Relax function; add the kernels."""
    bb = relax.BlockBuilder(mod)
    emitter = _Emitter(bb, isa, report)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            func = drop_elementwise_fake_quantization(func, report)
            func = rewrite_quantized_matmuls(func, emitter)
            if emitter.kernels:  # a quantized model: its range reductions, its fake quant
                func = split_full_reductions(drop_fake_quantization(func, report), bb)
            bb.update_func(gv, func)
    return relax.transform.DeadCodeElimination()(bb.get()) if emitter.kernels else mod
