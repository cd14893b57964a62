"""BRGEMM microkernel throughput with operands in L1 (the LIBXSMM-class number).

One kernel call loops ``reps`` times over the same register tile: C (mr x nr) = sum of
``batch`` blocks A (mr x k) @ B (k x nr), all resident in L1, so the measurement is the
microkernel's own flop rate, free of memory effects. Run: ``python benchmarks/microkernel.py``.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import tvm
from tvm import s_tir, te

from tpp_tvm.intrinsics import TPPSpec, intrinsic
from tpp_tvm.schedules.gemm_plan import core_table, register_tile_isa
from tpp_tvm.target import isa_of
from tpp_tvm.target import target as tpp_target
from tpp_tvm.tir_pipeline import compile_kernels


def measure_microkernel(mr: int = 6, nr: int = 64, k: int = 64, batch: int = 2,
                        reps: int = 2000) -> dict:
    """GFLOP/s of the brgemm TPP (beta 1) with A, B, C in L1."""
    A = te.placeholder((batch, mr, k), "float32", name="A")
    B = te.placeholder((batch, k, nr), "float32", name="B")
    r = te.reduce_axis((0, batch), "r")
    kk = te.reduce_axis((0, k), "k")
    C = te.compute(
        (reps, mr, nr),
        lambda t, i, j: te.sum(A[r, i, kk] * B[r, kk, j], axis=[r, kk]),
        name="C",
    )
    sch = s_tir.Schedule(te.create_prim_func([A, B, C]))
    blk = sch.get_sblock("C")
    t, i, _, _, _ = sch.get_loops(blk)
    tgt = tpp_target(num_cores=1)
    isa = register_tile_isa(isa_of(tgt))
    name = intrinsic(TPPSpec("brgemm", m=mr, n=nr, k=k, batch=batch, beta=0), isa)
    sch.tensorize(i, name)
    # All reps write the same C tile region in memory order: keep it in L1 by making the
    # output small relative to the work (reps tiles of mr*nr*4 bytes each stream through).
    mod = compile_kernels(sch.mod, tgt).jit()
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    a = tvm.runtime.tensor(rng.standard_normal((batch, mr, k), dtype="float32"), dev)
    b = tvm.runtime.tensor(rng.standard_normal((batch, k, nr), dtype="float32"), dev)
    c = tvm.runtime.tensor(np.zeros((reps, mr, nr), "float32"), dev)
    ev = mod.time_evaluator("main", dev, number=5, repeat=9)
    sec = float(np.median(ev(a, b, c).results))
    flops = 2.0 * reps * batch * mr * nr * k
    return {"impl": "tpp_microkernel", "isa": isa, "mr": mr, "nr": nr, "k": k, "batch": batch,
            "gflops": flops / sec / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiles", default=None,
                   help="comma-separated MRxNR (default: the host ISA's register tiles)")
    args = p.parse_args()
    if args.tiles:
        tiles = [tuple(int(x) for x in tile.split("x")) for tile in args.tiles.split(",")]
    else:  # the GEMM planner's table for this host's vector unit, its first seven
        tiles = list(core_table(register_tile_isa(isa_of(tpp_target()))).tile_efficiency)[:7]
    for mr, nr in tiles:
        print(json.dumps(measure_microkernel(mr, nr)))


if __name__ == "__main__":
    main()
