"""The ``SessionStore`` contract, as plain functions of a store: every implementation's test module
runs all of ``CONTRACT`` against its own store (tests/unit for memory, tests/integration for Redis).

Importable as ``store_contract`` from any test folder: tests/conftest.py puts tests/ on sys.path.
"""

from __future__ import annotations

import threading

import pytest

from specpool.core.errors import SpecpoolError, StoreUnavailable
from specpool.router.session_store import SessionKey, SessionStore


class LosesRepliesAfterCommit:
    """Mixin over a real store: its next ``lose`` writes are applied and then reported lost, as when
    Redis dies between running an EXEC and its reply reaching the router."""

    lose = 0

    def transact(self, key, fn):
        state = super().transact(key, fn)
        if self.lose:
            self.lose -= 1
            raise StoreUnavailable(f"lost the connection to Redis at {self.describe} (Connection reset by peer); "
                                   "the update may or may not have been applied")
        return state


def counting_update(worker: str):
    """fn for transact: counts writes in the state (in total and per worker) and adds one to the
    tenant's "n" stat of arm "code"; the same input always gives the same output (pure)."""

    def fn(state):
        state = state or {"n": 0, "by": {}}
        by = dict(state["by"])
        by[worker] = by.get(worker, 0) + 1
        return {"n": state["n"] + 1, "by": by}, {"code": {"n": 1.0}}

    return fn


def run_concurrent(stores: list[SessionStore], key: SessionKey, per_thread: int) -> list[int]:
    """One thread per entry of ``stores`` (entries may repeat), each doing ``per_thread`` counting
    transacts on ``key``, all released together. Returns how often each thread's fn ran."""
    barrier = threading.Barrier(len(stores))
    calls = [0] * len(stores)
    errors: list[BaseException] = []

    def work(i: int, store: SessionStore) -> None:
        inner = counting_update(f"w{i}")

        def fn(state):
            calls[i] += 1
            return inner(state)

        try:
            barrier.wait()
            for _ in range(per_thread):
                store.transact(key, fn)
        except BaseException as exc:  # reported by the caller's assertion
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return calls


def assert_exact_counts(store: SessionStore, key: SessionKey, threads: int, per_thread: int) -> None:
    state, stats = store.read(key)
    assert state == {"n": threads * per_thread, "by": {f"w{i}": per_thread for i in range(threads)}}
    assert stats == {"code": {"n": float(threads * per_thread)}}


# ---- the contract -----------------------------------------------------------------------------


def absent_session_reads_none(store: SessionStore) -> None:
    assert store.read(SessionKey("t1", "s1")) == (None, {})


def transact_stores_state_and_adds_increments(store: SessionStore) -> None:
    key = SessionKey("t1", "s1")
    seen = []

    def fn(state):
        seen.append(state)
        n = (state or {}).get("n", 0) + 1
        return {"n": n, "hist": [n, 0.5], "nested": {"k": "v"}}, {"code": {"n": 1, "s": 0.75}, "chat:v2@ckpt": {"n": 2.0}}

    assert store.transact(key, fn) == {"n": 1, "hist": [1, 0.5], "nested": {"k": "v"}}
    assert store.transact(key, fn) == {"n": 2, "hist": [2, 0.5], "nested": {"k": "v"}}
    assert seen == [None, {"n": 1, "hist": [1, 0.5], "nested": {"k": "v"}}]
    state, stats = store.read(key)
    assert state == {"n": 2, "hist": [2, 0.5], "nested": {"k": "v"}}
    assert stats == {"code": {"n": 2.0, "s": 1.5}, "chat:v2@ckpt": {"n": 4.0}}


def tenant_stats_aggregate_over_sessions(store: SessionStore) -> None:
    for session, reward in [("s1", 0.25), ("s2", 0.5), ("conv:2024-01:x", 1.0)]:
        store.transact(SessionKey("t1", session), lambda s, r=reward: ({"r": r}, {"code": {"n": 1.0, "s": r}}))
    store.transact(SessionKey("t2", "s1"), lambda s: ({"r": 9}, {"code": {"n": 5.0}, "other": {"n": 1.0}}))
    assert store.read(SessionKey("t1", "never-written"))[1] == {"code": {"n": 3.0, "s": 1.75}}
    assert store.read(SessionKey("t2", "s1")) == ({"r": 9}, {"code": {"n": 5.0}, "other": {"n": 1.0}})


def tenants_with_the_same_session_id_are_independent(store: SessionStore) -> None:
    a, b = SessionKey("a", "shared"), SessionKey("b", "shared")
    store.transact(a, lambda s: ({"who": "a"}, {"code": {"n": 1.0}}))
    assert store.read(b) == (None, {})
    store.transact(b, lambda s: ({"who": "b", "saw": s}, {"chat": {"n": 1.0}}))
    assert store.read(a) == ({"who": "a"}, {"code": {"n": 1.0}})
    assert store.read(b) == ({"who": "b", "saw": None}, {"chat": {"n": 1.0}})
    store.delete(a)
    assert store.read(b)[0] == {"who": "b", "saw": None}


def failing_fn_leaves_everything_unchanged(store: SessionStore) -> None:
    key = SessionKey("t1", "s1")
    store.transact(key, lambda s: ({"n": 1, "xs": [1]}, {"code": {"n": 1.0}}))

    def fn(state):
        state["n"] = 99  # mutates its own copy, then fails
        state["xs"].append(2)
        raise RuntimeError("policy bug")

    with pytest.raises(RuntimeError, match="policy bug"):
        store.transact(key, fn)
    assert store.read(key) == ({"n": 1, "xs": [1]}, {"code": {"n": 1.0}})


BAD_UPDATES = [
    ({"x": object()}, {}),  # state not JSON
    ({"x": float("nan")}, {}),  # NaN is not JSON
    (["not", "a", "dict"], {}),
    ({"ok": 1}, {"code": {"n:bad": 1.0}}),  # stat name with ':'
    ({"ok": 1}, {"code": {"n": float("inf")}}),
    ({"ok": 1}, {"code": {"n": "1"}}),
    ({"ok": 1}, {"": {"n": 1.0}}),
    ({"ok": 1}, {"code": 1.0}),
]


def invalid_updates_store_nothing(store: SessionStore) -> None:
    key = SessionKey("t1", "s1")
    store.transact(key, lambda s: ({"n": 1}, {"code": {"n": 1.0}}))
    for new_state, increments in BAD_UPDATES:
        with pytest.raises(SpecpoolError):
            store.transact(key, lambda s, a=new_state, b=increments: (a, b))
        assert store.read(key) == ({"n": 1}, {"code": {"n": 1.0}}), (new_state, increments)


def stored_state_cannot_be_mutated_through_references(store: SessionStore) -> None:
    key = SessionKey("t1", "s1")
    mine = {"xs": [1], "d": {"k": 1}}
    returned = store.transact(key, lambda s: (mine, {}))
    mine["xs"].append("mine")
    returned["d"]["k"] = "returned"
    state, stats = store.read(key)
    state["xs"].append("read")
    stats["code"] = {"n": 1.0}
    assert store.read(key) == ({"xs": [1], "d": {"k": 1}}, {})


def states_are_json_round_tripped(store: SessionStore) -> None:
    key = SessionKey("t1", "s1")
    returned = store.transact(key, lambda s: ({"t": (1, 2), "f": 0.1, "u": "é", "none": None, "b": True}, {}))
    expected = {"t": [1, 2], "f": 0.1, "u": "é", "none": None, "b": True}
    assert returned == expected
    assert store.read(key)[0] == expected


def delete_forgets_the_session_not_the_tenant_stats(store: SessionStore) -> None:
    key, other = SessionKey("t1", "s1"), SessionKey("t1", "s2")
    store.transact(key, lambda s: ({"n": 1}, {"code": {"n": 1.0}}))
    store.transact(other, lambda s: ({"n": 2}, {}))
    store.delete(key)
    store.delete(SessionKey("t1", "never-written"))  # no error
    assert store.read(key) == (None, {"code": {"n": 1.0}})
    assert store.read(other)[0] == {"n": 2}
    assert store.transact(key, lambda s: ({"fresh": s is None}, {})) == {"fresh": True}


def concurrent_writers_lose_no_update(store: SessionStore) -> None:
    key = SessionKey("t1", "hot")
    calls = run_concurrent([store] * 4, key, per_thread=50)
    assert all(c >= 50 for c in calls)
    assert_exact_counts(store, key, threads=4, per_thread=50)


CONTRACT = [
    absent_session_reads_none,
    transact_stores_state_and_adds_increments,
    tenant_stats_aggregate_over_sessions,
    tenants_with_the_same_session_id_are_independent,
    failing_fn_leaves_everything_unchanged,
    invalid_updates_store_nothing,
    stored_state_cannot_be_mutated_through_references,
    states_are_json_round_tripped,
    delete_forgets_the_session_not_the_tenant_stats,
    concurrent_writers_lose_no_update,
]
