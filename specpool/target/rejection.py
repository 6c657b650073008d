"""Speculative sampling: verify k draft tokens against the target's distributions.

Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding" (2023);
Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling" (2023).
Accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a
*recovered* token from norm(max(p_i - q_i, 0)); if all k are accepted emit a *bonus* token from
p_{k+1}. The output then follows p exactly, whatever q is, as long as x_i was drawn from q_i.

Pure math on tensors: no model, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpool.core.errors import InvalidArgument


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
