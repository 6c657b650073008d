"""Admission control and quotas (specpool/services/admission.py) against a real Redis on
127.0.0.1:6379, each test in its own key namespace (deleted after)."""

from __future__ import annotations

import logging
import pickle
import random
import threading
import time
import uuid

import pytest

from specpool.core.errors import InvalidArgument, NotFound, ResourceExhausted
from specpool.services.admission import (Admission, Quota, QuotaExceeded, Quotas, load_quotas, parse_quotas, prompt_bytes,
                                         retry_headers, retry_metadata)

redis = pytest.importorskip("redis")
URL = "redis://127.0.0.1:6379/0"
DOWN_URL = "redis://127.0.0.1:1/0"  # nothing listens there: a real connection failure


@pytest.fixture
def namespace():
    client = redis.Redis.from_url(URL)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("needs Redis on 127.0.0.1:6379")
    ns = f"test-admission-{uuid.uuid4().hex[:12]}"
    yield ns
    for key in client.scan_iter(f"{ns}:*"):
        client.delete(key)
    client.close()


@pytest.fixture
def make(namespace):
    made: list[Admission] = []

    def make(quotas, **kw) -> Admission:
        if isinstance(quotas, dict):
            quotas = parse_quotas(quotas, "quotas.yaml")
        kw.setdefault("namespace", namespace)
        made.append(Admission(quotas, kw.pop("url", URL), **kw))
        return made[-1]

    yield make
    for a in made:
        a.close()


def refused(fn) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as info:
        fn()
    exc = info.value
    assert isinstance(exc, ResourceExhausted) and exc.code == "RESOURCE_EXHAUSTED"
    assert exc.retry_after_s > 0 and "retry in" in str(exc)
    return exc


# -- configuration -----------------------------------------------------------------------------------
def test_parse_quotas_merges_tenants_over_the_default_and_null_lifts_a_limit():
    q = parse_quotas({"default": {"max_concurrent": 4, "tokens_per_minute": 1000, "max_new_tokens": 64},
                      "tenants": {"acme": {"max_concurrent": 32}, "ops": {"tokens_per_minute": None}, "bare": None}},
                     "quotas.yaml", known_tenants={"acme", "ops", "bare", "other"})
    assert q.of("acme") == Quota(32, 1000, None, 64)
    assert q.of("ops") == Quota(4, None, None, 64)
    assert q.of("bare") == q.of("anyone") == q.default == Quota(4, 1000, None, 64)
    assert Quotas().of("x") == Quota() and not Quotas().shared
    assert not parse_quotas({"default": {"max_prompt_bytes": 10}}, "q").shared  # size limits need no Redis


@pytest.mark.parametrize("document,message", [
    (None, "quotas.yaml: expected a mapping with 'default' and/or 'tenants'"),
    ([1, 2], "expected a mapping"),
    ({}, "remove the file to serve without quotas"),
    ({"defaults": {}}, "unknown top-level fields ['defaults'] (known: default, tenants)"),
    ({"default": {"max_concurent": 3}}, "quotas.yaml: default has unknown fields ['max_concurent']"),
    ({"default": {"max_concurrent": 0}}, "default.max_concurrent must be a positive integer or null"),
    ({"default": {"max_concurrent": "8"}}, "default.max_concurrent must be a positive integer or null (no limit), got '8'"),
    ({"default": {"max_concurrent": True}}, "must be a positive integer"),
    ({"default": {"tokens_per_minute": 1.5}}, "default.tokens_per_minute must be a positive integer"),
    ({"default": [1]}, "quotas.yaml: default must be a mapping of limits"),
    ({"tenants": ["acme"]}, "tenants must be a mapping of tenant -> limits"),
    ({"tenants": {"bad tenant!": {}}}, "tenant names are 1-64 characters"),
    ({"tenants": {"acme": {"max_new_tokens": -1}}}, "quotas.yaml: tenants.acme.max_new_tokens must be a positive integer"),
    ({"tenants": {"acme": 5}}, "tenants.acme must be a mapping of limits"),
])
def test_each_mistake_in_a_quota_document_is_one_line(document, message):
    with pytest.raises(InvalidArgument) as info:
        parse_quotas(document, "quotas.yaml")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_tenant_is_refused_naming_the_key_files_tenants():
    with pytest.raises(InvalidArgument) as info:
        parse_quotas({"tenants": {"acme": {}, "acne": {"max_concurrent": 1}}}, "quotas.yaml", known_tenants={"acme", "ops"})
    assert str(info.value) == "unknown tenant 'acne' in quotas.yaml (the key file has: acme, ops)"
    parse_quotas({"tenants": {"acne": {"max_concurrent": 1}}}, "quotas.yaml", known_tenants=None)  # keys off: any name


def test_load_quotas_files(tmp_path):
    assert load_quotas(None) == Quotas()  # no file: no limits
    with pytest.raises(NotFound, match="quota file .*missing.yaml does not exist"):
        load_quotas(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: {max_concurrent: [\n")
    with pytest.raises(InvalidArgument) as info:
        load_quotas(bad)
    assert str(info.value).startswith(f"{bad}: not valid YAML or JSON") and "\n" not in str(info.value)
    good = tmp_path / "quotas.json"
    good.write_text('{"default": {"max_concurrent": 2}, "tenants": {"acme": {"max_concurrent": 5}}}')
    assert load_quotas(good, {"acme"}).of("acme").max_concurrent == 5
    with pytest.raises(InvalidArgument, match="unknown tenant 'acme'"):
        load_quotas(good, {"ops"})


def test_prompt_bytes_counts_utf8_of_the_text_and_every_message():
    assert prompt_bytes("héllo") == 6
    assert prompt_bytes(messages=(("user", "€"), ("system", "ab"))) == 4 + 3 + 6 + 2


# -- the size limits: before tokenization, no Redis ------------------------------------------------
def test_size_limits_are_invalid_argument_and_never_reach_redis(make, namespace):
    a = make({"default": {"max_prompt_bytes": 100, "max_new_tokens": 50}}, url=DOWN_URL)
    with pytest.raises(InvalidArgument, match=r"the prompt has 101 bytes; tenant 'acme' may send at most 100 \(max_prompt_bytes\)"):
        a.precheck("acme", 101, 10)
    with pytest.raises(InvalidArgument, match="max_new_tokens is 51; tenant 'acme' may ask for at most 50"):
        a.precheck("acme", 100, 51)
    with a.precheck("acme", 100, 50) as t:
        assert t.max_new_tokens == 50
    assert a.precheck("acme", 1, 0, default_max_new_tokens=256).max_new_tokens == 50  # the default, capped
    assert a.precheck("acme", 1, 0, default_max_new_tokens=20).max_new_tokens == 20
    assert a.stats()["errors"] == 0 and a.stats()["refused"] == {"size": 2}


def test_an_invalid_tenant_is_refused_before_it_names_a_redis_key(make):
    a = make({"default": {"max_concurrent": 1}})
    for tenant in ("", "a b", "x" * 65, "a}:b"):
        with pytest.raises(InvalidArgument, match="invalid tenant"):
            a.precheck(tenant, 1, 1)


# -- concurrency ---------------------------------------------------------------------------------------
def test_max_concurrent_refuses_with_a_retry_hint_and_admits_after_a_release(make):
    a = make({"default": {"max_concurrent": 2}})
    t1, t2 = a.precheck("acme", 1, 1), a.precheck("acme", 1, 1)
    exc = refused(lambda: a.precheck("acme", 1, 1))
    assert "tenant 'acme' has 2 requests running, its limit (max_concurrent)" in str(exc)
    t1.release(5)
    t1.release(5)  # idempotent: frees one slot, once
    t3 = a.precheck("acme", 1, 1)
    refused(lambda: a.precheck("acme", 1, 1))
    t2.release(), t3.release()
    assert a.stats()["running"] == 0 and a.stats()["refused"] == {"concurrency": 2}


def test_two_replicas_and_many_threads_never_exceed_max_concurrent(make):
    """Eight threads over two Admission instances (two router replicas), seeded random holding
    times: the holders counted on this side (incremented after admit, decremented before release)
    never exceed the limit, and the limit is reached and refuses (so the test can fail)."""
    limit = 3
    replicas = [make({"default": {"max_concurrent": limit}}), make({"default": {"max_concurrent": limit}})]
    lock = threading.Lock()
    holders, peak, admitted, refusals = 0, 0, 0, 0

    def worker(seed: int) -> None:
        nonlocal holders, peak, admitted, refusals
        rng = random.Random(seed)
        for _ in range(40):
            try:
                ticket = replicas[rng.randrange(2)].precheck("acme", 1, 1)
            except QuotaExceeded:
                with lock:
                    refusals += 1
                time.sleep(rng.random() * 0.002)
                continue
            with lock:
                holders += 1
                admitted += 1
                peak = max(peak, holders)
            time.sleep(rng.random() * 0.005)
            with lock:
                holders -= 1
            ticket.release(1)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == limit and refusals > 0 and admitted > limit
    assert replicas[0].precheck("acme", 1, 1) and all(r.stats()["errors"] == 0 for r in replicas)


def test_a_crashed_replicas_slots_come_back_after_its_lease(make):
    crashed = make({"default": {"max_concurrent": 1}}, lease_s=0.6)
    crashed.precheck("acme", 1, 1)  # never released
    crashed.close()  # the replica died: nothing renews its lease any more
    other = make({"default": {"max_concurrent": 1}}, lease_s=0.6)
    refused(lambda: other.precheck("acme", 1, 1))
    time.sleep(0.8)
    other.precheck("acme", 1, 1).release()


def test_a_long_request_keeps_its_slot_while_its_replica_renews_the_lease(make):
    holder = make({"default": {"max_concurrent": 1}}, lease_s=1.5)  # renewed every 0.5 s (slack for a loaded machine)
    other = make({"default": {"max_concurrent": 1}}, lease_s=1.5)
    ticket = holder.precheck("acme", 1, 1)
    time.sleep(4.0)  # over 2.5 leases
    refused(lambda: other.precheck("acme", 1, 1))
    ticket.release()
    other.precheck("acme", 1, 1).release()


def test_max_concurrent_total_bounds_this_replica_over_every_tenant_at_once(make):
    a = make({"default": {"max_concurrent": 10}}, max_concurrent_total=2)
    t1, t2 = a.precheck("acme", 1, 1), a.precheck("ops", 1, 1)
    started = time.monotonic()
    exc = refused(lambda: a.precheck("third", 1, 1))
    assert time.monotonic() - started < 0.5 and "this server is at its limit of 2 requests in flight" in str(exc)
    t1.release()
    a.precheck("third", 1, 1)
    assert a.stats()["refused"] == {"replica": 1}
    t2.release()
    unlimited = make(Quotas(), max_concurrent_total=1)  # no quota file: only this bound, no Redis
    with unlimited.precheck("acme", 10**9, 10**6):
        refused(lambda: unlimited.precheck("acme", 1, 1))
    unlimited.precheck("acme", 1, 1).release()


# -- tokens per minute --------------------------------------------------------------------------------
def test_tokens_per_minute_refuses_with_the_time_until_the_bucket_holds_enough(make):
    a = make({"default": {"tokens_per_minute": 6000}})  # refills 100 tokens/s
    t = a.admit("acme", 1, 1000, prompt_tokens=5000)
    assert t.reserved == 6000
    exc = refused(lambda: a.precheck("acme", 1, 50))  # 50 short: ~0.5 s
    assert 0 < exc.retry_after_s <= 0.55 and "over its tokens_per_minute (6000) for this request's 50 tokens" in str(exc)
    time.sleep(exc.retry_after_s + 0.05)
    a.precheck("acme", 1, 50).release(50)
    t.release()  # used unknown: nothing given back


def test_a_release_gives_back_what_the_request_did_not_use_once(make):
    a = make({"default": {"tokens_per_minute": 1000}})  # refills ~16.7 tokens/s
    t1 = a.admit("acme", 1, 300, prompt_tokens=200)  # 500
    t2 = a.admit("acme", 1, 300, prompt_tokens=100)  # 400: 100 left
    refused(lambda: a.precheck("acme", 1, 300))
    t1.release(100)  # 400 back: ~500 left
    t1.release(0)  # idempotent: not 500 more
    t3 = a.precheck("acme", 1, 450)
    refused(lambda: a.precheck("acme", 1, 200))  # a double refund would have let this in
    t2.release(400), t3.release(450)


def test_the_charge_step_refuses_after_tokenization_and_the_release_refunds_the_precheck(make):
    a = make({"default": {"tokens_per_minute": 1000, "max_concurrent": 1}})
    hog = a.admit("acme", 1, 100, prompt_tokens=700)  # 200 left
    hog.release(800)
    t = a.precheck("acme", 1, 100)  # 100 left
    refused(lambda: t.charge(150))
    assert t.reserved == 100
    t.release(0)  # the caller's finally: slot freed, the 100 back
    a.admit("acme", 1, 100, prompt_tokens=90).release(190)


def test_a_request_over_the_whole_minute_can_never_run_so_it_is_invalid_argument(make):
    a = make({"default": {"tokens_per_minute": 1000, "max_concurrent": 1}})
    with pytest.raises(InvalidArgument, match="max_new_tokens 1001 alone exceeds the tokens_per_minute of tenant 'acme' \\(1000\\)"):
        a.precheck("acme", 1, 1001)
    t = a.precheck("acme", 1, 600)
    with pytest.raises(InvalidArgument, match="the prompt's 401 tokens plus max_new_tokens 600 exceed"):
        t.charge(401)
    t.release(0)
    a.admit("acme", 1, 600, prompt_tokens=400).release()  # the slot was freed


# -- fairness and outages ------------------------------------------------------------------------------
def test_one_tenant_flooding_leaves_another_untouched(make):
    a = make({"default": {"max_concurrent": 2, "tokens_per_minute": 1000}})
    held = [a.admit("flood", 1, 500, prompt_tokens=0) for _ in range(2)]
    for _ in range(200):  # the flood goes on, refused
        with pytest.raises(QuotaExceeded):
            a.precheck("flood", 1, 10)
    quiet = [a.admit("quiet", 1, 400, prompt_tokens=100), a.admit("quiet", 1, 400, prompt_tokens=100)]
    refused(lambda: a.precheck("quiet", 1, 1))  # its own limit, not the flood's
    for t in held + quiet:
        t.release(0)


def test_a_redis_outage_fails_open_counted_and_logged_once_per_backoff(make, caplog):
    a = make({"default": {"max_concurrent": 1, "tokens_per_minute": 10}}, url=DOWN_URL, max_concurrent_total=3,
             backoff_s=30.0)
    with caplog.at_level(logging.WARNING, logger="specpool.services.admission"):
        started = time.monotonic()
        tickets = [a.admit("acme", 1, 5, prompt_tokens=5) for _ in range(3)]  # over both shared limits: admitted
        assert time.monotonic() - started < 2.0
    warnings = [r for r in caplog.records if "admitting requests without their shared quotas for 30 s" in r.getMessage()]
    assert len(warnings) == 1 and a.stats()["errors"] == 1 and a.stats()["unchecked"] == 3
    refused(lambda: a.precheck("acme", 1, 1))  # the replica's own bound still holds
    for t in tickets:
        t.release(0)
    assert a.stats()["running"] == 0 and a.stats()["errors"] == 1  # releases skipped during the backoff


def test_quota_exceeded_keeps_its_retry_hint_through_pickling_and_maps_to_429_and_resource_exhausted():
    from specpool.services.openai_api import http_error
    from specpool.services.status import grpc_status

    exc = pickle.loads(pickle.dumps(QuotaExceeded("over; retry in 2.5 s", 2.5)))
    assert isinstance(exc, QuotaExceeded) and exc.retry_after_s == 2.5 and str(exc) == "over; retry in 2.5 s"
    assert grpc_status(exc)[0].name == "RESOURCE_EXHAUSTED" and http_error(exc).status == 429


def test_the_retry_hint_as_http_headers_and_grpc_trailing_metadata():
    assert retry_headers(QuotaExceeded("x", 1.2)) == {"Retry-After": "2", "retry-after-ms": "1200"}
    assert retry_headers(QuotaExceeded("x", 0.0004)) == {"Retry-After": "1", "retry-after-ms": "1"}
    assert retry_metadata(QuotaExceeded("x", 30)) == [("retry-after", "30"), ("retry-after-ms", "30000")]
    assert retry_headers(ResourceExhausted("no hint")) == {} and retry_metadata(ValueError()) == []


def test_every_counted_event_reaches_the_metrics_with_its_tenant(make):
    """Admission.on_event feeds specpool_admission_events: the real metrics class, read back from its registry."""
    from specpool.services.metrics import PrometheusMetrics

    metrics = PrometheusMetrics()
    a = make({"default": {"max_concurrent": 1, "max_prompt_bytes": 10}}, max_concurrent_total=2, on_event=metrics.admission)
    held = a.precheck("acme", 1, 1)
    refused(lambda: a.precheck("acme", 1, 1))  # the tenant's max_concurrent
    with pytest.raises(InvalidArgument):
        a.precheck("acme", 11, 1)  # max_prompt_bytes
    other = a.precheck("beta", 1, 1)
    refused(lambda: a.precheck("gamma", 1, 1))  # the replica's bound (2 running)
    held.release(), other.release()
    down = make({"default": {"max_concurrent": 1}}, url=DOWN_URL, on_event=metrics.admission)
    down.precheck("acme", 1, 1).release()

    def count(tenant, event):
        return metrics.registry.get_sample_value("specpool_admission_events_total", {"tenant": tenant, "event": event}) or 0

    assert count("acme", "refused_concurrency") == 1 and count("acme", "refused_size") == 1
    assert count("gamma", "refused_replica") == 1 and count("acme", "unchecked") == 1
    assert count("-", "store_error") == 1 and count("beta", "refused_concurrency") == 0
    assert sum(a.stats()["refused"].values()) == 3  # the same events as the counters the replica keeps


def test_a_failing_metrics_callback_never_changes_a_decision(make):
    def broken(event, tenant):
        raise RuntimeError("metrics backend down")

    a = make({"default": {"max_concurrent": 1}}, on_event=broken)
    held = a.precheck("acme", 1, 1)
    refused(lambda: a.precheck("acme", 1, 1))  # still RESOURCE_EXHAUSTED, not the callback's error
    held.release()
