"""Load test of a served instance: a fixed concurrency for a bounded time, with RSS and sessions over time.

    python -m bench.loadtest --serve --pool ngram,code --concurrency 4 --duration 1800 \\
        --max-new-tokens 48 --prompts ../shared/data/prompts/dev.jsonl --out bench/results/soak
    python -m bench.loadtest --address 127.0.0.1:50051 --http-url http://127.0.0.1:8000/v1 --api-key sp-... \\
        --concurrency 8 --duration 300 --prompts FILE --out DIR

C client threads each run a loop of streamed requests (GenerateStream over gRPC; a share over the
OpenAI-compatible HTTP API with --http-share) until --duration has passed; every request has a
new session id and nothing is released by the client, as a real client that never continues a
session behaves. Meanwhile a sampler records, every --sample-every seconds, the RSS of every Serve
replica process (router, target, drafters; found by their process titles under this cluster's
raylet, read from /proc) and the session counts of the deployments (Router ``Active()``: requests
running; Target and Drafter ``Sessions()``: caches held), through Serve handles (``--serve``, or
``ray.init(address=--ray-address)`` when connecting to a server this process did not start).

"No session left after the load stops" is two things here, because the router keeps a finished
request's caches (keep_caches: a continued session reuses them) and each server evicts the least
recently used beyond its capacity: (1) requests running (Router ``Active()``) must be 0 once the
load stopped; (2) caches held must stay bounded by the servers' capacity (the target's
cache_capacity) during and after the load, not grow with the number of requests. The report gives
both, then releases every cache still held (the deployments' Release, what a client ending its
sessions causes) and gives the counts again.

Writes DIR/report.json, DIR/README.md and DIR/rss_sessions.png. The aggregation and rendering are
pure functions (tests/unit/test_loadtest.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from bench.common import load_questions, machine_info
from bench.served import StreamTiming, percentile
from bench.served import _delete_namespace as delete

# Ray titles a Serve replica's worker "ray::ServeReplica:APP:DEPLOYMENT[.method]" (while it starts:
# "ray::SERVE_REPLICA::APP#DEPLOYMENT#ID:ServeReplica:APP:DEPLOYMENT.__init__").
TITLE_MARK = "ServeReplica:"
DEFAULT_CACHE_CAPACITY = 64  # the target's cache_capacity in the default served config
# The most sessions a drafter keeps state for: the n-gram drafter's session_capacity (model drafters keep 64).
DEFAULT_DRAFTER_CAPACITY = 1024


# -- pure aggregation ----------------------------------------------------------------------------------
def default_warmup(duration_s: float) -> float:
    """Seconds after which memory counts as warm: caches filled to capacity, lazy allocations done
    (a sixth of the run, at most 5 minutes)."""
    return min(300.0, duration_s / 6.0)


def rss_summary(samples: Sequence[dict], warmup_s: float, key: str = "total") -> dict:
    """RSS (MiB) of ``key`` at start, first sample at/after the warm-up, end (last sample taken
    under load), the peak, and growth after warm-up in % ((end - warm) / warm). Samples are dicts
    with ``t`` (seconds since the load began), ``under_load`` and ``rss_mib`` {group: MiB}."""
    loaded = [s for s in samples if s.get("under_load") and key in s.get("rss_mib", {})]
    if not loaded:
        return {"start_mib": None, "after_warmup_mib": None, "end_mib": None, "peak_mib": None,
                "growth_after_warmup_pct": None, "warmup_s": warmup_s}
    warm = next((s for s in loaded if s["t"] >= warmup_s), loaded[-1])
    start, end = loaded[0]["rss_mib"][key], loaded[-1]["rss_mib"][key]
    after = warm["rss_mib"][key]
    return {"start_mib": start, "after_warmup_mib": after, "end_mib": end,
            "peak_mib": max(s["rss_mib"][key] for s in loaded),
            "growth_after_warmup_pct": (end - after) / after * 100.0 if after else None,
            "warmup_s": warmup_s, "warmup_sample_t": warm["t"]}


def latency_summary(timings: Sequence[StreamTiming], wall_s: float) -> dict:
    ttft = [t for t in (x.ttft() for x in timings) if t is not None]
    itl = [g for x in timings for g in x.inter_token()]
    tokens = sum(x.tokens for x in timings)
    return {"requests": len(timings), "tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def session_verdict(samples: Sequence[dict], after_load: dict | None, capacity: int,
                    drafter_capacity: int = DEFAULT_DRAFTER_CAPACITY) -> dict:
    """Whether the load left nothing behind: 0 requests running after it stopped, and the target's
    caches within ``capacity`` at every sample (bounded, not growing with requests). Drafter
    sessions are reported (max, after) beside, with whether they stayed within ``drafter_capacity``."""
    target = [s["sessions"]["target"] for s in samples if s.get("sessions", {}).get("target") is not None]
    drafters: dict[str, list[int]] = {}
    for s in samples:
        for name, n in (s.get("sessions", {}).get("drafters") or {}).items():
            drafters.setdefault(name, []).append(n)
    active_after = (after_load or {}).get("router_active")
    return {
        "capacity": capacity, "drafter_capacity": drafter_capacity,
        "router_active_after_load": active_after,
        "target_caches_max": max(target) if target else None,
        "target_caches_after_load": (after_load or {}).get("target"),
        "drafter_sessions_max": {n: max(v) for n, v in drafters.items()},
        "drafter_sessions_after_load": dict((after_load or {}).get("drafters") or {}),
        "no_active_after_load": active_after == 0,
        "target_caches_bounded": bool(target) and max(target) <= capacity,
        "drafter_sessions_bounded": {n: max(v) <= drafter_capacity for n, v in drafters.items()},
    }


def _f(value, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{unit}"


def markdown_report(report: dict, plot: str | None) -> str:
    cfg, lat, rss, verdict = report["config"], report["latency"], report["rss"], report["sessions"]
    errors = report["errors_by_status"]
    after, released = report.get("after_load") or {}, report.get("after_release") or {}
    lines = [
        "# Load test (served)", "",
        f"- command: `{report['command']}`",
        f"- machine: {report['machine'].get('cpu', '?')} ({report['machine'].get('cores', '?')} cores), shared with other work",
        f"- {cfg['concurrency']} client sessions (threads, one stream each) for {cfg['duration_s']:.0f} s; "
        f"{cfg['max_new_tokens']} new tokens per request, greedy; a new session id per request; "
        f"HTTP share {cfg['http_share']:.0%}; pool {cfg.get('pool') or 'of the server'}",
        "",
        "## Requests", "",
        f"- requests: **{report['requests']}** ({report['requests_ok']} ok), errors: **{report['errors']}**"
        + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) + ")" if errors else ""),
        f"- tokens: {lat['tokens']}, {_f(lat['tokens_per_s'], 2)} tokens/s aggregate over {report['wall_s']:.0f} s",
        "",
        "| path | requests | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |", "|---|---|---|---|---|---|",
    ]
    for name, part in (("all", lat), *report.get("latency_by_path", {}).items()):
        lines.append(f"| {name} | {part['requests']} | {_f(part['ttft_p50_s'], 0, 1000, ' ms')} | {_f(part['ttft_p99_s'], 0, 1000, ' ms')} | "
                     f"{_f(part['itl_p50_s'], 0, 1000, ' ms')} | {_f(part['itl_p99_s'], 0, 1000, ' ms')} |")
    lines += ["", "TTFT: request sent → first streamed token; ITL: each streamed message's gap since the previous one, "
              "spread over the tokens it carries (a round's tokens arrive together; over HTTP a chunk counts one token).", "",
              "## Memory (RSS of the Serve replica processes)", "",
              f"Warm-up: the first {rss['total']['warmup_s']:.0f} s. Growth after warm-up = (end − after warm-up) / after warm-up.", "",
              "| process | start MiB | after warm-up MiB | end MiB | peak MiB | growth after warm-up |", "|---|---|---|---|---|---|"]
    for group, part in rss.items():
        lines.append(f"| {group} | {_f(part['start_mib'])} | {_f(part['after_warmup_mib'])} | {_f(part['end_mib'])} | "
                     f"{_f(part['peak_mib'])} | {_f(part['growth_after_warmup_pct'], 2, unit=' %')} |")
    drafters_max = ", ".join(f"{n} {v}" for n, v in verdict["drafter_sessions_max"].items()) or "–"
    drafters_after = ", ".join(f"{n} {v}" for n, v in verdict["drafter_sessions_after_load"].items()) or "–"
    drafters_released = ", ".join(f"{n} {v}" for n, v in (released.get("drafters") or {}).items()) or "–"
    lines += [
        "", "## Sessions", "",
        "The router keeps a finished request's caches (a continued session reuses them) and the target evicts the least "
        f"recently used beyond its capacity ({verdict['capacity']}); so \"no session left\" means: **no request running** "
        "once the load stopped (Router `Active()`), and **caches bounded** by the capacity at every sample (not growing "
        "with the number of requests). Then every cache still held is released (the deployments' `Release`) and counted again.", "",
        "| | during the load (max) | after the load stopped | after releasing the caches |", "|---|---|---|---|",
        f"| requests running (router) | {_max(report['samples'], 'router_active')} | {after.get('router_active', '–')} | {released.get('router_active', '–')} |",
        f"| target KV caches | {verdict['target_caches_max'] if verdict['target_caches_max'] is not None else '–'} | "
        f"{after.get('target', '–')} | {released.get('target', '–')} |",
        f"| drafter sessions | {drafters_max} | {drafters_after} | {drafters_released} |",
        "",
        f"- no request running after the load: **{_yes(verdict['no_active_after_load'])}**; target caches within "
        f"{verdict['capacity']}: **{_yes(verdict['target_caches_bounded'])}**; drafter sessions within "
        f"{verdict['drafter_capacity']} (the n-gram drafter's session capacity; model drafters keep 64): "
        + (", ".join(f"{n} **{_yes(ok)}**" for n, ok in verdict["drafter_sessions_bounded"].items()) or "–"),
        "",
    ]
    if plot:
        lines += [f"![RSS and sessions over time]({plot})", ""]
    return "\n".join(lines)


def _max(samples: Sequence[dict], key: str):
    values = [s["sessions"][key] for s in samples if s.get("sessions", {}).get(key) is not None]
    return max(values) if values else "–"


def _yes(ok: bool | None) -> str:
    return "yes" if ok else "no"


def plot_over_time(samples: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    groups = sorted({g for s in samples for g in s.get("rss_mib", {})})
    for group in groups:
        points = [(s["t"], s["rss_mib"][group]) for s in samples if group in s.get("rss_mib", {})]
        ax1.plot([p[0] for p in points], [p[1] for p in points], label=group)
    ax1.set_xlabel("s since the load began")
    ax1.set_ylabel("RSS MiB")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    series = {"router active": lambda s: s["sessions"].get("router_active"),
              "target caches": lambda s: s["sessions"].get("target")}
    for name in sorted({n for s in samples for n in (s.get("sessions", {}).get("drafters") or {})}):
        series[f"drafter {name}"] = lambda s, n=name: (s["sessions"].get("drafters") or {}).get(n)
    for label, get in series.items():
        points = [(s["t"], get(s)) for s in samples if s.get("sessions") and get(s) is not None]
        ax2.plot([p[0] for p in points], [p[1] for p in points], label=label)
    ax2.set_xlabel("s since the load began")
    ax2.set_ylabel("count")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- processes and sessions of the served instance ------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _process_table() -> tuple[dict[int, list[int]], dict[int, str]]:
    """({parent: [children]}, {pid: command line}) from /proc."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        cmdline = _read(f"/proc/{entry}/cmdline")
        if stat is None or cmdline is None:
            continue
        try:
            parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces or ")"
        except (IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
        cmdlines[int(entry)] = cmdline.replace("\0", " ").strip()
    return children, cmdlines


def replica_processes(gcs_address: str) -> dict[int, str]:
    """{pid: "APP:DEPLOYMENT"} of the Serve replicas of the cluster at ``gcs_address``: the
    workers under its raylet (this machine's) whose title is a Serve replica's. Other clusters on
    the same machine (other users' Ray) have other raylets and are left out."""
    children, cmdlines = _process_table()
    raylets = [pid for pid, cmd in cmdlines.items() if "raylet" in cmd.split(" ", 1)[0] and f"--gcs-address={gcs_address}" in cmd]
    found: dict[int, str] = {}
    stack = list(raylets)
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        group = replica_group(cmdlines.get(pid, ""))
        if group is not None:
            found[pid] = group
    return found


def replica_group(title: str) -> str | None:
    """"APP:DEPLOYMENT" of a Serve replica's process title; None for any other process."""
    title = title.split(" ", 1)[0]
    if not title.startswith("ray::") or TITLE_MARK not in title:
        return None
    return title.rsplit(TITLE_MARK, 1)[1].split(".", 1)[0]


def rss_mib(pid: int) -> float | None:
    status = _read(f"/proc/{pid}/status")
    for line in (status or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return None


def rss_by_group(processes: dict[int, str]) -> dict[str, float]:
    """{group: MiB} summed over each deployment's replicas, plus "total"; a process that exited
    meanwhile is skipped."""
    out: dict[str, float] = {}
    for pid, group in processes.items():
        value = rss_mib(pid)
        if value is not None:
            out[group] = out.get(group, 0.0) + value
            out["total"] = out.get("total", 0.0) + value
    return out


class Deployments:
    """Serve handles to the router, target and drafter deployments: session counts, releases."""

    def __init__(self):
        from ray import serve

        apps = list(serve.status().applications)
        self._router = serve.get_deployment_handle("Router", app_name="router") if "router" in apps else None
        self._target = serve.get_deployment_handle("Target", app_name="target") if "target" in apps else None
        self._drafters = {app[len("drafter-"):]: serve.get_deployment_handle("Drafter", app_name=app)
                          for app in apps if app.startswith("drafter-")}

    @staticmethod
    def _call(handle, method: str, *args):
        return handle.options(method_name=method).remote(*args).result(timeout_s=120)

    def counts(self) -> dict:
        out: dict = {"router_active": None, "target": None, "drafters": {}}
        if self._router is not None:
            out["router_active"] = len(self._call(self._router, "Active"))
        if self._target is not None:
            out["target"] = len(self._call(self._target, "Sessions"))
        for name, handle in self._drafters.items():
            out["drafters"][name] = len(self._call(handle, "Sessions"))
        return out

    def release_all(self) -> int:
        """Release every cache the target and the drafters still hold; how many were released."""
        from specpool.v1 import common_pb2

        released = 0
        for handle in [h for h in [self._target] if h is not None] + list(self._drafters.values()):
            for session in self._call(handle, "Sessions"):
                released += bool(self._call(handle, "Release", common_pb2.ReleaseRequest(session_id=session)).released)
        return released


# -- the load -----------------------------------------------------------------------------------------------
@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    timings: dict[str, list[StreamTiming]] = field(default_factory=lambda: {"grpc": [], "http": []})
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)

    def ok(self, path: str, timing: StreamTiming) -> None:
        with self.lock:
            self.timings[path].append(timing)

    def error(self, status: str, message: str) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1
            self.error_examples.setdefault(status, message[:300])


def grpc_request(client, prompt: str, max_new_tokens: int, timeout: float) -> StreamTiming:
    timing = StreamTiming()
    started = time.perf_counter()
    for chunk in client.generate_stream(prompt, max_new_tokens=max_new_tokens, session_id=uuid.uuid4().hex, timeout=timeout):
        timing.arrivals.append((time.perf_counter() - started, len(chunk.token_ids)))
    timing.wall_s = time.perf_counter() - started
    return timing


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.code = f"HTTP {status}"


def http_request(http, base_url: str, model: str, prompt: str, max_new_tokens: int, timeout: float) -> StreamTiming:
    """A streamed chat completion over SSE; each content chunk counts one token (OpenAI's chunks
    carry text, not token counts)."""
    timing = StreamTiming()
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens,
            "stream": True, "temperature": 0}
    started = time.perf_counter()
    # No session id: the server gives every HTTP request a new session.
    with http.stream("POST", f"{base_url}/chat/completions", json=body, timeout=timeout) as response:
        if response.status_code != 200:
            raise HttpError(response.status_code, response.read().decode("utf-8", "replace"))
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise HttpError(200, json.dumps(chunk["error"]))
            content = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
            timing.arrivals.append((time.perf_counter() - started, 1 if content else 0))
    timing.wall_s = time.perf_counter() - started
    return timing


def run_load(args: argparse.Namespace, address: str, http_url: str | None, prompts: list[str],
             sample: Callable[[float, bool], None]) -> tuple[Tally, float]:
    """``args.concurrency`` threads of requests until ``args.duration`` has passed (a request under
    way then finishes); ``sample(t, under_load)`` every ``args.sample_every`` seconds meanwhile."""
    import httpx

    from specpool.services.client import SpecPoolClient

    tally = Tally()
    client = SpecPoolClient(address, api_key=args.api_key or None)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    http = httpx.Client(headers=headers) if http_url and args.http_share > 0 else None
    model = ""
    if http is not None:
        model = http.get(f"{http_url}/models", timeout=60).json()["data"][0]["id"]
    counter = iter(range(1 << 62))
    counter_lock = threading.Lock()
    begin = time.monotonic()
    end = begin + args.duration

    def worker() -> None:
        while time.monotonic() < end:
            with counter_lock:
                n = next(counter)
            prompt = prompts[n % len(prompts)]
            # Every 1/share-th request goes over HTTP (deterministic: the share is exact over a run).
            over_http = http is not None and int((n + 1) * args.http_share) > int(n * args.http_share)
            try:
                if over_http:
                    tally.ok("http", http_request(http, http_url, model, prompt, args.max_new_tokens, args.request_timeout))
                else:
                    tally.ok("grpc", grpc_request(client, prompt, args.max_new_tokens, args.request_timeout))
            except Exception as exc:  # noqa: BLE001 - every failure is counted by its status
                tally.error(getattr(exc, "code", type(exc).__name__), f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, name=f"load-{i}", daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    next_sample = begin
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if now >= next_sample:
            sample(now - begin, True)
            next_sample += args.sample_every
        time.sleep(min(0.5, max(0.0, next_sample - time.monotonic())))
    wall = time.monotonic() - begin
    client.close()
    if http is not None:
        http.close()
    return tally, wall


# -- command line -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="HOST:PORT of a running server's gRPC API (or --serve)")
    p.add_argument("--http-url", help="base URL of its OpenAI-compatible API (http://HOST:PORT/v1), for --http-share")
    p.add_argument("--http-share", type=float, default=0.0, help="share of requests sent over HTTP, 0..1 (default 0)")
    p.add_argument("--serve", action="store_true", help="start a local served instance of its own (like bench/served.py)")
    p.add_argument("--pool", default="ngram", help="drafters of the --serve instance (default ngram)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis of the --serve instance")
    p.add_argument("--ray-address", default="auto", help="Ray cluster of a running server, for RSS and sessions (default auto)")
    p.add_argument("--no-introspect", action="store_true", help="no Ray connection: requests and latency only")
    p.add_argument("--concurrency", type=int, default=4, help="client threads, one stream each (default 4)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--api-key", default="", help="API key sent with every request (a server with keys needs one)")
    p.add_argument("--prompts", required=True, help="prompts: JSON lines with category and turns (Spec-Bench / MT-Bench)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS/session samples (default 10)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up for RSS growth (default duration/6, at most 300)")
    p.add_argument("--cache-capacity", type=int, default=DEFAULT_CACHE_CAPACITY,
                   help=f"the target's cache_capacity, the bound caches must stay within (default {DEFAULT_CACHE_CAPACITY})")
    p.add_argument("--drafter-capacity", type=int, default=DEFAULT_DRAFTER_CAPACITY,
                   help=f"the bound drafter sessions must stay within (default {DEFAULT_DRAFTER_CAPACITY})")
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline of one request in seconds (default 300)")
    p.add_argument("--out", required=True, help="output folder (report.json, README.md, rss_sessions.png)")
    return p


def check_args(args: argparse.Namespace) -> None:
    from specpool.core.errors import check

    check(args.serve or bool(args.address), "give --address HOST:PORT of a running server, or --serve to start one")
    check(not (args.serve and args.address), "give either --address or --serve, not both")
    check(args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}")
    check(args.duration > 0, f"--duration must be > 0 seconds, got {args.duration}")
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check(0.0 <= args.http_share <= 1.0, f"--http-share must be in 0..1, got {args.http_share}")
    check(args.http_share == 0 or args.serve or bool(args.http_url), "--http-share needs --http-url (or --serve)")
    check(args.sample_every > 0, f"--sample-every must be > 0, got {args.sample_every}")


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "bench.loadtest", *argv])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(message: str) -> None:
    print(f"loadtest: {message}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_args(args)

    prompts = [q.prompt for q in load_questions(Path(args.prompts), 1 << 30)]
    warmup = default_warmup(args.duration) if args.warmup is None else args.warmup
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples.jsonl").unlink(missing_ok=True)  # this run's samples only (written as taken)
    local, namespace, address, http_url = None, None, args.address, args.http_url
    if args.serve:
        from specpool.services.local_serve import start_local
        from specpool.services.serve_config import default_serve_config, plan_from_config

        pool = [p for p in args.pool.split(",") if p]
        config = default_serve_config(pool, args.redis_url, _free_port(), http_port=_free_port())
        namespace = f"specpool-load-{uuid.uuid4().hex[:8]}"  # the run's own Redis keys, deleted at the end
        for app in config["applications"]:
            if app["name"] == "router":
                app["args"]["redis_namespace"] = namespace
            if app["name"] == "target":
                args.cache_capacity = int(app["args"].get("cache_capacity", args.cache_capacity))
        local = start_local(plan_from_config(config, "the load test's config"), metrics_port=None, progress=_say)
        address, http_url = local.address, local.http_url
    try:
        deployments, gcs = None, None
        if not args.no_introspect:
            import ray

            if not ray.is_initialized():
                ray.init(address=args.ray_address, log_to_driver=False, logging_level="WARNING")
            gcs = ray.get_runtime_context().gcs_address
            deployments = Deployments()
        samples: list[dict] = []

        def sample(t: float, under_load: bool) -> dict:
            entry: dict = {"t": round(t, 1), "under_load": under_load}
            if gcs is not None:
                entry["rss_mib"] = {k: round(v, 1) for k, v in rss_by_group(replica_processes(gcs)).items()}
            if deployments is not None:
                try:
                    entry["sessions"] = deployments.counts()
                except Exception as exc:  # noqa: BLE001 - a slow answer loses one sample, not the run
                    entry["sessions_error"] = f"{type(exc).__name__}: {exc}"
            samples.append(entry)
            # Each sample is on disk as it is taken: a run that dies (its Ray cluster killed, the
            # machine rebooted) still leaves its RSS and session curve up to that moment.
            with open(out / "samples.jsonl", "a", encoding="utf-8") as live:
                live.write(json.dumps(entry) + "\n")
            return entry

        _say(f"{args.concurrency} sessions for {args.duration:.0f} s against {address} ...")
        tally, wall = run_load(args, address, http_url, prompts, sample)
        after_load = after_release = None
        if deployments is not None:
            after_load = sample(wall, False).get("sessions")
            released = deployments.release_all()
            after_release = dict(deployments.counts(), released=released)
        report = build_report(args, argv, tally, wall, samples, warmup, after_load, after_release)
    finally:
        if local is not None:
            _delete_namespace(args.redis_url, namespace)
            local.shutdown()
    write_report(out, report, samples)
    return 0


def build_report(args, argv, tally: Tally, wall: float, samples: list[dict], warmup: float,
                 after_load: dict | None, after_release: dict | None) -> dict:

    every = tally.timings["grpc"] + tally.timings["http"]
    errors = sum(tally.errors.values())
    groups = sorted({g for s in samples for g in s.get("rss_mib", {})})
    return {
        "command": command_line(argv), "machine": machine_info("cpu"),
        "config": {"concurrency": args.concurrency, "duration_s": args.duration, "max_new_tokens": args.max_new_tokens,
                   "http_share": args.http_share, "pool": args.pool if args.serve else None, "prompts": str(args.prompts),
                   "sample_every_s": args.sample_every, "warmup_s": warmup, "cache_capacity": args.cache_capacity},
        "requests": len(every) + errors, "requests_ok": len(every), "errors": errors,
        "errors_by_status": dict(tally.errors), "error_examples": dict(tally.error_examples), "wall_s": wall,
        "latency": latency_summary(every, wall),
        "latency_by_path": {p: latency_summary(t, wall) for p, t in tally.timings.items() if t},
        "rss": {g: rss_summary(samples, warmup, g) for g in ["total"] + [g for g in groups if g != "total"]},
        "sessions": session_verdict(samples, after_load, args.cache_capacity, args.drafter_capacity),
        "after_load": after_load, "after_release": after_release,
        "samples": samples,
    }


def write_report(out: Path, report: dict, samples: list[dict]) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot = None
    if samples:
        try:
            plot_over_time(samples, out / "rss_sessions.png", f"{report['config']['concurrency']} sessions, "
                           f"{report['config']['duration_s']:.0f} s")
            plot = "rss_sessions.png"
        except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
            _say(f"no plot ({exc})")
    (out / "README.md").write_text(markdown_report(report, plot))
    lat, rss = report["latency"], report["rss"]["total"]
    _say(f"{report['requests']} requests, {report['errors']} errors {report['errors_by_status'] or ''}; "
         f"TTFT p50/p99 {_f(lat['ttft_p50_s'], 0, 1000)}/{_f(lat['ttft_p99_s'], 0, 1000)} ms, "
         f"ITL p50/p99 {_f(lat['itl_p50_s'], 0, 1000)}/{_f(lat['itl_p99_s'], 0, 1000)} ms, {_f(lat['tokens_per_s'], 2)} tokens/s; "
         f"RSS {_f(rss['start_mib'])} -> {_f(rss['after_warmup_mib'])} -> {_f(rss['end_mib'])} MiB "
         f"({_f(rss['growth_after_warmup_pct'], 2)} % after warm-up); sessions after: {report['after_load']}")
    _say(f"wrote {out / 'report.json'}, {out / 'README.md'}")


def _delete_namespace(redis_url: str, namespace: str | None) -> None:
    """Drop the run's router state from Redis; best effort (cleanup must not hide the results)."""
    if not namespace:
        return

    delete(redis_url, namespace)


if __name__ == "__main__":
    sys.exit(main())
