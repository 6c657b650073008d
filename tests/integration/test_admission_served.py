"""Integration: quotas on a real `specpool serve` (Ray Serve, the real default target, the n-gram
drafter, Redis at 127.0.0.1:6379, API keys on), over gRPC and HTTP. A tenant at its concurrency
limit is refused at once with RESOURCE_EXHAUSTED / 429 and a retry hint (gRPC trailing metadata
``retry-after``, HTTP ``Retry-After``) while another tenant is served; a prompt over its byte limit
is refused before it reaches the target; the slot comes back when the holder cancels."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import grpc
import httpx
import pytest

from redis_helpers import URL, connect_or_skip, delete_namespace
from serve_helpers import free_port as _free_port
from specpool.services.api import request_to_proto
from specpool.services.auth import add_key
from specpool.v1 import specpool_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    raw_redis = connect_or_skip(decode_responses=True)
    folder = tmp_path_factory.mktemp("admission")
    keys_file, quotas_file = folder / "keys.yaml", folder / "quotas.yaml"
    keys = SimpleNamespace(acme=add_key(keys_file, "acme"), globex=add_key(keys_file, "globex"))
    quotas_file.write_text("default: {max_concurrent: 4, max_prompt_bytes: 2000, max_new_tokens: 256}\n"
                           "tenants: {acme: {max_concurrent: 1}}\n")
    namespace = f"specpool-adm-{uuid.uuid4().hex[:8]}"
    config = default_serve_config(["ngram"], URL, _free_port(), http_port=_free_port(), k=5)
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"].update(redis_namespace=namespace, api_keys_file=str(keys_file), quotas_file=str(quotas_file))
    local = start_local(plan_from_config(config, "the test config"), metrics_port=_free_port(),
                        progress=lambda m: print(f"[served] {m}", flush=True))
    channel = grpc.insecure_channel(local.address)
    listing = httpx.get(f"{local.http_url}/models", headers={"authorization": f"Bearer {keys.acme}"}, timeout=30)
    yield SimpleNamespace(stub=specpool_pb2_grpc.SpecPoolStub(channel), base_url=local.http_url, keys=keys,
                          model=listing.json()["data"][0]["id"], metrics_url=local.metrics_url)
    channel.close()
    local.shutdown()
    delete_namespace(raw_redis, namespace)
    raw_redis.close()


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _http(served, key: str, prompt: str = "hi", max_tokens: int = 2) -> httpx.Response:
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{served.base_url}/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)


def test_a_tenant_at_its_limit_is_refused_at_once_with_a_retry_hint_while_another_is_served(served):
    holder = served.stub.GenerateStream(request_to_proto("Count from one to one hundred:", max_new_tokens=256),
                                        metadata=_auth(served.keys.acme), timeout=300)
    next(holder)  # running: acme's one slot is taken
    started = time.monotonic()
    refused = _http(served, served.keys.acme)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) > 0
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and "max_concurrent" in refused.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Generate(request_to_proto("hi", max_new_tokens=2), metadata=_auth(served.keys.acme), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in" in info.value.details()
    assert float(dict(info.value.trailing_metadata())["retry-after"]) >= 1
    assert time.monotonic() - started < 10  # refusals answer at once, they never wait for the slot
    assert _http(served, served.keys.globex).status_code == 200  # another tenant is served meanwhile
    holder.cancel()
    deadline = time.monotonic() + 30  # the cancelled request frees its slot as it stops
    while (response := _http(served, served.keys.acme)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert response.status_code == 200, response.text


def test_a_prompt_over_its_byte_limit_and_too_many_new_tokens_are_400s_on_both_apis(served):
    big = _http(served, served.keys.globex, prompt="é" * 1001)  # 2002 bytes
    assert big.status_code == 400 and "max_prompt_bytes" in big.json()["error"]["message"]
    assert _http(served, served.keys.globex, max_tokens=257).status_code == 400
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Generate(request_to_proto("x" * 2001, max_new_tokens=2), metadata=_auth(served.keys.globex), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2001 bytes" in info.value.details()


def test_refusals_are_counted_by_tenant_and_reason_in_the_exported_metrics(served):
    """specpool_admission_events reaches Ray's metrics agent (the dashboard's "Admission" panel):
    after the refusals above, acme's refused_concurrency and globex's refused_size are scraped."""
    import re
    import urllib.request

    from serve_helpers import wait_until

    def counted():
        text = urllib.request.urlopen(served.metrics_url, timeout=5).read().decode()
        found = set(re.findall(r'ray_specpool_admission_events_total\{[^}]*event="(\w+)"[^}]*tenant="(\w+)"', text))
        found |= {(e, t) for t, e in re.findall(r'ray_specpool_admission_events_total\{[^}]*tenant="(\w+)"[^}]*event="(\w+)"', text)}
        return found if {("refused_concurrency", "acme"), ("refused_size", "globex")} <= found else None

    wait_until(counted, 90, "acme's refused_concurrency and globex's refused_size in the scrape", interval=2)
