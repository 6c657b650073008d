"""The online learners' update rules, as pure tensor math (no model, no I/O; unit-tested with
tables of cases in tests/unit/test_online.py). ``OnlineDrafterLearner`` (specpool/learning/online.py)
applies them to a drafter's trainable weights w:

- ``ogd_step``: online gradient descent, w <- w - eta * g_t (Zinkevich, "Online convex programming
  and generalized infinitesimal gradient ascent", 2003);
- ``optimistic_step``: optimistic OGD with the previous gradient as hint,
  w <- w - eta * (2 g_t - g_{t-1}) (Rakhlin & Sridharan, "Online learning with predictable
  sequences", 2013; Chiang et al., "Online optimization with gradual variations", 2012);
- ``clip_grads``: gradients scaled to a fixed global norm (OGD's regret bound assumes bounded
  gradients; clipping enforces it);
- ``adagrad_scale``: diagonal AdaGrad's per-coordinate step sizes (Duchi, Hazan & Singer,
  "Adaptive subgradient methods for online learning and stochastic optimization", 2011;
  McMahan & Streeter 2010);
- ``hedge_update``: Hedge's multiplicative weights over ensemble members (Freund & Schapire,
  "A decision-theoretic generalization of on-line learning", 1997) with fixed share (Herbster &
  Warmuth, "Tracking the best expert", 1998).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def ogd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float) -> None:
    """w <- w - lr * g, in place."""
    with torch.no_grad():
        torch._foreach_add_(list(params), list(grads), alpha=-lr)


def optimistic_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    previous: Sequence[torch.Tensor] | None, lr: float) -> None:
    """w <- w - lr * (2 g_t - g_{t-1}), in place; ``previous`` None means no hint yet (g_0 := g_1)."""
    if previous is None:
        ogd_step(params, grads, lr)
        return
    with torch.no_grad():
        for p, g, h in zip(params, grads, previous):
            p.sub_(2 * g - h, alpha=lr)


def clip_grads(grads: Sequence[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """The gradients scaled to at most ``max_norm`` global L2 norm (non-finite ones zeroed)."""
    grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
    # (torch._foreach_*: one call over all tensors; a step's elementwise work is a good part of
    # a small drafter's learning cost.)
    norm = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(grads))) if grads else 0.0
    scale = min(1.0, max_norm / (norm + 1e-12))
    if scale < 1.0:
        torch._foreach_mul_(grads, scale)  # the nan_to_num copies are ours to scale
    return grads


def adagrad_scale(grads: Sequence[torch.Tensor], accumulated: list[torch.Tensor] | None,
                  eps: float = 1e-8) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Diagonal AdaGrad: G <- G + g^2, g <- g / (sqrt(G) + eps). Returns (scaled gradients, new G);
    ``accumulated`` None starts from G = 0."""
    grads = list(grads)
    if accumulated is None:
        accumulated = [torch.zeros_like(g) for g in grads]
    new = list(torch._foreach_addcmul(accumulated, grads, grads))  # G + g^2, new tensors (G is not changed)
    denominators = torch._foreach_sqrt(new)
    torch._foreach_add_(denominators, eps)
    return list(torch._foreach_div(grads, denominators)), new


def hedge_update(weights: torch.Tensor, losses: torch.Tensor, eta: float, share: float = 0.0) -> torch.Tensor:
    """Hedge (Freund & Schapire 1997): w_i <- w_i exp(-eta l_i) / Z, then fixed share
    (Herbster & Warmuth 1998): w <- (1 - share) w + share / M. ``weights`` (M,) sum to 1."""
    log_w = torch.log(weights.double().clamp_min(1e-300)) - eta * losses.double()  # (M,)
    w = torch.softmax(log_w, dim=0)
    w = (1.0 - share) * w + share / len(w)
    return w.to(weights.dtype)
