"""specpool's one-way layers (docs/ARCHITECTURE.md) and an import graph without cycles.

The contracts live in pyproject.toml ([tool.importlinter]); these tests run them through
import-linter's ``lint-imports``, and show that the check can fail by running the same contracts
against a copy of the package with one upward import injected. grimp (import-linter's graph
builder) reads every import statement, those inside functions too, so neither a layer break nor a
cycle can hide in a function body.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "specpool"


def lint_imports_executable() -> str:
    beside_python = Path(sys.executable).with_name("lint-imports")  # the same environment's script
    found = str(beside_python) if beside_python.exists() else shutil.which("lint-imports")
    assert found, "lint-imports not found: pip install -e '.[test]' installs import-linter"
    return found


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """Run the repository's contracts against the ``specpool`` found in ``package_parent``
    (first on the path, so it wins over the installed package)."""
    env = {**os.environ, "PYTHONPATH": str(package_parent), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [lint_imports_executable(), str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=package_parent, env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_layer_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def copy_package_sources(destination: Path) -> Path:
    """The package's Python files only (the shipped drafter weights are not needed to read imports)."""

    def not_source(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or (Path(folder, n).is_file() and not n.endswith(".py"))]

    shutil.copytree(REPO / PACKAGE, destination / PACKAGE, ignore=not_source)
    return destination


@pytest.mark.parametrize("module, injected, contract, reported", [
    ("errors", "import specpool.services.engine  # injected: core -> services",
     "specpool's layers import only downward", "specpool.core.errors -> specpool.services.engine"),
    ("defaults", "import torch  # injected: core must stay torch-free",
     "core (errors, defaults, limits) imports no third-party package", "specpool.core.defaults -> torch"),
])
def test_the_contracts_report_an_injected_import(tmp_path, module, injected, contract, reported):
    """The check can fail: the same contracts, run on a copy of the package with one bad import."""
    copy = copy_package_sources(tmp_path)
    source = copy / PACKAGE / "core" / f"{module}.py"
    source.write_text(source.read_text() + f"\n{injected}\n")

    result = lint_imports(copy)

    assert result.returncode != 0, result.stdout
    assert f"{contract} BROKEN" in result.stdout, result.stdout
    assert reported in result.stdout, result.stdout


def package_graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, include_external_packages=True, cache_dir=None)


def test_core_imports_only_the_standard_library():
    graph = package_graph()
    outside = {
        f"{module} -> {imported}"
        for module in graph.find_descendants("specpool.core") | {"specpool.core"}
        for imported in graph.find_modules_directly_imported_by(module)
        if not imported.startswith(PACKAGE) and imported.partition(".")[0] not in sys.stdlib_module_names
    }
    assert not outside, sorted(outside)


def import_cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """One shortest cycle through each direct import that lies on a cycle, as the modules in import
    order with the first repeated at the end (``a -> b -> a``); each cycle once."""
    cycles: dict[frozenset, list[str]] = {}
    for importer in sorted(m for m in graph.modules if m == package or m.startswith(package + ".")):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if not imported.startswith(package):
                continue
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycle = [importer, *back]
                cycles.setdefault(frozenset(cycle), cycle)
    return list(cycles.values())


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    steps = []
    for importer, imported in zip(cycle, cycle[1:]):
        lines = sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
        steps.append(f"{importer} -> {imported} (line {', '.join(map(str, lines))})")
    return "\n  ".join(steps)


def test_the_package_has_no_import_cycle():
    graph = package_graph()
    cycles = import_cycles(graph, PACKAGE)
    assert not cycles, "import cycles:\n  " + "\n\n  ".join(describe(graph, c) for c in cycles)


def test_the_cycle_finder_reports_a_cycle_through_a_function_level_import():
    graph = grimp.ImportGraph()
    graph.add_import(importer="pkg.registry", imported="pkg.kinds", line_number=90, line_contents="import pkg.kinds")
    graph.add_import(importer="pkg.kinds", imported="pkg.base", line_number=3, line_contents="import pkg.base")
    graph.add_import(importer="pkg.base", imported="pkg.registry", line_number=5, line_contents="import pkg.registry")
    graph.add_import(importer="pkg.kinds", imported="pkg.util", line_number=4, line_contents="import pkg.util")

    cycles = import_cycles(graph, "pkg")

    assert cycles == [["pkg.base", "pkg.registry", "pkg.kinds", "pkg.base"]]
    assert describe(graph, cycles[0]).splitlines()[1].strip() == "pkg.registry -> pkg.kinds (line 90)"


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    """grimp reads the import in a function body: a cycle moved into a function is still one."""
    module = tmp_path / "pkg_fn" / "a.py"
    module.parent.mkdir()
    (module.parent / "__init__.py").write_text("")
    module.write_text("def load():\n    import pkg_fn.b  # noqa: F401\n")
    (module.parent / "b.py").write_text("import pkg_fn.a  # noqa: F401\n")
    sys.path.insert(0, str(tmp_path))
    try:
        graph = grimp.build_graph("pkg_fn", cache_dir=None)
    finally:
        sys.path.remove(str(tmp_path))

    assert import_cycles(graph, "pkg_fn") == [["pkg_fn.a", "pkg_fn.b", "pkg_fn.a"]]
