"""Sampled generation: seeds make outputs reproducible, and speculative sampling follows the
target's distribution at the sequence level on the tiny model."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specpool.drafters.hf_model import HFModelDrafter
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.target.sampling import SamplingParams, logits_to_probs
from specpool.target.verifier import TargetVerifier

PROMPT = [1, 3, 7, 9, 3, 7, 9, 21]


def generate(verifier, drafters, name, params, k=4, prompt=PROMPT, session="s"):
    result = speculative_generate(
        prompt, session_id=session, drafters=drafters, chooser=FixedChooser(name),
        verifier=verifier, params=params, k=k,
    )
    verifier.release(session)
    for d in drafters.values():
        d.release(session)
    return result


@pytest.fixture(scope="module")
def noisy_drafter(noisy_lm):
    return {"noisy": HFModelDrafter("noisy", *noisy_lm)}


@pytest.mark.parametrize("name", [None, "noisy"])
def test_same_seed_same_output_different_seed_different_output(name, verifier, noisy_drafter):
    params = [SamplingParams(temperature=0.8, seed=seed, max_new_tokens=16) for seed in (1, 2, 3, 4)]
    first = [generate(verifier, noisy_drafter, name, p).token_ids for p in params]
    again = [generate(verifier, noisy_drafter, name, p).token_ids for p in params]
    assert first == again
    assert all(len(t) == 16 for t in first)
    assert len({tuple(t) for t in first}) >= 3


def test_same_seed_same_output_with_a_warm_cache(verifier, noisy_drafter):
    """A session's caches hold other tokens from a previous request: same seed, same output."""
    params = SamplingParams(temperature=0.8, seed=5, max_new_tokens=12)
    cold = generate(verifier, noisy_drafter, "noisy", params).token_ids
    speculative_generate(  # leaves the caches of session "w" full of a different continuation
        PROMPT, session_id="w", drafters=noisy_drafter, chooser=FixedChooser("noisy"),
        verifier=verifier, params=SamplingParams(temperature=0.8, seed=6, max_new_tokens=12), k=4,
    )
    warm = speculative_generate(
        PROMPT, session_id="w", drafters=noisy_drafter, chooser=FixedChooser("noisy"),
        verifier=verifier, params=params, k=4,
    ).token_ids
    assert warm == cold


def test_engine_same_seed_same_output(engine):
    prompt = engine.encode_prompt("the cat sat on the mat the cat sat on the")
    outs = {}
    for seed in (0, 0, 1, 2):
        params = SamplingParams(temperature=0.8, seed=seed, max_new_tokens=10, stop_token_ids=())
        outs.setdefault(seed, []).append(engine.generate(prompt, params, "ngram", k=3).token_ids)
    assert outs[0][0] == outs[0][1]
    assert len({tuple(outs[s][0]) for s in (0, 1, 2)}) >= 2


# -- distribution of the first two tokens --------------------------------------------------------

DIST_PARAMS = dict(temperature=0.8, top_k=3, max_new_tokens=2)
SEEDS = 1000


@torch.inference_mode()
def exact_first_two(model, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The target's exact joint distribution of the first two sampled tokens."""
    params = SamplingParams(**DIST_PARAMS)
    p1 = logits_to_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1:], params)[0]  # (V,)
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = logits_to_probs(model(input_ids=torch.tensor([prompt + [t1]])).logits[0, -1:], params)[0]
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def chi_square_ok(counts: Counter, expected: dict, n: int, z: float = 3.72) -> tuple[float, float]:
    """Pearson's chi-square against ``expected``; bins with expected count < 5 are merged, and
    anything outside the support goes into the merged bin too. Returns (statistic, threshold at
    about alpha = 1e-4, via the Wilson-Hilferty approximation)."""
    bins, small_obs, small_exp = [], 0, 0.0
    for key, prob in expected.items():
        if prob * n >= 5:
            bins.append((counts.get(key, 0), prob * n))
        else:
            small_obs += counts.get(key, 0)
            small_exp += prob * n
    outside = sum(c for key, c in counts.items() if key not in expected)
    small_obs += outside
    if small_exp > 0 or small_obs > 0:
        bins.append((small_obs, max(small_exp, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    threshold = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, threshold


def tv(counts: Counter, expected: dict, n: int) -> float:
    keys = set(counts) | set(expected)
    return 0.5 * sum(abs(counts.get(key, 0) / n - expected.get(key, 0.0)) for key in keys)


@pytest.fixture(scope="module")
def first_two_samples(target_lm, noisy_lm):
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    drafters = {"noisy": HFModelDrafter("noisy", *noisy_lm)}
    spec, plain = Counter(), Counter()
    proposed = accepted = 0
    for seed in range(SEEDS):
        params = SamplingParams(seed=seed, **DIST_PARAMS)
        r = generate(verifier, drafters, "noisy", params, k=2, session=f"d{seed}")
        spec[tuple(r.token_ids)] += 1
        proposed += sum(x.proposed for x in r.rounds)
        accepted += sum(x.accepted for x in r.rounds)
        plain[tuple(generate(verifier, {}, None, params, session=f"t{seed}").token_ids)] += 1
    return exact_first_two(model, PROMPT), spec, plain, proposed, accepted


@pytest.mark.slow  # its fixture draws the statistical sample
def test_exact_distribution_is_usable(first_two_samples):
    expected, *_ = first_two_samples
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-5)
    assert 4 <= len(expected) <= 9  # top-3 then top-3
    assert max(expected.values()) < 0.8  # not (nearly) deterministic


@pytest.mark.slow  # statistical: SEEDS generations each way
def test_speculative_sampling_follows_target_distribution(first_two_samples):
    expected, spec, plain, proposed, accepted = first_two_samples
    # The drafter's first draft was both accepted and rejected in many requests.
    assert proposed == SEEDS
    assert 0.15 * SEEDS < accepted < 0.95 * SEEDS
    for counts in (spec, plain):
        assert sum(counts.values()) == SEEDS
        assert set(counts) <= set(expected), "emitted a pair the target gives zero probability"
        stat, threshold = chi_square_ok(counts, expected, SEEDS)
        assert stat < threshold, (stat, threshold, counts)
        assert tv(counts, expected, SEEDS) < 0.08
    # And the two empirical distributions agree with each other.
    assert 0.5 * sum(abs(spec[key] - plain[key]) for key in set(spec) | set(plain)) / SEEDS < 0.1
