"""GEMM planning: precisions, the register tile and the cache blocking of one GEMM.

Everything a GEMM schedule decides before it builds a loop nest: the dtypes of A, B and the
accumulator (and B's VNNI factor), the register tile ``mr x nr`` and the padded extents it
implies, the loop order and K blocking from the host's L2 size, and which unit of an AMX
CPU runs the tiles. Tile sizes come from the register file and measured tile
efficiencies, so no tuning is needed; the convolution and the tuning rules plan from the
same tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm.target import Target

from ..errors import UnsupportedDTypeError, UnsupportedShapeError
from ..intrinsics.llvm_ir import AMX_DOT, dot_features
from ..intrinsics.registry import vector_isa
from ..intrinsics.vector_isa import VectorISA
from ..target import host_isa, missing_features

#: Rows and columns of an AMX GEMM's output block (2 x 2 tiles of 16 x 16).
AMX_BLOCK = 32


@dataclass(frozen=True)
class Precision:
    """A GEMM precision: A, B and accumulator dtypes and B's VNNI factor."""

    a: str
    b: str
    acc: str
    vnni: int


#: GEMM precisions (A, B, accumulator dtypes) by the ``dtype`` a kernel is asked for; not
#: the graph's precision (fp32 or bf16) a model is compiled in.
GEMM_PRECISIONS: dict[str, Precision] = {
    "float32": Precision("float32", "float32", "float32", 1),
    "bfloat16": Precision("bfloat16", "bfloat16", "float32", 2),
    "int8": Precision("uint8", "int8", "int32", 4),
    # int8 models on AVX2 (vpmaddwd): u8 activations and s8 weights widened to s16, exact
    "int16": Precision("int16", "int16", "int32", 2),
}


@dataclass(frozen=True)
class GemmPlan:
    """Blocking of one GEMM: the register tile (mr x nr) and the padded extents."""

    m: int
    n: int
    k: int
    mr: int
    nr: int
    dtype: str = "float32"
    amx: bool = False
    """Tiles on AMX: 32 x 32 blocks, K in whole 16-group tile steps."""

    @property
    def precision(self) -> Precision:
        return GEMM_PRECISIONS[self.dtype]

    @property
    def mp(self) -> int:
        return -(-self.m // self.mr) * self.mr

    @property
    def np_(self) -> int:
        return -(-self.n // self.nr) * self.nr

    @property
    def kp(self) -> int:
        """K padded to whole VNNI groups, and to at least 2 of them: a unit reduction loop
        cannot be tensorized (TVM drops it)."""
        v = self.precision.vnni
        step = 16 * v if self.amx else v
        return max(-(-self.k // step) * step, 2 * v)

    @property
    def a_prepadded(self) -> bool:
        """Whether the kernel takes A already zero-padded to (mp, kp): bf16 kernels do,
        because TVM's bf16 legalisation widens a bf16 buffer allocated inside a kernel (the
        padded copy of A) to fp32, which the bf16 microkernel cannot read. (A u8 A is padded
        inside the kernel, under the tile loop, on AMX too.)"""
        return self.precision.a == "bfloat16"

    def a_shape(self, lead: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Shape of the kernel's A parameter."""
        return (*lead, self.mp, self.kp) if self.a_prepadded else (*lead, self.m, self.k)

    def b_packed_shape(self, lead: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Shape of packed B: ``(N/nr, kp, nr)``, or VNNI ``(N/nr, kp/V, nr, V)``."""
        v = self.precision.vnni
        if v == 1:
            return (*lead, self.np_ // self.nr, self.kp, self.nr)
        return (*lead, self.np_ // self.nr, self.kp // v, self.nr, v)


#: Register tiles (mr, nr) with mr * ceil(nr/16) accumulators plus one row of B inside the
#: 32 zmm registers. Tiles under 8 independent FMA chains cannot hide the FMA latency on two
#: pipes and serve only tiny M.
REGISTER_TILES: tuple[tuple[int, int], ...] = (
    (8, 48), (4, 64), (8, 32), (6, 64), (5, 64), (9, 48), (7, 48), (12, 32), (11, 32),
    (10, 32), (14, 32), (3, 64), (2, 64))


#: One-vector-wide tiles, for GEMMs of 16 columns or an odd number of 16-column panels
#: (MobileNetV2's 32 -> 16 projection, EfficientNet's 80 and 112): Zen 5 sustains them like
#: the wider ones (benchmarks/microkernel.py, in L1: 16x16 and 24x16 216 GFLOP/s, 28x16
#: 214, against 8x48's 222), and they save the padded columns (196x80x480: 0.088 -> 0.066
#: ms; 12544x16x32: 0.072 -> 0.063). Not measured on Intel cores, so not in their table.
ONE_VECTOR_TILES: dict[tuple[int, int], float] = {(16, 16): 0.95, (24, 16): 0.95,
                                                  (28, 16): 0.94}


#: AVX2 register tiles (16 ymm registers of 8 fp32 lanes): mr * nr/8 accumulators, B's row
#: and the broadcast A element in registers. Measured on Zen 3 (benchmarks/microkernel.py,
#: in L1, k = 128, best of 3 interleaved rounds, against the 100.6 GFLOP/s ymm FMA peak of
#: benchmarks/peak.py measured between them; the top six are within noise of each other);
#: tiles past the register file (7x16, 5x24) spill, and one column vector (8x8) broadcasts
#: A for every FMA.
AVX2_TILES: dict[tuple[int, int], float] = {
    (4, 24): 0.97, (5, 16): 0.97, (6, 16): 0.96, (3, 24): 0.96, (4, 16): 0.94, (2, 32): 0.93,
    (3, 16): 0.75, (2, 24): 0.75, (8, 8): 0.45}

#: AVX2 s16 dot-product tiles (``vpmaddwd``, int8 models on CPUs without VNNI): fraction of
#: the s16 multiply-add peak (1.6x the FMA's, ~160 GOP/s a Zen 3 core). The dot kernel holds
#: each row's broadcast A pair in a register too, so only tiles of at most 15 registers fit.
#: Measured on Zen 3 (interleaved, 1 thread, bias + ReLU + u8 output): 4 x 16 leads on GEMMs
#: (196x256x1024: 148 GOP/s against 2 x 32's 132 and 3 x 24's 132) and 3x3 convolutions
#: (28x28x128: 132 against 127 and 109); 2 x 32 wins where 4 rows would pad a 14-pixel row.
AVX2_INT16_TILES: dict[tuple[int, int], float] = {
    (4, 16): 0.92, (2, 32): 0.84, (3, 24): 0.78, (3, 16): 0.65, (2, 24): 0.6}


@dataclass(frozen=True)
class CoreTable:
    """GEMM choices for one family of cores, measured on one core of it (1 thread).

    The register file is the same on every AVX-512 core, but how well each tile sustains the
    FMA pipes, and when a panel should be K-blocked, are not: on the Intel core 6 x 64 leads
    and the 32-column tiles trail by 7-9%, where Zen 5 ranks 8 x 48 and 4 x 64 first; and
    small-M GEMMs gain 4-10% from K blocks that Zen 5's smaller L2 already forces (measured
    interleaved, 1 thread; fp32 at M = 840, N = 1536, K = 768 for the tiles).
    ``plan_gemm`` and the tuning rules read the host's.
    """

    family: str
    measured_on: str
    tile_efficiency: dict[tuple[int, int], float]
    """Fraction of the fp32 peak each register tile sustained (ties go to the earlier)."""
    small_gemm_rows: int = 0
    """GEMMs with at most this many rows K-block a panel from a quarter of the L2 on (0: only
    panels past half the L2 are blocked, the rule for every GEMM)."""
    dtype_tiles: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    """Tables of their own for dtypes whose kernels rank the tiles differently (AVX2's s16
    dot product); every other dtype uses ``tile_efficiency``."""
    stream_prefetch_bytes: int = 8192
    """How far ahead a kernel that streams its operand from memory once (a decoding step's
    weight-only matrix-vector products) prefetches it into L2; 0: not at all. One core
    streaming 4-bit weights: on the AMX Xeon 8 KiB ahead took 12 layers of 4096 x 4096 from
    18.5 to 11.3 ms (fp32 activations) and 10.4 to 8.1 ms (int8), 1 and 4 KiB gaining less,
    16 KiB no more; on Zen 4 every distance tried (1-16 KiB, into L1, L2 or non-temporal)
    was slower than none, which streams a 0.45B Llama's 215 MB at 20.7 GB/s against 17.0
    with 8 KiB (the core's own stream prefetcher keeps ahead)."""

    def tiles(self, dtype: str = "float32") -> dict[tuple[int, int], float]:
        """The register tiles a ``dtype`` GEMM chooses from, with their efficiencies."""
        return self.dtype_tiles.get(dtype, self.tile_efficiency)

    def summary(self) -> str:
        return f"{self.family} (measured on {self.measured_on})"


CORE_TABLES: dict[str, CoreTable] = {
    "zen": CoreTable(
        "zen", "AMD EPYC Zen 5, znver5",
        dict(zip(REGISTER_TILES, (0.97, 0.97, 0.95, 0.93, 0.92, 0.92, 0.92, 0.91, 0.90, 0.90,
                                  0.88, 0.80, 0.60))) | ONE_VECTOR_TILES,
        stream_prefetch_bytes=0),
    "intel": CoreTable(
        "intel", "Intel Xeon of the Sapphire Rapids family, emeraldrapids",
        dict(zip(REGISTER_TILES, (0.86, 0.87, 0.83, 0.89, 0.88, 0.88, 0.87, 0.82, 0.81, 0.80,
                                  0.82, 0.77, 0.58))),
        small_gemm_rows=64),
    "avx2": CoreTable("avx2", "AMD EPYC Zen 3, znver3", AVX2_TILES,
                      dtype_tiles={"int16": AVX2_INT16_TILES}),
}


def core_family(model_name: str) -> str:
    """The :data:`CORE_TABLES` family of an AVX-512 CPU by its ``/proc/cpuinfo`` model name:
    Intel cores use Intel's table; AMD and everything else (SVE cores, unknown names) Zen
    5's, the first one measured."""
    return "intel" if "intel" in model_name.lower() else "zen"


def core_table(isa: str = "avx512") -> CoreTable:
    """The table for ``isa``'s register tiles on the host's cores: AVX2's (its own register
    file), else the host family's (like the L2 size, the blocking follows the CPU the
    kernels are compiled on, which is where the host target runs them)."""
    if register_tile_isa(isa) == "avx2":
        return CORE_TABLES["avx2"]
    return CORE_TABLES[core_family(host_isa().model_name)]


def plan_gemm(m: int, n: int, k: int, dtype: str = "float32", isa: str = "avx512"
              ) -> GemmPlan:
    """Choose the register tile minimising padded work / tile efficiency (AMX: 32 x 32
    tile blocks for bf16/int8)."""
    if runs_on_tiles(isa, dtype):
        return GemmPlan(m, n, k, AMX_BLOCK, AMX_BLOCK, dtype, amx=True)
    unit = vector_unit(isa)
    lanes = unit.static_lanes("float32")
    best = None
    for (mr, nr), efficiency in core_table(isa).tiles(dtype).items():
        if mr > max(m, 2) and mr > 2:
            continue
        nv = -(-nr // lanes)
        if GEMM_PRECISIONS[dtype].vnni > 1 and mr * nv + nv + mr > unit.num_vregs - 1:
            # The dot-product kernel holds each row's broadcast A group in a register too
            # (measured: 8x48 ran bf16 at a third of 4x64's rate, spilling).
            continue
        plan = GemmPlan(m, n, k, mr, nr, dtype)
        cost = plan.mp * plan.np_ / efficiency
        if best is None or cost < best[0]:
            best = (cost, plan)
    return best[1]


def check_gemm(m: int, n: int, k: int, dtype: str) -> None:
    """Refuse, with a message naming what is supported, a GEMM no kernel exists for."""
    if dtype not in GEMM_PRECISIONS:
        raise UnsupportedDTypeError(
            f"GEMM: dtype {dtype!r} unsupported; one of {', '.join(GEMM_PRECISIONS)} (int8 is "
            "u8 activations x s8 weights into int32)")
    if min(m, n, k) < 1:
        raise UnsupportedShapeError(f"GEMM: M, N, K must be >= 1, got {m}x{n}x{k}")


def check_low_precision(isa: str, dtype: str, what: str = "GEMM") -> None:
    """Refuse a low-precision contraction on an ISA without its dot-product TPP (AVX2:
    s16 pairs only), naming what has them, before any kernel is built."""
    if not has_dot_product(isa, dtype):
        has = [d for d, prec in GEMM_PRECISIONS.items()
               if prec.vnni > 1 and has_dot_product(isa, d)]
        raise UnsupportedDTypeError(
            f"{what}: no {dtype} dot-product TPP on the {isa} target; bf16 and int8 ones exist "
            f"for AVX-512 (BF16, VNNI) and AMX targets, int16 ones for AVX2; the {isa} target "
            "has fp32 TPPs"
            + (f" and {', '.join(has)} dot products (int8 models run on them)" if has else
               " only"))


def vector_unit(isa: str) -> VectorISA:
    """The vector unit ``isa``'s register tiles run on (AVX-512's for AMX): lanes,
    registers and dot products, for every plan that sizes a tile."""
    return vector_isa(register_tile_isa(isa))


def has_dot_product(isa: str, dtype: str) -> bool:
    """Whether ``isa`` runs GEMMs of ``dtype`` (fp32 everywhere; AVX2 has no bf16 and no
    u8 x s8 dot product, only s16 pairs)."""
    prec = GEMM_PRECISIONS[dtype]
    return prec.vnni == 1 or (prec.a, prec.b) in vector_unit(isa).dot_dtypes


def int8_gemm_dtype(isa: str, target: Target | None = None) -> str | None:
    """The GEMM precision int8 layers run in on ``isa`` (and ``target``'s CPU features):
    ``int8`` (u8 x s8 dot products: AVX512_VNNI, AMX), ``int16`` (the operands widened to
    s16 for ``vpmaddwd``: AVX2, and AVX-512 CPUs without VNNI such as Skylake-SP), or None
    (no integer dot product: fp32)."""
    unit = vector_unit(isa)
    for dtype in ("int8", "int16"):
        prec = GEMM_PRECISIONS[dtype]
        if not has_dot_product(isa, dtype):
            continue
        needs = [f.lstrip("+") for f in dot_features(prec.a, prec.b, unit.static_lanes("int32"))]
        if target is None or isa == "amx" or not missing_features(target, needs):
            return dtype
    return None


def register_tile_isa(isa: str) -> str:
    """The ISA of a schedule's vector register tiles: on an AMX target everything but the
    tile GEMM microkernel (epilogues, packing, fp32 GEMMs) runs on the AVX-512 unit each
    AMX CPU has."""
    return "avx512" if isa == "amx" else isa


def runs_on_tiles(isa: str, dtype: str) -> bool:
    """Whether an ``isa`` GEMM of ``dtype`` runs on AMX tiles: bf16 and int8 on an AMX
    target, with any epilogue (fp32, and the s16 kernels of CPUs without VNNI, stay on the
    vector unit)."""
    prec = GEMM_PRECISIONS[dtype]
    return isa == "amx" and (prec.a, prec.b) in AMX_DOT


def weights_outer(a_elems: int, b_elems: int) -> bool:
    """Loop order: B panels outer (each panel reused over all rows, A re-streamed per
    panel) unless all of B fits in half the L2 and A is the bigger operand, then rows
    outer so A streams from memory exactly once. (The L2 size is the host's.)"""
    l2_budget = (host_isa().l2_bytes or 1024 * 1024) // 2
    return not (4 * b_elems <= l2_budget and a_elems > b_elems)


#: Row tiles from which a tile GEMM may put its rows outer (see :func:`tile_rows_outer`).
STREAMED_B_ROW_TILES = 8


def tile_rows_outer(row_tiles: int, a_tile_bytes: int, b_bytes: int) -> bool:
    """Loop order of a tile GEMM with at least :data:`STREAMED_B_ROW_TILES` row tiles:
    rows outer when one row tile of A (``a_tile_bytes``, its mr x K operand) stays in two
    thirds of the L1d and all of B (``b_bytes``) in half the L2, whichever operand is
    bigger. (Cache sizes are the host's.)

    The tile loads then keep A's strided tile rows in L1 and stream the contiguous packed
    B panels from L2, which they sustain better than the other way round (the AMX Xeon,
    1 thread, hot operands, rows outer against panels outer: int8 1024^3 1908 -> 3301
    GOP/s, bf16 512^3 1574 -> 1683 GFLOP/s). In a model the weights are cold: the first
    row tile reads all of B from memory before any of it is reused, which with few row
    tiles costs more than the streaming saves (int8 BERT, 4 row tiles, 576 KiB weights:
    5.34 -> 5.85 ms a model call; ResNet-50's 7-tile layers: within noise)."""
    l1 = host_isa().l1d_bytes or 48 * 1024
    l2 = host_isa().l2_bytes or 1024 * 1024
    return (row_tiles >= STREAMED_B_ROW_TILES and 3 * a_tile_bytes <= 2 * l1
            and 2 * b_bytes <= l2)


def row_block(rows: int, row_bytes: int, mr: int) -> int | None:
    """Rows of A to keep in half the L2 while every B panel passes over them (a whole
    number of ``mr`` tiles that divides ``rows``' tiles, at least two; a ragged block would
    leave a predicated loop the microkernel cannot be tensorized under), or None when all
    of A fits there already or no such block exists.

    With B panels outer, A is re-read once per panel: an A larger than the L2 then streams
    from L3 per panel (measured bf16 1024^3 on AMX: 304 GFLOP/s against torch's 1063)."""
    budget = (host_isa().l2_bytes or 1024 * 1024) // 2
    if rows * row_bytes <= budget:
        return None
    tiles, fit = -(-rows // mr), budget // row_bytes // mr
    block = max((d for d in range(2, min(fit, tiles - 1) + 1) if tiles % d == 0), default=None)
    return None if block is None else block * mr


def col_scale_once(plan: GemmPlan, batch: int = 1) -> bool:
    """Whether A's column scale (squeeze-excite) runs as one pass over A at the kernel's
    start, rather than per output tile (``mr x K`` multiplies per tile, repeated for every
    B panel): once pays where several panels re-read A and all of A stays in the L2.

    Measured on Zen 5, 1 thread, RegNetY-040's 1x1 convolutions after the channel scale:
    196 x 512 x 512 (8 panels) 5.72 -> 5.30 ms for its 12 calls, 49 x 1088 x 1088 1.19 ->
    1.06 ms, 784 x 192 x 192 (4 panels, 588 KiB of A) 1.64 -> 1.57; 3136 x 128 x 128 (2
    panels, 1.6 MiB of A) 0.95 -> 0.96, hence the L2 bound."""
    l2 = host_isa().l2_bytes or 1024 * 1024
    return plan.np_ // plan.nr > 1 and 4 * batch * plan.mp * plan.kp <= l2


#: A convolution's filter panel larger than this leaves L2 between output rows (each row
#: re-reads it): block its reduction then.
PANEL_BYTES = 192 * 1024
#: Target size of one K block of a panel (stays in L2 while all row blocks use it).
PANEL_BLOCK_BYTES = 128 * 1024


def k_block(k: int, nr: int, rows: int | None = None, mr: int | None = None) -> int | None:
    """K block for a GEMM panel too big for half the L2 (a divisor of k, >= 64), or None;
    for a GEMM of at most the core table's ``small_gemm_rows`` ``rows``, from a quarter of
    the L2 on; never for ``rows`` that are one register tile of ``mr``.

    Below that the panel stays in L2 across row blocks; blocking it then only costs
    (measured: 1024^3 and 2048^3 lost 5-10% with 256-512 KiB panels blocked). With few rows
    the panel is reused by few row tiles and its L2 residency dominates (Intel, 1 thread:
    64x4096x4096 111 -> 116 GFLOP/s, 32x4096x4096 81 -> 89; 197 and 512 rows gain nothing).
    A panel that one row tile reads (a GEMV: decode, a classifier at batch 1) streams once
    and has nothing to keep in L2; blocking it only reloads the C tile per block (same
    Xeon, 1 x 4096 x 4096: 21 GB/s blocked, 28 unblocked, ONNX Runtime 27; 8 rows gain
    from the blocks again, 14 -> 23 GB/s).
    """
    if rows is not None and mr is not None and rows <= mr:
        return None
    l2 = host_isa().l2_bytes or 1024 * 1024
    small = rows is not None and rows <= core_table().small_gemm_rows
    if 4 * k * nr <= (l2 // 4 if small else l2 // 2):
        return None
    best = None
    for kc in range(64, k):
        if k % kc == 0 and 4 * kc * nr <= PANEL_BLOCK_BYTES:
            best = kc
    return best
