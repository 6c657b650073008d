"""Integration: the learner's durability (issue 27, item 5) on a private ``redis-server`` that each
test starts (no persistence, so a restart loses every stream and group, as a crashed Redis does):

- the consumer group is created again after Redis restarts (NOGROUP), and ``run_learner`` goes on
  with the records sent since, instead of retrying forever;
- one tenant flooding its stream past MAXLEN trims only its own records: another tenant's all
  survive, and a read gives that tenant its share;
- ``specpool learner`` SIGKILLed between writing a checkpoint and acknowledging its records, twice,
  and restarted under the same consumer name: every record's effect lands exactly once (the
  checkpoint holds each record id once, and the learner state equals one uninterrupted pass).

Models: the unit tests' tiny random target and a tiny zoo drafter on it (no downloads).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from specpool.drafters.registry import DrafterContext
from specpool.learning.feedback import InProcessFeedbackStream
from specpool.learning.feedback_redis import RedisFeedbackStream
from specpool.learning.learner_loop import Learner
from specpool.learning.learner_process import registry_base_models, run_learner
from specpool.learning.learning_config import LearningConfig
from specpool.learning.model_store import DirectoryModelStore, VariantKey
from specpool.learning.online import OnlineConfig
from learner_helpers import LearnerProcess
from unit.conftest import WORDS, _prompt_texts, _save, make_model, make_tokenizer, plain_greedy
from unit.online_helpers import target_records, write_tiny_zoo
from unit.test_learning_durability import records as random_records, tiny_base

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TENANT = "acme"


class PrivateRedis:
    """A redis-server on a free port, without persistence; ``restart`` kills it (SIGKILL) and starts
    a fresh, empty one on the same port."""

    def __init__(self, workdir: Path):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(tmp_path)
    yield server
    server.stop()


def test_the_consumer_group_comes_back_after_a_redis_restart(private_redis, tmp_path):
    base = tiny_base()
    key = f"durability-{uuid.uuid4().hex}"
    producer = RedisFeedbackStream(private_redis.url, stream=key)
    source = RedisFeedbackStream(private_redis.url, stream=key)
    for record in random_records(3):
        producer.emit(record.encode())
    config = LearningConfig(online=OnlineConfig(lr=0.05), holdout_every=0, publish_every=3, read_block_s=0.05)
    store = DirectoryModelStore(tmp_path / "store")
    stop = threading.Event()
    progress: list[int] = []
    result: dict = {}

    def run():
        try:
            result["learner"] = run_learner(config, source, store, lambda name: base, "l1", stop, max_records=6,
                                            on_progress=lambda l: progress.append(l.counters["processed"]),
                                            retry_after_s=0.2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not progress or progress[-1] < 3:
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.05)
    private_redis.restart()  # every stream, group and the tenant set are gone
    producer.close()
    producer = RedisFeedbackStream(private_redis.url, stream=key)
    for record in random_records(3, start=3):
        producer.emit(record.encode())
    thread.join(60)
    stop.set()
    assert not thread.is_alive() and "error" not in result, result
    learner = result["learner"]
    assert learner.counters["applied"] == 6 and source.groups_recreated >= 1
    assert source.pending() == 0 and source.backlog() == 0
    state = store.load_state(VariantKey(TENANT, "d"))
    assert sorted(state["applied"]) == sorted(f"acme-r{i}" for i in range(6))
    producer.close()
    source.close()


def test_a_flooding_tenant_trims_only_its_own_stream(private_redis):
    key = f"durability-{uuid.uuid4().hex}"
    stream = RedisFeedbackStream(private_redis.url, stream=key, maxlen=100)
    quiet = random_records(40, "quiet")
    for i, record in enumerate(random_records(2000, "flood")):
        stream.emit(record.encode())
        if i % 50 == 0 and quiet:
            stream.emit(quiet.pop().encode())
    raw = redis.Redis.from_url(private_redis.url)
    assert raw.xlen(f"{key}:quiet") == 40  # every one of them survived the flood
    assert raw.xlen(f"{key}:flood") <= 300  # the flood trimmed its own (MAXLEN ~ trims whole nodes)
    first = stream.read("l1", 10)
    tenants = [d.entry_id.split("/")[0] for d in first]
    assert len(first) == 10 and tenants.count("quiet") == 5 and tenants.count("flood") == 5
    got = first
    while batch := stream.read("l1", 10):
        got += batch
    assert sum(d.entry_id.startswith("quiet/") for d in got) == 40
    raw.close()
    stream.close()


# --- specpool learner SIGKILLed mid-commit --------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tokenizer = make_tokenizer(WORDS)
    target = _save(root / "target", make_model(0), tokenizer)
    zoo = write_tiny_zoo(target, tokenizer, root / "zoo")
    return target, f"zoo:{zoo}", tokenizer


def test_learner_sigkilled_mid_commit_applies_every_record_exactly_once(private_redis, models, tmp_path):
    target, zoo, tokenizer = models
    home = tmp_path / "home"
    model = make_model(0)
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in _prompt_texts()[:10]]
    prompts = [p + plain_greedy(model, p, 12) for p in prompts]
    records = target_records(model, prompts, k=4, per_prompt=2, tenant=TENANT, drafter=zoo)  # 20
    key = f"durability-{uuid.uuid4().hex}"
    stream = RedisFeedbackStream(private_redis.url, stream=key)
    store = tmp_path / "store"
    args = ["--redis", private_redis.url, "--stream", key, "--drafters", zoo, "--store", str(store), "--algo",
            "optimistic", "--publish-every", "8", "--consumer", "learner-a", "--no-progress", "--target", str(target)]
    vkey = VariantKey(TENANT, zoo)

    for batch in (records[:12], records[12:]):
        for record in batch:
            stream.emit(record.encode())
        killed = LearnerProcess(home, args, pause_before_ack_s=120)
        killed.wait_for("not acknowledged yet; pausing")
        killed.process.send_signal(signal.SIGKILL)  # between the checkpoint and the acknowledgement
        killed.process.wait(30)
        assert stream.pending() == len(batch)  # nothing acknowledged...
        held = DirectoryModelStore(store).load_state(vkey)["applied"]
        assert set(r.record_id for r in batch) <= set(held)  # ...though the checkpoint holds them all
        err = LearnerProcess(home, [*args, "--once"]).finish()
        assert f"{len(batch)} duplicates" in err and "0 applied" in err, err  # acknowledged, not applied again
        assert stream.pending() == 0 and stream.backlog() == 0

    # Each record's effect exactly once: the state of one uninterrupted pass over the same records.
    config = LearningConfig(online=OnlineConfig(algorithm="optimistic"), publish_every=8, drafters=(zoo,))
    plain = InProcessFeedbackStream(100)
    for record in records:
        plain.emit(record.encode())
    reference = Learner(config, plain, DirectoryModelStore(tmp_path / "reference"),
                        registry_base_models(DrafterContext(home, str(target)), [zoo]))
    reference.drain()
    want = reference.variants[vkey].learner.state_dict()
    got = DirectoryModelStore(store).load_state(vkey)
    assert sorted(got["applied"]) == sorted(r.record_id for r in records)
    assert got["learner"]["steps"] == want["steps"] > 0
    for name, tensor in want["members"][0].items():
        assert torch.equal(tensor, got["learner"]["members"][0][name]), name
    stream.close()
