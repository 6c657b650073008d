"""Integration: faults injected into a real served instance mid-stream (issue 27, item 4).

Ray Serve on a local Ray cluster, the real default target, a pool of ``ngram`` and the ``code``
zoo drafter, gRPC on loopback, and the router's session store on a *private* ``redis-server``
this module starts (so it can be killed and restarted without touching the shared Redis).
One deployment for the module; short outputs.

- A drafter replica's process SIGKILLed mid-stream: the stream finishes, its tokens equal the
  embedded engine's, and the failure is counted in ``specpool_drafter_failures_total``.
- The router replica's process SIGKILLed mid-stream: the client gets UNAVAILABLE (the tokens it had
  are the right ones), Serve starts a new router, and a retry with the same session id finishes
  exactly, continuing the session's bandit state that the dead router had written to Redis.
- The router's Redis SIGKILLed mid-stream and restarted a few tokens later: the stream finishes
  exactly, and the session's bandit state holds every round once Redis is back (append-only file
  with ``appendfsync always``: what was written before the kill survives the restart).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from types import SimpleNamespace

import pytest
import redis

from specpool.services.client import SpecPoolClient
from serve_helpers import free_port as _free_port, wait_until as _wait, call as _call, embedded_greedy

pytestmark = pytest.mark.integration

POOL = ["ngram", "code"]
K = 5
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a loop."
MAX_NEW = 64


class PrivateRedis:
    """A redis-server of the test's own, on a free port, persisting every write before it answers."""

    def __init__(self, folder):
        self.port = _free_port()
        self.folder = folder
        self.process: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.folder), "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(self.answers, 20, f"redis-server on port {self.port}", interval=0.05)

    def answers(self) -> bool:
        try:
            return redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
        except redis.RedisError:
            return False

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True)


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.process.terminate()
        server.process.wait(10)


@pytest.fixture(scope="module")
def served(private_redis):
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    port, metrics_port = _free_port(), _free_port()
    config = default_serve_config(POOL, private_redis.url, port, k=K)
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"].update(redis_namespace="faults", http_api=False)
    local = start_local(plan_from_config(config, "the test config"), metrics_port=metrics_port,
                        progress=lambda m: print(f"[served] {m}", flush=True))
    from ray import serve

    handles = SimpleNamespace(router=serve.get_deployment_handle("Router", app_name="router"),
                              drafters={n: serve.get_deployment_handle("Drafter", app_name=f"drafter-{n}") for n in POOL})
    yield SimpleNamespace(local=local, address=local.address, handles=handles, metrics_url=local.metrics_url)
    local.shutdown()


@pytest.fixture(scope="module")
def client(served):
    with SpecPoolClient(served.address) as c:
        yield c


@pytest.fixture(scope="module")
def expected():
    return embedded_greedy(PROMPT, MAX_NEW, K, POOL)


def _replicas(app: str) -> list[str]:
    """The actor names of an application's replicas (Serve names them "SERVE_REPLICA::APP#...";
    the state API would need the dashboard, which the test's Ray runs without)."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and f"::{app}#" in a["name"]]


def _kill_replica(app: str) -> str:
    """SIGKILL the application's one replica process (found by its process title under this
    cluster's raylet, as the load test finds replicas): no graceful shutdown, no Ray involvement,
    the death of an OOM kill or a lost machine. Serve then starts another. Returns its actor name."""
    import os

    import ray
    from bench.loadtest import replica_processes

    (name,) = _replicas(app)
    pids = [pid for pid, group in replica_processes(ray.get_runtime_context().gcs_address).items()
            if group.split(":", 1)[0] == app]
    assert len(pids) == 1, f"expected one process of {app}, found {pids}"
    os.kill(pids[0], signal.SIGKILL)
    return name


def _failures(served, drafter: str) -> float:
    text = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if "specpool_drafter_failures" in line.split("{")[0] and f'drafter="{drafter}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_drafter_replica_killed_mid_stream_costs_no_token(served, client, expected):
    session = f"dkill-{uuid.uuid4().hex[:8]}"
    tokens: list[int] = []
    killed = None
    # fixed:code: every round asks the code drafter, so the rounds after the kill must do without it.
    for chunk in client.generate_stream(PROMPT, max_new_tokens=MAX_NEW, session_id=session, policy="fixed:code",
                                        timeout=300):
        tokens.extend(chunk.token_ids)
        if killed is None and len(tokens) >= 8:
            killed = _kill_replica("drafter-code")
    assert killed is not None
    assert tokens == expected
    _wait(lambda: _failures(served, "code") >= 1, 60, "specpool_drafter_failures_total{drafter=code} to count it", 2)

    _wait(lambda: [name for name in _replicas("drafter-code") if name != killed], 180,
          "Serve to replace the drafter replica", interval=2)
    _wait(lambda: _call(served.handles.drafters["code"], "Info"), 180, "the new drafter replica to answer", interval=2)
    # Once the cooldown is over the drafter is probed and drafts again: a new request is exact too.
    time.sleep(11)
    again = client.generate(PROMPT, max_new_tokens=MAX_NEW, session_id=f"{session}-2", policy="fixed:code", timeout=300)
    assert again.token_ids == expected and again.stats.draft_tokens > 0


def test_redis_killed_and_restarted_mid_stream_finishes_exactly_and_writes_the_state_back(
        served, client, expected, private_redis):
    tenant, session = "faults", f"rkill-{uuid.uuid4().hex[:8]}"
    key = f"faults:{{{tenant}}}:session:{session}"
    tokens: list[int] = []
    stats = None
    killed_at = restarted_at = None
    for chunk in client.generate_stream(PROMPT, max_new_tokens=MAX_NEW, session_id=session, tenant=tenant,
                                        timeout=300):
        tokens.extend(chunk.token_ids)
        if killed_at is None and len(tokens) >= 8:
            private_redis.kill()
            killed_at = len(tokens)
        elif killed_at is not None and restarted_at is None and len(tokens) >= killed_at + 12:
            private_redis.start()  # same port and folder: the append-only file brings back what was written
            restarted_at = len(tokens)
        if chunk.finish_reason:
            stats = chunk.stats
    assert killed_at is not None and restarted_at is not None, "the stream ended before the fault was injected"
    assert tokens == expected
    # The rounds played while Redis was gone are written once it answers again (at a later round of
    # the request, at its end, or at the next request): every round is in the state, once.
    store = private_redis.client()

    def written():
        raw = store.get(key)
        return json.loads(raw) if raw else None

    client.generate("Hello", max_new_tokens=4, session_id=f"other-{uuid.uuid4().hex[:6]}", tenant=tenant, timeout=120)
    state = _wait(written, 30, "the session's state to be written back")
    assert stats.rounds - 1 <= state["t"] <= stats.rounds, (state["t"], stats.rounds)


def test_a_router_replica_killed_mid_stream_gives_unavailable_and_a_retry_continues_the_session(
        served, client, expected, private_redis):
    from specpool.core.errors import SpecpoolError

    tenant, session = "faults", f"rtkill-{uuid.uuid4().hex[:8]}"
    key = f"faults:{{{tenant}}}:session:{session}"
    tokens: list[int] = []
    killed = None
    with pytest.raises(SpecpoolError) as info:
        for chunk in client.generate_stream(PROMPT, max_new_tokens=MAX_NEW, session_id=session, tenant=tenant,
                                            timeout=300):
            tokens.extend(chunk.token_ids)
            if killed is None and len(tokens) >= 8:
                killed = _kill_replica("router")
    assert killed is not None, "the stream ended before the router was killed"
    assert info.value.code == "UNAVAILABLE", (info.value.code, str(info.value))
    assert tokens == expected[: len(tokens)]  # what reached the client before the kill is right
    store = private_redis.client()
    before = json.loads(store.get(key))["t"]  # the dead router wrote the rounds it played
    assert before >= 1

    _wait(lambda: [name for name in _replicas("router") if name != killed], 180,
          "Serve to replace the router replica", interval=2)
    again = _wait(lambda: _retry(client, session, tenant), 180, "a retry to be answered by the new router", interval=2)
    assert again.token_ids == expected
    after = json.loads(store.get(key))["t"]
    assert after >= before + again.stats.rounds - 1, (before, again.stats.rounds, after)  # the state continued


def _retry(client, session: str, tenant: str):
    """The request again, same session; None while the new router is not reachable yet."""
    from specpool.core.errors import SpecpoolError

    try:
        return client.generate(PROMPT, max_new_tokens=MAX_NEW, session_id=session, tenant=tenant, timeout=300)
    except SpecpoolError as exc:
        if exc.code in ("UNAVAILABLE", "NOT_FOUND"):
            return None
        raise
