"""Zoo drafters on the tiny target: distillation lowers the loss, a resumed run continues exactly
where a straight run would be, the exported folder loads back and drafts losslessly through the
engine, and bad input (corpus, domain, checkpoint, output folder) gives one clear error with
nothing half-written left behind. Pure helpers (batches, loss, vocabulary, corpus formats, the
n-gram draft length) are checked on hand-made cases.

Training here is tiny (hidden 32, 16 prompts, 10-token answers, <= 30 steps): each run is ~1-2 s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specpool.drafters.ngram import best_draft_length
from specpool.drafters.zoo import ZooDrafter, load_zoo_model
from specpool.learning.zoo_data import CODE_INSTRUCTION, DOMAINS, MAX_PROMPT_CHARS, collect_prompts, read_prompts
from specpool.drafters.zoo_model import ZooConfig, ZooLM, init_from_target_layers, rope_tables
from specpool.learning.zoo_train import (
    Sequence,
    TrainConfig,
    TrainingError,
    batch_indices,
    build_vocab,
    collate,
    distillation_loss,
    export_drafter,
    generate_teacher,
    heldout_loss,
    load_teacher,
    split_heldout,
    teacher_store_key,
    train_drafter,
    train_steps,
    trim_context,
    zoo_config_for,
)
from specpool.core.errors import InvalidArgument, NotFound
from cli_helpers import assert_one_line_error
from specpool.target.models import ModelConfig, load_causal_lm, tokenizer_fingerprint
from specpool.target.sampling import SamplingParams

MODEL_FILES = ["README.md", "config.json", "model.safetensors"]
SPECIAL_TOKENS = {"[UNK]", "<s>", "</s>"}


# --- fixtures -----------------------------------------------------------------------------------


def tiny_config(corpus: Path, **overrides) -> TrainConfig:
    """Tiny settings: 16 prompts x 10 answer tokens; 30 steps of 4 sequences (~1.5 s)."""
    config = TrainConfig(
        domain="chat", data=(str(corpus),), steps=30, batch_size=4, max_prompts=16, max_new_tokens=10,
        teacher_batch=8, save_every=10, reduced_vocab=48, train_context_tokens=32, lr=3e-3, warmup=5,
    )
    return dataclasses.replace(config, **overrides)


def checkpoint_path(home: Path, out: Path, domain: str) -> Path:
    """Where ``train_drafter`` keeps a run's checkpoint (the formula of specpool/learning/zoo_train.py;
    ``test_checkpoint_location`` checks it against a real run)."""
    run_key = hashlib.sha256(f"{out.resolve()}:{domain}".encode()).hexdigest()[:12]
    return home / "zoo" / "checkpoints" / f"{domain}-{run_key}.pt"


def model_files_in(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.is_dir() else []


def hidden_leftovers(folder: Path) -> list[str]:
    """Temporary files or folders (dot names) a failed run could leave in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) if folder.is_dir() else []


def assert_nothing_half_written(out: Path) -> None:
    assert model_files_in(out) == [], f"{out} holds {model_files_in(out)} after a failed run"
    parent = out.parent if out.parent.is_dir() else out.parent.parent
    assert hidden_leftovers(parent) == [], f"temporary leftovers in {parent}: {hidden_leftovers(parent)}"


@pytest.fixture(scope="module")
def words(model_dirs) -> list[str]:
    """The word-level tokenizer's words (text made of them encodes without [UNK])."""
    vocab = json.loads((model_dirs.target / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w for w in vocab if w not in SPECIAL_TOKENS)


def write_instructions(path: Path, words: list[str], n: int = 24, seed: int = 0) -> Path:
    """A self-instruct style corpus ({"instruction", "instances"}) of ``n`` distinct prompts."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for i in range(n):
            instruction = " ".join(rng.sample(words, rng.randint(3, 7)))
            extra = " ".join(rng.sample(words, 2)) if i % 3 == 0 else ""
            handle.write(json.dumps({"instruction": instruction, "instances": [{"input": extra, "output": ""}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, words) -> Path:
    return write_instructions(tmp_path_factory.mktemp("corpus") / "instructions.jsonl", words)


@pytest.fixture(scope="module")
def zoo_home(tmp_path_factory) -> Path:
    """One specpool home for this module's training runs: the teacher store is shared (as in
    real use), checkpoints are keyed by output folder so runs do not collide."""
    return tmp_path_factory.mktemp("zoo-home")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, zoo_home, corpus, model_dirs) -> SimpleNamespace:
    """One full tiny training run, exported."""
    config = tiny_config(corpus)
    out = tmp_path_factory.mktemp("zoo-out") / "chat-tiny"
    metadata = train_drafter(config, zoo_home, out, resume=False, target_name=str(model_dirs.target))
    return SimpleNamespace(config=config, home=zoo_home, out=out, metadata=metadata,
                           checkpoint=checkpoint_path(zoo_home, out, "chat"))


# --- 1. training lowers the loss; the exported folder ------------------------------------------


def test_training_lowers_distillation_loss(trained):
    curve = trained.metadata["loss_curve"]
    assert len(curve) == trained.config.steps // trained.config.save_every == 3
    assert all(math.isfinite(x) and x > 0 for x in curve), curve
    assert curve[-1] < 0.9 * curve[0], f"distillation did not lower the loss: {curve}"
    assert trained.metadata["final_loss"] == pytest.approx(curve[-1], abs=1e-4)


def test_exported_folder_and_model_card(trained, corpus):
    assert model_files_in(trained.out) == MODEL_FILES
    config = json.loads((trained.out / "config.json").read_text())
    assert config == json.loads(json.dumps(trained.metadata))
    tensors = load_file(str(trained.out / "model.safetensors"))
    own = sum(t.numel() for name, t in tensors.items() if name != "vocab_ids")
    assert config["own_parameters"] == own
    assert tensors["vocab_ids"].dtype == torch.int32 and len(tensors["vocab_ids"]) == 48
    assert all(t.dtype == torch.float16 for name, t in tensors.items() if name != "vocab_ids")
    assert "embedding" not in tensors  # the target's embedding is borrowed at load time, never shipped
    assert config["model"]["reduced_vocab"] == 48
    assert (config["model"]["hidden_size"], config["model"]["num_heads"], config["model"]["num_kv_heads"]) == (32, 4, 2)
    assert config["steps"] == 30 and config["teacher_prompts"] == 16
    # Every sequence of every step contributes its answer positions (at most 10 each).
    assert 0 < config["tokens_seen"] <= 30 * 4 * 10

    card = (trained.out / "README.md").read_text()
    assert str(corpus) in card  # data files
    assert "| steps | 30 |" in card
    assert f"| tokens seen (answer positions) | {config['tokens_seen']} |" in card
    assert f"| final loss | {config['final_loss']:.4f} |" in card
    assert f"| own parameters | {own} |" in card


def test_checkpoint_location(trained):
    """The run's checkpoint lives under home/zoo/checkpoints, named as ``checkpoint_path`` says,
    and holds the final state (this is what the corrupted-checkpoint tests overwrite)."""
    assert trained.checkpoint.exists()
    data = torch.load(trained.checkpoint, map_location="cpu", weights_only=False)
    assert data["state"]["step"] == 30
    assert data["state"]["tokens_seen"] == trained.metadata["tokens_seen"]


# --- 2. exact resume ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(zoo_home, corpus, model_dirs) -> SimpleNamespace:
    """train_drafter's stages up to the model, by hand: teacher data, vocabulary, and a factory
    of identically initialised drafters."""
    config = tiny_config(corpus, steps=12, save_every=6)
    target, tokenizer = load_causal_lm(ModelConfig(str(model_dirs.target)), zoo_home)
    prompts = collect_prompts([Path(p) for p in config.data], config.max_prompts, config.seed)
    stop_ids = (tokenizer.eos_token_id,)
    store = zoo_home / "zoo" / "teacher" / teacher_store_key(config, tokenizer_fingerprint(tokenizer))
    index = generate_teacher(target, tokenizer, prompts, store, config, stop_ids)
    sequences = load_teacher(prompts, index)
    target_state = load_file(str(model_dirs.target / "model.safetensors"))
    embedding = target_state["model.embed_tokens.weight"].float()
    zoo_config = zoo_config_for(target.config, config)
    vocab_ids = build_vocab(sequences, zoo_config.reduced_vocab, embedding.shape[0], stop_ids)
    vocab_map = torch.full((embedding.shape[0],), -1, dtype=torch.long)
    vocab_map[vocab_ids] = torch.arange(len(vocab_ids))

    def fresh_model() -> ZooLM:
        torch.manual_seed(config.seed)
        model = ZooLM(zoo_config, embedding, vocab_ids)
        init_from_target_layers(model, target_state, list(config.init_layers))
        return model

    return SimpleNamespace(config=config, sequences=sequences, vocab_map=vocab_map, fresh_model=fresh_model)


def test_resume_continues_exactly_where_a_straight_run_would_be(pipeline, tmp_path):
    p = pipeline
    initial = {k: v.clone() for k, v in p.fresh_model().state_dict().items()}

    straight = p.fresh_model()
    straight_state = train_steps(straight, p.sequences, p.vocab_map, p.config, checkpoint=None, resume=False)

    checkpoint = tmp_path / "run.pt"
    interrupted = p.fresh_model()
    half = train_steps(interrupted, p.sequences, p.vocab_map, p.config, checkpoint, resume=False, until=6)
    assert half.step == 6 and checkpoint.exists()
    halfway = {k: v.clone() for k, v in interrupted.state_dict().items()}
    del interrupted

    resumed = p.fresh_model()  # a new process: nothing but the checkpoint carries over
    resumed_state = train_steps(resumed, p.sequences, p.vocab_map, p.config, checkpoint, resume=True)

    assert resumed_state.step == straight_state.step == 12
    assert resumed_state.tokens_seen == straight_state.tokens_seen > 0
    assert resumed_state.losses == straight_state.losses
    final_straight, final_resumed = straight.state_dict(), resumed.state_dict()
    assert final_straight.keys() == final_resumed.keys()
    for name in final_straight:
        assert torch.equal(final_straight[name], final_resumed[name]), name
    # Not vacuous: the second half of training changed the weights.
    assert not torch.equal(halfway["head_bias"], final_resumed["head_bias"])
    assert not torch.equal(initial["blocks.0.q_proj.weight"], halfway["blocks.0.q_proj.weight"])


def test_without_resume_an_old_checkpoint_is_ignored(tmp_path, zoo_home, corpus, model_dirs):
    out = tmp_path / "out"
    target = str(model_dirs.target)
    config = tiny_config(corpus, steps=12, save_every=6)
    straight = train_drafter(config, zoo_home, out, resume=False, target_name=target)
    expected = load_file(str(out / "model.safetensors"))

    # A different run (10x the learning rate) leaves its step-6 checkpoint at this output's path.
    train_drafter(dataclasses.replace(config, steps=6, lr=3e-2), zoo_home, out, resume=False, target_name=target)
    # Control: resuming from it does change the result (so the comparison below can fail).
    continued = train_drafter(config, zoo_home, out, resume=True, target_name=target)
    assert continued["loss_curve"] != straight["loss_curve"]
    assert not torch.equal(load_file(str(out / "model.safetensors"))["head_bias"], expected["head_bias"])

    again = train_drafter(config, zoo_home, out, resume=False, target_name=target)
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert again["loss_curve"] == straight["loss_curve"]
    assert again["tokens_seen"] == straight["tokens_seen"]


# --- 3. export -> load round trip; drafting through the engine -----------------------------------


def trained_model(trained, model_dirs) -> ZooLM:
    """The trained float32 model, rebuilt from the run's final checkpoint."""
    data = torch.load(trained.checkpoint, map_location="cpu", weights_only=False)
    embedding = load_file(str(model_dirs.target / "model.safetensors"))["model.embed_tokens.weight"].float()
    model = ZooLM(ZooConfig(**trained.metadata["model"]), embedding, data["model"]["vocab_ids"])
    model.load_state_dict(data["model"])
    return model.eval()


@torch.inference_mode()
def test_export_load_round_trip(trained, model_dirs):
    loaded, metadata = load_zoo_model(trained.out, trained.home, target=str(model_dirs.target))
    assert metadata == json.loads((trained.out / "config.json").read_text())
    reference = trained_model(trained, model_dirs)
    assert torch.equal(loaded.vocab_ids, reference.vocab_ids)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 64, (2, 20), generator=gen)
    expected, got = reference(input_ids).logits, loaded(input_ids).logits  # (2, 20, 48)
    assert got.shape == expected.shape == (2, 20, 48)
    # The export stores every layer in float16 (model.safetensors): the loaded model must be exactly
    # the trained one with its weights rounded to float16. (Compared with the unrounded model, how
    # far a logit moves depends on the trained weights: one run in a full suite moved one by 0.027.)
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            if tensor.is_floating_point():
                tensor.copy_(tensor.half().float())
    torch.testing.assert_close(got, reference(input_ids).logits, rtol=1e-5, atol=1e-5)
    # And the rounding costs next to nothing: the greedy token is the float32 model's almost everywhere.
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


@torch.inference_mode()
def test_zoo_model_kv_cache_matches_full_forward(trained, model_dirs):
    """The drafter's own KV cache (incremental steps, rollback by crop) gives the logits of a
    full forward: a cache bug would silently cost acceptance."""
    model, _ = load_zoo_model(trained.out, trained.home, target=str(model_dirs.target))
    ids = torch.randint(3, 64, (1, 14), generator=torch.Generator().manual_seed(1))
    full = model(ids).logits[0]  # (14, 48)
    cache = model.new_cache()
    parts = [model(ids[:, :8], cache=cache).logits[0]]
    parts += [model(ids[:, t:t + 1], cache=cache).logits[0] for t in range(8, 11)]
    cache.crop(-3)  # roll back 3 positions, then redo them as one block
    assert cache.get_seq_length() == 8
    parts.append(model(ids[:, 8:14], cache=cache).logits[0])
    torch.testing.assert_close(torch.cat(parts[:1] + [parts[-1]]), full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(parts[1:4]), full[8:11], rtol=1e-4, atol=1e-4)


def training_prompts(trained) -> list[str]:
    """The prompts the drafter was distilled on (train_drafter's own selection)."""
    config = trained.config
    return collect_prompts([Path(p) for p in config.data], config.max_prompts, config.seed)


def test_zoo_drafter_through_the_engine_is_lossless(trained, engine, words):
    spec = f"zoo:{trained.out}"
    # Eight training prompts, not three: the teacher store this run writes differs from process to
    # process (same target weights; cause not found yet), and so does the trained drafter. Over three
    # prompts (~25 proposals) its acceptance ranged 0.09-0.50 in 14 runs, one under the 0.1 below;
    # over eight (~65 proposals) 0.27-0.42. The bar is unchanged, the estimate steadier.
    trained_on = training_prompts(trained)[:8]
    texts = trained_on + [" ".join(words[:5])]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=engine.stop_token_ids())
    seen = {1: [0, 0], 3: [0, 0], 5: [0, 0]}  # k -> [accepted, proposed] on the training prompts
    for n, text in enumerate(texts):
        prompt_ids = engine.encode_prompt(text)
        reference = engine.generate(prompt_ids, params, None).token_ids
        for k in (1, 3, 5):
            result = engine.generate(prompt_ids, params, spec, k=k)
            assert result.token_ids == reference, (text, k)
            assert {r.drafter for r in result.rounds} == {spec}
            if n < len(trained_on):
                seen[k][0] += sum(r.accepted for r in result.rounds)
                seen[k][1] += sum(r.proposed for r in result.rounds)
    assert isinstance(engine.drafter(spec), ZooDrafter)
    # The drafter is really used, and trained: an untrained one agrees with the target ~2% of the time.
    accepted, proposed = seen[1]
    assert proposed > 0 and accepted / proposed > 0.1, seen


@torch.inference_mode()
def test_zoo_proposals_are_real_token_ids(trained, engine):
    drafter = engine.drafter(f"zoo:{trained.out}")
    model = drafter.model
    vocab = set(model.vocab_ids.tolist())
    context = engine.encode_prompt(training_prompts(trained)[0])

    greedy = drafter.propose("zoo-ids-greedy", context, 4, SamplingParams(temperature=0.0))
    drafter.release("zoo-ids-greedy")
    assert 1 <= len(greedy.tokens) <= 4 and set(greedy.tokens) <= vocab  # may stop early (confidence)
    first_logits = model(torch.tensor([context])).logits[0, -1]  # (48,) reduced vocabulary
    assert greedy.tokens[0] == int(model.vocab_ids[first_logits.argmax()])  # index mapped to its id
    assert [q.token_ids.tolist() for q in greedy.q] == [[t] for t in greedy.tokens]

    sampled = drafter.propose("zoo-ids-sampled", context, 3, SamplingParams(temperature=1.0, seed=7))
    drafter.release("zoo-ids-sampled")
    top = first_logits.topk(drafter.top_k).indices
    assert sorted(sampled.q[0].token_ids.tolist()) == sorted(model.vocab_ids[top].tolist())
    for token, q in zip(sampled.tokens, sampled.q):
        assert set(q.token_ids.tolist()) <= vocab and token in q.token_ids.tolist()
        assert float(q.probs.sum()) == pytest.approx(1.0, abs=1e-5)


# --- 4. bad input: clear errors, nothing half-written ---------------------------------------------


def _empty(tmp: Path) -> str:
    (tmp / "empty.jsonl").write_text("")
    return str(tmp / "empty.jsonl")


def _blank(tmp: Path) -> str:
    (tmp / "blank.jsonl").write_text("\n  \n\n")
    return str(tmp / "blank.jsonl")


def _unknown_shape(tmp: Path) -> str:
    (tmp / "shape.jsonl").write_text(json.dumps({"title": "x", "body": "y"}) + "\n")
    return str(tmp / "shape.jsonl")


def _bad_json(tmp: Path) -> str:
    (tmp / "broken.jsonl").write_text(json.dumps({"question": "the cat", "answer": "a"}) + "\n{not json\n")
    return str(tmp / "broken.jsonl")


def _csv(tmp: Path) -> str:
    (tmp / "data.csv").write_text("a,b\n")
    return str(tmp / "data.csv")


def _a_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("not a folder")
    return tmp / "afile"


BUG_BATCH = ("batch_size < 1 is not validated: train_steps -> collate([]) raises a bare ValueError "
             "('max() arg is an empty sequence') after the teacher data is generated")
BUG_NEW_TOKENS = ("max_new_tokens < 1 is not validated: model.generate raises a bare ValueError from "
                  "transformers inside generate_teacher")
BUG_PROMPTS = ("max_prompts < 1 is not validated: collect_prompts returns [] and the run fails late, "
               "after loading the target, with TrainingError 'the target produced no teacher data'")

# case -> (data maker or None for the shared corpus, out maker or None, config overrides, error, fragments)
BAD_TRAINING = {
    "missing-corpus": (lambda t: str(t / "nope.jsonl"), None, {}, InvalidArgument, ["nope.jsonl", "does not exist"]),
    "no-corpus": ("none", None, {}, InvalidArgument, ["--data"]),
    "empty-corpus": (_empty, None, {}, InvalidArgument, ["no prompts", "empty", "empty.jsonl"]),
    "blank-corpus": (_blank, None, {}, InvalidArgument, ["no prompts", "blank.jsonl"]),
    "unknown-json-shape": (_unknown_shape, None, {}, InvalidArgument, ["shape.jsonl:1", "unrecognised"]),
    "bad-json-line": (_bad_json, None, {}, InvalidArgument, ["broken.jsonl:2", "not a JSON line"]),
    "unsupported-file": (_csv, None, {}, InvalidArgument, ["data.csv", "unsupported"]),
    "unknown-domain": (None, None, {"domain": "nosuch"}, NotFound, ["'nosuch'", "known domains", "chat", "code"]),
    "steps-0": (None, None, {"steps": 0}, InvalidArgument, ["--steps must be >= 1", "got 0"]),
    "out-below-a-file": (None, lambda t: _a_file(t) / "out", {}, InvalidArgument, ["afile/out", "not writable"]),
    "out-is-a-file": (None, _a_file, {}, InvalidArgument, ["afile", "not writable"]),
}
BAD_TRAINING_SIZES = {
    "batch-size-0": (None, None, {"batch_size": 0}, InvalidArgument, ["batch"], ValueError, BUG_BATCH),
    "max-new-tokens-0": (None, None, {"max_new_tokens": 0}, InvalidArgument, ["max-new-tokens"], ValueError, BUG_NEW_TOKENS),
    "max-prompts-0": (None, None, {"max_prompts": 0}, InvalidArgument, ["max-prompts"], TrainingError, BUG_PROMPTS),
}


def _bad_training_params():
    cases = {**BAD_TRAINING, **{name: tuple(case[:-2]) for name, case in BAD_TRAINING_SIZES.items()}}
    return [pytest.param(*case, id=name) for name, case in cases.items()]


@pytest.mark.parametrize("make_data, make_out, overrides, error, fragments", _bad_training_params())
def test_bad_training_input(tmp_path, zoo_home, corpus, model_dirs, make_data, make_out, overrides, error, fragments):
    if make_data == "none":
        data: tuple[str, ...] = ()
    else:
        data = (make_data(tmp_path),) if make_data is not None else (str(corpus),)
    out = make_out(tmp_path) if make_out is not None else tmp_path / "drafters" / "chat"
    before = out.read_bytes() if out.is_file() else None
    config = dataclasses.replace(tiny_config(corpus), data=data, **overrides)
    with pytest.raises(error) as info:
        train_drafter(config, zoo_home, out, resume=False, target_name=str(model_dirs.target))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    if before is not None:
        assert out.read_bytes() == before  # the file in the way is left alone
    else:
        assert_nothing_half_written(out)


@pytest.fixture(scope="module")
def real_checkpoint(trained) -> bytes:
    return trained.checkpoint.read_bytes()


def _wrong_shape(real: bytes, path: Path) -> None:
    data = torch.load(io.BytesIO(real), map_location="cpu", weights_only=False)
    data["model"]["head_bias"] = torch.zeros(7)  # a checkpoint of another vocabulary size
    torch.save(data, path)


CORRUPTIONS = {
    "garbage": lambda real, path: path.write_bytes(b"\x00garbage, not a checkpoint\xff" * 40),
    "empty": lambda real, path: path.write_bytes(b""),
    "truncated": lambda real, path: path.write_bytes(real[: len(real) // 2]),
    "not-a-checkpoint-dict": lambda real, path: torch.save([1, 2, 3], path),
    "incompatible-shapes": _wrong_shape,
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_checkpoint(tmp_path, trained, real_checkpoint, model_dirs, corruption):
    out = tmp_path / "out"
    checkpoint = checkpoint_path(trained.home, out, "chat")
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    CORRUPTIONS[corruption](real_checkpoint, checkpoint)
    corrupted = checkpoint.read_bytes()

    with pytest.raises(TrainingError) as info:
        train_drafter(trained.config, trained.home, out, resume=True, target_name=str(model_dirs.target))
    message = str(info.value)
    assert str(checkpoint) in message and "corrupted or incompatible" in message
    assert "delete it" in message and "without --resume" in message  # what to do
    assert_nothing_half_written(out)
    assert checkpoint.read_bytes() == corrupted  # a failed run leaves the evidence alone
    assert hidden_leftovers(checkpoint.parent) == []

    if corruption == "garbage":  # the advice works: without --resume the run starts over
        metadata = train_drafter(trained.config, trained.home, out, resume=False, target_name=str(model_dirs.target))
        assert model_files_in(out) == MODEL_FILES and metadata["steps"] == trained.config.steps
        assert torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]["step"] == trained.config.steps


def test_failed_export_leaves_the_previous_drafter_intact(tmp_path, trained, model_dirs, monkeypatch):
    """A write that fails half-way (disk full) removes its temporary folder and leaves the
    folder it was replacing untouched."""
    out = tmp_path / "chat"
    shutil.copytree(trained.out, out)
    before = {name: (out / name).read_bytes() for name in MODEL_FILES}
    model, metadata = load_zoo_model(trained.out, trained.home, target=str(model_dirs.target))

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specpool.learning.zoo_train.save_file", disk_full)
    with pytest.raises(OSError):
        export_drafter(model, out, metadata, "card")
    assert {name: (out / name).read_bytes() for name in model_files_in(out)} == before
    assert hidden_leftovers(tmp_path) == []


def test_existing_unrelated_folder_is_not_wiped(tmp_path, zoo_home, corpus, model_dirs):
    out = tmp_path / "my-folder"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    try:
        train_drafter(tiny_config(corpus, steps=2), zoo_home, out, resume=False, target_name=str(model_dirs.target))
    except InvalidArgument as exc:  # refusing a non-drafter folder is fine too
        assert str(out) in str(exc)
    assert (out / "notes.txt").read_text() == "precious"


# --- 5. the command line --------------------------------------------------------------------------






# case -> (arguments after "zoo train"; "{corpus}" and "{tmp}" are filled in, fragments of the error)
BAD_CLI = {
    "unknown-domain": (["--domain", "nosuch", "--data", "X"], ["unknown domain 'nosuch'", "known domains", "chat"]),
    "no-data": (["--domain", "chat"], ["--data", "--data-root"]),
    "data-and-data-root": (["--domain", "chat", "--data", "{corpus}", "--data-root", "{tmp}"], ["either --data"]),
    "missing-corpus": (["--domain", "chat", "--data", "{tmp}/nope.jsonl"], ["nope.jsonl", "does not exist"]),
    "empty-corpus": (["--domain", "chat", "--data", "{tmp}/empty.jsonl", "--out", "{tmp}/out"], ["no prompts"]),
    "out-below-a-file": (["--domain", "chat", "--data", "{corpus}", "--out", "{tmp}/afile/sub/out"], ["not writable"]),
    "steps-0": (["--domain", "chat", "--data", "{corpus}", "--steps", "0", "--out", "{tmp}/out"], ["--steps must be >= 1"]),
    "steps-not-int": (["--domain", "chat", "--data", "{corpus}", "--steps", "many"], ["invalid int value: 'many'"]),
    "no-domain": (["--data", "{corpus}"], ["--domain"]),
    "reduced-vocab-0": (["--domain", "chat", "--data", "{corpus}", "--reduced-vocab", "0", "--out", "{tmp}/out"],
                        ["--reduced-vocab must be >= 1", "got 0"]),
}
BAD_CLI_SIZES = {
    "batch-size-0": (["--domain", "chat", "--data", "{corpus}", "--batch-size", "0", "--max-prompts", "4",
                      "--max-new-tokens", "3", "--out", "{tmp}/out"], ["batch"], ValueError, BUG_BATCH),
    "max-new-tokens-0": (["--domain", "chat", "--data", "{corpus}", "--max-new-tokens", "0", "--max-prompts", "4",
                          "--out", "{tmp}/out"], ["max-new-tokens"], ValueError, BUG_NEW_TOKENS),
}


def _bad_cli_params():
    cases = {**BAD_CLI, **{name: tuple(case[:-2]) for name, case in BAD_CLI_SIZES.items()}}
    return [pytest.param(*case, id=name) for name, case in cases.items()]


@pytest.mark.parametrize("args, fragments", _bad_cli_params())
def test_zoo_train_cli_bad_input(cli, tmp_path, corpus, args, fragments):
    (tmp_path / "empty.jsonl").write_text("")
    _a_file(tmp_path)
    argv = [a.format(corpus=corpus, tmp=tmp_path) for a in args]
    code, out, err = cli("zoo", "train", *argv)
    assert_one_line_error(code, err, *fragments)
    assert out == ""
    assert not (tmp_path / "home" / "zoo" / "drafters" / "chat").exists()
    assert model_files_in(tmp_path / "out") == [] and hidden_leftovers(tmp_path) == []


def test_zoo_train_cli_success(cli, tmp_path, corpus):
    code, out, err = cli("zoo", "train", "--domain", "chat", "--data", str(corpus), "--steps", "4",
                         "--max-prompts", "8", "--max-new-tokens", "6", "--batch-size", "2")
    assert code == 0, err
    folder = tmp_path / "home" / "zoo" / "drafters" / "chat"  # the default --out
    assert str(folder) in out and "steps 4" in out
    assert model_files_in(folder) == MODEL_FILES
    config = json.loads((folder / "config.json").read_text())
    assert config["steps"] == 4 and config["teacher_prompts"] == 8
    assert config["model"]["reduced_vocab"] == 64  # the default 8192 capped at the target's vocabulary
    assert hidden_leftovers(folder.parent) == []


# --- pure helpers ---------------------------------------------------------------------------------


def test_batch_indices_are_seeded_permutations_per_epoch():
    n, batch = 10, 3
    stream = [i for step in range(10) for i in batch_indices(step, n, batch, seed=5)]  # 3 epochs
    for epoch in range(3):
        assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n)), epoch
    assert stream[:n] != stream[n:2 * n]  # each epoch is its own permutation
    assert batch_indices(4, n, batch, seed=5) == stream[12:15]  # any step's batch, without replay
    assert [batch_indices(s, n, batch, seed=5) for s in range(10)] == [batch_indices(s, n, batch, seed=5) for s in range(10)]
    assert [batch_indices(s, n, batch, seed=6) for s in range(4)] != [batch_indices(s, n, batch, seed=5) for s in range(4)]
    assert sorted(batch_indices(0, 4, 8, seed=0)[4:]) == [0, 1, 2, 3]  # a batch larger than an epoch


def test_distillation_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, math.log(3.0), 0.0]], requires_grad=True)  # q1 = 1/5, 3/5, 1/5
    ids = torch.tensor([[0, -1], [1, 2]])  # -1: teacher token outside the reduced vocabulary
    probs = torch.tensor([[0.7, 0.3], [0.5, 0.5]])
    loss = distillation_loss(logits, ids, probs)
    expected = (0.7 * math.log(3.0) + -(0.5 * math.log(3 / 5) + 0.5 * math.log(1 / 5))) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    # Shifting a row's logits changes nothing (log-softmax); a row with no matchable token costs 0.
    shifted = distillation_loss(logits.detach() + torch.tensor([[5.0], [-2.0]]), ids, probs)
    assert float(shifted) == pytest.approx(expected, abs=1e-5)
    none = distillation_loss(torch.zeros(1, 3), torch.tensor([[-1, -1]]), torch.tensor([[0.6, 0.4]]))
    assert float(none) == 0.0


def make_sequence(prompt: list[int], answer: list[int], k: int = 2) -> Sequence:
    labels = torch.tensor([[t] + [(t + 1 + j) % 64 for j in range(k - 1)] for t in answer])  # (A, K)
    probs = torch.tensor([[0.8] + [0.2 / (k - 1)] * (k - 1)] * len(answer))
    return Sequence(torch.tensor(prompt + answer), len(prompt), labels, probs)


def test_trim_context():
    seq = make_sequence([1, 10, 11, 12, 13, 14], [20, 21, 22, 2])
    trimmed = trim_context(seq, 4)
    assert trimmed.tokens.tolist() == [11, 12, 13, 14, 20, 21, 22, 2]
    assert trimmed.answer_start == 4
    assert torch.equal(trimmed.label_ids, seq.label_ids) and torch.equal(trimmed.label_probs, seq.label_probs)
    assert trim_context(seq, 6) is seq and trim_context(seq, 100) is seq
    one = trim_context(seq, 1)
    assert one.tokens.tolist() == [14, 20, 21, 22, 2] and one.answer_start == 1


def test_collate_aligns_labels_with_the_positions_that_predict_them():
    vocab_map = torch.full((64,), -1, dtype=torch.long)
    vocab_map[torch.tensor([2, 20, 21, 22, 23])] = torch.arange(5)
    long = make_sequence([1, 10, 11], [20, 21, 22])
    short = make_sequence([1, 12], [23])
    inputs, ids, probs, mask = collate([long, short], vocab_map)
    assert inputs.tolist() == [[1, 10, 11, 20, 21], [1, 12, 0, 0, 0]]
    assert mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    assert ids[0, 2, 0] == vocab_map[20] and ids[0, 4, 0] == vocab_map[22] and ids[1, 1, 0] == vocab_map[23]
    assert ids[0, 2, 1] == vocab_map[21]  # second teacher choice
    assert ids[1, 1, 1] == -1  # teacher's second choice for 23 is 24, outside the reduced vocabulary
    assert (ids[~mask] == -1).all() and (probs[~mask] == 0).all()


def test_build_vocab():
    seqs = [
        Sequence(torch.tensor([1, 5, 5, 9, 40]), 3, torch.tensor([[10, 11], [12, 10]]), torch.tensor([[0.6, 0.4], [0.9, 0.1]])),
        Sequence(torch.tensor([1, 5, 30]), 2, torch.tensor([[30, 31]]), torch.tensor([[0.5, 0.5]])),
    ]
    # mass: 10: 0.7, 11: 0.4, 12: 0.9, 30: 0.5 (+seen), 31: 0.5; text: 5 seen 3x, 1 2x, others once.
    vocab = build_vocab(seqs, size=6, vocab_size=64, always=(2,))
    assert vocab.tolist() == [2, 10, 11, 12, 30, 31]  # sorted; stop id 2 in with no mass at all
    assert vocab.dtype == torch.long
    bigger = build_vocab(seqs, size=8, vocab_size=64, always=(2,))
    assert bigger.tolist() == [1, 2, 5, 10, 11, 12, 30, 31]  # ties broken towards seen text
    small = build_vocab(seqs, size=3, vocab_size=64, always=(2, 3))
    assert small.tolist() == [2, 3, 12]
    assert len(build_vocab(seqs, size=64, vocab_size=64, always=(2,)).unique()) == 64


def test_zoo_config_for_the_tiny_target(target_lm, corpus):
    model, _ = target_lm
    config = zoo_config_for(model.config, tiny_config(corpus, reduced_vocab=8192, intermediate_size=768, num_layers=3))
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (32, 4, 2, 8)
    assert config.reduced_vocab == 64 and config.intermediate_size == 64 and config.num_layers == 3
    assert config.max_positions == 256 and config.rms_eps == model.config.rms_norm_eps


# --- corpus formats ---------------------------------------------------------------------------------

PY_SOURCE = '''
def add(a, b):
    """Return the sum of a and b, as a plain number."""
    return a + b


def no_docstring(x):
    return x


class Box:
    def area(self, width, height):
        """Area of a width by height rectangle, in square units."""
        return width * height
'''


def test_read_prompts_python_files(tmp_path):
    (tmp_path / "funcs.py").write_text(PY_SOURCE)
    prompts = read_prompts(tmp_path / "funcs.py")
    assert len(prompts) == 2
    stub = 'def add(a, b):\n    """Return the sum of a and b, as a plain number."""'
    assert prompts[0] == CODE_INSTRUCTION.format(stub=stub)
    assert prompts[0].startswith("Complete the following Python function.")
    assert all("return" not in p for p in prompts)  # bodies left out
    assert 'def area(self, width, height):\n    """Area of a width' in prompts[1]  # method dedented
    (tmp_path / "broken.py").write_text("def oops(:\n")
    assert read_prompts(tmp_path / "broken.py") == []


JSON_FORMATS = {
    "gsm8k": ({"question": "How many cats?", "answer": "Two. #### 2"}, "How many cats?"),
    "math": ({"problem": "Solve x + 1 = 2.", "solution": "x = 1"}, "Solve x + 1 = 2."),
    "svamp": ({"Body": " Tom has 3 apples. ", "Question": "How many now? "}, "Tom has 3 apples. How many now?"),
    "t0": ({"prompt": "Summarize: the cat sat.\n\n", "completion": "cat"}, "Summarize: the cat sat."),
    "instruction": ({"instruction": "Sort these.", "instances": [{"input": "b a", "output": "a b"}]}, "Sort these.\n\nb a"),
    "instruction-no-input": ({"instruction": "Say hi.", "instances": [{"input": "", "output": "hi"}]}, "Say hi."),
    "spec-bench": ({"question_id": 1, "turns": ["First turn?", "Second?"]}, "First turn?"),
    "mbpp": ({"text": "Add two numbers.", "code": "def add(a, b):\r\n    return a + b"},
             CODE_INSTRUCTION.format(stub='def add(a, b):\n    """ Add two numbers.\n    """')),
}


@pytest.mark.parametrize("fmt", list(JSON_FORMATS))
def test_read_prompts_json_formats(tmp_path, fmt):
    record, expected = JSON_FORMATS[fmt]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(record) + "\n\n" + json.dumps(record) + "\n")  # blank lines are skipped
    assert read_prompts(path) == [expected, expected]


def test_read_prompts_text_formats(tmp_path):
    src = tmp_path / "src-train.txt"
    src.write_text("the cat sat\n\n  a dog ran  \n")
    assert read_prompts(src) == ["Translate English to German: the cat sat", "Translate English to German: a dog ran"]
    prose = tmp_path / "story.txt"
    prose.write_text("\n".join(f"line {i}" for i in range(19)))  # passages at lines 0 and 8
    passages = read_prompts(prose)
    assert passages[0] == "Continue the text: line 0 line 1 line 2 line 3"
    assert all(p.startswith("Continue the text: ") for p in passages) and len(passages) == 2


def test_short_prose_file_gives_a_prompt(tmp_path):
    prose = tmp_path / "short.txt"
    prose.write_text("the cat sat on the mat\nthe dog ran to the house\n")
    assert read_prompts(prose) == ["Continue the text: the cat sat on the mat the dog ran to the house"]


def test_read_prompts_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n\n{oops\n")
    with pytest.raises(InvalidArgument, match=r"bad\.jsonl:3: not a JSON line"):
        read_prompts(bad)
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n" + json.dumps({"x": 1}) + "\n")
    with pytest.raises(InvalidArgument, match=r"odd\.jsonl:2: unrecognised record keys \['x'\]"):
        read_prompts(odd)
    with pytest.raises(InvalidArgument, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(InvalidArgument, match="unsupported corpus file type"):
        read_prompts(tmp_path / "table.csv")


def test_read_prompts_folder(tmp_path):
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text(PY_SOURCE)
    (folder / "sub" / "b.jsonl").write_text(json.dumps({"question": "Why?", "answer": "Because."}) + "\n")
    (folder / "LICENSE.txt").write_text("\n".join(["license text"] * 20))
    (folder / "notes.md").write_text("ignored")
    prompts = read_prompts(folder)
    assert len(prompts) == 3 and prompts[-1] == "Why?"
    assert not any("license" in p for p in prompts)


def test_collect_prompts(tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"question": f"big {i}", "answer": "a"}) + "\n" for i in range(10)))
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"question": q, "answer": "a"}) + "\n" for q in ["small 0", "small 1", "big 3", "  "]))
    chosen = collect_prompts([big, small], limit=6, seed=0)
    assert len(chosen) == 6 and len(set(chosen)) == 6
    assert {"small 0", "small 1"} <= set(chosen)  # a small corpus is not drowned by a big one
    assert "  " not in chosen and chosen.count("big 3") <= 1  # blanks and duplicates dropped
    assert collect_prompts([big, small], limit=6, seed=0) == chosen
    assert collect_prompts([big], limit=10, seed=1) != collect_prompts([big], limit=10, seed=2)
    assert sorted(collect_prompts([big], limit=100, seed=1)) == sorted(f"big {i}" for i in range(10))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question": "x" * (MAX_PROMPT_CHARS + 50), "answer": "a"}) + "\n")
    assert [len(p) for p in collect_prompts([long], 5, 0)] == [MAX_PROMPT_CHARS]
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InvalidArgument, match="no prompts found"):
        collect_prompts([tmp_path / "empty.jsonl"], 5, 0)


def test_domains():
    assert set(DOMAINS) == {"code", "math", "translation", "summarization_qa", "chat", "general"}


# --- the n-gram drafter's draft length ------------------------------------------------------------

DRAFT_LENGTHS = [  # (acceptance, k_max, cost per draft token, best k)
    (0.0, 5, 0.12, 1),
    (0.1, 5, 0.12, 1),
    (0.0, 5, 0.0, 1),  # nothing to gain: the shortest draft
    (0.9, 5, 10.0, 1),  # verifying is dear
    (0.99, 5, 0.01, 5),
    (1.0, 8, 0.0, 8),
    (0.95, 32, 0.12, 14),
    (0.8, 1, 0.12, 1),
]


@pytest.mark.parametrize("acceptance, k_max, cost, expected", DRAFT_LENGTHS)
def test_best_draft_length(acceptance, k_max, cost, expected):
    assert best_draft_length(acceptance, k_max, cost) == expected


def test_best_draft_length_matches_brute_force_and_is_monotone():
    def brute(a, k_max, c):
        values = [sum(a ** i for i in range(k + 1)) / (1 + c * k) for k in range(1, k_max + 1)]
        return 1 + max(range(k_max), key=lambda i: (values[i] - 1e-9 * i))

    for cost in (0.05, 0.12, 0.3):
        lengths = [best_draft_length(a / 50, 10, cost) for a in range(51)]
        assert lengths == sorted(lengths), (cost, lengths)  # more acceptance, never a shorter draft
        assert lengths[0] == 1 and lengths[-1] == 10
        assert lengths == [brute(a / 50, 10, cost) for a in range(51)]


# --- held-out selection, time limits, teacher-only, device ------------------------------------


def test_split_heldout_is_a_function_of_each_prompt():
    prompts = [f"prompt number {i}" for i in range(400)]
    train, heldout = split_heldout(prompts)
    assert sorted(train + heldout) == sorted(prompts) and not set(train) & set(heldout)
    assert 8 <= len(heldout) <= 40  # ~5 %
    # Any order or superset of the corpus holds out the same prompts.
    shuffled = prompts[::-1] + [f"another {i}" for i in range(50)]
    assert set(heldout) <= set(split_heldout(shuffled)[1])
    assert split_heldout(prompts[:19]) == (prompts[:19], [])  # too few to hold any out


def _permuted_labels(sequences: list[Sequence], vocab_size: int) -> list[Sequence]:
    """The same sequences with every teacher label moved to another token."""
    return [Sequence(s.tokens, s.answer_start, (s.label_ids + 7) % vocab_size, s.label_probs) for s in sequences]


def test_heldout_selection_ships_the_best_checked_weights(pipeline, monkeypatch):
    """Held-out losses injected as 3, 1, 2, 4 at steps 3, 6, 9, 12: the model must end with the
    weights it had at step 6 (those of an identical run stopped there), not step 12's."""
    p = pipeline
    config = dataclasses.replace(p.config, steps=12, save_every=3)
    reference = p.fresh_model()
    train_steps(reference, p.sequences, p.vocab_map, config, checkpoint=None, resume=False, until=6)

    injected = iter([3.0, 1.0, 2.0, 4.0])
    monkeypatch.setattr("specpool.learning.zoo_train.heldout_loss", lambda *args, **kwargs: next(injected))
    model = p.fresh_model()
    state = train_steps(model, p.sequences, p.vocab_map, config, None, False, heldout=p.sequences[:2])
    assert state.val_losses == [3.0, 1.0, 2.0, 4.0] and state.best_step == 6 and state.step == 12
    for name, value in reference.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_heldout_loss_is_the_distillation_loss_on_those_sequences(pipeline):
    p = pipeline
    model = p.fresh_model()
    own = heldout_loss(model, p.sequences[:4], p.vocab_map, p.config)
    other = heldout_loss(model, _permuted_labels(p.sequences[:4], p.vocab_map.shape[0]), p.vocab_map, p.config)
    assert math.isfinite(own) and own > 0 and own != pytest.approx(other)


def test_resume_with_heldout_selects_exactly_as_a_straight_run(pipeline, tmp_path):
    p = pipeline
    heldout = _permuted_labels(p.sequences[:4], p.vocab_map.shape[0])
    config = dataclasses.replace(p.config, steps=12, save_every=3)
    straight = p.fresh_model()
    straight_state = train_steps(straight, p.sequences, p.vocab_map, config, None, False, heldout=heldout)
    checkpoint = tmp_path / "run.pt"
    train_steps(p.fresh_model(), p.sequences, p.vocab_map, config, checkpoint, False, until=6, heldout=heldout)
    resumed = p.fresh_model()
    resumed_state = train_steps(resumed, p.sequences, p.vocab_map, config, checkpoint, True, heldout=heldout)
    assert resumed_state.val_losses == straight_state.val_losses
    assert resumed_state.best_step == straight_state.best_step
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_time_limit_stops_at_a_checkpoint_and_resume_finishes(pipeline, tmp_path):
    p = pipeline
    config = dataclasses.replace(p.config, steps=12, save_every=3, time_limit_s=1e-6)
    checkpoint = tmp_path / "run.pt"
    state = train_steps(p.fresh_model(), p.sequences, p.vocab_map, config, checkpoint, False)
    assert state.step == 3 and state.stopped_by_time_limit
    unlimited = dataclasses.replace(config, time_limit_s=0.0)
    resumed = train_steps(p.fresh_model(), p.sequences, p.vocab_map, unlimited, checkpoint, True)
    assert resumed.step == 12 and not resumed.stopped_by_time_limit


def test_teacher_only_then_a_teacher_time_limit_trains_on_what_is_answered(tmp_path, corpus, model_dirs):
    home, target = tmp_path / "home", str(model_dirs.target)
    out = tmp_path / "out"
    few = tiny_config(corpus, max_prompts=6, steps=2)
    summary = train_drafter(few, home, out, resume=False, target_name=target, teacher_only=True)
    assert summary["teacher_prompts"] == 6 and summary["teacher_tokens"] > 0
    assert not out.exists()  # teacher-only writes no drafter
    # 12 prompts asked, no time to answer new ones: trains on the 6 answered before.
    more = tiny_config(corpus, max_prompts=12, steps=2, teacher_time_limit_s=1e-9)
    metadata = train_drafter(more, home, out, resume=False, target_name=target)
    assert metadata["teacher_prompts"] == 6
    assert metadata["device"] == "cpu" and model_files_in(out) == MODEL_FILES


def test_teacher_shards_are_named_by_their_prompts(tmp_path, corpus, model_dirs):
    """Two runs filling one store (as parallel domain runs do) never overwrite each other."""
    config = tiny_config(corpus, teacher_batch=4)
    target, tokenizer = load_causal_lm(ModelConfig(str(model_dirs.target)), tmp_path)
    prompts = collect_prompts([Path(p) for p in config.data], 12, 0)
    store = tmp_path / "store"
    stop_ids = (tokenizer.eos_token_id,)
    generate_teacher(target, tokenizer, prompts[:4], store, config, stop_ids)
    generate_teacher(target, tokenizer, prompts[4:8], store, config, stop_ids)
    index = generate_teacher(target, tokenizer, prompts[:8], store, config, stop_ids)  # nothing new
    assert len(list(store.glob("shard-*.safetensors"))) == 2
    assert len(load_teacher(prompts[:8], index)) == 8


def test_rope_tables_follow_the_positions_device():
    """Regression: the inverse frequencies were made on the CPU, so a drafter on a GPU failed."""
    cos, sin = rope_tables(ZooConfig(hidden_size=32, num_heads=4), torch.arange(5, device="meta"))
    assert cos.device.type == "meta" and cos.shape == (5, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_zoo_train_cli_cuda_without_a_gpu(cli, corpus, tmp_path):
    code, out, err = cli("zoo", "train", "--domain", "chat", "--data", str(corpus), "--device", "cuda",
                         "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "cuda", "no CUDA GPU")
    assert model_files_in(tmp_path / "out") == []


@pytest.mark.parametrize("flag, value", [("--lr", "0"), ("--teacher-batch", "0"), ("--save-every", "0"),
                                         ("--context-tokens", "0"), ("--warmup", "0")])
def test_zoo_train_cli_bad_training_options(cli, corpus, tmp_path, flag, value):
    code, out, err = cli("zoo", "train", "--domain", "chat", "--data", str(corpus), flag, value,
                         "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, flag)
    assert model_files_in(tmp_path / "out") == []


# --- starting from a trained drafter (--init-from) -----------------------------------------------


def test_init_from_a_trained_drafter_copies_blocks_norm_and_mapped_biases(trained, pipeline, model_dirs):
    """The new run's vocabulary differs from the source's (some tokens dropped, others added):
    blocks and norm are the source's; a shared token keeps its bias, a new one gets the median."""
    from specpool.learning.zoo_train import init_from_drafter

    source, _ = load_zoo_model(trained.out, trained.home, target=str(model_dirs.target))
    model = pipeline.fresh_model()
    vocab = model.vocab_ids.clone()
    outside = [t for t in range(model.vocab_size) if t not in set(source.vocab_ids.tolist())][:5]
    vocab[-len(outside):] = torch.tensor(outside)  # tokens the source never had
    model = ZooLM(model.config, model.embedding, vocab)
    init_from_drafter(model, str(trained.out), trained.home, str(model_dirs.target))
    for name, value in source.blocks.state_dict().items():
        assert torch.equal(model.blocks.state_dict()[name], value), name
    assert torch.equal(model.norm.weight, source.norm.weight)
    row = {int(t): i for i, t in enumerate(source.vocab_ids)}
    median = float(source.head_bias.detach().median())
    for i, token in enumerate(model.vocab_ids.tolist()):
        want = float(source.head_bias[row[token]].detach()) if token in row else median
        assert float(model.head_bias[i].detach()) == pytest.approx(want), token
    assert sum(t not in row for t in model.vocab_ids.tolist()) >= len(outside)


def test_init_from_refuses_a_drafter_of_another_shape(trained, pipeline, model_dirs):
    from specpool.learning.zoo_train import init_from_drafter

    model = pipeline.fresh_model()
    deeper = ZooLM(dataclasses.replace(model.config, num_layers=model.config.num_layers + 1), model.embedding, model.vocab_ids)
    with pytest.raises(InvalidArgument, match="num_layers"):
        init_from_drafter(deeper, str(trained.out), trained.home, str(model_dirs.target))


def test_init_from_an_unknown_drafter_fails_before_any_work(tmp_path, zoo_home, corpus, model_dirs):
    out = tmp_path / "out"
    with pytest.raises(NotFound, match="no-such-drafter"):
        train_drafter(tiny_config(corpus, init_from="no-such-drafter"), tmp_path / "home", out, resume=False,
                      target_name=str(model_dirs.target))
    assert not (tmp_path / "home").exists()  # no teacher store, no checkpoint
    assert_nothing_half_written(out)


def test_init_from_checks_the_starting_weights_on_the_heldout_set(pipeline, monkeypatch):
    """Started from a trained drafter, the starting weights are a held-out candidate (step 0): if
    no later check beats them, the run ships them unchanged."""
    p = pipeline
    config = dataclasses.replace(p.config, steps=6, save_every=3, init_from="general")
    start = p.fresh_model()
    before = {k: v.clone() for k, v in start.state_dict().items()}
    injected = iter([1.0, 2.0, 3.0])
    monkeypatch.setattr("specpool.learning.zoo_train.heldout_loss", lambda *args, **kwargs: next(injected))
    state = train_steps(start, p.sequences, p.vocab_map, config, None, False, heldout=p.sequences[:2])
    assert state.val_losses == [1.0, 2.0, 3.0] and state.best_step == 0 and state.step == 6
    for name, value in before.items():
        assert torch.equal(value, start.state_dict()[name]), name


def test_init_from_through_the_cli(cli, trained, tmp_path, corpus):
    common = ["zoo", "train", "--domain", "chat", "--data", str(corpus), "--steps", "4", "--max-prompts", "8",
              "--max-new-tokens", "6", "--batch-size", "2"]
    code, out, err = cli(*common, "--init-from", "nope")
    assert_one_line_error(code, err, "--init-from 'nope'", "shipped zoo drafter")
    code, out, err = cli(*common, "--init-from", str(trained.out))
    assert code == 0, err
    config = json.loads((tmp_path / "home" / "zoo" / "drafters" / "chat" / "config.json").read_text())
    assert config["train_config"]["init_from"] == str(trained.out) and config["steps"] == 4
