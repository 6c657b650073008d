"""Finds the benchmarks for ``specpool bench``, ``specpool zoo eval`` and ``specpool bench-served``.

The benchmarks are not part of the installed package (docs/ARCHITECTURE.md, "Layout"): they live
in ``bench/`` of the source checkout, beside ``specpool/`` (an editable install, ``pip install -e
'.[bench]'``, runs the package from there), and need the ``bench`` extra (matplotlib). Where
either is missing, the command says so in one line and exits with status 2, and every other
command works as before.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import specpool
from specpool.core.errors import SpecpoolError

INSTALL_HINT = "in a source checkout, pip install -e '.[bench]'"
# Modules of the bench extra (pyproject.toml [project.optional-dependencies] bench) -> the package to install.
BENCH_EXTRA = {"matplotlib": "matplotlib"}
# The checkout the package runs from: bench/ is its sibling in an editable install.
CHECKOUT = Path(specpool.__file__).resolve().parents[1]


class BenchmarksMissing(SpecpoolError):
    """The benchmarks (the checkout's bench/, or the bench extra) are not there."""


def load_bench(module: str, command: str, root: Path | None = None) -> ModuleType:
    """``bench.MODULE`` from ``root``/bench (default: the checkout the package runs from).

    Raises ``BenchmarksMissing``, whose message is the one line to show, when that folder or a
    module of the bench extra is missing, or when another ``bench`` package was imported first.
    """
    root = (CHECKOUT if root is None else root).resolve()
    package_dir = root / "bench"
    if not (package_dir / "__init__.py").is_file():
        raise BenchmarksMissing(f"`specpool {command}` needs the benchmarks (no bench/ beside {root / 'specpool'}): {INSTALL_HINT}")
    missing = [dist for name, dist in BENCH_EXTRA.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise BenchmarksMissing(f"`specpool {command}` needs the bench extra ({', '.join(missing)} is not installed): {INSTALL_HINT}")
    package = sys.modules.get("bench")
    if package is None:
        # Imported by location, so no other `bench` on sys.path can stand in for the checkout's.
        spec = importlib.util.spec_from_file_location("bench", package_dir / "__init__.py",
                                                      submodule_search_locations=[str(package_dir)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["bench"] = package
        try:
            spec.loader.exec_module(package)
        except BaseException:
            del sys.modules["bench"]
            raise
        # Child processes started with "spawn" (bench-served's embedded worker) import the
        # benchmarks by name from sys.path, which they take from this process: give them the checkout.
        if str(root) not in sys.path:
            sys.path.append(str(root))
    elif Path(package.__file__).resolve().parent != package_dir:
        raise BenchmarksMissing(f"`specpool {command}` needs the benchmarks of {package_dir}, but another `bench` "
                                f"package ({package.__file__}) is imported: {INSTALL_HINT}")
    return importlib.import_module(f"bench.{module}")


def add_bench_command(commands, name: str, *, command: str, help: str, module: str,
                      add_arguments: Callable[[ModuleType, argparse.ArgumentParser], None],
                      root: Path | None = None) -> argparse.ArgumentParser:
    """Register subcommand ``name`` whose options come from ``bench.MODULE`` (``add_arguments``).

    Without the benchmarks the subcommand still exists (``specpool --help`` lists it) but takes
    any arguments, so that running it reaches ``load_bench`` again and shows the one-line hint
    instead of an argparse complaint about options it does not know.
    """
    try:
        loaded = load_bench(module, command, root)
    except BenchmarksMissing:
        # A prefix character no option uses: every word, "--prompts" too, is a positional argument.
        parser = commands.add_parser(name, help=f"{help} (needs the benchmarks: {INSTALL_HINT})",
                                     prefix_chars="\0", add_help=False)
        parser.add_argument("bench_arguments", nargs="*")
        return parser
    parser = commands.add_parser(name, help=help)
    add_arguments(loaded, parser)
    return parser
