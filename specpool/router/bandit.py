"""The bandit chooser: a policy (specpool/router/policies.py) over a session store (specpool/router/session_store.py).

One object per request. ``select`` reads the session's state in one atomic snapshot and lets the
policy pick; ``update`` applies the policy's pure update atomically in the store, together with the
tenant's aggregate statistics. State lives in the store, so a session continues on another router
(or after a restart) exactly where it left off.

Within a request, ``select`` after the first round picks from the state its own last ``update``
committed instead of reading it again: one store round trip less per round. Only a second request
of the same session running at the same time could have written since, and its update is not
lost (``transact`` applies every update to the stored state); this request just chooses without it.

Written behind (a store with ``write_behind``, i.e. Redis): a round's write is two round trips
to the server, about 0.6 ms idle and more on a busy machine, so ``update`` hands it to the queue's
writer thread and the request drafts its next round meanwhile. The next choice is made from the
state the previous write stored (if it is back; it is, a round later, unless the store is slow)
with this round applied, which is what the stored state will be once this write lands; ``finish``
waits for the last write, so the session's next request reads every round. Same choices as
writing in the round, except that a concurrent request's rounds are seen one round later.

A round whose proposal came from a part several arms share (``shared_sources``: prompt lookup,
which ``ngram`` and every ``lookup:SPEC`` arm run first) is credited to no arm: whichever arm was
played, the same lookup would have made the same proposal, so its reward says nothing about the
arms' differences and only adds noise (an arm played through a stretch of copied text would look
good for the copies). The policy's state is left as it was, so an arm that has not yet had a round
of its own is still unexplored. Nor is a round the target verified without drafting for the hosted
arm played (``UNDRAFTED_SOURCE``: its load gate chose a plain batch): the arm did not fail, it was
not asked.

Store outages never fail a request (issue 27): the bandit only chooses which drafter drafts, and
the target decides every token, so a request can always finish on the state it holds.
- A failed read at the start: the request starts from a fresh state (counted, logged once).
- Every credited round is queued in ``PendingWrites`` (one per store, shared by the process's
  requests) and the queue is then written: a write that fails leaves the round queued, the
  request goes on from its own state (the round applied locally), and the queue is written again
  at a later round (at most every ``RETRY_AFTER_S``), at ``finish`` and when any later request of
  any session starts. A write applies the queued rounds *in order to the stored state*, with the
  policy of the request that played each, so nothing a concurrent writer stored is overwritten.
- Bounded: ``MAX_PENDING_SESSIONS`` sessions of ``MAX_PENDING_ROUNDS`` rounds; beyond, the oldest
  are dropped (counted).
- Exactly once: a write lost with the connection during EXEC may or may not have been applied,
  and it is retried. Each queued round carries a number (increasing per ``PendingWrites``, which
  has a random name), and the state records, under ``"written"``, the last number each of its
  ``WRITERS_KEPT`` latest writers applied; a retry skips the rounds the state already holds. The
  mark is in the same transaction as the rounds and the tenant's aggregate, so both count each
  round once. A queue writes one session at a time, so no later round can be stored before an
  earlier one (which the mark would then skip).
"""

from __future__ import annotations

import itertools
import logging
import random
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from specpool.core.errors import StoreUnavailable
from specpool.drafters.base import UNDRAFTED_SOURCE
from specpool.router.loop import Choice, RoundRecord
from specpool.router.policies import ArmStats, Policy, parse_arm
from specpool.router.session_store import SessionKey, SessionStore

logger = logging.getLogger(__name__)
MAX_PENDING_SESSIONS = 1024  # sessions with rounds not yet written, per store
MAX_PENDING_ROUNDS = 256  # rounds kept per such session (a few hundred bytes each)
RETRY_AFTER_S = 0.5  # a failed write is tried again no sooner (a round is ~75 ms on CPU; a dead
# Redis answers "connection refused" at once, but an unreachable one costs a connect timeout)
FLUSH_SESSIONS = 16  # other sessions' queued rounds a starting request writes (bounds its delay)
WRITERS_KEPT = 16  # writers (router processes) whose last written round a session's state remembers

# The policy that played it, its warm-start prior (for a session the store had no state for), the
# arm, what happened.
_Round = tuple[Policy, "ArmStats | None", str, RoundRecord]
_Queued = tuple[int, _Round]  # (the round's number within its PendingWrites, the round)


class PendingWrites:
    """Credited rounds not yet in the store, per session, oldest first: the rounds of requests that
    ran through a store outage. One per store (``pending_for``); thread-safe.

    ``on_event(kind)`` (the router's metrics) is told "read_failed", "write_failed", "written"
    (a queue that had waited through a failure reached the store) and "dropped" (over the bounds)."""

    def __init__(self, max_sessions: int = MAX_PENDING_SESSIONS, max_rounds: int = MAX_PENDING_ROUNDS,
                 clock: Callable[[], float] = time.monotonic):
        self.max_sessions = max_sessions
        self.max_rounds = max_rounds
        self.clock = clock
        self.counts = {"read_failed": 0, "write_failed": 0, "written": 0, "dropped": 0}
        self.on_event: Callable[[str], None] | None = None
        self.writer = secrets.token_hex(6)  # this queue's name in the "written" marks of the states it writes
        self._numbers = itertools.count(1)  # a session's rounds are queued, and so written, in this order
        self._queues: OrderedDict[SessionKey, list[_Queued]] = OrderedDict()
        self._failed: set[SessionKey] = set()  # queues that met a failure: a later write is a recovery
        self._retry_at = 0.0  # no write attempt before this (after a failure)
        self._lock = threading.Lock()
        self._writing: set[SessionKey] = set()  # sessions with a write in progress
        self._written = threading.Condition(self._lock)  # notified when one ends
        self._write_thread: ThreadPoolExecutor | None = None  # write_behind's (one thread)

    def count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[kind] += n
        if self.on_event is not None:
            for _ in range(n):
                self.on_event(kind)

    def sessions(self) -> int:
        with self._lock:
            return len(self._queues)

    def rounds(self, key: SessionKey) -> int:
        with self._lock:
            return len(self._queues.get(key, ()))

    def add(self, key: SessionKey, entry: _Round) -> None:
        with self._lock:
            number = next(self._numbers)
        self._put(key, [(number, entry)])

    def _put(self, key: SessionKey, entries: list[_Queued], failed: bool = False) -> None:
        """Queue ``entries`` after the session's queue, or, ``failed`` (a write's, taken back),
        before what was queued since they were taken: the queue stays in the order played."""
        dropped = 0
        with self._lock:
            queued = self._queues.pop(key, [])
            queue = entries + queued if failed else queued + entries
            if len(queue) > self.max_rounds:
                dropped += len(queue) - self.max_rounds
                queue = queue[-self.max_rounds:]
            self._queues[key] = queue
            if failed:
                self._failed.add(key)
            while len(self._queues) > self.max_sessions:
                old, lost = self._queues.popitem(last=False)
                self._failed.discard(old)
                dropped += len(lost)
        if dropped:
            logger.warning("bandit state: %d rounds not written to the store were dropped (over %d sessions "
                           "or %d rounds a session); the sessions go on from what the store holds",
                           dropped, self.max_sessions, self.max_rounds)
            self.count("dropped", dropped)

    def write(self, store: SessionStore, key: SessionKey, now: bool = False, wait: bool = True) -> dict | None:
        """Write the session's queued rounds (in order, in one transaction); the stored state
        after them, or None when nothing was queued or the store is (still) unavailable. Within
        ``RETRY_AFTER_S`` of a failure nothing is tried, unless ``now``.

        One write per session at a time, so its rounds reach the store in the order they were
        queued (the "written" marks rely on it): a write waits for the session's write in
        progress, or with ``wait=False`` leaves the session to it and returns None."""
        with self._lock:
            if not now and self.clock() < self._retry_at:
                return None
            if key in self._writing and not wait:
                return None
            while key in self._writing:
                self._written.wait()
            entries = self._queues.pop(key, None)
            if not entries:
                return None
            recovered = key in self._failed
            self._failed.discard(key)
            self._writing.add(key)
        try:
            return self._transact(store, key, entries, recovered)
        finally:
            with self._lock:
                self._writing.discard(key)
                self._written.notify_all()

    def write_behind(self, store: SessionStore, key: SessionKey) -> Future:
        """``write`` on this queue's writer thread (started on first use); the future's result is
        ``write``'s. One thread: a process's writes to one store queue up behind each other."""
        with self._lock:
            if self._write_thread is None:
                self._write_thread = ThreadPoolExecutor(1, thread_name_prefix="bandit-writes")
            thread = self._write_thread
        return thread.submit(self.write, store, key)

    def _transact(self, store: SessionStore, key: SessionKey, entries: list[_Queued], recovered: bool) -> dict | None:

        def apply(state: dict | None) -> tuple[dict, ArmStats]:
            marks = _written_marks(state)
            todo = [(n, r) for n, r in entries if n > marks.get(self.writer, 0)]  # not in it yet
            increments: ArmStats = {}
            for _, (policy, prior, arm, record) in todo:
                state, inc = policy.update(policy.adopt(state, prior), arm, record)
                for name, stats in inc.items():
                    total = increments.setdefault(name, {})
                    for stat, value in stats.items():
                        total[stat] = total.get(stat, 0.0) + value
            if todo:  # this writer's mark moves to the end: the oldest writers' marks go first
                marks.pop(self.writer, None)
                marks[self.writer] = todo[-1][0]
                state = {**state, "written": dict(list(marks.items())[-WRITERS_KEPT:])}  # type: ignore[dict-item]
            return state, increments  # type: ignore[return-value]

        try:
            state = store.transact(key, apply)
        except StoreUnavailable as exc:
            with self._lock:
                first = self._retry_at == 0.0  # the first failure since the store last took a write
                self._retry_at = self.clock() + RETRY_AFTER_S
            self._put(key, entries, failed=True)
            (logger.warning if first else logger.debug)(
                "bandit state of session %s/%s not written (%s); kept in memory and written when the store "
                "answers again", key.tenant, key.session, exc)
            self.count("write_failed")
            return None
        with self._lock:
            self._retry_at = 0.0
        if recovered:
            self.count("written")
        return state

    def write_others(self, store: SessionStore, limit: int = FLUSH_SESSIONS) -> None:
        """Write up to ``limit`` sessions' queues, oldest first; stop at the first failure."""
        with self._lock:  # a session being written is left to that write
            keys = [key for key in self._queues if key not in self._writing][:limit]
        for key in keys:
            if self.write(store, key, wait=False) is None and self.rounds(key):
                return


def _written_marks(state: dict | None) -> dict[str, int]:
    """A state's "written" marks (writer -> the number of its last round applied), oldest writer
    first; empty for a state without them or with malformed ones (they only prevent double counts)."""
    marks = state.get("written") if isinstance(state, dict) else None
    if not isinstance(marks, dict):
        return {}
    return {w: n for w, n in marks.items() if isinstance(w, str) and isinstance(n, int) and not isinstance(n, bool)}


# One queue per store object, for every request of the process that uses that store.
_PENDING: "weakref.WeakKeyDictionary[object, PendingWrites]" = weakref.WeakKeyDictionary()
_PENDING_LOCK = threading.Lock()


def pending_for(store: SessionStore) -> PendingWrites:
    """The queue of rounds not yet written to ``store`` (created on first use)."""
    with _PENDING_LOCK:
        pending = _PENDING.get(store)
        if pending is None:
            pending = _PENDING[store] = PendingWrites()
        return pending


@runtime_checkable
class ReplayPolicy(Protocol):
    """A policy that learns from replays (router/policies.ReplayUCB): whether, in a session's
    ``state``, it wants this round's side observations."""

    def wants_replay(self, state: dict) -> bool: ...


@dataclass(frozen=True)
class TraceEntry:
    """One round as the policy saw it: what it played and which arm it then believed best."""

    round: int  # the session's round counter t before this round
    arm: str
    leader: str | None  # argmax of the policy's estimates after the update
    credited: bool = True  # False: a shared-source round, not credited to the arm


class BanditChooser:
    """A ``DrafterChooser`` (and ``ReplayingChooser``) that asks a policy, with its state in a session store."""

    def __init__(self, policy: Policy, store: SessionStore, key: SessionKey, seed: int = 0, trace: bool = False,
                 shared_sources: frozenset[str] = frozenset(), pending: PendingWrites | None = None):
        self.policy = policy
        self._pool = list(dict.fromkeys(parse_arm(a)[0] for a in policy.arms))  # the drafters the arms use
        self.shared_sources = shared_sources  # specpool.drafters.registry.shared_sources(pool)
        self.shared_rounds = 0  # rounds credited to no arm
        self.store = store
        self.pending = pending if pending is not None else pending_for(store)  # rounds the store has not taken yet
        self.key = key
        self.seed = seed
        self.trace: list[TraceEntry] | None = [] if trace else None
        self.overhead_s = 0.0  # wall time inside select/update: policy math + store round trips
        self._pending: str | None = None
        self._prior: ArmStats | None = None
        self._round = 0
        self._committed: dict | None = None  # the state after this request's last round (as stored, or own in an outage)
        self._selected_from: dict | None = None  # the state the pending choice was made from
        self._behind = bool(getattr(store, "write_behind", False))  # write each round off the round's path
        self._writes: list[Future] = []  # (written behind) this request's writes not yet looked at, oldest first

    def _state(self, state: dict | None) -> dict:
        """The state as this policy reads it: a fresh one, or a stored one adopted (written
        under another policy, pool or fixed drafter: ``Policy.adopt``)."""
        return self.policy.adopt(state, self._prior)

    def _read(self) -> dict:
        """The session's state at the request's start, after writing what earlier requests left
        queued (its own session's first, so it continues from them); fresh when the store fails."""
        self.pending.write(self.store, self.key)
        self.pending.write_others(self.store)
        try:
            state, tenant_stats = self.store.read(self.key)
        except StoreUnavailable as exc:
            logger.warning("bandit state of session %s/%s unreadable (%s): this request starts from a fresh "
                           "state and its rounds are written when the store answers again",
                           self.key.tenant, self.key.session, exc)
            self.pending.count("read_failed")
            return self._state(None)
        if state is None:
            self._prior = tenant_stats if self.policy.warm is not None else None
        return self._state(state)

    def select(self) -> Choice:
        started = time.perf_counter()
        state = self._committed if self._committed is not None else self._read()
        self._round = int(state["t"])
        self._selected_from = state
        # A generator per (seed, session, round): the same seed repeats the same choices, and the
        # policy's draws never share a stream with acceptance sampling (specpool/target/sampling.py).
        rng = random.Random(f"policy:{self.seed}:{self.key.session}:{self._round}")
        self._pending = self.policy.select(state, rng)
        drafter, k = parse_arm(self._pending)
        self.overhead_s += time.perf_counter() - started
        return Choice(drafter, k)

    def replay_arms(self, source: str | None) -> list[str]:
        """The drafters to replay on this round's target tokens: while the policy wants side
        observations (router/policies.ReplayUCB), every drafter of the pool but the one played.
        A shared-source round is credited to no arm, so it is replayed by none either."""
        if not isinstance(self.policy, ReplayPolicy) or self._pending is None or self._selected_from is None:
            return []
        if not self._credits(source) or not self.policy.wants_replay(self._selected_from):
            return []
        played = parse_arm(self._pending)[0]
        return [d for d in self._pool if d != played]

    def update(self, record: RoundRecord) -> None:
        # A round with nothing to draft (k capped to 0 on the last token) says nothing about arms.
        if self._pending is None or record.drafter is None or record.k == 0:
            self._pending = None
            return
        started = time.perf_counter()
        arm = self._pending
        credited = self._credits(record.source)
        if credited:
            if self._behind:
                # The round goes on at once: the next choice is made from the state the last write
                # stored (other writers' rounds included) if it is back, else this request's own,
                # with this round applied; the write runs meanwhile on the queue's thread. The
                # last write is looked at before this round is queued, so it cannot hold it.
                stored = self._written_state()
                base = self._state(stored) if stored is not None else self._state(self._selected_from)
                self._committed = self.policy.update(base, arm, record)[0]
                self.pending.add(self.key, (self.policy, self._prior, arm, record))
                self._writes.append(self.pending.write_behind(self.store, self.key))
            else:
                self.pending.add(self.key, (self.policy, self._prior, arm, record))
                stored = self.pending.write(self.store, self.key)
                if stored is not None:
                    self._committed = self._state(stored)
                else:  # the store is out: go on from this request's own state, the round applied to it
                    self._committed = self.policy.update(self._state(self._selected_from), arm, record)[0]
        else:
            self.shared_rounds += 1
        if self.trace is not None:
            leader = self.policy.leader(self._committed) if self._committed is not None else None
            self.trace.append(TraceEntry(self._round, arm, leader, credited))
        self._pending = None
        self.overhead_s += time.perf_counter() - started

    def _credits(self, source: str | None) -> bool:
        """Whether a round whose proposal came from ``source`` is the played arm's (module docstring)."""
        return source is None or (source not in self.shared_sources and source != UNDRAFTED_SOURCE)

    def _written_state(self) -> dict | None:
        """The state this request's last write stored, if every write of it is over and the last
        reached the store (it holds the rounds before this one); None otherwise. Raises what a write
        raised beyond an outage (a refusal, endless contention), as a write in the round would have."""
        stored = None
        while self._writes and self._writes[0].done():
            stored = self._writes.pop(0).result()
        return None if self._writes else stored

    def finish(self) -> None:
        """At the request's end: wait for the writes still running, then try once more to write its
        rounds that a store outage held back (what still fails stays queued for the next
        request), so that the session's next request reads them. Never raises for the store."""
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()
        if self.pending.rounds(self.key):
            stored = self.pending.write(self.store, self.key, now=True)
            if stored is not None:
                self._committed = self._state(stored)
