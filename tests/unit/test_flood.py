"""bench/flood.py: the pure parts (argument checks, prompt ordering, retry hints, the quota file, the
per-request record, aggregation and the report); no server, no timing asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import flood
from bench.served import StreamTiming
from specpool.core.errors import InvalidArgument, NotFound
from specpool.services.admission import parse_quotas

ROOT = Path(__file__).resolve().parents[2]
DEV_PROMPTS = ROOT.parent / "shared" / "data" / "prompts" / "dev.jsonl"


def _args(*argv: str):
    return flood.build_parser().parse_args(list(argv))


# -- arguments ----------------------------------------------------------------------------------------------
def test_defaults_are_the_issues_settings_and_pass_the_checks():
    args = _args()
    flood.check_args(args)
    assert (args.pool, args.k, args.max_new_tokens, args.reps, args.flood_clients, args.flood_quota, args.target_ratio) == \
        ("ngram", 5, 48, 3, 8, 2, 1.5)
    assert args.prompts == flood.BUILTIN and args.out == "bench-results/flood"  # never into the checkout's bench/results


@pytest.mark.parametrize("argv, words", [
    (["--reps", "0"], "--reps"),
    (["--quiet-requests", "0"], "--quiet-requests"),
    (["--flood-clients", "0"], "--flood-clients"),
    (["--flood-quota", "0"], "--flood-quota"),
    (["--max-new-tokens", "1"], "ITL needs two tokens"),
    (["-k", "0"], "-k"),
    (["--target-ratio", "0"], "--target-ratio"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--settle", "-1"], "--settle"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--pool", " , "], "--pool is empty"),
])
def test_bad_arguments_are_one_clear_error(argv, words):
    with pytest.raises(InvalidArgument, match=words.replace("-", r"\-")):
        flood.check_args(_args(*argv))


def test_command_line_is_the_exact_invocation():
    assert flood.command_line(["--reps", "3", "--prompts", "a b.jsonl"]) == \
        "python -m bench.flood --reps 3 --prompts 'a b.jsonl'"


def test_phases_alternate_between_repetitions():
    assert flood.phase_order(0, False) == ["unloaded", "flooded"]
    assert flood.phase_order(1, False) == ["flooded", "unloaded"]
    assert flood.phase_order(2, True) == ["unloaded", "flooded", "unquoted"]
    assert flood.phase_order(3, True) == ["unquoted", "flooded", "unloaded"]


def test_the_quota_file_caps_only_the_flooding_tenant():
    quotas = parse_quotas(json.loads(flood.quotas_document("flood", 2)), "test", known_tenants={"quiet", "flood"})
    assert quotas.of("flood").max_concurrent == 2
    assert quotas.of("quiet").max_concurrent is None and quotas.of("unquoted").max_concurrent is None


# -- prompts ------------------------------------------------------------------------------------------------
def test_prompts_are_interleaved_by_category():
    items = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2")]
    assert [p for _, p in flood.interleave_by_category(items)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert flood.interleave_by_category([]) == []


def test_builtin_prompts_and_a_prompt_file(tmp_path):
    items, label = flood.load_prompt_set("builtin")
    assert len(items) == len(flood.HELDOUT_PROMPTS) and "held-out" in label
    assert len({c for c, _ in items[:6]}) == 6  # the first six cover six kinds of prompt
    path = tmp_path / "p.jsonl"
    path.write_text('{"category": "x", "turns": ["x1"]}\n{"category": "x", "turns": ["x2"]}\n'
                    '{"category": "y", "turns": ["y1"]}\n')
    assert flood.load_prompt_set(str(path)) == ([("x", "x1"), ("y", "y1"), ("x", "x2")], str(path))
    with pytest.raises(NotFound):
        flood.load_prompt_set(str(tmp_path / "missing.jsonl"))


def test_the_held_out_prompts_are_not_in_the_dev_set():
    if not DEV_PROMPTS.is_file():
        pytest.skip(f"{DEV_PROMPTS} not here")
    dev = " ".join(line.lower() for line in DEV_PROMPTS.read_text(encoding="utf-8").splitlines())
    assert not [p for _, p in flood.HELDOUT_PROMPTS if p.lower()[:60] in dev]


# -- retry hints --------------------------------------------------------------------------------------------
def test_retry_hint_prefers_milliseconds_then_seconds_then_the_default():
    assert flood.retry_hint_s([("retry-after", "2"), ("retry-after-ms", "1500")]) == pytest.approx(1.5)
    assert flood.retry_hint_s((("Retry-After", "3"),)) == 3.0
    assert flood.retry_hint_s([("retry-after", "soon")]) == flood.DEFAULT_RETRY_S
    assert flood.retry_hint_s(None, default=0.25) == 0.25
    assert flood.retry_hint_s([("retry-after-ms", "-5"), ("retry-after", "1")]) == 1.0  # a negative hint is no hint


# -- per request --------------------------------------------------------------------------------------------
def test_quiet_record_ttft_itl_and_digest():
    timing = StreamTiming(arrivals=[(0.5, 0), (1.0, 1), (1.3, 3), (1.5, 1)], wall_s=1.6)
    record = flood.quiet_record(timing, [5, 6, 7, 8, 9], phase="flooded", rep=2, index=0, prompt=4)
    assert record["ttft_s"] == 1.0 and record["tokens"] == 5 and record["first_message_tokens"] == 1
    assert record["itl_s"] == pytest.approx((1.5 - 1.0) / 4)  # (last - first) / (tokens - 1): one token first
    assert record["messages"] == 3 and (record["phase"], record["rep"], record["prompt"]) == ("flooded", 2, 4)
    same = flood.quiet_record(timing, [5, 6, 7, 8, 9], phase="unloaded", rep=2, index=0, prompt=4)
    other = flood.quiet_record(timing, [5, 6, 7, 8, 10], phase="unloaded", rep=2, index=0, prompt=4)
    assert same["digest"] == record["digest"] != other["digest"]
    one = flood.quiet_record(StreamTiming(arrivals=[(0.2, 3)], wall_s=0.2), [1, 2, 3], phase="unloaded", rep=1, index=0, prompt=0)
    assert one["itl_s"] is None  # a single message has no gap


def test_flood_tally_counts_and_rate():
    tally = flood.FloodTally()
    tally.add(attempts=3)
    tally.add(admitted=1, in_flight=1, tokens=10)
    tally.add(admitted=1, in_flight=1, tokens=5)
    tally.add(in_flight=-1, completed=1)
    tally.refusal(1.0)
    tally.refusal(0.5)
    tally.error("UNAVAILABLE")
    out = tally.as_dict(seconds=5.0)
    assert (out["attempts"], out["admitted"], out["refused"], out["completed"], out["tokens"]) == (3, 2, 2, 1, 15)
    assert out["max_in_flight_seen"] == 2 and out["tokens_per_s"] == 3.0 and out["errors"] == {"UNAVAILABLE": 1}
    assert out["retry_hint_s"] == {"min": 0.5, "median": 0.75, "max": 1.0}
    assert flood.FloodTally().as_dict(0.0)["tokens_per_s"] is None


# -- aggregation --------------------------------------------------------------------------------------------
def _rec(phase, rep, index, itl, ttft=0.2, digest="d"):
    return {"phase": phase, "rep": rep, "index": index, "prompt": index, "itl_s": itl, "ttft_s": ttft,
            "digest": f"{digest}{index}", "first_message_tokens": 1}


RECORDS = (
    [_rec("unloaded", 1, i, v) for i, v in enumerate([0.10, 0.20, 0.30])]
    + [_rec("flooded", 1, i, v, ttft=0.4) for i, v in enumerate([0.12, 0.30, 0.33])]
    + [_rec("unloaded", 2, i, v) for i, v in enumerate([0.10, 0.10, 0.10])]
    + [_rec("flooded", 2, i, v, ttft=0.4, digest="e" if i == 0 else "d") for i, v in enumerate([0.20, 0.20, 0.20])]
)


def test_metric_summary_pooled_per_rep_and_paired():
    out = flood.metric_summary(RECORDS, "itl_s", ["unloaded", "flooded"])
    unloaded, flooded = out["phases"]["unloaded"], out["phases"]["flooded"]
    assert unloaded["median"] == pytest.approx(0.10) and unloaded["n"] == 6
    assert flooded["median"] == pytest.approx(0.20) and flooded["p75"] == pytest.approx(0.275)
    assert out["flooded"]["ratio_of_medians"] == pytest.approx(2.0)
    assert [round(x["ratio"], 3) for x in out["flooded"]["per_rep"]] == [1.5, 2.0]
    assert out["flooded"]["per_rep_ratio"] == pytest.approx({"median": 1.75, "min": 1.5, "max": 2.0})
    # paired (same rep and prompt): 1.2, 1.5, 1.1, 2, 2, 2
    assert out["flooded"]["paired"]["median"] == pytest.approx(1.75) and out["flooded"]["paired"]["n"] == 6
    ttft = flood.metric_summary(RECORDS, "ttft_s", ["unloaded", "flooded"])
    assert ttft["flooded"]["ratio_of_medians"] == pytest.approx(2.0)


def test_summary_leaves_out_requests_without_itl_and_handles_a_missing_phase():
    records = RECORDS + [dict(_rec("flooded", 1, 3, None))]
    out = flood.metric_summary(records, "itl_s", ["unloaded", "flooded"])
    assert out["phases"]["flooded"]["n"] == 6
    only_unloaded = flood.metric_summary(RECORDS[:3], "itl_s", ["unloaded", "flooded"])
    assert only_unloaded["phases"]["flooded"] is None and only_unloaded["flooded"]["ratio_of_medians"] is None


def test_identical_outputs_pairs_by_rep_and_prompt():
    assert flood.identical_outputs(RECORDS, "flooded") == {"pairs": 6, "identical": 5}


def test_flood_tallies_merge_and_batch_histograms():
    a = flood.FloodTally(attempts=10, admitted=3, refused=7, completed=2, cancelled_at_stop=1, tokens=100,
                         max_in_flight=2, hints=[1.0]).as_dict(10.0)
    b = flood.FloodTally(attempts=5, admitted=2, refused=3, completed=2, tokens=60, max_in_flight=2,
                         errors={"UNAVAILABLE": 1}, hints=[0.5, 2.0]).as_dict(6.0)
    merged = flood.merge_flood([a, b])
    assert (merged["attempts"], merged["admitted"], merged["refused"], merged["tokens"]) == (15, 5, 10, 160)
    assert merged["tokens_per_s"] == pytest.approx(10.0) and merged["max_in_flight_seen"] == 2
    assert merged["errors"] == {"UNAVAILABLE": 1} and merged["retry_hint_s"] == {"min": 0.5, "max": 2.0}
    assert flood.merge_flood([]) == {}
    assert flood.batch_size_delta({1: 5, 3: 2}, {1: 9, 3: 2, 2: 4}) == {"1": 4, "2": 4}
    assert flood.batch_size_delta(None, {1: 2}) == {}
    total = flood.add_histograms([{"1": 4, "3": 10}, {"3": 2, "10": 1}])
    assert total == {"1": 4, "3": 12, "10": 1} and list(total) == ["1", "3", "10"]
    assert flood.mean_batch({"1": 2, "3": 2}) == 2.0 and flood.mean_batch({}) is None


def _report(records, target_ratio=1.5, prompts="built-in held-out set (12 prompts, bench/flood.py)"):
    phases = ["unloaded", "flooded"]
    tally = flood.FloodTally(attempts=20, admitted=6, refused=14, completed=5, cancelled_at_stop=1, tokens=240,
                             max_in_flight=2, hints=[1.0]).as_dict(30.0)
    summary = flood.build_summary(records, {"flooded": [tally]}, {"unloaded": [{"1": 40}], "flooded": [{"3": 40, "1": 2}]},
                                  phases, target_ratio)
    return {"command": "python -m bench.flood", "machine": {"cpu": "test cpu", "cores": 2, "torch": "x", "torch_threads": 2},
            "load": {"before": [0.5, 0.4, 0.3], "after": [2.1, 1.0, 0.5]},
            "config": {"pool": "ngram", "k": 5, "max_new_tokens": 48, "reps": 2, "quiet_requests": 3, "flood_clients": 8,
                       "flood_quota": 2, "control": False, "phases": phases, "max_batch_size": 8, "prompts": prompts},
            "wall_s": 300.0, "summary": summary}


def test_verdict_and_report_say_fail_over_the_target():
    report = _report(RECORDS)  # ratio 2.0
    assert report["summary"]["pass"] is False and report["summary"]["reps_within_target"] == 1
    text = flood.markdown_report(report, "itl.png")
    assert text.splitlines()[2].startswith("**FAIL**") and "**2.00×** its unloaded value (target ≤ 1.5×)" in text
    assert "1 of 2 repetitions" in text and "| flooded | `flood` (max_concurrent 2) | 20 | 6 | 14 |" in text
    assert "5 of 6" in text and "![quiet tenant ITL per request](itl.png)" in text
    assert "mean verify batch" in text and "2.90" in text  # (40 x 3 + 2 x 1) / 42
    assert "(tokens − 1)" in text  # every first message held one token
    assert "this run used the built-in held-out set" in text and "[0.5, 0.4, 0.3]" in text


def test_verdict_passes_within_the_target_and_the_report_asks_for_held_out_prompts():
    report = _report(RECORDS, target_ratio=2.0, prompts="../shared/data/prompts/dev.jsonl")
    assert report["summary"]["pass"] is True
    text = flood.markdown_report(report, None)
    assert text.splitlines()[2].startswith("**PASS**") and "itl.png" not in text
    assert "re-measure with the built-in held-out set" in text


def test_report_renders_without_itl_figures():
    records = [dict(_rec("unloaded", 1, 0, None)), dict(_rec("flooded", 1, 0, None))]
    report = _report(records)
    assert report["summary"]["pass"] is False and report["summary"]["ratio"] is None
    assert "**FAIL**" in flood.markdown_report(report, None)


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    flood.plot_itl(RECORDS, ["unloaded", "flooded"], tmp_path / "itl.png", "test", 1.5)
    assert (tmp_path / "itl.png").stat().st_size > 1000


def test_a_failed_quiet_request_is_counted_and_named_not_paired():
    failed = flood.failed_record("UNAVAILABLE: router gone", phase="flooded", rep=1, index=0, prompt=0)
    records = [r for r in RECORDS if not (r["phase"] == "flooded" and r["rep"] == 1 and r["index"] == 0)] + [failed]
    report = _report(records)
    report["quiet_requests"] = records
    s = report["summary"]
    assert s["quiet_errors"] == {"unloaded": 0, "flooded": 1} and s["quiet_requests_without_itl"] == 0
    assert flood.identical_outputs(records, "flooded") == {"pairs": 5, "identical": 4}
    assert s["itl"]["phases"]["flooded"]["n"] == 5
    assert "**1 quiet request(s) failed** (flooded): UNAVAILABLE: router gone" in flood.markdown_report(report, None)
