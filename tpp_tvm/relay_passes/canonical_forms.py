"""Rewrite operator forms the TPP kernels do not take into equivalent forms they do.

Real exports use operators outside the pattern table that are the same computation as one
inside it; left alone they run on TVM's untuned code, 10-1000x slower than a TPP kernel
(measured on the forms below, 1 thread: EfficientNet's final 1280x1280 ``AveragePool`` over
a 7x7 input 1.9 s vs ORT's 0.9 ms; wav2vec2's 3-tap stride-2 ``Conv`` over 512 channels
1.7 s vs 20 ms; its grouped positional ``Conv`` 321 vs 7 ms):

- a pooling whose one output window covers the whole input is a global reduction
  (``mean``/``max`` over the spatial axes), which the pattern table takes;
- any other 2-D average pooling is a depthwise convolution by a constant filter of
  1 / window (PoolFormer's 3x3 token mixer, Inception's branches), times a constant map of
  window / cells counted where padding is not counted;
- a two-operand ``Einsum`` that is a (batched) matrix product is a ``matmul`` between
  transposes and reshapes (CvT's attention, ``bhlk,bhtk->bhlt``), so the matmul and
  attention patterns see it;
- a 1-D convolution is a 2-D one over a single-row image (``W`` kept as the row), so it
  lands on the BRGEMM convolution TPP;
- a 3-D convolution is a 2-D one over the frames it reads: each output frame's ``kt``
  input frames become ``kt`` x channels input channels (im2col along time only), and the
  output frames are images of the batch (a video transformer's tubelet embedding is a
  reshape and one patch convolution);
- a grouped convolution with more than one channel per group and a filter computed at run
  time is ``groups`` ordinary convolutions on channel slices, concatenated (a constant
  filter goes to the grouped convolution kernel as it is: no slice or concat copies);
- a depthwise convolution by a 1x1 filter is a per-channel product (re-parameterised
  models' scale branches);
- a dilated convolution is an undilated one (:mod:`.dilated_conv`: segmentation heads'
  atrous convolutions);
- a softmax over another axis than the last is one over the last between transposes;
- a bilinear resize of narrow rows is one along W (a GEMM by the interpolation matrix)
  then one along H (whole rows gathered by constant indices and weighted);
- an explicit zero ``Pad`` of the spatial axes before a convolution (TF-style "same"
  padding, MobileNet's) is the convolution's own padding: the pad no longer sits
  between layers, where it kept the layout transposes around each convolution (a ReLU or
  a transpose between the pad and the convolution moves above the pad first).

Each rewrite keeps the graph's layouts and dtypes and is exact but for the order of sums
(and an average pool's 1/window weights, rounded once).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

from .dilated_conv import dilated_as_undilated
from .exprs import const_value, conv_layouts, ints, out_dtype, static_shape

#: Grouped convolutions with a run-time filter and up to this many groups are split into
#: per-group convolutions (each one BRGEMM); beyond it, TVM's code is the better unit.
MAX_SPLIT_GROUPS = 64


def _covers_input(size: int, window: int, stride: int, pad_before: int, pad_after: int,
                  dilation: int, out: int) -> bool:
    """One output position whose window spans the whole (unpadded) input axis."""
    return out == 1 and dilation == 1 and pad_before == 0 and window >= size


def _global_pool(call: relax.Call) -> relax.Expr | None:
    attrs = call.attrs
    x = call.args[0]
    shape, out = static_shape(x), static_shape(call)
    layout = str(attrs.layout)
    if shape is None or out is None or str(attrs.out_layout) not in ("", layout):
        return None
    spatial = [i for i, ax in enumerate(layout) if ax in "DHW"]
    pads = ints(attrs.padding)
    pads = pads * 2 if len(pads) == len(spatial) else pads
    dims = len(spatial)
    for k, axis in enumerate(spatial):
        if not _covers_input(shape[axis], int(attrs.pool_size[k]), int(attrs.strides[k]),
                             pads[k], pads[k + dims], int(attrs.dilation[k]), out[axis]):
            return None
        if pads[k + dims] and getattr(attrs, "count_include_pad", False):
            return None  # the padding would count in the average
    if call.op.name.endswith("max_pool2d") or call.op.name.endswith("max_pool1d"):
        return relax.op.max(x, axis=spatial, keepdims=True)
    return relax.op.mean(x, axis=spatial, keepdims=True)


def _window_taps(x: relax.Expr, axis: int, taps: int, out: int, stride: int,
                 dilation: int = 1) -> relax.Expr:
    """Tap ``j`` of every window along ``axis`` (``out`` windows, ``stride`` apart) stacked
    as a new axis after ``axis``: im2col along one axis. A concat of expand_dims, not a
    stack: TVM's ConvertLayout has no layout rule for stack."""
    cols = [relax.op.strided_slice(x, axes=[axis], begin=[j * dilation],
                                   end=[j * dilation + stride * (out - 1) + 1], strides=[stride])
            for j in range(taps)]
    return relax.op.concat([relax.op.expand_dims(t, axis + 1) for t in cols], axis=axis + 1)


def _cells(size: int, window: int, stride: int, pad: int, out: int) -> np.ndarray:
    """How many input cells of an axis each output window covers (padding excluded)."""
    start = np.arange(out) * stride - pad
    return np.minimum(start + window, size) - np.maximum(start, 0)


def _avg_pool_as_depthwise(call: relax.Call) -> relax.Expr | None:
    attrs = call.attrs
    x = call.args[0]
    shape, out = static_shape(x), static_shape(call)
    if str(attrs.layout) != "NCHW" or str(attrs.out_layout) not in ("", "NCHW") \
            or shape is None or out is None or str(x.ty.dtype) != "float32" \
            or any(int(d) != 1 for d in attrs.dilation):
        return None
    (kh, kw), (sh, sw) = ints(attrs.pool_size), ints(attrs.strides)
    top, left, bottom, right = ints(attrs.padding) * (2 if len(attrs.padding) == 2 else 1)
    n, c, h, w = shape
    if out[2] != (h + top + bottom - kh) // sh + 1 or out[3] != (w + left + right - kw) // sw + 1:
        return None  # ceil mode's partial windows past the padding
    if sh != sw or kh * kw < 2:
        return None  # the depthwise TPP takes square strides and windows of 2+ taps
    weight = np.full((c, 1, kh, kw), 1.0 / (kh * kw), dtype="float32")
    conv = relax.op.nn.conv2d(x, relax.const(weight), strides=(sh, sw),
                              padding=(top, left, bottom, right), groups=c)
    if attrs.count_include_pad or not (top or left or bottom or right):
        return conv
    cells = np.outer(_cells(h, kh, sh, top, out[2]), _cells(w, kw, sw, left, out[3]))
    return relax.op.multiply(conv, relax.const((kh * kw / cells).astype("float32")[None, None]))


def _avg_pool(call: relax.Call) -> relax.Expr | None:
    global_pool = _global_pool(call)
    return global_pool if global_pool is not None else _avg_pool_as_depthwise(call)


def _conv1d_as_matmul(x: relax.Expr, w: relax.Expr, shape: list[int], wshape: list[int],
                      stride: int) -> relax.Expr:
    """A 1-D convolution with a short reduction (few channels x taps, an audio front end's
    first layer) as im2col + one matmul: a BRGEMM over C x taps this short wastes most of
    each vector on padded channels."""
    n, c, width = shape
    oc, _, k = wshape
    ow = (width - k) // stride + 1
    stacked = _window_taps(x, 2, k, ow, stride)  # N, C, OW, K
    patches = relax.op.permute_dims(stacked, [0, 2, 1, 3])  # N, OW, C, K
    cols = relax.op.reshape(patches, (n, ow, c * k))
    out = relax.op.matmul(cols, relax.op.permute_dims(relax.op.reshape(w, (oc, c * k))))
    return relax.op.permute_dims(out, [0, 2, 1])


#: A 1-D convolution whose reduction (channels x taps) is at most this long runs as im2col
#: plus a matmul (:func:`_conv1d_as_matmul`).
IM2COL_MAX_REDUCTION = 64


def _conv1d_as_conv2d(call: relax.Call) -> relax.Expr | None:
    attrs = call.attrs
    if not conv_layouts(attrs, "NCW", "OIW"):
        return None
    x, w = call.args
    stride, dilation = int(attrs.strides[0]), int(attrs.dilation[0])
    left, right = ints(attrs.padding) * (2 if len(attrs.padding) == 1 else 1)
    shape, wshape = static_shape(x), static_shape(w)
    if (shape is not None and wshape is not None and int(attrs.groups) == 1 and dilation == 1
            and not left and not right and shape[1] * wshape[2] <= IM2COL_MAX_REDUCTION
            and out_dtype(attrs) in (None, str(x.ty.dtype))):
        return _conv1d_as_matmul(x, w, shape, wshape, stride)
    # A single-row image: a window of one row at stride ``stride`` keeps one output row.
    w_np = const_value(w)
    w2d = relax.op.expand_dims(w, 2) if w_np is None else relax.const(w_np[:, :, None, :])
    conv = relax.op.nn.conv2d(
        relax.op.expand_dims(x, 2), w2d, strides=(stride, stride),
        padding=(0, left, 0, right), dilation=(1, dilation), groups=int(attrs.groups),
        out_dtype=out_dtype(attrs))
    return relax.op.squeeze(conv, [2])


def _conv3d_as_conv2d(call: relax.Call) -> relax.Expr | None:
    """conv3d(x[N,C,T,H,W], w[O,I,kt,kh,kw]) -> conv2d over N*T' images of kt*C channels."""
    attrs = call.attrs
    if not conv_layouts(attrs, "NCDHW", "OIDHW"):
        return None
    x, w = call.args
    shape, wshape, out = static_shape(x), static_shape(w), static_shape(call)
    if shape is None or wshape is None or out is None:
        return None
    n, c, frames, height, width = shape
    oc, ic, kt = wshape[:3]
    ot = out[2]
    st, dt = int(attrs.strides[0]), int(attrs.dilation[0])
    pads = ints(attrs.padding)
    pads = pads * 2 if len(pads) == 3 else pads
    front, back = pads[0], pads[3]
    if front or back:
        x = relax.op.nn.pad(x, [0, 0, 0, 0, front, back, 0, 0, 0, 0])
        frames += front + back
    if kt == st and dt == 1 and frames == ot * kt:  # tubelets: frames split without copies
        windows = relax.op.reshape(x, (n, c, ot, kt, height, width))
        windows = relax.op.permute_dims(windows, [0, 2, 1, 3, 4, 5])
    else:  # each tap's frames, stacked next to their channel
        windows = _window_taps(x, 2, kt, ot, st, dt)  # N, C, T', kt, H, W
        windows = relax.op.permute_dims(windows, [0, 2, 1, 3, 4, 5])  # N, T', C, kt, H, W
    images = relax.op.reshape(windows, (n * ot, c * kt, height, width))
    w_np = const_value(w)
    w2d = (relax.const(w_np.reshape(oc, ic * kt, *wshape[3:])) if w_np is not None
           else relax.op.reshape(w, (oc, ic * kt, *wshape[3:])))
    conv = relax.op.nn.conv2d(
        images, w2d, strides=ints(attrs.strides)[1:],
        padding=(pads[1], pads[2], pads[4], pads[5]), dilation=ints(attrs.dilation)[1:],
        groups=int(attrs.groups), out_dtype=out_dtype(attrs))
    oh, ow = out[3], out[4]
    return relax.op.permute_dims(relax.op.reshape(conv, (n, ot, oc, oh, ow)), [0, 2, 1, 3, 4])


def _einsum_as_matmul(call: relax.Call) -> relax.Expr | None:
    """``einsum(a, b)`` as ``matmul`` of ``a`` viewed (batch.., rows, reduced) and ``b``
    viewed (batch.., reduced, cols), the result viewed back in the output's axis order."""
    operands = call.args[0]
    spec = str(call.attrs.subscripts).replace(" ", "")
    if not isinstance(operands, relax.Tuple) or len(operands.fields) != 2 or "." in spec \
            or "->" not in spec:
        return None
    ins, out = spec.split("->")
    ia, ib = ins.split(",")
    a, b = operands.fields
    sa, sb = static_shape(a), static_shape(b)
    if sa is None or sb is None or len(sa) != len(ia) or len(sb) != len(ib) \
            or len(set(ia)) != len(ia) or len(set(ib)) != len(ib) or len(set(out)) != len(out) \
            or str(a.ty.dtype) != str(b.ty.dtype):
        return None
    if any(c not in ib and c not in out for c in ia) or any(c not in ia and c not in out
                                                            for c in ib):
        return None  # an axis summed in one operand alone
    size = {**dict(zip(ib, sb)), **dict(zip(ia, sa))}
    if any(c in ib and size[c] != sb[ib.index(c)] for c in ia):
        return None  # broadcast shared axes
    batch = [c for c in out if c in ia and c in ib]
    rows = [c for c in out if c in ia and c not in ib]
    cols = [c for c in out if c in ib and c not in ia]
    reduced = [c for c in ia if c in ib and c not in out]

    def view(x: relax.Expr, axes: str, order: list[str], shape: list[int]) -> relax.Expr:
        perm = [axes.index(c) for c in order]
        if perm != list(range(len(perm))):
            x = relax.op.permute_dims(x, perm)
        if [size[c] for c in order] != shape:
            x = relax.op.reshape(x, shape)
        return x

    def prod(axes: list[str]) -> int:
        return int(np.prod([size[c] for c in axes], dtype=np.int64))

    lead = [size[c] for c in batch]
    lhs = view(a, ia, batch + rows + reduced, lead + [prod(rows), prod(reduced)])
    rhs = view(b, ib, batch + reduced + cols, lead + [prod(reduced), prod(cols)])
    product = relax.op.matmul(lhs, rhs)
    order = batch + rows + cols
    if [size[c] for c in order] != lead + [prod(rows), prod(cols)]:
        product = relax.op.reshape(product, [size[c] for c in order])
    perm = [order.index(c) for c in out]
    return product if perm == list(range(len(perm))) else relax.op.permute_dims(product, perm)


def _zero_pad(expr: relax.Expr | None) -> bool:
    """Whether ``expr`` is a constant-mode pad by zeros."""
    return isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.nn.pad" \
        and str(expr.attrs.pad_mode) == "constant" and float(expr.attrs.pad_value) == 0.0


def _fold_pad(call: relax.Call, producer: relax.Expr | None) -> relax.Expr | None:
    """conv2d(pad(x, zeros on H, W)) -> conv2d(x, padding + pads) for NCHW data."""
    attrs = call.attrs
    if not _zero_pad(producer) or str(attrs.data_layout) != "NCHW":
        return None
    width = ints(producer.attrs.pad_width)
    if len(width) != 8 or any(width[:4]) or min(width) < 0:
        return None
    top, bottom, left, right = width[4:]
    pad = ints(attrs.padding)
    pad = pad * 2 if len(pad) == 2 else pad
    return relax.op.nn.conv2d(
        producer.args[0], call.args[1], strides=attrs.strides,
        padding=(pad[0] + top, pad[1] + left, pad[2] + bottom, pad[3] + right),
        dilation=attrs.dilation, groups=int(attrs.groups), data_layout="NCHW",
        kernel_layout=str(attrs.kernel_layout), out_dtype=out_dtype(attrs))


def _split_groups(call: relax.Call) -> relax.Expr | None:
    attrs = call.attrs
    groups = int(attrs.groups)
    x, w = call.args
    shape, wshape = static_shape(x), static_shape(w)
    if groups == 1 or groups > MAX_SPLIT_GROUPS or shape is None or wshape is None:
        return None
    if not conv_layouts(attrs, "NCHW", "OIHW"):
        return None
    if wshape[1] == 1:  # depthwise-like: one channel per group
        return None
    if const_value(w) is not None:  # the grouped convolution kernel takes it as it is
        return None
    xs = relax.op.split(x, groups, axis=1)
    w_np = const_value(w)
    og = wshape[0] // groups
    # Constant filters are sliced here: FoldConstant leaves a split's tuple alone.
    ws = ([relax.const(w_np[g * og:(g + 1) * og]) for g in range(groups)] if w_np is not None
          else [relax.TupleGetItem(relax.op.split(w, groups, axis=0), g)
                for g in range(groups)])
    convs = [relax.op.nn.conv2d(relax.TupleGetItem(xs, g), ws[g],
                                strides=attrs.strides, padding=attrs.padding,
                                dilation=attrs.dilation, out_dtype=out_dtype(attrs))
             for g in range(groups)]
    return relax.op.concat(convs, axis=1)


def _channel_scale(call: relax.Call) -> relax.Expr | None:
    """A depthwise convolution with a 1x1 constant filter (no padding) is a product of each
    channel by its weight, the input strided first: MobileOne's and FastViT's scale
    branches. The depthwise kernel needs two taps; TVM left it a scalar loop nest."""
    attrs = call.attrs
    x, w = call.args
    shape, w_np = static_shape(x), const_value(w)
    if shape is None or w_np is None or not conv_layouts(attrs, "NCHW", "OIHW"):
        return None
    c = shape[1]
    if int(attrs.groups) != c or w_np.shape != (c, 1, 1, 1) or any(ints(attrs.padding)) \
            or any(d != 1 for d in ints(attrs.dilation)) or out_dtype(attrs) not in (
                None, str(w_np.dtype)):
        return None
    strides = ints(attrs.strides)
    if any(st != 1 for st in strides):
        x = relax.op.strided_slice(x, axes=[2, 3], begin=[0, 0], end=shape[2:],
                                   strides=strides)
    return relax.op.multiply(x, relax.const(w_np.reshape(1, c, 1, 1)))


def _conv2d(call: relax.Call) -> relax.Expr | None:
    for form in (_channel_scale, dilated_as_undilated, _split_groups):
        new = form(call)
        if new is not None:
            return new
    return None


def _softmax_last_axis(call: relax.Call) -> relax.Expr | None:
    """A softmax over another axis than the last is one over the last between two
    transposes (CoaT's factorized attention normalizes keys over the tokens, axis -2): the
    row-wise softmax TPP takes the last axis, and TVM left the other a serial loop nest
    (CoaT-Lite-Tiny: 5 s a call)."""
    shape = static_shape(call.args[0])
    if shape is None:
        return None
    axis = int(call.attrs.axis) % len(shape)
    if axis == len(shape) - 1:
        return None
    perm = [a for a in range(len(shape)) if a != axis] + [axis]
    inverse = [perm.index(a) for a in range(len(shape))]
    moved = relax.op.nn.softmax(relax.op.permute_dims(call.args[0], perm), axis=-1)
    return relax.op.permute_dims(moved, inverse)


def _attention_as_matmuls(call: relax.Call) -> relax.Expr | None:
    """``nn.attention`` (TVM's PyTorch importer writes ``scaled_dot_product_attention`` so;
    (batch, seq, heads, dim) operands) as the ONNX route's form the attention pattern takes:
    ``softmax(Q Kᵀ * scale (+ mask)) V`` on (batch, heads, seq, dim), a causal mask as a
    constant (the most negative float where a key comes after its query, so a fully masked
    row stays finite)."""
    q, k, v = call.args[:3]
    qs, ks, vs = (static_shape(x) for x in (q, k, v))
    if qs is None or ks is None or vs is None or len(qs) != 4 or \
            any(str(x.ty.dtype) != "float32" for x in (q, k, v)):
        return None
    scale = call.attrs.scale
    scale = 1.0 / math.sqrt(qs[-1]) if scale is None else float(scale)
    qh = relax.op.permute_dims(q, [0, 2, 1, 3])
    scores = relax.op.multiply(relax.op.matmul(qh, relax.op.permute_dims(k, [0, 2, 3, 1])),
                               relax.const(scale, "float32"))
    mask = call.args[3] if len(call.args) > 3 else None
    if mask is not None and (static_shape(mask) is None or str(mask.ty.dtype) != "float32"):
        return None
    causal = call.attrs.causal_mask
    if causal:
        queries, keys = qs[1], ks[1]
        offset = keys - queries if str(causal) == "BottomRight" else 0
        later = np.arange(keys)[None, :] > np.arange(queries)[:, None] + offset
        lower = np.where(later, np.finfo(np.float32).min, 0).astype(np.float32)
        causal_mask = relax.const(lower.reshape(1, 1, queries, keys))
        mask = causal_mask if mask is None else relax.op.add(mask, causal_mask)
    if mask is not None:
        scores = relax.op.add(scores, mask)
    probs = relax.op.nn.softmax(scores, axis=-1)
    out = relax.op.matmul(probs, relax.op.permute_dims(v, [0, 2, 1, 3]))
    return relax.op.permute_dims(out, [0, 2, 1, 3])


def _composed_permutes(call: relax.Call, producer: relax.Expr | None) -> relax.Expr | None:
    """permute(permute(x, p1), p2) → permute(x, p1∘p2), or x where that is the identity
    (the PyTorch importer's (batch, heads) swaps around the attention it emits meet the
    attention form's own)."""
    if not (isinstance(producer, relax.Call) and
            getattr(producer.op, "name", "") == "relax.permute_dims") or \
            call.attrs.axes is None or producer.attrs.axes is None:
        return None
    inner, outer = ints(producer.attrs.axes), ints(call.attrs.axes)
    if len(inner) != len(outer):
        return None
    composed = [inner[a] for a in outer]
    if composed == list(range(len(composed))):
        return producer.args[0]
    return relax.op.permute_dims(producer.args[0], composed)


#: Coordinate modes of a linear resize, as source position of output ``x`` along an axis
#: of ``size`` resized to ``out`` (ONNX's definitions; a single output reads position 0).
_RESIZE_SOURCES = {
    "half_pixel": lambda x, size, out: (x + 0.5) * size / out - 0.5,
    "pytorch_half_pixel": lambda x, size, out: (x + 0.5) * size / out - 0.5 if out > 1 else 0 * x,
    "align_corners": lambda x, size, out: x * (size - 1) / (out - 1) if out > 1 else 0 * x,
    "asymmetric": lambda x, size, out: x * size / out,
}


#: Widest input row a separable resize interpolates as a GEMM (its K).
MAX_RESIZE_GEMM_K = 64


def _linear_weights(size: int, out: int, mode: str
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first source index, second source index, second's weight) of each output position
    of a linear resize from ``size`` to ``out`` (indices clamped to the input, as ONNX and
    TVM clamp)."""
    src = _RESIZE_SOURCES[mode](np.arange(out, dtype=np.float64), size, out)
    low = np.floor(src)
    return (np.clip(low, 0, size - 1).astype("int64"),
            np.clip(low + 1, 0, size - 1).astype("int64"), (src - low).astype("float32"))


def _rows_resized(x: relax.Expr, size: int, out: int, mode: str) -> relax.Expr:
    """``x`` (NCHW) linearly resized along H: two gathers of whole rows by constant
    indices (injective, so fused with the weighted sum into one kernel), weighted by
    constant fractions per row. The indices are in range; ``clip`` only spares the build
    TVM's warning on every ``fast`` take."""
    first, second, frac = _linear_weights(size, out, mode)
    return relax.op.add(
        relax.op.multiply(relax.op.take(x, relax.const(first), axis=2, mode="clip"),
                          relax.const((1 - frac).reshape(out, 1))),
        relax.op.multiply(relax.op.take(x, relax.const(second), axis=2, mode="clip"),
                          relax.const(frac.reshape(out, 1))))


def _columns_resized(x: relax.Expr, size: int, out: int, mode: str) -> relax.Expr:
    """``x`` (NCHW) linearly resized along W as a GEMM with the constant (size x out)
    interpolation matrix (two non-zeros a column): a kernel of its own, so the row pass
    after it reads its result rather than recomputing it per output pixel."""
    first, second, frac = _linear_weights(size, out, mode)
    matrix = np.zeros((size, out), "float32")
    np.add.at(matrix, (first, np.arange(out)), 1 - frac)
    np.add.at(matrix, (second, np.arange(out)), frac)
    return relax.op.matmul(x, relax.const(matrix))


def _separable_resize(call: relax.Call) -> relax.Expr | None:
    """A bilinear resize of narrow rows as one along W (a GEMM by the
    interpolation matrix) then one along H (rows gathered and weighted). TVM's resize
    computes both source coordinates, four gathers and their weights for every output
    pixel; here the big pass reads whole rows, contiguous and vectorized (DeepLabV3's and
    LR-ASPP's 8x upsampling of the logits to 21 x 224 x 224: 2.7 ms of LR-ASPP's 9.6 on
    TVM's code). Only where the W pass is the smaller one and its K (the input width) is
    small; elsewhere TVM's resize stays."""
    attrs = call.attrs
    x = call.args[0]
    shape = static_shape(x)
    size = call.args[1]
    if shape is None or len(shape) != 4 or str(attrs.layout) != "NCHW" \
            or str(attrs.method) != "linear" \
            or str(attrs.coordinate_transformation_mode) not in _RESIZE_SOURCES \
            or not isinstance(size, relax.ShapeExpr) \
            or any(not isinstance(v, tvm.tirx.IntImm) for v in size.values) \
            or str(x.ty.dtype) != "float32" \
            or str(call.ty.dtype) != "float32":
        return None
    mode = str(attrs.coordinate_transformation_mode)
    (h, w), (oh, ow) = shape[2:], [int(v) for v in size.values]
    if h * ow > oh * w or w > MAX_RESIZE_GEMM_K:
        return None
    return _rows_resized(_columns_resized(x, w, ow, mode), h, oh, mode)


_REWRITES = {
    "relax.image.resize2d": _separable_resize,
    "relax.nn.softmax": _softmax_last_axis,
    "relax.nn.attention": _attention_as_matmuls,
    "relax.nn.attention_bias": _attention_as_matmuls,
    "relax.nn.avg_pool2d": _avg_pool,
    "relax.nn.max_pool2d": _global_pool,
    "relax.nn.avg_pool1d": _global_pool,
    "relax.nn.max_pool1d": _global_pool,
    "relax.nn.conv1d": _conv1d_as_conv2d,
    "relax.nn.conv3d": _conv3d_as_conv2d,
    "relax.einsum": _einsum_as_matmul,
    "relax.nn.conv2d": _conv2d,
}


def _keeps_zero(call: relax.Call) -> bool:
    """Whether element-wise ``call`` maps 0 to 0: a ReLU, max(x, c <= 0), min(x, c >= 0)
    (ReLU6's two halves)."""
    name = getattr(call.op, "name", "")
    if name == "relax.nn.relu":
        return True
    if name not in ("relax.maximum", "relax.minimum") or len(call.args) != 2:
        return False
    bound = const_value(call.args[1])
    if bound is None or bound.size != 1:
        return False
    return float(bound.reshape(-1)[0]) <= 0 if name == "relax.maximum" \
        else float(bound.reshape(-1)[0]) >= 0


def _activation_before_pad(call: relax.Call, producer: relax.Expr | None
                           ) -> relax.Expr | None:
    """f(pad(x, 0)) -> pad(f(x), 0) for f with f(0) = 0 (ReLU, ReLU6's max and min), so the
    pad reaches the convolution it feeds and folds into its padding: a static QDQ model's
    clipping (at 0, or 0 and 6), shown as a ReLU or ReLU6 after the pad
    (``fake_quant.expose_folded_relus``), stood between them in MobileNetV2."""
    if not _zero_pad(producer) or not _keeps_zero(call):
        return None
    inner = relax.Call(call.op, [producer.args[0], *call.args[1:]], call.attrs)
    return relax.op.nn.pad(inner, producer.attrs.pad_width, "constant", 0.0)


def _transpose_before_pad(call: relax.Call, producer: relax.Expr | None
                          ) -> relax.Expr | None:
    """permute(pad(x, 0), p) -> pad(permute(x, p), 0), the widths following their axes, so
    the pad reaches the convolution it feeds: the int8 passes sink an int8 layer's output
    transpose below the pad after it (to meet its inverse in a dynamically quantized
    model), which left a QDQ MobileNetV2's pad apart from its depthwise convolution."""
    if not _zero_pad(producer) or call.attrs.axes is None:
        return None
    perm = ints(call.attrs.axes)
    width = ints(producer.attrs.pad_width)
    if len(width) != 2 * len(perm):
        return None
    moved = [w for axis in perm for w in width[2 * axis:2 * axis + 2]]
    return relax.op.nn.pad(relax.op.permute_dims(producer.args[0], perm), moved, "constant",
                           0.0)


@relax.expr_functor.mutator
class _Canonicalize(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.builder_.normalize(super().visit_call_(call))
        op = getattr(call, "op", None)
        name = getattr(op, "name", None)
        if name == "relax.nn.conv2d" and isinstance(call.args[0], relax.Var):
            folded = _fold_pad(call, self.lookup_binding(call.args[0]))
            if folded is not None:
                return self.visit_expr(folded)
        if name in ("relax.nn.relu", "relax.maximum", "relax.minimum") \
                and isinstance(call.args[0], relax.Var):
            moved = _activation_before_pad(call, self.lookup_binding(call.args[0]))
            if moved is not None:
                return self.builder_.normalize(moved)
        if name == "relax.permute_dims" and isinstance(call.args[0], relax.Var):
            producer = self.lookup_binding(call.args[0])
            moved = _transpose_before_pad(call, producer)
            if moved is not None:
                return self.builder_.normalize(moved)
            composed = _composed_permutes(call, producer)
            if composed is not None:
                return self.builder_.normalize(composed)
        rewrite = _REWRITES.get(name)
        if rewrite is None:
            return call
        new = rewrite(call)
        return call if new is None else self.visit_expr(new)


@tvm.transform.module_pass(opt_level=0, name="tpp.CanonicalizeOperatorForms")
def CanonicalizeOperatorForms(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Apply the rewrites above to every Relax function (then re-normalize shapes)."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = _Canonicalize(mod).visit_expr(func)
    return relax.transform.Normalize()(mod)
