"""Online learning of zoo drafters from verification feedback.

OnlineSpec's observation (Liu et al., "Online Speculative Decoding", 2023): the target's
verification already computes its distribution p at every drafted position, so serving produces
distillation data for free, on exactly the traffic the drafter sees. Each feedback record
(drafters/feedback.py) is one small distillation example: the sequence context-tail + draft, and
the target's sparse top-K p at its last k+1 positions. The loss is the offline one
(``drafters.zoo_train.distillation_loss``, soft cross-entropy = KL(p || q) up to p's entropy) on
the drafter's reduced vocabulary; a target token outside that vocabulary cannot be proposed, so
its mass is left out of the loss, and a position where the whole top-K falls outside is skipped.

Three online algorithms over the drafter's weights w (embedding frozen, as offline):

- ``ogd``: online gradient descent, w <- w - eta * g_t (Zinkevich 2003), on gradients clipped to a
  fixed norm (OGD's regret bound assumes bounded gradients; clipping enforces it).
- ``optimistic``: optimistic OGD with the previous gradient as hint (Rakhlin & Sridharan 2013;
  Chiang et al. 2012): w <- w - eta * (2 g_t - g_{t-1}); the first step, with no hint yet, is a
  plain OGD step (g_0 := g_1).
- ``hedge``: an online ensemble of members that differ only in their learning rate; each member
  runs its own OGD (or optimistic OGD), and the members are weighted by Hedge (Freund & Schapire,
  "A decision-theoretic generalization of on-line learning", 1997) on their *live* losses - each
  member's loss on a record measured before it learns from it - with a small fixed share
  (Herbster & Warmuth 1998) so that a member can recover after drift. The drafter's q is the
  mixture in output-distribution space, q = sum_i w_i q_i (``ZooEnsembleLM``), so it still
  samples from, and reports, one exact proposal distribution: verification stays lossless.

With ``precondition="adagrad"`` every algorithm takes per-coordinate steps (diagonal AdaGrad,
Duchi, Hazan & Singer 2011): a plain global step lets the output bias, whose gradient dominates
the norm, absorb nearly all of a clipped step.

Pure math (``ogd_step``, ``optimistic_step``, ``hedge_update``, ``sparse_tv``) has no model and
is unit-tested with tables of cases.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from drafters.feedback import FeedbackRecord
from drafters.zoo_model import KVCache, ZooLM, ZooOutput
from drafters.zoo_train import distillation_loss
from router.errors import InvalidArgument, ModelUnavailable

ALGORITHMS = ("ogd", "optimistic", "hedge")


def parse_step_sizes(text: str) -> tuple[float, ...]:
    """The Hedge members' step sizes from "0.01,0.05,0.2" (command lines of generate, learner, bench)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidArgument(f"the hedge step sizes are comma-separated numbers, got {text!r}") from None


@dataclass(frozen=True)
class OnlineConfig:
    algorithm: str = "ogd"  # "ogd" | "optimistic" | "hedge"
    # Step sizes: per coordinate under AdaGrad (the default). Tuned by replaying the 150-prompt
    # Gutenberg stream offline (scripts/online_replay.py): AdaGrad at 1e-3..3e-3 gave +12 % mean
    # accepted length on the last third, plain OGD at its best step (0.05) +8 %, at 0.3 nothing.
    lr: float = 0.002  # eta of OGD / optimistic OGD, per step on a clipped gradient
    clip_norm: float = 1.0  # gradients are scaled down to at most this global norm
    hedge_lrs: tuple[float, ...] = (0.0005, 0.002, 0.008)  # the ensemble members' learning rates
    hedge_member: str = "ogd"  # the members' own update: "ogd" or "optimistic"
    hedge_eta: float = 1.0  # Hedge's learning rate on (capped) losses in nats
    hedge_share: float = 0.01  # fixed share: each member keeps at least share / M of the weight
    loss_cap: float = 10.0  # live losses are capped here: Hedge needs bounded losses
    # "adagrad": per-coordinate step sizes eta / sqrt(sum of squared past gradients) (Duchi, Hazan
    # & Singer 2011; McMahan & Streeter 2010), in every algorithm; "none": one global step size.
    precondition: str = "adagrad"
    adagrad_eps: float = 1e-8

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise InvalidArgument(f"unknown online algorithm {self.algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        if self.precondition not in ("none", "adagrad"):
            raise InvalidArgument(f"precondition is none or adagrad, not {self.precondition!r}")
        if self.hedge_member not in ("ogd", "optimistic"):
            raise InvalidArgument(f"hedge members run ogd or optimistic, not {self.hedge_member!r}")
        lrs = self.hedge_lrs if self.algorithm == "hedge" else (self.lr,)
        if not lrs or any(not math.isfinite(x) or x < 0 for x in lrs):
            raise InvalidArgument(f"learning rates must be finite and >= 0, got {lrs}")
        if self.clip_norm <= 0 or self.hedge_eta < 0 or not 0 <= self.hedge_share < 1 or self.loss_cap <= 0:
            raise InvalidArgument("clip_norm and loss_cap must be > 0, hedge_eta >= 0, 0 <= hedge_share < 1")


# --- pure math ----------------------------------------------------------------------------------


def ogd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float) -> None:
    """w <- w - lr * g, in place."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(g, alpha=lr)


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
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    scale = min(1.0, max_norm / (norm + 1e-12))
    return [g * scale for g in grads] if scale < 1.0 else grads


def adagrad_scale(grads: Sequence[torch.Tensor], accumulated: list[torch.Tensor] | None,
                  eps: float = 1e-8) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Diagonal AdaGrad: G <- G + g^2, g <- g / (sqrt(G) + eps). Returns (scaled gradients, new G);
    ``accumulated`` None starts from G = 0."""
    if accumulated is None:
        accumulated = [torch.zeros_like(g) for g in grads]
    new = [a + g * g for a, g in zip(accumulated, grads)]
    return [g / (a.sqrt() + eps) for g, a in zip(grads, new)], new


def hedge_update(weights: torch.Tensor, losses: torch.Tensor, eta: float, share: float = 0.0) -> torch.Tensor:
    """Hedge (Freund & Schapire 1997): w_i <- w_i exp(-eta l_i) / Z, then fixed share
    (Herbster & Warmuth 1998): w <- (1 - share) w + share / M. ``weights`` (M,) sum to 1."""
    log_w = torch.log(weights.double().clamp_min(1e-300)) - eta * losses.double()  # (M,)
    w = torch.softmax(log_w, dim=0)
    w = (1.0 - share) * w + share / len(w)
    return w.to(weights.dtype)


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


# --- batches of records -------------------------------------------------------------------------


@dataclass(frozen=True)
class FeedbackBatch:
    inputs: torch.Tensor  # (B, L) context tail + draft, right-padded
    ids: torch.Tensor  # (B, L, K) target top-K mapped into the reduced vocabulary, -1 outside
    probs: torch.Tensor  # (B, L, K)
    mask: torch.Tensor  # (B, L) positions with at least one target token inside the vocabulary

    @property
    def positions(self) -> int:
        return int(self.mask.sum())


def vocab_map_for(model: ZooLM) -> torch.Tensor:
    """(V,) full token id -> reduced-vocabulary index, -1 where the drafter cannot propose it."""
    vocab_map = torch.full((model.embedding.shape[0],), -1, dtype=torch.long)
    vocab_map[model.vocab_ids.cpu()] = torch.arange(len(model.vocab_ids))
    return vocab_map


def make_batch(records: Sequence[FeedbackRecord], vocab_map: torch.Tensor, bonus: bool = True) -> FeedbackBatch:
    """Records as one padded batch. Logits at position t predict token t+1, so the target's row j
    (the token after context + draft[:j]) sits at t = len(context) - 1 + j. ``bonus`` False
    leaves out the last row (BD is defined over the k draft positions only)."""
    length = max(len(r.context) + len(r.draft) for r in records)
    width = max(len(row) for r in records for row in r.target_ids)
    inputs = torch.zeros(len(records), length, dtype=torch.long)
    ids = torch.full((len(records), length, width), -1, dtype=torch.long)
    probs = torch.zeros(len(records), length, width)
    for b, r in enumerate(records):
        seq = r.context + r.draft
        inputs[b, : len(seq)] = torch.tensor(seq)
        rows = len(r.target_ids) if bonus else len(r.draft)
        for j in range(rows):
            t = len(r.context) - 1 + j
            row = torch.tensor(r.target_ids[j])
            ids[b, t, : len(row)] = vocab_map[row]
            probs[b, t, : len(row)] = torch.tensor(r.target_probs[j])
    mask = (ids >= 0).any(-1)  # (B, L)
    return FeedbackBatch(inputs, ids, probs, mask)


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


class ZooEnsembleLM(nn.Module):
    """Members combined in output-distribution space: its "logits" are log(sum_i w_i q_i), so
    softmax of them is the mixture q (and the drafter's top-K/temperature apply to the mixture)."""

    def __init__(self, members: list[ZooLM], weights: torch.Tensor):
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
    def device(self) -> torch.device:
        return self.members[0].device

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([m.new_cache() for m in self.members])

    def forward(self, input_ids: torch.Tensor, cache: EnsembleCache | None = None, use_cache: bool = True,
                logits_to_keep: int = 0) -> ZooOutput:
        caches = cache.caches if (cache is not None and use_cache) else [None] * len(self.members)
        parts = []
        for member, member_cache, w in zip(self.members, caches, self.weights):
            logits = member(input_ids, member_cache, use_cache=member_cache is not None,
                            logits_to_keep=logits_to_keep).logits  # (B, T, V_r)
            parts.append(F.log_softmax(logits.float(), dim=-1) + torch.log(w.clamp_min(1e-30)))
        return ZooOutput(torch.logsumexp(torch.stack(parts), dim=0))  # (B, T, V_r)


def clone_zoo(base: ZooLM) -> ZooLM:
    """A trainable copy of ``base`` that shares its frozen embedding matrix (never copied)."""
    model = ZooLM(base.config, base.embedding, base.vocab_ids.clone())
    model.load_state_dict(base.state_dict())
    return model.to(base.device)


def _own_state(model: ZooLM) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k != "vocab_ids"}


def build_served_model(base: ZooLM, tensors: dict[str, torch.Tensor], metadata: dict) -> nn.Module:
    """The drafter network of a published version: a ZooLM, or a ZooEnsembleLM for several members."""
    try:
        count = int(metadata.get("members", 1))
        members = []
        for i in range(count):
            prefix = f"members.{i}."
            state = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
            state["vocab_ids"] = base.vocab_ids
            member = ZooLM(base.config, base.embedding, base.vocab_ids)
            member.load_state_dict(state)
            members.append(member.to(base.device).eval())
        if count == 1:
            return members[0]
        return ZooEnsembleLM(members, tensors["hedge_weights"]).to(base.device).eval()
    except Exception as exc:  # noqa: BLE001 - a bad version must not take serving down
        raise ModelUnavailable(f"published drafter weights do not fit the drafter ({type(exc).__name__}: {exc})") from None


# --- evaluation ---------------------------------------------------------------------------------


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
def _per_position(model: nn.Module, records: Sequence[FeedbackRecord], vocab_map: torch.Tensor):
    """(1 - TV greedy, 1 - TV soft, agreement) per draft position (N,) each, and the loss."""
    batch = make_batch(records, vocab_map, bonus=True)
    log_q = F.log_softmax(model(batch.inputs.to(model.device), use_cache=False).logits.float().cpu(), dim=-1)  # (B, L, V_r)
    loss = float(distillation_loss(log_q[batch.mask], batch.ids[batch.mask], batch.probs[batch.mask]))
    drafts = make_batch(records, vocab_map, bonus=False)
    # Every draft position counts (also those whose top-K is outside the vocabulary: TV ~ 1 there).
    rows = drafts.probs.sum(-1) > 0  # (B, L)
    ids, probs = drafts.ids[rows], drafts.probs[rows]  # (N, K)
    q = log_q[rows].exp()  # (N, V_r)
    soft = 1 - sparse_tv(ids, probs, q)
    top = ids.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1)  # (N,) target argmax, reduced index or -1
    draft = q.argmax(-1)  # (N,) the greedy draft, reduced index
    greedy = (probs * (ids == draft[:, None])).sum(-1)  # p(greedy draft)
    return greedy, soft, (draft == top).float(), loss


def evaluate(model: nn.Module, records: Sequence[FeedbackRecord], vocab_map: torch.Tensor) -> Evaluation:
    """How well a drafter network matches the target on ``records`` (e.g. held-out feedback)."""
    if not records:
        return Evaluation(float("nan"), float("nan"), float("nan"), float("nan"), 0)
    greedy, soft, agreement, loss = _per_position(model, records, vocab_map)
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


def compare(candidate: nn.Module, serving: nn.Module, records: Sequence[FeedbackRecord], vocab_map: torch.Tensor,
            metric: str = "greedy") -> Comparison:
    """Paired BD comparison of two versions of a drafter on held-out records."""
    index = 0 if metric == "greedy" else 1
    a = _per_position(candidate, records, vocab_map)[index]  # (N,)
    b = _per_position(serving, records, vocab_map)[index]
    diff = (a - b).double()
    se = float(diff.std(unbiased=True)) / math.sqrt(len(diff)) if len(diff) > 1 else float("inf")
    z = float(diff.mean()) / se if se > 0 else (0.0 if float(diff.mean()) == 0 else math.copysign(float("inf"), float(diff.mean())))
    return Comparison(float(a.mean()), float(b.mean()), z, len(diff))


# --- the learner of one drafter variant ---------------------------------------------------------


@dataclass(frozen=True)
class StepReport:
    loss: float  # the served distribution's loss on the batch, before the update
    member_losses: tuple[float, ...]  # each member's live loss (before its own update)
    positions: int


class OnlineDrafterLearner:
    """Trainable members (copies of the drafter) and the algorithm's state for one variant."""

    def __init__(self, base: ZooLM, config: OnlineConfig):
        config.validate()
        self.config = config
        lrs = config.hedge_lrs if config.algorithm == "hedge" else (config.lr,)
        self.lrs = tuple(float(x) for x in lrs)
        self.update_rule = config.hedge_member if config.algorithm == "hedge" else config.algorithm
        self.members = [clone_zoo(base) for _ in self.lrs]
        self.weights = torch.full((len(self.lrs),), 1.0 / len(self.lrs))  # Hedge weights (M,)
        self.previous: list[list[torch.Tensor] | None] = [None] * len(self.lrs)  # optimistic hints
        self.accumulated: list[list[torch.Tensor] | None] = [None] * len(self.lrs)  # AdaGrad's G
        self.steps = 0
        self.vocab_map = vocab_map_for(base)

    def _params(self, member: ZooLM) -> list[torch.Tensor]:
        return [p for p in member.parameters() if p.requires_grad]

    def mixture_log_probs(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """log q of the served distribution from each member's logits (N, V_r)."""
        if len(logits) == 1:
            return F.log_softmax(logits[0].float(), dim=-1)
        parts = [F.log_softmax(l.float(), dim=-1) + math.log(max(float(w), 1e-30)) for l, w in zip(logits, self.weights)]
        return torch.logsumexp(torch.stack(parts), dim=0)

    def loss(self, batch: FeedbackBatch) -> float:
        """The served distribution's distillation loss on ``batch`` (no update)."""
        with torch.no_grad():
            logits = [m.reduced_logits(m.hidden(batch.inputs.to(m.device))[batch.mask.to(m.device)]).cpu()
                      for m in self.members]
            return float(distillation_loss(self.mixture_log_probs(logits), batch.ids[batch.mask], batch.probs[batch.mask]))

    @torch.inference_mode(False)
    @torch.enable_grad()
    def step(self, batch: FeedbackBatch) -> StepReport | None:
        """One online update on ``batch``; None when it has no supervised position."""
        if batch.positions == 0:
            return None
        ids, probs = batch.ids[batch.mask], batch.probs[batch.mask]  # (N, K)
        member_losses, served_logits = [], []
        for i, (member, lr) in enumerate(zip(self.members, self.lrs)):
            params = self._params(member)
            logits = member.reduced_logits(member.hidden(batch.inputs.to(member.device))[batch.mask.to(member.device)])  # (N, V_r)
            loss = distillation_loss(logits, ids.to(logits.device), probs.to(logits.device))
            grads = clip_grads(torch.autograd.grad(loss, params), self.config.clip_norm)
            if self.config.precondition == "adagrad":
                grads, self.accumulated[i] = adagrad_scale(grads, self.accumulated[i], self.config.adagrad_eps)
            member_losses.append(float(loss.detach()))
            served_logits.append(logits.detach().cpu())
            if self.update_rule == "optimistic":
                optimistic_step(params, grads, self.previous[i], lr)
                self.previous[i] = [g.detach().clone() for g in grads]
            else:
                ogd_step(params, grads, lr)
        served = float(distillation_loss(self.mixture_log_probs(served_logits), ids, probs))
        if len(self.members) > 1:
            capped = torch.tensor([min(x, self.config.loss_cap) if math.isfinite(x) else self.config.loss_cap
                                   for x in member_losses])
            self.weights = hedge_update(self.weights, capped, self.config.hedge_eta, self.config.hedge_share)
        self.steps += 1
        return StepReport(served, tuple(member_losses), batch.positions)

    # -- publishing and checkpoints --------------------------------------------------------------

    def serving_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What drafters load (``build_served_model``): every member's weights and the Hedge weights."""
        tensors = {f"members.{i}.{k}": v.detach().cpu().clone() for i, m in enumerate(self.members)
                   for k, v in _own_state(m).items()}
        tensors["hedge_weights"] = self.weights.clone()
        metadata = {"members": len(self.members), "algorithm": self.config.algorithm, "lrs": list(self.lrs),
                    "hedge_weights": [round(float(w), 6) for w in self.weights], "steps": self.steps}
        return tensors, metadata

    def state_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "members": [{k: v.detach().cpu().clone() for k, v in _own_state(m).items()} for m in self.members],
            "previous": [None if p is None else [g.clone() for g in p] for p in self.previous],
            "accumulated": [None if a is None else [g.clone() for g in a] for a in self.accumulated],
            "weights": self.weights.clone(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["members"]) != len(self.members):
            raise InvalidArgument(f"checkpoint has {len(state['members'])} members, this learner {len(self.members)}")
        for member, own in zip(self.members, state["members"]):
            member.load_state_dict({**own, "vocab_ids": member.vocab_ids})
        self.previous = [None if p is None else [g.clone() for g in p] for p in state["previous"]]
        self.accumulated = [None if a is None else [g.clone() for g in a]
                            for a in state.get("accumulated", [None] * len(self.members))]
        self.weights = state["weights"].clone()
        self.steps = int(state["steps"])
