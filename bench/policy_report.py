"""Pure aggregation and plots for ``specpool bench --policies``: no models, no clocks.

Input: the per-(prompt, system) records of ``per_prompt.jsonl``. A record has::

    prompt_index, category, system, kind ("target" | "fixed" | "policy" | "oracle"),
    new_tokens, wall_s, rounds, round_s, chooser_s, matches_target,
    emitted   [tokens emitted per round]
    arms      [arm played per round]           (None entries: target-only rounds)
    leaders   [the policy's best arm after each round]   (policies only)

Definitions (the vocabulary of docs/ARCHITECTURE.md):
- *oracle*: per prompt, the fixed drafter with the highest tokens/s, run again in its own slot;
- *best fixed*: the one fixed drafter with the highest pooled tokens/s over the whole mixed set;
- *rounds per 100 tokens*: 100 · rounds / new tokens (stopping time per 100 tokens);
- *stopping-time regret* at B tokens: rounds a policy needed to emit B tokens minus the rounds the
  prompt's stopping-time-best fixed drafter (fewest rounds) needed, averaged over prompts;
- *rounds to identify*: the first round after which the policy's leader is that best drafter for the
  rest of the prompt (counted only where it ends on it; the share that does is reported too);
- *steady time*: a run re-timed with each of its calls at that call's median over all runs of the
  same prompt (``steady_walls``), so one run slowed by the machine does not decide a ratio.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.report import ALL, TARGET, group_records, summarize

FIXED_PREFIX = "fixed:"
ORACLE = "oracle"


def _tps(r: dict) -> float | None:
    return r["new_tokens"] / r["wall_s"] if r["wall_s"] > 0 else None


def _pooled_tps(group: Sequence[dict], walls: dict | None = None) -> float | None:
    """All tokens over all seconds; ``walls``: (system, prompt_index) -> seconds instead of wall_s."""
    if walls is not None:
        group = [r for r in group if (r["system"], r["prompt_index"]) in walls]
    wall = sum(r["wall_s"] if walls is None else walls[(r["system"], r["prompt_index"])] for r in group)
    return sum(r["new_tokens"] for r in group) / wall if wall > 0 else None


def _drafter(arm: str | None) -> str | None:
    from specpool.router.policies import parse_arm

    return None if arm is None else parse_arm(arm)[0]


def best_fixed(records: Sequence[dict], walls: dict | None = None) -> str | None:
    """The fixed drafter with the highest pooled tokens/s over every prompt (on ``walls`` if given)."""
    by_system: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["kind"] == "fixed":
            by_system[r["system"]].append(r)
    scored = {s: _pooled_tps(g, walls) or 0.0 for s, g in by_system.items()}
    return max(scored, key=scored.__getitem__) if scored else None


def stopping_time_best(records: Sequence[dict]) -> dict[int, str]:
    """prompt_index -> the fixed drafter (name without ``fixed:``) needing the fewest rounds;
    ties go to the faster one."""
    best: dict[int, tuple[int, float, str]] = {}
    for r in records:
        if r["kind"] != "fixed":
            continue
        key = (r["rounds"], r["wall_s"], r["system"].removeprefix(FIXED_PREFIX))
        if r["prompt_index"] not in best or key < best[r["prompt_index"]]:
            best[r["prompt_index"]] = key
    return {i: v[2] for i, v in best.items()}


def rounds_to_identify(leaders: Sequence[str | None], best: str) -> int | None:
    """1-based round from which the leader's drafter is ``best`` to the end; None if it ends elsewhere."""
    if not leaders or _drafter(leaders[-1]) != best:
        return None
    last_wrong = max((i + 1 for i, a in enumerate(leaders) if _drafter(a) != best), default=0)
    return last_wrong + 1


def _call_keys(r: dict) -> list[tuple[tuple, tuple, tuple]]:
    """Per round of one record: the keys its draft, verify and other times are pooled under.

    A call's cost depends on what it does, not on which system asked for it: a verify on its
    width (proposed + 1, and whether it is the request's first, which prefills the prompt); a
    draft on the drafter, what made the proposal (lookup or the model), its length, and how much
    the drafter's cache must catch up: "first" (its first model call in the request prefills the
    prompt), "gap" (other rounds came between: it feeds their tokens first, as after a switch of
    arms) or "next" (its own previous round, or a replay of it, was the one before). Replays
    themselves (``replay_ms``) are left out of the keys: steady time keeps them as measured."""
    keys, last_call = [], {}
    for j, (arm, proposed, source) in enumerate(zip(r["arms"], r["proposed"], r["sources"])):
        drafter = _drafter(arm)
        catch_up = None
        if drafter is not None and source is None:
            catch_up = "first" if drafter not in last_call else "next" if last_call[drafter] == j - 1 else "gap"
            last_call[drafter] = j
        keys.append((("draft", drafter, source, proposed, catch_up), ("verify", proposed, j == 0), ("other",)))
        for replayed in (r.get("replayed") or [[]] * len(r["arms"]))[j]:
            last_call[replayed] = j  # a replay (ucb-replay) brought that drafter's cache up to date
    return keys


def steady_walls(records: Sequence[dict]) -> dict[tuple[str, int], float]:
    """(system, prompt_index) -> the run's wall time with every call at its median over the
    prompt's runs (all systems); only records that carry per-round times (draft_ms, ...) count.

    The host's speed drifts and stalls: the same fixed drafter run twice on one prompt differed by
    up to 30 % on the 2-core machines of bench/results/. Every system makes the same kinds of calls
    (same models, same widths), so pricing each call at the median of its kind over the prompt's
    ~13 runs keeps what differs between systems (which calls, how many) and drops the stalls."""
    by_prompt: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("draft_ms") is not None:
            by_prompt[r["prompt_index"]].append(r)
    walls = {}
    for index, group in by_prompt.items():
        samples: dict[tuple, list[float]] = defaultdict(list)
        keyed = []
        for r in group:
            keys = _call_keys(r)
            keyed.append((r, keys))
            for (dk, vk, ok), d, v, o in zip(keys, r["draft_ms"], r["verify_ms"], r["other_ms"]):
                samples[dk].append(d)
                samples[vk].append(v)
                samples[ok].append(o)
        median = {key: float(np.median(values)) for key, values in samples.items()}
        for r, keys in keyed:
            rounds_ms = sum(median[dk] + median[vk] + median[ok] for dk, vk, ok in keys)
            # What lies outside the rounds (chooser updates, encoding) is kept as measured.
            outside_ms = max(1e3 * r["wall_s"] - sum(r["draft_ms"]) - sum(r["verify_ms"]) - sum(r["other_ms"]), 0.0)
            walls[(r["system"], index)] = (rounds_ms + outside_ms) / 1e3
    return walls


def rounds_to_reach(emitted: Sequence[int], budget: int) -> int | None:
    total = 0
    for i, e in enumerate(emitted):
        total += e
        if total >= budget:
            return i + 1
    return None


def regret_curves(records: Sequence[dict], budgets: Sequence[int]) -> dict[str, list[float | None]]:
    """policy -> mean stopping-time regret (rounds) at each budget, over prompts that reach it."""
    best = stopping_time_best(records)
    by_key = {(r["system"], r["prompt_index"]): r for r in records}
    curves: dict[str, list[float | None]] = {}
    for system in dict.fromkeys(r["system"] for r in records if r["kind"] in ("policy", "oracle")):
        curve = []
        for budget in budgets:
            diffs = []
            for (s, i), r in by_key.items():
                if s != system or i not in best:
                    continue
                ours = rounds_to_reach(r["emitted"], budget)
                theirs = rounds_to_reach(by_key[(FIXED_PREFIX + best[i], i)]["emitted"], budget)
                if ours is not None and theirs is not None:
                    diffs.append(ours - theirs)
            curve.append(float(np.mean(diffs)) if diffs else None)
        curves[system] = curve
    return curves


def aggregate(records: Sequence[dict]) -> tuple[list[dict], dict]:
    """Rows per (category, system) plus ``all``; and a summary of the headline ratios."""
    speed = {(r["system"], r["prompt_index"]): _tps(r) for r in records}
    fixed_best = best_fixed(records)
    # The same ratios on steady time (steady_walls). Its oracle needs no second run: each prompt's
    # fixed drafter with the most steady tokens/s (a steady time has no stall to be lucky with).
    walls = steady_walls(records)
    steady = {key: r["new_tokens"] / walls[key] for r in records if (key := (r["system"], r["prompt_index"])) in walls}
    steady_oracle: dict[int, float] = {}
    for (system, index), value in steady.items():
        if system.startswith(FIXED_PREFIX):
            steady_oracle[index] = max(steady_oracle.get(index, 0.0), value)
    steady_fixed_best = best_fixed(records, walls) if walls else None
    st_best = stopping_time_best(records)
    groups, categories, systems = group_records(records)

    def ratio(r: dict, other: str | None) -> float | None:
        a, b = speed[(r["system"], r["prompt_index"])], speed.get((other, r["prompt_index"]))
        return a / b if a is not None and b else None

    def steady_ratio(r: dict, other: str | None) -> float | None:
        a = steady.get((r["system"], r["prompt_index"]))
        b = steady_oracle.get(r["prompt_index"]) if other == ORACLE else steady.get((other, r["prompt_index"]))
        return a / b if a is not None and b else None

    rows = []
    for category in [*categories, ALL]:
        for system in systems:
            group = groups.get((category, system))
            if not group:
                continue
            tokens = sum(r["new_tokens"] for r in group)
            rounds = sum(r["rounds"] or 0 for r in group)
            round_s = sum(r.get("round_s") or 0.0 for r in group)
            tps = summarize(_tps(r) for r in group)
            to_oracle = summarize(ratio(r, ORACLE) for r in group)
            to_fixed = summarize(ratio(r, fixed_best) for r in group)
            speedup = summarize(ratio(r, TARGET) for r in group)
            identify = [rounds_to_identify(r["leaders"], st_best[r["prompt_index"]])
                        for r in group if r.get("leaders") and r["prompt_index"] in st_best]
            found = [x for x in identify if x is not None]
            oracle_group = groups.get((category, ORACLE), [])
            fixed_group = groups.get((category, fixed_best), []) if fixed_best else []
            pooled, pooled_oracle, pooled_fixed = _pooled_tps(group), _pooled_tps(oracle_group), _pooled_tps(fixed_group)
            steady_tps = summarize(steady.get((r["system"], r["prompt_index"])) for r in group)
            steady_to_oracle = summarize(steady_ratio(r, ORACLE) for r in group)
            steady_to_fixed = summarize(steady_ratio(r, steady_fixed_best) for r in group)
            steady_fixed_group = groups.get((category, steady_fixed_best), []) if steady_fixed_best else []
            steady_pooled, steady_pooled_fixed = _pooled_tps(group, walls), _pooled_tps(steady_fixed_group, walls)
            # The steady oracle pooled: each prompt at its best fixed drafter's steady time.
            oracle_s = [r["new_tokens"] / steady_oracle[r["prompt_index"]] for r in group if steady_oracle.get(r["prompt_index"])]
            steady_pooled_oracle = tokens / sum(oracle_s) if oracle_s and len(oracle_s) == len(group) else None
            rows.append({
                "category": category, "system": system, "kind": group[0]["kind"], "n_prompts": len(group),
                "tokens_per_s": tps[0], "tokens_per_s_p25": tps[1], "tokens_per_s_p75": tps[2],
                "pooled_tokens_per_s": pooled,
                "mean_accepted_length": tokens / rounds if rounds else None,
                "rounds_per_100_tokens": 100.0 * rounds / tokens if tokens else None,
                "speedup_vs_target": speedup[0], "speedup_vs_target_p25": speedup[1], "speedup_vs_target_p75": speedup[2],
                "ratio_to_oracle": to_oracle[0], "ratio_to_oracle_p25": to_oracle[1], "ratio_to_oracle_p75": to_oracle[2],
                "pooled_ratio_to_oracle": pooled / pooled_oracle if pooled and pooled_oracle else None,
                "best_fixed": fixed_best,
                "ratio_to_best_fixed": to_fixed[0], "ratio_to_best_fixed_p25": to_fixed[1], "ratio_to_best_fixed_p75": to_fixed[2],
                "pooled_ratio_to_best_fixed": pooled / pooled_fixed if pooled and pooled_fixed else None,
                "steady_tokens_per_s": steady_tps[0], "steady_tokens_per_s_p25": steady_tps[1], "steady_tokens_per_s_p75": steady_tps[2],
                "steady_ratio_to_oracle": steady_to_oracle[0], "steady_ratio_to_oracle_p25": steady_to_oracle[1],
                "steady_ratio_to_oracle_p75": steady_to_oracle[2], "steady_best_fixed": steady_fixed_best,
                "steady_ratio_to_best_fixed": steady_to_fixed[0], "steady_ratio_to_best_fixed_p25": steady_to_fixed[1],
                "steady_ratio_to_best_fixed_p75": steady_to_fixed[2],
                "steady_pooled_ratio_to_best_fixed": steady_pooled / steady_pooled_fixed if steady_pooled and steady_pooled_fixed else None,
                "steady_pooled_ratio_to_oracle": steady_pooled / steady_pooled_oracle if steady_pooled and steady_pooled_oracle else None,
                "chooser_fraction": sum(r.get("chooser_s") or 0.0 for r in group) / round_s if round_s and group[0]["kind"] == "policy" else None,
                "rounds_to_identify": float(np.median(found)) if found else None,
                "identified_share": len(found) / len(identify) if identify else None,
                "lossless_mismatches": sum(1 for r in group if r["matches_target"] is False),
            })
    return rows, _summary(records, rows, categories, systems, fixed_best, steady_fixed_best, st_best)


def _summary(records: Sequence[dict], rows: list[dict], categories: list[str], systems: list[str], fixed_best: str | None,
             steady_fixed_best: str | None, st_best: dict[int, str]) -> dict:
    """The headline figures of ``aggregate``: per system its ratios averaged over categories and
    its overall row's, and the stopping-time oracle."""
    by_key = {(r["category"], r["system"]): r for r in rows}
    # Stopping time (rounds per 100 tokens) needs no clock, so machine noise cannot touch it: the
    # policy's rounds against those of each prompt's fewest-rounds fixed drafter.
    rounds_of = {(r["system"], r["prompt_index"]): r["rounds"] for r in records}
    tokens_of = {r["prompt_index"]: r["new_tokens"] for r in records}
    best_rounds = sum(rounds_of[(FIXED_PREFIX + d, i)] for i, d in st_best.items())
    best_tokens = sum(tokens_of[i] for i in st_best)
    summary = {"best_fixed": fixed_best, "steady_best_fixed": steady_fixed_best, "policies": {},
               "stopping_time_oracle_rounds_per_100_tokens": 100.0 * best_rounds / best_tokens if best_tokens else None}

    def category_mean(system: str, key: str) -> float | None:
        # A per-category figure (the median of per-prompt ratios, or a pooled ratio), averaged over categories.
        cells = [by_key[(c, system)][key] for c in categories if (c, system) in by_key]
        cells = [c for c in cells if c is not None]
        return float(np.mean(cells)) if cells else None

    for system in systems:
        overall = by_key.get((ALL, system))
        summary["policies"][system] = {
            "ratio_to_oracle_category_mean": category_mean(system, "ratio_to_oracle"),
            "ratio_to_best_fixed_category_mean": category_mean(system, "ratio_to_best_fixed"),
            "steady_ratio_to_oracle_category_mean": category_mean(system, "steady_ratio_to_oracle"),
            # Pooled: per category all tokens / all seconds, policy over oracle; then the mean over categories.
            "pooled_ratio_to_oracle_category_mean": category_mean(system, "pooled_ratio_to_oracle"),
            "steady_pooled_ratio_to_oracle_category_mean": category_mean(system, "steady_pooled_ratio_to_oracle"),
            "steady_ratio_to_best_fixed_category_mean": category_mean(system, "steady_ratio_to_best_fixed"),
            "steady_ratio_to_best_fixed": overall["steady_ratio_to_best_fixed"] if overall else None,
            "steady_pooled_ratio_to_best_fixed": overall["steady_pooled_ratio_to_best_fixed"] if overall else None,
            "ratio_to_best_fixed": overall["ratio_to_best_fixed"] if overall else None,
            "pooled_ratio_to_best_fixed": overall["pooled_ratio_to_best_fixed"] if overall else None,
            "rounds_per_100_tokens": overall["rounds_per_100_tokens"] if overall else None,
            "rounds_to_identify": overall["rounds_to_identify"] if overall else None,
            "identified_share": overall["identified_share"] if overall else None,
            "chooser_fraction": overall["chooser_fraction"] if overall else None,
        }
    return summary


# -- rendering ----------------------------------------------------------------------------------------
def _f(value: float | None, digits: int = 2, pct: bool = False) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.{max(digits - 1, 0)}f}%" if pct else f"{value:.{digits}f}"


def _spread(row: dict, key: str, digits: int = 2) -> str:
    if row[key] is None:
        return "–"
    return f"{row[key]:.{digits}f} [{_f(row[key + '_p25'], digits)}, {_f(row[key + '_p75'], digits)}]"


def markdown_table(rows: Sequence[dict], category: str | None = None) -> str:
    header = ["category", "system", "n", "tokens/s", "speedup vs target", "ratio to oracle", "ratio to best fixed",
              "mean accepted length", "rounds / 100 tokens", "rounds to identify (identified)", "chooser time", "mismatches"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for row in rows:
        if category is not None and row["category"] != category:
            continue
        identify = "–" if row["rounds_to_identify"] is None else f"{row['rounds_to_identify']:.0f} ({_f(row['identified_share'], 2, True)})"
        lines.append("| " + " | ".join([
            row["category"], f"`{row['system']}`", str(row["n_prompts"]),
            _spread(row, "tokens_per_s", 1), _spread(row, "speedup_vs_target"), _spread(row, "ratio_to_oracle"),
            _spread(row, "ratio_to_best_fixed"), _f(row["mean_accepted_length"]), _f(row["rounds_per_100_tokens"], 1),
            identify, _f(row["chooser_fraction"], 2, True), str(row["lossless_mismatches"]),
        ]) + " |")
    return "\n".join(lines)


def plot_arm_choices(records: Sequence[dict], system: str, path: Path, max_rounds: int = 60) -> None:
    """Per category: the share of prompts whose r-th round played each drafter (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in records if r["system"] == system]
    categories = list(dict.fromkeys(r["category"] for r in mine))
    drafters = list(dict.fromkeys(_drafter(a) or "none" for r in mine for a in r["arms"]))
    fig, axes = plt.subplots(len(categories), 1, figsize=(8, 1.6 * len(categories) + 0.8), sharex=True, squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, category in zip(axes[:, 0], categories):
        group = [r for r in mine if r["category"] == category]
        share = np.zeros((len(drafters), max_rounds))  # (drafters, rounds)
        for r in group:
            for j, arm in enumerate(r["arms"][:max_rounds]):
                share[drafters.index(_drafter(arm) or "none"), j] += 1
        share /= np.maximum(share.sum(axis=0, keepdims=True), 1)
        ax.stackplot(np.arange(1, max_rounds + 1), share, labels=drafters, colors=[colors(i % 10) for i in range(len(drafters))])
        ax.set_ylabel(category, fontsize=8)
        ax.set_ylim(0, 1)
    axes[0, 0].set_title(f"{system}: share of prompts playing each drafter, by round", fontsize=9)
    axes[-1, 0].set_xlabel("round")
    axes[0, 0].legend(fontsize=7, ncol=min(len(drafters), 4), loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_regret(curves: dict[str, list[float | None]], budgets: Sequence[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for system, curve in curves.items():
        ax.plot(budgets, [np.nan if v is None else v for v in curve], label=system)
    ax.axhline(0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("cumulative stopping-time regret (rounds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
