"""How well a drafter network matches the target on feedback records, and whether a candidate
version is worse than the serving one.

BD is MetaSD's block divergence (Kim et al. 2024; specpool/router/policies.py) per draft
position, 1 - TV(p, q) for the q the drafter proposes from: the probability that the drafted token
is accepted by rejection sampling (Leviathan et al., "Fast inference from transformers via
speculative decoding", 2023). The target's p is known only on its top-K, so TV is the lower bound
``sparse_tv``. ``paired`` compares two versions position by position on the same held-out
records (a paired z statistic): the learner's rollback check (specpool/learning/learner_loop.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpool.learning.batches import make_batch, vocab_map_for
from specpool.learning.feedback import FeedbackRecord
from specpool.learning.zoo_train import distillation_loss


def sparse_tv(p_ids: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) when p is known only on its top-K: the lower bound that puts p's unknown rest
    where q's rest is, 1/2 (sum_K |p_i - q_i| + |(1 - sum_K p) - (1 - sum_K q)|).

    p_ids (N, K) indices into q's last axis, -1 where q has no such entry (q = 0 there);
    p (N, K); q (N, V). Returns (N,).
    """
    present = p_ids >= 0
    q_on = q.gather(-1, p_ids.clamp_min(0)) * present  # (N, K)
    inside = (p - q_on).abs().sum(-1)
    rest = ((1.0 - p.sum(-1)) - (1.0 - q_on.sum(-1))).abs()
    return 0.5 * (inside + rest)

@dataclass(frozen=True)
class Evaluation:
    """How a drafter network does on feedback records, per draft position. BD = mean of
    1 - TV(p, q) for the q the drafter would propose from: ``bd_greedy`` for greedy drafting
    (q one-hot on its argmax, so 1 - TV = p(argmax), 0 when the argmax is outside the target's
    top-K: a lower bound), ``bd_soft`` for sampling at temperature 1 (q its full softmax)."""

    bd_greedy: float
    bd_soft: float
    agreement: float  # share of draft positions where the drafter's argmax is the target's
    loss: float  # distillation loss over all supervised positions
    positions: int

    def bd(self, metric: str) -> float:
        return self.bd_greedy if metric == "greedy" else self.bd_soft


@torch.inference_mode()
def _per_position(model: nn.Module, records: Sequence[FeedbackRecord]):
    """(1 - TV greedy, 1 - TV soft, agreement) per draft position (N,) each, and the loss; on the
    model's own vocabulary (two versions may differ in it when the vocabulary grows)."""
    vocab_map = vocab_map_for(model)
    batch = make_batch(records, vocab_map, bonus=True)
    drafts = make_batch(records, vocab_map, bonus=False)
    # Every draft position counts (also those whose top-K is outside the vocabulary: TV ~ 1 there).
    rows = drafts.probs.sum(-1) > 0  # (B, L)
    needed = batch.mask | rows  # the head runs at these positions only (a record's last k + 1)
    at = torch.full(needed.shape, -1, dtype=torch.long)
    at[needed] = torch.arange(int(needed.sum()))
    log_q = F.log_softmax(model.logits_at(batch.inputs.to(model.device), needed.to(model.device)).float().cpu(), dim=-1)  # (N', V_r)
    loss = float(distillation_loss(log_q[at[batch.mask]], batch.ids[batch.mask], batch.probs[batch.mask]))
    ids, probs = drafts.ids[rows], drafts.probs[rows]  # (N, K)
    q = log_q[at[rows]].exp()  # (N, V_r)
    soft = 1 - sparse_tv(ids, probs, q)
    top = ids.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1)  # (N,) target argmax, reduced index or -1
    draft = q.argmax(-1)  # (N,) the greedy draft, reduced index
    greedy = (probs * (ids == draft[:, None])).sum(-1)  # p(greedy draft)
    return greedy, soft, (draft == top).float(), loss


def evaluate(model: nn.Module, records: Sequence[FeedbackRecord]) -> Evaluation:
    """How well a drafter network matches the target on ``records`` (e.g. held-out feedback)."""
    if not records:
        return Evaluation(float("nan"), float("nan"), float("nan"), float("nan"), 0)
    greedy, soft, agreement, loss = _per_position(model, records)
    return Evaluation(float(greedy.mean()), float(soft.mean()), float(agreement.mean()), loss, len(greedy))


@dataclass(frozen=True)
class Comparison:
    """Candidate minus serving version on the same positions (paired)."""

    candidate_bd: float
    serving_bd: float
    z: float  # mean paired difference / its standard error (negative: the candidate is worse)
    positions: int

    def regressed(self, drop: float, z_min: float) -> bool:
        """Worse by more than ``drop`` and not by chance (|z| > ``z_min``)."""
        return self.candidate_bd < self.serving_bd - drop and self.z < -z_min


def compare(candidate: nn.Module, serving: nn.Module, records: Sequence[FeedbackRecord],
            metric: str = "greedy") -> Comparison:
    """Paired BD comparison of two versions of a drafter on held-out records."""
    index = 0 if metric == "greedy" else 1
    return paired(_per_position(candidate, records)[index], _per_position(serving, records)[index])


def record_bd(model: nn.Module, records: Sequence[FeedbackRecord], metric: str = "greedy") -> list[torch.Tensor]:
    """BD (1 - TV, greedy or soft) at each draft position, one tensor per record: a version's
    scores on a held-out record never change, so the learner keeps the serving version's."""
    if not records:
        return []
    values = _per_position(model, records)[0 if metric == "greedy" else 1]  # (N,), record by record
    counts = [sum(1 for row in r.target_probs[: len(r.draft)] if sum(row) > 0) for r in records]
    return list(values.split(counts))


def paired(a: torch.Tensor, b: torch.Tensor) -> Comparison:
    """The comparison of candidate scores ``a`` with serving scores ``b`` on the same positions (N,)."""
    diff = (a - b).double()
    se = float(diff.std(unbiased=True)) / math.sqrt(len(diff)) if len(diff) > 1 else float("inf")
    z = float(diff.mean()) / se if se > 0 else (0.0 if float(diff.mean()) == 0 else math.copysign(float("inf"), float(diff.mean())))
    return Comparison(float(a.mean()), float(b.mean()), z, len(diff))
