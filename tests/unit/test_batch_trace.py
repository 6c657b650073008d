"""The target's batch trace (specpool/services/batch_trace.py): counters of why a session's verify
calls miss the other sessions' batches, diffable between two snapshots."""

from __future__ import annotations

import pytest

from specpool.services.batch_trace import GAP_BUCKETS_MS, MAX_SESSIONS, BatchTrace, diff, gap_bucket


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("ms, label", [(0.0, "<5"), (4.99, "<5"), (5.0, "<10"), (49.0, "<50"), (199.9, "<200"),
                                       (200.0, ">=200"), (5000.0, ">=200")])
def test_gap_buckets(ms, label):
    assert gap_bucket(ms) == label
    assert GAP_BUCKETS_MS == tuple(sorted(GAP_BUCKETS_MS))


def test_a_group_and_a_lone_late_session():
    clock = Clock()
    trace = BatchTrace(clock)
    # Round 1: a and b arrive (first calls: no return gap) and are batched together, both over Serve.
    trace.arrived("a", direct=False)
    trace.arrived("b", direct=False)
    trace.batch(["a", "b"], waited_for=set())
    trace.answered("a")
    trace.answered("b")
    # Round 2: a comes back 8 ms later over the direct route; b is 120 ms late, and a's batch fired
    # without it (it waited for a and b).
    clock.now += 0.008
    trace.arrived("a", direct=True)
    trace.batch(["a"], waited_for={"a", "b"})
    clock.now += 0.112
    trace.arrived("b", direct=True)
    trace.batch(["b"], waited_for={"a"})
    snap = trace.snapshot()
    assert snap["calls"] == {"grouped serve": 2, "alone direct": 2}
    assert snap["return_gap_ms"] == {"alone <10": 1, "alone <200": 1}
    assert snap["short_batches"] == 2
    assert snap["missed_by_path"] == {"direct": 1, "serve": 1}  # b's last call was over Serve then; a's direct


def test_a_finished_request_has_no_return_gap_and_memory_is_bounded():
    clock = Clock()
    trace = BatchTrace(clock)
    trace.arrived("a", direct=True)
    trace.batch(["a"], waited_for=set())
    trace.answered("a")
    trace.forget("a")  # the request ended; a new request of the same session id starts later
    clock.now += 5.0
    trace.arrived("a", direct=True)
    trace.batch(["a"], waited_for=set())
    assert trace.snapshot()["return_gap_ms"] == {}
    for i in range(MAX_SESSIONS + 10):
        trace.arrived(f"s{i}", direct=False)
        trace.batch([f"s{i}"], waited_for=set())
        trace.answered(f"s{i}")
    assert len(trace._answered) == MAX_SESSIONS and len(trace._path) == MAX_SESSIONS and not trace._arrival


def test_diff_subtracts_every_counter():
    clock = Clock()
    trace = BatchTrace(clock)
    trace.arrived("a", direct=False)
    trace.batch(["a"], waited_for={"b"})
    before = trace.snapshot()
    trace.answered("a")
    clock.now += 0.03
    trace.arrived("a", direct=True)
    trace.arrived("b", direct=True)
    trace.batch(["a", "b"], waited_for={"a"})
    assert diff(trace.snapshot(), before) == {"calls": {"grouped direct": 2}, "return_gap_ms": {"grouped <50": 1},
                                               "short_batches": 0, "missed_by_path": {}, "busy_s": 0.0, "idle_s": 0.0}


def test_busy_and_idle_time_of_the_model_thread():
    clock = Clock()
    trace = BatchTrace(clock)
    trace.arrived("a", direct=False)
    trace.batch(["a"], waited_for=set())  # fires at 100.0
    clock.now += 0.2
    trace.ended()  # a 200 ms forward
    trace.answered("a")
    clock.now += 0.05  # a comes back 50 ms later: idle, a session is between rounds
    trace.arrived("a", direct=True)
    trace.batch(["a"], waited_for={"a"})
    clock.now += 0.1
    trace.ended()
    trace.answered("a")
    trace.forget("a")  # the request ended
    clock.now += 3.0  # nobody running: not the target's idle time
    trace.arrived("b", direct=False)
    trace.batch(["b"], waited_for=set())
    clock.now += 0.1
    trace.ended()
    trace.ended()  # a second end without a batch counts nothing
    snap = trace.snapshot()
    assert snap["busy_s"] == pytest.approx(0.4) and snap["idle_s"] == pytest.approx(0.05)


def test_bench_served_reports_the_trace_per_level():
    from bench.served import trace_table

    levels = [{"sessions": 1, "batch_trace": None},
              {"sessions": 8, "batch_trace": {"calls": {"grouped direct": 700, "alone serve": 2}, "short_batches": 3,
                                              "return_gap_ms": {"grouped <20": 600, "grouped >=200": 4, "alone <5": 1},
                                              "missed_by_path": {"direct": 5}, "busy_s": 30.0, "idle_s": 10.0}}]
    lines = trace_table(levels)
    rows = [line for line in lines if line.startswith("| 8 ")]
    assert rows == ["| 8 | alone serve 2, grouped direct 700 | <5 1 | <20 600, >=200 4 | 3 | direct 5 | 75% (30.0 s of 40.0) |"]
    assert trace_table([{"sessions": 1}]) == []  # a target without the trace: no table
