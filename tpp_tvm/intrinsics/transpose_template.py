"""Layout TPPs, written once for every vector ISA: transpose and VNNI packing.

Transpose moves lanes x lanes blocks through registers (log2(lanes) block-swap shuffle
steps, masks at the edges); VNNI packing and thin or non-32-bit transposes are plain loops
that LLVM vectorises (vpermt2ps, vpunpck*). On a scalable ISA (SVE), where a vector has no
compile-time lanes to shuffle, transposes read columns by gathers and VNNI packing uses
the ISA's interleaving stores (``VectorISA`` hooks).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .geometry import transform_out_shape
from .spec import TPPSpec
from .vector_isa import VectorISA
from .vector_rows import MOVE_DTYPES, TRANSFORM_DTYPES, VectorRow, check_supported, matrix_buffer


def _swap_lanes(b: int, lanes: int, upper: bool) -> list[tirx.Expr]:
    """Shuffle indices (over two concatenated vectors) of one block-swap transpose step.

    Rows r and r+b of an ``lanes`` x ``lanes`` block exchange their off-diagonal b-wide lane
    groups: row r keeps its lanes without bit b and takes row r+b's lanes without bit b
    in place of its own with it; ``upper`` gives row r+b.
    """
    if upper:
        idx = [c + b if not c & b else lanes + c for c in range(lanes)]
    else:
        idx = [c if not c & b else lanes + c - b for c in range(lanes)]
    return [tirx.const(i, "int32") for i in idx]


def transpose_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Transpose: register blocks, gathers or a plain loop, whichever this ISA, dtype and
    tile do best."""
    check_supported(spec, isa, TRANSFORM_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    L = isa.lanes(dt)
    if isa.gather and dt in ("float32", "int32"):
        return _transpose_gather(spec, isa)
    if isa.scalable or dt not in ("float32", "int32") or L not in (2, 4, 8, 16):
        return _transpose_loop(spec)
    if M <= L // 2 or N < L // 2:
        # A thin tile pays a whole block's shuffles for few elements; LLVM's vectorised
        # loop is faster there (measured on Zen 5: 8x37 25 vs 62 ns, 64x5 35 vs 80 ns;
        # 16x64: 267 vs 78 ns).
        return _transpose_loop(spec)
    return _transpose_registers(spec, isa)


def _transpose_block(isa: VectorISA, dt: str):
    """The macro transposing one block of X at (i0, j0), rows x cols of at most L x L:
    into registers (missing rows as zeros), log2(L) block-swap steps, out as cols rows of
    Y; masked loads and stores at the edges."""
    L = isa.lanes(dt)
    zero = isa.broadcast(tirx.const(0, dt), dt)
    final_in_a = (L.bit_length() - 1) % 2 == 0  # stages alternate between buffers A and B

    def mask(count):
        return isa.tail_mask(0, count, dt)

    def load_row(X, i, j0, cols):
        if cols == L:
            return X[i, isa.ramp(j0, dt)]
        return isa.masked_load(X[i, j0], mask(cols), dt)

    @T.macro
    def stage(src, dst, b):
        # Pair p is rows (r, r + b) with bit b of r clear.
        for p in T.unroll(L // 2):
            dst[p // b * 2 * b + p % b] = T.Shuffle(
                [src[p // b * 2 * b + p % b], src[p // b * 2 * b + p % b + b]],
                _swap_lanes(b, L, False))
            dst[p // b * 2 * b + p % b + b] = T.Shuffle(
                [src[p // b * 2 * b + p % b], src[p // b * 2 * b + p % b + b]],
                _swap_lanes(b, L, True))

    @T.macro
    def store_rows(Y, regs, i0, j0, rows, cols):
        for c in T.unroll(cols):
            if rows == L:
                Y[j0 + c, isa.ramp(i0, dt)] = regs[c]
            else:
                T.evaluate(isa.masked_store(regs[c], Y[j0 + c, i0], mask(rows)))

    @T.macro
    def block(X, Y, A, B, i0, j0, rows, cols):
        for r in T.unroll(rows):
            A[r] = load_row(X, i0 + r, j0, cols)
        for r in T.unroll(rows, L):
            A[r] = zero
        stage(A, B, L // 2)
        if L >= 4:
            stage(B, A, L // 4)
        if L >= 8:
            stage(A, B, L // 8)
        if L >= 16:
            stage(B, A, L // 16)
        if final_in_a:
            store_rows(Y, A, i0, j0, rows, cols)
        else:
            store_rows(Y, B, i0, j0, rows, cols)

    return block


def _transpose_registers(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Transpose in L x L register blocks; partial blocks at the bottom/right edges use
    masks."""
    M, N, dt = spec.m, spec.n, spec.dtype
    L = isa.lanes(dt)
    vt = isa.vtype(dt)
    MB, MT, NB, NT = M // L, M % L, N // L, N % L
    block = _transpose_block(isa, dt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        Y = T.match_buffer(y, (N, M), **matrix_buffer(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:N, 0:M])
            A = T.alloc_buffer((L,), vt, scope="local")
            B = T.alloc_buffer((L,), vt, scope="local")
            for bi in T.serial(MB):
                for bj in T.serial(NB):
                    block(X, Y, A, B, bi * L, bj * L, L, L)
                if NT > 0:
                    block(X, Y, A, B, bi * L, NB * L, L, NT)
            if MT > 0:
                for bj in T.serial(NB):
                    block(X, Y, A, B, MB * L, bj * L, MT, L)
                if NT > 0:
                    block(X, Y, A, B, MB * L, NB * L, MT, NT)

    return impl


def _transpose_gather(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Transpose by gathers: each vector of a row of Y is read down a column of X.

    For ISAs whose lane count is unknown at compile time (SVE), where the register-blocked
    shuffle transpose cannot be written; stores stay contiguous and tails predicated.
    """
    M, N, dt = spec.m, spec.n, spec.dtype
    row = VectorRow(isa, dt, M)  # a row of Y runs down the M rows of X

    def column(X, j, start, mask):
        ld = X.strides[0]
        index = T.ramp(start * ld, ld, row.lanes)
        return isa.gather_load(X[0, j], index, mask, dt)

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        Y = T.match_buffer(y, (N, M), **matrix_buffer(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:N, 0:M])
            for j in T.serial(N):
                for v in T.serial(row.full):
                    Y[j, row.at(v)] = column(X, j, v * row.lanes, isa.all_lanes(dt))
                if row.tail:
                    T.evaluate(row.store_tail(column(X, j, row.tail_start, row.mask()),
                                              Y[j, row.tail_start]))

    return impl


def _transpose_loop(spec: TPPSpec) -> tirx.PrimFunc:
    """Element-by-element transpose, for dtypes/ISAs without the register-blocked one."""
    M, N, dt = spec.m, spec.n, spec.dtype

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        Y = T.match_buffer(y, (N, M), **matrix_buffer(dt))
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:N, 0:M])
            for j in T.serial(N):
                for i in T.serial(M):
                    Y[j, i] = X[i, j]

    return impl


def vnni_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """VNNI packing: interleaving stores where the ISA has them, else a plain loop."""
    check_supported(spec, isa, TRANSFORM_DTYPES)
    M, N, dt = spec.m, spec.n, spec.dtype
    KO, _, V = transform_out_shape(spec)
    if V in isa.interleaved_store and dt in MOVE_DTYPES:
        return _vnni_interleaved(spec, isa)
    full, rem = M // V, M % V
    zero = tirx.const(0, dt)

    # VNNI: V consecutive rows interleave into one row of Y; the missing rows of the last
    # block are zeros.
    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        Y = T.match_buffer(y, (KO, N, V), dt, offset_factor=1, strides=[T.int32(), V, 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:KO, 0:N, 0:V])
            for ko in T.serial(full):
                for j in T.serial(N):
                    for v in T.unroll(V):
                        Y[ko, j, v] = X[ko * V + v, j]
            if rem > 0:
                for j in T.serial(N):
                    for v in T.unroll(rem):
                        Y[full, j, v] = X[full * V + v, j]
                    for v in T.unroll(rem, V):
                        Y[full, j, v] = zero

    return impl


def _vnni_interleaved(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """VNNI packing as interleaving stores: V rows of X in registers, one structured store
    (SVE ``st2w``/``st4w``) writes them element-interleaved; missing rows are zeros."""
    M, N, dt = spec.m, spec.n, spec.dtype
    KO, _, V = transform_out_shape(spec)
    full, rem = M // V, M % V
    row = VectorRow(isa, dt, N)
    zero = row.splat(tirx.const(0, dt))

    def rows(X, ko, rows_present, v, tail):
        if tail:
            return [row.load_tail(X[ko * V + r, row.tail_start]) if r < rows_present else zero
                    for r in range(V)]
        return [X[ko * V + r, row.at(v)] if r < rows_present else zero for r in range(V)]

    @T.macro
    def block(X, Y, ko, rows_present):
        for v in T.serial(row.full):
            T.evaluate(isa.store_interleaved(rows(X, ko, rows_present, v, False),
                                             Y[ko, v * row.lanes, 0], isa.all_lanes(dt)))
        if row.tail:
            T.evaluate(isa.store_interleaved(rows(X, ko, rows_present, 0, True),
                                             Y[ko, row.tail_start, 0], row.mask()))

    @T.prim_func(s_tir=True)
    def impl(x: T.handle, y: T.handle):
        X = T.match_buffer(x, (M, N), **matrix_buffer(dt))
        Y = T.match_buffer(y, (KO, N, V), dt, offset_factor=1, strides=[T.int32(), V, 1])
        with T.sblock("root"):
            T.reads(X[0:M, 0:N])
            T.writes(Y[0:KO, 0:N, 0:V])
            for ko in T.serial(full):
                block(X, Y, ko, V)
            if rem > 0:
                block(X, Y, full, rem)

    return impl
