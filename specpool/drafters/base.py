"""The ``Drafter`` protocol: propose k tokens and the distributions they were drawn from; and the
optional capabilities a drafter may have, as protocols checked with ``isinstance``: ``Replayable``
(side observations), ``PerRequestVersions`` (online-learned weights pinned per request),
``TreeDrafter``, ``BatchDrafter`` (several sessions' drafts in one forward) and ``WhiteBox``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from specpool.target.features import Features
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams


# A proposal's ``source`` when prompt lookup (specpool/drafters/ngram.py) made it. Several drafters of one
# pool can answer a round by the same lookup (``ngram`` and every ``lookup:SPEC``); such a round
# says nothing about which of them is better, so the router does not credit it to the arm played.
LOOKUP_SOURCE = "lookup"
# A proposal's ``source`` when the target hosting the arm chose not to draft that round (its load
# gate, specpool/router/hosted.py): a target-only round that says nothing about the arm either.
UNDRAFTED_SOURCE = "undrafted"


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # x_1..x_k'; k' <= k (a drafter may propose fewer, even none)
    q: list[SparseDist]  # q_i, the exact distribution x_i was sampled from
    forward_s: float = 0.0  # time spent in model forwards (the rest of propose is bookkeeping)
    source: str | None = None  # what made it, where drafters share a part (LOOKUP_SOURCE); None: the drafter's own
    # A draft tree (specpool/target/tree.py): each token's parent, -1 for the last context token;
    # None: the tokens are a chain. Only ``TreeDrafter.propose_tree`` returns one.
    parents: tuple[int, ...] | None = None


@dataclass
class CostMeter:
    """Measured wall time per proposed token, an exponential moving average.

    Drafters report this so that cost-aware policies can weigh cheap drafters against good ones.
    """

    alpha: float = 0.1  # weight of the newest measurement
    seconds_per_token: float = 0.0
    calls: int = 0
    _started: bool = field(default=False, repr=False)

    def record(self, seconds: float, tokens: int) -> None:
        if tokens <= 0:
            return
        sample = seconds / tokens
        self.calls += 1
        if not self._started:
            self.seconds_per_token, self._started = sample, True
        else:
            self.seconds_per_token += self.alpha * (sample - self.seconds_per_token)


@runtime_checkable
class Drafter(Protocol):
    """What the router needs from a drafter. Implementations register a kind in the registry."""

    name: str
    tokenizer_fingerprint: str | None  # None: model-free, works with any tokenizer
    cost: CostMeter

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        """Propose up to k tokens continuing ``context_ids`` (the full context so far)."""
        ...

    def release(self, session_id: str) -> None:
        """Forget the session (its KV cache, if any)."""
        ...


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that can propose a draft tree (EAGLE-2): several continuations at once, verified
    in one target forward (specpool/target/tree.py). The loop asks for one only in rounds without
    online-learning feedback whose verifier verifies trees (``speculative_generate``): greedy rounds,
    and sampled ones where the drafter says ``sampled_trees`` and the verifier
    ``verifies_sampled_trees``; a drafter with ``tree_nodes`` 0 drafts chains.

    A sampled tree's contract (``specpool.target.rejection.speculative_verify_tree``): a node's
    children are distinct draws, in node order, without replacement from one q, which each child
    carries as its q; a drafter that cannot keep it leaves ``sampled_trees`` unset (False)."""

    tree_nodes: int  # > 0: it drafts trees (at most this many nodes, for an EAGLE-2 tree); 0: chains only

    def propose_tree(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        """A tree of at most ``tree_nodes`` nodes, at most ``k`` deep, in parent-first order."""
        ...


def samples_trees(drafter: object) -> bool:
    """Whether ``drafter`` drafts trees in sampled rounds too (``TreeDrafter``'s contract)."""
    return isinstance(drafter, TreeDrafter) and drafter.tree_nodes > 0 and getattr(drafter, "sampled_trees", False) is True


@dataclass(frozen=True)
class DraftRequest:
    """One session's ask of a drafter: what ``Drafter.propose`` takes, as one value."""

    session_id: str
    context_ids: list[int]
    k: int
    params: SamplingParams


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter that drafts several sessions' chains at once: one model forward per draft step
    over all of them, where one session after another costs a forward each. The target's host
    (``specpool/router/hosted.py``) asks it for every session of a verify batch that plays it."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Proposal i is what ``propose`` would return for request i (up to the float round-off of
        a batched forward; each q is still exactly the one its token was drawn from)."""
        ...


def propose_many(drafter: Drafter, requests: Sequence[DraftRequest]) -> list[Proposal]:
    """Chains for ``requests``: batched where ``drafter`` can, one after another otherwise."""
    if isinstance(drafter, BatchDrafter):
        return drafter.propose_batch(requests)
    return [drafter.propose(r.session_id, r.context_ids, r.k, r.params) for r in requests]


@runtime_checkable
class Replayable(Protocol):
    """A drafter that can say what it *would* have had accepted in a round it did not draft.

    After a greedy round the target's tokens are known, so a drafter fed them teacher-forced
    predicts every position in one forward and its would-be acceptance follows exactly: the
    bandit gets a side observation of an arm it did not play (router/policies.ReplayUCB).
    """

    def replay(self, session_id: str, context_ids: list[int], continuation: list[int], k: int,
               params: SamplingParams) -> int | None:
        """How many draft tokens this drafter, asked for up to k tokens after ``context_ids``
        under greedy ``params``, would have had accepted, given that the target's own tokens
        there are ``continuation``. Exact when below ``len(continuation)``; a lower bound when
        equal (the target's tokens past it are unknown); None where it cannot say (a wrapper
        around a drafter that cannot replay). Mutates nothing a later ``propose``
        depends on, beyond caching the context."""
        ...


@runtime_checkable
class PerRequestVersions(Protocol):
    """A drafter whose weights change between requests (online learning) and that pins one
    weights version per request, so a request never mixes versions (``specpool/services/remote.py``:
    the first round lets the server choose the tenant's serving version, later rounds ask for it).

    The request orchestrator (``specpool/services/orchestrator.py``) brackets each request with
    ``begin_request``/``end_request`` and stamps feedback with ``version_of``."""

    def begin_request(self, session_id: str, tenant: str) -> None: ...

    def end_request(self, session_id: str) -> None: ...

    def version_of(self, session_id: str) -> int:
        """The weights version the session's current request drafts with (0: shipped weights,
        or none chosen yet)."""
        ...


@runtime_checkable
class WhiteBox(Protocol):
    """A drafter that reads the target's features (``specpool/target/features.py``): an EAGLE-style
    head (``specpool/drafters/eagle.py``), or a wrapper around one. The request loop asks the target
    for features only when the pool holds one (``feature_width`` > 0) and hands every round's to
    each, so a head not played for a while still has the whole context's."""

    feature_width: int  # the target hidden size the head reads; 0: a wrapper around a black-box drafter

    def observe_features(self, session_id: str, features: Features) -> None:
        """The target's features from ``features.start`` on (they replace any held from there)."""
        ...


def reads_features(drafter: object) -> bool:
    """Whether ``drafter`` needs the target's features."""
    return isinstance(drafter, WhiteBox) and drafter.feature_width > 0


def leading_matches(proposed: list[int], continuation: list[int]) -> int:
    """Greedy acceptance: how many of ``proposed`` agree with ``continuation`` before the first
    difference."""
    accepted = 0
    for mine, theirs in zip(proposed, continuation):
        if mine != theirs:
            break
        accepted += 1
    return accepted
