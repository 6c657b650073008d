"""Online learning of zoo drafters from verification feedback.

OnlineSpec's observation (Liu et al., "Online Speculative Decoding", 2023): the target's
verification already computes its distribution p at every drafted position, so serving produces
distillation data for free, on exactly the traffic the drafter sees. Each feedback record
(specpool/learning/feedback.py) is one small distillation example: the sequence context-tail + draft, and
the target's sparse top-K p at its last k+1 positions. The loss is the offline one
(``specpool.learning.zoo_train.distillation_loss``, soft cross-entropy = KL(p || q) up to p's entropy) on
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

With ``grow_vocab`` > 0 the drafter's reduced vocabulary grows online. A shipped drafter can only
propose the ``reduced_vocab`` tokens that carried most of the target's mass in *its* domain; on a
new domain (character names, period spellings) some of the target's likely tokens are outside it
and can never be accepted. The learner sums, per token outside the vocabulary, the target's p in
the records it trains on; a token whose sum reaches ``grow_min_mass`` joins the vocabulary (up to
``grow_vocab`` tokens in all). Its output row is the target's own embedding row (the head is the
frozen embedding matrix), so only its bias is new: it starts at the ``grow_bias_quantile`` of the
existing biases and is learnt like the rest. A published version carries its ``vocab_ids``.

With ``copy_window`` > 0 every member gets the drafter network's copy term
(specpool/drafters/zoo_model.py): a learned weight, starting at 0, on the tokens of the last
``copy_window`` inputs. It is trained with the rest and published with the weights (its window
and scale in the version's metadata). In a replay of the Tiny Shakespeare stream it added about
three points of mean accepted length on the last third, more with vocabulary growth (names from
the prompt become proposable and then copyable).

This module owns the algorithms' configuration (``OnlineConfig``) and the learner of one drafter
variant (``OnlineDrafterLearner``: its members, optimiser state, vocabulary growth, published
tensors and checkpoint). Its parts live beside it in specpool/learning/:

- online_updates.py: the update rules as pure math (OGD, optimistic OGD, AdaGrad, clipping, Hedge);
- batches.py: feedback records as padded training batches (``make_batch``);
- ensemble.py: the Hedge mixture as one drafter network (``ZooEnsembleLM``);
- zoo_weights.py: trainable copies of a zoo network and the network of a published version
  (``clone_zoo``, ``build_served_model``);
- evaluation.py: BD on held-out records and the paired comparison of two versions;
- online_heads.py: the same learner over white-box heads (``OnlineHeadLearner`` overrides the
  network-specific methods: ``_clone``, ``_member_loss``, ``_served_loss``, ``batch``, ...).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from specpool.core.errors import InvalidArgument
from specpool.drafters.zoo_model import ZooLM
from specpool.learning.batches import FeedbackBatch, make_batch, vocab_map_for
from specpool.learning.ensemble import mixture_log_probs, served_weights
from specpool.learning.feedback import FeedbackRecord
from specpool.learning.online_updates import adagrad_scale, clip_grads, hedge_update, ogd_step, optimistic_step
from specpool.learning.zoo_train import distillation_loss
from specpool.learning.zoo_weights import clone_zoo, freeze_lower_blocks, load_own_state, own_state

ALGORITHMS = ("ogd", "optimistic", "hedge")
SUPERVISION = ("distribution", "argmax")  # OnlineConfig.supervision


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
    # Members whose Hedge weight is below this are left out of the served mixture (the rest
    # renormalised; the heaviest always stays). Every served member drafts at full cost whatever
    # its weight, and the weights concentrate: in the Shakespeare run (bench/results/online-*) one
    # member held 0.95-0.98 from the second version on. The left-out members go on learning and
    # come back when Hedge moves weight to them. 0 serves every member.
    hedge_serve_min: float = 0.05
    loss_cap: float = 10.0  # live losses are capped here: Hedge needs bounded losses
    # What the drafter is fit to at each position: "distribution", the target's top-K p (soft
    # cross-entropy, right for sampled traffic); "argmax", the target's most likely token alone
    # (cross-entropy on it): greedy decoding accepts a draft token iff it is the target's argmax,
    # so the drafter need not spend capacity on the rest of p. A peaked fit also makes the drafter
    # confident where it is right, which its confidence stop (specpool/drafters/hf_model.py) rewards.
    supervision: str = "distribution"
    # "adagrad": per-coordinate step sizes eta / sqrt(sum of squared past gradients) (Duchi, Hazan
    # & Singer 2011; McMahan & Streeter 2010), in every algorithm; "none": one global step size.
    precondition: str = "adagrad"
    adagrad_eps: float = 1e-8
    # Online vocabulary growth (module docstring): at most this many tokens added; 0 = fixed vocabulary.
    grow_vocab: int = 0
    grow_min_mass: float = 0.5  # target p summed over records before an outside token joins
    grow_bias_quantile: float = 0.5  # a new token's bias starts at this quantile of the others'
    # The copy term (module docstring): input tokens looked back over, 0 = no copy term; and the
    # logits per unit of its weight (100: an AdaGrad step of 0.002 moves it by 0.2 logits; in the
    # Shakespeare replay 50 and 100 did equally well, 400 overshot).
    copy_window: int = 0
    copy_scale: float = 100.0
    # Which transformer blocks learn: None = all; n = only the last n (0: none, so only the output
    # bias, the final norm and the copy weight do). Gradients then stop at the lowest trained
    # block, so a step costs a forward and a short backward instead of a backward through every
    # block: what a learner sharing cores with serving needs (`specpool bench --online --learner-process`, bench/online_learner.py).
    trainable_blocks: int | None = None
    # The learner's cost (it shares the serving machine): replaying the Tiny Shakespeare stream as
    # served (scripts/online_replay.py --records served --confidence 0.4; argmax supervision, copy
    # window 64, vocabulary growth 2048), the last third's mean accepted length / learner seconds
    # per prompt were 1.522 / 0.75 with neither, 1.516 / 0.39 with both, 1.510 / 0.26 with both
    # and 8 records per step (frozen: 1.261).
    # True: a step fits the records of one session that line up (FeedbackRecord.position) as one
    # sequence (make_batch): successive records share most of their context, so four fit in
    # about a third of the tokens. Rows after a rejected draft token, off the session's path, are
    # left out but for the last record's (fitting on-path rows alone did as well in the replay).
    # False: every record is its own sequence, all rows kept.
    merge_records: bool = True
    # True: a step computes the context (up to the first supervised position) without gradients,
    # as a KV cache, and backpropagates through the rest only. The gradient leaves out the
    # weights' effect on the context's keys and values (truncated backpropagation).
    detach_context: bool = True

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise InvalidArgument(f"unknown online algorithm {self.algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        if self.supervision not in SUPERVISION:
            raise InvalidArgument(f"supervision is {' or '.join(SUPERVISION)}, not {self.supervision!r}")
        if self.precondition not in ("none", "adagrad"):
            raise InvalidArgument(f"precondition is none or adagrad, not {self.precondition!r}")
        if self.hedge_member not in ("ogd", "optimistic"):
            raise InvalidArgument(f"hedge members run ogd or optimistic, not {self.hedge_member!r}")
        lrs = self.hedge_lrs if self.algorithm == "hedge" else (self.lr,)
        if not lrs or any(not math.isfinite(x) or x < 0 for x in lrs):
            raise InvalidArgument(f"learning rates must be finite and >= 0, got {lrs}")
        if self.grow_vocab < 0 or not self.grow_min_mass > 0 or not 0 <= self.grow_bias_quantile <= 1:
            raise InvalidArgument("grow_vocab must be >= 0, grow_min_mass > 0 and 0 <= grow_bias_quantile <= 1")
        if self.copy_window < 0 or not (math.isfinite(self.copy_scale) and self.copy_scale > 0):
            raise InvalidArgument(f"copy_window must be >= 0 and copy_scale > 0, got {self.copy_window} and {self.copy_scale}")
        if self.trainable_blocks is not None and self.trainable_blocks < 0:
            raise InvalidArgument(f"trainable_blocks must be >= 0 (or None: all), got {self.trainable_blocks}")
        if not 0 <= self.hedge_serve_min < 1:
            raise InvalidArgument(f"hedge_serve_min must be in [0, 1), got {self.hedge_serve_min}")
        if self.clip_norm <= 0 or self.hedge_eta < 0 or not 0 <= self.hedge_share < 1 or self.loss_cap <= 0:
            raise InvalidArgument("clip_norm and loss_cap must be > 0, hedge_eta >= 0, 0 <= hedge_share < 1")


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
        self.members = [self._clone(base) for _ in self.lrs]
        self.weights = torch.full((len(self.lrs),), 1.0 / len(self.lrs))  # Hedge weights (M,)
        self.previous: list[list[torch.Tensor] | None] = [None] * len(self.lrs)  # optimistic hints
        self.accumulated: list[list[torch.Tensor] | None] = [None] * len(self.lrs)  # AdaGrad's G
        self.steps = 0
        self.vocab_map = vocab_map_for(base)
        self.base_vocab = len(base.vocab_ids)
        self.outside_mass = torch.zeros(base.vocab_size)  # (V,) target p seen on tokens outside the vocabulary

    # -- what depends on the network (a white-box head's learner overrides these: online_heads.py) --

    def _clone(self, base: ZooLM) -> ZooLM:
        """A trainable member: a copy of ``base`` (with the copy term, lower blocks frozen)."""
        member = clone_zoo(base, self.config.copy_window, self.config.copy_scale)
        freeze_lower_blocks(member, self.config.trainable_blocks)
        return member

    def _load_member(self, member: ZooLM, state: dict[str, torch.Tensor]) -> None:
        load_own_state(member, state)

    def _member_loss(self, member: ZooLM, batch: FeedbackBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss a member descends on ``batch``, its detached output for the served loss)."""
        ids, probs = batch.ids[batch.mask], batch.probs[batch.mask]  # (N, K)
        # The first supervised position of any record: everything before it is context.
        detach_before = int(batch.mask.float().argmax(1)[batch.mask.any(1)].min()) if self.config.detach_context else 0
        logits = member.logits_at(batch.inputs.to(member.device), batch.mask.to(member.device), detach_before)  # (N, V_r)
        return distillation_loss(logits, ids.to(logits.device), probs.to(logits.device)), logits.detach().cpu()

    def _served_loss(self, batch: FeedbackBatch, outputs: list[torch.Tensor], losses: list[float]) -> float:
        """The served distribution's loss from the members' outputs of ``_member_loss``."""
        return float(distillation_loss(self.mixture_log_probs(outputs), batch.ids[batch.mask], batch.probs[batch.mask]))

    def _network_metadata(self) -> dict:
        """What a published version says about the network beyond its tensors (the copy term)."""
        config = self.members[0].config
        if not config.copy_window:
            return {}
        return dict(copy_window=config.copy_window, copy_scale=config.copy_scale,
                    copy_weights=[round(float(m.copy_weight.detach()) * config.copy_scale, 4) for m in self.members])

    @property
    def grown(self) -> int:
        """Tokens added to the shipped vocabulary so far."""
        return len(self.members[0].vocab_ids) - self.base_vocab

    def batch(self, records: Sequence[FeedbackRecord]) -> FeedbackBatch:
        """``records`` as a training batch, after letting them grow the vocabulary."""
        self.observe(records)
        return make_batch(records, self.vocab_map, argmax=self.config.supervision == "argmax",
                          merge=self.config.merge_records)

    def observe(self, records: Sequence[FeedbackRecord]) -> torch.Tensor:
        """Add the target's p on outside tokens to their sums; the tokens whose sum reaches
        ``grow_min_mass`` join the vocabulary (the heaviest first, within ``grow_vocab``).
        Returns the token ids added."""
        room = self.config.grow_vocab - self.grown
        if room <= 0 or not records:
            return torch.empty(0, dtype=torch.long)
        ids = torch.tensor([i for r in records for row in r.target_ids for i in row], dtype=torch.long)
        probs = torch.tensor([p for r in records for row in r.target_probs for p in row], dtype=torch.float32)
        outside = self.vocab_map[ids] < 0
        self.outside_mass.index_add_(0, ids[outside], probs[outside])
        ready = (self.outside_mass >= self.config.grow_min_mass).nonzero().flatten()
        if len(ready) == 0:
            return ready
        ready = ready[self.outside_mass[ready].argsort(descending=True)][:room]
        self.grow(ready)
        return ready

    def grow(self, token_ids: torch.Tensor) -> None:
        """Append ``token_ids`` to every member's vocabulary; the optimiser state of the new
        biases starts at zero (AdaGrad's sums, optimistic hints)."""
        new = token_ids.long().cpu()
        if len(new) == 0:
            return
        if bool((self.vocab_map[new] >= 0).any()) or len(set(new.tolist())) != len(new):
            raise InvalidArgument("grow: tokens already in the vocabulary, or repeated")
        for i, member in enumerate(self.members):
            names = [n for n, p in member.named_parameters() if p.requires_grad]
            at = names.index("head_bias")
            start = torch.quantile(member.head_bias.detach().float().cpu(), self.config.grow_bias_quantile)
            member.extend_vocab(new, start.expand(len(new)))
            for states in (self.accumulated, self.previous):
                if states[i] is not None:
                    states[i][at] = torch.cat([states[i][at], torch.zeros(len(new), dtype=states[i][at].dtype,
                                                                          device=states[i][at].device)])
        self.vocab_map = vocab_map_for(self.members[0])
        self.outside_mass[new] = 0.0

    def _params(self, member: ZooLM) -> list[torch.Tensor]:
        return [p for p in member.parameters() if p.requires_grad]

    def mixture_log_probs(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """log q of the served distribution from each member's logits (N, V_r)."""
        return mixture_log_probs(logits, self.served_weights())

    def served_weights(self) -> torch.Tensor:
        """The weights of the served mixture: Hedge's, less the members below ``hedge_serve_min``."""
        return served_weights(self.weights, self.config.hedge_serve_min)

    def loss(self, batch: FeedbackBatch) -> float:
        """The served distribution's distillation loss on ``batch`` (no update)."""
        with torch.no_grad():
            logits = [m.logits_at(batch.inputs.to(m.device), batch.mask.to(m.device)).cpu() for m in self.members]
            return float(distillation_loss(self.mixture_log_probs(logits), batch.ids[batch.mask], batch.probs[batch.mask]))

    @torch.inference_mode(False)
    @torch.enable_grad()
    def step(self, batch: FeedbackBatch) -> StepReport | None:
        """One online update on ``batch``; None when it has no supervised position."""
        if batch.positions == 0:
            return None
        member_losses, outputs = [], []
        for i, (member, lr) in enumerate(zip(self.members, self.lrs)):
            params = self._params(member)
            loss, output = self._member_loss(member, batch)
            grads = clip_grads(torch.autograd.grad(loss, params), self.config.clip_norm)
            if self.config.precondition == "adagrad":
                grads, self.accumulated[i] = adagrad_scale(grads, self.accumulated[i], self.config.adagrad_eps)
            member_losses.append(float(loss.detach()))
            outputs.append(output)
            if self.update_rule == "optimistic":
                optimistic_step(params, grads, self.previous[i], lr)
                self.previous[i] = [g.detach().clone() for g in grads]
            else:
                ogd_step(params, grads, lr)
        served = self._served_loss(batch, outputs, member_losses)
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
                   for k, v in own_state(m).items()}
        tensors["hedge_weights"] = self.weights.clone()
        served = self.served_weights()
        if len(self.members) > 1:  # build_served_model drafts with these members only
            tensors["served_weights"] = served.clone()
        tensors["vocab_ids"] = self.members[0].vocab_ids.detach().cpu().clone()
        metadata = {"members": len(self.members), "algorithm": self.config.algorithm, "lrs": list(self.lrs),
                    "hedge_weights": [round(float(w), 6) for w in self.weights],
                    "served_members": [i for i, w in enumerate(served) if w > 0], "steps": self.steps,
                    "vocab": len(self.members[0].vocab_ids), "vocab_grown": self.grown, **self._network_metadata()}
        return tensors, metadata

    def _match_vocab(self, vocab_ids: torch.Tensor | None) -> None:
        """Grow to ``vocab_ids`` (a saved version's or checkpoint's), which must extend ours."""
        if vocab_ids is None:
            return
        if not self._extended_by(vocab_ids):
            raise InvalidArgument("the saved drafter's vocabulary does not extend this drafter's")
        self.grow(vocab_ids.long().cpu()[len(self.members[0].vocab_ids):])

    def load_serving_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take a published version's weights (``serving_tensors``) as the members' own."""
        self._match_vocab(tensors.get("vocab_ids"))
        for i, member in enumerate(self.members):
            prefix = f"members.{i}."
            own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            self._load_member(member, {**own, "vocab_ids": member.vocab_ids})
        self.weights = tensors["hedge_weights"].clone()

    def adopt_step_sizes(self, other: "OnlineDrafterLearner") -> bool:
        """Take ``other``'s AdaGrad sums G (not its optimistic hints), cut to this learner's
        vocabulary, which must be a prefix of ``other``'s. After a rollback the per-coordinate step
        sizes go on from where they were: a fresh G would make the next step move every
        coordinate by the full eta, as the stream's very first step does, and such a jolt is the
        kind of update that gets rolled back again. False (and G left as it is) when the two do
        not fit: another ensemble size or a vocabulary that is not a prefix."""
        if len(other.accumulated) != len(self.members) or not self._extended_by(other.members[0].vocab_ids):
            return False
        adopted = []
        for member, sums in zip(self.members, other.accumulated):
            params = self._params(member)
            if sums is not None and len(sums) != len(params):
                return False
            # A grown vocabulary only appends rows (head_bias), so the first rows are this learner's.
            adopted.append(None if sums is None else [g[: q.shape[0]].clone() for g, q in zip(sums, params)])
        self.accumulated = adopted
        return True

    def _extended_by(self, vocab_ids: torch.Tensor) -> bool:
        """Whether ``vocab_ids`` is this learner's vocabulary, possibly with tokens appended."""
        ours, vocab_ids = self.members[0].vocab_ids.cpu(), vocab_ids.long().cpu()
        return len(vocab_ids) >= len(ours) and torch.equal(vocab_ids[: len(ours)], ours)

    def state_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "members": [{k: v.detach().cpu().clone() for k, v in own_state(m).items()} for m in self.members],
            "previous": [None if p is None else [g.clone() for g in p] for p in self.previous],
            "accumulated": [None if a is None else [g.clone() for g in a] for a in self.accumulated],
            "weights": self.weights.clone(),
            "steps": self.steps,
            "vocab_ids": self.members[0].vocab_ids.detach().cpu().clone(),
            "outside_mass": self.outside_mass.to_sparse(),  # mostly zeros: (V,) is 49 K floats
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["members"]) != len(self.members):
            raise InvalidArgument(f"checkpoint has {len(state['members'])} members, this learner {len(self.members)}")
        self._match_vocab(state.get("vocab_ids"))
        if "outside_mass" in state:
            self.outside_mass = state["outside_mass"].to_dense().clone()
        for member, own in zip(self.members, state["members"]):
            self._load_member(member, {**own, "vocab_ids": member.vocab_ids})
        self.previous = [None if p is None else [g.clone() for g in p] for p in state["previous"]]
        self.accumulated = [None if a is None else [g.clone() for g in a]
                            for a in state.get("accumulated", [None] * len(self.members))]
        self.weights = state["weights"].clone()
        self.steps = int(state["steps"])
