"""The speculative loop for one request: choose a drafter, draft, verify, accept, repeat.

Pure logic over three collaborators passed in: a chooser (which drafter this round), the
drafters, and the target verifier. No threads, servers or clocks of its own beyond timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from specpool.drafters.base import Drafter, Proposal, Replayable, TreeDrafter, WhiteBox, reads_features
from specpool.core.errors import FailedPrecondition
from specpool.router.hosted import DraftingVerifier, HostedDraft, hand_features, is_hosted
from specpool.target.features import FeatureLog, Features
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import VerifyRequest, VerifyResult


class Verifier(Protocol):
    """What the loop needs from the target: one round's verification."""

    def verify(self, request: VerifyRequest) -> VerifyResult: ...


@runtime_checkable
class SessionVerifier(Verifier, Protocol):
    """A verifier that keeps a KV cache per session, and frees it when told (the local
    ``TargetVerifier`` and the target deployment's ``RemoteVerifier``)."""

    def release(self, session_id: str) -> bool | None: ...


@runtime_checkable
class FinishNoticed(Protocol):
    """A verifier that wants to hear when a session's request has ended and its caches stay (the
    target deployment's ``RemoteVerifier``: its verify batches stop waiting for that session)."""

    def request_finished(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class RoundRecord:
    """What one round did; the raw material for metrics, rewards and reports."""

    drafter: str | None  # the drafter chosen this round; None: target-only step
    k: int  # draft length asked for
    proposed: int  # draft tokens actually proposed (a drafter may propose fewer)
    accepted: int  # accepted draft tokens
    emitted: int  # tokens this round added to the output (accepted + 1, less after a stop)
    bd: float | None  # block divergence reward: mean over positions of 1 - TV(p, q)
    draft_s: float  # wall time of the drafter's propose call
    verify_s: float  # wall time of the target's verify call
    round_s: float  # wall time of the whole round, bookkeeping included
    draft_forward_s: float = 0.0  # time spent inside the drafter's model forwards
    verify_forward_s: float = 0.0  # time spent inside the target's forward
    source: str | None = None  # the proposal's source (specpool.drafters.base.LOOKUP_SOURCE); None: the drafter's own
    # Side observations (router/policies.ReplayUCB): drafter -> the accepted count it would have
    # had this round, replayed on the target's tokens; and the time those replays took.
    replays: Mapping[str, int] | None = None
    replay_s: float = 0.0


@dataclass(frozen=True)
class Choice:
    """What a chooser picked for one round."""

    drafter: str | None  # None: a target-only step
    k: int | None = None  # draft length; None: the request's k


@dataclass(frozen=True)
class RoundFeedback:
    """What a round that drafted something tells online learning (specpool/learning/feedback.py turns it
    into a bounded record). Only rounds with at least one draft token produce one."""

    session_id: str
    context_ids: list[int]  # everything before the first draft token
    drafter: str
    proposal: Proposal  # draft tokens and the q they were drawn from
    result: VerifyResult  # accepted count; target_top_k when the request asked for it
    record: RoundRecord
    # A white-box drafter's round: the target's features this request has been handed, from the
    # first position the target fed it (online learning of the heads). A view, valid during the
    # callback only: feedback copies the rows it keeps.
    features: Features | None = None


class DrafterChooser(Protocol):
    """Picks the drafter for each round and learns from its outcome (policies in router/)."""

    def select(self) -> Choice: ...

    def update(self, record: RoundRecord) -> None: ...


@runtime_checkable
class ReplayingChooser(Protocol):
    """A chooser that wants side observations: the drafters to replay on this round's target
    tokens, for arms it did not play (greedy rounds only; ``specpool/router/bandit.py``)."""

    def replay_arms(self, source: str | None) -> Sequence[str]: ...


@dataclass
class FixedChooser:
    """Always the same drafter (or none: target-only decoding)."""

    name: str | None

    def select(self) -> Choice:
        return Choice(self.name)

    def update(self, record: RoundRecord) -> None:
        pass


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens reached)
    rounds: list[RoundRecord] = field(default_factory=list)
    wall_s: float = 0.0
    chooser_s: float = 0.0  # time inside the chooser (policy math and session store), if measured
    trace: list = field(default_factory=list)  # the policy's per-round view (specpool/router/bandit.py), if asked

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round, bonus included (block efficiency, tau)."""
        return len(self.token_ids) / len(self.rounds) if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0

    def call_seconds(self) -> dict[str, float]:
        """The drafters' and the target's call and forward times, summed over rounds."""
        return {key: sum(getattr(r, key) for r in self.rounds)
                for key in ("draft_s", "draft_forward_s", "verify_s", "verify_forward_s")}

    def rounds_by_drafter(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self.rounds:
            key = record.drafter or "none"
            counts[key] = counts.get(key, 0) + 1
        return counts


def block_divergence(tv: list[float]) -> float | None:
    """MetaSD's BD reward: (1/k) sum_j (1 - TV(p_j, q_j)). None when nothing was drafted."""
    return sum(1.0 - d for d in tv) / len(tv) if tv else None


_EMPTY = Proposal([], [])


class _SeenFeatures:
    """The features one request has been handed, for its white-box rounds' feedback (float16,
    as they travel): rows from the first position the target fed, replaced from each round's start."""

    def __init__(self):
        self.base = 0
        self.log: FeatureLog | None = None

    def observe(self, features: Features) -> None:
        if self.log is None or not self.base <= features.start <= self.base + len(self.log):
            self.base, self.log = features.start, FeatureLog(int(features.rows.shape[1]), torch.float16)
        self.log.apply(Features(features.start - self.base, features.rows))

    def view(self) -> Features | None:
        return None if self.log is None else Features(self.base, self.log.rows(0))


def _replay(chooser: DrafterChooser, drafters: Mapping[str, Drafter], session_id: str, context: list[int],
            target_tokens: list[int], k: int, params: SamplingParams,
            source: str | None) -> tuple[dict[str, int] | None, float]:
    """Replay the drafters the chooser asks for on the target's tokens of this round (greedy
    only: a sampled draft is not determined by the context). Drafters that are not
    ``Replayable``, or answer None, are left out."""
    if not isinstance(chooser, ReplayingChooser) or not params.greedy or k <= 0 or not target_tokens:
        return None, 0.0
    names = chooser.replay_arms(source)
    if not names:
        return None, 0.0
    started = time.perf_counter()
    replays = {}
    for name in names:
        drafter = drafters.get(name)
        if isinstance(drafter, Replayable):
            accepted = drafter.replay(session_id, context, target_tokens, k, params)
            if accepted is not None:
                replays[name] = accepted
    return replays, time.perf_counter() - started


def speculative_generate(
    prompt_ids: list[int],
    *,
    session_id: str,
    drafters: Mapping[str, Drafter],
    chooser: DrafterChooser,
    verifier: Verifier,
    params: SamplingParams,
    k: int,
    on_tokens: Callable[[list[int]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    feedback: Callable[[RoundFeedback], None] | None = None,
    return_top_k: int = 0,
) -> GenerationResult:
    """Generate up to ``params.max_new_tokens`` tokens after ``prompt_ids``.

    Draft length is capped by the tokens still wanted, so ``max_new_tokens`` is met exactly; a
    stop token inside an accepted run ends the request right after it.

    ``feedback`` (online learning) is called after every round that drafted something;
    ``return_top_k`` > 0 asks the target for its sparse top-K p at each position of such rounds
    (the supervision online learning trains on). Neither changes the generated tokens.

    A pool with white-box drafters (``specpool.drafters.base.WhiteBox``) asks the target for its
    features every round and hands them to each of them; its first round is the target's prefill
    alone (a head drafts from the features of the context, which the target has not yet seen),
    recorded as a target-only step and not charged to any arm.
    """
    # Over 80 lines on purpose: one round reads top to bottom (choose, draft, verify, cut at a
    # stop token, replay, record, update), and its timing points (round start, drafted, verified)
    # must stay in the order the record reports them; helpers would scatter them.
    started = time.perf_counter()
    generated: list[int] = []
    rounds: list[RoundRecord] = []
    stop_ids = set(params.stop_token_ids)
    finish_reason = "length"
    white_box: list[WhiteBox] = [d for d in drafters.values() if reads_features(d)]  # type: ignore[misc]
    seen = _SeenFeatures() if white_box and feedback is not None else None
    hosted = {name for name, drafter in drafters.items() if is_hosted(drafter)}
    feed = tuple(sorted(name for name in hosted if drafters[name].white_box))  # type: ignore[attr-defined]
    if hosted and not isinstance(verifier, DraftingVerifier):
        raise FailedPrecondition(f"drafters {', '.join(sorted(hosted))} are hosted by the target, but this verifier drafts for none")
    # Draft trees (specpool/target/tree.py): a verifier that verifies them (in process, or a target
    # deployment), sampled ones only where it verifies those too and the drafter draws its
    # children (``sampled_trees``), and no online-learning feedback (its records describe a chain and
    # the target's top-K of it).
    trees = feedback is None and return_top_k == 0 and getattr(
        verifier, "verifies_trees" if params.greedy else "verifies_sampled_trees", False)
    while len(generated) < params.max_new_tokens:
        if should_stop is not None and should_stop():
            finish_reason = "cancelled"
            break
        round_started = time.perf_counter()
        remaining = params.max_new_tokens - len(generated)
        context = prompt_ids + generated
        choice = Choice(None) if (white_box or feed) and not rounds else chooser.select()
        name = choice.drafter
        k_round = min(choice.k or k, remaining - 1)  # accepted + 1 never overshoots max_new_tokens
        proposal = _EMPTY
        by_target = HostedDraft(None, feed=feed) if feed else None  # hosted heads read every round
        if name is not None and k_round > 0:
            drafter = drafters[name]
            tree = trees and getattr(drafter, "tree_nodes", 0) > 0 and (params.greedy or getattr(drafter, "sampled_trees", False))
            if name in hosted:
                by_target = HostedDraft(name, k_round, tree, feed)
            elif tree and isinstance(drafter, TreeDrafter):
                proposal = drafter.propose_tree(session_id, context, k_round, params)
            else:
                proposal = drafter.propose(session_id, context, k_round, params)
        drafted = time.perf_counter()
        top_k = return_top_k if proposal.tokens or (by_target and by_target.drafter) else 0
        request = VerifyRequest(session_id, context, proposal.tokens, proposal.q, params,
                                return_top_k=top_k, return_features=bool(white_box),
                                tree_parents=proposal.parents if proposal.tokens else None)
        if by_target is not None:
            drafted_by_target, result = verifier.draft_and_verify(request, by_target)  # type: ignore[union-attr]
            if by_target.drafter is not None:  # otherwise the draft is the loop's own (its source, its timing)
                proposal = drafted_by_target
                drafters[name].cost.record(proposal.forward_s, len(proposal.tokens))
        else:
            result = verifier.verify(request)
        verified = time.perf_counter()
        if white_box:
            result = hand_features(white_box, verifier, request, result)
            if seen is not None:
                seen.observe(result.features)

        emitted = result.tokens
        for i, token in enumerate(emitted):
            if token in stop_ids:
                emitted = emitted[: i + 1]
                finish_reason = "stop"
                break
        generated.extend(emitted)
        if on_tokens is not None:
            on_tokens(emitted)
        replays, replay_s = _replay(chooser, drafters, session_id, context, result.tokens, k_round, params, proposal.source)
        record = RoundRecord(
            drafter=name,
            k=k_round if name is not None else 0,
            proposed=len(proposal.tokens),
            accepted=result.accepted,
            emitted=len(emitted),
            bd=block_divergence(result.tv),
            draft_s=drafted - round_started,
            verify_s=verified - drafted,
            round_s=time.perf_counter() - round_started,
            draft_forward_s=proposal.forward_s,
            verify_forward_s=result.forward_s,
            source=proposal.source,
            replays=replays,
            replay_s=replay_s,
        )
        rounds.append(record)
        if not (white_box and len(rounds) == 1):  # the white-box prefill is no arm's round
            chooser.update(record)
        if on_round is not None:
            on_round(record)
        if feedback is not None and proposal.tokens and name is not None:
            features = seen.view() if seen is not None and reads_features(drafters[name]) else None
            feedback(RoundFeedback(session_id, context, name, proposal, result, record, features))
        if finish_reason == "stop":
            break
    return GenerationResult(generated, finish_reason, rounds, time.perf_counter() - started)
