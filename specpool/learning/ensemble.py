"""An online ensemble of zoo drafter networks served as one drafter (``MemberMixture``, its base,
also serves a white-box heads' ensemble: specpool/learning/online_heads.py).

The ``hedge`` algorithm (specpool/learning/online.py) learns members that differ only in their
step size and weights them by Hedge (Freund & Schapire 1997). The drafter's q is the mixture in
output-distribution space, q = sum_i w_i q_i (``mixture_log_probs``, ``ZooEnsembleLM``), so it
still samples from, and reports, one exact proposal distribution: verification stays lossless.
``served_weights`` leaves the members Hedge has all but dropped out of the served mixture (each
served member drafts at full cost whatever its weight).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpool.core.errors import InvalidArgument
from specpool.drafters.zoo_model import KVCache, ZooOutput


def served_weights(weights: torch.Tensor, minimum: float) -> torch.Tensor:
    """Hedge weights (M,) with those below ``minimum`` set to 0 (the largest always kept), renormalised."""
    kept = torch.where(weights >= minimum, weights, torch.zeros_like(weights))
    top = int(weights.argmax())
    kept[top] = weights[top]
    return kept / kept.sum()


def mixture_log_probs(logits: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """log q of the mixture q = sum_i w_i softmax(logits_i), from each member's logits (..., V_r)."""
    if len(logits) == 1:
        return F.log_softmax(logits[0].float(), dim=-1)
    parts = [F.log_softmax(l.float(), dim=-1) + torch.log(w.clamp_min(1e-30)) for l, w in zip(logits, weights)]
    return torch.logsumexp(torch.stack(parts), dim=0)


# --- the ensemble as one drafter network --------------------------------------------------------


class EnsembleCache:
    """One KV cache per member, cropped together."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def get_seq_length(self) -> int:
        return self.caches[0].get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        for cache in self.caches:
            cache.crop(tokens_to_remove)


class MemberMixture(nn.Module):
    """What an ensemble of drafting networks (zoo networks, white-box heads: online_heads.py) shares:
    its members, their weights (M,), and the members' vocabulary, device and caches."""

    def __init__(self, members: list[nn.Module], weights: torch.Tensor):
        super().__init__()
        if len(members) != len(weights):
            raise InvalidArgument(f"{len(members)} members but {len(weights)} weights")
        self.members = nn.ModuleList(members)
        self.register_buffer("weights", weights.float().clone())  # (M,)
        self.config = members[0].config

    @property
    def vocab_ids(self) -> torch.Tensor:
        return self.members[0].vocab_ids

    @property
    def vocab_size(self) -> int:
        return self.members[0].vocab_size

    @property
    def device(self) -> torch.device:
        return self.members[0].device

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([m.new_cache() for m in self.members])


class ZooEnsembleLM(MemberMixture):
    """Members combined in output-distribution space: its "logits" are log(sum_i w_i q_i), so
    softmax of them is the mixture q (and the drafter's top-K/temperature apply to the mixture)."""

    def logits_at(self, input_ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """log of the mixture q (N, V_r) at the positions ``where`` marks (as ``ZooLM.logits_at``)."""
        return mixture_log_probs([m.logits_at(input_ids, where) for m in self.members], self.weights)

    def forward(self, input_ids: torch.Tensor, cache: EnsembleCache | None = None, use_cache: bool = True,
                logits_to_keep: int = 0) -> ZooOutput:
        caches = cache.caches if (cache is not None and use_cache) else [None] * len(self.members)
        logits = [member(input_ids, member_cache, use_cache=member_cache is not None, logits_to_keep=logits_to_keep).logits
                  for member, member_cache in zip(self.members, caches)]  # each (B, T, V_r)
        return ZooOutput(mixture_log_probs(logits, self.weights))
