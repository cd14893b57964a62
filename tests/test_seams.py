"""The seams between modules are public names, and data flows one way (DESIGN.md).

Read statically (``ast``), so nothing is imported: every module of ``tpp_tvm/`` and
``benchmarks/`` is checked for imports of another module's private (``_name``) names,
``module._name`` reads, schedules that reach up into the runtime, and ``sys.path`` edits.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tpp_tvm"
BENCHMARKS = ROOT / "benchmarks"
SOURCES = sorted([*PACKAGE.rglob("*.py"), *BENCHMARKS.glob("*.py")])
BENCHMARK_MODULES = {p.stem for p in BENCHMARKS.glob("*.py")}

#: Private names of third-party packages we use on purpose, each with why (a new one needs
#: an entry here; an entry nothing uses any more fails the test).
THIRD_PARTY_PRIVATE: dict[tuple[str, str], str] = {
    ("tvm.relax.op", "_op_gradient"): "TVM's own gradients (softmax_grad, conv2d_grad): "
    "training/gradients.py falls back to them where its TPP gradients do not apply",
    ("tvm.relax.frontend.onnx.onnx_frontend", "_get_convert_map"): "the only list of the "
    "ONNX ops TVM converts: frontend.converters.unsupported_nodes reports the others before "
    "import",
    ("torch.utils._pytree", "treespec_dumps"): "torch's only serialization of an output "
    "structure (a TreeSpec): TorchModel.export writes it beside the library",
    ("torch.utils._pytree", "treespec_loads"): "reads what treespec_dumps wrote "
    "(torch_model.load_torch)",
    ("openvino._offline_transformations", "apply_make_stateful_transformation"): "OpenVINO's "
    "only Python entry to MakeStateful, the stateful KV cache its generation pipelines run: "
    "benchmarks/decoder.py gives OpenVINO that setting",
}

#: What a schedule must not import: schedules build PrimFuncs; compiling and running them
#: is the runtime's side (``tpp_tvm.kernels``, ``tir_pipeline``, ``runtime``).
ABOVE_SCHEDULES = ("tpp_tvm.runtime", "tpp_tvm.tir_pipeline", "tpp_tvm.kernels")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    """Dotted name of a source file (benchmarks are top-level scripts)."""
    if path.parent == BENCHMARKS:
        return path.stem
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _first_party(module: str, path: Path) -> bool:
    top = module.split(".")[0]
    return top == "tpp_tvm" or (path.parent == BENCHMARKS and top in BENCHMARK_MODULES)


def _imports(path: Path, tree: ast.Module) -> Iterator[tuple[ast.stmt, str, str | None, str]]:
    """(node, imported module, imported name or None, bound name) for every import,
    function-local ones included, relative modules resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, None, alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = _package(path).split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            for alias in node.names:
                yield node, module, alias.name, alias.asname or alias.name


def _parsed() -> Iterator[tuple[Path, ast.Module]]:
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), filename=str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_no_module_imports_a_private_name_of_ours() -> None:
    bad, third_party_used = [], set()
    for path, tree in _parsed():
        for node, module, name, _ in _imports(path, tree):
            parts = [*module.split("."), *([name] if name else [])]
            private = [p for p in parts if _private(p)]
            if not private:
                continue
            if _first_party(module, path):
                bad.append(f"{_where(path, node)}: {module} import {name or ''}")
            elif (module, name) in THIRD_PARTY_PRIVATE:
                third_party_used.add((module, name))
            else:
                bad.append(f"{_where(path, node)}: third-party private {module} {name or ''} "
                           "(add it to THIRD_PARTY_PRIVATE with a reason, or avoid it)")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)
    assert third_party_used == set(THIRD_PARTY_PRIVATE), (
        f"allowlisted but unused: {set(THIRD_PARTY_PRIVATE) - third_party_used}")


def test_no_module_reads_a_private_attribute_of_ours() -> None:
    """``zoo._seeded(...)`` on an imported module is the same seam as importing it."""
    bad = []
    for path, tree in _parsed():
        ours = {bound for _, module, _, bound in _imports(path, tree)
                if _first_party(module, path)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in ours:
                    bad.append(f"{_where(path, node)}: {ast.unparse(node)}")
    assert not bad, "private attributes read across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", sorted((PACKAGE / "schedules").rglob("*.py")),
                         ids=lambda p: p.name)
def test_schedules_do_not_import_the_runtime(path: Path) -> None:
    tree = ast.parse(path.read_text())
    bad = []
    for node, module, name, _ in _imports(path, tree):
        # ``from .. import runtime`` names the module in ``name``
        target = f"{module}.{name}" if name else module
        if any(target == up or target.startswith(up + ".") for up in ABOVE_SCHEDULES):
            bad.append(f"{_where(path, node)}: {target}")
    assert not bad, "schedules importing the runtime side:\n" + "\n".join(bad)


def test_nothing_edits_sys_path() -> None:
    """Benchmarks import tpp_tvm as installed and their siblings as scripts do."""
    bad = []
    for path, tree in _parsed():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                bad.append(_where(path, node))
    assert not bad, "sys.path edited at:\n" + "\n".join(bad)


def test_benchmarks_share_code_only_through_the_harness() -> None:
    """A benchmark script is not a library: what two of them need lives in harness.py
    (which itself wraps peak.py's measurement)."""
    bad = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        allowed = {"harness", "peak"} if path.stem == "harness" else {"harness"}
        tree = ast.parse(path.read_text())
        for node, module, _, _ in _imports(path, tree):
            top = module.split(".")[0]
            if top in BENCHMARK_MODULES and top not in allowed:
                bad.append(f"{_where(path, node)}: {module}")
    assert not bad, "benchmarks importing each other:\n" + "\n".join(bad)
