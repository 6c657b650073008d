"""Batched verification across sessions (TargetVerifier.verify_batch, kv_cache.batched_logits):
every request's result equals what verify() alone returns, the batch is one model forward, errors
stay in place, same-session requests run in order, and the caches are left as after verify()."""

from __future__ import annotations

import random
import re

import pytest
import torch

from specpool.drafters.hf_model import HFModelDrafter
from specpool.core.errors import InvalidArgument
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.target.kv_cache import PrefixCache, batched_logits, supports_batched_logits
from specpool.target.attention import GROUPED_SDPA
from specpool.target.models import ModelConfig, load_causal_lm
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest, VerifyResult, plan_forwards

ATOL = 1e-5


@pytest.fixture(scope="module")
def drafters(target_lm, noisy_lm):
    return {
        "self": HFModelDrafter("self", *target_lm),  # greedy drafts always accepted
        "noisy": HFModelDrafter("noisy", *noisy_lm),  # accepted often, not always
    }


@pytest.fixture
def reference(target_lm) -> TargetVerifier:
    """A second, independent verifier that serves the same requests one by one."""
    return TargetVerifier(*target_lm)


class ForwardCounter:
    """Counts forwards of the target model (a forward hook), to show a batch is one forward."""

    def __init__(self, model):
        self.calls = 0
        self.batch_sizes: list[int] = []
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        self.calls += 1
        self.batch_sizes.append(int(kwargs["input_ids"].shape[0]))

    def close(self):
        self._handle.remove()


@pytest.fixture
def forwards(target_lm):
    counter = ForwardCounter(target_lm[0])
    yield counter
    counter.close()


@torch.inference_mode()
def fresh_logits(model, ids: list[int], n_last: int) -> torch.Tensor:
    """Reference: one forward over the whole sequence, no cache."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -n_last:]


def assert_same_result(got, want: VerifyResult) -> None:
    assert isinstance(got, VerifyResult), got
    assert got.accepted == want.accepted
    assert got.tokens == want.tokens
    assert got.tv == pytest.approx(want.tv, abs=ATOL)
    if want.target_top_k is None:
        assert got.target_top_k is None
    else:
        assert len(got.target_top_k) == len(want.target_top_k)
        for g, w in zip(got.target_top_k, want.target_top_k):
            assert g.token_ids.tolist() == w.token_ids.tolist()
            torch.testing.assert_close(g.probs, w.probs, atol=ATOL, rtol=1e-4)


def assert_same_cache_state(verifier: TargetVerifier, reference: TargetVerifier, session_id: str) -> None:
    got, want = verifier.caches.get(session_id), reference.caches.get(session_id)
    assert got.token_ids == want.token_ids
    assert got.cache.get_seq_length() == want.cache.get_seq_length() == len(got.token_ids)


def request(drafters, name, session_id, context, k, params, return_top_k=0) -> VerifyRequest:
    if name is None or k == 0:
        return VerifyRequest(session_id, list(context), [], [], params, return_top_k)
    proposal = drafters[name].propose(session_id, context, k, params)
    return VerifyRequest(session_id, list(context), proposal.tokens, proposal.q, params, return_top_k)


# -- batched_logits: the ragged forward itself ---------------------------------------------------------

def test_batched_logits_equal_per_cache_logits_across_cache_states(target_lm):
    """Caches in every state (fresh, extended, branched, shorter than cached, n_last past the
    cached prefix) batched together give the per-cache logits and end up holding their input."""
    model, _ = target_lm
    rng = random.Random(5)
    base = [[1] + [rng.randrange(3, 64) for _ in range(n)] for n in (0, 4, 11, 19, 7, 30)]
    batched = [PrefixCache(model) for _ in base]
    single = [PrefixCache(model) for _ in base]
    for caches in (batched, single):
        for cache, ids in zip(caches[1:], base[1:]):
            cache.logits(ids, 1)
    inputs = [
        base[0] + [5, 6, 7],  # fresh cache: full prefill
        base[1] + [9, 10],  # extends the cached ids
        base[2][:6] + [40, 41, 42, 43],  # branches after 6 cached ids
        base[3][:10],  # shorter than the cache: crops
        base[4],  # same ids, more positions wanted than new ids: re-feeds them
        base[5] + [3],
    ]
    n_lasts = [2, 3, 4, 1, 5, 2]
    got = batched_logits(batched, inputs, n_lasts)
    for i, (ids, n_last) in enumerate(zip(inputs, n_lasts)):
        assert got[i].shape == (n_last, model.config.vocab_size)
        torch.testing.assert_close(got[i], single[i].logits(ids, n_last), atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(got[i], fresh_logits(model, ids, n_last), atol=ATOL, rtol=1e-4)
        assert batched[i].token_ids == ids
        assert batched[i].cache.get_seq_length() == len(ids)
        # The cache keeps working on its own afterwards.
        probe = ids + [8, 9]
        torch.testing.assert_close(batched[i].logits(probe, 3), fresh_logits(model, probe, 3), atol=ATOL, rtol=1e-4)


def test_after_a_batch_each_cache_owns_only_its_own_rows(target_lm):
    """Memory: a session kept after its request (keep_caches) must pin nothing of the batch, so
    each cache's tensors have storage of their own, exactly their rows (no padding, no other
    session's rows); a view into a batch tensor would hold all B sessions' rows."""
    model, _ = target_lm
    caches = [PrefixCache(model) for _ in range(4)]
    inputs = [[1] + list(range(3, 3 + n)) for n in (2, 9, 30, 5)]  # very different lengths: mostly padding
    batched_logits(caches, inputs, [1] * 4)
    storages = set()
    for cache, ids in zip(caches, inputs):
        for layer in cache.cache.layers:
            for tensor in (layer.keys, layer.values):
                storage = tensor.untyped_storage()
                assert storage.nbytes() == tensor.numel() * tensor.element_size()  # its rows, nothing more
                assert tensor.shape[-2] == len(ids)
                storages.add(storage.data_ptr())
    assert len(storages) == 4 * 2 * len(caches[0].cache.layers)  # nothing shared between sessions


def test_batched_logits_rejects_one_cache_twice(target_lm):
    cache = PrefixCache(target_lm[0])
    with pytest.raises(ValueError, match="distinct"):
        batched_logits([cache, cache], [[1, 2], [1, 3]], [1, 1])


def test_a_batched_forward_that_fails_leaves_every_cache_usable(target_lm):
    """A forward that fails part-way has already extended some layers of some caches; those caches
    start afresh (a re-prefill, never a wrong answer), and the model's attention is SDPA again."""
    model, _ = target_lm
    caches = [PrefixCache(model) for _ in range(3)]
    inputs = [[1] + list(range(3, 3 + n)) for n in (4, 9, 6)]
    for cache, ids in zip(caches, inputs):
        cache.logits(ids, 1)

    def fail(module, args, kwargs):
        raise RuntimeError("injected fault")

    handle = model.model.layers[-1].register_forward_pre_hook(fail, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            batched_logits(caches, [ids + [7, 8] for ids in inputs], [3] * 3)
    finally:
        handle.remove()
    assert model.config._attn_implementation == GROUPED_SDPA  # restored after the failed forward
    for cache, ids in zip(caches, inputs):
        assert cache.token_ids == [] and cache.cache is None
        probe = ids + [7, 8]
        torch.testing.assert_close(cache.logits(probe, 3), fresh_logits(model, probe, 3), atol=ATOL, rtol=1e-4)
    assert model(input_ids=torch.tensor([inputs[0]])).logits.isfinite().all()  # single forwards unaffected


def test_a_model_without_sdpa_attention_verifies_one_by_one(model_dirs, home, drafters, prompts):
    """The ragged batch computes SDPA's attention; a model on another kernel (eager here) is not
    batched, and its rounds still verify correctly one by one."""
    model, tokenizer = load_causal_lm(ModelConfig(str(model_dirs.target)), home, attn_implementation="eager")
    assert not supports_batched_logits(model)
    with pytest.raises(ValueError, match="cannot be batched"):
        batched_logits([PrefixCache(model), PrefixCache(model)], [[1, 3], [1, 4]], [1, 1])
    verifier, reference = TargetVerifier(model, tokenizer), TargetVerifier(model, tokenizer)
    assert not verifier.batchable
    requests = [request(drafters, "noisy", f"e{i}", prompts[i], 3, SamplingParams(max_new_tokens=10)) for i in range(3)]
    for r, g in zip(requests, verifier.verify_batch(requests)):
        assert_same_result(g, reference.verify(r))


# -- verify_batch == verify ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_verify_batch_equals_sequential_verify(temperature, verifier, reference, drafters, prompts, forwards):
    """Ten sessions with different context lengths and k = 0..8, over three rounds (the first a
    prefill of fresh caches, the later ones reuse them), in a shuffled order each round."""
    rng = random.Random(7)
    n = 10
    sessions = [f"s{i}" for i in range(n)]
    contexts = {s: prompts[i][: 6 + 4 * i] for i, s in enumerate(sessions)}
    ks = {s: i % 9 for i, s in enumerate(sessions)}
    params = {s: SamplingParams(temperature=temperature, seed=100 + i, max_new_tokens=64) for i, s in enumerate(sessions)}
    top_k = {s: 4 if i % 3 == 0 else 0 for i, s in enumerate(sessions)}
    name = "noisy"
    accepted_some = False
    for _ in range(3):
        order = list(sessions)
        rng.shuffle(order)
        requests = [request(drafters, name, s, contexts[s], ks[s], params[s], top_k[s]) for s in order]
        before = forwards.calls
        got = verifier.verify_batch(requests)
        assert forwards.calls - before == 1, "one forward for the whole batch"
        assert forwards.batch_sizes[-1] == n
        want = [reference.verify(r) for r in requests]
        for r, g, w in zip(requests, got, want):
            assert_same_result(g, w)
            assert_same_cache_state(verifier, reference, r.session_id)
            contexts[r.session_id] = r.context_ids + w.tokens
            accepted_some |= w.accepted > 0
    assert accepted_some


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_lockstep_generation_through_verify_batch(temperature, verifier, reference, drafters, prompts, target_lm, greedy_reference, forwards):
    """Six full speculative generations in lockstep: each round, every unfinished session drafts,
    then one verify_batch call verifies them all. Each output equals the unbatched loop's (same
    seed), and in greedy mode the target's own greedy decoding."""
    model, _ = target_lm
    specs = [("self", 4, 20), ("noisy", 3, 17), ("noisy", 6, 25), (None, 0, 9), ("noisy", 1, 14), ("self", 8, 22)]
    prompt_of = {f"g{i}": prompts[2 * i][: 10 + 5 * i] for i in range(len(specs))}
    states = {
        f"g{i}": dict(name=name, k=k, params=SamplingParams(temperature=temperature, seed=40 + i, max_new_tokens=m), generated=[])
        for i, (name, k, m) in enumerate(specs)
    }
    rounds = 0
    while True:
        active = [s for s, st in states.items() if len(st["generated"]) < st["params"].max_new_tokens]
        if not active:
            break
        requests = []
        for s in active:
            st = states[s]
            remaining = st["params"].max_new_tokens - len(st["generated"])
            k_round = min(st["k"], remaining - 1)  # as specpool/router/loop.py: never overshoot max_new_tokens
            requests.append(request(drafters, st["name"], s, prompt_of[s] + st["generated"], k_round, st["params"]))
        before = forwards.calls
        results = verifier.verify_batch(requests)
        assert forwards.calls - before == 1
        for s, result in zip(active, results):
            assert isinstance(result, VerifyResult), result
            states[s]["generated"].extend(result.tokens)
        rounds += 1
    assert rounds >= 5
    assert max(forwards.batch_sizes) == len(specs)
    for s, st in states.items():
        unbatched = speculative_generate(
            prompt_of[s], session_id=s, drafters=drafters, chooser=FixedChooser(st["name"]),
            verifier=reference, params=st["params"], k=max(st["k"], 1),
        )
        assert st["generated"] == unbatched.token_ids, s
        if temperature == 0.0:
            assert st["generated"] == greedy_reference(model, prompt_of[s], st["params"].max_new_tokens), s


# -- splitting a batch where padding would cost more than a forward ----------------------------------------


@pytest.mark.parametrize(
    "new_tokens, split_cost, expected",
    [
        ([], 64, []),
        ([6], 64, [[0]]),
        ([6] * 8, 64, [list(range(8))]),
        ([1, 9, 5, 3, 9, 1, 6, 2], 64, [[0, 5, 7, 3, 2, 6, 1, 4]]),  # mixed k: 8 x 9 wide, one forward
        ([6, 6, 400, 6], 64, [[0, 1, 3], [2]]),  # a prompt prefill joins decode rounds: own forward
        ([6, 300, 6, 310], 64, [[0, 2], [1, 3]]),  # two prefills of similar length batch together
        ([1, 9, 9, 9], 20, [[0, 1, 2, 3]]),  # widening one row by 8: 8 pads
        ([1, 1, 1, 9], 20, [[0, 1, 2], [3]]),  # widening three rows by 8: 24 pads > 20
        ([5, 5], 0, [[0, 1]]),  # equal widths never split
    ],
)
def test_plan_forwards_table(new_tokens, split_cost, expected):
    assert plan_forwards(new_tokens, split_cost) == expected


def test_prompt_prefill_in_a_batch_of_rounds_gets_its_own_forward(verifier, reference, drafters, prompts, forwards):
    """Five warm sessions verify k+1 = 6 tokens while a fresh session brings a long prompt: the
    rounds share one forward, the prefill runs alone (not padding five rows to its width)."""
    params = SamplingParams(temperature=0.9, seed=21, max_new_tokens=30)
    warm = [f"w{i}" for i in range(5)]
    contexts = {s: prompts[i] for i, s in enumerate(warm)}
    first = [request(drafters, "noisy", s, contexts[s], 5, params) for s in warm]
    for r, result in zip(first, verifier.verify_batch(first)):
        assert_same_result(result, reference.verify(r))
        contexts[r.session_id] = r.context_ids + result.tokens
    long_prompt = prompts[5] + prompts[6] + prompts[7]
    requests = [request(drafters, "noisy", s, contexts[s], 5, params) for s in warm[:3]]
    requests.append(request(drafters, "noisy", "fresh", long_prompt, 5, params))
    requests += [request(drafters, "noisy", s, contexts[s], 5, params) for s in warm[3:]]
    before = forwards.calls
    got = verifier.verify_batch(requests)
    assert forwards.calls - before == 2
    assert forwards.batch_sizes[-2:] == [5, 1]
    for r, g in zip(requests, got):
        assert_same_result(g, reference.verify(r))
        assert_same_cache_state(verifier, reference, r.session_id)


# -- errors, same-session requests, batch of one -------------------------------------------------------------


def test_invalid_requests_yield_errors_in_place(verifier, reference, drafters, prompts, target_lm, forwards):
    window = verifier.context_window
    params = SamplingParams(temperature=0.9, seed=3, max_new_tokens=8)
    good_a = request(drafters, "noisy", "a", prompts[0], 4, params)
    good_b = request(drafters, "noisy", "b", prompts[1][:9], 2, SamplingParams(max_new_tokens=8))
    empty = VerifyRequest("c", [], [5], [SparseDist.one_hot(5)], params)
    too_long = VerifyRequest("d", [1] + [7] * (window - 5), [5] * 4, [SparseDist.one_hot(5)] * 4, params)
    bad_q = VerifyRequest("e", prompts[2], [5, 6, 7], [SparseDist.one_hot(5)] * 2, params)  # one q too few
    bad_top_k = VerifyRequest("f", prompts[3], [], [], params, return_top_k=verifier.vocab_size + 1)
    # Caught only after the forward, by the acceptance rule: x_1 has no mass under its q.
    zero_mass = VerifyRequest("g", prompts[4], [7], [SparseDist.one_hot(5)], params)
    requests = [good_a, empty, too_long, bad_q, zero_mass, bad_top_k, good_b]
    before = forwards.calls
    got = verifier.verify_batch(requests)
    assert forwards.calls - before == 1  # a, g and b in one forward; the others never reach the model
    assert forwards.batch_sizes[-1] == 3
    assert isinstance(got[1], InvalidArgument) and "non-empty context" in str(got[1])
    assert isinstance(got[2], InvalidArgument) and "exceeds the window" in str(got[2])
    assert isinstance(got[3], InvalidArgument) and "one proposal distribution per draft token" in str(got[3])
    assert isinstance(got[4], InvalidArgument) and "zero proposal mass" in str(got[4])
    assert isinstance(got[5], InvalidArgument) and "return-top-k" in str(got[5])
    for i in (3, 4, 5):  # verify() alone raises the same errors
        with pytest.raises(InvalidArgument, match=re.escape(str(got[i]))):
            reference.verify(requests[i])
    for i in (0, 6):
        assert_same_result(got[i], reference.verify(requests[i]))
        assert_same_cache_state(verifier, reference, requests[i].session_id)
    # Only invalid requests: every slot an error, no forward at all.
    before = forwards.calls
    got = verifier.verify_batch([empty, too_long])
    assert [type(g) for g in got] == [InvalidArgument, InvalidArgument]
    assert forwards.calls == before
    assert verifier.verify_batch([]) == []


def test_same_session_requests_in_one_batch_run_in_order(verifier, reference, drafters, prompts, target_lm, greedy_reference, forwards):
    """Three requests of session "a" (a round, its continuation, then a branch back to an earlier
    point) among other sessions: each sees the cache the previous one left, as if sequential."""
    model, _ = target_lm
    greedy = SamplingParams(max_new_tokens=30)
    context = prompts[4][:20]
    cont = greedy_reference(model, context, 12)
    a1 = request(drafters, "self", "a", context, 3, greedy)
    a2 = request(drafters, "noisy", "a", context + cont[:4], 5, greedy)
    a3 = request(drafters, "noisy", "a", context[:15], 2, SamplingParams(temperature=0.9, seed=9, max_new_tokens=30))
    b = request(drafters, "noisy", "b", prompts[5][:12], 4, greedy)
    c = request(drafters, "noisy", "c", prompts[6], 6, SamplingParams(temperature=0.9, seed=1, max_new_tokens=30))
    requests = [a1, b, a2, c, a3]
    before = forwards.calls
    got = verifier.verify_batch(requests)
    # Waves: {a1, b, c} in one forward, then a2 alone, then a3 alone.
    assert forwards.calls - before == 3
    assert forwards.batch_sizes[-3:] == [3, 1, 1]
    for r, g in zip(requests, got):
        assert_same_result(g, reference.verify(r))
    for s in "abc":
        assert_same_cache_state(verifier, reference, s)
    assert got[0].tokens == cont[:4]  # the target drafting itself: all accepted + bonus


def test_batch_of_one_is_plain_verify(verifier, reference, drafters, prompts, monkeypatch):
    def no_batching(*args, **kwargs):
        raise AssertionError("a batch of one must not take the batched path")

    monkeypatch.setattr("specpool.target.verifier.batched_logits_and_features", no_batching)
    r = request(drafters, "noisy", "solo", prompts[7], 5, SamplingParams(temperature=0.9, seed=2, max_new_tokens=10))
    [got] = verifier.verify_batch([r])
    assert_same_result(got, reference.verify(r))


def test_unbatchable_model_falls_back_to_sequential(verifier, reference, drafters, prompts, forwards):
    verifier.batchable = False  # as for a sliding-window model or a custom cache type
    requests = [request(drafters, "noisy", f"u{i}", prompts[i], 3, SamplingParams(max_new_tokens=10)) for i in range(3)]
    before = forwards.calls
    got = verifier.verify_batch(requests)
    assert forwards.calls - before == 3
    for r, g in zip(requests, got):
        assert_same_result(g, reference.verify(r))


# -- caches after a batch ----------------------------------------------------------------------------


def test_caches_after_batch_behave_like_fresh_ones(verifier, drafters, prompts, target_lm):
    """After batches mixing fresh, extended, branched and cropped sessions, every cache holds
    exactly context + accepted tokens, and its logits equal a fresh cache's over the same ids."""
    model, _ = target_lm
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=40)
    sessions = [f"f{i}" for i in range(5)]
    contexts = {s: prompts[10 + i][: 8 + 3 * i] for i, s in enumerate(sessions)}
    for round_ in range(3):
        if round_ == 2:
            contexts["f1"] = contexts["f1"][:-3] + [11, 12]  # branch: partial prefix reuse
            contexts["f2"] = contexts["f2"][:5]  # shorter than the cache
            verifier.release("f3")  # evicted: a fresh cache joins a batch of warm ones
        requests = [request(drafters, "noisy", s, contexts[s], 2 + i, params) for i, s in enumerate(sessions)]
        results = verifier.verify_batch(requests)
        for r, result in zip(requests, results):
            assert isinstance(result, VerifyResult), result
            cache = verifier.caches.get(r.session_id)
            assert cache.token_ids == r.context_ids + r.draft_tokens[: result.accepted]
            assert cache.cache.get_seq_length() == len(cache.token_ids)
            contexts[r.session_id] = r.context_ids + result.tokens
    for s in sessions:
        cache = verifier.caches.get(s)
        probe = contexts[s] + [9, 10, 11]
        want = PrefixCache(model).logits(probe, 4)
        torch.testing.assert_close(cache.logits(probe, 4), want, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(want, fresh_logits(model, probe, 4), atol=ATOL, rtol=1e-4)
