"""InMemorySessionStore: the shared store contract, TTL and LRU, id validation, open_store."""

from __future__ import annotations

import pytest

from specpool.core.errors import InvalidArgument
from specpool.router.session_store import (
    InMemorySessionStore,
    SessionKey,
    SessionStore,
    open_store,
    tenant_key_pattern,
)
from store_contract import CONTRACT, assert_exact_counts, run_concurrent


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def put(store, session: str, value: int = 1, tenant: str = "t1") -> None:
    store.transact(SessionKey(tenant, session), lambda s: ({"v": value}, {"code": {"n": 1.0}}))


@pytest.mark.parametrize("case", CONTRACT, ids=lambda case: case.__name__)
def test_contract(case) -> None:
    case(InMemorySessionStore())


def test_is_a_session_store() -> None:
    store = InMemorySessionStore()
    assert isinstance(store, SessionStore)
    assert store.describe == "memory"


def test_sessions_expire_ttl_after_the_last_write() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(ttl_s=10.0, clock=clock)
    key = SessionKey("t1", "s1")
    put(store, "s1", 1)  # expires at 1010
    clock.now += 9
    assert store.read(key)[0] == {"v": 1}  # reads do not refresh the TTL ...
    put(store, "s1", 2)  # ... writes do: now it expires at 1019
    clock.now += 9
    assert store.read(key)[0] == {"v": 2}
    clock.now += 1
    assert store.read(key) == (None, {"code": {"n": 2.0}})  # expired; tenant stats stay
    assert len(store) == 0
    seen = []
    store.transact(key, lambda s: (seen.append(s) or {"v": 3}, {}))
    assert seen == [None]  # an expired state is not handed to fn


def test_writes_drop_expired_sessions() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(ttl_s=5.0, clock=clock)
    for i in range(3):
        put(store, f"old{i}")
    clock.now += 5.0
    put(store, "new")
    assert len(store) == 1


def test_least_recently_written_session_is_evicted() -> None:
    store = InMemorySessionStore(max_sessions=3)
    for session in ["s1", "s2", "s3"]:
        put(store, session)
    put(store, "s1", 2)  # s1 is now the most recent
    put(store, "s4")
    assert len(store) == 3
    assert store.read(SessionKey("t1", "s2")) == (None, {"code": {"n": 5.0}})  # evicted; stats kept
    assert [store.read(SessionKey("t1", s))[0] for s in ["s1", "s3", "s4"]] == [{"v": 2}, {"v": 1}, {"v": 1}]


def test_many_threads_lose_no_update() -> None:
    store = InMemorySessionStore()
    key = SessionKey("t1", "hot")
    calls = run_concurrent([store] * 8, key, per_thread=200)
    assert calls == [200] * 8  # under one lock, fn runs exactly once per transact
    assert_exact_counts(store, key, threads=8, per_thread=200)


@pytest.mark.parametrize("tenant", ["", "a:*", "../b", "a b", "a{b}", "-a", "x" * 65, "a\n", "é", None, 7])
def test_bad_tenant_ids_are_rejected(tenant) -> None:
    with pytest.raises(InvalidArgument, match="invalid tenant id"):
        SessionKey(tenant, "s1")


@pytest.mark.parametrize("session", ["", "*", "s/../x", "s*", "{s}", ":s", "x" * 129, "s\n", None])
def test_bad_session_ids_are_rejected(session) -> None:
    with pytest.raises(InvalidArgument, match="invalid session id"):
        SessionKey("t1", session)


@pytest.mark.parametrize("tenant, session", [("a" * 64, "s" * 128), ("acme-corp.eu_1", "conv:2024-01-01:abc_def.1")])
def test_longest_and_punctuated_ids_are_accepted(tenant, session) -> None:
    key = SessionKey(tenant, session)
    assert (key.tenant, key.session) == (tenant, session)  # kept verbatim, not normalised
    store = InMemorySessionStore()
    put(store, session, value=7, tenant=tenant)
    state, _ = store.read(key)
    assert state == {"v": 7}


def test_tenant_key_pattern() -> None:
    assert tenant_key_pattern("specpool", "acme-1") == "specpool:{acme-1}:*"
    with pytest.raises(InvalidArgument):
        tenant_key_pattern("specpool", "a*")
    with pytest.raises(InvalidArgument):
        tenant_key_pattern("spec{pool}", "a")


def test_open_store_memory() -> None:
    store = open_store("memory", ttl_s=12.0)
    assert isinstance(store, InMemorySessionStore)
    assert store.ttl_s == 12.0


@pytest.mark.parametrize("spec", ["bogus", "", "Memory", "http://127.0.0.1:6379", "redis//:hunter2@host"])
def test_open_store_rejects_unknown_specs(spec) -> None:
    with pytest.raises(InvalidArgument, match="use 'memory' or a Redis URL") as excinfo:
        open_store(spec)
    assert "hunter2" not in str(excinfo.value)


def test_constructor_validates_limits() -> None:
    with pytest.raises(InvalidArgument):
        InMemorySessionStore(ttl_s=0)
    with pytest.raises(InvalidArgument):
        InMemorySessionStore(max_sessions=0)
