"""The target's batch gate (specpool/services/batch_gate.py) on a plain event loop: which verify
calls make a batch, when the batch is released, and that the gate never stays shut."""

from __future__ import annotations

import asyncio

import pytest

from specpool.services.batch_gate import BatchGate

WAIT = 0.05


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 10))


async def one_batch(gate: BatchGate, sessions: list[str]) -> None:
    """What the target does with a released batch: fire, forward, answer each call."""
    gate.fired(sessions)
    await asyncio.sleep(0)
    gate.forward_done()
    for session in sessions:
        gate.answer_left(session)


def test_the_last_batchs_sessions_are_released_together_the_moment_all_have_joined():
    async def scenario():
        gate = BatchGate(8, wait_s=10.0)  # the wait never runs out here
        gate.expected = {"a", "b", "c"}
        loop = asyncio.get_running_loop()
        started = loop.time()
        joins = [asyncio.ensure_future(gate.join(s)) for s in ("a", "b")]
        await asyncio.sleep(0.02)
        assert not any(j.done() for j in joins) and gate.is_open  # waiting for c
        joins.append(asyncio.ensure_future(gate.join("c")))
        assert await asyncio.gather(*joins) == [3, 3, 3]
        assert loop.time() - started < 1.0 and not gate.is_open
    run(scenario)


def test_a_session_that_does_not_come_back_costs_one_wait():
    async def scenario():
        gate = BatchGate(8, wait_s=WAIT)
        gate.expected = {"a", "b"}
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await gate.join("a") == 1
        assert WAIT * 0.9 <= loop.time() - started < WAIT + 0.5
    run(scenario)


def test_a_full_batch_is_released_and_later_calls_wait_for_its_answers():
    async def scenario():
        gate = BatchGate(2, wait_s=10.0)
        gate.expected = {"a", "b", "c"}
        first = [asyncio.ensure_future(gate.join(s)) for s in ("a", "b")]
        assert await asyncio.gather(*first) == [2, 2]
        late = asyncio.ensure_future(gate.join("c"))
        await asyncio.sleep(0.02)
        assert not late.done()  # released: shut
        gate.fired(["a", "b"])
        gate.forward_done()
        await asyncio.sleep(0.02)
        assert not late.done()  # forward over, answers not yet left: still shut
        gate.answer_left("a")
        await asyncio.sleep(0.02)
        assert not late.done()
        gate.answer_left("b")
        # c now opens an assembly that waits for a and b (the last batch)
        await asyncio.sleep(0.02)
        assert gate.expected == {"a", "b"} and not late.done()
        both = [asyncio.ensure_future(gate.join(s)) for s in ("a", "b")]
        # the capacity (2) is reached by c and a: b waits at the shut gate for the next batch
        assert await late == 2 and await both[0] == 2
        await asyncio.sleep(0.02)
        assert not both[1].done()
        both[1].cancel()
    run(scenario)


def test_the_end_of_a_request_releases_an_assembly_waiting_for_it():
    async def scenario():
        gate = BatchGate(8, wait_s=10.0)
        gate.expected = {"a", "b"}
        join = asyncio.ensure_future(gate.join("a"))
        await asyncio.sleep(0.02)
        assert not join.done()
        gate.request_ended("b")
        assert await join == 1 and gate.expected == {"a"}
    run(scenario)


def test_a_cancelled_call_leaves_the_assembly_and_does_not_open_a_shut_gate():
    async def scenario():
        gate = BatchGate(8, wait_s=WAIT)
        gate.expected = {"a", "b", "c"}
        a = asyncio.ensure_future(gate.join("a"))
        b = asyncio.ensure_future(gate.join("b"))
        await asyncio.sleep(0)
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        gate.answer_left("b")  # the call's finally: it never was in a batch
        assert await a == 1  # released after the wait without b
        assert not gate.is_open
        waiting = asyncio.ensure_future(gate.join("c"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.answer_left("c")
        assert not gate.is_open  # a's batch has not even fired
        await one_batch(gate, ["a"])
        assert gate.is_open
    run(scenario)


def test_an_assembly_whose_members_were_all_cancelled_releases_nothing():
    async def scenario():
        gate = BatchGate(8, wait_s=WAIT)
        gate.expected = {"a", "b"}
        a = asyncio.ensure_future(gate.join("a"))
        await asyncio.sleep(0)
        a.cancel()
        await asyncio.sleep(WAIT * 2)
        assert gate.is_open and gate._assembly is None  # released nothing, shut nothing
        assert await gate.join("b") == 1  # b is expected, a is not there: released after the wait
    run(scenario)


def test_the_gate_opens_anyway_when_a_batch_never_answers_or_never_fires():
    async def scenario():
        gate = BatchGate(8, wait_s=WAIT, fallback_s=0.1)
        gate.expected = {"a"}
        assert await gate.join("a") == 1
        gate.fired(["a", "ghost"])
        gate.forward_done()
        gate.answer_left("a")  # "ghost" never answers
        assert not gate.is_open
        await asyncio.sleep(0.2)
        assert gate.is_open
        assert await gate.join("a") == 1  # expected: a and ghost; ghost never comes: after the wait
        assert not gate.is_open  # released, and its calls never reach the batch
        await asyncio.sleep(0.2)
        assert gate.is_open
    run(scenario)


def test_a_stale_fallback_does_not_open_the_gate_of_a_later_batch():
    async def scenario():
        gate = BatchGate(8, wait_s=WAIT, fallback_s=0.1)
        gate.expected = {"a"}
        assert await gate.join("a") == 1  # released: a fallback is set for it
        gate.fired(["a"])  # ... and it fired, so that fallback must do nothing
        await asyncio.sleep(0.15)
        assert not gate.is_open  # the forward is still running
        gate.forward_done()
        gate.answer_left("a")
        assert gate.is_open
    run(scenario)


def test_a_retried_call_of_a_waiting_session_does_not_orphan_the_first():
    """A router that gave up on a call and retried it: both calls of the session are released (the
    target's batch then verifies both, or the first one's caller has gone)."""
    async def scenario():
        gate = BatchGate(8, wait_s=WAIT)
        gate.expected = {"a", "b"}
        first = asyncio.ensure_future(gate.join("a"))
        await asyncio.sleep(0)
        retry = asyncio.ensure_future(gate.join("a"))
        assert await asyncio.gather(first, retry) == [2, 2]
    run(scenario)
