"""What a test needs from this machine, as markers: an ISA, the aarch64 cross tools, a package.

A test (or a whole module, through ``pytestmark``) that can only run where something is
present says so with a ``requires_*`` marker; elsewhere it skips with a reason naming what
this machine lacks::

    @pytest.mark.requires_avx512
    def test_kernel_runs_like_numpy() -> None: ...

    pytestmark = [pytest.mark.requires_torch, pytest.mark.requires_avx512_vnni]

The CPU is read through ``tpp_tvm.target.host_isa`` (only ``tpp_tvm/target.py`` reads
``/proc/cpuinfo``), the cross tools through ``tpp_tvm.cross.missing_tools``. The markers are
registered in ``pyproject.toml``; an unknown ``requires_*`` name is a usage error, not a
silently running test. A module that needs a package just to be imported (a torch module
subclassed at module level) keeps ``pytest.importorskip``.

Helpers that tests import (numeric checks, ONNX Runtime comparisons, free ports) live in
``checks.py``, TPP-level ones in ``tpp_harness.py``: a conftest is not imported.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tpp_tvm.cross import missing_tools
from tpp_tvm.cross.toolchain import PACKAGES
from tpp_tvm.target import host_isa

# Where the bench extra installed the registry's torchvision (a CUDA build), importing it
# beside the CPU torch dies registering fakes for its C ops, and ``transformers`` imports
# it: empty modules under the two names that register them let the model code import.
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))


@dataclass(frozen=True)
class Requirement:
    """What a marker's tests need, and how to tell what of it this machine lacks."""

    needs: str
    """Completes "needs ...": what the tests use it for."""
    lacking: Callable[[], list[str]]
    """What is missing here, each item named; empty where the tests can run."""
    context: Callable[[], str]
    """What this machine has, or how to get what it lacks (ends the skip reason)."""


def _cpu(**flags: str) -> Callable[[], list[str]]:
    """Lacking: the label of each ``HostISA`` flag (keyword) that is false on this host."""

    def lacking() -> list[str]:
        host = host_isa()
        return [label for flag, label in flags.items() if not getattr(host, flag)]

    return lacking


def _int8_lacking() -> list[str]:
    """The host's default target runs int8 kernels on AVX512_VNNI, or on AVX2's s16 dot
    product where there is no AVX-512 (an AVX-512 CPU without VNNI has neither)."""
    host = host_isa()
    if host.avx512_vnni or (host.avx2 and host.fma and not host.avx512f):
        return []
    return ["AVX512_VNNI"] if host.avx512f else ["AVX2"]


def _host() -> str:
    return f"this host: {host_isa().summary()}"


def _package(name: str) -> Callable[[], list[str]]:
    """Lacking: ``name`` when it cannot be imported (as ``pytest.importorskip`` decides)."""

    def lacking() -> list[str]:
        try:
            importlib.import_module(name)
        except ImportError:
            return [name]
        return []

    return lacking


def _test_extra() -> str:
    return "pip install 'tpp_tvm[test]'"


REQUIREMENTS: dict[str, Requirement] = {
    "requires_avx2": Requirement(
        "an AVX2 CPU to run AVX2 kernels", _cpu(avx2="AVX2", fma="FMA"), _host),
    "requires_avx512": Requirement(
        "an AVX-512 CPU to run AVX-512 kernels", _cpu(avx512f="AVX512F"), _host),
    "requires_avx512_vnni": Requirement(
        "an AVX512_VNNI CPU to run int8 kernels", _cpu(avx512_vnni="AVX512_VNNI"), _host),
    "requires_int8_kernels": Requirement(
        "a CPU with an integer dot product to run int8 kernels (AVX512_VNNI; or AVX2 on a "
        "CPU without AVX-512, whose kernels widen to s16)", lambda: _int8_lacking(), _host),
    "requires_avx512_bf16": Requirement(
        "an AVX512_BF16 CPU to run bf16 kernels", _cpu(avx512_bf16="AVX512_BF16"), _host),
    "requires_amx": Requirement(
        "an AMX CPU with OS-granted tile state to run AMX kernels",
        _cpu(amx_bf16="AMX-BF16", amx_int8="AMX-INT8",
             amx_permitted="tile state granted by the OS"), _host),
    "requires_sve_runner": Requirement(
        "the aarch64 cross tools to run SVE code under qemu", missing_tools,
        lambda: f"Debian packages {' '.join(PACKAGES)}; .ci/run installs them"),
    "requires_torch": Requirement(
        "torch (model generators, reference models)", _package("torch"), _test_extra),
    "requires_onnxruntime": Requirement(
        "ONNX Runtime (the reference results)", _package("onnxruntime"), _test_extra),
}


@functools.cache
def skip_reason(marker: str) -> str | None:
    """Why tests marked ``marker`` cannot run here, or ``None`` when they can."""
    req = REQUIREMENTS[marker]
    lacking = req.lacking()
    if not lacking:
        return None
    return f"needs {req.needs}; missing here: {', '.join(lacking)} ({req.context()})"


def pytest_configure(config: pytest.Config) -> None:
    registered = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    unregistered = sorted(set(REQUIREMENTS) - registered)
    if unregistered:
        raise pytest.UsageError(f"tests/conftest.py markers not registered in pyproject.toml "
                                f"[tool.pytest.ini_options] markers: {', '.join(unregistered)}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip each item whose ``requires_*`` markers name something this machine lacks (the
    first such marker, closest to the test, gives the reason)."""
    for item in items:
        names = [n for n in dict.fromkeys(m.name for m in item.iter_markers())
                 if n.startswith("requires_")]
        unknown = [n for n in names if n not in REQUIREMENTS]
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: unknown marker {unknown[0]!r}; the "
                                    f"requires_* markers are {', '.join(REQUIREMENTS)}")
        reason = next(filter(None, map(skip_reason, names)), None)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
