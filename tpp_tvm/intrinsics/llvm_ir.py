"""Low-precision kernels as LLVM IR text, for the operations TIR cannot express.

TIR in this TVM cannot carry LLVM's ``<32 x bfloat>`` operands (its bf16 legalisation turns
them into integers) nor AMX tiles, so the x86 low-precision kernels -- the VNNI dot-product
BRGEMM microkernel, the AMX tile BRGEMM and its tile configuration, and fp32 <-> bf16
conversion of one vector -- are ``alwaysinline`` LLVM functions generated here. A TPP
implementation imports them with ``T.attr(0, "pragma_import_llvm", text)`` and calls them
with ``T.call_extern``; after inlining, what remains is the instructions (``vdpbf16ps``,
``vpdpbusd``, ``tdpbf16ps``, ``vcvtneps2bf16``...) on registers and tiles.

One generator serves every dtype and tile: a :class:`DotOp` row says which instruction,
element types and VNNI factor; a column count that is not a whole number of vectors makes
the last vector's loads and stores masked (constant masks), so tails never touch memory
past a tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tvm

from ..errors import UnsupportedDTypeError

_LLVM_TYPES = {"float32": "float", "bfloat16": "bfloat", "int32": "i32", "int16": "i16",
               "int8": "i8", "uint8": "i8"}


@dataclass(frozen=True)
class DotOp:
    """A dot-product instruction: ``acc[l] += sum_v a[l, v] * b[l, v]`` over ``vnni`` pairs.

    ``intrinsic`` takes (acc, a, b) as ``<lanes x acc>``, ``<lanes*vnni x a>``,
    ``<lanes*vnni x b>``; one that does not ``accumulate`` takes (a, b) and returns the
    pair sums, which an ``add`` accumulates (AVX2's ``vpmaddwd``). ``features`` is what the
    calling function must be compiled with.
    """

    intrinsic: str
    acc_dtype: str
    vnni: int
    features: str
    accumulates: bool = True


#: x86 dot products by (A dtype, B dtype, accumulator lanes): 512-bit AVX-512 (16 lanes)
#: and 256-bit AVX2 (8 lanes). s16 x s16 pairs into s32 (``vpmaddwd``) are exact for u8 x
#: s8 values widened to s16: the int8 kernels of CPUs without VNNI (AVX2, and AVX-512
#: before Cascade Lake).
X86_DOT: dict[tuple[str, str, int], DotOp] = {
    ("bfloat16", "bfloat16", 16): DotOp("llvm.x86.avx512bf16.dpbf16ps.512", "float32", 2,
                                        "+avx512f,+avx512bf16"),
    ("uint8", "int8", 16): DotOp("llvm.x86.avx512.vpdpbusd.512", "int32", 4,
                                 "+avx512f,+avx512vnni"),
    ("int16", "int16", 16): DotOp("llvm.x86.avx512.pmaddw.d.512", "int32", 2,
                                  "+avx512f,+avx512bw", False),
    ("int16", "int16", 8): DotOp("llvm.x86.avx2.pmadd.wd", "int32", 2, "+avx2", False),
}


def dot_features(a_dtype: str, b_dtype: str, lanes: int) -> tuple[str, ...]:
    """The CPU features (``+avx512vnni``...) the dot-product BRGEMM of these operands at
    ``lanes`` needs; empty where there is none (the caller refuses such dtypes)."""
    op = X86_DOT.get((a_dtype, b_dtype, lanes))
    return tuple(op.features.split(",")) if op else ()


@dataclass(frozen=True)
class IRFunction:
    """One generated function: its name, its definition and the declarations it needs."""

    name: str
    definition: str
    declares: tuple[str, ...]
    features: str


def module_text(*fns: IRFunction) -> str:
    """One LLVM module holding ``fns`` (declarations and attribute groups merged)."""
    seen: dict[str, None] = {}
    for fn in fns:
        for d in fn.declares:
            seen.setdefault(d, None)
    groups = {f: i for i, f in enumerate(dict.fromkeys(fn.features for fn in fns))}
    body = [fn.definition.replace("#ATTRS", f"#{groups[fn.features]}") for fn in
            dict((fn.name, fn) for fn in fns).values()]
    attrs = [f'attributes #{i} = {{ alwaysinline nounwind "target-features"="{f}" }}'
             for f, i in groups.items()]
    return "\n".join([*body, *seen, *attrs]) + "\n"


def _vec(n: int, dtype: str) -> str:
    return f"<{n} x {_LLVM_TYPES[dtype]}>"


def _mask(n: int, width: int) -> str:
    bits = ", ".join("i1 true" if i < width else "i1 false" for i in range(n))
    return f"<{n} x i1> <{bits}>"


def _masked_load(dst: str, n: int, dtype: str, ptr: str, width: int) -> tuple[str, str]:
    """(instruction, declaration): load ``width`` of ``n`` elements, the rest zero."""
    vt, suffix = _vec(n, dtype), f"v{n}{_suffix(dtype)}"
    if width >= n:
        return f"  {dst} = load {vt}, ptr {ptr}, align 1", ""
    decl = f"declare {vt} @llvm.masked.load.{suffix}.p0(ptr, <{n} x i1>, {vt})"
    return (f"  {dst} = call {vt} @llvm.masked.load.{suffix}.p0(ptr align 1 {ptr}, "
            f"{_mask(n, width)}, {vt} zeroinitializer)", decl)


def _masked_store(val: str, n: int, dtype: str, ptr: str, width: int) -> tuple[str, str]:
    vt, suffix = _vec(n, dtype), f"v{n}{_suffix(dtype)}"
    if width >= n:
        return f"  store {vt} {val}, ptr {ptr}, align 1", ""
    decl = f"declare void @llvm.masked.store.{suffix}.p0({vt}, ptr, <{n} x i1>)"
    return (f"  call void @llvm.masked.store.{suffix}.p0({vt} {val}, ptr align 1 {ptr}, "
            f"{_mask(n, width)})", decl)


def _suffix(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "int32": "i32", "int16": "i16", "int8": "i8",
            "uint8": "i8"}[dtype]


#: Loop metadata that keeps LLVM from unrolling a microkernel's reduction loop (the ids are
#: the same in every kernel, so merged modules declare them once).
NO_UNROLL_LOOP = "!llvm.loop !9001"
NO_UNROLL_METADATA = ("!9001 = distinct !{!9001, !9002}",
                      '!9002 = !{!"llvm.loop.unroll.disable"}')


class _DotBrgemmText:
    """The LLVM IR of one dot-product BRGEMM microkernel as it is written: its lines and the
    intrinsic declarations they need (see :func:`dot_brgemm`)."""

    def __init__(self, op: DotOp, a_dtype: str, b_dtype: str, m: int, n: int,
                 lanes: int) -> None:
        self.op, self.a_dtype, self.b_dtype, self.m, self.lanes = op, a_dtype, b_dtype, m, lanes
        self.V, self.acc_dt = op.vnni, op.acc_dtype
        self.acc = _vec(lanes, self.acc_dt)
        self.at, self.bt = _vec(lanes * self.V, a_dtype), _vec(lanes * self.V, b_dtype)
        self.ea, self.eb = _LLVM_TYPES[a_dtype], _LLVM_TYPES[b_dtype]
        full = n // lanes
        self.nv = -(-n // lanes)
        self.widths = [lanes] * full + ([n - full * lanes] if n % lanes else [])
        operands = f"{self.acc}, {self.at}, {self.bt}" if op.accumulates \
            else f"{self.at}, {self.bt}"
        self.declares = {f"declare {self.acc} @{op.intrinsic}({operands})"}
        self.body: list[str] = []

    def emit(self, line_decl: tuple[str, str]) -> None:
        line, decl = line_decl
        self.body.append(line)
        if decl:
            self.declares.add(decl)

    def load_c(self, beta: int) -> dict[tuple[int, int], str]:
        """C's rows loaded into the accumulators' initial values (zeros for beta 0)."""
        body, lanes, acc_dt = self.body, self.lanes, self.acc_dt
        init = {}
        for i in range(self.m):
            body.append(f"  %crow{i} = mul i32 {i}, %ldc")
            for v, w in enumerate(self.widths):
                init[i, v] = "zeroinitializer" if beta == 0 else f"%init{i}_{v}"
                if beta == 0:
                    continue
                body.append(f"  %coff{i}_{v} = add i32 %crow{i}, {v * lanes}")
                body.append(f"  %pc{i}_{v} = getelementptr {_LLVM_TYPES[acc_dt]}, ptr %c, "
                            f"i32 %coff{i}_{v}")
                self.emit(_masked_load(f"%init{i}_{v}", lanes, acc_dt, f"%pc{i}_{v}", w))
        return init

    def loop_heads(self, init: dict[tuple[int, int], str]) -> None:
        """The filter-row loop's and the VNNI-group loop's heads: the accumulators' phis,
        A's row pointers and B's group pointer."""
        m, nv, acc, ea, eb, V = self.m, self.nv, self.acc, self.ea, self.eb, self.V
        body = self.body
        body += ["  %lda64 = sext i32 %lda to i64", "  %a_batch64 = sext i32 %a_batch to i64",
                 "  %b_group64 = sext i32 %b_group to i64",
                 "  %b_batch64 = sext i32 %b_batch to i64",
                 "  br label %rows", "rows:", "  %r = phi i64 [ 0, %entry ], [ %rn, %next ]"]
        body += [f"  %accr{i}_{v} = phi {acc} [ {init[i, v]}, %entry ], [ %new{i}_{v}, %next ]"
                 for i in range(m) for v in range(nv)]
        body += ["  %ra = mul i64 %r, %a_batch64", "  %rb = mul i64 %r, %b_batch64",
                 f"  %pbr = getelementptr inbounds {eb}, ptr %b, i64 %rb"]
        for i in range(m):
            body += [f"  %arow{i} = mul i64 {i}, %lda64", f"  %aoff{i} = add i64 %ra, %arow{i}",
                     f"  %par{i} = getelementptr inbounds {ea}, ptr %a, i64 %aoff{i}"]
        body += ["  br label %loop", "loop:", "  %g = phi i64 [ 0, %rows ], [ %gn, %loop ]"]
        body += [f"  %acc{i}_{v} = phi {acc} [ %accr{i}_{v}, %rows ], [ %new{i}_{v}, %loop ]"
                 for i in range(m) for v in range(nv)]
        body += [f"  %ga = mul i64 %g, {V}", "  %gb = mul i64 %g, %b_group64",
                 f"  %pbg = getelementptr inbounds {eb}, ptr %pbr, i64 %gb"]

    def dot_step(self) -> None:
        """One VNNI group: A's groups broadcast, B's vectors loaded, one dot product per
        accumulator."""
        op, lanes, V, acc, at, bt = self.op, self.lanes, self.V, self.acc, self.at, self.bt
        body = self.body
        for i in range(self.m):
            body += [f"  %pa{i} = getelementptr inbounds {self.ea}, ptr %par{i}, i64 %ga",
                     f"  %a32_{i} = load i32, ptr %pa{i}, align 1",
                     f"  %a1_{i} = insertelement <{lanes} x i32> poison, i32 %a32_{i}, i64 0",
                     f"  %as{i} = shufflevector <{lanes} x i32> %a1_{i}, <{lanes} x i32> "
                     f"poison, <{lanes} x i32> zeroinitializer",
                     f"  %av{i} = bitcast <{lanes} x i32> %as{i} to {at}"]
        for v, w in enumerate(self.widths):
            body.append(f"  %pb{v} = getelementptr inbounds {self.eb}, ptr %pbg, "
                        f"i64 {v * lanes * V}")
            self.emit(_masked_load(f"%bv{v}", lanes * V, self.b_dtype, f"%pb{v}", w * V))
        for i in range(self.m):
            for v in range(self.nv):
                if op.accumulates:
                    body.append(f"  %new{i}_{v} = call {acc} @{op.intrinsic}({acc} "
                                f"%acc{i}_{v}, {at} %av{i}, {bt} %bv{v})")
                    continue
                body += [f"  %dot{i}_{v} = call {acc} @{op.intrinsic}({at} %av{i}, "
                         f"{bt} %bv{v})",
                         f"  %new{i}_{v} = add {acc} %acc{i}_{v}, %dot{i}_{v}"]

    def loop_ends(self, kgroups: int, batch: int, no_unroll: str) -> None:
        """Both loops' back edges and exits."""
        self.body += ["  %gn = add i64 %g, 1", f"  %gdone = icmp eq i64 %gn, {kgroups}",
                      f"  br i1 %gdone, label %next, label %loop{no_unroll}", "next:",
                      "  %rn = add i64 %r, 1", f"  %rdone = icmp eq i64 %rn, {batch}",
                      "  br i1 %rdone, label %exit, label %rows", "exit:"]

    def store_c(self) -> None:
        """The accumulators stored into C (masked for a partial last vector)."""
        lanes, acc_dt = self.lanes, self.acc_dt
        for i in range(self.m):
            for v, w in enumerate(self.widths):
                self.body += [f"  %soff{i}_{v} = add i32 %crow{i}, {v * lanes}",
                              f"  %ps{i}_{v} = getelementptr {_LLVM_TYPES[acc_dt]}, ptr %c, "
                              f"i32 %soff{i}_{v}"]
                self.emit(_masked_store(f"%new{i}_{v}", lanes, acc_dt, f"%ps{i}_{v}", w))


def dot_brgemm(a_dtype: str, b_dtype: str, m: int, n: int, kgroups: int, batch: int,
               beta: int, lanes: int = 16, unroll_batch_reduce: bool = True) -> IRFunction:
    """A whole register-blocked low-precision BRGEMM microkernel as one LLVM function.

    ``void name(ptr a, ptr b, ptr c, i32 lda, i32 a_batch, i32 b_group, i32 b_batch,
    i32 ldc)`` (strides in elements): C (m x n, row stride ldc) (+)= sum over ``batch``
    blocks and ``kgroups`` VNNI groups of broadcast(A's ``vnni`` elements of row i) dot B's
    VNNI row (``n x vnni`` contiguous). The accumulators are SSA values carried by the
    loop's phis, so they live in registers for the whole reduction; a partial last vector
    of columns uses masked loads/stores. (Kept as one function rather than a per-step call
    from a TIR loop: TVM puts a 1 KiB+ accumulator array on the heap, and the step's untyped
    loads would then pin every accumulator to memory.)

    Two loops, filter rows (batch) outer and VNNI groups inner, on 64-bit pointers: the
    inner loop then only steps one pointer per row and B's (one flat loop with div/mod and
    32-bit offsets spent 14 integer instructions a step on address arithmetic: AVX2 s16 3x3
    convolutions ran at 87-92 GOP/s, now 139-145 on Zen 3). With
    ``unroll_batch_reduce=False`` (AVX2) a batch-reduce (a convolution's filter rows) is not
    unrolled: two steps of a 4 x 16 s16 tile need more than AVX2's 16 registers (spills;
    14x14 and 7x7 convolutions 4-6% slower unrolled). A plain GEMM keeps LLVM's unrolling
    everywhere: without it the dynamic-int8 MLP's 64x4096x4096 s16 GEMM took 33 ms instead
    of 18-21 in the model. (AVX-512's 32 registers: not measured, unchanged.)
    """
    op = X86_DOT.get((a_dtype, b_dtype, lanes))
    if op is None:
        raise UnsupportedDTypeError(
            f"no x86 dot-product BRGEMM for {a_dtype} x {b_dtype} at {lanes} lanes; supported: "
            + ", ".join(f"{a} x {b} at {n} lanes" for a, b, n in X86_DOT))
    name = (f"tpp_brgemm_{_suffix(a_dtype)}{_suffix(b_dtype)}_m{m}n{n}g{kgroups}b{batch}"
            f"_beta{beta}")
    text = _DotBrgemmText(op, a_dtype, b_dtype, m, n, lanes)
    text.body += [f"define linkonce_odr void @{name}(ptr %a, ptr %b, ptr %c, i32 %lda, "
                  "i32 %a_batch, i32 %b_group, i32 %b_batch, i32 %ldc) #ATTRS {", "entry:"]
    init = text.load_c(beta)
    no_unroll = f", {NO_UNROLL_LOOP}" if batch > 1 and not unroll_batch_reduce else ""
    text.loop_heads(init)
    text.dot_step()
    text.loop_ends(kgroups, batch, no_unroll)
    text.store_c()
    text.body += ["  ret void", "}"]
    if no_unroll:
        text.declares.update(NO_UNROLL_METADATA)
    return IRFunction(name, "\n".join(text.body), tuple(sorted(text.declares)), op.features)


#: Conversions :func:`convert_step` generates: (source, destination) -> LLVM cast.
CONVERSIONS = {("float32", "bfloat16"): "fptrunc", ("bfloat16", "float32"): "fpext"}


def convert_step(src: str, dst: str, lanes: int, width: int) -> IRFunction:
    """``void name(ptr x, ptr y)``: converts ``width`` (<= ``lanes``) contiguous elements.

    fp32 -> bf16 rounds to nearest even (``vcvtneps2bf16``); bf16 -> fp32 is exact.
    """
    cast = CONVERSIONS.get((src, dst))
    if cast is None:
        raise UnsupportedDTypeError(
            f"no LLVM conversion step {src}->{dst}; supported: "
            + ", ".join(f"{a}->{b}" for a, b in CONVERSIONS))
    name = f"tpp_cvt_{_suffix(src)}_{_suffix(dst)}_{lanes}_w{width}"
    load, decl_l = _masked_load("%x", lanes, src, "%px", width)
    store, decl_s = _masked_store("%y", lanes, dst, "%py", width)
    definition = "\n".join([
        f"define linkonce_odr void @{name}(ptr %px, ptr %py) #ATTRS {{",
        load,
        f"  %y = {cast} {_vec(lanes, src)} %x to {_vec(lanes, dst)}",
        store,
        "  ret void",
        "}",
    ])
    return IRFunction(name, definition, tuple(d for d in (decl_l, decl_s) if d),
                      "+avx512f,+avx512bf16")


#: AMX tile dot products by (A dtype, B dtype): the instruction and the VNNI factor.
AMX_DOT: dict[tuple[str, str], tuple[str, int]] = {
    ("bfloat16", "bfloat16"): ("llvm.x86.tdpbf16ps", 2),
    ("uint8", "int8"): ("llvm.x86.tdpbusd", 4),
}
AMX_FEATURES = "+avx512f,+amx-tile,+amx-bf16,+amx-int8"
#: Rows of a tile, and VNNI groups of K one tile dot product consumes (64-byte tile rows).
AMX_ROWS = 16
AMX_GROUPS = 16
#: Suffix of the tile microkernel that leaves configuration to its caller.
NO_CONFIG = "_nocfg"


def amx_tile_config(m: int, n: int) -> tuple[str, list[tuple[int, int]]]:
    """The 64-byte ``ldtilecfg`` palette-1 config of a (m x n) C block, and the tiles'
    (rows, bytes per row) it declares: C tiles 0.. (row-major, 16 x 16 fp32/int32 each),
    then one A tile per C tile row (16 x 64 bytes), then one B tile per C tile column
    (16 VNNI groups x 64 bytes)."""
    mt, nt = m // AMX_ROWS, n // 16
    tiles = [(AMX_ROWS, 64)] * (mt * nt) + [(AMX_ROWS, 64)] * mt + [(AMX_GROUPS, 64)] * nt
    return tile_config_bytes(tiles), tiles


def tile_config_bytes(tiles: list[tuple[int, int]]) -> str:
    """The 64-byte palette-1 ``ldtilecfg`` operand (an LLVM ``[64 x i8]`` constant) declaring
    tiles 0.. with the given (rows, bytes per row)."""
    cfg = [0] * 64
    cfg[0] = 1  # palette 1
    for t, (rows, colsb) in enumerate(tiles):
        cfg[16 + 2 * t] = colsb & 0xFF
        cfg[17 + 2 * t] = colsb >> 8
        cfg[48 + t] = rows
    return "[" + ", ".join(f"i8 {b}" for b in cfg) + "]"


#: MXCSR bits FTZ (flush results that would be denormal to zero, bit 15) and DAZ (read
#: denormal inputs as zero, bit 6).
MXCSR_FLUSH_DENORMALS = 0x8040


# Inline asm, not llvm.x86.sse.{st,ld}mxcsr: LLVM does not model the FP environment, so it
# deleted the intrinsic that sets MXCSR as a store overwritten by the one restoring it.
_STMXCSR = '"stmxcsr $0", "=*m,~{memory}"'
_LDMXCSR = '"ldmxcsr $0", "*m,~{memory}"'
_SLOT = "(ptr elementtype(i32) %slot)"


@functools.cache
def denormal_flushing() -> tuple[IRFunction, IRFunction, IRFunction]:
    """``i32 tpp_denormals_flush()`` (sets MXCSR's FTZ and DAZ bits, returns the old MXCSR)
    and ``void tpp_denormals_restore(i32)``: a kernel brackets its work with them so the SSE/AVX
    unit never takes the microcode assist a denormal operand or result costs on x86 cores;
    ``void tpp_denormals_keep_flushed()`` sets the bits if they are not set (1.6 ns when they
    are), for a worker thread's parallel iterations."""
    flush = "\n".join([
        "define linkonce_odr i32 @tpp_denormals_flush() #ATTRS {",
        "  %slot = alloca i32, align 4", f"  call void asm sideeffect {_STMXCSR}{_SLOT}",
        "  %old = load i32, ptr %slot, align 4",
        f"  %new = or i32 %old, {MXCSR_FLUSH_DENORMALS}", "  store i32 %new, ptr %slot, align 4",
        f"  call void asm sideeffect {_LDMXCSR}{_SLOT}", "  ret i32 %old", "}"])
    restore = "\n".join([
        "define linkonce_odr void @tpp_denormals_restore(i32 %old) #ATTRS {",
        "  %slot = alloca i32, align 4", "  store i32 %old, ptr %slot, align 4",
        f"  call void asm sideeffect {_LDMXCSR}{_SLOT}", "  ret void", "}"])
    keep = "\n".join([
        "define linkonce_odr void @tpp_denormals_keep_flushed() #ATTRS {", "entry:",
        "  %slot = alloca i32, align 4", f"  call void asm sideeffect {_STMXCSR}{_SLOT}",
        "  %old = load i32, ptr %slot, align 4",
        f"  %bits = and i32 %old, {MXCSR_FLUSH_DENORMALS}",
        f"  %set = icmp eq i32 %bits, {MXCSR_FLUSH_DENORMALS}",
        "  br i1 %set, label %done, label %flush", "flush:",
        f"  %new = or i32 %old, {MXCSR_FLUSH_DENORMALS}", "  store i32 %new, ptr %slot, align 4",
        f"  call void asm sideeffect {_LDMXCSR}{_SLOT}", "  br label %done", "done:",
        "  ret void", "}"])
    return (IRFunction("tpp_denormals_flush", flush, (), "+sse"),
            IRFunction("tpp_denormals_restore", restore, (), "+sse"),
            IRFunction("tpp_denormals_keep_flushed", keep, (), "+sse"))


def amx_configure(m: int, n: int) -> tuple[IRFunction, IRFunction]:
    """``void tpp_amx_cfg_m<m>n<n>()`` (``ldtilecfg`` of :func:`amx_tile_config`) and
    ``void tpp_amx_release()`` (``tilerelease``), for kernels that configure the tiles once
    and then call :func:`amx_brgemm` microkernels built with ``configure=False``."""
    cfg, _ = amx_tile_config(m, n)
    return _configure(f"tpp_amx_cfg_m{m}n{n}", cfg)


def _configure(name: str, cfg: str) -> tuple[IRFunction, IRFunction]:
    load = "\n".join([f"@{name}.cfg = linkonce_odr constant [64 x i8] {cfg}, align 64",
                      f"define linkonce_odr void @{name}() #ATTRS {{",
                      f"  call void @llvm.x86.ldtilecfg(ptr @{name}.cfg)", "  ret void", "}"])
    release = "\n".join(["define linkonce_odr void @tpp_amx_release() #ATTRS {",
                         "  call void @llvm.x86.tilerelease()", "  ret void", "}"])
    return (IRFunction(name, load, ("declare void @llvm.x86.ldtilecfg(ptr)",), AMX_FEATURES),
            IRFunction("tpp_amx_release", release, ("declare void @llvm.x86.tilerelease()",),
                       AMX_FEATURES))


@dataclass(frozen=True)
class TileBrgemm:
    """An AMX BRGEMM microkernel in three parts, so that a kernel can put other work between
    its K steps (:func:`tpp_tvm.intrinsics.amx.interleave_tile_epilogues` runs the previous
    block's AVX-512 epilogue there, while the tile unit computes):

    * ``begin(ptr c, i32 ldc)``: C tiles zeroed (beta 0) or loaded from ``c``;
    * ``run`` (symbol ``<name>_steps``; ``ptr a, ptr b, i32 lda, i32 a_batch,
      i32 b_group, i32 b_batch, i32 t0, i32 t1, ptr pf, i32 pf_lines``): steps
      ``t0 <= t < t1`` of the ``steps`` (batch x K/16-group) tile dot products; step ``t``
      also prefetches (into L2) the ``pf_lines`` cache lines from ``pf + 64 t pf_lines``
      bytes on (none where ``pf_lines`` is 0);
    * ``end(ptr c, i32 ldc)``: C tiles stored to ``c``.

    The tiles stay in the tile registers between the calls (they are architectural tiles
    numbered by the configuration, not values LLVM allocates)."""

    begin: IRFunction
    run: IRFunction
    end: IRFunction
    steps: int
    beta: int


#: The split microkernels made so far, by the symbol of their configuration-free function.
_TILE_BRGEMMS: dict[str, TileBrgemm] = {}


def tile_brgemm(name: str) -> TileBrgemm | None:
    """The parts of the configuration-free tile microkernel ``name`` (None if unknown)."""
    return _TILE_BRGEMMS.get(name)


def _amx_parts(name: str, intrinsic: str, V: int, a_dtype: str, b_dtype: str, m: int, n: int,
               kgroups: int, batch: int, beta: int) -> TileBrgemm:
    mt, nt = m // AMX_ROWS, n // 16
    acc_t = "float" if a_dtype == "bfloat16" else "i32"
    ea, eb = _LLVM_TYPES[a_dtype], _LLVM_TYPES[b_dtype]
    esize = 2 if a_dtype == "bfloat16" else 1
    steps = kgroups // AMX_GROUPS
    c_tile = {(i, j): i * nt + j for i in range(mt) for j in range(nt)}
    a_tile = {i: mt * nt + i for i in range(mt)}
    b_tile = {j: mt * nt + mt + j for j in range(nt)}

    def c_pointers() -> list[str]:
        lines = ["  %ldc64 = sext i32 %ldc to i64", "  %ldcb = mul i64 %ldc64, 4"]
        for (i, j), t in c_tile.items():
            lines += [f"  %crow{t} = mul i32 {i * AMX_ROWS}, %ldc",
                      f"  %coff{t} = add i32 %crow{t}, {j * 16}",
                      f"  %pc{t} = getelementptr {acc_t}, ptr %c, i32 %coff{t}"]
        return lines

    begin = [f"define linkonce_odr void @{name}_begin(ptr %c, i32 %ldc) #ATTRS {{", "entry:"]
    if beta == 0:
        begin += [f"  call void @llvm.x86.tilezero(i8 {t})" for t in c_tile.values()]
    else:
        begin += c_pointers() + [f"  call void @llvm.x86.tileloadd64(i8 {t}, ptr %pc{t}, i64 %ldcb)"
                                 for t in c_tile.values()]
    begin += ["  ret void", "}"]
    end = [f"define linkonce_odr void @{name}_end(ptr %c, i32 %ldc) #ATTRS {{", "entry:",
           *c_pointers(),
           *(f"  call void @llvm.x86.tilestored64(i8 {t}, ptr %pc{t}, i64 %ldcb)"
             for t in c_tile.values()), "  ret void", "}"]
    run = [f"define linkonce_odr void @{name}_steps(ptr %a, ptr %b, i32 %lda, i32 %a_batch, "
           "i32 %b_group, i32 %b_batch, i32 %t0, i32 %t1, ptr %pf, i32 %pf_lines) #ATTRS {",
           "entry:",
           "  %lda64 = sext i32 %lda to i64", f"  %ldab = mul i64 %lda64, {esize}",
           "  %ldb64 = sext i32 %b_group to i64", f"  %ldbb = mul i64 %ldb64, {esize}",
           "  %none = icmp sge i32 %t0, %t1", "  br i1 %none, label %exit, label %loop", "loop:",
           "  %t = phi i32 [ %t0, %entry ], [ %tn, %next ]",
           f"  %r = udiv i32 %t, {steps}", f"  %s = urem i32 %t, {steps}",
           "  %ra = mul i32 %r, %a_batch", f"  %sa = mul i32 %s, {AMX_GROUPS * V}",
           "  %abase = add i32 %ra, %sa", "  %rb = mul i32 %r, %b_batch",
           f"  %sg = mul i32 %s, {AMX_GROUPS}", "  %sb = mul i32 %sg, %b_group",
           "  %bbase = add i32 %rb, %sb"]
    for i, t in a_tile.items():
        run += [f"  %arow{i} = mul i32 {i * AMX_ROWS}, %lda",
                f"  %aoff{i} = add i32 %abase, %arow{i}",
                f"  %pa{i} = getelementptr {ea}, ptr %a, i32 %aoff{i}",
                f"  call void @llvm.x86.tileloadd64(i8 {t}, ptr %pa{i}, i64 %ldab)"]
    for j, t in b_tile.items():
        run += [f"  %boff{j} = add i32 %bbase, {j * 16 * V}",
                f"  %pb{j} = getelementptr {eb}, ptr %b, i32 %boff{j}",
                f"  call void @llvm.x86.tileloadd64(i8 {t}, ptr %pb{j}, i64 %ldbb)"]
    run += [f"  call void @{intrinsic}(i8 {t}, i8 {a_tile[i]}, i8 {b_tile[j]})"
            for (i, j), t in c_tile.items()]
    run += ["  %pf0 = mul i32 %t, %pf_lines", "  %any = icmp sgt i32 %pf_lines, 0",
            "  br i1 %any, label %fetch, label %next", "fetch:",
            "  %l = phi i32 [ 0, %loop ], [ %ln, %fetch ]", "  %line = add i32 %pf0, %l",
            "  %off = mul i32 %line, 64", "  %pl = getelementptr i8, ptr %pf, i32 %off",
            "  call void @llvm.prefetch.p0(ptr %pl, i32 0, i32 2, i32 1)",
            "  %ln = add i32 %l, 1", "  %fdone = icmp eq i32 %ln, %pf_lines",
            "  br i1 %fdone, label %next, label %fetch", "next:",
            "  %tn = add i32 %t, 1", "  %done = icmp eq i32 %tn, %t1",
            "  br i1 %done, label %exit, label %loop", "exit:", "  ret void", "}"]
    declares = ("declare void @llvm.x86.tilezero(i8 immarg)",
                "declare void @llvm.x86.tileloadd64(i8 immarg, ptr, i64)",
                "declare void @llvm.x86.tilestored64(i8 immarg, ptr, i64)",
                f"declare void @{intrinsic}(i8 immarg, i8 immarg, i8 immarg)",
                "declare void @llvm.prefetch.p0(ptr, i32 immarg, i32 immarg, i32 immarg)")
    parts = [IRFunction(f"{name}_{part}", "\n".join(lines), declares, AMX_FEATURES)
             for part, lines in (("begin", begin), ("steps", run), ("end", end))]
    return TileBrgemm(*parts, steps=steps * batch, beta=beta)


def amx_brgemm(a_dtype: str, b_dtype: str, m: int, n: int, kgroups: int, batch: int,
               beta: int, configure: bool = True) -> IRFunction:
    """An AMX BRGEMM microkernel (same signature and math as :func:`dot_brgemm`).

    C is ``m / 16 x n / 16`` tiles of 16 x 16 accumulators; per step of 16 VNNI groups it
    loads one A tile per tile row and one B tile per tile column (B's VNNI rows are
    exactly AMX's B-tile rows) and issues one ``tdpbf16ps``/``tdpbusd`` per C tile.

    The tile work is always the function ``<name>_nocfg``, which assumes the caller loaded
    :func:`amx_configure`'s configuration; it calls the :class:`TileBrgemm` parts (begin, all
    steps, end), which the module text also holds. With ``configure`` (a self-contained TPP)
    the returned function is a wrapper that loads the configuration, calls it and releases
    the tiles, so a kernel that configures once per thread
    (:func:`tpp_tvm.intrinsics.amx.configure_tiles_per_task`) only renames its calls.
    """
    op = AMX_DOT.get((a_dtype, b_dtype))
    if op is None:
        raise UnsupportedDTypeError(
            f"no AMX tile dot product for {a_dtype} x {b_dtype}; supported: "
            + ", ".join(f"{a} x {b}" for a, b in AMX_DOT))
    intrinsic, V = op
    if m % AMX_ROWS or n % 16 or not 1 <= (m // AMX_ROWS) * (n // 16) <= 4 \
            or m > 32 or n > 32 or kgroups % AMX_GROUPS:
        raise UnsupportedDTypeError(
            f"AMX BRGEMM: tile {m}x{n} with K={kgroups * V} is not supported; C must be 16 "
            f"or 32 rows by 16 or 32 columns and K a multiple of {AMX_GROUPS * V}")
    wrapper = f"tpp_amx_{_suffix(a_dtype)}{_suffix(b_dtype)}_m{m}n{n}g{kgroups}b{batch}_beta{beta}"
    name = wrapper + NO_CONFIG
    parts = _amx_parts(name, intrinsic, V, a_dtype, b_dtype, m, n, kgroups, batch, beta)
    _TILE_BRGEMMS[name] = parts
    args = ("ptr %a, ptr %b, ptr %c, i32 %lda, i32 %a_batch, i32 %b_group, i32 %b_batch, "
            "i32 %ldc")
    body = [parts.begin.definition, parts.run.definition, parts.end.definition,
            f"define linkonce_odr void @{name}({args}) #ATTRS {{", "entry:",
            f"  call void @{parts.begin.name}(ptr %c, i32 %ldc)",
            f"  call void @{parts.run.name}(ptr %a, ptr %b, i32 %lda, i32 %a_batch, "
            f"i32 %b_group, i32 %b_batch, i32 0, i32 {parts.steps}, ptr %b, i32 0)",
            f"  call void @{parts.end.name}(ptr %c, i32 %ldc)", "  ret void", "}"]
    declares = parts.run.declares
    if not configure:
        return IRFunction(name, "\n".join(body), declares, AMX_FEATURES)
    cfg, _ = amx_tile_config(m, n)
    body += [f"@{wrapper}.cfg = linkonce_odr constant [64 x i8] {cfg}, align 64",
             f"define linkonce_odr void @{wrapper}({args}) #ATTRS {{",
             f"  call void @llvm.x86.ldtilecfg(ptr @{wrapper}.cfg)",
             f"  call void @{name}({args})", "  call void @llvm.x86.tilerelease()",
             "  ret void", "}"]
    declares = ("declare void @llvm.x86.ldtilecfg(ptr)",
                "declare void @llvm.x86.tilerelease()", *declares)
    return IRFunction(wrapper, "\n".join(body), declares, AMX_FEATURES)


#: Bytes of one C tile (16 rows of 16 int32) as :func:`amx_block_dots` stores it.
TILE_BYTES = AMX_ROWS * 64


def amx_block_dots(columns: int, k_bytes: int, steps: int
                   ) -> tuple[IRFunction, IRFunction, IRFunction]:
    """Tile products of one quantization block for kernels that scale each block's int32
    dot products themselves (weight-only matmuls with int8 activations): s8 x s8
    (``tdpbssd``), so neither operand needs re-centering to unsigned.

    ``void <name>(ptr a, i64 lda, ptr b, ptr c)`` zeroes ``columns`` C tiles (16 rows x 16
    int32 each); per step ``s < steps`` loads the A tile (16 rows of ``k_bytes`` s8 from
    ``a + s k_bytes``, rows ``lda`` bytes apart) and, for each column tile ``j``, its B tile
    (``k_bytes / 4`` VNNI rows of 64 bytes from ``b + (j steps + s) 16 k_bytes``: one
    column tile's block rows are contiguous) into one of two B tiles in turn, and multiplies;
    then stores C tile ``j`` at ``c + TILE_BYTES j`` (rows 64 bytes apart).
    Returns the configuration (``ldtilecfg`` of these shapes, once per task), the release
    and the product function."""
    if not 1 <= columns <= 4 or k_bytes % 4 or not 4 <= k_bytes <= 64 or steps < 1:
        raise UnsupportedDTypeError(
            f"AMX block dots: {columns} column tiles of K {k_bytes} x {steps}; 1-4 column "
            "tiles, K a multiple of 4 bytes up to 64")
    a_tile, b_tiles = columns, (columns + 1, columns + 2 if columns > 1 else columns + 1)
    tiles = [(AMX_ROWS, 64)] * columns + [(AMX_ROWS, k_bytes)] \
        + [(k_bytes // 4, 64)] * len(set(b_tiles))
    configure, release = _configure(f"tpp_amx_cfg_blocks_c{columns}k{k_bytes}",
                                    tile_config_bytes(tiles))
    name = f"tpp_amx_block_dots_c{columns}k{k_bytes}s{steps}"
    body = [f"define linkonce_odr void @{name}(ptr %a, i64 %lda, ptr %b, ptr %c) #ATTRS {{",
            "entry:", *(f"  call void @llvm.x86.tilezero(i8 {j})" for j in range(columns))]
    for s in range(steps):
        body += [f"  %pa{s} = getelementptr i8, ptr %a, i64 {s * k_bytes}",
                 f"  call void @llvm.x86.tileloadd64(i8 {a_tile}, ptr %pa{s}, i64 %lda)"]
        for j in range(columns):
            b_tile = b_tiles[(s * columns + j) % 2]
            body += [f"  %pb{s}_{j} = getelementptr i8, ptr %b, i64 "
                     f"{(j * steps + s) * 16 * k_bytes}",
                     f"  call void @llvm.x86.tileloadd64(i8 {b_tile}, ptr %pb{s}_{j}, i64 64)",
                     f"  call void @llvm.x86.tdpbssd(i8 {j}, i8 {a_tile}, i8 {b_tile})"]
    for j in range(columns):
        body += [f"  %pc{j} = getelementptr i8, ptr %c, i64 {j * TILE_BYTES}",
                 f"  call void @llvm.x86.tilestored64(i8 {j}, ptr %pc{j}, i64 64)"]
    declares = ("declare void @llvm.x86.tilezero(i8 immarg)",
                "declare void @llvm.x86.tileloadd64(i8 immarg, ptr, i64)",
                "declare void @llvm.x86.tilestored64(i8 immarg, ptr, i64)",
                "declare void @llvm.x86.tdpbssd(i8 immarg, i8 immarg, i8 immarg)")
    dots = IRFunction(name, "\n".join([*body, "  ret void", "}"]), declares, AMX_FEATURES)
    return configure, release, dots


@functools.cache
def intrinsic_id(name: str) -> int:
    """LLVM's id of the intrinsic ``name``: what a ``call_llvm_pure_intrin`` holds as its
    first argument (for passes that recognize the calls a TPP body made)."""
    return int(tvm.target.codegen.llvm_lookup_intrinsic_id(name))
