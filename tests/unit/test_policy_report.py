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


# -- steady time: every call priced at its median over the prompt's runs ----------------------------

def timed(i, system, kind, arms, proposed, draft_ms, verify_ms, sources=None, tokens=None, outside_ms=0.0):
    emitted = [p + 1 for p in proposed]
    other_ms = [1.0] * len(arms)
    wall = (sum(draft_ms) + sum(verify_ms) + sum(other_ms) + outside_ms) / 1e3
    r = rec(i, "code", system, kind, tokens or sum(emitted), wall, emitted, arms)
    r.update(proposed=proposed, draft_ms=draft_ms, verify_ms=verify_ms, other_ms=other_ms,
             sources=sources or [None] * len(arms))
    return r


def test_call_keys_separate_what_costs_differently():
    r = timed(0, "p", "policy", ["lookup:x", "lookup:x", "lookup:x", "ngram", None, "lookup:x"], [3, 2, 2, 0, 0, 2],
              [0.2, 30.0, 9.0, 0.1, 0.0, 12.0], [90, 60, 60, 45, 45, 60], sources=["lookup", None, None, None, None, None])
    drafts, verifies = [k[0] for k in pr._call_keys(r)], [k[1] for k in pr._call_keys(r)]
    assert drafts == [("draft", "lookup:x", "lookup", 3, None),  # a lookup copy: no model call
                      ("draft", "lookup:x", None, 2, "first"),  # the model's first call: it prefills its cache
                      ("draft", "lookup:x", None, 2, "next"),
                      ("draft", "ngram", None, 0, "first"),  # an n-gram miss
                      ("draft", None, None, 0, None),  # a target-only round
                      ("draft", "lookup:x", None, 2, "gap")]  # two rounds' tokens to catch up first
    assert verifies == [("verify", 3, True), ("verify", 2, False), ("verify", 2, False), ("verify", 0, False),
                        ("verify", 0, False), ("verify", 2, False)]


def test_a_replay_counts_as_the_drafters_last_call():
    """ucb-replay's replays bring a drafter's cache up to date: its next draft is a "next", not a
    "first" or a "gap"; the replays' own time is kept as measured (outside the keyed calls)."""
    r = timed(0, "p", "policy", ["a", "a", "b", "a"], [2, 2, 2, 2], [9.0, 9.0, 9.0, 9.0], [60, 60, 60, 60])
    r["replayed"], r["replay_ms"] = [["b"], [], [], []], [5.0, 0.0, 0.0, 0.0]
    assert [k[0][4] for k in pr._call_keys(r)] == ["first", "next", "gap", "gap"]  # b replayed at round 0
    r["replayed"] = [["b"], ["b"], [], []]
    assert [k[0][4] for k in pr._call_keys(r)] == ["first", "next", "next", "gap"]
    r["wall_s"] += 0.005  # the replay's 5 ms lies outside draft, verify and other
    assert pr.steady_walls([r])[("p", 0)] == pytest.approx(r["wall_s"])


def test_a_stalled_call_is_priced_at_its_median():
    calm = timed(0, "fixed:a", "fixed", ["a", "a"], [2, 2], [10.0, 10.0], [80.0, 50.0])
    stalled = timed(0, "fixed:b", "fixed", ["b", "b"], [2, 2], [10.0, 10.0], [80.0, 500.0])
    other = timed(0, "fixed:c", "fixed", ["c", "c"], [2, 2], [10.0, 10.0], [80.0, 50.0], outside_ms=7.0)
    walls = pr.steady_walls([calm, stalled, other])
    # verify (2, later round): median of 50, 500, 50 = 50; drafts per drafter (each its own median)
    assert walls[("fixed:b", 0)] == pytest.approx((10 + 80 + 1 + 10 + 50 + 1) / 1e3)
    assert walls[("fixed:a", 0)] == pytest.approx(calm["wall_s"])
    assert walls[("fixed:c", 0)] == pytest.approx(other["wall_s"])  # time outside the rounds kept as measured
    assert pr.steady_walls([rec(0, "code", "fixed:a", "fixed", 8, 2.0, [4, 4], ["a", "a"])]) == {}  # no call times


def test_steady_ratios_use_each_prompts_best_fixed_drafter():
    records = [
        timed(0, "target", "target", [None] * 6, [0] * 6, [0.0] * 6, [50.0] * 6),
        timed(0, "fixed:a", "fixed", ["a", "a"], [2, 2], [10.0, 10.0], [60.0, 60.0]),  # 6 tokens, 142 ms
        timed(0, "fixed:b", "fixed", ["b", "b", "b"], [1, 1, 0], [5.0, 5.0, 5.0], [55.0, 55.0, 50.0]),
        # the policy's second verify stalls (900 ms measured); steady prices it at the median
        timed(0, "p", "policy", ["b", "a"], [1, 2], [5.0, 10.0], [55.0, 900.0], tokens=5),
        timed(0, "oracle", "oracle", ["a", "a"], [2, 2], [10.0, 10.0], [60.0, 60.0]),
    ]
    rows, summary = pr.aggregate(records)
    p = row(rows, "code", "p")
    steady_p = 5 / ((5 + 55 + 1 + 10 + 60 + 1) / 1e3)
    steady_a = 6 / ((10 + 60 + 1) * 2 / 1e3)
    assert p["steady_tokens_per_s"] == pytest.approx(steady_p)
    assert p["steady_ratio_to_oracle"] == pytest.approx(steady_p / steady_a)
    assert p["ratio_to_oracle"] < 0.2 < p["steady_ratio_to_oracle"]  # the stall decided the measured ratio
    assert summary["steady_best_fixed"] == "fixed:a"
    assert summary["policies"]["p"]["steady_ratio_to_oracle_category_mean"] == pytest.approx(steady_p / steady_a)
    assert summary["policies"]["p"]["steady_ratio_to_best_fixed"] == pytest.approx(steady_p / steady_a)
    # Pooled (all tokens / all seconds per category): one prompt, so the same ratio here.
    assert summary["policies"]["p"]["steady_pooled_ratio_to_oracle_category_mean"] == pytest.approx(steady_p / steady_a)
    assert summary["policies"]["p"]["pooled_ratio_to_oracle_category_mean"] == pytest.approx(p["ratio_to_oracle"])


def test_records_without_call_times_have_no_steady_figures():
    rows, summary = pr.aggregate(RECORDS)
    assert row(rows, "all", "p")["steady_ratio_to_oracle"] is None
    assert summary["steady_best_fixed"] is None
    assert summary["policies"]["p"]["steady_ratio_to_oracle_category_mean"] is None
    assert summary["policies"]["p"]["ratio_to_best_fixed_category_mean"] == pytest.approx(((8 / 3) / 2 + (8 / 4) / 4) / 2)
