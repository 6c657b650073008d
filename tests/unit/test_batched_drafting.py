"""Several sessions drafted at once (``BatchDrafter``): what the target does for the sessions of a
verify batch that play one hosted head (specpool/router/hosted.py).

On the tiny target with the fitted test head of test_eagle_drafter.py: a padded head forward over
sessions with caches of different lengths gives each row what that row alone gives; a batch of
chains equals each session's ``propose`` (greedy and seeded sampling, with different k, confidence
stops, a session without features, a session twice), behind prompt lookup too, in fewer head
forwards; a batch that fails mid-way leaves every session's head state as good as new; a
hosting verifier whose batch fails drafts one session at a time instead; and the load gate, which
lets a batch draft only where drafting has measured faster, keeps outputs exact either way."""

from __future__ import annotations

import pytest
import torch

from specpool.drafters.base import UNDRAFTED_SOURCE, DraftRequest, propose_many
from specpool.drafters.eagle import EagleDrafter
from specpool.drafters.lookup_first import LookupFirstDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.core.errors import InvalidArgument
from specpool.router.hosted import HostedDraft, HostingVerifier, LoadGate
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest
from test_eagle_drafter import GREEDY, drafter_of, final_hidden, head, head_dir, tell  # noqa: F401 - module fixtures

SAMPLED = SamplingParams(temperature=0.7, max_new_tokens=20, seed=5)


def same(a, b) -> None:
    """Two proposals agree: tokens exactly, each q's support exactly and its probabilities up to
    the round-off of a batched forward."""
    assert a.tokens == b.tokens
    assert len(a.q) == len(b.q)
    for qa, qb in zip(a.q, b.q):
        assert qa.token_ids.tolist() == qb.token_ids.tolist()
        torch.testing.assert_close(qa.probs, qb.probs, atol=1e-4, rtol=1e-4)


class CountedRows:
    """Counts the head's batched forwards (``forward_rows``) and single ones (``forward``)."""

    def __init__(self, head, monkeypatch, fail_on: int | None = None):
        self.rows = 0
        self.single = 0
        original_rows = head.forward_rows

        def rows(*args, **kwargs):
            self.rows += 1
            if fail_on is not None and self.rows == fail_on:
                raise RuntimeError("injected")
            return original_rows(*args, **kwargs)

        monkeypatch.setattr(head, "forward_rows", rows)
        self._handle = head.register_forward_hook(lambda *_: setattr(self, "single", self.single + 1))

    def close(self) -> None:
        self._handle.remove()


@torch.inference_mode()
def test_a_padded_forward_gives_each_row_what_it_gives_alone(head, target_lm, prompts):
    model, _ = target_lm
    shapes = [(5, 1), (0, 4), (12, 9), (3, 2)]  # (cached positions, new positions) per row
    alone, caches, fed = [], [], []
    for i, (past, new) in enumerate(shapes):
        ids = list(prompts[i][:past + new + 1])
        feats = final_hidden(model, ids)  # (L, d)
        own, shared = head.new_cache(), head.new_cache()
        if past:
            for cache in (own, shared):
                head(torch.tensor([ids[1:past + 1]]), feats[None, :past], cache)
        alone.append(head(torch.tensor([ids[past + 1:past + new + 1]]), feats[None, past:past + new], own)[0])  # (new, d)
        caches.append((own, shared))
        fed.append((torch.tensor(ids[past + 1:past + new + 1]), feats[past:past + new]))
    width = max(new for _, new in shapes)
    inputs = torch.stack([torch.nn.functional.pad(ids, (0, width - len(ids))) for ids, _ in fed])
    feats = torch.stack([torch.nn.functional.pad(f, (0, 0, 0, width - len(f))) for _, f in fed])
    out = head.forward_rows(inputs, feats, [shared for _, shared in caches], [new for _, new in shapes])
    for row, ((past, new), (own, shared)) in enumerate(zip(shapes, caches)):
        torch.testing.assert_close(out[row, :new], alone[row], atol=1e-5, rtol=1e-5)
        assert shared.get_seq_length() == own.get_seq_length() == past + new  # no padding kept
        torch.testing.assert_close(shared.keys[0], own.keys[0], atol=1e-5, rtol=1e-5)


def advance(drafters, model, contexts: dict[str, list[int]], sequences: dict[str, list[int]], told: set[str], step: int):
    """Every session moves ``step`` tokens along its own sequence; the drafters get the new features."""
    for session in contexts:
        old = len(contexts[session])
        contexts[session] = list(sequences[session][:old + step])
        if session in told:
            for drafter in drafters:
                tell(drafter, session, model, contexts[session], start=old - 1)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_batch_of_chains_equals_each_sessions_propose(params, head, target_lm, prompts, monkeypatch):
    model, _ = target_lm
    serial, batched = drafter_of(head), drafter_of(head)
    sequences = {f"p{i}": list(prompts[i]) for i in range(5)}
    contexts = {s: seq[:-24] for s, seq in sequences.items()}
    told = {"p0", "p1", "p2", "p4"}  # p3 has no features: no draft, as ``propose`` gives none
    for session in told:
        for drafter in (serial, batched):
            tell(drafter, session, model, contexts[session])
    ks = {"p0": 5, "p1": 3, "p2": 5, "p3": 5, "p4": 0}
    counter = CountedRows(head, monkeypatch)
    lengths, serial_forwards, batched_forwards = set(), 0, 0
    try:
        for _ in range(4):  # the first batch catches up on whole prompts, the later ones on a few positions
            asks = [DraftRequest(s, list(c), ks[s], params) for s, c in contexts.items()]
            before = counter.single
            one = [serial.propose(a.session_id, a.context_ids, a.k, a.params) for a in asks]
            serial_forwards += counter.single - before
            before = counter.rows, counter.single
            many = batched.propose_batch(asks)
            batched_forwards += counter.rows - before[0] + counter.single - before[1]
            for a, b in zip(one, many):
                same(a, b)
            assert not many[3].tokens and not many[4].tokens
            lengths |= {len(p.tokens) for p in many[:3]}
            advance((serial, batched), model, contexts, sequences, told, 3)
    finally:
        counter.close()
    assert len(lengths - {0}) > 1, "every row drafted as many tokens: the per-row stops went untested"
    assert batched_forwards < serial_forwards / 2
    assert batched.cost.calls > 0


def test_a_session_twice_in_a_batch_drafts_one_request_after_another(head, target_lm, prompts):
    model, _ = target_lm
    serial, batched = drafter_of(head), drafter_of(head)
    context = list(prompts[1][:-24])
    for drafter in (serial, batched):
        tell(drafter, "twice", model, context)
    asks = [DraftRequest("twice", context, 5, GREEDY), DraftRequest("twice", context[:-2], 4, GREEDY)]
    one = [serial.propose(a.session_id, a.context_ids, a.k, a.params) for a in asks]
    for a, b in zip(one, batched.propose_batch(asks)):
        same(a, b)


def test_behind_prompt_lookup_a_batch_drafts_with_the_head_only_where_lookup_is_silent(head, target_lm, prompts):
    model, _ = target_lm
    make = lambda: LookupFirstDrafter("lookup:eagle:tiny", drafter_of(head))  # noqa: E731
    serial, batched = make(), make()
    copying = list(prompts[0][:-24])
    copying += copying[5:12]  # its last tokens occur earlier: lookup copies what followed them
    contexts = {"copy": copying}
    for i, sequence in enumerate(prompts[1:], start=1):  # the tiny target loops: find contexts lookup has nothing for
        cut = next((n for n in range(len(sequence) - 24, 8, -1) if not NGramDrafter().would_propose("x", sequence[:n], 5)), 0)
        if cut and len(contexts) < 3:
            contexts[f"silent{i}"] = list(sequence[:cut])
    assert len(contexts) == 3
    for drafter in (serial, batched):
        for session, context in contexts.items():
            tell(drafter, session, model, context)
    asks = [DraftRequest(s, c, 5, GREEDY) for s, c in contexts.items()]
    one = [serial.propose(a.session_id, a.context_ids, a.k, a.params) for a in asks]
    many = propose_many(batched, asks)
    for a, b in zip(one, many):
        same(a, b)
        assert a.source == b.source
    assert many[0].tokens == copying[12:12 + len(many[0].tokens)] and many[0].tokens
    assert (batched.lookup_rounds, batched.inner_rounds) == (serial.lookup_rounds, serial.inner_rounds) == (1, 2)


def test_a_batch_that_fails_midway_leaves_each_session_as_good_as_new(head, target_lm, prompts, monkeypatch):
    model, _ = target_lm
    fresh, broken = drafter_of(head), drafter_of(head)
    contexts = {f"f{i}": list(prompts[i][:-24]) for i in range(3)}
    for drafter in (fresh, broken):
        for session, context in contexts.items():
            tell(drafter, session, model, context)
    asks = [DraftRequest(s, c, 5, GREEDY) for s, c in contexts.items()]
    counter = CountedRows(head, monkeypatch, fail_on=2)  # the catch-up ran, a draft step fails
    try:
        with pytest.raises(RuntimeError, match="injected"):
            broken.propose_batch(asks)
    finally:
        counter.close()
    monkeypatch.undo()
    for a, b in zip(fresh.propose_batch(asks), broken.propose_batch(asks)):
        same(a, b)


class BatchFails(EagleDrafter):
    def propose_batch(self, requests):
        raise RuntimeError("injected batch failure")


def test_a_hosting_verifier_whose_batch_fails_drafts_one_session_at_a_time(head, target_lm, prompts):
    model, tokenizer = target_lm
    good = HostingVerifier(TargetVerifier(model, tokenizer), {"eagle:tiny": drafter_of(head)})
    flaky = HostingVerifier(TargetVerifier(model, tokenizer),
                            {"eagle:tiny": BatchFails("eagle:tiny", head, {"target_tokenizer_fingerprint": "tiny"})})
    contexts = {f"h{i}": list(s[:-24]) for i, s in enumerate(prompts[:3])}
    drafted = 0
    for step in range(3):
        draft = HostedDraft("eagle:tiny" if step else None, 5, False, ("eagle:tiny",))
        requests = [VerifyRequest(s, list(c), [], [], GREEDY) for s, c in contexts.items()]
        a = good.verify_batch([(r, draft) for r in requests])
        b = flaky.verify_batch([(r, draft) for r in requests])
        for (pa, ra), (pb, rb), session in zip(a, b, list(contexts)):
            assert (pb.tokens, rb.tokens) == (pa.tokens, ra.tokens)
            contexts[session] += rb.tokens
            drafted += len(pb.tokens)
    assert drafted > 0 and flaky.draft_failures == good.draft_failures == 0


# -- the load gate ----------------------------------------------------------------------------------


def play(gate: LoadGate, sessions: int, batches: int, rate: dict[bool, float]) -> list[bool]:
    """``batches`` decisions, each answered with the given tokens/s of its choice."""
    chosen = []
    for _ in range(batches):
        drafted = gate.drafts(sessions)
        gate.observe(sessions, drafted, int(rate[drafted]), 1.0)
        chosen.append(drafted)
    return chosen


def test_the_gate_measures_both_choices_then_keeps_the_faster_and_keeps_exploring():
    gate = LoadGate(min_batches=2, explore_every=5, decay=0.5)
    assert all(gate.drafts(1) for _ in range(20))  # one session always drafts, and is not measured
    chosen = play(gate, 4, 4, {True: 10, False: 20})
    assert sorted(chosen) == [False, False, True, True] and chosen[0] is True  # both measured, drafting first
    steady = play(gate, 4, 10, {True: 10, False: 20})
    assert steady == [True, False, False, False, False, True, False, False, False, False]  # plain is faster: every 5th batch explores
    assert gate.plain_batches == 2 + 8
    assert play(gate, 8, 7, {True: 30, False: 20})[5:] == [True, True]  # each batch size learns on its own
    # Drafting gets faster at 4 sessions: its explored batches see it, and the gate turns.
    later = play(gate, 4, 20, {True: 40, False: 20})
    assert later[-4:] == [True, True, True, True]
    assert gate.rates()["4 drafted"] > gate.rates()["4 plain"]
    before = gate.rates()
    gate.observe(4, False, 1000, 1.0, most_fed=gate.max_fed_per_row + 1)  # a batch with a prompt's prefill
    assert gate.rates() == before  # counted as plain, not measured


@pytest.mark.parametrize("bad", [dict(min_batches=0), dict(explore_every=1), dict(decay=1.0)])
def test_a_gate_with_bad_settings_is_refused(bad):
    with pytest.raises(InvalidArgument, match="a load gate needs"):
        LoadGate(**bad)


class Pinned(LoadGate):
    """A gate whose choice the test sets (the real gate decides by the clock)."""

    def __init__(self, drafting: bool):
        super().__init__()
        self.drafting = drafting
        self.observed: list[tuple[int, bool, int]] = []

    def drafts(self, sessions: int) -> bool:
        return self.drafting or sessions < 2

    def observe(self, sessions, drafted, tokens, seconds, most_fed=0):
        self.observed.append((sessions, drafted, tokens))
        super().observe(sessions, drafted, tokens, seconds, most_fed)


def test_behind_the_gate_a_batch_drafts_or_not_and_outputs_stay_the_targets(head, target_lm, prompts, greedy_reference):
    model, tokenizer = target_lm
    head_drafter = drafter_of(head)
    gate = Pinned(True)
    hosting = HostingVerifier(TargetVerifier(model, tokenizer), {"eagle:tiny": head_drafter}, gate)
    contexts = {f"g{i}": list(s[:-24]) for i, s in enumerate(prompts[:3])}
    start = {s: list(c) for s, c in contexts.items()}
    drafted = {True: 0, False: 0}
    for step in range(8):
        gate.drafting = step % 4 < 2  # two batches drafting, two plain, and again
        draft = HostedDraft("eagle:tiny" if step else None, 5, False, ("eagle:tiny",))
        out = hosting.verify_batch([(VerifyRequest(s, list(c), [], [], GREEDY), draft) for s, c in contexts.items()])
        for (proposal, result), session in zip(out, list(contexts)):
            if step and not gate.drafting:
                assert proposal.tokens == [] and len(result.tokens) == 1  # a plain round
                assert proposal.source == UNDRAFTED_SOURCE  # credited to no arm (router/bandit.py)
            drafted[gate.drafting] += len(proposal.tokens)
            contexts[session] += result.tokens
        if step == 0:  # the prefill round asks no hosted arm for a draft: not the gate's batch
            assert gate.observed == []
            continue
        assert len(gate.observed) == step and gate.observed[-1][:2] == (3, gate.drafting)
        assert gate.observed[-1][2] == sum(len(r.tokens) for _, r in out)
    assert drafted[True] > 0 and drafted[False] == 0 and gate.plain_batches == 4
    for session, context in contexts.items():  # every plain round still fed the head: it drafts from where it is
        assert head_drafter.features_held(session) >= len(context) - 2
        n = len(context) - len(start[session])
        assert context[len(start[session]):] == greedy_reference(model, start[session], n)
