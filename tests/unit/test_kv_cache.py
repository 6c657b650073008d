"""KV caches (specpool/target/kv_cache.py): prefix reuse gives the same logits as a fresh forward, and the
rollback after a verify leaves no trace of rejected draft tokens."""

from __future__ import annotations

import random

import pytest
import torch

from specpool.drafters.hf_model import HFModelDrafter
from specpool.target.kv_cache import PrefixCache, SessionCaches, common_prefix_length
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.core.errors import InvalidArgument
from specpool.target.verifier import CPU_FORWARD_WIDTHS, PACKED_CPU_FORWARD_WIDTHS, TargetVerifier, VerifyRequest, forward_width

ATOL = 1e-5


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([], [], 0),
        ([1], [], 0),
        ([], [1, 2], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4], 3),
        ([1, 2, 3, 4], [1, 2], 2),
        ([1, 2, 3], [4, 2, 3], 0),
        ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 2),
        ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], 4),
        ([7] * 10, [7] * 9 + [8], 9),
        ([0, 0, 0], [0, 0, 1, 1, 1], 2),
    ],
)
def test_common_prefix_length_table(a, b, expected):
    assert common_prefix_length(a, b) == expected
    assert common_prefix_length(b, a) == expected


def test_common_prefix_length_every_mismatch_position():
    rng = random.Random(0)
    for n in (1, 2, 3, 16, 17, 100):
        a = [rng.randrange(5) for _ in range(n)]
        for m in range(n):
            b = list(a)
            b[m] += 1
            assert common_prefix_length(a, b) == m
            assert common_prefix_length(a, b + [1, 2]) == m
            assert common_prefix_length(a[: m + 1] + [9], b) == m


# -- PrefixCache -----------------------------------------------------------------------------------


@torch.inference_mode()
def fresh_logits(model, ids: list[int], n_last: int) -> torch.Tensor:
    """Reference: one forward over the whole sequence, no cache."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -n_last:]


def cached_length(cache: PrefixCache) -> int:
    return 0 if cache.cache is None else int(cache.cache.get_seq_length())


def test_prefix_cache_logits_match_fresh_forward_across_edits(target_lm):
    model, _ = target_lm
    cache = PrefixCache(model)
    base = [1, 5, 9, 12, 7, 30, 41]
    sequence_of_inputs = [
        (base, 1),
        (base + [3, 4], 2),  # extends: reuses the prefix
        (base + [3, 4, 8, 8, 8], 4),
        (base + [3, 6, 6], 3),  # branches after base + [3]
        (base[:4], 1),  # shorter than the cache
        ([1, 60, 61], 2),  # shares only the first token
        ([2, 5, 9], 1),  # shares nothing
        ([2, 5, 9], 3),  # same ids, more positions wanted: must re-feed them
    ]
    for ids, n_last in sequence_of_inputs:
        got = cache.logits(ids, n_last)
        assert got.shape == (n_last, model.config.vocab_size)
        torch.testing.assert_close(got, fresh_logits(model, ids, n_last), atol=ATOL, rtol=1e-4)
        assert cache.token_ids == ids
        assert cached_length(cache) == len(ids)


@pytest.mark.parametrize("length", [0, 1, 5, 9, 10, 15])
def test_prefix_cache_truncate(target_lm, length):
    model, _ = target_lm
    cache = PrefixCache(model)
    ids = list(range(3, 13))  # 10 tokens
    cache.logits(ids, 1)
    cache.truncate(length)
    kept = min(length, len(ids))
    assert cache.token_ids == ids[:kept]
    assert cached_length(cache) == kept
    # Whatever was kept still gives the right logits when extended.
    tail = [20, 21]
    torch.testing.assert_close(cache.logits(ids[:kept] + tail, 2), fresh_logits(model, ids[:kept] + tail, 2), atol=ATOL, rtol=1e-4)


def test_truncate_on_empty_cache_is_a_no_op(target_lm):
    cache = PrefixCache(target_lm[0])
    cache.truncate(0)
    cache.truncate(3)
    assert cache.token_ids == [] and cache.cache is None


# -- rollback through the verifier -------------------------------------------------------------------


def test_rejected_drafts_leave_no_trace_greedy(verifier, target_lm, greedy_reference):
    model, _ = target_lm
    context = [1, 4, 8, 15, 16, 23, 42]
    t = greedy_reference(model, context, 6)
    wrong = (t[2] + 1) % model.config.vocab_size
    drafts = [t[0], t[1], wrong, t[3], t[4]]  # the third draft is rejected
    params = SamplingParams(max_new_tokens=10)
    result = verifier.verify(VerifyRequest("s", context, drafts, [SparseDist.one_hot(x) for x in drafts], params))
    assert result.accepted == 2
    assert result.tokens == t[:3]

    cache = verifier.caches.get("s")
    assert cache.token_ids == context + t[:2]
    assert cached_length(cache) == len(context) + 2
    # The next round's logits (over the emitted token and some new drafts) equal a fresh cache's.
    nxt = context + t[:3] + [9, 10, 11]
    fresh = PrefixCache(model)
    torch.testing.assert_close(cache.logits(nxt, 4), fresh.logits(nxt, 4), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(cache.logits(nxt, 4), fresh_logits(model, nxt, 4), atol=ATOL, rtol=1e-4)


def test_rejected_drafts_leave_no_trace_over_sampled_rounds(verifier, target_lm, random_lm):
    """Many sampled rounds with a mostly-rejected drafter; before every round the verifier's cache
    holds exactly context + accepted tokens, and its logits equal a fresh forward's."""
    model, _ = target_lm
    drafter = HFModelDrafter("random", random_lm[0], random_lm[1])
    params = SamplingParams(temperature=1.0, seed=11, max_new_tokens=40)
    context = [1, 3, 3, 7, 12, 19]
    rejections = 0
    for _ in range(12):
        proposal = drafter.propose("s", context, 4, params)
        result = verifier.verify(VerifyRequest("s", context, proposal.tokens, proposal.q, params))
        rejections += result.accepted < len(proposal.tokens)
        cache = verifier.caches.get("s")
        assert cache.token_ids == context + proposal.tokens[: result.accepted]
        assert cached_length(cache) == len(cache.token_ids)
        context = context + result.tokens
        probe = context + [5, 6]
        snapshot = PrefixCache(model)
        expected = snapshot.logits(probe, 3)
        # Probe through the verifier's own cache, then crop the probe off again so the next round
        # starts from exactly the state the verifier left (context + accepted).
        got = cache.logits(probe, 3)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)
        cache.truncate(len(context) - 1)
    assert rejections >= 6, "the random drafter should be rejected in most rounds"


# -- SessionCaches -------------------------------------------------------------------------------------


def test_session_caches_lru(target_lm):
    caches = SessionCaches(target_lm[0], capacity=2)
    a = caches.get("a")
    a.token_ids.append(1)  # mark it
    caches.get("b")
    assert caches.get("a") is a  # refreshes "a": now "b" is the oldest
    caches.get("c")
    assert len(caches) == 2
    assert caches.get("a") is a
    b = caches.get("b")  # "b" was evicted: a new, empty cache
    assert b.token_ids == []
    assert len(caches) == 2
    caches.release("b")
    caches.release("unknown")
    assert len(caches) == 1


# -- padded forwards (specpool.target.verifier.forward_width) -------------------------------------------------


@pytest.mark.parametrize("fed, widths, expected", [
    (0, (4, 5, 8), 0),
    (1, (4, 5, 8), 1),  # a decode step is never padded
    (2, (4, 5, 8), 4),
    (3, (4, 5, 8), 4),
    (4, (4, 5, 8), 4),
    (5, (4, 5, 8), 5),
    (6, (4, 5, 8), 8),
    (7, (4, 5, 8), 8),
    (9, (4, 5, 8), 9),  # wider than every listed width: as is
    (300, (4, 5, 8), 300),  # a prefill
    (3, (), 3),  # no widths (a GPU): no padding
])
def test_forward_width_table(fed, widths, expected):
    assert forward_width(fed, widths) == expected


@pytest.mark.parametrize("pad_to", [4, 8])
def test_padded_logits_equal_unpadded_and_leave_no_pads_cached(target_lm, pad_to):
    model, _ = target_lm
    padded, plain = PrefixCache(model), PrefixCache(model)
    context = [1, 5, 9, 12, 7, 30, 41]
    for cache in (padded, plain):
        cache.logits(context, 1)
    for step in ([3, 4], [3, 4, 8], [3, 6]):  # extend, extend, branch
        ids = context + step
        got = padded.logits(ids, len(step) + 1, pad_to=pad_to)
        assert got.shape == (len(step) + 1, model.config.vocab_size)
        torch.testing.assert_close(got, plain.logits(ids, len(step) + 1), atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(got, fresh_logits(model, ids, len(step) + 1), atol=ATOL, rtol=1e-4)
        assert padded.token_ids == ids
        assert cached_length(padded) == len(ids)  # the pads' keys/values are gone


def test_verifier_pads_small_forwards_on_the_cpu_and_gives_the_same_outcome(target_lm, greedy_reference, monkeypatch):
    model, tokenizer = target_lm
    fed_widths: list[int] = []
    original = PrefixCache.logits_and_features

    def recording(self, input_ids, n_last, pad_to=0, features=False):  # observes the forward widths asked for
        fed_widths.append(max(pad_to, len(input_ids) - self.reusable(input_ids, n_last)))
        return original(self, input_ids, n_last, pad_to, features)

    context = [1, 4, 8, 15, 16, 23, 42]
    t = greedy_reference(model, context, 12)
    outcomes = {}
    # The CPU default (packed linears: only 3 positions pad, to 4), plain linears' widths, no padding.
    for widths in (None, CPU_FORWARD_WIDTHS, ()):
        verifier = TargetVerifier(model, tokenizer, forward_widths=widths)
        monkeypatch.setattr(PrefixCache, "logits_and_features", recording)
        fed_widths.clear()
        results = []
        ctx = list(context)
        for drafts in ([t[0], t[1]], [t[2] + 1], [t[4], t[5]], [t[7], t[8], t[9], t[10], t[11]]):
            drafts = [x % model.config.vocab_size for x in drafts]
            result = verifier.verify(VerifyRequest("s", ctx, drafts, [SparseDist.one_hot(x) for x in drafts], SamplingParams(max_new_tokens=20)))
            results.append((result.accepted, result.tokens))
            ctx = ctx + result.tokens
            assert verifier.caches.get("s").token_ids == ctx[:-1]
            assert cached_length(verifier.caches.get("s")) == len(ctx) - 1
        monkeypatch.setattr(PrefixCache, "logits_and_features", original)
        outcomes[widths] = (results, list(fed_widths))
    assert outcomes[None][0] == outcomes[CPU_FORWARD_WIDTHS][0] == outcomes[()][0]
    assert TargetVerifier(model, tokenizer).forward_widths == PACKED_CPU_FORWARD_WIDTHS
    assert [accepted for accepted, _ in outcomes[()][0]] == [2, 0, 2, 5]  # the rounds are what they seem
    assert outcomes[None][1] == [len(context) + 2, 2, 4, 6]  # prefill as is; 3 positions -> 4, 2 and 6 as is
    assert outcomes[CPU_FORWARD_WIDTHS][1] == [len(context) + 2, 4, 4, 8]  # 2 and 3 positions -> 4; 6 -> 8
    assert outcomes[()][1] == [len(context) + 2, 2, 3, 6]


def test_verifier_does_not_pad_past_the_context_window(target_lm, monkeypatch):
    model, tokenizer = target_lm
    context, drafts = [1, 4, 8, 15, 16, 23, 42], [5]  # 2 positions: padded to 4 with plain linears' widths
    pads_asked: list[int] = []
    original = PrefixCache.logits_and_features

    def recording(self, input_ids, n_last, pad_to=0, features=False):
        pads_asked.append(pad_to)
        return original(self, input_ids, n_last, pad_to, features)

    monkeypatch.setattr(PrefixCache, "logits_and_features", recording)
    for window, expected_pad_to in ((None, 4), (len(context) + len(drafts) + 1, 2)):
        verifier = TargetVerifier(model, tokenizer, forward_widths=CPU_FORWARD_WIDTHS)
        verifier.verify(VerifyRequest("s", context, [], [], SamplingParams(max_new_tokens=4)))
        if window is not None:
            verifier.context_window = window  # room for the round, none for pads
        pads_asked.clear()
        result = verifier.verify(VerifyRequest("s", context, drafts, [SparseDist.one_hot(x) for x in drafts],
                                               SamplingParams(max_new_tokens=4)))
        assert pads_asked == [expected_pad_to]
        assert cached_length(verifier.caches.get("s")) == len(context) + result.accepted


def test_verifier_rejects_bad_forward_widths(target_lm):
    model, tokenizer = target_lm
    with pytest.raises(InvalidArgument, match="forward widths"):
        TargetVerifier(model, tokenizer, forward_widths=(0, 4))
