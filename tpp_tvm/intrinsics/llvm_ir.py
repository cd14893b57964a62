"""Low-precision vector steps as LLVM IR text, for the operations TIR cannot express.

TIR in this TVM cannot carry LLVM's ``<32 x bfloat>`` operands (its bf16 legalisation turns
them into integers), so the x86 low-precision steps -- a VNNI dot product into a vector of
accumulators, and fp32 <-> bf16 conversion of one vector -- are small ``alwaysinline``
LLVM functions generated here. A TPP implementation imports them with
``T.attr(0, "pragma_import_llvm", text)`` and calls them with ``T.call_extern``; after
inlining, what remains is the instruction itself (``vdpbf16ps``, ``vpdpbusd``,
``vcvtneps2bf16``) on registers.

One generator serves every dtype and width: a :class:`DotOp` row says which instruction,
element types and VNNI factor; ``width`` below the lane count makes the step load only
``width`` columns (a constant mask), so tails never touch memory past a tile.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedDTypeError

_LLVM_TYPES = {"float32": "float", "bfloat16": "bfloat", "int32": "i32", "int8": "i8",
               "uint8": "i8"}


@dataclass(frozen=True)
class DotOp:
    """A dot-product instruction: ``acc[l] += sum_v a[l, v] * b[l, v]`` over ``vnni`` pairs.

    ``intrinsic`` takes (acc, a, b) as ``<lanes x acc>``, ``<lanes*vnni x a>``,
    ``<lanes*vnni x b>``; ``features`` is what the calling function must be compiled with.
    """

    intrinsic: str
    acc_dtype: str
    vnni: int
    features: str


#: x86 dot products by (A dtype, B dtype), 512-bit (16 accumulator lanes).
X86_DOT: dict[tuple[str, str], DotOp] = {
    ("bfloat16", "bfloat16"): DotOp("llvm.x86.avx512bf16.dpbf16ps.512", "float32", 2,
                                    "+avx512f,+avx512bf16"),
    ("uint8", "int8"): DotOp("llvm.x86.avx512.vpdpbusd.512", "int32", 4,
                             "+avx512f,+avx512vnni"),
}


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
    return {"float32": "f32", "bfloat16": "bf16", "int32": "i32", "int8": "i8",
            "uint8": "i8"}[dtype]


def dot_step(a_dtype: str, b_dtype: str, lanes: int, width: int) -> IRFunction:
    """``acc' = dot(acc, broadcast(A[vnni elements at a]), B[lanes x vnni at b])``.

    Signature ``<lanes x acc> name(<lanes x acc> acc, ptr a, ptr b)``: the ``vnni``
    consecutive A elements of one row (one 32-bit group) meet ``width`` columns of a VNNI
    row of B (``width * vnni`` contiguous elements; lanes past ``width`` read as zero).
    """
    op = X86_DOT.get((a_dtype, b_dtype))
    if op is None or lanes != 16:
        raise UnsupportedDTypeError(
            f"no x86 dot-product step for {a_dtype} x {b_dtype} at {lanes} lanes; supported: "
            + ", ".join(f"{a} x {b}" for a, b in X86_DOT) + " at 16 lanes (512-bit)")
    v, acc = op.vnni, _vec(lanes, op.acc_dtype)
    at, bt = _vec(lanes * v, a_dtype), _vec(lanes * v, b_dtype)
    name = f"tpp_dot_{_suffix(a_dtype)}{_suffix(b_dtype)}_{lanes}x{v}_w{width}"
    load_b, decl_b = _masked_load("%bv", lanes * v, b_dtype, "%b", width * v)
    definition = "\n".join([
        f"define linkonce_odr {acc} @{name}({acc} %acc, ptr %a, ptr %b) #ATTRS {{",
        "  %a32 = load i32, ptr %a, align 1",
        f"  %a1 = insertelement <{lanes} x i32> poison, i32 %a32, i64 0",
        f"  %as = shufflevector <{lanes} x i32> %a1, <{lanes} x i32> poison, "
        f"<{lanes} x i32> zeroinitializer",
        f"  %av = bitcast <{lanes} x i32> %as to {at}",
        load_b,
        f"  %r = call {acc} @{op.intrinsic}({acc} %acc, {at} %av, {bt} %bv)",
        f"  ret {acc} %r",
        "}",
    ])
    declares = tuple(d for d in (f"declare {acc} @{op.intrinsic}({acc}, {at}, {bt})", decl_b)
                     if d)
    return IRFunction(name, definition, declares, op.features)


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
