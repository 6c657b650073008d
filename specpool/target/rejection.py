"""Speculative sampling: verify k draft tokens against the target's distributions.

Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding" (2023);
Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling" (2023).
Accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a
*recovered* token from norm(max(p_i - q_i, 0)); if all k are accepted emit a *bonus* token from
p_{k+1}. The output then follows p exactly, whatever q is, as long as x_i was drawn from q_i.

Several drafts for one position (the runner-up leaves of a draft tree, specpool/target/tree.py)
are verified by *recursive* rejection sampling without replacement (Jeon et al. 2024, "Recursive
Speculative Decoding"; the multi-draft rule of SpecInfer, Miao et al. 2024, with draws without
replacement): ``speculative_verify_tree``.

Pure math on tensors: no model, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpool.core.errors import InvalidArgument
from specpool.target.tree import ROOT


@dataclass(frozen=True)
class SparseDist:
    """A distribution given by its support: ``probs[j]`` is the mass of ``token_ids[j]``.

    Drafters sample from a top-K truncated, renormalised distribution and send exactly that, so
    the sparse q is the true proposal (docs/ARCHITECTURE.md). Mass outside ``token_ids`` is zero.
    """

    token_ids: torch.Tensor  # (K,) int64
    probs: torch.Tensor  # (K,) float32, sums to 1

    @staticmethod
    def one_hot(token_id: int) -> "SparseDist":
        return SparseDist(torch.tensor([token_id], dtype=torch.long), torch.ones(1))

    def dense(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        out = torch.zeros(vocab_size, device=device)  # (V,)
        out.index_put_((self.token_ids.to(device),), self.probs.to(device).float(), accumulate=True)
        return out


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: int  # number of draft tokens accepted (a prefix)
    tokens: list[int]  # accepted drafts followed by one recovered or bonus token
    tv: list[float]  # TV(p_j, q_j) for each of the k draft positions


def tv_distance(p: torch.Tensor, q: SparseDist) -> float:
    """TV(p, q) = 1/2 sum |p - q| for dense p (V,) and sparse q, without densifying q."""
    ids = q.token_ids.to(p.device)
    p_on_support = p[ids]  # (K,)
    inside = (p_on_support - q.probs.to(p.device)).abs().sum()
    outside = (1.0 - p_on_support.sum()).clamp_min(0.0)  # q has no mass there
    return float(0.5 * (inside + outside))


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def speculative_verify(
    p: torch.Tensor,
    draft_tokens: list[int],
    q: list[SparseDist],
    generator: torch.Generator | None,
    greedy: bool,
) -> VerifyOutcome:
    """Run the acceptance rule over one round.

    p: (k+1, V) target distributions; row j is the distribution of the token after draft j-1
    (row 0 follows the context, row k gives the bonus token).
    """
    k = len(draft_tokens)
    if p.shape[0] != k + 1:
        raise InvalidArgument(f"need k+1={k + 1} target rows, got {p.shape[0]}")
    if len(q) != k:
        raise InvalidArgument(f"need one proposal distribution per draft token: {k} drafts, {len(q)} q")
    tv = [tv_distance(p[j], q[j]) for j in range(k)]

    if greedy:
        # p is one-hot, so min(1, p/q) is 1 exactly on the argmax and the residual is the argmax.
        targets = p.argmax(dim=-1).tolist()  # (k+1,)
        accepted = 0
        while accepted < k and draft_tokens[accepted] == targets[accepted]:
            accepted += 1
        return VerifyOutcome(accepted, list(draft_tokens[:accepted]) + [targets[accepted]], tv)

    # One uniform per draft position, drawn up front so the number of draws does not depend on
    # the outcome (keeps a seed's stream stable whatever happens).
    uniforms = torch.rand(k, generator=generator, device=p.device) if k else None
    for j, (token, q_j) in enumerate(zip(draft_tokens, q)):
        ids = q_j.token_ids.to(p.device)
        hit = (ids == token).nonzero()
        if hit.numel() == 0:
            raise InvalidArgument(f"draft token {token} at position {j} has zero proposal mass")
        q_x = float(q_j.probs[int(hit[0])])
        p_x = float(p[j, token])
        if float(uniforms[j]) * q_x < p_x:  # u < p/q, i.e. accept with probability min(1, p/q)
            continue
        residual = p[j].clone()  # (V,)
        residual.index_put_((ids,), -q_j.probs.to(p.device).float(), accumulate=True)
        residual.clamp_(min=0.0)
        total = float(residual.sum())
        # A rejection implies p(x) < q(x) somewhere, so the residual has mass; the guard only
        # covers float round-off when p and q are nearly equal.
        recovered = _sample(residual / total if total > 1e-12 else p[j], generator)
        return VerifyOutcome(j, list(draft_tokens[:j]) + [recovered], tv)
    return VerifyOutcome(k, list(draft_tokens) + [_sample(p[k], generator)], tv)


def sibling_draws(tokens: list[int], q: list[SparseDist], parents: tuple[int, ...] | list[int]) -> str | None:
    """Why a sampled draft tree breaks the contract ``speculative_verify_tree`` relies on, or None:
    the children of a node must be distinct tokens with one shared q (drawn from it without
    replacement, in node order)."""
    first: dict[int, int] = {}
    for i, parent in enumerate(parents):
        j = first.setdefault(parent, i)
        if j == i:
            continue
        if tokens[i] in {tokens[c] for c in range(j, i) if parents[c] == parent}:
            return f"draft tree node {i} repeats a sibling's token {tokens[i]}: siblings are draws without replacement"
        if not (torch.equal(q[i].token_ids, q[j].token_ids) and torch.equal(q[i].probs, q[j].probs)):
            return f"draft tree node {i} has another q than its first sibling, node {j}: siblings share one q"
    return None


def speculative_verify_tree(p: torch.Tensor, tokens: list[int], q: list[SparseDist], parents: tuple[int, ...] | list[int],
                            generator: torch.Generator | None) -> tuple[list[int], int]:
    """Sampled acceptance over a draft tree: (the accepted path as node indices, root's child
    first; the recovered or bonus token). ``p`` (1 + N, V): row 0 is the target's distribution
    after the last context token, row 1 + i after node i.

    Walking down from the root, the children of the current node are tried in order. A node's
    children x_1, x_2, .. were drawn from one q *without replacement* (``sibling_draws``): x_i from
    q_i = q with x_1..x_{i-1} removed, renormalised. Child i is accepted with probability
    min(1, r_i(x_i) / q_i(x_i)), where r_1 = p and r_{i+1} = norm(max(r_i - q_i, 0)) after a
    rejection. Each step is the one-draft rule of ``speculative_verify`` for the target r_i with the
    proposal q_i, so by induction from the last (no children left: emit a token from r), the token
    emitted at the node follows p; an accepted child continues the walk with its own children
    (drafted given it) or, without any, emits a bonus token from p after it. A chain (one child per
    node) is ``speculative_verify`` exactly, uniforms included (one per node, drawn up front)."""
    n = len(tokens)
    if p.shape[0] != n + 1:
        raise InvalidArgument(f"need 1 + {n} target rows for a tree of {n} nodes, got {p.shape[0]}")
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    uniforms = torch.rand(n, generator=generator, device=p.device) if n else None
    path: list[int] = []
    current = ROOT
    while True:
        kids = children.get(current)
        if not kids:
            return path, _sample(p[current + 1], generator)
        residual = p[current + 1]  # r_1 = p
        q_left = q[kids[0]].dense(p.shape[-1], p.device)  # q_1, then q_i with earlier siblings removed
        for child in kids:
            x = tokens[child]
            q_x = float(q_left[x])
            if q_x <= 0.0:
                raise InvalidArgument(f"draft tree node {child} (token {x}) has zero proposal mass")
            if float(uniforms[child]) * q_x < float(residual[x]):  # accept with probability min(1, r/q)
                path.append(child)
                current = child
                break
            rest = (residual - q_left).clamp_(min=0.0)
            total = float(rest.sum())
            # A rejection implies r < q somewhere, so the rest has mass; the guard only covers
            # float round-off when r and q_i are nearly equal.
            residual = rest / total if total > 1e-12 else residual
            q_left = q_left.clone()
            q_left[x] = 0.0
            left = float(q_left.sum())
            q_left = q_left / left if left > 0.0 else q_left
        else:
            return path, _sample(residual, generator)
