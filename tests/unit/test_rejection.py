"""Speculative sampling (specpool/target/rejection.py): tables of exact cases, and the statistical proof
of losslessness on a small vocabulary (the emitted token follows p whatever q is)."""

from __future__ import annotations

import pytest
import torch

from specpool.core.errors import InvalidArgument
from specpool.target.rejection import (SparseDist, VerifyOutcome, sibling_draws, speculative_verify, speculative_verify_tree,
                                       tv_distance)
from specpool.target.tree import ROOT

V = 8
P0 = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
P1 = torch.tensor([0.05, 0.10, 0.25, 0.05, 0.20, 0.05, 0.10, 0.20])
P2 = torch.tensor([0.40, 0.05, 0.05, 0.10, 0.05, 0.05, 0.10, 0.20])
UNIFORM = torch.full((V,), 1.0 / V)
DRAWS = 50_000
TV_BOUND = 0.02


def sparse(mass: dict[int, float]) -> SparseDist:
    ids = sorted(mass)
    return SparseDist(torch.tensor(ids, dtype=torch.long), torch.tensor([mass[i] for i in ids]))


def dense_tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


# -- SparseDist ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dist, vocab, expected",
    [
        (SparseDist.one_hot(2), 4, [0, 0, 1, 0]),
        (SparseDist.one_hot(0), 1, [1]),
        (sparse({1: 0.25, 3: 0.75}), 5, [0, 0.25, 0, 0.75, 0]),
        (sparse({4: 0.5, 0: 0.5}), 6, [0.5, 0, 0, 0, 0.5, 0]),
        # Unsorted ids keep their own masses.
        (SparseDist(torch.tensor([3, 1]), torch.tensor([0.9, 0.1])), 4, [0, 0.1, 0, 0.9]),
        # A repeated id accumulates (index_put with accumulate=True).
        (SparseDist(torch.tensor([2, 2, 0]), torch.tensor([0.25, 0.25, 0.5])), 3, [0.5, 0, 0.5]),
    ],
)
def test_sparse_dist_dense(dist, vocab, expected):
    out = dist.dense(vocab)
    assert out.shape == (vocab,)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32))


def test_sparse_dist_one_hot_fields():
    d = SparseDist.one_hot(7)
    assert d.token_ids.tolist() == [7]
    assert d.token_ids.dtype == torch.long
    assert d.probs.tolist() == [1.0]


# -- tv_distance ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, q, expected",
    [
        ([0.25, 0.25, 0.25, 0.25], sparse({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}), 0.0),
        ([1.0, 0.0, 0.0, 0.0], SparseDist.one_hot(0), 0.0),
        ([1.0, 0.0, 0.0, 0.0], SparseDist.one_hot(1), 1.0),
        ([0.5, 0.5, 0.0, 0.0], SparseDist.one_hot(0), 0.5),
        ([0.25, 0.25, 0.25, 0.25], sparse({0: 0.5, 1: 0.5}), 0.5),
        # q has mass where p has none.
        ([1.0, 0.0, 0.0, 0.0], sparse({0: 0.5, 3: 0.5}), 0.5),
        ([0.1, 0.2, 0.3, 0.4], sparse({3: 1.0}), 0.6),
        ([0.1, 0.2, 0.3, 0.4], sparse({2: 0.5, 3: 0.5}), 0.3),
    ],
)
def test_tv_distance_table(p, q, expected):
    assert tv_distance(torch.tensor(p), q) == pytest.approx(expected, abs=1e-6)


def test_tv_distance_matches_dense_formula_on_random_cases():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        vocab = 3 + trial % 10
        p = torch.softmax(3 * torch.randn(vocab, generator=gen), dim=-1)
        support = torch.randperm(vocab, generator=gen)[: 1 + trial % vocab]
        q = SparseDist(support, torch.softmax(torch.randn(len(support), generator=gen), dim=-1))
        assert tv_distance(p, q) == pytest.approx(dense_tv(p, q.dense(vocab)), abs=1e-5)


# -- speculative_verify: exact cases -------------------------------------------------------------


def one_hot_rows(targets: list[int], vocab: int = V) -> torch.Tensor:
    p = torch.zeros(len(targets), vocab)  # (k+1, V)
    p[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    return p


@pytest.mark.parametrize(
    "targets, drafts, accepted, tokens",
    [
        ([3], [], 0, [3]),  # no drafts: a plain decode step
        ([3, 5, 1, 2], [3, 5, 1], 3, [3, 5, 1, 2]),  # all accepted, then the bonus token
        ([3, 5, 1, 2], [4, 5, 1], 0, [3]),  # first rejected: the target's own token
        ([3, 5, 1, 2], [3, 6, 1], 1, [3, 5]),  # middle rejected; later drafts ignored
        ([3, 5, 1, 2], [3, 5, 7], 2, [3, 5, 1]),
        ([0, 0], [0], 1, [0, 0]),
    ],
)
def test_greedy_verify_table(targets, drafts, accepted, tokens):
    p = one_hot_rows(targets)
    q = [SparseDist.one_hot(t) for t in drafts]
    out = speculative_verify(p, drafts, q, generator=None, greedy=True)
    assert isinstance(out, VerifyOutcome)
    assert (out.accepted, out.tokens) == (accepted, tokens)
    assert out.tv == pytest.approx([0.0 if d == t else 1.0 for d, t in zip(drafts, targets)])


def test_greedy_verify_uses_argmax_of_non_one_hot_rows():
    p = torch.stack([P0, P1, P2])  # argmaxes 0, 2, 0
    out = speculative_verify(p, [0, 2], [SparseDist.one_hot(0), SparseDist.one_hot(2)], None, greedy=True)
    assert (out.accepted, out.tokens) == (2, [0, 2, 0])
    out = speculative_verify(p, [0, 1], [SparseDist.one_hot(0), SparseDist.one_hot(1)], None, greedy=True)
    assert (out.accepted, out.tokens) == (1, [0, 2])


@pytest.mark.parametrize("greedy", [True, False])
def test_verify_rejects_wrong_row_count(greedy):
    with pytest.raises(InvalidArgument, match="k\\+1"):
        speculative_verify(torch.stack([P0, P1]), [1, 2], [SparseDist.one_hot(1)] * 2, torch.Generator(), greedy)


@pytest.mark.parametrize("greedy", [True, False])
def test_verify_rejects_missing_proposals(greedy):
    with pytest.raises(InvalidArgument, match="proposal"):
        speculative_verify(torch.stack([P0, P1, P2]), [1, 2], [SparseDist.one_hot(1)], torch.Generator(), greedy)


def test_verify_rejects_draft_outside_its_proposal_support():
    with pytest.raises(InvalidArgument, match="zero proposal mass"):
        speculative_verify(torch.stack([P0, P1]), [4], [sparse({0: 0.5, 1: 0.5})], torch.Generator(), False)


def test_sampled_verify_always_accepts_when_q_equals_p():
    p = torch.stack([P0, P1, P2])
    q = [SparseDist(torch.arange(V), P0.clone()), SparseDist(torch.arange(V), P1.clone())]
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        out = speculative_verify(p, [seed % V, (seed * 3) % V], q, gen, greedy=False)
        assert out.accepted == 2
        assert out.tokens[:2] == [seed % V, (seed * 3) % V]
        assert len(out.tokens) == 3
        assert out.tv == pytest.approx([0.0, 0.0], abs=1e-6)


def test_sampled_verify_never_accepts_or_recovers_a_token_p_excludes():
    p_row = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    p = torch.stack([p_row, P1])
    q = [sparse({0: 0.5, 1: 0.25, 3: 0.25})]
    for seed in range(200):
        for draft in (0, 3):
            out = speculative_verify(p, [draft], q, torch.Generator().manual_seed(seed), greedy=False)
            assert out.accepted == 0
            assert out.tokens[0] in (1, 2)  # residual = max(p - q, 0) = {1: 0.25, 2: 0.5}


def test_sampled_verify_is_deterministic_for_a_seed():
    p = torch.stack([P0, P1, P2])
    q = [SparseDist(torch.arange(V), UNIFORM.clone()), sparse({2: 0.5, 4: 0.5})]
    outs = [
        [speculative_verify(p, [5, 4], q, torch.Generator().manual_seed(s), False).tokens for s in range(30)]
        for _ in range(2)
    ]
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs[0]}) > 1  # and the seed does matter


# -- speculative_verify: the output follows p exactly (statistical) ------------------------------


def empirical(tokens: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V).float()
    return counts / counts.sum()


def draw_drafts(q: SparseDist, n: int, seed: int) -> list[int]:
    """n draft tokens drawn from q, as a drafter would (vectorised)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.multinomial(q.probs, n, replacement=True, generator=gen)  # (n,)
    return q.token_ids[picks].tolist()


FIRST_POSITION_CASES = {
    # (a) dense q, full support, far from p.
    "dense": (P0, SparseDist(torch.arange(V), torch.tensor([0.05, 0.10, 0.20, 0.25, 0.05, 0.15, 0.10, 0.10]))),
    # (b) sparse q: a few tokens; p is sparse too, and q has mass (token 5) where p has none.
    "sparse": (
        torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0]),
        sparse({0: 0.1, 1: 0.5, 2: 0.2, 5: 0.2}),
    ),
    # (c) q with zero mass on most of p's support.
    "zero-mass": (P0, sparse({0: 0.2, 3: 0.5, 6: 0.3})),
}


@pytest.mark.slow  # statistical: thousands of verify draws per case
@pytest.mark.parametrize("case", sorted(FIRST_POSITION_CASES))
def test_first_emitted_token_follows_p(case):
    p0, q = FIRST_POSITION_CASES[case]
    p = torch.stack([p0, P1])  # (2, V): one draft, then the bonus row
    drafts = draw_drafts(q, DRAWS, seed=1)
    gen = torch.Generator().manual_seed(2)  # one generator reused, as a stream of rounds would
    firsts, accepted = [], 0
    for x in drafts:
        out = speculative_verify(p, [x], [q], gen, greedy=False)
        firsts.append(out.tokens[0])
        accepted += out.accepted
    tv_pq = dense_tv(p0, q.dense(V))
    assert dense_tv(empirical(firsts), p0) < TV_BOUND
    # Acceptance probability is sum_x min(p, q) = 1 - TV(p, q): the sampler is not just "emit p".
    assert accepted / DRAWS == pytest.approx(1.0 - tv_pq, abs=0.01)


@pytest.mark.slow  # statistical: thousands of verify draws
def test_second_emitted_token_follows_p_after_an_accepted_draft():
    """Condition on the first draft being accepted: the token emitted at position 2 must follow
    p row 1 (whether it is an accepted draft or a recovered token), and after two accepted drafts
    the bonus token must follow p row 2."""
    q0 = SparseDist(torch.arange(V), 0.8 * P0 + 0.2 * UNIFORM)  # close to p0: first draft mostly accepted
    q1 = sparse({1: 0.3, 2: 0.3, 5: 0.4})  # zero mass where p1 has mass, extra mass on 5
    p = torch.stack([P0, P1, P2])  # (3, V)
    n = 54_000
    x1 = draw_drafts(q0, n, seed=3)
    x2 = draw_drafts(q1, n, seed=4)
    gen = torch.Generator().manual_seed(5)
    firsts, seconds, bonuses = [], [], []
    for a, b in zip(x1, x2):
        out = speculative_verify(p, [a, b], [q0, q1], gen, greedy=False)
        firsts.append(out.tokens[0])
        if out.accepted >= 1:
            seconds.append(out.tokens[1])
        if out.accepted == 2:
            bonuses.append(out.tokens[2])
    assert len(seconds) >= DRAWS, "construct q0 closer to p0 so that enough first drafts are accepted"
    assert dense_tv(empirical(firsts), P0) < TV_BOUND
    assert dense_tv(empirical(seconds), P1) < TV_BOUND
    assert len(bonuses) > 20_000
    assert dense_tv(empirical(bonuses), P2) < TV_BOUND
    # Sanity of the construction: conditioning on acceptance really selected a subset.
    assert len(bonuses) < len(seconds) < n


# -- speculative_verify_tree: several drafts for a position (runner-up leaves) ----------------------


def draw_without_replacement(q: SparseDist, m: int, gen: torch.Generator) -> list[int]:
    """m distinct tokens drawn from q one after another, each from q without the ones before it (as
    the white-box drafter draws its chain token and then its leaves)."""
    left = q.probs.clone().float()
    out = []
    for _ in range(m):
        j = int(torch.multinomial(left, 1, generator=gen))
        out.append(int(q.token_ids[j]))
        left[j] = 0.0
    return out


def test_a_chain_tree_is_speculative_verify_exactly():
    """One child per node: the tree walk draws what the chain rule draws, seed for seed."""
    p = torch.stack([P0, P1, P2])
    q = [SparseDist(torch.arange(V), UNIFORM.clone()), sparse({2: 0.5, 4: 0.5})]
    for seed in range(60):
        drafts = [seed % V, (2, 4)[seed % 2]]
        chain = speculative_verify(p, drafts, q, torch.Generator().manual_seed(seed), False)
        path, last = speculative_verify_tree(p, drafts, q, (ROOT, 0), torch.Generator().manual_seed(seed))
        assert (len(path), [drafts[i] for i in path] + [last]) == (chain.accepted, chain.tokens)


def test_a_sampled_tree_breaking_the_sibling_contract_is_named():
    q = sparse({1: 0.5, 2: 0.3, 3: 0.2})
    assert sibling_draws([1, 2, 3], [q, q, q], (ROOT, ROOT, ROOT)) is None
    assert sibling_draws([2, 1, 2], [q, q, q], (ROOT, ROOT, 0)) is None  # a token again under another parent
    assert "repeats a sibling's token 2" in sibling_draws([1, 2, 2], [q, q, q], (ROOT, 0, 0))
    assert "another q than its first sibling" in sibling_draws([1, 2], [q, sparse({2: 1.0})], (ROOT, ROOT))
    with pytest.raises(InvalidArgument, match="zero proposal mass"):
        speculative_verify_tree(torch.stack([P0, P1, P2]), [7, 1], [q, q], (ROOT, ROOT), torch.Generator())
    with pytest.raises(InvalidArgument, match="1 \\+ 2 target rows"):
        speculative_verify_tree(torch.stack([P0, P1]), [1, 2], [q, q], (ROOT, ROOT), torch.Generator())


def test_a_sibling_p_excludes_is_never_accepted_nor_recovered():
    p_row = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    q = sparse({0: 0.4, 3: 0.3, 1: 0.3})
    p = torch.stack([p_row, P1, P1, P1])
    for seed in range(200):
        path, last = speculative_verify_tree(p, [0, 3, 1], [q, q, q], (ROOT, ROOT, ROOT), torch.Generator().manual_seed(seed))
        assert path in ([], [2])
        assert (last in (1, 2)) if not path else True


@pytest.mark.slow  # statistical: thousands of tree walks per case
@pytest.mark.parametrize("case", sorted(FIRST_POSITION_CASES))
@pytest.mark.parametrize("m", [2, 3])
def test_the_first_emitted_token_of_a_tree_follows_p_and_more_are_accepted(case, m):
    """m children of the root drawn from q without replacement: the first emitted token follows p,
    and a draft is accepted more often than one draft alone would be (1 - TV(p, q))."""
    p0, q = FIRST_POSITION_CASES[case]
    m = min(m, int((q.probs > 0).sum()))
    p = torch.cat([p0[None], P1.expand(m, V)])  # (1 + m, V)
    drafts = torch.Generator().manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    firsts, accepted = [], 0
    for _ in range(DRAWS):
        tokens = draw_without_replacement(q, m, drafts)
        path, last = speculative_verify_tree(p, tokens, [q] * m, (ROOT,) * m, gen)
        firsts.append(tokens[path[0]] if path else last)
        accepted += bool(path)
    assert dense_tv(empirical(firsts), p0) < TV_BOUND
    assert accepted / DRAWS > 1.0 - dense_tv(p0, q.dense(V)) + 0.02


@pytest.mark.slow  # statistical: thousands of tree walks
def test_the_second_emitted_token_follows_the_row_of_the_accepted_node():
    """A chain of two with two leaves beside its first node (the drafter's shape): the first token
    follows p's root row; after the chain's node, the next token follows that node's row (accepted
    second draft, recovered token or bonus), after a leaf the leaf's own row (its bonus)."""
    q0 = SparseDist(torch.arange(V), 0.3 * P0 + 0.7 * UNIFORM)
    q1 = sparse({1: 0.3, 2: 0.3, 5: 0.4})
    leaf_row = torch.tensor([0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.3, 0.4])
    parents = (ROOT, 0, ROOT, ROOT)  # chain 0 -> 1; nodes 2 and 3 are leaves beside node 0
    p = torch.stack([P0, P1, P2, leaf_row, leaf_row])  # rows: root, after node 0, 1, 2, 3
    drafts = torch.Generator().manual_seed(3)
    gen = torch.Generator().manual_seed(4)
    firsts, after_chain, after_leaf = [], [], []
    for _ in range(60_000):
        first, *leaves = draw_without_replacement(q0, 3, drafts)
        second = int(q1.token_ids[torch.multinomial(q1.probs, 1, generator=drafts)])
        tokens = [first, second, *leaves]
        path, last = speculative_verify_tree(p, tokens, [q0, q1, q0, q0], parents, gen)
        emitted = [tokens[i] for i in path] + [last]
        firsts.append(emitted[0])
        if path and path[0] == 0:
            after_chain.append(emitted[1])
        elif path:
            after_leaf.append(emitted[1])
    assert dense_tv(empirical(firsts), P0) < TV_BOUND
    assert len(after_chain) > 20_000 and len(after_leaf) > 5_000
    assert dense_tv(empirical(after_chain), P1) < TV_BOUND
    assert dense_tv(empirical(after_leaf), leaf_row) < 2 * TV_BOUND
