"""Adapters that make the drafter and target deployments look local to the speculative loop.

``RemoteDrafter`` implements the ``Drafter`` protocol and its optional capabilities ``Replayable``
and ``PerRequestVersions`` (``specpool/drafters/base.py``), and ``RemoteVerifier`` the loop's
``SessionVerifier`` protocol, by calling a Ray Serve deployment with the messages of
``protos/specpool/v1`` (``Drafter.Propose``/``Release``, ``Target.Verify``/``Release``). They
block, so the router calls them from a worker thread, never from its event loop.

Transport: with ``transport="grpc"`` (the default) each call is a deployment-handle call with
``_by_reference=False``, which Ray Serve 2.60 sends over gRPC to the replica's inter-deployment
gRPC server (the request and response are the specpool.v1 protobuf messages); "actor" uses Ray
actor calls instead.

Same-node direct calls (``specpool/services/direct.py``): after a session's first call through Serve, its
later calls go straight to the replica that answered when it runs on the router's node.

Session affinity: every call carries the session id (``handle.options(session_id=...)``) and the
model deployments route with Serve's consistent-hash request router, so all rounds of a session
reach the replica holding its KV cache. When that replica dies, the ring moves the session to
another replica, which re-prefills from the full context the request carries: slower once, never
wrong. Calls that fail because a replica is gone are retried (same request, same seed: a retried
round draws the same random numbers) for up to ``retry_s`` seconds.

Deadlines and degradation (issue 27): every call has an overall deadline, ``timeout_s`` (each
attempt waits at most what is left of it, retries included), so a hung replica never holds a
router thread for ever. The target has no substitute: its calls retry a replica being replaced
until the deadline, then fail the request. A drafter does: its proposals are only ever
suggestions the target verifies, so a drafter deployment that is unavailable, slow or failing
costs a *target-only round* (the loop verifies an empty draft: exactly the target's token), never
the request or a wrong token. Its caller gets a short deadline (``DEFAULT_DRAFTER_TIMEOUT_S``);
an unavailable or timed-out drafter is then skipped by every session for ``cooldown_s`` and probed
again by one call; every failure is counted by reason (``RemoteDrafter.failures``, ``on_failure``).

White-box drafters (EAGLE-style heads, ``specpool/drafters/eagle.py``) read the target's features.
Served, they travel as float16 (or bfloat16) bytes (``specpool/target/features.py``): the target
deployment returns each round's new rows in ``VerifyResponse.features`` ((a + 1) x width x 2
bytes for a round that accepts a drafts: 1,152 bytes a position for the default target), the
router keeps a copy per session (``FeatureRelay``, shared by the pool's white-box arms) and each
``RemoteDrafter`` sends its deployment only the rows it has not yet sent, with its next Propose
or Replay. A deployment that lost them (a restarted replica, an evicted session) answers
FAILED_PRECONDITION with the position it needs, and the call is made once more with the rows
from there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from specpool.drafters.base import CostMeter, Proposal
from specpool.core.errors import DeadlineExceeded, FailedPrecondition, ModelUnavailable, SpecpoolError
from specpool.router.hosted import HostedDraft
from specpool.services import convert
from specpool.services.direct import DirectRoutes
from specpool.v1 import common_pb2
from specpool.services.status import is_unavailable, unwrap
from specpool.target.features import WIRE_DTYPES, FeatureLog, Features
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import VerifyRequest, VerifyResult

logger = logging.getLogger(__name__)
# Sessions whose features the router keeps (least recently used forgotten beyond): a served
# session keeps its caches between requests, so only eviction bounds this. 2 bytes x width a
# position: 1,000 sessions of 1,000 positions are 1.2 GB at the default target's width.
FEATURE_SESSIONS = 1024
# Overall deadline of one call to the target, retries included: above ``retry_s`` (60 s: a replica
# replaced, its model loaded) plus a verify of a long prompt on CPU; only a hung replica reaches it.
DEFAULT_CALL_TIMEOUT_S = 120.0
# A drafter call's deadline. A round costs ~75 ms on 2 CPU cores, a zoo drafter's propose
# ~20-50 ms of it, and a session's first propose (prefill of a long prompt, or a white-box head's
# rows) a few hundred ms; 2 s is ~25 rounds, well above any of them, and what a round loses at
# most, once a cooldown, when the drafter is down (then every session skips it at no cost).
DEFAULT_DRAFTER_TIMEOUT_S = 2.0
# How long a failed drafter is skipped before one call probes it again: about what Serve takes to
# replace a killed replica and load a zoo drafter on CPU; a probe of a drafter still down costs one
# round at most ``drafter_timeout_s``, once per cooldown for the whole router.
DEFAULT_COOLDOWN_S = 10.0
# Deadline of the router's end-of-request notice to the target (``RemoteVerifier.request_finished``):
# notices go out one at a time, and one to a replica being replaced must not hold the others back.
NOTICE_TIMEOUT_S = 2.0


class DeploymentCaller:
    """Blocking calls to one deployment, with session affinity and retries on lost replicas."""

    def __init__(self, handle: Any, what: str, transport: str = "grpc", retry_s: float = 60.0,
                 direct: DirectRoutes | None = None, timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self.handle = handle
        self.what = what  # "the target", "drafter 'code'": for messages
        self.by_reference = transport == "actor"
        self.retry_s = retry_s
        self.timeout_s = timeout_s  # a call's overall deadline, retries included
        self.direct = direct  # same-node direct routes per session (specpool/services/direct.py); None: Serve only

    def call(self, method: str, message: Any, session_id: str = "", timeout_s: float | None = None) -> Any:
        """``timeout_s``: this call's deadline instead of the caller's own."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self.direct is None or not session_id:
            return self._through_serve(method, message, session_id, deadline, timeout_s)
        response = self.direct.call(method, message, session_id, timeout_s=timeout_s)
        if response is None:  # no route yet, or its replica is gone: Serve routes it, and its route is kept
            response = self._through_serve(method, message, session_id, deadline, timeout_s)
            if method != "Release":
                self.direct.learn(session_id, response)
        if method == "Release" and not getattr(message, "keep_caches", False):
            self.direct.forget(session_id)
        return response

    def _through_serve(self, method: str, message: Any, session_id: str, deadline: float, timeout_s: float) -> Any:
        retry_until = min(deadline, time.monotonic() + self.retry_s)
        delay = 0.05
        while True:
            try:
                options: dict = {"method_name": method, "_by_reference": self.by_reference}
                if session_id:
                    options["session_id"] = session_id
                left = max(0.001, deadline - time.monotonic())
                return self.handle.options(**options).remote(message).result(timeout_s=left)
            except Exception as exc:  # noqa: BLE001 - sorted below: domain error, timeout, lost replica, other
                cause = unwrap(exc)
                if isinstance(cause, SpecpoolError):
                    raise cause from None
                if isinstance(cause, TimeoutError):  # Ray's GetTimeoutError is one too
                    raise DeadlineExceeded(f"{self.what} did not answer {method} within {timeout_s:g} s") from None
                if not is_unavailable(exc):
                    raise
                if time.monotonic() + delay > retry_until:
                    raise ModelUnavailable(
                        f"{self.what} is unavailable ({type(cause).__name__}); gave up after "
                        f"{min(self.retry_s, timeout_s):g} s of retries"
                    ) from None
                time.sleep(delay)  # the controller is replacing the replica; the ring then moves the session
                delay = min(1.0, delay * 2)


@dataclass
class FeatureTraffic:
    """Feature bytes on the wire, as the router sees them (``RouterServer.FeatureStats``), and
    passed on to ``observer`` (the router's metrics: ``specpool_feature_bytes``)."""

    calls: int = 0  # calls that carried features
    rows: int = 0  # positions carried
    bytes: int = 0  # bytes of feature data carried
    observer: Callable[[int], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, msg: common_pb2.Features) -> None:
        with self._lock:
            self.calls += 1
            self.rows += len(msg.data) // (2 * msg.width) if msg.width else 0
            self.bytes += len(msg.data)
        if self.observer is not None:
            self.observer(len(msg.data))

    def as_dict(self) -> dict:
        return {"calls": self.calls, "rows": self.rows, "bytes": self.bytes}


class RemoteVerifier:
    """The target deployment as a ``SessionVerifier``. A verify that asks for features and gets
    none (a target deployment older than the field) returns ``features=None``, which the loop
    refuses (FAILED_PRECONDITION): a white-box arm never runs blind."""

    # The target deployment verifies draft trees (VerifyRequest.tree_parents); one that predates
    # the field verifies a greedy tree's tokens as a chain: slower, never wrong. A sampled tree
    # verified as a chain would not be exact, so it gets sampled trees only where its Info says
    # ``sampled_trees`` (``sampled_trees`` here).
    verifies_trees = True

    def __init__(self, caller: DeploymentCaller, sampled_trees: bool = False):
        self.caller = caller
        self.verifies_sampled_trees = sampled_trees
        self.features_received = FeatureTraffic()  # from the target: (a + 1) rows a round
        self._notices = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-notices")  # its thread starts on first use

    def verify(self, request: VerifyRequest) -> VerifyResult:
        response = self.caller.call("Verify", convert.verify_request_to_proto(request), request.session_id)
        if response.HasField("features"):
            self.features_received.add(response.features)
        return convert.verify_result_from_proto(response)

    def draft_and_verify(self, request: VerifyRequest, draft: HostedDraft) -> tuple[Proposal, VerifyResult]:
        """``specpool.router.hosted.DraftingVerifier``: one Verify call in which the target deployment
        drafts with an arm it hosts (``draft.drafter``) and verifies that draft. The router makes
        ``HostedArm`` stand-ins only for arms the target's Info lists as hosted."""
        response = self.caller.call("Verify", convert.verify_request_to_proto(request, draft), request.session_id)
        if response.HasField("features"):
            self.features_received.add(response.features)
        result = convert.verify_result_from_proto(response)
        if draft.drafter is None:
            return Proposal(list(request.draft_tokens), list(request.q)), result
        if not response.HasField("drafted"):
            raise FailedPrecondition(f"the target deployment did not draft with hosted drafter {draft.drafter!r} "
                                     "(a target too old to host drafters?)")
        return convert.proposal_from_proto(response.drafted), result

    def release(self, session_id: str) -> bool:
        return bool(self.caller.call("Release", common_pb2.ReleaseRequest(session_id=session_id), session_id).released)

    def request_finished(self, session_id: str) -> None:
        """Tell the target, without waiting, that the session's request has ended and its caches
        stay (``Release`` with ``keep_caches``), so its next verify batch does not wait for this
        session. Best effort: a lost notice costs the next request one batch timeout, nothing else."""
        self._notices.submit(self._send_finished, session_id)

    def _send_finished(self, session_id: str) -> None:
        try:
            self.caller.call("Release", common_pb2.ReleaseRequest(session_id=session_id, keep_caches=True), session_id,
                             timeout_s=NOTICE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a notice; the request it follows has already answered
            logger.debug("end-of-request notice for session %s was not delivered", session_id, exc_info=True)


class _Held:
    """One session's features in the router: positions ``base`` .. ``base + len(log) - 1``.

    ``base`` > 0 when the router never saw the earlier rows (it was restarted, or forgot the
    session, while the target kept the session's cache): the rows it holds still go on to
    deployments that have the earlier ones."""

    def __init__(self, width: int, dtype, base: int = 0):
        self.base = base
        self.log = FeatureLog(width, dtype)

    @property
    def end(self) -> int:
        return self.base + len(self.log)


class FeatureRelay:
    """The router's copy of each session's target features, shared by the pool's white-box
    ``RemoteDrafter``s (the loop hands each of them the same rows), stored in the wire dtype so
    what is resent is bit-identical to what the target sent. Bounded: a session is dropped when
    released and beyond ``capacity`` sessions (least recently used)."""

    def __init__(self, width: int, dtype: str = "float16", capacity: int = FEATURE_SESSIONS):
        self.width = width
        self.dtype = dtype  # the wire dtype, towards the drafters too
        self.capacity = capacity
        self._sessions: OrderedDict[str, _Held] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, session_id: str, features: Features) -> None:
        with self._lock:
            held = self._sessions.pop(session_id, None)
            if held is None or not held.base <= features.start <= held.end:
                # New, or rows the router cannot join to what it holds: keep these from their start.
                held = _Held(self.width, WIRE_DTYPES[self.dtype], features.start)
            held.log.apply(Features(features.start - held.base, features.rows))
            self._sessions[session_id] = held
            while len(self._sessions) > self.capacity:
                self._sessions.popitem(last=False)

    def span(self, session_id: str) -> tuple[int, int]:
        """(first, one past the last) position held; (0, 0) for an unknown session."""
        with self._lock:
            held = self._sessions.get(session_id)
            return (held.base, held.end) if held is not None else (0, 0)

    def since(self, session_id: str, start: int) -> common_pb2.Features | None:
        """Rows from ``start`` to the end, encoded; None when the router does not hold them."""
        with self._lock:
            held = self._sessions.get(session_id)
            if held is None or not held.base <= start <= held.end:
                return None
            self._sessions.move_to_end(session_id)
            rows = held.log.rows(start - held.base)  # (n, d) in the wire dtype
        return convert.features_to_proto(Features(start, rows), self.dtype)

    def release(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)


class RemoteDrafter:
    """One drafter deployment as a ``Drafter`` that is ``Replayable`` and ``PerRequestVersions``,
    and ``WhiteBox`` when the deployment's drafter reads the target's features
    (``feature_width`` > 0, from its Info).

    Learned versions (online learning): between ``begin_request`` and ``end_request`` of a
    session, the first Propose lets the replica choose the tenant's serving version and every
    later one asks for exactly the version it returned, so the request never mixes versions, even
    when its rounds reach different replicas.

    Features (white-box): per session, the position up to which this deployment has been sent
    the router's rows (``FeatureRelay``); a Propose or Replay carries the rows from there, and a
    deployment that lost the session's rows answers with the position to resend from.

    Degradation (the module's docstring): a Propose, Replay or Release that fails in any way
    answers "nothing" (an empty proposal, no replay count); the failure is counted in
    ``failures[reason]`` and passed to ``on_failure(name, reason)``, reason "unavailable" (the
    deployment or its replica is gone), "timeout" (no answer within the caller's deadline) or
    "error" (anything else the drafter raised: a bug or a request it cannot draft for, which the
    target may still serve). After "unavailable" or "timeout" the drafter is
    *down* for ``cooldown_s``: calls are skipped at once (``skipped``), then one call probes it
    while the others still skip; "error" marks nothing down (it may be this request's alone)."""

    def __init__(self, name: str, caller: DeploymentCaller, tokenizer_fingerprint: str | None,
                 feature_width: int = 0, relay: FeatureRelay | None = None, cooldown_s: float = DEFAULT_COOLDOWN_S,
                 on_failure: Callable[[str, str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 tree_nodes: int = 0, sampled_trees: bool = False):
        self.name = name
        self.tree_nodes = tree_nodes  # > 0: the deployment's drafter drafts trees (``TreeDrafter``, from its Info)
        self.sampled_trees = sampled_trees  # in sampled rounds too (from its Info)
        self.caller = caller
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.feature_width = feature_width  # 0: a black-box drafter (the loop sends it no features)
        self.relay = relay if relay is not None or not feature_width else FeatureRelay(feature_width)
        self.cost = CostMeter()  # as seen by the router: wall time of a remote propose per token
        self.features_sent = FeatureTraffic()  # to this deployment: rows it had not been sent
        self.resends = 0  # calls made again after the deployment asked for earlier rows
        self._requests: dict[str, tuple[str, int | None]] = {}  # session -> (tenant, its request's version)
        self._sent: OrderedDict[str, int] = OrderedDict()  # session -> positions this deployment has been sent
        self._lock = threading.Lock()
        self.cooldown_s = cooldown_s
        self.on_failure = on_failure  # the router's metrics: specpool_drafter_failures_total{drafter, reason}
        self.failures: Counter[str] = Counter()  # reason -> calls that failed
        self.skipped = 0  # calls not made because the drafter was down
        self._clock = clock
        self._down_until = 0.0  # skip calls until then (0: up)

    # -- degradation ------------------------------------------------------------------------------
    def available(self) -> bool:
        """Whether to call the deployment now. When a cooldown has just ended, the caller that
        asks first probes it: the others keep skipping for one call's deadline meanwhile."""
        with self._lock:
            now = self._clock()
            if not self._down_until:
                return True
            if now < self._down_until:
                self.skipped += 1
                return False
            self._down_until = now + getattr(self.caller, "timeout_s", DEFAULT_DRAFTER_TIMEOUT_S)  # this caller probes
            return True

    def _failed(self, exc: BaseException, method: str, session_id: str) -> None:
        cause = unwrap(exc)
        if isinstance(cause, (DeadlineExceeded, TimeoutError)):
            reason = "timeout"
        elif isinstance(cause, ModelUnavailable) or is_unavailable(exc) or getattr(cause, "code", None) == "UNAVAILABLE":
            reason = "unavailable"
        else:
            reason = "error"
        with self._lock:
            self.failures[reason] += 1
            if reason != "error":
                self._down_until = self._clock() + self.cooldown_s
        logger.warning("drafter %r: %s of session %s failed (%s: %s); %s", self.name, method, session_id, reason,
                       cause, "the round runs target-only" if reason == "error" else
                       f"target-only rounds, and the drafter skipped for {self.cooldown_s:g} s")
        if self.on_failure is not None:
            self.on_failure(self.name, reason)

    def _recovered(self) -> None:
        with self._lock:
            if self._down_until:
                logger.info("drafter %r answers again", self.name)
            self._down_until = 0.0

    def _guarded(self, method: str, session_id: str, call: Callable[[], Any]) -> Any | None:
        """``call()``, or None when the drafter is down or the call fails (counted)."""
        if not self.available():
            return None
        try:
            response = call()
        except Exception as exc:  # noqa: BLE001 - a drafter's failure never fails a request (the docstring)
            self._failed(exc, method, session_id)
            return None
        self._recovered()
        return response

    def observe_features(self, session_id: str, features: Features) -> None:
        """``specpool.drafters.base.WhiteBox``: keep the rows (shared relay); the deployment gets
        them with this drafter's next call, rows from ``features.start`` on sent again."""
        if self.relay is None:
            return
        self.relay.observe(session_id, features)
        with self._lock:
            self._sent[session_id] = min(self._sent.pop(session_id, 0), features.start)
            while len(self._sent) > self.relay.capacity:
                self._sent.popitem(last=False)

    def _with_features(self, session_id: str, method: str, build: Callable[[common_pb2.Features | None], Any]) -> Any | None:
        """Call ``method`` with the message ``build(features)`` makes, features being the rows
        the deployment has not been sent (None for a black-box drafter). On a gap, once more
        with the rows from where the deployment asks; None when the router does not hold those
        (the round then drafts nothing: slower, never wrong)."""
        if self.relay is None:
            return self.caller.call(method, build(None), session_id)
        with self._lock:
            sent = self._sent.get(session_id, 0)
        base, end = self.relay.span(session_id)
        features = self.relay.since(session_id, max(base, min(sent, end)))
        try:
            response = self.caller.call(method, build(features), session_id)
        except SpecpoolError as exc:
            needed = convert.features_needed(exc)
            if needed is None:
                raise
            features = self.relay.since(session_id, needed)
            if features is None:
                logger.warning("drafter %r lost session %s's features before position %d, which the router no longer "
                               "holds: it drafts nothing for this session until the target resends them",
                               self.name, session_id, needed)
                return None
            self.resends += 1
            response = self.caller.call(method, build(features), session_id)
        if features is not None:
            self.features_sent.add(features)
        with self._lock:
            self._sent[session_id] = end
            self._sent.move_to_end(session_id)
        return response

    def begin_request(self, session_id: str, tenant: str) -> None:
        with self._lock:
            self._requests[session_id] = (tenant, None)

    def end_request(self, session_id: str) -> None:
        with self._lock:
            self._requests.pop(session_id, None)

    def version_of(self, session_id: str) -> int:
        """The weights version the session's current request drafts with (0 before its first round)."""
        return self._request_of(session_id)[1] or 0

    def _request_of(self, session_id: str) -> tuple[str, int | None]:
        """(tenant, pinned version or None) of the session's current request."""
        with self._lock:
            return self._requests.get(session_id, ("", None))

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        return self._propose(session_id, context_ids, k, params, tree=False)

    def propose_tree(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        """``specpool.drafters.base.TreeDrafter`` over the wire (only when ``tree_nodes`` > 0)."""
        return self._propose(session_id, context_ids, k, params, tree=True)

    def _propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams, tree: bool) -> Proposal:
        started = time.perf_counter()
        tenant, version = self._request_of(session_id)
        response = self._guarded("Propose", session_id, lambda: self._with_features(
            session_id, "Propose", lambda features: convert.propose_request_to_proto(
                session_id, context_ids, k, params, tenant=tenant, weight_version=version, features=features,
                tree=tree)))
        if response is None:
            return Proposal([], [])
        proposal = convert.proposal_from_proto(response)
        if version is None:
            with self._lock:
                if session_id in self._requests:
                    self._requests[session_id] = (tenant, int(response.weight_version))
        self.cost.record(time.perf_counter() - started, len(proposal.tokens))
        return proposal

    def replay(self, session_id: str, context_ids: list[int], continuation: list[int], k: int,
               params: SamplingParams) -> int | None:
        """``specpool.drafters.base.Replayable`` over the wire: with the request's pinned weights version
        once it has one (a replay never pins one itself: it drafts nothing)."""
        tenant, version = self._request_of(session_id)
        response = self._guarded("Replay", session_id, lambda: self._with_features(
            session_id, "Replay", lambda features: convert.replay_request_to_proto(
                session_id, context_ids, continuation, k, params, tenant=tenant, weight_version=version,
                features=features)))
        return None if response is None else convert.replay_from_proto(response)

    def release(self, session_id: str) -> None:
        if self.relay is not None:
            with self._lock:
                self._sent.pop(session_id, None)
            self.relay.release(session_id)  # the loop's other white-box arms are released with it
        # A drafter that is down holds nothing worth a wait; one that lost the session frees it anyway.
        self._guarded("Release", session_id,
                      lambda: self.caller.call("Release", common_pb2.ReleaseRequest(session_id=session_id), session_id))
