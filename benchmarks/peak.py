"""Measured compute peak of this machine, the denominator of every "% of peak" we report.

A vendor's nominal peak is useless on a shared, frequency-scaled (and possibly virtualised)
CPU, so we measure it: a C loop of independent AVX-512 chains (inline asm, so the compiler
cannot fold or reorder them), compiled with gcc and run on 1..N pthreads pinned to distinct
CPUs. 16 accumulators cover FMA latency (4-5 cycles) times two FMA ports with room to spare.

The instruction is a parameter (:data:`INSTRUCTIONS`): fp32 FMA, the bf16 (``vdpbf16ps``)
and int8 (``vpdpbusd``) dot products, and on AMX CPUs the tile products ``tdpbf16ps`` and
``tdpbusd``. The tile loop (its own C template) configures 8 tiles, loads two A and two B
tiles of random data once and then issues 4 independent tile products per step with no
loads, the unit's ceiling. Random data, not zeros: on the AMX Xeon this was written on,
zero tiles ran 4.5x faster than random ones (2830 vs 630 GFLOP/s bf16 with loads), a
data-dependent throughput (power) no real GEMM sees. The ``_l1`` and ``_l2`` tile loops
add what a GEMM step cannot avoid: before its four products, the step loads its two A and
two B tiles (4 KiB), the same ones every step (L1-resident) or the next 4 KiB of a 1 MiB
buffer (L2-resident, not L1). They bound what a 2 x 2-tile GEMM kernel can reach: tile
registers are not renamed, so a load waits for the products still reading the tile it
overwrites, and its latency is not hidden behind them (AMX Xeon, 1 thread: no loads 3300
GFLOP/s bf16, from L1 about 2600, from L2 about 1900)::

    python benchmarks/peak.py                   # fp32 FMA, 1 and 2 threads
    python benchmarks/peak.py --instr bf16_dp   # vdpbf16ps
    python benchmarks/peak.py --instr amx_bf16  # tdpbf16ps tiles (AMX hosts)
    python benchmarks/peak.py --instr amx_bf16_l2  # the same with each step's tile loads

The memory side has its own measurement: ``--stream read`` (a vector sum, AVX-512 or AVX2,
over a buffer several times the L3, each thread its own slice) is the bandwidth a
memory-bound kernel such as a decoder's matrix-vector products can reach when streaming
weights; ``--stream triad`` is STREAM's ``a = b + s c`` (bytes counted as STREAM does:
two reads and one write)::

    python benchmarks/peak.py --stream read --threads 1,2
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class PeakInstruction:
    """One vector instruction to saturate: ``mnemonic src1, src2, acc`` (AT&T order), on
    zmm (AVX-512) or ymm (``vector_bits`` 256: AVX2) registers."""

    mnemonic: str
    flops: int
    """Floating-point (or integer) operations one instruction performs (on a zmm register,
    or on 16 x 16 accumulator tiles for a tile product)."""
    unit: str = "GFLOP/s"
    tile: bool = False
    """An AMX tile product (``tdp*``): the tile loop, not the zmm chains."""
    vector_bits: int = 512
    tile_buffer: int = 0
    """Bytes each step of the tile loop loads its four operand tiles from, 4 KiB a step
    round the buffer (0: no loads, the tiles loaded once before the loop)."""


INSTRUCTIONS: dict[str, PeakInstruction] = {
    # 16 fp32 lanes x (mul + add)
    "fp32_fma": PeakInstruction("vfmadd231ps", 16 * 2),
    # 8 fp32 lanes x (mul + add), on the 16 ymm registers of an AVX2 CPU
    "fp32_fma_avx2": PeakInstruction("vfmadd231ps", 8 * 2, vector_bits=256),
    # 16 fp32 lanes x 2 bf16 pairs x (mul + add)
    "bf16_dp": PeakInstruction("vdpbf16ps", 16 * 2 * 2),
    # 16 int32 lanes x 4 u8*s8 products x (mul + add)
    "int8_dp": PeakInstruction("vpdpbusd", 16 * 4 * 2, unit="GOP/s"),
    # 16 x 16 fp32 accumulators x 32 bf16 products x (mul + add)
    "amx_bf16": PeakInstruction("tdpbf16ps", 16 * 16 * 32 * 2, tile=True),
    # 16 x 16 int32 accumulators x 64 u8*s8 products x (mul + add)
    "amx_int8": PeakInstruction("tdpbusd", 16 * 16 * 64 * 2, unit="GOP/s", tile=True),
}
#: Bytes of the tile loops' operand buffers: one step's four tiles (L1), and a buffer in the
#: L2 of every AMX core but larger than its L1 (48 KiB).
TILE_STEP_BYTES = 4 * 16 * 64
TILE_L2_BUFFER = 1024 * 1024
for _name, _bytes in (("l1", TILE_STEP_BYTES), ("l2", TILE_L2_BUFFER)):
    for _dtype in ("bf16", "int8"):
        INSTRUCTIONS[f"amx_{_dtype}_{_name}"] = replace(INSTRUCTIONS[f"amx_{_dtype}"],
                                                       tile_buffer=_bytes)
#: Independent tile products per step of the tile loop (C tiles 0-3, A tiles 4-5, B 6-7).
TILE_PRODUCTS = 4

ACCUMULATORS = 16
#: On AVX2's 16 ymm registers: 12 chains still cover two FMA pipes' latency, 2 operands.
YMM_ACCUMULATORS = 12
UNROLL = 4  # bodies of ACCUMULATORS instructions per loop trip, to hide the loop branch

#: The C harness every measurement shares: ``threads`` pthreads pinned to distinct CPUs, each
#: running the source's ``measure(id)`` (seconds); prints the slowest thread's time. ``size``
#: is the loop's trip count (peak loops) or each thread's floats (streams).
_C_TEMPLATE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static pthread_barrier_t barrier;
static long size;
static double seconds[256];
static int cpus[256];

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

KERNEL

static void *worker(void *arg) {
  long id = (long)arg;
  if (cpus[id] >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[id], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  seconds[id] = measure(id);
  return NULL;
}

int main(int argc, char **argv) {
  int threads = atoi(argv[1]);
  size = atol(argv[2]);
  for (int i = 0; i < threads; ++i) cpus[i] = argc > 3 + i ? atoi(argv[3 + i]) : -1;
  MAIN_SETUP
  pthread_t tid[256];
  pthread_barrier_init(&barrier, NULL, threads);
  for (long i = 0; i < threads; ++i) pthread_create(&tid[i], NULL, worker, (void *)i);
  double slowest = 0;
  for (int i = 0; i < threads; ++i) {
    pthread_join(tid[i], NULL);
    if (seconds[i] > slowest) slowest = seconds[i];
  }
  printf("%.9f\n", slowest);
  return 0;
}
"""

#: ``measure`` for the peak loops: warm up (wake the core and its vector unit), then time.
_TIMED_LOOP = r"""
static double measure(long id) {
  SETUP_THREAD
  kernel(size / 8 + 1);
  pthread_barrier_wait(&barrier);
  double t0 = now();
  kernel(size);
  return now() - t0;
}
"""

_VECTOR_KERNEL = r"""
static void kernel(long n) {
  __asm__ volatile(ZERO_ACCS "1:\n\t" BODY
                   "dec %0\n\t"
                   "jnz 1b\n\t"
                   : "+r"(n)
                   :
                   : CLOBBERS "cc");
}
"""


_TILE_KERNEL = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static unsigned char tile_config[64] __attribute__((aligned(64)));
static unsigned char tile_data[TILE_BUFFER] __attribute__((aligned(64)));
static float tile_out[16 * 16] __attribute__((aligned(64)));
static const unsigned char *volatile tile_sink;

static void setup_tiles(void) {
  syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
  tile_config[0] = 1;  /* palette 1: 8 tiles of 16 rows x 64 bytes */
  for (int t = 0; t < 8; ++t) { tile_config[16 + 2 * t] = 64; tile_config[48 + t] = 16; }
  _tile_loadconfig(tile_config);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, tile_data, 64); _tile_loadd(5, tile_data + 1024, 64);
  _tile_loadd(6, tile_data + 2048, 64); _tile_loadd(7, tile_data + 3072, 64);
}

static void kernel(long n) {
  const unsigned char *p = tile_data;
  for (long i = 0; i < n; ++i) {
    TILE_BODY
  }
  _tile_stored(0, tile_out, 64);
  tile_sink = p;
}

static void fill_tiles(void) {  /* a fixed LCG; bf16 exponents kept small (finite) */
  unsigned x = 12345;
  for (long i = 0; i < TILE_BUFFER; ++i) {
    x = x * 1103515245u + 12345u;
    tile_data[i] = (unsigned char)(x >> 16);
    if (i % 2) tile_data[i] &= 0x3f;
  }
}
"""


def _chains(instr: PeakInstruction) -> int:
    """Independent instructions per loop body (tile products, or accumulator chains)."""
    if instr.tile:
        return TILE_PRODUCTS
    return ACCUMULATORS if instr.vector_bits == 512 else YMM_ACCUMULATORS


def _c_source(instr: PeakInstruction) -> str:
    if instr.tile:
        return _tile_source(instr)
    reg = "zmm" if instr.vector_bits == 512 else "ymm"
    count = _chains(instr)
    accs = [f"{reg}{i}" for i in range(count)]
    ops = [f"{reg}30", f"{reg}31"] if reg == "zmm" else ["ymm14", "ymm15"]
    body = "".join(
        f'"{instr.mnemonic} %%{ops[0]}, %%{ops[1]}, %%{acc}\\n\\t"\n'
        for _ in range(UNROLL)
        for acc in accs
    )
    xor = "vpxord" if reg == "zmm" else "vpxor"
    zero = "".join(f'"{xor} %%{a}, %%{a}, %%{a}\\n\\t"' for a in accs + ops)
    clobbers = "".join(f'"{a}", ' for a in accs + ops)
    return (
        f"#define ZERO_ACCS {zero}\n#define BODY {body.replace(chr(10), ' ')}\n"
        f"#define CLOBBERS {clobbers}\n#define SETUP_THREAD\n#define MAIN_SETUP\n"
        + _C_TEMPLATE.replace("KERNEL\n", _VECTOR_KERNEL + _TIMED_LOOP)
    )


def _tile_source(instr: PeakInstruction) -> str:
    """The tile loop: per step, C tile (2i + j) += A tile (4 + i) x B tile (6 + j). The
    operand tiles hold random bytes (a fixed LCG, bf16 values kept finite) loaded once per
    thread, before the timed loop."""
    builtin = {"tdpbf16ps": "_tile_dpbf16ps", "tdpbusd": "_tile_dpbusd"}[instr.mnemonic]
    step = " ".join(f"{builtin}({2 * i + j}, {4 + i}, {6 + j});"
                    for i in range(2) for j in range(2))
    buffer = instr.tile_buffer or TILE_STEP_BYTES
    if instr.tile_buffer:
        # the step's A tiles (4, 5) and B tiles (6, 7): 1 KiB each, then the next 4 KiB
        loads = " ".join(f"_tile_loadd({4 + t}, p + {1024 * t}, 64);" for t in range(4))
        wrap = f"p = p + {TILE_STEP_BYTES} == tile_data + {buffer} ? tile_data : p + " \
            f"{TILE_STEP_BYTES};"
        step = f"{loads} {step} {wrap}"
    body = " ".join(step for _ in range(UNROLL))
    return (f"#define TILE_BUFFER {buffer}\n#define TILE_BODY {body}\n"
            "#define SETUP_THREAD setup_tiles();\n"
            "#define MAIN_SETUP fill_tiles();\n"
            + _C_TEMPLATE.replace("KERNEL\n", _TILE_KERNEL + _TIMED_LOOP))


#: gcc flags for code that must run on a CPU without AVX-512 (the harness included).
AVX2_FLAGS = ["-mno-avx512f", "-mavx2", "-mfma"]


@functools.cache
def _binary(name: str) -> Path:
    """Compile the peak loop for ``name`` once per source text (cached in the temp dir)."""
    instr = INSTRUCTIONS[name]
    isa_flags = ["-mamx-tile", "-mamx-bf16", "-mamx-int8"] if instr.tile else []
    if instr.vector_bits == 256:  # the harness itself must run on a CPU without AVX-512
        isa_flags = AVX2_FLAGS
    return _compiled(f"peak_{name}", _c_source(instr), isa_flags)


def _compiled(stem: str, source: str, flags: list[str]) -> Path:
    """``source`` compiled with gcc (AVX-512 unless ``flags`` say otherwise, pthreads) once
    per text and flags, in the temp dir."""
    digest = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / "tpp_tvm_peak"
    cache.mkdir(exist_ok=True)
    exe = cache / f"{stem}_{digest}"
    if not exe.exists():
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "cc"
        src = cache / f"{stem}_{digest}.c"
        src.write_text(source)
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cc, "-O2", "-pthread", "-mavx512f", *flags, str(src), "-o", str(tmp)],
                       check=True, capture_output=True)
        tmp.replace(exe)
    return exe


#: Memory-stream kernels: name -> (C loop over one thread's slice, bytes counted per float),
#: written on the vector macros of :func:`_stream_vectors` (V, L lanes, VLOAD, VADD, ...).
STREAMS: dict[str, tuple[str, int]] = {
    "read": ("""
  /* four streams through the slice at once (one stream leaves the prefetchers idle) */
  V acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = VSETZERO();
  long q = n / 4 / (2 * L) * (2 * L);
  for (long i = 0; i < q; i += 2 * L)
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] = VADD(acc[2 * j], VLOAD(b + j * q + i));
      acc[2 * j + 1] = VADD(acc[2 * j + 1], VLOAD(b + j * q + i + L));
    }
  for (int j = 1; j < 8; ++j) acc[0] = VADD(acc[0], acc[j]);
  float lanes[L];
  VSTOREU(lanes, acc[0]);
  float sum = 0.0f;
  for (int j = 0; j < L; ++j) sum += lanes[j];
  sink[id * 16] = sum;
""", 4),
    "triad": ("""
  V s = VSET1(3.0f);
  for (long i = 0; i < n; i += L)
    VSTREAM(a + i, VFMADD(s, VLOAD(c + i), VLOAD(b + i)));
""", 12),
}

#: The stream kernels' vector operations, ``_mm{bits}_{op}_ps`` at either width.
STREAM_OPS = ("setzero", "load", "add", "storeu", "set1", "stream", "fmadd")


def _stream_vectors(bits: int) -> tuple[list[str], str]:
    """(gcc flags, ``#define``s) of :data:`STREAMS`' vector macros on ``bits``-wide registers:
    zmm where the CPU has AVX-512, ymm (AVX2 + FMA) elsewhere."""
    defines = [f"#define V __m{bits}", f"#define L {bits // 32}"]
    defines += [f"#define V{op.upper()} _mm{bits}_{op}_ps" for op in STREAM_OPS]
    return ([] if bits == 512 else AVX2_FLAGS), "".join(d + "\n" for d in defines)


#: ``measure`` for the streams: each thread touches its own buffers first (so they sit in its
#: memory), streams once to warm up, then keeps the best of ``REPEATS`` synchronized passes.
_STREAM_KERNEL = r"""
#include <immintrin.h>

static volatile float sink[256 * 16];  /* read by nobody: keeps the sums alive */

static void kernel(long id, float *a, float *b, float *c, long n) {
STREAM_BODY
}

static double measure(long id) {
  long n = size;
  float *a = aligned_alloc(64, n * 4), *b = aligned_alloc(64, n * 4), *c = aligned_alloc(64, n * 4);
  for (long i = 0; i < n; ++i) { a[i] = 0.0f; b[i] = 1.0f; c[i] = 2.0f; }
  kernel(id, a, b, c, n);
  pthread_barrier_wait(&barrier);
  double best = 1e30;
  for (int r = 0; r < REPEATS; ++r) {
    pthread_barrier_wait(&barrier);
    double t0 = now();
    kernel(id, a, b, c, n);
    double t = now() - t0;
    pthread_barrier_wait(&barrier);
    if (t < best) best = t;
  }
  free(a); free(b); free(c);
  return best;
}
"""


def measure_bandwidth(kind: str = "read", threads: int = 1, megabytes: int | None = None,
                      repeats: int = 5) -> float:
    """Memory bandwidth in GB/s of the ``STREAMS[kind]`` loop on ``threads`` threads: each
    thread streams its own buffers of ``megabytes`` (default: 4x the L3 over all threads,
    at least 256 MiB, so the data comes from memory); the best of ``repeats`` passes."""
    if kind not in STREAMS:
        raise ValueError(f"unknown stream {kind!r}; known: {', '.join(STREAMS)}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    from tpp_tvm.target import host_isa

    body, bytes_per_float = STREAMS[kind]
    l3 = host_isa().l3_bytes or 32 << 20
    total = (megabytes << 20) if megabytes else max(4 * l3, 256 << 20)
    floats = total // 4 // threads // 128 * 128
    flags, defines = _stream_vectors(512 if _has_flag("avx512f") else 256)
    source = (f"#define MAIN_SETUP\n#define REPEATS {int(repeats)}\n{defines}"
              + _C_TEMPLATE.replace("KERNEL\n", _STREAM_KERNEL.replace("STREAM_BODY", body)))
    seconds = _run(_compiled(f"stream_{kind}", source, flags), threads, floats)
    return threads * floats * bytes_per_float / seconds / 1e9


def _run(exe: Path, threads: int, size: int) -> float:
    cpus = sorted(os.sched_getaffinity(0))
    pin = [str(cpus[i]) for i in range(threads)] if threads <= len(cpus) else []
    out = subprocess.run(
        [str(exe), str(threads), str(size), *pin], check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip())


def measure_peak(name: str = "fp32_fma", threads: int = 1, seconds: float = 0.15) -> float:
    """Peak throughput of ``INSTRUCTIONS[name]`` on ``threads`` threads, in G(FL)OP/s.

    Calibrates the loop to about ``seconds`` per run, then takes the best of three runs (the
    best, not the median: a peak is what the hardware can do, and noise only subtracts).
    """
    if name not in INSTRUCTIONS:
        raise ValueError(f"unknown peak instruction {name!r}; known: {', '.join(INSTRUCTIONS)}")
    if name == "fp32_fma" and not _has_flag("avx512f"):
        name = "fp32_fma_avx2"  # the host's fp32 peak: ymm FMAs on a CPU without AVX-512
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    instr = INSTRUCTIONS[name]
    if instr.tile and not _has_amx():
        raise RuntimeError(f"{name}: this CPU has no AMX (amx_tile in /proc/cpuinfo)")
    exe = _binary(name)
    per_trip = _chains(instr) * UNROLL * instr.flops
    iters = 200_000
    elapsed = _run(exe, threads, iters)
    iters = max(iters, int(iters * seconds / max(elapsed, 1e-6)))
    best = min(_run(exe, threads, iters) for _ in range(3))
    return threads * iters * per_trip / best / 1e9


def _has_amx() -> bool:
    return _has_flag("amx_tile")


def _has_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag``."""
    try:
        return f" {flag}" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def measure_fp32_peak(threads: int) -> float:
    """Measured fp32 FMA peak (GFLOP/s) on ``threads`` threads: the "% of peak" denominator
    (zmm FMAs, or ymm ones on a CPU without AVX-512)."""
    return measure_peak("fp32_fma", threads)


def main(argv: list[str] | None = None) -> int:
    """Print the peak for each requested thread count (JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instr", default="fp32_fma", choices=sorted(INSTRUCTIONS))
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--stream", choices=sorted(STREAMS),
                        help="measure memory bandwidth (GB/s) with this loop instead")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    args = parser.parse_args(argv)
    if args.stream:
        gbs = {int(t): measure_bandwidth(args.stream, int(t)) for t in args.threads.split(",")}
        if args.json:
            print(json.dumps({"stream": args.stream, "unit": "GB/s", "bandwidth": gbs}))
        else:
            for threads, value in gbs.items():
                print(f"{args.stream} bandwidth, {threads} thread(s): {value:.1f} GB/s")
        return 0
    unit = INSTRUCTIONS[args.instr].unit
    results = {int(t): measure_peak(args.instr, int(t)) for t in args.threads.split(",")}
    if args.json:
        print(json.dumps({"instr": args.instr, "unit": unit, "peak": results}))
    else:
        for threads, value in results.items():
            print(f"{args.instr} peak, {threads} thread(s): {value:.1f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
