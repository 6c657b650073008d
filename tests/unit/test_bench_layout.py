"""The benchmarks outside the package (issue 25): the CLI finds bench/ of the checkout or says in
one line what to install; bench/ imports run one way; the package never imports matplotlib; the
committed results stay small and hold no raw logs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specpool.cli.bench_loader as bench_loader
from specpool.cli.bench_loader import BenchmarksMissing, load_bench
from specpool.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
HINT = "pip install -e '.[bench]'"
# All of bench/results/ in git: the reports the README cites (report.md, results.json, small plots).
RESULTS_CAP_BYTES = 5 * 1024 * 1024


# -- the loader -----------------------------------------------------------------------------------
def test_loader_finds_the_checkouts_benchmarks():
    module = load_bench("common", "bench")
    assert Path(module.__file__).resolve() == ROOT / "bench" / "common.py"
    assert bench_loader.CHECKOUT == ROOT  # an editable install runs the package from this checkout


SPAWNED_CHILD_IMPORTS_BENCH = """
import multiprocessing
from specpool.cli.bench_loader import load_bench

common = load_bench("common", "bench-served")
child = multiprocessing.get_context("spawn").Process(target=common.default_out, args=("served",))
child.start()  # as bench-served starts its embedded worker: the child unpickles bench.common.default_out
child.join(60)
print(child.exitcode)
"""


def test_loaded_benchmarks_reach_spawned_children(tmp_path):
    """bench-served runs the embedded engine in a child started with "spawn", which unpickles a
    function of bench/ by name: the loader must leave the checkout where such a child looks."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", SPAWNED_CHILD_IMPORTS_BENCH], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "0", result.stderr[-2000:]  # the child imported bench and ran


def test_loader_without_the_checkout_says_what_to_install(tmp_path):
    with pytest.raises(BenchmarksMissing) as caught:
        load_bench("cli", "bench", root=tmp_path)
    message = str(caught.value)
    assert "\n" not in message and HINT in message and "`specpool bench`" in message


def test_loader_without_the_bench_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    with pytest.raises(BenchmarksMissing) as caught:
        load_bench("cli", "bench")
    message = str(caught.value)
    assert "\n" not in message and HINT in message and "matplotlib" in message


@pytest.mark.parametrize("argv, command", [
    (["bench", "--prompts", "p.jsonl", "--out", "x"], "specpool bench"),
    (["bench", "--help"], "specpool bench"),
    (["zoo", "eval", "--prompts", "p.jsonl"], "specpool zoo eval"),
    (["bench-served", "--prompts", "p.jsonl"], "specpool bench-served"),
])
def test_cli_without_the_benchmarks_is_one_line_and_status_2(monkeypatch, tmp_path, capsys, argv, command):
    monkeypatch.setattr(bench_loader, "CHECKOUT", tmp_path)  # an installed package: no bench/ beside it
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`{command}` needs the benchmarks" in err and HINT in err


@pytest.mark.parametrize("missing", ["checkout", "extra"])
def test_other_commands_parse_without_the_benchmarks(monkeypatch, tmp_path, missing):
    """The README's first set-up command (pip install -e . && specpool generate ...) needs neither."""
    if missing == "checkout":
        monkeypatch.setattr(bench_loader, "CHECKOUT", tmp_path)
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = build_parser().parse_args(["generate", "Hello", "-k", "3"])
    assert (args.command, args.prompt, args.k) == ("generate", "Hello", 3)


def test_cli_with_the_benchmarks_parses_their_options():
    args = build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--policies", "metasd-ucb,oracle"])
    assert (args.prompts, args.policies, args.out) == ("p.jsonl", "metasd-ucb,oracle", None)


def test_benchmarks_write_into_the_working_directory_by_default():
    from bench.cli import resolve_bench_defaults
    from bench.online_args import online_args_from_bench

    parser = build_parser()
    outs = [
        resolve_bench_defaults(parser.parse_args(["bench", "--prompts", "p.jsonl"])).out,
        online_args_from_bench(parser.parse_args(["bench", "--online", "--prompts", "corpus"])).out,
        parser.parse_args(["zoo", "eval", "--prompts", "p.jsonl"]).out,
        parser.parse_args(["bench-served", "--prompts", "p.jsonl"]).out,
    ]
    assert all(out.startswith("bench-results/") for out in outs), outs  # relative: under the working directory
    # The python -m benchmarks too: no default points into the checkout's bench/results.
    for path in (ROOT / "bench").glob("*.py"):
        assert 'default="bench/results' not in path.read_text(), path.name


# -- imports --------------------------------------------------------------------------------------
def _bench_imports(path: Path) -> tuple[set[str], list[str]]:
    """bench.* modules ``path`` imports at module level, and those it imports inside a function."""
    top: set[str] = set()
    nested: list[str] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.module == "bench":  # from bench import report
                names = [f"bench.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            found = [n for n in names if n.startswith("bench.")]
            (nested.extend if in_function else top.update)(found)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return top, nested


def test_bench_imports_form_no_cycle_and_none_hides_in_a_function():
    graph = {}
    for path in sorted((ROOT / "bench").glob("*.py")):
        top, nested = _bench_imports(path)
        assert not nested, f"{path.name} imports {nested} inside a function"
        graph[f"bench.{path.stem}"] = top
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        assert module not in stack, "bench/ import cycle: " + " -> ".join(stack + [module])
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, stack + [module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_the_package_never_imports_matplotlib():
    offenders = []
    for path in (ROOT / "specpool").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            offenders += [f"{path.relative_to(ROOT)}: {m}" for m in modules if m.split(".")[0] == "matplotlib"]
    assert not offenders, "matplotlib is the bench extra's; move the plot to bench/: " + ", ".join(offenders)


# -- committed results ----------------------------------------------------------------------------
def _committed_results() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "bench/results"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]


def test_committed_results_stay_under_the_cap():
    files = _committed_results()
    total = sum(f.stat().st_size for f in files)
    biggest = sorted(files, key=lambda f: f.stat().st_size)[-3:]
    assert total <= RESULTS_CAP_BYTES, (
        f"bench/results holds {total / 2**20:.1f} MiB in git, over the {RESULTS_CAP_BYTES / 2**20:.0f} MiB cap; keep only "
        f"the reports the README cites (largest: {', '.join(str(f.relative_to(ROOT)) for f in biggest)})")


def test_committed_results_hold_no_raw_logs():
    raw = [f.relative_to(ROOT) for f in _committed_results()
           if f.name == "per_prompt.jsonl" or f.suffix == ".log" or "stores" in f.relative_to(ROOT).parts]
    assert not raw, f"raw per-prompt logs belong to a fresh run, not to git: {raw}"
