"""Backward operators on TPPs: activation gradients, softmax and layer-norm backward, and
the column sums of bias gradients.

Each operator is defined once as a TE computation on a (rows, width) tensor (``*_te``); the
training gradients (``training/gradients.py``) emit exactly that computation, tagged with
``tpp.backward``, and the ``tpp`` pipeline swaps in the schedule from here (same math, same
parameters), so a non-TPP target still gets a correct, plainly scheduled kernel.

* ``relu_inv`` / ``gelu_inv`` / ``tanh_inv`` / ``sigmoid_inv``: one unary-backward TPP per
  row block;
* softmax backward, dX = Y * (dY - rowsum(dY * Y)): mul, reduce_add_cols, sub (column
  broadcast), mul TPPs per row block;
* layer-norm backward: per row block the statistics are recomputed (reduce TPPs) and
  dX = rstd * (g - mean(g) - x̂ * mean(g x̂)) with g = dY * gamma; dgamma = Σ dY x̂ and
  dbeta = Σ dY are column sums over all rows (reduce_add_rows TPPs);
* bias gradient, Σ_rows dY: reduce_add_rows TPPs over column panels.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from ..errors import UnsupportedShapeError
from ..intrinsics import OPS, TPPSpec
from .rowwise import row_block, schedule_row_stages
from .tensorize import tensorize_rows, try_tensorize

#: Unary backward TPPs and whether S is the forward input (else the forward output).
UNARY_BWD = {"relu_inv": False, "gelu_inv": True, "tanh_inv": False, "sigmoid_inv": False}
#: Columns per panel of a column sum (one zmm accumulator per 16).
COL_PANEL = 64

F32 = "float32"


def unary_bwd_te(dy: te.Tensor, s: te.Tensor, op: str) -> te.Tensor:
    """dX = op(dY, S) element-wise (the TPP's math, see ``intrinsics/spec.py``)."""
    fn = OPS[op].fn
    return te.compute(dy.shape, lambda *ix: fn(dy[ix], s[ix]), name=op)


def softmax_bwd_te(y: te.Tensor, dy: te.Tensor) -> te.Tensor:
    rows, width = (int(d) for d in y.shape)
    k = te.reduce_axis((0, width), "k")
    prod = te.compute((rows, width), lambda i, j: dy[i, j] * y[i, j], name="dy_y")
    total = te.compute((rows,), lambda i: te.sum(prod[i, k], axis=k), name="row_sum")
    diff = te.compute((rows, width), lambda i, j: dy[i, j] - total[i], name="diff")
    return te.compute((rows, width), lambda i, j: y[i, j] * diff[i, j], name="softmax_bwd")


def layer_norm_bwd_te(x: te.Tensor, gamma: te.Tensor, dy: te.Tensor, eps: float
                      ) -> list[te.Tensor]:
    """(dX, dgamma, dbeta) of layer norm over the last axis, statistics recomputed."""
    rows, width = (int(d) for d in x.shape)
    inv_w = tirx.const(1.0 / width, F32)
    ks = [te.reduce_axis((0, width), f"k{i}") for i in range(4)]
    r1, r2 = te.reduce_axis((0, rows), "r1"), te.reduce_axis((0, rows), "r2")
    total = te.compute((rows,), lambda i: te.sum(x[i, ks[0]], axis=ks[0]), name="row_sum")
    mean = te.compute((rows,), lambda i: total[i] * inv_w, name="mean")
    d = te.compute((rows, width), lambda i, j: x[i, j] - mean[i], name="centered")
    ssq = te.compute((rows,), lambda i: te.sum(d[i, ks[1]] * d[i, ks[1]], axis=ks[1]),
                     name="row_ssq")
    rstd = te.compute((rows,), lambda i: tirx.rsqrt(ssq[i] * inv_w + tirx.const(eps, F32)),
                      name="rstd")
    xhat = te.compute((rows, width), lambda i, j: d[i, j] * rstd[i], name="xhat")
    g = te.compute((rows, width), lambda i, j: dy[i, j] * gamma[j], name="g")
    g_sum = te.compute((rows,), lambda i: te.sum(g[i, ks[2]], axis=ks[2]), name="g_sum")
    gx = te.compute((rows, width), lambda i, j: g[i, j] * xhat[i, j], name="gx")
    gx_sum = te.compute((rows,), lambda i: te.sum(gx[i, ks[3]], axis=ks[3]), name="gx_sum")
    t1 = te.compute((rows, width), lambda i, j: g[i, j] - g_sum[i] * inv_w, name="t1")
    t2 = te.compute((rows, width), lambda i, j: xhat[i, j] * (gx_sum[i] * inv_w), name="t2")
    t3 = te.compute((rows, width), lambda i, j: t1[i, j] - t2[i, j], name="t3")
    dx = te.compute((rows, width), lambda i, j: t3[i, j] * rstd[i], name="dx")
    dyx = te.compute((rows, width), lambda i, j: dy[i, j] * xhat[i, j], name="dy_xhat")
    dgamma = te.compute((width,), lambda j: te.sum(dyx[r1, j], axis=r1), name="dgamma")
    dbeta = te.compute((width,), lambda j: te.sum(dy[r2, j], axis=r2), name="dbeta")
    return [dx, dgamma, dbeta]


def col_sum_te(dy: te.Tensor) -> te.Tensor:
    rows, width = (int(d) for d in dy.shape)
    r = te.reduce_axis((0, rows), "r")
    return te.compute((width,), lambda j: te.sum(dy[r, j], axis=r), name="col_sum")


def _check_2d(what: str, rows: int, width: int) -> None:
    if rows < 2 or width < 2:
        raise UnsupportedShapeError(f"{what}: a {rows} x {width} tensor has no TPP tile "
                                    "(needs >= 2 rows and columns)")


def unary_bwd_schedule(rows: int, width: int, op: str, isa: str) -> s_tir.Schedule:
    """dX = op(dY, S) on (rows, width): one unary-backward TPP per row block."""
    _check_2d(op, rows, width)
    mr = row_block(rows, width)
    dy = te.placeholder((rows, width), F32, name="dy")
    s = te.placeholder((rows, width), F32, name="s")
    sch = s_tir.Schedule(te.create_prim_func([dy, s, unary_bwd_te(dy, s, op)]))
    i, _ = sch.get_loops(sch.get_sblock(op))
    io, _ = sch.split(i, [None, mr])
    sch.parallel(io)
    tensorize_rows(sch, sch.get_sblock(op), TPPSpec(op, m=mr, n=width), isa, op)
    return sch


def softmax_bwd_schedule(rows: int, width: int, isa: str) -> s_tir.Schedule:
    """Softmax backward over the last axis as a row-block equation of TPPs."""
    _check_2d("softmax backward", rows, width)
    mr = row_block(rows, width)
    y = te.placeholder((rows, width), F32, name="y")
    dy = te.placeholder((rows, width), F32, name="dy")
    func = te.create_prim_func([y, dy, softmax_bwd_te(y, dy)])
    return schedule_row_stages(func, [
        ("dy_y", TPPSpec("mul", m=mr, n=width)),
        ("row_sum", TPPSpec("reduce_add_cols", m=mr, n=width)),
        ("diff", TPPSpec("sub", m=mr, n=width, bcast="col")),
        ("softmax_bwd", TPPSpec("mul", m=mr, n=width)),
    ], mr, isa)


def _col_sum_stage(sch: s_tir.Schedule, name: str, rows: int, width: int, isa: str) -> None:
    """Σ over rows of a (rows, width) operand: column panels in parallel, one
    reduce_add_rows TPP per panel."""
    block = sch.get_sblock(name)
    j, r = sch.get_loops(block)
    panel = COL_PANEL if width % COL_PANEL == 0 else width
    jo, ji = sch.split(j, [None, panel])
    sch.parallel(jo)
    if not try_tensorize(sch, ji, TPPSpec("reduce_add_rows", m=rows, n=panel), isa, name):
        sch.reorder(r, ji)
        sch.vectorize(ji)


def col_sum_schedule(rows: int, width: int, isa: str) -> s_tir.Schedule:
    """A bias gradient: the column sums of a (rows, width) tensor."""
    _check_2d("bias gradient", rows, width)
    dy = te.placeholder((rows, width), F32, name="dy")
    sch = s_tir.Schedule(te.create_prim_func([dy, col_sum_te(dy)]))
    _col_sum_stage(sch, "col_sum", rows, width, isa)
    return sch


def layer_norm_bwd_schedule(rows: int, width: int, eps: float, isa: str) -> s_tir.Schedule:
    """Layer-norm backward: a row-block equation for dX, then column sums for the
    parameter gradients (dY·x̂ is kept for them, not recomputed)."""
    _check_2d("layer norm backward", rows, width)
    mr = row_block(rows, width)
    x = te.placeholder((rows, width), F32, name="x")
    gamma = te.placeholder((width,), F32, name="gamma")
    dy = te.placeholder((rows, width), F32, name="dy")
    outs = layer_norm_bwd_te(x, gamma, dy, eps)
    sch = s_tir.Schedule(te.create_prim_func([x, gamma, dy, *outs]))
    # Statistics and x̂ are whole-tensor stages (x̂ and rstd are read by dX and dgamma
    # both), each a parallel loop of row-block TPPs; dX is one row-block equation.
    for name, spec in [("row_sum", TPPSpec("reduce_add_cols", m=mr, n=width)),
                       ("mean", None),
                       ("centered", TPPSpec("sub", m=mr, n=width, bcast="col")),
                       ("row_ssq", TPPSpec("reduce_sumsq_cols", m=mr, n=width)),
                       ("rstd", None),
                       ("xhat", TPPSpec("mul", m=mr, n=width, bcast="col")),
                       ("dy_xhat", TPPSpec("mul", m=mr, n=width))]:
        _row_stage(sch, [(name, spec)], mr, isa)
    _row_stage(sch, [("g", TPPSpec("mul", m=mr, n=width, bcast="row")),
                     ("g_sum", TPPSpec("reduce_add_cols", m=mr, n=width)),
                     ("gx", TPPSpec("mul", m=mr, n=width)),
                     ("gx_sum", TPPSpec("reduce_add_cols", m=mr, n=width)),
                     ("t1", None),
                     ("t2", None),
                     ("t3", TPPSpec("sub", m=mr, n=width)),
                     ("dx", TPPSpec("mul", m=mr, n=width, bcast="col"))], mr, isa)
    _col_sum_stage(sch, "dgamma", rows, width, isa)
    _col_sum_stage(sch, "dbeta", rows, width, isa)
    return sch


def _row_stage(sch: s_tir.Schedule, group: list[tuple[str, TPPSpec | None]], mr: int,
               isa: str) -> None:
    """Stages computed per block of ``mr`` rows under the last one's parallel row loop,
    each tensorized with its TPP (per-row scalars stay plain loops)."""
    i = sch.get_loops(sch.get_sblock(group[-1][0]))[0]
    io, _ = sch.split(i, [None, mr])
    sch.parallel(io)
    for name, _spec in reversed(group[:-1]):
        sch.compute_at(sch.get_sblock(name), io)
    for name, spec in group:
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        if spec is None or len(loops) < 2 or not try_tensorize(sch, loops[1], spec, isa, name):
            _vectorize_last(sch, block)


def _vectorize_last(sch: s_tir.Schedule, block) -> None:
    try:
        sch.vectorize(sch.get_loops(block)[-1])
    except Exception:  # noqa: BLE001 - a reduction or scalar stage: LLVM's choice
        pass


def backward_schedule(func: tirx.PrimFunc, isa: str) -> s_tir.Schedule:
    """The TPP schedule of a kernel tagged ``tpp.backward`` (its shapes from its params)."""
    op = str(func.attrs["tpp.backward"])
    rows, width = (int(d) for d in func.params[0].shape)
    if op in UNARY_BWD:
        return unary_bwd_schedule(rows, width, op, isa)
    if op == "softmax_bwd":
        return softmax_bwd_schedule(rows, width, isa)
    if op == "layer_norm_bwd":
        return layer_norm_bwd_schedule(rows, width, float(func.attrs["tpp.eps"]), isa)
    if op == "col_sum":
        return col_sum_schedule(rows, width, isa)
    raise UnsupportedShapeError(f"no TPP schedule for backward kernel {op!r}")
