"""The synthetic bandit simulation (bench/bandit_sim.py) with the real policy code: regret grows
sublinearly (like log B, not like B), and BD identifies the best arm sooner than BE."""

from __future__ import annotations

import random

import pytest

from bench.bandit_sim import SimConfig, expected_tokens_per_round, fit_log, identification_race, simulate, simulate_round


@pytest.mark.parametrize("alpha, k, expected", [(0.0, 5, 1.0), (1.0, 5, 6.0), (0.5, 2, 1.75)])
def test_expected_tokens_per_round(alpha, k, expected):
    assert expected_tokens_per_round(alpha, k) == pytest.approx(expected)


def test_simulated_rounds_follow_the_acceptance_model():
    rng = random.Random(0)
    records = [simulate_round(0.7, 5, rng, "a") for _ in range(20000)]
    mean_tokens = sum(r.emitted for r in records) / len(records)
    assert mean_tokens == pytest.approx(expected_tokens_per_round(0.7, 5), rel=0.02)
    assert sum(r.bd for r in records) / len(records) == pytest.approx(0.7, abs=0.01)
    assert all(r.accepted + 1 == r.emitted and 0 <= r.accepted <= 5 for r in records)


@pytest.mark.slow  # a whole run / a regret sweep: the fast lane skips it
def test_regret_grows_like_log_budget():
    config = SimConfig(alphas=(0.8, 0.5, 0.3), checkpoints=(100, 300, 1000, 3000, 10000), runs=20)
    result = simulate(["metasd-ucb", "random"], config, progress=False)
    regret = {p: [r["regret_rounds"] for r in result["rows"] if r["policy"] == p] for p in ("metasd-ucb", "random")}
    # random's regret is linear in B: x100 budget -> ~x100 regret; UCB's grows ~ln B
    assert regret["random"][-1] / regret["random"][0] > 50
    assert regret["metasd-ucb"][-1] / regret["metasd-ucb"][0] < 4
    assert result["policies"]["metasd-ucb"]["fit"]["r2"] > 0.8


def test_fit_log_recovers_a_log_curve():
    budgets = [10, 100, 1000, 10000]
    import math

    fit = fit_log(budgets, [3 + 2 * math.log(b) for b in budgets])
    assert (fit["a"], fit["b"], fit["r2"]) == pytest.approx((3.0, 2.0, 1.0))


def test_bd_identifies_the_best_arm_sooner_than_be():
    race = identification_race(SimConfig(runs=100), rounds=300)
    assert race["bd"]["mean"] < race["be"]["mean"]
    assert race["bd"]["median"] <= race["be"]["median"]
