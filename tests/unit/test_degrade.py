"""Degrade, don't fail, never emit a wrong token (issue 27, item 4), with injected faults.

- A drafter deployment that dies (calls raise an exception Ray would, recognised by class name)
  or answers too slowly (past the caller's deadline) costs target-only rounds: the greedy output
  is the target's own, the failure is counted by reason, the drafter is skipped for a cooldown,
  then probed by one call and used again once it answers.
- A session store that is unavailable at a request's start, in its middle or through its end
  never fails it; the rounds it could not write are written, in order, when the store answers.
- A session's state written under one policy, pool or fixed drafter is adopted by another.

The drafter deployment is a stand-in for a Serve handle over a real local drafter (the real
``DeploymentCaller`` and ``RemoteDrafter`` in front of it); the target is the real local verifier
of the tiny test model; the store is the real in-memory store behind a switch that raises
``StoreUnavailable`` (what ``RedisSessionStore`` raises when Redis is gone).
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from specpool.core.errors import StoreUnavailable
from specpool.drafters.hf_model import HFModelDrafter
from specpool.router.bandit import BanditChooser, PendingWrites
from specpool.router.loop import FixedChooser, RoundRecord, speculative_generate
from specpool.router.policies import PolicyOptions, make_policy, parse_arm
from specpool.router.session_store import InMemorySessionStore, SessionKey
from specpool.services import convert
from specpool.services.remote import DeploymentCaller, RemoteDrafter
from specpool.target.sampling import SamplingParams
from specpool.v1 import common_pb2
from store_contract import LosesRepliesAfterCommit

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


class ActorDiedError(Exception):
    """Named as Ray's: ``status.is_unavailable`` recognises Ray's exceptions by class name."""


class FaultyDrafterHandle:
    """What ``DeploymentCaller`` uses of a Serve handle, ``options(...).remote(msg).result(timeout_s)``,
    serving a real drafter, with faults switched on and off by the test: ``dead`` (every call
    raises ActorDiedError) or ``delay_s`` (an answer that comes that late; ``result`` gives up at
    its timeout with TimeoutError, as Ray's does)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.dead = False
        self.delay_s = 0.0
        self.calls: list[str] = []

    def options(self, method_name: str, **_):
        handle = self

        class _Call:
            def remote(self, message):
                handle.calls.append(method_name)
                return _Response(method_name, message)

        class _Response:
            def __init__(self, method, message):
                self.method, self.message = method, message

            def result(self, timeout_s=None):
                if handle.delay_s:
                    if timeout_s is not None and handle.delay_s > timeout_s:
                        time.sleep(timeout_s)
                        raise TimeoutError("Timed out waiting for result")
                    time.sleep(handle.delay_s)
                if handle.dead:
                    raise ActorDiedError("The actor died unexpectedly before finishing this task.")
                return handle.serve(self.method, self.message)

        return _Call()

    def serve(self, method, message):
        if method == "Release":
            self.drafter.release(message.session_id)
            return common_pb2.ReleaseResponse(released=True)
        if method == "Propose":
            a = convert.propose_request_from_proto(message)
            return convert.proposal_to_proto(self.drafter.propose(a.session_id, a.context_ids, a.k, a.params))
        a = convert.replay_request_from_proto(message)
        return convert.replay_to_proto(self.drafter.replay(a.session_id, a.context_ids, a.continuation, a.k, a.params))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def remote_drafter(noisy_lm, clock=time.monotonic, timeout_s=0.3, cooldown_s=10.0):
    handle = FaultyDrafterHandle(HFModelDrafter("noisy", *noisy_lm))
    events: list[tuple[str, str]] = []
    caller = DeploymentCaller(handle, "drafter 'noisy'", retry_s=timeout_s, timeout_s=timeout_s)
    remote = RemoteDrafter("noisy", caller, None, cooldown_s=cooldown_s,
                           on_failure=lambda name, reason: events.append((name, reason)), clock=clock)
    return handle, remote, events


@pytest.fixture(scope="module")
def target_only(target_lm, prompts):
    from specpool.target.verifier import TargetVerifier

    verifier = TargetVerifier(*target_lm)
    return speculative_generate(prompts[0], session_id="ref", drafters={}, chooser=FixedChooser(None),
                                verifier=verifier, params=GREEDY, k=4).token_ids


def fault_after(rounds: int, fault, calls: list, seen: list):
    """An on_round callback that injects ``fault()`` after the given number of rounds, and notes
    in ``seen`` how many calls the deployment had had by the end of each round."""

    def on_round(record):
        seen.append(len(calls))
        if len(seen) == rounds:
            fault()
    return on_round


# -- drafters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault, reason", [("dead", "unavailable"), ("slow", "timeout")])
def test_a_drafter_that_dies_or_stalls_mid_request_costs_target_only_rounds(noisy_lm, verifier, prompts,
                                                                           target_only, fault, reason):
    handle, remote, events = remote_drafter(noisy_lm)

    def inject():
        if fault == "dead":
            handle.dead = True
        else:
            handle.delay_s = 5.0  # far past the 0.3 s deadline
    started, calls_by_round = time.monotonic(), []
    result = speculative_generate(prompts[0], session_id="s", drafters={"noisy": remote},
                                  chooser=FixedChooser("noisy"), verifier=verifier, params=GREEDY, k=4,
                                  on_round=fault_after(2, inject, handle.calls, calls_by_round))
    assert result.token_ids == target_only  # exact: the target's own greedy tokens
    assert sum(r.accepted for r in result.rounds[:2]) > 0  # it drafted (and was accepted) before the fault
    later = result.rounds[2:]
    assert later and all(r.proposed == 0 and r.accepted == 0 for r in later)  # then target-only rounds
    assert events == [("noisy", reason)] and remote.failures == {reason: 1}
    # One failed round (its call, retried within the deadline); every later round skipped the
    # drafter at once: it is down for the cooldown.
    assert remote.skipped == sum(1 for r in later if r.k > 0) - 1
    assert calls_by_round[1] == 2 and len(set(calls_by_round[2:])) == 1
    assert time.monotonic() - started < 30  # the deadline held: no 60 s of retries


def test_cooldown_then_one_probe_then_the_drafter_is_used_again(noisy_lm, prompts):
    clock = Clock()
    handle, remote, events = remote_drafter(noisy_lm, clock=clock, cooldown_s=10.0)
    context = prompts[0]
    assert remote.propose("s", context, 4, GREEDY).tokens  # up: it drafts
    handle.dead = True
    assert remote.propose("s", context, 4, GREEDY).tokens == []
    assert remote.failures == {"unavailable": 1}
    calls = len(handle.calls)  # the failed call's attempts included
    clock.now += 9.9
    assert remote.propose("s", context, 4, GREEDY).tokens == [] and remote.replay("s", context, [1], 4, GREEDY) is None
    remote.release("s")  # a down drafter holds nothing worth a wait
    assert remote.skipped == 3 and len(handle.calls) == calls
    clock.now += 0.2  # the cooldown is over: the next caller probes, the others still skip meanwhile
    assert remote.available() and not remote.available()
    clock.now += 5.0  # that probe's deadline passed unanswered: probe again (still dead: down again)
    assert remote.propose("s", context, 4, GREEDY).tokens == []
    assert remote.failures == {"unavailable": 2} and len(events) == 2
    handle.dead = False  # the replica is replaced
    clock.now += 10.1
    assert remote.propose("s", context, 4, GREEDY).tokens  # the probe answers: used again
    assert remote.propose("s", context, 4, GREEDY).tokens
    assert remote.failures == {"unavailable": 2}


def test_a_drafter_error_is_counted_and_marks_nothing_down(noisy_lm, prompts):
    handle, remote, events = remote_drafter(noisy_lm)
    handle.serve = lambda method, message: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory"))
    assert remote.propose("s", prompts[0], 4, GREEDY).tokens == []
    assert events == [("noisy", "error")] and remote.available()


def test_a_bandit_over_a_dead_drafter_finishes_exactly(noisy_lm, verifier, prompts, target_only):
    """ucb-replay over two arms, one dead from the start: proposals and replays of the dead one
    fail; the output is exact and the policy learns the dead arm is worth nothing."""
    live_handle, live, _ = remote_drafter(noisy_lm)
    dead_handle, dead, events = remote_drafter(noisy_lm)
    dead.name = "dead"
    dead_handle.dead = True
    store = InMemorySessionStore()
    chooser = BanditChooser(make_policy("ucb-replay", ["noisy", "dead"]), store, SessionKey("t", "s"))
    result = speculative_generate(prompts[0], session_id="s", drafters={"noisy": live, "dead": dead}, chooser=chooser,
                                  verifier=verifier, params=GREEDY, k=4)
    assert result.token_ids == target_only
    assert events and {reason for _, reason in events} == {"unavailable"}
    state, _ = store.read(SessionKey("t", "s"))
    assert state["arms"]["dead"]["s"] == 0.0 and state["arms"]["noisy"]["s"] > 0


# -- the session store -----------------------------------------------------------------------------
class SwitchedStore(InMemorySessionStore):
    """The real in-memory store, behind a switch: ``down`` makes every call raise StoreUnavailable."""

    def __init__(self):
        super().__init__()
        self.down = False
        self.refused = 0

    def _check(self):
        if self.down:
            self.refused += 1
            raise StoreUnavailable("lost the connection to Redis at redis://test (Connection refused)")

    def read(self, key):
        self._check()
        return super().read(key)

    def transact(self, key, fn):
        self._check()
        return super().transact(key, fn)


def rec(drafter="a", k=4, accepted=2, bd=0.5):
    return RoundRecord(drafter, k, k, accepted, accepted + 1, bd, 0.0, 0.0, 0.05)


def run_rounds(chooser: BanditChooser, n: int, during=None) -> list[str]:
    """n rounds of synthetic records; ``during(i)`` runs before round i's update."""
    played = []
    for i in range(n):
        choice = chooser.select()
        played.append(choice.drafter)
        if during is not None:
            during(i)
        chooser.update(rec(choice.drafter))
    chooser.finish()
    return played


def test_an_outage_mid_request_is_written_back_when_the_store_returns():
    store, pending = SwitchedStore(), PendingWrites()
    key = SessionKey("t", "s")
    policy = make_policy("metasd-ucb", ["a", "b"])
    run_rounds(BanditChooser(policy, store, key, pending=pending), 3)
    assert store.read(key)[0]["t"] == 3

    def outage(i):
        store.down = 2 <= i < 6  # down for rounds 2..5 of this request, back at round 6
        if i == 6:
            pending._retry_at = 0.0  # no real pause in a unit test: the next round retries
    chooser = BanditChooser(policy, store, key, pending=pending)
    run_rounds(chooser, 10, outage)
    state, tenant = store.read(key)
    assert state["t"] == 13 and sum(st["n"] for st in state["arms"].values()) == 13  # every round, once
    assert tenant["a"]["n"] + tenant["b"]["n"] == 13  # the tenant's aggregate too
    assert pending.counts["write_failed"] >= 1 and pending.counts["written"] == 1 and pending.sessions() == 0


def test_rounds_queued_through_an_outage_are_stored_in_the_order_played():
    def played(store, outage: bool) -> tuple[list[str], dict]:
        key, pending = SessionKey("t", "s"), PendingWrites()
        chooser = BanditChooser(make_policy("exp3", ["a", "b", "c"]), store, key, seed=3, pending=pending)

        def during(i):
            store.down = outage and 1 <= i < 9
            pending._retry_at = 0.0
        choices = []
        for i in range(12):
            drafter = chooser.select().drafter
            choices.append(drafter)
            during(i)
            chooser.update(rec(drafter, accepted={"a": 1, "b": 3, "c": 2}[drafter], bd={"a": 0.3, "b": 0.8, "c": 0.5}[drafter]))
        chooser.finish()
        state = store.read(key)[0]
        state.pop("written")
        return choices, state

    # Exp3's update depends on the state it is applied to: another order gives other weights.
    assert played(SwitchedStore(), outage=True) == played(SwitchedStore(), outage=False)


def test_a_store_down_from_start_to_end_loses_no_round_and_fails_nothing():
    store, pending = SwitchedStore(), PendingWrites()
    policy = make_policy("thompson", ["a", "b"])
    old = SessionKey("t", "old")
    run_rounds(BanditChooser(policy, store, old, pending=pending), 4)
    store.down = True
    key = SessionKey("t", "s")
    chooser = BanditChooser(policy, store, old, pending=pending)
    run_rounds(chooser, 5)  # read failed: a fresh state; every write failed
    assert chooser._committed["t"] == 5  # it went on from its own state
    run_rounds(BanditChooser(policy, store, key, pending=pending), 3)
    assert pending.counts["read_failed"] == 2 and pending.rounds(old) == 5 and pending.rounds(key) == 3
    store.down = False
    pending._retry_at = 0.0
    run_rounds(BanditChooser(policy, store, SessionKey("t", "other"), pending=pending), 1)  # any session's request
    assert pending.sessions() == 0
    assert store.read(old)[0]["t"] == 9  # the 4 stored before + the 5 of the outage, applied to the stored state
    assert store.read(key)[0]["t"] == 3


class CommitThenLoseStore(LosesRepliesAfterCommit, InMemorySessionStore):
    """The real in-memory store, losing the replies of its next ``lose`` writes."""


def test_a_write_applied_but_reported_lost_is_not_counted_twice_when_retried():
    store, pending = CommitThenLoseStore(), PendingWrites()
    key = SessionKey("t", "s")
    policy = make_policy("metasd-ucb", ["a", "b"])

    def lose(i):
        if i in (2, 5):
            store.lose = 1  # this round's write lands, then is reported lost
        pending._retry_at = 0.0  # no real pause in a unit test: every round retries
    run_rounds(BanditChooser(policy, store, key, pending=pending), 8, lose)
    state, tenant = store.read(key)
    assert pending.counts["write_failed"] == 2 and pending.sessions() == 0
    assert state["t"] == 8 and sum(st["n"] for st in state["arms"].values()) == 8  # every round, once
    assert tenant["a"]["n"] + tenant["b"]["n"] == 8  # the tenant's aggregate too
    assert state["written"] == {pending.writer: 8}


def test_written_marks_keep_each_writers_rounds_apart_and_only_the_latest_writers():
    from specpool.router.bandit import WRITERS_KEPT

    store = InMemorySessionStore()
    key = SessionKey("t", "s")
    policy = make_policy("metasd-ucb", ["a"])
    writers = [PendingWrites() for _ in range(WRITERS_KEPT + 2)]
    for pending in writers:  # a router each: their round numbers overlap, their names do not
        run_rounds(BanditChooser(policy, store, key, pending=pending), 2)
    state = store.read(key)[0]
    assert state["t"] == 2 * len(writers)
    assert list(state["written"]) == [p.writer for p in writers[-WRITERS_KEPT:]]
    assert set(state["written"].values()) == {2}


@pytest.mark.parametrize("marks", [None, "x", [1, 2], {"w": "3"}, {"w": True}])
def test_malformed_written_marks_are_ignored(marks):
    store, pending = InMemorySessionStore(), PendingWrites()
    key = SessionKey("t", "s")
    policy = make_policy("metasd-ucb", ["a"])
    run_rounds(BanditChooser(policy, store, key, pending=pending), 1)
    store.transact(key, lambda state: ({**state, "written": marks}, {}))
    run_rounds(BanditChooser(policy, store, key, pending=pending), 2)
    state = store.read(key)[0]
    assert state["t"] == 3 and state["written"] == {pending.writer: 3}


# -- written behind ------------------------------------------------------------------------------
class GatedStore(InMemorySessionStore):
    """The real in-memory store as a store written behind, whose writes (of session ``only``, if
    set) wait for ``gate`` (a slow Redis); ``entered`` is set when such a write has started."""

    write_behind = True

    def __init__(self, only: SessionKey | None = None):
        super().__init__()
        self.only = only
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def transact(self, key, fn):
        if self.only is None or key == self.only:
            self.entered.set()
            assert self.gate.wait(10), "the test never opened the gate"
        return super().transact(key, fn)


def test_written_behind_a_round_goes_on_during_its_write_and_finish_waits_for_every_round():
    store, pending = GatedStore(), PendingWrites()
    key = SessionKey("t", "s")
    chooser = BanditChooser(make_policy("metasd-ucb", ["a", "b"]), store, key, pending=pending)
    store.gate.clear()
    first = chooser.select()
    chooser.update(rec(first.drafter))  # returns with its write held at the gate
    assert store.entered.wait(10) and store.read(key)[0] is None
    for _ in range(3):  # chosen from the request's own state meanwhile
        chooser.update(rec(chooser.select().drafter))
    assert chooser._committed["t"] == 4 and store.read(key)[0] is None
    store.gate.set()
    chooser.finish()
    state, tenant = store.read(key)
    assert state["t"] == 4 and tenant["a"]["n"] + tenant["b"]["n"] == 4 and pending.sessions() == 0


@pytest.mark.parametrize("spec", ["metasd-ucb", "thompson", "ucb-discounted", "exp3", "ucb-replay"])
def test_written_behind_makes_the_choices_writing_in_the_round_makes(spec):
    def played(store) -> tuple[list[str], dict]:
        key = SessionKey("t", "s")
        policy = make_policy(spec, ["a", "b", "c"])
        choices = []
        for _ in range(3):  # three requests of one session
            chooser = BanditChooser(policy, store, key, seed=7, pending=PendingWrites())
            for _ in range(12):
                drafter = chooser.select().drafter
                choices.append(drafter)
                chooser.update(rec(drafter, accepted={"a": 1, "b": 3, "c": 2}[drafter], bd={"a": 0.3, "b": 0.8, "c": 0.5}[drafter]))
            chooser.finish()
        state = store.read(key)[0]
        state.pop("written")  # the writers' random names
        return choices, state

    behind = GatedStore()
    assert played(behind) == played(InMemorySessionStore())
    assert behind.entered.is_set()


def test_written_behind_an_outage_mid_request_is_written_back_when_the_store_returns():
    class SwitchedBehind(SwitchedStore):
        write_behind = True

    store, pending = SwitchedBehind(), PendingWrites()
    key = SessionKey("t", "s")
    policy = make_policy("metasd-ucb", ["a", "b"])
    chooser = BanditChooser(policy, store, key, pending=pending)

    def outage(i):
        for write in chooser._writes:
            write.result()  # the last rounds' writes are over before the switch moves
        store.down = 2 <= i < 6
        pending._retry_at = 0.0
    run_rounds(chooser, 10, outage)
    state, tenant = store.read(key)
    assert state["t"] == 10 and tenant["a"]["n"] + tenant["b"]["n"] == 10
    assert pending.counts["write_failed"] >= 1 and pending.counts["written"] == 1 and pending.sessions() == 0


def test_written_behind_a_refused_write_still_fails_the_request_even_when_later_writes_overtook_it():
    from specpool.core.errors import SpecpoolError

    class Refusing(GatedStore):
        refuse = True

        def transact(self, key, fn):
            if self.refuse:
                self.refuse = False
                self.entered.set()
                assert self.gate.wait(10)
                raise SpecpoolError("NOPERM this user has no permissions to access the key")
            return super().transact(key, fn)

    store = Refusing()
    chooser = BanditChooser(make_policy("metasd-ucb", ["a", "b"]), store, SessionKey("t", "s"), pending=PendingWrites())
    store.gate.clear()
    chooser.update(rec(chooser.select().drafter))  # its write is refused, once the gate opens
    assert store.entered.wait(10)
    chooser.update(rec(chooser.select().drafter))  # queued behind it
    store.gate.set()
    with pytest.raises(SpecpoolError, match="NOPERM"):
        chooser.finish()


def test_one_write_per_session_at_a_time_and_others_do_not_wait_for_it():
    key, other = SessionKey("t", "s"), SessionKey("t", "o")
    store, pending = GatedStore(only=key), PendingWrites()
    policy = make_policy("metasd-ucb", ["a"])
    pending.add(key, (policy, None, "a", rec()))
    store.gate.clear()
    first = pending.write_behind(store, key)
    assert store.entered.wait(10)
    pending.add(key, (policy, None, "a", rec()))
    pending.add(other, (policy, None, "a", rec()))
    pending.write_others(store)  # writes the other session, leaves this one to its write in progress
    assert store.read(other)[0]["t"] == 1 and pending.rounds(key) == 1
    # The session's own second write waits for the first (its round must not be stored first).
    second = threading.Thread(target=pending.write, args=(store, key))
    second.start()
    time.sleep(0.05)
    assert second.is_alive() and pending.rounds(key) == 1
    store.gate.set()
    first.result(10)
    second.join(10)
    assert store.read(key)[0]["t"] == 2 and store.read(other)[0]["t"] == 1


def test_pending_writes_are_bounded():
    store, pending = SwitchedStore(), PendingWrites(max_sessions=2, max_rounds=3)
    store.down = True
    policy = make_policy("metasd-ucb", ["a"])
    for session in ("s1", "s2", "s3"):
        run_rounds(BanditChooser(policy, store, SessionKey("t", session), pending=pending), 4)
    assert pending.sessions() == 2 and pending.rounds(SessionKey("t", "s3")) == 3
    assert pending.counts["dropped"] == 3 * 1 + 3  # one round over the cap in each session, then s1's 3


# -- policy switches ---------------------------------------------------------------------------------
SPECS = ["metasd-ucb", "ucb-be", "thompson", "ucb-replay", "fixed:b", "metasd-ucb+warm", "thompson+warm",
         "ucb-cost", "ucb-cost-k", "ucb-discounted", "exp3", "sequential-halving", "random"]


@pytest.mark.parametrize("first", SPECS)
@pytest.mark.parametrize("second", SPECS)
def test_a_session_used_under_one_policy_then_another_works(first, second):
    store = InMemorySessionStore()
    key = SessionKey("t", "s")
    pools = (["a", "b"], ["b", "c"])  # the pool changes too: "a" leaves, "c" arrives
    p1, p2 = make_policy(first, pools[0]), make_policy(second, pools[1])
    run_rounds(BanditChooser(p1, store, key), 6)
    before = store.read(key)[0]
    played = run_rounds(BanditChooser(p2, store, key, seed=1), 6)
    assert {parse_arm(a)[0] for a in played} <= set(pools[1])
    after = store.read(key)[0]
    assert set(p2.arms) <= set(after["arms"])
    if p1.reward == p2.reward:  # the counts continue; an arm of the old pool is kept for later
        assert after["t"] == before["t"] + 6
        assert set(before["arms"]) <= set(after["arms"])
    else:  # sums of another reward are not this policy's: a fresh state
        assert after["t"] == 6 and set(after["arms"]) == set(p2.arms)
    run_rounds(BanditChooser(p1, store, key, seed=2), 2)  # and back


@pytest.mark.parametrize("stored", [None, [], {"t": "x"}, {"t": 1, "arms": {"a": {"n": "1"}}}, {"t": 3, "arms": []}])
def test_a_malformed_stored_state_starts_fresh(stored):
    policy = make_policy("exp3", ["a", "b"])
    assert policy.adopt(stored) == policy.init_state()


def test_adopting_keeps_what_was_learned_about_shared_arms():
    ucb = make_policy("metasd-ucb", ["a", "b"])
    state = ucb.init_state()
    for arm, bd in [("a", 0.9), ("b", 0.1), ("a", 0.8)]:
        state, _ = ucb.update(state, arm, rec(arm, bd=bd))
    fixed = make_policy("fixed:b", ["a", "b"])
    state, _ = fixed.update(fixed.adopt(state), "b", rec("b", bd=0.2))
    back = ucb.adopt(state)
    assert back["arms"]["a"] == state["arms"]["a"] and back["arms"]["a"]["n"] == 2.0 and back["t"] == 4
    assert ucb.leader(back) == "a"
    halving = make_policy("sequential-halving", ["b", "c"])
    adopted = halving.adopt(back)
    assert adopted["survivors"] == ["b", "c"] and halving.select(adopted, random.Random(0)) in ("b", "c")
    warm = make_policy("metasd-ucb+warm", ["a", "c"], PolicyOptions())
    seeded = warm.adopt(back, {"c": {"n": 100.0, "bd": 70.0}})
    assert seeded["arms"]["c"]["n"] > 0  # an arriving arm gets the tenant's warm start
