"""Integration: RedisSessionStore against a real Redis (127.0.0.1:6379, and a private
redis-server for the persistence test). No mocks. Every test writes under its own namespace and
deletes its keys afterwards; the shared server is otherwise left as it was.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis

from specpool.router import session_store
from specpool.core.errors import SpecpoolError, StoreUnavailable
from specpool.router.session_store import RedisSessionStore, SessionKey, SessionStore, open_store, tenant_key_pattern
from store_contract import CONTRACT, LosesRepliesAfterCommit, assert_exact_counts, run_concurrent

pytestmark = pytest.mark.integration

from redis_helpers import URL, connect_or_skip
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@pytest.fixture(scope="module")
def raw() -> redis.Redis:
    client = connect_or_skip(decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def namespace(raw: redis.Redis):
    ns = f"specpool-test-{uuid.uuid4().hex}"
    yield ns
    keys = list(raw.scan_iter(match=f"{ns}:*", count=1000))
    if keys:
        raw.delete(*keys)


@pytest.fixture
def store(namespace: str):
    s = RedisSessionStore(URL, namespace=namespace)
    yield s
    s.close()


@pytest.mark.parametrize("case", CONTRACT, ids=lambda case: case.__name__)
def test_contract(case, store: RedisSessionStore) -> None:
    case(store)


def test_is_a_session_store(store: RedisSessionStore) -> None:
    assert isinstance(store, SessionStore)
    assert store.describe == URL


def test_key_layout(store: RedisSessionStore, raw: redis.Redis, namespace: str) -> None:
    """The documented keys: one JSON string per session, one hash per tenant, '{tenant}' hash tag."""
    store.transact(SessionKey("acme", "conv:1"), lambda s: ({"n": 1}, {"chat:v2@x": {"n": 1.0, "s": 0.5}}))
    assert sorted(raw.scan_iter(match=f"{namespace}:*")) == [f"{namespace}:{{acme}}:arms", f"{namespace}:{{acme}}:session:conv:1"]
    assert raw.get(f"{namespace}:{{acme}}:session:conv:1") == '{"n":1}'
    assert raw.hgetall(f"{namespace}:{{acme}}:arms") == {"n:chat:v2@x": "1", "s:chat:v2@x": "0.5"}


def test_eight_threads_with_their_own_and_a_shared_store_lose_no_update(store: RedisSessionStore, namespace: str) -> None:
    own = [RedisSessionStore(URL, namespace=namespace) for _ in range(4)]
    try:
        # Threads 0, 2, 4, 6 each have a store (a client, a connection pool) of their own; threads
        # 1, 3, 5, 7 share one store: conflicts come from other processes and from other threads.
        stores = [own[i // 2] if i % 2 == 0 else store for i in range(8)]
        key = SessionKey("t1", "hot")
        calls = run_concurrent(stores, key, per_thread=200)
        assert all(c >= 200 for c in calls)
        assert_exact_counts(store, key, threads=8, per_thread=200)  # state n == 1600, stat n == 1600.0
    finally:
        for s in own:
            s.close()


def test_transact_retries_on_conflict_and_gives_up_under_endless_contention(
    store: RedisSessionStore, raw: redis.Redis, namespace: str, monkeypatch
) -> None:
    monkeypatch.setattr(session_store, "MAX_TRANSACT_TRIES", 5)
    key = SessionKey("t1", "s1")
    calls = []

    def fn(state):  # impure on purpose: another writer changes the session inside every attempt
        calls.append(state)
        raw.set(f"{namespace}:{{t1}}:session:s1", json.dumps({"other": len(calls)}))
        return {"mine": True}, {"code": {"n": 1.0}}

    with pytest.raises(SpecpoolError, match="contention on this session is too high"):
        store.transact(key, fn)
    assert calls == [None, {"other": 1}, {"other": 2}, {"other": 3}, {"other": 4}]  # each retry saw the newer state
    assert store.read(key) == ({"other": 5}, {})  # none of the five commits happened


def test_sessions_expire_in_redis(raw: redis.Redis, namespace: str) -> None:
    store = RedisSessionStore(URL, ttl_s=0.5, namespace=namespace)
    key = SessionKey("t1", "s1")
    store.transact(key, lambda s: ({"n": 1}, {"code": {"n": 1.0}}))
    assert 0 < raw.pttl(f"{namespace}:{{t1}}:session:s1") <= 500
    assert raw.pttl(f"{namespace}:{{t1}}:arms") > 6 * 24 * 3600 * 1000  # the tenant's: a week
    time.sleep(1.0)
    assert store.read(key) == (None, {"code": {"n": 1.0}})
    assert raw.exists(f"{namespace}:{{t1}}:session:s1") == 0
    store.close()


def test_state_survives_reopening_the_store(store: RedisSessionStore, namespace: str) -> None:
    key = SessionKey("t1", "s1")
    store.transact(key, lambda s: ({"n": 7, "xs": [0.5]}, {"code": {"n": 3.0}}))
    store.close()
    again = RedisSessionStore(URL, namespace=namespace)
    assert again.read(key) == ({"n": 7, "xs": [0.5]}, {"code": {"n": 3.0}})
    again.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_redis(port: int, folder) -> subprocess.Popen:
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
         "--appendonly", "yes", "--save", "", "--logfile", str(folder / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start: {(folder / 'redis.log').read_text()}")
            time.sleep(0.05)
        finally:
            client.close()


def test_state_survives_a_redis_server_restart(tmp_path) -> None:
    if not shutil.which(REDIS_SERVER):
        pytest.skip(f"{REDIS_SERVER} not found: install redis-server to test persistence")
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    procs = [_start_redis(port, tmp_path)]
    try:
        store = RedisSessionStore(url)
        key = SessionKey("t1", "s1")
        store.transact(key, lambda s: ({"n": 42}, {"code": {"n": 2.0, "s": 0.25}}))
        redis.Redis(port=port).shutdown()  # SHUTDOWN: fsyncs the append-only file and exits
        assert procs[0].wait(timeout=10) == 0
        with pytest.raises(StoreUnavailable, match=f"lost the connection to Redis at {url}"):
            store.read(key)
        procs.append(_start_redis(port, tmp_path))
        assert store.read(key) == ({"n": 42}, {"code": {"n": 2.0, "s": 0.25}})  # the old store reconnects
        store.close()
        fresh = RedisSessionStore(url)
        assert fresh.read(key) == ({"n": 42}, {"code": {"n": 2.0, "s": 0.25}})
        fresh.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)


@pytest.fixture
def tenant_user(raw: redis.Redis, namespace: str):
    """A Redis ACL user confined to tenant "a"'s keys; returns its store URL."""
    name, password = f"specpool-test-{uuid.uuid4().hex}", uuid.uuid4().hex
    raw.execute_command(
        "ACL", "SETUSER", name, "on", f">{password}", "resetkeys", f"~{tenant_key_pattern(namespace, 'a')}",
        "resetchannels", "+@all", "-@dangerous",
    )
    yield f"redis://{name}:{password}@127.0.0.1:6379/0", password
    raw.execute_command("ACL", "DELUSER", name)


def _assert_noperm(excinfo) -> None:
    assert excinfo.type is redis.exceptions.NoPermissionError or "NOPERM" in str(excinfo.value), excinfo.value


def test_tenant_acl_user_is_confined_to_its_tenant(store: RedisSessionStore, namespace: str, tenant_user) -> None:
    url, password = tenant_user
    mine, theirs = SessionKey("a", "s1"), SessionKey("b", "s1")
    store.transact(theirs, lambda s: ({"who": "b"}, {"code": {"n": 1.0}}))
    confined = RedisSessionStore(url, namespace=namespace)
    try:
        assert password not in confined.describe
        assert confined.transact(mine, lambda s: ({"who": "a"}, {"code": {"n": 2.0}})) == {"who": "a"}
        assert confined.read(mine) == ({"who": "a"}, {"code": {"n": 2.0}})
        confined.delete(mine)
        for touch in [
            lambda: confined.read(theirs),
            lambda: confined.transact(theirs, lambda s: ({"who": "a"}, {})),
            lambda: confined.delete(theirs),
        ]:
            with pytest.raises(redis.exceptions.ResponseError) as excinfo:
                touch()
            _assert_noperm(excinfo)
        assert store.read(theirs) == ({"who": "b"}, {"code": {"n": 1.0}})
        assert store.read(mine) == (None, {"code": {"n": 2.0}})
    finally:
        confined.close()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis://alice:hunter2@127.0.0.1:1/0?password=hunter2"])
def test_unreachable_redis_is_a_clear_store_unavailable(url: str) -> None:
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as excinfo:
        RedisSessionStore(url)
    assert time.monotonic() - start < 5
    message = str(excinfo.value)
    assert excinfo.value.code == "UNAVAILABLE"
    assert message.startswith("cannot reach Redis at redis://"), message
    assert "127.0.0.1:1/0" in message and "Connection refused" in message, message
    assert "--store memory" in message, message
    assert "hunter2" not in message
    assert excinfo.value.__cause__ is None and excinfo.value.__suppress_context__


def test_wrong_password_is_a_clear_store_unavailable(raw: redis.Redis) -> None:
    with pytest.raises(StoreUnavailable, match="rejected the credentials") as excinfo:
        RedisSessionStore(f"redis://nobody-{uuid.uuid4().hex}:hunter2@127.0.0.1:6379/0")
    assert "hunter2" not in str(excinfo.value)


def test_open_store_redis(raw: redis.Redis) -> None:
    store = open_store(URL, ttl_s=5.0)
    assert isinstance(store, RedisSessionStore) and store.describe == URL
    store.close()
    with pytest.raises(StoreUnavailable):
        open_store("redis://127.0.0.1:1/0")


class CommitThenLose(LosesRepliesAfterCommit, RedisSessionStore):
    """Redis, losing the replies of its next ``lose`` writes."""


def test_the_bandit_writes_each_round_behind_and_once_even_when_a_reply_is_lost(namespace: str) -> None:
    from specpool.router.bandit import BanditChooser, PendingWrites
    from specpool.router.loop import RoundRecord
    from specpool.router.policies import make_policy

    store = CommitThenLose(URL, namespace=namespace)
    assert store.write_behind
    key = SessionKey("t", "s")
    policy = make_policy("metasd-ucb", ["a", "b"])
    try:
        for request in range(2):
            pending = PendingWrites()  # a router each
            chooser = BanditChooser(policy, store, key, pending=pending)
            for i in range(10):
                choice = chooser.select()
                if i == 4:
                    store.lose = 1  # this round's write lands, then is reported lost, then retried
                chooser.update(RoundRecord(choice.drafter, 4, 4, 2, 3, 0.5, 0.0, 0.0, 0.05))
                if i == 4:
                    chooser._writes[-1].result()
                    pending._retry_at = 0.0  # the next round's write retries at once
            chooser.finish()
            state, tenant = store.read(key)
            assert pending.counts["write_failed"] == 1 and pending.sessions() == 0
            assert state["t"] == 10 * (request + 1), state
            assert sum(st["n"] for st in state["arms"].values()) == 10 * (request + 1)
            assert tenant["a"]["n"] + tenant["b"]["n"] == 10 * (request + 1)
            assert state["written"][pending.writer] == 10
    finally:
        store.close()
