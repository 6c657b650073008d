"""Benchmarks with white-box heads (issue 26) on the tiny target: ``eagle:NAME`` systems side by
side with their draft cost, the in-domain head system (``--in-domain eagle``), policies over a
white-box and a mixed pool (a white-box pool's prefill round is no arm's), and the --pool
shorthands. The shipped-heads folder is pointed at tiny heads built from the tiny target."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from bench import policies as policy_bench
from bench import report
from bench.cli import resolve_bench_defaults, run_bench
from bench.common import expand_pool
from bench.speed import check_in_domain_heads, command_line, in_domain_specs, in_domain_systems
from specpool.cli.main import build_parser
from specpool.core.errors import NotFound
from specpool.drafters.eagle_model import EagleConfig, EagleHead, init_from_target
from specpool.learning.zoo_train import export_drafter
from specpool.router.bandit import TraceEntry
from specpool.router.loop import GenerationResult, RoundRecord
from specpool.target.models import tokenizer_fingerprint

HEADS = ["general", "code", "math", "translation", "summarization_qa", "chat"]
PROMPTS = [("chat", "the cat sat on the mat and the cat sat"), ("code", "one two three four one two three"),
           ("poetry", "red tree blue sky red tree blue sky")]  # poetry: no head of its own, the general head


def write_tiny_head(target_dir, tokenizer, out, layer: int, seed: int):
    """An EAGLE head on the tiny target (its embedding, warm-started from its layer ``layer``),
    exported as `specpool zoo train --arch eagle` does."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(target_dir))
    state = load_file(str(target_dir / "model.safetensors"))
    config = EagleConfig(hidden_size=tc.hidden_size, num_layers=1, num_heads=tc.num_attention_heads,
                         num_kv_heads=tc.num_key_value_heads, intermediate_size=tc.intermediate_size,
                         reduced_vocab=tc.vocab_size, rope_theta=10000.0, rms_eps=float(tc.rms_norm_eps),
                         max_positions=tc.max_position_embeddings)
    torch.manual_seed(seed)
    head = EagleHead(config, state["model.embed_tokens.weight"].float(), torch.arange(tc.vocab_size),
                     state.get("lm_head.weight"))
    init_from_target(head, state, layer)
    metadata = {"name": out.name, "kind": "eagle", "domain": out.name, "target": str(target_dir),
                "target_tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                "target_card": {"hidden_size": tc.hidden_size, "num_hidden_layers": tc.num_hidden_layers},
                "model": config.to_dict()}
    export_drafter(head.eval(), out, metadata, "# tiny test head\n")


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, model_dirs, target_lm):
    root = tmp_path_factory.mktemp("heads")
    for i, name in enumerate(HEADS):
        write_tiny_head(model_dirs.target, target_lm[1], root / name, layer=i % 2, seed=i)
    return root


@pytest.fixture
def shipped(heads_dir, monkeypatch):
    """The tiny heads stand in for specpool/drafters/heads/."""
    monkeypatch.setattr("specpool.drafters.eagle.SHIPPED_DIR", heads_dir)
    return heads_dir


def bench_args(tmp_path, model_dirs, *extra: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in PROMPTS))
    return build_parser().parse_args(["bench", "--prompts", str(prompts), "--limit-per-category", "1", "--max-new-tokens", "8",
                                      "--target", str(model_dirs.target), "--out", str(tmp_path / "out"), *extra])


# -- side by side ---------------------------------------------------------------------------------
def test_side_by_side_white_box_systems_and_their_draft_cost(tmp_path, model_dirs, home, shipped):
    args = bench_args(tmp_path, model_dirs, "--drafters", "eagle:general,eagle:chat,lookup:eagle:code",
                     "--in-domain", "eagle", "--in-domain-lookup", "eagle")
    assert run_bench(args, SimpleNamespace(home=home)) == 0
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    systems = ["target", "eagle:general", "eagle:chat", "lookup:eagle:code", "in-domain-eagle", "in-domain-eagle+lookup"]
    assert results["config"]["systems"] == systems
    assert results["config"]["in_domain_drafters"]["in-domain-eagle"]["summarization"] == "eagle:summarization_qa"
    assert "--in-domain eagle --in-domain-lookup eagle" in results["config"]["command"]
    assert all(n == 0 for n in results["lossless_mismatches"].values())  # every white-box output = target-only's
    rows = {(r["category"], r["system"]): r for r in results["rows"]}
    for system in systems[1:]:
        row = rows[(report.ALL, system)]
        assert row["draft_ms_per_token"] > 0 and 0 < row["draft_share"] < 1, (system, row)
        assert row["draft_ms_per_token_p25"] <= row["draft_ms_per_token"] <= row["draft_ms_per_token_p75"]
        assert row["mean_accepted_length"] >= 1 and row["speedup_vs_target"] is not None
    assert rows[(report.ALL, "target")]["draft_ms_per_token"] is None
    # The in-domain system ran each prompt's own head: the same rounds as that head run alone.
    records = {(r["system"], r["category"]): r for r in map(json.loads, (out / "per_prompt.jsonl").read_text().splitlines())}
    for category, alone in (("chat", "eagle:chat"), ("poetry", "eagle:general")):
        ran, ref = records[("in-domain-eagle", category)], records[(alone, category)]
        assert (ran["rounds"], ran["proposed"], ran["token_ids"]) == (ref["rounds"], ref["proposed"], ref["token_ids"])
    text = (out / "report.md").read_text()
    assert "## Draft cost" in text and "draft ms / proposed token" in text
    assert "| all | `in-domain-eagle` | 3 |" in text.split("## Draft cost")[1]


def test_in_domain_families_and_specs():
    assert list(in_domain_systems("zoo", None)) == ["in-domain"]
    assert list(in_domain_systems(None, "zoo")) == ["in-domain+lookup"]
    assert in_domain_systems("both", "eagle") == {"in-domain": ("zoo", ""), "in-domain-eagle": ("eagle", ""),
                                                   "in-domain-eagle+lookup": ("eagle", "lookup:")}
    assert in_domain_systems(None, None) == {}
    eagle = in_domain_specs("eagle", "lookup:")
    assert (eagle["code"], eagle["qa"], eagle["summarization"], eagle["*"]) == (
        "lookup:eagle:code", "lookup:eagle:summarization_qa", "lookup:eagle:summarization_qa", "lookup:eagle:general")
    assert in_domain_specs("zoo", "")["translation"] == "translation"


def test_old_in_domain_flags_still_parse(tmp_path, model_dirs):
    args = resolve_bench_defaults(bench_args(tmp_path, model_dirs, "--in-domain", "--in-domain-lookup"))
    assert (args.in_domain, args.in_domain_lookup) == ("zoo", "zoo")
    assert "--in-domain zoo --in-domain-lookup zoo" in command_line(args)


def test_the_recorded_command_repeats_a_sampled_run(tmp_path, model_dirs):
    """A sampled run's report names its temperature in the command (it used to drop it)."""
    sampled = resolve_bench_defaults(bench_args(tmp_path, model_dirs, "--temperature", "0.7"))
    assert command_line(sampled).endswith("--temperature 0.7")
    assert "--temperature" not in command_line(resolve_bench_defaults(bench_args(tmp_path, model_dirs)))


def test_in_domain_eagle_without_the_heads_fails_before_loading(tmp_path, model_dirs, home, monkeypatch):
    (tmp_path / "heads" / "code").mkdir(parents=True)
    monkeypatch.setattr("specpool.drafters.eagle.SHIPPED_DIR", tmp_path / "heads")
    with pytest.raises(NotFound, match="need the heads chat, code, general"):
        check_in_domain_heads(in_domain_systems(None, "eagle"))
    check_in_domain_heads(in_domain_systems("zoo", None))  # the zoo family does not need heads
    with pytest.raises(NotFound, match="in-domain white-box systems need the heads"):
        run_bench(bench_args(tmp_path, model_dirs, "--in-domain", "both", "--target", "/nonexistent"), SimpleNamespace(home=home))


def test_draft_cost_is_per_proposed_token_and_old_records_have_none():
    base = {"prompt_index": 0, "category": "code", "ours": True, "new_tokens": 10, "wall_s": 1.0, "rounds": 4,
            "round_s": 1.0, "draft_forward_s": 0.1, "verify_forward_s": 0.6, "matches_target": True}
    rows = report.aggregate([dict(base, system="target", matches_target=None, proposed=0, draft_s=0.0),
                             dict(base, system="eagle:code", proposed=8, draft_s=0.25),
                             dict(base, system="old")])  # a record from before the counters
    by = {(r["category"], r["system"]): r for r in rows}
    assert by[("code", "eagle:code")]["draft_ms_per_token"] == pytest.approx(12.5)
    assert by[("code", "eagle:code")]["draft_share"] == pytest.approx(0.25)
    assert by[("code", "old")]["draft_ms_per_token"] is None and by[("code", "target")]["draft_share"] is None
    table = report.draft_cost_table(rows)
    assert "| code | `eagle:code` | 1 | 2.50 | 12.50 [12.50, 12.50] | 25% [25%, 25%] | 1.00 [1.00, 1.00] |" in table
    assert "`old`" not in table and "`target`" not in table


# -- policies -------------------------------------------------------------------------------------
def test_pool_shorthands(shipped):
    heads = ",".join(f"eagle:{h}" for h in sorted(HEADS))
    assert expand_pool("white-box") == heads
    assert expand_pool("mixed") == heads + ",lookup:code,ngram"
    assert expand_pool("ngram, white-box,eagle:code") == "ngram," + heads  # duplicates dropped
    assert expand_pool("ngram,code") == "ngram,code"


def test_pool_shorthand_without_heads(tmp_path, monkeypatch):
    monkeypatch.setattr("specpool.drafters.eagle.SHIPPED_DIR", tmp_path / "none")
    with pytest.raises(NotFound, match="no white-box heads"):
        expand_pool("mixed")


def round_(drafter, k, proposed=0):
    return RoundRecord(drafter, k, proposed, 0, 1, None, 0.0, 0.0, 0.0)


def test_round_arms_align_with_rounds_around_the_prefill_and_a_last_empty_round():
    rounds = [round_(None, 0), round_("eagle:code", 3, 3), round_("ngram", 2, 2), round_("eagle:code", 0)]
    trace = [TraceEntry(1, "eagle:code@3", "eagle:code"), TraceEntry(2, "ngram@2", "eagle:code")]
    assert policy_bench.round_arms(GenerationResult([], "length", rounds, trace=trace)) == [None, "eagle:code@3", "ngram@2", "eagle:code"]
    assert policy_bench.round_arms(GenerationResult([], "length", rounds[:3])) == [None, "eagle:code", "ngram"]


@pytest.mark.slow  # whole policy runs: the fast lane skips them
@pytest.mark.parametrize("pool, expected", [
    ("white-box", [f"eagle:{h}" for h in sorted(HEADS)]),
    ("eagle:general,lookup:eagle:code,ngram", ["eagle:general", "lookup:eagle:code", "ngram"]),  # mixed
])
def test_policy_bench_over_white_box_and_mixed_pools(tmp_path, model_dirs, home, shipped, pool, expected):
    args = bench_args(tmp_path, model_dirs, "--policies", "metasd-ucb,oracle", "--pool", pool)
    assert run_bench(args, SimpleNamespace(home=home)) == 0
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["pool"] == expected
    assert all(r["lossless_mismatches"] == 0 for r in results["rows"])
    records = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    for r in records:
        assert len(r["arms"]) == len(r["emitted"]) == len(r["proposed"]) == len(r["draft_ms"]) == r["rounds"]
        if r["system"] == "metasd-ucb":  # a white-box pool: round 1 is the target's prefill, no arm's
            assert r["arms"][0] is None and r["proposed"][0] == 0 and all(a is not None for a in r["arms"][1:-1])
        if r["system"] == "oracle":
            assert r["oracle_drafter"] in expected
    assert results["summary"]["stopping_time_oracle_rounds_per_100_tokens"] > 0
    assert policy_bench.main(["--rerender", str(out)]) == 0
