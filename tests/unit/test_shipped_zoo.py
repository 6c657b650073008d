"""The shipped zoo drafters: every file matches its recorded hash, and the pool fits its budget."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from specpool.drafters.zoo import MANIFEST, SHIPPED_DIR, file_sha256, shipped_files, shipped_names
from specpool.learning.zoo_data import DOMAINS

MAX_TOTAL_BYTES = 60 * 1000 * 1000  # the budget for all shipped drafters together
MAX_OWN_PARAMETERS = 10_000_000  # per drafter


def manifest() -> dict:
    assert MANIFEST.exists(), f"{MANIFEST} is missing: run `specpool zoo manifest` after training"
    return json.loads(MANIFEST.read_text())


def test_every_domain_is_shipped() -> None:
    assert set(shipped_names()) == set(DOMAINS)
    on_disk = {p.name for p in SHIPPED_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert on_disk == set(shipped_names()), "a drafter folder is not in the manifest (or the reverse)"


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_shipped_files_match_their_hashes(name: str) -> None:
    recorded = manifest()["drafters"][name]["files"]
    folder = SHIPPED_DIR / name
    assert {p.name for p in shipped_files(folder)} == set(recorded), "files added or removed since the manifest"
    for filename, digest in recorded.items():
        assert file_sha256(folder / filename) == digest, f"{name}/{filename} differs from its recorded hash"


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_shipped_drafter_size_and_shape(name: str) -> None:
    folder = SHIPPED_DIR / name
    config = json.loads((folder / "config.json").read_text())
    assert config["domain"] == name
    assert config["target_tokenizer_fingerprint"] == manifest()["target_tokenizer_fingerprint"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        own = sum(handle.get_tensor(k).numel() for k in handle.keys() if k != "vocab_ids")
        assert len(handle.get_tensor("vocab_ids")) == config["model"]["reduced_vocab"]
    assert own == config["own_parameters"] <= MAX_OWN_PARAMETERS


def test_pool_fits_the_size_budget() -> None:
    total = sum(p.stat().st_size for name in shipped_names() for p in shipped_files(SHIPPED_DIR / name))
    assert total <= MAX_TOTAL_BYTES, f"shipped drafters take {total / 1e6:.1f} MB > 60 MB"
