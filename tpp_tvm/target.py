"""The TPP target and host ISA detection, in one place.

This is the only module that reads ``/proc/cpuinfo`` (and the cache/topology files in sysfs):
everything else asks :func:`host_isa` what the CPU can do, and :func:`target` for the TVM
target to compile for. A TPP target is an ordinary ``llvm`` target whose keys include
``"tpp"``; the graph pipeline offloads to TPPs only for such targets.

Three ISAs have TPP implementations, each registered as a target tag:

======== ============== ===================================================================
ISA      tag            config
======== ============== ===================================================================
avx512   ``tpp/avx512`` x86-64, ``mcpu`` = the host CPU when it has AVX-512, else
                        ``skylake-avx512``
amx      ``tpp/amx``    x86-64, ``mcpu`` = the host CPU when it has AMX-BF16, else
                        ``sapphirerapids``
sve      ``tpp/sve``    ``mtriple=aarch64-linux-gnu``, ``mattr=+v8.2a,+sve`` (vector-length
                        agnostic code, so no vector length is baked into the target)
======== ============== ===================================================================

The tags themselves are portable (``skylake-avx512``/``sapphirerapids``, no core count);
:func:`target` starts from the tag and overrides ``mcpu``, ``mattr`` and ``num-cores`` for
this host: ``mcpu`` is LLVM's name for the host CPU (its scheduling model), ``mattr`` the
TPP-relevant features ``/proc/cpuinfo`` reports (LLVM's name can be wrong about them).
:func:`require_features` is the check every kernel build makes before LLVM sees the code.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvm.target import Target, codegen
from tvm.target.tag import list_tags, register_tag

from tpp_tvm.errors import UnsupportedISAError

ISAS: tuple[str, ...] = ("amx", "avx512", "avx2", "sve")
"""ISAs with TPP implementations, in order of preference for :func:`best_isa`."""

TAG_PREFIX = "tpp/"
EMULATED_TILES_KEY = "tpp-amx-emulated"
"""Target key of an AMX target whose tile instructions call a software model of the tile
unit (``intrinsics/amx_emulator.py``): for testing tile kernels on CPUs without AMX."""

_CPUINFO = Path("/proc/cpuinfo")
_SYS_CPU = Path("/sys/devices/system/cpu")
#: The CPU bandwidth limit a container runtime sets: cgroup v2's ``cpu.max`` ("quota period"
#: or "max period"), else cgroup v1's quota and period files.
_CGROUP = Path("/sys/fs/cgroup")

# Linux constants for the two OS queries below (asm/prctl.h, linux/prctl.h).
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_PR_SVE_GET_VL = 51
_PR_SVE_VL_LEN_MASK = 0xFFFF

# x86 flags in /proc/cpuinfo that become HostISA fields of the same name, with the LLVM
# feature each one is (what a host target's ``mattr`` says, +present or -absent).
X86_LLVM_FEATURES: dict[str, str] = {
    "avx2": "avx2",
    "fma": "fma",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512_vnni": "avx512vnni",
    "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16",
    "amx_tile": "amx-tile",
    "amx_bf16": "amx-bf16",
    "amx_int8": "amx-int8",
}
_X86_FLAGS = tuple(X86_LLVM_FEATURES)


@dataclass(frozen=True)
class HostISA:
    """What the host CPU offers to TPP kernels.

    Flags come from ``/proc/cpuinfo`` (so they reflect what the kernel exposes, including
    hypervisor masking). Cache sizes are cpu0's view in bytes: L1d and L2 are per core, L3 is
    the (shared) slice cpu0 belongs to; ``None`` when sysfs does not say.
    """

    arch: str
    model_name: str = "unknown"
    avx2: bool = False
    fma: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512_vnni: bool = False
    avx512_bf16: bool = False
    avx512_fp16: bool = False
    amx_tile: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    amx_permitted: bool = False
    """Whether the OS granted this process AMX tile state (requested during detection)."""
    sve: bool = False
    sve_vector_bits: int | None = None
    """The SVE vector length of this process, in bits (aarch64 with SVE only)."""
    l1d_bytes: int | None = None
    l2_bytes: int | None = None
    l3_bytes: int | None = None
    physical_cores: int = 1
    """Physical cores this process may run on (SMT siblings counted once)."""

    def llvm_mattr(self) -> list[str]:
        """The TPP-relevant LLVM features as this CPU really has them (``+f``/``-f``).

        LLVM names a CPU from its model number, which a hypervisor may report for an older
        core (a Sapphire Rapids Xeon seen as ``rocketlake``, without AVX512_BF16), or with
        features masked; a host target carries these so code matches ``/proc/cpuinfo``.
        """
        if self.arch != "x86_64":
            return []
        return [("+" if getattr(self, flag) else "-") + feature
                for flag, feature in X86_LLVM_FEATURES.items()]

    def summary(self) -> str:
        """One line for logs and benchmark headers, e.g. ``x86_64 AVX-512 F/BW/VL ...``."""
        parts = [self.arch]
        if self.avx512f:
            subsets = [
                name
                for name, present in (
                    ("F", self.avx512f),
                    ("BW", self.avx512bw),
                    ("VL", self.avx512vl),
                    ("VNNI", self.avx512_vnni),
                    ("BF16", self.avx512_bf16),
                    ("FP16", self.avx512_fp16),
                )
                if present
            ]
            parts.append("AVX-512 " + "/".join(subsets))
        elif self.avx2:
            parts.append("AVX2" + ("/FMA" if self.fma else "") + ", no AVX-512")
        if self.amx_tile:
            kinds = [n for n, p in (("BF16", self.amx_bf16), ("INT8", self.amx_int8)) if p]
            permitted = "permitted" if self.amx_permitted else "NOT permitted by the OS"
            parts.append(f"AMX {'/'.join(kinds)} ({permitted})")
        elif self.arch == "x86_64":
            parts.append("no AMX")
        if self.sve:
            bits = f" {self.sve_vector_bits}-bit" if self.sve_vector_bits else ""
            parts.append(f"SVE{bits}")
        caches = [
            f"{name} {_fmt_bytes(size)}"
            for name, size in (
                ("L1d", self.l1d_bytes),
                ("L2", self.l2_bytes),
                ("L3", self.l3_bytes),
            )
            if size
        ]
        parts.append(", ".join(caches + [f"{self.physical_cores} cores"]))
        return "; ".join(parts)


def _fmt_bytes(size: int) -> str:
    if size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    return f"{size >> 10} KiB"


def normalize_arch(machine: str) -> str:
    """Map ``platform.machine()`` spellings onto ``x86_64`` / ``aarch64``."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if machine in ("aarch64", "arm64"):
        return "aarch64"
    return machine


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """Return (model name, feature flags) of the first processor in ``/proc/cpuinfo`` text.

    x86 lists features under ``flags``; aarch64 under ``Features`` and has no model name
    (then the implementer/part codes are used).
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # end of the first processor block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    flags = frozenset((fields.get("flags") or fields.get("features") or "").split())
    model = fields.get("model name")
    if not model and "cpu implementer" in fields:
        model = f"implementer {fields['cpu implementer']} part {fields.get('cpu part', '?')}"
    return model or "unknown", flags


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMGB") or 0) * scale


def read_cache_sizes(cache_dir: Path = _SYS_CPU / "cpu0" / "cache") -> dict[str, int]:
    """Cache sizes in bytes seen by cpu0, keyed ``l1d``/``l2``/``l3``; missing levels absent."""
    sizes: dict[str, int] = {}
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        key = "l1d" if level == "1" else f"l{level}"
        sizes.setdefault(key, size)
    return sizes


def cpu_quota(root: Path = _CGROUP) -> int | None:
    """CPUs' worth of time this process's cgroup may use (its quota over its period, rounded
    up), or None where no limit is set: a container given 2 CPUs on a 64-core host still
    sees 64 in its affinity mask, and a pool of 64 threads there waits on the scheduler."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no limit
        return None
    return max(1, -(-q // p)) if q > 0 and p > 0 else None


def physical_core_count() -> int:
    """Physical cores in this process's CPU affinity set (SMT siblings counted once), at most
    the cgroup's CPU quota."""
    quota = cpu_quota()
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return min(os.cpu_count() or 1, quota or os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        siblings = _SYS_CPU / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, min(len(cores), quota or len(cores)))


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def request_amx_permission(flags: frozenset[str]) -> bool:
    """Ask Linux for AMX tile state (needed before the first tile instruction).

    Only attempted on x86-64 Linux when the CPU reports ``amx_tile``; returns whether granted.
    """
    if "amx_tile" not in flags or not sys.platform.startswith("linux"):
        return False
    if normalize_arch(platform.machine()) != "x86_64":
        return False
    libc = _libc()
    if libc is None:
        return False
    ret = libc.syscall(
        ctypes.c_long(_SYS_ARCH_PRCTL),
        ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
        ctypes.c_ulong(_XFEATURE_XTILEDATA),
    )
    return ret == 0


def sve_vector_bits(flags: frozenset[str]) -> int | None:
    """This process's SVE vector length in bits via ``prctl(PR_SVE_GET_VL)``; None without SVE."""
    if "sve" not in flags or not sys.platform.startswith("linux"):
        return None
    if normalize_arch(platform.machine()) != "aarch64":
        return None
    libc = _libc()
    if libc is None:
        return None
    ret = libc.prctl(ctypes.c_int(_PR_SVE_GET_VL), 0, 0, 0, 0)
    if ret < 0:
        return None
    return (ret & _PR_SVE_VL_LEN_MASK) * 8


def detect_host(cpuinfo: str | None = None, arch: str | None = None) -> HostISA:
    """Build a :class:`HostISA` from ``/proc/cpuinfo`` text (read when not given) and the OS.

    Passing ``cpuinfo``/``arch`` makes the flag parsing testable; cache sizes, core count and
    the AMX/SVE OS queries always describe the real host, and the queries only run when the
    flags say the feature exists.
    """
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    arch = normalize_arch(arch or platform.machine())
    model, flags = parse_cpuinfo(cpuinfo)
    caches = read_cache_sizes()
    x86 = {name: arch == "x86_64" and name in flags for name in _X86_FLAGS}
    sve = arch == "aarch64" and "sve" in flags
    return HostISA(
        arch=arch,
        model_name=model,
        **x86,
        amx_permitted=x86["amx_tile"] and request_amx_permission(flags),
        sve=sve,
        sve_vector_bits=sve_vector_bits(flags) if sve else None,
        l1d_bytes=caches.get("l1d"),
        l2_bytes=caches.get("l2"),
        l3_bytes=caches.get("l3"),
        physical_cores=physical_core_count(),
    )


@functools.cache
def host_isa() -> HostISA:
    """The host's :class:`HostISA`, detected once per process."""
    return detect_host()


def best_isa(host: HostISA | None = None) -> str:
    """The fastest TPP ISA the host can run: ``amx``, then ``avx512``, ``avx2``, ``sve``."""
    host = host or host_isa()
    if host.amx_bf16 and host.amx_permitted:
        return "amx"
    if host.avx512f:
        return "avx512"
    if host.avx2 and host.fma:
        return "avx2"
    if host.sve:
        return "sve"
    raise UnsupportedISAError(
        f"no TPP ISA on this host ({host.model_name}: {host.summary()}); "
        f"tpp_tvm needs one of AMX-BF16 (OS-permitted), AVX-512F, AVX2 with FMA, or SVE"
    )


_TAG_CONFIGS: dict[str, dict[str, Any]] = {
    "avx512": {"kind": "llvm", "keys": ["tpp", "cpu"], "mcpu": "skylake-avx512"},
    "amx": {"kind": "llvm", "keys": ["tpp", "cpu"], "mcpu": "sapphirerapids"},
    "avx2": {"kind": "llvm", "keys": ["tpp", "cpu"], "mcpu": "haswell"},
    "sve": {
        "kind": "llvm",
        "keys": ["tpp", "cpu"],
        "mtriple": "aarch64-linux-gnu",
        "mattr": ["+v8.2a", "+sve"],
    },
}


def _register_tags() -> None:
    """Register ``tpp/<isa>`` tags once per process (TVM refuses to redefine a tag)."""
    existing = list_tags() or {}
    for isa, config in _TAG_CONFIGS.items():
        name = TAG_PREFIX + isa
        if name not in existing:
            register_tag(name, config)


_register_tags()


@functools.cache
def _host_mcpu() -> str | None:
    """LLVM's name for the host CPU if the host is x86-64 and LLVM knows it."""
    if host_isa().arch != "x86_64":
        return None
    cpu = str(codegen.llvm_get_system_cpu())
    if not cpu or cpu == "generic":
        return None
    try:
        codegen.llvm_cpu_has_features(["avx512f"], Target({"kind": "llvm", "mcpu": cpu}))
    except (RuntimeError, ValueError):  # TVM raises InternalError (a RuntimeError)
        return None
    return cpu


def _check_isa(isa: str) -> str:
    if isa not in ISAS:
        raise UnsupportedISAError(
            f"unknown TPP ISA {isa!r}; valid ISAs are: {', '.join(sorted(ISAS))}"
        )
    return isa


def target_config(isa: str, num_cores: int) -> dict[str, Any]:
    """The JSON config of the TPP target for ``isa`` on this host (see :func:`target`)."""
    _check_isa(isa)
    config: dict[str, Any] = {"tag": TAG_PREFIX + isa, "num-cores": int(num_cores)}
    host = host_isa()
    # The host's CPU where it is that ISA's machine; an avx2 target on an AVX-512 host keeps
    # the tag's Haswell, so its kernels stay AVX2 (LLVM would widen loops to zmm otherwise).
    if ((isa == "avx512" and host.avx512f) or (isa == "amx" and host.amx_bf16)
            or (isa == "avx2" and host.avx2 and host.fma and not host.avx512f)):
        mcpu = _host_mcpu()
        if mcpu:
            config["mcpu"] = mcpu
            config["mattr"] = host.llvm_mattr()
    return config


def missing_features(tgt: Target | str | dict[str, Any], features: list[str] | tuple[str, ...]
                     ) -> list[str]:
    """The LLVM ``features`` (``avx512bf16``, ``amx-tile``, ...) that ``tgt`` lacks."""
    tgt = _as_target(tgt)
    return [f for f in features if not codegen.llvm_cpu_has_features([f], tgt)]


def describe_cpu(tgt: Target | str | dict[str, Any]) -> str:
    """``mcpu`` and ``mattr`` of a target, for error messages."""
    tgt = _as_target(tgt)
    mcpu = str(tgt.attrs.get("mcpu", "")) or "the default CPU"
    mattr = [str(a) for a in tgt.attrs.get("mattr", [])]
    return mcpu + (f" (mattr {','.join(mattr)})" if mattr else "")


def require_features(tgt: Target | str | dict[str, Any], features: list[str] | tuple[str, ...],
                     what: str) -> None:
    """Refuse to build ``what`` for a target without ``features``: a clear
    :class:`UnsupportedISAError` instead of LLVM aborting the process (it does, e.g. on a
    bf16 dot product for a CPU without AVX512_BF16)."""
    missing = missing_features(tgt, features)
    if missing:
        raise UnsupportedISAError(
            f"{what} needs the CPU features {', '.join(missing)}, which the target CPU "
            f"{describe_cpu(tgt)} lacks; build it for a CPU that has them (target mcpu/mattr) "
            "or choose a precision this CPU has")


def target(isa: str | None = None, num_cores: int | None = None, *,
           emulate_tiles: bool = False) -> Target:
    """The TPP target for ``isa`` (default: :func:`best_isa` of the host).

    ``num_cores`` (default: the host's physical cores) is the ``num-cores`` attribute that
    MetaSchedule and the parallel schedules size their thread work by. Cross-compiling is
    fine: ``target("sve")`` works on an x86 host.

    ``emulate_tiles`` (``amx`` only): the AMX kernels, compiled for this host's CPU, with
    every tile instruction a call of the software tile model (on a CPU without AVX-512 BF16
    and VNNI, the AVX-512 instructions around the tiles in generic vector code too), so tile
    kernels and models run (slowly) where the CPU has no AMX: for tests, never for speed.
    """
    isa = _check_isa(isa) if isa is not None else best_isa()
    if num_cores is None:
        num_cores = host_isa().physical_cores
    if num_cores < 1:
        raise ValueError(f"num_cores must be >= 1, got {num_cores}")
    config = target_config(isa, num_cores)
    if emulate_tiles:
        config.update(_emulated_tiles_config(isa))
    return Target(config)


def _emulated_tiles_config(isa: str) -> dict[str, Any]:
    """``keys``, ``mcpu`` and ``mattr`` of an AMX target with emulated tiles on this host."""
    host = host_isa()
    mcpu = _host_mcpu()
    if isa != "amx" or not (host.avx2 and host.fma) or mcpu is None:
        raise UnsupportedISAError(
            f"emulated AMX tiles need target 'amx' (got {isa!r}) on an x86 host with AVX2 and "
            f"FMA (or AVX-512) for the kernels around the tiles; this host: {host.summary()}")
    tiles = {"-" + f: "+" + f for f in ("amx-tile", "amx-bf16", "amx-int8")}
    return {"keys": ["tpp", "cpu", EMULATED_TILES_KEY], "mcpu": mcpu,
            "mattr": [tiles.get(f, f) for f in host.llvm_mattr()]}


def tiles_emulated(tgt: Target | str | dict[str, Any] | None) -> bool:
    """Whether ``tgt`` runs AMX tile instructions on the software model."""
    return tgt is not None and EMULATED_TILES_KEY in [str(k) for k in _as_target(tgt).keys]


def _as_target(tgt: Target | str | dict[str, Any]) -> Target:
    return tgt if isinstance(tgt, Target) else Target(tgt)


def is_tpp_target(tgt: Target | str | dict[str, Any]) -> bool:
    """Whether TPP offload applies to ``tgt``: its keys include ``"tpp"``."""
    return "tpp" in [str(key) for key in _as_target(tgt).keys]


def isa_of(tgt: Target | str | dict[str, Any]) -> str:
    """Which TPP ISA (``amx``/``avx512``/``avx2``/``sve``) a target compiles for.

    A ``tpp/<isa>`` tag decides (targets from :func:`target` carry one). Untagged targets are
    read from their LLVM features, so an untagged ``sapphirerapids`` target reads as ``amx``.
    """
    tgt = _as_target(tgt)
    tag = str(tgt.tag)
    if tag.startswith(TAG_PREFIX) and tag[len(TAG_PREFIX) :] in ISAS:
        return tag[len(TAG_PREFIX) :]
    if str(tgt.kind.name) != "llvm":
        raise UnsupportedISAError(f"TPP targets are llvm targets; got kind {tgt.kind.name!r}")
    triple = str(tgt.attrs.get("mtriple", "")) or str(codegen.llvm_get_system_triple())
    if triple.startswith(("aarch64", "arm64")):
        if codegen.llvm_cpu_has_features(["sve"], tgt):
            return "sve"
    elif codegen.llvm_cpu_has_features(["amx-tile", "amx-bf16"], tgt):
        return "amx"
    elif codegen.llvm_cpu_has_features(["avx512f"], tgt):
        return "avx512"
    elif codegen.llvm_cpu_has_features(["avx2", "fma"], tgt):
        return "avx2"
    raise UnsupportedISAError(
        f"target {tgt} has none of the TPP ISAs ({', '.join(sorted(ISAS))}): "
        "x86 targets need an AVX2 (with FMA), AVX-512 or AMX mcpu, aarch64 targets need +sve"
    )
