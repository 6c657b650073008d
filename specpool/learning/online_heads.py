"""Online learning of white-box heads (``eagle:``) from verification feedback.

A white-box round's feedback record (specpool/learning/feedback.py) carries the target's features
of its context tail and accepted drafts beside the usual tokens and top-K p, which is what the
offline recipe trains on (specpool/learning/eagle_train.py, recipe ``eagle``, EAGLE-1: Li et al.
2024): teacher-forced, head position t reads (x_{t+1}, f_t) and is fit to the target's next feature
f_{t+1} (SmoothL1) and, at the round's on-path rows, to the target's top-K p of x_{t+2} (soft
cross-entropy on the head's reduced vocabulary). A record of context x_0..x_{n-1}, features from
position fs and a accepted drafts gives head positions fs .. n-2+a; its rows j = 0..a (the first
draft position up to the rejected one, or the bonus) are supervised; the rows after a rejected
draft token are off the path the features describe and are left out. The loss is
``eagle_train.head_loss`` itself, on ``eagle_train.collate_heads`` of the records.

``OnlineHeadLearner`` is ``OnlineDrafterLearner`` (specpool/learning/online.py) with the head as its
network: the same ``ogd`` / ``optimistic`` / ``hedge`` updates, AdaGrad, clipping, checkpoints and
published tensors. Vocabulary growth and the copy term are the zoo networks' and do not apply to
a head (ignored). A ``hedge`` version of several members drafts as ``EagleEnsembleHead``: each member
runs its own feature chain and the draft distribution is the mixture q = sum_i w_i q_i, so the
proposal stays exact (lossless, as ``ZooEnsembleLM``).

``head_record_bd`` scores a head on held-out records as ``EagleDrafter`` drafts: the target's
features up to position n-2, then the head's own guesses along the record's draft tokens; so the
learner's rollback check (specpool/learning/learner_loop.py) compares versions on what serving sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpool.core.errors import ModelUnavailable
from specpool.drafters.eagle_model import EagleHead
from specpool.drafters.zoo_model import KVCache
from specpool.learning.batches import vocab_map_for
from specpool.learning.eagle_train import FeatureSequence, collate_heads, head_loss
from specpool.learning.ensemble import EnsembleCache, MemberMixture, mixture_log_probs
from specpool.learning.evaluation import sparse_tv
from specpool.learning.feedback import BadFeedback, FeedbackRecord
from specpool.learning.online import OnlineDrafterLearner
from specpool.learning.zoo_train import distillation_loss
from specpool.learning.zoo_weights import freeze_lower_blocks, version_members

RECIPE = "eagle"  # the offline recipe whose loss the online updates descend (teacher-forced)
REGRESSION_WEIGHT = 1.0  # as the offline default (HeadOptions.regression_weight)


# --- records as head batches ---------------------------------------------------------------------


def check_head_record(record: FeedbackRecord, head: EagleHead) -> None:
    """A record a head can learn from: features of the head's width that reach back to position
    n-2 at least (the first draft's source). Raises ``BadFeedback`` ("no_features") otherwise."""
    features = record.features()
    if features is None:
        raise BadFeedback("no_features", f"a record of white-box head {record.drafter} carries no features")
    if record.feature_width != head.config.hidden_size:
        raise BadFeedback("no_features", f"features of width {record.feature_width}, the head reads {head.config.hidden_size}")
    if features.start > record.position - 2:
        raise BadFeedback("no_features", f"features start at {features.start}, after position {record.position - 2}")


def head_sequence(record: FeedbackRecord, argmax: bool = False) -> FeatureSequence:
    """A record as the offline recipe's sequence (``eagle_train.FeatureSequence``), in the
    record's own coordinates (position 0 = its context tail's first token): tokens = context tail +
    accepted drafts + the next token (the target's argmax there: only the agreement statistic reads
    it), the answer = the accepted drafts and that token (rows 0..a of the target's p)."""
    features = record.features()
    n, a = record.position, record.accepted
    offset = n - len(record.context)  # the session position of the tail's first token
    last = record.target_ids[a][max(range(len(record.target_probs[a])), key=record.target_probs[a].__getitem__)]
    tokens = torch.tensor([*record.context, *record.draft[:a], last], dtype=torch.long)  # (L,)
    width = max(len(row) for row in record.target_ids[: a + 1])
    label_ids = torch.full((a + 1, width), -1, dtype=torch.long)
    label_probs = torch.zeros(a + 1, width)
    for j in range(a + 1):
        ids, probs = torch.tensor(record.target_ids[j]), torch.tensor(record.target_probs[j])
        if argmax:
            top = int(probs.argmax())
            ids, probs = ids[top: top + 1], torch.ones(1)
        label_ids[j, : len(ids)], label_probs[j, : len(ids)] = ids, probs
    return FeatureSequence(tokens, len(record.context), features.start - offset, features.rows, label_ids, label_probs)


@dataclass(frozen=True)
class HeadBatch:
    """Records as ``eagle_train.collate_heads`` lays them out (ids, features, targets, valid,
    answer, label_ids, label_probs, next_token; (B, T, ...))."""

    tensors: dict[str, torch.Tensor]

    @property
    def positions(self) -> int:
        """Supervised rows (the target's p)."""
        return int(self.tensors["answer"].sum())


def make_head_batch(records: Sequence[FeedbackRecord], vocab_map: torch.Tensor, argmax: bool = False) -> HeadBatch:
    """One padded batch of the records that carry features (the others are left out)."""
    sequences = [head_sequence(r, argmax) for r in records if r.features() is not None]
    if not sequences:
        return HeadBatch({"answer": torch.zeros(0, 0, dtype=torch.bool)})
    width = max(s.label_ids.shape[1] for s in sequences)
    for s in sequences:  # collate_heads takes one K for the batch; padding has p = 0 (no effect on the loss)
        pad = width - s.label_ids.shape[1]
        s.label_ids = F.pad(s.label_ids, (0, pad), value=-1)
        s.label_probs = F.pad(s.label_probs, (0, pad))
    tensors = collate_heads(sequences, vocab_map)
    # collate_heads maps the padding id -1 through vocab_map as an index: mark it outside again.
    tensors["label_ids"] = torch.where(tensors["label_probs"] > 0, tensors["label_ids"], -1)
    return HeadBatch(tensors)


# --- the learner ----------------------------------------------------------------------------------


def clone_head(base: EagleHead) -> EagleHead:
    """A trainable copy of ``base`` sharing its frozen embedding and output matrices (never copied)."""
    head = EagleHead(base.config, base.embedding, base.vocab_ids.clone(), base.output)
    head.load_state_dict(base.state_dict())
    return head.to(base.device)


class OnlineHeadLearner(OnlineDrafterLearner):
    """``OnlineDrafterLearner`` over white-box heads (module docstring)."""

    def _clone(self, base: EagleHead) -> EagleHead:  # type: ignore[override]
        head = clone_head(base)
        freeze_lower_blocks(head, self.config.trainable_blocks)  # type: ignore[arg-type]  # (a head has .blocks too)
        return head

    def _load_member(self, member: EagleHead, state: dict[str, torch.Tensor]) -> None:  # type: ignore[override]
        member.load_state_dict(state)

    def observe(self, records: Sequence[FeedbackRecord]) -> torch.Tensor:
        """No vocabulary growth for heads (module docstring)."""
        return torch.empty(0, dtype=torch.long)

    def batch(self, records: Sequence[FeedbackRecord]) -> HeadBatch:  # type: ignore[override]
        return make_head_batch(records, self.vocab_map, argmax=self.config.supervision == "argmax")

    def _member_loss(self, member: EagleHead, batch: HeadBatch) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        tensors = {k: v.to(member.device) for k, v in batch.tensors.items()}
        loss, _ = head_loss(member, tensors, RECIPE, 1, REGRESSION_WEIGHT)
        return loss, None

    def _served_loss(self, batch: HeadBatch, outputs: list, losses: list[float]) -> float:  # type: ignore[override]
        """The members' live losses weighted by Hedge (one member: its own); ``loss`` gives the mixture's."""
        weights = self.served_weights()
        return float(sum(float(w) * x for w, x in zip(weights, losses)))

    def _network_metadata(self) -> dict:
        return {"kind": "eagle"}

    def loss(self, batch: HeadBatch) -> float:  # type: ignore[override]
        """The served head's loss on ``batch`` (no update): head_loss for one member; for a mixture,
        its cross-entropy plus the members' regression weighted as they are served."""
        with torch.no_grad():
            if len(self.members) == 1:
                member = self.members[0]
                return float(head_loss(member, {k: v.to(member.device) for k, v in batch.tensors.items()},
                                       RECIPE, 1, REGRESSION_WEIGHT)[0])
            t = batch.tensors
            weights = self.served_weights()
            logits, regression = [], 0.0
            for member, w in zip(self.members, weights):
                predicted = member(t["ids"].to(member.device), t["features"].to(member.device)).cpu()  # (B, T, d)
                regression += float(w) * float(F.smooth_l1_loss(predicted[t["valid"]], t["targets"][t["valid"]]))
                logits.append(member.reduced_logits(predicted[t["answer"]].to(member.device)).cpu())
            ce = distillation_loss(mixture_log_probs(logits, weights), t["label_ids"][t["answer"]], t["label_probs"][t["answer"]])
            return REGRESSION_WEIGHT * regression + float(ce)


# --- a published version as a drafting head -----------------------------------------------------------


class EagleEnsembleHead(MemberMixture):
    """Heads mixed in output-distribution space, drafting as one ``EagleHead`` does: ``forward``
    returns every member's predicted features side by side (B, T, M*d) and takes either the
    target's features (B, T, d: the same for every member) or such a concatenation (its own
    guesses); ``reduced_logits`` of it is log(sum_i w_i q_i), so softmax is the mixture q."""

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, cache: EnsembleCache | None = None,
                start: int | None = None) -> torch.Tensor:
        d = self.config.hidden_size
        parts = [features] * len(self.members) if features.shape[-1] == d else list(features.split(d, dim=-1))
        caches: list[KVCache | None] = cache.caches if cache is not None else [None] * len(self.members)
        return torch.cat([m(input_ids, f, c, start) for m, f, c in zip(self.members, parts, caches)], dim=-1)

    def reduced_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        d = self.config.hidden_size
        logits = [m.reduced_logits(h) for m, h in zip(self.members, hidden.split(d, dim=-1))]
        return mixture_log_probs(logits, self.weights.to(hidden.device))


def build_served_head(base: EagleHead, tensors: dict[str, torch.Tensor], metadata: dict) -> nn.Module:
    """The drafting head of a published version (``OnlineHeadLearner.serving_tensors``): one
    EagleHead, or an EagleEnsembleHead of the members the version serves. Each drafts in the
    base's precision (``eagle-int8``'s int8 kernels stay int8 across versions)."""
    try:
        states, weights = version_members(tensors, metadata)
        members = []
        for state in states:
            head = EagleHead(base.config, base.embedding, base.vocab_ids.clone(), base.output)
            head.load_state_dict({**state, "vocab_ids": base.vocab_ids})
            head.set_draft_precision(base.draft_precision)
            members.append(head.to(base.device).eval())
        if weights is None:
            return members[0]
        return EagleEnsembleHead(members, weights).to(base.device).eval()
    except Exception as exc:  # noqa: BLE001 - a bad version must not take serving down
        raise ModelUnavailable(f"published head weights do not fit the head ({type(exc).__name__}: {exc})") from None


# --- held-out scores -----------------------------------------------------------------------------------


@torch.inference_mode()
def draft_log_q(head: nn.Module, record: FeedbackRecord) -> torch.Tensor:
    """log q (k, V_r) of the head at the record's k draft positions, drafted as ``EagleDrafter``
    does: the target's features f_fs .. f_{n-2}, then the head's own guesses along the record's
    draft tokens (a fresh cache over the record's window, not the session's whole context)."""
    features = record.features()
    n, offset = record.position, record.position - len(record.context)
    ids = torch.tensor([record.context[features.start + 1 - offset:]], device=head.device)  # (1, T): x_{fs+1}..x_{n-1}
    feats = features.rows[: n - 1 - features.start].unsqueeze(0).to(head.device)  # (1, T, d): f_fs..f_{n-2}
    cache = head.new_cache()
    guess = head(ids, feats, cache)[0, -1]  # the head's f^_{n-1}
    rows = []
    for j, token in enumerate(record.draft):
        rows.append(F.log_softmax(head.reduced_logits(guess).float(), dim=-1))
        if j + 1 < len(record.draft):
            guess = head(torch.tensor([[token]], device=head.device), guess.view(1, 1, -1), cache)[0, -1]
    return torch.stack(rows).cpu()


def head_record_bd(head: nn.Module, records: Sequence[FeedbackRecord], metric: str = "greedy") -> list[torch.Tensor]:
    """BD (1 - TV, greedy or soft; specpool/learning/evaluation.py) at each draft position, one
    tensor per record, as ``evaluation.record_bd`` gives for a zoo network."""
    vocab_map = vocab_map_for(head)
    out = []
    for record in records:
        q = draft_log_q(head, record).exp()  # (k, V_r)
        k = len(record.draft)
        ids = torch.tensor([list(r) + [-1] * (max(map(len, record.target_ids)) - len(r)) for r in record.target_ids[:k]])
        probs = torch.tensor([list(r) + [0.0] * (ids.shape[1] - len(r)) for r in record.target_probs[:k]])  # (k, K)
        reduced = torch.where(ids >= 0, vocab_map[ids.clamp_min(0)], -1)  # (k, K)
        if metric == "greedy":
            draft = q.argmax(-1)  # (k,) reduced index
            out.append((probs * (reduced == draft[:, None])).sum(-1))
        else:
            out.append(1 - sparse_tv(reduced, probs, q))
    return out
