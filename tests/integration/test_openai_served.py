"""Integration: the OpenAI-compatible HTTP API of a real `specpool serve` (Ray Serve's HTTP proxy,
the router's ingress), beside its gRPC API, with API keys on. The real default target, the n-gram
drafter, Redis at 127.0.0.1:6379; the official `openai` client and raw HTTP (httpx); no mocks.

Greedy answers over HTTP (sync and streaming, chat and completions) must equal the gRPC API's and
the embedded engine's token for token; usage counts must be right; every unsupported parameter or
malformed body gets its status and OpenAI's error shape without reaching the target; a client that
disconnects mid-stream frees the session's caches; the metrics the Grafana dashboard queries are
all exported.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from specpool.core.errors import PermissionDenied, Unauthenticated
from specpool.services.auth import add_key
from specpool.services.client import SpecPoolClient

pytestmark = pytest.mark.integration

from redis_helpers import URL, connect_or_skip, delete_namespace
from serve_helpers import free_port as _free_port, wait_until as _wait, call as _call

POOL = ["ngram"]
MAX_NEW = 16
K = 5
CHAT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
RAW_PROMPT = "The three primary colors are"
DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "specpool-dashboard.json"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from ray import serve

    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    raw_redis = connect_or_skip(decode_responses=True)
    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = SimpleNamespace(acme=add_key(keys_file, "acme"), globex=add_key(keys_file, "globex"),
                           ops=add_key(keys_file, "ops", role="admin"))
    namespace = f"specpool-oai-{uuid.uuid4().hex[:8]}"
    port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    config = default_serve_config(POOL, URL, port, http_port=http_port, k=K)
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"].update(redis_namespace=namespace, api_keys_file=str(keys_file))
    local = start_local(plan_from_config(config, "the test config"), metrics_port=metrics_port,
                        progress=lambda m: print(f"[served] {m}", flush=True))
    handles = SimpleNamespace(router=serve.get_deployment_handle("Router", app_name="router"),
                              target=serve.get_deployment_handle("Target", app_name="target"))
    yield SimpleNamespace(local=local, address=local.address, base_url=local.http_url, keys=keys, handles=handles,
                          metrics_url=local.metrics_url)
    local.shutdown()
    delete_namespace(raw_redis, namespace)
    raw_redis.close()


@pytest.fixture(scope="module")
def model(served) -> str:
    listing = httpx.get(f"{served.base_url}/models", headers={"authorization": f"Bearer {served.keys.acme}"}, timeout=30)
    assert listing.status_code == 200, listing.text
    return listing.json()["data"][0]["id"]


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served.base_url, api_key=served.keys.acme, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(served):
    with SpecPoolClient(served.address, api_key=served.keys.acme) as client:
        yield client


@pytest.fixture(scope="module")
def engine():
    from specpool.services.config import settings_from_env
    from specpool.services.engine import EmbeddedEngine

    return EmbeddedEngine.default(settings_from_env().home)


@pytest.fixture(scope="module")
def reference(engine):
    """The embedded engine's greedy answer: (token ids, text, prompt tokens)."""
    from specpool.target.sampling import SamplingParams

    def answer(prompt: str, raw: bool):
        ids = engine.encode_prompt(prompt, raw=raw)
        params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=engine.stop_token_ids())
        result = engine.generate(ids, params, k=K, drafter="ngram", session_id=uuid.uuid4().hex)
        return SimpleNamespace(ids=result.token_ids, text=engine.orchestrator.decode(result.token_ids), prompt_tokens=len(ids))

    return {"chat": answer(CHAT_PROMPT, raw=False), "raw": answer(RAW_PROMPT, raw=True)}


def _verify_batches(served) -> int:
    return sum(_call(served.handles.target, "Stats")["batch_sizes"].values())


# -- the same answer everywhere ------------------------------------------------------------------------
def test_chat_sync_and_stream_equal_grpc_and_embedded(served, oai, grpc_client, model, reference):
    ref = reference["chat"]
    over_grpc = grpc_client.generate(CHAT_PROMPT, max_new_tokens=MAX_NEW)
    assert over_grpc.token_ids == ref.ids and over_grpc.text == ref.text

    sync = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                       max_tokens=MAX_NEW, temperature=0)
    assert sync.object == "chat.completion" and sync.choices[0].message.role == "assistant"
    assert sync.choices[0].message.content == ref.text
    assert sync.choices[0].finish_reason in ("stop", "length")
    assert (sync.usage.prompt_tokens, sync.usage.completion_tokens) == (ref.prompt_tokens, len(ref.ids))
    assert sync.usage.total_tokens == ref.prompt_tokens + len(ref.ids)
    extra = sync.model_extra["specpool"]
    assert extra["rounds"] >= 1 and sum(extra["rounds_by_drafter"].values()) == extra["rounds"]

    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                         max_tokens=MAX_NEW, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [sync.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.ids)


def test_completions_sync_and_stream_equal_grpc_and_embedded(served, oai, grpc_client, model, reference):
    ref = reference["raw"]
    over_grpc = grpc_client.generate(RAW_PROMPT, raw=True, max_new_tokens=MAX_NEW)
    assert over_grpc.token_ids == ref.ids
    sync = oai.completions.create(model=model, prompt=RAW_PROMPT, max_tokens=MAX_NEW, temperature=0)
    assert sync.object == "text_completion" and sync.choices[0].text == ref.text == over_grpc.text
    assert (sync.usage.prompt_tokens, sync.usage.completion_tokens) == (ref.prompt_tokens, len(ref.ids))
    stream = oai.completions.create(model=model, prompt=RAW_PROMPT, max_tokens=MAX_NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text


def test_raw_http_sse_and_extra_fields(served, model, reference):
    ref = reference["chat"]
    session = f"raw-{uuid.uuid4().hex[:8]}"
    body = {"model": model, "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": MAX_NEW,
            "temperature": 0, "stream": True, "policy": "fixed:ngram", "k": 3, "session_id": session}
    headers = {"authorization": f"Bearer {served.keys.acme}"}
    with httpx.stream("POST", f"{served.base_url}/chat/completions", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.headers.get("x-specpool-session-id") == session
        lines = [line for line in response.iter_lines() if line.strip()]
    assert lines[-1] == "data: [DONE]" and all(line.startswith(("data: ", ":")) for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1] if line.startswith("data: ")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == ref.text
    figures = [e["specpool"] for e in events if e.get("specpool")]
    assert figures and figures[-1]["session_id"] == session and set(figures[-1]["rounds_by_drafter"]) == {"ngram"}


def test_models_and_health(served, model):
    assert model == "smollm2-135m-instruct"
    listing = httpx.get(f"{served.base_url}/models", headers={"authorization": f"Bearer {served.keys.acme}"}).json()
    assert listing["object"] == "list" and listing["data"][0]["owned_by"] == "specpool"
    assert "ngram" in json.dumps(listing["data"][0])  # the pool rides along as metadata
    health = httpx.get(served.base_url.removesuffix("/v1") + "/health", timeout=30)
    assert health.status_code == 200


# -- keys and tenants: the same for both APIs ------------------------------------------------------------
def test_keys_decide_the_tenant_on_both_apis(served, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    url = f"{served.base_url}/chat/completions"
    for headers, status, code in (({}, 401, "invalid_api_key"), ({"authorization": "Bearer sp-wrong"}, 401, "invalid_api_key"),
                                  ({"authorization": "Basic abc"}, 401, "invalid_api_key")):
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert response.json()["error"]["code"] == code
    other = httpx.post(url, json={**body, "tenant": "globex"}, headers={"authorization": f"Bearer {served.keys.acme}"}, timeout=60)
    assert other.status_code == 403 and other.json()["error"]["type"] == "invalid_request_error"
    admin = httpx.post(url, json={**body, "tenant": "globex"}, headers={"authorization": f"Bearer {served.keys.ops}"}, timeout=120)
    assert admin.status_code == 200, admin.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.base_url, api_key="sp-wrong", max_retries=0).chat.completions.create(**body)

    with SpecPoolClient(served.address) as anonymous:
        with pytest.raises(Unauthenticated):
            anonymous.generate("hi", max_new_tokens=2)
    with SpecPoolClient(served.address, api_key=served.keys.acme) as acme:
        with pytest.raises(PermissionDenied):
            acme.generate("hi", max_new_tokens=2, tenant="globex")
        assert acme.generate("hi", max_new_tokens=2, tenant="acme").stats.new_tokens == 2


def test_a_sessions_state_lives_under_its_keys_tenant(served, model):
    import redis

    session = f"tenancy-{uuid.uuid4().hex[:8]}"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "session_id": session, "policy": "metasd-ucb"}
    response = httpx.post(f"{served.base_url}/chat/completions", json=body,
                          headers={"authorization": f"Bearer {served.keys.globex}"}, timeout=120)
    assert response.status_code == 200, response.text
    client = redis.Redis.from_url(URL, decode_responses=True)
    keys = [k for k in client.scan_iter(match=f"*:session:{session}", count=1000)]
    client.close()
    assert keys and all(":{globex}:" in k for k in keys), keys  # {tenant}: a Redis Cluster hash tag


# -- bad requests: a 4xx in OpenAI's shape, and the target never sees them -------------------------------
BAD_BODIES = [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ({"model": "gpt-4o"}, "model"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"frobnicate": 1}, None),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"k": 0}, "k"),
]


@pytest.mark.parametrize("change, param", BAD_BODIES, ids=[next(iter(c)) for c, _ in BAD_BODIES])
def test_unsupported_parameters_are_400s_that_never_reach_the_target(served, model, change, param):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
    before = _verify_batches(served)
    response = httpx.post(f"{served.base_url}/chat/completions", json=body,
                          headers={"authorization": f"Bearer {served.keys.acme}"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:  # the field, or a part of it (messages[0].content[0])
        assert error["param"] == param or error["param"].startswith(param + "["), error
    assert _verify_batches(served) == before


@pytest.mark.parametrize("content, kind", [(b"{not json", "application/json"), (b"[1, 2]", "application/json"),
                                           (b"", "application/json")])
def test_malformed_bodies_are_400s(served, content, kind):
    response = httpx.post(f"{served.base_url}/completions", content=content,
                          headers={"authorization": f"Bearer {served.keys.acme}", "content-type": kind}, timeout=60)
    assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_paths_and_methods(served):
    headers = {"authorization": f"Bearer {served.keys.acme}"}
    assert httpx.get(f"{served.base_url}/chat/completions", headers=headers, timeout=30).status_code in (404, 405)
    assert httpx.post(f"{served.base_url}/embeddings", json={}, headers=headers, timeout=30).status_code == 404


# -- a disconnect frees the session, as a gRPC cancel does ------------------------------------------------
def test_a_client_that_disconnects_mid_stream_frees_the_sessions_caches(served, model):
    session = f"gone-{uuid.uuid4().hex[:8]}"
    body = {"model": model, "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": 400,
            "temperature": 0, "stream": True, "session_id": session}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{served.base_url}/chat/completions", json=body,
                           headers={"authorization": f"Bearer {served.keys.acme}"}) as response:
            assert response.status_code == 200
            got = 0
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                if got >= 4:
                    break
            assert f"acme/{session}" in _call(served.handles.target, "Sessions")  # it really held a cache ...
        # ... until the connection closes here
    _wait(lambda: not _call(served.handles.router, "Active"), 20, "the router to stop the request")
    _wait(lambda: f"acme/{session}" not in _call(served.handles.target, "Sessions"), 20, "the session's caches to be released")
    batches = _verify_batches(served)
    time.sleep(1.0)
    assert _verify_batches(served) == batches  # nothing verifies for it any more


# -- metrics: what the dashboard queries is exported ----------------------------------------------------
def test_every_metric_the_dashboard_queries_is_exported(served, oai, grpc_client, model):
    from specpool.services.metrics import exported_metric_names

    copy_heavy = "one two three four five one two three four five one two three"  # the n-gram drafter drafts here
    oai.completions.create(model=model, prompt=copy_heavy, max_tokens=8, temperature=0)
    grpc_client.generate(copy_heavy, raw=True, max_new_tokens=8)
    dashboard = DASHBOARD.read_text() if DASHBOARD.exists() else ""
    queried = set(re.findall(r"ray_specpool_[a-z_]+", dashboard)) or exported_metric_names()
    # Counters a Ray agent exports only once something counted: white-box features (this pool has
    # no white-box arm), drafter failures (test_served_faults.py scrapes it after a kill) and
    # admission events (test_admission_served.py scrapes it after a refusal).
    wanted = queried - {"ray_specpool_feature_bytes_total", "ray_specpool_drafter_failures_total",
                        "ray_specpool_admission_events_total"}

    last = {}

    def scrape():
        text = urllib.request.urlopen(served.metrics_url, timeout=5).read().decode()
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("ray_specpool_")}
        endpoints = set(re.findall(r'ray_specpool_request_seconds_count\{[^}]*endpoint="(\w+)"', text))
        last.update(missing=sorted(wanted - names), endpoints=sorted(endpoints))
        return names if wanted <= names and {"grpc", "http"} <= endpoints else None

    try:
        names = _wait(scrape, 90, f"every dashboard metric at {served.metrics_url}", interval=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still missing {last}") from None
    assert names <= exported_metric_names(), names - exported_metric_names()  # and the names are the ones we declare
