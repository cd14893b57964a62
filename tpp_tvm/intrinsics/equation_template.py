"""The equation TPP, written once for every vector ISA: a chain of element-wise steps (a
GEMM or convolution epilogue: bias, activation, gate, residual, scale, ...) applied to each
vector of a tile in registers, then one store.

Rows split as every template's do (full vectors, one masked tail); on a fixed-width ISA
full vectors are grouped where a step is a long chain, and a small tile prefetches the
rows of its tile operands below it (the next tile's residual).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .geometry import equation_operand_dtypes, equation_operand_shapes, whole
from .spec import MAX_EQUATION_STEPS, OPERAND_STEPS, TPPSpec, equation_operands
from .vector_isa import VectorISA
from .vector_math import LONG_CHAINS, concat_lanes, slice_lanes, statement_slots, vector_fn
from .vector_rows import COMPUTE_DTYPES, VectorRow, check_supported, matrix_buffer

#: Bytes of a cache line (what one prefetch fetches).
CACHE_LINE = 64
#: Full vectors an equation (a GEMM epilogue) computes at once on a fixed-width ISA.
EQUATION_GROUP = 4
#: Values one step of an equation binds to statements (``vector_math.statement_slots``).
BOUND_SLOTS = 8
#: Equation operands that are whole tiles (M, N), not rows.
TILE_OPERANDS = tuple(s for s, op in OPERAND_STEPS.items() if not op.row)
#: Tiles of at most this many rows prefetch the residual rows below them (see equation_impl).
RESIDUAL_PREFETCH_ROWS = 64


class _EquationTile:
    """What an equation's implementation computes with: the row split, the step slots,
    each operand step's operand (index, dtype), and how full vectors are grouped.

    On a fixed-width ISA the running value holds :data:`EQUATION_GROUP` full vectors of the
    tile as one wide vector (any rows) where a step is a long chain (``LONG_CHAINS``): an
    erf-GELU is ~55 dependent instructions a vector, and interleaving four chains took a
    GEMM's GELU epilogue from 2.6 to 1.8 cycles an element (gelu_tanh 1.6 -> 1.2, Zen 5).
    Bias, residual and clips gain nothing from groups and pay the group's index arithmetic
    (MobileNetV2 1.2% slower), so they run a vector at a time."""

    def __init__(self, spec: TPPSpec, isa: VectorISA) -> None:
        M, N, dt, steps = spec.m, spec.n, spec.dtype, spec.steps
        self.spec, self.steps = spec, steps
        self.row = row = VectorRow(isa, dt, N)
        self.vt = isa.vtype(dt)
        self.wide = self.vt if isa.scalable else f"{dt}x{row.lanes * EQUATION_GROUP}"
        self.kinds = equation_operands(steps)
        self.shapes = equation_operand_shapes(spec)
        self.pdt = equation_operand_dtypes(spec)
        self.slots = list(steps) + [None] * (MAX_EQUATION_STEPS - len(steps))
        self.operand_of = {}  # slot -> index into the operand list
        for slot, step in enumerate(steps):
            if step in OPERAND_STEPS:
                self.operand_of[slot] = len(self.operand_of)
        # (rows narrower than one vector have only their masked tails: nothing to group)
        self.group = 1 if isa.scalable or not LONG_CHAINS.intersection(steps) \
            or row.full == 0 else EQUATION_GROUP
        self.total = M * row.full
        self.groups = 0 if self.group == 1 else self.total // self.group
        # The next tile's residual (or gate) rows (the tile below: the next one when B
        # panels are outer) are prefetched into L1 while this one's epilogue and the next
        # microkernel run.
        residuals = [self.operand_of[slot] for slot, st in enumerate(steps)
                     if st in TILE_OPERANDS]
        self.prefetched = residuals if M <= RESIDUAL_PREFETCH_ROWS else []

    def gathered(self, load_at, pos):
        vecs = [load_at(i, v) for i, v in pos]
        return vecs[0] if len(vecs) == 1 else concat_lanes(vecs)

    def operand(self, ops, slot, pos, tail):
        """Operand step ``slot``'s operand at the vectors ``pos`` (or the row's tail)."""
        row = self.row
        P = ops[self.operand_of[slot]]
        bias = OPERAND_STEPS[self.steps[slot]].row
        if tail:  # a quantized tile's tail: as many u8/s8 lanes as the fp32 vector has
            ((i, _),) = pos
            return row.load_tail(P[row.tail_start] if bias else P[i, row.tail_start],
                                 self.pdt[self.operand_of[slot]])
        if bias:
            return self.gathered(lambda i, v: P[row.at(v)], pos)
        return self.gathered(lambda i, v: P[i, row.at(v)], pos)

    def apply(self, slot, value, ops, pos, tail, bound):
        """Step slot ``slot`` on ``value`` (unused slots leave it)."""
        step = self.slots[slot]
        if step is None:
            return value
        if step in OPERAND_STEPS:
            x = self.operand(ops, slot, pos, tail)
            return value * x if OPERAND_STEPS[step].multiplies else value + x
        with statement_slots(bound):
            return vector_fn(step)(value)

    def flat(self, f):
        """Full vector ``f`` of the tile, row-major: (row, vector in the row)."""
        return (f // self.row.full, f % self.row.full)

    def group_at(self, g):
        return [self.flat(g * self.group + u) for u in range(self.group)]

    def part(self, t, u):
        return slice_lanes(t[0], u * self.row.lanes, self.row.lanes)

    def per_line(self, k):
        """Elements of prefetched operand ``k`` in a cache line."""
        return CACHE_LINE * 8 // tvm.DataType(self.pdt[self.prefetched[k]]).bits

    def prefetch_below(self, ops, k, i, ln):
        P = ops[self.prefetched[k]]
        return T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                  T.address_of(P[i + self.spec.m, ln * self.per_line(k)]),
                                  T.int32(0), T.int32(3), T.int32(1))  # read, L1, data


def _equation_rows(eq: _EquationTile):
    """The macro computing the whole tile: prefetches of the next tile's operands, the
    grouped (or single) full vectors, then each row's masked tail."""
    M, N = eq.spec.m, eq.spec.n
    row, group, groups, total, prefetched = eq.row, eq.group, eq.groups, eq.total, eq.prefetched
    apply, gathered, flat, group_at, part = eq.apply, eq.gathered, eq.flat, eq.group_at, eq.part
    per_line, prefetch_below = eq.per_line, eq.prefetch_below

    # One statement per step slot (MAX_EQUATION_STEPS of them; unused slots are no-ops).
    @T.macro
    def steps_at(t, ops, pos, tail, bound):
        t[0] = apply(0, t[0], ops, pos, tail, bound)
        t[0] = apply(1, t[0], ops, pos, tail, bound)
        t[0] = apply(2, t[0], ops, pos, tail, bound)
        t[0] = apply(3, t[0], ops, pos, tail, bound)

    assert EQUATION_GROUP == 4, "store_group writes four vectors"

    @T.macro
    def store_group(Y, t, pos):
        Y[pos[0][0], row.at(pos[0][1])] = part(t, 0)
        Y[pos[1][0], row.at(pos[1][1])] = part(t, 1)
        Y[pos[2][0], row.at(pos[2][1])] = part(t, 2)
        Y[pos[3][0], row.at(pos[3][1])] = part(t, 3)

    @T.macro
    def prefetch(ops, k):
        for i in T.serial(M):
            for ln in T.serial(-(-N // per_line(k))):
                T.evaluate(prefetch_below(ops, k, i, ln))

    @T.macro
    def rows(X, Y, ops, t, tg, bound):
        if len(prefetched) > 0:  # an equation has at most two operands
            prefetch(ops, 0)
        if len(prefetched) > 1:
            prefetch(ops, 1)
        if group > 1:
            for g in T.serial(groups):
                tg[0] = gathered(lambda i, v: X[i, row.at(v)], group_at(g))
                steps_at(tg, ops, group_at(g), False, bound)
                store_group(Y, tg, group_at(g))
            for f in T.serial(groups * group, total):
                t[0] = X[f // row.full, row.at(f % row.full)]
                steps_at(t, ops, [flat(f)], False, bound)
                Y[f // row.full, row.at(f % row.full)] = t[0]
        else:
            for i in T.serial(M):
                for v in T.serial(row.full):
                    t[0] = X[i, row.at(v)]
                    steps_at(t, ops, [(i, v)], False, bound)
                    Y[i, row.at(v)] = t[0]
        if row.tail:
            for i in T.serial(M):
                t[0] = row.load_tail(X[i, row.tail_start])
                steps_at(t, ops, [(i, 0)], True, bound)
                T.evaluate(row.store_tail(t[0], Y[i, row.tail_start]))

    return rows


def equation_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Equation: each vector of X goes through every step in registers, then one store.

    The running value lives in a local buffer so each step's math (which may repeat its
    argument, e.g. gelu) reads a register, not a re-expanded expression; on a fixed-width
    ISA it holds a group of full vectors where the steps are long chains
    (:class:`_EquationTile`). Values a step would copy per zmm are bound to ``bound``
    (``statement_slots``). One PrimFunc per operand count (0, 1 or 2)."""
    check_supported(spec, isa, COMPUTE_DTYPES)
    eq = _EquationTile(spec, isa)
    rows = _equation_rows(eq)
    M, N, dt = spec.m, spec.n, spec.dtype
    vt, wide, shapes, pdt = eq.vt, eq.wide, eq.shapes, eq.pdt

    def strides(shape):
        return [1] if len(shape) == 1 else [T.int32(), 1]

    if not eq.kinds:

        @T.prim_func(s_tir=True)
        def impl(x: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
            Y = T.match_buffer(y, (M, N), **matrix_buffer(dt))
            with T.sblock("root"):
                T.reads(X[0:M, 0:N])
                T.writes(Y[0:M, 0:N])
                t = T.alloc_buffer((1,), vt, scope="local")
                tg = T.alloc_buffer((1,), wide, scope="local")
                bound = T.alloc_buffer((BOUND_SLOTS,), wide, scope="local")
                rows(X, Y, [], t, tg, bound)

        return impl
    if len(eq.kinds) == 1:

        @T.prim_func(s_tir=True)
        def impl(x: T.handle, p: T.handle, y: T.handle):
            X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
            P = T.match_buffer(p, shapes[0], pdt[0], offset_factor=1,
                               strides=strides(shapes[0]))
            Y = T.match_buffer(y, (M, N), **matrix_buffer(dt))
            with T.sblock("root"):
                T.reads(whole(X), whole(P))
                T.writes(Y[0:M, 0:N])
                t = T.alloc_buffer((1,), vt, scope="local")
                tg = T.alloc_buffer((1,), wide, scope="local")
                bound = T.alloc_buffer((BOUND_SLOTS,), wide, scope="local")
                rows(X, Y, [P], t, tg, bound)

        return impl

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, p: T.handle, q: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        P = T.match_buffer(p, shapes[0], pdt[0], offset_factor=1, strides=strides(shapes[0]))
        Q = T.match_buffer(q, shapes[1], pdt[1], offset_factor=1, strides=strides(shapes[1]))
        Y = T.match_buffer(y, (M, N), **matrix_buffer(dt))
        with T.sblock("root"):
            T.reads(whole(X), whole(P), whole(Q))
            T.writes(Y[0:M, 0:N])
            t = T.alloc_buffer((1,), vt, scope="local")
            tg = T.alloc_buffer((1,), wide, scope="local")
            bound = T.alloc_buffer((BOUND_SLOTS,), wide, scope="local")
            rows(X, Y, [P, Q], t, tg, bound)

    return impl
