"""Drafters the target hosts: a round drafted and verified in one call.

A white-box head reads the target's features, and the target has them the moment it verifies. Served
with a drafter deployment of its own, each round crosses two replicas: the router asks the drafter
(sending it the features the target returned last round), then asks the target to verify. vLLM,
SGLang and TensorRT-LLM instead run the EAGLE head in the target's own worker. ``HostingVerifier``
does that here: it wraps the target's ``TargetVerifier`` with the drafters it hosts, and a round
names the arm to draft (``HostedDraft``); it drafts, verifies the draft in the same forward batch
as every other session's round, and hands the round's features to its hosted heads in process
(nothing on the wire). The sessions of a batch that play one arm draft together where the arm can
(``BatchDrafter``: one head forward per draft step for all of them, as vLLM's EAGLE proposer drafts
for its whole batch). The router sees such an arm as a ``HostedArm``, a stand-in that says who
drafts; ``speculative_generate`` then calls ``DraftingVerifier.draft_and_verify`` instead of the
drafter and the verifier in turn. Same drafter, same context, same seeded draws: the same proposals
and tokens as a drafter called on its own (``tests/unit/test_hosted.py``).

Hosted arms serve their shipped weights: online learning (versions per request, feedback records
with features) and replays (side observations) stay with drafter deployments.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specpool.core.errors import FailedPrecondition, InvalidArgument, NotFound, SpecpoolError
from specpool.drafters.base import (UNDRAFTED_SOURCE, BatchDrafter, CostMeter, DraftRequest, Drafter, Proposal, TreeDrafter,
                                    WhiteBox, reads_features, samples_trees)
from specpool.target.features import FeatureGap
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest, VerifyResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostedDraft:
    """What a round asks of a verifier that hosts drafters, beside the ``VerifyRequest``."""

    drafter: str | None  # the hosted arm that drafts this round; None: the request carries its draft
    k: int = 0  # most tokens to draft (with ``drafter``)
    tree: bool = False  # draft a tree, if the arm drafts trees (greedy rounds, see the loop)
    # The session's hosted white-box arms: each gets this round's features (all of them, every
    # round, so an arm not played for a while still holds the whole context's, as in the loop).
    feed: tuple[str, ...] = ()


@runtime_checkable
class DraftingVerifier(Protocol):
    """A verifier that also drafts for the arms it hosts (``HostingVerifier``, or the target deployment
    through ``RemoteVerifier``)."""

    def draft_and_verify(self, request: VerifyRequest, draft: HostedDraft) -> tuple[Proposal, VerifyResult]:
        """Draft with ``draft.drafter`` (if set: ``request`` then carries no draft) and verify.
        Returns the round's proposal (the request's own when it carried one) and its result."""
        ...


class HostedArm:
    """The router's stand-in for an arm its target hosts: the pool and the policies see a drafter
    by that name; the loop sees ``hosted_by_target`` and lets the target draft.

    ``propose`` is never called by the loop; a caller that does gets an error naming the cause."""

    hosted_by_target = True

    def __init__(self, name: str, tokenizer_fingerprint: str | None, white_box: bool, tree_nodes: int = 0,
                 sampled_trees: bool = False):
        self.name = name
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.white_box = white_box  # reads the target's features (the loop's first round is then a prefill)
        self.tree_nodes = tree_nodes
        self.sampled_trees = sampled_trees  # its trees may be sampled (``TreeDrafter``)
        self.cost = CostMeter()  # the target's drafting time per proposed token (its forward_s)

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        raise FailedPrecondition(f"drafter {self.name!r} is hosted by the target: its rounds are drafted in the verify call")

    def release(self, session_id: str) -> None:
        """Nothing here: the target frees the arm's session with its own."""


def is_hosted(drafter: object) -> bool:
    return getattr(drafter, "hosted_by_target", False) is True


def hosted_arm_of(name: str, drafter: Drafter) -> HostedArm:
    """The stand-in for ``drafter`` hosted under ``name`` (in process: tests, the embedded check)."""
    return HostedArm(name, drafter.tokenizer_fingerprint, reads_features(drafter),
                     int(drafter.tree_nodes) if isinstance(drafter, TreeDrafter) else 0, samples_trees(drafter))



class LoadGate:
    """Whether a verify batch of several sessions is worth drafting for, measured as it serves.

    A batched verify pads every session's round to the longest one's positions, so its cost grows
    with sessions × draft length whether or not the drafts are accepted, and the host drafts before
    it. With one session a forward's cost is mostly reading the weights, and a round's five more
    positions cost little (``bench/results/cpu-linear``). With eight sessions on a CPU the forward is
    compute-bound, and their rounds cost more than the accepted tokens are worth: eight sessions
    always busy decoded fewer tokens a second drafting than plain batched decoding did
    (``bench/results/hosted-drafting``). vLLM has a fixed switch for this
    (``speculative_disable_by_batch_size``); how many sessions are too many depends on the machine,
    the model and the heads' acceptance, so here it is measured.

    Per batch size B ≥ 2, the gate keeps an exponentially weighted mean of the tokens per second a
    batch emitted (drafting plus verifying) when its hosted arms drafted and when they did not, and
    drafts when drafting has measured faster (batches holding a prompt's prefill are not measured).
    Every ``explore_every``-th batch of a size plays the other choice, so a changed load keeps being
    measured (deterministic: no random draws), and each choice is played ``min_batches`` times
    first. A plain batch verifies its hosted rounds without a draft: target-only rounds, lossless as
    any. One session always drafts; a batch that asks no hosted arm for a draft is not the gate's."""

    def __init__(self, min_batches: int = 4, explore_every: int = 10, decay: float = 0.9, max_fed_per_row: int = 16):
        if min_batches < 1 or explore_every < 2 or not 0.0 < decay < 1.0:
            raise InvalidArgument(f"a load gate needs min_batches >= 1, explore_every >= 2 and decay in (0, 1); "
                                  f"got {min_batches}, {explore_every}, {decay}")
        self.min_batches = min_batches
        self.explore_every = explore_every
        self.decay = decay
        # A batch where a session feeds more positions than this holds a prompt's prefill (or a long
        # catch-up): it costs the same either way and would drown the difference, so it is not measured.
        self.max_fed_per_row = max_fed_per_row
        self._rate: dict[tuple[int, bool], float] = {}  # (sessions, drafted) -> tokens per second, EW mean
        self._count: dict[tuple[int, bool], int] = {}
        self._batches: dict[int, int] = {}
        self.plain_batches = 0  # batches verified without hosted drafts (counted for reports)

    def drafts(self, sessions: int) -> bool:
        """Whether the hosted arms draft for a batch of ``sessions`` sessions."""
        if sessions < 2:
            return True
        seen = self._batches.get(sessions, 0)
        self._batches[sessions] = seen + 1
        counts = {choice: self._count.get((sessions, choice), 0) for choice in (True, False)}
        if min(counts.values()) < self.min_batches:
            return counts[True] <= counts[False]  # measure both first, drafting first
        best = self._rate[sessions, True] >= self._rate[sessions, False]
        return (not best) if seen % self.explore_every == self.explore_every - 1 else best

    def observe(self, sessions: int, drafted: bool, tokens: int, seconds: float, most_fed: int = 0) -> None:
        """A batch of ``sessions`` sessions emitted ``tokens`` in ``seconds`` (drafting and verifying),
        the widest session feeding ``most_fed`` positions."""
        self.plain_batches += sessions >= 2 and not drafted
        if sessions < 2 or seconds <= 0.0 or most_fed > self.max_fed_per_row:
            return
        key = (sessions, drafted)
        rate = tokens / seconds
        self._rate[key] = rate if key not in self._rate else self.decay * self._rate[key] + (1 - self.decay) * rate
        self._count[key] = self._count.get(key, 0) + 1

    def rates(self) -> dict[str, float]:
        """The measured means, "B drafted" / "B plain" -> tokens per second (for reports)."""
        return {f"{b} {'drafted' if d else 'plain'}": rate for (b, d), rate in sorted(self._rate.items())}


class HostingVerifier:
    """A ``TargetVerifier`` with the drafters it hosts (see the module docstring). Not thread-safe,
    like the verifier: the target deployment calls it from its one model thread."""

    def __init__(self, verifier: TargetVerifier, drafters: Mapping[str, Drafter], gate: LoadGate | None = None):
        self.verifier = verifier
        self.drafters = dict(drafters)
        self.draft_failures = 0  # rounds whose hosted draft raised (verified with no draft instead)
        self.gate = gate  # None: the hosted arms draft for every batch

    # -- what the loop and the deployment call --------------------------------------------------------
    @property
    def verifies_trees(self) -> bool:
        return bool(getattr(self.verifier, "verifies_trees", False))

    @property
    def verifies_sampled_trees(self) -> bool:
        return bool(getattr(self.verifier, "verifies_sampled_trees", False))

    def verify(self, request: VerifyRequest) -> VerifyResult:
        return self.verifier.verify(request)

    def draft_and_verify(self, request: VerifyRequest, draft: HostedDraft) -> tuple[Proposal, VerifyResult]:
        outcome = self.verify_batch([(request, draft)])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def verify_batch(self, items: Sequence[tuple[VerifyRequest, HostedDraft | None]]
                     ) -> list[tuple[Proposal, VerifyResult] | SpecpoolError]:
        """Draft each item's hosted arm (the chains of the sessions that play one arm together, in
        one head forward per draft step where it can: ``BatchDrafter``), verify all of them in one
        batched forward, then give each session's hosted heads its features. A failed item's entry
        is its error; the others go on."""
        started = time.perf_counter()
        outcomes: list = [None] * len(items)
        gated = self.gate is not None and any(d is not None and d.drafter is not None and d.k > 0 for _, d in items)
        drafting = not gated or self.gate.drafts(len(items))
        proposals = self._draft_all(items, outcomes, drafting)
        ready: list[tuple[int, VerifyRequest, Proposal, HostedDraft | None]] = []
        for i, (request, draft) in enumerate(items):
            if outcomes[i] is None:
                proposal = proposals.get(i) or Proposal(
                    list(request.draft_tokens), list(request.q),
                    parents=tuple(request.tree_parents) if request.tree_parents is not None else None)
                ready.append((i, self._request_for(request, draft, proposal), proposal, draft))
        requests = [request for _, request, _, _ in ready]
        most_fed = max((self.verifier.new_tokens(r) for r in requests), default=0) if gated else 0
        results = self.verifier.verify_batch(requests) if requests else []
        for (i, request, proposal, draft), result in zip(ready, results):
            if isinstance(result, BaseException):
                outcomes[i] = result
                continue
            try:
                result = self._fed(request, draft, result)
            except SpecpoolError as exc:
                outcomes[i] = exc
                continue
            if not items[i][0].return_features and result.features is not None:
                result = dataclasses.replace(result, features=None)  # read here; the caller did not ask
            outcomes[i] = (proposal, result)
        if gated:
            self.gate.observe(len(items), drafting, sum(len(o[1].tokens) for o in outcomes if isinstance(o, tuple)),
                              time.perf_counter() - started, most_fed)
        return outcomes

    def release(self, session_id: str) -> None:
        self.verifier.release(session_id)
        for drafter in self.drafters.values():
            drafter.release(session_id)

    # -- the steps -------------------------------------------------------------------------------------
    def _arm(self, name: str) -> Drafter:
        drafter = self.drafters.get(name)
        if drafter is None:
            raise NotFound(f"this target hosts no drafter {name!r} (it hosts: {', '.join(sorted(self.drafters)) or 'none'})")
        return drafter

    def _draft_all(self, items: Sequence[tuple[VerifyRequest, HostedDraft | None]], outcomes: list,
                   drafting: bool = True) -> dict[int, Proposal]:
        """The proposals of the items a hosted arm drafts (by item index; with ``drafting`` off, an
        empty one each: the gate chose a plain batch). An invalid item gets its error in ``outcomes``
        before any work. A tree arm drafts its tree only for a batch of one session: a tree needs a
        forward of its own, so in a batch of several the verifier verifies only its first branch
        inside the batched forward (``TargetVerifier.verify_batch``), and the arm drafts that chain
        without the tree's extra work. The chains of an arm's sessions go to it together
        (``propose_many``)."""
        proposals: dict[int, Proposal] = {}
        alone = len(items) == 1
        chains: dict[str, list[int]] = {}  # arm -> the items whose chains it drafts
        for i, (request, draft) in enumerate(items):
            if draft is None:
                continue
            try:
                for name in draft.feed:
                    self._arm(name)  # unknown names fail the round, before any work
                if draft.drafter is None or draft.k <= 0:
                    continue
                drafter = self._arm(draft.drafter)
                if request.draft_tokens:
                    raise FailedPrecondition("a round drafted by a hosted arm carries no draft tokens of its own")
            except SpecpoolError as exc:
                outcomes[i] = exc
                continue
            if not drafting:
                proposals[i] = Proposal([], [], source=UNDRAFTED_SOURCE)  # no arm's round (router/bandit.py)
            elif (alone and draft.tree and isinstance(drafter, TreeDrafter) and drafter.tree_nodes > 0
                    and (self.verifies_trees if request.params.greedy
                         else self.verifies_sampled_trees and samples_trees(drafter))):
                proposals[i] = self._guarded(draft.drafter, lambda: drafter.propose_tree(
                    request.session_id, request.context_ids, draft.k, request.params))
            else:
                chains.setdefault(draft.drafter, []).append(i)
        for name, members in chains.items():
            asks = [DraftRequest(items[i][0].session_id, items[i][0].context_ids, items[i][1].k, items[i][0].params)
                    for i in members]
            proposals.update(zip(members, self._chains(name, asks)))
        return proposals

    def _chains(self, name: str, asks: list[DraftRequest]) -> list[Proposal]:
        """The arm's chains for ``asks``, as the loop would ask a drafter of its own for each. A batch
        that fails is drafted again one session after another, so only a session whose own draft
        fails loses it."""
        drafter = self.drafters[name]
        if isinstance(drafter, BatchDrafter) and len(asks) > 1:
            try:
                return drafter.propose_batch(asks)
            except Exception:  # noqa: BLE001 - drafts are suggestions: fall back to one session at a time
                logger.exception("hosted drafter %s failed on a batch of %d sessions; drafting them one by one",
                                 name, len(asks))
        return [self._guarded(name, lambda a=a: drafter.propose(a.session_id, a.context_ids, a.k, a.params))
                for a in asks]

    def _guarded(self, name: str, draft: Callable[[], Proposal]) -> Proposal:
        """``draft()``, or no draft where it raises: a drafter that fails costs the round its draft (a
        target-only round), never the request, as a drafter deployment that fails
        (``specpool/services/remote.py``)."""
        try:
            return draft()
        except Exception:  # noqa: BLE001 - a draft is only a suggestion: the round goes on without one
            self.draft_failures += 1
            logger.exception("hosted drafter %s failed; the round is verified without a draft", name)
            return Proposal([], [])

    @staticmethod
    def _request_for(request: VerifyRequest, draft: HostedDraft | None, proposal: Proposal) -> VerifyRequest:
        """The request that verifies ``proposal`` (with features when hosted heads read them)."""
        if draft is None:
            return request
        return dataclasses.replace(
            request, draft_tokens=list(proposal.tokens), q=list(proposal.q),
            tree_parents=proposal.parents if proposal.tokens else None,
            return_features=request.return_features or bool(draft.feed))

    def _fed(self, request: VerifyRequest, draft: HostedDraft | None, result: VerifyResult) -> VerifyResult:
        """Hand the round's features to the session's hosted heads, as the loop does for heads of its
        own (``hand_features``: a head missing earlier rows gets the round re-verified in full)."""
        if draft is None or not draft.feed:
            return result
        heads = [self.drafters[name] for name in draft.feed if reads_features(self.drafters[name])]
        return hand_features(heads, self.verifier, request, result) if heads else result


def hand_features(heads: Sequence[WhiteBox], verifier, request: VerifyRequest, result: VerifyResult) -> VerifyResult:
    """Give every white-box drafter of ``heads`` the round's features; returns the round's result. The
    loop (``speculative_generate``) calls it for the heads it holds, ``HostingVerifier`` for those it hosts.

    The target returns rows from the first position it fed, i.e. past the prefix it still had
    cached for the session. A head that lacks rows before that (the session's earlier requests had
    no white-box arm, or the head evicted the session) raises ``FeatureGap``: the round is then
    verified again from an empty target cache (``verifier.release``, where the verifier has one),
    which returns every row. Its outcome is the same round's (same logits up to float round-off,
    same seeded draws): one extra prefill, no change."""
    if result.features is None:
        raise FailedPrecondition("the pool has white-box drafters but the target returned no features "
                                 "(a target deployment too old to return them?)")
    try:
        for head in heads:
            head.observe_features(request.session_id, result.features)
    except FeatureGap:
        if not callable(getattr(verifier, "release", None)):
            raise
        verifier.release(request.session_id)
        result = verifier.verify(request)
        if result.features is None:
            raise FailedPrecondition("the target returned no features on a re-verified round") from None
        for head in heads:
            head.observe_features(request.session_id, result.features)
    return result
