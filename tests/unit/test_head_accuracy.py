"""bench/head_accuracy.py on the tiny target, with a head fitted for a second to its features: the
first drafts it scores are those ``EagleDrafter`` proposes, its vocabulary share and top-k rates
count what they say, and a widened head scores its own ids exactly as before."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench.feature_fusion import answer, features_of
from bench.head_accuracy import best_heads, first_drafts, measure, render, widened, write_cards
from specpool.drafters.eagle import SHIPPED_DIR, EagleDrafter
from specpool.drafters.eagle_model import EagleHead
from specpool.target.features import Features
from specpool.target.sampling import SamplingParams
from test_eagle_drafter import fit_head

PROMPTS = ["the cat sat", "a dog ran far", "the cat ran", "a bird sat on the mat"]
WINDOW = 10_000  # prompts uncut, features from position 0, as the bench reads them


@pytest.fixture(scope="module")
def fitted(target_lm, model_dirs):
    model, tokenizer = target_lm
    answers = answer(model, tokenizer, PROMPTS, 12, 2, tokenizer.eos_token_id, WINDOW)
    sequences = features_of(model, tokenizer, PROMPTS, answers, (), context=WINDOW, top_k=1, max_prompt_tokens=WINDOW)
    head = fit_head(model, model_dirs.target, [s.tokens.tolist() for s in sequences])
    return head, sequences


def narrowed(head: EagleHead, keep: int) -> EagleHead:
    """The fitted head proposing only its first ``keep`` ids: answer tokens fall outside its vocabulary."""
    config = dataclasses.replace(head.config, reduced_vocab=keep)
    narrow = EagleHead(config, head.embedding, head.vocab_ids[:keep], head.output)
    state = {k: v for k, v in head.state_dict().items() if k not in ("vocab_ids", "head_bias")}
    narrow.load_state_dict(state, strict=False)
    with torch.no_grad():
        narrow.head_bias.copy_(head.head_bias[:keep])
    return narrow.eval()


def test_first_drafts_are_what_the_drafter_proposes_first(fitted):
    head, sequences = fitted
    drafter = EagleDrafter("eagle:check", head, {"target_tokenizer_fingerprint": "tiny"}, confidence_threshold=0.0)
    greedy = SamplingParams(temperature=0.0)
    checked = 0
    for j, s in enumerate(sequences):
        assert s.feature_start == 0
        tokens, P = s.tokens.tolist(), s.answer_start
        guesses, truth = first_drafts(head, s, 3)
        assert truth.tolist() == tokens[max(P, 2):]
        assert guesses.shape == (len(truth), 3)
        drafter.observe_features(f"s{j}", Features(0, s.features.float()))
        for row, n in enumerate(range(max(P, 2), len(tokens))):
            assert drafter.propose(f"s{j}", tokens[:n], 1, greedy).tokens == [int(guesses[row, 0])]
            checked += 1
    assert checked >= 20


def test_measure_counts_vocabulary_and_top_k(fitted):
    head, sequences = narrowed(fitted[0], 24), fitted[1]
    reduced = len(head.vocab_ids)
    got = measure(head, sequences, [1, 2, reduced], k=3, starts=20)
    truth = torch.cat([first_drafts(head, s, 1)[1] for s in sequences])
    inside = torch.isin(truth, head.vocab_ids)
    assert got["tokens"] == len(truth)
    assert got["outside_vocab"] == pytest.approx(1.0 - float(inside.float().mean()))
    assert 0.0 < got["outside_vocab"] < 1.0  # the tiny head's vocabulary leaves some answer tokens out
    top = [got["top"][str(t)] for t in (1, 2, reduced)]
    assert top == sorted(top) and top[0] > 0.0
    assert top[-1] == pytest.approx(float(inside.float().mean()))  # its whole vocabulary hits every token it holds
    assert got["chain_tokens_per_round"] >= 1.0 + top[0] - 1e-9  # a chain gets at least its first draft


def test_a_widened_head_scores_its_own_ids_as_before_and_adds_the_lowest_it_lacks(fitted):
    head, sequences = narrowed(fitted[0], 24), fitted[1]
    own = head.vocab_ids.tolist()
    wide = widened(head, len(own) + 5)
    lacking = [i for i in range(head.vocab_size) if i not in own][:5]
    assert wide.vocab_ids.tolist() == sorted(own + lacking)
    hidden = torch.randn(3, head.config.hidden_size)
    with torch.inference_mode():
        narrow_logits, wide_logits = head.reduced_logits(hidden), wide.reduced_logits(hidden)
    where = {int(t): i for i, t in enumerate(wide.vocab_ids)}
    torch.testing.assert_close(wide_logits[:, [where[t] for t in own]], narrow_logits)
    new_bias = wide.head_bias.detach()[[where[t] for t in lacking]]
    assert torch.allclose(new_bias, head.head_bias.detach().quantile(0.25).expand(5))
    assert measure(wide, sequences, [1], k=3, starts=20)["outside_vocab"] <= measure(head, sequences, [1], k=3, starts=20)["outside_vocab"]
    with pytest.raises(ValueError, match="already proposes"):
        widened(head, len(own))
    with pytest.raises(ValueError, match="only"):
        widened(head, head.vocab_size + 1)


def test_the_report_names_the_best_head_of_each_category():
    def row(category, head, top1):
        return {"category": category, "head": head, "tokens": 10, "top": {"1": top1, "2": top1 + 0.1},
                "outside_vocab": 0.05, "chain_tokens_per_round": 1.5}

    rows = [row("code", "general", 0.5), row("code", "code", 0.6), row("chat", "general", 0.3), row("chat", "code", 0.2)]
    assert best_heads(rows) == {"code": ("code", 0.6), "chat": ("general", 0.3)}
    machine = {"cpu": "cpu", "cores": 2, "torch": "t", "transformers": "x"}
    text = render({"machine": machine, "top_k": [1, 2], "target": "tiny", "max_new_tokens": 8, "prompts_count": 4,
                   "prompts": "p.jsonl", "limit_per_category": 2, "command": "cmd", "k": 5, "rows": rows})
    assert "| code | `code` | 10 | 0.600 | 0.700 | 5.0% | 1.50 |" in text
    assert "code `code` (0.600), chat `general` (0.300)" in text


def test_write_cards_puts_each_shipped_heads_rows_in_its_card_one_table_per_prompts_file(tmp_path):
    shipped = tmp_path / "heads"
    for name in ("general", "code"):  # two shipped cards without their rows (the weights are not read)
        (shipped / name).mkdir(parents=True)
        card = json.loads((SHIPPED_DIR / name / "config.json").read_text())
        card.pop("acceptance_rows", None)
        (shipped / name / "config.json").write_text(json.dumps(card))
    machine = {"cpu": "cpu", "cores": 2, "torch": "t", "transformers": "x"}

    def run(prompts, top1):
        rows = [{"category": c, "head": h, "tokens": 10, "top": {"1": top1, "2": top1 + 0.1}, "outside_vocab": 0.05,
                 "chain_tokens_per_round": 1.5} for h in ("general", "code", "general (vocab 16384)", "/tmp/other")
                for c in ("code", "all")]
        return {"machine": machine, "top_k": [1, 2], "max_new_tokens": 8, "prompts_count": 4, "prompts": prompts,
                "command": f"python -m bench.head_accuracy --prompts {prompts}", "k": 5, "rows": rows}

    assert write_cards(run("dev.jsonl", 0.5), shipped) == ["code", "general"]  # paths and widened copies left alone
    assert write_cards(run("heldout.jsonl", 0.25), shipped) == ["code", "general"]
    card = json.loads((shipped / "general" / "config.json").read_text())
    assert list(card["acceptance_rows"]) == ["dev.jsonl", "heldout.jsonl"]  # the second run added its rows beside the first
    readme = (shipped / "general" / "README.md").read_text()
    assert readme.startswith("# specpool white-box head: general")
    assert "### `dev.jsonl`" in readme and "### `heldout.jsonl`" in readme
    assert "| code | 10 | 0.500 | 0.600 | 5.0% | 1.50 |" in readme and "| all | 10 | 0.250 | 0.350 | 5.0% | 1.50 |" in readme
    assert "python -m bench.head_accuracy --prompts heldout.jsonl" in readme
    assert sorted(p.name for p in (shipped / "general").iterdir()) == ["README.md", "config.json"]  # no temporary file left
    original = json.loads((SHIPPED_DIR / "general" / "config.json").read_text())
    assert card["acceptance_rows"]["dev.jsonl"] != original.get("acceptance_rows", {}).get("dev.jsonl")
    rows_keys = ("acceptance_rows", "acceptance_row")  # the only keys write_cards may change
    assert {k: v for k, v in card.items() if k not in rows_keys} == {k: v for k, v in original.items() if k not in rows_keys}
