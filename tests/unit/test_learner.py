"""The learner worker (specpool/learning/learner.py) on the tiny target and a tiny zoo drafter: it consumes
and acknowledges; after a crash the unacknowledged records come back and every record's effect
counts exactly once; a corrupted update is rolled back; one tenant's feedback never changes another
tenant's drafter; bad records are rejected and counted; and, through the embedded engine, drafters
hot-swap under concurrent requests while greedy output stays the target's own.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from specpool.learning.feedback import Delivery, FeedbackRecord, InProcessFeedbackStream
from specpool.learning.model_store import SHARED_SCOPE, DirectoryModelStore, VariantKey
from specpool.learning.online import OnlineConfig, OnlineDrafterLearner
from online_helpers import target_records, tiny_zoo_model, write_tiny_zoo
from specpool.learning import learner_process as learner_module
from specpool.services.engine import EmbeddedEngine, EngineConfig
from specpool.learning.learner_loop import Learner, is_held_out
from specpool.learning.learning_config import LearningConfig
from specpool.target.models import ModelConfig
from specpool.target.sampling import SamplingParams
from test_online import BAD_RECORDS

DRAFTER = "d"


@pytest.fixture(scope="module")
def zoo_base(model_dirs):
    return tiny_zoo_model(model_dirs.target)


@pytest.fixture(scope="module")
def records(target_lm, prompts):
    return target_records(target_lm[0], prompts, k=4, per_prompt=2, drafter=DRAFTER)  # 48 records


def make_learner(root: Path, stream, zoo_base, consumer: str = "learner-1", **settings) -> Learner:
    settings.setdefault("holdout_every", 0)  # no held-out records unless a test wants them
    settings.setdefault("online", OnlineConfig(algorithm="optimistic", lr=0.05))
    return Learner(LearningConfig(**settings), stream, DirectoryModelStore(root / "store"),
                   base_model=lambda name: zoo_base if name == DRAFTER else None, consumer=consumer)


def filled(records) -> InProcessFeedbackStream:
    stream = InProcessFeedbackStream(capacity=1000)
    for record in records:
        stream.emit(record.encode())
    return stream


def member_state(learner: Learner, key: VariantKey) -> dict[str, torch.Tensor]:
    return learner.variants[key].learner.state_dict()["members"][0]


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


KEY = VariantKey("t1", DRAFTER)


def variant_vocab(learner: Learner) -> torch.Tensor:
    return learner.variants[KEY].learner.members[0].vocab_ids


# --- consume, acknowledge, publish ----------------------------------------------------------------


def test_learner_consumes_acknowledges_and_publishes(tmp_path, zoo_base, records):
    stream = filled(records[:10])
    learner = make_learner(tmp_path, stream, zoo_base, publish_every=4, read_count=4)
    assert learner.drain() == 10
    assert stream.pending() == 0 and stream.backlog() == 0
    c = learner.counters
    assert (c["read"], c["applied"], c["acked"], c["steps"]) == (10, 10, 10, 10)
    assert c["rejected"] == c["errors"] == c["duplicates"] == 0
    store = learner.store
    assert c["published"] == c["promoted"] >= 2 and store.serving(KEY) == store.versions(KEY)[-1]
    tensors, meta = store.load(KEY, store.serving(KEY))
    assert meta["algorithm"] == "optimistic" and meta["members"] == 1
    assert torch.equal(tensors["members.0.head_bias"], member_state(learner, KEY)["head_bias"])
    assert not torch.equal(tensors["members.0.head_bias"], zoo_base.head_bias.detach())


# --- crash and redelivery: each record's effect exactly once --------------------------------------


class Crash(Exception):
    pass


class CrashOn:
    """Wraps a callable so that its n-th call raises ``Crash`` (the process dies there)."""

    def __init__(self, inner, n: int):
        self.inner, self.n, self.calls = inner, n, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise Crash(f"crash in call {self.n}")
        return self.inner(*args, **kwargs)


def crash_in_second_commit(learner: Learner, stream, where: str) -> None:
    """Run ``learner`` until its second commit dies before its checkpoint or before acknowledging."""
    if where == "before_checkpoint":
        learner.store.save_state = CrashOn(learner.store.save_state, 2)
    else:
        stream.ack = CrashOn(stream.ack, 2)
    with pytest.raises(Crash):
        for _ in range(10):
            learner.poll(0.0)


@pytest.mark.parametrize("algorithm", ["optimistic", "hedge", "optimistic+grow"])
@pytest.mark.parametrize("where", ["before_checkpoint", "before_ack"])
def test_crash_redelivers_and_each_record_counts_once(tmp_path, zoo_base, records, where, algorithm):
    online = (OnlineConfig(algorithm="optimistic", lr=0.05) if algorithm == "optimistic"
              else OnlineConfig(algorithm="optimistic", lr=0.003, grow_vocab=16, grow_min_mass=0.3)
              if algorithm == "optimistic+grow" else OnlineConfig(algorithm="hedge", hedge_lrs=(0.02, 0.08)))
    settings = dict(publish_every=5, read_count=4, online=online)
    stream_records = records[:20]

    reference = make_learner(tmp_path / "reference", filled(stream_records), zoo_base, **settings)
    reference.drain()

    stream = filled(stream_records)
    first = make_learner(tmp_path / "run", stream, zoo_base, **settings)
    crash_in_second_commit(first, stream, where)
    # Commit 1 (records 1-8) went through; commit 2 (records 9-16) died before its checkpoint or
    # right after it, before acknowledging: records 9-16 are pending, 17-20 never delivered.
    assert stream.pending() == 8 and stream.backlog() == 4
    del first  # the process is gone: only the stream and the store survive

    second = make_learner(tmp_path / "run", stream, zoo_base, consumer="learner-2", claim_idle_s=0.0, **settings)
    assert second.recover() == 8  # the dead consumer's records are redelivered
    second.drain()
    assert stream.pending() == 0 and stream.backlog() == 0
    duplicates = 8 if where == "before_ack" else 0  # already in the checkpoint: acknowledged, not re-applied
    assert second.counters["duplicates"] == duplicates
    assert second.counters["applied"] == 12 - duplicates
    variant = second.variants[KEY]
    assert sorted(variant.applied) == sorted(r.record_id for r in stream_records)  # each id once
    # The weights, optimiser hints and Hedge weights are those of one uninterrupted pass.
    want, got = reference.variants[KEY].learner.state_dict(), variant.learner.state_dict()
    for a, b in zip(want["members"], got["members"]):
        assert_same_state(a, b)
    torch.testing.assert_close(want["weights"], got["weights"], rtol=0, atol=0)
    assert want["steps"] == got["steps"] == 20
    assert torch.equal(want["vocab_ids"], got["vocab_ids"])  # the same tokens grown, in the same order
    if algorithm == "optimistic+grow":
        assert len(got["vocab_ids"]) > len(zoo_base.vocab_ids)
    if algorithm.startswith("optimistic"):
        for a, b in zip(want["previous"][0], got["previous"][0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["before_checkpoint", "before_ack"])
def test_held_out_records_train_once_after_leaving_the_window(tmp_path, zoo_base, records, where):
    # Every third record is held out; the window keeps the last 2; versions go unchecked (min_holdout).
    settings = dict(publish_every=5, read_count=4, holdout_every=3, holdout_size=2, min_holdout=100)
    stream_records = records[:20]
    held = [r for r in stream_records if is_held_out(r.record_id, 3)]
    assert len(held) >= 4  # the test needs evictions

    reference = make_learner(tmp_path / "reference", filled(stream_records), zoo_base, **settings)
    reference.drain()
    counters, variant = reference.counters, reference.variants[KEY]
    assert counters["held_out"] == len(held) and counters["applied"] == 20 - len(held)
    assert counters["trained_after_holdout"] == len(held) - 2  # all but the window's last two
    assert [r.record_id for r in variant.holdout] == [r.record_id for r in held[-2:]]
    assert counters["steps"] == variant.learner.state_dict()["steps"] == 18

    off = make_learner(tmp_path / "off", filled(stream_records), zoo_base, train_after_holdout=False, **settings)
    off.drain()
    assert off.counters["trained_after_holdout"] == 0 and off.counters["steps"] == 20 - len(held)

    # A crash in the second commit: the redelivered records evict (and train) the same held-out
    # records once, and the learner ends where the uninterrupted one did.
    stream = filled(stream_records)
    first = make_learner(tmp_path / "run", stream, zoo_base, **settings)
    crash_in_second_commit(first, stream, where)
    del first
    second = make_learner(tmp_path / "run", stream, zoo_base, consumer="learner-2", claim_idle_s=0.0, **settings)
    second.recover()
    second.drain()
    assert stream.pending() == 0 and stream.backlog() == 0
    got = second.variants[KEY]
    assert [r.record_id for r in got.holdout] == [r.record_id for r in held[-2:]]
    want_state, got_state = variant.learner.state_dict(), got.learner.state_dict()
    assert want_state["steps"] == got_state["steps"] == 18
    for a, b in zip(want_state["members"], got_state["members"]):
        assert_same_state(a, b)


# --- rollback -----------------------------------------------------------------------------------


@pytest.mark.parametrize("grow_vocab", [0, 16])
def test_corrupted_update_is_rolled_back(tmp_path, zoo_base, records, monkeypatch, caplog, grow_vocab):
    stream = InProcessFeedbackStream(capacity=1000)
    # The tiny drafter's greedy BD is ~0.02 whatever its weights: the soft BD is the signal here.
    online = OnlineConfig(algorithm="optimistic", lr=0.05, grow_vocab=grow_vocab, grow_min_mass=0.3)
    learner = make_learner(tmp_path, stream, zoo_base, publish_every=12, holdout_every=3, min_holdout=3,
                           rollback_bd_drop=0.02, rollback_metric="soft", online=online)
    held = [r for r in records if is_held_out(r.record_id, 3)]
    assert len(held) >= 6  # the test needs held-out records in both halves
    for record in records[:24]:
        stream.emit(record.encode())
    learner.drain()
    store = learner.store
    good = store.serving(KEY)
    assert good is not None and learner.counters["rollbacks"] == 0
    good_tensors, _ = store.load(KEY, good)

    variant = learner.variants[KEY]
    clean_step = type(variant.learner).step

    def corrupted_step(self, batch):  # a poisoned update: the weights blow up
        report = clean_step(self, batch)
        with torch.no_grad():
            for p in self.members[0].parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 3.0)
        return report

    monkeypatch.setattr(type(variant.learner), "step", corrupted_step)
    restores = []  # (AdaGrad sums before the rollback, the learner after it)
    clean_restore = Learner._restore_serving

    def recorded_restore(self, rolled_variant):
        before = [None if a is None else [g.clone() for g in a] for a in rolled_variant.learner.accumulated]
        clean_restore(self, rolled_variant)
        restores.append((before, rolled_variant.learner))

    monkeypatch.setattr(Learner, "_restore_serving", recorded_restore)
    for record in records[24:]:
        stream.emit(record.encode())
    with caplog.at_level("WARNING", logger="specpool.learner"):
        learner.drain()
    assert learner.counters["rollbacks"] >= 1, learner.history
    assert "rolled back" in caplog.text
    assert store.serving(KEY) == good  # drafters keep serving the good version
    rolled = [row for row in learner.history if row["decision"] == "rolled_back"]
    assert rolled and all(row["heldout_bd"] < row["parent_heldout_bd"] - 0.02 for row in rolled)
    folder = tmp_path / "store" / KEY.scope / KEY.folder()
    assert (folder / f"v{rolled[0]['version']:06d}" / "ROLLED_BACK").exists()
    # The learner went back to the serving weights (not on from the corrupted ones).
    state = member_state(learner, KEY)
    for name, value in state.items():
        assert torch.equal(value, good_tensors[f"members.0.{name}"]), name
    assert torch.equal(variant_vocab(learner), good_tensors["vocab_ids"])  # its vocabulary too
    if grow_vocab:
        assert len(good_tensors["vocab_ids"]) > len(zoo_base.vocab_ids)
    assert stream.pending() == 0  # rolled-back records are acknowledged: their effect was decided once
    # The step sizes go on (AdaGrad's sums are kept, cut to the served vocabulary); the stale
    # optimistic hint is dropped.
    before, restored = restores[0]
    assert before[0] is not None and restored.previous == [None]
    for kept, summed in zip(restored.accumulated[0], before[0]):
        assert torch.equal(kept, summed[: kept.shape[0]])


# --- tenants --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_records(target_lm, prompts):
    return {t: target_records(target_lm[0], prompts[6 * n:6 * n + 6], k=3, per_prompt=2, tenant=t, drafter=DRAFTER)
            for n, t in enumerate(("a", "b", "c"))}


def test_one_tenants_feedback_never_changes_another_tenants_drafter(tmp_path, zoo_base, tenant_records):
    stream = InProcessFeedbackStream(capacity=1000)
    learner = make_learner(tmp_path, stream, zoo_base, publish_every=4, opt_out=frozenset({"c"}))
    store = learner.store
    key_a, key_b, key_c = (VariantKey(t, DRAFTER) for t in "abc")
    for record in tenant_records["a"] + tenant_records["c"]:
        stream.emit(record.encode())
    learner.drain()
    assert set(learner.variants) == {key_a}
    assert store.serving(key_a) and store.serving(key_b) is None and store.serving(key_c) is None
    assert learner.counters["opted_out"] == len(tenant_records["c"])
    a_state = {k: v.clone() for k, v in store.load_state(key_a)["learner"]["members"][0].items()}
    a_version = store.serving(key_a)

    for record in tenant_records["b"]:
        stream.emit(record.encode())
    learner.drain()
    assert store.serving(key_b) and store.serving(key_a) == a_version
    assert_same_state(store.load_state(key_a)["learner"]["members"][0], a_state)
    assert not torch.equal(store.load_state(key_b)["learner"]["members"][0]["head_bias"], a_state["head_bias"])
    assert not (tmp_path / "store" / "c").exists()


def test_shared_pool_trains_one_variant_for_all(tmp_path, zoo_base, tenant_records):
    stream = filled(tenant_records["a"] + tenant_records["b"])
    learner = make_learner(tmp_path, stream, zoo_base, publish_every=100, shared_pool=True)
    learner.drain()
    assert set(learner.variants) == {VariantKey(SHARED_SCOPE, DRAFTER)}
    assert learner.counters["applied"] == len(tenant_records["a"]) + len(tenant_records["b"])


def test_training_budget_per_tenant(tmp_path, zoo_base, tenant_records):
    stream = filled(tenant_records["a"] + tenant_records["b"])
    learner = make_learner(tmp_path, stream, zoo_base, publish_every=100, budget_records=3)
    learner.drain()
    assert learner.counters["applied"] == 6 and learner.counters["over_budget"] == 2 * (len(tenant_records["a"]) - 3)
    assert stream.pending() == 0
    by_tokens = make_learner(tmp_path / "tokens", filled(tenant_records["a"]), zoo_base, budget_tokens=9)
    by_tokens.drain()  # 4 positions a record (k = 3): two fit in 9
    assert by_tokens.counters["applied"] == 2


# --- bad input ------------------------------------------------------------------------------------


def test_bad_records_are_rejected_and_counted_never_crash(tmp_path, zoo_base, records, monkeypatch):
    good = records[:6]
    outside = FeedbackRecord(**{**records[6].__dict__, "record_id": "outside", "draft": (100, 3, 4, 5)})
    unknown = FeedbackRecord(**{**records[7].__dict__, "record_id": "unknown", "drafter": "ngram"})
    payloads = [payload for payload, _ in BAD_RECORDS] + [outside.encode(), unknown.encode()]
    stream = InProcessFeedbackStream(capacity=1000)
    for n, payload in enumerate(payloads):
        stream.emit(payload)
        if n % 5 == 0 and good:
            stream.emit(good.pop().encode())
    for record in good:
        stream.emit(record.encode())
    learner = make_learner(tmp_path, stream, zoo_base, publish_every=3)
    learner.drain()
    c = learner.counters
    assert c["applied"] == 6 and c["rejected"] == len(BAD_RECORDS) + 1 and c["not_learnable"] == 1
    expected: dict[str, int] = {}
    for _, reason in BAD_RECORDS:
        expected[reason] = expected.get(reason, 0) + 1
    expected["out_of_range"] += 1  # token 100 >= the tiny vocabulary's 64
    assert learner.rejected == expected
    assert stream.pending() == 0 and c["errors"] == 0

    # A record that keeps killing consumers is dropped after max_deliveries.
    learner.process(Delivery("99-0", records[8].encode(), deliveries=6))
    assert learner.counters["dead_lettered"] == 1
    # An unexpected failure while applying one record is counted; the learner goes on.
    real = OnlineDrafterLearner.batch
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(OnlineDrafterLearner, "batch", flaky)
    for record in records[9:12]:
        stream.emit(record.encode())
    learner.drain()
    assert learner.counters["errors"] == 1 and learner.counters["applied"] == 8 and stream.pending() == 0


def test_a_broken_checkpoint_leaves_records_pending(tmp_path, zoo_base, records):
    """A store problem is not the record's fault: the record is not dropped but left pending, and
    a learner started after the fix applies it."""
    stream = filled(records[:3])
    learner = make_learner(tmp_path, stream, zoo_base)
    folder = tmp_path / "store" / KEY.scope / KEY.folder()
    folder.mkdir(parents=True)
    (folder / "learner_state.pt").write_bytes(b"not a checkpoint")
    learner.drain()
    assert learner.counters["errors"] == 3 and learner.counters["applied"] == 0 and stream.pending() == 3
    (folder / "learner_state.pt").unlink()
    fixed = make_learner(tmp_path, stream, zoo_base, consumer="learner-2", claim_idle_s=0.0)
    assert fixed.recover() == 3
    fixed.drain()
    assert fixed.counters["applied"] == 3 and stream.pending() == 0


# --- through the embedded engine: hot swap under concurrent requests --------------------------------


@pytest.fixture(scope="module")
def zoo_spec(model_dirs, target_lm, tmp_path_factory) -> str:
    folder = write_tiny_zoo(model_dirs.target, target_lm[1], tmp_path_factory.mktemp("zoo") / "tiny")
    return f"zoo:{folder}"


def learning_engine(home: Path, model_dirs, store: Path, **settings) -> EmbeddedEngine:
    settings.setdefault("holdout_every", 0)
    config = LearningConfig(store=str(store), online=OnlineConfig(algorithm="ogd", lr=0.1), **settings)
    return EmbeddedEngine(EngineConfig(home=home, target=ModelConfig(str(model_dirs.target))), learning=config)


class RecordingEmitter:
    """Wraps the engine's emitter: remembers the version each round was drafted with."""

    def __init__(self, inner):
        self.inner = inner
        self.versions: dict[str, set[int]] = {}
        self.lock = threading.Lock()

    def __call__(self, fb, tenant, version):
        with self.lock:
            self.versions.setdefault(fb.session_id, set()).add(version)
        self.inner(fb, tenant, version)


def test_engine_learns_and_swaps_for_the_next_request(home, model_dirs, zoo_spec, tmp_path, engine, prompts):
    learning = learning_engine(home, model_dirs, tmp_path / "store", publish_every=4, opt_out=frozenset({"quiet"}))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=())
        reference = [engine.generate(p, params, None).token_ids for p in prompts[:4]]
        for prompt, want in zip(prompts[:4], reference):
            assert learning.generate(prompt, params, zoo_spec, k=4, tenant="a").token_ids == want
        assert learning.learning.stream.emitted > 0
        assert learning.learning.commit_now()
        slot_a = learning.learning.slot("a", zoo_spec)
        assert slot_a.version >= 1 and learning.learning.learner.counters["promoted"] >= 1
        recorder = RecordingEmitter(learning.learning.emitter)
        learning.learning.emitter = recorder
        learned = slot_a.version  # nothing new to commit: this is what the next request pins
        result = learning.generate(prompts[5], params, zoo_spec, k=4, tenant="a", session_id="after")
        assert result.token_ids == engine.generate(prompts[5], params, None).token_ids
        assert recorder.versions["after"] == {learned}  # (the learner may promote again meanwhile)
        # Another tenant is still served the shipped weights; an opted-out tenant emits nothing.
        learning.generate(prompts[6], params, zoo_spec, k=4, tenant="b", session_id="other")
        assert recorder.versions["other"] == {0}
        learning.generate(prompts[7], params, zoo_spec, k=4, tenant="quiet", session_id="quiet-1")
        assert "quiet-1" not in recorder.versions
    finally:
        learning.close()


@pytest.mark.slow  # a whole run / a regret sweep: the fast lane skips it
def test_hot_swap_under_concurrent_requests(home, model_dirs, zoo_spec, tmp_path, engine, prompts):
    """Threads generate while the learner trains and promotes new versions: nothing errors, every
    output is the target's own greedy output, and each request drafts with one version only."""
    learning = learning_engine(home, model_dirs, tmp_path / "store", publish_every=2, commit_after_s=0.05)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=14, stop_token_ids=())
        work = prompts[:9]
        reference = {n: engine.generate(p, params, None).token_ids for n, p in enumerate(work)}
        learning.drafter(zoo_spec)  # load once, before the threads start
        recorder = RecordingEmitter(learning.learning.emitter)
        learning.learning.emitter = recorder
        errors: list[BaseException] = []
        mismatches: list[tuple[int, int]] = []

        def client(worker: int) -> None:
            try:
                for round_ in range(3):
                    for n in range(worker, len(work), 3):
                        got = learning.generate(work[n], params, zoo_spec, k=4, tenant="a",
                                                session_id=f"w{worker}-{round_}-{n}").token_ids
                        if got != reference[n]:
                            mismatches.append((worker, n))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            learning.learning.commit_now(timeout=10)  # promote what was learned so far, while requests run
        for t in threads:
            t.join()
        assert not errors, errors
        assert not mismatches
        assert all(len(v) == 1 for v in recorder.versions.values()), recorder.versions  # never mixed
        seen = set().union(*recorder.versions.values())
        assert len(seen) >= 2, seen  # versions really changed while serving
        assert learning.learning.learner.counters["promoted"] >= 2
        assert learning.learning.learner.counters["errors"] == 0
    finally:
        learning.close()


# --- served mode's pieces -------------------------------------------------------------------------


def test_run_learner_until_stopped(tmp_path, zoo_base, records):
    stream = filled(records[:8])
    stop = threading.Event()
    store = DirectoryModelStore(tmp_path / "store")
    config = LearningConfig(publish_every=4, holdout_every=0, read_block_s=0.01)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault(
        "learner", learner_module.run_learner(config, stream, store, lambda n: zoo_base, "served-1", stop)))
    thread.start()
    for _ in range(500):
        if stream.backlog() == 0 and stream.pending() == 0:
            break
        threading.Event().wait(0.01)
    stop.set()
    thread.join(10)
    assert box["learner"].counters["applied"] == 8 and store.serving(KEY) is not None


def test_registry_base_models_only_builds_allowed_drafters(home):
    from specpool.drafters.registry import DrafterContext

    base = learner_module.registry_base_models(DrafterContext(home), allowed=["ngram"])
    assert base("hf:some-org/some-model") is None  # never loaded: not allowed
    assert base("ngram") is None  # allowed, but not a zoo drafter


def test_learning_options():
    import argparse

    from specpool.core.errors import InvalidArgument
    from specpool.cli.learning import add_learner_command, add_learning_arguments, learning_config_from_args

    parser = argparse.ArgumentParser()
    add_learning_arguments(parser)
    assert learning_config_from_args(parser.parse_args([])) is None
    config = learning_config_from_args(parser.parse_args(
        ["--learn", "--learn-algorithm", "hedge", "--learn-hedge-lrs", "0.1,1", "--learn-opt-out", "x, y",
         "--learn-shared", "--learn-budget-records", "5"]))
    assert config.online.algorithm == "hedge" and config.online.hedge_lrs == (0.1, 1.0)
    assert config.opt_out == {"x", "y"} and config.shared_pool and config.budget_records == 5
    with pytest.raises(InvalidArgument):
        learning_config_from_args(parser.parse_args(["--learn", "--learn-lr", "-1"]))
    commands = argparse.ArgumentParser().add_subparsers(dest="command")
    learner = add_learner_command(commands)
    args = learner.parse_args(["--drafters", "chat,code", "--learn-algorithm", "optimistic"])
    assert args.drafters == "chat,code" and learning_config_from_args(args, ("chat",)).online.algorithm == "optimistic"


def test_learning_only_between_requests(home, model_dirs, zoo_spec, tmp_path, prompts):
    """continuous=False: records wait in the stream while requests run; commit_now applies them."""
    from specpool.learning.learner import EmbeddedLearning

    engine = EmbeddedEngine(EngineConfig(home=home, target=ModelConfig(str(model_dirs.target))))
    engine.learning = EmbeddedLearning(LearningConfig(store=str(tmp_path / "store"), holdout_every=0), home, continuous=False)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=())
        engine.generate(prompts[0], params, zoo_spec, k=4, tenant="a")
        threading.Event().wait(0.3)  # the thread is alive, and idle
        assert engine.learning.thread.alive and engine.learning.learner.counters["read"] == 0
        assert engine.learning.stream.backlog() > 0
        assert engine.learning.commit_now()
        assert engine.learning.stream.backlog() == 0 and engine.learning.stream.pending() == 0
        assert engine.learning.slot("a", zoo_spec).version >= 1
    finally:
        engine.learning.close()


# --- served drafter replicas: learned versions per tenant, one per request ---------------------------


def test_served_variants_pin_one_version_per_request_and_follow_promotions(tmp_path, zoo_base, prompts):
    """What a served drafter replica (specpool/services/serve_app.py DrafterServer) does with a model store:
    a request's first round gets the tenant's serving version, its later rounds exactly that one
    (also on a fresh replica, from the store), other tenants keep theirs."""
    from specpool.learning.hot_swap import ServedVariants
    from specpool.learning.model_store import SHARED_SCOPE
    from specpool.learning.online import OnlineDrafterLearner
    from specpool.drafters.zoo import ZooDrafter
    from specpool.core.errors import ModelUnavailable
    from specpool.target.sampling import SamplingParams

    store = DirectoryModelStore(tmp_path / "store")
    base = ZooDrafter(DRAFTER, zoo_base, {"target_tokenizer_fingerprint": "x"})

    def promote(key: VariantKey, scale: float) -> int:
        learner = OnlineDrafterLearner(zoo_base, OnlineConfig())
        with torch.no_grad():
            for p in learner.members[0].parameters():
                if p.requires_grad:
                    p.mul_(scale)
        version = store.publish(key, *learner.serving_tensors())
        store.promote(key, version)
        return version

    params = SamplingParams(max_new_tokens=8)

    def draft(drafter, session: str):
        proposal = drafter.propose(session, prompts[0], 4, params)
        return proposal.tokens, [q.probs.tolist() for q in proposal.q]

    variants = ServedVariants(base, store, refresh_every_s=0.0)
    assert variants.pick("t1") == (0, base)  # nothing learned yet: the shipped weights
    v1 = promote(KEY, 0.9)
    version, first = variants.pick("t1")
    assert version == v1 == 1 and first is not base
    assert variants.pick("t1", 1, exact=True)[1] is first and variants.pick("t2") == (0, base)
    v2 = promote(KEY, 0.8)
    assert variants.pick("t1")[0] == v2  # the next request drafts with the new version ...
    assert variants.pick("t1", v1, exact=True)[1] is first  # ... a running one keeps its own
    assert variants.pick("t1", 0, exact=True)[1] is base

    fresh = ServedVariants(base, store)  # another replica, after a failover: v1 from the store
    assert draft(fresh.pick("t1", v1, exact=True)[1], "s-fresh") == draft(first, "s-first")
    assert draft(first, "s-first") != draft(base, "s-base")  # (the versions really differ)
    with pytest.raises(ModelUnavailable, match="version 99"):
        fresh.pick("t1", 99, exact=True)
    with pytest.raises(ModelUnavailable, match="needs the request's tenant"):
        fresh.pick("", 1, exact=True)
    assert fresh.pick("") == (0, base)

    shared = ServedVariants(base, store, shared=True, refresh_every_s=0.0)
    assert shared.pick("t1") == (0, base)  # the shared variant has no version yet
    promote(VariantKey(SHARED_SCOPE, DRAFTER), 0.7)
    assert shared.pick("t2")[0] == 1 and shared.pick("t1")[1] is shared.pick("t2")[1]

    variants.release("s-first")  # every version's caches of the session
    assert "s-first" not in first.caches._caches and "s-base" in base.caches._caches
    variants.release("s-base")
    assert "s-base" not in base.caches._caches


def test_remembered_serving_scores_give_the_fresh_comparison(tmp_path, zoo_base, records):
    """The serving version's held-out scores are kept per record between commits; every commit's
    figures equal a comparison made from scratch on that commit's held-out set."""
    from specpool.learning.evaluation import compare
    from specpool.learning.zoo_weights import build_served_model

    stream = InProcessFeedbackStream(capacity=1000)
    learner = make_learner(tmp_path, stream, zoo_base, publish_every=10**6, holdout_every=3, min_holdout=2,
                           rollback_metric="soft")
    checked = 0
    for start in range(0, len(records), 8):
        for record in records[start:start + 8]:
            stream.emit(record.encode())
        rows = len(learner.history)
        learner.drain()  # one commit
        if len(learner.history) == rows or learner.history[-1]["heldout_bd"] is None:
            continue
        row = learner.history[-1]
        holdout = list(learner.variants[KEY].holdout)

        def model(version):
            if version == 0:
                return zoo_base
            tensors, metadata = learner.store.load(KEY, version)
            return build_served_model(zoo_base, tensors, metadata)

        fresh = compare(model(row["version"]), model(row["parent"]), holdout, "soft")
        assert row["heldout_bd"] == pytest.approx(fresh.candidate_bd, abs=1e-6)
        assert row["parent_heldout_bd"] == pytest.approx(fresh.serving_bd, abs=1e-6)
        checked += 1
    assert checked >= 3  # several commits, most of them with remembered scores
