"""The TIR lowering tpp_tvm compiles kernels with: TVM's default pipeline, then small
kernel-local buffers kept on the stack instead of TVM's workspace allocator.

A tiled TPP kernel keeps a register tile's intermediates (a GEMM's C tile before its
epilogue, an int8 tile before dequantization, an equation's temporaries) in buffers that
TVM allocates inside the tile loop. ``LowerTVMBuiltin`` turns every such allocation of
1 KiB or more, and every non-``global`` one of any size, into a
``TVMBackendAllocWorkspace``/``FreeWorkspace`` pair *per tile*: three pairs per 4x64 tile
of an int8 GEMM with a dequantize epilogue (512^3: 814 -> 989 GOP/s on one core once on the
stack), 7-14% of fp32 GEMMs with a bias/GELU epilogue.
Buffers this small belong on the stack: this pass marks constant-size allocations up to
:data:`STACK_LIMIT_BYTES` with TVM's ``disable_lower_builtin`` annotation, so they stay
``alloca``s (one per thread, hoisted by LLVM), and the ``"tpp"`` TIR pipeline runs it
after TVM's default lowering. :func:`compile_kernels` is ``tvm.compile`` with it; the
Relax ``build`` and the tuning builder pass the same pipeline name.

Transcendentals outside TPPs (``exp``, ``tanh``, ``erf`` in a default-scheduled kernel, a
TE epilogue or a row's untensorized tail) would reach LLVM as ``llvm.exp.v16f32``, which
x86 has no instruction for: LLVM scalarizes it into 16 libm calls (a depthwise conv's SiLU
epilogue ran 8x longer than the convolution). Inside this pipeline's ``LowerIntrin``, fp32
calls lower to the ``vector_math`` forms the TPPs use (plain SIMD, a few ulp; with the AVX-512
forms for AVX-512 targets) instead; other builds in the process keep TVM's lowering.

On x86 every kernel runs with denormals flushed (MXCSR's FTZ and DAZ bits): a denormal
operand or result costs a microcode assist per instruction, and softmax weights of a -100
mask (Swin's shifted windows) are denormal, which made each window-attention matmul 80x
slower. :func:`flush_denormals` brackets the body with setting the bits and restoring the
calling thread's own mode, and sets them in the pool's workers (which keep them).

The pipeline also refuses, before LLVM sees them, kernels that import LLVM IR needing CPU
features the target lacks (a bf16 dot product for a CPU without AVX512_BF16 aborts the whole
process inside LLVM): :func:`required_features` reads them off the imported functions'
``"target-features"``, :func:`tpp_tvm.target.require_features` raises the error.

bf16 buffers a kernel allocates itself (attention's bf16 Q block and probabilities on AMX
tiles) stay 16-bit where a TPP takes them by address: :func:`keep_bf16_storage`, before
TVM's ``BF16ComputeLegalize`` would widen them to fp32.

For a target with emulated AMX tiles (``target("amx", emulate_tiles=True)``), the last pass
renames the tile instructions in every imported IR text to the software tile model's
functions (:mod:`tpp_tvm.intrinsics.amx_emulator`), and on a host without AVX-512 BF16 and
VNNI also puts the AVX-512 instructions of the kernels around the tiles in generic form.
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.runtime import Executable
from tvm.tirx import compilation_pipeline

from tpp_tvm.intrinsics import precision_template, vector_math
from tpp_tvm.intrinsics.amx import (
    TILE_CONFIG_ATTR,
    configure_tiles_per_task,
    interleave_tile_epilogues,
    read_whole_blocks_in_place,
)
from tpp_tvm.intrinsics.amx_emulator import EMULATED_FEATURES, emulate_tile_instructions
from tpp_tvm.intrinsics.llvm_ir import IRFunction, denormal_flushing, module_text
from tpp_tvm.intrinsics.prefetch import prefetch_next_panels
from tpp_tvm.runtime import target_threads
from tpp_tvm.target import require_features, tiles_emulated

#: Largest buffer kept on the stack. Worker threads have MiB-sized stacks; a register
#: tile's intermediates are a few KiB, an unrolled conv panel's tens of KiB.
STACK_LIMIT_BYTES = 64 * 1024
#: The TIR pipeline name that adds this pass (``tvm.compile(..., tir_pipeline=...)``).
PIPELINE = "tpp"
_DISABLE_LOWER = "disable_lower_builtin"  # tvm::tirx::transform::kDisableLowerTVMBuiltin


def _constant_bytes(buffer: tirx.Buffer) -> int | None:
    size = tvm.DataType(buffer.dtype)
    total = size.bits * max(size.lanes, 1) // 8
    for dim in buffer.shape:
        if not isinstance(dim, tirx.IntImm):
            return None
        total *= int(dim)
    return total


def _children(stmt: tirx.Stmt) -> list[tirx.Stmt]:
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return [s for s in (stmt.then_case, stmt.else_case) if s is not None]
    if isinstance(stmt, s_tir.stmt.SBlockRealize):
        return [stmt.block]
    if isinstance(stmt, s_tir.stmt.SBlock) and stmt.init is not None:
        return [stmt.init, stmt.body]
    body = getattr(stmt, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def _imports_bf16_dot_kernel(stmt: tirx.Stmt) -> bool:
    """Whether ``stmt`` calls the bf16 dot-product microkernel (imported LLVM IR)."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "pragma_import_llvm" \
            and "dpbf16ps" in str(getattr(stmt.value, "value", "")):
        return True
    return any(_imports_bf16_dot_kernel(child) for child in _children(stmt))


_TARGET_FEATURES = re.compile(r'"target-features"="([^"]*)"')


def _imported_llvm(stmt: tirx.Stmt) -> list[str]:
    """The LLVM IR texts a kernel imports with ``pragma_import_llvm``."""
    found = []
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "pragma_import_llvm":
        found.append(str(getattr(stmt.value, "value", "")))
    for child in _children(stmt):
        found.extend(_imported_llvm(child))
    return found


def required_features(func: tirx.PrimFunc) -> list[str]:
    """The LLVM CPU features (``avx512bf16``, ``amx-tile``, ...) the IR ``func`` imports
    was written for, in first-seen order."""
    features: dict[str, None] = {}
    for text in _imported_llvm(func.body):
        for group in _TARGET_FEATURES.findall(text):
            for feature in group.split(","):
                if feature.startswith("+"):
                    features.setdefault(feature[1:])
    return list(features)


def check_target_features(mod: tvm.IRModule) -> None:
    """Raise :class:`~tpp_tvm.errors.UnsupportedISAError` if a kernel of ``mod`` imports
    LLVM IR for features its target does not have."""
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
            continue
        target = func.attrs.get("target")
        if target is None or target.kind.name != "llvm":
            continue
        features = required_features(func)
        if tiles_emulated(target):
            features = [f for f in features if f not in EMULATED_FEATURES]
        if features:
            require_features(target, features, f"TPP kernel {gvar.name_hint!r}")


def _vector_temporary(buffer: tirx.Buffer) -> bool:
    """A one-vector ``local`` temporary (an equation TPP's running value)."""
    return buffer.scope() == "local" and all(
        isinstance(d, tirx.IntImm) and int(d) == 1 for d in buffer.shape)


def _on_stack(stmt: tirx.Stmt, keep_temporaries: bool = False) -> tirx.Stmt:
    """``stmt`` with every small AllocBuffer annotated; unchanged nodes are returned as is."""
    if isinstance(stmt, tirx.AllocBuffer):
        nbytes = _constant_bytes(stmt.buffer)
        if nbytes is None or nbytes > STACK_LIMIT_BYTES or _DISABLE_LOWER in stmt.annotations \
                or (keep_temporaries and _vector_temporary(stmt.buffer)):
            return stmt
        marked = {**dict(stmt.annotations), _DISABLE_LOWER: tirx.IntImm("int32", 1)}
        return tirx.AllocBuffer(stmt.buffer, marked)
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_on_stack(s, keep_temporaries) for s in stmt.seq]
        changed = any(a is not b for a, b in zip(seq, stmt.seq))
        return tirx.SeqStmt(seq, stmt.span) if changed else stmt
    if isinstance(stmt, tirx.For):
        body = _on_stack(stmt.body, keep_temporaries)
        if body is stmt.body:
            return stmt
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
                        stmt.thread_binding, stmt.annotations, stmt.step, stmt.span)
    if isinstance(stmt, tirx.AttrStmt):
        body = _on_stack(stmt.body, keep_temporaries)
        if body is stmt.body:
            return stmt
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body, stmt.span)
    if isinstance(stmt, tirx.IfThenElse):
        then_case = _on_stack(stmt.then_case, keep_temporaries)
        else_case = (None if stmt.else_case is None
                     else _on_stack(stmt.else_case, keep_temporaries))
        if then_case is stmt.then_case and else_case is stmt.else_case:
            return stmt
        return tirx.IfThenElse(stmt.condition, then_case, else_case, stmt.span)
    if isinstance(stmt, tirx.While):
        body = _on_stack(stmt.body, keep_temporaries)
        return stmt if body is stmt.body else tirx.While(stmt.condition, body, stmt.span)
    return stmt


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.StackAllocateSmallBuffers")
def stack_allocate_small_buffers(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Mark small constant-size allocations of CPU kernels to stay on the stack."""
    target = func.attrs.get("target") if func.attrs is not None else None
    if target is not None and target.kind.name not in ("llvm", "c"):
        return func
    # Measured exception: in a bf16 GEMM (64x4096x1024, GELU epilogue) LLVM, once the
    # equation's running value was a promotable alloca, rotated every hoisted constant
    # through registers per column step (3x slower epilogue); fp32 and int8 kernels gain
    # from it. There the temporary stays where TVM puts it.
    body = _on_stack(func.body, _imports_bf16_dot_kernel(func.body))
    return func if body is func.body else func.with_body(body)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.ConfigureTilesPerTask")
def configure_tiles(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """AMX kernels marked by their schedule load the tile configuration once per task."""
    block = func.attrs.get(TILE_CONFIG_ATTR) if func.attrs is not None else None
    if block is None:
        return func
    return configure_tiles_per_task(func, int(block[0]), int(block[1]))


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.InterleaveTileEpilogues")
def interleave_epilogues(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """AMX GEMMs run each block's epilogue between the next block's tile steps (lowered TIR,
    where the block loop is plain statements)."""
    if func.attrs is None or func.attrs.get(TILE_CONFIG_ATTR) is None:
        return func
    return interleave_tile_epilogues(func)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.ReadWholeBlocksInPlace")
def read_blocks_in_place(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Tile GEMMs with row-padded A copy only the partial block's rows (lowered TIR)."""
    return read_whole_blocks_in_place(func)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.PrefetchNextPanels")
def prefetch_panels(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Vector GEMMs marked by their schedule prefetch the next weight panel per tile."""
    return prefetch_next_panels(func)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.KeepBF16Storage")
def keep_bf16_storage(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """bf16 buffers a kernel allocates itself stay bf16 in memory where a TPP takes them by
    address (AMX tiles loading bf16 rows, the conversion TPP writing them).

    TVM's ``BF16ComputeLegalize`` widens every constant-size bf16 buffer a kernel allocates
    to fp32 (its loads and stores then convert) unless the buffer's data pointer is used as
    a raw value; an imported-IR kernel handed ``&buf[i]`` would then read and write it with
    the wrong element size. Each tensorized block that calls imported IR with bf16
    operands first evaluates their buffers' data pointers (scheduled TIR, before lowering):
    that is the raw use, inside the block that accesses the buffers (where StorageRewrite
    accepts it), and LLVM drops the unused values."""

    def mark(block: s_tir.SBlock) -> s_tir.SBlock:
        sources = [m.source.source for m in block.match_buffers
                   if m.source.source.dtype == "bfloat16"]
        if not sources or not _imports_llvm(block.body):
            return block
        body = tirx.SeqStmt([*(tirx.Evaluate(b.data) for b in sources),
                             block.body])
        return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                            block.init, block.alloc_buffers, block.match_buffers,
                            block.annotations)

    return func.with_body(tvm_ffi.structural_map(func.body, [(s_tir.SBlock, mark)]))


def _imports_llvm(stmt: tirx.Stmt) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, [(tirx.AttrStmt, lambda a: found.append(
        a.attr_key == "pragma_import_llvm"))])
    return any(found)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.EmulateTiles")
def emulate_tiles(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Kernels for a target with emulated tiles call the tile model instead of AMX."""
    target = func.attrs.get("target") if func.attrs is not None else None
    if not tiles_emulated(target or tvm.target.Target.current(allow_none=True)):
        return func

    vectors = not _runs_avx512_dot_products(target)

    def rename(stmt: tirx.AttrStmt) -> tirx.AttrStmt:
        if stmt.attr_key != "pragma_import_llvm":
            return stmt
        text = emulate_tile_instructions(str(stmt.value.value), vectors)
        return tirx.AttrStmt(stmt.node, stmt.attr_key, tvm.ir.StringImm(text), stmt.body)

    body = tvm_ffi.structural_map(func.body, [(tirx.AttrStmt, rename)])
    if vectors:  # the AVX-512 forms the TPP bodies were built with, in generic vector math
        body = tvm_ffi.structural_map(body, [(tvm.ir.Call, _generic_call)])
    return func.with_body(body)


def _generic_call(call: tvm.ir.Call) -> tvm.ir.Call | tirx.Expr:
    for form in (vector_math.generic_form, precision_template.generic_form):
        generic = form(call)
        if generic is not None:
            return generic
    return call


def _runs_avx512_dot_products(target: tvm.target.Target | None) -> bool:
    """Whether the (emulated-tile) target's CPU has the AVX-512 instructions the kernels
    around the tiles use; else (an AVX2 CPU, or AVX-512 without BF16/VNNI like Skylake)
    they are put in generic form."""
    target = target or tvm.target.Target.current(allow_none=True)
    return target is not None and bool(tvm.target.codegen.llvm_cpu_has_features(
        ["avx512f", "avx512bw", "avx512bf16", "avx512vnni"], target))


#: Annotation of the parallel loops whose iterations :func:`flush_denormals` flushes.
DENORMALS_FLUSHED = "tpp.denormals_flushed"


def _x86(target: tvm.target.Target | None) -> bool:
    """An LLVM target for x86 (its ``mtriple``, else the host's, as ``target.isa_of``)."""
    if target is None or target.kind.name != "llvm":
        return False
    triple = str(target.attrs.get("mtriple", "")) or str(
        tvm.target.codegen.llvm_get_system_triple())
    return triple.startswith(("x86_64", "i386", "i686"))


def _importing(fns: tuple[IRFunction, ...], stmts: list[tirx.Stmt]) -> tirx.Stmt:
    """``stmts`` with the LLVM IR of ``fns`` imported around them."""
    return tirx.AttrStmt(tirx.const(0, "int32"), "pragma_import_llvm",
                         tvm.ir.StringImm(module_text(*fns)), tirx.SeqStmt(stmts))


def _flushing(body: tirx.Stmt) -> tirx.Stmt:
    """``body`` run with MXCSR's FTZ and DAZ bits set, the caller's MXCSR restored after."""
    flush, restore, _ = denormal_flushing()
    old = tirx.Var("tpp_mxcsr", "int32")
    return _importing((flush, restore), [
        tirx.Bind(old, tirx.call_extern("int32", flush.name)), body,
        tirx.Evaluate(tirx.call_extern("void", restore.name, old))])


def _kept_flushed(body: tirx.Stmt) -> tirx.Stmt:
    """``body`` after setting FTZ and DAZ on this thread if they are not set yet."""
    _, _, keep = denormal_flushing()
    return _importing((keep,), [tirx.Evaluate(tirx.call_extern("void", keep.name)), body])


_FLOAT_MATH = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div)
_CALLS = ("tirx.call_extern", "tirx.call_llvm_pure_intrin", "tirx.call_llvm_intrin")


def _does_float_math(stmt: tirx.Stmt) -> bool:
    """Whether ``stmt`` does floating-point arithmetic or calls a microkernel (where a
    denormal costs an assist); copies, pads and layout changes only move values."""
    found = []

    def arithmetic(node: tirx.Expr) -> None:
        if not found and vector_math.dtype_of(node).startswith(("float", "bfloat")):
            found.append(node)

    def call(node: tirx.Call) -> None:
        if not found and node.op.name in _CALLS:
            found.append(node)

    tvm_ffi.structural_walk(stmt, [(_FLOAT_MATH, arithmetic), (tvm.ir.Call, call)])
    return bool(found)


def with_denormals_flushed(func: tirx.PrimFunc, threads: int) -> tirx.PrimFunc:
    """``func`` run with denormals flushed: the whole body on the calling thread (its own
    mode restored after), and, built for more than one thread, every parallel iteration on
    whichever worker runs it.

    MXCSR is per thread. A worker keeps the bits once set (1.6 ns per iteration to check;
    the pool's workers only run TVM tasks). Splitting each parallel loop into one task per
    thread, to set and restore once per task, made TVM keep a GEMM's whole C as one buffer
    instead of a tile per iteration (2x slower), so the loops keep their shape. Built for
    one thread, the pool runs everything on the calling thread and only the body is
    bracketed (a larger pool then runs such a kernel's loops unflushed: correct, only slower
    on denormals)."""
    def per_iteration(loop: tirx.For) -> tirx.For:
        if loop.kind != tirx.ForKind.PARALLEL or DENORMALS_FLUSHED in loop.annotations \
                or threads <= 1 or not _does_float_math(loop.body):
            return loop
        marks = {**dict(loop.annotations), DENORMALS_FLUSHED: tirx.IntImm("int32", 1)}
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                        _kept_flushed(loop.body), loop.thread_binding, marks, loop.step)

    body = tvm_ffi.structural_map(func.body, [(tirx.For, per_iteration)], order="pre")
    return func.with_body(_flushing(body))


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tpp.FlushDenormals")
def flush_denormals(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """x86 kernels run with denormals flushed to zero (see the module doc)."""
    target = func.attrs.get("target") if func.attrs is not None else None
    if not _x86(target):
        return func
    return with_denormals_flushed(func, target_threads(target))


#: TIR ops lowered to their ``vector_math`` form (fp32) while this pipeline finalizes.
FAST_OPS = ("exp", "tanh", "erf")
#: Per thread: a build on another thread (TVM's own pipeline) keeps TVM's lowering.
_FAST_SCOPE = vector_math.ThreadFlag()


def _fast_lowering(name: str):
    default = tvm.ir.Op.get(f"tirx.{name}").get_attr("llvm.FLowerIntrinsic")
    fast = getattr(vector_math, name)

    def lower(call: tirx.Call) -> tirx.Expr:
        if not _FAST_SCOPE.active or not vector_math.dtype_of(call).startswith("float32"):
            return default(call) if default is not None else call
        x = call.args[0]
        if isinstance(x, tirx.Var | tirx.FloatImm | tirx.Broadcast):
            return fast(x)
        # The forms read x several times: compute it once.
        v = tirx.Var("tpp_x", vector_math.dtype_of(x))
        return tirx.Let(v, x, fast(v))

    return lower


for _name in FAST_OPS:
    tvm.tirx.op.register_intrin_lowering(f"tirx.{_name}", "llvm", f=_fast_lowering(_name),
                                          level=99)


def _compiles_for_avx512(mod: tvm.IRModule) -> bool:
    """Whether ``mod``'s functions target an x86 CPU with AVX-512F (the vector math may then
    use AVX-512 instructions)."""
    for func in mod.functions.values():
        tgt = func.attrs.get("target") if func.attrs is not None else None
        if tgt is None or tgt.kind.name != "llvm":
            continue
        if "aarch64" in str(tgt.attrs.get("mtriple", "")):
            return False
        return bool(tvm.target.codegen.llvm_cpu_has_features(["avx512f"], tgt))
    return False


def _tpp_pipeline():
    base, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("default")

    @tvm.transform.module_pass(opt_level=0, name="tpp.TIRPipeline")
    def pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        check_target_features(mod)
        lowered = base(keep_bf16_storage(flush_denormals(configure_tiles(mod))))
        return emulate_tiles(stack_allocate_small_buffers(
            prefetch_panels(interleave_epilogues(read_blocks_in_place(lowered)))))

    def finalize_host_fast() -> tvm.transform.Pass:
        passes = finalize_host()

        @tvm.transform.module_pass(opt_level=0, name="tpp.FinalizeHost")
        def finalize(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
            with _FAST_SCOPE.on():
                if not _compiles_for_avx512(mod):
                    return passes(mod)
                with vector_math.avx512_forms():
                    return passes(mod)

        return finalize

    return pipeline, finalize_host_fast, finalize_device


compilation_pipeline.register_tir_pipeline(PIPELINE, _tpp_pipeline)


def compile_kernels(mod: tvm.IRModule | tirx.PrimFunc, target: tvm.target.Target | str
                    ) -> Executable:
    """``tvm.compile`` of TIR kernels through the ``"tpp"`` TIR pipeline."""
    return tvm.compile(mod, target=target, tir_pipeline=PIPELINE)
