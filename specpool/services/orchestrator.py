"""The one request orchestrator: everything between a request and the speculative loop, in both modes.

The served router (``specpool/services/serve_app.py``, ``RouterServer``) and the embedded engine
(``specpool/services/engine.py``, ``EmbeddedEngine``) run every request through ``Orchestrator``;
they differ only in the parts they hand it (docs/ARCHITECTURE.md):

| part | embedded | served |
|---|---|---|
| drafters (``DrafterSource``) | ``LocalDrafters``: built from specs on first use | ``ServedDrafters``: the pool's deployments (``RemoteDrafter``) |
| verifier (``SessionVerifier``) | the local ``TargetVerifier`` | ``RemoteVerifier`` (the target deployment) |
| session store | in memory (or Redis) | Redis |
| feedback (``FeedbackWiring``) | ``EmbeddedLearning`` (a learner thread) | ``EmittedFeedback`` (a Redis stream) |
| caches after a finished request | released | kept for the session's next request |

Owned here, once: prompt encoding (``encode``), request defaults (``OrchestratorSettings``, from
``specpool.core.defaults``) and the default tenant, the drafter choice (``_chooser``: one fixed
drafter, target-only, or a bandit policy over a pool), per-request weight versions
(``PerRequestVersions``), feedback wiring, incremental detokenization and stop strings
(``specpool/services/detokenize.py``), metrics, and the outcome's statistics.

Per request:
- the session runs one request at a time (a second concurrent one is ABORTED);
- model servers know the session as ``tenant/session`` (``cache_id``): tenants that pick the same
  session id never touch each other's caches, weight pins or releases;
- ``should_stop`` (the caller cancelled or its deadline passed) ends the loop before the next
  round, and the session's caches are then released in the target and every drafter used;
- a request that fails releases them too; one that finishes normally keeps them when
  ``keep_caches`` (a continued session reuses them; each server evicts the least recently used
  beyond its capacity);
- with feedback wiring (online learning, issue 6), every round that drafted something asks the
  target for its top-K p and becomes a bounded record, stamped with the weights version that
  drafted it; opted-out tenants emit nothing. Emitting never fails a request.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, Sequence

from specpool.core.defaults import (DEFAULT_BETA, DEFAULT_K, DEFAULT_MAX_NEW_TOKENS, DEFAULT_POLICY,
                                    DEFAULT_PROBE_ROUNDS, DEFAULT_TENANT)
from specpool.core.errors import Cancelled, InvalidArgument, NotFound, SessionBusy, check
from specpool.drafters.base import Drafter, PerRequestVersions
from specpool.drafters.registry import shared_sources
from specpool.learning.feedback import FeedbackEmitter
from specpool.router.bandit import BanditChooser
from specpool.router.loop import (DrafterChooser, FinishNoticed, FixedChooser, GenerationResult, RoundFeedback,
                                  RoundRecord, SessionVerifier, speculative_generate)
from specpool.router.policies import PolicyOptions, make_policy, parse_arm
from specpool.router.session_store import SessionKey, SessionStore
from specpool.services.api import GenerationSpec, Stats
from specpool.services.detokenize import Chunk, IncrementalDetokenizer
from specpool.services.metrics import Metrics, NoMetrics
from specpool.services.status import grpc_status
from specpool.target.models import chat_ids, chat_prompt_ids
from specpool.target.sampling import SamplingParams, validate_draft_length

FeedbackCallback = Callable[[RoundFeedback], None]


@dataclass(frozen=True)
class ModelInfo:
    """What the orchestrator needs to know about the target it verifies with."""

    model: str  # the target's name as configured (embedded name, folder or hub id)
    stop_token_ids: tuple[int, ...]  # end-of-sequence ids: always stop
    context_window: int
    tokenizer_fingerprint: str


@dataclass(frozen=True)
class OrchestratorSettings:
    """What a request that leaves something unset gets."""

    policy: str = DEFAULT_POLICY  # a request given as a GenerationSpec that names no policy
    k: int = DEFAULT_K  # draft length
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    beta: float = DEFAULT_BETA  # UCB exploration weight
    probe_rounds: int = DEFAULT_PROBE_ROUNDS  # ucb-replay: rounds in which every drafter is replayed
    # Served sessions continue over requests (chat turns) and their caches save a re-prefill; an
    # embedded request (CLI, benchmarks) is usually its session's only one, so keeping its caches
    # would only hold memory.
    keep_caches: bool = True

    def policy_options(self) -> PolicyOptions:
        return PolicyOptions(beta=self.beta, probe_rounds=self.probe_rounds)


class DrafterSource(Protocol):
    """Where the orchestrator gets a drafter by name."""

    def drafter(self, name: str) -> Drafter:
        """The drafter ``name`` names; NotFound (or another SpecpoolError) when there is none."""
        ...

    def default_pool(self) -> list[str]:
        """What a policy chooses among when the request names no pool."""
        ...


class ServedDrafters:
    """The served pool: a fixed set of drafters, in the router's configured order."""

    def __init__(self, drafters: Mapping[str, Drafter]):
        self._drafters = dict(drafters)

    def drafter(self, name: str) -> Drafter:
        if name not in self._drafters:
            raise NotFound(f"drafter {name!r} is not served here; served drafters: {', '.join(self._drafters)}")
        return self._drafters[name]

    def default_pool(self) -> list[str]:
        return list(self._drafters)


class FeedbackWiring(Protocol):
    """Online learning's hook into a request (``EmbeddedLearning`` in specpool/learning/learner.py,
    ``EmittedFeedback`` below)."""

    @property
    def top_k(self) -> int:
        """Entries of the target's p per position that a feedback round asks for."""
        ...

    def prepare(self, tenant: str, drafters: Mapping[str, Drafter]) -> tuple[dict[str, Drafter], FeedbackCallback | None]:
        """(the drafters this request uses, versions pinned; the per-round callback, or None)."""
        ...


class EmittedFeedback:
    """Served online learning: every drafted round to a feedback stream, for ``specpool learner``.
    Versions are pinned by the drafter servers (``PerRequestVersions``), not here."""

    def __init__(self, emitter: FeedbackEmitter, top_k: int, opt_out: frozenset[str] = frozenset()):
        self.emitter = emitter  # counts what it emitted, skipped and failed (RouterServer.Feedback)
        self.top_k = top_k
        self.opt_out = opt_out

    def prepare(self, tenant: str, drafters: Mapping[str, Drafter]) -> tuple[dict[str, Drafter], FeedbackCallback | None]:
        if tenant in self.opt_out:
            return dict(drafters), None

        def feedback(fb: RoundFeedback) -> None:
            drafter = drafters.get(fb.drafter)
            # The weights version that drafted (0: shipped weights, or a drafter with none); the
            # drafter server pinned it under the session's cache id.
            version = drafter.version_of(cache_id(tenant, fb.session_id)) if isinstance(drafter, PerRequestVersions) else 0
            self.emitter(fb, tenant, version)

        return dict(drafters), feedback


def cache_id(tenant: str, session_id: str) -> str:
    """What the target's and drafters' per-session structures (KV caches, drafter caches, weight
    pins, feature logs, direct routes, releases) are keyed by: ``tenant/session``. Two tenants that
    pick the same session id then never share, evict or free each other's caches. Unambiguous: a
    tenant id holds no ``/`` (``SessionKey`` checks both)."""
    return f"{tenant}/{session_id}"


def _named_feedback(feedback: FeedbackCallback, session_id: str) -> FeedbackCallback:
    def named(fb: RoundFeedback) -> None:
        feedback(replace(fb, session_id=session_id))

    return named


@dataclass
class Prepared:
    """A request ready to run: everything checked, nothing started."""

    session_id: str
    tenant: str
    prompt_ids: list[int]
    params: SamplingParams
    k: int
    policy: str  # the policy's name; "fixed:NAME" / "fixed:none" for a fixed drafter / target-only
    chooser: DrafterChooser
    drafters: dict[str, Drafter]  # weights versions pinned for this request (online learning)
    stop: tuple[str, ...] = ()
    feedback: FeedbackCallback | None = None  # online learning: called after every drafted round
    feedback_top_k: int = 0  # entries of the target's p per position those rounds ask for
    endpoint: str = "embedded"  # which API it came through (grpc, http): a metrics label

    @property
    def cache_id(self) -> str:
        """The session's name in every model server (``cache_id``)."""
        return cache_id(self.tenant, self.session_id)


@dataclass(frozen=True)
class Outcome:
    """A finished request, as both modes return it (the embedded engine hands back ``result``)."""

    session_id: str
    text: str  # decoded output (new tokens only)
    stats: Stats
    result: GenerationResult  # the loop's; tokens and finish reason as the caller sees them (cut after a stop string)
    tail_text: str = ""  # text not yet handed out as a Chunk (a streaming call's last message carries it)

    @property
    def token_ids(self) -> list[int]:
        return self.result.token_ids

    @property
    def finish_reason(self) -> str:
        """"stop", "length" or "cancelled"."""
        return self.result.finish_reason


class Orchestrator:
    """One request from input to outcome, over the parts a mode hands it (the table above).
    Thread-safe: the served router runs one request per worker thread."""

    def __init__(
        self,
        tokenizer,
        info: ModelInfo,
        drafters: DrafterSource,
        verifier: SessionVerifier,
        store: SessionStore,
        settings: OrchestratorSettings = OrchestratorSettings(),
        metrics: Metrics | None = None,
        feedback: FeedbackWiring | None = None,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.drafters = drafters
        self.verifier = verifier
        self.store = store
        self.settings = settings
        self.metrics = metrics or NoMetrics()
        self.feedback = feedback
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share between threads
        self._active_lock = threading.Lock()
        self._active: set[tuple[str, str]] = set()  # (tenant, session) running here

    # -- text ----------------------------------------------------------------------------------
    def encode(self, kind: str, text: str = "", messages: Sequence[tuple[str, str]] = ()) -> list[int]:
        """Prompt ids of one input: "prompt" (one user turn of the chat template), "raw" (no
        template) or "chat" (``messages``, (role, content) pairs)."""
        check(kind == "chat" or bool(text.strip()), "the prompt is empty")
        with self._tokenizer_lock:
            if kind == "prompt":
                ids = chat_prompt_ids(self.tokenizer, text)
            elif kind == "raw":
                ids = self.tokenizer.encode(text, add_special_tokens=True)
            else:
                ids = chat_ids(self.tokenizer, messages)
        ids = list(ids)
        check(bool(ids), "the prompt encodes to no tokens")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- preparation (no model work) -------------------------------------------------------------
    def prepare(self, spec: GenerationSpec) -> Prepared:
        """A served request: its input encoded, "0 / empty: the default" filled in. Raises
        SpecpoolError (INVALID_ARGUMENT, NOT_FOUND, ...) before any model work."""
        for token in spec.stop_token_ids:
            check(token >= 0, f"stop token ids must be >= 0, got {token}")
        prompt_ids = self.encode(spec.input_kind, spec.text, spec.messages)
        params = SamplingParams(
            temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
            max_new_tokens=spec.max_new_tokens or self.settings.max_new_tokens,
            stop_token_ids=tuple(sorted(set(self.info.stop_token_ids) | set(spec.stop_token_ids))),
        )
        return self.prepare_ids(prompt_ids, params, k=spec.k or self.settings.k, session_id=spec.session_id or None,
                                tenant=spec.tenant or DEFAULT_TENANT, policy=spec.policy or self.settings.policy,
                                stop=spec.stop)

    def prepare_ids(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        k: int,
        session_id: str | None = None,
        tenant: str = DEFAULT_TENANT,
        drafter: str | None = None,
        policy: str | None = None,
        pool: Sequence[str] | None = None,
        policy_options: PolicyOptions | None = None,
        stop: Sequence[str] = (),
        trace: bool = False,
    ) -> Prepared:
        """A request over prompt ids. Either ``drafter`` (one fixed drafter, or None: target-only)
        or ``policy`` (a bandit over ``pool``, default the drafter source's) picks each round's drafter."""
        validate_draft_length(k)
        params.validate(self.info.context_window, len(prompt_ids))
        session = session_id or uuid.uuid4().hex
        key = SessionKey(tenant, session)  # validates both before any work
        options = policy_options or self.settings.policy_options()
        chooser, drafters, name = self._chooser(key, params.seed, drafter, policy, pool, options, trace)
        feedback, top_k = None, 0
        if self.feedback is not None:  # pins this request's drafter versions: never mixed within it
            drafters, feedback = self.feedback.prepare(tenant, drafters)
            top_k = self.feedback.top_k if feedback is not None else 0
            if feedback is not None:  # the loop names the session by its cache id; records by the client's id
                feedback = _named_feedback(feedback, session)
        return Prepared(session, tenant, list(prompt_ids), params, k, name, chooser, drafters, tuple(stop), feedback, top_k)

    def _chooser(self, key: SessionKey, seed: int, drafter: str | None, policy: str | None, pool: Sequence[str] | None,
                 options: PolicyOptions, trace: bool) -> tuple[DrafterChooser, dict[str, Drafter], str]:
        """(the chooser, the drafters it may pick, the policy's name)."""
        if policy is None:
            drafters = {drafter: self.drafters.drafter(drafter)} if drafter is not None else {}
            return FixedChooser(drafter), drafters, f"fixed:{drafter or 'none'}"
        if drafter is not None:
            raise InvalidArgument("give either a drafter or a policy, not both (a fixed drafter is policy fixed:NAME)")
        bandit = make_policy(policy, list(pool) if pool is not None else self.drafters.default_pool(), options)
        names = list(dict.fromkeys(parse_arm(a)[0] for a in bandit.arms))
        drafters = {name: self.drafters.drafter(name) for name in names}
        chooser = BanditChooser(bandit, self.store, key, seed=seed, trace=trace, shared_sources=shared_sources(names))
        return chooser, drafters, policy

    # -- running ----------------------------------------------------------------------------------
    def run(
        self,
        prepared: Prepared,
        on_chunk: Callable[[Chunk], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
    ) -> Outcome:
        """Generate (blocking; the served router calls this in a worker thread). Raises Cancelled
        when ``should_stop`` ended it, after the session's caches were released everywhere."""
        slot = (prepared.tenant, prepared.session_id)
        with self._active_lock:
            if slot in self._active:
                raise SessionBusy(f"session {prepared.session_id!r} of tenant {prepared.tenant!r} already has a request "
                                  "running; a session runs one request at a time")
            self._active.add(slot)
        status = "OK"
        try:
            outcome = self._run(prepared, on_chunk, should_stop, on_round)
            if outcome.finish_reason == "cancelled":
                status = "CANCELLED"
                self.release(prepared)
                raise Cancelled(f"request of session {prepared.session_id!r} was cancelled after "
                                f"{outcome.stats.new_tokens} tokens; its caches were released")
            if not self.settings.keep_caches:
                self.release(prepared)
            elif isinstance(self.verifier, FinishNoticed):
                self.verifier.request_finished(prepared.cache_id)
            return outcome
        except Cancelled:
            raise
        except BaseException as exc:
            status = grpc_status(exc)[0].name
            self.release(prepared)
            raise
        finally:
            with self._active_lock:
                self._active.discard(slot)
            self.metrics.request(prepared.tenant, status, prepared.endpoint)

    def _run(self, prepared: Prepared, on_chunk, should_stop, on_round) -> Outcome:
        text = IncrementalDetokenizer(self.decode, prepared.stop)

        def on_tokens(new_ids: list[int]) -> None:
            chunk = text.add(new_ids)
            if on_chunk is not None and chunk.token_ids:
                on_chunk(chunk)

        def stop() -> bool:
            return text.stopped or (should_stop is not None and should_stop())

        def record_round(record: RoundRecord) -> None:
            self.metrics.round(prepared.tenant, record, prepared.endpoint)
            if on_round is not None:
                on_round(record)

        pinning = [d for d in prepared.drafters.values() if isinstance(d, PerRequestVersions)]
        for drafter in pinning:
            drafter.begin_request(prepared.cache_id, prepared.tenant)
        try:
            result = speculative_generate(
                prepared.prompt_ids, session_id=prepared.cache_id, drafters=prepared.drafters,
                chooser=prepared.chooser, verifier=self.verifier, params=prepared.params, k=prepared.k,
                on_tokens=on_tokens, should_stop=stop, on_round=record_round, feedback=prepared.feedback,
                return_top_k=prepared.feedback_top_k,
            )
        finally:
            for drafter in pinning:
                drafter.end_request(prepared.cache_id)
            if isinstance(prepared.chooser, BanditChooser):
                prepared.chooser.finish()  # rounds a store outage held back: written now, or by a later request
        return self._outcome(prepared, text, result)

    def _outcome(self, prepared: Prepared, text: IncrementalDetokenizer, result: GenerationResult) -> Outcome:
        full_text, tail = text.finish()
        result.token_ids = list(text.token_ids)  # the loop's tokens, cut after a stop string
        if text.stopped:
            result.finish_reason = "stop"
        if isinstance(prepared.chooser, BanditChooser):
            result.chooser_s = prepared.chooser.overhead_s
            result.trace = prepared.chooser.trace or []
        rounds = result.rounds
        stats = Stats(
            rounds=len(rounds), new_tokens=len(result.token_ids), prompt_tokens=len(prepared.prompt_ids),
            mean_accepted_length=result.mean_accepted_length, rounds_by_drafter=result.rounds_by_drafter(),
            draft_tokens=sum(r.proposed for r in rounds), accepted_tokens=sum(r.accepted for r in rounds),
            wall_s=result.wall_s, **result.call_seconds(),
        )
        return Outcome(prepared.session_id, full_text, stats, result, tail)

    def release(self, prepared: Prepared) -> None:
        """Free the session's caches in the target and every drafter the request used. Best
        effort: a server that cannot be reached holds nothing worth freeing."""
        for release in [self.verifier.release, *(d.release for d in prepared.drafters.values())]:
            try:
                release(prepared.cache_id)
            except Exception:  # noqa: BLE001 - freeing memory must not mask the request's own outcome
                pass

    def active_sessions(self) -> list[tuple[str, str]]:
        with self._active_lock:
            return sorted(self._active)
