"""Integration: ``specpool learner`` on the real Redis at 127.0.0.1:6379 (skipped without one).

- ``generate --learn --learn-feedback`` sends feedback to a stream; ``specpool learner --once``, in
  its own process, trains on it and publishes to the model store; the next ``generate`` drafts with
  that version and still gives the target's own output;
- a learner that crashed with records unacknowledged: ``--claim-idle-s 0`` takes them over,
  ``--max-records`` stops where asked, and the runs together equal one uninterrupted pass over the
  same records, each applied exactly once; a further ``--once`` finds nothing to do;
- without ``--once`` the learner runs until SIGTERM, logs its progress, and commits on the way out.

Every test uses its own stream and deletes it. Models: the unit tests' tiny random target and a
tiny zoo drafter on it (no downloads).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from specpool.learning.feedback import InProcessFeedbackStream
from specpool.learning.feedback_redis import RedisFeedbackStream
from specpool.learning.model_store import DirectoryModelStore, VariantKey
from specpool.learning.online import OnlineConfig
from specpool.drafters.registry import DrafterContext
from redis_helpers import URL, connect_or_skip
from specpool.learning.learner_loop import Learner
from specpool.learning.learner_process import registry_base_models
from specpool.learning.learning_config import LearningConfig
from unit.conftest import WORDS, _prompt_texts, _save, make_model, make_tokenizer, plain_greedy
from unit.online_helpers import target_records, write_tiny_zoo

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TENANT = "acme"


@pytest.fixture(scope="module")
def raw() -> redis.Redis:
    client = connect_or_skip()
    yield client
    client.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target folder, zoo drafter spec, tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = make_tokenizer(WORDS)
    target = _save(root / "target", make_model(0), tokenizer)
    zoo = write_tiny_zoo(target, tokenizer, root / "zoo")
    return target, f"zoo:{zoo}", tokenizer


@pytest.fixture
def stream_key(raw):
    key = f"specpool-test-learner-{uuid.uuid4().hex}"
    yield key
    stream = RedisFeedbackStream(URL, stream=key)
    stream.delete()  # every tenant's stream and the tenant set too
    stream.close()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECPOOL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def specpool(capsys, *args: str) -> tuple[int, str, str]:
    """``specpool ARGS`` in this process."""
    from specpool.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def specpool_process(home: Path, *args: str) -> subprocess.Popen:
    """``specpool ARGS`` in a process of its own (as served mode runs the learner)."""
    env = {**os.environ, "SPECPOOL_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "specpool.cli.main", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lag_and_pending(raw: redis.Redis, key: str, group: str = "learners") -> tuple[int, int]:
    """Over every tenant's stream (one stream per tenant: specpool/learning/feedback_redis.py)."""
    stream = RedisFeedbackStream(URL, stream=key, group=group)
    try:
        return stream.backlog(), stream.pending()
    finally:
        stream.close()


def test_generate_feeds_a_learner_process_and_drafts_with_its_version(raw, models, stream_key, home, tmp_path, capsys):
    target, zoo, tokenizer = models
    store = tmp_path / "store"
    prompt = _prompt_texts()[1]
    generate = ["generate", prompt, "--raw", "--json", "--max-new-tokens", "24", "--drafter", zoo, "-k", "4",
                "--target", str(target), "--tenant", TENANT, "--learn", "--learn-store", str(store),
                "--learn-feedback", URL, "--learn-stream", stream_key]
    code, out, err = specpool(capsys, *generate)
    assert code == 0, err
    first = json.loads(out)
    learning = first["stats"]["learning"]
    assert learning["records"] > 0 and learning["dropped"] == 0 and stream_key in learning["feedback"]
    assert learning["versions"][zoo] == {"drafted_with": 0, "serving": 0}  # nobody learned in this process
    assert raw.xlen(f"{stream_key}:{TENANT}") == learning["records"]  # the tenant's own stream
    code, out, err = specpool(capsys, "generate", prompt, "--raw", "--json", "--max-new-tokens", "24", "--drafter", "none",
                              "--target", str(target))
    assert code == 0, err
    assert first["token_ids"] == json.loads(out)["token_ids"]  # the target's own output

    learner = specpool_process(home, "learner", "--once", "--redis", URL, "--stream", stream_key, "--drafters", zoo,
                               "--store", str(store), "--algo", "optimistic", "--publish-every", "8", "--target", str(target))
    _, err = learner.communicate(timeout=300)
    assert learner.returncode == 0, err
    assert "stopped;" in err and f"{learning['records']} records" in err, err
    assert lag_and_pending(raw, stream_key) == (0, 0)  # everything read and acknowledged
    serving = DirectoryModelStore(store).serving(VariantKey(TENANT, zoo))
    assert serving is not None and serving >= 1 and f"serving {TENANT}/{zoo} v{serving}" in err

    code, out, err = specpool(capsys, *generate)
    assert code == 0, err
    second = json.loads(out)
    assert second["stats"]["learning"]["versions"][zoo]["drafted_with"] == serving
    assert second["token_ids"] == first["token_ids"]  # a learned drafter changes speed, never the output


def test_learner_takes_over_a_crashed_consumer_and_applies_each_record_once(raw, models, stream_key, home, tmp_path, capsys):
    target, zoo, tokenizer = models
    model = make_model(0)
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in _prompt_texts()[:10]]
    prompts = [p + plain_greedy(model, p, 12) for p in prompts]
    records = target_records(model, prompts, k=4, per_prompt=2, tenant=TENANT, drafter=zoo)  # 20
    stream = RedisFeedbackStream(URL, stream=stream_key)
    for record in records:
        stream.emit(record.encode())
    crashed = stream.read("crashed-learner", 5)  # delivered, never acknowledged: the consumer died
    assert len(crashed) == 5 and stream.pending() == 5
    store = tmp_path / "store"
    learner = ["learner", "--redis", URL, "--stream", stream_key, "--drafters", zoo, "--store", str(store),
               "--algo", "optimistic", "--publish-every", "8", "--claim-idle-s", "0", "--no-progress", "--target", str(target)]

    code, out, err = specpool(capsys, *learner, "--once", "--max-records", "12")
    assert code == 0, err
    assert "12 records" in err and "12 acknowledged" in err, err
    assert lag_and_pending(raw, stream_key) == (8, 0)  # the 5 taken over + 7 new; 8 never read

    code, out, err = specpool(capsys, *learner, "--once")
    assert code == 0, err
    assert "8 records" in err and "duplicates" not in err, err
    assert lag_and_pending(raw, stream_key) == (0, 0)

    # One uninterrupted pass over the same records, in process, gives the same learner state.
    config = LearningConfig(online=OnlineConfig(algorithm="optimistic"), publish_every=8, drafters=(zoo,))
    plain = InProcessFeedbackStream(100)
    for record in records:
        plain.emit(record.encode())
    base = registry_base_models(DrafterContext(home, str(target)), [zoo])
    reference = Learner(config, plain, DirectoryModelStore(tmp_path / "reference"), base)
    reference.drain()
    key = VariantKey(TENANT, zoo)
    want = reference.variants[key].learner.state_dict()
    got = DirectoryModelStore(store).load_state(key)
    assert sorted(got["applied"]) == sorted(r.record_id for r in records)  # each exactly once
    assert got["learner"]["steps"] == want["steps"] > 0
    for name, tensor in want["members"][0].items():
        assert torch.equal(tensor, got["learner"]["members"][0][name]), name

    versions = DirectoryModelStore(store).versions(key)
    code, out, err = specpool(capsys, *learner, "--once")
    assert code == 0 and "0 records" in err, err
    assert DirectoryModelStore(store).versions(key) == versions  # nothing new: no new version


def test_learner_runs_until_sigterm_and_logs_progress(raw, models, stream_key, home, tmp_path):
    target, zoo, tokenizer = models
    model = make_model(0)
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in _prompt_texts()[10:14]]
    prompts = [p + plain_greedy(model, p, 12) for p in prompts]
    stream = RedisFeedbackStream(URL, stream=stream_key)
    for record in target_records(model, prompts, k=4, per_prompt=2, tenant=TENANT, drafter=zoo):  # 8
        stream.emit(record.encode())
    store = tmp_path / "store"
    learner = specpool_process(home, "learner", "--redis", URL, "--stream", stream_key, "--drafters", zoo,
                               "--store", str(store), "--publish-every", "4", "--report-every-s", "0.2",
                               "--target", str(target))
    try:
        deadline = time.monotonic() + 180
        while lag_and_pending(raw, stream_key) != (0, 0) or DirectoryModelStore(store).serving(VariantKey(TENANT, zoo)) is None:
            assert learner.poll() is None, learner.communicate()[1]
            assert time.monotonic() < deadline, "the learner did not consume the stream"
            time.sleep(0.2)
        time.sleep(0.6)  # at least one progress report
        learner.send_signal(signal.SIGTERM)
        _, err = learner.communicate(timeout=60)
    finally:
        if learner.poll() is None:
            learner.kill()
    assert learner.returncode == 0, err
    assert "until stopped" in err and "stopped;" in err and "8 records" in err, err
    assert "'applied': 8" in err, err  # a progress line: the counters so far


# --- bench --online --learner-process: a learner process per system, running only beside its requests


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_bench_learner_process_is_paused_between_its_requests_and_learns_while_running(raw, models, stream_key, home, tmp_path):
    import argparse

    from bench.online import LearnerProcess, add_online_arguments

    target, zoo, tokenizer = models
    model = make_model(0)
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in _prompt_texts()[:10]]
    parser = argparse.ArgumentParser()
    add_online_arguments(parser)
    args = parser.parse_args(["--drafter", zoo, "--learner-process", URL, "--publish-every", "4", "--lr", "0.01",
                              "--learner-idle"])
    store = tmp_path / "store"
    key = VariantKey("bench", zoo)
    learner = LearnerProcess("optimistic", args, stream_key, str(store), str(target), tmp_path / "learner.log", home)
    try:
        learner.wait_ready()
        assert os.sched_getscheduler(learner.process.pid) == os.SCHED_IDLE  # --learner-idle
        learner.pause()
        assert learner.state() == "T" == _proc_state(learner.process.pid)  # stopped: no CPU taken from others
        # Feedback arrives while it is paused: nothing is read, nothing learnt, no CPU used.
        records = target_records(model, prompts, k=4, per_prompt=2, drafter=zoo, tenant="bench")
        writer = RedisFeedbackStream(URL, stream=stream_key)
        for record in records:
            writer.emit(record.encode())
        writer.close()
        before = learner.cpu_s()
        time.sleep(1.0)
        assert learner.cpu_s() == before
        # None acknowledged. (A read the learner had blocked in when paused may still be handed
        # entries by the server: they wait, pending, until it runs again.)
        assert sum(lag_and_pending(raw, stream_key, "bench")) == len(records)
        assert DirectoryModelStore(store).serving(key) is None
        learner.resume()
        assert learner.state() != "T"
        deadline = time.monotonic() + 120
        while DirectoryModelStore(store).serving(key) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert DirectoryModelStore(store).serving(key) is not None, (tmp_path / "learner.log").read_text()
        assert learner.cpu_s() > before
    finally:
        last = learner.stop()
    assert learner.process.returncode == 0 and "stopped;" in last, last


def test_bench_online_with_learner_processes(raw, models, home, tmp_path):
    import argparse
    from types import SimpleNamespace

    from bench.online import add_online_arguments, run_online_bench

    target, zoo, _ = models
    corpus = tmp_path / "book.txt"
    corpus.write_text("\n\n".join(" ".join(["the cat sat on the mat and the dog ran to the house"] * 4) for _ in range(4)))
    parser = argparse.ArgumentParser()
    add_online_arguments(parser)
    out = tmp_path / "out"
    argv = ["--corpus", str(corpus), "--limit", "3", "--drafter", zoo, "--max-new-tokens", "8", "--systems", "frozen,ogd",
            "--out", str(out), "--target", str(target), "--forgetting-per-category", "0",
            "--learner-process", URL, "--publish-every", "4"]
    before = {k for k in raw.scan_iter("specpool:bench:*")}
    assert run_online_bench(parser.parse_args(argv), SimpleNamespace(home=home)) == 0
    per_prompt = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert {r["system"] for r in per_prompt} == {"frozen", "ogd"}
    assert all("learner_cpu_s" in r for r in per_prompt if r["system"] == "ogd")
    assert not any("learner_cpu_s" in r for r in per_prompt if r["system"] == "frozen")
    report = (out / "report.md").read_text()
    assert "separate processes" in report and "learner CPU s" in report and "stopped;" in report
    assert "stopped;" in (out / "learner-ogd.log").read_text()
    assert {k for k in raw.scan_iter("specpool:bench:*")} == before  # its streams are deleted
    with pytest.raises(Exception, match="not both"):
        run_online_bench(parser.parse_args(argv + ["--concurrent"]), SimpleNamespace(home=home))


def test_bench_learner_process_dies_with_the_benchmark(models, home, tmp_path):
    """A paused learner whose benchmark was killed does not linger (PR_SET_PDEATHSIG)."""
    target, zoo, _ = models
    script = tmp_path / "parent.py"
    script.write_text(
        "import argparse, os, sys, time\n"
        "from pathlib import Path\n"
        "from bench.online import LearnerProcess, add_online_arguments\n"
        "parser = argparse.ArgumentParser(); add_online_arguments(parser)\n"
        f"args = parser.parse_args(['--drafter', {zoo!r}, '--learner-process', {URL!r}])\n"
        f"learner = LearnerProcess('ogd', args, 'specpool-test-orphan', {str(tmp_path / 'store')!r}, {str(target)!r}, "
        f"Path({str(tmp_path / 'learner.log')!r}), Path({str(home)!r}))\n"
        "learner.wait_ready(); learner.pause()\n"
        "print(learner.process.pid, flush=True)\n"
        "time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _proc_state(child) == "T"
        parent.kill()  # no cleanup runs in the benchmark
        parent.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and _proc_state(child) != "Z" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{child}").exists() or _proc_state(child) == "Z"
    finally:
        if parent.poll() is None:
            parent.kill()
