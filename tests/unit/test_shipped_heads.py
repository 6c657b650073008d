"""The shipped white-box heads: every file matches its recorded hash, each head and the whole
shipped zoo (black-box drafters + heads) fit their budgets, and every card names the default target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from specpool.drafters import eagle, zoo
from specpool.drafters.zoo import file_sha256, shipped_files

HEAD_NAMES = ("general", "code", "math", "translation", "summarization_qa", "chat")  # the white-box pool
MAX_HEAD_BYTES = 10 * 1000 * 1000  # per head, on disk
MAX_ZOO_BYTES = 120 * 1000 * 1000  # everything shipped under specpool/drafters/


def manifest() -> dict:
    assert eagle.MANIFEST.exists(), f"{eagle.MANIFEST} is missing: run `specpool zoo manifest` after training"
    return json.loads(eagle.MANIFEST.read_text())


def test_every_head_is_shipped() -> None:
    assert set(eagle.shipped_heads()) == set(HEAD_NAMES)
    assert set(manifest()["drafters"]) == set(HEAD_NAMES), "a head folder is not in the manifest (or the reverse)"


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_shipped_head_files_match_their_hashes(name: str) -> None:
    recorded = manifest()["drafters"][name]["files"]
    folder = eagle.SHIPPED_DIR / name
    assert {p.name for p in shipped_files(folder)} == set(recorded), "files added or removed since the manifest"
    for filename, digest in recorded.items():
        assert file_sha256(folder / filename) == digest, f"{name}/{filename} differs from its recorded hash"


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_shipped_head_card_size_and_shape(name: str) -> None:
    folder = eagle.SHIPPED_DIR / name
    config = json.loads((folder / "config.json").read_text())
    assert config["kind"] == eagle.HEAD_KIND and config["domain"] == name
    assert config["target"] == manifest()["target"]
    assert config["target_tokenizer_fingerprint"] == manifest()["target_tokenizer_fingerprint"]
    assert config["target_card"]["hidden_size"] == config["model"]["hidden_size"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        own = sum(handle.get_tensor(k).numel() for k in handle.keys() if k != "vocab_ids")
        assert len(handle.get_tensor("vocab_ids")) == config["model"]["reduced_vocab"]
    assert own == config["own_parameters"]
    size = sum(p.stat().st_size for p in shipped_files(folder))
    assert size <= MAX_HEAD_BYTES, f"head {name} takes {size / 1e6:.1f} MB > 10 MB"


def test_whole_shipped_zoo_fits_its_budget() -> None:
    total = sum(p.stat().st_size for name in zoo.shipped_names() for p in shipped_files(zoo.SHIPPED_DIR / name))
    total += sum(p.stat().st_size for name in eagle.shipped_heads() for p in shipped_files(eagle.SHIPPED_DIR / name))
    assert total <= MAX_ZOO_BYTES, f"shipped drafters and heads take {total / 1e6:.1f} MB > 120 MB"


def test_the_default_drafter_is_the_general_head_behind_lookup_on_its_own_target_only() -> None:
    """`specpool generate` without --drafter: lookup:eagle-alt-int8:general (the general head's chain
    with runner-up leaves, int8 kernels on a CPU) for the target the heads read, ngram for any other (whose features a head
    cannot read), both drafters the registry knows."""
    from specpool.core.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET, FALLBACK_DRAFTER
    from specpool.drafters.registry import known_spec
    from specpool.services.engine import default_drafter

    assert default_drafter(DEFAULT_TARGET) == DEFAULT_DRAFTER == "lookup:eagle-alt-int8:general"
    assert default_drafter("/models/some-other-target") == FALLBACK_DRAFTER == "ngram"
    assert known_spec(DEFAULT_DRAFTER) and known_spec(FALLBACK_DRAFTER)
    assert json.loads((eagle.SHIPPED_DIR / "general" / "config.json").read_text())["target"] == DEFAULT_TARGET


def test_the_default_pool_is_every_shipped_head_behind_lookup_and_ngram_on_its_own_target_only() -> None:
    """What a policy chooses among without --pool: for the heads' target, the general head behind
    lookup first, then each other shipped head behind lookup (each with runner-up leaves and int8 kernels), then ngram; any other target gets
    ngram and the zoo (a head would be refused there). Every arm is a spec the registry knows."""
    from specpool.core.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET
    from specpool.drafters.registry import DrafterContext, known_spec
    from specpool.drafters.zoo import shipped_names
    from specpool.services.engine import LocalDrafters, default_pool

    pool = default_pool(DEFAULT_TARGET)
    heads = eagle.shipped_heads()
    assert pool[0] == DEFAULT_DRAFTER and pool[-1] == "ngram"
    assert sorted(pool[1:-1]) == sorted(f"lookup:eagle-alt-int8:{name}" for name in heads if name != "general")
    assert len(pool) == len(set(pool)) == len(heads) + 1
    assert all(known_spec(spec) for spec in pool)
    assert default_pool() == pool  # the served default config serves DEFAULT_TARGET
    other = default_pool("/models/some-other-target")
    assert other == ["ngram"] + shipped_names() and not any("eagle" in spec for spec in other)
    # The embedded engine's pool follows its own target.
    assert LocalDrafters(DrafterContext(Path("/nonexistent"), "/models/some-other-target"), "fp").default_pool() == other
    assert LocalDrafters(DrafterContext(Path("/nonexistent"), DEFAULT_TARGET), "fp").default_pool() == pool
