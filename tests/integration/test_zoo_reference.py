"""Integration: the shipped zoo drafters on the real target — they load by bare name, share the
target's tokenizer, stay lossless, and reproduce their recorded reference acceptance."""

from __future__ import annotations

import json

import pytest

from specpool.drafters.zoo import MANIFEST, shipped_names
from specpool.services.config import settings_from_env
from specpool.services.engine import EmbeddedEngine
from specpool.target.sampling import SamplingParams

pytestmark = pytest.mark.integration

# Greedy decoding is deterministic on one machine; across CPUs float round-off may flip a rare
# near-tie, which moves the acceptance of a 48-token reference by a little.
ACCEPTANCE_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def engine() -> EmbeddedEngine:
    return EmbeddedEngine.default(settings_from_env().home)


@pytest.mark.parametrize("name", shipped_names())
def test_shipped_drafter_reproduces_its_reference(engine: EmbeddedEngine, name: str) -> None:
    reference = json.loads(MANIFEST.read_text())["drafters"][name]["reference"]
    drafter = engine.drafter(name)  # bare name -> zoo:NAME; checks the tokenizer fingerprint
    assert drafter.tokenizer_fingerprint == engine.verifier.tokenizer_fingerprint
    ids = engine.encode_prompt(reference["prompt"])
    params = SamplingParams(max_new_tokens=reference["max_new_tokens"], stop_token_ids=engine.stop_token_ids())
    speculative = engine.generate(ids, params, name, k=reference["k"])
    target_only = engine.generate(ids, params, None)
    assert speculative.token_ids == target_only.token_ids
    assert speculative.mean_accepted_length == pytest.approx(reference["mean_accepted_length"], abs=ACCEPTANCE_TOLERANCE)
