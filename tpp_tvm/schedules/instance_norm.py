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

A group norm (G groups of C/G consecutive channels, BiT's GroupNorm on NHWC images) has
the same two passes: the per-channel means and squared deviations are combined per group
(Chan's pairwise formula: the group's squared deviation is the channels' own plus rows
times each channel mean's squared distance from the group mean), so no channel mean is
subtracted from another channel's values.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from ..intrinsics.registry import vector_isa
from .rowwise import equation_schedule

#: Output names of the statistics kernel: the per-channel scale and shift.
STATS_OUTPUTS = ("norm_scale", "norm_shift")


#: Vectors of channels one task of the statistics pass sums: each row's read of a block is
#: then whole cache lines (AMX Xeon, 1 thread, 3136 x 256: one vector a task 0.35 ms, two
#: 0.19, four 0.20; wav2vec2's 3199 x 512: 0.75 -> 0.33).
STATS_BLOCK_VECTORS = (4, 2)


def _channel_block(width: int, lanes: int) -> int:
    """Channels a statistics task sums: the widest block of :data:`STATS_BLOCK_VECTORS`
    that divides ``width`` and leaves at least two tasks, else one vector."""
    for vectors in STATS_BLOCK_VECTORS:
        block = vectors * lanes
        if width % block == 0 and width // block >= 2:
            return block
    return lanes


def _group_statistics(X: te.Tensor, gamma: te.Tensor, s1: te.Tensor, s2: te.Tensor,
                      rows: int, width: int, groups: int, eps: float) -> tuple:
    """A group norm's ``scale_of(c)`` and ``mean_of(c)``: each channel's mean and squared
    deviation from its shifted sums ``s1``, ``s2``, combined per group of ``width /
    groups`` channels."""
    inv = tirx.const(1.0 / rows, "float32")
    zero = tirx.const(0.0, "float32")
    size = width // groups
    mean_c = te.compute((width,), lambda c: X[0, c] + s1[c] * inv, name="channel_mean")
    dev_c = te.compute((width,), lambda c: tirx.max(s2[c] - s1[c] * s1[c] * inv, zero),
                       name="channel_sqdev")
    j = te.reduce_axis((0, size), name="j")
    group_mean = te.compute((groups,), lambda g: te.sum(
        mean_c[g * size + j] * tirx.const(1.0 / size, "float32"), axis=j),
        name="group_mean")
    j2 = te.reduce_axis((0, size), name="j2")

    def group_dev(g):
        d = mean_c[g * size + j2] - group_mean[g]
        return te.sum(dev_c[g * size + j2] + tirx.const(float(rows), "float32") * d * d,
                      axis=j2)

    dev_g = te.compute((groups,), group_dev, name="group_sqdev")
    inv_n = tirx.const(1.0 / (rows * size), "float32")

    def scale_of(c):
        var = dev_g[c // size] * inv_n
        return gamma[c] * tirx.rsqrt(var + tirx.const(eps, "float32"))

    def mean_of(c):
        return group_mean[c // size]

    return scale_of, mean_of


def _schedule_statistics(sch: s_tir.Schedule, width: int, isa: str) -> None:
    """One pass over the rows, parallel over blocks of channels as vector lanes."""
    lanes = vector_isa(isa).schedule_lanes("float32")
    lanes = lanes if width % lanes == 0 else 1
    # One pass: per block of channels, the sum and the sum of squares of each row.
    blk = sch.get_sblock("shifted_sums")
    c, r = sch.get_loops(blk)
    co, ci = sch.split(c, [None, _channel_block(width, lanes)])
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


def instance_norm_stats_schedule(rows: int, width: int, eps: float, isa: str,
                                 groups: int | None = None) -> s_tir.Schedule:
    """Kernel (x (rows, width), gamma (width,), beta (width,)) -> (scale, shift), each
    (width,): ``scale = gamma * rstd``, ``shift = beta - mean * scale``, the statistics
    per channel, or per group of ``width / groups`` consecutive channels. Channels run as
    vector lanes, parallel over channel blocks."""
    groups = width if groups is None else groups
    if groups < 1 or width % groups:
        raise ValueError(f"group norm: {width} channels do not split into {groups} groups")
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
    zero = tirx.const(0.0, "float32")
    if groups == width:
        def scale_of(c):
            mean = s1[c] * inv
            var = tirx.max(s2[c] * inv - mean * mean, zero)
            return gamma[c] * tirx.rsqrt(var + tirx.const(eps, "float32"))

        def mean_of(c):
            return X[0, c] + s1[c] * inv
    else:
        scale_of, mean_of = _group_statistics(X, gamma, s1, s2, rows, width, groups, eps)

    scale = te.compute((width,), scale_of, name=STATS_OUTPUTS[0])
    shift = te.compute((width,), lambda c: beta[c] - mean_of(c) * scale[c],
                       name=STATS_OUTPUTS[1])
    sch = s_tir.Schedule(te.create_prim_func([X, gamma, beta, scale, shift]))
    _schedule_statistics(sch, width, isa)
    return sch


def instance_norm_apply_schedule(rows: int, width: int, activation: str | None,
                                 isa: str) -> s_tir.Schedule:
    """Kernel (x (rows, width), scale (width,), shift (width,)) -> y: ``act(x * scale +
    shift)`` as one equation TPP per row block."""
    steps = ("scale", "bias") + ((activation,) if activation else ())
    return equation_schedule(rows, width, steps, ["scale", "bias"], isa)
