"""The ``specpool`` command line on the tiny model: bad input gives one clear line on stderr and
exit status 2 (never a traceback); ``generate --json`` has a fixed shape, and the drafter does not
change greedy output."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error

REPEATING = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"






BAD_GENERATE = {
    "empty-prompt": (["generate", ""], ["prompt is empty"]),
    "blank-prompt": (["generate", "   \n "], ["prompt is empty"]),
    "max-new-tokens-0": (["generate", "the cat", "--max-new-tokens", "0"], ["max-new-tokens must be >= 1", "got 0"]),
    "max-new-tokens-neg": (["generate", "the cat", "--max-new-tokens", "-3"], ["max-new-tokens must be >= 1", "got -3"]),
    "max-new-tokens-window": (["generate", "the cat", "--max-new-tokens", "1000"], ["max-new-tokens 1000 does not fit", "context window is 256"]),
    "prompt-fills-window": (["generate", " ".join(["cat"] * 300), "--max-new-tokens", "1"], ["does not fit", "room for 0"]),
    "k-0": (["generate", "the cat", "-k", "0"], ["draft length", "1..32", "got 0"]),
    "k-33": (["generate", "the cat", "-k", "33"], ["draft length", "got 33"]),
    "temperature-neg": (["generate", "the cat", "--temperature", "-1"], ["temperature must be >= 0"]),
    "top-p-0": (["generate", "the cat", "--top-p", "0"], ["top-p must be in (0, 1]"]),
    "top-p-1.5": (["generate", "the cat", "--top-p", "1.5"], ["top-p must be in (0, 1]", "1.5"]),
    "top-k-neg": (["generate", "the cat", "--top-k", "-2"], ["top-k must be >= 0"]),
    "unknown-drafter": (["generate", "the cat", "--drafter", "bogus"], ["unknown drafter 'bogus'", "ngram"]),
    "bad-ngram-spec": (["generate", "the cat", "--drafter", "ngram:3-1"], ["n-gram drafter spec"]),
    "hf-without-model": (["generate", "the cat", "--drafter", "hf"], ["hf:PATH_OR_HUB_ID"]),
    "k-not-int": (["generate", "the cat", "-k", "abc"], ["invalid int value: 'abc'"]),  # argparse
    "unknown-flag": (["generate", "the cat", "--no-such-flag"], ["unrecognized arguments"]),  # argparse
    "missing-prompt": (["generate"], ["prompt"]),  # argparse
}


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_bad_generate_input(cli, case):
    argv, fragments = BAD_GENERATE[case]
    code, out, err = cli(*argv)
    assert_one_line_error(code, err, *fragments)
    assert out == ""


def test_incompatible_drafter_tokenizer(cli, model_dirs):
    code, out, err = cli("generate", "the cat", "--drafter", f"hf:{model_dirs.other}")
    assert_one_line_error(code, err, "different tokenizer", "must share the target's tokenizer")
    assert out == ""


def test_missing_drafter_folder(cli, tmp_path):
    missing = tmp_path / "no" / "such" / "drafter"
    code, _, err = cli("generate", "the cat", "--drafter", f"hf:{missing}")
    assert_one_line_error(code, err, str(missing))


def test_nonexistent_target_folder(cli, tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    code, out, err = cli("generate", "the cat", target=str(missing))
    assert_one_line_error(code, err, str(missing))
    assert out == ""


def test_target_folder_without_config(cli, tmp_path):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "README").write_text("hello")
    code, _, err = cli("generate", "the cat", target=str(folder))
    assert_one_line_error(code, err, "no config.json")


def test_bad_dtype(cli):
    code, _, err = cli("generate", "the cat", "--dtype", "float13")
    assert_one_line_error(code, err, "dtype", "float13")


@pytest.mark.parametrize("device", ["bogus", "cuda:0"])
def test_bad_or_unavailable_device(cli, device):
    """``--device cuda`` on a machine without CUDA is bad input too: one line, exit 2."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, _, err = cli("generate", "the cat", "--device", device, "--max-new-tokens", "2")
    assert_one_line_error(code, err, device)


def test_extreme_temperature_is_not_a_traceback(cli):
    code, out, err = cli("generate", "the cat", "--temperature", "1e-45", "--max-new-tokens", "3", "--json")
    assert "Traceback" not in err
    if code == 0:
        assert len(json.loads(out.strip().splitlines()[-1])["token_ids"]) <= 3
    else:
        assert_one_line_error(code, err, "temperature")


# -- successful runs -------------------------------------------------------------------------------


def generate_json(cli, *args):
    code, out, err = cli("generate", REPEATING, "--json", "--max-new-tokens", "12", *args)
    assert code == 0, err
    assert "Traceback" not in err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_generate_json_shape(cli, target_lm):
    payload = generate_json(cli, "--drafter", "ngram", "-k", "4")
    assert set(payload) == {"text", "token_ids", "finish_reason", "stats"}
    assert set(payload["stats"]) == {"new_tokens", "rounds", "mean_accepted_length", "tokens_per_s", "drafters", "policy"}
    assert payload["stats"]["policy"] == "fixed:ngram"
    ids = payload["token_ids"]
    assert isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < 64 for t in ids)
    assert isinstance(payload["text"], str)
    assert payload["finish_reason"] in {"length", "stop"}
    stats = payload["stats"]
    assert stats["new_tokens"] == len(ids)
    if payload["finish_reason"] == "length":
        assert len(ids) == 12
    else:
        assert ids[-1] == 2 and len(ids) <= 12  # eos
    assert isinstance(stats["rounds"], int) and 1 <= stats["rounds"] <= len(ids)
    assert stats["drafters"] == {"ngram": stats["rounds"]}
    assert stats["mean_accepted_length"] == pytest.approx(len(ids) / stats["rounds"], abs=1e-3)
    assert isinstance(stats["tokens_per_s"], (int, float)) and stats["tokens_per_s"] > 0
    _, tokenizer = target_lm
    assert payload["text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_generate_drafter_does_not_change_greedy_output(cli, model_dirs, engine, greedy_reference):
    none = generate_json(cli, "--drafter", "none")
    ngram = generate_json(cli, "--drafter", "ngram", "-k", "3")
    model_drafter = generate_json(cli, "--drafter", f"hf:{model_dirs.noisy}", "-k", "4")
    assert none["token_ids"] == ngram["token_ids"] == model_drafter["token_ids"]
    assert none["stats"]["drafters"] == {"none": none["stats"]["rounds"]}
    assert none["stats"]["rounds"] == len(none["token_ids"])
    assert model_drafter["stats"]["rounds"] < len(model_drafter["token_ids"]), "the noisy drafter should get drafts accepted"
    # And it is the target's own greedy continuation of the chat-formatted prompt.
    prompt = engine.encode_prompt(REPEATING)
    expected = greedy_reference(engine.model, prompt, 12)
    if 2 in expected:
        expected = expected[: expected.index(2) + 1]
    assert none["token_ids"] == expected


def test_generate_streams_text_and_a_summary(cli, target_lm):
    code, out, err = cli("generate", REPEATING, "--max-new-tokens", "6", "--drafter", "ngram")
    assert code == 0, err
    payload = generate_json(cli, "--drafter", "ngram")
    _, tokenizer = target_lm
    text = tokenizer.decode(payload["token_ids"][:6], skip_special_tokens=True)
    assert out.startswith(text)
    assert "new tokens" in out.strip().splitlines()[-1] and "finish:" in out


def test_raw_skips_the_chat_template(cli, engine, greedy_reference):
    payload = generate_json(cli, "--raw", "--drafter", "none")
    prompt = engine.encode_prompt(REPEATING, raw=True)
    assert prompt[0] == 1  # bos from the post-processor: not the chat template's ids
    expected = greedy_reference(engine.model, prompt, 12)
    if 2 in expected:
        expected = expected[: expected.index(2) + 1]
    assert payload["token_ids"] == expected


def test_seeded_sampling_through_the_cli(cli):
    a = generate_json(cli, "--temperature", "0.8", "--seed", "3")
    b = generate_json(cli, "--temperature", "0.8", "--seed", "3")
    c = generate_json(cli, "--temperature", "0.8", "--seed", "4")
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]
