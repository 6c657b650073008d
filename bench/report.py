"""Pure aggregation and rendering for ``specpool bench``: no models, no clocks.

Input is the list of per-prompt records the benchmark writes to ``per_prompt.jsonl``, one per
(prompt, system), holding raw counters only (docs/ARCHITECTURE.md, "Conventions"); every rate and ratio is
derived here. A record has at least::

    prompt_index, category, system, ours (bool), new_tokens, wall_s, matches_target
    rounds, round_s, draft_forward_s, verify_forward_s   # ours only (None for HF systems)
    proposed, draft_s                                     # ours, newer runs: draft tokens proposed, propose-call seconds

Speedups are per-prompt ratios against target-only decoding on the same prompt, then summarised
by median and [p25, p75] over prompts: ratios of paired runs cancel most machine noise.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

TARGET = "target"  # system name of target-only decoding
HF_PROMPT_LOOKUP = "hf-prompt-lookup"
HF_ASSISTED = "hf-assisted:"  # + drafter spec
ALL = "all"  # pseudo-category over every prompt


def hf_peer(system: str) -> str | None:
    """The Hugging Face system that does what our ``system`` does, if there is one."""
    kind = system.partition(":")[0]
    if kind == "ngram":
        return HF_PROMPT_LOOKUP
    if kind in ("hf", "early-exit"):  # model drafters that are transformers models
        return HF_ASSISTED + system
    return None


def summarize(values: Iterable[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, p25, p75) of the values that are not None; all None when there are none."""
    data = [v for v in values if v is not None]
    if not data:
        return None, None, None
    p25, median, p75 = np.percentile(np.asarray(data, dtype=np.float64), [25, 50, 75])
    return float(median), float(p25), float(p75)


def tokens_per_s(record: dict) -> float | None:
    return record["new_tokens"] / record["wall_s"] if record["wall_s"] > 0 else None


def bookkeeping_fraction(record: dict) -> float | None:
    """Share of our loop's round time spent outside model forwards (drafting logic, acceptance,
    cache bookkeeping, Python). None for HF systems and for empty runs."""
    round_s = record.get("round_s")
    if not record.get("ours") or not round_s:
        return None
    return (round_s - record["draft_forward_s"] - record["verify_forward_s"]) / round_s


def draft_ms_per_token(record: dict) -> float | None:
    """Drafter forward milliseconds per proposed draft token: what a drafter's guess costs (None
    for HF systems, target-only, runs that proposed nothing, and records older than the counter)."""
    proposed = record.get("proposed")
    if not record.get("ours") or not proposed or record.get("draft_forward_s") is None:
        return None
    return 1e3 * record["draft_forward_s"] / proposed


def draft_share(record: dict) -> float | None:
    """Share of the loop's round time spent in the drafter's propose calls (None where unknown
    or where nothing was drafted)."""
    round_s = record.get("round_s")
    if not record.get("ours") or not round_s or record.get("draft_s") is None or not record.get("proposed"):
        return None
    return record["draft_s"] / round_s


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def group_records(records: Sequence[dict]) -> tuple[dict[tuple[str, str], list[dict]], list[str], list[str]]:
    """Records by (category, system), with an ``all`` pseudo-category; categories and systems
    in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    categories: dict[str, None] = {}
    systems: dict[str, None] = {}
    for r in records:
        categories.setdefault(r["category"], None)
        systems.setdefault(r["system"], None)
        groups[(r["category"], r["system"])].append(r)
        groups[(ALL, r["system"])].append(r)
    return groups, list(categories), list(systems)


def aggregate(records: Sequence[dict]) -> list[dict]:
    """One row per (category, system), categories in first-seen order then ``all``; systems in
    first-seen order. Rows of categories without a target-only run have no speedups."""
    speed = {(r["system"], r["prompt_index"]): tokens_per_s(r) for r in records}
    groups, categories, systems = group_records(records)

    rows = []
    for category in [*categories, ALL]:
        for system in systems:
            group = groups.get((category, system))
            if not group:
                continue
            peer = hf_peer(system) if group[0]["ours"] else None
            tps = summarize(speed[(system, r["prompt_index"])] for r in group)
            speedup = summarize(_ratio(speed[(system, r["prompt_index"])], speed.get((TARGET, r["prompt_index"]))) for r in group)
            vs_hf = summarize(_ratio(speed[(system, r["prompt_index"])], speed.get((peer, r["prompt_index"]))) for r in group)
            rounds = sum(r.get("rounds") or 0 for r in group)
            draft_cost, share = summarize(draft_ms_per_token(r) for r in group), summarize(draft_share(r) for r in group)
            rows.append({
                "category": category,
                "system": system,
                "n_prompts": len(group),
                "tokens_per_s": tps[0], "tokens_per_s_p25": tps[1], "tokens_per_s_p75": tps[2],
                "speedup_vs_target": speedup[0], "speedup_p25": speedup[1], "speedup_p75": speedup[2],
                "vs_hf_peer": peer if vs_hf[0] is not None else None,
                "vs_hf": vs_hf[0], "vs_hf_p25": vs_hf[1], "vs_hf_p75": vs_hf[2],
                # tau pooled over the group's prompts: all new tokens / all rounds (ours only)
                "mean_accepted_length": sum(r["new_tokens"] for r in group) / rounds if group[0]["ours"] and rounds else None,
                "bookkeeping_fraction": summarize(bookkeeping_fraction(r) for r in group)[0],
                "draft_ms_per_token": draft_cost[0], "draft_ms_per_token_p25": draft_cost[1], "draft_ms_per_token_p75": draft_cost[2],
                "draft_share": share[0], "draft_share_p25": share[1], "draft_share_p75": share[2],
                "mean_new_tokens": sum(r["new_tokens"] for r in group) / len(group),
                # None: no output of the group was compared (a sampled run); target-only is itself
                "lossless_mismatches": 0 if system == TARGET else _mismatches(group),
            })
    return rows


def _mismatches(records: Sequence[dict]) -> int | None:
    """Outputs of ``records`` that differ from target-only's; None when none was compared (a
    sampled run compares no tokens: its outputs follow the target's distribution instead)."""
    checked = [r["matches_target"] for r in records if r["matches_target"] is not None]
    return sum(1 for match in checked if match is False) if checked else None


def mismatch_counts(records: Sequence[dict]) -> dict[str, int | None]:
    """Prompts whose output differs from target-only's, per non-target system (None: not compared)."""
    systems: dict[str, list[dict]] = {}
    for r in records:
        if r["system"] != TARGET:
            systems.setdefault(r["system"], []).append(r)
    return {system: _mismatches(group) for system, group in systems.items()}


# -- rendering ----------------------------------------------------------------------------------
def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _fmt_spread(row: dict, key: str, p25: str, p75: str, digits: int = 2) -> str:
    if row[key] is None:
        return "–"
    return f"{row[key]:.{digits}f} [{_fmt(row[p25], digits)}, {_fmt(row[p75], digits)}]"


def markdown_table(rows: Sequence[dict]) -> str:
    header = ["category", "system", "n", "tokens/s", "speedup vs target", "vs HF peer",
              "mean accepted length", "bookkeeping", "mismatches"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for row in rows:
        cells = [
            row["category"], f"`{row['system']}`", str(row["n_prompts"]),
            _fmt_spread(row, "tokens_per_s", "tokens_per_s_p25", "tokens_per_s_p75", 1),
            _fmt_spread(row, "speedup_vs_target", "speedup_p25", "speedup_p75"),
            _fmt_spread(row, "vs_hf", "vs_hf_p25", "vs_hf_p75"),
            _fmt(row["mean_accepted_length"]),
            "–" if row["bookkeeping_fraction"] is None else f"{100 * row['bookkeeping_fraction']:.0f}%",
            "–" if row["lossless_mismatches"] is None else str(row["lossless_mismatches"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draft_cost_table(rows: Sequence[dict]) -> str:
    """Per (category, drafting system): tokens per round, the drafter's forward cost per proposed
    token, and its propose calls' share of round time; empty when no row drafted."""
    drafting = [r for r in rows if r["draft_ms_per_token"] is not None or r["draft_share"] is not None]
    if not drafting:
        return ""
    lines = ["| category | system | n | tokens / round | draft ms / proposed token | draft share of round time | speedup vs target |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in drafting:
        share = "–" if row["draft_share"] is None else (
            f"{100 * row['draft_share']:.0f}% [{100 * row['draft_share_p25']:.0f}%, {100 * row['draft_share_p75']:.0f}%]")
        lines.append("| " + " | ".join([
            row["category"], f"`{row['system']}`", str(row["n_prompts"]), _fmt(row["mean_accepted_length"]),
            _fmt_spread(row, "draft_ms_per_token", "draft_ms_per_token_p25", "draft_ms_per_token_p75"), share,
            _fmt_spread(row, "speedup_vs_target", "speedup_p25", "speedup_p75"),
        ]) + " |")
    return "\n".join(lines)


def markdown_report(header: Sequence[tuple[str, str]], rows: Sequence[dict], mismatches: dict[str, int | None], plot: str | None) -> str:
    """The whole report.md: a header of (label, value) lines, the table, mismatches, the plot."""
    parts = ["# specpool bench", ""]
    parts += [f"- **{label}**: {value}" for label, value in header]
    parts += [
        "",
        "Medians over prompts, [p25, p75] in brackets. *tokens/s* = new tokens / wall seconds of the generate "
        "call; *speedup* = per-prompt ratio to target-only tokens/s on the same prompt; *vs HF peer* = per-prompt "
        "ratio to the Hugging Face system doing the same job (ngram vs `hf-prompt-lookup`, `hf:X` vs "
        "`hf-assisted:hf:X`); *mean accepted length* = new tokens / rounds; *bookkeeping* = share of round "
        "time outside model forwards; *mismatches* = prompts whose tokens differ from target-only's.",
        "",
        markdown_table(rows),
        "",
    ]
    cost = draft_cost_table(rows)
    if cost:
        parts += [
            "## Draft cost", "",
            "Medians over prompts, [p25, p75] in brackets. *tokens / round* = new tokens / rounds (pooled, as *mean "
            "accepted length* above; a white-box system's first round is the target's prefill alone, which it counts); "
            "*draft ms / proposed token* = the drafter's forward time / the draft tokens it proposed; *draft share* = "
            "the drafter's propose calls / round time; *speedup* as above (side by side with target-only).",
            "",
            cost,
            "",
        ]
    bad = {s: n for s, n in mismatches.items() if n}
    if bad:
        parts.append("**Outputs differing from target-only** (a bug for ours; float noise is possible for HF): "
                     + ", ".join(f"`{s}` {n}" for s, n in bad.items()))
    elif mismatches and all(n is None for n in mismatches.values()):
        parts.append("Sampled: outputs are not compared token by token with target-only's (each system draws its "
                     "own); that they follow the target's distribution is what tests/unit/test_rejection.py and "
                     "tests/unit/test_eagle_drafter.py test.")
    else:
        parts.append("Every system's output equals target-only's on every prompt (lossless).")
    if plot:
        parts += ["", f"![speedup vs target-only per category]({plot})"]
    return "\n".join(parts) + "\n"


def plot_speedup(rows: Sequence[dict], path: Path, title: str = "") -> None:
    """Grouped bars: speedup vs target-only per category, one bar per system, p25–p75 whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["system"] != TARGET and r["speedup_vs_target"] is not None]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by_key = {(r["category"], r["system"]): r for r in rows}
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) * max(len(systems), 1) * 0.6 + 2), 4.2))
    x = np.arange(len(categories))
    for i, system in enumerate(systems):
        cells = [by_key.get((c, system)) for c in categories]
        mid = [r["speedup_vs_target"] if r else np.nan for r in cells]
        low = [r["speedup_vs_target"] - r["speedup_p25"] if r else 0.0 for r in cells]
        high = [r["speedup_p75"] - r["speedup_vs_target"] if r else 0.0 for r in cells]
        ax.bar(x + (i - (len(systems) - 1) / 2) * width, mid, width, yerr=[low, high], capsize=2, label=system)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")  # target-only
    ax.set_xticks(x, categories)
    ax.set_ylabel("speedup vs target-only (median, p25–p75)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
