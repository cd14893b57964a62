"""The register-blocked BRGEMM/GEMM microkernel, written once for every vector ISA.

C's tile (M x N) lives in ``ceil(N / lanes) * M`` vector accumulators for the whole
reduction; per k step the kernel loads one row of B as vectors and broadcasts one element
of A per row, then issues one FMA per accumulator (the LIBXSMM/oneDNN "A broadcast, B
packed" scheme). The batch-reduce loop walks A and B blocks by their batch strides, so C
is loaded and stored once per call however many blocks are reduced. A partial last vector
(N not a multiple of the lane count) uses the ISA's masked loads/stores, so any M, N, K is
exact and never touches memory outside the operands.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .spec import TPPSpec, operand_reads
from .vector_isa import VectorISA


def brgemm_impl(spec: TPPSpec, isa: VectorISA) -> tirx.PrimFunc:
    """Implementation of ``gemm``/``brgemm`` fp32 for ``isa`` (fused multiply-add form)."""
    M, N, K, R = spec.m, spec.n, spec.k, spec.batch
    dt = spec.dtype
    if dt != "float32":
        raise NotImplementedError(f"{isa.name} FMA BRGEMM template is fp32-only, got {dt}")
    lanes = isa.static_lanes(dt)
    vt = isa.vtype(dt)
    NV = -(-N // lanes)
    full = N // lanes  # vectors without a tail
    tail = N - full * lanes
    beta0 = spec.beta == 0
    batched = spec.op == "brgemm"
    a_shape = (R, M, K) if batched else (M, K)
    b_shape = (R, K, N) if batched else (K, N)
    a_strides = [T.int32(), T.int32(), 1] if batched else [T.int32(), 1]
    b_strides = [T.int32(), T.int32(), 1] if batched else [T.int32(), 1]

    def a_at(r, i, k):
        return (r, i, k) if batched else (i, k)

    def b_at(r, k, j):
        return (r, k, j) if batched else (k, j)

    def tail_mask():
        return isa.tail_mask(full * lanes, N, dt)

    def b_tail(B, r, k):
        return isa.masked_load(B[b_at(r, k, full * lanes)], tail_mask(), dt)

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
        A = T.match_buffer(a, a_shape, dt, offset_factor=1, strides=a_strides)
        B = T.match_buffer(b, b_shape, dt, offset_factor=1, strides=b_strides)
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
            for r in T.serial(R):
                for k in T.serial(K):
                    for i in T.unroll(M):
                        for v in T.unroll(full):
                            acc[i, v] = fma(A[a_at(r, i, k)],
                                            B[b_at(r, k, isa.ramp(v * lanes, dt))], acc[i, v])
                        if tail > 0:
                            acc[i, full] = fma(A[a_at(r, i, k)], b_tail(B, r, k), acc[i, full])
            for i in T.unroll(M):
                for v in T.unroll(full):
                    C[i, isa.ramp(v * lanes, dt)] = acc[i, v]
                if tail > 0:
                    T.evaluate(isa.masked_store(acc[i, full], C[i, full * lanes], tail_mask()))

    return impl
