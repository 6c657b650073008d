"""Integration: tenants are isolated on a real `specpool serve` (issue 27, "isolation tests").

Ray Serve on a local Ray cluster, the real default target, the n-gram drafter, Redis at
127.0.0.1:6379, gRPC on loopback, API keys on (tenants ``acme`` and ``globex``), per-tenant
quotas, online-learning feedback to Redis; no mocks. One deployment for the module.

Isolation means every per-session structure is keyed by (tenant, session): the model servers know a
session as ``tenant/session`` (``cache_id``, specpool/services/orchestrator.py), the session store
and admission keep each tenant's keys under its ``{tenant}`` hash tag, feedback goes to the tenant's
own stream, and metrics count under the tenant's label. So here the two tenants pick the SAME
session id, and each test shows that what one does reaches nothing of the other's:

1. both at once: both answers exact, two caches in the target and the drafter, two bandit states;
2. one cancels: only its caches are freed; the other's continues its session over its cache;
3. one "continues" the other's session id: it starts fresh and leaves the other's state as it was;
4. spending: one's requests touch none of the other's admission keys (slots, token bucket);
5. feedback: one's rounds go to its own stream only;
6. metrics: one's requests count under its own tenant label only.

Every answer is compared with the embedded engine's greedy answer (the target's own tokens).
What is already covered elsewhere is not repeated: keys deciding the tenant on both APIs and a
session's state under its key's tenant (test_openai_served.py), learned weights serving only their
tenant (test_served.py, test_served_online_learning_loop).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
import uuid
from types import SimpleNamespace

import pytest

from redis_helpers import URL, delete_namespace
from serve_helpers import call as _call, free_port as _free_port, wait_until as _wait
from specpool.core.defaults import DEFAULT_POLICY
from specpool.core.errors import NotFound
from specpool.router.policies import make_policy
from specpool.router.session_store import RedisSessionStore, SessionKey
from specpool.services.auth import add_key
from specpool.services.client import SpecPoolClient

pytestmark = pytest.mark.integration

POOL = ["ngram"]
TENANTS = ("acme", "globex")
K = 5
MAX_NEW = 32
LONG = 400  # a request that would run for tens of seconds: the cancel cuts it short
TOKENS_PER_MINUTE = 100_000
PROMPT_A = "Write a Python function that returns the n-th Fibonacci number."
PROMPT_B = "Translate to French: Where is the train station? Then explain the grammar in a few sentences."
FOLLOW_UP = "Now write it without recursion."
COPY_HEAVY = "one two three four five one two three four five one two three"  # raw: the n-gram drafter drafts here


@pytest.fixture(scope="module")
def served(raw_redis, tmp_path_factory):
    from ray import serve

    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    folder = tmp_path_factory.mktemp("isolation")
    keys_file, quotas_file = folder / "keys.yaml", folder / "quotas.yaml"
    keys = {tenant: add_key(keys_file, tenant) for tenant in TENANTS}
    # Every tenant has a concurrency limit and a token bucket: both leave keys in Redis to watch.
    quotas_file.write_text(f"default: {{max_concurrent: 8, tokens_per_minute: {TOKENS_PER_MINUTE}}}\n")
    namespace = f"specpool-iso-{uuid.uuid4().hex[:8]}"
    config = default_serve_config(POOL, URL, _free_port(), http_port=_free_port(), k=K)
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"].update(redis_namespace=namespace, api_keys_file=str(keys_file), quotas_file=str(quotas_file),
                          http_api=False, feedback=True, feedback_stream=f"{namespace}:feedback")
    local = start_local(plan_from_config(config, "the test config"), metrics_port=_free_port(),
                        progress=lambda m: print(f"[served] {m}", flush=True))
    handles = SimpleNamespace(router=serve.get_deployment_handle("Router", app_name="router"),
                              target=serve.get_deployment_handle("Target", app_name="target"),
                              drafter=serve.get_deployment_handle("Drafter", app_name="drafter-ngram"))
    clients = {tenant: SpecPoolClient(local.address, api_key=key, timeout=300) for tenant, key in keys.items()}
    yield SimpleNamespace(local=local, namespace=namespace, handles=handles, clients=clients,
                          metrics_url=local.metrics_url)
    for client in clients.values():
        client.close()
    local.shutdown()
    delete_namespace(raw_redis, namespace)


@pytest.fixture(scope="module")
def engine():
    from specpool.services.config import settings_from_env
    from specpool.services.engine import EmbeddedEngine

    return EmbeddedEngine.default(settings_from_env().home)


@pytest.fixture(scope="module")
def reference(engine):
    """The embedded engine's greedy answer (token ids) to a prompt, a raw prompt or chat messages; cached."""
    from specpool.target.sampling import SamplingParams

    cache: dict = {}

    def answer(prompt: str | None = None, *, raw: bool = False, chat: tuple = (), max_new_tokens: int = MAX_NEW) -> list[int]:
        key = (prompt, raw, tuple(chat), max_new_tokens)
        if key not in cache:
            ids = engine.orchestrator.encode("chat", messages=chat) if chat else engine.encode_prompt(prompt, raw=raw)
            params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids())
            cache[key] = engine.generate(ids, params, k=K, drafter="ngram", session_id=uuid.uuid4().hex).token_ids
        return cache[key]

    return answer


# -- what each tenant holds ---------------------------------------------------------------------------------
def _holders(served, tenant: str, session: str) -> set[str]:
    """The model servers holding something for ``session`` of ``tenant``."""
    scoped = f"{tenant}/{session}"
    held = set()
    if scoped in _call(served.handles.target, "Sessions"):
        held.add("target")
    if scoped in _call(served.handles.drafter, "Sessions"):
        held.add("drafter")
    return held


def _session_key(served, tenant: str, session: str) -> str:
    return f"{served.namespace}:{{{tenant}}}:session:{session}"


def _arms_key(served, tenant: str) -> str:
    return f"{served.namespace}:{{{tenant}}}:arms"


def _state(served, raw_redis, tenant: str, session: str) -> dict | None:
    raw = raw_redis.get(_session_key(served, tenant, session))
    return None if raw is None else json.loads(raw)


def _admission(served, raw_redis, tenant: str) -> dict:
    """A tenant's admission keys as they are (specpool/services/admission.py, Admission._keys)."""
    prefix = f"{served.namespace}:{{{tenant}}}:admission"
    return {"inflight": raw_redis.zrange(f"{prefix}:inflight", 0, -1, withscores=True),
            "tokens": raw_redis.hgetall(f"{prefix}:tokens")}


def _stream(served, tenant: str = "") -> str:
    """A tenant's feedback stream (RedisFeedbackStream: ``<stream>:<tenant>``); "" the bare one."""
    return f"{served.namespace}:feedback:{tenant}" if tenant else f"{served.namespace}:feedback"


def _records(raw_redis, stream: str) -> list:
    from specpool.learning.feedback import FeedbackRecord
    from specpool.learning.feedback_redis import FIELD

    return [FeedbackRecord.decode(fields[FIELD.decode()].encode()) for _, fields in raw_redis.xrange(stream)]


def _rounds_fit(state: dict, rounds: int, before: float = 0) -> bool:
    """The bandit state's round counter went from ``before`` through this request's rounds (the last
    round may draft nothing: k capped to 0), i.e. this state saw this request's rounds and no one else's."""
    return before + rounds - 1 <= state["t"] <= before + rounds


def _new_session_start(served, tenant: str, session: str) -> float:
    """The round counter a new session of ``tenant`` starts from under the server's policy: 0 cold;
    under a +warm policy (DEFAULT_POLICY is one) the weight of ``tenant``'s own statistics, read
    from the store as the router reads them."""
    store = RedisSessionStore(URL, namespace=served.namespace)
    try:
        state, stats = store.read(SessionKey(tenant, session))
    finally:
        store.close()
    assert state is None, "not a new session"
    return make_policy(DEFAULT_POLICY, POOL).init_state(stats)["t"]


def _active(served) -> set[tuple[str, str]]:
    return {tuple(slot) for slot in _call(served.handles.router, "Active")}


# -- 1. the same session id, two tenants, at once --------------------------------------------------------------
def test_two_tenants_run_the_same_session_id_at_once_each_on_its_own_caches_and_state(served, reference, raw_redis):
    session = f"shared-{uuid.uuid4().hex[:8]}"
    prompts = {"acme": PROMPT_A, "globex": PROMPT_B}
    expected = {tenant: reference(prompt) for tenant, prompt in prompts.items()}
    starts = {tenant: _new_session_start(served, tenant, session) for tenant in TENANTS}
    start = threading.Barrier(len(TENANTS))
    arrivals: dict[str, list[float]] = {tenant: [] for tenant in TENANTS}
    tokens: dict[str, list[int]] = {tenant: [] for tenant in TENANTS}
    finals, errors = {}, []

    def run(tenant: str) -> None:
        try:
            start.wait(30)  # both calls go out together
            for chunk in served.clients[tenant].generate_stream(prompts[tenant], max_new_tokens=MAX_NEW,
                                                                session_id=session):
                arrivals[tenant].append(time.monotonic())
                tokens[tenant].extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    finals[tenant] = chunk
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((tenant, exc))

    threads = [threading.Thread(target=run, args=(tenant,)) for tenant in TENANTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors  # neither refused as busy: a session is busy per (tenant, session)
    # At once: each stream got a message while the other was still streaming.
    assert arrivals["acme"][0] < arrivals["globex"][-1] and arrivals["globex"][0] < arrivals["acme"][-1], arrivals
    for tenant in TENANTS:
        assert tokens[tenant] == expected[tenant], tenant  # neither saw the other's context
        assert finals[tenant].session_id == session

    # Two caches in each model server, one per tenant, both kept for the session's next request.
    assert _holders(served, "acme", session) == _holders(served, "globex", session) == {"target", "drafter"}
    # Two bandit states, each holding its own request's rounds only (one shared key would hold both's).
    for tenant in TENANTS:
        state = _state(served, raw_redis, tenant, session)
        assert state is not None and _rounds_fit(state, finals[tenant].stats.rounds, before=starts[tenant]), (
            tenant, state["t"], starts[tenant], finals[tenant].stats)
    assert sorted(raw_redis.scan_iter(match=f"{served.namespace}:*:session:{session}", count=1000)) == \
        sorted(_session_key(served, tenant, session) for tenant in TENANTS)


# -- 2. one tenant's cancel frees its own caches only ----------------------------------------------------------
def test_a_cancel_frees_only_the_cancelling_tenants_caches_and_the_other_continues_its_session(served, reference):
    session = f"cancel-{uuid.uuid4().hex[:8]}"
    first = served.clients["globex"].generate(PROMPT_A, max_new_tokens=MAX_NEW, session_id=session)
    assert first.token_ids == reference(PROMPT_A)
    assert _holders(served, "globex", session) == {"target", "drafter"}  # kept for the next turn

    stream = served.clients["acme"].generate_stream(PROMPT_B, max_new_tokens=LONG, session_id=session)
    got = 0
    for chunk in stream:
        got += len(chunk.token_ids)
        if got >= 6:
            break
    assert _holders(served, "acme", session) == {"target", "drafter"}  # acme really held caches ...
    stream.close()  # ... until it cancels
    _wait(lambda: not _active(served), 60, "the router to stop acme's request")
    _wait(lambda: not _holders(served, "acme", session), 60, "acme's caches to be released")
    assert _holders(served, "globex", session) == {"target", "drafter"}  # globex's, under the same id, are not

    # globex's next turn continues its session: its context starts with what the cache holds.
    chat = (("user", PROMPT_A), ("assistant", first.text), ("user", FOLLOW_UP))
    second = served.clients["globex"].generate(chat=list(chat), max_new_tokens=MAX_NEW, session_id=session)
    assert second.token_ids == reference(chat=chat)
    assert second.stats.prompt_tokens > first.stats.prompt_tokens + len(first.token_ids) - 1  # a continuation


# -- 3. continuing "another tenant's" session id starts fresh ----------------------------------------------------
def test_a_tenant_using_another_tenants_session_id_sees_none_of_its_state(served, reference, raw_redis):
    session = f"chat-{uuid.uuid4().hex[:8]}"
    t = _new_session_start(served, "acme", session)
    for prompt in (PROMPT_A, PROMPT_B):  # acme's session grows over two requests
        answer = served.clients["acme"].generate(prompt, max_new_tokens=MAX_NEW, session_id=session)
        assert answer.token_ids == reference(prompt)
        state = _state(served, raw_redis, "acme", session)
        assert _rounds_fit(state, answer.stats.rounds, before=t), (t, state["t"], answer.stats.rounds)
        t = state["t"]
    acme_session = raw_redis.get(_session_key(served, "acme", session))
    acme_arms = raw_redis.hgetall(_arms_key(served, "acme"))
    assert acme_arms  # acme's aggregate exists, to be compared below
    assert raw_redis.get(_session_key(served, "globex", session)) is None

    start = _new_session_start(served, "globex", session)
    assert start < t  # so the counter below tells globex's fresh state from acme's
    answer = served.clients["globex"].generate(PROMPT_B, max_new_tokens=MAX_NEW, session_id=session)
    assert answer.token_ids == reference(PROMPT_B)
    fresh = _state(served, raw_redis, "globex", session)
    # A fresh state: its counter holds globex's start and rounds only (continuing acme's would start at acme's t).
    assert fresh is not None and _rounds_fit(fresh, answer.stats.rounds, before=start), (fresh["t"], answer.stats.rounds, start, t)
    assert raw_redis.get(_session_key(served, "acme", session)) == acme_session  # acme's, byte for byte
    assert raw_redis.hgetall(_arms_key(served, "acme")) == acme_arms
    assert _holders(served, "acme", session) == _holders(served, "globex", session) == {"target", "drafter"}


# -- 4. spending ---------------------------------------------------------------------------------------------
def test_a_tenants_requests_never_touch_the_other_tenants_admission_keys(served, reference, raw_redis):
    session = f"spend-{uuid.uuid4().hex[:8]}"
    warm = served.clients["globex"].generate(PROMPT_A, max_new_tokens=4, session_id=session)
    assert warm.stats.new_tokens == 4
    globex_before = _admission(served, raw_redis, "globex")
    assert globex_before["tokens"] and float(globex_before["tokens"]["tokens"]) < TOKENS_PER_MINUTE  # globex spent
    assert globex_before["inflight"] == []  # and gave its slot back
    acme_before = _admission(served, raw_redis, "acme")

    stream = served.clients["acme"].generate_stream(PROMPT_A, max_new_tokens=MAX_NEW, session_id=session)
    tokens = list(next(stream).token_ids)
    running = _admission(served, raw_redis, "acme")
    assert len(running["inflight"]) == 1 and running["tokens"] != acme_before["tokens"]  # acme holds a slot, spent tokens
    assert _admission(served, raw_redis, "globex") == globex_before  # ... and globex's keys are as they were
    for chunk in stream:
        tokens.extend(chunk.token_ids)
    assert tokens == reference(PROMPT_A)

    acme_after = _admission(served, raw_redis, "acme")
    assert acme_after["inflight"] == [] and float(acme_after["tokens"]["tokens"]) < TOKENS_PER_MINUTE
    assert _admission(served, raw_redis, "globex") == globex_before


# -- 5. feedback ----------------------------------------------------------------------------------------------
def test_a_tenants_feedback_goes_to_its_own_stream_only(served, reference, raw_redis):
    session = f"learn-{uuid.uuid4().hex[:8]}"
    expected = reference(COPY_HEAVY, raw=True)
    for tenant, other in (("acme", "globex"), ("globex", "acme")):  # the same session id, one after the other
        others_before = raw_redis.xrange(_stream(served, other))
        bare_before = raw_redis.xrange(_stream(served))
        own_before = len(_records(raw_redis, _stream(served, tenant)))
        answer = served.clients[tenant].generate(COPY_HEAVY, raw=True, max_new_tokens=MAX_NEW, session_id=session)
        assert answer.token_ids == expected
        assert answer.stats.draft_tokens > 0  # it drafted: there is feedback to send

        def new_records():
            records = _records(raw_redis, _stream(served, tenant))[own_before:]
            return records if sum(len(r.draft) for r in records) >= answer.stats.draft_tokens else None

        records = _wait(new_records, 60, f"{tenant}'s feedback records")
        assert sum(len(r.draft) for r in records) == answer.stats.draft_tokens  # every drafted round, once
        assert {(r.tenant, r.session) for r in records} == {(tenant, session)}
        time.sleep(1.0)  # anything emitted elsewhere would have landed by now
        assert raw_redis.xrange(_stream(served, other)) == others_before, f"{tenant}'s rounds reached {other}'s stream"
        assert raw_redis.xrange(_stream(served)) == bare_before
    assert _call(served.handles.router, "Feedback")["errors"] == 0


# -- 6. metrics -----------------------------------------------------------------------------------------------
def _requests_by_tenant_and_status(served) -> dict[tuple[str, str], float]:
    """ray_specpool_requests_total summed over endpoints, per (tenant, status) label."""
    text = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
    totals: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("ray_specpool_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            key = (labels["tenant"], labels["status"])
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def test_a_tenants_requests_count_under_its_own_tenant_label_only(served):
    """Counted by statuses no other request of this module ends with for globex (NOT_FOUND: refused
    while being prepared; CANCELLED: stopped in the loop), so the check does not depend on how late
    Ray's metrics agent exports the counts of earlier requests."""
    before = _requests_by_tenant_and_status(served)
    for _ in range(2):
        with pytest.raises(NotFound):
            served.clients["acme"].generate(PROMPT_A, max_new_tokens=2, policy="no-such-policy")
    stream = served.clients["acme"].generate_stream(PROMPT_B, max_new_tokens=LONG, session_id=f"count-{uuid.uuid4().hex[:8]}")
    next(stream)
    stream.close()
    _wait(lambda: not _active(served), 60, "the router to stop acme's request")
    wanted = {("acme", "NOT_FOUND"): before.get(("acme", "NOT_FOUND"), 0) + 2,
              ("acme", "CANCELLED"): before.get(("acme", "CANCELLED"), 0) + 1}
    last: dict = {}

    def counted():
        last.update(_requests_by_tenant_and_status(served))
        return all(last.get(k, 0) >= v for k, v in wanted.items())

    try:  # Ray's metrics agent exports what the router counted every few seconds
        _wait(counted, 120, f"acme's requests in ray_specpool_requests_total at {served.metrics_url}", interval=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: wanted {wanted}, scraped {last}, before {before}") from None
    time.sleep(2.0)  # one more export: a count under another label would come with these
    after = _requests_by_tenant_and_status(served)
    assert {k: after.get(k) for k in wanted} == wanted
    strays = {k: v for k, v in after.items() if k[0] != "acme" and k[1] in ("NOT_FOUND", "CANCELLED")}
    assert strays == {}, strays
