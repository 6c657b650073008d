"""Rounds answered by a lookup that several arms share are credited to no arm (specpool/router/bandit.py).

``ngram`` and every ``lookup:SPEC`` drafter run the same prompt lookup first; when it matches,
the round's proposal is the same whichever of them was played, so its reward must not move the
played arm's estimate."""

from __future__ import annotations

import pytest
import torch

from specpool.drafters.base import LOOKUP_SOURCE, UNDRAFTED_SOURCE, Proposal
from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.lookup_first import LookupFirstDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.drafters.registry import shared_sources
from specpool.router.bandit import BanditChooser
from specpool.router.loop import RoundRecord, speculative_generate
from specpool.router.policies import make_policy
from specpool.router.session_store import InMemorySessionStore, SessionKey
from specpool.services import convert
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier

SHARED = frozenset({LOOKUP_SOURCE})


@pytest.mark.parametrize(("specs", "expected"), [
    (["ngram", "lookup:code"], SHARED),
    (["lookup:code", "lookup:math"], SHARED),
    (["ngram", "lookup:code", "lookup:zoo:/tmp/x", "code"], SHARED),
    (["ngram", "code", "math"], frozenset()),  # only one drafter looks up: its copies are its own
    (["lookup:code"], frozenset()),
    (["code", "math", "hf:/models/x"], frozenset()),
    ([], frozenset()),
])
def test_shared_sources(specs, expected):
    assert shared_sources(specs) == expected


def test_lookup_proposals_carry_their_source(noisy_lm):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    ngram = NGramDrafter()
    assert ngram.propose("s", [1, 5, 6, 7, 8, 5, 6], 3, params).source == LOOKUP_SOURCE  # "5 6" repeats
    miss = ngram.propose("t", [1, 5, 6, 7, 8, 9], 3, params)
    assert (miss.tokens, miss.source) == ([], None)  # a miss is the n-gram drafter's own target-only step
    lookup = LookupFirstDrafter("lookup:noisy", HFModelDrafter("noisy", *noisy_lm))
    assert lookup.propose("s", [1, 5, 6, 7, 8, 5, 6], 3, params).source == LOOKUP_SOURCE
    fresh = lookup.propose("s", [1, 5, 6, 7, 8, 9], 3, params)
    assert fresh.tokens and fresh.source is None  # the model's round


def test_the_source_crosses_the_wire():
    proposal = Proposal([4, 8], [SparseDist.one_hot(4), SparseDist.one_hot(8)], 0.0, LOOKUP_SOURCE)
    assert convert.proposal_from_proto(convert.proposal_to_proto(proposal)).source == LOOKUP_SOURCE
    own = Proposal([4], [SparseDist(torch.tensor([4, 2]), torch.tensor([0.5, 0.5]))])
    assert convert.proposal_from_proto(convert.proposal_to_proto(own)).source is None


def record(drafter: str, accepted: int, source: str | None = None, k: int = 4) -> RoundRecord:
    return RoundRecord(drafter=drafter, k=k, proposed=k, accepted=accepted, emitted=accepted + 1, bd=accepted / k,
                       draft_s=0.01, verify_s=0.05, round_s=0.06, source=source)


def play(chooser: BanditChooser, outcomes: dict[str, list[tuple[int, str | None]]], rounds: int) -> list[str]:
    """``rounds`` rounds; each arm's next (accepted, source) from its list, in the order chosen."""
    played = []
    for _ in range(rounds):
        arm = chooser.select().drafter
        accepted, source = outcomes[arm].pop(0)
        chooser.update(record(arm, accepted, source))
        played.append(arm)
    return played


@pytest.mark.parametrize("policy_name", ["metasd-ucb", "ucb-be", "ucb-cost", "thompson", "exp3"])
def test_a_shared_round_leaves_the_policy_state_as_it_was(policy_name):
    store, key = InMemorySessionStore(), SessionKey("acme", "s1")
    policy = make_policy(policy_name, ["lookup:a", "lookup:b"])
    chooser = BanditChooser(policy, store, key, trace=True, shared_sources=SHARED)
    arm = chooser.select().drafter
    chooser.update(record(arm, 4, LOOKUP_SOURCE))  # a long copy: the best round an arm could have
    state, tenant = store.read(key)
    assert state is None and not tenant  # nothing written: no arm was credited
    assert chooser.shared_rounds == 1 and chooser.trace[-1].credited is False
    arm = chooser.select().drafter
    chooser.update(record(arm, 1))  # the arm's own round
    state, tenant = store.read(key)
    assert state["t"] == 1 and sum(st["n"] for st in state["arms"].values()) == 1
    assert set(tenant) == {arm} and chooser.trace[-1].credited is True


def test_a_round_the_target_did_not_draft_is_credited_to_no_arm():
    """The hosting target's load gate verified the round without drafting (specpool/router/hosted.py):
    the arm was not asked, so its zero-token round must not count against it, whatever the pool."""
    store, key = InMemorySessionStore(), SessionKey("acme", "s1")
    chooser = BanditChooser(make_policy("metasd-ucb", ["eagle:a", "ngram"]), store, key, trace=True)
    arm = chooser.select().drafter
    chooser.update(RoundRecord(drafter=arm, k=4, proposed=0, accepted=0, emitted=1, bd=None, draft_s=0.0,
                               verify_s=0.05, round_s=0.05, source=UNDRAFTED_SOURCE))
    assert store.read(key)[0] is None and chooser.trace[-1].credited is False
    arm = chooser.select().drafter
    chooser.update(record(arm, 2))
    assert store.read(key)[0]["arms"][arm]["n"] == 1


def test_without_shared_sources_the_same_round_is_credited():
    store, key = InMemorySessionStore(), SessionKey("acme", "s1")
    chooser = BanditChooser(make_policy("metasd-ucb", ["lookup:a", "lookup:b"]), store, key)
    arm = chooser.select().drafter
    chooser.update(record(arm, 4, LOOKUP_SOURCE))
    assert store.read(key)[0]["arms"][arm]["n"] == 1


def test_copies_do_not_make_a_worse_arm_look_better():
    """Arm a's model accepts 0 of 4, b's 2 of 4; a is played first, through a stretch the lookup
    copies (4 of 4). Credited, those copies make a the leader; not credited, b leads."""
    def outcomes():
        return {"lookup:a": [(4, LOOKUP_SOURCE)] * 6 + [(0, None)] * 30, "lookup:b": [(2, None)] * 30}

    runs = {}
    for shared in (frozenset(), SHARED):
        chooser = BanditChooser(make_policy("metasd-ucb", ["lookup:a", "lookup:b"]), InMemorySessionStore(),
                                SessionKey("t", "s"), trace=True, shared_sources=shared)
        runs[shared] = (play(chooser, outcomes(), 10), chooser.trace[-1].leader)
    assert runs[frozenset()][1] == "lookup:a"
    played, leader = runs[SHARED]
    assert leader == "lookup:b"
    # UCB still gives a a round of its own: an arm whose rounds were all copies is unexplored.
    assert played[:7] == ["lookup:a"] * 7 and played[7] == "lookup:b"


def test_greedy_output_is_the_targets_and_only_own_rounds_are_credited(target_lm, noisy_lm, random_lm, prompts,
                                                                        greedy_reference):
    pool = {
        "ngram": NGramDrafter(),
        "lookup:noisy": LookupFirstDrafter("lookup:noisy", HFModelDrafter("noisy", *noisy_lm)),
        "lookup:random": LookupFirstDrafter("lookup:random", HFModelDrafter("random", *random_lm)),
    }
    verifier = TargetVerifier(*target_lm)
    store = InMemorySessionStore()
    shared_total = 0
    for i, prompt in enumerate(prompts[:8]):
        key = SessionKey("t", f"s{i}")
        params = SamplingParams(temperature=0.0, max_new_tokens=24)
        chooser = BanditChooser(make_policy("metasd-ucb", list(pool)), store, key, trace=True,
                                shared_sources=shared_sources(list(pool)))
        result = speculative_generate(prompt, session_id=f"s{i}", drafters=pool, chooser=chooser, verifier=verifier,
                                      params=params, k=4)
        for d in [verifier, *pool.values()]:
            d.release(f"s{i}")
        assert result.token_ids == greedy_reference(target_lm[0], prompt, 24), i
        drafted = [r for r in result.rounds if r.k > 0]
        lookup_rounds = sum(r.source == LOOKUP_SOURCE for r in drafted)
        assert [t.credited for t in chooser.trace] == [r.source != LOOKUP_SOURCE for r in drafted]
        state, _ = store.read(key)
        credited = sum(st["n"] for st in state["arms"].values()) if state else 0
        assert credited == len(drafted) - lookup_rounds
        shared_total += lookup_rounds
    assert shared_total > 0  # the prompts repeat phrases: the lookup did answer rounds


def test_cli_trace_marks_the_rounds_the_lookup_made(cli, model_dirs):
    code, out, err = cli("generate", "the cat sat on the mat and the cat sat on the mat and the cat", "--json",
                         "--max-new-tokens", "24", "--policy", "metasd-ucb", "--pool",
                         f"ngram,lookup:hf:{model_dirs.noisy}", "--trace")
    assert code == 0, err
    trace = [line for line in err.splitlines() if line.startswith("round ")]
    copied = [line for line in trace if line.endswith("(lookup)")]
    assert copied and len(copied) < len(trace)  # the repeated phrase is copied; other rounds are the arms' own
    assert all(" proposed 0 " not in line for line in copied)
