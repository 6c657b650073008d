"""``lookup:SPEC`` (specpool/drafters/lookup_first.py): prompt lookup first, the model where nothing
matches. Lossless both ways (greedy identical to target-only, sampled output follows the target's
distribution), both sources really used, and bad specs refused."""

from __future__ import annotations

from collections import Counter

import pytest

from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.lookup_first import LookupFirstDrafter
from specpool.drafters.registry import DrafterContext, create_drafter
from specpool.core.errors import InvalidArgument
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier
from test_sampled_generation import chi_square_ok, exact_first_two, tv

NEW_TOKENS = 12


def test_spec_builds_the_named_drafter_behind_lookup(model_dirs, home):
    drafter = create_drafter(f"lookup:hf:{model_dirs.noisy}", DrafterContext(home))
    assert isinstance(drafter, LookupFirstDrafter)
    assert isinstance(drafter.inner, HFModelDrafter)
    assert drafter.name == f"lookup:hf:{model_dirs.noisy}"
    assert drafter.tokenizer_fingerprint == drafter.inner.tokenizer_fingerprint is not None


@pytest.mark.parametrize("spec, message", [
    ("lookup", "lookup needs a drafter to fall back to"),
    ("lookup:", "lookup needs a drafter to fall back to"),
    ("lookup:ngram", "falls back to a model drafter"),
    ("lookup:lookup:code", "falls back to a model drafter"),
])
def test_bad_specs(spec, message, home):
    with pytest.raises(InvalidArgument, match=message):
        create_drafter(spec, DrafterContext(home))


@pytest.mark.parametrize("k", [3, pytest.param(5, marks=pytest.mark.slow)])  # the fast lane keeps one k
def test_greedy_output_equals_target_only_and_both_sources_draft(k, target_lm, noisy_lm, prompts):
    verifier = TargetVerifier(*target_lm)
    drafter = LookupFirstDrafter("lookup:noisy", HFModelDrafter("noisy", *noisy_lm))
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    accepted = 0
    for i, prompt in enumerate(prompts):
        expected = speculative_generate(prompt, session_id=f"t{i}", drafters={}, chooser=FixedChooser(None),
                                        verifier=verifier, params=params, k=k).token_ids
        result = speculative_generate(prompt, session_id=f"l{i}", drafters={"l": drafter}, chooser=FixedChooser("l"),
                                      verifier=verifier, params=params, k=k)
        assert result.token_ids == expected, f"prompt {i}"
        accepted += sum(r.accepted for r in result.rounds)
        drafter.release(f"l{i}")
    # The prompts repeat phrases: lookup answers some rounds, the model the others.
    assert drafter.lookup_rounds > 0 and drafter.inner_rounds > 0
    assert accepted > 0


def test_a_round_comes_from_lookup_when_it_matches_and_from_the_model_otherwise(noisy_lm):
    drafter = LookupFirstDrafter("lookup:noisy", HFModelDrafter("noisy", *noisy_lm))
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    copied = drafter.propose("s", [1, 5, 6, 7, 8, 5, 6], 3, params)  # "5 6" seen before: copy "7 8 5"
    assert copied.tokens == [7, 8, 5][: len(copied.tokens)] and copied.tokens
    assert all(float(q.probs.max()) == 1.0 for q in copied.q)  # one-hot q
    fresh = drafter.propose("s", [1, 5, 6, 7, 8, 9], 3, params)  # nothing repeats: the model drafts
    assert fresh.tokens and (drafter.lookup_rounds, drafter.inner_rounds) == (1, 1)


PROMPT = [1, 3, 7, 9, 21, 3, 7, 9]  # ends in a repeat, so lookup proposes "21 3" in round one
# Three tokens, of which the first two are counted: a round one that emits a single token leaves a
# round two that drafts (from the model, unless the new suffix repeats) the second token.
DIST = dict(temperature=0.8, top_k=3, max_new_tokens=3)
SEEDS = 1000


@pytest.mark.slow  # statistical: many seeded generations
def test_sampled_output_follows_the_target_distribution(target_lm, noisy_lm):
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    drafter = LookupFirstDrafter("lookup:noisy", HFModelDrafter("noisy", *noisy_lm))
    counts = Counter()
    for seed in range(SEEDS):
        result = speculative_generate(PROMPT, session_id=f"s{seed}", drafters={"l": drafter},
                                      chooser=FixedChooser("l"), verifier=verifier,
                                      params=SamplingParams(seed=seed, **DIST), k=2)
        counts[tuple(result.token_ids[:2])] += 1
        verifier.release(f"s{seed}")
        drafter.release(f"s{seed}")
    expected = exact_first_two(model, PROMPT)  # its own params: the first two of top-3 at T = 0.8
    assert drafter.lookup_rounds >= SEEDS and drafter.inner_rounds > 0  # rejected copies -> model rounds
    assert set(counts) <= set(expected), "emitted a pair the target gives zero probability"
    stat, threshold = chi_square_ok(counts, expected, SEEDS)
    assert stat < threshold, (stat, threshold, counts)
    assert tv(counts, expected, SEEDS) < 0.08
