"""Learning durability (issue 27, item 5), without Redis: durable writes (fsync before rename, a full
disk is one clear error and leaves nothing half-written), checkpoints that cannot run code (a
crafted pickle is refused and runs nothing), acknowledgement only after what a record did is on
disk (dead letters, over-budget records), and memory bounded per tenant (the learner's variants
and history, the served drafters' slots). No model files: the drafter is a tiny random zoo network.
"""

from __future__ import annotations

import errno
import os
import pickle

import pytest
import torch

from specpool.core.errors import ModelUnavailable, StoreUnavailable
from specpool.drafters.zoo import ZooDrafter
from specpool.drafters.zoo_model import ZooConfig, ZooLM
from specpool.learning import durable
from specpool.learning.feedback import Delivery, FeedbackRecord, InProcessFeedbackStream
from specpool.learning.hot_swap import ServedVariants
from specpool.learning.learner_loop import Learner
from specpool.learning.learning_config import LearningConfig
from specpool.learning.model_store import LEGACY_STATE_FILE, STATE_FILE, DirectoryModelStore, VariantKey
from specpool.learning.online import OnlineConfig

KEY = VariantKey("acme", "d")


def tiny_base() -> ZooLM:
    torch.manual_seed(0)
    config = ZooConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, reduced_vocab=24)
    return ZooLM(config, torch.randn(32, 16), torch.arange(24)).eval()


def records(n: int, tenant: str = "acme", start: int = 0) -> list[FeedbackRecord]:
    gen = torch.Generator().manual_seed(start)
    out = []
    for i in range(start, start + n):
        context = torch.randint(0, 32, (6,), generator=gen).tolist()
        draft = torch.randint(0, 32, (3,), generator=gen).tolist()
        rows = [torch.randperm(32, generator=gen)[:5].tolist() for _ in range(4)]
        out.append(FeedbackRecord(f"{tenant}-r{i}", tenant, "s", "d", 0, tuple(context), tuple(draft), 1,
                                  tuple(map(tuple, rows)), ((0.5, 0.2, 0.1, 0.1, 0.05),) * 4))
    return out


def learner(tmp_path, stream, base, **settings) -> Learner:
    settings.setdefault("holdout_every", 0)
    settings.setdefault("online", OnlineConfig(lr=0.05))
    return Learner(LearningConfig(**settings), stream, DirectoryModelStore(tmp_path / "store"), lambda name: base)


def filled(items) -> InProcessFeedbackStream:
    stream = InProcessFeedbackStream(1000)
    for record in items:
        stream.emit(record.encode())
    return stream


# --- durable writes ------------------------------------------------------------------------------


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    durable.atomic_write(tmp_path / "SERVING", b"7\n")
    assert (tmp_path / "SERVING").read_bytes() == b"7\n"
    assert [e[0] for e in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith(".SERVING-") and events[2][1] == tmp_path.name  # the temp file, then the folder
    assert [p.name for p in tmp_path.iterdir()] == ["SERVING"]  # no temporary left


def disk_full_after(monkeypatch, n_bytes: int) -> None:
    """Writes fail with ENOSPC once ``n_bytes`` have been written (the injected fault)."""
    written = [0]
    real = durable._write_fully

    def write(fd, data):
        if written[0] + len(data) > n_bytes:
            real(fd, bytes(data[: max(0, n_bytes - written[0])]))  # part of it reaches the disk first
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        real(fd, data)

    monkeypatch.setattr(durable, "_write_fully", write)


def test_disk_full_while_publishing_is_one_clear_error_and_leaves_no_version(tmp_path, monkeypatch):
    store = DirectoryModelStore(tmp_path / "store")
    tensors = {"w": torch.randn(64, 64)}
    assert store.publish(KEY, tensors, {}) == 1
    store.promote(KEY, 1)
    disk_full_after(monkeypatch, 1000)
    with pytest.raises(StoreUnavailable) as raised:
        store.publish(KEY, tensors, {})
    message = str(raised.value)
    assert "no space left" in message and "bytes free" in message and str(tmp_path / "store") in message, message
    assert store.versions(KEY) == [1] and store.serving(KEY) == 1
    folder = tmp_path / "store" / KEY.scope / KEY.folder()
    assert sorted(p.name for p in folder.iterdir()) == ["SERVING", "v000001"]  # no temporary, no half version
    # The checkpoint too: the old one stays whole, no temporary beside it.
    monkeypatch.undo()
    store.save_state(KEY, {"n": 1, "t": torch.ones(3)})
    disk_full_after(monkeypatch, 10)
    with pytest.raises(StoreUnavailable, match="no space left"):
        store.save_state(KEY, {"n": 2, "t": torch.ones(1000)})
    monkeypatch.undo()
    assert store.load_state(KEY)["n"] == 1
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_disk_full_on_commit_leaves_the_records_pending(tmp_path, monkeypatch):
    base = tiny_base()
    stream = filled(records(4))
    run = learner(tmp_path, stream, base, publish_every=100)
    run.poll(0.0)
    disk_full_after(monkeypatch, 100)
    with pytest.raises(StoreUnavailable):
        run.flush()
    assert stream.pending() == 4  # nothing acknowledged: their effect is on no disk
    monkeypatch.undo()
    run.flush()
    assert stream.pending() == 0 and run.counters["acked"] == 4


# --- checkpoints that cannot run code ------------------------------------------------------------


class RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")  # unpickling creates the marker file


def test_a_pickled_checkpoint_is_refused_and_runs_nothing(tmp_path):
    store = DirectoryModelStore(tmp_path / "store")
    folder = tmp_path / "store" / KEY.scope / KEY.folder()
    folder.mkdir(parents=True)
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(RunsCode(str(proof))))
    assert proof.exists()  # the payload does run code when unpickled
    marker = tmp_path / "marker"
    for name, write in [(LEGACY_STATE_FILE, lambda p: torch.save({"learner": RunsCode(str(marker))}, p)),
                        (STATE_FILE, lambda p: torch.save({"learner": RunsCode(str(marker))}, p)),
                        (STATE_FILE, lambda p: p.write_bytes(pickle.dumps(RunsCode(str(marker)))))]:
        write(folder / name)
        with pytest.raises(ModelUnavailable, match="pickle") as raised:
            store.load_state(KEY)
        assert "\n" not in str(raised.value) and name in str(raised.value)
        (folder / name).unlink()
    assert not marker.exists()
    # And the learner leaves the variant's records pending rather than loading it.
    torch.save({"learner": RunsCode(str(marker))}, folder / STATE_FILE)
    stream = filled(records(2))
    run = learner(tmp_path, stream, tiny_base())
    run.drain()
    assert run.counters["errors"] == 2 and stream.pending() == 2 and not marker.exists()


def test_checkpoint_round_trip_keeps_every_kind_of_value(tmp_path):
    sparse = torch.zeros(50)
    sparse[[3, 17]] = torch.tensor([0.5, 2.0])
    state = {"learner": {"members": [{"w": torch.randn(3, 4), "b": torch.arange(5)}], "previous": [None, [torch.ones(2)]],
                         "outside_mass": sparse.to_sparse(), "steps": 7, "config": {"algorithm": "ogd", "lrs": (0.1, 0.2)}},
             "holdout": [b'{"id":"x"}'], "usage": {"acme": [3, 12]}, "applied": ["r1", "r2"], "f": float("inf")}
    back = durable.decode_state(durable.encode_state(state), "here")
    assert torch.equal(back["learner"]["members"][0]["w"], state["learner"]["members"][0]["w"])
    assert torch.equal(back["learner"]["members"][0]["b"], torch.arange(5))
    assert back["learner"]["previous"][0] is None and torch.equal(back["learner"]["previous"][1][0], torch.ones(2))
    assert torch.equal(back["learner"]["outside_mass"].to_dense(), sparse)
    assert back["holdout"] == [b'{"id":"x"}'] and back["usage"] == {"acme": [3, 12]} and back["f"] == float("inf")
    assert back["learner"]["config"]["lrs"] == [0.1, 0.2] and back["learner"]["steps"] == 7
    with pytest.raises(ModelUnavailable, match="unreadable"):
        durable.decode_state(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", "here")


def test_zoo_train_resume_loads_without_unpickling_code():
    """zoo_train's --resume checkpoint (local, self-written) is loaded with weights_only=True too."""
    source = open(os.path.join(os.path.dirname(durable.__file__), "zoo_train.py")).read()
    learning = os.path.dirname(durable.__file__)
    for name in os.listdir(learning):
        if name.endswith(".py"):
            assert "weights_only=False" not in open(os.path.join(learning, name)).read(), name
    assert "weights_only=True" in source


# --- nothing acknowledged before its effect is on disk ---------------------------------------------


class Redelivering(InProcessFeedbackStream):
    """Hands out every entry as delivered ``times`` times already (a poison record)."""

    def __init__(self, times: int):
        super().__init__(100)
        self.times = times

    def read(self, consumer, count, block_s=0.0):
        return [Delivery(d.entry_id, d.payload, self.times) for d in super().read(consumer, count, block_s)]


def test_dead_letters_are_written_before_they_are_acknowledged(tmp_path, monkeypatch):
    stream = Redelivering(times=9)
    for record in records(2):
        stream.emit(record.encode())
    run = learner(tmp_path, stream, tiny_base(), max_deliveries=5)
    calls = []
    real = run.store.dead_letter

    def dead_letter(entry_id, payload, reason):
        calls.append(stream.pending())  # still pending while it is being written
        if len(calls) == 1:
            raise StoreUnavailable("disk full (injected)")
        real(entry_id, payload, reason)

    monkeypatch.setattr(run.store, "dead_letter", dead_letter)
    run.poll(0.0)
    assert calls == [2, 2] and stream.pending() == 1  # the first could not be written: still pending
    assert run.counters["dead_lettered"] == 1 and run.counters["errors"] == 1
    letters = run.store.dead_letters()
    assert len(letters) == 1 and "delivered 9 times" in letters[0]["reason"]
    assert FeedbackRecord.decode(letters[0]["payload"].encode()).record_id == "acme-r1"


def test_over_budget_records_are_acknowledged_with_the_checkpoint(tmp_path):
    stream = filled(records(5))
    run = learner(tmp_path, stream, tiny_base(), budget_records=2, publish_every=100)
    run.poll(0.0)
    assert run.counters["over_budget"] == 3 and stream.pending() == 5  # none before the commit
    run.flush()
    assert stream.pending() == 0
    assert run.store.load_state(KEY)["usage"] == {"acme": [2, 8]}


# --- bounded memory per tenant --------------------------------------------------------------------


def test_learner_holds_at_most_max_variants_and_resumes_an_evicted_one(tmp_path):
    base = tiny_base()
    stream = InProcessFeedbackStream(1000)
    tenants = ["t0", "t1", "t2", "t3"]
    for tenant in tenants:
        for record in records(3, tenant):
            stream.emit(record.encode())
    run = learner(tmp_path, stream, base, max_variants=2, publish_every=100, history_kept=2, read_count=3)
    for _ in range(4):
        run.poll(0.0)
        assert len(run.variants) <= 2
    assert run.counters["evicted"] == 2 and list(k.scope for k in run.variants) == ["t2", "t3"]
    assert stream.pending() == 6  # the evicted ones were committed and acknowledged; t2, t3 are not yet
    t0 = run.store.load_state(VariantKey("t0", "d"))
    assert sorted(t0["applied"]) == [f"t0-r{i}" for i in range(3)]
    # A record of an evicted tenant resumes its variant from the checkpoint (duplicates still known).
    for record in records(3, "t0")[:1] + records(1, "t0", start=3):
        stream.emit(record.encode())
    run.drain()
    assert run.counters["duplicates"] == 1 and run.counters["applied"] == 13
    assert sorted(run.store.load_state(VariantKey("t0", "d"))["applied"]) == [f"t0-r{i}" for i in range(4)]
    assert len(run.history) == 2  # the last history_kept commits
    assert stream.pending() == 0


def test_served_variants_keep_at_most_max_tenants_slots(tmp_path):
    base_model = tiny_base()
    drafter = ZooDrafter("d", base_model, {"target_tokenizer_fingerprint": "x"})
    store = DirectoryModelStore(tmp_path / "store")
    tensors = {f"members.0.{k}": v for k, v in base_model.state_dict().items() if k != "vocab_ids"}
    for tenant in ("a", "b", "c"):
        store.promote(VariantKey(tenant, "d"), store.publish(VariantKey(tenant, "d"), tensors, {}))
    served = ServedVariants(drafter, store, max_tenants=2, keep=2)
    pinned = {t: served.pick(t) for t in ("a", "b")}
    assert all(v == 1 for v, _ in pinned.values())
    served.pick("a")  # a used last: b is the least recently used
    served.pick("c")
    assert [k.scope for k in served._slots] == ["a", "c"] and served.evicted == 1
    # b's request in flight still gets exactly its version (from the held ones or the store).
    version, again = served.pick("b", version=1, exact=True)
    assert version == 1 and isinstance(again, ZooDrafter)
    assert [k.scope for k in served._slots] == ["a", "c"]  # exact picks make no slot
