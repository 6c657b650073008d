"""Greedy speculative decoding is token-identical to target-only greedy decoding, which is itself
identical to a plain reference (full forward every step, argmax): 24 prompts x k in {1,3,5,8} x
three drafters (a partially agreeing model, an unrelated model, n-gram lookup)."""

from __future__ import annotations

import pytest

from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.target.sampling import SamplingParams

NEW_TOKENS = 12
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def drafters(noisy_lm, random_lm):
    return {
        "noisy": HFModelDrafter("noisy", *noisy_lm),
        "random": HFModelDrafter("random", *random_lm),
        "ngram": NGramDrafter("ngram"),
    }


@pytest.fixture(scope="module")
def target_only(target_lm, prompts):
    from specpool.target.verifier import TargetVerifier

    verifier = TargetVerifier(*target_lm)
    outputs = []
    for i, prompt in enumerate(prompts):
        result = speculative_generate(
            prompt, session_id=f"base-{i}", drafters={}, chooser=FixedChooser(None),
            verifier=verifier, params=PARAMS, k=5,
        )
        assert all(r.drafter is None and r.proposed == 0 for r in result.rounds)
        assert len(result.rounds) == NEW_TOKENS  # one token per round without a drafter
        outputs.append(result.token_ids)
    return outputs


def test_prompt_set(prompts):
    assert len(prompts) >= 20
    assert len({tuple(p) for p in prompts}) == len(prompts)


def test_target_only_matches_plain_greedy_reference(target_lm, prompts, target_only, greedy_reference):
    model, _ = target_lm
    for prompt, got in zip(prompts, target_only):
        assert got == greedy_reference(model, prompt, NEW_TOKENS)
    # Not a degenerate model: outputs vary across prompts.
    assert len({tuple(o) for o in target_only}) == len(target_only)


@pytest.mark.parametrize("kind", ["noisy", "random", "ngram"])
# The fast lane keeps k = 3 (several drafts a round, accepted and rejected); the sweep is slow.
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3,
                               pytest.param(5, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_speculative_greedy_equals_target_only(kind, k, drafters, verifier, prompts, target_only):
    proposed = accepted = rejected_rounds = 0
    for i, (prompt, expected) in enumerate(zip(prompts, target_only)):
        result = speculative_generate(
            prompt, session_id=f"{kind}-{k}-{i}", drafters=drafters, chooser=FixedChooser(kind),
            verifier=verifier, params=PARAMS, k=k,
        )
        assert result.token_ids == expected, f"prompt {i}: speculative output differs from target-only"
        assert result.finish_reason == "length"
        assert sum(r.emitted for r in result.rounds) == NEW_TOKENS
        for r in result.rounds:
            assert r.drafter == kind
            assert r.proposed <= r.k <= k
            assert 0 <= r.accepted <= r.proposed
            assert r.emitted == r.accepted + 1
        proposed += sum(r.proposed for r in result.rounds)
        accepted += sum(r.accepted for r in result.rounds)
        rejected_rounds += sum(r.accepted < r.proposed for r in result.rounds)
    # Both paths of verification were exercised, so a broken verifier could not pass unnoticed.
    assert proposed > 0
    assert rejected_rounds > 0
    if kind == "noisy":
        assert accepted >= 0.2 * proposed / k, "the noisy copy of the target should agree with it often"
    if kind == "ngram":
        assert accepted > 0, "the prompts repeat, so some n-gram drafts should be accepted"
    if kind == "random":
        assert accepted < 0.2 * proposed
