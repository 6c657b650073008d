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
"""

from __future__ import annotations

import threading
import time
from typing import Any

from specpool.drafters.base import CostMeter, Proposal
from specpool.core.errors import ModelUnavailable, SpecpoolError
from specpool.services import convert
from specpool.services.direct import DirectRoutes
from specpool.v1 import common_pb2
from specpool.services.status import is_unavailable, unwrap
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import VerifyRequest, VerifyResult


class DeploymentCaller:
    """Blocking calls to one deployment, with session affinity and retries on lost replicas."""

    def __init__(self, handle: Any, what: str, transport: str = "grpc", retry_s: float = 60.0,
                 direct: DirectRoutes | None = None):
        self.handle = handle
        self.what = what  # "the target", "drafter 'code'": for messages
        self.by_reference = transport == "actor"
        self.retry_s = retry_s
        self.direct = direct  # same-node direct routes per session (specpool/services/direct.py); None: Serve only

    def call(self, method: str, message: Any, session_id: str = "") -> Any:
        if self.direct is None or not session_id:
            return self._through_serve(method, message, session_id)
        response = self.direct.call(method, message, session_id)
        if response is None:  # no route yet, or its replica is gone: Serve routes it, and its route is kept
            response = self._through_serve(method, message, session_id)
            if method != "Release":
                self.direct.learn(session_id, response)
        if method == "Release":
            self.direct.forget(session_id)
        return response

    def _through_serve(self, method: str, message: Any, session_id: str) -> Any:
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                options: dict = {"method_name": method, "_by_reference": self.by_reference}
                if session_id:
                    options["session_id"] = session_id
                return self.handle.options(**options).remote(message).result()
            except Exception as exc:  # noqa: BLE001 - sorted below: domain error, lost replica, other
                cause = unwrap(exc)
                if isinstance(cause, SpecpoolError):
                    raise cause from None
                if not is_unavailable(exc):
                    raise
                if time.monotonic() + delay > deadline:
                    raise ModelUnavailable(
                        f"{self.what} is unavailable ({type(cause).__name__}); gave up after {self.retry_s:.0f} s of retries"
                    ) from None
                time.sleep(delay)  # the controller is replacing the replica; the ring then moves the session
                delay = min(1.0, delay * 2)


class RemoteVerifier:
    """The target deployment as a ``SessionVerifier``."""

    def __init__(self, caller: DeploymentCaller):
        self.caller = caller

    def verify(self, request: VerifyRequest) -> VerifyResult:
        response = self.caller.call("Verify", convert.verify_request_to_proto(request), request.session_id)
        return convert.verify_result_from_proto(response)

    def release(self, session_id: str) -> bool:
        return bool(self.caller.call("Release", common_pb2.ReleaseRequest(session_id=session_id), session_id).released)


class RemoteDrafter:
    """One drafter deployment as a ``Drafter`` that is ``Replayable`` and ``PerRequestVersions``.

    Learned versions (online learning): between ``begin_request`` and ``end_request`` of a
    session, the first Propose lets the replica choose the tenant's serving version and every
    later one asks for exactly the version it returned, so the request never mixes versions, even
    when its rounds reach different replicas."""

    def __init__(self, name: str, caller: DeploymentCaller, tokenizer_fingerprint: str | None):
        self.name = name
        self.caller = caller
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.cost = CostMeter()  # as seen by the router: wall time of a remote propose per token
        self._requests: dict[str, tuple[str, int | None]] = {}  # session -> (tenant, its request's version)
        self._lock = threading.Lock()

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
        started = time.perf_counter()
        tenant, version = self._request_of(session_id)
        request = convert.propose_request_to_proto(session_id, context_ids, k, params, tenant=tenant, weight_version=version)
        response = self.caller.call("Propose", request, session_id)
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
        request = convert.replay_request_to_proto(session_id, context_ids, continuation, k, params,
                                                  tenant=tenant, weight_version=version)
        return convert.replay_from_proto(self.caller.call("Replay", request, session_id))

    def release(self, session_id: str) -> None:
        self.caller.call("Release", common_pb2.ReleaseRequest(session_id=session_id), session_id)
