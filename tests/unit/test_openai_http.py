"""The OpenAI-compatible HTTP app (specpool/services/openai_http.py) over a real Orchestrator on the tiny
models: raw HTTP through Starlette's TestClient, the official ``openai`` client over the same app, and a
client that disconnects mid-stream driven at the ASGI level."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from starlette.testclient import TestClient

from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.router.session_store import InMemorySessionStore
from specpool.services.auth import ApiKeys, KeyEntry, hash_key
from specpool.services.metrics import PrometheusMetrics
from specpool.services.openai_http import SESSION_HEADER, build_openai_app
from specpool.services.orchestrator import Orchestrator, OrchestratorSettings, ServedDrafters
from specpool.services.runner import RequestRunner
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier

PROMPT = "the cat sat on the mat and the dog ran to the house"
TOKENS = 20


class Faulty:
    """A test double for injected faults around a real drafter: slow rounds, or a failure after some."""

    def __init__(self, inner, name: str, delay_s: float = 0.0, fail_after: int | None = None):
        self.inner, self.name = inner, name
        self.tokenizer_fingerprint, self.cost = inner.tokenizer_fingerprint, inner.cost
        self.delay_s, self.fail_after, self.calls = delay_s, fail_after, 0

    def propose(self, session_id, context_ids, k, params):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("injected drafter failure")
        time.sleep(self.delay_s)
        return self.inner.propose(session_id, context_ids, k, params)

    def release(self, session_id):
        self.inner.release(session_id)


class Served:
    """A router's parts as ``specpool serve`` wires them (served pool, caches kept per session,
    Prometheus metrics), over the embedded engine's target and tokenizer."""

    def __init__(self, engine, noisy_lm, keys: ApiKeys):
        self.verifier = TargetVerifier(engine.model, engine.tokenizer)
        self.faulty = Faulty(NGramDrafter(), "broken")  # armed by the test that needs it
        drafters = {"ngram": NGramDrafter(), "noisy": HFModelDrafter("noisy", *noisy_lm), "broken": self.faulty,
                    "slow": Faulty(NGramDrafter(), "slow", delay_s=0.02)}
        self.metrics = PrometheusMetrics()
        self.core = Orchestrator(engine.tokenizer, engine.orchestrator.info, ServedDrafters(drafters), self.verifier,
                                 InMemorySessionStore(), OrchestratorSettings(policy="metasd-ucb", k=4), self.metrics)
        self.healthy = True
        self.runner = RequestRunner(self.core, ThreadPoolExecutor(4))
        self.app = build_openai_app(self.runner, keys, self.health)
        self.model = engine.orchestrator.info.model

    async def health(self) -> bool:
        return self.healthy

    def requests(self, status: str, tenant: str | None = None) -> float:
        """specpool_requests_total for endpoint http and ``status`` (all tenants unless named)."""
        total = 0.0
        for metric in self.metrics.registry.collect():
            for sample in metric.samples:
                labels = sample.labels
                if (sample.name == "specpool_requests_total" and labels.get("endpoint") == "http"
                        and labels.get("status") == status and tenant in (None, labels.get("tenant"))):
                    total += sample.value
        return total


@pytest.fixture(scope="module")
def served(engine, noisy_lm):
    return Served(engine, noisy_lm, ApiKeys.open())


@pytest.fixture(scope="module")
def http(served):
    with TestClient(served.app) as client:
        yield client


def reference(engine, kind: str, tokens: int = TOKENS):
    """(text, prompt tokens, completion tokens, finish reason) of the embedded engine, target only, greedy."""
    core = engine.orchestrator
    ids = core.encode("chat", messages=[("user", PROMPT)]) if kind == "chat" else engine.encode_prompt(PROMPT, raw=True)
    result = engine.generate(ids, SamplingParams(max_new_tokens=tokens, stop_token_ids=engine.stop_token_ids()))
    return core.decode(result.token_ids), len(ids), len(result.token_ids), result.finish_reason


def body(served, kind: str, **kw) -> dict:
    base = {"model": served.model, "temperature": 0, "max_tokens": TOKENS}
    base.update({"messages": [{"role": "user", "content": PROMPT}]} if kind == "chat" else {"prompt": PROMPT})
    base.update(kw)
    return base


def path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def sse_data(text: str) -> list[str]:
    """The data of each server-sent event, in order (comments such as pings skipped)."""
    assert "\r" not in text
    events = [e for e in text.split("\n\n") if e.strip()]
    out = []
    for event in events:
        lines = [line for line in event.split("\n") if not line.startswith(":")]
        if lines:
            assert len(lines) == 1 and lines[0].startswith("data: "), event
            out.append(lines[0].removeprefix("data: "))
    return out


def assert_error(resp, status: int, param=..., code=None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not ...:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# -- greedy text, usage, the specpool object -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("extra", [dict(policy="metasd-ucb"), dict(drafter="noisy", k=3), dict()])
def test_greedy_text_is_the_engines(served, http, engine, kind, extra):
    text, prompt_tokens, new_tokens, finish = reference(engine, kind)
    resp = http.post(path(kind), json=body(served, kind, **extra))
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choice = out["choices"][0]
    assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == text
    assert choice["finish_reason"] == finish
    assert out["model"] == served.model and out["object"] == ("chat.completion" if kind == "chat" else "text_completion")
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
                            "total_tokens": prompt_tokens + new_tokens}
    figures = out["specpool"]
    assert figures["session_id"] == resp.headers[SESSION_HEADER]
    assert figures["policy"] == ("fixed:noisy" if "drafter" in extra else "metasd-ucb")
    assert sum(figures["rounds_by_drafter"].values()) == figures["rounds"] > 0
    assert figures["tokens_per_round"] == pytest.approx(new_tokens / figures["rounds"], abs=1e-4)
    if "drafter" in extra:
        assert set(figures["rounds_by_drafter"]) <= {"noisy", "none"}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_chunks_concatenate_to_the_engines_text(served, http, engine, kind, include_usage):
    text, prompt_tokens, new_tokens, finish = reference(engine, kind)
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    resp = http.post(path(kind), json=body(served, kind, stream=True, drafter="ngram", **extra))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    data = sse_data(resp.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    assert all(c["object"] == obj and c["model"] == served.model for c in chunks)
    with_choices = [c for c in chunks if c["choices"]]
    if kind == "chat":
        assert with_choices[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        pieces = [c["choices"][0]["delta"].get("content", "") for c in with_choices]
    else:
        pieces = [c["choices"][0]["text"] for c in with_choices]
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) > 1  # streamed, not one piece at the end
    last = with_choices[-1]
    assert last["choices"][0]["finish_reason"] == finish
    assert all(c["choices"][0]["finish_reason"] is None for c in with_choices[:-1])
    assert last["specpool"]["session_id"] == resp.headers[SESSION_HEADER]
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1] is not last
        assert chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
                                       "total_tokens": prompt_tokens + new_tokens}
        assert chunks[-1]["specpool"]["rounds"] == last["specpool"]["rounds"] > 0
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert chunks[-1] is last and all("usage" not in c for c in chunks)


def test_stop_string_ends_the_text(served, http, engine):
    text, *_ = reference(engine, "completion")
    words = text.split()
    stop = words[len(words) // 2]
    out = http.post("/v1/completions", json=body(served, "completion", stop=[stop])).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert stop in out["choices"][0]["text"] and text.startswith(out["choices"][0]["text"])


def test_sampling_without_seed_differs_and_with_seed_repeats(served, http):
    def sample(**kw):
        return http.post("/v1/completions", json=body(served, "completion", temperature=1.5, max_tokens=16,
                                                      drafter="ngram", **kw)).json()["choices"][0]["text"]

    assert sample(seed=7) == sample(seed=7)
    assert len({sample() for _ in range(4)}) > 1


# -- the official client ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_openai_client_chat_and_completions(served, client, engine):
    text, prompt_tokens, new_tokens, _ = reference(engine, "chat")
    chat = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0, max_completion_tokens=TOKENS, extra_body={"drafter": "noisy"})
    assert chat.choices[0].message.content == text and chat.choices[0].message.role == "assistant"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (prompt_tokens, new_tokens)
    assert chat.model_extra["specpool"]["policy"] == "fixed:noisy"

    stream = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": PROMPT}],
                                            temperature=0, max_tokens=TOKENS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == new_tokens

    text, prompt_tokens, new_tokens, _ = reference(engine, "completion")
    done = client.completions.create(model=served.model, prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    assert done.choices[0].text == text and done.usage.total_tokens == prompt_tokens + new_tokens
    streamed = client.completions.create(model=served.model, prompt=PROMPT, temperature=0, max_tokens=TOKENS, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_openai_client_sees_errors(served, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": PROMPT}], n=2)
    assert info.value.param == "n" and info.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="gpt-4o", prompt=PROMPT)
    assert info.value.code == "model_not_found"
    models = client.models.list()
    assert [m.id for m in models.data] == [served.model] and models.data[0].owned_by == "specpool"
    assert models.data[0].model_extra["specpool"] == {"drafters": ["ngram", "noisy", "broken", "slow"],
                                                      "default_policy": "metasd-ucb"}
    assert client.models.retrieve(served.model).id == served.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


# -- refusals: status, shape, never reaching the target -----------------------------------------------------
@pytest.mark.parametrize("kind, extra, param, code", [
    ("chat", dict(n=2), "n", "unsupported_parameter"),
    ("chat", dict(logprobs=True, top_logprobs=2), "logprobs", "unsupported_parameter"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools", None),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]", "unsupported_parameter"),
    ("chat", dict(model="gpt-4o"), "model", "model_not_found"),
    ("chat", dict(response_format={"type": "json_object"}), "response_format", None),
    ("chat", dict(max_tokens="many"), "max_tokens", "invalid_type"),
    ("chat", dict(wat=1), "wat", "unknown_parameter"),
    ("completion", dict(prompt=[1, 2, 3]), "prompt", None),
    ("completion", dict(echo=True), "echo", None),
    ("completion", dict(best_of=3), "best_of", None),
    ("completion", dict(logprobs=1), "logprobs", None),
])
def test_unsupported_parameters_are_400_and_reach_nothing(served, http, kind, extra, param, code):
    before, cached = served.requests("INVALID_ARGUMENT", "-"), set(served.verifier.caches.sessions())
    calls = served.faulty.calls
    assert_error(http.post(path(kind), json=body(served, kind, drafter="broken", **extra)), 400, param, code)
    assert served.requests("INVALID_ARGUMENT", "-") == before + 1  # counted as refused, before any tenant
    assert set(served.verifier.caches.sessions()) == cached and served.faulty.calls == calls


@pytest.mark.parametrize("raw, message", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_malformed_bodies(served, http, raw, message):
    for kind in ("chat", "completion"):
        error = assert_error(http.post(path(kind), content=raw, headers={"content-type": "application/json"}), 400)
        assert message in error["message"]


def test_errors_found_while_preparing_keep_their_status(served, http):
    error = assert_error(http.post("/v1/chat/completions", json=body(served, "chat", drafter="nope")), 400, code="not_found")
    assert "nope" in error["message"]
    assert_error(http.post("/v1/chat/completions", json=body(served, "chat", policy="no-such-policy", stream=True)),
                 400, code="not_found")
    error = assert_error(http.post("/v1/completions", json=body(served, "completion", max_tokens=100_000)), 400,
                         code="invalid_value")
    assert "context window" in error["message"]
    assert_error(http.post("/v1/completions", json=body(served, "completion", session_id="bad id!")), 400)


def test_an_error_after_streaming_started_is_the_last_event(served, http):
    failures = served.requests("INTERNAL")
    served.faulty.fail_after = 2  # two rounds, then the drafter fails
    try:
        served.faulty.calls = 0
        resp = http.post("/v1/completions", json=body(served, "completion", stream=True, drafter="broken", max_tokens=40))
        assert resp.status_code == 200
        data = sse_data(resp.text)
        assert data[-1] != "[DONE]"
        assert json.loads(data[-1])["error"]["type"] == "server_error"
        assert "Traceback" not in data[-1]
        assert any(json.loads(d).get("choices") for d in data[:-1])  # text came before the failure
        # Unary: the status says it.
        served.faulty.calls = 0
        assert_error(http.post("/v1/completions", json=body(served, "completion", drafter="broken", max_tokens=40)), 500)
    finally:
        served.faulty.fail_after = None
    assert served.requests("INTERNAL") == failures + 2


def test_unknown_routes_and_methods(http):
    assert_error(http.get("/v1/nothing"), 404, code="not_found")
    assert_error(http.get("/v1/chat/completions"), 405)


def test_health(served, http):
    assert http.get("/health").json() == {"status": "ok"}
    served.healthy = False
    try:
        resp = http.get("/health")
        assert resp.status_code == 503 and resp.json()["status"] == "unavailable"
    finally:
        served.healthy = True


# -- keys and tenants ---------------------------------------------------------------------------------------
def test_api_keys(engine, noisy_lm):
    acme, ops = "sp-acme-key", "sp-ops-key"
    keys = ApiKeys([KeyEntry("acme", hash_key(acme)), KeyEntry("ops", hash_key(ops), role="admin")])
    served = Served(engine, noisy_lm, keys)
    with TestClient(served.app) as http:
        request = body(served, "completion", drafter="ngram", max_tokens=4)

        def post(key: str | None, **kw):
            headers = {"authorization": key} if key is not None else {}
            return http.post("/v1/completions", json={**request, **kw}, headers=headers)

        assert_error(post(None), 401, code="invalid_api_key")
        assert post(None).headers["www-authenticate"] == "Bearer"
        assert_error(post("Bearer sp-wrong"), 401, code="invalid_api_key")
        assert_error(post(f"Basic {acme}"), 401, code="invalid_api_key")
        assert_error(post(None, n=5), 401)  # the key first: no hints about the body to strangers
        assert_error(post(f"Bearer {acme}", tenant="other"), 403, code="permission_denied")
        assert_error(post(f"Bearer {acme}", n=5), 400, "n")
        assert post(f"Bearer {acme}").status_code == 200
        assert post(f"bearer {acme}", tenant="acme").status_code == 200
        assert post(f"Bearer {ops}", tenant="acme").status_code == 200  # an admin may act for any tenant
        assert served.requests("UNAUTHENTICATED", "-") == 5  # post(None) twice
        assert served.requests("PERMISSION_DENIED", "-") == 1
        assert served.requests("INVALID_ARGUMENT", "-") == 1
        assert served.requests("OK", "acme") == 3 and served.requests("OK") == 3

        assert_error(http.get("/v1/models"), 401)
        assert http.get("/v1/models", headers={"authorization": f"Bearer {acme}"}).json()["data"][0]["id"] == served.model
        assert http.get("/health").status_code == 200  # probes carry no key


def post_scope(payload: bytes, path: str = "/v1/completions") -> dict:
    """An ASGI HTTP scope of a JSON POST, as a server hands it to the app."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode())]}


# -- a client that goes away --------------------------------------------------------------------------------
def test_disconnect_mid_stream_stops_the_loop_and_frees_the_caches(served, http):
    # A finished request keeps its session's caches for the next turn (served mode): the baseline.
    done = http.post("/v1/completions", json=body(served, "completion", drafter="slow", max_tokens=4))
    assert f"default/{done.headers[SESSION_HEADER]}" in served.verifier.caches.sessions()  # tenant/session

    cancelled = served.requests("CANCELLED", "default")
    payload = json.dumps(body(served, "completion", drafter="slow", stream=True, max_tokens=200,
                              session_id="leaving")).encode()
    sent: list[dict] = []

    async def drive() -> float:
        gone = asyncio.Event()
        asked = False

        async def receive():
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if sum(b'"text"' in m.get("body", b"") for m in sent) >= 3:
                gone.set()  # three chunks read, then the client closes the connection

        start = time.perf_counter()
        await asyncio.wait_for(served.app(post_scope(payload), receive, send), timeout=60)
        return time.perf_counter() - start

    elapsed = asyncio.run(drive())
    body_bytes = b"".join(m.get("body", b"") for m in sent)
    assert sent[0]["status"] == 200 and b"[DONE]" not in body_bytes
    assert elapsed < 200 * 0.02  # stopped long before its 200 rounds of >= 20 ms
    # When the app returns, the loop has stopped and the session's caches are gone everywhere.
    assert served.core.active_sessions() == []
    assert "default/leaving" not in served.verifier.caches.sessions()
    assert served.requests("CANCELLED", "default") == cancelled + 1
    # The session is free again: a new request on it runs.
    again = http.post("/v1/completions", json=body(served, "completion", drafter="slow", max_tokens=4,
                                                   session_id="leaving"))
    assert again.status_code == 200


def test_a_second_request_on_a_busy_session_is_409(served, http):
    results: dict = {}

    def long_request():
        results["first"] = http.post("/v1/completions", json=body(served, "completion", drafter="slow", stream=True,
                                                                  max_tokens=80, session_id="busy"))

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while ("default", "busy") not in served.core.active_sessions() and time.monotonic() < deadline:
        time.sleep(0.01)
    second = http.post("/v1/completions", json=body(served, "completion", drafter="ngram", session_id="busy"))
    thread.join(60)
    assert_error(second, 409, code="session_busy")
    assert sse_data(results["first"].text)[-1] == "[DONE]"


def test_an_oversized_body_is_refused_unread(served, http):
    from specpool.services.openai_http import MAX_BODY_BYTES

    huge = json.dumps(body(served, "completion", prompt="the " * (MAX_BODY_BYTES // 4 + 1))).encode()
    error = assert_error(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}), 413)
    assert str(MAX_BODY_BYTES) in error["message"]


def test_a_cancelled_unary_request_stops_the_loop(served):
    """Serve cancels the handler of a client that went away: the loop stops and the caches are freed."""
    cancelled = served.requests("CANCELLED", "default")
    payload = json.dumps(body(served, "chat", drafter="slow", max_tokens=200, session_id="unary-gone")).encode()

    async def drive() -> None:
        async def receive():
            return {"type": "http.request", "body": payload, "more_body": False}

        async def send(message):
            raise AssertionError(f"nothing is sent to a cancelled request: {message}")

        task = asyncio.ensure_future(served.app(post_scope(payload, "/v1/chat/completions"), receive, send))
        deadline = time.monotonic() + 30
        while ("default", "unary-gone") not in served.core.active_sessions() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # a few rounds
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(drive())
    assert served.core.active_sessions() == []
    assert "default/unary-gone" not in served.verifier.caches.sessions()
    assert served.requests("CANCELLED", "default") == cancelled + 1


def test_quotas_answer_429_with_retry_after_and_400_for_what_never_fits(served):
    import uuid

    import redis

    from specpool.services.admission import Admission, parse_quotas

    ns = f"test-http-admission-{uuid.uuid4().hex[:8]}"
    quotas = parse_quotas({"default": {"tokens_per_minute": 300, "max_new_tokens": 100}}, "quotas.yaml")
    runner = RequestRunner(served.core, ThreadPoolExecutor(2), Admission(quotas, namespace=ns))
    try:
        with TestClient(build_openai_app(runner, ApiKeys.open(), served.health)) as client:
            assert_error(client.post("/v1/completions", json=body(served, "completions", max_tokens=101)), 400)
            hog = runner.admission.admit("default", 1, 100, prompt_tokens=190)  # the tenant's minute, taken elsewhere
            resp = client.post("/v1/completions", json=body(served, "completions", max_tokens=100))
            hog.release(0)  # given back: the next one passes
            assert_error(resp, 429, code="rate_limit_exceeded")
            assert int(resp.headers["retry-after"]) >= 1 and int(resp.headers["retry-after-ms"]) > 0
            assert "retry in" in resp.json()["error"]["message"]
            assert client.post("/v1/completions", json=body(served, "completions", max_tokens=100)).status_code == 200
    finally:
        client_ = redis.Redis()
        for key in client_.scan_iter(f"{ns}:*"):
            client_.delete(key)
