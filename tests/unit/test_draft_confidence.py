"""Dynamic draft length of model drafters: stop drafting when the drafter doubts its own token."""

from __future__ import annotations

import pytest

from specpool.drafters.hf_model import HFModelDrafter
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.target.sampling import SamplingParams


@pytest.mark.parametrize("threshold, expected", [(0.0, 6), (1.01, 1)])
def test_threshold_bounds_the_proposal(noisy_lm, prompts, threshold: float, expected: int) -> None:
    model, tokenizer = noisy_lm
    drafter = HFModelDrafter("noisy", model, tokenizer, confidence_threshold=threshold)
    proposal = drafter.propose("s", prompts[0], 6, SamplingParams())
    assert len(proposal.tokens) == len(proposal.q) == expected


def test_some_but_not_all_proposals_stop_early(noisy_lm, prompts) -> None:
    model, tokenizer = noisy_lm
    drafter = HFModelDrafter("noisy", model, tokenizer, confidence_threshold=0.5)
    lengths = {len(drafter.propose(f"s{i}", p, 6, SamplingParams()).tokens) for i, p in enumerate(prompts[:12])}
    assert len(lengths) > 1, lengths


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_early_stopping_stays_lossless(verifier, noisy_lm, prompts, temperature: float) -> None:
    model, tokenizer = noisy_lm
    drafter = HFModelDrafter("noisy", model, tokenizer, confidence_threshold=0.5)
    for i, prompt in enumerate(prompts[:6]):
        params = SamplingParams(temperature=temperature, seed=i, max_new_tokens=14)
        run = lambda name: speculative_generate(  # noqa: E731
            prompt, session_id=f"{name}{i}", drafters={"noisy": drafter}, chooser=FixedChooser(name),
            verifier=verifier, params=params, k=6)
        # Greedy: token-identical. Sampled: the same seed gives the target's own distribution, not
        # the same tokens, so there the check is only that it runs to the exact length.
        speculative, reference = run("noisy"), run(None)
        assert len(speculative.token_ids) == 14
        if temperature == 0.0:
            assert speculative.token_ids == reference.token_ids
