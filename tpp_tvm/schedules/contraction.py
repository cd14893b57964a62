"""Recognise matmul-like blocks in any PrimFunc by their iteration variables and accesses.

A block ``C[..] += A[..] * B[..]`` is a contraction whatever produced it (``R.matmul``,
a batched matmul, a stride-1 NHWC convolution, a user's TE expression): every block
iterator plays one role, read off the buffers it indexes —

* **batch**: spatial, indexes A, B and C;
* **M**: spatial, indexes A and C (not B); **N**: spatial, indexes B and C (not A);
* **K**: reduction, indexes A and B.

The BRGEMM TPP maps the *innermost* iterator of each role — C's second-to-last index (M),
C's and B's last index (N), A's last index (K) — so its tiles are 2D sub-blocks with unit
stride in the fast dimension; all other iterators become loops around the TPP call. Blocks
that do not fit (a strided window, casts on the operands, an operand read twice) are not
contractions here and keep TVM's default treatment.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import Schedule
from tvm.s_tir.schedule import SBlockRV
from tvm.tirx.analysis import undefined_vars

#: ``IterVar.iter_type`` values (``tvm.tirx.IterVar`` enum).
_SPATIAL, _REDUCE = 0, 2


@dataclass(frozen=True)
class ContractionRoles:
    """Loop positions (indices into the block's loops) of each role, and the TPP's three."""

    batch: tuple[int, ...]
    m: tuple[int, ...]
    n: tuple[int, ...]
    k: tuple[int, ...]
    inner_m: int
    inner_n: int
    inner_k: int
    extents: tuple[int, ...]
    dtype: str


def _vars_in(expr: tirx.Expr) -> set:
    return set(undefined_vars(expr))


def _product_operands(value: tirx.Expr, out: tirx.Buffer):
    """(A load, B load) when ``value`` is ``C[...] + A[...] * B[...]``, else None."""
    if not isinstance(value, tirx.Add):
        return None
    for acc, prod in ((value.a, value.b), (value.b, value.a)):
        if (isinstance(acc, TensorLoad) and acc.source.same_as(out)
                and isinstance(prod, tirx.Mul)
                and isinstance(prod.a, TensorLoad) and isinstance(prod.b, TensorLoad)):
            return prod.a, prod.b
    return None


def product_loads(store: tirx.BufferStore) -> tuple[TensorLoad, TensorLoad] | None:
    """(A load, B load) of a contraction's update ``C[...] = C[...] + A[...] * B[...]``."""
    return _product_operands(store.value, store.buffer)


def contraction_roles(sch: Schedule, block: SBlockRV) -> ContractionRoles | None:
    """The roles of ``block``'s loops if it is a contraction a BRGEMM TPP can serve."""
    blk = sch.get(block)
    store = blk.body
    if not isinstance(store, tirx.BufferStore) or len(blk.writes) != 1:
        return None
    operands = _product_operands(store.value, store.buffer)
    if operands is None:
        return None
    a, b = operands
    dtype = store.buffer.dtype
    if not (a.source.dtype == b.source.dtype == dtype == "float32"):
        return None  # low-precision contractions: not on this path yet
    loops = sch.get_loops(block)
    ivs = list(blk.iter_vars)
    if len(loops) != len(ivs):
        return None
    extents = []
    for lp, iv in zip(loops, ivs):
        ext = sch.get(lp).extent
        if not isinstance(ext, tirx.IntImm) or int(ext) != int(iv.dom.extent):
            return None
        extents.append(int(ext))
    in_a = set().union(*(_vars_in(i) for i in a.indices))
    in_b = set().union(*(_vars_in(i) for i in b.indices))
    in_c = set().union(*(_vars_in(i) for i in store.indices))
    roles: dict[str, list[int]] = {"batch": [], "m": [], "n": [], "k": []}
    for pos, iv in enumerate(ivs):
        v, spatial = iv.var, int(iv.iter_type) == _SPATIAL
        if int(iv.iter_type) not in (_SPATIAL, _REDUCE):
            return None
        where = (v in in_a, v in in_b, v in in_c)
        role = {(True, True, True): "batch", (True, False, True): "m",
                (False, True, True): "n"}.get(where) if spatial else (
            "k" if where == (True, True, False) else None)
        if role is None:
            if extents[pos] == 1:
                roles["batch"].append(pos)
                continue
            return None
        roles[role].append(pos)
    if not (roles["m"] and roles["n"] and roles["k"]):
        return None
    pos_of = {iv.var: pos for pos, iv in enumerate(ivs)}

    def plain(index: tirx.Expr, role: str) -> int | None:
        pos = pos_of.get(index) if isinstance(index, tirx.Var) else None
        return pos if pos in roles[role] else None

    inner_n = plain(store.indices[-1], "n")
    inner_k = plain(a.indices[-1], "k")
    inner_m = plain(store.indices[-2], "m") if len(store.indices) >= 2 else None
    if None in (inner_m, inner_n, inner_k) or plain(b.indices[-1], "n") != inner_n:
        return None
    return ContractionRoles(tuple(roles["batch"]), tuple(roles["m"]), tuple(roles["n"]),
                            tuple(roles["k"]), inner_m, inner_n, inner_k, tuple(extents),
                            str(dtype))
