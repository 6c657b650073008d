"""bench/loadtest.py: the pure parts (percentiles and latency, RSS growth after warm-up, the
session verdict, the report), the command line's checks, and the process discovery on /proc."""

from __future__ import annotations

import json
import os

import pytest

from bench import loadtest
from bench.served import StreamTiming
from specpool.core.errors import InvalidArgument


def _sample(t, total, under_load=True, target=None, active=0, drafters=None, **groups):
    entry = {"t": t, "under_load": under_load, "rss_mib": {"total": total, **groups}}
    if target is not None:
        entry["sessions"] = {"router_active": active, "target": target, "drafters": drafters or {}}
    return entry


def test_latency_summary_percentiles_and_tokens_per_second():
    a = StreamTiming(arrivals=[(0.5, 0), (1.0, 2), (1.4, 2)], wall_s=1.5)  # TTFT 1.0, gaps 0.2 0.2
    b = StreamTiming(arrivals=[(2.0, 1), (3.0, 1)], wall_s=3.0)  # TTFT 2.0, gap 1.0
    out = loadtest.latency_summary([a, b], wall_s=3.0)
    assert out["requests"] == 2 and out["tokens"] == 6 and out["tokens_per_s"] == pytest.approx(2.0)
    assert out["ttft_p50_s"] == pytest.approx(1.5) and out["ttft_p99_s"] == pytest.approx(1.99)
    assert out["itl_p50_s"] == pytest.approx(0.2) and out["itl_p99_s"] == pytest.approx(0.984)
    empty = loadtest.latency_summary([], wall_s=0.0)
    assert empty["ttft_p50_s"] is None and empty["tokens_per_s"] is None


def test_rss_growth_counts_from_the_first_sample_after_warm_up():
    samples = [_sample(0, 500.0), _sample(10, 900.0), _sample(20, 1000.0), _sample(30, 1020.0),
               _sample(40, 1050.0), _sample(45, 2000.0, under_load=False)]  # after the load: not counted
    out = loadtest.rss_summary(samples, warmup_s=15)
    assert out["start_mib"] == 500.0 and out["after_warmup_mib"] == 1000.0 and out["end_mib"] == 1050.0
    assert out["growth_after_warmup_pct"] == pytest.approx(5.0) and out["peak_mib"] == 1050.0
    assert out["warmup_sample_t"] == 20
    # A warm-up longer than the run: the last sample is the warm one (growth 0, not a crash).
    assert loadtest.rss_summary(samples, warmup_s=999)["growth_after_warmup_pct"] == 0.0
    # Per group; a group never sampled gives Nones.
    grouped = [_sample(0, 10.0, **{"target:Target": 8.0}), _sample(20, 12.0, **{"target:Target": 6.0})]
    assert loadtest.rss_summary(grouped, 5, "target:Target")["growth_after_warmup_pct"] == 0.0
    assert loadtest.rss_summary(grouped, 0, "target:Target")["growth_after_warmup_pct"] == pytest.approx(-25.0)
    assert loadtest.rss_summary(grouped, 5, "router:Router")["end_mib"] is None


def test_default_warmup():
    assert loadtest.default_warmup(120) == 20 and loadtest.default_warmup(1800) == 300


def test_session_verdict():
    samples = [_sample(0, 1, target=3, active=4, drafters={"ngram": 3}),
               _sample(10, 1, target=64, active=4, drafters={"ngram": 90})]
    ok = loadtest.session_verdict(samples, {"router_active": 0, "target": 64, "drafters": {"ngram": 94}}, 64, 64)
    assert ok["no_active_after_load"] and ok["target_caches_bounded"] and ok["target_caches_max"] == 64
    assert ok["drafter_sessions_bounded"] == {"ngram": False} and ok["drafter_sessions_max"] == {"ngram": 90}
    assert loadtest.session_verdict(samples, None, 64)["drafter_sessions_bounded"] == {"ngram": True}  # within 1024
    leaked = loadtest.session_verdict(samples + [_sample(20, 1, target=65)], {"router_active": 1, "target": 65}, 64)
    assert not leaked["no_active_after_load"] and not leaked["target_caches_bounded"]
    # No introspection at all: nothing is claimed.
    blind = loadtest.session_verdict([_sample(0, 1)], None, 64)
    assert not blind["no_active_after_load"] and not blind["target_caches_bounded"]


def _report(errors=None):
    samples = [_sample(0, 500.0, target=2, active=2, drafters={"ngram": 2}),
               _sample(30, 600.0, target=40, active=2, drafters={"ngram": 40})]
    after = {"router_active": 0, "target": 40, "drafters": {"ngram": 40}}
    timing = StreamTiming(arrivals=[(0.1, 1), (0.2, 1)], wall_s=0.2)
    return {
        "command": "python -m bench.loadtest --serve", "machine": {"cpu": "x86_64", "cores": 2},
        "config": {"concurrency": 2, "duration_s": 30, "max_new_tokens": 8, "http_share": 0.25, "pool": "ngram"},
        "requests": 11, "requests_ok": 10, "errors": 1 if errors else 0, "errors_by_status": errors or {},
        "wall_s": 31.0, "latency": loadtest.latency_summary([timing] * 10, 31.0),
        "latency_by_path": {"grpc": loadtest.latency_summary([timing] * 8, 31.0)},
        "rss": {"total": loadtest.rss_summary(samples, 5)}, "sessions": loadtest.session_verdict(samples, after, 64),
        "after_load": after, "after_release": {"router_active": 0, "target": 0, "drafters": {"ngram": 0}, "released": 80},
        "samples": samples,
    }


def test_report_renders_every_figure():
    text = loadtest.markdown_report(_report({"UNAVAILABLE": 1}), "rss_sessions.png")
    assert "errors: **1** (UNAVAILABLE 1)" in text and "requests: **11**" in text
    assert "| all | 10 | 100 ms | 100 ms | 100 ms | 100 ms |" in text and "| grpc | 8 |" in text
    assert "| total | 500.0 | 600.0 | 600.0 | 600.0 | 0.00 % |" in text
    assert "| requests running (router) | 2 | 0 | 0 |" in text and "| target KV caches | 40 | 40 | 0 |" in text
    assert "| drafter sessions | ngram 40 | ngram 40 | ngram 0 |" in text
    assert "no request running after the load: **yes**" in text and "![RSS and sessions over time](rss_sessions.png)" in text
    assert "HTTP share 25%" in text
    clean = loadtest.markdown_report(_report(), None)
    assert "errors: **0**\n" in clean and "![" not in clean


def test_report_is_json_and_plots(tmp_path):
    report = _report()
    loadtest.write_report(tmp_path, report, report["samples"])
    assert json.loads((tmp_path / "report.json").read_text())["requests"] == 11
    assert (tmp_path / "rss_sessions.png").stat().st_size > 1000
    assert "rss_sessions.png" in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "p", "--out", "o"], "--address HOST:PORT"),
    (["--serve", "--address", "h:1", "--prompts", "p", "--out", "o"], "not both"),
    (["--serve", "--concurrency", "0", "--prompts", "p", "--out", "o"], "--concurrency"),
    (["--serve", "--duration", "0", "--prompts", "p", "--out", "o"], "--duration"),
    (["--address", "h:1", "--http-share", "0.5", "--prompts", "p", "--out", "o"], "--http-url"),
    (["--serve", "--http-share", "2", "--prompts", "p", "--out", "o"], "0..1"),
])
def test_bad_command_lines_are_one_clear_error(argv, message):
    with pytest.raises(InvalidArgument, match=message):
        loadtest.check_args(loadtest.build_parser().parse_args(argv))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc")
def test_rss_of_this_process_and_no_replicas_of_an_unknown_cluster():
    assert loadtest.rss_mib(os.getpid()) > 1.0
    assert loadtest.rss_by_group({os.getpid(): "me:Me"})["total"] == loadtest.rss_by_group({os.getpid(): "me:Me"})["me:Me"]
    assert loadtest.replica_processes("127.0.0.1:1") == {}  # no raylet has that GCS address


@pytest.mark.parametrize("title, group", [
    ("ray::ServeReplica:target:Target", "target:Target"),
    ("ray::ServeReplica:router:Router.handle_request_streaming", "router:Router"),
    ("ray::SERVE_REPLICA::drafter-code#Drafter#ab12:ServeReplica:drafter-code:Drafter.__init__", "drafter-code:Drafter"),
    ("ray::ServeController.listen_for_change", None), ("ray::ProxyActor", None), ("python -m pytest", None),
    ("/usr/bin/python ServeReplica:x:y", None),
])
def test_replica_group_from_process_titles(title, group):
    assert loadtest.replica_group(title) == group
