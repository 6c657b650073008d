"""A drafter variant's learner state (``VariantState``) and its checkpoint in the model store.

A commit (specpool/learning/learner_loop.py) saves the checkpoint - the online learner's weights
and optimiser state, the serving version, the applied record ids, the tenants' budget usage and
the held-out records - before it acknowledges the variant's records, so a learner that restarts
from it applies each record's effect exactly once (``save_checkpoint``, ``restore_checkpoint``).
A checkpoint made by another algorithm cannot be continued (``checkpoint_conflict``). The store
keeps it as safetensors plus JSON, fsynced before its rename (specpool/learning/durable.py): loading
one never runs code, and a pickle is refused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from specpool.drafters.zoo_model import ZooLM
from specpool.learning.feedback import FeedbackLimits, FeedbackRecord
from specpool.learning.model_store import ModelStore, VariantKey
from specpool.learning.online import OnlineConfig, OnlineDrafterLearner


@dataclass
class VariantState:
    """One variant's learner and what the learner loop keeps about it between records and commits."""

    key: VariantKey
    learner: OnlineDrafterLearner
    base: ZooLM
    serving_version: int = 0
    applied: OrderedDict = field(default_factory=OrderedDict)  # record id -> None (bounded)
    usage: dict = field(default_factory=dict)  # tenant -> [records, tokens] trained on
    holdout: deque = field(default_factory=deque)  # recent held-out FeedbackRecords
    batch: list = field(default_factory=list)  # records waiting for a gradient step
    uncommitted: list = field(default_factory=list)  # entry ids to ack at the next commit
    uncommitted_ids: set = field(default_factory=set)  # the same, for lookups
    first_uncommitted: float = 0.0
    steps_since_commit: int = 0
    serving_model: tuple[int, object] | None = None  # (version, network) last built, saves a load per commit
    serving_bd: tuple[int, dict] | None = None  # (version, held-out record id -> its BD per position)


def save_checkpoint(store: ModelStore, variant: VariantState) -> None:
    """Replace the variant's checkpoint in ``store`` with its state now."""
    store.save_state(variant.key, {
        "learner": variant.learner.state_dict(),
        "serving_version": variant.serving_version,
        "applied": list(variant.applied),
        "usage": variant.usage,
        "holdout": [r.encode() for r in variant.holdout],
    })


def restore_checkpoint(variant: VariantState, state: dict, limits: FeedbackLimits) -> None:
    """Take a checkpoint ``save_checkpoint`` wrote (and ``checkpoint_conflict`` accepted) as the
    variant's state; its held-out records are decoded under ``limits``."""
    variant.learner.load_state_dict(state["learner"])
    variant.serving_version = int(state["serving_version"])
    variant.applied = OrderedDict((i, None) for i in state["applied"])
    variant.usage = {t: list(u) for t, u in state["usage"].items()}
    variant.holdout = deque(FeedbackRecord.decode(p, limits) for p in state["holdout"])


def checkpoint_conflict(online: OnlineConfig, state: dict | None, key: VariantKey, where: str) -> str | None:
    """Why a variant's stored learner checkpoint cannot go on under ``online`` - it was made by
    another algorithm, or by an ensemble of another size - or None when it can (or there is none)."""
    if state is None:
        return None
    learner = state.get("learner") or {}
    saved_config = learner.get("config") or {}
    saved = saved_config.get("algorithm")
    saved_members = len(learner.get("members") or ())
    members = len(online.hedge_lrs) if online.algorithm == "hedge" else 1

    def plural(n: int) -> str:
        return f"{n} member" + ("s" if n != 1 else "")

    if saved != online.algorithm or saved_members != members:
        return (f"the learner checkpoint of {key.scope}/{key.drafter} in the model store {where} was made by {saved} "
                f"({plural(saved_members)}), not {online.algorithm} ({plural(members)}); learn on with the algorithm "
                "it was trained with, or use another model store")
    saved_blocks = saved_config.get("trainable_blocks")
    if saved_blocks != online.trainable_blocks:
        # The optimiser state (AdaGrad sums, optimistic hints) holds one tensor per trained parameter.
        def blocks(n: int | None) -> str:
            return "every block" if n is None else f"the last {n} block(s)"

        return (f"the learner checkpoint of {key.scope}/{key.drafter} in the model store {where} trained "
                f"{blocks(saved_blocks)}, not {blocks(online.trainable_blocks)}; learn on with the setting it was "
                "trained with, or use another model store")
    return None
