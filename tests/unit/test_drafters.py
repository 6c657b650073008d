"""Drafters: the registry and its specs, n-gram lookup, the HF model drafter, the cost meter."""

from __future__ import annotations

import pytest
import torch

from specpool.drafters.base import CostMeter, Drafter, Proposal
from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.drafters.registry import DrafterContext, create_drafter, drafter_kinds
from specpool.core.errors import InvalidArgument, ModelUnavailable, NotFound
from specpool.target.models import tokenizer_fingerprint
from specpool.target.sampling import SamplingParams

GREEDY = SamplingParams()


@pytest.fixture
def context(home) -> DrafterContext:
    return DrafterContext(home)


# -- registry -------------------------------------------------------------------------------------


def test_builtin_kinds():
    assert {"hf", "ngram"} <= set(drafter_kinds())
    assert drafter_kinds() == sorted(drafter_kinds())


@pytest.mark.parametrize(
    "spec, min_ngram, max_ngram",
    [
        ("ngram", 2, 4),
        ("ngram:3", 2, 3),
        ("ngram:5", 2, 5),
        ("ngram:2", 2, 2),
        ("ngram:1-4", 1, 4),
        ("ngram:3-3", 3, 3),
        ("ngram:2-6", 2, 6),
    ],
)
def test_create_ngram(spec, min_ngram, max_ngram, context):
    drafter = create_drafter(spec, context)
    assert isinstance(drafter, NGramDrafter)
    assert isinstance(drafter, Drafter)
    assert drafter.name == spec
    assert (drafter.min_ngram, drafter.max_ngram) == (min_ngram, max_ngram)
    assert drafter.tokenizer_fingerprint is None


@pytest.mark.parametrize(
    "spec",
    ["ngram:x", "ngram:0-2", "ngram:3-2", "ngram:-3", "ngram:a-b", "ngram:2-x", "ngram:0", "ngram:1.5", "ngram:1-4-5"],
)
def test_bad_ngram_specs(spec, context):
    with pytest.raises(InvalidArgument, match="n-gram drafter spec"):
        create_drafter(spec, context)


@pytest.mark.parametrize("spec", ["bogus", "bogus:3", "NGRAM", "", "medusa:x"])
def test_unknown_kind(spec, context):
    with pytest.raises(NotFound, match="unknown drafter") as info:
        create_drafter(spec, context)
    assert "ngram" in str(info.value) and "hf" in str(info.value)


def test_hf_spec_needs_a_model(context):
    with pytest.raises(InvalidArgument, match="hf:PATH_OR_HUB_ID"):
        create_drafter("hf", context)


def test_hf_spec_loads_a_folder(model_dirs, target_lm, context):
    spec = f"hf:{model_dirs.noisy}"
    drafter = create_drafter(spec, context)
    assert isinstance(drafter, HFModelDrafter)
    assert isinstance(drafter, Drafter)
    assert drafter.name == spec
    assert drafter.tokenizer_fingerprint == tokenizer_fingerprint(target_lm[1])
    other = create_drafter(f"hf:{model_dirs.other}", context)
    assert other.tokenizer_fingerprint != drafter.tokenizer_fingerprint


def test_hf_spec_missing_folder(tmp_path, context):
    empty = tmp_path / "no-config"
    empty.mkdir()
    with pytest.raises(ModelUnavailable, match="no config.json"):
        create_drafter(f"hf:{empty}", context)
    with pytest.raises(ModelUnavailable):
        create_drafter(f"hf:{tmp_path / 'missing' / 'model'}", context)


# -- n-gram lookup --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "context_ids, k, min_ngram, max_ngram, expected",
    [
        ([1, 2, 3, 4, 1, 2], 3, 2, 4, [3, 4, 1]),
        # Longest match wins: the 3-gram [7, 1, 2] matched at 0 beats the more recent 2-gram [1, 2].
        ([7, 1, 2, 5, 9, 1, 2, 6, 7, 1, 2], 3, 2, 4, [5, 9, 1]),
        # ... unless longer n-grams are not tried.
        ([7, 1, 2, 5, 9, 1, 2, 6, 7, 1, 2], 3, 2, 2, [6, 7, 1]),
        # Most recent occurrence of the same n-gram.
        ([1, 2, 3, 1, 2, 4, 1, 2], 3, 2, 4, [4, 1, 2]),
        # No match: nothing proposed.
        ([1, 2, 3, 4, 5], 4, 2, 4, []),
        ([5, 3, 9, 3], 4, 2, 4, []),
        # 1-gram matches only when allowed.
        ([5, 3, 9, 3], 4, 1, 4, [9, 3]),
        # k caps the length; the context end caps it too.
        ([1, 2, 3, 4, 5, 6, 1, 2], 2, 2, 4, [3, 4]),
        ([1, 2, 3, 4, 5, 6, 1, 2], 1, 2, 4, [3]),
        ([1, 2, 3, 4, 5, 6, 1, 2], 10, 2, 4, [3, 4, 5, 6, 1, 2]),
        # Overlapping self-match in a run of one token.
        ([8, 8, 8, 8], 3, 2, 4, [8]),
        ([4, 8, 8, 8, 8, 8], 2, 2, 4, [8]),
        ([8, 8, 8, 8, 3], 2, 2, 4, []),
        # Too short to match anything.
        ([], 3, 1, 4, []),
        ([1], 3, 1, 4, []),
        ([1, 1], 3, 1, 4, [1]),
        ([1, 1], 3, 2, 4, []),
    ],
)
def test_ngram_lookup_table(context_ids, k, min_ngram, max_ngram, expected):
    drafter = NGramDrafter("ngram", max_ngram=max_ngram, min_ngram=min_ngram)
    assert drafter.lookup(context_ids, k) == expected


def test_ngram_propose_returns_one_hot_q_and_records_cost():
    drafter = NGramDrafter()
    proposal = drafter.propose("s", [1, 2, 3, 4, 1, 2], 3, GREEDY)
    assert isinstance(proposal, Proposal)
    assert proposal.tokens == [3, 4, 1]
    assert [q.token_ids.tolist() for q in proposal.q] == [[3], [4], [1]]
    assert all(q.probs.tolist() == [1.0] for q in proposal.q)
    assert drafter.cost.calls == 1
    empty = drafter.propose("s", [1, 2, 3], 3, GREEDY)
    assert empty.tokens == [] and empty.q == []
    assert drafter.cost.calls == 2  # a miss is still a (cheap) call
    drafter.release("s")


# -- CostMeter ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alpha, records, seconds_per_token, calls",
    [
        (0.1, [], 0.0, 0),
        (0.1, [(0.2, 2)], 0.1, 1),
        (0.1, [(0.2, 2), (0.4, 1)], 0.1 + 0.1 * (0.4 - 0.1), 2),
        (0.5, [(1.0, 1), (0.0, 4)], 0.5, 2),
        (0.1, [(0.3, 0), (0.5, -1)], 0.0, 0),  # no tokens: nothing recorded
        (0.1, [(0.3, 0), (0.6, 3)], 0.2, 1),  # the first real sample initialises the average
        (1.0, [(1.0, 1), (3.0, 1)], 3.0, 2),
    ],
)
def test_cost_meter(alpha, records, seconds_per_token, calls):
    meter = CostMeter(alpha=alpha)
    for seconds, tokens in records:
        meter.record(seconds, tokens)
    assert meter.seconds_per_token == pytest.approx(seconds_per_token)
    assert meter.calls == calls


# -- HF model drafter -----------------------------------------------------------------------------


def test_hf_drafter_rejects_bad_top_k(noisy_lm):
    with pytest.raises(InvalidArgument, match="top-k"):
        HFModelDrafter("x", *noisy_lm, top_k=0)


def test_hf_drafter_greedy_proposal_is_its_own_greedy_continuation(noisy_lm, greedy_reference):
    model, tokenizer = noisy_lm
    drafter = HFModelDrafter("noisy", model, tokenizer)
    context = [1, 5, 6, 7, 5, 6]
    for k in (1, 4, 8):
        proposal = drafter.propose("s", context, k, GREEDY)
        assert proposal.tokens == greedy_reference(model, context, k)
        assert [q.token_ids.tolist() for q in proposal.q] == [[t] for t in proposal.tokens]
        assert proposal.forward_s > 0
    assert drafter.cost.calls == 3
    assert drafter.cost.seconds_per_token > 0
    drafter.release("s")
    assert len(drafter.caches) == 0


def test_hf_drafter_sampled_q_is_the_top_k_renormalised(noisy_lm):
    model, tokenizer = noisy_lm
    drafter = HFModelDrafter("noisy", model, tokenizer, top_k=5)
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7)
    q = drafter.proposal_dist(logits, params)
    values, ids = torch.topk(logits / 0.7, 5)
    assert q.token_ids.tolist() == ids.tolist()
    torch.testing.assert_close(q.probs, torch.softmax(values, dim=-1))
    assert float(q.probs.sum()) == pytest.approx(1.0)
    wide = HFModelDrafter("noisy", model, tokenizer, top_k=1000).proposal_dist(logits, params)
    assert len(wide.token_ids) == 64


def test_drafter_and_target_draw_from_separate_streams():
    """Drafts and acceptance uniforms must be independent, so the per-round generators of the
    drafter and the target must differ for the same (seed, position)."""
    from specpool.drafters.hf_model import DRAFTER_STREAM
    from specpool.target.verifier import TARGET_STREAM

    assert DRAFTER_STREAM != TARGET_STREAM


def test_hf_drafter_sampled_proposals(noisy_lm):
    model, tokenizer = noisy_lm
    drafter = HFModelDrafter("noisy", model, tokenizer, top_k=8)
    context = [1, 9, 10, 11]
    outs = []
    for seed in (0, 0, 1, 2, 3):
        proposal = drafter.propose(f"s{seed}", context, 6, SamplingParams(temperature=1.0, seed=seed))
        assert len(proposal.tokens) == len(proposal.q) == 6
        for token, q in zip(proposal.tokens, proposal.q):
            assert token in q.token_ids.tolist()  # x_i was drawn from q_i's support
            assert len(q.token_ids) == 8
        outs.append(proposal.tokens)
    assert outs[0] == outs[1]  # same seed, same draft
    assert len({tuple(o) for o in outs}) >= 3
