"""Noisy neighbour: a quiet tenant's latency while another tenant floods at its quota (issue 27).

    python -m bench.flood --reps 3 --quiet-requests 8 --flood-clients 8 --flood-quota 2 \\
        --max-new-tokens 48 --out bench-results/flood

Starts a local served instance of its own (like ``bench/loadtest.py --serve``: Ray Serve, gRPC,
Redis; pool ``ngram``, k = 5, greedy) with API keys on for two tenants and a quota file that gives
the flooding tenant ``max_concurrent: --flood-quota`` and the quiet tenant the default (no limit).
Then, in phases alternated within each repetition (ABBA over the reps, so slow drift of the
machine falls on both sides alike):

- **unloaded**: only the quiet tenant: ``--quiet-requests`` streamed requests (GenerateStream over
  gRPC with the real ``SpecPoolClient``), one at a time;
- **flooded**: the same quiet requests while ``--flood-clients`` threads of the flooding tenant
  send requests as fast as they can. Those over its quota are refused at once with
  RESOURCE_EXHAUSTED and a retry hint (trailing metadata ``retry-after-ms`` / ``retry-after``);
  a flood thread waits that long and tries again, as a real client does. When the quiet requests
  are done the flood stops (its streams in flight are cancelled) and the server drains before the
  next phase;
- with ``--control``, also **unquoted**: the same flood from a third tenant that has no quota, to
  show what the quota is holding back.

For each quiet request: time to first token (TTFT) and inter-token latency (ITL: the mean gap
between its streamed tokens after the first message, ``StreamTiming.inter_token`` of
bench/served.py; tokens arrive a round at a time). The report: the quiet tenant's median ITL and
TTFT [p25, p75] in each phase, the ratio of the medians flooded / unloaded against the target
(``--target-ratio``, 1.5), per-repetition ratios, per-prompt paired ratios, the flood's admitted
and refused requests and tokens/s, the target's verify batch sizes in each phase, whether the quiet
tenant's greedy outputs were identical under flood, the machine and its load average before and
after.

Writes DIR/report.json, DIR/README.md and DIR/itl.png. Argument checks, prompt ordering, retry
hints, aggregation and rendering are pure functions (tests/unit/test_flood.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from bench.common import default_out, load_questions, machine_info, summary
from bench.loadtest import _free_port as free_port
from bench.served import StreamTiming
from bench.served import _delete_namespace as delete_namespace
from specpool.core.errors import SpecpoolError, check

QUIET, FLOOD, UNQUOTED = "quiet", "flood", "unquoted"  # the tenants (API keys of each)
UNLOADED, FLOODED, FLOODED_UNQUOTED = "unloaded", "flooded", "unquoted"  # the phases
FLOOD_PHASES = {FLOODED: FLOOD, FLOODED_UNQUOTED: UNQUOTED}  # phase -> the tenant that floods in it
BUILTIN = "builtin"  # --prompts value: HELDOUT_PROMPTS below
DEFAULT_RETRY_S = 1.0  # a refusal without a hint: what the server's concurrency refusals say anyway

# Held-out prompts, written for this benchmark and never used to develop or tune specpool (the
# drafters, the policies and the earlier benchmarks all worked on ../shared/data/prompts/dev.jsonl):
# figures that are meant to hold should be measured on prompts like these, not on the dev set.
HELDOUT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("writing", "Write a short note to a neighbour asking them to water your plants while you are away for a week."),
    ("code", "Write a Python function that returns the second largest distinct number in a list, or None if there is none."),
    ("math", "A train leaves at 9:40 and arrives at 13:05. How long is the journey in minutes? Show the steps."),
    ("translation", "Translate into German: The library closes early on Fridays, so please return your books by noon."),
    ("summarization", "Summarize in two sentences: Bees visit flowers to collect nectar and pollen. While they move "
                      "between flowers, pollen sticks to their bodies and is carried to other plants, which lets "
                      "many crops produce fruit. Farmers sometimes rent hives during the flowering season."),
    ("qa", "Why does ice float on water?"),
    ("writing", "Describe a quiet harbour town at dawn in four sentences."),
    ("code", "Explain what a race condition is and give a small example in Python with two threads."),
    ("math", "What is the sum of the integers from 1 to 200 that are divisible by 3?"),
    ("reasoning", "List three advantages and three disadvantages of working from home."),
    ("qa", "What is the difference between weather and climate?"),
    ("translation", "Translate into French: Could you tell me where the nearest bus stop is?"),
)


# -- prompts --------------------------------------------------------------------------------------------------
def interleave_by_category(items: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(category, prompt) items in turns over the categories (first of each, second of each, ...),
    categories in order of first appearance: a few requests then cover every kind of prompt."""
    by_category: dict[str, list[tuple[str, str]]] = {}
    for item in items:
        by_category.setdefault(item[0], []).append(item)
    out: list[tuple[str, str]] = []
    for depth in range(max((len(v) for v in by_category.values()), default=0)):
        out += [v[depth] for v in by_category.values() if depth < len(v)]
    return out


def load_prompt_set(spec: str) -> tuple[list[tuple[str, str]], str]:
    """(category, prompt) pairs of --prompts (``builtin``: the held-out set above; else a Spec-Bench
    JSON-lines file), interleaved by category, and a label saying where they came from."""
    if spec == BUILTIN:
        return interleave_by_category(HELDOUT_PROMPTS), f"built-in held-out set ({len(HELDOUT_PROMPTS)} prompts, bench/flood.py)"
    questions = load_questions(Path(spec), 1 << 30)
    return interleave_by_category([(q.category, q.prompt) for q in questions]), spec


# -- retry hints ----------------------------------------------------------------------------------------------
def retry_hint_s(metadata: Sequence[tuple[str, str]] | None, default: float = DEFAULT_RETRY_S) -> float:
    """Seconds to wait before retrying a refusal, from its trailing metadata: ``retry-after-ms``
    (exact) if present, else ``retry-after`` (whole seconds), else ``default``."""
    found = {str(k).lower(): v for k, v in (metadata or ())}
    for key, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            value = float(found[key]) * scale
        except (KeyError, TypeError, ValueError):
            continue
        if value >= 0:
            return value
    return default


# -- per request ----------------------------------------------------------------------------------------------
def quiet_record(timing: StreamTiming, token_ids: Sequence[int], *, phase: str, rep: int, index: int, prompt: int) -> dict:
    """One quiet request: TTFT, ITL (mean gap between tokens after the first message), and a digest
    of its tokens (greedy: the same prompt must give the same tokens in every phase)."""
    gaps = timing.inter_token()
    first = next((n for _, n in timing.arrivals if n > 0), 0)
    return {"phase": phase, "rep": rep, "index": index, "prompt": prompt, "tokens": timing.tokens,
            "first_message_tokens": first, "messages": sum(1 for _, n in timing.arrivals if n > 0),
            "ttft_s": timing.ttft(), "itl_s": statistics.fmean(gaps) if gaps else None, "wall_s": timing.wall_s,
            "digest": hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]}


def failed_record(error: str, *, phase: str, rep: int, index: int, prompt: int) -> dict:
    """A quiet request that failed: no figures, the error (status: message)."""
    return {"phase": phase, "rep": rep, "index": index, "prompt": prompt, "tokens": 0, "first_message_tokens": 0,
            "messages": 0, "ttft_s": None, "itl_s": None, "wall_s": None, "digest": None, "error": error[:300]}


@dataclass
class FloodTally:
    """What the flood threads of one phase did (thread-safe)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: int = 0
    admitted: int = 0  # streams that delivered a token or ended normally: past admission
    refused: int = 0  # RESOURCE_EXHAUSTED: over the quota
    completed: int = 0  # ended normally
    cancelled_at_stop: int = 0  # in flight (admitted) when the phase ended: cancelled by the bench
    cancelled_before_first_token: int = 0  # in flight with no token yet when the phase ended
    errors: dict[str, int] = field(default_factory=dict)  # any other failure, by status
    tokens: int = 0
    in_flight: int = 0  # streams with a token and not ended, as the client sees them
    max_in_flight: int = 0
    hints: list[float] = field(default_factory=list)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def refusal(self, hint: float) -> None:
        with self.lock:
            self.refused += 1
            self.hints.append(hint)

    def error(self, status: str) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def as_dict(self, seconds: float) -> dict:
        return {"attempts": self.attempts, "admitted": self.admitted, "refused": self.refused, "completed": self.completed,
                "cancelled_at_stop": self.cancelled_at_stop, "cancelled_before_first_token": self.cancelled_before_first_token,
                "errors": dict(self.errors), "tokens": self.tokens, "seconds": seconds,
                "tokens_per_s": self.tokens / seconds if seconds > 0 else None, "max_in_flight_seen": self.max_in_flight,
                "retry_hint_s": ({"min": min(self.hints), "median": statistics.median(self.hints), "max": max(self.hints)}
                                 if self.hints else None)}


# -- aggregation (pure) ---------------------------------------------------------------------------------------
def _values(records: Sequence[dict], phase: str, key: str, rep: int | None = None) -> list[float]:
    return [r[key] for r in records if r["phase"] == phase and r.get(key) is not None and (rep is None or r["rep"] == rep)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def metric_summary(records: Sequence[dict], key: str, phases: Sequence[str]) -> dict:
    """For one metric (``itl_s`` or ``ttft_s``): median [p25, p75] of each phase over every rep; for
    each loaded phase the ratio of its median to the unloaded median, the ratio in each repetition
    (median of the rep's requests / the same rep's unloaded median) with their median and range,
    and the per-prompt paired ratios (same rep and prompt, loaded / unloaded)."""
    out: dict = {"phases": {}}
    for phase in phases:
        values = _values(records, phase, key)
        out["phases"][phase] = dict(summary(values), n=len(values)) if values else None
    base = out["phases"].get(UNLOADED)
    reps = sorted({r["rep"] for r in records})
    for phase in phases:
        if phase == UNLOADED:
            continue
        loaded = out["phases"][phase]
        per_rep = []
        for rep in reps:
            u, f = _values(records, UNLOADED, key, rep), _values(records, phase, key, rep)
            if u and f:
                per_rep.append({"rep": rep, "unloaded_median": statistics.median(u), "loaded_median": statistics.median(f),
                                "ratio": statistics.median(f) / statistics.median(u)})
        ratios = [x["ratio"] for x in per_rep]
        unloaded_by = {(r["rep"], r["prompt"], r["index"]): r[key] for r in records if r["phase"] == UNLOADED and r.get(key)}
        paired = [r[key] / unloaded_by[(r["rep"], r["prompt"], r["index"])] for r in records
                  if r["phase"] == phase and r.get(key) is not None and unloaded_by.get((r["rep"], r["prompt"], r["index"]))]
        out[phase] = {
            "ratio_of_medians": _ratio(loaded["median"] if loaded else None, base["median"] if base else None),
            "per_rep": per_rep,
            "per_rep_ratio": ({"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)} if ratios else None),
            "paired": dict(summary(paired), n=len(paired)) if paired else None,
        }
    return out


def identical_outputs(records: Sequence[dict], phase: str) -> dict:
    """Quiet requests of ``phase`` whose tokens equal the same rep's unloaded request for that prompt."""
    unloaded = {(r["rep"], r["index"]): r["digest"] for r in records if r["phase"] == UNLOADED and r["digest"]}
    pairs = [(r["digest"], unloaded[(r["rep"], r["index"])]) for r in records
             if r["phase"] == phase and r["digest"] and (r["rep"], r["index"]) in unloaded]
    return {"pairs": len(pairs), "identical": sum(a == b for a, b in pairs)}


def merge_flood(tallies: Sequence[dict]) -> dict:
    """The flood phases' tallies (FloodTally.as_dict) added up; tokens/s over their summed time."""
    if not tallies:
        return {}
    out: dict = {}
    for name in ("attempts", "admitted", "refused", "completed", "cancelled_at_stop", "cancelled_before_first_token",
                 "tokens", "seconds"):
        out[name] = sum(t[name] for t in tallies)
    errors: dict[str, int] = {}
    for t in tallies:
        for status, n in t["errors"].items():
            errors[status] = errors.get(status, 0) + n
    out["errors"] = errors
    out["tokens_per_s"] = out["tokens"] / out["seconds"] if out["seconds"] > 0 else None
    out["max_in_flight_seen"] = max(t["max_in_flight_seen"] for t in tallies)
    hints = [t["retry_hint_s"] for t in tallies if t["retry_hint_s"]]
    out["retry_hint_s"] = ({"min": min(h["min"] for h in hints), "max": max(h["max"] for h in hints)} if hints else None)
    return out


def batch_size_delta(before: dict | None, after: dict | None) -> dict[str, int]:
    """The target's verify batch-size histogram between two Stats() readings (keys as strings)."""
    if before is None or after is None:
        return {}
    before = {str(k): v for k, v in before.items()}
    return {str(k): v - before.get(str(k), 0) for k, v in sorted(after.items(), key=lambda kv: int(kv[0]))
            if v - before.get(str(k), 0)}


def add_histograms(histograms: Sequence[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in histograms:
        for size, n in h.items():
            out[size] = out.get(size, 0) + n
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def mean_batch(histogram: dict[str, int]) -> float | None:
    """Mean sessions per verify forward, weighted by forwards."""
    forwards = sum(histogram.values())
    return sum(int(s) * n for s, n in histogram.items()) / forwards if forwards else None


def build_summary(records: Sequence[dict], flood_by_phase: dict[str, list[dict]], batches_by_phase: dict[str, list[dict]],
                  phases: Sequence[str], target_ratio: float) -> dict:
    """Everything the verdict and the README need, from the quiet records and the flood tallies."""
    itl = metric_summary(records, "itl_s", phases)
    ttft = metric_summary(records, "ttft_s", phases)
    ratio = (itl.get(FLOODED) or {}).get("ratio_of_medians")
    per_rep = [x["ratio"] for x in (itl.get(FLOODED) or {}).get("per_rep", [])]
    histograms = {p: add_histograms(batches_by_phase.get(p, [])) for p in phases}
    return {
        "itl": itl, "ttft": ttft,
        "flood": {p: merge_flood(flood_by_phase.get(p, [])) for p in phases if p in FLOOD_PHASES},
        "identical_outputs": {p: identical_outputs(records, p) for p in phases if p != UNLOADED},
        "verify_batch_sizes": histograms,
        "mean_verify_batch": {p: mean_batch(h) for p, h in histograms.items()},
        "quiet_errors": {p: sum(1 for r in records if r["phase"] == p and r.get("error")) for p in phases},
        "quiet_requests_without_itl": sum(1 for r in records if r.get("itl_s") is None and not r.get("error")),
        # 1: every first message held one token, so ITL = (last token - first token) / (tokens - 1)
        "first_message_tokens_max": max((r["first_message_tokens"] for r in records), default=None),
        "target_ratio": target_ratio, "ratio": ratio,
        "pass": ratio is not None and ratio <= target_ratio,
        "reps_within_target": sum(1 for x in per_rep if x <= target_ratio), "reps": len(per_rep),
    }


# -- the report (pure) ----------------------------------------------------------------------------------------
def _f(value, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{unit}"


def _ms(s: dict | None) -> str:
    return "–" if not s else f"{s['median'] * 1000:.1f} ms [{s['p25'] * 1000:.1f}, {s['p75'] * 1000:.1f}] (n = {s['n']})"


def _x(s: dict | None) -> str:
    return "–" if not s else f"{s['median']:.2f}× [{s['p25']:.2f}, {s['p75']:.2f}] (n = {s['n']})"


def _hint(hint: dict | None) -> str:
    if not hint:
        return "–"
    return f"{hint['min']:g} s" if hint["min"] == hint["max"] else f"{hint['min']:g}–{hint['max']:g} s"


def markdown_report(report: dict, plot: str | None) -> str:
    cfg, s, m = report["config"], report["summary"], report["machine"]
    phases = cfg["phases"]
    itl_ratio = s["ratio"]
    verdict = "PASS" if s["pass"] else "FAIL"
    flooded = s["flood"].get(FLOODED, {})
    lines = [
        "# Noisy neighbour: a quiet tenant under another tenant's flood", "",
        f"**{verdict}**: under a flood from one tenant at its quota (max_concurrent {cfg['flood_quota']}, "
        f"{cfg['flood_clients']} flooding clients), the quiet tenant's median inter-token latency was "
        f"**{_f(itl_ratio, 2)}×** its unloaded value (target ≤ {s['target_ratio']:g}×); "
        f"{s['reps_within_target']} of {s['reps']} repetitions within the target on their own.", "",
        f"- command: `{report['command']}`",
        f"- machine: {m.get('cpu', '?')} ({m.get('cores', '?')} cores), torch {m.get('torch', '?')}, "
        f"{m.get('torch_threads', '?')} torch threads; load average (1, 5, 15 min) before the run "
        f"{report['load']['before']}, after {report['load']['after']} (`uptime`: "
        f"`{report['load'].get('uptime_before', '')}` / `{report['load'].get('uptime_after', '')}`)",
        f"- served instance: Ray Serve + gRPC + Redis on loopback, pool `{cfg['pool']}`, k = {cfg['k']}, greedy, "
        f"{cfg['max_new_tokens']} new tokens per request, target verify batches of at most {cfg['max_batch_size']}",
        f"- prompts: {cfg['prompts']}",
        f"- phases per repetition: {', '.join(phases)} (order reversed in every other repetition), "
        f"{cfg['reps']} repetitions, {cfg['quiet_requests']} quiet requests per phase, one stream at a time; "
        f"run time {report['wall_s'] / 60:.1f} min (serving start-up included)",
        "",
        "## The quiet tenant", "",
        "Median [p25, p75] over the quiet requests of every repetition. ITL: a request's mean gap between "
        "streamed tokens after its first message (tokens arrive a verify round at a time)"
        + (", here (last token time − first token time) / (tokens − 1), as every first message held one token"
           if s.get("first_message_tokens_max") == 1 else "")
        + "; TTFT: request sent to first token.", "",
        "| phase | ITL | TTFT | ITL ratio of medians | ITL ratio per rep: median [min, max] | ITL paired per prompt | TTFT ratio of medians |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase in phases:
        itl_p, ttft_p = s["itl"]["phases"].get(phase), s["ttft"]["phases"].get(phase)
        if phase == UNLOADED:
            lines.append(f"| {phase} | {_ms(itl_p)} | {_ms(ttft_p)} | 1 | – | – | 1 |")
            continue
        itl_l, ttft_l = s["itl"].get(phase) or {}, s["ttft"].get(phase) or {}
        rr = itl_l.get("per_rep_ratio")
        rr_text = "–" if not rr else f"{rr['median']:.2f}× [{rr['min']:.2f}, {rr['max']:.2f}]"
        lines.append(f"| {phase} | {_ms(itl_p)} | {_ms(ttft_p)} | **{_f(itl_l.get('ratio_of_medians'), 2)}×** | {rr_text} | "
                     f"{_x(itl_l.get('paired'))} | {_f(ttft_l.get('ratio_of_medians'), 2)}× |")
    lines += ["", "Per repetition (ITL medians):", ""]
    for phase in phases:
        for x in (s["itl"].get(phase) or {}).get("per_rep", []):
            lines.append(f"- rep {x['rep']} {phase}: {_f(x['loaded_median'], 1, 1000)} ms vs unloaded "
                         f"{_f(x['unloaded_median'], 1, 1000)} ms: {x['ratio']:.2f}×")
    for phase, same in s["identical_outputs"].items():
        lines.append(f"- greedy outputs identical to the unloaded run of the same prompt ({phase}): "
                     f"{same['identical']} of {same['pairs']}")
    for phase, n in s["quiet_errors"].items():
        if n:
            lines.append(f"- **{n} quiet request(s) failed** ({phase}): "
                         + "; ".join(sorted({r['error'] for r in report.get('quiet_requests', []) if r.get('error') and r['phase'] == phase})))
    if s["quiet_requests_without_itl"]:
        lines.append(f"- {s['quiet_requests_without_itl']} quiet request(s) arrived in one message: no ITL, left out")
    if plot:
        lines += ["", f"![quiet tenant ITL per request]({plot})"]
    lines += ["", "## The flood", "",
              "| phase | flooding tenant | attempts | admitted | refused (RESOURCE_EXHAUSTED) | completed | cancelled at phase end | "
              "other errors | max streams in flight seen | flood tokens/s | retry hint | mean verify batch |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for phase, f in s["flood"].items():
        if not f:
            continue
        hint = f["retry_hint_s"]
        quota = f"max_concurrent {cfg['flood_quota']}" if phase == FLOODED else "no quota"
        lines.append(f"| {phase} | `{FLOOD_PHASES[phase]}` ({quota}) | {f['attempts']} | {f['admitted']} | {f['refused']} | "
                     f"{f['completed']} | {f['cancelled_at_stop'] + f['cancelled_before_first_token']} | "
                     f"{sum(f['errors'].values()) or 0}{' ' + json.dumps(f['errors']) if f['errors'] else ''} | "
                     f"{f['max_in_flight_seen']} | {_f(f['tokens_per_s'], 1)} | "
                     f"{_hint(hint)} | {_f(s['mean_verify_batch'].get(phase), 2)} |")
    lines += ["", "The target's verify batch sizes (sessions per forward) in each kind of phase: " + "; ".join(
        f"{p}: {json.dumps(h) if h else '–'}" for p, h in s["verify_batch_sizes"].items()), ""]
    lines += [
        "## Why", "",
        f"- **The quota bounds the flooder's concurrency.** Admission (specpool/services/admission.py) counts the "
        f"flooding tenant's running requests in Redis and refuses a request beyond its {cfg['flood_quota']} at once "
        f"(RESOURCE_EXHAUSTED with a retry hint), before tokenization and before any model work: "
        f"however many clients it runs, at most {cfg['flood_quota']} of its requests reach the models, and each refusal "
        f"costs the router a Lua call, not a forward. Its clients wait the hint and retry. "
        f"The client saw at most {flooded.get('max_in_flight_seen', '–')} of its streams in flight.",
        f"- **Batched verification shares the forward.** The target joins the verify calls of concurrent sessions "
        f"into one forward (`@serve.batch`, up to {cfg['max_batch_size']} sessions): under the flood the quiet "
        "tenant's rounds ride in a batch with the flooder's admitted sessions rather than queueing behind them, so "
        "its round costs one batched forward, not one forward per session ahead of it. On this CPU a batched "
        "forward still costs more than a single one (the work grows with the rows), so the quiet tenant's ITL "
        "grows with the flooder's admitted concurrency: the quota is what keeps it bounded.",
        "- The machine is small (2 cores shared by the client, the router, the target and the drafter), so the "
        "flood's client threads and the router's handling of refused requests take CPU from the quiet tenant too; "
        "the load average above says what else ran.",
    ]
    if FLOODED_UNQUOTED in phases:
        r = (s["itl"].get(FLOODED_UNQUOTED) or {}).get("ratio_of_medians")
        lines.append(f"- Control: the same {cfg['flood_clients']} clients from a tenant without a quota put the quiet "
                     f"tenant's median ITL at {_f(r, 2)}× its unloaded value.")
    lines += [
        "", "## Caveats", "",
        "- The figures are from one run on one machine; compare the ratios, not absolute milliseconds, with other hosts.",
        "- Figures meant to hold should be measured on held-out prompts (not the dev set that specpool was developed "
        "and tuned on): " + ("this run used the built-in held-out set." if cfg["prompts"].startswith("built-in")
                             else "this run used " + cfg["prompts"] + "; re-measure with the built-in held-out set "
                             "(`--prompts builtin`) or other held-out prompts."),
        "- ITL here is the quiet tenant's own view through the real client on loopback: it includes gRPC and the "
        "router's loop, as a user sees them.",
        "", f"Raw figures: `report.json` (every quiet request, every phase's flood tally).", "",
    ]
    return "\n".join(lines)


def plot_itl(records: Sequence[dict], phases: Sequence[str], path: Path, title: str, target_ratio: float | None = None) -> None:
    """Each quiet request's ITL by phase and repetition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = sorted({r["rep"] for r in records})
    colours = {UNLOADED: "tab:blue", FLOODED: "tab:orange", FLOODED_UNQUOTED: "tab:red"}
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    width = 0.8 / max(1, len(phases))
    for rep in reps:
        for j, phase in enumerate(phases):
            ys = [r["itl_s"] * 1000 for r in records if r["phase"] == phase and r["rep"] == rep and r.get("itl_s")]
            x = rep + (j - (len(phases) - 1) / 2) * width
            ax.scatter([x] * len(ys), ys, s=12, color=colours.get(phase, "k"), alpha=0.7,
                       label=phase if rep == reps[0] else None)
            if ys:
                ax.hlines(statistics.median(ys), x - width / 2.5, x + width / 2.5, color=colours.get(phase, "k"))
        base = [r["itl_s"] * 1000 for r in records if r["phase"] == UNLOADED and r["rep"] == rep and r.get("itl_s")]
        if base and target_ratio:  # the target: a loaded median must stay under this line
            ax.hlines(statistics.median(base) * target_ratio, rep - 0.45, rep + 0.45, color="grey", linestyles="dashed",
                      label=f"{target_ratio:g}× unloaded median" if rep == reps[0] else None)
    ax.set_xticks(reps)
    ax.set_xlabel("repetition")
    ax.set_ylabel("quiet tenant ITL (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.flood", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=BUILTIN,
                   help="prompts: 'builtin' (the held-out set in bench/flood.py, default) or a JSON-lines file with "
                        "category and turns (Spec-Bench), e.g. ../shared/data/prompts/dev.jsonl")
    p.add_argument("--pool", default="ngram", help="drafters of the served instance (default ngram)")
    p.add_argument("-k", type=int, default=5, help="draft length (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per request, both tenants (default 48)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the phases (default 3)")
    p.add_argument("--quiet-requests", type=int, default=8, help="quiet tenant's requests per phase (default 8)")
    p.add_argument("--flood-clients", type=int, default=8, help="flooding client threads (default 8)")
    p.add_argument("--flood-quota", type=int, default=2, help="the flooding tenant's max_concurrent (default 2)")
    p.add_argument("--control", action="store_true",
                   help="add a phase flooded by a tenant without a quota (same clients), to show what the quota holds back")
    p.add_argument("--target-ratio", type=float, default=1.5,
                   help="the flooded / unloaded median ITL the verdict holds the run to (default 1.5)")
    p.add_argument("--max-batch-size", type=int, default=8, help="the target's verify batch limit (default 8, the served default)")
    p.add_argument("--flood-ramp", type=float, default=15.0,
                   help="most seconds a flood phase waits for the flood to reach its quota before the quiet requests (default 15)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds between phases once the server is idle (default 1)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis of the served instance")
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline of one request in seconds (default 300)")
    p.add_argument("--out", default=default_out("flood"), help=f"output folder (default ./{default_out('flood')})")
    return p


def check_args(args: argparse.Namespace) -> None:
    check(args.reps >= 1, f"--reps must be >= 1, got {args.reps}")
    check(args.quiet_requests >= 1, f"--quiet-requests must be >= 1, got {args.quiet_requests}")
    check(args.flood_clients >= 1, f"--flood-clients must be >= 1, got {args.flood_clients}")
    check(args.flood_quota >= 1, f"--flood-quota must be >= 1 (the flooding tenant's max_concurrent), got {args.flood_quota}")
    check(args.max_new_tokens >= 2, f"--max-new-tokens must be >= 2 (ITL needs two tokens), got {args.max_new_tokens}")
    check(1 <= args.k <= 64, f"-k must be in 1..64, got {args.k}")
    check(args.target_ratio > 0, f"--target-ratio must be > 0, got {args.target_ratio}")
    check(1 <= args.max_batch_size <= 256, f"--max-batch-size must be in 1..256, got {args.max_batch_size}")
    check(args.flood_ramp >= 0 and args.settle >= 0, "--flood-ramp and --settle must be >= 0 seconds")
    check(args.request_timeout > 0, f"--request-timeout must be > 0, got {args.request_timeout}")
    check(bool([p for p in args.pool.split(",") if p.strip()]), "--pool is empty")


def phase_order(rep: int, control: bool) -> list[str]:
    """The phases of repetition ``rep`` (0-based): forward in even reps, reversed in odd ones."""
    phases = [UNLOADED, FLOODED] + ([FLOODED_UNQUOTED] if control else [])
    return phases if rep % 2 == 0 else phases[::-1]


def quotas_document(flood_tenant: str, flood_quota: int) -> str:
    """The quota file: the flooding tenant capped at ``flood_quota`` requests at once; everyone
    else (the quiet tenant, the control's unquoted tenant) the default, which has no limit."""
    return json.dumps({"default": {}, "tenants": {flood_tenant: {"max_concurrent": flood_quota}}}) + "\n"


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "bench.flood", *argv])


def load_average() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def uptime_line() -> str:
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _say(message: str) -> None:
    print(f"flood: {message}", flush=True)


# -- the run --------------------------------------------------------------------------------------------------
def quiet_request(client, prompt: str, args: argparse.Namespace) -> tuple[StreamTiming, list[int]]:
    timing, tokens = StreamTiming(), []
    started = time.perf_counter()
    for chunk in client.generate_stream(prompt, max_new_tokens=args.max_new_tokens, k=args.k, temperature=0.0,
                                        session_id=uuid.uuid4().hex, timeout=args.request_timeout):
        timing.arrivals.append((time.perf_counter() - started, len(chunk.token_ids)))
        tokens.extend(chunk.token_ids)
    timing.wall_s = time.perf_counter() - started
    return timing, tokens


class Flood:
    """``clients`` threads of one tenant sending streamed requests back to back over the raw stub
    (so a refusal's trailing metadata, the retry hint, is readable), until ``stop()``."""

    def __init__(self, stub, key: str, prompts: Sequence[str], args: argparse.Namespace):
        self.stub, self.prompts, self.args = stub, list(prompts), args
        self.metadata = [("authorization", f"Bearer {key}")]
        self.tally = FloodTally()
        self._stop = threading.Event()
        self._calls: dict[int, object] = {}
        self._calls_lock = threading.Lock()
        self._counter = iter(range(1 << 62))
        self._threads = [threading.Thread(target=self._worker, args=(i,), name=f"flood-{i}", daemon=True)
                         for i in range(args.flood_clients)]
        self.started = self.stopped = 0.0

    def start(self) -> None:
        self.started = time.perf_counter()
        for t in self._threads:
            t.start()

    def stop(self) -> float:
        """Stops the threads, cancelling their streams in flight; the flood's seconds."""
        self._stop.set()
        self.stopped = time.perf_counter()
        with self._calls_lock:
            for call in list(self._calls.values()):
                call.cancel()
        for t in self._threads:
            t.join(timeout=60)
        return self.stopped - self.started

    def _worker(self, i: int) -> None:
        import grpc

        from specpool.services.api import request_to_proto

        while not self._stop.is_set():
            with self._calls_lock:
                n = next(self._counter)
            request = request_to_proto(self.prompts[n % len(self.prompts)], max_new_tokens=self.args.max_new_tokens,
                                       k=self.args.k, session_id=uuid.uuid4().hex)
            self.tally.add(attempts=1)
            got_token = False
            call = self.stub.GenerateStream(request, metadata=self.metadata, timeout=self.args.request_timeout)
            with self._calls_lock:
                self._calls[i] = call
            if self._stop.is_set():  # stop() may have cancelled the calls just before this one was made
                call.cancel()
            try:
                for msg in call:
                    if msg.token_ids:
                        tokens = len(msg.token_ids)
                        if not got_token:
                            got_token = True
                            self.tally.add(admitted=1, in_flight=1, tokens=tokens)
                        else:
                            self.tally.add(tokens=tokens)
                if not got_token:
                    self.tally.add(admitted=1)
                self.tally.add(completed=1)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    hint = retry_hint_s(exc.trailing_metadata())
                    self.tally.refusal(hint)
                    self._stop.wait(hint)  # a real client's back-off: the server said when a slot may be free
                elif code == grpc.StatusCode.CANCELLED and self._stop.is_set():
                    self.tally.add(**({"cancelled_at_stop": 1} if got_token else {"cancelled_before_first_token": 1}))
                else:
                    self.tally.error(code.name if code is not None else type(exc).__name__)
                    self._stop.wait(0.5)  # not a quota refusal: do not spin on it
            finally:
                with self._calls_lock:
                    self._calls.pop(i, None)
                if got_token:
                    self.tally.add(in_flight=-1)


class Server:
    """Introspection of the served instance through Serve handles (this process started Ray)."""

    def __init__(self):
        from ray import serve

        self._router = serve.get_deployment_handle("Router", app_name="router")
        self._target = serve.get_deployment_handle("Target", app_name="target")

    def batch_sizes(self) -> dict | None:
        try:
            return self._target.options(method_name="Stats").remote().result(timeout_s=60)["batch_sizes"]
        except Exception as exc:  # noqa: BLE001 - a missing histogram costs a table row, not the run
            _say(f"no batch sizes ({type(exc).__name__}: {exc})")
            return None

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Until the router runs no request (the cancelled flood streams have stopped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if not self._router.options(method_name="Active").remote().result(timeout_s=30):
                    return True
            except Exception:  # noqa: BLE001 - fall back to waiting out the timeout
                pass
            time.sleep(0.25)
        return False


def run_phases(args: argparse.Namespace, address: str, keys: dict[str, str], prompts: list[str],
               server: Server | None, progress: Callable[[str], None] = _say) -> tuple[list[dict], dict, dict]:
    """Every repetition's phases: the quiet records, the flood tallies and batch histograms by phase."""
    import grpc

    from specpool.services.client import SpecPoolClient
    from specpool.v1 import specpool_pb2_grpc

    quiet = SpecPoolClient(address, api_key=keys[QUIET])
    channel = grpc.insecure_channel(address)
    stub = specpool_pb2_grpc.SpecPoolStub(channel)
    quiet_prompts = [prompts[i % len(prompts)] for i in range(args.quiet_requests)]
    flood_prompts = prompts[args.quiet_requests % len(prompts):] + prompts[:args.quiet_requests % len(prompts)]
    records: list[dict] = []
    floods: dict[str, list[dict]] = {}
    batches: dict[str, list[dict]] = {}
    try:
        progress("warm-up: a quiet request and a short flood ...")
        quiet_request(quiet, quiet_prompts[0], args)
        warm = Flood(stub, keys[FLOOD], flood_prompts, argparse.Namespace(**{**vars(args), "flood_clients": args.flood_quota}))
        warm.start()
        quiet_request(quiet, quiet_prompts[-1], args)
        warm.stop()
        if server is not None:
            server.wait_idle()
        for rep in range(args.reps):
            for phase in phase_order(rep, args.control):
                before = server.batch_sizes() if server is not None else None
                flood = None
                if phase in FLOOD_PHASES:
                    flood = Flood(stub, keys[FLOOD_PHASES[phase]], flood_prompts, args)
                    flood.start()
                    ramp_end = time.monotonic() + args.flood_ramp
                    # Its quota's worth of streams (every client's, for the tenant without a quota).
                    want = args.flood_clients if phase == FLOODED_UNQUOTED else min(args.flood_quota, args.flood_clients)
                    while flood.tally.in_flight < want and time.monotonic() < ramp_end:
                        time.sleep(0.05)
                progress(f"rep {rep + 1}/{args.reps} {phase}: {args.quiet_requests} quiet requests"
                         + (f" (flood: {flood.tally.in_flight} streams in flight)" if flood else "") + " ...")
                for index, prompt in enumerate(quiet_prompts):
                    where = dict(phase=phase, rep=rep + 1, index=index, prompt=prompts.index(prompt))
                    try:
                        timing, tokens = quiet_request(quiet, prompt, args)
                    except SpecpoolError as exc:  # the quiet tenant failing under the flood is a finding, not a crash
                        records.append(failed_record(f"{getattr(exc, 'code', type(exc).__name__)}: {exc}", **where))
                        progress(f"  quiet request {index} failed: {records[-1]['error']}")
                        continue
                    records.append(quiet_record(timing, tokens, **where))
                if flood is not None:
                    seconds = flood.stop()
                    floods.setdefault(phase, []).append(flood.tally.as_dict(seconds))
                if server is not None:
                    after = server.batch_sizes()
                    batches.setdefault(phase, []).append(batch_size_delta(before, after))
                    server.wait_idle()
                time.sleep(args.settle)
                done = [r for r in records if r["phase"] == phase and r["rep"] == rep + 1 and r["itl_s"]]
                if done:
                    progress(f"  median ITL {statistics.median(r['itl_s'] for r in done) * 1000:.1f} ms"
                             + (f"; flood admitted {floods[phase][-1]['admitted']}, refused {floods[phase][-1]['refused']}"
                                if flood else ""))
    finally:
        quiet.close()
        channel.close()
    return records, floods, batches


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_args(args)
    items, prompts_label = load_prompt_set(args.prompts)
    prompts = [text for _, text in items]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from specpool.services.auth import add_key
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    load_before, uptime_before = load_average(), uptime_line()
    begin = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="specpool-flood-"))
    keys_file, quotas_file = folder / "keys.yaml", folder / "quotas.json"
    tenants = [QUIET, FLOOD] + ([UNQUOTED] if args.control else [])
    keys = {tenant: add_key(keys_file, tenant) for tenant in tenants}
    quotas_file.write_text(quotas_document(FLOOD, args.flood_quota))
    pool = [p.strip() for p in args.pool.split(",") if p.strip()]
    config = default_serve_config(pool, args.redis_url, free_port(), http_port=free_port(), k=args.k)
    namespace = f"specpool-flood-{uuid.uuid4().hex[:8]}"  # the run's own Redis keys, deleted at the end
    for app in config["applications"]:
        if app["name"] == "router":
            app["args"].update(redis_namespace=namespace, api_keys_file=str(keys_file), quotas_file=str(quotas_file))
        if app["name"] == "target":
            app["args"]["max_batch_size"] = args.max_batch_size
    local = start_local(plan_from_config(config, "the flood benchmark's config"), metrics_port=None, progress=_say)
    try:
        records, floods, batches = run_phases(args, local.address, keys, prompts, Server())
    finally:
        delete_namespace(args.redis_url, namespace)
        local.shutdown()
        for path in (keys_file, quotas_file):
            path.unlink(missing_ok=True)
        folder.rmdir()
    wall = time.perf_counter() - begin
    phases = phase_order(0, args.control)
    report = {
        "command": command_line(argv), "machine": machine_info("cpu"),
        "load": {"before": load_before, "after": load_average(), "uptime_before": uptime_before, "uptime_after": uptime_line()},
        "config": {"pool": ",".join(pool), "k": args.k, "max_new_tokens": args.max_new_tokens, "reps": args.reps,
                   "quiet_requests": args.quiet_requests, "flood_clients": args.flood_clients, "flood_quota": args.flood_quota,
                   "control": args.control, "phases": phases, "max_batch_size": args.max_batch_size,
                   "prompts": prompts_label, "prompt_count": len(prompts), "flood_ramp_s": args.flood_ramp,
                   "settle_s": args.settle, "quotas": json.loads(quotas_document(FLOOD, args.flood_quota))},
        "wall_s": wall,
        "summary": build_summary(records, floods, batches, phases, args.target_ratio),
        "flood_by_phase": floods, "verify_batches_by_phase": batches, "quiet_requests": records,
    }
    write_report(out, report)
    return 0


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot = None
    try:
        cfg = report["config"]
        plot_itl(report["quiet_requests"], cfg["phases"], out / "itl.png",
                 f"quiet tenant vs {cfg['flood_clients']} flooding clients at max_concurrent {cfg['flood_quota']}",
                 report["summary"]["target_ratio"])
        plot = "itl.png"
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        _say(f"no plot ({exc})")
    (out / "README.md").write_text(markdown_report(report, plot))
    s = report["summary"]
    _say(f"{'PASS' if s['pass'] else 'FAIL'}: quiet median ITL flooded / unloaded {_f(s['ratio'], 2)}x "
         f"(target <= {s['target_ratio']:g}x); flood {json.dumps({k: v for k, v in s['flood'].get(FLOODED, {}).items() if k in ('admitted', 'refused', 'tokens_per_s')})}")
    _say(f"wrote {out / 'report.json'}, {out / 'README.md'}")


if __name__ == "__main__":
    sys.exit(main())
