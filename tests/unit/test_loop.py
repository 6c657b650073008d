"""The speculative loop (specpool/router/loop.py): max_new_tokens met exactly, stop tokens end generation
right after them (inside an accepted run too), streaming, cancellation, round records."""

from __future__ import annotations

import pytest

from specpool.drafters.base import Proposal
from specpool.drafters.hf_model import HFModelDrafter
from specpool.router.loop import (
    Choice,
    FixedChooser,
    GenerationResult,
    RoundRecord,
    block_divergence,
    speculative_generate,
)
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams


@pytest.fixture(scope="module")
def drafters(target_lm, noisy_lm):
    return {
        # The target itself as drafter: greedy drafts are always accepted.
        "self": HFModelDrafter("self", *target_lm),
        "noisy": HFModelDrafter("noisy", *noisy_lm),
    }


def run(verifier, drafters, name, params, prompt, k, **kwargs):
    return speculative_generate(
        prompt, session_id=kwargs.pop("session_id", "s"), drafters=drafters, chooser=kwargs.pop("chooser", FixedChooser(name)),
        verifier=verifier, params=params, k=k, **kwargs,
    )


# -- max_new_tokens --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, "self", "noisy"])
@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_max_new_tokens_met_exactly(name, k, verifier, drafters, prompts):
    for max_new in (1, 2, 7, 10):
        for temperature in (0.0, 0.9):
            params = SamplingParams(temperature=temperature, seed=max_new, max_new_tokens=max_new)
            result = run(verifier, drafters, name, params, prompts[max_new], k, session_id=f"{name}{k}{max_new}{temperature}")
            assert len(result.token_ids) == max_new
            assert result.finish_reason == "length"
            assert sum(r.emitted for r in result.rounds) == max_new
            produced = 0
            for r in result.rounds:
                # Draft length is capped by what is still wanted: accepted + 1 never overshoots.
                if name is None:
                    assert r.k == 0 and r.proposed == 0
                else:
                    assert r.proposed <= r.k == min(k, max_new - produced - 1)
                produced += r.emitted


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_self_drafting_accepts_everything(k, verifier, drafters, prompts, target_lm, greedy_reference):
    params = SamplingParams(max_new_tokens=14)
    result = run(verifier, drafters, "self", params, prompts[0], k)
    assert result.token_ids == greedy_reference(target_lm[0], prompts[0], 14)
    assert all(r.accepted == r.proposed == r.k for r in result.rounds)
    assert len(result.rounds) == -(-14 // (k + 1))  # ceil(14 / (k + 1))
    assert result.mean_accepted_length == pytest.approx(14 / len(result.rounds))
    assert all(r.bd == pytest.approx(1.0) for r in result.rounds if r.proposed)


# -- stop tokens -----------------------------------------------------------------------------------


def first_new_position(tokens: list[int], candidates) -> int | None:
    """A position j in ``candidates`` whose token does not occur before j."""
    for j in candidates:
        if tokens[j] not in tokens[:j]:
            return j
    return None


@pytest.mark.parametrize("k", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_stop_token_inside_an_accepted_run(k, verifier, drafters, prompts, target_lm, greedy_reference):
    """With the target as drafter, the first round accepts k drafts; a stop token at an accepted
    position j < k ends generation right after it, discarding the rest of the run."""
    model, _ = target_lm
    checked = 0
    for i, prompt in enumerate(prompts):
        full = greedy_reference(model, prompt, 12)
        j = first_new_position(full, range(1, k))  # inside the first round's accepted drafts
        if j is None:
            continue
        params = SamplingParams(max_new_tokens=12, stop_token_ids=(full[j],))
        result = run(verifier, drafters, "self", params, prompt, k, session_id=f"stop{k}{i}")
        assert result.finish_reason == "stop"
        assert result.token_ids == full[: j + 1]
        assert len(result.rounds) == 1
        record = result.rounds[0]
        assert record.accepted == k  # the stop token was one of the accepted drafts
        assert record.emitted == j + 1
        target_only = run(verifier, {}, None, params, prompt, k, session_id=f"stop-base{k}{i}")
        assert target_only.token_ids == result.token_ids
        assert target_only.finish_reason == "stop"
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("name", [None, "noisy", "self"])
def test_stop_token_anywhere_truncates_target_only_output(name, verifier, drafters, prompts, target_lm, greedy_reference):
    model, _ = target_lm
    checked = 0
    for i, prompt in enumerate(prompts[:8]):
        full = greedy_reference(model, prompt, 12)
        unused = next(t for t in range(64) if t not in full)  # a second stop id, never emitted
        for j in (0, 4, 9, 11):
            if full[j] in full[:j]:
                continue
            params = SamplingParams(max_new_tokens=12, stop_token_ids=(unused, full[j]))
            result = run(verifier, drafters, name, params, prompt, 4, session_id=f"{name}{i}{j}")
            assert result.token_ids == full[: j + 1]
            assert result.finish_reason == "stop"
            checked += 1
    assert checked >= 10


def test_stop_token_never_emitted_changes_nothing(verifier, drafters, prompts, target_lm, greedy_reference):
    full = greedy_reference(target_lm[0], prompts[3], 10)
    unused = next(t for t in range(3, 64) if t not in full)
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(unused,))
    result = run(verifier, drafters, "self", params, prompts[3], 3)
    assert result.token_ids == full
    assert result.finish_reason == "length"


# -- streaming, cancellation, choosers ---------------------------------------------------------------


def test_on_tokens_streams_exactly_the_output(verifier, drafters, prompts):
    chunks: list[list[int]] = []
    params = SamplingParams(temperature=0.7, seed=3, max_new_tokens=15)
    result = run(verifier, drafters, "noisy", params, prompts[2], 4, on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == result.token_ids
    assert [len(c) for c in chunks] == [r.emitted for r in result.rounds]


def test_should_stop_cancels_between_rounds(verifier, drafters, prompts):
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 3

    result = run(verifier, drafters, "noisy", SamplingParams(max_new_tokens=50), prompts[1], 2, should_stop=should_stop)
    assert result.finish_reason == "cancelled"
    assert len(result.rounds) == 3
    assert len(result.token_ids) == sum(r.emitted for r in result.rounds) < 50


class RecordingChooser:
    def __init__(self, names):
        self.names = list(names)
        self.records: list[RoundRecord] = []

    def select(self):
        return Choice(self.names[len(self.records) % len(self.names)])

    def update(self, record):
        self.records.append(record)


def test_chooser_sees_every_round(verifier, drafters, prompts, target_lm, greedy_reference):
    chooser = RecordingChooser(["self", None, "noisy"])
    params = SamplingParams(max_new_tokens=16)
    result = run(verifier, drafters, None, params, prompts[4], 3, chooser=chooser)
    assert chooser.records == result.rounds
    assert [r.drafter for r in result.rounds] == [["self", None, "noisy"][i % 3] for i in range(len(result.rounds))]
    assert result.token_ids == greedy_reference(target_lm[0], prompts[4], 16)
    assert result.rounds_by_drafter() == {
        key: sum(1 for r in result.rounds if (r.drafter or "none") == key) for key in ("self", "none", "noisy")
    }
    for r in result.rounds:
        assert r.round_s >= r.draft_s >= 0 and r.round_s >= r.verify_s >= 0
        if r.drafter is None:
            assert (r.k, r.proposed, r.bd) == (0, 0, None)


class ShortDrafter:
    """Proposes fewer tokens than asked (even none), as the protocol allows."""

    name = "short"
    tokenizer_fingerprint = None

    def __init__(self):
        from specpool.drafters.base import CostMeter

        self.cost = CostMeter()

    def propose(self, session_id, context_ids, k, params):
        tokens = [context_ids[-1]] * (len(context_ids) % 3)
        tokens = tokens[:k]
        return Proposal(tokens, [SparseDist.one_hot(t) for t in tokens])

    def release(self, session_id):
        pass


def test_drafter_may_propose_fewer_tokens(verifier, prompts, target_lm, greedy_reference):
    params = SamplingParams(max_new_tokens=12)
    result = run(verifier, {"short": ShortDrafter()}, "short", params, prompts[5], 4)
    assert result.token_ids == greedy_reference(target_lm[0], prompts[5], 12)
    assert {r.proposed for r in result.rounds} <= {0, 1, 2}
    assert any(r.proposed == 0 and r.bd is None for r in result.rounds)


# -- small pure helpers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tv, expected",
    [([], None), ([0.0], 1.0), ([1.0], 0.0), ([0.0, 0.5], 0.75), ([0.2, 0.4, 0.6], 0.6)],
)
def test_block_divergence(tv, expected):
    assert block_divergence(tv) == (None if expected is None else pytest.approx(expected))


def record(drafter, emitted):
    return RoundRecord(drafter, 3, 3, emitted - 1, emitted, 1.0, 0.0, 0.0, 0.0)


def test_generation_result_derived_values():
    result = GenerationResult([5, 6, 7, 8, 9], "length", [record("a", 3), record(None, 1), record("a", 1)], wall_s=2.0)
    assert result.mean_accepted_length == pytest.approx(5 / 3)
    assert result.tokens_per_s == pytest.approx(2.5)
    assert result.rounds_by_drafter() == {"a": 2, "none": 1}
    empty = GenerationResult([], "length")
    assert (empty.mean_accepted_length, empty.tokens_per_s, empty.rounds_by_drafter()) == (0.0, 0.0, {})


def test_fixed_chooser():
    chooser = FixedChooser("x")
    assert [chooser.select() for _ in range(3)] == [Choice("x")] * 3
    chooser.update(record("x", 2))
    assert FixedChooser(None).select() == Choice(None, None)
