"""The router's work for one request, independent of how it is served.

``RouterCore`` turns a checked ``GenerationSpec`` into prompt ids, sampling parameters and a bandit
chooser over a session store, runs the same ``speculative_generate`` loop as the embedded engine
over whatever drafters and verifier it was given (in served mode: adapters that call the drafter
and target deployments, ``specpool/services/remote.py``), and returns the outcome, optionally chunk by
chunk for streaming. The Ray Serve router (``specpool/services/serve_app.py``) runs ``run`` in a worker
thread; unit tests run it over in-process models.

Per request:
- the session runs one request at a time (a second concurrent one is ABORTED);
- ``should_stop`` (the caller cancelled or its deadline passed) ends the loop before the next
  round, and the session's caches are then released in the target and every drafter used;
- a normally finished session keeps its caches (a continued session reuses them; each server
  evicts the least recently used beyond its capacity);
- with a ``feedback`` emitter (online learning, issue 6), every round that drafted something asks
  the target for its top-K p and becomes a bounded record on the feedback stream, for
  ``specpool learner``, stamped with the weights version that drafted it; tenants in
  ``feedback_opt_out`` emit nothing. Emitting never fails a request (``FeedbackEmitter`` counts
  its own errors).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Mapping

from specpool.drafters.base import Drafter
from specpool.learning.feedback import FeedbackEmitter
from specpool.drafters.registry import shared_sources
from specpool.router.bandit import BanditChooser
from specpool.core.errors import Cancelled, NotFound, SessionBusy, check
from specpool.router.loop import RoundFeedback, RoundRecord, Verifier, speculative_generate
from specpool.router.policies import PolicyOptions, make_policy, parse_arm
from specpool.router.session_store import SessionKey, SessionStore
from specpool.services.api import GenerationSpec, Stats
from specpool.services.metrics import Metrics, NoMetrics
from specpool.services.status import grpc_status
from specpool.target.sampling import SamplingParams, validate_draft_length

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to know about the target it verifies with."""

    model: str  # the target's name as configured (embedded name, folder or hub id)
    stop_token_ids: tuple[int, ...]  # end-of-sequence ids: always stop
    context_window: int
    tokenizer_fingerprint: str


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "metasd-ucb"  # default policy
    k: int = 5  # default draft length
    max_new_tokens: int = 128  # when a request says 0
    beta: float = 0.2  # UCB exploration weight
    probe_rounds: int = 4  # ucb-replay: rounds in which every drafter is replayed


@dataclass
class Prepared:
    """A request ready to run: everything checked, nothing started."""

    session_id: str
    tenant: str
    prompt_ids: list[int]
    params: SamplingParams
    k: int
    policy: str
    chooser: BanditChooser
    drafters: dict[str, Drafter]
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """Tokens one round added, and the text they completed."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Outcome:
    session_id: str
    token_ids: list[int]
    text: str  # decoded output (new tokens only)
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: Stats
    tail_text: str = ""  # text not yet sent as a Chunk (a streaming call's last message carries it)


class Detokenizer:
    """Incremental text, and stop strings: emits only complete text (no half UTF-8 character), and
    ends the output at the token that completes the first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self._decode = decode
        self.stop = stop
        self.token_ids: list[int] = []
        self.sent = 0  # characters of text handed out
        self.hit = False  # a stop string appeared
        self._checked = 0  # text length already searched for stop strings
        self._longest = max((len(s) for s in stop), default=0)

    def add(self, new_ids: list[int]) -> Chunk:
        """Take a round's tokens (only up to a stop string); return what they add."""
        if self.hit:
            return Chunk("", [])
        taken: list[int] = []
        for token in new_ids:
            self.token_ids.append(token)
            taken.append(token)
            if self.stop and self._stop_found():
                self.hit = True
                break
        text = self._decode(self.token_ids)
        if text.endswith("\ufffd") and not self.hit:  # a multi-byte character is still incomplete
            return Chunk("", taken)
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return Chunk(delta, taken)

    def _stop_found(self) -> bool:
        text = self._decode(self.token_ids)
        start = max(0, self._checked - self._longest + 1)
        found = any(s in text[start:] for s in self.stop)
        self._checked = len(text)
        return found

    def flush(self) -> str:
        text = self._decode(self.token_ids)
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta


class RouterCore:
    def __init__(
        self,
        tokenizer,
        info: ModelInfo,
        drafters: Mapping[str, Drafter],
        verifier: Verifier,
        store: SessionStore,
        settings: RouterSettings = RouterSettings(),
        metrics: Metrics | None = None,
        feedback: FeedbackEmitter | None = None,
        feedback_top_k: int = 20,
        feedback_opt_out: frozenset[str] = frozenset(),
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.drafters = dict(drafters)  # the served pool, in order
        self.verifier = verifier
        self.store = store
        self.settings = settings
        self.metrics = metrics or NoMetrics()
        self.feedback = feedback
        self.feedback_top_k = feedback_top_k
        self.feedback_opt_out = feedback_opt_out
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share between threads
        self._active_lock = threading.Lock()
        self._active: set[tuple[str, str]] = set()  # (tenant, session) running here

    # -- preparation (no model work) ------------------------------------------------------------
    def encode(self, spec: GenerationSpec) -> list[int]:
        from specpool.target.models import chat_prompt_ids

        with self._tokenizer_lock:
            if spec.input_kind == "prompt":
                ids = chat_prompt_ids(self.tokenizer, spec.text)
            elif spec.input_kind == "raw":
                ids = self.tokenizer.encode(spec.text, add_special_tokens=True)
            else:
                messages = [{"role": r, "content": c} for r, c in spec.messages]
                if getattr(self.tokenizer, "chat_template", None):
                    ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                        ids = ids["input_ids"]
                else:
                    ids = self.tokenizer.encode("\n".join(c for _, c in spec.messages), add_special_tokens=True)
        ids = list(ids)
        check(bool(ids), "the prompt encodes to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prepare(self, spec: GenerationSpec) -> Prepared:
        """Check and build everything a request needs; raises SpecpoolError (INVALID_ARGUMENT,
        NOT_FOUND, ...) before any model work."""
        tenant = spec.tenant or DEFAULT_TENANT
        session = spec.session_id or uuid.uuid4().hex
        key = SessionKey(tenant, session)  # validates both ids
        k = spec.k or self.settings.k
        validate_draft_length(k)
        for token in spec.stop_token_ids:
            check(token >= 0, f"stop token ids must be >= 0, got {token}")
        prompt_ids = self.encode(spec)
        params = SamplingParams(
            temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
            max_new_tokens=spec.max_new_tokens or self.settings.max_new_tokens,
            stop_token_ids=tuple(sorted(set(self.info.stop_token_ids) | set(spec.stop_token_ids))),
        )
        params.validate(self.info.context_window, len(prompt_ids))
        policy_name = spec.policy or self.settings.policy
        pool = list(self.drafters)
        policy = make_policy(policy_name, pool, PolicyOptions(beta=self.settings.beta, probe_rounds=self.settings.probe_rounds))
        names = list(dict.fromkeys(parse_arm(a)[0] for a in policy.arms))
        for name in names:
            if name not in self.drafters:
                raise NotFound(f"drafter {name!r} is not served here; served drafters: {', '.join(pool)}")
        chooser = BanditChooser(policy, self.store, key, seed=params.seed, shared_sources=shared_sources(names))
        return Prepared(session, tenant, prompt_ids, params, k, policy_name, chooser,
                        {name: self.drafters[name] for name in names}, spec.stop)

    # -- running ----------------------------------------------------------------------------------
    def run(
        self,
        prepared: Prepared,
        on_chunk: Callable[[Chunk], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
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
            outcome = self._run(prepared, on_chunk, should_stop)
            if outcome.finish_reason == "cancelled":
                status = "CANCELLED"
                self.release(prepared)
                raise Cancelled(f"request of session {prepared.session_id!r} was cancelled after "
                                f"{outcome.stats.new_tokens} tokens; its caches were released")
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
            self.metrics.request(prepared.tenant, status)

    def _run(self, prepared: Prepared, on_chunk, should_stop) -> Outcome:
        text = Detokenizer(self.decode, prepared.stop)

        def on_tokens(new_ids: list[int]) -> None:
            chunk = text.add(new_ids)
            if on_chunk is not None and chunk.token_ids:
                on_chunk(chunk)

        def stop() -> bool:
            return text.hit or (should_stop is not None and should_stop())

        def on_round(record: RoundRecord) -> None:
            self.metrics.round(prepared.tenant, record)

        feedback = None
        if self.feedback is not None and prepared.tenant not in self.feedback_opt_out:
            emitter, tenant = self.feedback, prepared.tenant

            def feedback(fb: RoundFeedback) -> None:
                # The weights version that drafted (0: shipped weights, or a drafter with none).
                version_of = getattr(prepared.drafters.get(fb.drafter), "version_of", None)
                emitter(fb, tenant, version_of(fb.session_id) if version_of is not None else 0)

        # Remote drafters pin one weights version per request (specpool/services/remote.py).
        requests = [d for d in prepared.drafters.values() if hasattr(d, "begin_request")]
        for drafter in requests:
            drafter.begin_request(prepared.session_id, prepared.tenant)  # type: ignore[attr-defined]
        try:
            result = speculative_generate(
                prepared.prompt_ids, session_id=prepared.session_id, drafters=prepared.drafters,
                chooser=prepared.chooser, verifier=self.verifier, params=prepared.params, k=prepared.k,
                on_tokens=on_tokens, should_stop=stop, on_round=on_round,
                feedback=feedback, return_top_k=self.feedback_top_k if feedback is not None else 0,
            )
        finally:
            for drafter in requests:
                drafter.end_request(prepared.session_id)  # type: ignore[attr-defined]
        finish = "stop" if text.hit else result.finish_reason
        tail = text.flush()
        tokens = text.token_ids  # the loop's tokens, cut after a stop string
        rounds = result.rounds
        stats = Stats(
            rounds=len(rounds), new_tokens=len(tokens), prompt_tokens=len(prepared.prompt_ids),
            mean_accepted_length=len(tokens) / len(rounds) if rounds else 0.0,
            rounds_by_drafter=result.rounds_by_drafter(),
            draft_tokens=sum(r.proposed for r in rounds), accepted_tokens=sum(r.accepted for r in rounds),
            wall_s=result.wall_s, **result.call_seconds(),
        )
        return Outcome(prepared.session_id, list(tokens), self.decode(tokens), finish, stats, tail)

    def release(self, prepared: Prepared) -> None:
        """Free the session's caches in the target and every drafter the request used. Best
        effort: a server that cannot be reached holds nothing worth freeing."""
        for release in [self.verifier.release, *(d.release for d in prepared.drafters.values())]:  # type: ignore[attr-defined]
            try:
                release(prepared.session_id)
            except Exception:  # noqa: BLE001 - freeing memory must not mask the request's own outcome
                pass

    def active_sessions(self) -> list[tuple[str, str]]:
        with self._active_lock:
            return sorted(self._active)

