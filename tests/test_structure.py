"""Tests of the package's structure: the import graph of ``tpp_tvm`` has no cycle.

Data flows one way (ONNX -> frontend -> Relax passes -> schedules -> intrinsics ->
runtime, tuning beside the pipeline and imported by it); a cycle, even through a
function-local import, is a module that needs its own importer. The graph is read from the
source with ``ast`` (nothing is imported), so a lazy import counts like any other.

Edges, as Python executes them:

* ``import a.b.c`` and ``from a.b import c`` (``c`` a submodule) are edges to ``a.b.c``;
  ``from a.b import name`` (``name`` not a submodule) is an edge to ``a.b``'s
  ``__init__``, because the name comes from there;
* importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__`` first: an edge to each
  of those packages, unless the importer is inside it (then that package is already being
  imported, and a package whose ``__init__`` imports its submodules, which import their
  siblings with ``from . import sibling``, is not a cycle). So a module that imports one
  leaf of a package still depends on everything that package's ``__init__`` imports.

Dynamic imports (``importlib.import_module`` with a computed name) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tpp_tvm"

#: Cycles that exist and are owned by a refactoring in progress elsewhere; each entry is a
#: sorted tuple of the modules of one strongly connected component. Empty: keep it so.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Module name -> source file; a package is its ``__init__.py``."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_package(name: str, mods: dict[str, Path]) -> bool:
    return name in mods and mods[name].name == "__init__.py"


def _imported(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of the package that importing ``module`` may execute, from every import
    statement in it (module level, function-local, under ``if``)."""
    package = module if _is_package(module, mods) else module.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                named.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                named.add(sub if sub in mods else source)
    edges = set()
    for name in named:
        while name and name not in mods:  # `import tpp_tvm.x.y` of a non-module y
            name = name.rpartition(".")[0]
        if not name:
            continue  # outside the package
        edges.add(name)
        parent = name.rpartition(".")[0]
        while parent:  # packages whose __init__ runs first
            inside = module == parent or module.startswith(parent + ".")
            if _is_package(parent, mods) and not inside:
                edges.add(parent)
            parent = parent.rpartition(".")[0]
    edges.discard(module)
    return edges


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    mods = _modules(root)
    return {m: _imported(m, p, mods) for m, p in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component with more than one
    module, found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(comp, graph) for comp in components]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"not a cycle: {sorted(comp)}")


def transitive_imports(graph: dict[str, set[str]], module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_no_import_cycle():
    graph = import_graph()
    assert "tpp_tvm.relay_passes.pipeline" in graph  # the walk found the package
    cycles = [c for c in find_cycles(graph) if tuple(sorted(set(c))) not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_known_cycles_still_exist():
    """An entry of KNOWN_CYCLES that is gone must leave the list (so it cannot come back)."""
    found = {tuple(sorted(set(c))) for c in find_cycles(import_graph())}
    assert KNOWN_CYCLES <= found, f"fixed, remove from KNOWN_CYCLES: {KNOWN_CYCLES - found}"


def test_tuning_logs_is_a_leaf_of_the_graph_side():
    """The pipeline imports tuning's logs; the logs import nothing of the graph side nor the
    tuning driver (which import the pipeline)."""
    reached = transitive_imports(import_graph(), "tpp_tvm.tuning.logs")
    assert not {m for m in reached if m.startswith("tpp_tvm.relay_passes")
                or m in ("tpp_tvm", "tpp_tvm.tuning.tasks", "tpp_tvm.tuning.driver")}, reached


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, cycle", [
    # a function-local import closes the cycle
    ({"pkg/__init__.py": "", "pkg/a.py": "from . import b\n",
      "pkg/b.py": "def f():\n    from .a import x\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    # importing a leaf runs its package's __init__, which imports the importer back
    ({"pkg/__init__.py": "", "pkg/sub/__init__.py": "from .leaf import x\nfrom .top import y\n",
      "pkg/sub/leaf.py": "", "pkg/sub/top.py": "from ..user import z\n",
      "pkg/user.py": "from .sub.leaf import x\n"},
     ["pkg.sub", "pkg.sub.top", "pkg.user", "pkg.sub"]),
    # a name re-exported by __init__ is an edge to __init__
    ({"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "from pkg import y\n"},
     ["pkg", "pkg.a", "pkg"]),
])
def test_cycles_are_found(tmp_path, files, cycle):
    assert find_cycles(import_graph(_write(tmp_path, files))) == [cycle]


def test_package_importing_its_submodules_is_no_cycle(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "from .a import x\nfrom .b import y\n",
        "pkg/a.py": "from . import b\nfrom .b import y\nimport pkg.b\n",
        "pkg/b.py": "import os\n", "pkg/c/__init__.py": "from pkg.c import d\n",
        "pkg/c/d.py": "from ..a import x\n"})
    assert find_cycles(import_graph(root)) == []


def test_architecture_doc_names_every_module():
    """docs/architecture.md stays true: every module it names exists, and every module of
    the package is named there (by file, or by its folder for whole sub-packages)."""
    import fnmatch
    import re

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text()
    tokens = {t.removeprefix("tpp_tvm/") for t in re.findall(r"`([\w*/]+(?:\.py|/))`", doc)
              if not t.startswith("tests/")}
    modules = [p.relative_to(root / "tpp_tvm").as_posix()
               for p in (root / "tpp_tvm").rglob("*.py")]

    def names(token: str, module: str) -> bool:
        return any(fnmatch.fnmatch(m, token)
                   for m in (module, module.rsplit("/", 1)[-1], module.split("/", 1)[-1]))

    files = {t for t in tokens if t.endswith(".py")}
    packages = {t for t in tokens if t.endswith("/")} - {"relay_passes/", "schedules/",
                                                          "intrinsics/"}
    stale = sorted(t for t in files if not any(names(t, m) for m in modules))
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
    missing = sorted(m for m in modules
                     if not (m.endswith("/__init__.py") or any(names(t, m) for t in files)
                             or any(("/" + m).startswith("/" + p) or ("/" + p) in ("/" + m)
                                    for p in packages)))
    assert not missing, f"modules missing from docs/architecture.md: {missing}"


#: Where a newcomer gets lost: a module doing several jobs, a function with its steps
#: unrolled by hand (the conventions' "size as a smell").
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def test_no_module_or_function_outgrows_one_job():
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {lines} lines")
    assert not too_long, "split these: " + "; ".join(too_long)
