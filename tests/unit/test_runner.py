"""The router's one async request path (specpool/services/runner.py) over a real Orchestrator on the
tiny models: events in order and adding up to the answer, request metrics by endpoint, and a
consumer that goes away (a gRPC cancel, an HTTP disconnect) stopping the loop and freeing caches."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from specpool.core.errors import InvalidArgument, Unauthenticated
from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.router.session_store import InMemorySessionStore
from specpool.services.api import GenerationSpec
from specpool.services.detokenize import Chunk
from specpool.services.metrics import PrometheusMetrics
from specpool.services.orchestrator import ModelInfo, Orchestrator, OrchestratorSettings, Outcome, Prepared, ServedDrafters
from specpool.services.runner import RequestRunner
from specpool.target.verifier import TargetVerifier

PROMPT = "the cat sat on the mat and the dog sat on the mat"


@pytest.fixture
def setup(target_lm, noisy_lm):
    model, tokenizer = target_lm
    verifier = TargetVerifier(model, tokenizer)
    drafters = {"ngram": NGramDrafter(), "noisy": HFModelDrafter("noisy", *noisy_lm)}
    info = ModelInfo("tiny", (tokenizer.eos_token_id,), verifier.context_window, verifier.tokenizer_fingerprint)
    metrics = PrometheusMetrics()
    core = Orchestrator(tokenizer, info, ServedDrafters(drafters), verifier, InMemorySessionStore(),
                        OrchestratorSettings(k=4, max_new_tokens=24, keep_caches=False), metrics)
    executor = ThreadPoolExecutor(4)
    yield RequestRunner(core, executor), verifier, metrics
    executor.shutdown(wait=True)


def spec(**kw) -> GenerationSpec:
    return GenerationSpec(**{"input_kind": "prompt", "text": PROMPT, "max_new_tokens": 20, "policy": "fixed:noisy", **kw})


async def collect(runner: RequestRunner, s: GenerationSpec, endpoint="http", tenant="acme") -> list:
    return [event async for event in runner.run(s, endpoint, tenant)]


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0


def test_events_come_in_order_and_add_up_to_the_answer(setup):
    runner, _, metrics = setup
    events = asyncio.run(collect(runner, spec(session_id="s1")))
    assert isinstance(events[0], Prepared) and events[0].endpoint == "http" and events[0].tenant == "acme"
    assert isinstance(events[-1], Outcome)
    chunks = events[1:-1]
    assert chunks and all(isinstance(c, Chunk) for c in chunks)
    outcome = events[-1]
    assert "".join(c.text for c in chunks) + outcome.tail_text == outcome.text
    assert [t for c in chunks for t in c.token_ids] == outcome.token_ids
    # the same tokens as the orchestrator alone (greedy)
    direct = runner.core.run(runner.core.prepare(spec(session_id="s2")))
    assert direct.token_ids == outcome.token_ids


def test_the_authenticated_tenant_replaces_the_one_the_request_names(setup):
    runner, *_ = setup
    events = asyncio.run(collect(runner, spec(session_id="t1", tenant="someone-else"), tenant="acme"))
    assert events[0].tenant == "acme"


def test_request_metrics_by_endpoint(setup):
    runner, _, metrics = setup
    asyncio.run(collect(runner, spec(session_id="m1"), endpoint="http"))
    asyncio.run(collect(runner, spec(session_id="m2"), endpoint="grpc"))
    for endpoint in ("http", "grpc"):
        assert sample(metrics, "specpool_requests_total", tenant="acme", endpoint=endpoint, status="OK") == 1
        assert sample(metrics, "specpool_requests_in_flight", endpoint=endpoint) == 0
        for name in ("time_to_first_token", "request", "queue", "inter_token"):
            assert sample(metrics, f"specpool_{name}_seconds_count", endpoint=endpoint) == 1, name
        ttft = sample(metrics, "specpool_time_to_first_token_seconds_sum", endpoint=endpoint)
        total = sample(metrics, "specpool_request_seconds_sum", endpoint=endpoint)
        queue = sample(metrics, "specpool_queue_seconds_sum", endpoint=endpoint)
        assert 0 <= queue <= ttft <= total
        assert sample(metrics, "specpool_rounds_total", tenant="acme", drafter="noisy", endpoint=endpoint) > 0


def test_in_flight_counts_a_running_request(setup):
    runner, _, metrics = setup

    async def main():
        seen = []
        async for event in runner.run(spec(session_id="f1"), "http", "acme"):
            seen.append(sample(metrics, "specpool_requests_in_flight", endpoint="http"))
        return seen

    assert set(asyncio.run(main())) == {1}
    assert sample(metrics, "specpool_requests_in_flight", endpoint="http") == 0


def test_a_consumer_that_stops_early_stops_the_loop_and_frees_the_caches(setup):
    runner, verifier, metrics = setup

    async def main():
        async with contextlib.aclosing(runner.run(spec(session_id="gone", max_new_tokens=200), "http", "acme")) as events:
            async for event in events:
                if isinstance(event, Chunk):
                    return event  # leaves the loop: aclosing closes the generator, as a disconnect does

    first = asyncio.run(main())
    assert first.token_ids
    assert "acme/gone" not in verifier.caches.sessions()
    assert runner.core.active_sessions() == []
    assert sample(metrics, "specpool_requests_total", tenant="acme", endpoint="http", status="CANCELLED") == 1
    assert sample(metrics, "specpool_requests_in_flight", endpoint="http") == 0


def test_a_cancelled_unary_call_stops_the_loop_and_frees_the_caches(setup):
    runner, verifier, metrics = setup

    async def main():
        task = asyncio.create_task(runner.generate(spec(session_id="cut", max_new_tokens=200), "grpc", "acme"))
        while "acme/cut" not in verifier.caches.sessions():  # the first round ran
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert "acme/cut" not in verifier.caches.sessions()
    assert runner.core.active_sessions() == []
    assert sample(metrics, "specpool_requests_total", tenant="acme", endpoint="grpc", status="CANCELLED") == 1


def test_refusals_are_counted_by_status(setup):
    runner, _, metrics = setup
    with pytest.raises(InvalidArgument, match="does not fit"):
        asyncio.run(collect(runner, spec(session_id="big", max_new_tokens=10**6)))
    assert sample(metrics, "specpool_requests_total", tenant="acme", endpoint="http", status="INVALID_ARGUMENT") == 1
    runner.refused("grpc", Unauthenticated("unknown API key"))
    assert sample(metrics, "specpool_requests_total", tenant="-", endpoint="grpc", status="UNAUTHENTICATED") == 1
    assert sample(metrics, "specpool_requests_in_flight", endpoint="http") == 0
    assert sample(metrics, "specpool_request_seconds_count", endpoint="http") == 0  # latencies: answered requests only



# -- admission (specpool/services/admission.py) -----------------------------------------------------
@pytest.fixture
def quota_namespace():
    import uuid

    import redis

    client = redis.Redis()
    ns = f"test-runner-admission-{uuid.uuid4().hex[:8]}"
    yield ns
    for key in client.scan_iter(f"{ns}:*"):
        client.delete(key)


def admitted_runner(runner: RequestRunner, namespace: str, **limits) -> RequestRunner:
    from specpool.services.admission import Admission, parse_quotas

    return RequestRunner(runner.core, runner.executor, Admission(parse_quotas({"default": limits}, "q"), namespace=namespace))


def test_quotas_refuse_before_tokenizing_and_every_way_out_frees_the_slot(setup, quota_namespace):
    from specpool.services.admission import QuotaExceeded

    runner, _, metrics = setup
    runner = admitted_runner(runner, quota_namespace, max_concurrent=1, tokens_per_minute=10_000, max_prompt_bytes=100,
                             max_new_tokens=16)
    with pytest.raises(InvalidArgument, match="may send at most 100"):
        asyncio.run(collect(runner, spec(text="the " * 30)))
    with pytest.raises(InvalidArgument, match="may ask for at most 16"):
        asyncio.run(collect(runner, spec(max_new_tokens=17)))
    outcome = asyncio.run(collect(runner, spec(max_new_tokens=0)))[-1]  # the server default (24), capped at 16
    assert outcome.stats.new_tokens <= 16

    async def hold_one_and_try_another():
        events = runner.run(spec(session_id="holder", max_new_tokens=8), "http", "acme")
        await anext(events)  # prepared: holds acme's slot
        with pytest.raises(QuotaExceeded) as info:
            await collect(runner, spec(session_id="other", max_new_tokens=8))
        await events.aclose()  # a consumer that stops early frees the slot
        return info.value

    refused = asyncio.run(hold_one_and_try_another())
    assert refused.retry_after_s > 0
    asyncio.run(collect(runner, spec(session_id="after", max_new_tokens=8), tenant="acme"))  # admitted again
    assert runner.admission.stats()["running"] == 0
    assert sample(metrics, "specpool_requests_total", tenant="acme", endpoint="http", status="RESOURCE_EXHAUSTED") == 1


def test_a_finished_request_gives_back_the_tokens_it_did_not_use(setup, quota_namespace):
    runner, _, _ = setup
    runner = admitted_runner(runner, quota_namespace, tokens_per_minute=200)
    async def first_chunk_only():
        async with contextlib.aclosing(runner.run(spec(max_new_tokens=120), "http", "acme")) as events:
            async for event in events:
                if isinstance(event, Chunk):
                    return event

    for _ in range(5):  # each reserves prompt + 120 and stops after its first chunk: without refunds the second is refused
        assert asyncio.run(first_chunk_only()) is not None
    assert runner.admission.stats()["refused"] == {}


def test_a_caller_that_leaves_while_its_request_is_admitted_leaves_no_slot_behind(setup, quota_namespace, monkeypatch):
    import threading
    import time

    runner, _, _ = setup
    runner = admitted_runner(runner, quota_namespace, max_concurrent=1)
    entered, go = threading.Event(), threading.Event()
    prepare = runner.core.prepare

    def slow_prepare(s):  # an injected delay: the caller goes away while this thread holds the ticket
        entered.set()
        go.wait(10)
        return prepare(s)

    monkeypatch.setattr(runner.core, "prepare", slow_prepare)

    async def leave_early():
        task = asyncio.create_task(collect(runner, spec(max_new_tokens=4)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    go.set()
    deadline = time.monotonic() + 5
    while runner.admission.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert runner.admission.stats()["running"] == 0
    monkeypatch.setattr(runner.core, "prepare", prepare)
    asyncio.run(collect(runner, spec(max_new_tokens=4)))  # the tenant's one slot is free


def test_tenant_labels_are_bounded():
    from specpool.services.metrics import TenantLabels

    keyed = TenantLabels({"acme", "globex"})
    assert [keyed(t) for t in ("acme", "globex", "default", "-", "mallory", "x1")] == \
        ["acme", "globex", "default", "-", "other", "other"]
    open_ = TenantLabels(max_tenants=3)
    assert [open_(f"t{i}") for i in range(5)] == ["t0", "t1", "t2", "other", "other"]
    assert open_("t1") == "t1"  # a name once admitted keeps its series

    metrics = PrometheusMetrics(tenant_labels=TenantLabels({"acme"}))
    for tenant in ("acme", "spam1", "spam2", "spam3"):
        metrics.request(tenant, "OK", "grpc")
    assert sample(metrics, "specpool_requests_total", tenant="acme", endpoint="grpc", status="OK") == 1
    assert sample(metrics, "specpool_requests_total", tenant="other", endpoint="grpc", status="OK") == 3
    labels = {s.labels["tenant"] for m in metrics.registry.collect() for s in m.samples if "tenant" in s.labels}
    assert labels == {"acme", "other"}
