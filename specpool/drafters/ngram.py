"""Model-free drafter: prompt lookup / n-gram matching.

Saxena, "Prompt Lookup Decoding" (2023); Yang et al., "Inference with Reference" (2023).
Find the longest suffix of the context (``max_ngram`` down to ``min_ngram`` tokens) that occurred
earlier, and propose what followed its most recent occurrence. q is one-hot.

A miss must cost almost nothing, and a verify pass over many positions is not free on a CPU
(each extra position costs roughly ``verify_cost_per_token`` of a decode step). So the drafter
tracks, per session, how often its proposals were accepted — read off the next call's context,
which holds the accepted tokens — and proposes the draft length that maximises expected tokens
per unit of verify cost: with per-token acceptance a, E[tokens](k) = (1 - a^(k+1)) / (1 - a)
(Leviathan et al. 2023, eq. 1) against cost 1 + c·k. When nothing matches it proposes nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specpool.drafters.base import LOOKUP_SOURCE, CostMeter, Proposal, leading_matches
from specpool.drafters.registry import DrafterContext, register_drafter
from specpool.core.errors import InvalidArgument
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams


@dataclass
class _SessionStats:
    """Acceptance bookkeeping of one session: a Beta-like running estimate of per-token
    acceptance, and the last proposal, to score it when the next context arrives."""

    accepted: float  # pseudo-counts of accepted draft tokens
    tried: float  # pseudo-counts of draft tokens that were put to the test
    last_context_length: int = -1
    last_proposal: tuple[int, ...] = ()

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


def best_draft_length(acceptance: float, k_max: int, cost_per_token: float) -> int:
    """argmax_k E[tokens](k) / (1 + c·k) for k in 1..k_max, E[tokens] = sum_{i<=k} a^i."""
    best_k, best_value, expected, power = 1, 0.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        power *= acceptance
        expected += power  # 1 + a + ... + a^k
        value = expected / (1.0 + cost_per_token * k)
        if value > best_value + 1e-12:
            best_k, best_value = k, value
    return best_k


class NGramDrafter:
    tokenizer_fingerprint = None  # works with any tokenizer

    def __init__(
        self,
        name: str = "ngram",
        max_ngram: int = 4,
        min_ngram: int = 2,
        adaptive: bool = True,
        verify_cost_per_token: float = 0.12,  # extra verify cost per draft token, in decode steps
        prior_acceptance: float = 0.6,  # belief before any evidence (weight: prior_weight tokens)
        prior_weight: float = 4.0,
        decay: float = 0.9,  # per-round forgetting, so a session's phase change shows quickly
        session_capacity: int = 1024,
    ):
        self.name = name
        self.max_ngram = max_ngram  # longest suffix tried first: longer matches are more reliable
        self.min_ngram = min_ngram  # 1-token matches are mostly noise and cost a wider verify pass
        self.adaptive = adaptive
        self.verify_cost_per_token = verify_cost_per_token
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.decay = decay
        self.session_capacity = session_capacity
        self.cost = CostMeter()
        self._sessions: OrderedDict[str, _SessionStats] = OrderedDict()

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        started = time.perf_counter()
        stats = self._observe(session_id, context_ids) if self.adaptive else None
        continuation = self.lookup(context_ids, k)
        if stats is not None and continuation:
            continuation = self._cut(continuation, stats, k)
            stats.last_context_length, stats.last_proposal = len(context_ids), tuple(continuation)
        self.cost.record(time.perf_counter() - started, max(len(continuation), 1))
        # A miss proposes nothing: that round is the n-gram drafter's own (a target-only step),
        # where a lookup:SPEC drafter would have asked its model instead.
        return Proposal(continuation, [SparseDist.one_hot(t) for t in continuation],
                        source=LOOKUP_SOURCE if continuation else None)

    def would_propose(self, session_id: str, context_ids: list[int], k: int) -> list[int]:
        """What ``propose`` would return after ``context_ids``, changing no state."""
        continuation = self.lookup(context_ids, k)
        if self.adaptive and continuation:
            stats = self._sessions.get(session_id)
            stats = self._scored(replace(stats) if stats is not None else self._fresh(), context_ids)
            continuation = self._cut(continuation, stats, k)
        return continuation

    def _cut(self, continuation: list[int], stats: _SessionStats, k: int) -> list[int]:
        """The lookup's match cut to the draft length that pays best at the session's acceptance."""
        return continuation[: best_draft_length(stats.rate, min(k, len(continuation)), self.verify_cost_per_token)]

    def replay(self, session_id: str, context_ids: list[int], continuation: list[int], k: int,
               params: SamplingParams) -> int:
        """``specpool.drafters.base.Replayable``: the lookup is model-free, so this is just its would-be
        proposal against the target's tokens (a miss: 0)."""
        return leading_matches(self.would_propose(session_id, context_ids, k), continuation)

    def _fresh(self) -> _SessionStats:
        return _SessionStats(self.prior_acceptance * self.prior_weight, self.prior_weight)

    def _observe(self, session_id: str, context_ids: list[int]) -> _SessionStats:
        """Score the session's previous proposal against the context that followed it."""
        stats = self._sessions.pop(session_id, None)
        if stats is None:
            stats = self._fresh()
        self._sessions[session_id] = stats
        while len(self._sessions) > self.session_capacity:
            self._sessions.popitem(last=False)
        return self._scored(stats, context_ids)

    def _scored(self, stats: _SessionStats, context_ids: list[int]) -> _SessionStats:
        """``stats`` after scoring its pending proposal against ``context_ids`` (in place)."""
        if stats.last_proposal and len(context_ids) > stats.last_context_length:
            start = stats.last_context_length
            arrived = context_ids[start:start + len(stats.last_proposal)]
            accepted = leading_matches(list(stats.last_proposal), arrived)
            # Tokens after the first rejection were never tested: count accepted + 1 trials
            # (or all of them when everything was accepted).
            tried = min(accepted + 1, len(stats.last_proposal))
            stats.accepted = stats.accepted * self.decay + accepted
            stats.tried = stats.tried * self.decay + tried
        stats.last_proposal = ()
        return stats

    def lookup(self, context_ids: list[int], k: int) -> list[int]:
        context = np.asarray(context_ids, dtype=np.int64)  # (L,)
        length = len(context)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context[length - n:]  # (n,)
            # Windows that start before the suffix itself (so at least one token follows them).
            windows = sliding_window_view(context[: length - 1], n)  # (L-n, n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if starts.size:
                begin = int(starts[-1]) + n  # most recent occurrence
                return context[begin: begin + k].tolist()
        return []

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


@register_drafter("ngram")
def _make_ngram(name: str, argument: str, context: DrafterContext) -> NGramDrafter:
    """``ngram`` or ``ngram:MAX`` or ``ngram:MIN-MAX`` (n-gram lengths tried)."""
    if not argument:
        return NGramDrafter(name)
    low, dash, high = argument.partition("-")
    if not dash:  # ngram:MAX
        low, high = str(min(2, int(low))) if low.isdigit() else low, low
    try:
        max_ngram, min_ngram = int(high), int(low)
    except ValueError:
        raise InvalidArgument(f"bad n-gram drafter spec {name!r}; use ngram, ngram:MAX or ngram:MIN-MAX") from None
    if not 1 <= min_ngram <= max_ngram:
        raise InvalidArgument(f"bad n-gram drafter spec {name!r}: need 1 <= MIN <= MAX")
    return NGramDrafter(name, max_ngram=max_ngram, min_ngram=min_ngram)
