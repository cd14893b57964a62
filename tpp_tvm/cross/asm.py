"""Reading compiled kernels' assembly: functions, innermost loops, instruction classes.

Used to check that SVE kernels really run SVE (not NEON) in their hot loops and to count
the instructions of each inner loop next to the AVX-512 build (``benchmarks/
sve_instructions.py``). Works on ``objdump -d --no-show-raw-insn`` text of either ISA.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_FUNC = re.compile(r"^([0-9a-f]+) <([^>]+)>:$")
_INSN = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
_TARGET = re.compile(r"\b([0-9a-f]+) <")
# aarch64: z registers and predicates are SVE; v registers with an arrangement are NEON.
_SVE_REG = re.compile(r"\b[zp]\d+(\.[bhsdq])?\b|\bp\d+/[mz]\b")
_SVE_ONLY = {"whilelo", "whilelt", "ptrue", "pfalse", "cntw", "cntb", "cnth", "cntd", "rdvl",
             "addvl", "incw", "incb", "inch", "incd", "decw", "ptest"}
_NEON_REG = re.compile(r"\bv\d+\.\d*[bhsd]\b")
# x86: zmm is AVX-512, ymm/xmm vector code (scalar ss/sd instructions use xmm too).
_X86_VEC = re.compile(r"%[xyz]mm\d+")


@dataclass(frozen=True)
class Insn:
    address: int
    mnemonic: str
    operands: str

    @property
    def branch_target(self) -> int | None:
        if self.mnemonic in ("bl", "blr", "call", "callq"):
            return None  # calls return; they do not loop
        if not (self.mnemonic.startswith(("b", "j", "cb", "tb")) and "<" in self.operands):
            return None
        m = _TARGET.search(self.operands)
        return int(m.group(1), 16) if m else None

    @property
    def kind(self) -> str:
        """``sve``, ``neon``, ``avx512``, ``x86vec``, ``zeroing`` or ``scalar``."""
        ops, mn = self.operands, self.mnemonic
        if mn == "movi" and ops.endswith(", #0x0"):
            return "zeroing"  # how LLVM zeroes a whole z register (a v write clears its top)
        if _SVE_REG.search(ops) or mn in _SVE_ONLY:
            return "sve"
        if _NEON_REG.search(ops):
            return "neon"
        if "%zmm" in ops or re.search(r"%k[0-7]\b", ops):
            return "avx512"
        if _X86_VEC.search(ops) and not mn.endswith(("ss", "sd", "si2ss", "si2sd")):
            return "x86vec"
        return "scalar"


def functions(objdump: str) -> dict[str, list[Insn]]:
    """Instructions of every function in ``objdump -d`` output, by symbol name."""
    out: dict[str, list[Insn]] = {}
    current: list[Insn] | None = None
    for line in objdump.splitlines():
        if m := _FUNC.match(line):
            current = out.setdefault(m.group(2), [])
        elif current is not None and (m := _INSN.match(line)):
            current.append(Insn(int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def loops(insns: list[Insn]) -> list[list[Insn]]:
    """Every loop (a backward branch and the code it jumps back over), in code order.

    A backward jump over a return is a shared tail block (tail merging), not a loop.
    """
    found = []
    for i, insn in enumerate(insns):
        target = insn.branch_target
        if target is not None and insns[0].address <= target <= insn.address:
            body = [x for x in insns[: i + 1] if x.address >= target]
            if not any(x.mnemonic in ("ret", "retq") for x in body):
                found.append(body)
    return sorted(found, key=lambda lp: lp[0].address)


def innermost_loops(insns: list[Insn]) -> list[list[Insn]]:
    """Loops that contain no other loop."""
    all_loops = loops(insns)
    spans = [(lp[0].address, lp[-1].address) for lp in all_loops]
    inner = []
    for lp, (lo, hi) in zip(all_loops, spans, strict=True):
        if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in spans):
            inner.append(lp)
    return inner


_VECTOR_KINDS = ("sve", "neon", "avx512", "x86vec")
_FMA_PREFIXES = ("vfmadd", "vfnmadd", "vfmsub", "vfnmsub", "fmla", "fmad", "fmls", "fmsb",
                 "fnmla", "fnmls", "fnmad", "fnmsb")


def is_vector(insn: Insn) -> bool:
    return insn.kind in _VECTOR_KINDS


def is_fma(insn: Insn) -> bool:
    return is_vector(insn) and insn.mnemonic.startswith(_FMA_PREFIXES)


def _operands(text: str) -> list[str]:
    """Operands split at top-level commas (x86 memory operands have commas in parentheses)."""
    text = text.split("//")[0]  # aarch64 comment
    if "%" in text:
        text = text.split("#")[0]  # x86 (AT&T) comment; aarch64 immediates also use '#'
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()] if current.strip() else parts


def _x86_memory(operand: str) -> bool:
    return "(" in operand and not operand.startswith("<")


def is_load(insn: Insn) -> bool:
    """A memory read: aarch64 ``ld*``; x86 a memory source operand (AT&T: not the last)."""
    if insn.mnemonic.startswith(("ld", "prf")):
        return True
    if "%" not in insn.operands or insn.mnemonic.startswith(("lea", "nop")):
        return False
    return any(_x86_memory(op) for op in _operands(insn.operands)[:-1])


def is_store(insn: Insn) -> bool:
    if insn.mnemonic.startswith("st"):
        return True
    ops = _operands(insn.operands) if "%" in insn.operands else []
    return bool(ops) and _x86_memory(ops[-1]) and not insn.mnemonic.startswith(("lea", "nop"))


def hot_loop(insns: list[Insn]) -> list[Insn]:
    """The innermost loop with the most vector instructions (empty if there is no loop)."""
    inner = innermost_loops(insns)
    return max(inner, key=lambda lp: sum(map(is_vector, lp)), default=[])


def kinds(insns: list[Insn]) -> Counter:
    """How many instructions of each :attr:`Insn.kind`."""
    return Counter(x.kind for x in insns)


def mnemonics(insns: list[Insn]) -> Counter:
    return Counter(x.mnemonic for x in insns)
