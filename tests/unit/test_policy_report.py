"""Aggregation of ``specpool bench --policies`` (bench/policy_report.py) on hand-made records."""

from __future__ import annotations

import pytest

from bench import policy_report as pr


def rec(i, category, system, kind, tokens, wall, emitted, arms=None, leaders=None, chooser_s=0.0):
    return {"prompt_index": i, "category": category, "system": system, "kind": kind, "new_tokens": tokens,
            "wall_s": wall, "rounds": len(emitted), "round_s": wall, "chooser_s": chooser_s,
            "matches_target": None if system == "target" else True, "emitted": emitted,
            "arms": arms or [None] * len(emitted), "leaders": leaders}


RECORDS = [
    # prompt 0 (code): fixed:a is fast (2 rounds), fixed:b slow (4 rounds)
    rec(0, "code", "target", "target", 8, 8.0, [1] * 8),
    rec(0, "code", "fixed:a", "fixed", 8, 2.0, [4, 4], ["a", "a"]),
    rec(0, "code", "fixed:b", "fixed", 8, 4.0, [2, 2, 2, 2], ["b"] * 4),
    rec(0, "code", "p", "policy", 8, 3.0, [2, 2, 4], ["b", "a", "a"], ["b", "a", "a"], chooser_s=0.03),
    rec(0, "code", "oracle", "oracle", 8, 2.0, [4, 4], ["a", "a"]),
    # prompt 1 (math): fixed:b is the better one
    rec(1, "math", "target", "target", 8, 8.0, [1] * 8),
    rec(1, "math", "fixed:a", "fixed", 8, 8.0, [2, 2, 2, 2], ["a"] * 4),
    rec(1, "math", "fixed:b", "fixed", 8, 2.0, [4, 4], ["b", "b"]),
    rec(1, "math", "p", "policy", 8, 4.0, [2, 2, 4], ["a", "b", "b"], ["a", "a", "b"], chooser_s=0.04),
    rec(1, "math", "oracle", "oracle", 8, 2.0, [4, 4], ["b", "b"]),
]


def row(rows, category, system):
    return next(r for r in rows if r["category"] == category and r["system"] == system)


def test_best_fixed_and_stopping_time_best():
    # pooled: a 16 tokens / 10 s, b 16 / 6 s
    assert pr.best_fixed(RECORDS) == "fixed:b"
    assert pr.stopping_time_best(RECORDS) == {0: "a", 1: "b"}


@pytest.mark.parametrize("leaders, best, expected", [
    (["b", "a", "a"], "a", 2), (["a", "a", "b"], "b", 3), (["a", "a"], "a", 1),
    (["a", "b"], "a", None), ([], "a", None), (["a@3", "b@2", "b@5"], "b", 2),
])
def test_rounds_to_identify(leaders, best, expected):
    assert pr.rounds_to_identify(leaders, best) == expected


@pytest.mark.parametrize("emitted, budget, expected", [([2, 2, 4], 1, 1), ([2, 2, 4], 4, 2), ([2, 2, 4], 5, 3), ([2, 2], 5, None)])
def test_rounds_to_reach(emitted, budget, expected):
    assert pr.rounds_to_reach(emitted, budget) == expected


def test_aggregate_rows_and_summary():
    rows, summary = pr.aggregate(RECORDS)
    p_code = row(rows, "code", "p")
    assert p_code["tokens_per_s"] == pytest.approx(8 / 3)
    assert p_code["ratio_to_oracle"] == pytest.approx((8 / 3) / 4)
    assert p_code["ratio_to_best_fixed"] == pytest.approx((8 / 3) / 2)  # vs fixed:b on prompt 0
    assert p_code["speedup_vs_target"] == pytest.approx(8 / 3)
    assert p_code["rounds_per_100_tokens"] == pytest.approx(100 * 3 / 8)
    assert p_code["mean_accepted_length"] == pytest.approx(8 / 3)
    assert p_code["rounds_to_identify"] == 2 and p_code["identified_share"] == 1.0
    assert p_code["chooser_fraction"] == pytest.approx(0.01)
    p_all = row(rows, "all", "p")
    assert p_all["n_prompts"] == 2
    assert p_all["pooled_ratio_to_best_fixed"] == pytest.approx((16 / 7) / (16 / 6))
    # category mean of pooled ratios to the oracle: code (8/3)/4, math (8/4)/4
    assert summary["policies"]["p"]["ratio_to_oracle_category_mean"] == pytest.approx(((8 / 3) / 4 + 2 / 4) / 2)
    assert summary["best_fixed"] == "fixed:b"
    # stopping time: each prompt's fewest-rounds fixed drafter needs 2 + 2 rounds for 16 tokens
    assert summary["stopping_time_oracle_rounds_per_100_tokens"] == pytest.approx(25.0)
    assert summary["policies"]["p"]["rounds_per_100_tokens"] == pytest.approx(100 * 6 / 16)
    assert summary["policies"]["p"]["ratio_to_best_fixed"] == pytest.approx(((8 / 3) / 2 + (8 / 4) / 4) / 2)
    assert row(rows, "all", "fixed:a")["chooser_fraction"] is None


def test_regret_curves():
    curves = pr.regret_curves(RECORDS, [2, 4, 8])
    # p vs each prompt's best fixed: prompt 0 rounds (1, 2, 3) vs a (1, 1, 2); prompt 1 (1, 2, 3) vs b (1, 1, 2)
    assert curves["p"] == [0.0, 1.0, 1.0]
    assert curves["oracle"] == [0.0, 0.0, 0.0]
    assert "fixed:a" not in curves


def test_markdown_and_plots(tmp_path):
    rows, _ = pr.aggregate(RECORDS)
    table = pr.markdown_table(rows, "all")
    assert table.count("\n") == 1 + 5  # header, rule, 5 systems
    assert "| all | `p` | 2 |" in table
    pr.plot_arm_choices(RECORDS, "p", tmp_path / "arms.png")
    pr.plot_regret(pr.regret_curves(RECORDS, [2, 4, 8]), [2, 4, 8], tmp_path / "regret.png", "t")
    assert (tmp_path / "arms.png").stat().st_size > 1000 and (tmp_path / "regret.png").stat().st_size > 1000
