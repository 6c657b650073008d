"""A zoo drafter network's weights as the online learner handles them: trainable copies of the
shipped network (``clone_zoo``, ``freeze_lower_blocks``), its own state without the shared frozen
embedding (``own_state``, ``load_own_state``), the copy term's configuration (``with_copy_term``;
the term itself is specpool/drafters/zoo_model.py's), and the network of a published version
(``build_served_model``: one ZooLM, or a ZooEnsembleLM from specpool/learning/ensemble.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specpool.core.errors import InvalidArgument, ModelUnavailable
from specpool.drafters.zoo_model import ZooConfig, ZooLM
from specpool.learning.ensemble import ZooEnsembleLM


def with_copy_term(config: ZooConfig, window: int, scale: float) -> ZooConfig:
    """``config`` with a copy term of ``window`` and ``scale`` (``window`` 0: without one)."""
    return replace(config, copy_window=int(window), copy_scale=float(scale))


def load_own_state(model: ZooLM, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` strictly, except that a copy weight it lacks (it was saved without the copy
    term) starts at 0, which is the network ``state`` describes."""
    if model.config.copy_window and "copy_weight" not in state:
        state = {**state, "copy_weight": torch.zeros(1)}
    if not model.config.copy_window and "copy_weight" in state:
        raise InvalidArgument("the saved drafter has a copy term and this learner none: set the same copy window")
    model.load_state_dict(state)


def clone_zoo(base: ZooLM, copy_window: int | None = None, copy_scale: float = 100.0) -> ZooLM:
    """A trainable copy of ``base`` that shares its frozen embedding matrix (never copied); with
    ``copy_window`` given, with that copy term (a new one starts at 0)."""
    config = base.config if copy_window is None else with_copy_term(base.config, copy_window, copy_scale)
    model = ZooLM(config, base.embedding, base.vocab_ids.clone())
    state = base.state_dict()
    if not config.copy_window:
        state.pop("copy_weight", None)
    load_own_state(model, state)
    return model.to(base.device)


def freeze_lower_blocks(model: ZooLM, trainable_blocks: int | None) -> None:
    """Keep only the last ``trainable_blocks`` blocks trainable (None: all of them); the output
    bias, the final norm and the copy weight always are."""
    if trainable_blocks is None:
        return
    frozen = len(model.blocks) - min(trainable_blocks, len(model.blocks))
    for block in list(model.blocks)[:frozen]:
        block.requires_grad_(False)


def own_state(model: ZooLM) -> dict[str, torch.Tensor]:
    """A member's weights as a learner saves and publishes them: its state without ``vocab_ids``,
    which is stored once for all members (the frozen embedding is never in a state)."""
    return {k: v for k, v in model.state_dict().items() if k != "vocab_ids"}


def version_members(tensors: dict[str, torch.Tensor], metadata: dict) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """The states (float32) of the members a published version serves - those its served mixture
    (``served_weights``) keeps - and their weights renormalised (None when one member is left)."""
    count = int(metadata.get("members", 1))
    weights = tensors["served_weights"] if "served_weights" in tensors else tensors.get("hedge_weights")
    chosen = [i for i in range(count) if count == 1 or float(weights[i]) > 0]
    states = [{k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
              for prefix in (f"members.{i}." for i in chosen)]
    return states, (weights[chosen] / weights[chosen].sum() if len(chosen) > 1 else None)


def build_served_model(base: ZooLM, tensors: dict[str, torch.Tensor], metadata: dict) -> nn.Module:
    """The drafter network of a published version: a ZooLM, or a ZooEnsembleLM for several members.
    A version learnt with vocabulary growth carries its own ``vocab_ids``, one with a copy term
    its window and scale (metadata ``copy_window``, ``copy_scale``). An ensemble's version lists
    its served mixture (``served_weights``): members left out of it are not built, and a single
    one left is served alone."""
    try:
        vocab_ids = tensors["vocab_ids"].long() if "vocab_ids" in tensors else base.vocab_ids
        config = with_copy_term(base.config, int(metadata.get("copy_window", 0)), float(metadata.get("copy_scale", 100.0)))
        states, weights = version_members(tensors, metadata)
        members = []
        for state in states:
            member = ZooLM(config, base.embedding, vocab_ids)
            member.load_state_dict({**state, "vocab_ids": vocab_ids})
            members.append(member.to(base.device).eval())
        if weights is None:
            return members[0]
        return ZooEnsembleLM(members, weights).to(base.device).eval()
    except Exception as exc:  # noqa: BLE001 - a bad version must not take serving down
        raise ModelUnavailable(f"published drafter weights do not fit the drafter ({type(exc).__name__}: {exc})") from None
