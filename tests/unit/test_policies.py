"""Policy math (specpool/router/policies.py) as tables of cases: rewards, UCB indices, discounting, Exp3
weights, sequential halving's phases, warm start, and the registry's errors."""

from __future__ import annotations

import math
import random

import pytest

from specpool.core.errors import InvalidArgument, NotFound
from specpool.router.loop import RoundRecord
from specpool.router.policies import (
    Exp3,
    PolicyOptions,
    WarmStart,
    arm_name,
    make_policy,
    parse_arm,
    policy_names,
    round_rewards,
)


def rec(drafter="a", k=5, proposed=5, accepted=2, emitted=3, bd=0.6, round_s=0.05):
    return RoundRecord(drafter, k, proposed, accepted, emitted, bd, 0.0, 0.0, round_s)


def state_of(arms: dict[str, tuple[float, float]], t=None) -> dict:
    """{arm: (n, sum)} -> a counts state."""
    return {"t": t if t is not None else sum(n for n, _ in arms.values()),
            "arms": {a: {"n": n, "s": s} for a, (n, s) in arms.items()}}


# -- arms and rewards -----------------------------------------------------------------------------


@pytest.mark.parametrize("name, parsed", [
    ("code", ("code", None)), ("code@3", ("code", 3)), ("hf:/m@x", ("hf:/m@x", None)),
    ("zoo:/a@b@12", ("zoo:/a@b", 12)), ("ngram:2-4", ("ngram:2-4", None)),
])
def test_parse_arm(name, parsed):
    assert parse_arm(name) == parsed
    assert arm_name(*parsed) == name


@pytest.mark.parametrize("record, expected", [
    # all 5 proposed, BD over proposed 0.6 -> 0.6; BE 2/5; rate 3 tokens / 0.05 s
    (rec(), {"bd": 0.6, "be": 0.4, "rate": 60.0}),
    # a drafter proposing 2 of 5 asked: its BD counts the 3 empty positions as TV = 1
    (rec(proposed=2, accepted=2, bd=1.0, emitted=3), {"bd": 0.4, "be": 0.4, "rate": 60.0}),
    # an n-gram miss: nothing proposed, BD None -> 0
    (rec(proposed=0, accepted=0, bd=None, emitted=1, round_s=0.04), {"bd": 0.0, "be": 0.0, "rate": 25.0}),
    # everything accepted
    (rec(k=3, proposed=3, accepted=3, emitted=4, bd=1.0, round_s=0.1), {"bd": 1.0, "be": 1.0, "rate": 40.0}),
    # zero round time (a clock that did not tick) gives rate 0, not a division error
    (rec(round_s=0.0), {"bd": 0.6, "be": 0.4, "rate": 0.0}),
])
def test_round_rewards(record, expected):
    assert round_rewards(record) == pytest.approx(expected)


# -- UCB ------------------------------------------------------------------------------------------------


def test_ucb_plays_each_arm_once_in_pool_order():
    policy = make_policy("metasd-ucb", ["a", "b", "c"])
    state, rng = policy.init_state(), random.Random(0)
    played = []
    for _ in range(3):
        arm = policy.select(state, rng)
        played.append(arm)
        state, _ = policy.update(state, arm, rec(arm, bd=0.1))
    assert played == ["a", "b", "c"]
    assert state["t"] == 3 and all(st["n"] == 1 for st in state["arms"].values())


@pytest.mark.parametrize("beta, expected", [
    # a: mean 0.6 over 10, b: mean 0.5 over 2, t = 12.
    # beta 1:   a 0.6 + sqrt(2 ln 12 / 10) = 1.305;  b 0.5 + sqrt(2 ln 12 / 2) = 2.076 -> b
    (1.0, "b"),
    # beta 0.1: a 0.6705; b 0.6576 -> a
    (0.1, "a"),
    # beta 0.2: a 0.741; b 0.815 -> b
    (0.2, "b"),
])
def test_ucb_index(beta, expected):
    policy = make_policy("metasd-ucb", ["a", "b"], PolicyOptions(beta=beta))
    state = state_of({"a": (10, 6.0), "b": (2, 1.0)})
    assert policy.select(state, random.Random(0)) == expected
    index = {a: m + beta * math.sqrt(2 * math.log(12) / n) for a, (n, m) in {"a": (10, 0.6), "b": (2, 0.5)}.items()}
    assert max(index, key=index.get) == expected


@pytest.mark.parametrize("name, reward", [("metasd-ucb", 0.6), ("ucb-be", 0.4), ("ucb-cost", 60.0)])
def test_each_ucb_learns_from_its_own_reward(name, reward):
    policy = make_policy(name, ["a", "b"])
    state, increments = policy.update(policy.init_state(), "a", rec())
    assert state["arms"]["a"] == {"n": 1.0, "s": pytest.approx(reward)}
    assert state["arms"]["b"] == {"n": 0.0, "s": 0.0}
    # the tenant sees every reward, whatever the policy learns from
    assert increments == {"a": pytest.approx({"n": 1.0, "bd": 0.6, "be": 0.4, "rate": 60.0})}


def test_cost_reward_is_normalised_by_the_best_arm():
    # raw rates: a 60 tokens/s, b 30 tokens/s; normalised 1.0 and 0.5: with a small beta a wins
    # even though b is barely explored, and the leader is a.
    policy = make_policy("ucb-cost", ["a", "b"], PolicyOptions(beta=0.05))
    state = state_of({"a": (10, 600.0), "b": (10, 300.0)})
    assert policy.select(state, random.Random(0)) == "a"
    assert policy.leader(state) == "a"


def test_cost_k_arms_pair_every_drafter_with_every_length():
    policy = make_policy("ucb-cost-k", ["ngram", "code"], PolicyOptions(k_choices=(2, 5)))
    assert policy.arms == ("ngram@2", "ngram@5", "code@2", "code@5")


# -- discounted UCB -----------------------------------------------------------------------------


def test_discounted_ucb_decays_old_evidence():
    policy = make_policy("ucb-discounted", ["a", "b"], PolicyOptions(gamma_discount=0.5))
    state = state_of({"a": (4.0, 4.0), "b": (2.0, 0.0)})
    state, _ = policy.update(state, "b", rec("b", bd=1.0))
    assert state["arms"]["a"] == {"n": 2.0, "s": 2.0}  # 4 * 0.5
    assert state["arms"]["b"] == {"n": 2.0, "s": 1.0}  # 2 * 0.5 + 1, 0 * 0.5 + 1


def test_discounted_ucb_follows_a_domain_change_that_plain_ucb_misses():
    rng = random.Random(3)
    # a is perfect for 300 rounds, then useless; b is mediocre throughout.
    def reward(arm, t):
        return (1.0 if t < 300 else 0.0) if arm == "a" else 0.5

    late_b = {}
    for name in ("metasd-ucb", "ucb-discounted"):
        policy = make_policy(name, ["a", "b"])
        state, plays = policy.init_state(), []
        for t in range(500):
            arm = policy.select(state, rng)
            plays.append(arm)
            state, _ = policy.update(state, arm, rec(arm, bd=reward(arm, t)))
        late_b[name] = plays[450:].count("b") / 50  # γ = 0.99: a's discounted mean falls below b's ~70 rounds after
    assert late_b["ucb-discounted"] > 0.8
    assert late_b["metasd-ucb"] < 0.5


# -- Thompson, Exp3, sequential halving, fixed, random -------------------------------------------------


def test_thompson_prefers_the_arm_with_strong_evidence():
    policy = make_policy("thompson", ["a", "b"])
    state = state_of({"a": (50, 40.0), "b": (50, 10.0)})
    picks = [policy.select(state, random.Random(i)) for i in range(200)]
    assert picks.count("a") == 200
    # little evidence: both get played
    weak = state_of({"a": (1, 0.6), "b": (1, 0.4)})
    picks = [policy.select(weak, random.Random(i)) for i in range(200)]
    assert 40 < picks.count("b") < 160


def test_exp3_probabilities_and_weight_update():
    policy = make_policy("exp3", ["a", "b", "c", "d"], PolicyOptions(gamma_exp3=0.2))
    assert isinstance(policy, Exp3)
    state = policy.init_state()
    assert policy.probabilities(state) == pytest.approx({a: 0.25 for a in "abcd"})
    state, _ = policy.update(state, "b", rec("b", bd=0.5))
    # logw_b += gamma * (r / p) / K = 0.2 * (0.5 / 0.25) / 4 = 0.1
    assert state["logw"] == pytest.approx({"a": 0.0, "b": 0.1, "c": 0.0, "d": 0.0})
    w_b = math.exp(0.1)
    expected_b = 0.8 * w_b / (3 + w_b) + 0.05
    assert policy.probabilities(state)["b"] == pytest.approx(expected_b)
    assert policy.leader(state) == "b"
    # sampling follows the probabilities
    picks = [policy.select(state, random.Random(i)) for i in range(4000)]
    assert picks.count("b") / 4000 == pytest.approx(expected_b, abs=0.03)


def test_sequential_halving_phases_then_commits():
    means = {"a": 0.2, "b": 0.9, "c": 0.5, "d": 0.7}
    policy = make_policy("sequential-halving", list(means))
    state, rng, plays = policy.init_state(), random.Random(0), []
    for _ in range(30):
        arm = policy.select(state, rng)
        plays.append(arm)
        state, _ = policy.update(state, arm, rec(arm, bd=means[arm]))
    # K = 4: 2 phases, budget 2*4*2 = 16: phase 1 plays each arm 16 // (4*2) = 2 times,
    # phase 2 plays the better half (b, d) 16 // (2*2) = 4 times each, then b for good.
    assert sorted(plays[:8]) == sorted("abcd" * 2)
    assert sorted(plays[8:16]) == sorted("bd" * 4)
    assert set(plays[16:]) == {"b"}
    assert state["survivors"] == ["b"] and policy.leader(state) == "b"


def test_fixed_and_random():
    fixed = make_policy("fixed:code", ["ngram", "code"])
    assert fixed.arms == ("code",)
    assert {fixed.select(fixed.init_state(), random.Random(i)) for i in range(20)} == {"code"}
    uniform = make_policy("random", ["a", "b", "c"])
    picks = [uniform.select(uniform.init_state(), random.Random(i)) for i in range(3000)]
    assert all(picks.count(a) / 3000 == pytest.approx(1 / 3, abs=0.04) for a in "abc")


# -- warm start ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tenant_n, expected_n", [(100.0, 4.0), (20.0, 1.0), (0.0, 0.0)])
def test_warm_start_is_down_weighted_and_capped(tenant_n, expected_n):
    policy = make_policy("metasd-ucb+warm", ["a", "b"], PolicyOptions(warm=WarmStart(weight=0.05, cap=4.0)))
    prior = {"a": {"n": tenant_n, "bd": 0.8 * tenant_n, "be": 0.1 * tenant_n, "rate": 0.0}}
    state = policy.init_state(prior)
    assert state["arms"]["a"]["n"] == pytest.approx(expected_n)
    assert state["arms"]["a"]["s"] == pytest.approx(0.8 * expected_n)  # the tenant's mean BD
    assert state["arms"]["b"] == {"n": 0.0, "s": 0.0}
    assert state["t"] == pytest.approx(expected_n)
    # b has no prior: it is still played once before UCB takes over
    assert policy.select(state, random.Random(0)) == ("b" if expected_n else "a")


def test_without_warm_start_the_prior_is_ignored():
    policy = make_policy("metasd-ucb", ["a", "b"])
    assert policy.init_state({"a": {"n": 100.0, "bd": 80.0}}) == policy.init_state()


# -- the registry's errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, options, error, message", [
    ("nope", None, NotFound, "unknown policy 'nope'"),
    ("oracle", None, InvalidArgument, "evaluation"),
    ("metasd-ucb", PolicyOptions(beta=0.0), InvalidArgument, "beta must be > 0"),
    ("metasd-ucb", PolicyOptions(beta=-1.0), InvalidArgument, "beta must be > 0"),
    ("ucb-discounted", PolicyOptions(gamma_discount=1.0), InvalidArgument, "discount"),
    ("ucb-cost-k", PolicyOptions(k_choices=(0,)), InvalidArgument, "1..32"),
    ("fixed:", None, InvalidArgument, "fixed: needs a drafter"),
    ("", None, InvalidArgument, "empty"),
])
def test_bad_policies(spec, options, error, message):
    with pytest.raises(error, match=message):
        make_policy(spec, ["a"], options)


def test_empty_pool_and_names():
    with pytest.raises(InvalidArgument, match="at least one drafter"):
        make_policy("metasd-ucb", [])
    assert {"metasd-ucb", "ucb-be", "thompson", "exp3", "ucb-discounted", "sequential-halving",
            "random", "fixed:NAME", "oracle"} <= set(policy_names())
    assert make_policy("thompson+warm", ["a"]).warm is not None
    assert make_policy("metasd-ucb", ["a", "a", "b"]).arms == ("a", "b")
