"""Reverse-mode differentiation of TE computations (TVM 0.27 ships no ``te.gradient``).

The class handled is what custom operators are made of: one output ``Y[o] = f(loads)`` or
``Y[o] = Σ_r f(loads)``, where ``f`` is built from + - * /, max/min, select, casts and the
unary math calls below, and every input is read with plain loop variables (``X[i, k]``,
``W[k, j]``, a bias ``b[j]``: a permutation/subset of the output and reduction axes).
Intermediate element-wise ``te.compute`` stages are inlined first. Then, per input X read as
``X[v_1..v_d]``:

    dX[v_1..v_d] = Σ_{all other axes} dY[o] · ∂f/∂X[v_1..v_d]

which is again a TE computation (an element-wise map, or a contraction when axes are summed),
so the derived gradient is scheduled like any other kernel. Anything outside the class raises
:class:`UnsupportedOperatorError` naming the construct.
"""

from __future__ import annotations

import math

from tvm import te, tirx
from tvm.ir import Call

from ..errors import UnsupportedOperatorError

F32 = "float32"


def _is_load(e) -> bool:
    return isinstance(e, Call) and getattr(e.op, "name", "") == "te.tensor_load"


def _c(value: float, dtype: str = F32) -> tirx.Expr:
    return tirx.const(value, dtype)


def substitute(e, pairs: list):
    """``e`` with each variable of ``pairs`` ((var, expr), matched by identity) replaced
    (this TVM exposes no substitution to Python)."""
    if isinstance(e, tirx.Var):
        return next((x for v, x in pairs if v.same_as(e)), e)
    if _is_load(e):
        return e.args[0](*[substitute(i, pairs) for i in e.args[1:]])
    return _map(e, lambda x: substitute(x, pairs), "substitute")


def _inline(e, name: str):
    """``e`` with loads of element-wise compute stages replaced by their bodies."""
    def rec(x):
        return _inline(x, name)

    if _is_load(e):
        tensor, idx = e.args[0], list(e.args[1:])
        op = tensor.op
        if not isinstance(op, te.ComputeOp):  # an operand (te or Relax placeholder)
            return tensor(*[rec(i) for i in idx])
        body = op.body[tensor.value_index]
        if isinstance(body, tirx.Reduce):
            raise UnsupportedOperatorError(
                f"custom op {name}: stage {op.name} is a reduction feeding another stage; "
                "only the output stage may reduce")
        return rec(substitute(body, [(ax.var, rec(i)) for ax, i in zip(op.axis, idx)]))
    return _map(e, rec, name)


_BINARY = ("Add", "Sub", "Mul", "Div", "Max", "Min", "EQ", "NE", "LT", "LE", "GT", "GE",
           "And", "Or", "FloorDiv")


def _map(e, fn, name: str):
    """Rebuild ``e`` with ``fn`` applied to its direct sub-expressions."""
    if isinstance(e, tirx.FloatImm | tirx.IntImm | tirx.Var):
        return e
    for cls in _BINARY:
        if isinstance(e, getattr(tirx, cls)):
            return getattr(tirx, cls)(fn(e.a), fn(e.b))
    if isinstance(e, tirx.Cast):
        return tirx.Cast(e.dtype, fn(e.value))
    if isinstance(e, tirx.Not):
        return tirx.Not(fn(e.a))
    if isinstance(e, tirx.Select):
        return tirx.Select(fn(e.condition), fn(e.true_value), fn(e.false_value))
    if isinstance(e, Call):
        return tirx.call_intrin(str(e.ty.dtype), e.op.name, *[fn(a) for a in e.args])
    raise UnsupportedOperatorError(f"custom op {name}: expression {type(e).__name__} is not "
                                   "differentiable here")


def _loads_of(e, tensor, out: list) -> None:
    """Index tuples of every load of ``tensor`` in ``e``."""
    if _is_load(e):
        if e.args[0].same_as(tensor):
            out.append(list(e.args[1:]))
        for a in e.args[1:]:
            _loads_of(a, tensor, out)
        return
    for attr in ("a", "b", "value", "condition", "true_value", "false_value"):
        if hasattr(e, attr) and not isinstance(e, tirx.Var):
            _loads_of(getattr(e, attr), tensor, out)
    if isinstance(e, Call):
        for a in e.args:
            _loads_of(a, tensor, out)


def _unary_derivative(op: str, a, name: str):
    """d op(a) / da."""
    if op == "tirx.exp":
        return tirx.exp(a)
    if op == "tirx.log":
        return _c(1.0) / a
    if op == "tirx.tanh":
        t = tirx.tanh(a)
        return _c(1.0) - t * t
    if op == "tirx.sigmoid":
        s = tirx.sigmoid(a)
        return s * (_c(1.0) - s)
    if op == "tirx.sqrt":
        return _c(0.5) / tirx.sqrt(a)
    if op == "tirx.rsqrt":
        r = tirx.rsqrt(a)
        return _c(-0.5) * r * r * r
    if op == "tirx.erf":
        return _c(2.0 / math.sqrt(math.pi)) * tirx.exp(-(a * a))
    if op == "tirx.fabs":
        return tirx.Select(a >= _c(0.0), _c(1.0), _c(-1.0))
    raise UnsupportedOperatorError(f"custom op {name}: no derivative for {op}")


def derivative(e, tensor, name: str):
    """∂e/∂tensor[idx] for the single index tuple ``tensor`` is read with (None: zero)."""
    def d(x):
        return derivative(x, tensor, name)

    if _is_load(e):
        return _c(1.0) if e.args[0].same_as(tensor) else None
    if isinstance(e, tirx.FloatImm | tirx.IntImm | tirx.Var):
        return None
    if isinstance(e, tirx.Add | tirx.Sub):
        da, db = d(e.a), d(e.b)
        if db is not None and isinstance(e, tirx.Sub):
            db = -db
        return db if da is None else da if db is None else da + db
    if isinstance(e, tirx.Mul):
        da, db = d(e.a), d(e.b)
        terms = [t for t in (da * e.b if da is not None else None,
                             e.a * db if db is not None else None) if t is not None]
        return None if not terms else terms[0] if len(terms) == 1 else terms[0] + terms[1]
    if isinstance(e, tirx.Div):
        da, db = d(e.a), d(e.b)
        out = da / e.b if da is not None else None
        if db is not None:
            term = e.a * db / (e.b * e.b)
            out = -term if out is None else out - term
        return out
    if isinstance(e, tirx.Max | tirx.Min):
        da, db = d(e.a), d(e.b)
        if da is None and db is None:
            return None
        pick_a = e.a >= e.b if isinstance(e, tirx.Max) else e.a <= e.b
        return tirx.Select(pick_a, da if da is not None else _c(0.0),
                           db if db is not None else _c(0.0))
    if isinstance(e, tirx.Select):
        dt, df = d(e.true_value), d(e.false_value)
        if dt is None and df is None:
            return None
        return tirx.Select(e.condition, dt if dt is not None else _c(0.0),
                           df if df is not None else _c(0.0))
    if isinstance(e, tirx.Cast):
        dv = d(e.value)
        return None if dv is None else tirx.Cast(e.dtype, dv)
    if isinstance(e, Call) and len(e.args) == 1:
        da = d(e.args[0])
        if da is None:
            return None
        return _unary_derivative(e.op.name, e.args[0], name) * da
    raise UnsupportedOperatorError(f"custom op {name}: cannot differentiate "
                                   f"{type(e).__name__} ({e})")


def gradient(output: te.Tensor, inputs: list[te.Tensor], dy: te.Tensor, name: str
             ) -> list[te.Tensor]:
    """dL/dX for every X in ``inputs``, given dL/dY = ``dy`` for ``output`` = Y."""
    op = output.op
    if not isinstance(op, te.ComputeOp) or len(op.body) != 1:
        raise UnsupportedOperatorError(f"custom op {name}: the output must be one te.compute")
    body = op.body[0]
    axes = [(ax.var, int(ax.dom.extent)) for ax in op.axis]
    if isinstance(body, tirx.Reduce):
        if str(body.combiner.result[0]) != str(body.combiner.lhs[0] + body.combiner.rhs[0]):
            raise UnsupportedOperatorError(f"custom op {name}: only te.sum reductions")
        axes += [(ax.var, int(ax.dom.extent)) for ax in body.axis]
        f = body.source[0]
    else:
        f = body
    f = _inline(f, name)
    out_vars = [v for v, _ in axes[: len(op.axis)]]
    grads = []
    for x in inputs:
        loads: list = []
        _loads_of(f, x, loads)
        grads.append(_input_gradient(f, x, loads, axes, out_vars, dy, name))
    return grads


def _input_gradient(f, x: te.Tensor, loads: list, axes: list, out_vars: list,
                    dy: te.Tensor, name: str) -> te.Tensor:
    shape = [int(s) for s in x.shape]
    if not loads:
        return te.compute(shape, lambda *_: _c(0.0, x.dtype), name=f"d_{x.op.name}")
    idx = loads[0]
    if any(len(i) != len(idx) or any(not a.same_as(b) for a, b in zip(i, idx)) for i in loads):
        raise UnsupportedOperatorError(
            f"custom op {name}: input {x.op.name} is read at different indices; the gradient "
            "needs one access pattern per input")
    if not all(isinstance(i, tirx.Var) and any(i.same_as(v) for v, _ in axes) for i in idx):
        raise UnsupportedOperatorError(
            f"custom op {name}: input {x.op.name} is read at {list(idx)}; indices must be "
            "plain output or reduction axes")
    if any(a.same_as(b) for n, a in enumerate(idx) for b in idx[n + 1:]):
        raise UnsupportedOperatorError(f"custom op {name}: input {x.op.name} repeats an axis")
    df = derivative(f, x, name)
    summed = [(v, e) for v, e in axes if not any(v.same_as(i) for i in idx)]

    def compute(*xi):
        raxes = [te.reduce_axis((0, e), f"r_{v.name}") for v, e in summed]
        pairs = list(zip(idx, xi)) + [(v, r.var) for (v, _), r in zip(summed, raxes)]

        def at(var):  # tirx.Var == builds an expression: look up by identity
            return next(e for v, e in pairs if v.same_as(var))

        term = dy(*[at(v) for v in out_vars]) * substitute(df, pairs)
        return te.sum(term, axis=raxes) if raxes else term

    return te.compute(shape, compute, name=f"d_{x.op.name}")


def _factors(e, out: list) -> bool:
    """Flatten a product into its factors; False if ``e`` is not a pure product."""
    if isinstance(e, tirx.Mul):
        return _factors(e.a, out) and _factors(e.b, out)
    if _is_load(e) or isinstance(e, tirx.FloatImm):
        out.append(e)
        return True
    return False


def contraction_of(tensor: te.Tensor, inputs: list[te.Tensor]) -> dict | None:
    """``tensor`` as a (batched) GEMM of two of ``inputs``, or None.

    Matches ``Y[b?, p, q] = Σ_k c · U[..] · V[..]`` where each operand is read with plain
    axes: the one holding ``p`` is A, the one holding ``q`` is B, each either way round
    (``a_t``/``b_t``: stored transposed), batch (if any) leading in all three. Returns the
    GEMM's shape, operand positions in ``inputs``, transposes and the constant ``scale``.
    """
    op = tensor.op
    if not isinstance(op, te.ComputeOp) or not isinstance(op.body[0], tirx.Reduce):
        return None
    body = op.body[0]
    if len(body.axis) != 1 or len(op.axis) not in (2, 3):
        return None
    factors: list = []
    try:
        src = _inline(body.source[0], "contraction")
    except UnsupportedOperatorError:
        return None
    if not _factors(src, factors):
        return None
    loads = [f for f in factors if _is_load(f)]
    scale = 1.0
    for f in factors:
        if isinstance(f, tirx.FloatImm):
            scale *= float(f.value)
    if len(loads) != 2 or not all(all(isinstance(i, tirx.Var) for i in ld.args[1:])
                                  for ld in loads):
        return None
    out_vars = [ax.var for ax in op.axis]
    kvar = body.axis[0].var
    batched = len(out_vars) == 3
    p, q = out_vars[-2], out_vars[-1]

    def holds(ld, var):
        return any(i.same_as(var) for i in ld.args[1:])

    a = next((ld for ld in loads if holds(ld, p) and not holds(ld, q)), None)
    b = next((ld for ld in loads if holds(ld, q) and not holds(ld, p)), None)
    if a is None or b is None or a is b:
        return None
    layouts = []
    for ld, own in ((a, p), (b, q)):
        idx = list(ld.args[1:])
        lead = idx[:-2]
        if batched and (len(lead) != 1 or not lead[0].same_as(out_vars[0])):
            return None
        if not batched and lead:
            return None
        pair = idx[-2:]
        if pair[0].same_as(own) and pair[1].same_as(kvar):
            layouts.append("own_k")
        elif pair[0].same_as(kvar) and pair[1].same_as(own):
            layouts.append("k_own")
        else:
            return None
    positions = []
    for ld in (a, b):
        pos = next((i for i, x in enumerate(inputs) if ld.args[0].same_as(x)), None)
        if pos is None:
            return None
        positions.append(pos)
    shape = [int(d) for d in tensor.shape]
    return {"a": positions[0], "b": positions[1], "batch": shape[0] if batched else 0,
            "m": shape[-2], "n": shape[-1], "k": int(body.axis[0].dom.extent),
            "a_t": layouts[0] == "k_own", "b_t": layouts[1] == "own_k", "scale": scale}
