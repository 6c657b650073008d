"""Online learning's parts without the learner worker: the pure math (OGD, optimistic OGD, Hedge,
sparse TV) on tables of cases, feedback records (round trip, bounded, bad input rejected with a
reason), the in-process stream's consumer-group semantics, the directory model store, and the
three algorithms lowering the distillation loss on a repeated feedback stream from the tiny target.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from specpool.learning.feedback import (
    BadFeedback,
    FeedbackEmitter,
    FeedbackLimits,
    FeedbackRecord,
    InProcessFeedbackStream,
    record_from_round,
)
from specpool.learning.model_store import SHARED_SCOPE, DirectoryModelStore, VariantKey, open_model_store
from specpool.learning.batches import make_batch, vocab_map_for
from specpool.learning.ensemble import ZooEnsembleLM
from specpool.learning.evaluation import evaluate, sparse_tv
from specpool.learning.online import OnlineConfig, OnlineDrafterLearner
from specpool.learning.online_updates import clip_grads, hedge_update, ogd_step, optimistic_step
from specpool.learning.zoo_weights import build_served_model
from specpool.drafters.zoo import ZooDrafter
from online_helpers import target_records, tiny_zoo_model
from specpool.core.errors import InvalidArgument, NotFound
from specpool.router.loop import FixedChooser, RoundFeedback, speculative_generate
from specpool.target.sampling import SamplingParams

# --- pure math ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights, losses, eta, share, expected",
    [
        ([0.5, 0.5], [1.0, 1.0], 1.0, 0.0, [0.5, 0.5]),  # equal losses: nothing moves
        ([0.5, 0.5], [0.0, 1.0], 1.0, 0.0, [1 / (1 + math.e ** -1), math.e ** -1 / (1 + math.e ** -1)]),
        ([0.5, 0.5], [0.0, 1.0], 0.0, 0.0, [0.5, 0.5]),  # eta 0: no learning
        ([0.2, 0.8], [2.0, 2.0], 3.0, 0.0, [0.2, 0.8]),  # a shared loss is no information
        ([0.25, 0.75], [1.0, 0.0], math.log(3), 0.0, [0.1, 0.9]),  # 0.25/3 : 0.75 = 1 : 9
        ([1.0, 0.0], [0.0, 0.0], 1.0, 0.1, [0.95, 0.05]),  # fixed share revives a dead member
        ([0.5, 0.5], [0.0, 1000.0], 1.0, 0.0, [1.0, 0.0]),  # huge loss: no NaN, no overflow
        ([1 / 3] * 3, [0.0, 1.0, 2.0], 1.0, 0.0,
         [1 / (1 + math.e ** -1 + math.e ** -2), math.e ** -1 / (1 + math.e ** -1 + math.e ** -2),
          math.e ** -2 / (1 + math.e ** -1 + math.e ** -2)]),
    ],
)
def test_hedge_update(weights, losses, eta, share, expected):
    got = hedge_update(torch.tensor(weights), torch.tensor(losses), eta, share)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert abs(float(got.sum()) - 1.0) < 1e-6


@pytest.mark.parametrize(
    "w, g, previous, lr, expected",
    [
        (1.0, 2.0, None, 0.1, 0.8),  # no hint yet: a plain OGD step
        (1.0, 2.0, 2.0, 0.1, 0.8),  # hint = this gradient: the same step
        (1.0, 2.0, 1.0, 0.1, 0.7),  # 1 - 0.1 (2*2 - 1)
        (0.0, 0.0, 1.0, 0.1, 0.1),  # gradient vanished: the hint's overshoot is taken back
        (1.0, -1.0, 0.0, 0.5, 2.0),  # 1 - 0.5 (-2 - 0)
        (3.0, 5.0, -5.0, 0.0, 3.0),  # lr 0: no move
    ],
)
def test_optimistic_step(w, g, previous, lr, expected):
    param = torch.tensor([w])
    optimistic_step([param], [torch.tensor([g])], None if previous is None else [torch.tensor([previous])], lr)
    assert float(param) == pytest.approx(expected)


@pytest.mark.parametrize("w, g, lr, expected", [(1.0, 2.0, 0.1, 0.8), (0.0, -3.0, 1.0, 3.0), (2.0, 5.0, 0.0, 2.0)])
def test_ogd_step(w, g, lr, expected):
    param = torch.tensor([w])
    ogd_step([param], [torch.tensor([g])], lr)
    assert float(param) == pytest.approx(expected)


@pytest.mark.parametrize(
    "grads, max_norm, expected",
    [
        ([[3.0], [4.0]], 10.0, [[3.0], [4.0]]),  # norm 5 <= 10: unchanged
        ([[3.0], [4.0]], 1.0, [[0.6], [0.8]]),  # scaled to norm 1
        ([[float("nan")], [4.0]], 1.0, [[0.0], [1.0]]),  # non-finite entries dropped first
    ],
)
def test_clip_grads(grads, max_norm, expected):
    got = clip_grads([torch.tensor(g) for g in grads], max_norm)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, torch.tensor(b))


@pytest.mark.parametrize(
    "p_ids, p, q, expected",
    [
        ([0, 1], [0.5, 0.5], [0.5, 0.5, 0.0], 0.0),  # same distribution
        ([0], [1.0], [0.0, 1.0, 0.0], 1.0),  # disjoint
        ([0, 1], [0.6, 0.4], [0.3, 0.3, 0.4], 0.4),  # 1/2 (0.3 + 0.1 + |0 - 0.4|)
        ([2, -1], [0.5, 0.3], [0.0, 0.0, 1.0], 0.5),  # p's second token outside q's vocabulary
        ([0], [0.7], [0.7, 0.3, 0.0], 0.0),  # p's unknown 0.3 may sit where q's rest is
    ],
)
def test_sparse_tv(p_ids, p, q, expected):
    got = sparse_tv(torch.tensor([p_ids]), torch.tensor([p]), torch.tensor([q]))
    assert float(got[0]) == pytest.approx(expected, abs=1e-6)


def test_online_config_validation():
    OnlineConfig().validate()
    for bad in (OnlineConfig(algorithm="adam"), OnlineConfig(lr=-1.0), OnlineConfig(hedge_member="hedge"),
                OnlineConfig(algorithm="hedge", hedge_lrs=()), OnlineConfig(clip_norm=0.0),
                OnlineConfig(hedge_share=1.0), OnlineConfig(lr=float("nan")), OnlineConfig(grow_vocab=-1),
                OnlineConfig(grow_min_mass=0.0), OnlineConfig(grow_bias_quantile=1.5),
                OnlineConfig(supervision="hard"), OnlineConfig(trainable_blocks=-1)):
        with pytest.raises(InvalidArgument):
            bad.validate()


# --- feedback records ---------------------------------------------------------------------------


def a_record(**overrides) -> FeedbackRecord:
    fields = dict(record_id="r1", tenant="acme", session="s-1", drafter="zoo:/x/y", version=3,
                  context=(1, 5, 7), draft=(9, 10), accepted=1,
                  target_ids=((9, 4), (11, 10), (2, 3)), target_probs=((0.7, 0.2), (0.5, 0.4), (1.0, 0.0)), created=12.5)
    fields.update(overrides)
    return FeedbackRecord(**fields)


def test_record_round_trip():
    record = a_record()
    assert FeedbackRecord.decode(record.encode()) == record
    assert FeedbackRecord.decode(record.encode(), vocab_size=12) == record
    assert record.positions == 3


def _payload(**changes) -> bytes:
    data = json.loads(a_record().encode())
    data.update(changes)
    return json.dumps(data).encode()


BAD_RECORDS = [
    (b"\x00\xff garbage", "malformed"),
    (b"[1, 2, 3]", "malformed"),
    (b"[" * 100_000 + b"]" * 100_000, "oversized"),
    (b"[" * 5000 + b"]" * 5000, "malformed"),  # deep nesting
    (b"x" * 70_000, "oversized"),
    (_payload(f=2), "malformed"),
    (_payload(id=""), "malformed"),
    (_payload(id="a b"), "malformed"),
    (_payload(tenant="*"), "malformed"),
    (_payload(session=None), "malformed"),
    (_payload(drafter="x" * 600), "malformed"),
    (_payload(version=-1), "out_of_range"),
    (_payload(version=True), "malformed"),
    (_payload(context=[]), "malformed"),
    (_payload(context=[1, "2"]), "malformed"),
    (_payload(context=[1, -2]), "out_of_range"),
    (_payload(context=[1, 2.0]), "malformed"),
    (_payload(context=list(range(300))), "oversized"),
    (_payload(draft=[True, 1]), "malformed"),
    (_payload(accepted=3), "out_of_range"),
    (_payload(p_ids=[[9, 4], [11, 10]]), "malformed"),  # k rows instead of k+1
    (_payload(p=[[0.7], [0.5, 0.4], [1.0, 0.0]]), "malformed"),
    (_payload(p=[[0.7, 0.2], [0.5, 0.6], [1.0, 0.0]]), "out_of_range"),  # sums to 1.1
    (_payload(p=[[0.7, 1.5], [0.5, 0.4], [1.0, 0.0]]), "out_of_range"),
    (b'{"f":1,"id":"r","tenant":"a","session":"s","drafter":"d","version":0,"context":[1],"draft":[2],'
     b'"accepted":0,"p_ids":[[1],[2]],"p":[[NaN],[0.1]]}', "out_of_range"),
    (_payload(p_ids=[[9, 9], [11, 10], [2, 3]]), "malformed"),
    (_payload(p_ids=[list(range(70)), [11, 10], [2, 3]]), "oversized"),
    (_payload(t="yesterday"), "malformed"),
    (b'{"f": 1}', "malformed"),
]


@pytest.mark.parametrize("payload, reason", BAD_RECORDS, ids=range(len(BAD_RECORDS)))
def test_bad_records_are_rejected_with_a_reason(payload, reason):
    with pytest.raises(BadFeedback) as info:
        FeedbackRecord.decode(payload, FeedbackLimits())
    assert info.value.reason == reason


def test_token_ids_beyond_the_vocabulary_are_out_of_range():
    with pytest.raises(BadFeedback) as info:
        FeedbackRecord.decode(a_record().encode(), vocab_size=10)
    assert info.value.reason == "out_of_range"


def test_record_from_a_real_round_is_bounded(verifier, noisy_lm, prompts):
    """The loop's feedback hook + the target's top-K give records of k+1 rows, K entries each,
    the context cut to its tail; the output is the same as without feedback."""
    from specpool.drafters.hf_model import HFModelDrafter

    drafters = {"noisy": HFModelDrafter("noisy", *noisy_lm)}
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    rounds: list[RoundFeedback] = []
    stream = InProcessFeedbackStream(capacity=100)
    emitter = FeedbackEmitter(stream, context_tail=8)

    def sink(fb: RoundFeedback) -> None:
        rounds.append(fb)
        emitter(fb, "acme", 0)

    plain = speculative_generate(prompts[0], session_id="fb-plain", drafters=drafters, chooser=FixedChooser("noisy"),
                                 verifier=verifier, params=params, k=4)
    with_feedback = speculative_generate(prompts[0], session_id="fb", drafters=drafters, chooser=FixedChooser("noisy"),
                                         verifier=verifier, params=params, k=4, feedback=sink, return_top_k=5)
    assert with_feedback.token_ids == plain.token_ids
    assert rounds and len(rounds) == sum(1 for r in with_feedback.rounds if r.proposed > 0)
    assert emitter.emitted == len(rounds) and emitter.errors == 0
    for fb, delivery in zip(rounds, stream.read("c", 100)):
        record = FeedbackRecord.decode(delivery.payload, vocab_size=64)
        assert record.context == tuple(fb.context_ids[-8:]) and len(record.context) == 8
        assert record.draft == tuple(fb.proposal.tokens) and record.accepted == fb.result.accepted
        assert len(record.target_ids) == len(record.draft) + 1 and all(len(r) == 5 for r in record.target_ids)
        # Row j's top token is the target's greedy choice after context + draft[:j].
        assert record.target_ids[record.accepted][0] == fb.result.tokens[record.accepted]
    # Without the target's top-K there is nothing to learn from: skipped, never an error.
    assert record_from_round(dataclasses.replace(rounds[0], result=plain_result(rounds[0])), "a", 0) is None


def session_records(verifier, noisy_lm, prompt, context_tail: int, session: str = "m") -> tuple[list[FeedbackRecord], list[int]]:
    """The feedback records of one greedy request with the noisy drafter (which gets rejected),
    and the request's whole token sequence."""
    from specpool.drafters.hf_model import HFModelDrafter

    stream = InProcessFeedbackStream(capacity=1000)
    emitter = FeedbackEmitter(stream, context_tail=context_tail)
    result = speculative_generate(prompt, session_id=session, drafters={"noisy": HFModelDrafter("noisy", *noisy_lm)},
                                  chooser=FixedChooser("noisy"), verifier=verifier,
                                  params=SamplingParams(temperature=0.0, max_new_tokens=24), k=4,
                                  feedback=lambda fb: emitter(fb, "acme", 0), return_top_k=5)
    records = [FeedbackRecord.decode(d.payload) for d in stream.read("c", 1000)]
    return records, list(prompt) + list(result.token_ids)


def test_records_carry_their_position_in_the_session(verifier, noisy_lm, prompts):
    records, sequence = session_records(verifier, noisy_lm, prompts[0], context_tail=8)
    assert records and all(r.position is not None for r in records)
    for r in records:  # the context is the tail of the session's tokens before the draft
        assert r.context == tuple(sequence[r.position - len(r.context): r.position])
        assert r.draft[: r.accepted] == tuple(sequence[r.position: r.position + r.accepted])
    assert FeedbackRecord.decode(a_record(position=40).encode()).position == 40
    with pytest.raises(BadFeedback) as error:  # a position inside the context tail cannot be
        FeedbackRecord.decode(a_record(position=2).encode())
    assert error.value.reason == "out_of_range"


def test_merged_records_are_one_sequence_with_the_same_rows_on_the_path(verifier, noisy_lm, prompts, zoo_base):
    """One session's records merged: one sequence (the session's tokens and the last draft); each
    record keeps its rows up to the target's correction (j <= accepted), the last one all its
    rows; the drafter's logits at the kept rows are those of the records fitted one by one
    (whole contexts here, so every row sees the same prefix either way)."""
    from specpool.learning.batches import batch_sequences

    records, sequence = session_records(verifier, noisy_lm, prompts[1], context_tail=256)
    assert len(records) >= 3 and any(r.accepted < len(r.draft) for r in records[:-1])
    [(tokens, rows)] = batch_sequences(records, merge=True)
    last = records[-1]
    assert tokens == sequence[: last.position] + list(last.draft)
    kept: dict[int, list[int]] = {}
    for t, i, j in rows:
        kept.setdefault(i, []).append(j)
        assert t == records[i].position - 1 + j
    for i, r in enumerate(records):
        assert kept[i] == list(range(len(r.target_ids) if r is last else r.accepted + 1))
    vocab_map = vocab_map_for(zoo_base)
    merged, single = make_batch(records, vocab_map, merge=True), make_batch(records, vocab_map)
    assert merged.inputs.shape[0] == 1 and single.inputs.shape[0] == len(records)
    merged_logits = zoo_base.logits_at(merged.inputs, merged.mask)
    single_logits = zoo_base.logits_at(single.inputs, single.mask)
    index = {}  # (record, row) -> its row in single_logits
    for i, r in enumerate(records):
        for j in range(len(r.target_ids)):
            if bool(single.mask[i, len(r.context) - 1 + j]):
                index[(i, j)] = len(index)
    picked = [index[(i, j)] for t, i, j in sorted(rows) if bool(merged.mask[0, t])]
    assert len(picked) == int(merged.mask.sum()) > 0
    assert torch.allclose(merged_logits, single_logits[picked], atol=1e-4)
    assert torch.equal(merged.ids[merged.mask], single.ids[single.mask][picked])


def test_only_records_that_line_up_are_merged(verifier, noisy_lm, prompts):
    from specpool.learning.batches import batch_sequences

    records, _ = session_records(verifier, noisy_lm, prompts[2], context_tail=8)
    other, _ = session_records(verifier, noisy_lm, prompts[3], context_tail=8, session="n")
    assert len(batch_sequences(records, merge=True)) == 1  # tails of 8 still overlap (a round moves <= k + 1)
    assert len(batch_sequences(records + other, merge=True)) == 2  # one per session
    assert len(batch_sequences(records, merge=False)) == len(records)
    unplaced = [dataclasses.replace(r, position=None) for r in records]
    assert len(batch_sequences(unplaced, merge=True)) == len(records)  # no position: on its own
    gap = [r for i, r in enumerate(records) if i != 1]  # a record missing (held out): still lined up
    assert len(batch_sequences(gap, merge=True)) == 1
    moved = dataclasses.replace(records[1], context=(records[1].context[0] + 1,) + records[1].context[1:])
    assert len(batch_sequences([records[0], moved], merge=True)) == 2  # tokens disagree: two sequences


def plain_result(fb: RoundFeedback):
    from specpool.target.verifier import VerifyResult

    return VerifyResult(fb.result.accepted, fb.result.tokens, fb.result.tv)


def test_emitter_never_raises():
    class Broken:
        def emit(self, payload):
            raise OSError("disk full")

    emitter = FeedbackEmitter(Broken())
    emitter(object(), "a", 0)  # not even a round
    assert emitter.errors == 1


# --- the in-process stream ----------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stream_read_ack_and_redelivery():
    clock = FakeClock()
    stream = InProcessFeedbackStream(capacity=10, clock=clock)
    for i in range(5):
        stream.emit(f"p{i}".encode())
    first = stream.read("a", 3)
    assert [d.payload for d in first] == [b"p0", b"p1", b"p2"] and all(d.deliveries == 1 for d in first)
    assert stream.pending() == 3 and stream.backlog() == 2
    assert stream.ack([first[0].entry_id, "nope"]) == 1
    assert [d.payload for d in stream.read("a", 10)] == [b"p3", b"p4"]  # pending ones are not read again
    assert stream.read("a", 10) == []
    assert stream.claim_stale("b", min_idle_s=5.0) == ("0-0", [])  # not idle long enough
    clock.now = 10.0
    cursor, again = stream.claim_stale("b", min_idle_s=5.0, count=3)
    assert [d.payload for d in again] == [b"p1", b"p2", b"p3"] and all(d.deliveries == 2 for d in again)
    # The cursor goes on where the scan stopped (p4); claimed ones are not handed out twice.
    cursor, rest = stream.claim_stale("c", min_idle_s=0.0, count=3, start=cursor)
    assert [d.payload for d in rest] == [b"p4"] and cursor == "0-0"
    stream.ack([d.entry_id for d in again])
    clock.now = 20.0
    assert [d.payload for d in stream.claim_stale("b", min_idle_s=5.0)[1]] == [b"p4"]
    stream.ack([rest[0].entry_id])
    assert stream.pending() == 0


def test_stream_drops_the_oldest_when_full_and_never_blocks():
    stream = InProcessFeedbackStream(capacity=3)
    for i in range(7):
        stream.emit(str(i).encode())
    assert stream.dropped == 4 and stream.emitted == 7
    assert [d.payload for d in stream.read("a", 10)] == [b"4", b"5", b"6"]
    with pytest.raises(InvalidArgument):
        InProcessFeedbackStream(capacity=0)


# --- the model store ----------------------------------------------------------------------------


def test_directory_store_versions(tmp_path):
    store = DirectoryModelStore(tmp_path / "store", keep_versions=2)
    key = VariantKey("acme", "zoo:/some/path with spaces/chat")
    assert store.serving(key) is None and store.versions(key) == [] and store.load_state(key) is None
    v1 = store.publish(key, {"w": torch.ones(2)}, {"note": "a"})
    v2 = store.publish(key, {"w": torch.full((2,), 2.0)}, {})
    assert (v1, v2) == (1, 2) and store.serving(key) is None  # published is not served
    store.promote(key, v1)
    assert store.serving(key) == 1
    tensors, meta = store.load(key, 1)
    assert torch.equal(tensors["w"], torch.ones(2)) and meta["note"] == "a" and meta["version"] == 1
    v3 = store.publish(key, {"w": torch.zeros(2)}, {})
    v4 = store.publish(key, {"w": torch.zeros(2)}, {})
    # Only the newest two are kept, and the serving one whatever its age.
    assert store.versions(key) == [1, v3, v4]
    store.mark_rolled_back(key, v4, "BD dropped")
    folder = tmp_path / "store" / "acme" / key.folder()
    assert (folder / f"v{v4:06d}" / "ROLLED_BACK").read_text().startswith("BD dropped")
    store.save_state(key, {"x": torch.arange(3)})
    assert torch.equal(store.load_state(key)["x"], torch.arange(3))
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporaries left
    with pytest.raises(NotFound):
        store.promote(key, 99)
    with pytest.raises(NotFound):
        store.load(key, 2)  # pruned
    # Scopes are separate folders; the shared pool has its own.
    other = VariantKey(SHARED_SCOPE, key.drafter)
    assert store.serving(other) is None and os.sep not in key.folder()


def test_open_model_store(tmp_path):
    assert isinstance(open_model_store(tmp_path), DirectoryModelStore)
    assert open_model_store(f"file://{tmp_path}").root == tmp_path
    with pytest.raises(NotFound, match="s3://"):
        open_model_store("s3://bucket/x")
    made = []
    assert open_model_store("mem://x", schemes={"mem": lambda uri: made.append(uri) or "store"}) == "store"
    assert made == ["mem://x"]
    with pytest.raises(InvalidArgument):
        VariantKey("bad tenant", "d")


# --- the algorithms on a repeated feedback stream from the tiny target ---------------------------


@pytest.fixture(scope="module")
def zoo_base(model_dirs):
    return tiny_zoo_model(model_dirs.target)


@pytest.fixture(scope="module")
def stream_records(target_lm, prompts):
    return target_records(target_lm[0], prompts[:12], k=4, per_prompt=2)


ALGORITHM_CASES = {
    "ogd": OnlineConfig(algorithm="ogd", lr=0.05),
    "optimistic": OnlineConfig(algorithm="optimistic", lr=0.05),
    "hedge": OnlineConfig(algorithm="hedge", hedge_lrs=(0.01, 0.05, 0.1)),
    "hedge-optimistic": OnlineConfig(algorithm="hedge", hedge_lrs=(0.01, 0.05), hedge_member="optimistic"),
}


@pytest.mark.parametrize("name", ALGORITHM_CASES)
def test_algorithms_lower_the_distillation_loss(name, zoo_base, stream_records):
    learner = OnlineDrafterLearner(zoo_base, ALGORITHM_CASES[name])
    everything = make_batch(stream_records, learner.vocab_map)
    before = learner.loss(everything)
    served_before = evaluate(zoo_base, stream_records)
    for _ in range(3):  # the same stream, three times
        for record in stream_records:
            learner.step(make_batch([record], learner.vocab_map))
    after = learner.loss(everything)
    assert after < before - 0.3, (before, after)
    tensors, metadata = learner.serving_tensors()
    served = build_served_model(zoo_base, tensors, metadata)
    served_after = evaluate(served, stream_records)
    assert served_after.loss == pytest.approx(after, rel=1e-4)  # what is served is what was trained
    assert served_after.bd_soft > served_before.bd_soft + 0.03
    assert served_after.agreement > served_before.agreement
    # The base network is untouched: learning trains copies.
    assert evaluate(zoo_base, stream_records).loss == pytest.approx(served_before.loss)


@pytest.mark.parametrize("trainable_blocks, trained", [(None, {0, 1}), (2, {0, 1}), (5, {0, 1}), (1, {1}), (0, set())])
def test_only_the_last_trainable_blocks_learn(trainable_blocks, trained, zoo_base, stream_records):
    """trainable_blocks n: the lower blocks stay the shipped ones; the last n, the output bias
    and the final norm move; the loss still falls; checkpoints refuse a learner trained otherwise."""
    config = OnlineConfig(algorithm="ogd", lr=0.05, trainable_blocks=trainable_blocks)
    learner = OnlineDrafterLearner(zoo_base, config)
    everything = make_batch(stream_records, learner.vocab_map)
    before = learner.loss(everything)
    for record in stream_records:
        learner.step(make_batch([record], learner.vocab_map))
    assert learner.loss(everything) < before - 0.05
    member = learner.members[0]
    for i, (block, shipped) in enumerate(zip(member.blocks, zoo_base.blocks)):
        moved = any(not torch.equal(a, b) for a, b in zip(block.state_dict().values(), shipped.state_dict().values()))
        assert moved == (i in trained), (i, trainable_blocks)
    assert not torch.equal(member.head_bias, zoo_base.head_bias)
    assert not torch.equal(member.norm.weight, zoo_base.norm.weight)
    # The optimiser state holds the trained parameters only: one AdaGrad sum each.
    assert len(learner.accumulated[0]) == sum(p.requires_grad for p in member.parameters())
    # A checkpoint goes on only under the same setting.
    from specpool.learning.learner_checkpoint import checkpoint_conflict

    state = {"learner": learner.state_dict()}
    key = VariantKey("t", "chat")
    assert checkpoint_conflict(config, state, key, "here") is None
    other = 1 if trainable_blocks == 0 else 0
    conflict = checkpoint_conflict(dataclasses.replace(config, trainable_blocks=other), state, key, "here")
    assert conflict is not None and "block" in conflict


def test_argmax_batch_keeps_each_rows_most_likely_token():
    """Hard labels: one entry per row, the target's most likely token (wherever it sits in the
    row), p = 1; a row whose most likely token is outside the vocabulary is not supervised."""
    vocab_map = torch.full((20,), -1, dtype=torch.long)
    vocab_map[torch.tensor([2, 3, 4, 9, 10, 11])] = torch.arange(6)
    record = a_record(context=(1, 5, 7), draft=(9, 10), target_ids=((4, 9), (11, 10), (12, 3)),
                      target_probs=((0.2, 0.7), (0.5, 0.4), (0.6, 0.3)))
    soft, hard = make_batch([record], vocab_map), make_batch([record], vocab_map, argmax=True)
    assert soft.ids.shape[-1] == 2 and hard.ids.shape[-1] == 1
    assert hard.ids[0, 2:5, 0].tolist() == [vocab_map[9], vocab_map[11], -1]
    assert hard.probs[0, 2:4, 0].tolist() == [1.0, 1.0]
    assert hard.mask[0].tolist() == [False, False, True, True, False]
    assert soft.mask[0].tolist() == [False, False, True, True, True]


def test_argmax_supervision_teaches_the_targets_argmax(zoo_base, stream_records):
    """Fit to the target's most likely token, the drafter agrees with it more often, and its
    greedy BD (p of its argmax) rises."""
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="ogd", lr=0.05, supervision="argmax"))
    before = evaluate(zoo_base, stream_records)
    hard = learner.batch(stream_records)
    assert hard.ids.shape[-1] == 1
    loss_before = learner.loss(hard)
    for _ in range(3):
        for record in stream_records:
            learner.step(learner.batch([record]))
    assert learner.loss(hard) < loss_before - 0.3
    after = evaluate(learner.members[0], stream_records)
    assert after.agreement > before.agreement and after.bd_greedy > before.bd_greedy


def test_hedge_moves_weight_to_the_member_with_lower_loss(zoo_base, stream_records):
    """A member that never learns (lr 0) keeps the initial loss; the learning one's drops, and
    Hedge moves the weight there; the served mixture follows."""
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="hedge", hedge_lrs=(0.0, 0.05), hedge_share=0.0))
    weights = [float(learner.weights[1])]
    for record in stream_records * 2:
        report = learner.step(make_batch([record], learner.vocab_map))
        weights.append(float(learner.weights[1]))
    assert report.member_losses[1] < report.member_losses[0]
    assert weights[0] == 0.5 and weights[-1] > 0.95
    assert sum(b >= a - 1e-9 for a, b in zip(weights, weights[1:])) > 0.8 * (len(weights) - 1)


@pytest.mark.parametrize("weights, minimum, expected", [
    ([0.97, 0.02, 0.01], 0.05, [1.0, 0.0, 0.0]),
    ([0.6, 0.38, 0.02], 0.05, [0.6 / 0.98, 0.38 / 0.98, 0.0]),
    ([0.3, 0.3, 0.4], 0.5, [0.0, 0.0, 1.0]),  # the heaviest stays even below the minimum
    ([0.97, 0.02, 0.01], 0.0, [0.97, 0.02, 0.01]),
])
def test_served_weights(weights, minimum, expected):
    from specpool.learning.ensemble import served_weights

    assert served_weights(torch.tensor(weights), minimum).tolist() == pytest.approx(expected)


@pytest.mark.parametrize("weights, served_members", [([0.97, 0.02, 0.01], 1), ([0.6, 0.38, 0.02], 2), ([0.4, 0.3, 0.3], 3)])
def test_a_hedge_version_serves_only_its_weighty_members(weights, served_members, zoo_base, stream_records):
    """Members under hedge_serve_min are not built into the served network (one left: a plain
    ZooLM); the learner's own served loss is that network's; the version still restores every
    member and the full Hedge weights."""
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="hedge", hedge_lrs=(0.01, 0.05, 0.1)))
    for record in stream_records[:6]:
        learner.step(make_batch([record], learner.vocab_map))
    learner.weights = torch.tensor(weights)
    tensors, metadata = learner.serving_tensors()
    served = build_served_model(zoo_base, tensors, metadata)
    assert len(metadata["served_members"]) == served_members
    assert isinstance(served, ZooEnsembleLM) == (served_members > 1)
    if served_members > 1:
        assert len(served.members) == served_members
    everything = make_batch(stream_records, learner.vocab_map)
    assert evaluate(served, stream_records).loss == pytest.approx(learner.loss(everything), rel=1e-4)
    restored = OnlineDrafterLearner(zoo_base, learner.config)
    restored.load_serving_tensors(tensors)
    assert restored.weights.tolist() == pytest.approx(weights) and len(restored.members) == 3


def test_ensemble_network_is_the_mixture_and_its_cache_is_exact(zoo_base, stream_records):
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="hedge", hedge_lrs=(0.02, 0.1)))
    for record in stream_records[:6]:
        learner.step(make_batch([record], learner.vocab_map))
    tensors, metadata = learner.serving_tensors()
    model = build_served_model(zoo_base, tensors, metadata)
    assert isinstance(model, ZooEnsembleLM)
    ids = torch.tensor([list(stream_records[0].context)])
    with torch.inference_mode():
        mix = torch.softmax(model(ids, use_cache=False).logits, -1)  # (1, T, V_r)
        expected = sum(float(w) * torch.softmax(m(ids, use_cache=False).logits, -1)
                       for w, m in zip(learner.weights, learner.members))
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache=cache).logits[0]]
        steps += [model(ids[:, t:t + 1], cache=cache).logits[0] for t in range(5, 8)]
        cache.crop(-2)
        length = cache.get_seq_length()
        full = model(ids[:, :8], use_cache=False).logits[0]
    torch.testing.assert_close(mix, expected, rtol=1e-4, atol=1e-5)
    assert length == 6
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-4, atol=1e-4)


def test_ensemble_drafter_is_lossless(zoo_base, stream_records, verifier, prompts, greedy_reference, target_lm):
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="hedge", hedge_lrs=(0.02, 0.1)))
    for record in stream_records:
        learner.step(make_batch([record], learner.vocab_map))
    tensors, metadata = learner.serving_tensors()
    drafter = ZooDrafter("ens", build_served_model(zoo_base, tensors, metadata), {"target_tokenizer_fingerprint": "x"})
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    for n, prompt in enumerate(prompts[:3]):
        result = speculative_generate(prompt, session_id=f"ens{n}", drafters={"ens": drafter}, chooser=FixedChooser("ens"),
                                      verifier=verifier, params=params, k=4)
        assert result.token_ids == greedy_reference(target_lm[0], prompt, 16)
        drafter.release(f"ens{n}")


@pytest.mark.parametrize(
    "grads, accumulated, expected, expected_g",
    [
        ([2.0], None, [1.0], [4.0]),  # first step: g / |g| = sign
        ([3.0], [16.0], [0.6], [25.0]),  # 3 / sqrt(16 + 9)
        ([0.0], [4.0], [0.0], [4.0]),  # no gradient: no move, G unchanged
        ([-1.0], [0.0], [-1.0], [1.0]),
    ],
)
def test_adagrad_scale(grads, accumulated, expected, expected_g):
    from specpool.learning.online_updates import adagrad_scale

    scaled, new = adagrad_scale([torch.tensor(grads)], None if accumulated is None else [torch.tensor(accumulated)], eps=0.0)
    torch.testing.assert_close(scaled[0], torch.tensor(expected))
    torch.testing.assert_close(new[0], torch.tensor(expected_g))


def test_adagrad_preconditioned_learning_lowers_the_loss(zoo_base, stream_records):
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="optimistic", lr=0.003, precondition="adagrad"))
    everything = make_batch(stream_records, learner.vocab_map)
    before = learner.loss(everything)
    for record in stream_records * 2:
        learner.step(make_batch([record], learner.vocab_map))
    assert learner.loss(everything) < before - 0.3
    restored = OnlineDrafterLearner(zoo_base, learner.config)
    restored.load_state_dict(learner.state_dict())  # G travels with the checkpoint
    assert all(torch.equal(a, b) for a, b in zip(restored.accumulated[0], learner.accumulated[0]))


@pytest.mark.parametrize(
    "candidate, serving, z, drop, z_min, regressed",
    [
        (0.30, 0.40, -5.0, 0.02, 2.0, True),  # worse, clearly
        (0.30, 0.40, -1.0, 0.02, 2.0, False),  # worse, but within the noise of the held-out set
        (0.39, 0.40, -9.0, 0.02, 2.0, False),  # significant, but smaller than the allowed drop
        (0.45, 0.40, 5.0, 0.02, 2.0, False),  # better
        (0.30, 0.40, -1.0, 0.02, 0.0, True),  # z_min 0: the drop alone decides
    ],
)
def test_rollback_decision(candidate, serving, z, drop, z_min, regressed):
    from specpool.learning.evaluation import Comparison

    assert Comparison(candidate, serving, z, 100).regressed(drop, z_min) is regressed


def test_compare_versions(zoo_base, stream_records):
    from specpool.learning.evaluation import compare

    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(lr=0.05))
    same = compare(zoo_base, zoo_base, stream_records, "soft")
    assert same.candidate_bd == same.serving_bd and same.z == 0.0 and not same.regressed(0.0, 0.0)
    for record in stream_records:
        learner.step(make_batch([record], learner.vocab_map))
    tensors, metadata = learner.serving_tensors()
    better = compare(build_served_model(zoo_base, tensors, metadata), zoo_base, stream_records, "soft")
    assert better.candidate_bd > better.serving_bd and better.z > 2
    greedy = compare(zoo_base, zoo_base, stream_records, "greedy")
    assert 0.0 <= greedy.serving_bd <= 1.0 and greedy.positions == sum(len(r.draft) for r in stream_records)


# --- online vocabulary growth -------------------------------------------------------------------


def _outside_mass(records, vocab_map) -> dict[int, float]:
    """The target's p per token outside the vocabulary, summed over ``records`` (by hand)."""
    mass: dict[int, float] = {}
    for r in records:
        for ids, probs in zip(r.target_ids, r.target_probs):
            for i, p in zip(ids, probs):
                if vocab_map[i] < 0:
                    mass[i] = mass.get(i, 0.0) + p
    return mass


def test_vocabulary_grows_by_the_targets_mass_outside_it(zoo_base, stream_records):
    config = OnlineConfig(lr=0.003, grow_vocab=3, grow_min_mass=0.2)
    learner = OnlineDrafterLearner(zoo_base, config)
    shipped = learner.vocab_map.clone()
    first = stream_records[:4]
    mass = _outside_mass(first, shipped)
    expected = sorted((i for i, m in mass.items() if m >= 0.2), key=lambda i: -mass[i])[:3]
    assert expected, "the tiny target must put some mass outside the 48-token vocabulary"
    added = learner.observe(first)
    assert sorted(added.tolist()) == sorted(expected)
    assert learner.grown == len(expected)
    vocab = learner.members[0].vocab_ids.tolist()
    assert vocab[:48] == zoo_base.vocab_ids.tolist() and vocab[48:] == added.tolist()
    assert all(int(learner.vocab_map[i]) == vocab.index(i) for i in added.tolist())
    # The head rows of new tokens are the frozen embedding's; only the bias is new.
    member = learner.members[0]
    torch.testing.assert_close(member.head_weight()[48:], zoo_base.embedding[added])
    assert member.head_bias.shape == (48 + len(expected),) and member.head_bias.requires_grad
    # The budget holds, whatever later records bring; the shipped network is untouched.
    for record in stream_records:
        learner.step(learner.batch([record]))
    assert learner.grown <= 3 and len(zoo_base.vocab_ids) == 48 and zoo_base.head_bias.shape == (48,)


def test_step_sizes_carry_over_to_a_learner_on_a_prefix_of_the_vocabulary(zoo_base, stream_records):
    grown = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="optimistic", lr=0.003, grow_vocab=3, grow_min_mass=0.2))
    for record in stream_records[:6]:
        grown.step(grown.batch([record]))
    assert grown.grown > 0 and grown.accumulated[0] is not None
    fresh = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="optimistic", lr=0.003))
    assert fresh.adopt_step_sizes(grown)
    names = [n for n, p in fresh.members[0].named_parameters() if p.requires_grad]
    for name, kept, summed in zip(names, fresh.accumulated[0], grown.accumulated[0]):
        assert kept.shape == dict(fresh.members[0].named_parameters())[name].shape
        assert torch.equal(kept, summed[: kept.shape[0]]), name
    assert fresh.previous == [None]  # hints are not step sizes: they stay behind
    # A vocabulary that is not a prefix, or another ensemble size, does not fit: nothing changes.
    sums = [g.clone() for g in grown.accumulated[0]]
    assert not grown.adopt_step_sizes(fresh)  # fresh's vocabulary is shorter than grown's
    assert all(torch.equal(a, b) for a, b in zip(grown.accumulated[0], sums))
    other = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="hedge", hedge_lrs=(0.001, 0.003)))
    assert not other.adopt_step_sizes(grown) and other.accumulated == [None, None]


def test_fixed_vocabulary_never_grows(zoo_base, stream_records):
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(lr=0.003, grow_vocab=0))
    for record in stream_records:
        learner.step(learner.batch([record]))
    assert learner.grown == 0 and torch.equal(learner.members[0].vocab_ids, zoo_base.vocab_ids)


@pytest.mark.parametrize("algorithm", ["optimistic", "hedge"])
def test_grown_vocabulary_learns_serves_and_stays_lossless(algorithm, zoo_base, stream_records, verifier, prompts,
                                                           greedy_reference, target_lm):
    config = OnlineConfig(algorithm=algorithm, lr=0.003, hedge_lrs=(0.001, 0.003), grow_vocab=16, grow_min_mass=0.3)
    learner = OnlineDrafterLearner(zoo_base, config)
    everything_before = evaluate(zoo_base, stream_records)
    for _ in range(2):
        for record in stream_records:
            learner.step(learner.batch([record]))  # AdaGrad sums and hints grow with the vocabulary
    assert learner.grown > 0
    tensors, metadata = learner.serving_tensors()
    assert metadata["vocab_grown"] == learner.grown and len(tensors["vocab_ids"]) == 48 + learner.grown
    served = build_served_model(zoo_base, tensors, metadata)
    assert torch.equal(served.vocab_ids, learner.members[0].vocab_ids)
    # Versions with different vocabularies compare on the same positions.
    from specpool.learning.evaluation import compare

    comparison = compare(served, zoo_base, stream_records, "soft")
    assert comparison.positions == everything_before.positions
    assert comparison.candidate_bd > comparison.serving_bd
    drafter = ZooDrafter("grown", served, {"target_tokenizer_fingerprint": "x"})
    assert drafter.output_ids.tolist()[48:] == learner.members[0].vocab_ids.tolist()[48:]  # it can propose them
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    for n, prompt in enumerate(prompts[:3]):
        result = speculative_generate(prompt, session_id=f"grown{n}", drafters={"grown": drafter},
                                      chooser=FixedChooser("grown"), verifier=verifier, params=params, k=4)
        assert result.token_ids == greedy_reference(target_lm[0], prompt, 16)
        drafter.release(f"grown{n}")


def test_grown_vocabulary_travels_with_checkpoints_and_versions(zoo_base, stream_records):
    config = OnlineConfig(algorithm="optimistic", lr=0.003, grow_vocab=16, grow_min_mass=0.3)
    learner = OnlineDrafterLearner(zoo_base, config)
    for record in stream_records[:12]:
        learner.step(learner.batch([record]))
    assert learner.grown > 0
    restored = OnlineDrafterLearner(zoo_base, config)
    restored.load_state_dict(learner.state_dict())
    assert torch.equal(restored.vocab_map, learner.vocab_map)
    assert torch.equal(restored.outside_mass, learner.outside_mass)
    # The next records have exactly the same effect on both (weights, AdaGrad sums, hints, growth).
    for record in stream_records[12:]:
        learner.step(learner.batch([record]))
        restored.step(restored.batch([record]))
    for a, b in zip(learner.members[0].parameters(), restored.members[0].parameters()):
        assert torch.equal(a, b)
    assert torch.equal(restored.members[0].vocab_ids, learner.members[0].vocab_ids)
    # A published version's weights load into a fresh learner (what a rollback returns to).
    tensors, _ = learner.serving_tensors()
    fresh = OnlineDrafterLearner(zoo_base, config)
    fresh.load_serving_tensors(tensors)
    assert torch.equal(fresh.members[0].vocab_ids, learner.members[0].vocab_ids)
    assert torch.equal(fresh.members[0].head_bias, learner.members[0].head_bias)
    # A vocabulary that does not extend the drafter's is refused.
    bad = dict(tensors, vocab_ids=tensors["vocab_ids"].flip(0))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        OnlineDrafterLearner(zoo_base, config).load_serving_tensors(bad)


def test_record_bd_splits_the_comparison_by_record(zoo_base, stream_records):
    from specpool.learning.evaluation import compare, paired, record_bd

    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(lr=0.05))
    for record in stream_records[:8]:
        learner.step(learner.batch([record]))
    tensors, metadata = learner.serving_tensors()
    candidate = build_served_model(zoo_base, tensors, metadata)
    for metric in ("greedy", "soft"):
        per_record = record_bd(zoo_base, stream_records, metric)
        assert [len(v) for v in per_record] == [len(r.draft) for r in stream_records]
        # Scored in other batches (as the learner's cache does), a record's scores stay the same.
        halves = record_bd(zoo_base, stream_records[:5], metric) + record_bd(zoo_base, stream_records[5:], metric)
        for a, b in zip(per_record, halves):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        fresh = compare(candidate, zoo_base, stream_records, metric)
        cached = paired(torch.cat(record_bd(candidate, stream_records, metric)), torch.cat(halves))
        assert cached.candidate_bd == pytest.approx(fresh.candidate_bd, abs=1e-6)
        assert cached.serving_bd == pytest.approx(fresh.serving_bd, abs=1e-6)
        assert cached.z == pytest.approx(fresh.z, rel=1e-3, abs=1e-6) and cached.positions == fresh.positions


# --- the copy term ------------------------------------------------------------------------------


def with_copy_weight(base, window: int, logits: float):
    """A copy of ``base`` with a copy term of ``window`` whose weight adds ``logits``."""
    from specpool.learning.zoo_weights import clone_zoo

    model = clone_zoo(base, copy_window=window, copy_scale=10.0)
    with torch.no_grad():
        model.copy_weight.fill_(logits / 10.0)
    return model.eval()


@torch.inference_mode()
def test_copy_term_adds_its_weight_on_the_tokens_of_the_window(zoo_base):
    """Brute force: at position t the term is on every in-vocabulary token among ids (t-W, t],
    and nowhere else; without a learned weight the network is the base network exactly."""
    window = 3
    model = with_copy_weight(zoo_base, window, 2.5)
    ids = torch.tensor([[5, 50, 7, 5, 60, 9, 11, 7, 2, 63, 40]])  # 50, 60, 63 are outside the vocabulary
    base = zoo_base(ids, use_cache=False).logits[0]  # (T, 48)
    got = model(ids, use_cache=False).logits[0]
    expected = base.clone()
    for t in range(ids.shape[1]):
        for token in set(ids[0, max(0, t - window + 1): t + 1].tolist()):
            if token < 48:
                expected[t, token] += 2.5
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    where = torch.zeros_like(ids, dtype=torch.bool)
    where[0, [0, 4, 10]] = True
    torch.testing.assert_close(model.logits_at(ids, where), expected[[0, 4, 10]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_copy_weight(zoo_base, window, 0.0)(ids, use_cache=False).logits[0], base)


@torch.inference_mode()
def test_copy_term_with_the_kv_cache_matches_a_full_forward(zoo_base):
    """The cache keeps the ids its keys came from, so incremental steps, a rollback by crop, a
    block after it, and keeping only the last logits all see the same windows as a full forward."""
    model = with_copy_weight(zoo_base, 4, 3.0)
    ids = torch.randint(3, 64, (1, 16), generator=torch.Generator().manual_seed(2))
    full = model(ids, use_cache=False).logits[0]
    cache = model.new_cache()
    first = model(ids[:, :7], cache=cache, logits_to_keep=1).logits[0]
    steps = [model(ids[:, t:t + 1], cache=cache).logits[0] for t in range(7, 11)]
    cache.crop(-3)
    assert cache.get_seq_length() == 8 and cache.tokens.shape[1] == 8
    block = model(ids[:, 8:16], cache=cache).logits[0]
    torch.testing.assert_close(first, full[6:7], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps), full[7:11], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(block, full[8:16], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [0, 4])
def test_logits_with_a_detached_context_equal_the_full_forward(window, zoo_base):
    """detach_before t: the same logits (the first t positions run as a KV cache), gradients only
    through positions t.. (so none reach a block's weights from the context alone), and marking a
    position before t is refused."""
    model = with_copy_weight(zoo_base, window, 1.5) if window else zoo_base
    torch.manual_seed(1)
    inputs = torch.randint(0, 48, (2, 12))
    where = torch.zeros(2, 12, dtype=torch.bool)
    where[0, 7:10] = where[1, 8:12] = True
    full = model.logits_at(inputs, where)
    for t in (1, 5, 7):
        assert torch.allclose(model.logits_at(inputs, where, detach_before=t), full, atol=1e-5)
    with pytest.raises(ValueError):
        model.logits_at(inputs, where, detach_before=8)
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="ogd", lr=0.05, detach_context=True))
    member = learner.members[0]
    loss = member.logits_at(inputs, where, detach_before=7).logsumexp(-1).sum()
    grads = torch.autograd.grad(loss, [member.blocks[0].q_proj.weight, member.head_bias])
    assert all(g.abs().sum() > 0 for g in grads)


def test_learning_with_a_detached_context_lowers_the_loss(zoo_base, stream_records):
    learner = OnlineDrafterLearner(zoo_base, OnlineConfig(algorithm="ogd", lr=0.05, detach_context=True))
    everything = make_batch(stream_records, learner.vocab_map)
    before = learner.loss(everything)
    for _ in range(2):
        for s in range(0, len(stream_records), 3):
            learner.step(make_batch(stream_records[s:s + 3], learner.vocab_map))
    assert learner.loss(everything) < before - 0.2


def copy_records(n: int, seed: int = 0) -> list[FeedbackRecord]:
    """Records whose target always continues with a token the context holds (a copying target):
    random in-vocabulary contexts, and a draft (and p = 1 rows) of tokens picked from them."""
    generator = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        context = torch.randint(3, 48, (12,), generator=generator).tolist()
        picks = torch.randint(0, 12, (4,), generator=generator).tolist()
        follow = [context[j] for j in picks]
        records.append(a_record(record_id=f"c{i}", context=tuple(context), draft=tuple(follow[:3]), accepted=3,
                                target_ids=tuple((t,) for t in follow), target_probs=((1.0,),) * 4))
    return records


def test_the_online_learner_learns_the_copy_weight(zoo_base):
    """On a copying target the weight grows from 0 and the drafter fits the target better than
    the same learner without the term does (the term narrows the choice to the window's ~12
    tokens, it cannot tell which one: agreement ~1/12 against ~1/45); what is published serves
    the same network."""
    train, held_out = copy_records(40), copy_records(20, seed=1)
    config = OnlineConfig(algorithm="ogd", lr=0.01, supervision="argmax")
    plain, copying = OnlineDrafterLearner(zoo_base, config), OnlineDrafterLearner(zoo_base, dataclasses.replace(config, copy_window=16))
    for record in train:
        plain.step(plain.batch([record]))
        copying.step(copying.batch([record]))
    weight = float(copying.members[0].copy_weight.detach()) * copying.config.copy_scale
    assert weight > 1.0, weight
    with_copy, without = evaluate(copying.members[0], held_out), evaluate(plain.members[0], held_out)
    assert with_copy.loss < without.loss - 1.0 and with_copy.agreement > 3 * without.agreement, (with_copy, without)
    tensors, metadata = copying.serving_tensors()
    assert metadata["copy_window"] == 16 and metadata["copy_weights"] == [pytest.approx(weight, abs=1e-3)]
    served = build_served_model(zoo_base, tensors, metadata)
    assert served.config.copy_window == 16
    assert evaluate(served, held_out).loss == pytest.approx(with_copy.loss, rel=1e-5)
    # Checkpoints carry it; a version without the term loads with weight 0; the reverse is refused.
    restored = OnlineDrafterLearner(zoo_base, copying.config)
    restored.load_state_dict(copying.state_dict())
    assert torch.equal(restored.members[0].copy_weight, copying.members[0].copy_weight)
    restored.load_serving_tensors(plain.serving_tensors()[0])
    assert restored.members[0].copy_weight.tolist() == [0.0]
    with pytest.raises(InvalidArgument, match="copy"):
        OnlineDrafterLearner(zoo_base, config).load_serving_tensors(tensors)


@pytest.mark.parametrize("hedge", [False, True])
def test_a_copying_drafter_is_lossless(hedge, zoo_base, stream_records, verifier, prompts, greedy_reference, target_lm):
    """A large copy weight changes what is proposed, never what is output."""
    config = OnlineConfig(algorithm="hedge" if hedge else "ogd", lr=0.05, hedge_lrs=(0.02, 0.1), copy_window=8, copy_scale=10.0)
    learner = OnlineDrafterLearner(zoo_base, config)
    for record in stream_records[:6]:
        learner.step(learner.batch([record]))
    for member in learner.members:
        with torch.no_grad():
            member.copy_weight.fill_(0.4)  # 4 logits on recent tokens
    tensors, metadata = learner.serving_tensors()
    drafter = ZooDrafter("copy", build_served_model(zoo_base, tensors, metadata), {"target_tokenizer_fingerprint": "x"})
    plain = ZooDrafter("plain", zoo_base, {"target_tokenizer_fingerprint": "x"})
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    differs = 0
    for n, prompt in enumerate(prompts[:3]):
        result = speculative_generate(prompt, session_id=f"copy{n}", drafters={"copy": drafter}, chooser=FixedChooser("copy"),
                                      verifier=verifier, params=params, k=4)
        assert result.token_ids == greedy_reference(target_lm[0], prompt, 16)
        reference = speculative_generate(prompt, session_id=f"plain{n}", drafters={"plain": plain}, chooser=FixedChooser("plain"),
                                         verifier=verifier, params=params, k=4)
        differs += [r.accepted for r in result.rounds] != [r.accepted for r in reference.rounds]
        drafter.release(f"copy{n}")
        plain.release(f"plain{n}")
    assert differs > 0  # the term really changed the drafts
