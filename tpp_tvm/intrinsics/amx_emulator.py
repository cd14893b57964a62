"""AMX tile kernels run without AMX: a software model of the tile unit (``amx_emulator.c``)
that kernels compiled for an *emulated* AMX target call in place of the tile instructions.

Why: most machines that build and test tpp_tvm have no AMX, and there the tile kernels were
only compiled and read as assembly, which cannot catch a tile stride, a K step or a block
offset that is wrong but well formed. With the model, the very kernels an AMX CPU runs (the
same LLVM IR, with ``llvm.x86.tdpbf16ps`` and friends renamed to the model's functions, and
the rest compiled for the host) compute real results that tests compare with numpy and ONNX
Runtime, whole bf16 and int8 models included. It is for checking, not speed: one emulated
tile product costs about a microsecond.

On a host without AVX-512 BF16 and VNNI (an AVX2 CPU, or a Skylake-era AVX-512 one) the
kernels around the tiles, written for those, are compiled for the host as well: their
AVX-512 dot products become generic-IR functions (:data:`VECTOR_DOTS`), the TPP bodies'
AVX-512 forms generic vector math (``vector_math.generic_form``), and fp32 -> bf16
conversions, which LLVM then lowers to a call of ``__truncsfbf2``, find that routine in
the model's library.

:func:`tpp_tvm.target.target` ``("amx", emulate_tiles=True)`` makes such a target; the
``tpp`` TIR pipeline rewrites its kernels' imported IR with :func:`emulate_tile_instructions`;
:func:`library` builds the model with the host's C compiler once (cached by its source's
hash) and loads it into the process's global symbol scope, where both JIT-compiled kernels
and exported libraries find it. Misuse the hardware would fault on (no configuration, a tile
outside it, shapes that do not chain) is recorded, not executed: :func:`check` raises it.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

from ..errors import ExecutionError, UnsupportedISAError
from ..native import NativeBuildError, load_library

#: The tile instructions the model implements, as LLVM names them (``llvm.x86.<name>``).
TILE_INSTRUCTIONS: tuple[str, ...] = ("ldtilecfg", "tilerelease", "tilezero", "tileloadd64",
                                      "tilestored64", "tdpbf16ps", "tdpbusd", "tdpbssd")
#: Prefix of the model's functions (``tpp_amx_emu_<name>``).
SYMBOL_PREFIX = "tpp_amx_emu_"
_SOURCE = Path(__file__).with_name("amx_emulator.c")
_INTRINSIC = re.compile(r"@llvm\.x86\.(" + "|".join(TILE_INSTRUCTIONS) + r")\b")


def emulate_tile_instructions(text: str, vector_instructions: bool = False) -> str:
    """LLVM IR ``text`` with every tile instruction a call of the model's function (their
    declarations lose ``immarg``, which only intrinsics may carry).

    ``vector_instructions`` (a host without AVX-512 BF16/VNNI): the AVX-512 dot products too,
    each then a call of a generic-IR function defined in the text (:data:`VECTOR_DOTS`),
    and the functions' ``target-features`` without the AVX-512 and AMX features, so LLVM
    compiles the kernels around the tiles for the host's vector unit (AVX2 splits each
    512-bit vector in two). Raises :class:`UnsupportedISAError` naming any AVX-512
    intrinsic left that the host could not run."""
    lines, used = [], []
    for line in text.split("\n"):
        renamed = _INTRINSIC.sub("@" + SYMBOL_PREFIX + r"\1", line)
        if renamed != line and renamed.startswith("declare "):
            renamed = renamed.replace(" immarg", "")
        if vector_instructions:
            if renamed.startswith("declare ") and _VECTOR_DOT.search(renamed):
                continue  # defined below instead
            renamed, found = _VECTOR_DOT.subn(lambda m: "@" + _dot_function(m[1]), renamed)
            if found:
                used.extend(_VECTOR_DOT.findall(line))
            renamed = _FEATURES.sub(_host_features, renamed)
        lines.append(renamed)
    if vector_instructions:
        left = sorted(set(re.findall(r"@llvm\.x86\.avx512[\w.]*", "\n".join(lines))))
        if left:
            raise UnsupportedISAError(
                f"emulated AMX tiles on a host without AVX-512: no generic form of "
                f"{', '.join(left)} (emulated: {', '.join(VECTOR_DOTS)})")
        lines.extend(VECTOR_DOTS[name] for name in dict.fromkeys(used))
    return "\n".join(lines)


def _lane_indices(count: int, start: int, step: int) -> str:
    return "<" + ", ".join(f"i32 {start + step * i}" for i in range(count)) + ">"


def _dot_definition(name: str, operand: str, widen: tuple[str, str], wide: str,
                    products: int) -> str:
    """A 16-lane dot product in generic IR: the accumulator plus, per lane, the ``products``
    adjacent products of the widened operands, added in the instruction's order (the odd
    bf16 product first, as Intel's pseudocode for ``vdpbf16ps``)."""
    mul = "fmul" if wide == "float" else "mul"
    add = "fadd" if wide == "float" else "add"
    n = 16 * products
    body = [f"define linkonce_odr <16 x {wide}> @{_dot_function(name)}(<16 x {wide}> %acc, "
            f"<{n} x {operand}> %a, <{n} x {operand}> %b) alwaysinline {{",
            f"  %aw = {widen[0]} <{n} x {operand}> %a to <{n} x {wide}>",
            f"  %bw = {widen[1]} <{n} x {operand}> %b to <{n} x {wide}>",
            f"  %p = {mul} <{n} x {wide}> %aw, %bw"]
    order = [1, 0] if wide == "float" else list(range(products))
    total = "%acc"
    for j in order:
        body += [f"  %p{j} = shufflevector <{n} x {wide}> %p, <{n} x {wide}> poison, "
                 f"<16 x i32> {_lane_indices(16, j, products)}",
                 f"  %s{j} = {add} <16 x {wide}> {total}, %p{j}"]
        total = f"%s{j}"
    return "\n".join([*body, f"  ret <16 x {wide}> {total}", "}"])


def _dot_function(intrinsic: str) -> str:
    return SYMBOL_PREFIX + intrinsic.rsplit(".", 2)[-2]


#: The AVX-512 dot products of the kernels around the tiles (``llvm_ir.X86_DOT``), by LLVM
#: name, as generic-IR definitions: what a host without AVX-512 runs in their place.
VECTOR_DOTS: dict[str, str] = {
    "avx512bf16.dpbf16ps.512": _dot_definition("avx512bf16.dpbf16ps.512", "bfloat",
                                               ("fpext", "fpext"), "float", 2),
    "avx512.vpdpbusd.512": _dot_definition("avx512.vpdpbusd.512", "i8",
                                           ("zext", "sext"), "i32", 4),
}
#: The CPU features an emulated target provides whatever its host has: the tiles, and the
#: AVX-512 ones of the kernels around them (on a host without AVX-512: :data:`VECTOR_DOTS`).
EMULATED_FEATURES = ("amx-tile", "amx-bf16", "amx-int8", "avx512f", "avx512bw", "avx512bf16",
                     "avx512vnni")
_VECTOR_DOT = re.compile(r"@llvm\.x86\.(" + "|".join(re.escape(k) for k in VECTOR_DOTS)
                         + r")\b")
_FEATURES = re.compile(r'"target-features"="([^"]*)"')


def _host_features(match: re.Match) -> str:
    kept = [f for f in match[1].split(",") if not f.lstrip("+-").startswith(("avx512", "amx"))]
    return f'"target-features"="{",".join(kept)}"'


@functools.cache
def library() -> ctypes.CDLL:
    """The tile model, built once per source version and loaded with ``RTLD_GLOBAL``."""
    try:
        lib = load_library(_SOURCE, mode=ctypes.RTLD_GLOBAL)
    except NativeBuildError as exc:
        raise UnsupportedISAError(f"emulating AMX tiles needs the tile model: {exc}") from exc
    lib.tpp_amx_emu_fault.restype = ctypes.c_char_p
    lib.tpp_amx_emu_products.restype = ctypes.c_ulonglong
    return lib


def reset() -> None:
    """Forget a recorded fault and zero the product count."""
    library().tpp_amx_emu_reset()


def products() -> int:
    """Tile products (``tdpbf16ps``, ``tdpbusd``, ``tdpbssd``) run since the last :func:`reset`."""
    return int(library().tpp_amx_emu_products())


def check(what: str) -> None:
    """Raise :class:`ExecutionError` if an emulated tile instruction faulted (where AMX
    hardware would raise #UD), naming ``what`` ran and the instruction's shapes."""
    fault = library().tpp_amx_emu_fault()
    if fault:
        reset()
        raise ExecutionError(f"{what}: an emulated AMX tile instruction faulted (AMX "
                             f"hardware would raise #UD): {fault.decode()}")
