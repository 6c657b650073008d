"""Integration: served mode for real. Ray Serve on a local Ray cluster, the real default target and
two drafters (n-gram and the `code` zoo drafter), Redis at 127.0.0.1:6379, gRPC on loopback; no
mocks. One deployment is started for the whole module (about a minute on two cores) and shut down
at the end; generations are short (24 tokens).

Every served answer is compared with the embedded engine's for the same prompt, policy, pool, k
and seed (greedy: the target's own tokens).
"""

from __future__ import annotations

import json
import signal
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from types import SimpleNamespace

import grpc
import pytest

from specpool.core.errors import DeadlineExceeded, InvalidArgument, NotFound
from specpool.services import batch_trace
from specpool.services.client import SpecPoolClient
from specpool.v1 import specpool_pb2, specpool_pb2_grpc

pytestmark = pytest.mark.integration

from redis_helpers import URL, delete_namespace
from serve_helpers import free_port as _free_port, wait_until as _wait, call as _call, feedback_records, generate_concurrently
POOL = ["ngram", "code"]
MAX_NEW = 24
K = 5
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in one sentence: The cat sat on the mat because the mat was warm and the sun was out.",
    "Translate to French: Where is the train station?",
    "What is 12 times 7? Explain briefly.",
]
LONG = 400  # tokens a request would take tens of seconds for: deadlines and cancels cut it short


@pytest.fixture(scope="module")
def served(raw_redis, tmp_path_factory):
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    namespace = f"specpool-it-{uuid.uuid4().hex[:8]}"
    port, metrics_port = _free_port(), _free_port()
    config = default_serve_config(POOL, URL, port, k=K)
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"]["redis_namespace"] = namespace
    # Online learning on (so every test here also shows feedback changes no answer); "quiet" opts out.
    router["args"].update(feedback=True, feedback_stream=f"{namespace}:feedback", feedback_opt_out=["quiet"])
    store = tmp_path_factory.mktemp("online-store")  # the zoo drafter serves what specpool learner publishes here
    drafter = next(a for a in config["applications"] if a["name"] == "drafter-code")
    drafter["args"].update(model_store=str(store), refresh_s=0.0)
    local = start_local(plan_from_config(config, "the test config"), metrics_port=metrics_port,
                        progress=lambda m: print(f"[served] {m}", flush=True))
    from ray import serve

    handles = SimpleNamespace(
        router=serve.get_deployment_handle("Router", app_name="router"),
        target=serve.get_deployment_handle("Target", app_name="target"),
        drafters={name: serve.get_deployment_handle("Drafter", app_name=f"drafter-{name}") for name in POOL},
    )
    yield SimpleNamespace(local=local, address=local.address, namespace=namespace, handles=handles,
                          metrics_url=local.metrics_url, store=store)
    local.shutdown()
    delete_namespace(raw_redis, namespace)


@pytest.fixture(scope="module")
def client(served):
    with SpecPoolClient(served.address) as c:
        yield c


@pytest.fixture(scope="module")
def engine():
    from specpool.services.config import settings_from_env
    from specpool.services.engine import EmbeddedEngine

    engine = EmbeddedEngine.default(settings_from_env().home)
    for name in POOL:
        engine.drafter(name)
    return engine


@pytest.fixture(scope="module")
def reference(engine):
    """The embedded engine's greedy answer to a prompt (cached)."""
    from specpool.target.sampling import SamplingParams

    cache: dict[str, list[int]] = {}

    def answer(prompt: str, max_new_tokens: int = MAX_NEW) -> list[int]:
        if (prompt, max_new_tokens) not in cache:
            params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids())
            result = engine.generate(engine.encode_prompt(prompt), params, k=K, session_id=uuid.uuid4().hex,
                                     policy="metasd-ucb", pool=POOL)
            cache[(prompt, max_new_tokens)] = result.token_ids
        return cache[(prompt, max_new_tokens)]

    return answer


def _holders(served, session: str, tenant: str = "default") -> list[str]:
    """Which servers still hold something for ``session`` of ``tenant`` (model servers key their
    per-session structures by tenant/session)."""
    held = []
    scoped = f"{tenant}/{session}"
    if scoped in _call(served.handles.target, "Sessions"):
        held.append("target")
    for name, handle in served.handles.drafters.items():
        if scoped in _call(handle, "Sessions"):
            held.append(f"drafter {name}")
    return held


# -- correctness -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_unary_and_stream_equal_the_embedded_engine(client, reference, engine, prompt):
    expected = reference(prompt)
    answer = client.generate(prompt, max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex)
    assert answer.token_ids == expected
    assert answer.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.finish_reason in ("length", "stop") and answer.stats.new_tokens == len(expected)
    assert sum(answer.stats.rounds_by_drafter.values()) == answer.stats.rounds > 0
    chunks = list(client.generate_stream(prompt, max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex))
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == answer.text
    assert chunks[-1].finish_reason == answer.finish_reason and all(c.finish_reason is None for c in chunks[:-1])


def test_stream_delivers_tokens_incrementally_and_in_order(client, reference):
    expected = reference(PROMPTS[0])
    started = time.perf_counter()
    arrivals = []
    for chunk in client.generate_stream(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex):
        arrivals.append((time.perf_counter() - started, chunk.token_ids))
    token_messages = [(t, ids) for t, ids in arrivals if ids]
    assert len(token_messages) >= 3, "a stream of one message is not incremental"
    assert [t for _, ids in token_messages for t in ids] == expected  # in order
    times = [t for t, _ in arrivals]
    assert times == sorted(times)
    first, last = token_messages[0][0], arrivals[-1][0]
    # The first round's tokens arrive well before the answer is complete.
    assert first < 0.75 * last, arrivals


def test_four_concurrent_sessions_are_each_correct(served, client, reference):
    expected = {p: reference(p) for p in PROMPTS}
    before = _call(served.handles.target, "Stats")["batch_sizes"]
    results = generate_concurrently(client, PROMPTS, max_new_tokens=MAX_NEW)
    for prompt in PROMPTS:
        assert results[prompt] == expected[prompt], prompt
    after = _call(served.handles.target, "Stats")["batch_sizes"]
    batched = sum(count - before.get(size, 0) for size, count in after.items() if size > 1)
    assert batched > 0, f"no verify batch of more than one session: {after}"


def test_a_sessions_later_model_calls_go_over_same_node_direct_routes(served, client, reference):
    """After a session's first call to each model server (through Serve), its calls go straight to
    that replica's loopback endpoint (specpool/services/direct.py); the answer does not change."""
    router_before = _call(served.handles.router, "Direct")
    target_before = _call(served.handles.target, "Stats")["direct_calls"]
    trace_before = _call(served.handles.target, "Stats")["batch_trace"]
    drafters_before = sum(_call(h, "Stats")["direct_calls"] for h in served.handles.drafters.values())
    session = uuid.uuid4().hex
    answer = client.generate(PROMPTS[3], max_new_tokens=MAX_NEW, session_id=session)
    assert answer.token_ids == reference(PROMPTS[3])
    rounds = answer.stats.rounds
    # The end-of-request notice (Release with keep_caches) goes direct too, after the answer.
    _wait(lambda: f"default/{session}" not in _call(served.handles.target, "Stats")["waiting_for"], timeout=10,
          what="the end-of-request notice")
    target_direct = _call(served.handles.target, "Stats")["direct_calls"] - target_before
    drafters_direct = sum(_call(h, "Stats")["direct_calls"] for h in served.handles.drafters.values()) - drafters_before
    # Every verify but the first goes direct, and so does the notice; each drafter used is reached
    # through Serve once.
    assert target_direct == rounds, (target_direct, rounds)
    # The target's batch trace saw the same: one verify through Serve, the rest direct, each of
    # them with the session's return gap (all but the first).
    trace = batch_trace.diff(_call(served.handles.target, "Stats")["batch_trace"], trace_before)
    by_path = {path: sum(n for key, n in trace["calls"].items() if key.endswith(path)) for path in ("serve", "direct")}
    assert by_path == {"serve": 1, "direct": rounds - 1}, trace
    assert sum(trace["return_gap_ms"].values()) == rounds - 1, trace
    # (The last round may draft nothing: k capped to 0.)
    assert rounds - 2 - len(served.handles.drafters) <= drafters_direct <= rounds - 1, (drafters_direct, rounds)
    router = _wait(lambda: (lambda r: r if r["calls"] - router_before["calls"] == target_direct + drafters_direct else None)(
        _call(served.handles.router, "Direct")), timeout=10, what="the router's count of direct calls")
    assert router["fallbacks"] == router_before["fallbacks"]


def test_the_target_stops_waiting_for_a_session_whose_request_ended(served, client, reference):
    """A verify batch waits for a call from each session of the last one. After a request, the
    router's end-of-request notice (Release with keep_caches) takes its session off that list, so
    the next request (any session's) is not held a batch timeout; the session's cache stays."""
    session = uuid.uuid4().hex
    answer = client.generate(PROMPTS[1], max_new_tokens=MAX_NEW, session_id=session)
    assert answer.token_ids == reference(PROMPTS[1])
    scoped = f"default/{session}"
    _wait(lambda: scoped not in _call(served.handles.target, "Stats")["waiting_for"], timeout=10,
          what="the end-of-request notice to reach the target")
    assert "target" in _holders(served, session)


def test_ucb_replay_replays_the_other_drafter_over_the_wire(served, client, reference):
    """The request's policy field picks ucb-replay: in its probe rounds the router asks the drafter
    it did not play for a Replay (drafter.proto), one per round; the answer stays the target's."""
    before = {name: _call(h, "Stats")["replays"] for name, h in served.handles.drafters.items()}
    answer = client.generate(PROMPTS[2], max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex, policy="ucb-replay")
    assert answer.token_ids == reference(PROMPTS[2])
    replays = sum(_call(h, "Stats")["replays"] - before[name] for name, h in served.handles.drafters.items())
    # Four probe rounds (the default), each replaying the one drafter not played; fewer only if
    # the answer took fewer drafting rounds.
    assert replays == min(4, answer.stats.rounds - 1) or replays == min(4, answer.stats.rounds), (replays, answer.stats.rounds)


def test_session_state_is_in_redis_under_the_tenant(served, client, raw_redis):
    tenant, session = f"acme-{uuid.uuid4().hex[:6]}", "chat-1"
    answer = client.generate(PROMPTS[2], max_new_tokens=MAX_NEW, session_id=session, tenant=tenant)
    assert answer.session_id == session
    state = json.loads(raw_redis.get(f"{served.namespace}:{{{tenant}}}:session:{session}"))
    assert state["t"] >= 1 and set(state["arms"]) == set(POOL)
    arms = raw_redis.hgetall(f"{served.namespace}:{{{tenant}}}:arms")
    assert any(field.startswith("n:") for field in arms), arms
    assert raw_redis.pttl(f"{served.namespace}:{{{tenant}}}:session:{session}") > 0  # expires


def test_a_new_session_id_is_chosen_when_none_is_given(client):
    answer = client.generate(PROMPTS[3], max_new_tokens=4)
    assert len(answer.session_id) >= 16


# -- errors, deadlines, cancellation ---------------------------------------------------------------------------
@pytest.mark.parametrize("request_kwargs,code,fragment", [
    (dict(prompt="   "), grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "no input"),
    (dict(prompt="hi", k=40), grpc.StatusCode.INVALID_ARGUMENT, "k (draft length) must be in 1..32"),
    (dict(prompt="hi", tenant="bad tenant"), grpc.StatusCode.INVALID_ARGUMENT, "invalid tenant id"),
    (dict(prompt="hi", session_id="x" * 200), grpc.StatusCode.INVALID_ARGUMENT, "invalid session id"),
    (dict(prompt="hi", max_new_tokens=100_000), grpc.StatusCode.INVALID_ARGUMENT, "does not fit"),
    (dict(prompt="hi", policy="nope"), grpc.StatusCode.NOT_FOUND, "unknown policy 'nope'"),
    (dict(prompt="hi", policy="fixed:math"), grpc.StatusCode.NOT_FOUND, "not served here"),
])
def test_bad_input_gets_a_status_code_and_a_clear_message(served, request_kwargs, code, fragment):
    with grpc.insecure_channel(served.address) as channel:
        stub = specpool_pb2_grpc.SpecPoolStub(channel)
        request = specpool_pb2.GenerateRequest(**request_kwargs)
        for call in (lambda: stub.Generate(request, timeout=30), lambda: list(stub.GenerateStream(request, timeout=30))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code, info.value.details()
            details = info.value.details()
            assert fragment in details and "Traceback" not in details and "\n" not in details, details


def test_client_raises_domain_errors(client):
    with pytest.raises(InvalidArgument, match="the prompt is empty"):
        client.generate("  ")
    with pytest.raises(NotFound):
        client.generate("hi", policy="nope")


def test_an_exceeded_deadline_stops_the_sessions_work(served, client):
    session = f"late-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    with pytest.raises(DeadlineExceeded):
        client.generate(PROMPTS[0], max_new_tokens=LONG, session_id=session, timeout=2.0)
    assert time.perf_counter() - started < 10
    _wait(lambda: not _call(served.handles.router, "Active"), 15, "the router to stop the request")
    _wait(lambda: not _holders(served, session), 15, "the session's caches to be released")
    # ... and nothing keeps verifying for it.
    batches = sum(_call(served.handles.target, "Stats")["batch_sizes"].values())
    time.sleep(1.0)
    assert sum(_call(served.handles.target, "Stats")["batch_sizes"].values()) == batches


def test_a_client_cancel_frees_the_sessions_resources(served, client):
    session = f"gone-{uuid.uuid4().hex[:8]}"
    stream = client.generate_stream(PROMPTS[1], max_new_tokens=LONG, session_id=session)
    got = 0
    for chunk in stream:
        got += len(chunk.token_ids)
        if got >= 6:
            break
    assert "target" in _holders(served, session)  # it really held a cache ...
    stream.close()  # ... until the client cancels
    _wait(lambda: not _call(served.handles.router, "Active"), 15, "the router to stop the request")
    _wait(lambda: not _holders(served, session), 15, "the session's caches to be released")


# -- protocol extras ----------------------------------------------------------------------------------------
def test_health_checking_and_reflection(served, client):
    assert client.health() == "SERVING"
    assert client.health("") == "SERVING"
    with pytest.raises(NotFound):
        client.health("no.such.Service")
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(served.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"specpool.v1.SpecPool", "grpc.health.v1.Health"} <= services, services


def test_metrics_endpoint_has_counters_per_drafter_and_tenant(served, client):
    tenant = f"metrics-{uuid.uuid4().hex[:6]}"
    client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, tenant=tenant)

    def scrape():
        text = urllib.request.urlopen(served.metrics_url, timeout=5).read().decode()
        lines = [line for line in text.splitlines() if f'tenant="{tenant}"' in line]
        return lines if any("specpool_rounds" in l for l in lines) and any("specpool_requests" in l for l in lines) else None

    lines = _wait(scrape, 60, f"specpool metrics of tenant {tenant} at {served.metrics_url}", interval=2)
    names = {line.split("{")[0] for line in lines}
    for metric in ("specpool_rounds", "specpool_draft_tokens", "specpool_accepted_tokens", "specpool_requests",
                   "specpool_block_divergence", "specpool_accepted_length", "specpool_round_seconds"):
        assert any(metric in name for name in names), (metric, sorted(names))
    assert any('part="verify"' in line for line in lines) and any('status="OK"' in line for line in lines)


def test_served_online_learning_loop(served, client, raw_redis, reference):
    """Issue 6 in served mode, end to end: the router sends each drafted round (with the target's
    top-K p) to the Redis stream; `specpool learner` consumes it and publishes the tenant's
    variant of the zoo drafter; the drafter replica then drafts that tenant's next request with the
    new version - one version for the whole request - and the answer is still the target's own.
    Other tenants keep the shipped weights; an opted-out tenant sends nothing."""
    from specpool.learning.model_store import DirectoryModelStore, VariantKey
    from specpool.cli.main import main

    stream = f"{served.namespace}:feedback"
    tenant = f"learn-{uuid.uuid4().hex[:6]}"

    def records_of(who: str, session: str) -> list:
        return feedback_records(raw_redis, stream, who, session)

    def ask(who: str, session: str, max_new_tokens: int = MAX_NEW):
        answer = client.generate(PROMPTS[1], max_new_tokens=max_new_tokens, session_id=session, tenant=who, policy="fixed:code")
        assert list(answer.token_ids) == reference(PROMPTS[1], max_new_tokens)  # lossless, whatever the weights
        return answer

    answer = ask(tenant, "before")
    records = _wait(lambda: records_of(tenant, "before"), 30, "feedback records in the stream")
    assert sum(len(r.draft) for r in records) == answer.stats.draft_tokens > 0  # every drafted round, once
    assert sum(r.accepted for r in records) == answer.stats.accepted_tokens
    assert all(r.drafter == "code" and r.version == 0 and len(r.target_ids) == len(r.draft) + 1 for r in records)
    ask("quiet", "silent", 8)
    assert records_of("quiet", "silent") == []

    assert main(["learner", "--once", "--redis", URL, "--stream", stream, "--drafters", "code",
                 "--store", str(served.store), "--publish-every", "4", "--no-progress"]) == 0
    serving = DirectoryModelStore(served.store).serving(VariantKey(tenant, "code"))
    assert serving is not None and serving >= 1  # learned and published

    ask(tenant, "after")
    after = _wait(lambda: records_of(tenant, "after"), 30, "feedback of the next request")
    assert {r.version for r in after} == {serving}  # the new version, for every round of the request
    ask("other", "elsewhere", 8)
    assert {r.version for r in _wait(lambda: records_of("other", "elsewhere"), 30, "other tenant's feedback")} == {0}
    assert _call(served.handles.router, "Feedback")["errors"] == 0


def test_a_separate_learner_process_promotes_a_version_and_loses_nothing_when_killed(served, client, raw_redis,
                                                                                      reference, tmp_path):
    """Issue 27 item 6, the Kubernetes topology on this machine: the router with feedback on,
    `specpool learner` in a process of its own (the learner Deployment) over the model store the
    drafter replica reads (the ReadWriteMany volume). A learned version is promoted and the next
    request is drafted with it; the learner SIGKILLed while records wait and started again applies
    every record (none lost, none twice) and leaves nothing pending in the consumer group."""
    from learner_helpers import LearnerProcess
    from specpool.learning.feedback_redis import RedisFeedbackStream
    from specpool.learning.model_store import DirectoryModelStore, VariantKey

    stream = f"{served.namespace}:feedback"
    tenant = f"proc-{uuid.uuid4().hex[:6]}"
    vkey = VariantKey(tenant, "code")
    store = DirectoryModelStore(served.store)
    args = ["--redis", URL, "--stream", stream, "--drafters", "code", "--store", str(served.store),
            "--publish-every", "4", "--consumer", "learner-0", "--no-progress"]

    def records(session: str | None = None) -> list:
        return feedback_records(raw_redis, stream, tenant, session)

    def ask(session: str):
        answer = client.generate(PROMPTS[1], max_new_tokens=MAX_NEW, session_id=session, tenant=tenant, policy="fixed:code")
        assert list(answer.token_ids) == reference(PROMPTS[1])  # lossless, whatever the weights
        return _wait(lambda: records(session), 30, f"feedback of {session}")

    ask("one")
    learner = LearnerProcess(tmp_path / "home", args)
    try:
        promoted = _wait(lambda: store.serving(vkey), 240, "the learner process to promote a version", interval=1)
        drafted = {r.version for r in ask("two")}
        assert len(drafted) == 1 and drafted.pop() >= promoted >= 1  # one learned version for the whole request
    finally:
        learner.process.send_signal(signal.SIGKILL)  # no goodbye: what an evicted pod gets after its grace period
        learner.process.wait(30)
    ask("three")  # its records wait in the stream while no learner runs
    feedback = RedisFeedbackStream(URL, stream=stream)
    try:
        assert feedback.backlog() + feedback.pending() > 0
        restarted = LearnerProcess(tmp_path / "home", args)
        try:
            _wait(lambda: feedback.backlog() == 0 and feedback.pending() == 0, 240,
                  "the restarted learner to consume and acknowledge every record", interval=1)
            applied = set(store.load_state(vkey)["applied"])
            every = [r.record_id for r in records()]
            assert len(every) == len(set(every)) and set(every) <= applied  # none lost, each once
        finally:
            restarted.process.send_signal(signal.SIGTERM)
            restarted.process.wait(60)
    finally:
        feedback.close()


def test_cli_client_generate(served, reference):
    proc = subprocess.run(
        [sys.executable, "-m", "specpool.cli.main", "client", "generate", PROMPTS[0], "--address", served.address,
         "--max-new-tokens", str(MAX_NEW), "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["token_ids"] == reference(PROMPTS[0])
    assert set(result) == {"text", "token_ids", "finish_reason", "stats", "session_id"}


# -- failover (last: they replace replicas) --------------------------------------------------------------------
def _kill_replica(handle) -> dict:
    """SIGKILL the replica's process (no graceful shutdown: an OOM kill, a lost machine); Serve
    then starts another."""
    old = _call(handle, "Replica")
    os.kill(old["pid"], signal.SIGKILL)
    return old


def test_a_session_survives_losing_the_target_replica_that_holds_its_cache(served, client, reference):
    """Mid-generation the target replica holding the session's KV cache dies; the round is retried
    on its replacement, which re-prefills from the full context: the answer is still exact."""
    session = f"survive-{uuid.uuid4().hex[:8]}"
    expected = reference(PROMPTS[2], 48)
    fallbacks = _call(served.handles.router, "Direct")["fallbacks"]
    tokens: list[int] = []
    killed = None
    for chunk in client.generate_stream(PROMPTS[2], max_new_tokens=48, session_id=session, timeout=300):
        tokens.extend(chunk.token_ids)
        if killed is None and len(tokens) >= 8:
            assert f"default/{session}" in _call(served.handles.target, "Sessions")
            killed = _kill_replica(served.handles.target)
    assert killed is not None
    assert tokens == expected
    assert _call(served.handles.target, "Replica")["replica_id"] != killed["replica_id"]
    # The session was on the dead replica's direct route; the router went back through Serve.
    assert _call(served.handles.router, "Direct")["fallbacks"] > fallbacks


def test_a_session_continues_after_its_router_replica_is_replaced(served, client, reference, raw_redis):
    tenant, session = f"fail-{uuid.uuid4().hex[:6]}", "s-1"
    key = f"{served.namespace}:{{{tenant}}}:session:{session}"
    first = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=session, tenant=tenant)
    assert first.token_ids == reference(PROMPTS[0])
    t1 = json.loads(raw_redis.get(key))["t"]
    old = _kill_replica(served.handles.router)

    def replaced():
        try:
            now = _call(served.handles.router, "Replica")
        except Exception:  # noqa: BLE001 - the old replica is gone and the new one not up yet
            return None
        return now if now["replica_id"] != old["replica_id"] else None

    _wait(replaced, 180, "Serve to replace the router replica", interval=1)
    second = client.generate(PROMPTS[1], max_new_tokens=MAX_NEW, session_id=session, tenant=tenant)
    assert second.token_ids == reference(PROMPTS[1])
    t2 = json.loads(raw_redis.get(key))["t"]
    # The new replica continued the session's bandit state from Redis: the round counter went on
    # from t1 (a fresh state would restart near 0). The last round may draft nothing (k capped to 0).
    assert t1 + second.stats.rounds - 1 <= t2 <= t1 + second.stats.rounds, (t1, t2, second.stats.rounds)
