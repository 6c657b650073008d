"""Online learning of white-box heads (specpool/learning/online_heads.py) on the tiny target: a
white-box round's feedback record carries the target's features (and a black-box round's does
not), round-trips, and malformed or oversized feature payloads are rejected with a reason; the
learner's updates (ogd, optimistic, hedge) lower the head's loss on the records it saw; the
scores it checks versions with are the drafter's own drafts; and through the embedded engine a
learned head is published, hot-swapped between requests and stays lossless (greedy output equal
to target-only), one version per request, as a Hedge mixture too."""

from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specpool.drafters.eagle import EagleDrafter, load_eagle_head
from specpool.drafters.hf_model import HFModelDrafter
from specpool.learning.feedback import (BadFeedback, FeedbackLimits, FeedbackRecord, InProcessFeedbackStream,
                                        record_from_round)
from specpool.learning.hot_swap import drafter_kind, learnable, network_of, version_drafter
from specpool.learning.learner_loop import Learner
from specpool.learning.learning_config import LearningConfig
from specpool.learning.model_store import DirectoryModelStore, VariantKey
from specpool.learning.online import OnlineConfig
from specpool.learning.online_heads import EagleEnsembleHead, OnlineHeadLearner, draft_log_q, head_record_bd
from specpool.router.loop import Choice, RoundFeedback, speculative_generate
from specpool.services.engine import EmbeddedEngine, EngineConfig
from specpool.target.models import ModelConfig
from specpool.target.sampling import SamplingParams
from test_eagle_drafter import final_hidden, fit_head, write_head

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=())
EAGLE = "eagle:tiny"


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target_lm, prompts, model_dirs) -> Path:
    """A head fitted briefly on half the prompts: accepted sometimes on the others, with room to learn."""
    model, tokenizer = target_lm
    head = fit_head(model, model_dirs.target, prompts[:12], steps=60)
    return write_head(tmp_path_factory.mktemp("heads") / "tiny", head, model_dirs.target, tokenizer)


@pytest.fixture(scope="module")
def base_drafter(head_dir, home, model_dirs) -> EagleDrafter:
    head, metadata = load_eagle_head(head_dir, home, str(model_dirs.target))
    return EagleDrafter(EAGLE, head, metadata)


class Alternate:
    """Plays the drafters in turn (a chooser for a mixed pool)."""

    def __init__(self, names: list[str]):
        self.names, self.i = names, 0

    def select(self) -> Choice:
        self.i += 1
        return Choice(self.names[self.i % len(self.names)])

    def update(self, record) -> None:
        pass


def feedback_rounds(verifier, drafters: dict, prompts: list[list[int]], top_k: int = 8) -> list[RoundFeedback]:
    """The feedback of greedy requests over ``prompts`` (each prompt's first half) with ``drafters``
    played in turn; each round's feature rows are copied (the loop's view is valid during the callback only)."""
    rounds: list[RoundFeedback] = []

    def keep(fb: RoundFeedback) -> None:
        features = fb.features
        if features is not None:
            features = replace(features, rows=features.rows.clone())
        rounds.append(replace(fb, features=features))

    for n, ids in enumerate(prompts):
        speculative_generate(ids[: len(ids) // 2], session_id=f"s{n}", drafters=drafters, chooser=Alternate(list(drafters)),
                             verifier=verifier, params=GREEDY, k=4, feedback=keep, return_top_k=top_k)
        verifier.release(f"s{n}")
        for drafter in drafters.values():
            drafter.release(f"s{n}")
    return rounds


@pytest.fixture(scope="module")
def head_records(target_lm, prompts, base_drafter, model_dirs, home) -> list[FeedbackRecord]:
    """Records of real white-box rounds on the prompts the head was not fitted on."""
    from specpool.target.verifier import TargetVerifier

    verifier = TargetVerifier(*target_lm)
    rounds = feedback_rounds(verifier, {EAGLE: base_drafter}, prompts[12:])
    records = [record_from_round(fb, "t1", 0, feature_tail=8) for fb in rounds]
    return [FeedbackRecord.decode(r.encode()) for r in records if r is not None]


# -- records ------------------------------------------------------------------------------------------


def test_white_box_records_carry_the_targets_features_and_black_box_ones_do_not(verifier, target_lm, noisy_lm, prompts,
                                                                                 base_drafter):
    model, _ = target_lm
    drafters = {EAGLE: base_drafter, "noisy": HFModelDrafter("noisy", *noisy_lm)}
    rounds = feedback_rounds(verifier, drafters, prompts[12:16])
    by_drafter = Counter(fb.drafter for fb in rounds)
    assert by_drafter[EAGLE] >= 4 and by_drafter["noisy"] >= 4, by_drafter
    for fb in rounds:
        record = record_from_round(fb, "t1", 0, context_tail=32, feature_tail=6)
        decoded = FeedbackRecord.decode(record.encode())
        assert decoded == record
        if fb.drafter == "noisy":  # a black-box round: the record as before
            assert record.feature_start is None and b'"fx"' not in record.encode()
            continue
        n, a = record.position, record.accepted
        assert record.feature_start == n - 6 and record.feature_width == model.config.hidden_size
        features = decoded.features()
        assert features.start == n - 6 and features.rows.shape == (6 + a, model.config.hidden_size)
        want = final_hidden(model, fb.context_ids + list(fb.proposal.tokens[:a]))[n - 6:n + a]  # (6 + a, d)
        torch.testing.assert_close(features.rows, want, atol=2e-3, rtol=2e-3)  # float16 on the way
        assert len(record.encode()) <= FeedbackLimits().max_white_box_bytes


def _with(record: FeedbackRecord, **changes) -> bytes:
    data = json.loads(record.encode())
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not ...}).encode()


def test_malformed_and_oversized_feature_payloads_are_rejected_with_a_reason(head_records):
    record = next(r for r in head_records if r.accepted >= 1)
    width, rows = record.feature_width, record.position + record.accepted - record.feature_start
    nan_rows = torch.zeros(rows, width, dtype=torch.float16)
    nan_rows[0, 0] = float("nan")
    nan = base64.b64encode(nan_rows.view(torch.int16).numpy().tobytes()).decode()
    limits = FeedbackLimits()
    cases = [
        (_with(record, fx="not base64!"), "malformed"),
        (_with(record, fx=base64.b64encode(record.feature_bytes[:-2]).decode()), "malformed"),  # not whole rows
        (_with(record, fx=123), "malformed"),
        (_with(record, fw=0), "out_of_range"),
        (_with(record, fw=limits.max_feature_width + 1), "out_of_range"),
        (_with(record, fs=record.position + record.accepted), "out_of_range"),  # no row at all
        (_with(record, fs=record.position - len(record.context) - 1), "out_of_range"),  # before the context tail
        (_with(record, fs="3"), "malformed"),
        (_with(record, pos=...), "malformed"),  # features need the position
        (_with(record, fx=nan), "out_of_range"),
        (_with(record, fx="A" * limits.max_white_box_bytes), "oversized"),
        (_with(record, fs=..., fw=..., fx=..., pad="x" * limits.max_bytes), "oversized"),  # only features may be large
    ]
    for payload, reason in cases:
        with pytest.raises(BadFeedback) as info:
            FeedbackRecord.decode(payload, limits)
        assert info.value.reason == reason, (payload[:200], info.value)


def test_the_learner_rejects_head_records_without_features_and_goes_on(tmp_path, base_drafter, head_records):
    stream = InProcessFeedbackStream()
    bare = replace(head_records[0], record_id="bare", feature_start=None, feature_width=0, feature_bytes=b"")
    late = replace(head_records[1], record_id="late")  # features that start after position n-2: no first draft
    late = replace(late, feature_start=late.position - 1, feature_width=late.feature_width,
                   feature_bytes=late.feature_bytes[-(late.accepted + 1) * late.feature_width * 2:])
    for r in (bare, FeedbackRecord.decode(late.encode()), *head_records[2:6]):
        stream.emit(r.encode())
    config = LearningConfig(online=OnlineConfig(algorithm="ogd", lr=0.01), holdout_every=0)
    learner = Learner(config, stream, DirectoryModelStore(tmp_path), lambda name: base_drafter.head)
    learner.drain()
    assert learner.rejected == {"no_features": 2}
    assert learner.counters["applied"] == 4 and learner.counters["promoted"] == 1 and stream.pending() == 0


# -- the learner -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["ogd", "optimistic", "hedge"])
def test_updates_lower_the_loss_on_the_records_seen(base_drafter, head_records, algorithm):
    config = OnlineConfig(algorithm=algorithm, lr=0.003, hedge_lrs=(0.001, 0.003, 0.01), hedge_serve_min=0.0)
    learner = OnlineHeadLearner(base_drafter.head, config)
    assert len(head_records) >= 24
    seen = head_records[:24]
    batch = learner.batch(seen)
    assert batch.positions == sum(r.accepted + 1 for r in seen)  # rows 0..a of each record
    before = learner.loss(batch)
    for _ in range(3):
        for i in range(0, len(seen), 4):
            assert learner.step(learner.batch(seen[i:i + 4])) is not None
    after = learner.loss(batch)
    assert after < 0.9 * before, (before, after)
    assert learner.steps == 18
    # The shipped head is not touched (the learner trains copies).
    assert not any(torch.equal(p, q) for p, q in zip(base_drafter.head.blocks.parameters(),
                                                       learner.members[0].blocks.parameters()))


def test_held_out_scores_are_the_drafters_own_drafts(base_drafter, head_records, target_lm):
    """``draft_log_q`` drafts as EagleDrafter does (from the record's window): its greedy tokens
    are the drafter's when the window is the whole context."""
    from specpool.target.features import Features

    model, _ = target_lm
    head = base_drafter.head
    checked = 0
    for r in head_records[:8]:
        context = list(r.context)
        if r.position != len(context):
            continue  # a tail: the drafter would have read more context
        features = final_hidden(model, context)[: len(context) - 1]
        drafter = EagleDrafter(EAGLE, head, base_drafter.metadata, confidence_threshold=0.0)
        drafter.observe_features("s", Features(0, features))
        whole = replace(r, feature_start=0, feature_width=r.feature_width,
                        feature_bytes=features.to(torch.float16).view(torch.int16).numpy().tobytes()
                        + r.feature_bytes[-(r.accepted + 1) * r.feature_width * 2:])
        tokens = drafter.propose("s", context, len(r.draft), GREEDY).tokens
        mine = [int(head.vocab_ids[row.argmax()]) for row in draft_log_q(head, whole)]
        # Along the record's own draft the tokens agree up to the first one the record drafted otherwise.
        for want, got, drafted in zip(tokens, mine, r.draft):
            assert want == got
            if want != drafted:
                break
        checked += 1
    assert checked >= 2
    scores = head_record_bd(head, head_records[:8], "greedy")
    assert [len(s) for s in scores] == [len(r.draft) for r in head_records[:8]]
    assert all(0 <= float(s.min()) and float(s.max()) <= 1 for s in scores)


# -- through the embedded engine -------------------------------------------------------------------------


def learning_engine(home: Path, model_dirs, store: Path, online: OnlineConfig, **settings) -> EmbeddedEngine:
    config = LearningConfig(store=str(store), online=online, holdout_every=0, **settings)
    return EmbeddedEngine(EngineConfig(home=home, target=ModelConfig(str(model_dirs.target))), learning=config)


def learn_while_generating(learning: EmbeddedEngine, engine: EmbeddedEngine, prompts: list[list[int]], spec: str):
    """Tenant "a"'s greedy requests with ``spec`` while it learns, each equal to target-only, then a
    commit; returns the learner (it applied records, rejected none) and the tenant's slot."""
    for n, prompt in enumerate(prompts):
        want = engine.generate(prompt, GREEDY, None).token_ids
        assert learning.generate(prompt, GREEDY, spec, k=4, tenant="a", session_id=f"p{n}").token_ids == want
    learner = learning.learning.learner
    assert learning.learning.stream.emitted > 0 and learning.learning.commit_now()
    assert learner.counters["applied"] > 0 and learner.counters["rejected"] == 0, learner.counters
    return learner, learning.learning.slot("a", spec)


@pytest.mark.parametrize("online, kind", [(OnlineConfig(algorithm="ogd", lr=0.01), "eagle"),
                                          (OnlineConfig(algorithm="hedge", hedge_lrs=(0.003, 0.01), hedge_serve_min=0.0), "eagle"),
                                          (OnlineConfig(algorithm="hedge", hedge_lrs=(0.003, 0.01), hedge_serve_min=0.0),
                                           "eagle-int8")],
                         ids=["ogd", "hedge", "hedge-int8"])
def test_a_learned_head_is_hot_swapped_and_stays_lossless(home, model_dirs, head_dir, tmp_path, engine, prompts, online,
                                                          kind):
    spec = f"{kind}:{head_dir}"
    learning = learning_engine(home, model_dirs, tmp_path / "store", online, publish_every=8)
    try:
        assert learnable(learning.drafter(spec)) and drafter_kind(learning.drafter(spec)).learner is OnlineHeadLearner
        learner, slot = learn_while_generating(learning, engine, prompts[12:18], spec)
        assert slot.version >= 1 and learner.counters["promoted"] >= 1
        _, drafter = slot.pin()
        assert isinstance(drafter, EagleDrafter) and drafter is not slot.base
        if online.algorithm == "hedge":
            assert isinstance(drafter.head, EagleEnsembleHead) and len(drafter.head.members) == 2
            # a learned version drafts in its base's precision (eagle-int8: int8 kernels)
            precision = slot.base.head.draft_precision
            assert precision == ("int8" if kind == "eagle-int8" else "float32")
            assert {m.draft_precision for m in drafter.head.members} == {m._output.precision for m in drafter.head.members} == {precision}
        else:
            assert not torch.equal(drafter.head.head_bias, slot.base.head.head_bias)  # the learned weights
        # The next requests draft with the learned version and give the target's own tokens; each
        # request's rounds are all of one version (the learner may promote again meanwhile).
        versions: dict[str, set[int]] = {}
        emit = learning.learning.emitter

        def recording(fb, tenant, version):
            versions.setdefault(fb.session_id, set()).add(version)
            emit(fb, tenant, version)

        learning.learning.emitter = recording
        for n, prompt in enumerate(prompts[18:22]):
            result = learning.generate(prompt, GREEDY, spec, k=4, tenant="a", session_id=f"after{n}")
            assert result.token_ids == engine.generate(prompt, GREEDY, None).token_ids
            assert sum(r.proposed for r in result.rounds) > 0
            assert len(versions[f"after{n}"]) == 1 and min(versions[f"after{n}"]) >= 1
        learning.learning.thread.stop()  # (it commits what it applied): nothing changes the store from here on
        key = VariantKey("a", spec)
        # The serving version loads as the same kind of drafter elsewhere (a served replica's path).
        again = version_drafter(slot.base, learning.learning.store, key, learning.learning.store.serving(key))
        assert isinstance(again, EagleDrafter) and type(again.head) is type(drafter.head)
        # A new learner resumes from the checkpoint: the variant's weights and step count.
        resumed = Learner(learning.learning.config, InProcessFeedbackStream(), learning.learning.store,
                          lambda name: network_of(slot.base))
        state = resumed._variant(key)
        assert state.serving_version == learning.learning.store.serving(key)
        assert state.learner.steps == learner.variants[key].learner.steps > 0
    finally:
        learning.close()


def test_a_head_behind_prompt_lookup_learns_and_its_versions_keep_the_lookup(home, model_dirs, head_dir, tmp_path, engine,
                                                                             prompts):
    """``lookup:eagle:...`` (the default drafter's shape) learns: the head behind the lookup is
    trained on the rounds' records, a version is a new head behind a lookup of its own, served
    lossless, and the served learner builds the head for such a name."""
    from specpool.drafters.lookup_first import LookupFirstDrafter
    from specpool.drafters.registry import DrafterContext
    from specpool.learning.hot_swap import behind_lookup
    from specpool.learning.learner_process import registry_base_models

    spec = f"lookup:eagle:{head_dir}"
    learning = learning_engine(home, model_dirs, tmp_path / "store", OnlineConfig(algorithm="ogd", lr=0.01), publish_every=8)
    try:
        base = learning.drafter(spec)
        assert isinstance(base, LookupFirstDrafter) and learnable(base)
        assert drafter_kind(base).learner is OnlineHeadLearner and network_of(base) is base.inner.head
        learner, slot = learn_while_generating(learning, engine, prompts[12:18], spec)
        assert slot.version >= 1
        _, drafter = slot.pin()
        assert isinstance(drafter, LookupFirstDrafter) and drafter is not slot.base
        assert drafter.lookup is not slot.base.lookup  # a version shares no per-session state
        assert not torch.equal(behind_lookup(drafter).head.head_bias, slot.base.inner.head.head_bias)
        for n, prompt in enumerate(prompts[18:21]):
            result = learning.generate(prompt, GREEDY, spec, k=4, tenant="a", session_id=f"after{n}")
            assert result.token_ids == engine.generate(prompt, GREEDY, None).token_ids
        learning.learning.thread.stop()
        key = VariantKey("a", spec)
        again = version_drafter(slot.base, learning.learning.store, key, learning.learning.store.serving(key))
        assert isinstance(again, LookupFirstDrafter) and isinstance(again.inner, EagleDrafter)
        assert again.name == spec and again.feature_width == slot.base.feature_width
    finally:
        learning.close()
    # The served learner (`specpool learner`) builds the head for a record naming the lookup-fronted spec.
    base_model = registry_base_models(DrafterContext(home, str(model_dirs.target)), [spec])
    assert isinstance(base_model(spec), type(network_of(base)))
    assert base_model("ngram") is None  # not allowed: never built
