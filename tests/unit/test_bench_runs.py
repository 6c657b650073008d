"""``specpool bench`` end to end on the tiny target: the side-by-side benchmark and the policy
benchmark write their results (every output of ours identical to target-only decoding), and a
policy run's report is rebuilt from its raw per-prompt log (``python -m bench.policies --rerender``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench import policies as policy_bench
from bench.cli import run_bench
from specpool.cli.main import build_parser

PROMPTS = [("chat", "the cat sat on the mat and the cat sat"), ("code", "one two three four one two three"),
           ("math", "two and two is four and two and two is")]


def bench_args(tmp_path, model_dirs, *extra: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in PROMPTS))
    return build_parser().parse_args(["bench", "--prompts", str(prompts), "--limit-per-category", "1", "--max-new-tokens", "8",
                                      "--target", str(model_dirs.target), "--out", str(tmp_path / "out"), *extra])


def test_side_by_side_bench(tmp_path, model_dirs, home, capsys):
    assert run_bench(bench_args(tmp_path, model_dirs, "--drafters", "ngram"), SimpleNamespace(home=home)) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["systems"] == ["target", "ngram", "hf-prompt-lookup"]
    assert results["config"]["n_prompts"] == len(PROMPTS)
    assert results["lossless_mismatches"]["ngram"] == 0
    assert {r["system"] for r in results["rows"]} == {"target", "ngram", "hf-prompt-lookup"}
    for name in ("per_prompt.jsonl", "report.md", "speedup.png"):
        assert (tmp_path / "out" / name).is_file()
    assert "specpool bench --prompts" in (tmp_path / "out" / "report.md").read_text()


def test_side_by_side_bench_sampled(tmp_path, model_dirs, home):
    """--temperature: our systems sample (seeded per prompt), HF's greedy peers are left out and no
    token check is made (sampled outputs are other draws of the same distribution)."""
    assert run_bench(bench_args(tmp_path, model_dirs, "--drafters", "ngram", "--temperature", "0.7"),
                     SimpleNamespace(home=home)) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["systems"] == ["target", "ngram"]
    assert results["config"]["temperature"] == 0.7
    records = [json.loads(line) for line in (tmp_path / "out" / "per_prompt.jsonl").read_text().splitlines()]
    assert records and all(r["matches_target"] is None for r in records)
    assert "temperature 0.7" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.slow  # a whole run / a regret sweep: the fast lane skips it
def test_policy_bench_and_its_rerender(tmp_path, model_dirs, home):
    args = bench_args(tmp_path, model_dirs, "--policies", "metasd-ucb,oracle", "--pool", "ngram,ngram:3")
    assert run_bench(args, SimpleNamespace(home=home)) == 0
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["systems"] == ["target", "fixed:ngram", "fixed:ngram:3", "metasd-ucb", "oracle"]
    assert all(r["lossless_mismatches"] == 0 for r in results["rows"])
    report = (out / "report.md").read_text()
    (out / "report.md").unlink()
    assert policy_bench.main(["--rerender", str(out)]) == 0
    assert (out / "report.md").read_text() == report  # the same report from the raw log
    (out / "per_prompt.jsonl").unlink()  # as in git: the report without its raw log
    assert policy_bench.main(["--rerender", str(out)]) == 2
