"""Draft trees (EAGLE-2; specpool/target/tree.py): the tree helpers against brute-force definitions,
the target's tree forward against cache-free forwards of each path, the verifier's walk, the
white-box head's dynamic tree against its cache-free reference, and generation with trees
identical to target-only greedy decoding; trees only where they are exact (greedy, in process, no
feedback), chains otherwise; clear errors for malformed trees."""

from __future__ import annotations

import random

import pytest
import torch

from specpool.core.errors import InvalidArgument
from specpool.drafters.eagle import (DEFAULT_ALT_MIN_PROB, DEFAULT_ALT_PER_DEPTH, DEFAULT_ALTERNATIVES, DEFAULT_TREE_NODES,
                                     EagleDrafter)
from specpool.drafters.registry import DrafterContext, create_drafter
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.target.kv_cache import PrefixCache
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.target.tree import (
    ROOT, check_tree, greedy_tree_walk, primary_chain, tree_attention_mask, tree_depths,
)
from specpool.target.verifier import TargetVerifier, VerifyRequest
from test_eagle_drafter import drafter_of, final_hidden, head, head_dir, tell  # noqa: F401 - fixtures

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def ancestors(parents, i) -> list[int]:
    """Node i's path from the root's child to i itself."""
    path = []
    while i != ROOT:
        path.append(i)
        i = parents[i]
    return path[::-1]


def random_tree(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(-1, i) for i in range(n))


# -- the helpers --------------------------------------------------------------------------------------


def test_tree_helpers_against_their_definitions():
    rng = random.Random(0)
    for _ in range(50):
        parents = random_tree(rng, rng.randrange(0, 12))
        check_tree(parents, len(parents))
        assert tree_depths(parents) == [len(ancestors(parents, i)) for i in range(len(parents))]
        chain = primary_chain(parents)
        for j, node in enumerate(chain):  # each node the first child of the one before
            parent = chain[j - 1] if j else ROOT
            assert parents[node] == parent and node == min(i for i, p in enumerate(parents) if p == parent)
        assert not any(p == (chain[-1] if chain else ROOT) for p in parents)  # it ends at a leaf
        past, fed = rng.randrange(0, 4), rng.randrange(1, 4)
        mask = tree_attention_mask(parents, past, fed, torch.float32, "cpu")
        n = len(parents)
        assert mask.shape == (1, 1, fed + n, past + fed + n)
        visible = mask[0, 0] == 0
        for row in range(fed + n):
            if row < fed:
                want = set(range(past + row + 1))
            else:
                want = set(range(past + fed)) | {past + fed + a for a in ancestors(parents, row - fed)}
            assert set(torch.nonzero(visible[row]).flatten().tolist()) == want


def test_the_walk_accepts_the_longest_path_of_target_tokens():
    tokens = [5, 6, 7, 8, 9, 7]
    parents = (ROOT, ROOT, 0, 0, 1, 4)
    # target: after root 6 -> node 1; after node 1: 9 -> node 4; after node 4: 7 -> node 5; after 5: 3
    target = [6, 0, 9, 0, 0, 7, 3]
    assert greedy_tree_walk(target, tokens, parents) == [1, 4, 5]
    assert greedy_tree_walk([4] + [0] * 6, tokens, parents) == []
    assert greedy_tree_walk([5, 8, 0, 0, 0, 0, 0], tokens, parents) == [0, 3]


@pytest.mark.parametrize("parents, n, words", [((ROOT, 1), 2, "parent 1"), ((0,), 1, "parent 0"),
                                               ((ROOT, -2), 2, "parent -2"), ((ROOT,), 2, "2 nodes, 1 parents")])
def test_malformed_trees_are_one_clear_error(parents, n, words):
    with pytest.raises(InvalidArgument, match=words):
        check_tree(parents, n)


# -- the target's tree forward ------------------------------------------------------------------------


@torch.inference_mode()
def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]


def test_a_tree_forward_equals_a_forward_of_each_path(target_lm, prompts):
    model, _ = target_lm
    rng = random.Random(1)
    for sequence in prompts[:6]:
        context = sequence[:14]
        parents = random_tree(rng, 9)
        tree = [rng.randrange(4, 60) for _ in parents]
        cache = PrefixCache(model)
        cache.logits(context[:10], 1)  # a cached prefix, so the forward feeds a context tail too
        logits, keep, hidden = cache.tree_logits_and_hidden(context, tree, parents)
        assert keep == 10 and logits.shape[0] == 1 + len(tree) and hidden.shape[0] == 4 + len(tree)
        torch.testing.assert_close(logits[0], fresh_logits(model, context), atol=1e-4, rtol=1e-4)
        truth = final_hidden(model, context)
        torch.testing.assert_close(hidden[:4], truth[10:], atol=1e-4, rtol=1e-4)
        for i in range(len(tree)):
            path = [tree[a] for a in ancestors(parents, i)]
            torch.testing.assert_close(logits[1 + i], fresh_logits(model, context + path), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[4 + i], final_hidden(model, context + path)[-1], atol=1e-4, rtol=1e-4)
        path = ancestors(parents, len(tree) - 1)  # a deepest-last node's path: keep it
        cache.keep_tree_path(len(context), path)
        kept = context + [tree[a] for a in path]
        assert cache.token_ids == kept
        nxt = cache.logits(kept + [7], 1)[0]  # the cache now serves context + path as its prefix
        torch.testing.assert_close(nxt, fresh_logits(model, kept + [7]), atol=1e-4, rtol=1e-4)


def test_the_verifier_walks_the_tree_and_keeps_the_accepted_path(target_lm, prompts, greedy_reference):
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    rng = random.Random(2)
    accepted_any = 0
    for s, sequence in enumerate(prompts[:8]):
        context = sequence[:12]
        truth = greedy_reference(model, context, 6)
        # A random tree with the target's own continuation grafted on at a random depth.
        parents = list(random_tree(rng, 7))
        tree = [rng.randrange(4, 60) for _ in parents]
        depth = rng.randrange(0, 5)
        parent = ROOT
        for j in range(depth):
            parents.append(parent)
            tree.append(truth[j])
            parent = len(tree) - 1
        request = VerifyRequest(f"t{s}", context, tree, [SparseDist.one_hot(t) for t in tree], GREEDY,
                                return_features=True, tree_parents=tuple(parents))
        result = verifier.verify(request)
        assert result.accepted >= depth
        assert result.tokens == truth[: result.accepted + 1]  # the target's own tokens, bonus included
        accepted_any += result.accepted
        kept = context + truth[: result.accepted]
        assert verifier.caches.get(f"t{s}").token_ids == kept
        torch.testing.assert_close(result.features.rows, final_hidden(model, kept)[result.features.start:],
                                   atol=1e-4, rtol=1e-4)
        assert result.features.start == 0 and len(result.tv) == len(primary_chain(parents))
        # The next round continues from the kept path as from any chain round.
        follow = verifier.verify(VerifyRequest(f"t{s}", kept + result.tokens[-1:], [], [], GREEDY))
        assert follow.tokens == truth[result.accepted + 1: result.accepted + 2]
    assert accepted_any > 0


def test_batched_verification_serves_a_tree_beside_chains_as_its_first_branch(target_lm, prompts, greedy_reference):
    """A tree needs a forward of its own; beside other sessions it is verified as the chain of its
    first branch, in the one batched forward, and alone as the whole tree."""
    model, tokenizer = target_lm
    truth = greedy_reference(model, prompts[0][:10], 4)
    wrong = 1 if truth[0] != 1 else 2
    # The first branch misses at once; the tree's second child of the root is the target's token.
    parents = (ROOT, ROOT, 1, 2)
    tree = [wrong, truth[0], truth[1], truth[2]]
    requests = [VerifyRequest("a", prompts[0][:10], tree, [SparseDist.one_hot(t) for t in tree], GREEDY,
                              tree_parents=parents),
                VerifyRequest("b", prompts[1][:10], [9, 10], [SparseDist.one_hot(t) for t in (9, 10)], GREEDY)]
    forwards: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: forwards.append(int(kw["input_ids"].shape[0])),
                                           with_kwargs=True)
    verifier = TargetVerifier(model, tokenizer)
    verifier.verify_batch([VerifyRequest(s, c, [], [], GREEDY) for s, c in (("a", prompts[0][:9]), ("b", prompts[1][:9]))])
    forwards.clear()
    batched = verifier.verify_batch(requests)
    hook.remove()
    assert forwards == [2]  # one forward, both sessions in it
    alone = TargetVerifier(model, tokenizer)
    chain = VerifyRequest("a", prompts[0][:10], [wrong], [SparseDist.one_hot(wrong)], GREEDY)
    expected = [alone.verify(chain), alone.verify(requests[1])]
    assert [(r.accepted, r.tokens) for r in batched] == [(x.accepted, x.tokens) for x in expected]
    assert batched[0].accepted == 0 and batched[0].tokens == truth[:1]
    assert verifier.caches.get("a").token_ids == prompts[0][:10]
    # Alone, the same tree is verified whole: its second branch is the target's own path.
    whole = TargetVerifier(model, tokenizer).verify(requests[0])
    assert (whole.accepted, whole.tokens) == (3, truth[:4])


SAMPLED_TREE = SamplingParams(temperature=0.7, max_new_tokens=5)
SHARED_Q = SparseDist(torch.tensor([5, 6, 7]), torch.tensor([0.5, 0.3, 0.2]))


@pytest.mark.parametrize("change, words", [
    # Sampled: siblings must be distinct draws from one q (the walk's recursive rejection sampling).
    ({"params": SAMPLED_TREE, "tree_parents": (ROOT, ROOT)}, "siblings share one q"),
    ({"params": SAMPLED_TREE, "tree_parents": (ROOT, ROOT), "draft_tokens": [5, 5], "q": [SHARED_Q, SHARED_Q]},
     "repeats a sibling's token 5"),
    ({"return_top_k": 4}, "top-K"),
    ({"tree_parents": (ROOT, 3)}, "parent 3"),
])
def test_a_tree_the_verifier_cannot_verify_exactly_is_refused(change, words, target_lm, prompts):
    model, tokenizer = target_lm
    fields = dict(session_id="x", context_ids=prompts[0][:8], draft_tokens=[5, 6],
                  q=[SparseDist.one_hot(5), SparseDist.one_hot(6)], params=GREEDY, tree_parents=(ROOT, 0))
    fields.update(change)
    with pytest.raises(InvalidArgument, match=words):
        TargetVerifier(model, tokenizer).verify(VerifyRequest(**fields))


# -- the head's dynamic tree ----------------------------------------------------------------------------


@torch.inference_mode()
def reference_top(head, context: list[int], features: torch.Tensor, path: list[int], beam: int) -> list[int]:
    """The head's ``beam`` likeliest tokens after ``path``, recomputed without a cache: the target's
    features up to the context's end, then the head's own guesses along ``path``."""
    n = len(context)
    ids, feats = list(context[1:n]), [features[t] for t in range(n - 1)]
    for token in [None, *path]:
        if token is not None:
            ids.append(token)
            feats.append(guess)
        guess = head(torch.tensor([ids]), torch.stack(feats)[None], None, start=0)[0, -1]  # (d,)
    return head.vocab_ids[head.reduced_logits(guess).topk(beam).indices].tolist()


def test_the_heads_tree_expands_its_likeliest_nodes(head, target_lm, prompts):
    model, _ = target_lm
    drafter = drafter_of(head, tree_nodes=10, tree_beam=3, confidence_threshold=0.0)
    for s, sequence in enumerate(prompts[:5]):
        context = sequence[:16]
        tell(drafter, f"s{s}", model, context)
        proposal = drafter.propose_tree(f"s{s}", context, 4, GREEDY)
        parents = proposal.parents
        check_tree(parents, len(proposal.tokens))
        assert 0 < len(proposal.tokens) <= 10 and max(tree_depths(parents)) <= 4
        assert [float(q.probs.sum()) for q in proposal.q] == [1.0] * len(proposal.tokens)
        assert [int(q.token_ids[0]) for q in proposal.q] == proposal.tokens
        features = final_hidden(model, context)
        for i, token in enumerate(proposal.tokens):
            path = [proposal.tokens[a] for a in ancestors(parents, i)[:-1]]
            assert token in reference_top(head, context, features, path, 3), (s, i)
        chain = [proposal.tokens[i] for i in primary_chain(parents)]
        greedy_chain = drafter.propose(f"s{s}", context, 4, GREEDY).tokens
        assert chain == greedy_chain[: len(chain)]  # the first branch is the head's greedy chain
        assert drafter.features_held(f"s{s}") == len(context) - 1  # the session's cache untouched


@torch.inference_mode()
def path_probability(head, context: list[int], features: torch.Tensor, path: list[int]) -> float:
    """The product of the head's probabilities along ``path``, recomputed without a cache."""
    n = len(context)
    ids, feats, probability = list(context[1:n]), [features[t] for t in range(n - 1)], 1.0
    for token in path:
        guess = head(torch.tensor([ids]), torch.stack(feats)[None], None, start=0)[0, -1]  # (d,)
        probs = torch.softmax(head.reduced_logits(guess), dim=-1)  # (V_r,)
        probability *= float(probs[int(head.reduced_index()[token]) - 1])
        ids.append(token)
        feats.append(guess)
    return probability


def test_a_minimum_path_probability_prunes_the_tree(head, target_lm, prompts):
    model, _ = target_lm
    full, pruned = (drafter_of(head, tree_nodes=12, tree_beam=3, tree_min_prob=p) for p in (0.0, 0.2))
    sizes = []
    for s, sequence in enumerate(prompts[:5]):
        context = sequence[:16]
        for drafter in (full, pruned):
            tell(drafter, f"p{s}", model, context)
        big, small = (d.propose_tree(f"p{s}", context, 4, GREEDY) for d in (full, pruned))
        features = final_hidden(model, context)
        for i in range(len(small.tokens)):
            path = [small.tokens[a] for a in ancestors(small.parents, i)]
            assert path_probability(head, context, features, path) >= 0.2 - 1e-4, (s, i)
        kept = {tuple(small.tokens[a] for a in ancestors(small.parents, i)) for i in range(len(small.tokens))}
        assert kept <= {tuple(big.tokens[a] for a in ancestors(big.parents, i)) for i in range(len(big.tokens))}
        sizes.append((len(small.tokens), len(big.tokens)))
    assert sum(a for a, _ in sizes) < sum(b for _, b in sizes)  # it did prune


def test_tree_options_are_checked(head):
    for options in ({"tree_nodes": -1}, {"tree_beam": 0}, {"tree_min_prob": 1.0}):
        with pytest.raises(InvalidArgument, match="draft tree"):
            drafter_of(head, **options)
    with pytest.raises(InvalidArgument, match="greedy"):
        drafter_of(head, tree_nodes=4).propose_tree("x", [1, 2, 3], 3, SamplingParams(temperature=0.7))


# -- generation ---------------------------------------------------------------------------------------


class ChainOnlyVerifier:
    """The in-process verifier without tree support, as a target deployment is seen from the router."""

    def __init__(self, inner: TargetVerifier):
        self.inner = inner
        self.requests: list[VerifyRequest] = []

    def verify(self, request):
        self.requests.append(request)
        return self.inner.verify(request)

    def release(self, session_id):
        self.inner.release(session_id)


def generate(verifier, drafter, prompt, params=GREEDY, k=5, session="g", **kwargs):
    return speculative_generate(prompt, session_id=session, drafters={"e": drafter}, chooser=FixedChooser("e"),
                                verifier=verifier, params=params, k=k, **kwargs)


def test_greedy_generation_with_trees_equals_target_only(head, target_lm, prompts, greedy_reference):
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    tree_rounds = chain_rounds = tree_tokens = chain_tokens = 0
    for i, sequence in enumerate(prompts[::3]):
        prompt = sequence[:-24]
        expected = greedy_reference(model, prompt, GREEDY.max_new_tokens)
        for k in (1, 3, 5):
            tree = generate(verifier, drafter_of(head, tree_nodes=12), prompt, k=k, session=f"t{i}-{k}")
            chain = generate(verifier, drafter_of(head), prompt, k=k, session=f"c{i}-{k}")
            assert tree.token_ids == expected and chain.token_ids == expected, (i, k)
            assert all(r.proposed <= 12 for r in tree.rounds)
            tree_rounds, tree_tokens = tree_rounds + len(tree.rounds), tree_tokens + len(tree.token_ids)
            chain_rounds, chain_tokens = chain_rounds + len(chain.rounds), chain_tokens + len(chain.token_ids)
    assert tree_tokens / tree_rounds > chain_tokens / chain_rounds  # more tokens per round than chains


def test_trees_only_where_exact_chains_elsewhere(head, target_lm, prompts, greedy_reference):
    model, tokenizer = target_lm
    prompt = prompts[3][:-24]
    expected = greedy_reference(model, prompt, GREEDY.max_new_tokens)
    # A target that cannot verify trees (a target deployment): chains, same tokens.
    remote = ChainOnlyVerifier(TargetVerifier(model, tokenizer))
    assert generate(remote, drafter_of(head, tree_nodes=12), prompt, session="r").token_ids == expected
    assert all(r.tree_parents is None for r in remote.requests)
    # Online-learning feedback: its records describe chains with the target's top-K.
    local = ChainOnlyVerifier(TargetVerifier(model, tokenizer))
    local.verifies_trees = True
    feedback = []
    result = generate(local, drafter_of(head, tree_nodes=12), prompt, session="f", feedback=feedback.append,
                      return_top_k=4)
    assert result.token_ids == expected and feedback
    assert all(r.tree_parents is None for r in local.requests)
    # Sampled rounds: chains for an EAGLE-2 tree (its children are chosen, not drawn), seeded as ever.
    sampled = SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)
    local.requests.clear()
    first = generate(local, drafter_of(head, tree_nodes=12), prompt, params=sampled, session="s1")
    assert all(r.tree_parents is None for r in local.requests)
    assert generate(local, drafter_of(head), prompt, params=sampled, session="s2").token_ids == first.token_ids
    # Runner-up leaves draw their sampled trees, but only for a verifier that says it verifies them
    # (a target deployment older than sampled trees would verify one as a chain: not exact).
    leaves = drafter_of(head, alternatives=2, alt_min_prob=0.0)
    assert leaves.sampled_trees and not drafter_of(head, tree_nodes=12).sampled_trees
    local.requests.clear()
    generate(local, leaves, prompt, params=sampled, session="s3")
    assert all(r.tree_parents is None for r in local.requests)
    local.verifies_sampled_trees = True
    local.requests.clear()
    generate(local, leaves, prompt, params=sampled, session="s4")
    assert any(r.tree_parents is not None and not r.params.greedy for r in local.requests)
    # Greedy, in process, no feedback: trees.
    local.requests.clear()
    assert generate(local, drafter_of(head, tree_nodes=12), prompt, session="t").token_ids == expected
    assert any(r.tree_parents is not None for r in local.requests)


def test_eagle_tree_spec_through_the_registry_and_engine(head_dir, home, model_dirs, engine):  # noqa: F811
    drafter = create_drafter(f"eagle-tree:{head_dir}", DrafterContext(home, target=str(model_dirs.target)))
    assert isinstance(drafter, EagleDrafter) and drafter.tree_nodes == DEFAULT_TREE_NODES
    assert create_drafter(f"eagle:{head_dir}", DrafterContext(home, target=str(model_dirs.target))).tree_nodes == 0
    with pytest.raises(InvalidArgument, match="eagle-tree needs a head"):
        create_drafter("eagle-tree:", DrafterContext(home, target=str(model_dirs.target)))
    prompt = engine.encode_prompt("the cat sat on the mat the cat sat")
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=())
    result = engine.generate(prompt, params, f"eagle-tree:{head_dir}", k=4)
    assert result.token_ids == engine.generate(prompt, params, None).token_ids


# -- on the wire ------------------------------------------------------------------------------------


def test_trees_travel_the_protos_and_malformed_ones_are_refused():
    from specpool.drafters.base import Proposal
    from specpool.services import convert

    q = [SparseDist.one_hot(t) for t in (5, 6, 7)]
    request = VerifyRequest("s", [1, 2, 3], [5, 6, 7], q, GREEDY, tree_parents=(ROOT, ROOT, 0))
    back = convert.verify_request_from_proto(convert.verify_request_to_proto(request))
    assert back.tree_parents == (ROOT, ROOT, 0) and back.draft_tokens == [5, 6, 7]
    chain = VerifyRequest("s", [1, 2, 3], [5, 6, 7], q, GREEDY)
    assert convert.verify_request_from_proto(convert.verify_request_to_proto(chain)).tree_parents is None
    empty = VerifyRequest("s", [1, 2, 3], [], [], GREEDY, tree_parents=())
    assert convert.verify_request_from_proto(convert.verify_request_to_proto(empty)).tree_parents == ()
    proposal = Proposal([5, 6, 7], q, 0.5, parents=(ROOT, 0, 0))
    assert convert.proposal_from_proto(convert.proposal_to_proto(proposal)).parents == (ROOT, 0, 0)
    assert convert.proposal_from_proto(convert.proposal_to_proto(Proposal([5], q[:1]))).parents is None
    message = convert.propose_request_to_proto("s", [1, 2], 3, GREEDY, tree=True)
    assert convert.propose_request_from_proto(message).tree
    assert not convert.propose_request_from_proto(convert.propose_request_to_proto("s", [1, 2], 3, GREEDY)).tree
    bad = convert.verify_request_to_proto(request)
    bad.tree_parents[2] = 2  # its own parent
    with pytest.raises(InvalidArgument, match="parent 2"):
        convert.verify_request_from_proto(bad)
    stray = convert.verify_request_to_proto(chain)
    stray.tree_parents.extend([ROOT, ROOT, ROOT])
    with pytest.raises(InvalidArgument, match="not a tree"):
        convert.verify_request_from_proto(stray)


def test_a_learned_version_of_a_tree_head_drafts_trees_too(head):
    from specpool.learning.hot_swap import drafter_kind

    base = drafter_of(head, tree_nodes=7, tree_beam=2, tree_min_prob=0.01)
    rebuilt = drafter_kind(base).rebuild(base, head)
    assert (rebuilt.tree_nodes, rebuilt.tree_beam, rebuilt.tree_min_prob) == (7, 2, 0.01)


# -- runner-up leaves (eagle-alt) ---------------------------------------------------------------------


@pytest.mark.parametrize("per_depth", [1, 3])
def test_runner_up_leaves_are_the_heads_next_choices_beside_its_chain(per_depth, head, target_lm, prompts):
    model, _ = target_lm
    drafter = drafter_of(head, alternatives=2, alt_per_depth=per_depth, alt_min_prob=0.0, confidence_threshold=0.0)
    floor = drafter_of(head, alternatives=2, alt_per_depth=per_depth, alt_min_prob=0.02, confidence_threshold=0.0)
    strict = drafter_of(head, alternatives=2, alt_per_depth=per_depth, alt_min_prob=0.99, confidence_threshold=0.0)
    for s, sequence in enumerate(prompts[:5]):
        context = sequence[:16]
        for d in (drafter, floor, strict):
            tell(d, f"a{s}", model, context)
        proposal = drafter.propose_tree(f"a{s}", context, 4, GREEDY)
        chain = drafter.propose(f"a{s}", context, 4, GREEDY).tokens
        assert len(chain) == 4 and len(proposal.tokens) == 4 + 2 * per_depth
        check_tree(proposal.parents, len(proposal.tokens))
        assert proposal.tokens[:4] == chain
        assert proposal.parents == (ROOT, 0, 1, 2) + (ROOT,) * per_depth + (0,) * per_depth
        assert [proposal.tokens[i] for i in primary_chain(proposal.parents)] == chain
        features = final_hidden(model, context)
        for depth in range(2):  # leaves at depth d+1: the head's next choices after chain[:d], best first
            top = reference_top(head, context, features, chain[:depth], 1 + per_depth)
            assert top[0] == chain[depth]
            first = 4 + per_depth * depth
            assert proposal.tokens[first:first + per_depth] == top[1:], (s, depth)
        assert [int(q.token_ids[0]) for q in proposal.q] == proposal.tokens
        # A minimum probability keeps the leaves the head gives at least that much: best first, so
        # a prefix of each depth's runners-up.
        every: list = []
        drafter._draft(f"a{s}", context, 4, GREEDY, every)
        runners_up: list = []
        floor._draft(f"a{s}", context, 4, GREEDY, runners_up)
        assert len(every) == len(runners_up) == 2 and all(len(c) == per_depth for c in every)
        assert all(kept == c[:len(kept)] for c, kept in zip(every, runners_up))
        kept = floor.propose_tree(f"a{s}", context, 4, GREEDY)
        assert kept.tokens == chain + [t for c in runners_up for t in c]
        # Below the minimum probability there are no leaves: the chain alone, as a tree.
        alone = strict.propose_tree(f"a{s}", context, 4, GREEDY)
        assert alone.tokens == chain and alone.parents == (ROOT, 0, 1, 2)
        assert drafter.features_held(f"a{s}") == len(context) - 1
    with pytest.raises(InvalidArgument, match="at least one a depth"):
        drafter_of(head, alternatives=2, alt_per_depth=0)


def test_sampled_runner_up_leaves_are_draws_without_replacement_from_the_chains_q(head, target_lm, prompts):
    """Sampled, the chain is ``propose``'s own (same seed, same draws) and each depth's leaves are
    distinct tokens of that depth's q other than the chain's, as many as q has of at least the
    minimum probability (at most ``alt_per_depth``), each carrying the chain's q: what the target's
    recursive rejection sampling needs. Seeded: the same seed, the same tree."""
    model, tokenizer = target_lm
    drafter = drafter_of(head, alternatives=2, alt_per_depth=3, alt_min_prob=0.02, confidence_threshold=0.0)
    verifier = TargetVerifier(model, tokenizer)
    seen_leaves = set()
    for s, sequence in enumerate(prompts[:4]):
        context = sequence[:16]
        tell(drafter, f"s{s}", model, context)
        for seed in range(3):
            params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed)
            tree = drafter.propose_tree(f"s{s}", context, 4, params)
            chain = drafter.propose(f"s{s}", context, 4, params)
            assert tree.tokens[:4] == chain.tokens
            for a, b in zip(tree.q[:4], chain.q):  # a cached catch-up against a fresh one: float round-off
                assert torch.equal(a.token_ids, b.token_ids)
                torch.testing.assert_close(a.probs, b.probs, atol=1e-4, rtol=1e-4)
            assert drafter.propose_tree(f"s{s}", context, 4, params).tokens == tree.tokens
            for depth in range(2):
                leaves = [i for i in range(4, len(tree.tokens)) if tree.parents[i] == (ROOT if depth == 0 else depth - 1)]
                q = tree.q[depth]
                others = {int(t) for t, p in zip(q.token_ids, q.probs) if float(p) >= 0.02} - {chain.tokens[depth]}
                assert len(leaves) == min(3, len(others))
                tokens = [tree.tokens[i] for i in leaves]
                assert len(set(tokens)) == len(tokens) and chain.tokens[depth] not in tokens
                assert set(tokens) <= {int(t) for t in q.token_ids}
                assert all(tree.q[i] is tree.q[depth] for i in leaves)
                seen_leaves.add((s, depth, tuple(tokens)))
            # The target verifies it: a sampled tree in one forward, the cache keeping the path.
            request = VerifyRequest(f"s{s}-{seed}", context, tree.tokens, tree.q, params, tree_parents=tree.parents)
            result = verifier.verify(request)
            assert len(result.tokens) == result.accepted + 1
            assert verifier.caches.get(f"s{s}-{seed}").token_ids == context + result.tokens[:-1]
    assert len(seen_leaves) > 8  # seeds and contexts change the draws


def test_a_padded_tree_forward_equals_an_unpadded_one(target_lm, prompts):
    model, tokenizer = target_lm
    padded, plain = TargetVerifier(model, tokenizer, forward_widths=(8, 16)), TargetVerifier(model, tokenizer, forward_widths=())
    rng = random.Random(3)
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(int(kw["input_ids"].shape[1])), with_kwargs=True)
    for s, sequence in enumerate(prompts[:6]):
        context = sequence[:14]
        parents = random_tree(rng, rng.randrange(1, 6))
        tree = [rng.randrange(4, 60) for _ in parents]
        request = VerifyRequest(f"p{s}", context, tree, [SparseDist.one_hot(t) for t in tree], GREEDY,
                                return_features=True, tree_parents=parents)
        for verifier in (padded, plain):
            verifier.verify(VerifyRequest(f"p{s}", context[:10], [], [], GREEDY))  # a cached prefix
        widths.clear()
        a, b = padded.verify(request), plain.verify(request)
        assert widths == [8 if 4 + len(tree) <= 8 else 16, 4 + len(tree)]  # context tail + nodes, padded or not
        assert (a.accepted, a.tokens, a.features.start) == (b.accepted, b.tokens, b.features.start)
        torch.testing.assert_close(a.features.rows, b.features.rows, atol=1e-4, rtol=1e-4)
        assert padded.caches.get(f"p{s}").token_ids == plain.caches.get(f"p{s}").token_ids
        keys = [padded.caches.get(f"p{s}").cache.layers[0].keys, plain.caches.get(f"p{s}").cache.layers[0].keys]
        assert keys[0].shape == keys[1].shape  # the pads left nothing in the cache
        torch.testing.assert_close(keys[0], keys[1], atol=1e-4, rtol=1e-4)
    hook.remove()


def test_greedy_generation_with_runner_up_leaves_equals_target_only(head, head_dir, target_lm, prompts,  # noqa: F811
                                                                    greedy_reference, home, model_dirs, engine):
    from specpool.drafters.lookup_first import LookupFirstDrafter

    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    leaves = 0
    for i, sequence in enumerate(prompts[::3]):
        prompt = sequence[:-24]
        expected = greedy_reference(model, prompt, GREEDY.max_new_tokens)
        for k in (1, 3, 5):
            alt = drafter_of(head, alternatives=2, alt_min_prob=0.0)
            rounds = []
            result = generate(verifier, alt, prompt, k=k, session=f"a{i}-{k}", on_round=rounds.append)
            assert result.token_ids == expected, (i, k)
            leaves += sum(r.proposed > k for r in rounds)  # more tokens than a chain of k: leaves
            behind = LookupFirstDrafter("lookup:alt", drafter_of(head, alternatives=2, alt_min_prob=0.0))
            assert behind.tree_nodes > 0
            assert generate(verifier, behind, prompt, k=k, session=f"l{i}-{k}").token_ids == expected, (i, k)
    assert leaves > 0
    context = DrafterContext(home, target=str(model_dirs.target))
    spec = create_drafter(f"eagle-alt:{head_dir}", context)
    assert (spec.alternatives, spec.alt_per_depth, spec.alt_min_prob) == (DEFAULT_ALTERNATIVES, DEFAULT_ALT_PER_DEPTH,
                                                                         DEFAULT_ALT_MIN_PROB)
    assert spec.tree_nodes > 0
    assert create_drafter(f"lookup:eagle-alt:{head_dir}", context).tree_nodes > 0
    assert create_drafter(f"lookup:eagle:{head_dir}", context).tree_nodes == 0
    with pytest.raises(InvalidArgument, match="eagle-alt needs a head"):
        create_drafter("eagle-alt:", context)
    with pytest.raises(InvalidArgument, match="runner-up leaves"):
        drafter_of(head, alternatives=-1)
    prompt = engine.encode_prompt("the cat sat on the mat the cat sat")
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=())
    want = engine.generate(prompt, params, None).token_ids
    assert engine.generate(prompt, params, f"lookup:eagle-alt:{head_dir}", k=4).token_ids == want


def test_the_int8_runner_up_kind_drafts_leaves_with_int8_kernels_and_stays_lossless(head_dir, home, model_dirs, engine):
    """``eagle-alt-int8:NAME`` (the default drafter's kind): ``eagle-alt``'s leaves and
    ``eagle-int8``'s kernels (which compute in float32 where this torch has no int8 linear),
    lossless behind lookup."""
    context = DrafterContext(home, target=str(model_dirs.target))
    drafter = create_drafter(f"eagle-alt-int8:{head_dir}", context)
    assert (drafter.alternatives, drafter.alt_per_depth, drafter.alt_min_prob) == (
        DEFAULT_ALTERNATIVES, DEFAULT_ALT_PER_DEPTH, DEFAULT_ALT_MIN_PROB)
    assert drafter.head.draft_precision == "int8"
    assert create_drafter(f"lookup:eagle-alt-int8:{head_dir}", context).tree_nodes > 0
    with pytest.raises(InvalidArgument, match="eagle-alt-int8 needs a head"):
        create_drafter("eagle-alt-int8:", context)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=())
    for text in ("the cat sat on the mat the cat sat", "a dog ran"):
        prompt = engine.encode_prompt(text)
        want = engine.generate(prompt, params, None).token_ids
        assert engine.generate(prompt, params, f"lookup:eagle-alt-int8:{head_dir}", k=4).token_ids == want


def test_a_learned_version_of_a_runner_up_head_keeps_its_leaves(head):
    from specpool.learning.hot_swap import drafter_kind

    base = drafter_of(head, alternatives=3, alt_min_prob=0.1, alt_per_depth=2)
    rebuilt = drafter_kind(base).rebuild(base, head)
    assert ((rebuilt.alternatives, rebuilt.alt_min_prob, rebuilt.alt_per_depth, rebuilt.tree_nodes)
            == (3, 0.1, 2, base.tree_nodes))


def test_the_leaf_sweeps_kinds_draft_with_their_settings(head_dir, home, model_dirs):  # noqa: F811
    """bench/leaf_sweep.py (bench/results/white-box-leaves): each swept kind is the head with its row's settings."""
    from bench.leaf_sweep import SWEEP, register_sweep

    register_sweep()
    context = DrafterContext(home, target=str(model_dirs.target))
    for suffix, options in SWEEP.items():
        drafter = create_drafter(f"lookup:eagle-{suffix}:{head_dir}", context).inner
        assert drafter.tree_nodes > 0
        for option, value in options.items():
            got = drafter.head.draft_precision if option == "precision" else getattr(drafter, option)
            assert got == value, (suffix, option)
