"""Integration: the feedback stream on a real Redis (127.0.0.1:6379), and a learner over it that
crashes and is replaced: the unacknowledged records come back and each counts exactly once.
Every test uses its own stream name and deletes it afterwards. No model files: the drafter is a
tiny random zoo network."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
import torch

from specpool.learning.feedback import FeedbackRecord, InProcessFeedbackStream
from specpool.learning.feedback_redis import RedisFeedbackStream
from specpool.learning.model_store import DirectoryModelStore, VariantKey
from specpool.learning.online import OnlineConfig
from specpool.drafters.zoo_model import ZooConfig, ZooLM
from specpool.core.errors import StoreUnavailable
from specpool.learning.learner_loop import Learner
from specpool.learning.learning_config import LearningConfig

pytestmark = pytest.mark.integration

from redis_helpers import URL, connect_or_skip


@pytest.fixture(scope="module")
def raw() -> redis.Redis:
    client = connect_or_skip(decode_responses=False)
    yield client
    client.close()


@pytest.fixture
def stream(raw):
    s = RedisFeedbackStream(URL, stream=f"specpool-test-feedback-{uuid.uuid4().hex}", group="learners")
    yield s
    s.delete()
    s.close()


def test_read_ack_claim(stream):
    for i in range(5):
        stream.emit(f"p{i}".encode())
    first = stream.read("a", 3)
    assert [d.payload for d in first] == [b"p0", b"p1", b"p2"] and all(d.deliveries == 1 for d in first)
    assert stream.pending() == 3 and stream.backlog() == 2
    assert stream.ack([first[0].entry_id]) == 1
    assert [d.payload for d in stream.read("a", 10)] == [b"p3", b"p4"]
    assert stream.read("a", 10, block_s=0.05) == []
    assert stream.claim_stale("b", min_idle_s=60.0)[1] == []  # not idle long enough
    time.sleep(0.02)
    cursor, again = stream.claim_stale("b", min_idle_s=0.01, count=2)
    assert [d.payload for d in again] == [b"p1", b"p2"] and all(d.deliveries == 2 for d in again)
    cursor, rest = stream.claim_stale("b", min_idle_s=0.0, count=10, start=cursor)
    assert [d.payload for d in rest] == [b"p3", b"p4"] and cursor == "0-0"
    stream.ack([d.entry_id for d in again + rest])
    assert stream.pending() == 0


def test_maxlen_bounds_the_stream(raw):
    s = RedisFeedbackStream(URL, stream=f"specpool-test-feedback-{uuid.uuid4().hex}", maxlen=100)
    try:
        for i in range(1000):
            s.emit(b"x")
        assert s.emitted == 1000 and raw.xlen(s.stream) <= 250  # MAXLEN ~ trims whole nodes
    finally:
        s.delete()
        s.close()


def test_unreachable_redis():
    with pytest.raises(StoreUnavailable, match="unreachable"):
        RedisFeedbackStream("redis://127.0.0.1:1/0", stream="x")


def test_emit_never_raises_when_redis_goes_away(stream):
    stream.emit(b"a")
    stream._client.connection_pool.disconnect()
    stream._client = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    started = time.monotonic()
    for _ in range(50):
        stream.emit(b"b")  # one failed call, then dropped without trying until retry_after_s
    assert time.monotonic() - started < 2.0
    assert stream.dropped == 50 and stream.emitted == 1
    stream._client = redis.Redis.from_url(URL)


def tiny_base() -> ZooLM:
    torch.manual_seed(0)
    config = ZooConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, reduced_vocab=24)
    return ZooLM(config, torch.randn(32, 16), torch.arange(24)).eval()


def records(n: int) -> list[FeedbackRecord]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        context = torch.randint(0, 32, (6,), generator=gen).tolist()
        draft = torch.randint(0, 32, (3,), generator=gen).tolist()
        rows = [torch.randperm(32, generator=gen)[:5].tolist() for _ in range(4)]
        probs = [[0.5, 0.2, 0.1, 0.1, 0.05]] * 4
        out.append(FeedbackRecord(f"r{i}", "acme", "s", "d", 0, tuple(context), tuple(draft), 1,
                                  tuple(map(tuple, rows)), tuple(map(tuple, probs))))
    return out


def test_learner_over_redis_survives_a_crash(stream, tmp_path):
    base = tiny_base()
    settings = LearningConfig(online=OnlineConfig(lr=0.05), publish_every=4, read_count=3, holdout_every=0,
                              claim_idle_s=0.0)
    store = DirectoryModelStore(tmp_path / "store")
    for record in records(12):
        stream.emit(record.encode())
    first = Learner(settings, stream, store, lambda name: base, consumer="l1")
    first.poll(0.0)  # 3 records, not committed
    first.poll(0.0)  # 6: committed (>= 4) and acknowledged
    first.poll(0.0)  # 9: applied, not committed...
    assert stream.pending() == 3
    del first  # ...and the process dies

    second = Learner(settings, stream, store, lambda name: base, consumer="l2")
    assert second.recover() == 3
    second.drain()
    assert stream.pending() == 0 and stream.backlog() == 0
    variant = second.variants[VariantKey("acme", "d")]
    assert sorted(variant.applied) == sorted(f"r{i}" for i in range(12))
    assert second.counters["applied"] == 6 and variant.learner.steps == 12

    plain = InProcessFeedbackStream(1000)
    for record in records(12):
        plain.emit(record.encode())
    reference = Learner(settings, plain, DirectoryModelStore(tmp_path / "ref"), lambda name: base)
    reference.drain()
    want = reference.variants[VariantKey("acme", "d")].learner.state_dict()["members"][0]
    got = variant.learner.state_dict()["members"][0]
    for name in want:
        assert torch.equal(want[name], got[name]), name

