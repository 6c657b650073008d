"""The target's features (specpool/target/features.py): the per-session FeatureLog (replace from
start, gaps, truncation, growth), the wire encoding, and what verification returns: the rows of
exactly the positions the target's cache holds past the prefix it reused, equal to the model's
own final hidden states (after the last norm: the LM head applied to them gives the logits),
through rollbacks, cache misses, padded forwards and batched verification."""

from __future__ import annotations

import random

import pytest
import torch

from specpool.core.errors import FailedPrecondition, InvalidArgument
from specpool.target.features import FeatureGap, FeatureLog, Features, decode_features, encode_features
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest, VerifyResult

ATOL = 1e-5
GREEDY = SamplingParams(temperature=0.0)


def rows(start: int, n: int, width: int = 4, offset: float = 0.0) -> Features:
    """Features whose row for position t is filled with t + offset (easy to read back)."""
    values = torch.arange(start, start + n, dtype=torch.float32)[:, None] + offset  # (n, 1)
    return Features(start, values.expand(n, width).clone())  # (n, d)


def positions(log: FeatureLog, start: int = 0) -> list[float]:
    """The first column of the log from ``start`` on: which rows it holds."""
    return log.rows(start)[:, 0].tolist()


# -- FeatureLog -----------------------------------------------------------------------------------------


def test_feature_log_apply_extends_and_replaces_from_start():
    log = FeatureLog(4)
    assert len(log) == 0
    log.apply(rows(0, 5))
    assert len(log) == 5 and positions(log) == [0, 1, 2, 3, 4]
    log.apply(rows(5, 2))  # extends
    assert positions(log) == [0, 1, 2, 3, 4, 5, 6]
    # A rollback: rows from 3 on are replaced, and the log ends where the new rows end (rows 5, 6
    # of the old log are gone even though the new features are shorter).
    log.apply(rows(3, 2, offset=100))
    assert len(log) == 5 and positions(log) == [0, 1, 2, 103, 104]
    log.apply(rows(0, 1, offset=50))  # a re-prefill from the start: one row left
    assert positions(log) == [50]
    log.apply(Features(1, torch.zeros(0, 4)))  # no rows: nothing changes but the length
    assert len(log) == 1


def test_feature_log_gap_says_where_to_resend_from():
    log = FeatureLog(4)
    log.apply(rows(0, 3))
    with pytest.raises(FeatureGap) as caught:
        log.apply(rows(5, 2))
    assert caught.value.needed == 3
    assert isinstance(caught.value, FailedPrecondition) and caught.value.code == "FAILED_PRECONDITION"
    assert "resend from 3" in str(caught.value) and "\n" not in str(caught.value)
    assert positions(log) == [0, 1, 2]  # the failed apply changed nothing
    log.apply(rows(3, 4))  # the resend
    assert positions(log) == [0, 1, 2, 3, 4, 5, 6]


def test_feature_log_refuses_rows_of_another_width():
    log = FeatureLog(4)
    with pytest.raises(InvalidArgument, match="width"):
        log.apply(Features(0, torch.zeros(2, 5)))
    with pytest.raises(InvalidArgument, match="width"):
        log.apply(Features(0, torch.zeros(4)))  # not 2-D
    assert len(log) == 0


def test_feature_log_truncate_rows_and_since():
    log = FeatureLog(4)
    log.apply(rows(0, 6))
    log.truncate(4)
    assert positions(log) == [0, 1, 2, 3]
    log.truncate(10)  # never grows
    assert len(log) == 4
    log.truncate(-3)
    assert len(log) == 0
    log.apply(rows(0, 6))
    assert log.rows(2, 4)[:, 0].tolist() == [2, 3]
    assert log.rows(2, 99)[:, 0].tolist() == [2, 3, 4, 5]  # end capped by the length
    since = log.since(4)
    assert since.start == 4 and since.end == 6 and since.rows[:, 0].tolist() == [4, 5]
    part = rows(10, 5).since(12)
    assert part.start == 12 and part.rows[:, 0].tolist() == [12, 13, 14]


def test_feature_log_grows_and_keeps_its_rows():
    log = FeatureLog(3, dtype=torch.float16)
    total = 0
    for n in (1, 63, 1, 70, 200, 5):  # past the first 64 rows, then past doublings
        log.apply(rows(total, n, width=3))
        total += n
    assert len(log) == total == 340
    assert log.rows(0).dtype == torch.float16
    assert positions(log) == [float(torch.tensor(t, dtype=torch.float16)) for t in range(total)]
    log.apply(rows(10, 1000, width=3, offset=0.5))  # replaces the tail and grows at once
    assert len(log) == 1010
    assert positions(log, 8)[:3] == [8.0, 9.0, 10.5]


# -- wire format ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_encode_decode_round_trip(dtype, torch_dtype):
    values = torch.randn(7, 12, generator=torch.Generator().manual_seed(0)) * 3  # (7, 12)
    data = encode_features(Features(5, values), dtype)
    assert isinstance(data, bytes) and len(data) == 7 * 12 * 2
    back = decode_features(5, 12, data, dtype)
    assert back.start == 5 and back.rows.dtype == torch.float32 and back.rows.shape == (7, 12)
    # Exactly the value rounded to the wire dtype (no other loss, right byte order).
    assert torch.equal(back.rows, values.to(torch_dtype).float())
    other = "bfloat16" if dtype == "float16" else "float16"
    assert not torch.equal(decode_features(5, 12, data, other).rows, back.rows)  # the dtype matters
    empty = decode_features(3, 12, encode_features(Features(3, torch.zeros(0, 12)), dtype), dtype)
    assert empty.start == 3 and empty.rows.shape == (0, 12)


def test_encode_decode_errors():
    features = Features(0, torch.zeros(2, 4))
    with pytest.raises(InvalidArgument, match="float16, bfloat16"):
        encode_features(features, "float32")
    data = encode_features(features)
    with pytest.raises(InvalidArgument, match="float16, bfloat16"):
        decode_features(0, 4, data, "int8")
    with pytest.raises(InvalidArgument, match="not whole rows of width 3"):
        decode_features(0, 3, data)  # 16 bytes are 2.67 rows of 3
    with pytest.raises(InvalidArgument, match="not whole rows"):
        decode_features(0, 4, data[:-2])
    with pytest.raises(InvalidArgument, match="not whole rows"):
        decode_features(0, 0, data)
    with pytest.raises(InvalidArgument, match="start"):
        decode_features(-1, 4, data)


# -- verification returns the features ------------------------------------------------------------------


@torch.inference_mode()
def final_hidden(model, ids: list[int]) -> torch.Tensor:
    """Reference: the model's own last hidden states over the whole sequence, no cache (L, d)."""
    return model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states[-1][0]


@torch.inference_mode()
def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(model(input_ids=torch.tensor([out]), use_cache=False).logits[0, -1].argmax()))
    return out[len(ids):]


def verify(verifier: TargetVerifier, session: str, context: list[int], drafts: list[int],
           features: bool = True, params: SamplingParams = GREEDY) -> VerifyResult:
    q = [SparseDist.one_hot(t) for t in drafts]
    return verifier.verify(VerifyRequest(session, list(context), list(drafts), q, params, return_features=features))


def assert_features_of(model, result: VerifyResult, context: list[int], start: int) -> None:
    """``result.features`` are the rows start .. len(context)+accepted-1 of the model's own."""
    kept = context + result.tokens[: result.accepted]
    assert result.features is not None
    assert result.features.start == start
    assert result.features.end == len(kept), "rows past the accepted tokens (a rejected draft's, a pad's)"
    torch.testing.assert_close(result.features.rows, final_hidden(model, kept)[start:], atol=ATOL, rtol=1e-4)


def test_features_are_the_final_hidden_states_after_the_last_norm(target_lm):
    """What the LM head reads: head(features) gives the logits (a pre-norm state would not)."""
    model, _ = target_lm
    ids = [1, 5, 9, 12, 5, 9, 30]
    hidden = final_hidden(model, ids)
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]  # (L, V)
    torch.testing.assert_close(model.lm_head(hidden), logits, atol=ATOL, rtol=1e-4)


def test_verify_features_across_rounds_rollback_and_a_cache_miss(target_lm):
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer, forward_widths=())
    log = FeatureLog(verifier.feature_width)
    assert verifier.feature_width == model.config.hidden_size == 32
    prompt = [1, 5, 9, 12, 5, 9, 30, 17]

    first = verify(verifier, "s", prompt, [])  # prefill: the whole context is fed
    assert_features_of(model, first, prompt, start=0)
    log.apply(first.features)
    context = prompt + first.tokens

    # Two right drafts, then a wrong one: rows for the last context token and the accepted two.
    right = greedy_tokens(model, context, 3)
    wrong = (right[2] + 1) % model.config.vocab_size
    second = verify(verifier, "s", context, right[:2] + [wrong])
    assert second.accepted == 2
    assert_features_of(model, second, context, start=len(context) - 1)
    log.apply(second.features)
    context = context + second.tokens

    # All wrong: only the last context token's row.
    miss = (greedy_tokens(model, context, 1)[0] + 1) % model.config.vocab_size
    third = verify(verifier, "s", context, [miss, miss])
    assert third.accepted == 0
    assert_features_of(model, third, context, start=len(context) - 1)
    log.apply(third.features)
    context = context + third.tokens

    # The log assembled from the rounds is the whole context's (but the last token's, which the
    # target has not seen yet): no rejected draft's row survived.
    assert len(log) == len(context) - 1
    torch.testing.assert_close(log.rows(0), final_hidden(model, context)[:-1], atol=ATOL, rtol=1e-4)

    # Another request of the session on a different context: re-fed from the common prefix.
    other = context[:4] + [40, 41, 42]
    fourth = verify(verifier, "s", other, greedy_tokens(model, other, 2))
    assert fourth.accepted == 2
    assert_features_of(model, fourth, other, start=4)
    log.apply(fourth.features)
    kept = other + fourth.tokens[:2]
    torch.testing.assert_close(log.rows(0), final_hidden(model, kept), atol=ATOL, rtol=1e-4)

    # A context shorter than the cache: re-fed from its last token (its logits are wanted).
    fifth = verify(verifier, "s", kept[:5], [])
    assert_features_of(model, fifth, kept[:5], start=4)


@pytest.mark.parametrize("widths", [(), (4, 8), (16,)], ids=["unpadded", "cpu-widths", "wide"])
def test_verify_features_of_padded_forwards(target_lm, widths):
    """Pads after the real positions give no rows; the real rows are unchanged."""
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer, forward_widths=widths)
    context = [1, 7, 3, 9, 22, 7, 3]
    context = context + verify(verifier, "p", context, []).tokens
    for drafts_right in (0, 1, 2, 5):
        right = greedy_tokens(model, context, drafts_right)
        drafts = right + [(greedy_tokens(model, context + right, 1)[0] + 1) % 64]
        result = verify(verifier, "p", context, drafts)
        assert result.accepted == drafts_right
        assert_features_of(model, result, context, start=len(context) - 1)
        context = context + result.tokens


def test_without_features_nothing_is_returned_and_tokens_are_the_same(target_lm):
    model, tokenizer = target_lm
    plain, with_features = TargetVerifier(model, tokenizer), TargetVerifier(model, tokenizer)
    params = SamplingParams(temperature=0.9, seed=3)
    context = [1, 4, 8, 15, 16, 23, 42]
    for round_ in range(4):
        drafts = [(7 * round_ + j) % 60 + 3 for j in range(3)]
        q = [SparseDist(torch.tensor([t, 5]), torch.tensor([0.6, 0.4])) for t in drafts]
        a = plain.verify(VerifyRequest("x", context, drafts, q, params))
        b = with_features.verify(VerifyRequest("x", context, drafts, q, params, return_features=True))
        assert a.features is None and b.features is not None
        assert (a.accepted, a.tokens) == (b.accepted, b.tokens)
        assert a.tv == pytest.approx(b.tv, abs=ATOL)
        context = context + a.tokens


def test_verify_batch_features_equal_per_request_verify(target_lm):
    """Sessions in different states (fresh prefill, extended, branched, padded widths) batched
    with features: each result's features equal what verify alone returns; a request that did not
    ask gets none though its neighbours did."""
    model, tokenizer = target_lm
    batched, single = TargetVerifier(model, tokenizer), TargetVerifier(model, tokenizer)
    rng = random.Random(3)
    contexts = {f"b{i}": [1] + [rng.randrange(3, 64) for _ in range(4 + 5 * i)] for i in range(5)}
    asks = {s: i != 2 for i, s in enumerate(contexts)}
    for round_ in range(3):
        requests = []
        for i, (s, context) in enumerate(contexts.items()):
            if round_ == 2 and i == 1:
                context = context[:3] + [50, 51]  # branched: re-fed from position 3
            k = 0 if round_ == 0 and i % 2 else (i + round_) % 4
            right = greedy_tokens(model, context, k)
            drafts = right[: k // 2] + [(t + 1) % 64 for t in right[k // 2:]]  # half right, then wrong
            q = [SparseDist.one_hot(t) for t in drafts]
            requests.append(VerifyRequest(s, context, drafts, q, GREEDY, return_features=asks[s]))
        got = batched.verify_batch(requests)
        want = [single.verify(r) for r in requests]
        for r, g, w in zip(requests, got, want):
            assert isinstance(g, VerifyResult), g
            assert (g.accepted, g.tokens) == (w.accepted, w.tokens)
            if not r.return_features:
                assert g.features is None and w.features is None
                continue
            assert g.features.start == w.features.start and g.features.end == w.features.end
            torch.testing.assert_close(g.features.rows, w.features.rows, atol=ATOL, rtol=1e-4)
            assert_features_of(model, g, r.context_ids, start=w.features.start)
            contexts[r.session_id] = r.context_ids + g.tokens
        for r, w in zip(requests, want):
            if not r.return_features:
                contexts[r.session_id] = r.context_ids + w.tokens


def test_prefix_cache_features_leave_out_the_pads(target_lm):
    """``logits_and_features`` itself: one row per real position fed, whatever ``pad_to``."""
    from specpool.target.kv_cache import PrefixCache

    model, _ = target_lm
    cache = PrefixCache(model)
    ids = [1, 9, 8, 7, 6, 5]
    _, first = cache.logits_and_features(ids, n_last=1, pad_to=10, features=True)
    assert first.start == 0 and first.rows.shape == (6, 32)
    longer = ids + [4, 3]
    _, second = cache.logits_and_features(longer, n_last=2, pad_to=8, features=True)
    assert second.start == 6 and second.rows.shape == (2, 32)
    torch.testing.assert_close(second.rows, final_hidden(model, longer)[6:], atol=ATOL, rtol=1e-4)
    assert cache.logits_and_features(longer + [2], n_last=1)[1] is None  # not asked: none
