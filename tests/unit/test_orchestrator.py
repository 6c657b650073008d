"""The request orchestrator (specpool/services/orchestrator.py) as the served router sets it up, over
in-process tiny models: the same output as the embedded engine, streaming chunks that add up, stop
strings, one request per session, and cancellation that stops the loop and frees the session's
caches everywhere."""

from __future__ import annotations

from specpool.services.orchestrator import cache_id

import threading

import pytest

from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.core.errors import Cancelled, InvalidArgument, NotFound, SessionBusy
from specpool.router.session_store import InMemorySessionStore, SessionKey
from specpool.services.api import GenerationSpec
from specpool.services.metrics import PrometheusMetrics
from specpool.services.orchestrator import (EmittedFeedback, ModelInfo, Orchestrator, OrchestratorSettings,
                                            ServedDrafters)
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier

PROMPT = "the cat sat on the mat and the dog sat on the mat"


class Recording:
    """A drafter that records release calls (and passes everything else through)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.tokenizer_fingerprint = inner.tokenizer_fingerprint
        self.cost = inner.cost
        self.released: list[str] = []
        self.sessions: set[str] = set()

    def propose(self, session_id, context_ids, k, params):
        self.sessions.add(session_id)
        return self.inner.propose(session_id, context_ids, k, params)

    def release(self, session_id):
        self.released.append(session_id)
        self.inner.release(session_id)


@pytest.fixture
def parts(target_lm, noisy_lm):
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    drafters = {"ngram": Recording(NGramDrafter()), "noisy": Recording(HFModelDrafter("noisy", *noisy_lm))}
    info = ModelInfo("tiny", (tokenizer.eos_token_id,), verifier.context_window, verifier.tokenizer_fingerprint)
    metrics = PrometheusMetrics()
    core = Orchestrator(tokenizer, info, ServedDrafters(drafters), verifier, InMemorySessionStore(),
                        OrchestratorSettings(k=4, max_new_tokens=24), metrics)
    return core, verifier, drafters, metrics


def spec(**kw) -> GenerationSpec:
    base = dict(input_kind="prompt", text=PROMPT, max_new_tokens=20)
    base.update(kw)
    return GenerationSpec(**base)


def test_same_tokens_as_the_embedded_engine(parts, engine, model_dirs):
    core, *_ = parts
    prepared = core.prepare(spec(session_id="s1", tenant="acme"))
    outcome = core.run(prepared)
    ids = engine.encode_prompt(PROMPT)
    assert prepared.prompt_ids == ids
    params = SamplingParams(max_new_tokens=20, stop_token_ids=engine.stop_token_ids())
    reference = engine.generate(ids, params, k=4, policy="metasd-ucb", pool=["ngram", f"hf:{model_dirs.noisy}"])
    assert outcome.token_ids == reference.token_ids
    assert outcome.text == engine.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    assert outcome.finish_reason == reference.finish_reason
    assert outcome.stats.new_tokens == len(outcome.token_ids)
    assert outcome.stats.rounds == sum(outcome.stats.rounds_by_drafter.values()) > 0
    assert outcome.stats.accepted_tokens <= outcome.stats.draft_tokens


def test_stream_chunks_add_up_to_the_answer(parts):
    core, *_ = parts
    chunks = []
    outcome = core.run(core.prepare(spec(session_id="s2")), on_chunk=chunks.append)
    assert [t for c in chunks for t in c.token_ids] == outcome.token_ids
    assert "".join(c.text for c in chunks) + outcome.tail_text == outcome.text
    assert len(chunks) == outcome.stats.rounds  # one chunk per round


def test_a_normal_finish_keeps_the_caches_for_the_next_request(parts):
    core, verifier, drafters, _ = parts
    core.run(core.prepare(spec(session_id="keep")))
    assert cache_id("default", "keep") in verifier.caches.sessions()  # tenant/session
    assert not any(d.released for d in drafters.values())


class NoticedVerifier:
    """The local verifier, plus the end-of-request notice a target deployment's RemoteVerifier takes."""

    def __init__(self, inner: TargetVerifier):
        self.inner = inner
        self.finished: list[str] = []

    def verify(self, request):
        return self.inner.verify(request)

    def release(self, session_id):
        return self.inner.release(session_id)

    def request_finished(self, session_id):
        self.finished.append(session_id)


def test_a_normal_finish_tells_the_target_the_request_ended_and_a_cancel_releases_instead(parts):
    """With caches kept, the target hears that the session's request ended (its verify batches stop
    waiting for that session); a cancelled request frees the caches instead."""
    core, verifier, *_ = parts
    noticed = NoticedVerifier(verifier)
    core.verifier = noticed
    core.run(core.prepare(spec(session_id="done", tenant="acme")))
    assert noticed.finished == ["acme/done"]
    assert cache_id("acme", "done") in verifier.caches.sessions()
    stop = threading.Event()
    with pytest.raises(Cancelled):
        core.run(core.prepare(spec(session_id="gone")), lambda chunk: stop.set(), stop.is_set)
    assert noticed.finished == ["acme/done"]  # no notice for a cancelled request: it was released


def test_stop_string_ends_the_text_right_after_it(parts):
    core, *_ = parts
    full = core.run(core.prepare(spec(session_id="s3", max_new_tokens=24)))
    words = full.text.split()
    assert len(words) >= 6, full.text
    stop = " ".join(words[3:5])
    cut = core.run(core.prepare(spec(session_id="s4", max_new_tokens=24, stop=(stop,))))
    assert cut.finish_reason == "stop"
    assert stop in cut.text and cut.text.endswith(stop), (cut.text, stop)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert cut.stats.new_tokens == len(cut.token_ids) < len(full.token_ids)


def test_cancel_stops_the_loop_and_releases_every_cache(parts):
    core, verifier, drafters, metrics = parts
    stop = threading.Event()
    chunks = []

    def on_chunk(chunk):
        chunks.append(chunk)
        stop.set()  # the caller goes away after the first round

    with pytest.raises(Cancelled, match="cancelled"):
        core.run(core.prepare(spec(session_id="gone", tenant="acme", policy="fixed:noisy")), on_chunk, stop.is_set)
    assert len(chunks) == 1  # no round after the cancel
    assert cache_id("acme", "gone") not in verifier.caches.sessions()
    assert drafters["noisy"].released == ["acme/gone"]
    assert core.active_sessions() == []
    assert metrics.registry.get_sample_value("specpool_requests_total", {"tenant": "acme", "endpoint": "embedded", "status": "CANCELLED"}) == 1


def test_one_request_per_session(parts):
    core, *_ = parts
    prepared = core.prepare(spec(session_id="busy"))
    second = core.prepare(spec(session_id="busy"))
    errors = []

    def on_chunk(chunk):
        if not errors:
            try:
                core.run(second)
            except SessionBusy as exc:
                errors.append(exc)

    core.run(prepared, on_chunk)
    assert errors and errors[0].code == "ABORTED" and "one request at a time" in str(errors[0])
    core.run(second)  # free again afterwards


@pytest.mark.parametrize("kw,error,message", [
    (dict(session_id="bad id!"), InvalidArgument, "invalid session id"),
    (dict(tenant="a:b"), InvalidArgument, "invalid tenant id"),
    (dict(k=40), InvalidArgument, "k (draft length)"),
    (dict(policy="nope"), NotFound, "unknown policy"),
    (dict(policy="fixed:code"), NotFound, "not served here"),
    (dict(max_new_tokens=10_000), InvalidArgument, "does not fit"),
    (dict(temperature=-1.0), InvalidArgument, "temperature"),
])
def test_prepare_rejects_bad_requests(parts, kw, error, message):
    core, *_ = parts
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        core.prepare(spec(**kw))


def test_chat_and_raw_inputs(parts, target_lm):
    core, *_ = parts
    tokenizer = target_lm[1]
    raw = core.prepare(spec(input_kind="raw", text="the cat"))
    assert raw.prompt_ids == tokenizer.encode("the cat", add_special_tokens=True)
    chat = core.prepare(GenerationSpec(input_kind="chat", messages=(("user", "the cat"), ("assistant", "sat")), max_new_tokens=4))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}], add_generation_prompt=True, tokenize=True)
    assert chat.prompt_ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_metrics_count_rounds_and_tokens_per_drafter(parts):
    core, _, _, metrics = parts
    outcome = core.run(core.prepare(spec(session_id="m1", tenant="t1", policy="fixed:ngram")))
    value = metrics.registry.get_sample_value
    rounds = value("specpool_rounds_total", {"tenant": "t1", "drafter": "ngram", "endpoint": "embedded"}) or 0
    rounds_none = value("specpool_rounds_total", {"tenant": "t1", "drafter": "none", "endpoint": "embedded"}) or 0
    assert rounds + rounds_none == outcome.stats.rounds
    emitted = sum(value("specpool_emitted_tokens_total", {"tenant": "t1", "drafter": d, "endpoint": "embedded"}) or 0 for d in ("ngram", "none"))
    assert emitted == outcome.stats.new_tokens
    assert value("specpool_requests_total", {"tenant": "t1", "endpoint": "embedded", "status": "OK"}) == 1
    assert value("specpool_round_seconds_count", {"tenant": "t1", "drafter": "ngram", "endpoint": "embedded", "part": "verify"}) == rounds


def test_feedback_sends_every_drafted_round_and_changes_nothing_else(parts):
    """Served online learning: each round that drafted becomes a record with the target's top-K p
    (as the learner reads it); the answer is the same as without feedback; opted-out tenants send nothing."""
    from specpool.learning.feedback import FeedbackEmitter, FeedbackRecord, InProcessFeedbackStream

    core, *_ = parts
    reference = core.run(core.prepare(spec(session_id="plain", tenant="acme")))
    stream = InProcessFeedbackStream(1000)
    emitter = FeedbackEmitter(stream, context_tail=16)
    core.feedback = EmittedFeedback(emitter, top_k=8, opt_out=frozenset({"quiet"}))
    outcome = core.run(core.prepare(spec(session_id="taught", tenant="acme")))
    assert outcome.token_ids == reference.token_ids
    records = [FeedbackRecord.decode(d.payload) for d in stream.read("learner", 1000)]
    drafted = outcome.stats.rounds_by_drafter
    assert len(records) == emitter.emitted > 0 and emitter.errors == 0
    assert len(records) + emitter.skipped <= outcome.stats.rounds
    assert sum(len(r.draft) for r in records) == outcome.stats.draft_tokens  # every drafted round, once
    assert sum(r.accepted for r in records) == outcome.stats.accepted_tokens
    for r in records:
        assert (r.tenant, r.session, r.version) == ("acme", "taught", 0) and r.drafter in drafted
        assert len(r.target_ids) == len(r.draft) + 1 and all(len(row) == 8 for row in r.target_ids)
        assert 0 < len(r.context) <= 16
    core.run(core.prepare(spec(session_id="q", tenant="quiet")))
    assert stream.read("learner", 1000) == [] and emitter.emitted == len(records)


def test_optional_capabilities_are_protocols_the_parts_declare_by_shape(noisy_lm):
    """What the loop and the orchestrator check with isinstance instead of probing attributes."""
    from specpool.drafters.base import PerRequestVersions, Replayable
    from specpool.drafters.lookup_first import LookupFirstDrafter
    from specpool.router.bandit import BanditChooser, ReplayPolicy
    from specpool.router.loop import FixedChooser, ReplayingChooser
    from specpool.router.policies import make_policy
    from specpool.services.remote import DeploymentCaller, RemoteDrafter

    remote = RemoteDrafter("code", DeploymentCaller(None, "drafter 'code'"), None)  # no call is made
    assert isinstance(remote, PerRequestVersions) and isinstance(remote, Replayable)
    local = [NGramDrafter(), HFModelDrafter("noisy", *noisy_lm), LookupFirstDrafter("lookup:x", NGramDrafter("x"))]
    assert all(isinstance(d, Replayable) and not isinstance(d, PerRequestVersions) for d in local)
    assert isinstance(make_policy("ucb-replay", ["a", "b"]), ReplayPolicy)
    assert not isinstance(make_policy("metasd-ucb", ["a", "b"]), ReplayPolicy)
    chooser = BanditChooser(make_policy("metasd-ucb", ["a"]), InMemorySessionStore(), SessionKey("t", "s"))
    assert isinstance(chooser, ReplayingChooser) and not isinstance(FixedChooser("a"), ReplayingChooser)
    remote.begin_request("s", "acme")
    assert remote.version_of("s") == 0  # no round yet: the shipped weights until the server picks
    remote.end_request("s")


class Versioned(Recording):
    """A drafter with per-request weight versions (as a remote one): records the brackets."""

    def __init__(self, inner, version: int):
        super().__init__(inner)
        self.version = version
        self.requests: list[tuple[str, str]] = []
        self.open: set[str] = set()

    def begin_request(self, session_id, tenant):
        self.requests.append((session_id, tenant))
        self.open.add(session_id)

    def end_request(self, session_id):
        self.open.discard(session_id)

    def version_of(self, session_id):
        assert session_id in self.open  # asked only while its request runs
        return self.version


def test_per_request_versions_are_bracketed_and_stamp_the_feedback(target_lm):
    from specpool.learning.feedback import FeedbackEmitter, FeedbackRecord, InProcessFeedbackStream

    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    drafter = Versioned(NGramDrafter(), version=7)
    stream = InProcessFeedbackStream(100)
    core = Orchestrator(tokenizer, ModelInfo("tiny", (tokenizer.eos_token_id,), verifier.context_window,
                                             verifier.tokenizer_fingerprint),
                        ServedDrafters({"ngram": drafter}), verifier, InMemorySessionStore(),
                        OrchestratorSettings(k=4, max_new_tokens=24),
                        feedback=EmittedFeedback(FeedbackEmitter(stream), top_k=4))
    outcome = core.run(core.prepare(spec(session_id="v", tenant="acme", policy="fixed:ngram")))
    assert drafter.requests == [("acme/v", "acme")] and not drafter.open  # pinned under tenant/session
    records = [FeedbackRecord.decode(d.payload) for d in stream.read("learner", 100)]
    assert records and all(r.version == 7 for r in records)
    assert {(r.tenant, r.session) for r in records} == {("acme", "v")}  # records name the client's session
    assert len(records) <= outcome.stats.rounds
