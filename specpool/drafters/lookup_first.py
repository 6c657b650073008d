"""Prompt lookup first, a model drafter where nothing matches: ``lookup:SPEC``.

Where the context repeats itself (identifiers in code, names and numbers copied into a
translation or a summary), prompt lookup (specpool/drafters/ngram.py) proposes up to k tokens for no model
work and is usually right; elsewhere it has nothing to say, and a model drafter guesses. The two
fail in different places, so one drafter that asks lookup first and falls back to the model
(``lookup:code``, ``lookup:zoo:PATH``, ``lookup:hf:ID``) keeps both strengths: it is the model's
acceptance plus the copies, at the n-gram's price on the copied rounds.

Each round's proposal comes whole from one of the two, with that one's exact q (one-hot for a
lookup match, the model's top-K otherwise), so verification stays exact. The lookup adapts its
draft length to its own acceptance, as the plain n-gram drafter does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specpool.drafters.base import (CostMeter, DraftRequest, Drafter, Proposal, Replayable, TreeDrafter, WhiteBox,
                                    leading_matches, propose_many, samples_trees)
from specpool.drafters.ngram import NGramDrafter
from specpool.drafters.registry import DrafterContext, create_drafter, register_drafter
from specpool.core.errors import InvalidArgument
from specpool.target.features import Features
from specpool.target.sampling import SamplingParams


class LookupFirstDrafter:
    """``inner`` drafts only the rounds where ``lookup`` finds no match."""

    def __init__(self, name: str, inner: Drafter, lookup: NGramDrafter | None = None):
        self.name = name
        self.inner = inner
        self.lookup = lookup if lookup is not None else NGramDrafter(f"{name}/lookup")
        self.tokenizer_fingerprint = inner.tokenizer_fingerprint
        # In front of a white-box head (``lookup:eagle:code``) it passes the target's features on.
        self.feature_width = inner.feature_width if isinstance(inner, WhiteBox) else 0
        # In front of a tree drafter (``lookup:eagle-alt:code``) a round lookup does not answer is
        # the inner drafter's tree (``propose_tree``); a lookup match stays a chain.
        self.tree_nodes = inner.tree_nodes if isinstance(inner, TreeDrafter) else 0
        self.cost = CostMeter()
        self.lookup_rounds = 0  # raw counters: rounds answered by lookup, and by the inner drafter
        self.inner_rounds = 0

    @property
    def sampled_trees(self) -> bool:
        """Its inner drafter's trees in sampled rounds too (a lookup match stays a chain)."""
        return samples_trees(self.inner)

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        return self._propose(session_id, context_ids, k, params, self.inner.propose)

    def propose_tree(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        """``specpool.drafters.base.TreeDrafter``: lookup's chain where it matches, else the inner
        drafter's tree."""
        return self._propose(session_id, context_ids, k, params, self.inner.propose_tree)  # type: ignore[attr-defined]

    def _propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams, inner) -> Proposal:
        started = time.perf_counter()
        proposal = self.lookup.propose(session_id, context_ids, k, params)
        if proposal.tokens:
            self.lookup_rounds += 1
        else:
            proposal = inner(session_id, context_ids, k, params)
            self.inner_rounds += 1
        self.cost.record(time.perf_counter() - started, len(proposal.tokens))
        return proposal

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """``specpool.drafters.base.BatchDrafter``: lookup for each session, then the inner drafter for
        those lookup does not answer, batched where it can (``propose_many``). Each proposal's cost
        record is an equal share of the batch's wall time."""
        started = time.perf_counter()
        proposals = [self.lookup.propose(r.session_id, r.context_ids, r.k, r.params) for r in requests]
        unanswered = [i for i, p in enumerate(proposals) if not p.tokens]
        self.lookup_rounds += len(requests) - len(unanswered)
        self.inner_rounds += len(unanswered)
        for i, proposal in zip(unanswered, propose_many(self.inner, [requests[i] for i in unanswered])):
            proposals[i] = proposal
        share = (time.perf_counter() - started) / max(len(requests), 1)
        for proposal in proposals:
            self.cost.record(share, len(proposal.tokens))
        return proposals

    def replay(self, session_id: str, context_ids: list[int], continuation: list[int], k: int,
               params: SamplingParams) -> int | None:
        """``specpool.drafters.base.Replayable``: the lookup's would-be copy where it matches, else the inner
        drafter's replay (None when the inner drafter cannot replay)."""
        copied = self.lookup.would_propose(session_id, context_ids, k)
        if copied:
            return leading_matches(copied, continuation)
        if not isinstance(self.inner, Replayable):
            return None
        return self.inner.replay(session_id, context_ids, continuation, k, params)

    def observe_features(self, session_id: str, features: Features) -> None:
        if isinstance(self.inner, WhiteBox):
            self.inner.observe_features(session_id, features)

    def release(self, session_id: str) -> None:
        self.lookup.release(session_id)
        self.inner.release(session_id)


@register_drafter("lookup")
def _make_lookup_first(name: str, argument: str, context: DrafterContext) -> LookupFirstDrafter:
    """``lookup:SPEC``: prompt lookup, then the drafter SPEC names (``lookup:code``)."""
    if not argument:
        raise InvalidArgument("lookup needs a drafter to fall back to: lookup:SPEC, e.g. lookup:code")
    if argument.partition(":")[0] in ("lookup", "ngram", "none"):
        raise InvalidArgument(f"bad drafter spec {name!r}: lookup falls back to a model drafter, not {argument!r}")
    return LookupFirstDrafter(name, create_drafter(argument, context))
