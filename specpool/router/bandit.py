"""The bandit chooser: a policy (specpool/router/policies.py) over a session store (specpool/router/session_store.py).

One object per request. ``select`` reads the session's state in one atomic snapshot and lets the
policy pick; ``update`` applies the policy's pure update atomically in the store, together with the
tenant's aggregate statistics. State lives in the store, so a session continues on another router
(or after a restart) exactly where it left off.

Within a request, ``select`` after the first round picks from the state its own last ``update``
committed instead of reading it again: one store round trip less per round. Only a second request
of the same session running at the same time could have written since, and its update is not
lost (``transact`` applies every update to the stored state); this request just chooses without it.

A round whose proposal came from a part several arms share (``shared_sources``: prompt lookup,
which ``ngram`` and every ``lookup:SPEC`` arm run first) is credited to no arm: whichever arm was
played, the same lookup would have made the same proposal, so its reward says nothing about the
arms' differences and only adds noise (an arm played through a stretch of copied text would look
good for the copies). The policy's state is left as it was, so an arm that has not yet had a round
of its own is still unexplored.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specpool.router.loop import Choice, RoundRecord
from specpool.router.policies import ArmStats, Policy, parse_arm
from specpool.router.session_store import SessionKey, SessionStore


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
                 shared_sources: frozenset[str] = frozenset()):
        self.policy = policy
        self._pool = list(dict.fromkeys(parse_arm(a)[0] for a in policy.arms))  # the drafters the arms use
        self.shared_sources = shared_sources  # specpool.drafters.registry.shared_sources(pool)
        self.shared_rounds = 0  # rounds credited to no arm
        self.store = store
        self.key = key
        self.seed = seed
        self.trace: list[TraceEntry] | None = [] if trace else None
        self.overhead_s = 0.0  # wall time inside select/update: policy math + store round trips
        self._pending: str | None = None
        self._prior: ArmStats | None = None
        self._round = 0
        self._committed: dict | None = None  # the state this request's last update wrote
        self._selected_from: dict | None = None  # the state the pending choice was made from

    def _state(self, state: dict | None) -> dict:
        return state if state is not None else self.policy.init_state(self._prior)

    def select(self) -> Choice:
        started = time.perf_counter()
        if self._committed is not None:
            state = self._committed
        else:
            state, tenant_stats = self.store.read(self.key)
            if state is None:
                self._prior = tenant_stats if self.policy.warm is not None else None
            state = self._state(state)
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
        if (source is not None and source in self.shared_sources) or not self.policy.wants_replay(self._selected_from):
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

        def apply(state: dict | None) -> tuple[dict, ArmStats]:
            return self.policy.update(self._state(state), arm, record)

        credited = record.source is None or record.source not in self.shared_sources
        if credited:
            self._committed = self.store.transact(self.key, apply)
        else:
            self.shared_rounds += 1
        if self.trace is not None:
            leader = self.policy.leader(self._committed) if self._committed is not None else None
            self.trace.append(TraceEntry(self._round, arm, leader, credited))
        self._pending = None
        self.overhead_s += time.perf_counter() - started
