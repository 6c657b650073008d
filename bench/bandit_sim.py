"""Synthetic bandit simulation: arms with known reward distributions, the real policy code.

Each arm is a drafter whose draft tokens each match the target's greedy token independently with
probability α (the i.i.d. acceptance model of Leviathan et al. 2023). A round drafts k tokens: the
accepted count is the leading run of matches, BD is the fraction of the k positions that match
(greedy: TV is 0 or 1 per position), and the round emits accepted + 1 tokens.

Stopping-time regret (MetaSD, Kim et al. 2024): to produce B tokens a policy needs N(B) rounds; the
best arm alone needs B / τ* in expectation, τ* = Σ_{j=0..k} α*^j. Regret(B) = E[N(B)] − B/τ*.
By Wald's identity E[tokens after N rounds] = E[Σ_t τ_{a_t}], so Regret(B) equals (up to the last
round's overshoot) E[Σ_{t≤N(B)} (1 − τ_{a_t}/τ*)]: we average that pseudo-regret over runs, which
leaves out the best arm's own sampling noise (√B large) and keeps the policy's cost. For UCB it
grows like log B; we fit regret = a + b·ln B and report the fit.

Rounds to identify: the first round after which the policy's leader (its empirical best arm) is the
true best arm for the rest of the run. BD sees all k positions of a round, BE only the accepted
prefix, so BD's estimates settle sooner.

    python -m bench.bandit_sim --out bench-results/bandit-sim
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import default_out
from specpool.core.defaults import DEFAULT_BETA
from specpool.router.loop import RoundRecord
from specpool.router.policies import PolicyOptions, make_policy

DEFAULT_ALPHAS = (0.8, 0.7, 0.55, 0.4, 0.25)  # per-token match probability of each arm
DEFAULT_CHECKPOINTS = (50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


@dataclass(frozen=True)
class SimConfig:
    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    k: int = 5  # draft length
    checkpoints: tuple[int, ...] = DEFAULT_CHECKPOINTS  # budgets B (tokens) at which regret is read
    runs: int = 100  # independent runs per policy
    seed: int = 0
    beta: float = 0.2


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """τ = E[accepted + 1] = Σ_{j=0..k} α^j under i.i.d. matches."""
    return sum(alpha ** j for j in range(k + 1))


def simulate_round(alpha: float, k: int, rng: random.Random, arm: str) -> RoundRecord:
    matches = [rng.random() < alpha for _ in range(k)]
    accepted = next((j for j, m in enumerate(matches) if not m), k)
    return RoundRecord(drafter=arm, k=k, proposed=k, accepted=accepted, emitted=accepted + 1,
                       bd=sum(matches) / k, draft_s=0.0, verify_s=0.0, round_s=1.0)


def simulate_run(policy_name: str, config: SimConfig, run: int) -> tuple[list[tuple[int, float]], int]:
    """One run: (rounds, pseudo-regret) on reaching each checkpoint, and the rounds to identify the best arm."""
    arms = tuple(f"arm{i}" for i in range(len(config.alphas)))
    alpha = dict(zip(arms, config.alphas))
    best = max(arms, key=alpha.__getitem__)
    tau = {a: expected_tokens_per_round(alpha[a], config.k) for a in arms}
    regret = 0.0
    policy = make_policy(policy_name, arms, PolicyOptions(beta=config.beta))
    rng = random.Random(f"sim:{config.seed}:{policy_name}:{run}")
    state = policy.init_state()
    tokens = rounds = 0
    last_wrong = 0  # last round whose leader was not the best arm
    reached: list[int] = []
    goals = iter(config.checkpoints)
    goal = next(goals)
    while True:
        arm = policy.select(state, rng)
        record = simulate_round(alpha[arm], config.k, rng, arm)
        state, _ = policy.update(state, arm, record)
        rounds += 1
        tokens += record.emitted
        regret += 1.0 - tau[arm] / tau[best]
        if policy.leader(state) != best:
            last_wrong = rounds
        while tokens >= goal:
            reached.append((rounds, regret))
            goal = next(goals, None)
            if goal is None:
                return reached, last_wrong + 1


def identification_race(config: SimConfig, rounds: int = 400) -> dict[str, dict[str, float]]:
    """Both rewards on the SAME rounds: arms played round-robin, each round scored by BD and by BE.
    Rounds until each reward's empirical best is the true best for good: the reward's own
    statistical efficiency, free of how a policy would spend its rounds."""
    arms = list(range(len(config.alphas)))
    best = max(arms, key=lambda a: config.alphas[a])
    found: dict[str, list[int]] = {"bd": [], "be": []}
    for run in range(config.runs):
        rng = random.Random(f"race:{config.seed}:{run}")
        sums = {"bd": [0.0] * len(arms), "be": [0.0] * len(arms)}
        last_wrong = {"bd": 0, "be": 0}
        for t in range(rounds):
            arm = arms[t % len(arms)]
            record = simulate_round(config.alphas[arm], config.k, rng, str(arm))
            sums["bd"][arm] += record.bd
            sums["be"][arm] += record.accepted / config.k
            for reward, s in sums.items():
                if t + 1 >= len(arms) and max(arms, key=lambda a: (s[a], -a)) != best:
                    last_wrong[reward] = t + 1
        for reward in found:
            found[reward].append(max(last_wrong[reward] + 1, len(arms)))
    out = {}
    for reward, values in found.items():
        p25, median, p75 = np.percentile(values, [25, 50, 75])
        out[reward] = {"median": float(median), "p25": float(p25), "p75": float(p75), "mean": float(np.mean(values))}
    return out


def drift_race(policies: list[str], config: SimConfig, rounds: int = 2000, runs: int = 30) -> dict[str, float]:
    """A domain change inside one long session: the arms' α are reversed half way. Returns, per
    policy, tokens per round in the second half as a share of the new best arm's τ."""
    arms = tuple(f"arm{i}" for i in range(len(config.alphas)))
    before = dict(zip(arms, config.alphas))
    after = dict(zip(arms, reversed(config.alphas)))
    tau_after = expected_tokens_per_round(max(config.alphas), config.k)
    out = {}
    for name in policies:
        shares = []
        for run in range(runs):
            policy = make_policy(name, arms, PolicyOptions(beta=config.beta))
            rng = random.Random(f"drift:{config.seed}:{name}:{run}")
            state, tokens = policy.init_state(), 0
            for t in range(rounds):
                alpha = before if t < rounds // 2 else after
                arm = policy.select(state, rng)
                record = simulate_round(alpha[arm], config.k, rng, arm)
                state, _ = policy.update(state, arm, record)
                if t >= rounds // 2:
                    tokens += record.emitted
            shares.append(tokens / (rounds - rounds // 2) / tau_after)
        out[name] = float(np.mean(shares))
    return out


def fit_log(budgets: list[int], regret: list[float]) -> dict:
    """Least squares regret = a + b ln B, with R²."""
    x, y = np.log(np.asarray(budgets, dtype=float)), np.asarray(regret, dtype=float)
    b, a = np.polyfit(x, y, 1)
    residual = y - (a + b * x)
    total = ((y - y.mean()) ** 2).sum()
    return {"a": float(a), "b": float(b), "r2": float(1 - (residual ** 2).sum() / total) if total > 0 else 1.0}


def simulate(policies: list[str], config: SimConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    tau_best = expected_tokens_per_round(max(config.alphas), config.k)
    rows, summaries = [], {}
    bar = tqdm(total=len(policies) * config.runs, desc="bandit-sim", unit="run", file=sys.stderr, disable=not progress)
    for name in policies:
        reached, identify = [], []
        for run in range(config.runs):
            r, i = simulate_run(name, config, run)
            reached.append(r)
            identify.append(i)
            bar.update()
        both = np.asarray(reached, dtype=float)  # (runs, checkpoints, 2)
        rounds, regret = both[:, :, 0], both[:, :, 1]  # (runs, checkpoints) each
        mean, sem = regret.mean(axis=0), regret.std(axis=0, ddof=1) / math.sqrt(config.runs)
        for j, budget in enumerate(config.checkpoints):
            rows.append({"policy": name, "budget_tokens": budget, "mean_rounds": float(rounds[:, j].mean()),
                         "regret_rounds": float(mean[j]), "regret_sem": float(sem[j])})
        p25, median, p75 = np.percentile(identify, [25, 50, 75])
        summaries[name] = {"fit": fit_log(list(config.checkpoints), list(mean)),
                           "rounds_to_identify": {"median": float(median), "p25": float(p25), "p75": float(p75)}}
    bar.close()
    race = identification_race(config)
    drift = drift_race(policies, config)
    return {"identification_race": race, "drift": drift, "config": {"alphas": list(config.alphas), "k": config.k, "runs": config.runs, "seed": config.seed,
                       "beta": config.beta, "tau_best": tau_best,
                       "tau": [expected_tokens_per_round(a, config.k) for a in config.alphas]},
            "rows": rows, "policies": summaries}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, summary in result["policies"].items():
        rows = [r for r in result["rows"] if r["policy"] == name]
        b = np.asarray([r["budget_tokens"] for r in rows], dtype=float)
        y = np.asarray([r["regret_rounds"] for r in rows])
        e = np.asarray([r["regret_sem"] for r in rows])
        line = ax.plot(b, y, "o-", label=f"{name} (fit {summary['fit']['a']:.1f} + {summary['fit']['b']:.1f}·ln B, R² {summary['fit']['r2']:.3f})")
        ax.fill_between(b, y - e, y + e, alpha=0.2, color=line[0].get_color())
        fit = summary["fit"]
        ax.plot(b, fit["a"] + fit["b"] * np.log(b), ":", color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("budget B (tokens), log scale")
    ax.set_ylabel("stopping-time regret (rounds)")
    cfg = result["config"]
    ax.set_title(f"Synthetic arms α={cfg['alphas']}, k={cfg['k']}, {cfg['runs']} runs")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict, command: str) -> str:
    cfg = result["config"]
    lines = [
        "# Bandit simulation: stopping-time regret on synthetic arms", "",
        f"Arms: per-token match probability α = {cfg['alphas']} (τ = " + ", ".join(f"{t:.2f}" for t in cfg["tau"]) + "),"
        f" k = {cfg['k']}, β = {cfg['beta']}, {cfg['runs']} runs per policy, seed {cfg['seed']}.", "",
        f"Command: `{command}`", "",
        "| policy | " + " | ".join(f"B={r['budget_tokens']}" for r in result["rows"] if r["policy"] == next(iter(result["policies"]))) + " | fit a + b·ln B (R²) | rounds to identify, median [p25, p75] |",
    ]
    budgets = [r for r in result["rows"] if r["policy"] == next(iter(result["policies"]))]
    lines.append("|---" * (len(budgets) + 3) + "|")
    for name, summary in result["policies"].items():
        cells = [f"{r['regret_rounds']:.1f} ± {r['regret_sem']:.1f}" for r in result["rows"] if r["policy"] == name]
        fit, ident = summary["fit"], summary["rounds_to_identify"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {fit['a']:.1f} + {fit['b']:.2f}·ln B ({fit['r2']:.3f}) | "
                     f"{ident['median']:.0f} [{ident['p25']:.0f}, {ident['p75']:.0f}] |")
    race = result["identification_race"]
    lines += ["", "Regret in rounds (mean ± standard error over runs). ![regret](regret.png)", "",
              "Identification race: arms played round-robin, every round scored by both rewards; rounds until each "
              "reward's empirical best is the true best for good, median [p25, p75] (mean) over runs: "
              + "; ".join(f"{r.upper()} {v['median']:.0f} [{v['p25']:.0f}, {v['p75']:.0f}] ({v['mean']:.1f})" for r, v in race.items()) + ".", "",
              "Drift: one session of 2,000 rounds whose arms' α are reversed half way (a domain change); tokens per round "
              "in the second half as a share of the new best arm's τ: "
              + ", ".join(f"`{p}` {v:.3f}" for p, v in result["drift"].items()) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bandit_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out("bandit-sim"), help=f"output folder (default ./{default_out('bandit-sim')})")
    parser.add_argument("--policies", default="metasd-ucb,ucb-be,thompson,ucb-discounted,exp3,random")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--beta", type=float, default=DEFAULT_BETA, help=f"UCB exploration weight (default {DEFAULT_BETA})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = SimConfig(runs=args.runs, beta=args.beta, seed=args.seed)
    result = simulate([p.strip() for p in args.policies.split(",") if p.strip()], config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.bandit_sim " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "results.json").write_text(json.dumps({**result, "command": command}, indent=2) + "\n")
    plot(result, out / "regret.png")
    (out / "report.md").write_text(markdown(result, command))
    print(markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
