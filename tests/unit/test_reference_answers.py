"""Reference answers for white-box heads: corpus (prompt, answer) pairs read teacher-forced.

- ``read_pairs`` reads an answer from every format that has one, with the very prompt
  ``read_prompts`` makes of the same record (so the held-out rule and de-duplication agree);
- ``collect_pairs`` balances the files, de-duplicates and leaves out what it is told to;
- ``reference_teacher`` stores exactly the target's own final hidden states and top-K over
  chat(prompt) + the reference (closed with the stop token when whole, cut to the answer length
  otherwise), batches of mixed lengths included, and a rerun reads nothing again;
- ``train_head --reference-answers`` trains on both stores, and no held-out prompt trains."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch

from specpool.learning.eagle_train import (
    DEFAULT_FEATURES_CONTEXT, HeadOptions, load_feature_teacher, reference_store_key, reference_teacher, train_head,
)
from specpool.learning.zoo_data import collect_pairs, read_pairs, read_prompts
from specpool.learning.zoo_train import TrainConfig, encode_chat, prompt_hash, split_heldout, teacher_index
from specpool.target.models import tokenizer_fingerprint
from test_eagle_train import final_hidden
from test_zoo import SPECIAL_TOKENS


def write_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- reading pairs ----------------------------------------------------------------------------------------


def test_every_format_with_an_answer_gives_pairs_with_read_prompts_prompt(tmp_path):
    files = {
        "mbpp.jsonl": [{"text": "Add two numbers.", "code": "def add(a, b):\r\n    return a + b", "task_id": 1}],
        "gsm8k.jsonl": [{"question": "Tom has 2 apples and buys 3. How many?",
                         "answer": "He has 2+3 = <<2+3=5>>5 apples.\n#### 5"}],
        "math.json": [{"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "level": "Level 1"}],
        "t0.jsonl": [{"prompt": "Summarize: the cat sat.\n", "completion": "A cat sat.<|endoftext|>"}],
        "instructions.jsonl": [{"instruction": "Name a colour.", "instances": [{"input": "", "output": "Blue."}]},
                               {"instruction": "Say nothing.", "instances": [{"input": "", "output": ""}]}],
        "bench.jsonl": [{"question_id": 1, "category": "chat", "turns": ["Hello?"]}],
    }
    for name, records in files.items():
        write_lines(tmp_path / name, records)
    (tmp_path / "src-train.txt").write_text("Hello world .\n\nGood day .\n")
    (tmp_path / "tgt-train.txt").write_text("Hallo Welt .\n\nGuten Tag .\n")
    (tmp_path / "mod.py").write_text('def f(x):\n    """Double x, whatever number it is."""\n    return 2 * x\n')

    def pairs(name: str) -> list[tuple[str, str]]:
        got = read_pairs(tmp_path / name)
        prompts = read_prompts(tmp_path / name)
        assert all(p in prompts for p, _ in got), "a pair's prompt is not the one read_prompts makes"
        return got

    assert pairs("mbpp.jsonl")[0][1] == "```python\ndef add(a, b):\n    return a + b\n```"
    assert pairs("gsm8k.jsonl") == [("Tom has 2 apples and buys 3. How many?",
                                     "He has 2+3 = 5 apples.\nThe answer is 5.")]
    assert pairs("math.json") == [("What is $1+1$?", "It is $\\boxed{2}$.")]
    assert pairs("t0.jsonl") == [("Summarize: the cat sat.", "A cat sat.")]
    assert pairs("instructions.jsonl") == [("Name a colour.", "Blue.")]  # an empty answer is no pair
    assert pairs("bench.jsonl") == []  # questions without answers
    assert pairs("src-train.txt") == [("Translate English to German: Hello world .", "Hallo Welt ."),
                                      ("Translate English to German: Good day .", "Guten Tag .")]
    (code_prompt, code_answer), = pairs("mod.py")
    assert code_answer == '```python\ndef f(x):\n    """Double x, whatever number it is."""\n    return 2 * x\n```'
    assert "return 2 * x" not in code_prompt  # the stub asks; the answer completes
    assert read_pairs(tmp_path / "tgt-train.txt") == []  # the other side of a pair is not a corpus
    assert len(read_pairs(tmp_path)) == 8  # a folder: every file in it (mbpp, gsm8k, math, t0, instructions, py 1 each, src 2)


def test_collect_pairs_balances_deduplicates_and_excludes(tmp_path):
    big = write_lines(tmp_path / "big.jsonl", [{"question": f"q{i}", "answer": f"a{i}\n#### {i}"} for i in range(50)]
                      + [{"question": "q0", "answer": "again\n#### 0"}])
    small = write_lines(tmp_path / "small.jsonl", [{"problem": f"p{i}", "solution": f"s{i}"} for i in range(4)])
    chosen = collect_pairs([big, small], 10, seed=0)
    assert len(chosen) == 10 and len({p for p, _ in chosen}) == 10
    assert sum(p.startswith("p") for p, _ in chosen) == 4  # the small file is not drowned
    assert collect_pairs([big, small], 10, seed=0) == chosen  # seeded
    left_out = {p for p, _ in chosen[:3]}
    assert not left_out & {p for p, _ in collect_pairs([big, small], 100, seed=0, exclude=left_out)}
    assert len(collect_pairs([big, small], 100, seed=0)) == 54  # q0 once
    spelled = Path(os.path.relpath(big)), Path(os.path.relpath(small))  # the same files, spelled otherwise
    assert collect_pairs(list(spelled), 10, seed=0) == chosen


# -- the reference store -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def words(model_dirs) -> list[str]:
    vocab = json.loads((model_dirs.target / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w for w in vocab if w not in SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def answered_corpus(tmp_path_factory, words) -> Path:
    """Self-instruct style records with answers of 2 .. 30 words (some longer than the answer cap)."""
    rng = random.Random(1)
    records = [{"instruction": " ".join(rng.sample(words, rng.randint(3, 7))),
                "instances": [{"input": "", "output": " ".join(rng.choices(words, k=rng.randint(2, 30)))}]}
               for _ in range(60)]
    return write_lines(tmp_path_factory.mktemp("answered") / "instructions.jsonl", records)


def tiny_config(corpus: Path, **overrides) -> TrainConfig:
    config = TrainConfig(domain="chat", data=(str(corpus),), steps=8, batch_size=4, max_prompts=60, max_new_tokens=12,
                         teacher_batch=16, save_every=4, reduced_vocab=48, train_context_tokens=32, lr=3e-3, warmup=2,
                         features_context=DEFAULT_FEATURES_CONTEXT)
    return dataclasses.replace(config, **overrides)


def test_reference_rows_are_the_targets_own_features_and_top_k(tmp_path, answered_corpus, target_lm):
    model, tokenizer = target_lm
    config = tiny_config(answered_corpus)
    pairs = collect_pairs([answered_corpus], 30, seed=0)
    stop = (tokenizer.eos_token_id,)
    store = tmp_path / "store"
    # A small token budget makes batches of several rows, right-padded to different lengths.
    index = reference_teacher(model, tokenizer, pairs, store, config, stop, token_budget=120)
    assert len({shard for shard, _ in index.values()}) >= 3
    sequences = load_feature_teacher([p for p, _ in pairs], index)
    lm_head = model.get_output_embeddings()  # a module (the CPU build may pack its weight)
    whole = 0
    for (prompt, reference), s in zip(pairs, sequences):
        prompt_ids = encode_chat(tokenizer, prompt, config.max_prompt_tokens)
        answer = tokenizer.encode(reference, add_special_tokens=False)
        if len(answer) < config.max_new_tokens:
            answer, whole = answer + [stop[0]], whole + 1
        else:
            answer = answer[:config.max_new_tokens]
        assert s.tokens.tolist() == prompt_ids + answer and s.answer_start == len(prompt_ids)
        L, P = len(s.tokens), s.answer_start
        want = final_hidden(model, s.tokens.tolist())  # (L, d), the sequence alone
        torch.testing.assert_close(s.features.float(), want[s.feature_start:L - 1], atol=2e-3, rtol=2e-3)
        with torch.inference_mode():
            top = torch.softmax(lm_head(want[P - 1:L - 1]), dim=-1).topk(config.teacher_top_k, dim=-1)
        assert (s.label_ids[:, 0] == top.indices[:, 0]).all()  # the target's argmax at each answer position
        torch.testing.assert_close(s.label_probs, top.values, atol=2e-3, rtol=2e-3)
    assert 0 < whole < len(pairs)  # both cases met
    shards = sorted(store.glob("shard-*"))
    again = reference_teacher(model, tokenizer, pairs, store, config, stop, token_budget=120)
    assert again == index and sorted(store.glob("shard-*")) == shards  # nothing read twice
    assert not list(store.glob(".*"))  # no temporary files left


def test_a_run_with_reference_answers_trains_on_both_and_holds_out_the_same_prompts(tmp_path, answered_corpus,
                                                                                     model_dirs, target_lm):
    config = tiny_config(answered_corpus)
    options = HeadOptions(intermediate_size=64, reference_answers=60, onpolicy_weight=2)
    metadata = train_head(config, options, tmp_path, tmp_path / "head", resume=False, target_name=str(model_dirs.target))
    _, heldout = split_heldout(read_prompts(answered_corpus))
    assert heldout, "the tiny corpus should hold some prompts out"
    store = tmp_path / "zoo" / "teacher" / reference_store_key(config, tokenizer_fingerprint(target_lm[1]))
    referenced = set(teacher_index(store))
    assert referenced and not referenced & {prompt_hash(p) for p in heldout}
    assert metadata["reference_pairs"] == len(referenced) == 60 - len(heldout)  # N = 60: every pair not held out
    assert metadata["reference_tokens"] > 0 and metadata["onpolicy_weight"] == 2
    assert metadata["heldout_prompts"] == len(heldout)
    assert "reference answers read teacher-forced" in (tmp_path / "head" / "README.md").read_text()
    # A run takes the pairs its store already read first: here the last 10 of the seeded order.
    home = tmp_path / "home2"
    store2 = home / "zoo" / "teacher" / reference_store_key(config, tokenizer_fingerprint(target_lm[1]))
    last = [(p, r) for p, r in collect_pairs([answered_corpus], 1000, config.seed) if p not in heldout][-10:]
    reference_teacher(target_lm[0], target_lm[1], last, store2, config, (target_lm[1].eos_token_id,))
    shards = sorted(store2.glob("shard-*"))
    fewer = train_head(config, dataclasses.replace(options, reference_answers=10), home, tmp_path / "unused",
                       resume=False, target_name=str(model_dirs.target), teacher_only=True)
    assert fewer["reference_pairs"] == 10
    assert sorted(store2.glob("shard-*")) == shards  # nothing read again
