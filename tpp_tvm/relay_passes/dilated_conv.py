"""Dilated convolutions as undilated ones, which the convolution kernels take.

The BRGEMM convolution kernels take no dilation (the depthwise kernel does); TVM's code
ran FCN-ResNet50's dilated 3x3 convolutions in 47 s a call. Three exact forms, chosen by
how wide the dilation is against the map:

- taps that only ever read padding are dropped (DeepLabV3's ASPP at dilation 36 over
  28x28 is a 1x1);
- a stride-1 dilation whose phases are whole images runs the undilated convolution on
  the dh x dw phases of its input as a batch;
- a dilation so wide that each phase is a few pixels runs one 1x1 convolution per tap
  over the outputs that tap reaches;
- stride and dilation both above 1, one dividing the other, subsample first.
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from .exprs import const_value, conv_layouts, ints, out_dtype, static_shape

__all__ = ["dilated_as_undilated"]


def dilated_as_undilated(call: relax.Call) -> relax.Expr | None:
    """A stride-1 convolution dilated by (dh, dw) is an undilated one on each of the dh x dw
    phases of its padded input (every dh-th row and dw-th column from offset (a, b)), the
    phases a batch: output pixel (dh y + a, dw x + b) is phase (a, b)'s pixel (y, x). The
    input is padded to whole phases and regrouped, the phases' outputs interleaved back and
    cropped. Taps that only ever read padding are dropped first. The convolution kernels
    take no dilation; TVM's code ran FCN-ResNet50's dilated 3x3 convolutions in 47 s a
    call."""
    attrs = call.attrs
    x, w = call.args
    shape, wshape = static_shape(x), static_shape(w)
    (dh, dw), strides = ints(attrs.dilation), ints(attrs.strides)
    if shape is None or wshape is None or not conv_layouts(attrs, "NCHW", "OIHW") \
            or (dh, dw) == (1, 1) or strides[0] != strides[1]:
        return None
    (n, c, h, wd), (oc, _, r, s) = shape, wshape
    pad = ints(attrs.padding)
    top, left, bottom, right = pad * 2 if len(pad) == 2 else pad
    depthwise = int(attrs.groups) == c and wshape[1] == 1  # its kernel takes dilation
    if strides[0] != 1:
        return _strided_dilated(call, strides[0], dh, (top, left, bottom, right)) \
            if dh == dw and not depthwise else None
    trimmed = _without_dead_taps(call)
    if trimmed is not None or depthwise:
        return trimmed
    oh, ow = h + top + bottom - dh * (r - 1), wd + left + right - dw * (s - 1)
    if oh < 1 or ow < 1:
        return None
    h1, w1 = -(-(h + top + bottom) // dh), -(-(wd + left + right) // dw)
    if h1 < 2 * r or w1 < 2 * s:
        return _dilated_as_taps(call, (top, left, bottom, right), oh, ow)
    padded = relax.op.nn.pad(x, [0, 0, 0, 0, top, h1 * dh - h - top, left, w1 * dw - wd - left],
                             "constant", 0.0)
    phases = relax.op.permute_dims(relax.op.reshape(padded, (n, c, h1, dh, w1, dw)),
                                   [0, 3, 5, 1, 2, 4])
    conv = relax.op.nn.conv2d(
        relax.op.reshape(phases, (n * dh * dw, c, h1, w1)), w, groups=int(attrs.groups),
        data_layout="NCHW", kernel_layout=str(attrs.kernel_layout),
        out_dtype=out_dtype(attrs))
    oh1, ow1 = h1 - r + 1, w1 - s + 1
    out = relax.op.permute_dims(relax.op.reshape(conv, (n, dh, dw, oc, oh1, ow1)),
                                [0, 3, 4, 1, 5, 2])
    out = relax.op.reshape(out, (n, oc, oh1 * dh, ow1 * dw))
    if (oh1 * dh, ow1 * dw) == (oh, ow):
        return out
    return relax.op.strided_slice(out, axes=[2, 3], begin=[0, 0], end=[oh, ow])


def _dilated_as_taps(call: relax.Call, pad: tuple[int, int, int, int], oh: int, ow: int
                     ) -> relax.Expr | None:
    """A dilation so wide that each phase image is a few pixels (DeepLabV3's ASPP at
    dilation 12 over a 14x14 map: 144 phases of 2x2 outputs) as one 1x1 convolution per
    tap, summed. Each tap runs only over the outputs where it reads the image (its window
    of the unpadded input), zero-padded back to the whole map: at dilation 12 over 14x14
    the eight outer taps see 2 of 14 rows or columns, and a full 1x1 per tap did 5.4x the
    work (DeepLabV3-MobileNetV3: 5.5 ms of 22). Taps over the whole map come first, so the
    adds of whole taps are the next convolution's residual epilogue."""
    attrs = call.attrs
    x, w = call.args
    w_np, shape = const_value(w), static_shape(x)
    if w_np is None or shape is None:
        return None
    top, left, _, _ = pad
    h, wd = shape[2], shape[3]
    dh, dw = ints(attrs.dilation)
    taps = []
    for ry in range(w_np.shape[2]):
        y0, y1 = max(0, top - ry * dh), min(oh, h + top - ry * dh)
        for rx in range(w_np.shape[3]):
            x0, x1 = max(0, left - rx * dw), min(ow, wd + left - rx * dw)
            if y0 < y1 and x0 < x1:
                taps.append((ry, rx, y0, y1, x0, x1))
    taps.sort(key=lambda t: (t[2], t[3], t[4], t[5]) != (0, oh, 0, ow))
    total = None
    for ry, rx, y0, y1, x0, x1 in taps:
        iy, ix = y0 + ry * dh - top, x0 + rx * dw - left
        window = relax.op.strided_slice(x, axes=[2, 3], begin=[iy, ix],
                                        end=[iy + y1 - y0, ix + x1 - x0])
        tap = relax.op.nn.conv2d(
            window, relax.const(np.ascontiguousarray(w_np[:, :, ry:ry + 1, rx:rx + 1])),
            groups=int(attrs.groups), data_layout="NCHW", kernel_layout="OIHW",
            out_dtype=out_dtype(attrs))
        if (y0, y1, x0, x1) != (0, oh, 0, ow):
            tap = relax.op.nn.pad(tap, [0, 0, 0, 0, y0, oh - y1, x0, ow - x1], "constant", 0.0)
        total = tap if total is None else relax.op.add(tap, total)
    return total


def _live_taps(size: int, taps: int, d: int, before: int, after: int, out: int
               ) -> tuple[int, int]:
    """[first, last] of a stride-1 dilated axis's taps that read the input for some output
    position (the others only ever read padding)."""
    live = [t for t in range(taps) if t * d - before < size and t * d - before + out > 0]
    return (live[0], live[-1]) if live else (taps // 2, taps // 2)


def _without_dead_taps(call: relax.Call) -> relax.Expr | None:
    """A stride-1 dilated convolution whose outer taps only ever read padding (DeepLabV3's
    ASPP at dilations 12-36 over a 28x28 map: only the centre tap sees the image) with
    those taps dropped from its constant filter, and their padding with them: a 3x3 at
    dilation 36 there is a 1x1."""
    attrs = call.attrs
    x, w = call.args
    shape, w_np = static_shape(x), const_value(w)
    if shape is None or w_np is None or any(st != 1 for st in ints(attrs.strides)):
        return None
    d = ints(attrs.dilation)
    pad = ints(attrs.padding)
    top, left, bottom, right = pad * 2 if len(pad) == 2 else pad
    r, s = w_np.shape[2:]
    oh, ow = (shape[2] + top + bottom - d[0] * (r - 1), shape[3] + left + right - d[1] * (s - 1))
    r0, r1 = _live_taps(shape[2], r, d[0], top, bottom, oh)
    s0, s1 = _live_taps(shape[3], s, d[1], left, right, ow)
    new_pad = (top - r0 * d[0], left - s0 * d[1], bottom - (r - 1 - r1) * d[0],
               right - (s - 1 - s1) * d[1])
    if (r0, r1, s0, s1) == (0, r - 1, 0, s - 1) or min(new_pad) < 0:
        return None
    dilation = [d[0] if r1 > r0 else 1, d[1] if s1 > s0 else 1]
    return relax.op.nn.conv2d(
        x, relax.const(np.ascontiguousarray(w_np[:, :, r0:r1 + 1, s0:s1 + 1])),
        padding=new_pad, dilation=dilation, groups=int(attrs.groups), data_layout="NCHW",
        kernel_layout="OIHW", out_dtype=out_dtype(attrs))


def _strided_dilated(call: relax.Call, stride: int, d: int,
                     pad: tuple[int, int, int, int]) -> relax.Expr | None:
    """Stride and dilation both above 1, one dividing the other (SKNet's dilated 3x3 at
    stride 2): with g the smaller, the taps and the outputs only read every g-th row and
    column of the padded input, so the convolution is one of stride / g and dilation / g
    on that subsampled image (a dilation left is then :func:`dilated_as_undilated`'s)."""
    g = min(stride, d)
    if stride % g or d % g:
        return None
    attrs = call.attrs
    x, w = call.args
    top, left, bottom, right = pad
    padded = relax.op.nn.pad(x, [0, 0, 0, 0, top, bottom, left, right], "constant", 0.0)
    shape = static_shape(x)
    every = relax.op.strided_slice(padded, axes=[2, 3], begin=[0, 0],
                                   end=[shape[2] + top + bottom, shape[3] + left + right],
                                   strides=[g, g])
    return relax.op.nn.conv2d(every, w, strides=stride // g, dilation=d // g,
                              groups=int(attrs.groups), data_layout="NCHW",
                              kernel_layout=str(attrs.kernel_layout),
                              out_dtype=out_dtype(attrs))
