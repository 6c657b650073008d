"""bench/online.py: prompts from a corpus (no models), the results rows, and a three-prompt run on
the tiny target with a tiny zoo drafter (every system's greedy output is the target's own), with
its forgetting check, and the check again on its own (--forgetting-only) from the stores it left."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from bench.online import main, run_online_bench
from bench.online_args import add_online_arguments
from bench.online_report import aggregate, render_spread, rerender, segment_of, spread
from bench.online_stream import passages, stream_prompts
from specpool.core.errors import InvalidArgument
from online_helpers import write_tiny_zoo

HEADER = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\n"
FOOTER = "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence " + "word " * 60


def test_prompts_round_robin_over_files_without_gutenberg_boilerplate(tmp_path):
    for name, word in (("a.txt", "cat"), ("b.txt", "dog")):
        paragraphs = [" ".join([f"{word}{i}"] * 45) for i in range(3)] + ["short one", "CHAPTER " * 50]
        (tmp_path / name).write_text("licence " * 60 + "\n\n" + HEADER + "\n\n".join(paragraphs) + "\n\n" + FOOTER)
    (tmp_path / "LICENSE").write_text("x " * 100)
    assert len(passages(tmp_path / "a.txt")) == 3
    prompts = stream_prompts(tmp_path, 5)
    firsts = [p.split("\n\n")[1].split()[0] for p in prompts]
    assert firsts == ["cat0", "dog0", "cat1", "dog1", "cat2"]
    assert all(len(p.split("\n\n")[1].split()) == 45 for p in prompts)


def test_segments_and_rows():
    assert [segment_of(i, 9) for i in range(9)] == ["first_third"] * 3 + [None] * 3 + ["last_third"] * 3
    records = [{"prompt_index": i, "system": s, "new_tokens": 10, "rounds": r, "wall_s": 1.0}
               for i in range(6) for s, r in (("frozen", 5), ("ogd", 5 if i < 3 else 4))]
    rows = {(r["system"], r["segment"]): r for r in aggregate(records)}
    assert rows[("frozen", "all")]["mean_accepted_length"] == 2.0
    assert rows[("ogd", "last_third")]["mean_accepted_length"] == 2.5 and rows[("ogd", "last_third")]["n_prompts"] == 2
    assert set(rows[("ogd", "all")]) == {"system", "segment", "mean_accepted_length", "tokens_per_s", "n_prompts", "learner_s"}


def test_spread_pairs_prompts():
    """A system exactly 1.25x frozen on every prompt: ratio, interval, median and IQR all 1.25;
    uneven prompts: the interval and the IQR hold the pooled and the median ratio."""
    even = [{"prompt_index": i, "system": s, "new_tokens": 10, "rounds": r, "wall_s": 2.0}
            for i in range(6) for s, r in (("frozen", 5), ("ogd", 4))]
    rows = {(r["segment"], r["metric"]): r for r in spread(even)}
    assert set(rows) == {(g, m) for g in ("first_third", "last_third", "all") for m in ("mean_accepted_length", "tokens_per_s")}
    mal = rows[("all", "mean_accepted_length")]
    assert mal["ratio"] == pytest.approx(1.25) and mal["ci95"] == pytest.approx([1.25, 1.25])
    assert mal["median_per_prompt"] == pytest.approx(1.25) and mal["iqr_per_prompt"] == pytest.approx([1.25, 1.25])
    assert rows[("all", "tokens_per_s")]["ratio"] == pytest.approx(1.0) and mal["n_prompts"] == 6
    uneven = [{"prompt_index": i, "system": s, "new_tokens": 10, "rounds": 5 if s == "frozen" else 3 + i % 3, "wall_s": 1.0 + i}
              for i in range(9) for s in ("frozen", "ogd")]
    for r in spread(uneven):
        assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1]
        assert r["iqr_per_prompt"][0] <= r["median_per_prompt"] <= r["iqr_per_prompt"][1]
    assert "| ogd | all | mean_accepted_length |" in render_spread(spread(uneven))
    assert render_spread([]) == ""


@pytest.mark.slow  # a whole run / a regret sweep: the fast lane skips it
def test_tiny_online_bench(tmp_path, model_dirs, target_lm, home):
    corpus = tmp_path / "book.txt"
    corpus.write_text("\n\n".join(" ".join(["the cat sat on the mat and the dog ran to the house"] * 4) for _ in range(4)))
    zoo = write_tiny_zoo(model_dirs.target, target_lm[1], tmp_path / "zoo")
    parser = argparse.ArgumentParser()
    add_online_arguments(parser)
    questions = tmp_path / "dev.jsonl"
    questions.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in
                                 (("chat", "the cat sat"), ("code", "def f"), ("chat", "the dog ran to"), ("chat", "on the mat"))))
    argv = ["--corpus", str(corpus), "--limit", "3", "--drafter", f"zoo:{zoo}", "--max-new-tokens", "8",
            "--out", str(tmp_path / "out"), "--target", str(model_dirs.target), "--lr", "0.1",
            "--forgetting-prompts", str(questions), "--forgetting-categories", "chat", "--forgetting-per-category", "2"]
    assert run_online_bench(parser.parse_args(argv), SimpleNamespace(home=home)) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {(r["system"], r["segment"]) for r in rows} == {(s, g) for s in ("frozen", "ogd", "optimistic", "hedge")
                                                            for g in ("first_third", "last_third", "all")}
    per_prompt = [json.loads(line) for line in (tmp_path / "out" / "per_prompt.jsonl").read_text().splitlines()]
    assert max(r["version"] for r in per_prompt if r["system"] == "ogd") >= 1  # it learned between prompts
    assert (tmp_path / "out" / "report.md").exists()

    forgetting = json.loads((tmp_path / "out" / "forgetting.json").read_text())
    assert forgetting["mismatches"] == 0  # every learned version still gives the target's greedy output
    by_system = {r["system"]: r for r in forgetting["rows"]}
    assert set(by_system) == {"frozen", "ogd", "optimistic", "hedge"}
    assert {r["category"] for r in forgetting["rows"]} == {"chat"} and all(r["n_prompts"] == 2 for r in forgetting["rows"])
    assert by_system["frozen"]["version"] == 0 and by_system["frozen"]["vs_frozen"] == 1.0
    assert by_system["ogd"]["version"] == max(r["version"] for r in per_prompt if r["system"] == "ogd")  # its final version
    assert "Forgetting check" in (tmp_path / "out" / "report.md").read_text()

    # The check alone, later, on the stores the run left: the same versions, the same figures.
    (tmp_path / "out" / "forgetting.json").unlink()
    assert run_online_bench(parser.parse_args(argv + ["--forgetting-only"]), SimpleNamespace(home=home)) == 0
    again = json.loads((tmp_path / "out" / "forgetting.json").read_text())
    assert again["rows"] == forgetting["rows"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.count("## Forgetting check") == 1 and "--forgetting-only" in report  # replaced, not added
    assert "| ogd | last_third |" in report  # the run's own rows stay

    # --rerender: the same rows from per_prompt.jsonl; a stream stopped inside a prompt is cut to whole prompts.
    out = tmp_path / "out"
    assert main(["--rerender", str(out)]) == 0
    assert json.loads((out / "results.json").read_text()) == rows
    assert "learning_curves.png" in (out / "report.md").read_text() and "Forgetting check" in (out / "report.md").read_text()
    lines = (out / "per_prompt.jsonl").read_text().splitlines()
    (out / "per_prompt.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # the last prompt lacks one system
    with pytest.raises(InvalidArgument, match="2 complete prompts"):
        rerender(out)


def test_forgetting_only_needs_stores_and_a_category(tmp_path, model_dirs, home):
    corpus = tmp_path / "book.txt"
    corpus.write_text(" ".join(["word"] * 50))
    parser = argparse.ArgumentParser()
    add_online_arguments(parser)
    argv = ["--corpus", str(corpus), "--limit", "3", "--drafter", "ngram", "--out", str(tmp_path / "out"),
            "--target", str(model_dirs.target), "--forgetting-only"]
    with pytest.raises(InvalidArgument, match="no model stores"):
        run_online_bench(parser.parse_args(argv), SimpleNamespace(home=home))
    (tmp_path / "out" / "stores" / "ogd-1234").mkdir(parents=True)
    with pytest.raises(InvalidArgument, match="no category to check"):
        run_online_bench(parser.parse_args(argv), SimpleNamespace(home=home))
