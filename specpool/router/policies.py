"""Drafter-selection policies: which arm (drafter, or drafter with a draft length) each round uses.

Pure math over a JSON-serialisable state dict, so the same policy runs against the in-memory store
and Redis (specpool/router/session_store.py), and a router restart loses nothing. A policy is a frozen
config object with four pure functions:

    init_state(prior)            fresh state; ``prior`` = the tenant's aggregated arm stats (warm start)
    select(state, rng)           the arm to play next (rng: a seeded ``random.Random``; Convention 7)
    update(state, arm, record)   the state after observing one round, plus the tenant increments
    leader(state)                the arm the policy currently believes best (for rounds-to-identify)

Rewards (MetaSD, Kim et al. 2024, "Unified Framework for Speculative Decoding with Multiple
Drafters as a Bandit"): *block divergence* BD = (1/k) Σ_j (1 − TV(p_j, q_j)) over the k positions
asked for (positions the drafter did not propose count as TV = 1), and *block efficiency* BE =
accepted count, here as accepted/k so both live in [0, 1]. BD sees every drafted position, even those
after the first rejection, so it has lower variance than BE and separates arms in fewer rounds.
A third, cost-aware reward is tokens per second of round time ("rate"): a cheap drafter with slightly
lower acceptance can win on it. Rate has no natural scale, so it is normalised at selection time by
the best arm's mean rate; the stored sums stay raw.

Every round adds ``{arm: {"n": 1, "bd": ..., "be": ..., "rate": ...}}`` to the tenant's statistics
whatever the policy, so any policy can warm-start a new session from them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from specpool.core.defaults import DEFAULT_BETA, DEFAULT_PROBE_ROUNDS
from specpool.core.errors import InvalidArgument, NotFound, check
from specpool.router.loop import RoundRecord
from specpool.router.session_store import ArmStats
REWARDS = ("bd", "be", "rate")
ARM_K_SEPARATOR = "@"  # arm name of a (drafter, k) pair: "code@3"


# -- arms and rewards -----------------------------------------------------------------------------


def arm_name(drafter: str, k: int | None = None) -> str:
    return drafter if k is None else f"{drafter}{ARM_K_SEPARATOR}{k}"


def parse_arm(name: str) -> tuple[str, int | None]:
    """``"code@3"`` -> ("code", 3); ``"code"`` -> ("code", None)."""
    drafter, sep, k = name.rpartition(ARM_K_SEPARATOR)
    if sep and k.isdigit():
        return drafter, int(k)
    return name, None


def round_rewards(record: RoundRecord) -> dict[str, float]:
    """All three rewards of one drafted round. ``k`` is the length asked for, so a drafter that
    proposes fewer tokens (an n-gram miss) is charged for the positions it left empty."""
    k = max(record.k, 1)
    bd = (record.bd or 0.0) * record.proposed / k  # mean over proposed -> mean over the k asked
    return {
        "bd": bd,
        "be": record.accepted / k,
        "rate": record.emitted / record.round_s if record.round_s > 0 else 0.0,
    }


# -- shared helpers ---------------------------------------------------------------------------------


def _means(state: dict, reward: str, arms: Sequence[str]) -> dict[str, float | None]:
    """Empirical mean reward of each of ``arms`` (None for an arm never played), normalised for
    ``rate``. Only the policy's own arms: a state may also hold arms of another pool (``adopt``)."""
    means = {a: (st["s"] / st["n"] if st["n"] > 0 else None) for a in arms for st in (state["arms"][a],)}
    if reward == "rate":
        top = max((m for m in means.values() if m is not None), default=0.0)
        means = {a: (m / top if m is not None and top > 0 else m) for a, m in means.items()}
    return means


def _argmax(values: Mapping[str, float]) -> str:
    """Highest value; ties go to the earliest arm (dicts keep the pool's order), so runs repeat."""
    best, best_value = None, -math.inf
    for arm, value in values.items():
        if value > best_value:
            best, best_value = arm, value
    return best  # type: ignore[return-value]


def _sample(weights: Mapping[str, float], rng: random.Random) -> str:
    u = rng.random() * sum(weights.values())
    for arm, w in weights.items():
        u -= w
        if u < 0:
            return arm
    return next(reversed(weights))  # float round-off: the last arm


def _counts_state(arms: Sequence[str], reward: str, prior: ArmStats | None, warm: "WarmStart | None") -> dict:
    """{"t", "reward", "arms": {arm: {"n", "s"}}}, optionally seeded from the tenant's statistics.
    "reward" names what the sums "s" add up, so a policy on another reward never reads them (``adopt``)."""
    state = {"t": 0, "reward": reward, "arms": {a: {"n": 0.0, "s": 0.0} for a in arms}}
    if warm is not None and prior:
        for a in arms:
            stats = prior.get(a)
            if not stats or stats.get("n", 0.0) <= 0:
                continue
            # Down-weighted: the tenant's mean counts as at most ``cap`` rounds of evidence, so a
            # session whose domain differs from the tenant's usual one overrides it quickly.
            n = min(warm.cap, warm.weight * stats["n"])
            state["arms"][a] = {"n": n, "s": n * stats.get(reward, 0.0) / stats["n"]}
        state["t"] = sum(st["n"] for st in state["arms"].values())
    return state


def _valid_counts(state: object) -> bool:
    """Whether ``state`` has the shape every policy's counts share: {"t": number, "arms": {arm: {"n", "s"}}}."""
    if not isinstance(state, dict) or not isinstance(state.get("arms"), dict):
        return False
    if isinstance(state.get("t"), bool) or not isinstance(state.get("t"), (int, float)):
        return False
    return all(isinstance(st, dict) and all(isinstance(st.get(x), (int, float)) and not isinstance(st.get(x), bool)
                                            for x in ("n", "s")) for st in state["arms"].values())


def _add(state: dict, arm: str, reward: float, discount: float = 1.0) -> dict:
    arms = {a: dict(st) for a, st in state["arms"].items()}
    if discount != 1.0:
        for st in arms.values():
            st["n"] *= discount
            st["s"] *= discount
    arms[arm]["n"] += 1.0
    arms[arm]["s"] += reward
    return {**state, "t": state["t"] + 1, "arms": arms}


# -- policies -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmStart:
    """Tenant warm start: a new session starts from the tenant's per-arm means, each worth
    ``weight`` × the tenant's rounds on that arm, at most ``cap`` rounds."""

    weight: float = 0.05
    cap: float = 4.0


@dataclass(frozen=True)
class Policy:
    """Base: arms, the reward it learns from, and an optional warm start."""

    name: str
    arms: tuple[str, ...]
    reward: str = "bd"
    warm: WarmStart | None = None

    def init_state(self, prior: ArmStats | None = None) -> dict:
        return _counts_state(self.arms, self.reward, prior, self.warm)

    def adopt(self, state: dict | None, prior: ArmStats | None = None) -> dict:
        """A stored state made fit for this policy: the session may have been used under another
        policy, pool or fixed drafter (a request names its own), or written by an older version.

        - none, malformed, or its sums of another reward (BD sums are no BE sums, and "rate" has
          no scale at all): a fresh state, as for a new session;
        - same reward: kept; arms of this pool it lacks get fresh stats (the warm start's if
          any); arms it has beyond this pool are *kept*, unplayed and unselected here, so what
          the session learned about them survives a detour through a smaller pool or a
          ``fixed:`` request (they are bounded by the drafters served). A state written before
          states named their reward is taken as this policy's.
        Subclasses fill their own fields (``_adopt_extra``)."""
        if not _valid_counts(state) or state.get("reward", self.reward) != self.reward:  # type: ignore[union-attr]
            return self.init_state(prior)
        fresh = self.init_state(prior)
        arms = {a: dict(st) for a, st in state["arms"].items()}  # type: ignore[index]
        for a in self.arms:
            arms.setdefault(a, fresh["arms"][a])
        return self._adopt_extra({**state, "reward": self.reward, "arms": arms}, fresh)  # type: ignore[dict-item]

    def _adopt_extra(self, state: dict, fresh: dict) -> dict:
        return state

    def select(self, state: dict, rng: random.Random) -> str:
        raise NotImplementedError

    def update(self, state: dict, arm: str, record: RoundRecord) -> tuple[dict, ArmStats]:
        rewards = round_rewards(record)
        return _add(state, arm, rewards[self.reward]), {arm: {"n": 1.0, **rewards}}

    def leader(self, state: dict) -> str | None:
        means = {a: m for a, m in _means(state, self.reward, self.arms).items() if m is not None}
        return _argmax(means) if means else None


@dataclass(frozen=True)
class UCB(Policy):
    """UCB1 (Auer et al. 2002) as MetaSD-UCB uses it: every arm once, then
    a_t = argmax_i μ̂_i + β·sqrt(2 ln t / n_i)."""

    beta: float = DEFAULT_BETA

    def select(self, state: dict, rng: random.Random) -> str:
        for arm in self.arms:
            if state["arms"][arm]["n"] <= 0:
                return arm
        means = _means(state, self.reward, self.arms)
        log_t = math.log(max(self._rounds(state), 1.0))
        return _argmax({a: means[a] + self.beta * math.sqrt(2.0 * log_t / state["arms"][a]["n"]) for a in self.arms})

    def _rounds(self, state: dict) -> float:
        return state["t"]


@dataclass(frozen=True)
class ReplayUCB(UCB):
    """UCB on block efficiency with side observations: for the first ``probe_rounds`` rounds of a
    session, every other drafter of the pool is *replayed* on the target's tokens of the round
    (teacher-forced, one forward each: specpool.drafters.base.Replayable) and credited the accepted count
    it would have had, as if it had been played too. A greedy round's target tokens are what any
    arm would have been checked against, so this is what that arm's round would have scored,
    except that it is capped at the tokens the target emitted (a lower bound for an arm better
    than the one played; the played arm's own count is exact, so the comparison leans towards
    the arm in play, never away from it).

    Why BE and not BD: BD also scores the positions after the first rejection, which only the
    arm actually played has; replayed arms have exactly the accepted count. Why only a few
    rounds: each replay is one drafter forward (~4 ms on a 2-core CPU against a ~75 ms round),
    worth paying while the arms are unknown, not once one clearly leads. The probe replaces
    "every arm once": arms replayed are no longer unexplored. Sampled requests get no replays
    (a sampled draft is not determined by the context) and run as plain UCB on BE."""

    probe_rounds: int = DEFAULT_PROBE_ROUNDS

    def init_state(self, prior: ArmStats | None = None) -> dict:
        # Probe rounds are counted apart from t, which a warm start seeds with the prior's weight.
        return {**super().init_state(prior), "probed": 0}

    def _adopt_extra(self, state: dict, fresh: dict) -> dict:
        probed = state.get("probed")
        return state if isinstance(probed, int) and not isinstance(probed, bool) else {**state, "probed": 0}

    def wants_replay(self, state: dict) -> bool:
        return state.get("probed", 0) < self.probe_rounds

    def update(self, state: dict, arm: str, record: RoundRecord) -> tuple[dict, ArmStats]:
        new, increments = super().update(state, arm, record)
        new["probed"] = state.get("probed", 0) + (1 if record.replays is not None else 0)
        if record.replays:
            k = max(record.k, 1)
            arms = {a: dict(st) for a, st in new["arms"].items()}
            for other, accepted in record.replays.items():
                if other in arms and other != arm:
                    arms[other]["n"] += 1.0
                    arms[other]["s"] += min(accepted, k) / k
            new = {**new, "arms": arms}
        return new, increments


@dataclass(frozen=True)
class DiscountedUCB(UCB):
    """Discounted UCB (Garivier & Moulines 2011): counts and sums decay by γ each round, so old
    evidence fades and a domain change inside one long session is tracked (window ≈ 1/(1-γ))."""

    gamma: float = 0.99

    def _rounds(self, state: dict) -> float:
        return sum(st["n"] for st in state["arms"].values())  # the discounted round count

    def update(self, state: dict, arm: str, record: RoundRecord) -> tuple[dict, ArmStats]:
        rewards = round_rewards(record)
        return _add(state, arm, rewards[self.reward], self.gamma), {arm: {"n": 1.0, **rewards}}


@dataclass(frozen=True)
class Thompson(Policy):
    """Thompson sampling with Beta posteriors; a reward r in [0, 1] counts as r successes and
    1 − r failures (Agrawal & Goyal 2012's trick for bounded rewards, without the Bernoulli draw)."""

    def select(self, state: dict, rng: random.Random) -> str:
        draws = {a: rng.betavariate(1.0 + st["s"], 1.0 + max(st["n"] - st["s"], 0.0))
                 for a in self.arms for st in (state["arms"][a],)}
        return _argmax(draws)


@dataclass(frozen=True)
class Exp3(Policy):
    """Exp3 (Auer et al. 2002), for adversarial rewards: p_i = (1−γ)·w_i/Σw + γ/K, and the played
    arm's log-weight grows by γ·(r/p_i)/K. Log-weights keep long sessions from overflowing."""

    gamma: float = 0.1

    def init_state(self, prior: ArmStats | None = None) -> dict:
        state = super().init_state(prior)
        state["logw"] = {a: 0.0 for a in self.arms}
        return state

    def _adopt_extra(self, state: dict, fresh: dict) -> dict:
        logw = state.get("logw")
        logw = {a: w for a, w in logw.items() if isinstance(w, (int, float))} if isinstance(logw, dict) else {}
        return {**state, "logw": {**{a: 0.0 for a in self.arms}, **logw}}

    def probabilities(self, state: dict) -> dict[str, float]:
        top = max(state["logw"][a] for a in self.arms)
        w = {a: math.exp(state["logw"][a] - top) for a in self.arms}
        total, k = sum(w.values()), len(self.arms)
        return {a: (1.0 - self.gamma) * w[a] / total + self.gamma / k for a in self.arms}

    def select(self, state: dict, rng: random.Random) -> str:
        return _sample(self.probabilities(state), rng)

    def update(self, state: dict, arm: str, record: RoundRecord) -> tuple[dict, ArmStats]:
        p = self.probabilities(state)[arm]  # the state has not changed since select
        new, increments = super().update(state, arm, record)
        logw = dict(state["logw"])
        logw[arm] += self.gamma * (round_rewards(record)[self.reward] / p) / len(self.arms)
        return {**new, "logw": logw}, increments

    def leader(self, state: dict) -> str | None:
        return _argmax({a: state["logw"][a] for a in self.arms}) if state["t"] > 0 else None


@dataclass(frozen=True)
class SequentialHalving(Policy):
    """Sequential halving (Karnin, Koren & Somekh 2013): ⌈log2 K⌉ phases over an exploration budget
    of ``budget`` rounds; in each phase every surviving arm is played ⌊budget / (|S|·⌈log2 K⌉)⌋ times
    (at least once) and the better half survives. Then the last survivor is played for good."""

    budget: int = 0  # 0: 2·K·⌈log2 K⌉ rounds

    def _phases(self) -> int:
        return max(1, math.ceil(math.log2(len(self.arms))))

    def _pulls(self, survivors: int) -> int:
        budget = self.budget or 2 * len(self.arms) * self._phases()
        return max(1, budget // (survivors * self._phases()))

    def init_state(self, prior: ArmStats | None = None) -> dict:
        state = super().init_state(prior)
        state["survivors"] = list(self.arms)
        state["phase_pulls"] = {a: 0 for a in self.arms}
        return state

    def _adopt_extra(self, state: dict, fresh: dict) -> dict:
        # Survivors of another pool are not this pool's: the halving restarts unless it ran over
        # exactly these arms.
        survivors, pulls = state.get("survivors"), state.get("phase_pulls")
        if (not isinstance(survivors, list) or not survivors or not set(survivors) <= set(self.arms)
                or not isinstance(pulls, dict) or set(pulls) != set(self.arms)):
            return {**state, "survivors": fresh["survivors"], "phase_pulls": fresh["phase_pulls"]}
        return state

    def select(self, state: dict, rng: random.Random) -> str:
        survivors = state["survivors"]
        if len(survivors) == 1:
            return survivors[0]
        # Round-robin within the phase: the survivor played least so far in it (update() halves
        # the survivors as soon as each has had its share).
        return min(survivors, key=lambda a: (state["phase_pulls"][a], survivors.index(a)))

    def update(self, state: dict, arm: str, record: RoundRecord) -> tuple[dict, ArmStats]:
        new, increments = super().update(state, arm, record)
        survivors = list(state["survivors"])
        pulls = dict(state["phase_pulls"])
        if arm in pulls:
            pulls[arm] += 1
        need = self._pulls(len(survivors))
        if len(survivors) > 1 and all(pulls[a] >= need for a in survivors):
            means = _means(new, self.reward, self.arms)
            ranked = sorted(survivors, key=lambda a: (-(means[a] or 0.0), survivors.index(a)))
            survivors = ranked[: math.ceil(len(survivors) / 2)]
            pulls = {a: 0 for a in self.arms}
        return {**new, "survivors": survivors, "phase_pulls": pulls}, increments

    def leader(self, state: dict) -> str | None:
        if len(state["survivors"]) == 1:
            return state["survivors"][0]
        return super().leader(state)


@dataclass(frozen=True)
class Fixed(Policy):
    """Always one arm: a single drafter (the core's ``--drafter``)."""

    def select(self, state: dict, rng: random.Random) -> str:
        return self.arms[0]

    def leader(self, state: dict) -> str | None:
        return self.arms[0]


@dataclass(frozen=True)
class Uniform(Policy):
    """Uniformly random arm each round: the floor any learning policy must beat."""

    def select(self, state: dict, rng: random.Random) -> str:
        return self.arms[rng.randrange(len(self.arms))]


# -- the registry -------------------------------------------------------------------------------------

ORACLE = "oracle"  # evaluation only: the best fixed drafter per prompt, in hindsight (bench)
WARM_SUFFIX = "+warm"
DEFAULT_K_CHOICES = (2, 3, 5, 8)


@dataclass(frozen=True)
class PolicyOptions:
    """Knobs shared by the policies (CLI flags / request fields)."""

    beta: float = DEFAULT_BETA  # UCB exploration weight β (specpool.core.defaults says why this value)
    gamma_discount: float = 0.99  # ucb-discounted: per-round discount γ (evidence window ≈ 100 rounds)
    gamma_exp3: float = 0.1  # exp3: exploration mix γ
    k_choices: tuple[int, ...] = DEFAULT_K_CHOICES  # ucb-cost-k: draft lengths paired with each drafter
    probe_rounds: int = DEFAULT_PROBE_ROUNDS  # ucb-replay: rounds at the start of a session in which every drafter is replayed
    warm: WarmStart = field(default_factory=WarmStart)

    def validate(self) -> None:
        check(self.beta > 0, f"beta must be > 0, got {self.beta}")
        check(0 < self.gamma_discount < 1, f"the discount gamma must be in (0, 1), got {self.gamma_discount}")
        check(0 < self.gamma_exp3 <= 1, f"exp3's gamma must be in (0, 1], got {self.gamma_exp3}")
        check(bool(self.k_choices) and all(1 <= k <= 32 for k in self.k_choices),
              f"draft lengths to pair with drafters must be in 1..32, got {self.k_choices}")
        check(self.probe_rounds >= 1, f"probe rounds must be >= 1, got {self.probe_rounds}")
        check(self.warm.weight > 0 and self.warm.cap > 0, "warm start weight and cap must be > 0")


# name -> (description, builder(arms, options) -> Policy). Arms are drafter names; ucb-cost-k pairs
# them with draft lengths itself.
_Builder = Callable[[tuple[str, ...], PolicyOptions], Policy]
POLICIES: dict[str, tuple[str, _Builder]] = {
    "metasd-ucb": ("UCB on the block-divergence reward (MetaSD)",
                   lambda arms, o: UCB("metasd-ucb", arms, "bd", beta=o.beta)),
    "ucb-be": ("UCB on the block-efficiency reward (accepted count), MetaSD's ablation",
               lambda arms, o: UCB("ucb-be", arms, "be", beta=o.beta)),
    "ucb-cost": ("UCB on tokens per second of round time (cost-aware)",
                 lambda arms, o: UCB("ucb-cost", arms, "rate", beta=o.beta)),
    "ucb-cost-k": ("UCB on tokens per second over (drafter, draft length) pairs",
                   lambda arms, o: UCB("ucb-cost-k", tuple(arm_name(a, k) for a in arms for k in o.k_choices), "rate", beta=o.beta)),
    "ucb-replay": ("UCB on BE; every drafter replayed on the target's tokens in the first rounds (side observations)",
                   lambda arms, o: ReplayUCB("ucb-replay", arms, "be", beta=o.beta, probe_rounds=o.probe_rounds)),
    "ucb-discounted": ("discounted UCB on BD, for domain changes inside one session",
                       lambda arms, o: DiscountedUCB("ucb-discounted", arms, "bd", beta=o.beta, gamma=o.gamma_discount)),
    "thompson": ("Thompson sampling, Beta posteriors on BD",
                 lambda arms, o: Thompson("thompson", arms, "bd")),
    "exp3": ("Exp3 on BD (adversarial rewards)",
             lambda arms, o: Exp3("exp3", arms, "bd", gamma=o.gamma_exp3)),
    "sequential-halving": ("sequential halving on BD, then commit",
                           lambda arms, o: SequentialHalving("sequential-halving", arms, "bd")),
    "random": ("a uniformly random drafter each round",
               lambda arms, o: Uniform("random", arms, "bd")),
}


def policy_names() -> list[str]:
    return list(POLICIES) + ["fixed:NAME", ORACLE]


def make_policy(spec: str, pool: Sequence[str], options: PolicyOptions | None = None) -> Policy:
    """``spec`` is a policy name, ``fixed:DRAFTER``, optionally followed by ``+warm`` (tenant warm
    start); ``pool`` the drafter names it chooses among."""
    options = options or PolicyOptions()
    options.validate()
    check(bool(spec), "the policy name is empty")
    base, warm = (spec[: -len(WARM_SUFFIX)], True) if spec.endswith(WARM_SUFFIX) else (spec, False)
    if base == ORACLE:
        raise InvalidArgument("the oracle knows each prompt's best drafter only in hindsight: it is for "
                              "evaluation (specpool bench --policies ...,oracle), not for generating")
    if base.startswith("fixed:"):
        drafter = base.removeprefix("fixed:")
        check(bool(drafter), "fixed: needs a drafter name, e.g. fixed:ngram")
        policy: Policy = Fixed(base, (drafter,), "bd")
    else:
        if base not in POLICIES:
            raise NotFound(f"unknown policy {spec!r}; known: {', '.join(policy_names())} (append +warm for tenant warm start)")
        pool = tuple(dict.fromkeys(pool))
        check(bool(pool), f"policy {base} needs at least one drafter in the pool")
        policy = POLICIES[base][1](pool, options)
    return replace(policy, name=spec, warm=options.warm) if warm else policy
