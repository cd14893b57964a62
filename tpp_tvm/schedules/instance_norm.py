"""Instance norm of a channels-last tensor: statistics per channel over the rows (time or
space), then one equation TPP pass.

``y = act((x - mean_c) * rstd_c * gamma_c + beta_c)`` for x of shape (rows, channels), the
per-channel statistics reduced over the rows. wav2vec2's feature extractor normalizes its
first convolution's 512 channels over 3199 frames (a GroupNorm with a group per channel);
run as a layer norm it needed the tensor transposed to channels-first and back, two of
the model's slowest kernels. Here the statistics are column sums read with channels as
the vector lanes, folded into a scale and a shift per channel, and the normalization,
affine and activation are one equation TPP (``scale``, ``bias``, activation) over row
blocks: two passes over the tensor, no transposes.

The variance is computed from sums shifted by the first row (``x - x[0, c]``): as accurate
as the two-pass form when the mean is large against the spread, in one pass.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from ..intrinsics.registry import vector_isa
from .rowwise import equation_schedule

#: Output names of the statistics kernel: the per-channel scale and shift.
STATS_OUTPUTS = ("norm_scale", "norm_shift")


def instance_norm_stats_schedule(rows: int, width: int, eps: float, isa: str
                                 ) -> s_tir.Schedule:
    """Kernel (x (rows, width), gamma (width,), beta (width,)) -> (scale, shift), each
    (width,): ``scale = gamma * rstd``, ``shift = beta - mean * scale``. Channels run as
    vector lanes, parallel over channel blocks."""
    X = te.placeholder((rows, width), "float32", name="x")
    gamma = te.placeholder((width,), "float32", name="gamma")
    beta = te.placeholder((width,), "float32", name="beta")
    r = te.reduce_axis((0, rows), name="r")
    sums = te.comm_reducer(lambda a, b: (a[0] + b[0], a[1] + b[1]),
                           lambda t0, t1: (tirx.const(0.0, t0), tirx.const(0.0, t1)),
                           name="sum_and_sumsq")

    def shifted(c):
        d = X[r, c] - X[0, c]
        return sums((d, d * d), axis=r)

    s1, s2 = te.compute((width,), shifted, name="shifted_sums")
    inv = tirx.const(1.0 / rows, "float32")

    def scale_of(c):
        mean = s1[c] * inv
        var = tirx.max(s2[c] * inv - mean * mean, tirx.const(0.0, "float32"))
        return gamma[c] * tirx.rsqrt(var + tirx.const(eps, "float32"))

    scale = te.compute((width,), scale_of, name=STATS_OUTPUTS[0])
    shift = te.compute((width,), lambda c: beta[c] - (X[0, c] + s1[c] * inv) * scale[c],
                       name=STATS_OUTPUTS[1])
    sch = s_tir.Schedule(te.create_prim_func([X, gamma, beta, scale, shift]))
    lanes = vector_isa(isa).schedule_lanes("float32")
    lanes = lanes if width % lanes == 0 else 1
    # One pass: per block of channels, the sum and the sum of squares of each row.
    blk = sch.get_sblock("shifted_sums")
    c, r = sch.get_loops(blk)
    co, ci = sch.split(c, [None, lanes])
    sch.reorder(co, r, ci)
    sch.parallel(co)
    init = sch.decompose_reduction(blk, r)
    if lanes > 1:
        # the update under the row loop is not a complete block for TIR's vectorize;
        # unrolled, LLVM's SLP vectorizer makes it vector adds and FMAs, one each a row
        sch.vectorize(sch.get_loops(init)[-1])
        sch.unroll(ci)
    for name in STATS_OUTPUTS:
        c, = sch.get_loops(sch.get_sblock(name))
        if lanes > 1:
            sch.vectorize(sch.split(c, [None, lanes])[1])
    return sch


def instance_norm_apply_schedule(rows: int, width: int, activation: str | None,
                                 isa: str) -> s_tir.Schedule:
    """Kernel (x (rows, width), scale (width,), shift (width,)) -> y: ``act(x * scale +
    shift)`` as one equation TPP per row block."""
    steps = ("scale", "bias") + ((activation,) if activation else ())
    return equation_schedule(rows, width, steps, ["scale", "bias"], isa)
