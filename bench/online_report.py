"""The online benchmark's results: rows per system and third of the stream, the paired spread
against frozen, the Markdown report, the learning curves, and a report again from the raw
per-prompt records of a run (``--rerender``). Pure but for the files they write; no models.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from bench.common import percentile
from specpool.core.errors import check

SYSTEMS = ("frozen", "ogd", "optimistic", "hedge")
SEGMENTS = ("first_third", "last_third", "all")


def segment_of(index: int, n: int) -> str | None:
    third = n // 3
    if index < third:
        return "first_third"
    if index >= n - third:
        return "last_third"
    return None


def aggregate(records: list[dict]) -> list[dict]:
    """results.json rows: pooled tokens / rounds and tokens / serving seconds per system and segment."""
    n = 1 + max((r["prompt_index"] for r in records), default=-1)
    rows = []
    for system in dict.fromkeys(r["system"] for r in records):
        for segment in SEGMENTS:
            group = [r for r in records if r["system"] == system and (segment == "all" or segment_of(r["prompt_index"], n) == segment)]
            if not group:
                continue
            tokens = sum(r["new_tokens"] for r in group)
            rows.append({
                "system": system, "segment": segment,
                "mean_accepted_length": tokens / max(sum(r["rounds"] for r in group), 1),
                "tokens_per_s": tokens / max(sum(r["wall_s"] for r in group), 1e-9),
                "n_prompts": len(group),
                "learner_s": round(sum(r.get("learner_s", 0.0) for r in group), 3),
                **({"learner_cpu_s": round(sum(r["learner_cpu_s"] for r in group), 3)}
                   if any("learner_cpu_s" in r for r in group) else {}),
            })
    return rows


def spread(records: list[dict], resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Each learning system against frozen, per segment and metric, paired by prompt: the median
    per-prompt ratio with its interquartile range, and a 95 % bootstrap interval (prompts drawn
    with replacement) of the pooled ratio that results.json reports."""
    n = 1 + max((r["prompt_index"] for r in records), default=-1)
    by = {(r["system"], r["prompt_index"]): r for r in records}
    metrics = {"mean_accepted_length": ("new_tokens", "rounds"), "tokens_per_s": ("new_tokens", "wall_s")}
    out = []
    for system in dict.fromkeys(r["system"] for r in records):
        if system == "frozen":
            continue
        for segment in SEGMENTS:
            prompts = [i for i in range(n) if (system, i) in by and ("frozen", i) in by
                       and (segment == "all" or segment_of(i, n) == segment)]
            if len(prompts) < 2:
                continue
            for metric, (num, den) in metrics.items():
                def pooled(sample: list[int], who: str) -> float:
                    return sum(by[(who, i)][num] for i in sample) / max(sum(by[(who, i)][den] for i in sample), 1e-9)

                def ratio(sample: list[int]) -> float:
                    base = pooled(sample, "frozen")
                    return pooled(sample, system) / base if base else float("nan")

                per_prompt = [ratio([i]) for i in prompts]
                rng = random.Random(seed)
                boot = [ratio([rng.choice(prompts) for _ in prompts]) for _ in range(resamples)]
                out.append({"system": system, "segment": segment, "metric": metric, "n_prompts": len(prompts),
                            "ratio": ratio(prompts), "ci95": [percentile(boot, 0.025), percentile(boot, 0.975)],
                            "median_per_prompt": percentile(per_prompt, 0.5),
                            "iqr_per_prompt": [percentile(per_prompt, 0.25), percentile(per_prompt, 0.75)]})
    return out


def render_spread(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = ["", "## Spread (paired by prompt, against frozen)", "",
             "| system | segment | metric | ratio | bootstrap 95 % | per-prompt median | per-prompt IQR |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['segment']} | {r['metric']} | {r['ratio']:.3f} | "
                     f"{r['ci95'][0]:.3f}–{r['ci95'][1]:.3f} | {r['median_per_prompt']:.3f} | "
                     f"{r['iqr_per_prompt'][0]:.3f}–{r['iqr_per_prompt'][1]:.3f} |")
    return "\n".join(lines) + "\n"


def render(rows: list[dict], header: dict, plot: str | None) -> str:
    frozen = {r["segment"]: r for r in rows if r["system"] == "frozen"}
    lines = ["# Online learning benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    # A learner process runs inside the requests' wall time: its CPU seconds are shown, not added.
    cpu = any("learner_cpu_s" in r for r in rows)
    learner_column = "learner CPU s (inside tokens/s)" if cpu else "learner s"
    lines += ["", f"| system | segment | prompts | mean accepted length | vs frozen | tokens/s | vs frozen | {learner_column} |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = frozen.get(r["segment"])
        gain = lambda key: f"{r[key] / base[key] - 1:+.1%}" if base and base[key] else "-"  # noqa: E731
        learner = r.get("learner_cpu_s", 0.0) if cpu else r["learner_s"]
        lines.append(f"| {r['system']} | {r['segment']} | {r['n_prompts']} | {r['mean_accepted_length']:.3f} | "
                     f"{gain('mean_accepted_length')} | {r['tokens_per_s']:.2f} | {gain('tokens_per_s')} | {learner:.1f} |")
    if plot:
        lines += ["", f"![learning curves]({plot})"]
    return "\n".join(lines) + "\n"


def plot_curves(records: list[dict], path: Path, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for system in dict.fromkeys(r["system"] for r in records):
        rows = sorted((r for r in records if r["system"] == system), key=lambda r: r["prompt_index"])
        for ax, key in zip(axes, ("mean_accepted_length", "tokens_per_s")):
            values = [r[key] for r in rows]
            smooth = [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
                      for i in range(len(values))]
            ax.plot([r["prompt_index"] for r in rows], smooth, label=system)
    for ax, title in zip(axes, ("mean accepted length", "tokens/s (serving)")):
        ax.set_xlabel("prompt index")
        ax.set_title(f"{title}, moving average of {window}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FORGETTING_HEADING = "## Forgetting check"


def render_forgetting(rows: list[dict], mismatches: int, command: str) -> str:
    lines = ["", f"{FORGETTING_HEADING} (the drafter's own categories, after the stream)", "",
             "| system | version | category | prompts | mean accepted length | vs shipped | within 5 % |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "-" if r["system"] == "frozen" else ("yes" if r["vs_frozen"] is not None and r["vs_frozen"] >= 0.95 else "NO")
        lines.append(f"| {r['system']} | {r['version']} | {r['category']} | {r['n_prompts']} | {r['mean_accepted_length']:.3f} | "
                     f"{r['vs_frozen']:.3f} | {ok} |")
    lines.append(f"\nprompts whose outputs differ between versions (must be 0): {mismatches}")
    lines.append(f"\n(command: `{command}`)")
    return "\n".join(lines) + "\n"


def write_forgetting(out: Path, rows: list[dict], mismatches: int, command: str) -> str:
    (out / "forgetting.json").write_text(json.dumps({"command": command, "rows": rows, "mismatches": mismatches}, indent=2) + "\n")
    return render_forgetting(rows, mismatches, command)


def write_results(out: Path, records: list[dict]) -> tuple[list[dict], str | None]:
    """results.json and the learning curves (when matplotlib is there) of ``records``."""
    rows = aggregate(records)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    try:
        plot_curves(records, out / "learning_curves.png")
    except ImportError:
        return rows, None
    return rows, "learning_curves.png"


def rerender(out: Path) -> int:
    """``python -m bench.online --rerender DIR``: results.json, report.md and the plot again from
    DIR/per_prompt.jsonl (and DIR/run.json, DIR/forgetting.json when present). A run stopped early
    is reported as the stream it completed: its thirds are of the prompts every system finished."""
    raw = out / "per_prompt.jsonl"
    check(raw.is_file(), f"{raw} does not exist: --rerender needs the raw per-prompt log of a fresh run "
                         "(committed results keep only the reports)")
    records = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    systems = {r["system"] for r in records}
    per_prompt = Counter(r["prompt_index"] for r in records)
    done = {i for i, count in per_prompt.items() if count == len(systems)}
    records = [r for r in records if r["prompt_index"] in done and r["prompt_index"] < len(done)]  # whole prompts, in order
    check(len(done) >= 3, f"{raw} holds {len(done)} complete prompts; the report compares thirds (3 or more)")
    header = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
    header["prompts completed (rerendered from per_prompt.jsonl)"] = len(done)
    rows, plot = write_results(out, records)
    text = render(rows, header, plot) + render_spread(spread(records))
    if (out / "forgetting.json").is_file():
        saved = json.loads((out / "forgetting.json").read_text())
        text += render_forgetting(saved["rows"], saved["mismatches"], saved["command"])
    (out / "report.md").write_text(text)
    print(text)
    return 0
