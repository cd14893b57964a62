"""Sink layout transposes through layout-agnostic ops until they meet their inverse.

The int8 convolution kernels run NHWC inside NCHW graphs (ONNX's layout), so each one is
wrapped in ``permute_dims`` on the way in and out (``quantized.py``). Between two of them sit
ops that do not care about layout: the QDQ model's quantize/dequantize, ReLU, the residual
add, max pooling, a global mean, a constant pad (the explicit padding ``quantize_dynamic``
puts before a depthwise convolution's quantization). ``sink_transposes`` moves each
transpose below such ops (rewriting their axis attributes) so that
``permute(permute(x, p), p⁻¹)`` appears and cancels: the network then runs NHWC from the
first convolution to the last, as it would with ``ConvertLayout``, which does not know the
quantization ops. A transpose is only moved
past an op all of whose tensor inputs can follow it, so no transpose is ever added.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard
from tvm_ffi import structural_equal

from .canonicalize import EPILOGUE_UNARY, sink_dense_reshapes
from .exprs import bindings, static_shape

#: Element-wise ops with one tensor input and no axis: ``f(x.T) = f(x).T``.
_UNARY = frozenset({
    "relax.nn.relu", "relax.astype", "relax.clip", "relax.sigmoid", "relax.tanh",
    "relax.erf", "relax.exp", "relax.round", "relax.sqrt", "relax.negative",
    # no layout inference in TVM, so ConvertLayout wraps it in transposes (CSPDarknet)
    "relax.nn.leakyrelu",
})
#: Element-wise ops with two (broadcasting) tensor inputs.
_BINARY = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum",
    "relax.minimum",
})
#: Reductions that, over all axes (``axis=None``), give a scalar whatever the layout (the
#: range of dynamic quantization).
_FULL_REDUCTIONS = frozenset({"relax.max", "relax.min", "relax.sum"})
#: NCHW -> NHWC and back.
TO_NCHW = [0, 3, 1, 2]
TO_NHWC = [0, 2, 3, 1]


def _axes(call: relax.Call) -> list[int] | None:
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


def _ndim(expr: relax.Expr) -> int:
    return len(expr.ty.shape.values)


def _inverse(perm: list[int]) -> list[int]:
    return [int(i) for i in np.argsort(perm)]


def _follows(other: relax.Expr, perm: list[int]) -> relax.Expr | None:
    """``other`` as the un-transposed op would take it (None: it cannot follow cheaply):
    a scalar (of any rank up to the op's, all dims 1) stays; a constant of full rank is
    transposed back (folded at build time). Anything else, a per-channel row included
    (it would broadcast along another axis after the move), keeps the transpose."""
    rank = _ndim(other)
    shape = [int(d) for d in other.ty.shape.values]
    if rank <= len(perm) and all(d == 1 for d in shape):
        return other
    if rank == len(perm) and isinstance(other, tvm.ir.Constant):
        return relax.op.permute_dims(other, _inverse(perm))
    return None


def _move_unary(call: relax.Call, x: relax.Expr, perm: list[int]) -> relax.Expr | None:
    """``call`` applied to ``x`` where it was applied to ``permute(x, perm)``, or None."""
    name = call.op.name
    if name in _UNARY:
        return relax.Call(call.op, [x, *call.args[1:]], call.attrs, call.ty_args)
    if name in ("relax.quantize", "relax.dequantize"):
        axis = int(call.attrs.axis) % len(perm)
        op = relax.op.quantize if name == "relax.quantize" else relax.op.dequantize
        return op(x, call.args[1], call.args[2], axis=perm[axis],
                  out_dtype=str(call.attrs.out_dtype))
    if name == "relax.nn.max_pool2d" and perm == TO_NCHW and str(call.attrs.layout) == "NCHW" \
            and str(call.attrs.out_layout) == "NCHW":
        a = call.attrs
        return relax.op.nn.max_pool2d(
            x, [int(v) for v in a.pool_size], [int(v) for v in a.strides],
            [int(v) for v in a.padding], [int(v) for v in a.dilation], bool(a.ceil_mode),
            bool(a.count_include_pad), layout="NHWC", out_layout="NHWC")
    if name == "relax.nn.pad" and str(call.attrs.pad_mode) == "constant":
        # each output axis i is x's axis perm[i]: its (before, after) widths go there
        width = [int(v) for v in call.attrs.pad_width]
        moved = [0] * len(width)
        for i, axis in enumerate(perm):
            moved[2 * axis:2 * axis + 2] = width[2 * i:2 * i + 2]
        return relax.op.nn.pad(x, moved, "constant", float(call.attrs.pad_value))
    if name in _FULL_REDUCTIONS and call.attrs.axis is None:
        return relax.Call(call.op, [x], call.attrs, call.ty_args)  # no layout left
    if name == "relax.mean" and bool(call.attrs.keepdims) and call.attrs.axis is not None:
        axes = [perm[int(a) % len(perm)] for a in call.attrs.axis]
        return relax.op.mean(x, axes, keepdims=True)
    return None


def sink_transposes(func: relax.Function, perms: list[list[int]] | None = None
                    ) -> relax.Function:
    """Move transposes below layout-agnostic ops and cancel inverse pairs (see module);
    with ``perms`` (all of one rank), only transposes by one of them move or cancel."""
    x, y = wildcard(), wildcard()
    transposed = is_op("relax.permute_dims")(x)
    twice = is_op("relax.permute_dims")(transposed)
    binary_lhs = is_op("relax.permute_dims")(x)
    binary_rhs = is_op("relax.permute_dims")(y)

    def movable(perm: list[int] | None) -> bool:
        return perm is not None and (perms is None or perm in perms)

    def cancel(orig, m):
        inner, outer = _axes(m[transposed]), _axes(orig)
        if not (movable(inner) and movable(outer)):
            return orig
        combined = [inner[a] for a in outer]
        if combined == list(range(len(combined))):
            return m[x]
        return relax.op.permute_dims(m[x], combined)

    def sink_unary(orig, m):
        perm = _axes(m[transposed])
        if not movable(perm):
            return orig
        moved = _move_unary(orig, m[x], perm)
        if moved is None or orig.op.name in _FULL_REDUCTIONS:
            return orig if moved is None else moved
        return relax.op.permute_dims(moved, perm)

    def sink_binary(orig, m):
        if orig.op.name not in _BINARY:
            return orig
        a, b = orig.args
        pa = _axes(m[binary_lhs]) if binary_lhs in m else None
        pb = _axes(m[binary_rhs]) if binary_rhs in m else None
        if pa is not None and pb is not None:
            if pa != pb or not movable(pa):
                return orig
            return relax.op.permute_dims(relax.Call(orig.op, [m[x], m[y]], orig.attrs), pa)
        perm = pa if pa is not None else pb
        if not movable(perm):
            return orig
        other = _follows(b if pa is not None else a, perm)
        if other is None:
            return orig
        inner = m[x] if pa is not None else m[y]
        args = [inner, other] if pa is not None else [other, inner]
        return relax.op.permute_dims(relax.Call(orig.op, args, orig.attrs), perm)

    # f(permute(x), ...): the transposed tensor first, any other arguments (clip's bounds,
    # quantize's scale and zero point) as they are
    unary_patterns = [is_op(op)(transposed, varg_default_wildcard=True) for op in sorted(
        _UNARY | _FULL_REDUCTIONS | {"relax.quantize", "relax.dequantize",
                                     "relax.nn.max_pool2d", "relax.mean", "relax.nn.pad"})]
    func = rewrite_call(twice, cancel, func)
    for _ in range(64):  # each round moves every transpose one op further down
        before = func
        for pattern in unary_patterns:
            func = rewrite_call(pattern, sink_unary, func)
        for op in sorted(_BINARY):
            both = is_op(op)(binary_lhs, binary_rhs)
            left = is_op(op)(binary_lhs, wildcard())
            right = is_op(op)(wildcard(), binary_rhs)
            for pattern in (both, left, right):
                func = rewrite_call(pattern, sink_binary, func)
        func = rewrite_call(twice, cancel, func)
        if structural_equal(before, func):
            break
    return func


#: Ops that only re-index memory.
_VIEWS = ("relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.permute_dims")


def _view_of(expr: relax.Expr, binds: dict) -> relax.Call | None:
    """The view op ``expr`` is (or is bound to), else None."""
    value = binds.get(expr) if isinstance(expr, relax.Var) else expr
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
            value.op.name in _VIEWS and static_shape(value) is not None:
        return value
    return None


def _keeps_order(chain: list[relax.Call], src_shape: list[int]) -> bool:
    """Whether the views ``chain`` (first applied first) leave a tensor of ``src_shape``'s
    elements in the same row-major order, tried on an index array (reshapes, squeezes and
    expand_dims always do)."""
    if all(call.op.name != "relax.permute_dims" for call in chain):
        return True
    size = int(np.prod(src_shape))
    if size > 1 << 22:
        return False
    a = np.arange(size).reshape(src_shape)
    for call in chain:
        a = np.transpose(a, _axes(call)) if call.op.name == "relax.permute_dims" \
            else a.reshape(static_shape(call))
    return bool((a.ravel() == np.arange(size)).all())


def drop_identity_views(func: relax.Function) -> relax.Function:
    """A chain of views (reshape, squeeze, expand_dims, transposes) that keeps its source's
    element order is a reshape of the source, or the source itself when the shapes agree.
    Each 1-D convolution of wav2vec2's feature extractor sat between ``squeeze``,
    ``expand_dims`` and a unit-dim ``permute_dims`` (a copy per layer, and the GELU could
    not reach the convolution's epilogue); its positional convolution's input was three
    views of the projection's output, two of them transposes."""
    binds = bindings(func)
    view = None
    for op in _VIEWS:
        view = is_op(op)(wildcard()) if view is None else view | is_op(op)(wildcard())

    def rewriter(orig, m):
        shape = static_shape(orig)
        if shape is None or (orig.op.name == "relax.permute_dims" and len(shape) < 3):
            return orig  # a matrix transpose is a GEMM operand's (``matmul_ta``), kept
        chain, src, best = [orig], orig.args[0], None
        while static_shape(src) is not None:
            if _keeps_order(chain[::-1], static_shape(src)):
                best = (src, len(chain))
            parent = _view_of(src, binds)
            if parent is None:
                break
            chain.append(parent)
            src = parent.args[0]
        if best is None:
            return orig
        src, length = best
        if static_shape(src) == shape:
            return src
        if length == 1 and orig.op.name != "relax.permute_dims":
            return orig  # already a single view that is not a copy
        return relax.op.reshape(src, shape)

    return rewrite_call(view, rewriter, func)


def sink_views_below_activations(func: relax.Function) -> relax.Function:
    """``act(view(conv))`` → ``view(act(conv))`` for a squeeze or reshape of a convolution
    (+ constant bias), so the activation joins the convolution's epilogue (a 1-D
    convolution runs as a single-row 2-D one, squeezed back to 1-D before its GELU)."""
    conv = is_op("relax.nn.conv2d")(wildcard(), is_const())
    conv = conv | is_op("relax.add")(conv, is_const())
    view = is_op("relax.squeeze")(conv) | is_op("relax.reshape")(conv, wildcard())
    pattern = None
    for op in EPILOGUE_UNARY:
        pattern = is_op(op)(view) if pattern is None else pattern | is_op(op)(view)

    def rewriter(orig, m):
        inner = m[view]
        shape = static_shape(inner)
        if shape is None:
            return orig
        return relax.op.reshape(relax.Call(orig.op, [inner.args[0]], orig.attrs), shape)

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="tpp.SinkLayoutTransposes")
def SinkLayoutTransposes(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass name
    """:func:`sink_transposes` of the NCHW/NHWC layout transposes on every Relax function,
    for fp32 graphs after ``ConvertLayout``: it leaves each NCHW residual add between an
    inverse pair of transposes (ConvNeXt's first stage added its residuals NCHW: a
    transposing kernel of TVM's default code and a TPP add per block, where the add joins
    the GEMM's epilogue). Other transposes (a matmul's operand) stay where they are. Then
    activations move above the views after a convolution, view chains that change
    nothing go (:func:`drop_identity_views`), and a residual add the sinking brought next
    to a GEMM's row view moves above the view into its epilogue (ConvNeXt through
    ``torch.export``: ``Linear`` on flattened NHWC rows, then the NCHW residual)."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            func = sink_views_below_activations(sink_transposes(func, [TO_NCHW, TO_NHWC]))
            # a residual the transposes' sinking brought next to a viewed GEMM joins it
            mod[gv] = sink_dense_reshapes(drop_identity_views(func))
    return mod
