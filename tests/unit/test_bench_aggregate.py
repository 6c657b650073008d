"""bench/report.py aggregation and rendering, and bench/speed.py input checks, on hand-made data."""

import json

import pytest

from bench import report
from bench.common import load_questions, parse_drafters
from specpool.core.errors import InvalidArgument, NotFound


def rec(index, category, system, new_tokens, wall_s, rounds=None, round_s=None, draft_s=0.0, verify_s=0.0, matches=True):
    ours = not system.startswith("hf-")
    return {
        "prompt_index": index, "category": category, "system": system, "ours": ours,
        "new_tokens": new_tokens, "wall_s": wall_s, "rounds": rounds if ours else None,
        "round_s": round_s if ours else None, "draft_forward_s": draft_s if ours else None,
        "verify_forward_s": verify_s if ours else None,
        "matches_target": None if system == report.TARGET else matches,
    }


# Two categories, two prompts each. Target runs at 10 tok/s on every prompt, so ratios are easy.
RECORDS = [
    rec(0, "code", "target", 20, 2.0, rounds=20, round_s=2.0, verify_s=1.8),
    rec(0, "code", "ngram", 20, 1.0, rounds=5, round_s=1.0, verify_s=0.9),  # 2x, tau 4, 10% bookkeeping
    rec(0, "code", "hf-prompt-lookup", 20, 0.8),  # 2.5x
    rec(1, "code", "target", 10, 1.0, rounds=10, round_s=1.0, verify_s=0.9),
    rec(1, "code", "ngram", 10, 0.25, rounds=5, round_s=0.25, draft_s=0.05, verify_s=0.15),  # 4x, tau 2, 20%
    rec(1, "code", "hf-prompt-lookup", 10, 0.5),  # 2x
    rec(2, "chat", "target", 10, 1.0, rounds=10, round_s=1.0, verify_s=0.9),
    rec(2, "chat", "ngram", 10, 1.25, rounds=10, round_s=1.25, verify_s=1.0, matches=False),  # 0.8x, mismatch
    rec(2, "chat", "hf-prompt-lookup", 10, 1.0),  # 1x
]


def rows_by_key(rows):
    return {(r["category"], r["system"]): r for r in rows}


def test_summarize_median_and_quartiles_skip_none():
    assert report.summarize([1.0, None, 2.0, 3.0, 4.0, 5.0]) == (3.0, 2.0, 4.0)
    assert report.summarize([None]) == (None, None, None)
    assert report.summarize([]) == (None, None, None)


def test_hf_peer_maps_ngram_and_model_drafters():
    assert report.hf_peer("ngram") == "hf-prompt-lookup"
    assert report.hf_peer("ngram:1-3") == "hf-prompt-lookup"
    assert report.hf_peer("hf:/m/small") == "hf-assisted:hf:/m/small"
    assert report.hf_peer("target") is None


def test_aggregate_rows_order_and_counts():
    rows = report.aggregate(RECORDS)
    assert [(r["category"], r["system"]) for r in rows] == [
        (c, s) for c in ("code", "chat", "all") for s in ("target", "ngram", "hf-prompt-lookup")
    ]
    by = rows_by_key(rows)
    assert by[("code", "ngram")]["n_prompts"] == 2 and by[("all", "ngram")]["n_prompts"] == 3


def test_aggregate_speedups_are_per_prompt_ratios():
    by = rows_by_key(report.aggregate(RECORDS))
    code = by[("code", "ngram")]
    assert code["tokens_per_s"] == pytest.approx(30.0)  # median of 20 and 40
    assert code["speedup_vs_target"] == pytest.approx(3.0)  # median of 2x and 4x
    assert (code["speedup_p25"], code["speedup_p75"]) == (pytest.approx(2.5), pytest.approx(3.5))
    assert code["vs_hf_peer"] == "hf-prompt-lookup"
    assert code["vs_hf"] == pytest.approx((0.8 + 2.0) / 2)  # per prompt: 20/25 and 40/20
    everything = by[("all", "ngram")]
    assert everything["speedup_vs_target"] == pytest.approx(2.0)  # median of 2, 4, 0.8
    assert by[("all", "target")]["speedup_vs_target"] == pytest.approx(1.0)
    assert by[("code", "hf-prompt-lookup")]["speedup_vs_target"] == pytest.approx(2.25)


def test_aggregate_accepted_length_bookkeeping_and_mismatches():
    by = rows_by_key(report.aggregate(RECORDS))
    assert by[("code", "ngram")]["mean_accepted_length"] == pytest.approx(30 / 10)  # pooled tokens / rounds
    assert by[("code", "ngram")]["bookkeeping_fraction"] == pytest.approx(0.15)  # median of 10% and 20%
    assert by[("code", "target")]["mean_accepted_length"] == pytest.approx(1.0)
    hf = by[("code", "hf-prompt-lookup")]
    assert hf["mean_accepted_length"] is None and hf["bookkeeping_fraction"] is None and hf["vs_hf"] is None
    assert by[("chat", "ngram")]["lossless_mismatches"] == 1
    assert by[("all", "ngram")]["lossless_mismatches"] == 1
    assert by[("all", "hf-prompt-lookup")]["lossless_mismatches"] == 0
    assert report.mismatch_counts(RECORDS) == {"ngram": 1, "hf-prompt-lookup": 0}


def test_aggregate_without_target_gives_no_speedup():
    rows = report.aggregate([rec(0, "qa", "ngram", 10, 1.0, rounds=5, round_s=1.0)])
    assert rows[0]["speedup_vs_target"] is None and rows[0]["tokens_per_s"] == pytest.approx(10.0)


def test_markdown_report_has_header_table_and_mismatches():
    rows = report.aggregate(RECORDS)
    text = report.markdown_report([("k", "5"), ("command", "`specpool bench`")], rows, report.mismatch_counts(RECORDS), "speedup.png")
    assert "- **k**: 5" in text and "`specpool bench`" in text
    assert "| code | `ngram` | 2 | 30.0 [25.0, 35.0] | 3.00 [2.50, 3.50] | 1.40 [1.10, 1.70] | 3.00 | 15% | 0 |" in text
    assert "| all | `hf-prompt-lookup` | 3 |" in text
    assert "`ngram` 1" in text and "![speedup" in text
    clean = [dict(r, lossless_mismatches=0) for r in rows]
    assert "lossless" in report.markdown_report([], clean, {"ngram": 0}, None)


def test_a_sampled_run_reports_no_comparison_rather_than_zero_mismatches():
    """Sampled outputs are not compared with target-only's (matches_target None): the table says
    "–" and the report says so, instead of claiming every output equals target-only's."""
    sampled = [dict(r, matches_target=None) for r in RECORDS]
    rows = report.aggregate(sampled)
    assert all((r["lossless_mismatches"] == 0) if r["system"] == report.TARGET else r["lossless_mismatches"] is None
               for r in rows)
    counts = report.mismatch_counts(sampled)
    assert counts == {"ngram": None, "hf-prompt-lookup": None}
    text = report.markdown_report([], rows, counts, None)
    assert "lossless" not in text and "not compared token by token" in text
    assert "| all | `ngram` |" in text and text.count(" | – |") >= len([r for r in rows if r["system"] != report.TARGET])


def test_plot_speedup_writes_png(tmp_path):
    path = tmp_path / "speedup.png"
    report.plot_speedup(report.aggregate(RECORDS), path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- inputs -------------------------------------------------------------------------------------
def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def question(i, category, text="Why?"):
    return json.dumps({"question_id": i, "category": category, "turns": [text, "second turn"]})


def test_load_questions_takes_first_turn_and_limits_per_category(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [question(1, "a", "one"), question(2, "a"), "", question(3, "b"), question(4, "a")])
    questions = load_questions(path, 2)
    assert [(q.question_id, q.category) for q in questions] == [(1, "a"), (2, "a"), (3, "b")]
    assert questions[0].prompt == "one"


@pytest.mark.parametrize("lines, limit, error, message", [
    ([question(1, "a"), "{not json"], 5, InvalidArgument, "line 2: not valid JSON"),
    ([json.dumps({"category": "a", "turns": []})], 5, InvalidArgument, "line 1: \"turns\""),
    ([json.dumps({"turns": ["x"]})], 5, InvalidArgument, "line 1: missing or empty \"category\""),
    ([json.dumps([1, 2])], 5, InvalidArgument, "line 1: expected a JSON object"),
    (["", "  "], 5, InvalidArgument, "holds no questions"),
    ([question(1, "a")], 0, InvalidArgument, "--limit-per-category must be >= 1"),
])
def test_load_questions_rejects_bad_input(tmp_path, lines, limit, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        load_questions(write_lines(tmp_path / "q.jsonl", lines), limit)


def test_load_questions_missing_file(tmp_path):
    with pytest.raises(NotFound, match="does not exist"):
        load_questions(tmp_path / "nope.jsonl", 5)


def test_parse_drafters():
    assert parse_drafters(" ngram , hf:/m ") == ["ngram", "hf:/m"]
    for text, error in [("", InvalidArgument), ("ngram,ngram", InvalidArgument), ("none", InvalidArgument), ("nosuchkind", NotFound)]:
        with pytest.raises(error):
            parse_drafters(text)
