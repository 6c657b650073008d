"""Sampling parameters (specpool/target/sampling.py): validation, the distribution p they define, and the
per-round seeded generators."""

from __future__ import annotations

import math

import pytest
import torch

from specpool.core.errors import InvalidArgument
from specpool.target.sampling import (
    MAX_DRAFT_LENGTH,
    SamplingParams,
    logits_to_probs,
    request_generator,
    validate_draft_length,
)


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (one row)."""
    return torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]])


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=1e-5)


# -- SamplingParams.validate ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, window, prompt, message",
    [
        (SamplingParams(temperature=-1.0), None, 0, "temperature"),
        (SamplingParams(temperature=float("nan")), None, 0, "temperature"),
        (SamplingParams(top_p=0.0), None, 0, "top-p"),
        (SamplingParams(top_p=1.5), None, 0, "top-p"),
        (SamplingParams(top_p=-0.1), None, 0, "top-p"),
        (SamplingParams(top_k=-1), None, 0, "top-k"),
        (SamplingParams(max_new_tokens=0), None, 0, "max-new-tokens"),
        (SamplingParams(max_new_tokens=-3), None, 0, "max-new-tokens"),
        (SamplingParams(max_new_tokens=11), 256, 246, "context window is 256"),
        (SamplingParams(max_new_tokens=1), 256, 256, "room for 0"),
        (SamplingParams(max_new_tokens=1), 256, 300, "room for 0"),
    ],
)
def test_validate_rejects(params, window, prompt, message):
    with pytest.raises(InvalidArgument, match=message):
        params.validate(window, prompt)


@pytest.mark.parametrize(
    "params, window, prompt",
    [
        (SamplingParams(), None, 0),
        (SamplingParams(temperature=0.8, top_p=1.0, top_k=5, seed=3), None, 0),
        (SamplingParams(top_p=1e-6), None, 0),
        (SamplingParams(max_new_tokens=10), 256, 246),  # exactly fills the window
        (SamplingParams(max_new_tokens=100_000), None, 10),  # no window given: not checked
    ],
)
def test_validate_accepts(params, window, prompt):
    params.validate(window, prompt)
    # What acceptance promises: the parameters define a distribution p over the vocabulary.
    probs = logits_to_probs(torch.tensor([[0.3, 2.0, -1.0, 0.5], [1.0, 1.0, 1.0, 1.0]]), params)  # (2, V)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2))
    assert bool((probs >= 0).all()) and probs[0].argmax().item() == 1  # the likeliest token stays the likeliest


def test_greedy_property():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=3).greedy
    assert not SamplingParams(temperature=0.01).greedy


@pytest.mark.parametrize("k, ok", [(0, False), (-1, False), (1, True), (5, True), (MAX_DRAFT_LENGTH, True), (33, False)])
def test_validate_draft_length(k, ok):
    assert MAX_DRAFT_LENGTH == 32
    if ok:
        validate_draft_length(k)
    else:
        with pytest.raises(InvalidArgument, match="draft length"):
            validate_draft_length(k)


# -- logits_to_probs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits, expected",
    [
        ([[1.0, 3.0, 2.0]], [[0.0, 1.0, 0.0]]),
        ([[5.0, 0.0, 0.0], [0.0, 0.0, -1.0], [-3.0, -2.0, -9.0]], [[1, 0, 0], [1, 0, 0], [0, 1, 0]]),
        ([[0.1, 0.1, 0.2, 0.1]], [[0, 0, 1, 0]]),
    ],
)
def test_greedy_is_one_hot_on_argmax(logits, expected):
    close(logits_to_probs(torch.tensor(logits), SamplingParams(temperature=0.0)), expected)


def test_greedy_ignores_top_k_and_top_p():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.9]])
    close(logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.01)), [[0, 1, 0, 0]])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0, 0.8])
def test_temperature_scales_logits(temperature):
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 3.0]])
    expected = torch.softmax(logits / temperature, dim=-1)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=temperature)), expected)


def test_lower_temperature_is_sharper():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    cold = logits_to_probs(logits, SamplingParams(temperature=0.25))[0, 1]
    hot = logits_to_probs(logits, SamplingParams(temperature=4.0))[0, 1]
    assert cold > 0.95 > 0.5 > hot


def norm(masses: list[float]) -> list[float]:
    return [m / sum(masses) for m in masses]


@pytest.mark.parametrize(
    "top_k, expected",
    [
        (1, [0.0, 1.0, 0.0, 0.0]),
        (2, norm([0.0, 0.5, 0.0, 0.3])),
        (3, norm([0.1, 0.5, 0.0, 0.3])),
        (4, norm([0.1, 0.5, 0.05, 0.3])),  # k >= V: no limit
        (10, norm([0.1, 0.5, 0.05, 0.3])),
        (0, norm([0.1, 0.5, 0.05, 0.3])),  # 0 = no limit
    ],
)
def test_top_k(top_k, expected):
    probs = logits_to_probs(logits_of([0.1, 0.5, 0.05, 0.3]), SamplingParams(temperature=1.0, top_k=top_k))
    close(probs, [expected])


def test_top_k_with_temperature():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    expected = torch.softmax(torch.tensor([[1.0, 2.0]]) / 0.5, dim=-1)[0].tolist() + [0.0, 0.0]
    close(logits_to_probs(logits, SamplingParams(temperature=0.5, top_k=2)), [expected])


def test_top_k_applies_per_row():
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    close(probs, [[1, 0, 0], [0, 0, 1]])


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (1.0, [0.5, 0.3, 0.15, 0.05]),
        (0.01, [1.0, 0.0, 0.0, 0.0]),  # the top token always stays
        (0.4, [1.0, 0.0, 0.0, 0.0]),
        (0.6, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # smallest set with mass >= 0.6 is {0, 1}
        (0.79, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (0.81, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (0.96, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p(top_p, expected):
    # Token order shuffled so that sorting is exercised: masses 0.15, 0.5, 0.05, 0.3.
    order = [2, 0, 3, 1]
    probs = logits_to_probs(logits_of([0.15, 0.5, 0.05, 0.3]), SamplingParams(temperature=1.0, top_p=top_p))
    close(probs, [[expected[i] for i in order]])


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.50001, 3), (0.75, 3), (0.76, 4)])
def test_top_p_exact_boundary(top_p, kept):
    """Equal logits give exactly 0.25 each: the smallest set with mass >= top_p is kept, so mass
    exactly reaching top_p stops the set there."""
    probs = logits_to_probs(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert int((probs > 0).sum()) == kept
    close(probs.sort(descending=True).values, [1.0 / kept] * kept + [0.0] * (4 - kept))


def test_top_p_with_single_dominant_token():
    probs = logits_to_probs(torch.tensor([[10.0, 0.0, 0.0]]), SamplingParams(temperature=1.0, top_p=0.5))
    close(probs, [[1.0, 0.0, 0.0]])


def test_top_k_then_top_p():
    # top-k 3 keeps {0.5, 0.3, 0.15} -> renormalised {0.526, 0.316, 0.158}; top-p 0.8 keeps two.
    probs = logits_to_probs(
        logits_of([0.5, 0.3, 0.15, 0.05]), SamplingParams(temperature=1.0, top_k=3, top_p=0.8)
    )
    close(probs, [[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]])


def test_probs_are_float32_and_normalised_for_half_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).half()
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)):
        probs = logits_to_probs(logits, params)
        assert probs.dtype == torch.float32
        assert probs.shape == (3, 50)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))
        assert (probs >= 0).all()


# -- request_generator -----------------------------------------------------------------------------


def draws(seed, position, stream, n=8) -> list[float]:
    return torch.rand(n, generator=request_generator(seed, position, stream)).tolist()


def test_request_generator_is_deterministic():
    assert draws(7, 12, 0) == draws(7, 12, 0)
    assert draws(0, 0, 0) == draws(0, 0, 0)
    assert draws(2**63 + 5, 10**9, 3) == draws(2**63 + 5, 10**9, 3)


@pytest.mark.parametrize(
    "a, b",
    [
        ((7, 12, 0), (8, 12, 0)),  # seed
        ((7, 12, 0), (7, 13, 0)),  # position
        ((7, 12, 0), (7, 12, 1)),  # stream: drafter vs target
        ((0, 1, 0), (1, 0, 0)),  # nearby pairs are unrelated
        ((0, 0, 1), (0, 1, 0)),
        ((0, 0, 0), (0, 0, 1)),
    ],
)
def test_request_generator_streams_differ(a, b):
    assert draws(*a) != draws(*b)


def test_request_generator_fresh_per_call():
    """A retried round gets the same numbers: the generator does not carry state across calls."""
    g1 = request_generator(3, 4, 0)
    torch.rand(100, generator=g1)  # consume some
    assert draws(3, 4, 0) == draws(3, 4, 0)


def test_request_generator_draws_look_uniform():
    values = torch.tensor([draws(seed, 0, 0, n=1)[0] for seed in range(2000)])
    assert 0.45 < float(values.mean()) < 0.55
    assert len(set(values.tolist())) == 2000


@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_tiny_positive_temperature_gives_a_finite_distribution(temperature):
    """validate() accepts any temperature > 0; logits / T must not overflow into NaN (which makes
    torch.multinomial raise mid-generation). The limit T -> 0+ is the argmax."""
    logits = torch.tensor([[10.0, 20.0, -3.0], [1.0, -2.0, 0.5]])
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all()
    close(probs, [[0, 1, 0], [1, 0, 0]])
