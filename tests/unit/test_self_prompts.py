"""Self-written prompts (specpool/learning/self_prompts.py) on the tiny random target: a chat
template with markers around the user's turn, so the model has somewhere to write a request."""

from __future__ import annotations

import copy
import json

import pytest

from specpool.core.errors import InvalidArgument
from specpool.learning.self_prompts import SelfPromptConfig, user_turn_prefix, write_self_prompts
from specpool.learning.zoo_data import read_prompts

MARKED_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> {% endif %}"
SMALL = SelfPromptConfig(count=12, batch_size=8, max_new_tokens=40)


@pytest.fixture(scope="module")
def marked(target_lm):
    """The tiny target with a tokenizer whose template marks the user's turn: <s> TEXT </s>."""
    model, tokenizer = target_lm
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = MARKED_TEMPLATE
    return model, tokenizer


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_prefix_is_the_template_up_to_the_users_text_and_the_turn_ends_with_its_marker(marked):
    _, tokenizer = marked
    prefix, end = user_turn_prefix(tokenizer)
    assert prefix == [1]  # "<s> "
    assert end == 2  # "</s>"


def test_a_tokenizer_without_a_chat_template_is_refused_with_one_line(target_lm):
    tokenizer = copy.deepcopy(target_lm[1])
    tokenizer.chat_template = None
    with pytest.raises(InvalidArgument, match="no chat template"):
        user_turn_prefix(tokenizer)


def test_a_template_with_nothing_before_the_users_text_is_refused(target_lm):
    _, tokenizer = target_lm  # the conftest template: contents joined, no markers
    with pytest.raises(InvalidArgument, match="no marker"):
        user_turn_prefix(tokenizer)


def test_writes_the_count_of_distinct_finished_requests_in_the_format_zoo_train_reads(marked, tmp_path):
    model, tokenizer = marked
    out = tmp_path / "self.jsonl"
    report = write_self_prompts(model, tokenizer, out, SMALL, progress=False)
    records = lines(out)
    assert report["prompts"] == len(records) == SMALL.count
    texts = [r["turns"][0] for r in records]
    assert len(set(texts)) == len(texts)
    assert all(len(t.split()) >= 3 and "</s>" not in t and "<s>" not in t for t in texts)
    assert [r["question_id"] for r in records] == list(range(1, SMALL.count + 1))
    assert read_prompts(out) == texts  # ``specpool zoo train --data`` reads them unchanged
    assert not (tmp_path / "self.jsonl.partial").exists()
    # The tiny random model ends its turn only sometimes: unfinished requests were sampled and dropped.
    assert report["sampled_this_run"] == report["batches"] * SMALL.batch_size
    assert report["dropped_unfinished"] > 0


def test_the_same_seed_writes_the_same_requests_and_another_seed_others(marked, tmp_path):
    model, tokenizer = marked
    write_self_prompts(model, tokenizer, tmp_path / "a.jsonl", SMALL, progress=False)
    write_self_prompts(model, tokenizer, tmp_path / "b.jsonl", SMALL, progress=False)
    write_self_prompts(model, tokenizer, tmp_path / "c.jsonl", SelfPromptConfig(**{**SMALL.__dict__, "seed": 1}),
                       progress=False)
    assert lines(tmp_path / "a.jsonl") == lines(tmp_path / "b.jsonl")
    assert [r["turns"] for r in lines(tmp_path / "a.jsonl")] != [r["turns"] for r in lines(tmp_path / "c.jsonl")]


class FailsOnCall:
    """The model, except that its ``fail_on``-th generate call raises (a kill mid-run)."""

    def __init__(self, model, fail_on: int):
        self.model, self.fail_on, self.calls = model, fail_on, 0

    def parameters(self):
        return self.model.parameters()

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("killed")
        return self.model.generate(*args, **kwargs)


def test_a_stopped_run_resumes_where_it_stopped_and_ends_as_an_unbroken_run_would(marked, tmp_path):
    model, tokenizer = marked
    config = SelfPromptConfig(count=20, batch_size=8, max_new_tokens=40)
    write_self_prompts(model, tokenizer, tmp_path / "whole.jsonl", config, progress=False)
    out = tmp_path / "resumed.jsonl"
    with pytest.raises(RuntimeError, match="killed"):
        write_self_prompts(FailsOnCall(model, fail_on=3), tokenizer, out, config, progress=False)
    partial = tmp_path / "resumed.jsonl.partial"
    assert not out.exists() and partial.exists()
    kept = lines(partial)
    assert 0 < len(kept) < config.count and {r["batch"] for r in kept} == {0, 1}
    with partial.open("a") as handle:  # a line torn by the kill
        handle.write('{"question_id": 99, "turns": ["the ca')
    report = write_self_prompts(model, tokenizer, out, config, progress=False)
    assert lines(out) == lines(tmp_path / "whole.jsonl")
    assert report["sampled_this_run"] == (report["batches"] - 2) * config.batch_size  # batches 0 and 1 not again


def test_an_existing_output_is_never_overwritten(marked, tmp_path):
    model, tokenizer = marked
    out = tmp_path / "self.jsonl"
    out.write_text("mine\n")
    with pytest.raises(InvalidArgument, match="exists"):
        write_self_prompts(model, tokenizer, out, SMALL, progress=False)
    assert out.read_text() == "mine\n"


@pytest.mark.parametrize("field, value", [("count", 0), ("batch_size", 0), ("max_new_tokens", 0),
                                          ("temperature", 0.0), ("top_p", 1.5)])
def test_bad_settings_are_refused_with_one_line(field, value):
    with pytest.raises(InvalidArgument):
        SelfPromptConfig(**{field: value}).check()


def test_the_cli_writes_requests_from_the_target_folder(cli, marked, model_dirs, tmp_path):
    _, tokenizer = marked
    folder = tmp_path / "target"
    folder.mkdir()
    for f in model_dirs.target.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tokenizer.save_pretrained(folder)  # the marked template
    out = tmp_path / "self.jsonl"
    code, stdout, _ = cli("zoo", "self-prompts", "--count", "5", "--batch-size", "8", "--max-new-tokens", "40",
                          "--out", str(out), target=str(folder))
    assert code == 0, stdout
    assert "5 self-written prompts" in stdout and f"--data {out}" in stdout
    assert len(lines(out)) == 5
    code, _, err = cli("zoo", "self-prompts", "--count", "5", "--out", str(out), target=str(folder))
    assert code != 0 and "exists" in err
