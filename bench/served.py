"""``specpool bench-served``: served mode (Ray Serve + gRPC + Redis) against the embedded engine.

One run (docs/ARCHITECTURE.md, "Measuring"): it starts a local served deployment (the same ``start_local``
as `specpool serve`) and the embedded engine with the same models in a child process of its own
(``EmbeddedWorker``: no Ray in it, as in a user's `specpool generate`), then

1. **single session, side by side**: for every prompt, served (GenerateStream over gRPC on
   loopback) and embedded (``EmbeddedEngine.generate``), alternating which goes first; greedy
   (or sampled at ``--temperature``, seeded by the prompt's length in characters), same policy,
   pool, k and seed. Reports tokens/s of each, their ratio (per prompt and pooled), and whether
   the tokens are identical (sampled, they are where the drafts are: a head on a drafter deployment
   reads float16 features, which can change a draft and so the tokens drawn, each side's still
   following the target's distribution);
2. **concurrency**: 1, 4 and 8 client sessions at once (threads, one gRPC stream each) working
   through the prompts; aggregate tokens/s = all tokens / wall time, and the target's batch sizes;
3. **latency** at every concurrency level: time to first token (TTFT, request sent -> first
   streamed token) and inter-token latency (ITL: each streamed message's gap since the previous
   one, spread over the tokens it carries; tokens arrive a round at a time).

Writes results.json, report.md and throughput.png to --out. Aggregation and rendering are pure
functions below (unit-tested).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import queue
import shlex
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from bench.common import WARMUP_PROMPT, default_out, expand_pool, load_questions, machine_info
from specpool.core.defaults import DEFAULT_K, DEFAULT_POLICY
from specpool.core.errors import check
from specpool.services import batch_trace

DEFAULT_CONCURRENCY = "1,4,8"
EMBEDDED_START_TIMEOUT_S = 600.0  # loading the target and the pool's drafters in the child


class EmbeddedWorker:
    """The embedded engine in a child process without Ray, answering one prompt at a time.

    Why not in the benchmark's own process: that process is the Ray driver and the gRPC client,
    and their threads share its interpreter. Measured there, the embedded engine ran ~30 % slower
    than alone on a 2-core box (the code prompt took 6.7 s instead of 2.7 s), which flattered
    served mode (served/embedded read 1.04 where the fair figure was ~0.75). A user's
    `specpool generate` has no Ray in its process; neither has this one. The child is started
    with "spawn", so it inherits none of the driver's threads or state.
    """

    def __init__(self, home: Path, pool: Sequence[str], k: int, max_new_tokens: int, policy: str,
                 temperature: float = 0.0):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_embedded_worker_main, name="specpool-bench-embedded", daemon=True,
                                        args=(child_conn, str(home), list(pool), k, max_new_tokens, policy, temperature))
        self._process.start()
        child_conn.close()  # only the child holds its end: its death then reads as EOF here
        self._receive(EMBEDDED_START_TIMEOUT_S, "loading")

    def generate(self, prompt: str) -> tuple[list[int], float, dict]:
        """(token ids, wall seconds of ``EmbeddedEngine.generate`` in the child, its ``time_split``)."""
        self._conn.send(prompt)
        return self._receive(None, "generating")

    def _receive(self, timeout: float | None, doing: str):
        from specpool.core.errors import SpecpoolError

        if timeout is not None and not self._conn.poll(timeout):
            self.close()
            raise SpecpoolError(f"the embedded engine's process did not finish {doing} within {timeout:.0f} s")
        try:
            status, payload = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise SpecpoolError(f"the embedded engine's process died while {doing} (exit code {self._process.exitcode})") from None
        if status != "ok":
            raise SpecpoolError(f"the embedded engine failed while {doing}: {payload}")
        return payload

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()


def prompt_seed(prompt: str) -> int:
    """The seed of a sampled request for ``prompt``, served and embedded alike: its length in characters."""
    return len(prompt)


def _embedded_worker_main(conn, home: str, pool: list[str], k: int, max_new_tokens: int, policy: str,
                          temperature: float = 0.0) -> None:
    """Child process of ``EmbeddedWorker``: load, say ready, then answer prompts until None."""
    try:
        from specpool.services.engine import EmbeddedEngine, EngineConfig
        from specpool.services.serve_config import DEFAULT_TARGET
        from specpool.target.models import ModelConfig
        from specpool.target.sampling import SamplingParams

        engine = EmbeddedEngine(EngineConfig(home=Path(home), target=ModelConfig(DEFAULT_TARGET)))
        for name in pool:
            engine.drafter(name)
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids(), temperature=temperature)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    while (prompt := conn.recv()) is not None:
        try:
            ids = engine.encode_prompt(prompt)
            started = time.perf_counter()
            result = engine.generate(ids, dataclasses.replace(params, seed=prompt_seed(prompt)), k=k,
                                     session_id=uuid.uuid4().hex, policy=policy, pool=pool)
            wall = time.perf_counter() - started
            split = time_split(rounds=len(result.rounds), wall_s=wall, loop_s=result.wall_s, **result.call_seconds())
            conn.send(("ok", (list(result.token_ids), wall, split)))
        except Exception as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def add_bench_served_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", required=True, help="Spec-Bench / MT-Bench question file (JSON lines with category and turns)")
    parser.add_argument("--limit-per-category", type=int, default=1, help="first N prompts of each category (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    parser.add_argument("--pool", default=None,
                        help="drafters served and chosen among, any drafter specs (eagle:NAME too); 'white-box' stands for "
                             "every shipped head, 'mixed' for those, lookup:code and ngram; the same pool runs embedded "
                             "(default: what `specpool serve` deploys, every shipped head behind prompt lookup and ngram)")
    parser.add_argument("--policy", default=None,
                        help=f"drafter-choice policy, served and embedded (default: as `specpool serve`, "
                             f"fixed:lookup:eagle:general over the default pool, {DEFAULT_POLICY} over a --pool)")
    parser.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft length (default {DEFAULT_K})")
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help=f"concurrent sessions to measure (default {DEFAULT_CONCURRENCY})")
    parser.add_argument("--requests-per-level", type=int, default=0,
                        help="requests at each concurrency level (default: max(#prompts, 2 x sessions))")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature, seeded by each prompt's length (default 0: greedy, outputs compared)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="the target's @serve.batch size (default 8)")
    parser.add_argument("--host-heads", default=None, action=argparse.BooleanOptionalAction,
                        help="the target deployment hosts the pool's white-box heads and drafts with them inside its verify "
                             "call (as `specpool serve`, whose default this follows); --no-host-heads: a drafter deployment each")
    parser.add_argument("--load-gate", default=None, action=argparse.BooleanOptionalAction,
                        help="with hosted heads, batches of several sessions draft only where that has measured faster "
                             "(as `specpool serve`, the default); --no-load-gate: every batch drafts")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--port", type=int, default=50061, help="gRPC port of the benchmark's own server (default 50061)")
    parser.add_argument("--out", default=default_out("served"), help=f"output folder (default ./{default_out('served')} in the working directory)")


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    check(bool(levels) and all(1 <= n <= 64 for n in levels), f"--concurrency must be comma-separated numbers in 1..64, got {text!r}")
    return sorted(set(levels))


# -- pure aggregation ------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class StreamTiming:
    """When a streamed request's messages arrived, relative to sending it."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since send, tokens in message)
    wall_s: float = 0.0  # send -> last message

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    def ttft(self) -> float | None:
        return next((t for t, n in self.arrivals if n > 0), None)

    def inter_token(self) -> list[float]:
        """Per-token gaps: a message's gap since the previous token-bearing one, spread over its tokens."""
        gaps: list[float] = []
        previous = None
        for t, n in self.arrivals:
            if n <= 0:
                continue
            if previous is not None:
                gaps.extend([(t - previous) / n] * n)
            previous = t
        return gaps


def time_split(*, rounds: int, wall_s: float, loop_s: float, draft_s: float, draft_forward_s: float,
               verify_s: float, verify_forward_s: float) -> dict:
    """Where one request's time went, in seconds: the models' forwards, reaching them (transport,
    queueing, conversion: a call's wall time minus its forward), the rest of the speculative loop
    (the policy and its state store, streaming callbacks) and what lies outside the loop (request
    set-up, the client's transport, release).

    A head the target hosts (specpool/router/hosted.py) drafts inside the verify call: the router's
    draft time is then ~0 and its forwards lie in ``verify_s``; the draft forward time beyond
    ``draft_s`` is taken out of reaching the target."""
    inside_verify = max(0.0, draft_forward_s - draft_s)
    return {
        "rounds": rounds, "wall_s": wall_s,
        "draft_forward_s": draft_forward_s, "draft_reach_s": max(0.0, draft_s - draft_forward_s),
        "verify_forward_s": verify_forward_s, "verify_reach_s": max(0.0, verify_s - verify_forward_s - inside_verify),
        "loop_other_s": max(0.0, loop_s - draft_s - verify_s), "outside_loop_s": max(0.0, wall_s - loop_s),
    }


SPLIT_PARTS = (("draft_forward_s", "draft forward"), ("draft_reach_s", "reaching drafter"),
               ("verify_forward_s", "verify forward"), ("verify_reach_s", "reaching target"),
               ("loop_other_s", "rest of loop"), ("outside_loop_s", "outside loop"))


def split_per_round(splits: Sequence[dict]) -> dict | None:
    """Pooled over requests: each part's total seconds / total rounds (ms per round below)."""
    rounds = sum(x["rounds"] for x in splits)
    if not rounds:
        return None
    out = {key: sum(x[key] for x in splits) / rounds for key, _ in SPLIT_PARTS}
    out["total_s"] = sum(x["wall_s"] for x in splits) / rounds
    out["rounds"] = rounds
    return out


def latency_summary(timings: Sequence[StreamTiming]) -> dict:
    ttft = [t for t in (x.ttft() for x in timings) if t is not None]
    itl = [g for x in timings for g in x.inter_token()]
    return {
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "requests": len(timings), "tokens": sum(x.tokens for x in timings),
    }


def single_session_summary(records: Sequence[dict]) -> dict:
    """Served vs embedded over the side-by-side records (one per prompt)."""
    ratios = [r["served_tps"] / r["embedded_tps"] for r in records if r["embedded_tps"] and r["served_tps"]]
    served_tokens = sum(r["served_tokens"] for r in records)
    embedded_tokens = sum(r["embedded_tokens"] for r in records)
    served_s = sum(r["served_s"] for r in records)
    embedded_s = sum(r["embedded_s"] for r in records)
    served_tps = served_tokens / served_s if served_s else None
    embedded_tps = embedded_tokens / embedded_s if embedded_s else None
    return {
        "prompts": len(records),
        "served_tokens_per_s": served_tps, "embedded_tokens_per_s": embedded_tps,
        "ratio_pooled": served_tps / embedded_tps if served_tps and embedded_tps else None,
        "ratio_mean_per_prompt": sum(ratios) / len(ratios) if ratios else None,
        "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
        "identical_outputs": sum(1 for r in records if r["identical"]),
        "ms_per_round": {system: split_per_round([r[f"{system}_split"] for r in records if r.get(f"{system}_split")])
                         for system in ("served", "embedded")},
    }


def decoding(cfg: dict) -> str:
    temperature = cfg.get("temperature") or 0.0
    return f"sampled at T = {temperature:g} (seed = prompt length in characters)" if temperature > 0 else "greedy"


def _f(value, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{unit}"


def markdown_report(result: dict, plot: str | None) -> str:
    cfg, single, levels = result["config"], result["single_session"], result["concurrency"]
    lines = [
        "# Served vs embedded", "",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine'].get('cpu')} ({result['machine'].get('cores')} cores), torch {result['machine'].get('torch')}; "
        f"Ray {result['machine'].get('ray')}, grpcio {result['machine'].get('grpcio')}",
        f"- target {cfg['target']}, pool {', '.join(cfg['pool'])}, policy {cfg['policy']}, k {cfg['k']}, {decoding(cfg)}, "
        f"{cfg['max_new_tokens']} new tokens, {single['prompts']} prompts ({cfg['prompts_file']}, {cfg['limit_per_category']} per category)",
        f"- served: router + target (@serve.batch max {cfg['max_batch_size']}{hosted_note(cfg)}) + "
        f"{plural(len(cfg['pool']) - len(hosted_drafters(cfg)), 'drafter deployment')} on one local Ray, "
        "client over gRPC on loopback, session state in Redis; embedded: the same models in a child process without Ray, in-memory state",
        "",
        "## Single session, side by side", "",
        "| system | tokens/s (pooled) |", "|---|---|",
        f"| embedded | {_f(single['embedded_tokens_per_s'])} |",
        f"| served | {_f(single['served_tokens_per_s'])} |",
        "",
        f"**served / embedded = {_f(single['ratio_pooled'], 3)}** pooled (total tokens / total time); mean of per-prompt ratios "
        f"{_f(single['ratio_mean_per_prompt'], 3)} (min {_f(single['ratio_min'], 3)}, max {_f(single['ratio_max'], 3)}). "
        + (f"Identical greedy outputs: {single['identical_outputs']} of {single['prompts']}." if not cfg.get("temperature")
           else f"Identical sampled outputs (same seeds): {single['identical_outputs']} of {single['prompts']}; a draft that "
                "differs (float16 features on the wire) changes the tokens drawn, not their distribution."),
        "",
        *split_table(single.get("ms_per_round") or {}),
        "## Concurrent sessions (served)", "",
        "| sessions | requests | tokens | wall s | aggregate tokens/s | × 1 session | TTFT p50 / p99 | ITL p50 / p99 | target batch sizes | of them without drafts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((lv["tokens_per_s"] for lv in levels if lv["sessions"] == 1), None)
    for lv in levels:
        lat = lv["latency"]
        sizes = ", ".join(f"{size}×{count}" for size, count in sorted(lv["batch_sizes"].items(), key=lambda kv: int(kv[0])))
        lines.append(
            f"| {lv['sessions']} | {lv['requests']} | {lv['tokens']} | {lv['wall_s']:.1f} | {_f(lv['tokens_per_s'])} | "
            f"{_f(lv['tokens_per_s'] / base if base else None)} | {_f(lat['ttft_p50_s'], 0, 1000, ' ms')} / {_f(lat['ttft_p99_s'], 0, 1000, ' ms')} | "
            f"{_f(lat['itl_p50_s'], 0, 1000, ' ms')} / {_f(lat['itl_p99_s'], 0, 1000, ' ms')} | {sizes or '–'} | "
            f"{lv.get('plain_batches', 0)} |"
        )
    lines += ["", "Target batch sizes: `size×count` of the target's verify forwards at that level (from its `Stats`); "
              "without drafts: batches of several sessions whose hosted arms its load gate let verify without drafting "
              "(`LoadGate`, specpool/router/hosted.py).",
              "TTFT: request sent → first streamed token; ITL: each streamed message's gap since the previous one, "
              "spread over the tokens it carries (a round's tokens arrive together).", ""]
    lines += trace_table(levels)
    if plot:
        lines += [f"![aggregate tokens/s]({plot})", ""]
    return "\n".join(lines)


def trace_table(levels: list[dict]) -> list[str]:
    """Markdown lines: the target's batch trace per level (specpool/services/batch_trace.py), where
    the level has one: verify calls by batch kind and path, each session's return gap, batches that
    fired without a session they waited for."""
    rows = [lv for lv in levels if lv.get("batch_trace")]
    if not rows:
        return []

    def busy(tr: dict) -> str:
        total = tr.get("busy_s", 0.0) + tr.get("idle_s", 0.0)
        return f"{tr['busy_s'] / total:.0%} ({tr['busy_s']:.1f} s of {total:.1f})" if total else "–"

    def counts(table: dict, order: list[str]) -> str:
        return ", ".join(f"{k} {table[k]}" for k in order if table.get(k)) or "–"

    paths = [f"{kind} {path}" for kind in ("alone", "grouped") for path in ("direct", "serve")]
    buckets = [f"<{b}" for b in batch_trace.GAP_BUCKETS_MS] + [f">={batch_trace.GAP_BUCKETS_MS[-1]}"]
    lines = ["Target batch trace (`specpool/services/batch_trace.py`): its verify calls by the batch they ran in "
             "(alone or grouped) and the path they came by (the same-node direct route or Serve's handle); "
             "each call's return gap (from the target's answer to that session's next call arriving, the "
             "router's work and both transports); batches that fired (`batch_wait_timeout_s` passed) without "
             "a call from a session of the batch before, and those sessions' paths.", "",
             "Busy: the model thread's share of the level's batch time (from a batch firing to its forward's end), "
             "against idle between batches while some session was between rounds.", "",
             "| sessions | calls | return gap, alone (ms) | return gap, grouped (ms) | batches fired short | missed, by path | busy |",
             "|---|---|---|---|---|---|---|"]
    for lv in rows:
        tr = lv["batch_trace"]
        gaps = tr.get("return_gap_ms", {})
        alone = {b: gaps.get(f"alone {b}", 0) for b in buckets}
        grouped = {b: gaps.get(f"grouped {b}", 0) for b in buckets}
        lines.append(f"| {lv['sessions']} | {counts(tr.get('calls', {}), paths)} | {counts(alone, buckets)} | "
                     f"{counts(grouped, buckets)} | {tr.get('short_batches', 0)} | "
                     f"{counts(tr.get('missed_by_path', {}), ['direct', 'serve'])} | {busy(tr)} |")
    return lines + [""]


def split_table(ms_per_round: dict) -> list[str]:
    """Markdown lines: where a round's time goes, served next to embedded (empty without data)."""
    systems = [(name, ms_per_round[name]) for name in ("embedded", "served") if ms_per_round.get(name)]
    if not systems:
        return []
    lines = ["### Where a round's time goes (ms per round, pooled over prompts)", "",
             "| system | rounds | " + " | ".join(label for _, label in SPLIT_PARTS) + " | total |",
             "|---|---|" + "---|" * (len(SPLIT_PARTS) + 1)]
    for name, split in systems:
        lines.append(f"| {name} | {split['rounds']} | " + " | ".join(_f(split[key], 1, 1000) for key, _ in SPLIT_PARTS)
                     + f" | {_f(split['total_s'], 1, 1000)} |")
    return lines + ["", "Forward: inside the model's server; reaching: the call's wall time as the loop saw it minus the "
                    "forward (transport, queueing, conversion); rest of loop: the policy and its state store, streaming "
                    "callbacks; outside loop: request set-up, the client's transport, releasing caches.", ""]


def plot_throughput(levels: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    xs = [lv["sessions"] for lv in levels]
    ax1.plot(xs, [lv["tokens_per_s"] for lv in levels], marker="o")
    ax1.set_xlabel("concurrent sessions")
    ax1.set_ylabel("aggregate tokens/s")
    ax1.set_xticks(xs)
    ax1.grid(alpha=0.3)
    for key, label in (("ttft_p50_s", "TTFT p50"), ("itl_p50_s", "ITL p50"), ("itl_p99_s", "ITL p99")):
        ax2.plot(xs, [(lv["latency"][key] or 0) * 1000 for lv in levels], marker="o", label=label)
    ax2.set_xlabel("concurrent sessions")
    ax2.set_ylabel("ms")
    ax2.set_xticks(xs)
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run -----------------------------------------------------------------------------------------------
def _stream_once(client, prompt: str, fields: dict):
    """(arrival times, token ids, the router's Stats from the last message)."""
    timing = StreamTiming()
    tokens: list[int] = []
    stats = None
    started = time.perf_counter()
    for chunk in client.generate_stream(prompt, **{"seed": prompt_seed(prompt), **fields}):
        now = time.perf_counter() - started
        timing.arrivals.append((now, len(chunk.token_ids)))
        tokens.extend(chunk.token_ids)
        stats = chunk.stats or stats
    timing.wall_s = time.perf_counter() - started
    return timing, tokens, stats


def command_line(args: argparse.Namespace) -> str:
    return shlex.join([
        "specpool", "bench-served", "--prompts", str(args.prompts), "--limit-per-category", str(args.limit_per_category),
        "--max-new-tokens", str(args.max_new_tokens), "--pool", args.pool, "--policy", args.policy, "-k", str(args.k),
        "--concurrency", args.concurrency, "--max-batch-size", str(args.max_batch_size), "--out", str(args.out),
    ] + (["--requests-per-level", str(args.requests_per_level)] if args.requests_per_level else [])
      + ([] if getattr(args, "host_heads", None) is None else ["--host-heads" if args.host_heads else "--no-host-heads"])
      + ([] if getattr(args, "load_gate", None) is None else ["--load-gate" if args.load_gate else "--no-load-gate"])
      + (["--temperature", f"{args.temperature:g}"] if getattr(args, "temperature", 0.0) else []))


def run_bench_served(args: argparse.Namespace, settings) -> int:
    """The whole benchmark: a local served deployment and the embedded engine, single session
    side by side, then each concurrency level; results.json, report.md and throughput.png."""
    import grpc
    import ray
    from ray import serve

    from specpool.router.policies import PolicyOptions, make_policy
    from specpool.services.client import SpecPoolClient
    from specpool.services.engine import default_policy, default_pool
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config
    from specpool.target.sampling import validate_draft_length

    questions = load_questions(Path(args.prompts), args.limit_per_category)
    # Unset: the pool and policy `specpool serve` runs without flags (recorded as given, in the report's command).
    if args.policy is None:
        args.policy = default_policy(pool_named=args.pool is not None)
    if args.pool is None:
        args.pool = ",".join(default_pool())
    pool = [p for p in expand_pool(args.pool).split(",") if p]  # passed on as given: served mode builds each spec
    check(bool(pool), "--pool is empty")
    make_policy(args.policy, pool, PolicyOptions())
    validate_draft_length(args.k)
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check(0.0 <= args.temperature <= 2.0, f"--temperature must be in 0..2 (0: greedy), got {args.temperature}")
    levels = parse_levels(args.concurrency)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    config = default_serve_config(pool, args.redis_url, args.port, policy=args.policy, k=args.k,
                                  host_white_box=args.host_heads, load_gate=args.load_gate is not False)
    namespace = f"specpool-bench-{uuid.uuid4().hex[:8]}"  # the run's own Redis keys, deleted at the end
    for app in config["applications"]:
        if app["name"] == "target":
            app["args"]["max_batch_size"] = args.max_batch_size
        if app["name"] == "router":
            app["args"]["redis_namespace"] = namespace
    plan = plan_from_config(config, "the benchmark's config")
    local = start_local(plan, metrics_port=None, progress=_say)
    engine: EmbeddedWorker | None = None
    try:
        _say("loading the embedded engine (same target and drafters) in its own process ...")
        engine = EmbeddedWorker(settings.home, pool, args.k, args.max_new_tokens, args.policy, args.temperature)
        client = SpecPoolClient(local.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        fields = dict(max_new_tokens=args.max_new_tokens, policy=args.policy, k=args.k, tenant="bench",
                      temperature=args.temperature)
        _say("warm-up ...")
        engine.generate(WARMUP_PROMPT)
        _stream_once(client, WARMUP_PROMPT, {**fields, "session_id": uuid.uuid4().hex})
        records = single_session_runs(client, engine.generate, questions, fields)
        engine.close()  # frees the embedded models before the concurrency runs
        target_handle = serve.get_deployment_handle("Target", app_name="target")

        def target_stats() -> dict:
            return target_handle.options(method_name="Stats").remote().result()

        concurrency = [concurrency_level(client, [q.prompt for q in questions], sessions,
                                         args.requests_per_level or max(len(questions), 2 * sessions), fields, target_stats)
                       for sessions in levels]
        client.close()
    finally:
        if engine is not None:
            engine.close()
        _delete_namespace(args.redis_url, namespace)
        local.shutdown()

    machine = machine_info("cpu")
    machine.update({"ray": ray.__version__, "grpcio": grpc.__version__})
    write_results(out, args, machine, config, pool, records, concurrency)
    return 0


def _say(message: str) -> None:
    print(f"bench-served: {message}", flush=True)


def single_session_runs(client, embedded, questions: Sequence, fields: dict) -> list[dict]:
    """Every prompt served (GenerateStream) and embedded, alternating which goes first: the
    per-prompt records (tokens/s of each, identical outputs, TTFT, the round-time splits)."""
    from tqdm import tqdm

    records = []
    for i, q in enumerate(tqdm(questions, desc="single session (served | embedded)", unit="prompt")):
        session = uuid.uuid4().hex
        order = ("served", "embedded") if i % 2 == 0 else ("embedded", "served")
        got: dict = {}
        for system in order:
            if system == "served":
                timing, tokens, stats = _stream_once(client, q.prompt, {**fields, "session_id": session})
                split = time_split(rounds=stats.rounds, wall_s=timing.wall_s, loop_s=stats.wall_s,
                                   draft_s=stats.draft_s, draft_forward_s=stats.draft_forward_s,
                                   verify_s=stats.verify_s, verify_forward_s=stats.verify_forward_s)
                got["served"] = (tokens, timing.wall_s, timing, split)
            else:
                tokens, wall, split = embedded(q.prompt)
                got["embedded"] = (tokens, wall, None, split)
        s_tokens, s_wall, s_timing, s_split = got["served"]
        e_tokens, e_wall, _, e_split = got["embedded"]
        records.append({
            "question_id": q.question_id, "category": q.category, "first": order[0],
            "served_tokens": len(s_tokens), "served_s": s_wall, "served_tps": len(s_tokens) / s_wall if s_wall else None,
            "embedded_tokens": len(e_tokens), "embedded_s": e_wall, "embedded_tps": len(e_tokens) / e_wall if e_wall else None,
            "identical": s_tokens == e_tokens, "ttft_s": s_timing.ttft(),
            "served_split": s_split, "embedded_split": e_split,
        })
    return records


def concurrency_level(client, prompts: list[str], sessions: int, n_requests: int, fields: dict, target_stats) -> dict:
    """``n_requests`` requests (the prompts in turn) through ``sessions`` client threads, one
    stream each: aggregate tokens/s, latency, and the target's batch sizes meanwhile (and how many
    of its batches its load gate verified without hosted drafts)."""
    work: queue.Queue = queue.Queue()
    for j in range(n_requests):
        work.put(prompts[j % len(prompts)])
    timings: list[StreamTiming] = []
    errors: list[str] = []
    lock = threading.Lock()
    before = target_stats()

    def worker() -> None:
        while True:
            try:
                prompt = work.get_nowait()
            except queue.Empty:
                return
            try:
                timing, _, _ = _stream_once(client, prompt, {**fields, "session_id": uuid.uuid4().hex})
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                timings.append(timing)

    _say(f"{sessions} concurrent session(s), {n_requests} requests ...")
    threads = [threading.Thread(target=worker) for _ in range(sessions)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    after = target_stats()
    plain = after.get("plain_batches", 0) - before.get("plain_batches", 0)
    trace = batch_trace.diff(after["batch_trace"], before["batch_trace"]) if "batch_trace" in after else None
    before, after = before["batch_sizes"], after["batch_sizes"]
    sizes = {str(s): after.get(s, 0) - before.get(s, 0) for s in after if after.get(s, 0) - before.get(s, 0)}
    tokens = sum(t.tokens for t in timings)
    return {"sessions": sessions, "requests": len(timings), "errors": errors, "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "latency": latency_summary(timings), "batch_sizes": sizes, "plain_batches": plain, "batch_trace": trace}


def _delete_namespace(redis_url: str, namespace: str) -> None:
    """Drop the run's router state from Redis; best effort (cleanup must not hide the results)."""
    import redis

    try:
        raw = redis.Redis.from_url(redis_url)
        keys = list(raw.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            raw.delete(*keys)
        raw.close()
    except Exception:  # noqa: BLE001 - cleanup only
        pass


def hosted_drafters(cfg: dict) -> list[str]:
    """The drafters the run's target application hosted (specpool/router/hosted.py)."""
    apps = (cfg.get("serve_config") or {}).get("applications") or []
    return list(next((a["args"].get("hosted_drafters", []) for a in apps if a.get("name") == "target"), []))


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def hosted_note(cfg: dict) -> str:
    hosted = hosted_drafters(cfg)
    return f", hosting {', '.join(hosted)}: drafted inside its verify call" if hosted else ""


def write_results(out: Path, args: argparse.Namespace, machine: dict, config: dict, pool: list[str],
                  records: list[dict], concurrency: list[dict]) -> None:
    """results.json, throughput.png and report.md, and a summary line."""
    from specpool.services.serve_config import DEFAULT_TARGET

    result = {
        "command": command_line(args), "machine": machine,
        "config": {"target": DEFAULT_TARGET, "pool": pool, "policy": args.policy, "k": args.k,
                   "max_new_tokens": args.max_new_tokens, "prompts_file": str(args.prompts),
                   "limit_per_category": args.limit_per_category, "max_batch_size": args.max_batch_size,
                   "temperature": getattr(args, "temperature", 0.0),
                   "serve_config": config},
        "single_session": single_session_summary(records), "per_prompt": records, "concurrency": concurrency,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    plot = None
    try:
        plot_throughput(concurrency, out / "throughput.png", f"served, {', '.join(pool)}, k={args.k}")
        plot = "throughput.png"
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        _say(f"no plot ({exc})")
    (out / "report.md").write_text(markdown_report(result, plot))
    single = result["single_session"]
    _say(f"single session: served {_f(single['served_tokens_per_s'])} vs embedded {_f(single['embedded_tokens_per_s'])} tokens/s "
         f"(ratio {_f(single['ratio_pooled'], 3)}); " + "; ".join(f"{lv['sessions']} sessions {_f(lv['tokens_per_s'])} tokens/s"
                                                           for lv in concurrency))
    _say(f"wrote {out / 'results.json'}, {out / 'report.md'}")
