"""HTTP (the OpenAI-compatible API) against gRPC on one served instance, one session at a time (issue 28:
"HTTP throughput for one session >= 0.95x the gRPC path's, side by side in one run, and streaming time
to first token reported for both").

    python -m bench.http_vs_grpc --prompts ../shared/data/prompts/dev.jsonl --limit-per-category 2 \\
        --max-new-tokens 64 --reps 2 --out bench-results/http-vs-grpc

One local served deployment (``start_local``, as `specpool serve`: router, target, the pool's
drafters; Redis state under a namespace of its own, deleted afterwards). For every prompt and
repetition, one streaming request over gRPC (``SpecPoolClient.generate_stream``) and one over HTTP
with the official ``openai`` client (``chat.completions.create(stream=True)``), each its own session,
in alternating order (gRPC first on even prompt+rep, HTTP first on odd: drift hits both paths alike).
Both paths send the same chat (one user turn, the target's chat template), greedy, the same policy
and k, so their texts must be identical. Then, per prompt, a non-streaming pair (unary Generate
against a non-streaming chat completion).

Client-side figures per request: TTFT (request sent -> first non-empty text), end-to-end time,
completion tokens (gRPC: the last message's stats; HTTP: ``usage.completion_tokens``), tokens/s;
and the server's own loop time (both paths report it), which splits a path's overhead into what
lies inside the router's loop and what lies outside it (proxy, transport, client parsing).

Writes results.json, README.md and per_prompt.jsonl (raw rows, not for git) to --out; aggregation and
rendering are the pure functions below (tests/unit/test_bench_http_vs_grpc.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from bench.common import WARMUP_PROMPT, default_out, load_questions, machine_info, percentile
from bench.served import _delete_namespace
from specpool.core.defaults import DEFAULT_K, DEFAULT_POLICY
from specpool.core.errors import NotFound, SpecpoolError, check

PATHS = ("grpc", "http")
GOAL_RATIO = 0.95  # the bar: HTTP tokens/s >= 0.95x gRPC's, one session
CLIENT_TIMEOUT_S = 600.0


# -- one request's measurement -----------------------------------------------------------------------
@dataclass
class RequestRow:
    """One request as the client saw it (times in seconds from sending it)."""

    path: str  # "grpc" | "http"
    mode: str  # "stream" | "unary"
    question_id: object
    category: str
    rep: int
    position: int  # 0: sent first of its pair, 1: second
    text: str
    completion_tokens: int
    prompt_tokens: int
    wall_s: float  # sent -> last byte (stream: the last message)
    ttft_s: float | None  # sent -> first non-empty text (streams only)
    server_wall_s: float | None = None  # the router's loop time for it (GenerationStats.wall_s / specpool.wall_s)
    rounds: int | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else None


def order_for(prompt_index: int, rep: int) -> tuple[str, str]:
    """Which path goes first: gRPC when prompt index + rep is even, HTTP otherwise, so consecutive
    pairs alternate (ABAB / BABA) and with two reps every prompt runs in both orders."""
    return PATHS if (prompt_index + rep) % 2 == 0 else PATHS[::-1]


def pair_record(grpc_row: RequestRow, http_row: RequestRow) -> dict:
    """The paired comparison of one prompt/rep: HTTP tokens/s over gRPC's, whether they agree."""
    check(grpc_row.path == "grpc" and http_row.path == "http", "pair_record takes a gRPC row, then an HTTP row")
    check((grpc_row.question_id, grpc_row.rep, grpc_row.mode) == (http_row.question_id, http_row.rep, http_row.mode),
          f"rows of different requests paired: {grpc_row.question_id}/{grpc_row.rep} vs {http_row.question_id}/{http_row.rep}")
    g, h = grpc_row.tokens_per_s, http_row.tokens_per_s
    return {
        "question_id": grpc_row.question_id, "category": grpc_row.category, "rep": grpc_row.rep, "mode": grpc_row.mode,
        "first": "grpc" if grpc_row.position == 0 else "http",
        "grpc_tokens": grpc_row.completion_tokens, "http_tokens": http_row.completion_tokens,
        "grpc_s": grpc_row.wall_s, "http_s": http_row.wall_s, "grpc_tps": g, "http_tps": h,
        "ratio": h / g if g and h else None,
        "grpc_ttft_s": grpc_row.ttft_s, "http_ttft_s": http_row.ttft_s,
        # Client time outside the router's loop (proxy, transport, client parsing, request set-up).
        "grpc_outside_s": _outside(grpc_row), "http_outside_s": _outside(http_row),
        "identical_text": grpc_row.text == http_row.text,
        "same_tokens": grpc_row.completion_tokens == http_row.completion_tokens,
        "same_prompt_tokens": grpc_row.prompt_tokens == http_row.prompt_tokens,
    }


def _outside(row: RequestRow) -> float | None:
    return None if row.server_wall_s is None else row.wall_s - row.server_wall_s


def _spread(values: Sequence[float]) -> dict | None:
    """Median, p25, p75, p90, min, max of ``values``; None for none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "p25": percentile(values, 0.25), "p75": percentile(values, 0.75),
            "p90": percentile(values, 0.90), "min": min(values), "max": max(values), "n": len(values)}


def ratio_summary(pairs: Sequence[dict]) -> dict:
    """Over the pairs of one mode: the per-pair ratio's spread, the pooled ratio (each path's total
    tokens / total time), TTFT of each path, time outside the loop, and the mismatches."""
    out: dict = {"pairs": len(pairs), "ratio": _spread([p["ratio"] for p in pairs])}
    for path in PATHS:
        tokens = sum(p[f"{path}_tokens"] for p in pairs)
        seconds = sum(p[f"{path}_s"] for p in pairs)
        out[path] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None,
                     "ttft_s": _spread([p[f"{path}_ttft_s"] for p in pairs]),
                     "outside_loop_s": _spread([p[f"{path}_outside_s"] for p in pairs])}
    g, h = out["grpc"]["tokens_per_s"], out["http"]["tokens_per_s"]
    out["ratio_pooled"] = h / g if g and h else None
    out["text_mismatches"] = sum(1 for p in pairs if not p["identical_text"])
    out["token_count_mismatches"] = sum(1 for p in pairs if not p["same_tokens"])
    out["prompt_token_mismatches"] = sum(1 for p in pairs if not p["same_prompt_tokens"])
    out["http_first_ratio"] = _spread([p["ratio"] for p in pairs if p["first"] == "http"])
    out["grpc_first_ratio"] = _spread([p["ratio"] for p in pairs if p["first"] == "grpc"])
    out["meets_goal"] = (out["ratio"] is not None and out["ratio_pooled"] is not None
                         and out["ratio"]["median"] >= GOAL_RATIO and out["ratio_pooled"] >= GOAL_RATIO)
    return out


# -- the report ---------------------------------------------------------------------------------------
def _f(value, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{unit}"


def _ms(spread: dict | None, key: str) -> str:
    return _f(spread[key] if spread else None, 0, 1000, " ms")


def _mode_section(title: str, s: dict, stream: bool) -> list[str]:
    r = s["ratio"] or {}
    lines = [f"## {title}", "",
             f"**HTTP / gRPC tokens/s: median {_f(r.get('median'))} [p25 {_f(r.get('p25'))}, p75 {_f(r.get('p75'))}]** "
             f"over {s['pairs']} pairs (min {_f(r.get('min'))}, max {_f(r.get('max'))}); "
             f"pooled (total tokens / total time) **{_f(s['ratio_pooled'])}**. "
             f"Goal ≥ {GOAL_RATIO}: {'met' if s['meets_goal'] else 'NOT met'}.", "",
             "| path | tokens | seconds | tokens/s (pooled) |" + (" TTFT median | TTFT p90 |" if stream else "")
             + " outside the loop, median |",
             "|---|---|---|---|" + ("---|---|" if stream else "") + "---|"]
    for path in PATHS:
        p = s[path]
        lines.append(f"| {path} | {p['tokens']} | {p['seconds']:.2f} | {_f(p['tokens_per_s'], 2)} |"
                     + (f" {_ms(p['ttft_s'], 'median')} | {_ms(p['ttft_s'], 'p90')} |" if stream else "")
                     + f" {_ms(p['outside_loop_s'], 'median')} |")
    lines += ["", f"Ratio by which path went first: gRPC first {_f((s['grpc_first_ratio'] or {}).get('median'))}, "
              f"HTTP first {_f((s['http_first_ratio'] or {}).get('median'))} (medians).",
              f"Mismatches (greedy, must be 0): text {s['text_mismatches']}, completion token counts "
              f"{s['token_count_mismatches']}, prompt token counts {s['prompt_token_mismatches']}.", ""]
    return lines


def markdown_report(result: dict) -> str:
    cfg, machine = result["config"], result["machine"]
    lines = [
        "# HTTP (OpenAI-compatible) vs gRPC, one session", "",
        f"- command: `{result['command']}`",
        f"- machine: {machine.get('cpu')} ({machine.get('cores')} cores), torch {machine.get('torch')}, Ray {machine.get('ray')}, "
        f"grpcio {machine.get('grpcio')}, openai {machine.get('openai')}, httpx {machine.get('httpx')}",
        f"- target {cfg['target']} (served as {cfg['model']!r}), pool {', '.join(cfg['pool'])}, policy {cfg['policy']}, k {cfg['k']}, "
        f"greedy, {cfg['max_new_tokens']} new tokens; {cfg['prompts']} prompts ({cfg['prompts_file']}, "
        f"{cfg['limit_per_category']} per category) × {cfg['reps']} reps streamed, {cfg['unary_reps']} rep(s) unary",
        "- one local served instance (router + target + drafters on one Ray, Redis state); gRPC: `SpecPoolClient` over "
        "Serve's gRPC proxy; HTTP: the official `openai` client over Serve's HTTP proxy; each request its own session, "
        "one at a time, the pair's order alternating (ABAB / BABA); both send the same single user turn (chat template)",
        "- TTFT: request sent → first non-empty text; tokens/s: completion tokens / end-to-end client time; "
        "outside the loop: client time minus the router's own loop time for the request (proxy, transport, "
        "request set-up, client parsing)", "",
    ]
    lines += _mode_section("Streaming", result["stream"], stream=True)
    if result.get("unary"):
        lines += _mode_section("Non-streaming (unary Generate vs chat completion)", result["unary"], stream=False)
    if result.get("notes"):
        lines += ["## Notes", "", *result["notes"], ""]
    return "\n".join(lines)


def command_line(args: argparse.Namespace) -> str:
    return shlex.join([
        "python", "-m", "bench.http_vs_grpc", "--prompts", str(args.prompts), "--limit-per-category", str(args.limit_per_category),
        "--max-new-tokens", str(args.max_new_tokens), "--reps", str(args.reps), "--unary-reps", str(args.unary_reps),
        "--pool", args.pool, "--policy", args.policy, "-k", str(args.k), "--out", str(args.out),
    ])


# -- the two clients ------------------------------------------------------------------------------------
def _extra(model_obj) -> dict:
    """The ``specpool`` object the server adds to responses and chunks (openai keeps unknown fields)."""
    value = (getattr(model_obj, "model_extra", None) or {}).get("specpool")
    return value if isinstance(value, dict) else {}


class Paths:
    """Both clients of one served instance, with the same generation settings."""

    def __init__(self, grpc_address: str, http_url: str, max_new_tokens: int, policy: str, k: int):
        from openai import OpenAI

        from specpool.services.client import SpecPoolClient

        self.grpc = SpecPoolClient(grpc_address, timeout=CLIENT_TIMEOUT_S)
        # No retries: a failed request must fail the run, not be measured twice.
        self.http = OpenAI(base_url=http_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        models = self.http.models.list().data
        check(len(models) == 1, f"GET /v1/models listed {len(models)} models; expected the one target")
        self.model = models[0].id
        self.max_new_tokens, self.policy, self.k = max_new_tokens, policy, k

    def grpc_stream(self, prompt: str) -> dict:
        started = time.perf_counter()
        ttft, parts, stats = None, [], None
        for chunk in self.grpc.generate_stream(chat=[("user", prompt)], max_new_tokens=self.max_new_tokens,
                                               policy=self.policy, k=self.k, session_id=uuid.uuid4().hex):
            if chunk.text and ttft is None:
                ttft = time.perf_counter() - started
            parts.append(chunk.text)
            stats = chunk.stats or stats
        wall = time.perf_counter() - started
        check(stats is not None, "the gRPC stream ended without its stats message", SpecpoolError)
        return dict(text="".join(parts), completion_tokens=stats.new_tokens, prompt_tokens=stats.prompt_tokens,
                    wall_s=wall, ttft_s=ttft, server_wall_s=stats.wall_s, rounds=stats.rounds)

    def http_stream(self, prompt: str) -> dict:
        started = time.perf_counter()
        stream = self.http.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=self.max_new_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"policy": self.policy, "k": self.k, "session_id": uuid.uuid4().hex})
        ttft, parts, usage, figures = None, [], None, {}
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
            figures = _extra(chunk) or figures
        wall = time.perf_counter() - started
        check(usage is not None, "the HTTP stream ended without a usage chunk (stream_options.include_usage)", SpecpoolError)
        return dict(text="".join(parts), completion_tokens=usage.completion_tokens, prompt_tokens=usage.prompt_tokens,
                    wall_s=wall, ttft_s=ttft, server_wall_s=figures.get("wall_s"), rounds=figures.get("rounds"))

    def grpc_unary(self, prompt: str) -> dict:
        started = time.perf_counter()
        answer = self.grpc.generate(chat=[("user", prompt)], max_new_tokens=self.max_new_tokens, policy=self.policy,
                                    k=self.k, session_id=uuid.uuid4().hex)
        wall = time.perf_counter() - started
        return dict(text=answer.text, completion_tokens=answer.stats.new_tokens, prompt_tokens=answer.stats.prompt_tokens,
                    wall_s=wall, ttft_s=None, server_wall_s=answer.stats.wall_s, rounds=answer.stats.rounds)

    def http_unary(self, prompt: str) -> dict:
        started = time.perf_counter()
        answer = self.http.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=self.max_new_tokens,
            temperature=0, extra_body={"policy": self.policy, "k": self.k, "session_id": uuid.uuid4().hex})
        wall = time.perf_counter() - started
        figures = _extra(answer)
        return dict(text=answer.choices[0].message.content or "", completion_tokens=answer.usage.completion_tokens,
                    prompt_tokens=answer.usage.prompt_tokens, wall_s=wall, ttft_s=None,
                    server_wall_s=figures.get("wall_s"), rounds=figures.get("rounds"))

    def close(self) -> None:
        self.grpc.close()
        self.http.close()


def run_pairs(questions: Sequence, reps: int, mode: str, send: dict[str, Callable[[str], dict]],
              rows_out, progress) -> list[dict]:
    """Every prompt × rep as a pair of requests in ``order_for``'s order; raw rows go to ``rows_out``
    (a file, one JSON line each) as they come, so an interrupted run keeps what it measured."""
    pairs = []
    for rep in range(reps):
        for i, q in enumerate(questions):
            rows: dict[str, RequestRow] = {}
            for position, path in enumerate(order_for(i, rep)):
                got = send[path](q.prompt)
                rows[path] = RequestRow(path, mode, q.question_id, q.category, rep, position, **got)
                rows_out.write(json.dumps(asdict(rows[path]) | {"tokens_per_s": rows[path].tokens_per_s}) + "\n")
                rows_out.flush()
            pairs.append(pair_record(rows["grpc"], rows["http"]))
            progress(pairs[-1])
    return pairs


# -- the run ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.http_vs_grpc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", help="Spec-Bench / MT-Bench question file (JSON lines with category and turns); required to run")
    parser.add_argument("--limit-per-category", type=int, default=2, help="first N prompts of each category (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request (default 64)")
    parser.add_argument("--reps", type=int, default=2, help="streamed pairs per prompt (default 2: both orders)")
    parser.add_argument("--unary-reps", type=int, default=1, help="non-streaming pairs per prompt (default 1; 0 skips them)")
    parser.add_argument("--pool", default="ngram", help="drafters served (default ngram)")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help=f"drafter-choice policy (default {DEFAULT_POLICY})")
    parser.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft length (default {DEFAULT_K})")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--port", type=int, default=50071, help="gRPC port of the benchmark's own server (default 50071)")
    parser.add_argument("--http-port", type=int, default=8071, help="HTTP port of the benchmark's own server (default 8071)")
    parser.add_argument("--out", default=default_out("http-vs-grpc"), help="output folder (default ./bench-results/http-vs-grpc)")
    parser.add_argument("--rerender", metavar="DIR", help="only write DIR/README.md again from DIR/results.json (e.g. after adding notes)")
    return parser


def _say(message: str) -> None:
    print(f"http-vs-grpc: {message}", flush=True)


def run(args: argparse.Namespace) -> dict:
    import grpc
    import httpx
    import openai
    import ray

    from specpool.router.policies import PolicyOptions, make_policy
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import DEFAULT_TARGET, default_serve_config, plan_from_config
    from specpool.target.sampling import validate_draft_length

    questions = load_questions(Path(args.prompts), args.limit_per_category)
    pool = [p.strip() for p in args.pool.split(",") if p.strip()]
    check(bool(pool), "--pool is empty")
    make_policy(args.policy, pool, PolicyOptions())
    validate_draft_length(args.k)
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check(args.reps >= 1, f"--reps must be >= 1, got {args.reps}")
    check(args.unary_reps >= 0, f"--unary-reps must be >= 0, got {args.unary_reps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    config = default_serve_config(pool, args.redis_url, args.port, http_port=args.http_port, policy=args.policy, k=args.k)
    namespace = f"specpool-bench-{uuid.uuid4().hex[:8]}"  # the run's own Redis keys, deleted at the end
    for app in config["applications"]:
        if app["name"] == "router":
            app["args"]["redis_namespace"] = namespace
            app["args"]["http_api"] = True
    plan = plan_from_config(config, "the benchmark's config")
    local = start_local(plan, metrics_port=None, progress=_say)
    paths = None
    try:
        check(local.http_url is not None, "the served instance has no HTTP API (router arg http_api)")
        paths = Paths(local.address, local.http_url, args.max_new_tokens, args.policy, args.k)
        _say(f"gRPC {local.address}, HTTP {local.http_url} (model {paths.model!r}); warm-up ...")
        for send in (paths.grpc_stream, paths.http_stream, paths.grpc_unary, paths.http_unary):
            send(WARMUP_PROMPT)  # first calls set up connections and routes; not measured
        total = len(questions) * (args.reps + args.unary_reps)
        done = [0]

        def progress(p: dict) -> None:
            done[0] += 1
            _say(f"[{done[0]}/{total}] {p['mode']} {p['category']} {p['question_id']} rep {p['rep']} ({p['first']} first): "
                 f"gRPC {_f(p['grpc_tps'], 1)} HTTP {_f(p['http_tps'], 1)} tokens/s, ratio {_f(p['ratio'])}"
                 + ("" if p["identical_text"] else "  TEXT DIFFERS"))

        with (out / "per_prompt.jsonl").open("w") as rows_out:
            stream_pairs = run_pairs(questions, args.reps, "stream", {"grpc": paths.grpc_stream, "http": paths.http_stream},
                                     rows_out, progress)
            unary_pairs = run_pairs(questions, args.unary_reps, "unary", {"grpc": paths.grpc_unary, "http": paths.http_unary},
                                    rows_out, progress) if args.unary_reps else []
        model = paths.model
    finally:
        if paths is not None:
            paths.close()
        _delete_namespace(args.redis_url, namespace)
        local.shutdown()

    machine = machine_info("cpu")
    machine.update({"ray": ray.__version__, "grpcio": grpc.__version__, "openai": openai.__version__, "httpx": httpx.__version__})
    result = {
        "command": command_line(args), "machine": machine,
        "config": {"target": DEFAULT_TARGET, "model": model, "pool": pool, "policy": args.policy, "k": args.k,
                   "max_new_tokens": args.max_new_tokens, "prompts_file": str(args.prompts), "prompts": len(questions),
                   "limit_per_category": args.limit_per_category, "reps": args.reps, "unary_reps": args.unary_reps,
                   "grpc_port": args.port, "http_port": args.http_port},
        "stream": ratio_summary(stream_pairs), "unary": ratio_summary(unary_pairs) if unary_pairs else None,
        "pairs": stream_pairs + unary_pairs,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "README.md").write_text(markdown_report(result))
    s = result["stream"]
    _say(f"streaming HTTP/gRPC median {_f(s['ratio']['median'])} [{_f(s['ratio']['p25'])}, {_f(s['ratio']['p75'])}], "
         f"pooled {_f(s['ratio_pooled'])}; TTFT median gRPC {_ms(s['grpc']['ttft_s'], 'median')}, "
         f"HTTP {_ms(s['http']['ttft_s'], 'median')}; "
         f"text mismatches {s['text_mismatches']}")
    _say(f"wrote {out / 'results.json'}, {out / 'README.md'}, {out / 'per_prompt.jsonl'}")
    return result


def rerender(out: Path) -> None:
    """README.md again from results.json (after editing its notes)."""
    check((out / "results.json").is_file(), f"{out / 'results.json'} does not exist (the folder of a run?)", NotFound)
    result = json.loads((out / "results.json").read_text())
    (out / "README.md").write_text(markdown_report(result))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.rerender:
            rerender(Path(args.rerender))
        else:
            check(args.prompts is not None, "--prompts is required (a question file such as ../shared/data/prompts/dev.jsonl)")
            run(args)
    except SpecpoolError as exc:
        print(f"http-vs-grpc: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
