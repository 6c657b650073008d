"""The embedded engine and model loading on the tiny model folders."""

from __future__ import annotations

import pytest
import torch

from specpool.drafters.ngram import NGramDrafter
from specpool.core.errors import IncompatibleModels, InvalidArgument, ModelUnavailable, NotFound
from specpool.services.engine import EmbeddedEngine, EngineConfig
from specpool.target.models import (
    ModelConfig,
    check_same_tokenizer,
    context_window,
    load_causal_lm,
    resolve_model,
    tokenizer_fingerprint,
)
from specpool.target.sampling import SamplingParams

# -- model loading -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, dtype",
    [
        (ModelConfig("x"), torch.float32),
        (ModelConfig("x", device="cuda"), torch.bfloat16),
        (ModelConfig("x", device="cuda:1"), torch.bfloat16),
        (ModelConfig("x", dtype="float16"), torch.float16),
        (ModelConfig("x", device="cuda", dtype="float32"), torch.float32),
        (ModelConfig("x", dtype="bfloat16"), torch.bfloat16),
    ],
)
def test_model_config_dtype(config, dtype):
    assert config.torch_dtype() == dtype


def test_model_config_bad_dtype():
    with pytest.raises(InvalidArgument, match="unknown dtype 'float13'"):
        ModelConfig("x", dtype="float13").torch_dtype()


def test_load_with_a_bad_dtype_is_an_invalid_argument(model_dirs, home):
    """A bad dtype is the caller's mistake (INVALID_ARGUMENT), not an unavailable model: the
    message must not send the user looking for a different model folder."""
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        load_causal_lm(ModelConfig(str(model_dirs.target), dtype="float13"), home)


def test_load_causal_lm(target_lm, model_dirs, home):
    model, tokenizer = target_lm
    assert not model.training
    assert model.dtype == torch.float32
    assert context_window(model) == 256
    assert model.config.vocab_size == 64
    assert resolve_model(str(model_dirs.target), home) == str(model_dirs.target)


def test_resolve_model_errors(tmp_path, home):
    folder = tmp_path / "empty"
    folder.mkdir()
    with pytest.raises(ModelUnavailable, match="no config.json"):
        resolve_model(str(folder), home)
    with pytest.raises(ModelUnavailable):
        load_causal_lm(ModelConfig(str(tmp_path / "missing")), home)
    assert resolve_model("some-org/some-model", home) == "some-org/some-model"  # a hub id


def test_tokenizer_fingerprints(model_dirs, home, target_lm, noisy_lm):
    from transformers import AutoTokenizer

    same = tokenizer_fingerprint(target_lm[1])
    assert same == tokenizer_fingerprint(noisy_lm[1])
    assert same == tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(model_dirs.target)))
    other = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(model_dirs.other)))
    assert other != same
    check_same_tokenizer(same, same, "d")
    with pytest.raises(IncompatibleModels, match="different tokenizer") as info:
        check_same_tokenizer(same, other, "d")
    assert isinstance(info.value, InvalidArgument)


# -- engine -----------------------------------------------------------------------------------------


def test_engine_encode_prompt(engine, target_lm):
    _, tokenizer = target_lm
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        engine.encode_prompt("  \t\n")
    raw = engine.encode_prompt("the cat sat", raw=True)
    assert raw == [1] + tokenizer.convert_tokens_to_ids(["the", "cat", "sat"])
    chat = engine.encode_prompt("the cat sat")
    assert isinstance(chat, list) and all(isinstance(t, int) for t in chat)
    assert chat == tokenizer.convert_tokens_to_ids(["the", "cat", "sat"])  # the template adds no bos


def test_engine_stop_token_ids(engine):
    assert engine.stop_token_ids() == (2,)


def test_engine_drafters_are_built_once_and_checked(engine, model_dirs):
    first = engine.drafter("ngram:2-3")
    assert isinstance(first, NGramDrafter)
    assert engine.drafter("ngram:2-3") is first
    noisy = engine.drafter(f"hf:{model_dirs.noisy}")
    assert noisy.tokenizer_fingerprint == engine.verifier.tokenizer_fingerprint
    with pytest.raises(IncompatibleModels):
        engine.drafter(f"hf:{model_dirs.other}")
    with pytest.raises(NotFound):
        engine.drafter("bogus")


@pytest.mark.parametrize(
    "kwargs, k, message",
    [
        (dict(max_new_tokens=0), 5, "max-new-tokens"),
        (dict(max_new_tokens=300), 5, "does not fit"),
        (dict(temperature=-0.5), 5, "temperature"),
        (dict(), 0, "draft length"),
        (dict(), 33, "draft length"),
    ],
)
def test_engine_generate_validates(engine, kwargs, k, message):
    with pytest.raises(InvalidArgument, match=message):
        engine.generate([1, 4, 5], SamplingParams(**kwargs), "ngram", k=k)


def test_engine_generate_releases_sessions(engine, model_dirs):
    spec = f"hf:{model_dirs.noisy}"
    prompt = engine.encode_prompt("the cat sat on the mat the cat sat")
    result = engine.generate(prompt, SamplingParams(max_new_tokens=8), spec, k=3)
    assert len(result.token_ids) == 8 or result.finish_reason == "stop"
    assert len(engine.verifier.caches) == 0
    assert len(engine.drafter(spec).caches) == 0
    # A caller-chosen session is released as well.
    engine.generate(prompt, SamplingParams(max_new_tokens=4), None, session_id="mine")
    assert len(engine.verifier.caches) == 0


def test_engine_generate_matches_target_only(engine, model_dirs, greedy_reference):
    prompt = engine.encode_prompt("one two three one two three one two")
    params = SamplingParams(max_new_tokens=10)
    base = engine.generate(prompt, params, None).token_ids
    assert base == greedy_reference(engine.model, prompt, 10)
    for spec in ("ngram", f"hf:{model_dirs.noisy}", f"hf:{model_dirs.random}"):
        assert engine.generate(prompt, params, spec, k=4).token_ids == base


def test_engine_on_tokens(engine):
    chunks = []
    result = engine.generate([1, 5, 6, 5, 6], SamplingParams(max_new_tokens=6), "ngram", k=2, on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == result.token_ids


def test_engine_bad_target(tmp_path, home):
    with pytest.raises(ModelUnavailable):
        EmbeddedEngine(EngineConfig(home=home, target=ModelConfig(str(tmp_path / "nothing-here"))))


# -- streamed text ----------------------------------------------------------------------------------


def test_engine_on_text_streams_the_decoded_output(engine):
    """The CLI's streaming: the pieces, as they come, add up to the decoded output (the
    incremental detokenizer itself: tests/unit/test_detokenize.py)."""
    pieces, rounds = [], []
    result = engine.generate(engine.encode_prompt("the cat sat on the mat the cat sat"), SamplingParams(max_new_tokens=12),
                             "ngram", k=3, on_text=pieces.append, on_tokens=rounds.append)
    assert "".join(pieces) == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert all(pieces) and len(pieces) <= len(rounds) == len(result.rounds)
