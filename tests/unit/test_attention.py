"""The grouped SDPA attention (specpool/target/attention.py): the same numbers as transformers' SDPA
with ``repeat_kv``, without copying the keys, and only where it applies."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specpool.target.attention import GROUPED_SDPA, grouped_sdpa_attention, runs_sdpa, use_grouped_sdpa
from specpool.target.kv_cache import PrefixCache
from specpool.target.models import ModelConfig, load_causal_lm
from specpool.target.tree import ROOT


class Grouped(torch.nn.Module):
    """What the attention functions read off a layer."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def offset_causal_mask(queries: int, context: int) -> torch.Tensor:
    """(1, 1, T, context + T): position j of the fed ones sees the context and the fed ones up to j."""
    return torch.ones(queries, context + queries, dtype=torch.bool).tril(context)[None, None]


@pytest.mark.parametrize("queries,context,groups", [(2, 7, 3), (8, 40, 3), (16, 130, 2), (5, 0, 4)])
def test_grouped_attention_equals_sdpa_with_repeated_keys(queries, context, groups):
    torch.manual_seed(queries + context)
    kv_heads, dim = 3, 64
    query = torch.randn(1, kv_heads * groups, queries, dim)
    key, value = torch.randn(2, 1, kv_heads, context + queries, dim)
    mask = offset_causal_mask(queries, context)
    module = Grouped(groups)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=dim ** -0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    assert got.shape == want.shape == (1, queries, kv_heads * groups, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_masked_grouped_cpu_call_does_not_repeat_the_keys(monkeypatch):
    """The point of it: transformers' path copies the keys (``repeat_kv``); this one must not."""
    calls = []
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or x.repeat_interleave(n, dim=1))
    query, key, value = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    mask = offset_causal_mask(4, 5)
    grouped_sdpa_attention(Grouped(3), query, key, value, mask)
    assert calls == []
    sdpa_attention_forward(Grouped(3), query, key, value, mask)
    assert calls == [3, 3]  # the copy it saves: keys and values


def test_calls_it_does_not_change_go_to_transformers_sdpa(monkeypatch):
    """No mask, no groups, dropout or a position bias: transformers' own SDPA, unchanged."""
    seen = []
    monkeypatch.setattr("specpool.target.attention.sdpa_attention_forward",
                        lambda *args, **kwargs: seen.append(kwargs) or (None, None))
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    grouped_sdpa_attention(Grouped(2), q, k, k, None)  # a prefill: causal, no mask
    grouped_sdpa_attention(Grouped(1), q, q, q, offset_causal_mask(3, 0))  # no grouped heads
    grouped_sdpa_attention(Grouped(2), q, k, k, offset_causal_mask(3, 0), dropout=0.1)
    grouped_sdpa_attention(Grouped(2), q, k, k, offset_causal_mask(3, 0), position_bias=torch.zeros(1, 4, 3, 3))
    assert len(seen) == 4


def test_models_loaded_for_sdpa_run_the_grouped_implementation(model_dirs, home):
    model, _ = load_causal_lm(ModelConfig(str(model_dirs.target)), home)
    assert model.config._attn_implementation == GROUPED_SDPA and runs_sdpa(model)
    eager, _ = load_causal_lm(ModelConfig(str(model_dirs.target)), home, attn_implementation="eager")
    use_grouped_sdpa(eager)
    assert eager.config._attn_implementation == "eager" and not runs_sdpa(eager)


def test_verify_and_tree_forwards_match_plain_sdpa(model_dirs, home, monkeypatch):
    """The tiny target has grouped heads (4 query, 2 key): a verify forward after a cached context
    and a draft tree's forward give the logits transformers' SDPA gives, without its key copies."""
    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or repeat_kv(x, n))
    grouped, _ = load_causal_lm(ModelConfig(str(model_dirs.target)), home)
    plain, _ = load_causal_lm(ModelConfig(str(model_dirs.target)), home)
    plain.config._attn_implementation = "sdpa"
    context, drafts = [1, 5, 9, 11, 4, 17, 23, 8, 30], [12, 6, 40, 3, 19]
    a, b = PrefixCache(grouped), PrefixCache(plain)
    for cache in (a, b):
        cache.logits(context, 1)
    parents = [ROOT, 0, 0, 1, 2]

    def forwards(cache: PrefixCache) -> tuple[torch.Tensor, torch.Tensor]:
        chain = cache.logits(context + drafts, 6, pad_to=8)
        tree = cache.tree_logits_and_hidden(context + [7], drafts, parents)[0]
        return chain, tree

    copies.clear()
    got = forwards(a)
    assert copies == []  # both forwards had masks: the grouped path served every layer
    want = forwards(b)
    assert len(copies) == 2 * 2 * 2  # two forwards, two layers, keys and values
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_the_grouped_attention_benchmark_pairs_the_same_verifications(model_dirs, home, prompts):
    """bench/grouped_attention.py's measurement on the tiny target: every draft count timed for both
    systems, the same outcomes (its report's mismatch count), and a report that renders."""
    from bench.common import machine_info, summary
    from bench.cpu_linear import target_only_decoding
    from bench.grouped_attention import DRAFT_COUNTS, render
    from bench.verify_width import alternate_verifications
    from specpool.target.verifier import TargetVerifier

    verifiers = {}
    for system in ("G", "S"):
        model, tokenizer = load_causal_lm(ModelConfig(str(model_dirs.target)), home)
        if system == "S":
            model.config._attn_implementation = "sdpa"
        verifiers[system] = TargetVerifier(model, tokenizer)
    per_draft_count, mismatches = alternate_verifications(verifiers, prompts[:3], 2, "test", DRAFT_COUNTS)
    assert len(per_draft_count) == len(DRAFT_COUNTS) and mismatches == 0
    assert all(len(times["G"]) == len(times["S"]) == 2 for times in per_draft_count)
    decode = target_only_decoding(verifiers, prompts[:3], 6)
    assert decode["identical"] == 3
    rows = [{"drafts": d, "width": d + 1, "G": summary(t["G"]), "S": summary(t["S"]),
             "ratio": summary([g / s for g, s in zip(t["G"], t["S"])])} for d, t in zip(DRAFT_COUNTS, per_draft_count)]
    text = render({"target": "tiny", "machine": machine_info("cpu"), "reps": 2, "prompts": 3, "context_tokens": [2, 9],
                   "rows": rows, "mismatches": mismatches, "decode": decode})
    assert "| 15 | 16 |" in text and "differed in 0 verification(s)" in text
