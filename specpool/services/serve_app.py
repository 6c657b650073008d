"""Ray Serve applications of served mode, and their builders (``import_path`` targets).

    specpool.services.serve_app:build_target_app    the target's verification (deployment "Target")
    specpool.services.serve_app:build_drafter_app   one drafter of the pool (deployment "Drafter")
    specpool.services.serve_app:build_router_app    the gRPC ingress, specpool.v1.SpecPool (deployment "Router")

A Serve config (KubeRay's serveConfigV2, or `specpool serve --config FILE`) runs one target
application, one application per drafter and one router application; each builder validates its
``args`` (``specpool/services/serve_config.py``) before anything loads.

How the pieces talk (see also ``specpool/services/remote.py``):

- **Client -> router**: Serve's gRPC proxy, with ``grpc_ingress.add_specpool_servicer_to_server`` (the generated registration, tolerant of bad bytes)
  (and the gRPC health service) in ``grpc_options.grpc_servicer_functions``. The router is the only
  application with a route_prefix, so the proxy needs no ``application`` metadata. The proxy also
  serves gRPC server reflection (Serve's ``enable_reflection``, on by default); health checks
  (``grpc.health.v1.Health/Check``) reach ``RouterServer.Check``.
- **Router -> target and drafters: gRPC through deployment handles.** The deployments' methods
  are the internal services of ``protos/specpool/v1`` (``Verify``/``Release``, ``Propose``/
  ``Release``) taking and returning those protobuf messages, and the router calls them with
  ``_by_reference=False``, which Ray Serve 2.60 carries over gRPC to each replica's
  inter-deployment gRPC server. Why this and not a gRPC server of our own inside each replica:
  Serve keeps doing what we need from it, replica discovery, health, autoscaling, request routing
  with session affinity and ``@serve.batch``, while the messages are the versioned protos; a
  private gRPC port per replica would need its own discovery and load balancing and would bypass
  batching and affinity. (``transport: actor`` in the router args switches to Ray actor calls.)
- **Same-node direct routes** (``specpool/services/direct.py``): each model replica also answers on a
  loopback gRPC endpoint, opened on first use, whose address and token ride on every response.
  After a session's first call through Serve, the router sends that session's later calls there
  when the replica is on its node: the same methods on the same event loop (so batching and the
  model thread are shared), without Serve's per-call routing and wrappers. A route that stops
  answering sends the session back through Serve. ``direct_calls: false`` in the router args
  turns this off.
- **Session affinity**: the target and drafter deployments use Serve's consistent-hash request
  router keyed by the session id the router puts on every call, so all rounds of a session reach
  the replica holding its KV cache. (Model multiplexing with the session id as model id was the
  other candidate: ``@serve.batch`` splits batches by multiplexed model id, which would defeat
  batching across sessions.) When the replica dies, the ring maps the session to a live replica,
  which re-prefills from the full context every call carries: correct, one prefill slower.
- **Batching**: the target's ``Verify`` calls from concurrent sessions meet in a ``@serve.batch``
  handler and run as one ``TargetVerifier.verify_batch`` forward (features too, when asked).
- **White-box drafters** (``eagle:...``, ``lookup:eagle:...``): a drafter deployment whose drafter
  reads the target's features says so in its Info (``feature_width`` > 0); the router then asks
  every verify for features, which the target returns as float16 bytes (``feature_dtype`` in its
  args: bfloat16 too), keeps them per session and sends each such deployment the rows it has
  not yet seen with its next Propose or Replay ((a + 1) x 1,152 bytes a round for the default
  target; ``specpool/services/remote.py``). A deployment that lost them answers
  FAILED_PRECONDITION with the position to resend from; the router resends once. Or the target
  hosts them (``hosted_drafters`` in its args, the default of ``specpool serve``): the router maps
  those names to the target application, and a round is one ``Verify`` naming the arm, drafted and
  verified on the target's model thread with its features read in process
  (``specpool/router/hosted.py``).
- **Deadlines and cancellation**: a client's deadline or cancel makes the gRPC proxy cancel the
  router's request; the router then stops its loop before the next round and releases the
  session's KV caches in the target and every drafter it used (``Orchestrator.run``,
  ``specpool/services/orchestrator.py``: the same request path as the embedded engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import ray
import torch
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from transformers import AutoTokenizer

from specpool.core.errors import FailedPrecondition, IncompatibleModels, NotFound
from specpool.drafters.base import Proposal, Replayable, TreeDrafter, reads_features, samples_trees
from specpool.drafters.registry import DrafterContext, create_drafter
from specpool.learning.feedback import FeedbackEmitter
from specpool.learning.feedback_redis import RedisFeedbackStream
from specpool.learning.hot_swap import ServedVariants, learnable
from specpool.learning.model_store import open_model_store
from specpool.router.hosted import HostedArm, HostingVerifier, LoadGate
from specpool.router.session_store import RedisSessionStore, SessionKey
from specpool.services import convert
from specpool.services.admission import Admission, QuotaExceeded, load_quotas, retry_metadata
from specpool.services.api import finish_reason_to_proto, spec_from_proto, stats_to_proto
from specpool.services.auth import ApiKeys, bearer_token, load_api_keys
from specpool.services.config import settings_from_env
from specpool.services.batch_gate import BatchGate
from specpool.services.batch_trace import BatchTrace
from specpool.services.direct import DirectEndpoint, DirectRoutes, in_direct_call
from specpool.services.metrics import RayMetrics, TenantLabels
from specpool.services.orchestrator import (EmittedFeedback, ModelInfo, Orchestrator, OrchestratorSettings, Outcome,
                                           Prepared, ServedDrafters)
from specpool.services.remote import DeploymentCaller, FeatureRelay, RemoteDrafter, RemoteVerifier
from specpool.services.runner import RequestRunner
from specpool.services.serve_config import REPLICA_SWITCH_INTERVAL_S, DrafterArgs, RouterArgs, TargetArgs
from specpool.services.status import grpc_status
from specpool.target.features import FeatureGap
from specpool.target.models import ModelConfig, check_same_tokenizer, load_causal_lm, resolve_model, stop_token_ids
from specpool.target.verifier import TargetVerifier
from specpool.v1 import common_pb2, drafter_pb2, specpool_pb2, target_pb2

logger = logging.getLogger("ray.serve")

# Serve's consistent-hash request router: the session id of a call picks the replica.
SESSION_AFFINITY_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
SPECPOOL_SERVICE = "specpool.v1.SpecPool"
METRICS_REFRESH_S = 5.0  # gauges set again this often: Ray's agent drops one unset for two export intervals


def _session_affinity() -> RequestRouterConfig:
    # Up to 2 fallback replicas when the session's replica is at max_ongoing_requests.
    return RequestRouterConfig(request_router_class=SESSION_AFFINITY_ROUTER,
                               request_router_kwargs={"num_fallback_replicas": 2})


class _RecentSessions:
    """Sessions a replica served and has not released, least recently used out past ``limit``: a
    bookkeeping set that would otherwise grow by one entry per session for the replica's lifetime
    (the caches themselves are bounded by their own LRU capacities)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._order: OrderedDict[str, None] = OrderedDict()

    def add(self, session_id: str) -> None:
        self._order[session_id] = None
        self._order.move_to_end(session_id)
        while len(self._order) > self.limit:
            self._order.popitem(last=False)

    def update(self, session_ids) -> None:
        for session_id in session_ids:
            self.add(session_id)

    def discard(self, session_id: str) -> None:
        self._order.pop(session_id, None)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._order

    def __iter__(self):
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


def _model_thread(threads: int, prefix: str) -> ThreadPoolExecutor:
    """The one thread that does all of a replica's torch work, its models' loading included.

    Each thread that runs a parallel torch op gets its own OpenMP team of ``threads`` threads, and
    a team stays alive after its last op. With two teams in one process (the model loaded on Serve's
    init thread, forwards on this one) the process holds twice as many compute threads as cores,
    and every forward slows. ``python -m bench.omp_teams`` on a 2-core AMD EPYC, the default target
    at 2 threads (a 6-token forward over 300 cached, medians of 15, 8 alternations): 65 ms while one
    thread had run torch ops, 95 ms (81-107) on either thread once a second had; at 1 thread (no
    team) 72-76 ms either way. ``bench-served`` with one head,
    one session: the target's verify forward took 115 ms served against 73 ms embedded (where one
    thread does it all), 99 ms once loading moved here; serve_config.target_threads_for did the rest.
    """
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=prefix)
    executor.submit(_latch_torch_threads, threads).result()
    # Every other thread of the process gets one torch thread, so no stray op ever starts a second
    # team. torch.set_num_threads also sets the count a thread adopts at its first parallel op, and
    # the model thread's 2 made Serve's event-loop thread take 2 when it encoded a prefill's features
    # (``convert.verify_result_to_proto``: over 56 rows at the default width a parallel copy): a
    # second team, and every later forward ~1.5x slower (``python -m bench.omp_teams --stray-op``).
    _latch_torch_threads(1)
    return executor


def _latch_torch_threads(threads: int) -> int:
    """Give the calling thread ``threads`` torch threads for good. A thread takes torch's process-
    wide count at its first parallel op (``at::internal::lazy_init_num_threads``, which
    ``torch.get_num_threads`` triggers), not later; ``torch.set_num_threads`` sets both that count
    and the calling thread's, so set, then trigger."""
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def _quick_thread_switches() -> None:
    """Hand the GIL between this replica's threads within REPLICA_SWITCH_INTERVAL_S.

    A model forward is hundreds of short ops, and the model thread takes the GIL back after each.
    When Serve's event-loop thread holds it at that moment, CPython makes the model thread wait up
    to the switch interval (5 ms by default) before asking for it back. Measured on 2 cores with
    `specpool bench-served` (6 prompts, paired with embedded): the target's verify forward took
    152 ms served against 131 ms embedded at 5 ms, 138 ms at 0.5 ms and 137 ms at 0.1 ms (the
    same machine, noisier later, also gave 146 against 124 at 0.5 ms).
    """
    sys.setswitchinterval(REPLICA_SWITCH_INTERVAL_S)


def _home():
    return settings_from_env().home


def _replica() -> dict:
    """Which replica answered: its Ray actor name (namespace "serve"), replica id and process id (tests)."""
    return {"actor_name": ray.get_runtime_context().get_actor_name(),
            "replica_id": serve.get_replica_context().replica_id.unique_id, "pid": os.getpid()}


async def _offer_route(endpoint: DirectEndpoint, response) -> None:
    """Put this replica's same-node route on a response (specpool/services/direct.py)."""
    route = await endpoint.route()
    if route is not None:
        response.direct.CopyFrom(route)


# -- the target ----------------------------------------------------------------------------------------
@serve.deployment(name="Target")
class TargetServer:
    """``specpool.v1.Target``: verification of concurrent sessions' rounds, batched."""

    def __init__(self, args: TargetArgs):
        _quick_thread_switches()
        self.args = args
        # Every model operation runs on this one thread (see _model_thread): batches never overlap,
        # and Release never races a forward over the same cache.
        self._model_thread = _model_thread(args.threads, "target-model")
        self.verifier = self._model_thread.submit(self._load_verifier, args).result()
        # The drafters it hosts draft inside Verify, on the same thread (specpool/router/hosted.py).
        self.hosting = self._model_thread.submit(self._load_hosted, args, self.verifier).result()
        self.info = {
            "model": args.model,
            "stop_token_ids": list(stop_token_ids(self.verifier.model, self.verifier.tokenizer)),
            "context_window": self.verifier.context_window,
            "tokenizer_fingerprint": self.verifier.tokenizer_fingerprint,
            "feature_width": self.verifier.feature_width,  # white-box drafters read features this wide
            "feature_dtype": args.feature_dtype,  # and get them as these 2-byte values
            "hosted": {name: {"tokenizer_fingerprint": drafter.tokenizer_fingerprint,
                              "feature_width": int(drafter.feature_width) if reads_features(drafter) else 0,
                              "tree_nodes": int(drafter.tree_nodes) if isinstance(drafter, TreeDrafter) else 0,
                              "sampled_trees": samples_trees(drafter)}
                       for name, drafter in self.hosting.drafters.items()},
            # It verifies sampled draft trees (runner-up leaves drawn without replacement); a target
            # older than them would verify such a tree as a chain, which is not exact for sampled
            # drafts, so routers send sampled trees only to a target that says this.
            "sampled_trees": bool(getattr(self.verifier, "verifies_sampled_trees", False)),
        }
        self._live = _RecentSessions()  # sessions verified and not released since (LRU may drop more)
        self._batch_sizes: Counter[int] = Counter()
        # Which calls make the next batch (specpool/services/batch_gate.py); Serve's batch then takes
        # them whole, and its own wait only matters for a member cancelled on its way in.
        self._batch_gate = BatchGate(args.max_batch_size, args.batch_wait_timeout_s)
        self._trace = BatchTrace()  # why a session's calls miss the others' batches (Stats)
        self._verify_batch.set_max_batch_size(1)
        self._verify_batch.set_batch_wait_timeout_s(args.batch_wait_timeout_s)
        self._direct = DirectEndpoint("target", {"Verify": self.Verify, "Release": self.Release})

    @staticmethod
    def _load_verifier(args: TargetArgs) -> TargetVerifier:
        model, tokenizer = load_causal_lm(ModelConfig(args.model, args.device, args.dtype), _home())
        return TargetVerifier(model, tokenizer, args.cache_capacity)

    @staticmethod
    def _load_hosted(args: TargetArgs, verifier: TargetVerifier) -> HostingVerifier:
        context = DrafterContext(_home(), args.model, args.device, args.dtype)
        drafters = {name: create_drafter(name, context) for name in args.hosted_drafters}
        for name, drafter in drafters.items():
            if drafter.tokenizer_fingerprint is not None:
                check_same_tokenizer(verifier.tokenizer_fingerprint, drafter.tokenizer_fingerprint, name)
        return HostingVerifier(verifier, drafters, LoadGate() if args.load_gate and drafters else None)

    async def Verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        """One session's round, verified in a batch with the other sessions' (``@serve.batch``
        below), assembled by the gate (specpool/services/batch_gate.py, which says why).

        A session whose request has ended leaves the batch's wait by the router's notice (``Release``
        with ``keep_caches``); without it, the next request of a lone client waited one timeout (50 ms
        of its time to first token), and a session that finished cost the others one timeout.
        """
        verify_request = convert.verify_request_from_proto(request)
        hosted = convert.hosted_draft_from_proto(request)
        session = verify_request.session_id
        self._trace.arrived(session, in_direct_call())
        try:
            size = await self._batch_gate.join(session)
            # Every member of the batch sets the same size and enters the queue in this event-loop
            # step, before Serve's batch loop runs: it seals exactly them at once.
            self._verify_batch.set_max_batch_size(size)
            outcome = await self._verify_batch((verify_request, hosted))
            if isinstance(outcome, BaseException):
                raise outcome
            proposal, result = outcome
            response = convert.verify_result_to_proto(result, self.args.feature_dtype,
                                                      proposal if hosted is not None and hosted.drafter else None)
            await _offer_route(self._direct, response)
            self._trace.answered(session)
            return response
        finally:
            self._batch_gate.answer_left(session)  # an error or a cancelled call counts as answered too

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _verify_batch(self, requests: list) -> list:
        sessions = [r.session_id for r, _ in requests]
        self._trace.batch(sessions, self._batch_gate.expected)
        self._batch_gate.fired(sessions)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._model_thread, self._run_batch, requests)
        finally:
            self._trace.ended()
            self._batch_gate.forward_done()

    def _run_batch(self, items: list) -> list:
        """(request, hosted draft) pairs -> (proposal, result) pairs; a failed one's entry is its SpecpoolError."""
        self._batch_sizes[len(items)] += 1
        self._live.update(r.session_id for r, _ in items)
        return self.hosting.verify_batch(items)

    async def Release(self, request: common_pb2.ReleaseRequest) -> common_pb2.ReleaseResponse:
        """Frees a session's cache; with ``keep_caches``, only says that its request has ended.
        Either way the next batch stops waiting for this session's call (see ``Verify``)."""
        self._batch_gate.request_ended(request.session_id)  # no more rounds to wait for
        self._trace.forget(request.session_id)
        if request.keep_caches:
            return common_pb2.ReleaseResponse(released=False)
        loop = asyncio.get_running_loop()
        return common_pb2.ReleaseResponse(released=await loop.run_in_executor(self._model_thread, self._release, request.session_id))

    def _release(self, session_id: str) -> bool:
        held = session_id in self._live or session_id in self.verifier.caches.sessions()
        self.hosting.release(session_id)  # the hosted drafters' caches too
        self._live.discard(session_id)
        return held

    async def Info(self) -> dict:
        return dict(self.info)

    async def Sessions(self) -> list[str]:
        """Sessions whose KV cache this replica holds."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._model_thread, lambda: sorted(self.verifier.caches.sessions()))

    async def Stats(self) -> dict:
        """Batches run by size: {size: count}; calls that came over the direct route; the sessions
        the next batch would wait for (those of the last batch whose request has not ended); hosted
        drafts that failed; batches the load gate verified without drafts, and its measured tokens/s;
        the batch trace (calls by batch kind and path, return gaps, batches that fired short:
        specpool/services/batch_trace.py)."""
        return {"batch_sizes": dict(self._batch_sizes), "direct_calls": self._direct.calls,
                "batch_trace": self._trace.snapshot(),
                "waiting_for": sorted(self._batch_gate.expected), "hosted_draft_failures": self.hosting.draft_failures,
                "plain_batches": self.hosting.gate.plain_batches if self.hosting.gate else 0,
                "gate_tokens_per_s": self.hosting.gate.rates() if self.hosting.gate else {}}

    async def Replica(self) -> dict:
        return _replica()


def build_target_app(args: dict | None = None):
    parsed = TargetArgs.parse(args)
    return TargetServer.options(
        num_replicas=parsed.num_replicas, ray_actor_options=parsed.ray_actor_options,
        max_ongoing_requests=parsed.ongoing, request_router_config=_session_affinity(),
    ).bind(parsed)


# -- a drafter --------------------------------------------------------------------------------------------
@serve.deployment(name="Drafter")
class DrafterServer:
    """``specpool.v1.Drafter``: one drafter proposing tokens and the q they were sampled from."""

    def __init__(self, args: DrafterArgs):
        _quick_thread_switches()
        self.args = args
        self._model_thread = _model_thread(args.threads, "drafter-model")  # all torch work (see _model_thread)
        context = DrafterContext(_home(), args.target, args.device, args.dtype)
        self.drafter = self._model_thread.submit(create_drafter, args.name, context).result()
        self.variants = None  # learned versions per tenant (online learning), when a model store is set
        if args.model_store is not None:
            if learnable(self.drafter):
                self.variants = ServedVariants(self.drafter, open_model_store(args.model_store), args.learn_shared,
                                               args.refresh_s, max_tenants=args.max_tenants)
            else:
                logger.warning("drafter %s: model_store is set but this drafter does not learn online; it serves as is", args.name)
        self._live = _RecentSessions()  # sessions proposed for and not released (bounded like the drafters' caches)
        self._replays = 0  # Replay calls answered (side observations for ucb-replay)
        self._direct = DirectEndpoint("drafter", {"Propose": self.Propose, "Release": self.Release, "Replay": self.Replay})

    def _hosted(self, args):
        """``args`` if they name this server's drafter (or none); NotFound otherwise."""
        if args.drafter and args.drafter != self.args.name:
            raise NotFound(f"this server hosts drafter {self.args.name!r}, not {args.drafter!r}")
        return args

    def _pick(self, args):
        """(version, drafter) for a call of this request: its pinned version, or the tenant's
        serving one (online learning); the shipped weights (version 0) otherwise."""
        if self.variants is None:
            return 0, self.drafter
        return self.variants.pick(args.tenant, args.weight_version or 0, args.weight_version is not None)

    async def Propose(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        args = self._hosted(convert.propose_request_from_proto(request))
        loop = asyncio.get_running_loop()
        proposal, version = await loop.run_in_executor(self._model_thread, self._propose, args)
        response = convert.proposal_to_proto(proposal, version)
        await _offer_route(self._direct, response)
        return response

    def _propose(self, args):
        self._live.add(args.session_id)
        version, drafter = self._pick(args)
        self._observe(drafter, args)
        return self._draft(drafter, args), version

    @staticmethod
    def _draft(drafter, args) -> Proposal:
        """The proposal for a Propose call: a tree where the call asks for one and the drafter drafts
        trees (greedy, or sampled where it draws them: ``samples_trees``), else a chain."""
        if args.tree and isinstance(drafter, TreeDrafter) and drafter.tree_nodes > 0 and (
                args.params.greedy or samples_trees(drafter)):
            return drafter.propose_tree(args.session_id, args.context_ids, args.k, args.params)
        return drafter.propose(args.session_id, args.context_ids, args.k, args.params)

    @staticmethod
    def _observe(drafter, args) -> None:
        """A white-box drafter takes the call's features first; rows after a gap (this replica lost
        the session's earlier ones) fail the call with the position the router must resend from."""
        if args.features is None or not reads_features(drafter):
            return
        try:
            drafter.observe_features(args.session_id, args.features)
        except FeatureGap as gap:
            raise convert.feature_gap_error(gap) from None

    async def Replay(self, request: drafter_pb2.ReplayRequest) -> drafter_pb2.ReplayResponse:
        args = self._hosted(convert.replay_request_from_proto(request))
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        accepted = await loop.run_in_executor(self._model_thread, self._replay, args)
        self._replays += 1
        return convert.replay_to_proto(accepted, time.perf_counter() - started)

    def _replay(self, args) -> int | None:
        self._live.add(args.session_id)  # a replay warms the session's cache: Release frees it
        drafter = self._pick(args)[1]
        self._observe(drafter, args)
        if not isinstance(drafter, Replayable):
            return None
        return drafter.replay(args.session_id, args.context_ids, args.continuation, args.k, args.params)

    async def Release(self, request: common_pb2.ReleaseRequest) -> common_pb2.ReleaseResponse:
        loop = asyncio.get_running_loop()
        return common_pb2.ReleaseResponse(released=await loop.run_in_executor(self._model_thread, self._release, request.session_id))

    def _release(self, session_id: str) -> bool:
        held = session_id in self._live
        if self.variants is not None:
            self.variants.release(session_id)  # every version's caches (the shipped weights' too)
        else:
            self.drafter.release(session_id)
        self._live.discard(session_id)
        return held

    async def Info(self) -> dict:
        return {"name": self.args.name, "tokenizer_fingerprint": self.drafter.tokenizer_fingerprint,
                "feature_width": int(self.drafter.feature_width) if reads_features(self.drafter) else 0,
                "tree_nodes": int(self.drafter.tree_nodes) if isinstance(self.drafter, TreeDrafter) else 0,
                "sampled_trees": samples_trees(self.drafter)}

    async def Sessions(self) -> list[str]:
        """Sessions this replica proposed for and has not released."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._model_thread, lambda: sorted(self._live))

    async def Stats(self) -> dict:
        """Calls that came over the direct route, and Replay calls answered."""
        return {"direct_calls": self._direct.calls, "replays": self._replays}


def build_drafter_app(args: dict | None = None):
    parsed = DrafterArgs.parse(args)
    return DrafterServer.options(
        num_replicas=parsed.num_replicas, ray_actor_options=parsed.ray_actor_options,
        max_ongoing_requests=parsed.max_ongoing_requests, request_router_config=_session_affinity(),
    ).bind(parsed)


# -- the router ------------------------------------------------------------------------------------------
def _http_api_off():
    """What the HTTP proxy reaches when the router's ``http_api`` is false: 404 everywhere, in
    OpenAI's error shape, saying how to turn it on."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse

    async def off(scope, receive, send):
        if scope["type"] == "http":
            message = "the HTTP API is off on this server (router arg http_api: false; `specpool serve` without --no-http)"
            await JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                          "code": "http_api_off"}}, status_code=404)(scope, receive, send)
        elif scope["type"] == "lifespan":
            await Starlette()(scope, receive, send)

    return off


class _Failed(Exception):
    """Ends a gRPC call whose status code and details are already set on the context."""


@serve.deployment(name="Router")
@serve.ingress()  # the ASGI app comes from __serve_build_asgi_app__, once the constructor ran
class RouterServer:
    """``specpool.v1.SpecPool`` (and grpc.health.v1.Health/Check) over gRPC, and the OpenAI-compatible
    HTTP API (``specpool/services/openai_http.py``) over Serve's HTTP proxy: both run every request
    through one ``RequestRunner`` over one ``Orchestrator`` (bandit state per session in Redis, the
    target and drafters called through their deployments). Who a request is comes from its API key
    (``specpool/services/auth.py``), the same keys for both APIs."""

    async def __init__(self, args: RouterArgs):
        _quick_thread_switches()  # request threads and Serve's loop hand over on every model call
        # No model here, but torch work on each session's thread (decoding features): at Ray's
        # OMP_NUM_THREADS (the replica's num_cpus) each such thread would start an OpenMP team of
        # its own (see _model_thread); at 1, none does.
        _latch_torch_threads(1)
        self.args = args
        self.store = RedisSessionStore(args.resolved_redis_url(), ttl_s=args.session_ttl_s, namespace=args.redis_namespace)
        target = serve.get_deployment_handle("Target", app_name=args.target_app)
        info = await target.options(method_name="Info").remote()
        hosted = {name for name, app in args.drafter_apps if app == args.target_app}  # drafted inside Verify
        if hosted and args.feedback:  # also checked in plan_from_config; a config given to Serve directly skips that
            raise FailedPrecondition(f"drafters {', '.join(sorted(hosted))} are hosted by the target, which serves shipped weights "
                                     "and sends no features with feedback records; with feedback: true give them drafter applications")
        drafter_handles = {name: serve.get_deployment_handle("Drafter", app_name=app) for name, app in args.drafter_apps
                           if name not in hosted}
        node = ray.get_runtime_context().get_node_id()
        self._direct: list[DirectRoutes] = []

        def routes(service: str) -> DirectRoutes | None:
            if not args.direct_calls:
                return None
            self._direct.append(DirectRoutes(service, node))
            return self._direct[-1]

        infos = await asyncio.gather(*(h.options(method_name="Info").remote() for h in drafter_handles.values()))
        drafters: dict = {name: self._hosted_arm(info, name) for name in hosted}
        self._relay: FeatureRelay | None = None  # the target's features per session, for the white-box arms
        for (name, handle), drafter_info in zip(drafter_handles.items(), infos):
            if drafter_info["name"] != name:
                raise NotFound(f"application {dict(args.drafter_apps)[name]!r} serves drafter {drafter_info['name']!r}, not {name!r}")
            fingerprint = drafter_info["tokenizer_fingerprint"]
            if fingerprint is not None:
                check_same_tokenizer(info["tokenizer_fingerprint"], fingerprint, name)
            width = int(drafter_info.get("feature_width", 0))
            if width and self._relay is None:
                self._relay = self._feature_relay(info, name, width)
            if width and width != self._relay.width:
                raise IncompatibleModels(f"drafter {name!r} reads features of width {width}, but the target "
                                         f"{info['model']} returns width {self._relay.width}")
            caller = DeploymentCaller(handle, f"drafter {name!r}", args.transport, args.retry_s, routes("drafter"),
                                      timeout_s=args.drafter_timeout_s)
            drafters[name] = RemoteDrafter(name, caller, fingerprint, width, self._relay if width else None,
                                           tree_nodes=int(drafter_info.get("tree_nodes", 0)),
                                           sampled_trees=bool(drafter_info.get("sampled_trees", False)))
        self._drafters = {name: drafters[name] for name, _ in args.drafter_apps}  # pool order
        self._verifier = RemoteVerifier(DeploymentCaller(target, "the target", args.transport, args.retry_s, routes("target"),
                                                         timeout_s=args.call_timeout_s),
                                        sampled_trees=bool(info.get("sampled_trees", False)))
        keys = load_api_keys(args.api_keys_file)  # also bounds the tenant label of the metrics
        metrics = RayMetrics(TenantLabels(keys.tenants if keys.enabled else None))
        self._verifier.features_received.observer = lambda count: metrics.feature_bytes("target", "none", count)
        for name, drafter in drafters.items():
            if isinstance(drafter, RemoteDrafter):
                drafter.features_sent.observer = lambda count, name=name: metrics.feature_bytes("drafter", name, count)
                drafter.on_failure = metrics.drafter_failure
        loop = asyncio.get_running_loop()
        source = await loop.run_in_executor(None, resolve_model, info["model"], _home())
        tokenizer = await loop.run_in_executor(None, AutoTokenizer.from_pretrained, source)
        self.core = Orchestrator(
            tokenizer,
            ModelInfo(info["model"], tuple(info["stop_token_ids"]), info["context_window"], info["tokenizer_fingerprint"]),
            ServedDrafters(self._drafters),
            self._verifier,
            self.store,
            OrchestratorSettings(policy=args.policy, k=args.k, max_new_tokens=args.max_new_tokens, beta=args.beta,
                                 probe_rounds=args.probe_rounds),
            metrics,
            feedback=self._feedback(args),
        )
        # One thread per request in flight: the loop blocks on model calls between rounds.
        self._rounds = ThreadPoolExecutor(max_workers=args.max_ongoing_requests + 2, thread_name_prefix="request")
        self.keys: ApiKeys = keys
        # Quotas per tenant over every router replica (Redis), and this replica's own bound.
        self.admission = Admission(load_quotas(args.quotas_file, self.keys.tenants if self.keys.enabled else None),
                                   args.resolved_redis_url(), namespace=args.redis_namespace,
                                   max_concurrent_total=args.max_ongoing_requests, on_event=metrics.admission)
        self.runner = RequestRunner(self.core, self._rounds, self.admission)  # the one request path of both APIs
        self._metrics_refresh = asyncio.get_running_loop().create_task(self._refresh_metrics(metrics))

    @staticmethod
    async def _refresh_metrics(metrics: RayMetrics) -> None:
        """Keep the requests-in-flight gauge exported while it does not change (RayMetrics.refresh)."""
        while True:
            await asyncio.sleep(METRICS_REFRESH_S)
            try:
                metrics.refresh()
            except Exception:  # noqa: BLE001 - a metrics hiccup must not end the loop
                logger.warning("refreshing the metrics failed", exc_info=True)

    def __serve_build_asgi_app__(self):
        """The HTTP side (Serve calls this after the constructor): the OpenAI-compatible API, or,
        with ``http_api: false``, an app that answers 404 to every path."""
        if not self.args.http_api:
            return _http_api_off()
        from specpool.services.openai_http import build_openai_app

        return build_openai_app(self.runner, self.keys, self._healthy)

    async def _healthy(self) -> bool:
        return await self._serving() == health_pb2.HealthCheckResponse.SERVING

    @staticmethod
    def _hosted_arm(info: dict, name: str) -> HostedArm:
        """The stand-in for an arm the target application hosts; one it does not host is refused here."""
        hosted = info.get("hosted") or {}
        if name not in hosted:
            raise FailedPrecondition(f"drafter {name!r} is mapped to the target application, but the target hosts "
                                     f"{', '.join(sorted(hosted)) or 'no drafters'} (its hosted_drafters; an older specpool?)")
        arm = hosted[name]
        if arm["tokenizer_fingerprint"] is not None:
            check_same_tokenizer(info["tokenizer_fingerprint"], arm["tokenizer_fingerprint"], name)
        return HostedArm(name, arm["tokenizer_fingerprint"], int(arm["feature_width"]) > 0, int(arm["tree_nodes"]),
                         bool(arm.get("sampled_trees", False)))

    @staticmethod
    def _feature_relay(info: dict, drafter: str, width: int) -> FeatureRelay:
        """The router's feature store, once the pool has a white-box arm; a target deployment that
        does not say it returns features (one older than them) is refused here, not run blind."""
        if not info.get("feature_width"):
            raise FailedPrecondition(f"drafter {drafter!r} reads the target's features, but the target deployment does not "
                                     "return them (an older specpool?): upgrade the target application")
        return FeatureRelay(int(info["feature_width"]), info.get("feature_dtype", "float16"))

    @staticmethod
    def _feedback(args: RouterArgs) -> EmittedFeedback | None:
        """Online learning: verification feedback to a Redis stream for `specpool learner`."""
        if not args.feedback:
            return None
        emitter = FeedbackEmitter(RedisFeedbackStream(args.resolved_redis_url(), stream=args.feedback_stream, maxlen=args.feedback_maxlen))
        return EmittedFeedback(emitter, args.feedback_top_k, frozenset(args.feedback_opt_out))

    async def Feedback(self) -> dict:
        """Feedback records emitted, rounds skipped and emit errors of this replica (tests, ops)."""
        if not isinstance(self.core.feedback, EmittedFeedback):
            return {"enabled": False}
        emitter = self.core.feedback.emitter
        return {"enabled": True, "emitted": emitter.emitted, "skipped": emitter.skipped, "errors": emitter.errors}

    # -- errors: the one mapping --------------------------------------------------------------------
    def _fail(self, exc: BaseException, grpc_context: Any) -> None:
        code, message = grpc_status(exc)
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(message)
            if retry := retry_metadata(exc):  # a quota refusal: when to retry
                grpc_context.set_trailing_metadata(retry)
        if code.name == "INTERNAL":
            logger.error("request failed: %r", exc, exc_info=exc)
        raise _Failed(f"{code.name}: {message}") from None

    def _tenant(self, grpc_context: Any, requested: str) -> str:
        """The tenant a gRPC call runs as: its key's (``authorization: Bearer KEY`` metadata)."""
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        return self.keys.tenant_for(bearer_token(metadata.get("authorization")), requested)

    def _admit(self, request: specpool_pb2.GenerateRequest, grpc_context: Any):
        """(spec, tenant) of a call, checked before any model work; a refusal is counted and raised."""
        try:
            return spec_from_proto(request), self._tenant(grpc_context, request.tenant)
        except Exception as exc:  # noqa: BLE001
            self.runner.refused("grpc", exc)
            raise

    # -- SpecPool -----------------------------------------------------------------------------------
    async def Generate(self, request: specpool_pb2.GenerateRequest, grpc_context: Any = None) -> specpool_pb2.GenerateResponse:
        try:
            spec, tenant = self._admit(request, grpc_context)
            # A client cancel or deadline cancels this call: the runner stops the loop before its
            # next round and frees the session's caches (Orchestrator.run) before it returns.
            outcome = await self.runner.generate(spec, "grpc", tenant)
        except asyncio.CancelledError:
            raise
        except QuotaExceeded as exc:
            # Ray Serve 2.60 carries trailing metadata only when the method returns (a raise keeps
            # code and details alone): set the status and its retry hint, return an empty answer.
            code, message = grpc_status(exc)
            if grpc_context is None:
                raise
            grpc_context.set_code(code)
            grpc_context.set_details(message)
            grpc_context.set_trailing_metadata(retry_metadata(exc))
            return specpool_pb2.GenerateResponse()
        except Exception as exc:  # noqa: BLE001 - every failure leaves through the one mapping
            self._fail(exc, grpc_context)
        return specpool_pb2.GenerateResponse(
            text=outcome.text, token_ids=outcome.token_ids, finish_reason=finish_reason_to_proto(outcome.finish_reason),
            stats=stats_to_proto(outcome.stats), session_id=outcome.session_id,
        )

    async def GenerateStream(self, request: specpool_pb2.GenerateRequest,
                             grpc_context: Any = None) -> AsyncIterator[specpool_pb2.GenerateStreamResponse]:
        try:
            spec, tenant = self._admit(request, grpc_context)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, grpc_context)
        session = ""
        async with contextlib.aclosing(self.runner.run(spec, "grpc", tenant)) as events:
            try:
                async for event in events:
                    if isinstance(event, Outcome):
                        yield specpool_pb2.GenerateStreamResponse(
                            text=event.tail_text, finish_reason=finish_reason_to_proto(event.finish_reason),
                            stats=stats_to_proto(event.stats), session_id=session,
                        )
                    elif isinstance(event, Prepared):
                        session = event.session_id
                    else:
                        yield specpool_pb2.GenerateStreamResponse(text=event.text, token_ids=event.token_ids, session_id=session)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._fail(exc, grpc_context)

    # -- grpc.health.v1.Health ----------------------------------------------------------------------
    async def Check(self, request, grpc_context: Any = None):
        if request.service not in ("", SPECPOOL_SERVICE):
            self._fail(NotFound(f"unknown service {request.service!r}; this server has {SPECPOOL_SERVICE!r}"), grpc_context)
        return health_pb2.HealthCheckResponse(status=await self._serving())

    async def Watch(self, request, grpc_context: Any = None):
        """The current status, once (Serve's proxy cannot keep a watch open without holding a
        router slot; clients poll Check instead)."""
        if request.service not in ("", SPECPOOL_SERVICE):
            self._fail(NotFound(f"unknown service {request.service!r}; this server has {SPECPOOL_SERVICE!r}"), grpc_context)
        yield health_pb2.HealthCheckResponse(status=await self._serving())

    async def _serving(self) -> int:
        loop = asyncio.get_running_loop()
        try:  # the router's own dependency; the model servers are Serve's to watch
            await loop.run_in_executor(self._rounds, self.store.read, self._probe_key())
        except Exception:  # noqa: BLE001 - any failure means "not serving"
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    @staticmethod
    def _probe_key():
        return SessionKey("health", "probe")

    # -- introspection (deployment handles only; not on the gRPC API) ------------------------------
    async def FeatureStats(self) -> dict:
        """Feature traffic of this replica: received from the target, sent to each white-box
        drafter (calls, rows, bytes), resends after a deployment's gap, sessions held."""
        white_box = {name: d for name, d in self._drafters.items() if isinstance(d, RemoteDrafter) and d.relay is not None}
        return {"received": self._verifier.features_received.as_dict(),
                "sent": {name: d.features_sent.as_dict() for name, d in white_box.items()},
                "resends": {name: d.resends for name, d in white_box.items()},
                "sessions": self._relay.sessions() if self._relay is not None else 0}

    async def Direct(self) -> dict:
        """Calls this replica made over same-node direct routes, and those that fell back to Serve."""
        return {"calls": sum(r.calls for r in self._direct), "fallbacks": sum(r.fallbacks for r in self._direct)}

    async def Active(self) -> list[tuple[str, str]]:
        """(tenant, session) of the requests running on this replica."""
        return self.core.active_sessions()

    async def Replica(self) -> dict:
        return _replica()


def build_router_app(args: dict | None = None):
    parsed = RouterArgs.parse(args)
    return RouterServer.options(
        num_replicas=parsed.num_replicas, ray_actor_options=parsed.ray_actor_options,
        max_ongoing_requests=parsed.max_ongoing_requests, max_queued_requests=parsed.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
    ).bind(parsed)
