"""Tests of host ISA detection and the TPP target (deterministic, no measuring)."""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

import pytest
from tvm.target import Target, codegen

from tpp_tvm.errors import TPPError, UnsupportedISAError

# The package re-exports the function `target`, which shadows the submodule attribute.
tt = importlib.import_module("tpp_tvm.target")

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16

processor\t: 1
model name\t: second processor must be ignored
flags\t\t: fpu avx512_fp16 amx_int8
"""

ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve sve2
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def _proc_flags() -> frozenset[str]:
    path = Path("/proc/cpuinfo")
    if not path.exists():
        pytest.skip("no /proc/cpuinfo on this OS")
    return tt.parse_cpuinfo(path.read_text())[1]


# ----------------------------------------------------------------------------- detection


def test_parse_cpuinfo_x86_reads_first_processor_only() -> None:
    model, flags = tt.parse_cpuinfo(X86_CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx512f", "amx_bf16"} <= flags
    assert "avx512_fp16" not in flags and "amx_int8" not in flags


def test_parse_cpuinfo_aarch64_uses_features_and_part() -> None:
    model, flags = tt.parse_cpuinfo(ARM_CPUINFO)
    assert "sve" in flags and "asimd" in flags
    assert "0x41" in model and "0xd40" in model


def test_detect_host_maps_x86_flags() -> None:
    host = tt.detect_host(X86_CPUINFO, arch="x86_64")
    assert host.arch == "x86_64"
    assert host.avx512f and host.avx512bw and host.avx512vl
    assert host.avx512_vnni and host.avx512_bf16 and not host.avx512_fp16
    assert host.amx_tile and host.amx_bf16 and not host.amx_int8
    assert not host.sve and host.sve_vector_bits is None


def test_detect_host_aarch64_ignores_x86_names() -> None:
    host = tt.detect_host(ARM_CPUINFO.replace("sve2", "sve2 avx512f amx_tile"), arch="arm64")
    assert host.arch == "aarch64"
    assert host.sve
    assert not host.avx512f and not host.amx_tile and not host.amx_permitted


def test_host_flags_match_proc_cpuinfo() -> None:
    flags = _proc_flags()
    host = tt.host_isa()
    for name in tt._X86_FLAGS:
        assert getattr(host, name) == (host.arch == "x86_64" and name in flags), name
    assert host.sve == (host.arch == "aarch64" and "sve" in flags)


def test_host_isa_is_cached_and_frozen() -> None:
    host = tt.host_isa()
    assert tt.host_isa() is host
    with pytest.raises(dataclasses.FrozenInstanceError):
        host.avx512f = not host.avx512f  # type: ignore[misc]


def test_amx_not_permitted_without_amx_flag() -> None:
    assert tt.request_amx_permission(frozenset({"avx512f"})) is False
    assert tt.detect_host("flags: avx512f avx512bw\n", arch="x86_64").amx_permitted is False
    host = tt.host_isa()
    if not host.amx_tile:
        assert host.amx_permitted is False


def test_sve_vector_bits_only_with_sve() -> None:
    assert tt.sve_vector_bits(frozenset({"asimd"})) is None
    host = tt.host_isa()
    if host.sve:
        bits = host.sve_vector_bits
        assert bits is not None and bits % 128 == 0 and 128 <= bits <= 2048
    else:
        assert host.sve_vector_bits is None


def test_read_cache_sizes_from_fake_sysfs(tmp_path: Path) -> None:
    for index, (level, kind, size) in enumerate(
        [
            ("1", "Data", "48K"),
            ("1", "Instruction", "32K"),
            ("2", "Unified", "2048K"),
            ("3", "Unified", "32M"),
        ]
    ):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(level + "\n")
        (folder / "type").write_text(kind + "\n")
        (folder / "size").write_text(size + "\n")
    assert tt.read_cache_sizes(tmp_path) == {"l1d": 48 << 10, "l2": 2 << 20, "l3": 32 << 20}
    assert tt.read_cache_sizes(tmp_path / "missing") == {}


def test_host_caches_and_cores_are_sane() -> None:
    host = tt.host_isa()
    sizes = [s for s in (host.l1d_bytes, host.l2_bytes, host.l3_bytes) if s is not None]
    assert sizes == sorted(sizes)
    assert 1 <= host.physical_cores <= (os.cpu_count() or 1)


def test_summary_names_the_isa() -> None:
    host = tt.host_isa()
    assert ("AVX-512 F" in host.summary()) == host.avx512f
    assert ("AVX2" in host.summary()) == (host.avx2 and not host.avx512f)
    assert host.arch in host.summary()


# ----------------------------------------------------------------------------- best_isa


def _fake(**flags: bool) -> tt.HostISA:
    return tt.HostISA(arch="x86_64", model_name="fake", **flags)


def test_best_isa_preference_order() -> None:
    assert (
        tt.best_isa(_fake(avx512f=True, amx_bf16=True, amx_tile=True, amx_permitted=True)) == "amx"
    )
    assert tt.best_isa(_fake(avx512f=True, amx_bf16=True, amx_tile=True)) == "avx512"
    assert tt.best_isa(tt.HostISA(arch="aarch64", sve=True)) == "sve"
    assert tt.best_isa(_fake(avx2=True, fma=True)) == "avx2"
    assert tt.best_isa(_fake(avx2=True, fma=True, avx512f=True)) == "avx512"


def test_best_isa_without_any_tpp_isa_says_what_it_found() -> None:
    with pytest.raises(UnsupportedISAError, match="fake.*AVX-512F, AVX2 with FMA"):
        tt.best_isa(_fake())
    with pytest.raises(UnsupportedISAError, match="AVX2 with FMA"):
        tt.best_isa(_fake(avx2=True))  # AVX2 without FMA3: no TPP ISA


def test_best_isa_of_this_host_is_a_known_isa() -> None:
    try:
        assert tt.best_isa() in tt.ISAS
    except UnsupportedISAError:
        host = tt.host_isa()
        assert not (host.avx512f or host.sve or host.amx_permitted)


# ----------------------------------------------------------------------------- target


@pytest.mark.parametrize("isa", tt.ISAS)
def test_target_for_each_isa(isa: str) -> None:
    tgt = tt.target(isa, num_cores=3)
    keys = [str(k) for k in tgt.keys]
    assert "tpp" in keys and "cpu" in keys
    assert str(tgt.kind.name) == "llvm"
    assert int(tgt.attrs["num-cores"]) == 3
    assert str(tgt.tag) == f"tpp/{isa}"
    assert tt.is_tpp_target(tgt)
    assert tt.isa_of(tgt) == isa


def test_target_avx512_uses_an_avx512_cpu() -> None:
    tgt = tt.target("avx512")
    assert codegen.llvm_cpu_has_features(["avx512f"], tgt)
    host = tt.host_isa()
    if host.arch == "x86_64" and host.avx512f:
        assert str(tgt.mcpu) == str(codegen.llvm_get_system_cpu())
    else:
        assert str(tgt.mcpu) == "skylake-avx512"


def test_target_amx_has_amx_features() -> None:
    tgt = tt.target("amx")
    assert codegen.llvm_cpu_has_features(["amx-tile", "amx-bf16"], tgt)
    if not tt.host_isa().amx_bf16:
        assert str(tgt.mcpu) == "sapphirerapids"


def test_target_sve_cross_compiles_for_aarch64() -> None:
    tgt = tt.target("sve")
    assert str(tgt.mtriple) == "aarch64-linux-gnu"
    assert "+sve" in [str(a) for a in tgt.mattr]


def test_target_default_is_best_isa_on_all_cores() -> None:
    try:
        isa = tt.best_isa()
    except UnsupportedISAError:
        pytest.skip("this host has no TPP ISA")
    tgt = tt.target()
    assert tt.isa_of(tgt) == isa
    assert int(tgt.attrs["num-cores"]) == tt.host_isa().physical_cores


def test_unknown_isa_names_the_valid_ones() -> None:
    with pytest.raises(UnsupportedISAError, match="neon.*amx, avx2, avx512, sve"):
        tt.target("neon")
    assert issubclass(UnsupportedISAError, TPPError)


def test_bad_core_count() -> None:
    with pytest.raises(ValueError, match="num_cores"):
        tt.target("avx512", num_cores=0)


# ----------------------------------------------------------------------------- tags


@pytest.mark.parametrize("isa", tt.ISAS)
def test_tags_resolve(isa: str) -> None:
    by_name = Target(f"tpp/{isa}")
    assert "tpp" in [str(k) for k in by_name.keys]
    assert tt.isa_of(by_name) == isa
    with_override = Target({"tag": f"tpp/{isa}", "num-cores": 2})
    assert str(with_override.tag) == f"tpp/{isa}"
    assert int(with_override.attrs["num-cores"]) == 2


def test_tag_registration_survives_reimport() -> None:
    tt._register_tags()
    importlib.reload(tt)
    assert tt.isa_of(Target("tpp/avx512")) == "avx512"


def test_isa_of_untagged_targets() -> None:
    assert tt.isa_of({"kind": "llvm", "mcpu": "skylake-avx512"}) == "avx512"
    assert tt.isa_of({"kind": "llvm", "mcpu": "sapphirerapids"}) == "amx"
    sve = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+sve"]}
    assert tt.isa_of(sve) == "sve"
    with pytest.raises(UnsupportedISAError):
        tt.isa_of({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    assert tt.isa_of({"kind": "llvm", "mcpu": "haswell"}) == "avx2"
    assert tt.isa_of({"kind": "llvm", "mcpu": "znver3"}) == "avx2"
    with pytest.raises(UnsupportedISAError):
        tt.isa_of({"kind": "llvm", "mcpu": "sandybridge"})  # AVX without AVX2/FMA


def test_plain_llvm_is_not_a_tpp_target() -> None:
    assert not tt.is_tpp_target({"kind": "llvm"})
    assert not tt.is_tpp_target(Target("llvm"))


@pytest.mark.requires_avx512  # x86 AVX-512 hosts only
def test_host_targets_carry_the_cpuinfo_features() -> None:
    """LLVM names a CPU from its model number (a Sapphire Rapids Xeon once read as
    ``rocketlake``, without AVX512_BF16): the host target's mattr says what it really has."""
    host = tt.host_isa()
    tgt = tt.target("avx512")
    mattr = [str(a) for a in tgt.attrs["mattr"]]
    for flag, feature in tt.X86_LLVM_FEATURES.items():
        assert (("+" if getattr(host, flag) else "-") + feature) in mattr
        assert (feature in tt.missing_features(tgt, [feature])) != getattr(host, flag)


def test_llvm_mattr_follows_the_flags() -> None:
    host = tt.detect_host("flags : avx512f avx512bw avx512_bf16\n", "x86_64")
    mattr = host.llvm_mattr()
    assert "+avx512bf16" in mattr and "-avx512fp16" in mattr and "-amx-tile" in mattr
    assert tt.detect_host("Features : sve\n", "aarch64").llvm_mattr() == []


def test_require_features_names_what_is_missing() -> None:
    from tpp_tvm.errors import UnsupportedISAError

    tgt = {"kind": "llvm", "mcpu": "icelake-server"}
    tt.require_features(tgt, ["avx512f", "avx512vnni"], "x")
    with pytest.raises(UnsupportedISAError, match="avx512bf16.*icelake-server"):
        tt.require_features(tgt, ["avx512bf16"], "a bf16 kernel")


@pytest.mark.parametrize(("files", "want"), [
    ({"cpu.max": "150000 100000\n"}, 2),            # cgroup v2: 1.5 CPUs rounds up
    ({"cpu.max": "max 100000\n"}, None),            # v2, no limit
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),                                     # no cgroup files
])
def test_cpu_quota_reads_the_containers_limit(tmp_path, files: dict, want) -> None:
    """The default thread count follows a container's CPU quota, not the host's cores."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert tt.cpu_quota(tmp_path) == want


def test_physical_cores_are_capped_by_the_quota(monkeypatch) -> None:
    monkeypatch.setattr(tt, "cpu_quota", lambda: 1)
    assert tt.physical_core_count() == 1
