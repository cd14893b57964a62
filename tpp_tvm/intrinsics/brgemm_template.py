"""The register-blocked BRGEMM/GEMM microkernel, written once for every vector ISA.

C's tile (M x N) lives in ``ceil(N / lanes) * M`` vector accumulators for the whole
reduction; per k step the kernel loads one row of B as vectors and broadcasts one element
of A per row, then issues one FMA per accumulator (the LIBXSMM/oneDNN "A broadcast, B
packed" scheme). The batch-reduce loop walks A and B blocks by their batch strides, so C
is loaded and stored once per call however many blocks are reduced. A partial last vector
(N not a multiple of the lane count) uses the ISA's masked loads/stores, so any M, N, K is
exact and never touches memory outside the operands.

Low-precision contractions (bf16, u8 x s8) keep the same scheme with the FMA replaced by
the ISA's dot product (``VectorISA.dot_brgemm``): per step, one 32-bit group of A (``vnni``
elements of a row) is broadcast and meets ``lanes`` columns of a VNNI-packed row of B; the
reduction walks K in groups. That microkernel is LLVM IR imported into the kernel (see
``llvm_ir.py``), because TIR cannot type its operands.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as TB

from ..errors import UnsupportedDTypeError
from .geometry import contraction_geometry, free_strides, operand_reads
from .llvm_ir import module_text
from .spec import TPPSpec
from .vector_isa import VectorISA


def _loop_vars(ivs) -> tuple:
    """Loop vars of a ``T.grid`` as a tuple, whether it has one extent or several."""
    return (ivs,) if isinstance(ivs, tirx.Var) else tuple(ivs)


def column_panel(n: int, m: int, isa: VectorISA, dtype: str) -> tuple[int, int]:
    """(unmasked, masked) vectors of one column panel of the C tile.

    Fixed-width ISAs hold the whole row of C in one panel: ``N // lanes`` plain vectors and
    one masked tail vector if ``N`` is not a multiple of ``lanes``. A scalable ISA does not
    know the lane count until run time, so every vector is predicated and the panel is as
    wide as the register file allows at the minimum vector length (``m`` accumulators per
    vector, plus one register for the B vector and one for the broadcast A element);
    panels then repeat until ``N`` is covered.
    """
    lanes = isa.static_lanes(dtype)
    if not isa.scalable:
        return n // lanes, int(n % lanes != 0)
    fit = max(1, (isa.num_vregs - 1) // (m + 1))
    return 0, min(fit, -(-n // lanes))


def brgemm_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Implementation of ``gemm``/``brgemm``/``conv_brgemm`` for ``isa``: FMA form for fp32,
    dot-product form for VNNI-packed low precision."""
    dt = spec.dtype
    if spec.vnni > 1:
        return dot_brgemm_impl(spec, isa)
    if dt != "float32":
        raise UnsupportedDTypeError(f"{isa.name} FMA BRGEMM template is fp32-only, got {dt}")
    if not isa.scalable:
        return _fixed_width_impl(spec, isa)
    return _scalable_impl(spec, isa)


class _Panels:
    """How a scalable FMA BRGEMM reads and writes its operands: column panels of ``NV``
    vectors (``plain`` whole ones, then ``masked`` predicated ones), as many panels as the
    run-time vector length needs to cover N."""

    def __init__(self, spec: TPPSpec, isa: VectorISA) -> None:
        M, N, dt = spec.m, spec.n, spec.dtype
        self.spec, self.isa, self.dt = spec, isa, dt
        self.geo = contraction_geometry(spec)
        self.lanes = isa.lanes(dt)  # an int, or a vscale expression on a scalable ISA
        self.vt = isa.vtype(dt)
        self.plain, self.masked = column_panel(N, M, isa, dt)
        self.NV = self.plain + self.masked  # vectors per panel
        # Fixed width: one panel (the loop vanishes); scalable: as many as the run-time VL
        # needs.
        self.panels = 1 if not isa.scalable else tirx.floordiv(N + self.NV * self.lanes - 1,
                                                                self.NV * self.lanes)
        self.beta0 = spec.beta == 0

    def col(self, p, v):
        return (p * self.NV + v) * self.lanes

    def mask(self, p, v):
        return self.isa.tail_mask(self.col(p, v), self.spec.n, self.dt)

    def a_el(self, A, ivs, i):
        lv = _loop_vars(ivs)
        return A[self.geo.a_index(lv[:-1], i, lv[-1])]

    def b_vec(self, B, ivs, p, v):
        lv = _loop_vars(ivs)
        return B[self.geo.b_index(lv[:-1], lv[-1], self.isa.ramp(self.col(p, v), self.dt))]

    def b_masked(self, B, ivs, p, v):
        lv = _loop_vars(ivs)
        return self.isa.masked_load(B[self.geo.b_index(lv[:-1], lv[-1], self.col(p, v))],
                                    self.mask(p, v), self.dt)

    def zero(self):
        return self.isa.broadcast(tirx.const(0, self.dt), self.dt)

    def c_init(self, C, i, p, v):
        return self.zero() if self.beta0 else C[i, self.isa.ramp(self.col(p, v), self.dt)]

    def c_init_masked(self, C, i, p, v):
        if self.beta0:
            return self.zero()
        return self.isa.masked_load(C[i, self.col(p, v)], self.mask(p, v), self.dt)

    def fma(self, a, b, c):
        return T.call_llvm_pure_intrin(self.vt, "llvm.fma", self.isa.broadcast(a, self.dt), b,
                                       c)


def _scalable_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """fp32 FMA BRGEMM for a scalable ISA (SVE): predicated column panels sized for the
    minimum vector length, one register per accumulator."""
    M, N, K = spec.m, spec.n, spec.k
    dt = spec.dtype
    pn = _Panels(spec, isa)
    geo, vt, plain, NV, panels, beta0 = pn.geo, pn.vt, pn.plain, pn.NV, pn.panels, pn.beta0
    reduction = (*geo.batch, K)
    col, mask, a_el, b_vec, b_masked = pn.col, pn.mask, pn.a_el, pn.b_vec, pn.b_masked
    c_init, c_init_masked, fma = pn.c_init, pn.c_init_masked, pn.fma

    # Built with the IR builder rather than parsed TVMScript so that each accumulator is its
    # own one-vector buffer: LLVM keeps those in registers, while an (M, NV) array of
    # scalable vectors stays in memory (SROA cannot split it).
    with IRBuilder() as ib:
        with TB.prim_func(s_tir=True):
            TB.func_name("impl")
            A = TB.match_buffer(TB.arg("a", TB.handle()), geo.a_shape, dt, offset_factor=1,
                               strides=free_strides(len(geo.a_shape)))
            B = TB.match_buffer(TB.arg("b", TB.handle()), geo.b_shape, dt, offset_factor=1,
                               strides=free_strides(len(geo.b_shape)))
            C = TB.match_buffer(TB.arg("c", TB.handle()), (M, N), dt, offset_factor=1,
                               strides=[TB.int32(), 1])
            for name, buf in (("A", A), ("B", B), ("C", C)):
                IRBuilder.name(name, buf)
            with TB.sblock("root"):
                TB.reads(*operand_reads(beta0, C, A, B))
                TB.writes(C[0:M, 0:N])
                acc = [[IRBuilder.name(f"acc_{i}_{v}", TB.alloc_local((1,), vt))
                        for v in range(NV)] for i in range(M)]
                with TB.serial(panels) as p:
                    IRBuilder.name("panel", p)
                    for i in range(M):
                        for v in range(NV):
                            init = c_init(C, i, p, v) if v < plain else c_init_masked(C, i, p, v)
                            TB.buffer_store(acc[i][v], init, [0])
                    with TB.grid(*reduction) as ivs:
                        for i in range(M):
                            for v in range(NV):
                                bv = b_vec(B, ivs, p, v) if v < plain else b_masked(B, ivs, p, v)
                                TB.buffer_store(acc[i][v], fma(a_el(A, ivs, i), bv, acc[i][v][0]),
                                               [0])
                    for i in range(M):
                        for v in range(NV):
                            if v < plain:
                                TB.buffer_store(C, acc[i][v][0], [i, isa.ramp(col(p, v), dt)])
                            else:
                                TB.evaluate(isa.masked_store(acc[i][v][0], C[i, col(p, v)],
                                                            mask(p, v)))
    return ib.get()


def _fixed_width_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """fp32 FMA BRGEMM for a fixed-width ISA: C's row in one panel (whole vectors and one
    masked tail), accumulators as one local (M, NV) array. Parsed TVMScript: the IR-builder
    form below ran the same hot loop but 20-25% slower in whole GEMMs on AVX-512 (measured
    512^3: 194 vs 250 GFLOP/s), cause not found yet."""
    M, N, K = spec.m, spec.n, spec.k
    dt = spec.dtype
    geo = contraction_geometry(spec)
    lanes = isa.static_lanes(dt)
    vt = isa.vtype(dt)
    NV = -(-N // lanes)
    full = N // lanes  # vectors without a tail
    tail = N - full * lanes
    beta0 = spec.beta == 0
    reduction = (*geo.batch, K)

    def a_el(A, ivs, i):
        lv = _loop_vars(ivs)
        return A[geo.a_index(lv[:-1], i, lv[-1])]

    def b_vec(B, ivs, v):
        lv = _loop_vars(ivs)
        return B[geo.b_index(lv[:-1], lv[-1], isa.ramp(v * lanes, dt))]

    def b_tail(B, ivs):
        lv = _loop_vars(ivs)
        return isa.masked_load(B[geo.b_index(lv[:-1], lv[-1], full * lanes)], tail_mask(), dt)

    def tail_mask():
        return isa.tail_mask(full * lanes, N, dt)

    def c_init(C, i, v):
        return isa.broadcast(tirx.const(0, dt), dt) if beta0 else C[i, isa.ramp(v * lanes, dt)]

    def c_init_tail(C, i):
        if beta0:
            return isa.broadcast(tirx.const(0, dt), dt)
        return isa.masked_load(C[i, full * lanes], tail_mask(), dt)

    def fma(a, b, c):
        return T.call_llvm_pure_intrin(vt, "llvm.fma", isa.broadcast(a, dt), b, c)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, geo.a_shape, dt, offset_factor=1,
                           strides=free_strides(len(geo.a_shape)))
        B = T.match_buffer(b, geo.b_shape, dt, offset_factor=1,
                           strides=free_strides(len(geo.b_shape)))
        C = T.match_buffer(c, (M, N), dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(*operand_reads(beta0, C, A, B))
            T.writes(C[0:M, 0:N])
            acc = T.alloc_buffer((M, NV), vt, scope="local")
            for i in T.unroll(M):
                for v in T.unroll(full):
                    acc[i, v] = c_init(C, i, v)
                if tail > 0:
                    acc[i, full] = c_init_tail(C, i)
            for ivs in T.grid(*reduction):
                for i in T.unroll(M):
                    for v in T.unroll(full):
                        acc[i, v] = fma(a_el(A, ivs, i), b_vec(B, ivs, v), acc[i, v])
                    if tail > 0:
                        acc[i, full] = fma(a_el(A, ivs, i), b_tail(B, ivs), acc[i, full])
            for i in T.unroll(M):
                for v in T.unroll(full):
                    C[i, isa.ramp(v * lanes, dt)] = acc[i, v]
                if tail > 0:
                    T.evaluate(isa.masked_store(acc[i, full], C[i, full * lanes], tail_mask()))

    return impl




def dot_brgemm_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Low-precision GEMM/BRGEMM: one call of the ISA's dot-product microkernel (LLVM IR)
    with the operands' addresses and strides."""
    M, N, dt, acc_dt = spec.m, spec.n, spec.dtype, spec.acc_dtype
    bdt = spec.b_dtype or dt
    if isa.dot_brgemm is None or isa.scalable:
        raise UnsupportedDTypeError(
            f"TPP {spec.op} {dt} x {bdt}: {isa.name} has no dot-product kernel in this package")
    geo = contraction_geometry(spec)
    conv = spec.op == "conv_brgemm"
    batched = spec.op == "brgemm" or (conv and spec.batch > 1)
    kernel = isa.dot_brgemm(dt, bdt, M, N, spec.k // spec.vnni, spec.batch if batched else 1,
                            spec.beta)
    ir_text = module_text(kernel)
    beta0 = spec.beta == 0

    def strides(A, B, C):
        """lda, A's batch stride, B's k-group stride, B's batch stride, ldc. A convolution's
        rows are output pixels ``stride`` elements apart in one flattened input row; its
        batch is the filter rows (input rows)."""
        if conv:
            return (spec.stride, A.strides[0] if batched else 0, B.strides[-3],
                    B.strides[0] if batched else 0, C.strides[0])
        if batched:
            return A.strides[1], A.strides[0], B.strides[1], B.strides[0], C.strides[0]
        return A.strides[0], 0, B.strides[0], 0, C.strides[0]

    def first(buf):
        # address_of, not access_ptr: bf16 legalisation rejects access_ptr on bf16 buffers
        return T.address_of(buf[(0,) * len(buf.shape)])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, geo.a_shape, dt, offset_factor=1,
                           strides=free_strides(len(geo.a_shape)))
        B = T.match_buffer(b, geo.b_shape, bdt, offset_factor=1,
                           strides=geo.b_buffer_strides())
        C = T.match_buffer(c, (M, N), acc_dt, offset_factor=1, strides=[T.int32(), 1])
        with T.sblock("root"):
            T.reads(*operand_reads(beta0, C, A, B))
            T.writes(C[0:M, 0:N])
            with T.attr(0, "pragma_import_llvm", ir_text):
                T.evaluate(T.call_extern("void", kernel.name, first(A), first(B), first(C),
                                         *strides(A, B, C)))

    return impl
