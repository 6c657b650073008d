"""Integration: `python -m bench.loadtest --serve` for two minutes against a real served instance
(Ray Serve, the real default target, the n-gram drafter, Redis at 127.0.0.1:6379, gRPC on
loopback and a share over the OpenAI-compatible HTTP API); no mocks.

The command's own report must show 0 errors, no request running once the load stopped, the
target's caches bounded by its capacity throughout, every cache released afterwards, and RSS
sampled for every deployment. Runs as a child process, as a user runs it (it starts its own Ray).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

from redis_helpers import connect_or_skip

ROOT = Path(__file__).resolve().parents[2]
DURATION_S = 120
PROMPTS = [
    ("coding", "Write a Python function that returns the n-th Fibonacci number."),
    ("writing", "Write a haiku about caches."),
    ("reasoning", "What is 12 times 7? Explain briefly."),
    ("translation", "Translate to French: Where is the train station?"),
    ("chat", "What if the Beatles had never formed as a band?"),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    connect_or_skip().close()
    base = tmp_path_factory.mktemp("loadtest")
    prompts = base / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [p]}) + "\n"
                               for i, (c, p) in enumerate(PROMPTS)))
    out = base / "out"
    command = [sys.executable, "-m", "bench.loadtest", "--serve", "--pool", "ngram", "--concurrency", "4",
               "--duration", str(DURATION_S), "--max-new-tokens", "8", "--http-share", "0.25", "--sample-every", "5",
               "--prompts", str(prompts), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=DURATION_S + 900)
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "README.md").exists() and (out / "rss_sessions.png").exists()
    return json.loads((out / "report.json").read_text())


def test_two_minutes_of_load_without_errors(report):
    assert report["errors"] == 0, (report["errors_by_status"], report["error_examples"])
    assert report["requests"] == report["requests_ok"] > 0
    assert report["latency_by_path"]["grpc"]["requests"] > 0 and report["latency_by_path"]["http"]["requests"] > 0
    latency = report["latency"]
    assert latency["tokens"] > 0 and 0 < latency["ttft_p50_s"] <= latency["ttft_p99_s"]
    assert 0 < latency["itl_p50_s"] <= latency["itl_p99_s"]
    assert report["wall_s"] >= DURATION_S


def test_no_request_left_and_caches_bounded(report):
    sessions, samples = report["sessions"], report["samples"]
    assert len([s for s in samples if s.get("sessions")]) >= DURATION_S // 5 - 2  # sampled throughout
    assert sessions["router_active_after_load"] == 0 and sessions["no_active_after_load"]
    assert sessions["target_caches_bounded"], sessions
    assert sessions["target_caches_max"] <= sessions["capacity"] == 64
    # Finished requests keep their caches (keep_caches), never more than there were requests.
    assert 0 < report["after_load"]["target"] <= min(report["requests_ok"], sessions["capacity"])
    assert all(0 < n <= report["requests_ok"] for n in report["after_load"]["drafters"].values())
    released = report["after_release"]
    assert released["router_active"] == 0 and released["target"] == 0 and set(released["drafters"].values()) == {0}


def test_rss_is_sampled_for_every_deployment(report):
    rss = report["rss"]
    assert {"total", "router:Router", "target:Target", "drafter-ngram:Drafter"} <= set(rss)
    for group, part in rss.items():
        assert 50 < part["start_mib"] and part["after_warmup_mib"] and part["end_mib"], (group, part)
        assert part["growth_after_warmup_pct"] is not None
    total = rss["total"]
    groups = [v["end_mib"] for g, v in rss.items() if g != "total"]  # each rounded to 0.1 MiB, as the total
    assert total["end_mib"] == pytest.approx(sum(groups), abs=0.05 * (len(groups) + 1))
