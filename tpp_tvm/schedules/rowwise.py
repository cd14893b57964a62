"""Row-wise equations on TPPs: layer norm, RMS norm and softmax over the last axis.

Each is a small tree of TPPs (LIBXSMM's "equations") applied to a block of ``mr`` rows
while it sits in L1: column reductions (sum, sum of squares, max), broadcast binary ops
and a unary op. Every stage is computed under the row-block loop (one parallel loop), and
each tile-sized stage is tensorized with its TPP; per-row scalars (mean, 1/std, 1/sum)
are plain TIR.

layer norm (two-pass, as accurate as the reference):
    mean = sum(x)/H;  d = x - mean;  rstd = 1/sqrt(sum(d^2)/H + eps);  y = d*rstd*gamma + beta
RMS norm:
    rstd = 1/sqrt(sum(x^2)/H + eps);  y = x*rstd*gamma
softmax:
    m = max(x);  e = exp(x - m);  y = e * (1/sum(e))
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from ..intrinsics import TPPSpec
from ..intrinsics.spec import OPERAND_STEPS, equation_expr
from .tensorize import tensorize_row_block, vectorize_whole_vectors

#: Largest row block; a block of rows x H fp32 should stay well inside L1.
MAX_ROWS = 16


def row_block(rows: int, width: int) -> int:
    """Rows per block: the largest divisor of ``rows`` up to 16 keeping the block under
    ~24 KiB; one row (a one-row TPP per block) when ``rows`` is 1 or has no such divisor,
    as ViT's 197 tokens or a 7x7 feature map's 49 pixels at a wide channel count."""
    limit = max(2, min(MAX_ROWS, (24 * 1024) // max(1, 4 * width)))
    for mr in range(min(limit, rows), 1, -1):
        if rows % mr == 0:
            return mr
    return 1


def padded_rows(rows: int, width: int) -> int:
    """Rows a row-wise kernel runs on: ``rows``, or, when no block size divides it (a prime
    such as ViT's 197 tokens), the next count one does: one-row blocks cannot be
    tensorized, and their plain TIR ran 7x slower (197 x 768 layer norm: 0.47 vs 0.07 ms).
    The layer norm, RMS norm and softmax kernels pad inside (:func:`_rows_in`); the
    element-wise equation's caller pads with zero rows and drops their outputs."""
    if rows == 1 or row_block(rows, width) > 1:
        return rows
    return next(r for r in range(rows + 1, 2 * rows + 2) if row_block(r, width) > 1)


def _rows_in(x: te.Tensor, padded: int) -> te.Tensor:
    """``x``'s rows with zero rows appended up to ``padded``, copied one row block at a
    time next to the TPP stages; the kernel's own input and output keep the true row count,
    so no pad or slice kernel surrounds it (ViT: two copies of the token rows per norm)."""
    rows = int(x.shape[0])
    if padded == rows:
        return x
    zero = tirx.const(0.0, "float32")
    return te.compute((padded, x.shape[1]), lambda i, j: tirx.if_then_else(
        i < rows, x[tirx.min(i, rows - 1), j], zero), name="rows_in")


def _rows_out(y: te.Tensor, rows: int) -> te.Tensor:
    """The first ``rows`` rows of a padded stage: the kernel's output."""
    if int(y.shape[0]) == rows:
        return y
    return te.compute((rows, y.shape[1]), lambda i, j: y[i, j], name="rows_out")


def _padded_stages(stages: list[tuple[str, TPPSpec | None]], rows: int, padded: int
                   ) -> list[tuple[str, TPPSpec | None]]:
    """``stages`` with the row copies of :func:`_rows_in` / :func:`_rows_out` around them."""
    if padded == rows:
        return stages
    return [("rows_in", None), *stages, ("rows_out", None)]


def schedule_row_stages(func: tirx.PrimFunc, stages: list[tuple[str, TPPSpec | None]],
                        mr: int, isa: str) -> s_tir.Schedule:
    """Block the output's rows, compute every stage per block (the block stays in L1
    between stages) and tensorize each tile stage; ``None`` marks a per-row scalar stage."""
    sch = s_tir.Schedule(func)
    out_name = stages[-1][0]
    out = sch.get_sblock(out_name)
    i, _ = sch.get_loops(out)
    io, _ = sch.split(i, [None, mr])
    sch.parallel(io)
    for name, _spec in reversed(stages[:-1]):
        sch.compute_at(sch.get_sblock(name), io)
    for name, spec in stages:
        if spec is not None:
            tensorize_row_block(sch, name, spec, isa)
        elif name in ("rows_in", "rows_out"):
            vectorize_whole_vectors(sch, sch.get_sblock(name), isa)
    return sch


def equation_schedule(rows: int, width: int, steps: tuple[str, ...],
                      operand_kinds: list[str], isa: str) -> s_tir.Schedule:
    """An element-wise chain over a (rows, width) tensor as one equation TPP per row block.

    ``operand_kinds`` lists the extra inputs in order, one per operand step: a row
    (width,) or a tile (rows, width), as ``spec.OPERAND_STEPS`` says.
    """
    mr = row_block(rows, width)
    X = te.placeholder((rows, width), "float32", name="x")
    ops = [te.placeholder(OPERAND_STEPS[k].shape(rows, width), "float32",
                          name=f"p{i}") for i, k in enumerate(operand_kinds)]
    y = te.compute((rows, width), lambda i, j: equation_expr(steps, X[i, j], [
        p[j] if OPERAND_STEPS[k].row else p[i, j] for p, k in zip(ops, operand_kinds)
    ]), name="equation")
    sch = s_tir.Schedule(te.create_prim_func([X, *ops, y]))
    i, _ = sch.get_loops(sch.get_sblock("equation"))
    io, _ = sch.split(i, [None, mr])
    sch.parallel(io)
    tensorize_row_block(sch, "equation", TPPSpec("equation", m=mr, n=width, steps=steps), isa)
    return sch


def layer_norm_schedule(rows: int, width: int, eps: float, isa: str) -> s_tir.Schedule:
    """Layer norm over the last axis of a (rows, width) fp32 tensor with gamma and beta."""
    padded = padded_rows(rows, width)
    mr = row_block(padded, width)
    X = te.placeholder((rows, width), "float32", name="x")
    xin = _rows_in(X, padded)
    gamma = te.placeholder((width,), "float32", name="gamma")
    beta = te.placeholder((width,), "float32", name="beta")
    k1 = te.reduce_axis((0, width), "k1")
    k2 = te.reduce_axis((0, width), "k2")
    inv_w = tirx.const(1.0 / width, "float32")
    total = te.compute((padded,), lambda i: te.sum(xin[i, k1], axis=k1), name="row_sum")
    mean = te.compute((padded,), lambda i: total[i] * inv_w, name="mean")
    d = te.compute((padded, width), lambda i, j: xin[i, j] - mean[i], name="centered")
    ssq = te.compute((padded,), lambda i: te.sum(d[i, k2] * d[i, k2], axis=k2), name="row_ssq")
    rstd = te.compute(
        (padded,), lambda i: tirx.rsqrt(ssq[i] * inv_w + tirx.const(eps, "float32")), name="rstd"
    )
    scaled = te.compute((padded, width), lambda i, j: d[i, j] * rstd[i], name="scaled")
    weighted = te.compute((padded, width), lambda i, j: scaled[i, j] * gamma[j], name="weighted")
    y = te.compute((padded, width), lambda i, j: weighted[i, j] + beta[j], name="layer_norm")
    func = te.create_prim_func([X, gamma, beta, _rows_out(y, rows)])
    stages = [
        ("row_sum", TPPSpec("reduce_add_cols", m=mr, n=width)),
        ("mean", None),
        ("centered", TPPSpec("sub", m=mr, n=width, bcast="col")),
        ("row_ssq", TPPSpec("reduce_sumsq_cols", m=mr, n=width)),
        ("rstd", None),
        ("scaled", TPPSpec("mul", m=mr, n=width, bcast="col")),
        ("weighted", TPPSpec("mul", m=mr, n=width, bcast="row")),
        ("layer_norm", TPPSpec("add", m=mr, n=width, bcast="row")),
    ]
    return schedule_row_stages(func, _padded_stages(stages, rows, padded), mr, isa)


def rms_norm_schedule(rows: int, width: int, eps: float, isa: str) -> s_tir.Schedule:
    """RMS norm over the last axis of a (rows, width) fp32 tensor with gamma."""
    padded = padded_rows(rows, width)
    mr = row_block(padded, width)
    X = te.placeholder((rows, width), "float32", name="x")
    xin = _rows_in(X, padded)
    gamma = te.placeholder((width,), "float32", name="gamma")
    k = te.reduce_axis((0, width), "k")
    ssq = te.compute((padded,), lambda i: te.sum(xin[i, k] * xin[i, k], axis=k), name="row_ssq")
    rstd = te.compute((padded,), lambda i: tirx.rsqrt(
        ssq[i] * tirx.const(1.0 / width, "float32") + tirx.const(eps, "float32")), name="rstd")
    scaled = te.compute((padded, width), lambda i, j: xin[i, j] * rstd[i], name="scaled")
    y = te.compute((padded, width), lambda i, j: scaled[i, j] * gamma[j], name="rms_norm")
    func = te.create_prim_func([X, gamma, _rows_out(y, rows)])
    stages = [
        ("row_ssq", TPPSpec("reduce_sumsq_cols", m=mr, n=width)),
        ("rstd", None),
        ("scaled", TPPSpec("mul", m=mr, n=width, bcast="col")),
        ("rms_norm", TPPSpec("mul", m=mr, n=width, bcast="row")),
    ]
    return schedule_row_stages(func, _padded_stages(stages, rows, padded), mr, isa)


def softmax_schedule(rows: int, width: int, isa: str) -> s_tir.Schedule:
    """Softmax over the last axis of a (rows, width) fp32 tensor."""
    padded = padded_rows(rows, width)
    mr = row_block(padded, width)
    X = te.placeholder((rows, width), "float32", name="x")
    xin = _rows_in(X, padded)
    k1 = te.reduce_axis((0, width), "k1")
    k2 = te.reduce_axis((0, width), "k2")
    mx = te.compute((padded,), lambda i: te.max(xin[i, k1], axis=k1), name="row_max")
    shifted = te.compute((padded, width), lambda i, j: xin[i, j] - mx[i], name="shifted")
    e = te.compute((padded, width), lambda i, j: tirx.exp(shifted[i, j]), name="exp")
    total = te.compute((padded,), lambda i: te.sum(e[i, k2], axis=k2), name="row_sum")
    inv = te.compute((padded,), lambda i: tirx.const(1.0, "float32") / total[i], name="inv_sum")
    y = te.compute((padded, width), lambda i, j: e[i, j] * inv[i], name="softmax")
    func = te.create_prim_func([X, _rows_out(y, rows)])
    stages = [
        ("row_max", TPPSpec("reduce_max_cols", m=mr, n=width)),
        ("shifted", TPPSpec("sub", m=mr, n=width, bcast="col")),
        ("exp", TPPSpec("exp", m=mr, n=width)),
        ("row_sum", TPPSpec("reduce_add_cols", m=mr, n=width)),
        ("inv_sum", None),
        ("softmax", TPPSpec("mul", m=mr, n=width, bcast="col")),
    ]
    return schedule_row_stages(func, _padded_stages(stages, rows, padded), mr, isa)
