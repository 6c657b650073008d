"""Training white-box heads (specpool/learning/eagle_train.py) on the tiny target: both recipes run
and export a head folder atomically with its card; a run interrupted and resumed ends with the
weights of a straight run; the teacher store's features are the target's own final hidden states
at the stored positions; ``collate_heads`` aligns (x_{t+1}, f_t) with f_{t+1} and x_{t+2}; and the
held-out acceptance is what ``EagleDrafter`` drafting the same sequences gets.

Tiny settings (hidden 32, 60 prompts, 10-token answers, 12 steps): each run ~2 s."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specpool.drafters.base import leading_matches
from specpool.drafters.eagle import EagleDrafter, load_eagle_head
from specpool.drafters.eagle_model import EagleConfig, EagleHead
from specpool.learning.eagle_train import (
    DEFAULT_FEATURES_CONTEXT, FeatureSequence, HeadOptions, collate_heads, head_loss, heldout_acceptance,
    load_feature_teacher, train_head, trim_features,
)
from specpool.learning.zoo_data import collect_prompts
from specpool.learning.zoo_train import TrainConfig, distillation_loss, prompt_hash, split_heldout, teacher_index
from specpool.target.features import Features
from specpool.target.sampling import SamplingParams
from test_zoo import MODEL_FILES, SPECIAL_TOKENS, hidden_leftovers, model_files_in, write_instructions

OPTIONS = HeadOptions(intermediate_size=64)


def tiny_config(corpus: Path, **overrides) -> TrainConfig:
    config = TrainConfig(
        domain="chat", data=(str(corpus),), steps=12, batch_size=4, max_prompts=60, max_new_tokens=10,
        teacher_batch=16, save_every=4, reduced_vocab=48, train_context_tokens=32, lr=3e-3, warmup=3,
    )
    return dataclasses.replace(config, **overrides)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, model_dirs) -> Path:
    vocab = json.loads((model_dirs.target / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(w for w in vocab if w not in SPECIAL_TOKENS)
    return write_instructions(tmp_path_factory.mktemp("corpus") / "instructions.jsonl", words, n=60)


@pytest.fixture(scope="module")
def head_home(tmp_path_factory) -> Path:
    """One home for the module: the teacher store is shared, checkpoints are keyed by output folder."""
    return tmp_path_factory.mktemp("head-home")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, head_home, corpus, model_dirs) -> dict[str, SimpleNamespace]:
    """One tiny run per recipe."""
    out = {}
    for recipe in ("eagle", "unroll"):
        folder = tmp_path_factory.mktemp(f"heads-{recipe}") / f"chat-{recipe}"
        options = dataclasses.replace(OPTIONS, recipe=recipe)
        metadata = train_head(tiny_config(corpus), options, head_home, folder, resume=False,
                              target_name=str(model_dirs.target))
        out[recipe] = SimpleNamespace(out=folder, metadata=metadata, options=options)
    return out


@pytest.fixture(scope="module")
def teacher(runs, head_home, corpus, model_dirs) -> SimpleNamespace:
    """The runs' teacher sequences with features, read back from the store."""
    config = tiny_config(corpus)
    summary = train_head(config, OPTIONS, head_home, Path("unused"), resume=False,
                         target_name=str(model_dirs.target), teacher_only=True)
    index = teacher_index(Path(summary["store"]))
    prompts = [p for p in collect_prompts([corpus], config.max_prompts, config.seed) if prompt_hash(p) in index]
    train, heldout = split_heldout(prompts)
    return SimpleNamespace(sequences=load_feature_teacher(prompts, index), train=train, heldout=heldout,
                           summary=summary)


# -- runs and their output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["eagle", "unroll"])
def test_a_run_exports_a_head_atomically_with_its_card(recipe, runs, model_dirs, head_home, teacher):
    run = runs[recipe]
    assert model_files_in(run.out) == MODEL_FILES
    assert hidden_leftovers(run.out.parent) == [] and hidden_leftovers(run.out) == []
    assert not list((head_home / "zoo" / "checkpoints").glob(".*")), "a temporary checkpoint left behind"
    card = json.loads((run.out / "config.json").read_text())
    assert card == json.loads(json.dumps(run.metadata))
    assert card["kind"] == "eagle" and card["recipe"] == recipe and card["target"] == str(model_dirs.target)
    assert card["target_card"] == {"hidden_size": 32, "num_hidden_layers": 2}
    assert card["steps"] == 12 and len(card["loss_curve"]) == 3
    assert all(math.isfinite(x) and x > 0 for x in card["loss_curve"])
    # Held out: the starting point, then every save; tokens per round at k = 5 lie in [1, 6].
    assert card["heldout_prompts"] == len(teacher.heldout) > 0
    curve = card["heldout_acceptance_curve"]
    assert len(curve) == 4 and all(1.0 <= x <= 6.0 for x in curve), curve
    assert card["best_heldout_acceptance"] == max(curve)
    assert card["train_config"]["features_context"] == DEFAULT_FEATURES_CONTEXT
    readme = (run.out / "README.md").read_text()
    assert f"recipe `{recipe}`" in readme and "width 32, 2 layers" in readme
    tensors = load_file(str(run.out / "model.safetensors"))
    assert "embedding" not in tensors and "output" not in tensors  # the target's, borrowed at load time
    assert tensors["vocab_ids"].dtype == torch.int32 and len(tensors["vocab_ids"]) == 48
    head, _ = load_eagle_head(run.out, head_home, str(model_dirs.target))
    assert isinstance(head, EagleHead) and head.config.intermediate_size == 64


@pytest.fixture(scope="module")
def trained(tmp_path_factory, head_home, corpus, model_dirs, runs) -> dict[str, Path]:
    """Per recipe, a run on 19 prompts: none held out, so the exported weights are the last
    step's (on the tiny target held-out acceptance stays at its start, 1.0, and the best check is
    the warm start itself)."""
    out = {}
    for recipe in ("eagle", "unroll"):
        out[recipe] = tmp_path_factory.mktemp(f"trained-{recipe}") / recipe
        metadata = train_head(tiny_config(corpus, max_prompts=19), dataclasses.replace(OPTIONS, recipe=recipe),
                              head_home, out[recipe], resume=False, target_name=str(model_dirs.target))
        assert metadata["heldout_prompts"] == 0 and metadata["heldout_acceptance_curve"] == []
    return out


def test_the_recipes_train_differently(trained, runs):
    """Not one recipe twice, and training moved the weights away from the warm start."""
    eagle, unroll = (load_file(str(trained[r] / "model.safetensors")) for r in ("eagle", "unroll"))
    assert not torch.equal(eagle["fuse.weight"], unroll["fuse.weight"])
    start = load_file(str(runs["eagle"].out / "model.safetensors"))  # best check: the warm start
    assert not torch.equal(eagle["fuse.weight"], start["fuse.weight"])


def assert_same_weights(a: Path, b: Path) -> dict[str, torch.Tensor]:
    want, got = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    return got


def test_interrupted_then_resumed_equals_a_straight_run(tmp_path, head_home, corpus, model_dirs):
    target = str(model_dirs.target)
    config = tiny_config(corpus, max_prompts=19)  # none held out: every step counts (see ``trained``)
    straight = train_head(config, OPTIONS, head_home, tmp_path / "straight", resume=False, target_name=target)
    out = tmp_path / "resumed"
    # A time limit stops the run at its first save (step 4): what an interruption leaves.
    stopped = train_head(dataclasses.replace(config, time_limit_s=1e-9), OPTIONS, head_home, out, resume=False,
                         target_name=target)
    assert stopped["steps"] == 4 and stopped["stopped_by_time_limit"]
    halfway = load_file(str(out / "model.safetensors"))
    resumed = train_head(config, OPTIONS, head_home, out, resume=True, target_name=target)
    assert resumed["steps"] == 12 and not resumed["stopped_by_time_limit"]
    for key in ("loss_curve", "tokens_seen"):
        assert resumed[key] == straight[key], key
    got = assert_same_weights(tmp_path / "straight", out)
    # Not vacuous: the steps after the interruption changed the weights.
    assert any(not torch.equal(halfway[name], got[name]) for name in got)


def test_resume_keeps_the_best_checked_weights_as_a_straight_run(tmp_path, head_home, corpus, model_dirs, monkeypatch):
    """Held-out acceptance injected as 1.0, 1.5, 1.2, 1.1 at steps 0, 4, 8, 12: straight and
    interrupted-at-4-then-resumed runs both ship step 4's weights."""
    target = str(model_dirs.target)
    config = tiny_config(corpus)

    def inject(values):
        values = iter(values)
        monkeypatch.setattr("specpool.learning.eagle_train.heldout_acceptance", lambda *args, **kwargs: next(values))

    inject([1.0, 1.5, 1.2, 1.1])
    straight = train_head(config, OPTIONS, head_home, tmp_path / "straight", resume=False, target_name=target)
    inject([1.0, 1.5])
    out = tmp_path / "resumed"
    train_head(dataclasses.replace(config, time_limit_s=1e-9), OPTIONS, head_home, out, resume=False, target_name=target)
    inject([1.2, 1.1])
    resumed = train_head(config, OPTIONS, head_home, out, resume=True, target_name=target)
    assert straight["heldout_acceptance_curve"] == resumed["heldout_acceptance_curve"] == [1.0, 1.5, 1.2, 1.1]
    assert straight["best_step"] == resumed["best_step"] == 4 and resumed["best_heldout_acceptance"] == 1.5
    got = assert_same_weights(tmp_path / "straight", out)
    # Not vacuous: neither the warm start's weights (best at step 0) nor the last step's.
    for values, name in (([1.5, 1.0, 1.0, 1.0], "first"), ([1.0, 1.1, 1.2, 1.5], "last")):
        inject(values)
        train_head(config, OPTIONS, head_home, tmp_path / name, resume=False, target_name=target)
        other = load_file(str(tmp_path / name / "model.safetensors"))
        assert not torch.equal(other["fuse.weight"], got["fuse.weight"]), name


# -- teacher features ----------------------------------------------------------------------------------------


@torch.inference_mode()
def final_hidden(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states[-1][0]


def test_teacher_features_are_the_targets_final_hidden_states(teacher, target_lm, model_dirs):
    model, _ = target_lm
    lm_head = load_file(str(model_dirs.target / "model.safetensors"))["lm_head.weight"]  # (V, d)
    assert len(teacher.sequences) == teacher.summary["teacher_prompts"] == 60
    for s in teacher.sequences:
        L, P, fs = len(s.tokens), s.answer_start, s.feature_start
        assert fs == max(P - DEFAULT_FEATURES_CONTEXT, 0) == 0
        assert s.features.dtype == torch.float16 and s.features.shape == (L - 1 - fs, 32)
        assert len(s.label_ids) == L - P
        want = final_hidden(model, s.tokens.tolist())[fs:L - 1]  # (L-1-fs, d)
        # float16 storage (and a left-padded batched generate): equal up to float16 rounding (the
        # worst seen: 1e-3 on values up to ~4).
        torch.testing.assert_close(s.features.float(), want, atol=2e-3, rtol=2e-3)
        # The features are what the LM head reads: its argmax at answer positions is the greedy answer.
        logits = s.features.float() @ lm_head.T  # (L-1-fs, V)
        assert logits[P - 1 - fs:].argmax(-1).tolist() == s.tokens[P:].tolist()


# -- collate_heads, loss -------------------------------------------------------------------------------------


def make_sequence(prompt: int, answer: int, feature_start: int = 0, d: int = 3, k: int = 2) -> FeatureSequence:
    """Tokens 10, 11, ...; the feature of position t is filled with t; teacher labels of answer
    token j are ids (10 + P + j, 0) so each label names its own token."""
    L = prompt + answer
    tokens = torch.arange(10, 10 + L)
    features = torch.arange(feature_start, L - 1, dtype=torch.float16)[:, None].expand(-1, d).clone()
    label_ids = torch.stack([tokens[prompt:], torch.zeros(answer, dtype=torch.long)], dim=1)  # (A, K)
    label_probs = torch.tensor([[0.75, 0.25]]).expand(answer, k).clone()
    return FeatureSequence(tokens, prompt, feature_start, features, label_ids, label_probs)


@pytest.mark.parametrize("prompt, answer, feature_start, context", [
    (6, 4, 0, 100),  # every prompt position
    (9, 5, 0, 3),  # trimmed to 3 prompt positions before the answer
    (7, 3, 6, 100),  # the store kept one prompt feature (features_context = 1): starts past P - 2
])
def test_collate_heads_aligns_inputs_targets_and_labels(prompt, answer, feature_start, context):
    vocab_map = torch.full((64,), -1, dtype=torch.long)
    vocab_map[torch.arange(0, 64, 2)] = torch.arange(32)  # even ids in the reduced vocabulary
    s = trim_features(make_sequence(prompt, answer, feature_start), context)
    short = make_sequence(3, 2)  # a shorter neighbour: right padding
    batch = collate_heads([s, short], vocab_map)
    fs, L, P = s.feature_start, len(s.tokens), s.answer_start
    assert fs == max(feature_start, P - context) if context < P else fs == feature_start
    rows = L - 2 - fs  # head positions fs .. L-3
    assert batch["ids"].shape == (2, max(rows, 3)) and batch["valid"][0].sum() == rows
    for i in range(rows):
        t = fs + i  # head position t: reads x_{t+1} and f_t, learns f_{t+1} and x_{t+2}
        assert int(batch["ids"][0, i]) == 10 + t + 1
        assert batch["features"][0, i].tolist() == [t] * 3
        assert batch["targets"][0, i].tolist() == [t + 1] * 3
        assert int(batch["next_token"][0, i]) == 10 + t + 2
        is_answer = t + 2 >= P
        assert bool(batch["answer"][0, i]) == is_answer, t
        if is_answer:
            token = 10 + t + 2  # the label's first id is the answer token itself
            assert batch["label_ids"][0, i].tolist() == [int(vocab_map[token]), int(vocab_map[0])]
            assert batch["label_probs"][0, i].tolist() == [0.75, 0.25]
        else:
            assert batch["label_ids"][0, i].tolist() == [-1, -1]
    # The neighbour's padding is neither valid nor trained on.
    assert batch["valid"][1].sum() == len(short.tokens) - 2 and not batch["answer"][1, 3:].any()


def test_unroll_of_one_step_is_the_eagle_loss(trained, teacher, head_home, model_dirs):
    head, _ = load_eagle_head(trained["eagle"], head_home, str(model_dirs.target))
    vocab_map = torch.full((64,), -1, dtype=torch.long)
    vocab_map[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    batch = collate_heads(teacher.sequences[:4], vocab_map)
    with torch.no_grad():  # losses only
        eagle, _ = head_loss(head, batch, "eagle", 3)
        one, _ = head_loss(head, batch, "unroll", 1)
        three, stats = head_loss(head, batch, "unroll", 3)
    assert float(one) == pytest.approx(float(eagle)) and float(three) != pytest.approx(float(eagle))
    assert set(stats) == {f"{name}{j}" for name in ("agree", "ce", "regression") for j in range(3)}  # one entry per unrolled step
    # Step 1 of the unroll: head position t reads x_{t+1} and step 0's guess of f_t (made at t-1).
    with torch.no_grad():
        two, _ = head_loss(head, batch, "unroll", 2)
        guesses = head(batch["ids"], batch["features"])  # (B, T, d): step 0
        predicted = head(batch["ids"][:, 1:], guesses[:, :-1])  # (B, T-1, d): step 1, positions 1..
        valid, answer = batch["valid"][:, 1:], batch["answer"][:, 1:]
        step1 = F.smooth_l1_loss(predicted[valid], batch["targets"][:, 1:][valid]) + distillation_loss(
            head.reduced_logits(predicted[answer]), batch["label_ids"][:, 1:][answer], batch["label_probs"][:, 1:][answer])
    assert float(two) == pytest.approx((float(eagle) + float(step1)) / 2, rel=1e-5)


# -- held-out acceptance == EagleDrafter ---------------------------------------------------------------------


def drafted_acceptance(head: EagleHead, sequences: list[FeatureSequence], k: int = 5, starts: int = 8) -> float:
    """Brute force: EagleDrafter (no confidence stop) asked for k drafts at the check's starts,
    its features handed over as the loop does, accepted against the target's own tokens."""
    drafter = EagleDrafter("eagle:check", head, {"target_tokenizer_fingerprint": "tiny"}, confidence_threshold=0.0)
    params = SamplingParams(temperature=0.0)
    accepted, rounds = 0, 0
    for j, s in enumerate(sequences):
        tokens, L, P = s.tokens.tolist(), len(s.tokens), s.answer_start
        assert s.feature_start == 0  # the drafter reads features from position 0
        drafter.observe_features(f"s{j}", Features(0, s.features.float()))
        for n in torch.linspace(max(P, 2), L - 2, starts).long().unique().tolist():
            proposal = drafter.propose(f"s{j}", tokens[:n], min(k, L - n), params)
            accepted += leading_matches(proposal.tokens, tokens[n:])
            rounds += 1
    return 1.0 + accepted / rounds


@pytest.mark.parametrize("recipe", ["eagle", "unroll"])
def test_heldout_acceptance_is_what_the_drafter_gets(recipe, trained, teacher, head_home, model_dirs):
    head, _ = load_eagle_head(trained[recipe], head_home, str(model_dirs.target))
    sequences = teacher.sequences[:20]
    got = heldout_acceptance(head, sequences)
    assert got == pytest.approx(drafted_acceptance(head, sequences), abs=1e-9)
    assert got > 1.0  # some drafts accepted: the comparison counted something


def test_fused_layers_start_as_the_final_feature_head_and_learn_from_their_own_rows():
    """EagleConfig.feature_layers (EAGLE-3's fusion, measured by bench/feature_fusion.py): zero at
    first, so a fused head warm-started from a final-feature head drafts exactly as it does; true
    rows carry the layers (width d(1+E)), the head's own guesses do not (width d); the fusion gets
    gradients from head_loss, whose regression target is the final feature only; a card's JSON
    list of layers loads as the tuple."""
    torch.manual_seed(0)
    d, V = 8, 32
    base_config = EagleConfig(hidden_size=d, num_heads=2, num_kv_heads=1, intermediate_size=16, reduced_vocab=16)
    embedding = torch.randn(V, d)
    base = EagleHead(base_config, embedding, torch.arange(16))
    config = dataclasses.replace(base_config, feature_layers=[2, 5])
    assert config.feature_layers == (2, 5) and config.feature_width == 3 * d
    assert EagleConfig(**json.loads(json.dumps(config.to_dict()))) == config
    fused = EagleHead(config, embedding, torch.arange(16))
    missing = fused.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["layer_fuse.weight", "layer_norms.0.weight", "layer_norms.1.weight"]
    ids, rows = torch.randint(0, V, (2, 5)), torch.randn(2, 5, 3 * d)
    with torch.no_grad():
        assert torch.allclose(fused(ids, rows), base(ids, rows[..., :d]), atol=1e-6)
        assert torch.allclose(fused(ids, rows[..., :d]), base(ids, rows[..., :d]), atol=1e-6)
        fused.layer_fuse.weight.normal_()
        assert not torch.allclose(fused(ids, rows), base(ids, rows[..., :d]), atol=1e-3)  # the layers are read
    batch = collate_heads([make_sequence(4, 6, d=3 * d, k=2)], torch.arange(V).remainder(16))
    loss, _ = head_loss(fused, batch, "unroll", 2)
    loss.backward()
    assert fused.layer_fuse.weight.grad is not None and fused.layer_fuse.weight.grad.abs().sum() > 0


def test_feature_fusion_bench_rows_are_the_final_then_the_chosen_layers(target_lm):
    """bench/feature_fusion.py's teacher: the target's greedy answer, then rows [final ; layer i ...]
    of prompt + answer from ``context`` prompt positions before the answer, and the top-K labels
    at answer positions."""
    from bench.feature_fusion import answer, features_of, final_only

    model, tokenizer = target_lm
    prompts = ["the cat sat", "a dog ran far"]
    stop = tokenizer.eos_token_id
    answers = answer(model, tokenizer, prompts, 6, 2, stop)
    sequences = features_of(model, tokenizer, prompts, answers, (1, 2), context=2, top_k=3)
    d = model.config.hidden_size
    for s in sequences:
        L, P, fs = len(s.tokens), s.answer_start, s.feature_start
        assert fs == P - 2 and s.features.shape == (L - 1 - fs, 3 * d) and s.label_ids.shape == (L - P, 3)
        with torch.no_grad():
            hs = model(input_ids=s.tokens[None].clone(), output_hidden_states=True).hidden_states
        want = torch.cat([hs[-1][0], hs[1][0], hs[2][0]], dim=-1)[fs:L - 1]
        torch.testing.assert_close(s.features.float(), want, atol=2e-3, rtol=2e-3)
        assert s.label_ids[:, 0].tolist() == s.tokens[P:].tolist()  # greedy: each answer token is the top-1
        assert final_only(s, d).features.shape == (L - 1 - fs, d)


def test_a_warm_start_keeps_its_heads_vocabulary_and_fills_the_rest_from_the_new_data(runs, tmp_path, head_home,
                                                                                        corpus, model_dirs):
    """``--init-from``: a head continued on other data keeps every token it could propose (the
    data it learnt before) where the size leaves room, and its biases for them."""
    source = load_file(str(runs["eagle"].out / "model.safetensors"))
    source_ids = set(source["vocab_ids"].tolist())  # 48 tokens
    few = dict(max_prompts=6, steps=2, save_every=2, reduced_vocab=56)  # little new data: few tokens of its own
    warm = tmp_path / "warm"
    options = dataclasses.replace(OPTIONS, init_from=str(runs["eagle"].out))
    metadata = train_head(tiny_config(corpus, **few, lr=1e-9), options, head_home, warm, resume=False,
                          target_name=str(model_dirs.target))
    weights = load_file(str(warm / "model.safetensors"))
    warm_ids = weights["vocab_ids"].tolist()
    assert len(warm_ids) == 56 and source_ids <= set(warm_ids) and metadata["model"]["reduced_vocab"] == 56
    # The biases carry over for the shared tokens (lr ~ 0: the warm start itself).
    position = {t: i for i, t in enumerate(source["vocab_ids"].tolist())}
    carried = torch.stack([source["head_bias"][position[t]] for t in warm_ids if t in position])
    shared = torch.stack([weights["head_bias"][i] for i, t in enumerate(warm_ids) if t in position])
    assert torch.allclose(carried.float(), shared.float(), atol=1e-3)
    # Smaller than the source's vocabulary: the new data chooses alone, as a cold run does.
    small = tmp_path / "small"
    train_head(tiny_config(corpus, **{**few, "reduced_vocab": 40}), options, head_home, small, resume=False,
               target_name=str(model_dirs.target))
    cold_small = tmp_path / "cold-small"
    train_head(tiny_config(corpus, **{**few, "reduced_vocab": 40}), OPTIONS, head_home, cold_small, resume=False,
               target_name=str(model_dirs.target))
    assert torch.equal(load_file(str(small / "model.safetensors"))["vocab_ids"],
                       load_file(str(cold_small / "model.safetensors"))["vocab_ids"])


def test_training_grows_a_head_and_ships_it_in_int8_at_about_half_the_size(runs, tmp_path, head_home, corpus,
                                                                          model_dirs):
    source = runs["unroll"].out
    options = dataclasses.replace(OPTIONS, recipe="unroll", init_from=str(source), num_layers=2, storage="int8")
    out = tmp_path / "grown"
    metadata = train_head(tiny_config(corpus, steps=4), options, head_home, out, resume=False,
                          target_name=str(model_dirs.target))
    card = json.loads((out / "config.json").read_text())
    assert card["model"]["num_layers"] == 2 and card["storage"] == "int8" and card["train_config"]["head"]["num_layers"] == 2
    assert metadata["steps"] == 4
    assert "| decoder blocks, weights on disk | 2, int8 |" in (out / "README.md").read_text()
    head, _ = load_eagle_head(out, head_home, str(model_dirs.target))
    assert head.config.num_layers == 2
    float16 = tmp_path / "grown-f16"
    train_head(tiny_config(corpus, steps=4), dataclasses.replace(options, storage="float16"), head_home, float16,
               resume=False, target_name=str(model_dirs.target))
    blocks = lambda folder: sum(v.numel() * v.element_size() for k, v in load_file(str(folder / "model.safetensors")).items()
                                if k.startswith("blocks."))
    assert blocks(out) < 0.6 * blocks(float16)
    with pytest.raises(Exception, match="--head-layers"):
        train_head(tiny_config(corpus), dataclasses.replace(options, num_layers=0), head_home, tmp_path / "x",
                   resume=False, target_name=str(model_dirs.target))
    with pytest.raises(Exception, match="--storage"):
        train_head(tiny_config(corpus), dataclasses.replace(options, storage="int4"), head_home, tmp_path / "y",
                   resume=False, target_name=str(model_dirs.target))
