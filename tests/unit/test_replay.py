"""Replay (specpool.drafters.base.Replayable) and the policy that uses it (router/policies.ReplayUCB).

A drafter replayed on the target's greedy tokens must report exactly the accepted count it would
have had, had it drafted that round; replays must leave later proposals unchanged; the policy
credits replayed arms during its probe rounds only; and the loop replays only when asked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.lookup_first import LookupFirstDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.router.bandit import BanditChooser
from specpool.core.errors import InvalidArgument
from specpool.router.loop import FixedChooser, RoundRecord, speculative_generate
from specpool.router.policies import PolicyOptions, ReplayUCB, make_policy
from specpool.router.session_store import InMemorySessionStore, SessionKey
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import VerifyRequest

GREEDY = SamplingParams(max_new_tokens=32)


def actual_accepted(drafter, verifier, session: str, context: list[int], k: int) -> int:
    """What drafting the round for real gets: propose, then the target's verification."""
    proposal = drafter.propose(session, context, k, GREEDY)
    result = verifier.verify(VerifyRequest(session, context, proposal.tokens, proposal.q, GREEDY))
    verifier.release(session)
    return result.accepted


def drafters_under_test(noisy_lm, random_lm):
    return {
        "noisy": HFModelDrafter("noisy", *noisy_lm),
        "noisy-confident": HFModelDrafter("noisy-confident", *noisy_lm, confidence_threshold=0.5),
        "random": HFModelDrafter("random", *random_lm),
        "ngram": NGramDrafter(),
        "lookup:noisy": LookupFirstDrafter("lookup:noisy", HFModelDrafter("inner", *noisy_lm)),
    }


@pytest.mark.parametrize("k", [1, 4, pytest.param(6, marks=pytest.mark.slow)])
def test_replay_is_the_accepted_count_drafting_would_have_had(verifier, noisy_lm, random_lm, target_lm, prompts,
                                                              greedy_reference, k):
    target = target_lm[0]
    seen = set()
    for name, drafter in drafters_under_test(noisy_lm, random_lm).items():
        for i, prompt in enumerate(prompts[:10]):
            context = prompt[: len(prompt) - 3 - i % 5]  # cut inside the target's own continuation
            truth = actual_accepted(drafter, verifier, f"real-{name}-{i}", context, k)
            for length in range(1, k + 2):  # the target's tokens known: 1 .. k + 1
                tokens = greedy_reference(target, context, length)
                replayed = drafter.replay(f"replay-{name}-{i}-{length}", context, tokens, k, GREEDY)
                assert replayed == min(truth, length), (name, i, k, length, truth, replayed)
            seen.add(truth)
    assert len(seen) >= 2, seen  # not all rejections (or all acceptances): the check has teeth


def test_a_replay_leaves_the_next_proposal_unchanged(noisy_lm, random_lm, target_lm, prompts, greedy_reference):
    """Replays only warm a cache (model drafters) or read state (n-gram): drafting afterwards
    proposes exactly what a drafter that was never replayed proposes."""
    replayed, fresh = drafters_under_test(noisy_lm, random_lm), drafters_under_test(noisy_lm, random_lm)
    for name in replayed:
        for i, prompt in enumerate(prompts[:8]):
            session = f"s{i}"
            # A round of history, so the n-gram drafters have a pending proposal to score.
            for d in (replayed[name], fresh[name]):
                d.propose(session, prompt[:-6], 4, GREEDY)
            context = prompt[:-3]
            replayed[name].replay(session, context, greedy_reference(target_lm[0], context, 3), 4, GREEDY)
            a = replayed[name].propose(session, context, 4, GREEDY)
            b = fresh[name].propose(session, context, 4, GREEDY)
            assert (a.tokens, a.source) == (b.tokens, b.source), (name, i)


def test_replay_needs_greedy(noisy_lm, prompts):
    drafter = HFModelDrafter("noisy", *noisy_lm)
    with pytest.raises(InvalidArgument, match="greedy"):
        drafter.replay("s", prompts[0], [5, 6], 4, SamplingParams(temperature=0.7))
    assert drafter.replay("s", prompts[0], [], 4, GREEDY) == 0


def test_lookup_first_without_a_replayable_inner_drafter_says_none(prompts):
    class Opaque:  # a drafter that cannot replay (a remote one, say)
        name, tokenizer_fingerprint = "opaque", None

        def propose(self, *a):
            raise AssertionError("not called")

        def release(self, session_id):
            pass

    drafter = LookupFirstDrafter("lookup:opaque", Opaque())
    miss = list(range(3, 40))  # no repeated n-gram: the lookup has nothing
    assert drafter.replay("s", miss, [4], 4, GREEDY) is None


# -- the policy ----------------------------------------------------------------------------------


def rec(drafter="a", k=5, accepted=2, replays=None, proposed=5):
    return RoundRecord(drafter, k, proposed, accepted, accepted + 1, 0.6, 0.0, 0.0, 0.05, replays=replays)


@pytest.mark.parametrize("replays, expected_arms", [
    # replayed arms get n + 1 and their accepted/k; the played arm its own BE, once
    ({"b": 3, "c": 0}, {"a": (1.0, 0.4), "b": (1.0, 0.6), "c": (1.0, 0.0)}),
    # a replay never counts for more than k (the target's tokens can be k + 1)
    ({"b": 6}, {"a": (1.0, 0.4), "b": (1.0, 1.0), "c": (0.0, 0.0)}),
    # the played arm named among the replays is not counted twice
    ({"a": 5, "b": 1}, {"a": (1.0, 0.4), "b": (1.0, 0.2), "c": (0.0, 0.0)}),
    # no replays: plain UCB on BE
    (None, {"a": (1.0, 0.4), "b": (0.0, 0.0), "c": (0.0, 0.0)}),
])
def test_replayed_arms_are_credited(replays, expected_arms):
    policy = ReplayUCB("ucb-replay", ("a", "b", "c"), "be", probe_rounds=2)
    state, tenant = policy.update(policy.init_state(), "a", rec(replays=replays))
    assert state["t"] == 1  # one round, however many arms it informed
    assert {a: (st["n"], pytest.approx(st["s"])) for a, st in state["arms"].items()} == expected_arms
    assert set(tenant) == {"a"}  # the tenant's statistics hold played rounds only
    assert state["probed"] == (0 if replays is None else 1)


def test_probe_rounds_then_plain_ucb():
    policy = ReplayUCB("ucb-replay", ("a", "b"), "be", probe_rounds=2)
    state = policy.init_state()
    wants = []
    for _ in range(4):
        wants.append(policy.wants_replay(state))
        state, _ = policy.update(state, "a", rec(replays={"b": 1} if wants[-1] else None))
    assert wants == [True, True, False, False]
    # Replayed arms are explored: select does not force-play "b" although it was never played.
    assert state["arms"]["b"]["n"] == 2 and policy.select(state, None) == "a"


def test_a_warm_start_does_not_use_up_the_probe():
    policy = replace(make_policy("ucb-replay+warm", ["a", "b"]), probe_rounds=3)
    state = policy.init_state({"a": {"n": 100.0, "be": 40.0, "bd": 50.0, "rate": 1.0}})
    assert state["t"] > 0 and policy.wants_replay(state)


def test_probe_rounds_option_is_validated():
    assert make_policy("ucb-replay", ["a"], PolicyOptions(probe_rounds=7)).probe_rounds == 7
    with pytest.raises(InvalidArgument, match="probe rounds must be >= 1"):
        make_policy("ucb-replay", ["a"], PolicyOptions(probe_rounds=0))


# -- the chooser and the loop --------------------------------------------------------------------


def test_the_chooser_asks_for_replays_only_while_probing_and_not_on_shared_rounds():
    store, key = InMemorySessionStore(), SessionKey("t", "s")
    chooser = BanditChooser(make_policy("ucb-replay", ["a", "b", "c"], PolicyOptions(probe_rounds=2)), store, key,
                            shared_sources=frozenset({"lookup"}))
    asked = []
    for source in (None, "lookup", None, None):
        choice = chooser.select()
        names = chooser.replay_arms(source)
        asked.append(names)
        chooser.update(replace(rec(choice.drafter), source=source, replays=dict.fromkeys(names, 1) if names else None))
    # "a" leads throughout (BE 0.4 against the replays' 0.2). A shared round is replayed by none
    # and does not use up the probe; after two probe rounds, no more replays.
    assert asked == [["b", "c"], [], ["b", "c"], []]
    # A policy without replays never asks.
    plain = BanditChooser(make_policy("metasd-ucb", ["a", "b"]), store, SessionKey("t", "other"))
    plain.select()
    assert plain.replay_arms(None) == []


def run(verifier, pool, policy_name, prompt, params, session, options=None):
    chooser = BanditChooser(make_policy(policy_name, list(pool), options), InMemorySessionStore(), SessionKey("t", session),
                            seed=params.seed)
    result = speculative_generate(prompt, session_id=session, drafters=pool, chooser=chooser, verifier=verifier,
                                  params=params, k=4)
    verifier.release(session)
    for d in pool.values():
        d.release(session)
    return result


def test_the_loop_replays_the_other_drafters_in_the_probe_rounds(verifier, noisy_lm, random_lm, prompts,
                                                                 target_lm, greedy_reference):
    pool = {"noisy": HFModelDrafter("noisy", *noisy_lm), "random": HFModelDrafter("random", *random_lm)}
    result = run(verifier, pool, "ucb-replay", prompts[0], SamplingParams(max_new_tokens=24), "s",
                 PolicyOptions(probe_rounds=3))
    assert result.token_ids == greedy_reference(target_lm[0], prompts[0], 24)
    replayed = [set(r.replays) if r.replays is not None else None for r in result.rounds]
    others = [{"noisy", "random"} - {r.drafter} for r in result.rounds]
    assert replayed[:3] == others[:3] and all(x is None for x in replayed[3:]), replayed
    assert all(r.replay_s > 0 for r in result.rounds[:3]) and all(r.replay_s == 0 for r in result.rounds[3:])
    # Sampled requests get no replays: a sampled draft is not determined by the context.
    sampled = run(verifier, pool, "ucb-replay", prompts[0], SamplingParams(temperature=0.8, seed=3, max_new_tokens=12), "x")
    assert all(r.replays is None for r in sampled.rounds)


def test_replay_spares_the_poor_arm_its_exploration_rounds(verifier, noisy_lm, random_lm, prompts):
    """ucb-be must play the mostly-rejected drafter at least once per request ("every arm once");
    ucb-replay learns from its replays instead and plays it less over the same requests."""
    pool = {"noisy": HFModelDrafter("noisy", *noisy_lm), "random": HFModelDrafter("random", *random_lm)}
    plays = {}
    for name in ("ucb-be", "ucb-replay"):
        plays[name] = sum(r.drafter == "random"
                          for i, p in enumerate(prompts[:6])
                          for r in run(verifier, pool, name, p, SamplingParams(max_new_tokens=20), f"{name}{i}").rounds)
    assert plays["ucb-be"] >= 6 and plays["ucb-replay"] < plays["ucb-be"], plays


def test_fixed_choosers_never_replay(verifier, noisy_lm, prompts):
    drafter = HFModelDrafter("noisy", *noisy_lm)
    result = speculative_generate(prompts[0], session_id="f", drafters={"noisy": drafter}, chooser=FixedChooser("noisy"),
                                  verifier=verifier, params=SamplingParams(max_new_tokens=8), k=4)
    assert all(r.replays is None and r.replay_s == 0 for r in result.rounds)
