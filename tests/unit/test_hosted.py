"""Drafters the target hosts (specpool/router/hosted.py): a round drafted and verified in one call.

On the tiny target with the fitted test head of test_eagle_drafter.py: the loop with a hosted arm
gives the very rounds (drafter, proposed, accepted, emitted) and tokens that the same drafter gives
called by the loop itself, greedy and sampled, alone, behind prompt lookup and beside a router-side
arm under a bandit; batches equal single calls; a head that lost the session, a drafter that fails,
an arm the target does not host and a verifier that hosts nothing each do what they say."""

from __future__ import annotations

import pytest

from specpool.core.errors import FailedPrecondition, NotFound
from specpool.drafters.lookup_first import LookupFirstDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.router.bandit import BanditChooser
from specpool.router.hosted import HostedArm, HostedDraft, HostingVerifier, hosted_arm_of, is_hosted
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.router.policies import make_policy
from specpool.router.session_store import InMemorySessionStore, SessionKey
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest
from test_eagle_drafter import GREEDY, drafter_of, head, head_dir  # noqa: F401 - module fixtures

SAMPLED = SamplingParams(temperature=0.7, max_new_tokens=20, seed=11)


def rounds_of(result) -> list[tuple]:
    return [(r.drafter, r.k, r.proposed, r.accepted, r.emitted, r.source) for r in result.rounds]


def run(verifier, drafters, chooser, prompt, params=GREEDY, session="s", k=5):
    return speculative_generate(prompt, session_id=session, drafters=drafters, chooser=chooser,
                                verifier=verifier, params=params, k=k)


def pair(head, target_lm, make):
    """(own, hosted): the loop calling a drafter itself, and the loop letting the target host a twin."""
    model, tokenizer = target_lm
    own = make(head)
    hosting = HostingVerifier(TargetVerifier(model, tokenizer), {own.name: make(head)})
    return (TargetVerifier(model, tokenizer), {own.name: own}), (hosting, {own.name: hosted_arm_of(own.name, own)})


def eagle(head):
    return drafter_of(head)


def lookup_eagle(head):
    return LookupFirstDrafter("lookup:eagle:tiny", drafter_of(head))


@pytest.mark.parametrize("make", [eagle, lookup_eagle], ids=["eagle", "lookup-eagle"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_hosted_arm_makes_the_rounds_and_tokens_of_the_drafter_called_by_the_loop(make, params, head, target_lm, prompts,
                                                                                     greedy_reference):
    (verifier, own), (hosting, hosted) = pair(head, target_lm, make)
    name = next(iter(own))
    assert is_hosted(hosted[name]) and hosted[name].white_box
    drafted = 0
    for i, sequence in enumerate(prompts[::4]):
        prompt = sequence[:-24]
        a = run(verifier, own, FixedChooser(name), prompt, params, session=f"s{i}")
        b = run(hosting, hosted, FixedChooser(name), prompt, params, session=f"s{i}")
        assert b.token_ids == a.token_ids, i
        assert rounds_of(b) == rounds_of(a), i
        assert b.rounds[0].drafter is None  # the prefill round: the hosted head had no features yet
        if params.greedy:
            assert b.token_ids == greedy_reference(target_lm[0], prompt, params.max_new_tokens)
        drafted += sum(r.accepted for r in b.rounds)
    assert drafted > 0, "the hosted head never had a draft accepted: the test would show nothing"
    assert hosting.draft_failures == 0
    assert hosted[name].cost.calls > 0  # the target's drafting time reaches the arm's cost meter


def test_hosted_and_router_side_arms_mix_under_a_bandit(head, target_lm, prompts):
    model, tokenizer = target_lm
    pool = ["eagle:tiny", "ngram"]

    def go(hosted: bool, prompt, session):
        head_drafter = drafter_of(head)
        ngram = NGramDrafter("ngram")
        if hosted:
            verifier = HostingVerifier(TargetVerifier(model, tokenizer), {"eagle:tiny": head_drafter})
            drafters = {"eagle:tiny": hosted_arm_of("eagle:tiny", head_drafter), "ngram": ngram}
        else:
            verifier, drafters = TargetVerifier(model, tokenizer), {"eagle:tiny": head_drafter, "ngram": ngram}
        chooser = BanditChooser(make_policy("metasd-ucb", pool), InMemorySessionStore(), SessionKey("t", session))
        return run(verifier, drafters, chooser, prompt, session=session)

    played = set()
    for i, sequence in enumerate(prompts[:6]):
        a, b = go(False, sequence[:-24], f"m{i}"), go(True, sequence[:-24], f"m{i}")
        assert b.token_ids == a.token_ids and rounds_of(b) == rounds_of(a), i
        played |= {r.drafter for r in b.rounds}
    assert {"eagle:tiny", "ngram"} <= played  # both kinds of arm really drafted


def test_a_batch_of_sessions_equals_each_session_alone(head, target_lm, prompts):
    model, tokenizer = target_lm
    alone = HostingVerifier(TargetVerifier(model, tokenizer), {"eagle:tiny": drafter_of(head)})
    batched = HostingVerifier(TargetVerifier(model, tokenizer), {"eagle:tiny": drafter_of(head)})
    feed = ("eagle:tiny",)
    contexts = {f"b{i}": list(s[:-24]) for i, s in enumerate(prompts[:3])}
    for step in range(4):  # a prefill round, then drafted rounds: each session moves by what it emitted
        draft = HostedDraft("eagle:tiny" if step else None, 5, False, feed)
        requests = [VerifyRequest(s, list(c), [], [], GREEDY) for s, c in contexts.items()]
        one = [alone.draft_and_verify(r, draft) for r in requests]
        many = batched.verify_batch([(r, draft) for r in requests])
        for (p1, r1), (p2, r2), session in zip(one, many, list(contexts)):
            assert (p2.tokens, r2.tokens, r2.accepted) == (p1.tokens, r1.tokens, r1.accepted)
            assert r2.features is None  # read inside, not asked for by the caller
            contexts[session] += r2.tokens
        if step:
            assert any(p.tokens for p, _ in many)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, max_new_tokens=20, seed=5)],
                         ids=["greedy", "sampled"])
def test_a_tree_arm_drafts_trees_alone_and_chains_in_a_batch_of_sessions(params, head, target_lm, prompts):
    """One session's tree is verified in a forward of its own; in a batch of several, trees would
    split the one batched forward into one per session, so there the arm drafts its chain. Runner-up
    leaves draw sampled trees too."""
    model, tokenizer = target_lm
    arm = "eagle-alt:tiny"
    hosting = HostingVerifier(TargetVerifier(model, tokenizer),
                              {arm: drafter_of(head, alternatives=2, alt_per_depth=2, alt_min_prob=0.0)})
    chains = HostingVerifier(TargetVerifier(model, tokenizer), {arm: drafter_of(head)})
    contexts = {f"t{i}": list(s[:-24]) for i, s in enumerate(prompts[:3])}
    for verifier in (hosting, chains):  # the prefill round: every arm gets the prompts' features
        verifier.verify_batch([(VerifyRequest(s, list(c), [], [], params), HostedDraft(None, 5, True, (arm,)))
                               for s, c in contexts.items()])
    draft = HostedDraft(arm, 5, True, (arm,))
    session, context = next(iter(contexts.items()))
    alone, _ = hosting.draft_and_verify(VerifyRequest(session, list(context), [], [], params), draft)
    assert alone.parents is not None and len(alone.tokens) > 5  # the chain and its leaves
    hosting.verifier.caches.get(session).truncate(len(context))  # as before that round (heads re-read)
    requests = [VerifyRequest(s, list(c), [], [], params) for s, c in contexts.items()]
    many = hosting.verify_batch([(r, draft) for r in requests])
    like = chains.verify_batch([(r, draft) for r in requests])
    for (p, r), (q, rq) in zip(many, like):
        assert p.parents is None and p.tokens == q.tokens  # the chain a chain-only head drafts
        assert (r.tokens, r.accepted) == (rq.tokens, rq.accepted)
    assert any(p.tokens for p, _ in many)


def test_a_head_that_lost_the_session_gets_every_row_again(head, target_lm, prompts, greedy_reference):
    """The target still caches the session's prefix from a request without the head, so it feeds
    only the new rows; the head lacks the earlier ones: that round is verified again from scratch."""
    model, tokenizer = target_lm
    head_drafter = drafter_of(head)
    hosting = HostingVerifier(TargetVerifier(model, tokenizer), {"eagle:tiny": head_drafter})
    prompt = prompts[5][:-24]
    first = run(hosting, {"ngram": NGramDrafter("ngram")}, FixedChooser("ngram"), prompt, session="gap")
    assert "gap" in hosting.verifier.caches.sessions() and head_drafter.features_held("gap") == 0
    context = prompt + first.token_ids
    again = run(hosting, {"eagle:tiny": hosted_arm_of("eagle:tiny", head_drafter)}, FixedChooser("eagle:tiny"), context,
                session="gap")
    assert again.token_ids == greedy_reference(model, context, GREEDY.max_new_tokens)
    assert head_drafter.features_held("gap") >= len(context)
    assert sum(r.accepted for r in again.rounds) > 0


class Failing:
    name, tokenizer_fingerprint, feature_width = "broken", None, 0

    def propose(self, *args):
        raise RuntimeError("injected")

    def release(self, session_id):
        pass


def test_a_hosted_drafter_that_fails_costs_its_rounds_draft_not_the_request(target_lm, prompts, greedy_reference):
    model, tokenizer = target_lm
    failing = Failing()
    hosting = HostingVerifier(TargetVerifier(model, tokenizer), {"broken": failing})
    arm = HostedArm("broken", None, white_box=False)
    prompt = prompts[2][:-24]
    result = run(hosting, {"broken": arm}, FixedChooser("broken"), prompt, session="f")
    assert result.token_ids == greedy_reference(model, prompt, GREEDY.max_new_tokens)
    assert all(r.proposed == 0 for r in result.rounds)
    assert hosting.draft_failures == sum(1 for r in result.rounds if r.k > 0) > 0  # the last round asks for none


def test_an_arm_the_target_does_not_host_and_a_verifier_that_hosts_none_are_errors(head, target_lm, prompts):
    model, tokenizer = target_lm
    hosting = HostingVerifier(TargetVerifier(model, tokenizer), {"eagle:tiny": drafter_of(head)})
    request = VerifyRequest("e", prompts[0][:-24], [], [], GREEDY)
    with pytest.raises(NotFound, match="hosts no drafter 'eagle:code'"):
        hosting.draft_and_verify(request, HostedDraft("eagle:code", 5))
    with pytest.raises(NotFound, match="hosts no drafter 'other'"):
        hosting.draft_and_verify(request, HostedDraft(None, feed=("other",)))
    arm = hosted_arm_of("eagle:tiny", drafter_of(head))
    with pytest.raises(FailedPrecondition, match="hosted by the target, but this verifier drafts for none"):
        run(TargetVerifier(model, tokenizer), {"eagle:tiny": arm}, FixedChooser("eagle:tiny"), prompts[0][:-24])
    with pytest.raises(FailedPrecondition, match="drafted in the verify call"):
        arm.propose("e", [1, 2], 3, GREEDY)
