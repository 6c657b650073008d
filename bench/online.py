"""Online learning benchmark: drafters that learn from verification feedback on a stream of
prompts from a domain they were not trained on (issue 6).

    python -m bench.online --corpus ../shared/data/prose/gutenberg --drafter chat --limit 150

Prompts are passages of the corpus (plain-text files; Project Gutenberg headers skipped), taken
in order, round-robin over the files; each asks the target to continue the passage. Every system
answers every prompt, in one process, the order rotating from prompt to prompt (A B C D, B C D A, ...):

    frozen       the shipped drafter, never updated
    ogd          online gradient descent on the distillation loss (specpool/learning/online.py)
    optimistic   optimistic OGD (hint = previous gradient)
    hedge        a Hedge-weighted ensemble of learning rates, mixed in output space

Each learning system has its own feedback stream, learner and model store (specpool/learning/learner.py).
By default the learner runs *between* requests (``commit_now`` after each prompt: that prompt's
feedback is applied and a version promoted, so the next prompt drafts with it) and its CPU time
is reported separately (``learner_s``): tokens/s is serving time only, as with a learner in a
separate process on other cores. ``--concurrent`` lets the learner threads train while requests
run instead (all on the same cores). ``--learner-process REDIS_URL`` measures *net* tokens/s: each
learning system sends its feedback to its own Redis stream, read by its own ``specpool learner``
process on the same machine (``--learner-nice``, ``--learner-threads``), which runs only while
its system serves (the others' learners are paused with SIGSTOP, and frozen runs with none), so
each system's tokens/s includes what its learner takes from serving; drafters pick up promoted
versions between requests. The learner's CPU seconds are reported as ``learner_cpu_s``.

Writes results.json (rows: system, segment = first_third | last_third | all, mean_accepted_length,
tokens_per_s, n_prompts), per_prompt.jsonl, report.md and learning_curves.png. The report also gives
each learning system's ratios to frozen paired by prompt: the per-prompt median with its
interquartile range, and a 95 % bootstrap interval (over prompts) of the pooled ratio.

Forgetting check: after the stream, the drafter's shipped weights and each system's final learned
version draft for the first ``--forgetting-per-category`` prompts of the drafter's own Spec-Bench
categories (``--forgetting-prompts``, default dev.jsonl; chat for the chat drafter), greedy;
forgetting.json holds each version's mean accepted length there and its ratio to the shipped
weights (the target: within 5 %). ``--forgetting-only`` runs just this check on the stores an
earlier run left in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

from specpool.core.errors import InvalidArgument, check

SYSTEMS = ("frozen", "ogd", "optimistic", "hedge")
SEGMENTS = ("first_third", "last_third", "all")


# --- prompts (no models) ------------------------------------------------------------------------


def _body(text: str) -> str:
    """A Project Gutenberg file without its licence header and footer (other text unchanged)."""
    start = re.search(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG[^\n]*\n", text)
    end = re.search(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", text)
    return text[start.end() if start else 0: end.start() if end else len(text)]


def passages(path: Path, min_words: int = 40, max_words: int = 90) -> list[str]:
    """Paragraphs of ``min_words``+ words (cut to ``max_words``) of a text file, in order."""
    text = _body(path.read_text(encoding="utf-8", errors="replace"))
    out = []
    for block in re.split(r"\n\s*\n", text):
        words = block.split()
        if len(words) >= min_words and not block.strip().isupper():
            out.append(" ".join(words[:max_words]))
    return out


def stream_prompts(corpus: Path, limit: int) -> list[str]:
    """``limit`` prompts from the corpus files (a file or folder), round-robin over the files."""
    check(corpus.exists(), f"corpus {corpus} does not exist")
    files = sorted(p for p in corpus.rglob("*") if p.is_file() and p.suffix in (".txt", "")) if corpus.is_dir() else [corpus]
    files = [f for f in files if not f.name.upper().startswith(("LICENSE", "README"))]
    per_file = [passages(f) for f in files]
    check(any(per_file), f"no passages of 40+ words in {corpus}")
    prompts: list[str] = []
    index = 0
    while len(prompts) < limit and any(index < len(p) for p in per_file):
        for p in per_file:
            if index < len(p) and len(prompts) < limit:
                prompts.append(f"Continue this passage from a novel, in the same style:\n\n{p[index]}")
        index += 1
    return prompts


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


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile of ``values`` (non-empty)."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def spread(records: list[dict], resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Each learning system against frozen, per segment and metric, paired by prompt: the median
    per-prompt ratio with its interquartile range, and a 95 % bootstrap interval (prompts drawn
    with replacement) of the pooled ratio that results.json reports."""
    import random

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
                            "ratio": ratio(prompts), "ci95": [_quantile(boot, 0.025), _quantile(boot, 0.975)],
                            "median_per_prompt": _quantile(per_prompt, 0.5),
                            "iqr_per_prompt": [_quantile(per_prompt, 0.25), _quantile(per_prompt, 0.75)]})
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


# --- forgetting check ---------------------------------------------------------------------------


def forgetting_categories(args: argparse.Namespace) -> list[str]:
    """The categories of the check: --forgetting-categories, else those whose in-domain drafter
    (bench/speed.py) is the stream's drafter; [] when the check is off or has none."""
    from bench.speed import IN_DOMAIN_DRAFTERS

    if args.forgetting_per_category <= 0:
        return []
    if args.forgetting_categories:
        return [c.strip() for c in args.forgetting_categories.split(",") if c.strip()]
    return [c for c, d in IN_DOMAIN_DRAFTERS.items() if d == args.drafter]


def forgetting_prompts(path: Path, categories: list[str], per_category: int) -> list[tuple[str, str]]:
    """(category, first turn) of the first ``per_category`` questions of each category."""
    from bench.verify_batch import load_prompts

    check(path.is_file(), f"forgetting prompts {path} do not exist (give --forgetting-prompts, or --forgetting-per-category 0)")
    questions = load_prompts(path)
    picked = [(c, [q for qc, q in questions if qc == c][:per_category]) for c in categories]
    missing = [c for c, qs in picked if not qs]
    check(not missing, f"no prompts of category {', '.join(missing)} in {path}")
    return [(c, q) for c, qs in picked for q in qs]


def newest_store(out: Path, system: str) -> Path | None:
    """The model store a run of ``system`` left in ``out``/stores (the newest, if several)."""
    stores = sorted((out / "stores").glob(f"{system}-*"), key=lambda p: p.stat().st_mtime)
    return stores[-1] if stores else None


class _PinnedVersion:
    """Stands in for the engine's learning: every request drafts with one given drafter version
    and emits no feedback, so the check itself teaches nothing."""

    top_k = 0

    def __init__(self, name: str, drafter):
        self.name, self.drafter = name, drafter

    def prepare(self, tenant: str, drafters: dict):
        return {n: (self.drafter if n == self.name else d) for n, d in drafters.items()}, None


def run_forgetting_check(engine, args: argparse.Namespace, stores: dict[str, Path]) -> tuple[list[dict], int]:
    """Rows {system, category, version, mean_accepted_length, vs_frozen, n_prompts} for the shipped
    weights (system frozen) and each system's serving version in ``stores``; and the number of
    prompts whose greedy outputs differ between versions (must be 0)."""
    from specpool.learning.hot_swap import DrafterSlot
    from specpool.learning.model_store import VariantKey, open_model_store
    from specpool.target.sampling import SamplingParams

    categories = forgetting_categories(args)
    if not categories:
        return [], 0
    questions = forgetting_prompts(Path(args.forgetting_prompts).expanduser(), categories, args.forgetting_per_category)
    base = engine.drafter(args.drafter)
    versions = {"frozen": (0, base)}
    for system, path in stores.items():
        slot = DrafterSlot(VariantKey("bench", args.drafter), base, open_model_store(path))
        slot.refresh()
        versions[system] = slot.pin()
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=engine.stop_token_ids())
    totals: dict[tuple[str, str], list[int]] = {}
    mismatches = 0
    saved = engine.learning
    try:
        for category, text in questions:
            ids = engine.encode_prompt(text)
            outputs = set()
            for system, (_, drafter) in versions.items():
                engine.learning = _PinnedVersion(args.drafter, drafter)
                result = engine.generate(ids, params, args.drafter, k=args.k, tenant="bench")
                outputs.add(tuple(result.token_ids))
                tokens, rounds = totals.setdefault((system, category), [0, 0])
                totals[(system, category)] = [tokens + len(result.token_ids), rounds + len(result.rounds)]
            mismatches += len(outputs) > 1
    finally:
        engine.learning = saved
    rows = []
    for (system, category), (tokens, rounds) in totals.items():
        mal = tokens / max(rounds, 1)
        frozen_tokens, frozen_rounds = totals[("frozen", category)]
        frozen = frozen_tokens / max(frozen_rounds, 1)
        rows.append({"system": system, "category": category, "version": versions[system][0],
                     "mean_accepted_length": round(mal, 4), "vs_frozen": round(mal / frozen, 4) if frozen else None,
                     "n_prompts": sum(1 for c, _ in questions if c == category)})
    return rows, mismatches


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


# --- the run ------------------------------------------------------------------------------------


def add_online_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", default="../shared/data/prose/gutenberg", help="text file or folder of the stream's domain")
    parser.add_argument("--limit", type=int, default=150, help="prompts in the stream (default 150)")
    parser.add_argument("--drafter", default="chat", help="the zoo drafter every system starts from (default chat)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("-k", type=int, default=5, help="draft length (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    from specpool.learning.online import SUPERVISION, OnlineConfig

    online = OnlineConfig()  # the library's defaults are the benchmark's
    parser.add_argument("--lr", type=float, default=online.lr, help=f"OGD / optimistic OGD step size (default {online.lr})")
    parser.add_argument("--hedge-lrs", default=",".join(map(str, online.hedge_lrs)),
                        help=f"the Hedge members' step sizes (default {','.join(map(str, online.hedge_lrs))})")
    parser.add_argument("--precondition", choices=("none", "adagrad"), default=online.precondition,
                        help=f"adagrad: per-coordinate steps; none: one global step (default {online.precondition})")
    parser.add_argument("--grow-vocab", type=int, default=online.grow_vocab,
                        help=f"tokens the learners may add to the drafter's vocabulary (default {online.grow_vocab})")
    parser.add_argument("--copy-window", type=int, default=online.copy_window,
                        help=f"the learners' copy term: inputs looked back over, 0 = none (default {online.copy_window})")
    add_learner_cost_arguments(parser)
    parser.add_argument("--batch-records", type=int, default=4, help="feedback records per gradient step")
    parser.add_argument("--supervision", choices=SUPERVISION, default=online.supervision,
                        help=f"distribution (the target's top-K p) or argmax (its most likely token) (default {online.supervision})")
    parser.add_argument("--context-tail", type=int, default=64, help="context tokens a feedback record keeps (default 64)")
    parser.add_argument("--concurrent", action="store_true", help="learners train while requests run (default: between)")
    add_process_arguments(parser)
    parser.add_argument("--out", default="bench/results/online", help="output folder")
    parser.add_argument("--target", default=None, help="target model (default: the embedded default)")
    parser.add_argument("--device", default="cpu")
    add_forgetting_arguments(parser)


def add_learner_cost_arguments(parser) -> None:
    """--merge-records / --detach-context, with the library's defaults (specpool/learning/online.py)."""
    from specpool.learning.online import OnlineConfig

    online = OnlineConfig()
    parser.add_argument("--merge-records", action=argparse.BooleanOptionalAction, default=online.merge_records,
                        help=f"the learners fit a session's records that line up as one sequence (default {online.merge_records})")
    parser.add_argument("--detach-context", action=argparse.BooleanOptionalAction, default=online.detach_context,
                        help=f"the learners backpropagate through the draft positions only (default {online.detach_context})")


def learner_cost_flags(args: argparse.Namespace) -> list[str]:
    """The learner-cost options of ``args`` as command-line flags (for the report and the learner processes)."""
    return ["--merge-records" if args.merge_records else "--no-merge-records",
            "--detach-context" if args.detach_context else "--no-detach-context"]


def add_process_arguments(parser) -> None:
    parser.add_argument("--learner-process", default=None, metavar="REDIS_URL",
                        help="each learning system's learner runs as its own `specpool learner` process fed through "
                             "Redis at this URL, during its system's requests only: tokens/s is then net of learning")
    parser.add_argument("--learner-nice", type=int, default=10, help="with --learner-process: the learners' nice value (default 10)")
    parser.add_argument("--learner-threads", type=int, default=1, help="with --learner-process: torch threads per learner (default 1)")
    parser.add_argument("--learner-idle", action="store_true",
                        help="with --learner-process: run the learners under SCHED_IDLE (Linux; as `chrt --idle 0 "
                             "specpool learner` would): any waking serving thread preempts them at once, so they use "
                             "only cycles serving leaves idle")
    parser.add_argument("--publish-every", type=int, default=32,
                        help="with --learner-process: records between published versions (default 32)")
    parser.add_argument("--commit-after-s", type=float, default=30.0,
                        help="with --learner-process: or publish this many seconds after a version's first "
                             "unpublished record, paused time included, whichever comes first (default 30)")


def add_forgetting_arguments(parser) -> None:
    parser.add_argument("--forgetting-prompts", default="../shared/data/prompts/dev.jsonl",
                        help="Spec-Bench question file of the forgetting check (default dev.jsonl)")
    parser.add_argument("--forgetting-per-category", type=int, default=8,
                        help="prompts per own category in the forgetting check (default 8; 0 skips the check)")
    parser.add_argument("--forgetting-categories", default=None,
                        help="comma-separated categories of the check (default: the drafter's own, bench/speed.py)")
    parser.add_argument("--forgetting-only", action="store_true",
                        help="only run the forgetting check, on the learned versions an earlier run left in --out")


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
    check(raw.is_file(), f"{raw} does not exist: nothing to rerender")
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


def command_line(args: argparse.Namespace) -> str:
    if getattr(args, "via_specpool", False):  # the same run, as `specpool bench --online` spells it
        head = ["specpool", "bench", "--online", "--prompts", args.corpus, "--limit", str(args.limit), "--drafters", args.drafter]
    else:
        head = ["python", "-m", "bench.online", "--corpus", args.corpus, "--limit", str(args.limit), "--drafter", args.drafter]
    return shlex.join([
        *head,
        "--systems", args.systems, "-k", str(args.k), "--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr),
        "--hedge-lrs", args.hedge_lrs, "--batch-records", str(args.batch_records), "--supervision", args.supervision, "--context-tail", str(args.context_tail), "--precondition", args.precondition,
        "--grow-vocab", str(args.grow_vocab), "--copy-window", str(args.copy_window), *learner_cost_flags(args),
        "--out", args.out,
        "--device", args.device, *(["--concurrent"] if args.concurrent else []),
        *(["--learner-process", args.learner_process, "--learner-nice", str(args.learner_nice), "--learner-threads",
           str(args.learner_threads), "--publish-every", str(args.publish_every), "--commit-after-s", str(args.commit_after_s),
           *(["--learner-idle"] if args.learner_idle else [])] if args.learner_process else []), *(["--target", args.target] if args.target else []),
        "--forgetting-prompts", args.forgetting_prompts, "--forgetting-per-category", str(args.forgetting_per_category),
        *(["--forgetting-categories", args.forgetting_categories] if args.forgetting_categories else []),
        *(["--forgetting-only"] if args.forgetting_only else []),
    ])


# --- `specpool bench --online`: the same benchmark from the main command -------------------------

# Options of `specpool bench` whose default differs under --online: their bench defaults are None,
# and each mode fills in its own (bench/speed.py resolve_bench_defaults).
ONLINE_DEFAULTS = {"drafters": "chat", "max_new_tokens": 64, "out": "bench/results/online"}


def add_bench_online_arguments(parser: argparse.ArgumentParser) -> None:
    """``--online`` and the options only it uses, on the ``specpool bench`` parser. Shared options
    keep their bench names: --prompts is the corpus (a text file or folder), --drafters the one
    drafter every system starts from, -k, --max-new-tokens, --out, --target, --device, --dtype."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_online_arguments(defaults)
    d = vars(defaults.parse_args([]))
    group = parser.add_argument_group(
        "online learning (bench/online.py)",
        "drafters learning on a stream from an unseen domain; --prompts is then "
        f"the corpus (text file or folder, e.g. ../shared/data/prose/gutenberg), --drafters one zoo drafter "
        f"(default {ONLINE_DEFAULTS['drafters']}), --max-new-tokens defaults to {ONLINE_DEFAULTS['max_new_tokens']}, "
        f"--out to {ONLINE_DEFAULTS['out']}")
    group.add_argument("--online", action="store_true", help="switch to the online learning benchmark (frozen vs ogd, optimistic, hedge)")
    group.add_argument("--limit", type=int, default=d["limit"], help=f"prompts in the stream (default {d['limit']})")
    group.add_argument("--systems", default=d["systems"], help=f"comma-separated, from {','.join(SYSTEMS)} (default all)")
    group.add_argument("--lr", type=float, default=d["lr"], help=f"OGD / optimistic OGD step size (default {d['lr']})")
    group.add_argument("--hedge-lrs", default=d["hedge_lrs"], help=f"the Hedge members' step sizes (default {d['hedge_lrs']})")
    group.add_argument("--precondition", choices=("none", "adagrad"), default=d["precondition"],
                       help=f"adagrad: per-coordinate steps; none: one global step (default {d['precondition']})")
    group.add_argument("--grow-vocab", type=int, default=d["grow_vocab"],
                       help=f"tokens the learners may add to the drafter's vocabulary (default {d['grow_vocab']})")
    group.add_argument("--copy-window", type=int, default=d["copy_window"],
                       help=f"the learners' copy term: inputs looked back over, 0 = none (default {d['copy_window']})")
    add_learner_cost_arguments(group)
    group.add_argument("--batch-records", type=int, default=d["batch_records"],
                       help=f"feedback records per gradient step (default {d['batch_records']})")
    from specpool.learning.online import SUPERVISION

    group.add_argument("--supervision", choices=SUPERVISION, default=d["supervision"],
                       help=f"distribution (the target's top-K p) or argmax (its most likely token) (default {d['supervision']})")
    group.add_argument("--context-tail", type=int, default=d["context_tail"],
                       help=f"context tokens a feedback record keeps (default {d['context_tail']})")
    group.add_argument("--concurrent", action="store_true", help="learners train while requests run (default: between requests)")
    add_process_arguments(group)
    add_forgetting_arguments(group)


def online_args_from_bench(args: argparse.Namespace) -> argparse.Namespace:
    """The ``python -m bench.online`` namespace a ``specpool bench --online`` command stands for."""
    if args.policies is not None:
        raise InvalidArgument("give either --online or --policies, not both")
    if args.in_domain or args.in_domain_lookup:
        flag = "--in-domain" if args.in_domain else "--in-domain-lookup"
        raise InvalidArgument(f"{flag} does not apply to --online (every system starts from --drafters)")
    drafters = [d.strip() for d in (args.drafters or ONLINE_DEFAULTS["drafters"]).split(",") if d.strip()]
    check(len(drafters) == 1, f"--online trains one drafter; give one in --drafters, got {args.drafters!r}")
    return argparse.Namespace(
        corpus=args.prompts, limit=args.limit, drafter=drafters[0], systems=args.systems, k=args.k,
        max_new_tokens=ONLINE_DEFAULTS["max_new_tokens"] if args.max_new_tokens is None else args.max_new_tokens,
        lr=args.lr, hedge_lrs=args.hedge_lrs, precondition=args.precondition, batch_records=args.batch_records,
        supervision=args.supervision, context_tail=args.context_tail,
        grow_vocab=args.grow_vocab, copy_window=args.copy_window,
        merge_records=args.merge_records, detach_context=args.detach_context,
        concurrent=args.concurrent, out=ONLINE_DEFAULTS["out"] if args.out is None else args.out,
        learner_process=args.learner_process, learner_nice=args.learner_nice, learner_threads=args.learner_threads,
        learner_idle=args.learner_idle,
        publish_every=args.publish_every, commit_after_s=args.commit_after_s,
        target=args.target, device=args.device, dtype=args.dtype, via_specpool=True,
        forgetting_prompts=args.forgetting_prompts, forgetting_per_category=args.forgetting_per_category,
        forgetting_categories=args.forgetting_categories, forgetting_only=args.forgetting_only,
    )


def _delete_streams(url: str, streams: list[str]) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.delete(*streams)
    except redis.RedisError:
        pass
    finally:
        client.close()


def _die_with_parent() -> None:
    """Linux: the learner gets SIGKILL when the benchmark dies (a paused learner would otherwise
    wait for a SIGCONT forever); elsewhere nothing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class LearnerProcess:
    """One learning system's ``specpool learner`` process (``--learner-process``), on this
    machine: niced, with few torch threads, and paused (SIGSTOP) except while its system serves."""

    def __init__(self, system: str, args: argparse.Namespace, stream: str, store: str, target: str, log_path: Path,
                 home: Path):
        command = [sys.executable, "-m", "specpool.cli.main", "learner", "--redis", args.learner_process, "--stream", stream,
                   "--group", "bench", "--store", store, "--algo", system, "--drafters", args.drafter,
                   "--lr", str(args.lr), "--hedge-lrs", args.hedge_lrs, "--precondition", args.precondition,
                   "--grow-vocab", str(args.grow_vocab), "--copy-window", str(args.copy_window),
                   *learner_cost_flags(args), "--batch-records", str(args.batch_records), "--supervision", args.supervision,
                   "--publish-every", str(args.publish_every), "--commit-after-s", str(args.commit_after_s),
                   "--no-progress", "--report-every-s", "30",
                   "--target", target, "--device", args.device]
        threads = str(args.learner_threads)
        root = str(Path(__file__).resolve().parents[1])  # this checkout's services/, installed or not
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, SPECPOOL_HOME=str(home),
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.log_path = log_path
        self._log = log_path.open("w")
        nice, idle = args.learner_nice, args.learner_idle

        def setup() -> None:  # in the child, before exec
            if nice:
                os.nice(nice)
            if idle:  # a nice value still lets the learner hold a core until the scheduler's next tick
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            _die_with_parent()

        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=setup)
        self.paused = False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the learner says it reads its stream (imports done); a learner that exits is an error."""
        deadline = time.monotonic() + timeout_s
        while "reading" not in self.log_path.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise InvalidArgument(f"the learner process did not start; its log {self.log_path}:\n"
                                      f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        """A learner that died would leave its system serving stale versions: the run stops instead."""
        if self.process.poll() is not None:
            raise InvalidArgument(f"the learner process exited with code {self.process.returncode}; its log "
                                  f"{self.log_path}:\n{self.log_path.read_text()[-2000:]}")

    def pause(self) -> None:
        if not self.paused and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGSTOP)
            self.paused = True
            deadline = time.monotonic() + 2.0  # the signal lands asynchronously: wait until it has
            while self.state() not in ("T", "t", "Z", "") and time.monotonic() < deadline:
                time.sleep(0.001)

    def resume(self) -> None:
        if self.paused and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.paused = False

    def _stat(self) -> list[str]:
        """/proc/PID/stat after the command name; [] once the process is gone."""
        try:
            return Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            return []

    def state(self) -> str:
        """The process state letter (T: stopped), "" once gone."""
        fields = self._stat()
        return fields[0] if fields else ""

    def cpu_s(self) -> float:
        """CPU seconds the process has used (all its threads), from /proc."""
        fields = self._stat()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0  # utime + stime

    def stop(self, timeout_s: float = 600.0) -> str:
        """SIGTERM (the learner commits what it applied, then exits); returns its last log line."""
        self.resume()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        lines = self.log_path.read_text().strip().splitlines()
        return lines[-1] if lines else ""


def run_online_bench(args: argparse.Namespace, settings) -> int:
    from tqdm import tqdm

    from bench.speed import WARMUP_PROMPT, WARMUP_TOKENS, machine_info
    from specpool.learning.online import OnlineConfig, parse_step_sizes
    from specpool.services.engine import EmbeddedEngine, EngineConfig
    from specpool.learning.learner import EmbeddedLearning, LearningConfig
    from specpool.target.models import DEFAULT_TARGET, ModelConfig
    from specpool.target.sampling import SamplingParams, validate_draft_length

    validate_draft_length(args.k)
    check(args.limit >= 3, f"--limit must be >= 3 (the report compares thirds), got {args.limit}")
    process_mode = getattr(args, "learner_process", None) is not None
    check(not (process_mode and args.concurrent), "give --concurrent or --learner-process, not both")
    check(args.publish_every >= 1 and args.learner_threads >= 1, "--publish-every and --learner-threads must be >= 1")
    check(args.commit_after_s > 0, f"--commit-after-s must be > 0, got {args.commit_after_s}")
    check(args.batch_records >= 1 and args.context_tail >= 1, "--batch-records and --context-tail must be >= 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    check(bool(systems) and all(s in SYSTEMS for s in systems), f"--systems must name some of {', '.join(SYSTEMS)}")
    hedge_lrs = parse_step_sizes(args.hedge_lrs)
    prompts = stream_prompts(Path(args.corpus).expanduser(), args.limit)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target = args.target or DEFAULT_TARGET

    print(f"specpool bench --online: {len(prompts)} prompts, drafter {args.drafter}, systems {', '.join(systems)}", file=sys.stderr)
    dtype = getattr(args, "dtype", "auto")  # (specpool bench --dtype; python -m bench.online has none)
    engine = EmbeddedEngine(EngineConfig(home=settings.home, target=ModelConfig(target, args.device, dtype),
                                         drafter_device=args.device, drafter_dtype=dtype))
    engine.drafter(args.drafter)
    if args.forgetting_only:
        stores = {s: newest_store(out, s) for s in systems if s != "frozen"}
        stores = {s: path for s, path in stores.items() if path is not None}
        check(bool(stores), f"--forgetting-only: no model stores of {', '.join(systems)} in {out / 'stores'}")
        check(bool(forgetting_categories(args)), f"--forgetting-only: no category to check for drafter {args.drafter!r}; "
                                                 "give --forgetting-categories and a --forgetting-per-category above 0")
        rows, mismatches = run_forgetting_check(engine, args, stores)
        text = write_forgetting(out, rows, mismatches, command_line(args))
        report = out / "report.md"
        if report.is_file():  # the run's report gets this check in place of an earlier one
            kept = report.read_text().split(FORGETTING_HEADING)[0].rstrip("\n") + "\n"
            report.write_text(kept + text)
        print(text)
        return 0 if mismatches == 0 else 1
    run_tag = uuid.uuid4().hex[:8]
    run_info = {  # the report's header; run.json keeps it for a --rerender of a stopped run
        "command": command_line(args), "machine": json.dumps(machine_info(args.device)), "target": target,
        "drafter": args.drafter, "k": args.k, "temperature": 0.0, "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts), "corpus": args.corpus,
        "learner": ("separate processes, each running only while its system serves (tokens/s is net of learning; "
                    f"nice {args.learner_nice}{', SCHED_IDLE' if args.learner_idle else ''}, {args.learner_threads} torch thread(s), a version every "
                    f"{args.publish_every} records)" if process_mode else
                    "concurrent threads" if args.concurrent else "between requests (learner_s, not in tokens/s)"),
    }
    (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
    base = LearningConfig(publish_every=10**9, commit_after_s=10**9 if not args.concurrent else 5.0,
                          batch_records=args.batch_records, context_tail=args.context_tail, drafters=(args.drafter,), read_block_s=0.01,
                          online=OnlineConfig(lr=args.lr, hedge_lrs=hedge_lrs, precondition=args.precondition,
                                              grow_vocab=args.grow_vocab, copy_window=args.copy_window,
                                              merge_records=args.merge_records, detach_context=args.detach_context,
                                              supervision=args.supervision))
    learnings: dict[str, EmbeddedLearning | None] = {}
    processes: dict[str, LearnerProcess] = {}
    previous_sigterm = None
    if process_mode:  # SIGTERM unwinds like Ctrl-C, so the learners are resumed, stopped and reaped
        previous_sigterm = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for system in systems:
        if system == "frozen":
            learnings[system] = None
            continue
        config = replace(base, store=str(out / "stores" / f"{system}-{run_tag}"),
                         online=replace(base.online, algorithm=system))
        if process_mode:  # feedback to Redis; the system's own learner process trains and publishes
            config = replace(config, feedback_url=args.learner_process, feedback_stream=f"specpool:bench:{run_tag}:{system}")
            processes[system] = LearnerProcess(system, args, config.feedback_stream, config.store, target,
                                               out / f"learner-{system}.log", settings.home)
        learnings[system] = EmbeddedLearning(config, settings.home, continuous=args.concurrent)
    try:
        for process in processes.values():
            process.wait_ready()
            process.pause()
    except BaseException:
        for process in processes.values():
            process.stop(timeout_s=30)
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        raise
    stop_ids = engine.stop_token_ids()
    encoded = [engine.encode_prompt(p) for p in prompts]

    def run(system: str, ids: list[int], n: int, index: int) -> dict:
        engine.learning = learnings[system]
        params = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=stop_ids)
        process = processes.get(system)
        if process is not None:  # its learner runs beside this request, and only then
            process.check_alive()
            cpu = process.cpu_s()
            process.resume()
        started = time.perf_counter()
        result = engine.generate(ids, params, args.drafter, k=args.k, session_id=f"{run_tag}-{system}-{index}", tenant="bench")
        wall = time.perf_counter() - started
        learner_s = 0.0
        extra = {}
        if process is not None:
            process.pause()
            extra["learner_cpu_s"] = round(process.cpu_s() - cpu, 3)
        elif learnings[system] is not None:
            busy = learnings[system].learner.busy_s
            if not args.concurrent:
                learnings[system].commit_now(timeout=600)
            learner_s = learnings[system].learner.busy_s - busy  # (concurrent: what it did meanwhile)
        slot = learnings[system].slot("bench", args.drafter) if learnings[system] is not None else None
        return {"prompt_index": index, "system": system, "new_tokens": len(result.token_ids), "rounds": len(result.rounds),
                "wall_s": wall, "learner_s": learner_s, "version": slot.version if slot else 0,
                "mean_accepted_length": result.mean_accepted_length, "tokens_per_s": len(result.token_ids) / wall,
                "accepted": sum(r.accepted for r in result.rounds), "proposed": sum(r.proposed for r in result.rounds),
                **extra, "token_ids": result.token_ids}

    warmup = engine.encode_prompt(WARMUP_PROMPT)
    for system in systems:
        engine.learning = None
        engine.generate(warmup, SamplingParams(temperature=0.0, max_new_tokens=WARMUP_TOKENS, stop_token_ids=stop_ids),
                        args.drafter, k=args.k)
    records: list[dict] = []
    mismatches = 0
    try:
        with (out / "per_prompt.jsonl").open("w") as raw:
            for i in tqdm(range(len(prompts)), desc="bench online", unit="prompt", file=sys.stderr, dynamic_ncols=True):
                shift = i % len(systems)
                runs = [run(s, encoded[i], args.max_new_tokens, i) for s in systems[shift:] + systems[:shift]]
                outputs = {tuple(r.pop("token_ids")) for r in runs}
                mismatches += len(outputs) > 1  # greedy: every system must give the target's own output
                for r in sorted(runs, key=lambda r: systems.index(r["system"])):
                    records.append(r)
                    raw.write(json.dumps(r) + "\n")
                raw.flush()  # a stopped run can still be reported (--rerender)
    finally:
        engine.learning = None
        learner_summaries = {s: p.stop() for s, p in processes.items()}
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        for learning in learnings.values():
            if learning is not None:
                learning.close()
        if processes:
            _delete_streams(args.learner_process, [learnings[s].config.feedback_stream for s in processes])

    forgetting, forgetting_mismatches = run_forgetting_check(
        engine, args, {s: Path(l.config.store) for s, l in learnings.items() if l is not None})
    rows, plot = write_results(out, records)
    counters = {s: l.learner.counters for s, l in learnings.items() if l is not None and l.learner is not None}
    counters.update(learner_summaries)
    header = {
        **run_info,
        "prompts whose outputs differ between systems (must be 0)": mismatches,
        "learner counters": json.dumps(counters),
    }
    text = render(rows, header, plot) + render_spread(spread(records))
    if forgetting:
        text += write_forgetting(out, forgetting, forgetting_mismatches, command_line(args))
    (out / "report.md").write_text(text)
    print(text)
    return 0 if mismatches == 0 and forgetting_mismatches == 0 else 1


def main(argv: list[str] | None = None) -> int:
    from specpool.services.config import settings_from_env

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rerender"]:
        check(len(argv) == 2, "usage: python -m bench.online --rerender DIR")
        return rerender(Path(argv[1]))
    parser = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__.split("\n\n")[0],
                                     epilog="python -m bench.online --rerender DIR: the report again from DIR/per_prompt.jsonl")
    add_online_arguments(parser)
    return run_online_bench(parser.parse_args(argv), settings_from_env())


if __name__ == "__main__":
    sys.exit(main())
