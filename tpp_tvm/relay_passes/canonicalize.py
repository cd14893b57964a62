"""Recognise decomposed activations that exporters emit, so patterns see one op.

torch's ONNX export (opset < 20) writes GELU as ``x * (erf(x / sqrt 2) + 1) * 0.5`` (and
the tanh form as its polynomial); TVM's converter keeps that as five element-wise ops.
Rewriting the chain back into ``R.nn.gelu`` lets the TPP patterns fuse it into a GEMM
epilogue as one GELU TPP, and even unfused it becomes one kernel instead of five.
Casts to the dtype a tensor already has go too: HF attention writes
``softmax(..., dtype=float32).to(query.dtype)``, two no-op ``astype``s between the softmax
and the second matmul that kept ViT's attention from matching as one kernel. And the scale
torch's SDPA export splits over Q and Kᵀ goes back onto the scores.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, is_tuple, rewrite_call, wildcard
from tvm_ffi import structural_equal

from .exprs import bindings, const_value, scalar_value, static_shape, use_counts


def _erf_gelu_pattern():
    x = wildcard()
    c_div = is_const()
    c_one = is_const()
    c_half = is_const()
    erf = is_op("relax.erf")(is_op("relax.divide")(x, c_div))
    cdf = is_op("relax.add")(erf, c_one)
    pattern = is_op("relax.multiply")(is_op("relax.multiply")(x, cdf), c_half)
    return pattern, x, c_div, c_one, c_half


def rewrite_erf_gelu(func: relax.Function) -> relax.Function:
    """``x * (erf(x / sqrt2) + 1) * 0.5`` → ``R.nn.gelu(x)`` when the constants match."""
    pattern, x, c_div, c_one, c_half = _erf_gelu_pattern()

    def rewriter(orig, m):
        vals = [scalar_value(m[c]) for c in (c_div, c_one, c_half)]
        if None in vals:
            return orig
        div, one, half = vals
        if abs(div - math.sqrt(2.0)) > 1e-5 or abs(one - 1.0) > 1e-7 or abs(half - 0.5) > 1e-7:
            return orig
        return relax.op.nn.gelu(m[x])

    return rewrite_call(pattern, rewriter, func)


def _tanh_gelu_pattern():
    x = wildcard()
    c_cube, c_coef, c_scale, c_one, c_half = (is_const() for _ in range(5))
    cube = is_op("relax.power")(x, c_cube)
    inner = is_op("relax.add")(x, is_op("relax.multiply")(cube, c_coef))
    th = is_op("relax.tanh")(is_op("relax.multiply")(inner, c_scale))
    one_plus = is_op("relax.add")(th, c_one)
    # torch writes 0.5 * x * (1 + tanh(...)); other exporters x * (1 + tanh(...)) * 0.5.
    pattern = (is_op("relax.multiply")(is_op("relax.multiply")(x, c_half), one_plus)
               | is_op("relax.multiply")(is_op("relax.multiply")(x, one_plus), c_half))
    return pattern, x, (c_cube, c_coef, c_scale, c_one, c_half)


def rewrite_tanh_gelu(func: relax.Function) -> relax.Function:
    """GPT-2's ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` → ``R.nn.gelu_tanh(x)``
    when the constants match, so it fuses into the GEMM epilogue as one TPP (unfused, its
    ``x^3`` ran as an untuned ``power`` kernel: 20% of GPT-2's time)."""
    pattern, x, consts = _tanh_gelu_pattern()
    want = (3.0, 0.044715, math.sqrt(2.0 / math.pi), 1.0, 0.5)

    def rewriter(orig, m):
        vals = [scalar_value(m[c]) for c in consts]
        if None in vals or any(abs(v - w) > 1e-5 * max(1.0, abs(w)) for v, w in zip(vals, want)):
            return orig
        return relax.op.nn.gelu_tanh(m[x])

    return rewrite_call(pattern, rewriter, func)


def rewrite_silu(func: relax.Function) -> relax.Function:
    """``x * sigmoid(x)`` (either order) → ``R.nn.silu(x)``: EfficientNet's and the Llama
    MLP's activation, one TPP in a convolution or GEMM epilogue instead of two kernels."""
    x = wildcard()
    sig = is_op("relax.sigmoid")(x)
    pattern = is_op("relax.multiply")(x, sig) | is_op("relax.multiply")(sig, x)
    return rewrite_call(pattern, lambda orig, m: relax.op.nn.silu(m[x]), func)


def rewrite_clips(func: relax.Function) -> relax.Function:
    """``clip(x, lo, hi)`` of a float tensor → ``minimum(maximum(x, lo), hi)``, and HardSwish
    as torch decomposes it, ``(x * clip(x + 3, 0, 6)) / 6``, → ``x * (clip(..) / 6)``: the
    forms the ONNX importer writes (ReLU6, HardSwish), which the epilogue patterns take.
    ``R.clip`` is an opaque kernel: MobileNetV3 through torch.export ran 21 activations as
    kernels of their own."""
    x = wildcard()
    clip = is_op("relax.clip")(x, wildcard(), wildcard())

    def bounds(orig, m):
        try:
            lo, hi = (float(getattr(a, "value", a)) for a in orig.args[1:3])
        except (TypeError, ValueError):
            return orig
        if str(getattr(m[x].ty, "dtype", "")) != "float32":
            return orig
        out = m[x]
        if math.isfinite(lo) and lo > -3.4e38:
            out = relax.op.maximum(out, relax.const(lo, "float32"))
        if math.isfinite(hi) and hi < 3.4e38:
            out = relax.op.minimum(out, relax.const(hi, "float32"))
        return out

    func = rewrite_call(clip, bounds, func)
    y, shift, lo, hi, div = wildcard(), is_const(), is_const(), is_const(), is_const()
    gate = is_op("relax.minimum")(is_op("relax.maximum")(is_op("relax.add")(y, shift), lo), hi)
    product = is_op("relax.multiply")(y, gate) | is_op("relax.multiply")(gate, y)
    pattern = is_op("relax.divide")(product, div)

    def regroup(orig, m):
        return relax.op.multiply(m[y], relax.op.divide(m[gate], m[div]))

    func = rewrite_call(pattern, regroup, func)
    # HardSigmoid as torch decomposes it, clip(x + 3, 0, 6) / 6 (not multiplied by x): the
    # ONNX importer's min(max(x / 6 + 0.5, 0), 1), a squeeze-excite gate's form.
    z, shift2, lo2, hi2, div2 = wildcard(), is_const(), is_const(), is_const(), is_const()
    hard = is_op("relax.divide")(
        is_op("relax.minimum")(is_op("relax.maximum")(is_op("relax.add")(z, shift2), lo2), hi2),
        div2)

    swish_gates: list = []  # the same form as a HardSwish's gate, x * gate(x): kept
    scaled = is_op("relax.multiply")(z, hard) | is_op("relax.multiply")(hard, z)
    rewrite_call(scaled, lambda orig, m: swish_gates.append(m[hard]) or orig, func)

    def hard_sigmoid(orig, m):
        if any(orig.same_as(gate) for gate in swish_gates):
            return orig
        values = [scalar_value(m[c]) for c in (shift2, lo2, hi2, div2)]
        if any(v is None for v in values) or values[1] != 0.0 or values[3] == 0.0 or \
                values[2] != values[3] or str(m[z].ty.dtype) != "float32":
            return orig
        shift, _, _, scale = values
        linear = relax.op.add(relax.op.multiply(m[z], relax.const(1.0 / scale, "float32")),
                              relax.const(shift / scale, "float32"))
        return relax.op.minimum(relax.op.maximum(linear, relax.const(0.0, "float32")),
                                relax.const(1.0, "float32"))

    return rewrite_call(hard, hard_sigmoid, func)


def drop_identity_casts(func: relax.Function) -> relax.Function:
    """``R.astype(x, dtype)`` where ``x`` already is ``dtype`` → ``x``."""
    x = wildcard()
    pattern = is_op("relax.astype")(x)

    def rewriter(orig, m):
        src = m[x].ty
        same = str(getattr(src, "dtype", None)) == str(orig.attrs.dtype)
        return m[x] if same else orig

    return rewrite_call(pattern, rewriter, func)


def rewrite_rms_norm(func: relax.Function) -> relax.Function:
    """``gamma * (x / sqrt(mean(x², -1) + eps))`` in the forms exporters write it (``x²`` as
    a power or a product, the division as ``x * (1 / s)``, ``x / s`` or ``x * rsqrt(..)``,
    gamma on either side) → ``R.nn.rms_norm``: Llama's norm, one row-wise TPP kernel. As
    TVM fused it, each output element recomputed the row's mean: 0.76 ms for one 1024-wide
    row (Llama's decode step spent 20% of its time there)."""
    x, gamma, two, one, eps = wildcard(), wildcard(), is_const(), is_const(), is_const()
    square = is_op("relax.power")(x, two) | is_op("relax.multiply")(x, x)
    mean = is_op("relax.mean")(square)
    shifted = is_op("relax.add")(mean, eps)
    root = is_op("relax.sqrt")(shifted)
    inverse = is_op("relax.divide")(one, root)
    norm = (is_op("relax.multiply")(x, inverse) | is_op("relax.multiply")(inverse, x)
            | is_op("relax.divide")(x, root) | is_op("relax.multiply")(x, is_op("relax.rsqrt")(
                shifted)))
    pattern = is_op("relax.multiply")(gamma, norm) | is_op("relax.multiply")(norm, gamma)

    def rewriter(orig, m):
        shape = static_shape(m[x])
        if shape is None or str(m[x].ty.dtype) != "float32" or not shape:
            return orig
        if static_shape(m[gamma]) != [shape[-1]] or scalar_value(m[eps]) is None:
            return orig
        if two in m and scalar_value(m[two]) != 2.0:
            return orig
        if one in m and scalar_value(m[one]) != 1.0:
            return orig
        attrs = m[mean].attrs
        axes = [int(a) % len(shape) for a in (attrs.axis or range(len(shape)))]
        if axes != [len(shape) - 1] or not attrs.keepdims:
            return orig
        return relax.op.nn.rms_norm(m[x], m[gamma], axes=[-1], epsilon=scalar_value(m[eps]))

    return rewrite_call(pattern, rewriter, func)


def merge_operand_scales(func: relax.Function) -> relax.Function:
    """``matmul(q * a, kᵀ * b)`` with scalar constants ``a``, ``b`` → ``matmul(q, kᵀ) * ab``,
    and ``matmul(q * a, kᵀ)`` → ``matmul(q, kᵀ) * a`` where a softmax reads the product
    (through a mask's add): attention scores.

    torch's export of ``scaled_dot_product_attention`` (transformers' default attention)
    scales both operands by the scale's square root, timm's attention scales Q; as one scale
    on the scores it is the form the attention pattern matches (else a scaled Kᵀ is written
    per call: 0.23 ms per layer of a 256-token GPT-2 cache, and the softmax and both matmuls
    run apart: every timm ViT, DeiT, PiT, CaiT, EVA). A matmul that is not attention keeps
    its scaled operand (as the product's epilogue it would cost a pass over the output)."""
    q, kt, a, b = wildcard(), wildcard(), is_const(), is_const()
    pattern = is_op("relax.matmul")(is_op("relax.multiply")(q, a),
                                    is_op("relax.multiply")(kt, b))

    def rewriter(orig, m):
        sa, sb = scalar_value(m[a]), scalar_value(m[b])
        if sa is None or sb is None:
            return orig
        dtype = str(orig.ty.dtype)
        return relax.op.multiply(relax.op.matmul(m[q], m[kt]), relax.const(sa * sb, dtype))

    func = rewrite_call(pattern, rewriter, func)
    scores = is_op("relax.matmul")(is_op("relax.multiply")(q, a), kt)
    masked = is_op("relax.add")(scores, wildcard())
    softmax = is_op("relax.nn.softmax")(scores | masked)

    def scaled_scores(orig, m):
        sa = scalar_value(m[a])
        if sa is None:
            return orig
        z = relax.op.multiply(relax.op.matmul(m[q], m[kt]),
                              relax.const(sa, str(m[scores].ty.dtype)))
        if masked in m:
            z = relax.op.add(z, m[masked].args[1])
        return relax.op.nn.softmax(z, int(orig.attrs.axis))

    return rewrite_call(softmax, scaled_scores, func)


def drop_single_concats(func: relax.Function) -> relax.Function:
    """``concat((x,))`` → ``x``: a decoder's cache concat when the export has no past (the
    zoo's GPT-2 and Llama exports). It hid the ``repeat_kv`` chain of grouped-query attention
    from the attention pattern and cost a copy of K and V per layer."""
    x = wildcard()
    return rewrite_call(is_op("relax.concat")(is_tuple([x])), lambda orig, m: m[x], func)


def _read_more_than_once(func: relax.Function):
    """A predicate: is this bound value read by more than one binding? (Folding such a value
    into its reader would compute it twice.)"""
    reads = use_counts(func)
    bound_to = {value: var for var, value in bindings(func).items()}
    return lambda value: reads.get(bound_to.get(value), 1) > 1


def fold_output_scales(func: relax.Function) -> relax.Function:
    """``(x @ W + b) * c`` → ``x @ (W c) + b c`` for constants ``W``, ``b`` and a constant
    ``c`` per output column (or a scalar).

    ConvNeXt's layer scale (``gamma * pwconv2(x)``) sat between the second GEMM and the
    residual add, so the add could not join the GEMM's epilogue and the product ran as a
    kernel of TVM's default code per block; folded into the weights it costs nothing.
    A product read elsewhere too stays: folding would compute the GEMM twice (CLIP's
    ``h * sigmoid(1.702 h)`` ran its first MLP GEMM once per operand)."""
    x, w, b, c = wildcard(), is_const(), is_const(), is_const()
    shared = _read_more_than_once(func)
    dense = is_op("relax.matmul")(x, w)
    dense = dense | is_op("relax.add")(dense, b) | is_op("relax.add")(b, dense)
    pattern = is_op("relax.multiply")(dense, c) | is_op("relax.multiply")(c, dense)

    def rewriter(orig, m):
        if shared(m[dense]):
            return orig
        weight, scale = const_value(m[w]), const_value(m[c])
        out = static_shape(orig)
        if weight is None or scale is None or weight.ndim != 2 or out is None or \
                static_shape(m[dense]) != out or weight.dtype.kind != "f" or \
                scale.dtype != weight.dtype:
            return orig
        n = weight.shape[1]
        if scale.size not in (1, n) or scale.ndim > len(out) or \
                (scale.size == n and scale.shape[-1] != n):
            return orig  # a scale along rows (or anything else) stays a multiply
        row = scale.reshape(-1)
        scaled = relax.op.matmul(m[x], relax.const(weight * row))
        if b not in m:
            return scaled
        bias = const_value(m[b])
        if bias is None or bias.dtype != weight.dtype or bias.shape[-1:] != (n,) or \
                any(d != 1 for d in bias.shape[:-1]):
            return orig
        return relax.op.add(scaled, relax.const(bias * row))

    return rewrite_call(pattern, rewriter, func)


def fold_convolution_scales(func: relax.Function) -> relax.Function:
    """``(conv2d(x, W) [+ b]) * c`` → ``conv2d(x, W c) [+ b c]`` for constants ``W``, ``b``
    and a constant ``c`` per output channel (or a scalar): a batch norm after a convolution,
    once :func:`fold_batch_norms` made it ``* scale + shift``, becomes the convolution's
    filters and a bias (:func:`merge_constant_adds` joins the two), as ONNX exporters fold
    it. torch.export keeps batch norms apart: without this a PyTorch model's convolutions
    lost their bias and activation epilogues (the shift and the ReLU ran as separate
    kernels). A convolution read elsewhere too stays."""
    x, w, b, c = wildcard(), is_const(), is_const(), is_const()
    shared = _read_more_than_once(func)
    conv = is_op("relax.nn.conv2d")(x, w)
    biased = conv | is_op("relax.add")(conv, b) | is_op("relax.add")(b, conv)
    pattern = is_op("relax.multiply")(biased, c) | is_op("relax.multiply")(c, biased)

    def per_channel(value: np.ndarray, out: tuple, channel_axis: int) -> np.ndarray | None:
        """``value`` as one number per output channel, None if it varies along another axis."""
        channels = out[channel_axis]
        if value.size == 1:
            return np.full(channels, value.reshape(-1)[0], value.dtype)
        if value.ndim > len(out):
            return None
        axes = [a for a, d in enumerate((1,) * (len(out) - value.ndim) + value.shape) if d != 1]
        return value.reshape(-1) if axes == [channel_axis] and value.size == channels else None

    def rewriter(orig, m):
        call = m[conv]
        if any(shared(m[p]) for p in (conv, biased) if p in m):
            return orig
        attrs, weight, scale = call.attrs, const_value(m[w]), const_value(m[c])
        out = static_shape(orig)
        if weight is None or scale is None or out is None or static_shape(call) != out or \
                weight.dtype.kind != "f" or scale.dtype != weight.dtype or \
                str(attrs.out_layout) != str(attrs.data_layout):
            return orig
        layout, kernel_layout = str(attrs.data_layout), str(attrs.kernel_layout)
        if "C" not in layout or "O" not in kernel_layout or len(layout) != len(out):
            return orig
        axis = layout.index("C")
        row = per_channel(scale, out, axis)
        if row is None:
            return orig  # a scale along anything but the channels stays a multiply
        shape = [1] * weight.ndim
        shape[kernel_layout.index("O")] = out[axis]
        scaled = relax.Call(call.op, [m[x], relax.const(weight * row.reshape(shape))], attrs)
        if b not in m:
            return scaled
        bias = const_value(m[b])
        bias_row = per_channel(bias, out, axis) if bias is not None else None
        if bias_row is None or bias.dtype != weight.dtype:
            return orig
        broadcast = [1] * len(out)
        broadcast[axis] = out[axis]
        return relax.op.add(scaled, relax.const((bias_row * row).reshape(broadcast)))

    return rewrite_call(pattern, rewriter, func)


def drop_zero_adds(func: relax.Function) -> relax.Function:
    """``x + 0`` → ``x`` for a constant of zeros over two or more axes that does not widen
    ``x``: an attention mask that masks nothing, as a traced model computes it (ViT through
    ``torch.export``: ``where(arange >= 0, 0, -inf)``, folded to zeros), which the attention
    kernel then read. A zero vector stays: a bias costs nothing in an epilogue, and fused
    forms take one (the expansion + depthwise kernel)."""
    x, zeros = wildcard(), is_const()
    pattern = is_op("relax.add")(x, zeros) | is_op("relax.add")(zeros, x)

    def rewriter(orig, m):
        value = const_value(m[zeros])
        if value is None or value.any() or sum(n > 1 for n in value.shape) < 2 or \
                static_shape(m[x]) is None or \
                static_shape(m[x]) != static_shape(orig) or \
                str(m[x].ty.dtype) != str(value.dtype):
            return orig
        return m[x]

    return rewrite_call(pattern, rewriter, func)


def merge_constant_adds(func: relax.Function) -> relax.Function:
    """``(y + c1) + c2`` → ``y + (c1 + c2)`` for constants that broadcast to ``y``'s shape
    (a convolution's bias and the shift of the batch norm after it), so one add remains for
    the bias epilogue. An inner sum read elsewhere too stays."""
    y, c1, c2 = wildcard(), is_const(), is_const()
    shared = _read_more_than_once(func)
    inner = is_op("relax.add")(y, c1) | is_op("relax.add")(c1, y)
    pattern = is_op("relax.add")(inner, c2) | is_op("relax.add")(c2, inner)

    def rewriter(orig, m):
        if shared(m[inner]):
            return orig
        first, second = const_value(m[c1]), const_value(m[c2])
        out = static_shape(orig)
        if first is None or second is None or out is None or first.dtype != second.dtype or \
                static_shape(m[y]) != out or str(m[y].ty.dtype) != str(first.dtype):
            return orig
        try:
            total = first + second
        except ValueError:
            return orig
        if np.broadcast_shapes(total.shape, tuple(out)) != tuple(out):
            return orig
        return relax.op.add(m[y], relax.const(total))

    return rewrite_call(pattern, rewriter, func)


def fold_batch_norms(func: relax.Function) -> relax.Function:
    """``(x - mean) / std * gamma + beta`` (a batch norm as ``DecomposeOpsForInference``
    writes it, constants folded) → ``x * scale + shift``: two operations an element and no
    division. A batch norm the exporter could not fold into a convolution (after DenseNet's
    and MixNet's concatenations) divided every element (``vdivps``) in TVM's code."""
    x, mean, std, gamma, beta = wildcard(), is_const(), is_const(), is_const(), is_const()
    pattern = is_op("relax.add")(is_op("relax.multiply")(
        is_op("relax.divide")(is_op("relax.subtract")(x, mean), std), gamma), beta)

    def rewriter(orig, m):
        values = [const_value(m[p]) for p in (mean, std, gamma, beta)]
        out = static_shape(orig)
        if any(v is None or v.dtype != "float32" for v in values) or out is None:
            return orig
        mu, sigma, g, b = (v.astype("float64") for v in values)
        try:
            scale = g / sigma
            shift = b - mu * scale
            if np.broadcast_shapes(scale.shape, shift.shape, tuple(out)) != tuple(out):
                return orig
        except ValueError:  # constants that do not broadcast together
            return orig
        return relax.op.add(relax.op.multiply(m[x], relax.const(scale.astype("float32"))),
                            relax.const(np.asarray(shift, "float32")))

    return rewrite_call(pattern, rewriter, func)


def _conv_branch(expr, binds: dict) -> tuple | None:
    """(input, OIHW filter, bias or None, attrs) of ``conv2d(x, W const) [+ b const]``:
    one branch of a re-parameterisable block, with odd windows padded "same"."""
    call = binds.get(expr, expr)
    bias = None
    if isinstance(call, relax.Call) and getattr(call.op, "name", "") == "relax.add":
        bias = const_value(call.args[1])
        call = binds.get(call.args[0], call.args[0])
        if bias is None:
            return None
    if not (isinstance(call, relax.Call) and getattr(call.op, "name", "") == "relax.nn.conv2d"):
        return None
    attrs, w = call.attrs, const_value(call.args[1])
    if w is None or str(attrs.data_layout) != "NCHW" or str(attrs.kernel_layout) != "OIHW" \
            or any(int(d) != 1 for d in attrs.dilation) or w.dtype != "float32":
        return None
    r, s = w.shape[2:]
    pad = [int(v) for v in attrs.padding]
    pad = pad * 2 if len(pad) == 2 else pad
    if r % 2 == 0 or s % 2 == 0 or pad != [r // 2, s // 2, r // 2, s // 2]:
        return None
    if bias is not None and bias.size != w.shape[0]:
        return None
    return call.args[0], w, bias, attrs


def merge_parallel_convolutions(func: relax.Function) -> relax.Function:
    """``conv(x, W1) + b1 + conv(x, W2) + b2`` → ``conv(x, W1 + W2') + b1 + b2``, W2' the
    smaller filter zero-padded to the larger's window (both "same"-padded, same stride and
    groups): the branches of a re-parameterisable block (MobileOne, RepVGG, RepGhost) as
    one convolution, as their authors fold them for inference. Unfolded, each branch was a
    convolution and each sum a pass over the output."""
    a, b = wildcard(), wildcard()
    pattern = is_op("relax.add")(a, b)
    reads = use_counts(func)
    binds = bindings(func)
    bound_to = {value: var for var, value in binds.items()}

    def single_use(expr) -> bool:
        return reads.get(bound_to.get(expr, expr), 1) <= 1

    def rewriter(orig, m):
        first, second = _conv_branch(m[a], binds), _conv_branch(m[b], binds)
        if first is None or second is None or not (single_use(m[a]) and single_use(m[b])):
            return orig
        (x1, w1, b1, at1), (x2, w2, b2, at2) = first, second
        if not x1.same_as(x2) or [int(v) for v in at1.strides] != [int(v) for v in at2.strides] \
                or int(at1.groups) != int(at2.groups) or w1.shape[:2] != w2.shape[:2]:
            return orig
        big, small, attrs = (w1, w2, at1) if w1.shape[2] >= w2.shape[2] else (w2, w1, at2)
        if small.shape[3] > big.shape[3]:
            return orig
        dr, ds = (big.shape[2] - small.shape[2]) // 2, (big.shape[3] - small.shape[3]) // 2
        merged = big.astype("float64").copy()
        merged[:, :, dr:dr + small.shape[2], ds:ds + small.shape[3]] += small
        conv = relax.op.nn.conv2d(x1, relax.const(merged.astype("float32")),
                                  strides=attrs.strides, padding=attrs.padding,
                                  groups=int(attrs.groups), data_layout="NCHW",
                                  kernel_layout="OIHW", out_dtype=None)
        biases = [v.reshape(-1) for v in (b1, b2) if v is not None]
        if not biases:
            return conv
        total = np.sum(np.stack([v.astype("float64") for v in biases]), axis=0)
        return relax.op.add(conv, relax.const(total.astype("float32").reshape(1, -1, 1, 1)))

    return rewrite_call(pattern, rewriter, func)


#: Rounds of :func:`merge_parallel_convolutions` (MobileOne-S0 sums up to 3 branches).
MAX_BRANCHES = 8

#: Element-wise ops a reshape commutes with that a GEMM epilogue can take.
EPILOGUE_UNARY = ("relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.sigmoid",
                   "relax.nn.silu", "relax.tanh")


def sink_dense_reshapes(func: relax.Function) -> relax.Function:
    """``act(reshape(dense))`` → ``reshape(act(dense))`` and ``reshape(dense) + r`` →
    ``reshape(dense + reshape(r))`` (r shaped like the reshape), where ``dense`` is a
    matmul by a constant (+ a constant bias), possibly activated already.

    GPT-2's ``Conv1D`` layers flatten rows around every GEMM (``view(-1, n)``, ``addmm``,
    ``view(*size)``), so its tanh-GELU and residual adds met the GEMM only through a
    reshape and ran as separate kernels. Sunk below them, the reshape is a free view and
    the epilogue fuses into the GEMM (a product ``reshape(dense) * r`` too: Llama's SwiGLU
    gate through ``torch.export``). Only reshapes keeping the last axis move (rows merged
    or split), so a bias row still lines up. A constant scale per column moves below the
    reshape too (ConvNeXt's layer scale after a ``Linear`` on NHWC rows), where
    :func:`fold_output_scales` folds it into the weights."""
    x, w, b, r = wildcard(), is_const(), is_const(), wildcard()
    dense = is_op("relax.matmul")(x, w)
    dense = dense | is_op("relax.add")(dense, b)
    dense = dense | is_op("relax.nn.gelu_tanh")(dense) | is_op("relax.nn.gelu")(dense)
    reshaped = is_op("relax.reshape")(dense, wildcard())
    unary = None
    for op in EPILOGUE_UNARY:
        unary = is_op(op)(reshaped) if unary is None else unary | is_op(op)(reshaped)
    added = is_op("relax.add")(reshaped, r) | is_op("relax.add")(r, reshaped) | \
        is_op("relax.multiply")(reshaped, r) | is_op("relax.multiply")(r, reshaped)
    c = is_const()
    scaled = is_op("relax.multiply")(reshaped, c) | is_op("relax.multiply")(c, reshaped)

    def inner(view: relax.Call) -> relax.Expr | None:
        """The reshape's source when the reshape keeps its last axis, else None."""
        src = view.args[0]
        src_shape, out_shape = static_shape(src), static_shape(view)
        if src_shape is None or out_shape is None or not src_shape or not out_shape:
            return None
        return src if src_shape[-1] == out_shape[-1] else None

    def rewrite_unary(orig, m):
        view = m[reshaped]
        src = inner(view)
        if src is None:
            return orig
        return relax.op.reshape(relax.Call(orig.op, [src], orig.attrs), static_shape(view))

    def rewrite_add(orig, m):
        view, other = m[reshaped], m[r]
        src = inner(view)
        shape = static_shape(view)
        if src is None or static_shape(other) != shape or \
                str(other.ty.dtype) != str(src.ty.dtype):
            return orig
        flat = relax.op.reshape(other, static_shape(src))
        return relax.op.reshape(relax.Call(orig.op, [src, flat]), shape)

    def rewrite_scale(orig, m):
        view, scale = m[reshaped], const_value(m[c])
        src, shape = inner(view), static_shape(view)
        if src is None or scale is None or static_shape(orig) != shape or \
                scale.ndim > len(shape) or scale.size not in (1, shape[-1]) or \
                (scale.size > 1 and scale.shape[-1] != shape[-1]):
            return orig  # only a scale per column (or a scalar) commutes with the view
        column = relax.const(scale.reshape(-1)) if scale.size > 1 else m[c]
        return relax.op.reshape(relax.op.multiply(src, column), shape)

    func = rewrite_call(scaled, rewrite_scale, func)
    return rewrite_call(added, rewrite_add, rewrite_call(unary, rewrite_unary, func))


@tvm.transform.module_pass(opt_level=0, name="tpp.CanonicalizeActivations")
def CanonicalizeActivations(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass name
    """Apply the activation rewrites to every Relax function of the module."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            func = rewrite_silu(rewrite_tanh_gelu(rewrite_erf_gelu(
                rewrite_clips(drop_identity_casts(func)))))
            func = rewrite_rms_norm(merge_operand_scales(drop_single_concats(func)))
            func = merge_constant_adds(drop_zero_adds(fold_convolution_scales(
                fold_batch_norms(fold_output_scales(func)))))
            for _ in range(MAX_BRANCHES):  # one pair of branches merges per round
                merged = merge_parallel_convolutions(func)
                if structural_equal(merged, func):
                    break
                func = merged
            # a scale sunk below a view meets its GEMM only now
            mod[gv] = fold_output_scales(sink_dense_reshapes(func))
    return mod
