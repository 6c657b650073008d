"""Why a session's verify calls miss the batches of the others: a trace the target keeps.

The target batches concurrent sessions' verify calls (``TargetServer.Verify``): a batch waits, up to
``batch_wait_timeout_s``, for a call from every session of the batch before it. In some served runs
eight sessions split into a group and sessions that verified alone for their whole request
(bench/results/ragged-batch/report.md, "Sessions out of phase"; what this trace then showed:
bench/results/batch-trace/report.md). A lone session's call missed the
group's batch, but the batch sizes alone do not say why: was it late (the router took longer than
the wait between this session's answer and its next call), or did it come another way (Serve's
handle rather than the same-node direct route)? This trace counts, per kind of batch (alone or
grouped) and per path of the call, how many calls there were and how long each session took to
come back, how many batches fired without every session they waited for, and how long the model
thread was busy with batches against idle between them while sessions were running.

Counters only (no samples), so a benchmark reads it before and after a level and subtracts
(``diff``). Every method runs on the replica's event loop; nothing here blocks.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Callable, Iterable

# Upper bounds (ms) of the return-gap buckets: the time between the target answering a session and
# that session's next call arriving (the router's own work and both transports in between).
GAP_BUCKETS_MS = (5, 10, 20, 50, 100, 200)
MAX_SESSIONS = 4096  # sessions remembered (their last answer and path); the least recent are forgotten


def gap_bucket(ms: float) -> str:
    """The bucket label of a gap: "<5", ..., "<200", ">=200"."""
    for bound in GAP_BUCKETS_MS:
        if ms < bound:
            return f"<{bound}"
    return f">={GAP_BUCKETS_MS[-1]}"


class BatchTrace:
    """Per call: its path ("direct" or "serve") and its return gap; per batch: alone or grouped,
    and whether it fired without a session it waited for. See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._answered: OrderedDict[str, float] = OrderedDict()  # session -> when its last answer left
        self._arrival: dict[str, tuple[str, float | None]] = {}  # session -> (path, gap ms) of its queued call
        self._path: OrderedDict[str, str] = OrderedDict()  # session -> path of its last call
        self.calls: Counter[str] = Counter()  # "alone direct", "grouped serve", ...
        self.gaps: Counter[str] = Counter()  # "alone <50", "grouped >=200", ...
        self.short_batches = 0  # batches that fired without a call from a session they waited for
        self.missed: Counter[str] = Counter()  # those missing sessions, by the path of their last call
        self.busy_s = 0.0  # from a batch firing to its forward's end (the model thread busy)
        self.idle_s = 0.0  # from a batch's end to the next one firing, when sessions are running
        self._fired: float | None = None
        self._ended: float | None = None

    def arrived(self, session: str, direct: bool) -> None:
        """A verify call of ``session`` came in (before any waiting)."""
        path = "direct" if direct else "serve"
        answered = self._answered.get(session)
        gap = (self._clock() - answered) * 1000.0 if answered is not None else None
        self._arrival[session] = (path, gap)
        _remember(self._path, session, path)

    def batch(self, sessions: Iterable[str], waited_for: Iterable[str]) -> None:
        """A batch of ``sessions`` fired; it waited for the sessions in ``waited_for``."""
        sessions = list(sessions)
        now = self._clock()
        if self._ended is not None and self._answered:
            # Idle only while some session is between rounds: the gap after a lone client's last
            # request (its session forgotten) is not the target's to fill.
            self.idle_s += now - self._ended
        self._fired, self._ended = now, None
        kind = "alone" if len(sessions) == 1 else "grouped"
        for session in sessions:
            path, gap = self._arrival.pop(session, ("serve", None))
            self.calls[f"{kind} {path}"] += 1
            if gap is not None:
                self.gaps[f"{kind} {gap_bucket(gap)}"] += 1
        missing = set(waited_for) - set(sessions)
        if missing:
            self.short_batches += 1
            for session in missing:
                self.missed[self._path.get(session, "serve")] += 1

    def ended(self) -> None:
        """The batch that fired last has finished its forward."""
        if self._fired is not None:
            self._ended = self._clock()
            self.busy_s += self._ended - self._fired
            self._fired = None

    def answered(self, session: str) -> None:
        """The target's answer to ``session``'s call is leaving now."""
        _remember(self._answered, session, self._clock())

    def forget(self, session: str) -> None:
        """The session's request ended: its next call (a new request) has no return gap."""
        self._answered.pop(session, None)

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "return_gap_ms": dict(self.gaps),
                "short_batches": self.short_batches, "missed_by_path": dict(self.missed),
                "busy_s": round(self.busy_s, 4), "idle_s": round(self.idle_s, 4)}


def _remember(table: OrderedDict, key: str, value) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_SESSIONS:
        table.popitem(last=False)


def diff(after: dict, before: dict) -> dict:
    """``after - before`` of two snapshots (counters that did not change are left out)."""
    out: dict = {}
    for key, value in after.items():
        if isinstance(value, dict):
            old = before.get(key) or {}
            out[key] = {k: v - old.get(k, 0) for k, v in value.items() if v - old.get(k, 0)}
        elif isinstance(value, float):
            out[key] = round(value - before.get(key, 0.0), 4)
        else:
            out[key] = value - before.get(key, 0)
    return out
