"""bench/http_vs_grpc.py, the pure parts: which path goes first, pairing two requests, the ratio
summary, the report and the command line. No server: the run itself is the benchmark."""

from __future__ import annotations

import io
import json
import shlex

import pytest

from bench import http_vs_grpc as hg
from bench.common import Question
from specpool.core.errors import InvalidArgument


def row(path, *, tokens=64, wall=4.0, ttft=0.5, text="same text", qid=1, rep=0, position=0, mode="stream",
        server_wall=None, prompt_tokens=20):
    return hg.RequestRow(path, mode, qid, "code", rep, position, text, tokens, prompt_tokens, wall,
                         ttft if mode == "stream" else None, server_wall, 10)


# -- order ---------------------------------------------------------------------------------------------
def test_order_alternates_over_prompts_and_flips_with_the_rep():
    firsts = [[hg.order_for(i, rep)[0] for i in range(4)] for rep in range(2)]
    assert firsts == [["grpc", "http", "grpc", "http"], ["http", "grpc", "http", "grpc"]]
    for i in range(5):
        for rep in range(3):
            assert sorted(hg.order_for(i, rep)) == ["grpc", "http"]  # both paths, once each


def test_two_reps_run_every_prompt_in_both_orders():
    for i in range(7):
        assert {hg.order_for(i, 0), hg.order_for(i, 1)} == {("grpc", "http"), ("http", "grpc")}


# -- pairing -------------------------------------------------------------------------------------------
def test_pair_record_ratio_is_http_over_grpc_tokens_per_s():
    p = hg.pair_record(row("grpc", tokens=64, wall=4.0, position=1, server_wall=3.5),
                       row("http", tokens=64, wall=5.0, position=0, server_wall=3.6))
    assert p["grpc_tps"] == pytest.approx(16.0) and p["http_tps"] == pytest.approx(12.8)
    assert p["ratio"] == pytest.approx(0.8)
    assert p["first"] == "http"
    assert p["grpc_outside_s"] == pytest.approx(0.5) and p["http_outside_s"] == pytest.approx(1.4)
    assert p["identical_text"] and p["same_tokens"] and p["same_prompt_tokens"]


def test_pair_record_flags_differing_texts_and_counts():
    p = hg.pair_record(row("grpc", text="a b c", tokens=3), row("http", text="a b d", tokens=4, prompt_tokens=21))
    assert not p["identical_text"] and not p["same_tokens"] and not p["same_prompt_tokens"]


def test_pair_record_refuses_rows_of_different_requests_or_swapped_paths():
    with pytest.raises(InvalidArgument, match="different requests"):
        hg.pair_record(row("grpc", qid=1), row("http", qid=2))
    with pytest.raises(InvalidArgument, match="different requests"):
        hg.pair_record(row("grpc", rep=0), row("http", rep=1))
    with pytest.raises(InvalidArgument, match="gRPC row, then an HTTP row"):
        hg.pair_record(row("http"), row("grpc"))


def test_zero_time_gives_no_ratio_rather_than_a_crash():
    p = hg.pair_record(row("grpc", wall=0.0), row("http"))
    assert p["grpc_tps"] is None and p["ratio"] is None


# -- summary -------------------------------------------------------------------------------------------
def _pairs(http_walls, grpc_wall=4.0, tokens=64):
    return [hg.pair_record(row("grpc", wall=grpc_wall, qid=i, tokens=tokens, position=i % 2, ttft=0.1 * (i + 1)),
                           row("http", wall=w, qid=i, tokens=tokens, position=1 - i % 2, ttft=0.2 * (i + 1)))
            for i, w in enumerate(http_walls)]


def test_summary_median_quartiles_and_pooled_ratio():
    walls = [4.0, 5.0, 8.0, 4.0 / 1.1, 10.0]  # ratios 1.0, 0.8, 0.5, 1.1, 0.4
    s = hg.ratio_summary(_pairs(walls))
    assert s["pairs"] == 5
    assert s["ratio"]["median"] == pytest.approx(0.8)
    assert s["ratio"]["p25"] == pytest.approx(0.5) and s["ratio"]["p75"] == pytest.approx(1.0)
    assert (s["ratio"]["min"], s["ratio"]["max"]) == (pytest.approx(0.4), pytest.approx(1.1))
    # Pooled: total tokens / total time of each path; not the mean of the ratios.
    assert s["grpc"]["tokens_per_s"] == pytest.approx(5 * 64 / 20.0)
    assert s["http"]["tokens_per_s"] == pytest.approx(5 * 64 / sum(walls))
    assert s["ratio_pooled"] == pytest.approx(20.0 / sum(walls))
    assert s["ratio_pooled"] != pytest.approx(sum([1.0, 0.8, 0.5, 1.1, 0.4]) / 5)
    assert not s["meets_goal"]


def test_summary_ttft_of_both_paths_and_order_split():
    s = hg.ratio_summary(_pairs([4.0] * 10))
    assert s["grpc"]["ttft_s"]["median"] == pytest.approx(0.55)  # 0.1 .. 1.0
    assert s["http"]["ttft_s"]["median"] == pytest.approx(1.1)  # 0.2 .. 2.0
    assert s["grpc"]["ttft_s"]["p90"] == pytest.approx(0.91) and s["http"]["ttft_s"]["p90"] == pytest.approx(1.82)
    assert s["grpc_first_ratio"]["n"] == 5 and s["http_first_ratio"]["n"] == 5
    assert s["meets_goal"] and s["ratio_pooled"] == pytest.approx(1.0)


def test_summary_counts_mismatches():
    pairs = _pairs([4.0] * 3)
    pairs[1]["identical_text"] = False
    pairs[2]["same_tokens"] = False
    s = hg.ratio_summary(pairs)
    assert (s["text_mismatches"], s["token_count_mismatches"], s["prompt_token_mismatches"]) == (1, 1, 0)


def test_goal_needs_both_the_median_and_the_pooled_ratio():
    # Median 1.0 but one very slow HTTP request drags the pooled ratio below 0.95.
    s = hg.ratio_summary(_pairs([4.0, 4.0, 40.0]))
    assert s["ratio"]["median"] == pytest.approx(1.0) and s["ratio_pooled"] < hg.GOAL_RATIO
    assert not s["meets_goal"]


def test_unary_pairs_have_no_ttft():
    pairs = [hg.pair_record(row("grpc", mode="unary"), row("http", mode="unary"))]
    s = hg.ratio_summary(pairs)
    assert s["grpc"]["ttft_s"] is None and s["http"]["ttft_s"] is None


# -- the loop over prompts (plain functions stand in for the two paths) -------------------------------------
def test_run_pairs_sends_in_alternating_order_and_writes_every_row():
    sent = []

    def path(name):
        def send(prompt):
            sent.append((name, prompt))
            return dict(text=prompt.upper(), completion_tokens=8, prompt_tokens=3, wall_s=1.0 if name == "grpc" else 2.0,
                        ttft_s=0.1, server_wall_s=0.9, rounds=2)
        return send

    questions = [Question(i, "chat", f"prompt {i}") for i in range(3)]
    sink = io.StringIO()
    pairs = hg.run_pairs(questions, 2, "stream", {"grpc": path("grpc"), "http": path("http")}, sink, lambda p: None)
    assert [name for name, _ in sent] == ["grpc", "http", "http", "grpc", "grpc", "http",
                                          "http", "grpc", "grpc", "http", "http", "grpc"]
    assert [p["first"] for p in pairs] == ["grpc", "http", "grpc", "http", "grpc", "http"]
    assert all(p["ratio"] == pytest.approx(0.5) and p["identical_text"] for p in pairs)
    rows = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert len(rows) == 12 and {r["path"] for r in rows} == {"grpc", "http"}
    assert rows[0]["tokens_per_s"] == pytest.approx(8.0) and rows[0]["text"] == "PROMPT 0"


# -- report and command --------------------------------------------------------------------------------------
def _result(unary=True):
    stream = hg.ratio_summary(_pairs([4.0, 4.2, 4.4, 3.9]))
    return {
        "command": "python -m bench.http_vs_grpc --prompts p.jsonl",
        "machine": {"cpu": "Test CPU", "cores": 2, "torch": "t", "ray": "r", "grpcio": "g", "openai": "o", "httpx": "h"},
        "config": {"target": "T", "model": "m", "pool": ["ngram"], "policy": "metasd-ucb", "k": 5, "max_new_tokens": 64,
                   "prompts_file": "p.jsonl", "prompts": 2, "limit_per_category": 1, "reps": 2, "unary_reps": 1},
        "stream": stream,
        "unary": hg.ratio_summary([hg.pair_record(row("grpc", mode="unary"), row("http", mode="unary", wall=4.4))]) if unary else None,
        "notes": ["A finding."],
    }


def test_report_states_ratios_ttft_mismatches_machine_and_command():
    result = _result()
    text = hg.markdown_report(result)
    s = result["stream"]
    assert f"median {s['ratio']['median']:.3f} [p25 {s['ratio']['p25']:.3f}, p75 {s['ratio']['p75']:.3f}]" in text
    assert f"pooled (total tokens / total time) **{s['ratio_pooled']:.3f}**" in text
    assert f"{s['grpc']['ttft_s']['median'] * 1000:.0f} ms | {s['grpc']['ttft_s']['p90'] * 1000:.0f} ms" in text
    assert f"{s['http']['ttft_s']['median'] * 1000:.0f} ms | {s['http']['ttft_s']['p90'] * 1000:.0f} ms" in text
    assert "Mismatches (greedy, must be 0): text 0" in text
    assert "Test CPU (2 cores)" in text and "`python -m bench.http_vs_grpc --prompts p.jsonl`" in text
    assert "## Non-streaming" in text and "A finding." in text
    assert "## Non-streaming" not in hg.markdown_report(_result(unary=False))


def test_report_says_when_the_goal_is_missed():
    result = _result()
    result["stream"] = hg.ratio_summary(_pairs([8.0, 8.0]))
    assert "NOT met" in hg.markdown_report(result)


def test_command_line_parses_back_to_the_same_settings():
    args = hg.build_parser().parse_args(["--prompts", "../p.jsonl", "--limit-per-category", "2", "--max-new-tokens", "64",
                                         "--reps", "2", "--pool", "ngram", "-k", "4", "--out", "out dir"])
    words = shlex.split(hg.command_line(args))
    assert words[:3] == ["python", "-m", "bench.http_vs_grpc"]
    again = hg.build_parser().parse_args(words[3:])
    for name in ("prompts", "limit_per_category", "max_new_tokens", "reps", "unary_reps", "pool", "policy", "k", "out"):
        assert getattr(again, name) == getattr(args, name), name


def test_cli_without_prompts_is_one_line_and_status_2(capsys):
    assert hg.main(["--out", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompts is required" in err


def test_rerender_writes_the_readme_from_results(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(_result()))
    assert hg.main(["--rerender", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == hg.markdown_report(_result())
    assert hg.main(["--rerender", str(tmp_path / "missing")]) == 2
