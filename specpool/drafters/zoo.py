"""Zoo drafters: small domain drafters distilled from the target (specpool/learning/zoo_train.py).

Shipped ones live in ``specpool/drafters/zoo/<name>/`` and load by name (``--drafter code``); any trained
folder loads with ``zoo:PATH``. A zoo drafter borrows the target's embedding matrix at load time,
so it needs the target it was distilled from (checked by tokenizer fingerprint).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file

from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.registry import DrafterContext, register_drafter, register_name_resolver
from specpool.drafters.weight_storage import unpack
from specpool.drafters.zoo_model import ZooConfig, ZooLM
from specpool.core.errors import InvalidArgument, ModelUnavailable
from specpool.target.models import ModelConfig, resolve_model

SHIPPED_DIR = Path(__file__).parent / "zoo"
MANIFEST = SHIPPED_DIR / "manifest.json"


def shipped_names() -> list[str]:
    """Drafter folders shipped in specpool/drafters/zoo/ (their hashes are in the manifest)."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").exists())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_zoo_model(folder: Path, home: Path, target: str, device: str = "cpu") -> tuple[ZooLM, dict]:
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not config_path.exists() or not weights_path.exists():
        raise ModelUnavailable(f"{folder} is not a zoo drafter (needs config.json and model.safetensors)")
    metadata = json.loads(config_path.read_text())
    target_dir = Path(resolve_model(target, home))
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as handle:
        embedding = handle.get_tensor("model.embed_tokens.weight").float()  # (V, d) frozen, shared
    try:
        weights = unpack(load_file(str(weights_path)))  # float16 or int8 storage (weight_storage.py)
    except Exception as exc:  # noqa: BLE001
        raise ModelUnavailable(f"{weights_path} is unreadable ({exc})") from exc
    model = ZooLM(ZooConfig(**metadata["model"]), embedding, weights["vocab_ids"].long())
    model.load_state_dict(weights)
    model.to(device).eval()
    return model, metadata


class ZooDrafter(HFModelDrafter):
    """An ``HFModelDrafter`` whose network outputs the reduced vocabulary; q is mapped back to
    full-vocabulary ids through ``vocab_ids``."""

    def __init__(self, name: str, model: ZooLM, metadata: dict, top_k: int = 16, confidence_threshold: float = 0.4):
        # Small drafters are often unsure; stopping at confidence < 0.4 (transformers' default
        # for assistants) keeps doubtful tokens out of the verify pass.
        super().__init__(name, model, tokenizer=None, top_k=top_k, confidence_threshold=confidence_threshold,
                         output_ids=model.vocab_ids.cpu())
        self.metadata = metadata
        self.tokenizer_fingerprint = metadata["target_tokenizer_fingerprint"]


def _load(name: str, folder: Path, context: DrafterContext) -> ZooDrafter:
    # A zoo drafter distilled from another target still loads; the engine's tokenizer check
    # decides whether the pair is compatible.
    model, metadata = load_zoo_model(folder, context.home, context.target, context.device)
    return ZooDrafter(name, model, metadata)


def zoo_folder(argument: str) -> Path:
    """A shipped drafter's name (``general``) -> its folder in specpool/drafters/zoo/; anything else is a
    path to a trained folder."""
    return SHIPPED_DIR / argument if argument in shipped_names() else Path(argument).expanduser()


@register_drafter("zoo")
def _make_zoo(name: str, argument: str, context: DrafterContext) -> ZooDrafter:
    """``zoo:NAME`` (a shipped drafter) or ``zoo:PATH`` (a trained folder)."""
    if not argument:
        raise InvalidArgument(f"zoo drafter needs a name or folder; shipped: {', '.join(shipped_names()) or 'none'}")
    return _load(name, zoo_folder(argument), context)


@register_name_resolver
def _resolve_shipped(spec: str) -> str | None:
    """Bare shipped names (``code``, ``math``, ...) mean ``zoo:NAME``."""
    return f"zoo:{spec}" if spec in shipped_names() else None




# --- shipping: file hashes and a reference acceptance per drafter -----------------------------

# A fixed prompt per domain for the shipped drafters' reference acceptance (not from dev.jsonl).
REFERENCE_PROMPTS = {
    "code": 'Complete the following Python function.\n\n```python\ndef is_palindrome(text: str) -> bool:\n'
            '    """Return True if text reads the same forwards and backwards, ignoring case."""\n```',
    "math": "A baker makes 48 cupcakes and sells them in boxes of 6. She sells 5 boxes. How many cupcakes are left?",
    "translation": "Translate English to German: The committee will discuss the new proposal next week .",
    "summarization_qa": "The city council voted on Tuesday to build a new library downtown. The project will cost "
                        "12 million dollars and open in 2027.\n\nTL;DR:",
    "chat": "Give me three tips for staying focused while studying.",
    "general": "Give me three tips for staying focused while studying.",
}
REFERENCE_SETTINGS = {"k": 5, "max_new_tokens": 48, "temperature": 0.0}


def shipped_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def build_manifest(names: list[str], target: str, target_fingerprint: str, measure,
                   shipped_dir: Path = SHIPPED_DIR) -> dict:
    """Hashes of every shipped file and each drafter's acceptance on its reference prompt, for the
    drafters (or white-box heads, specpool/drafters/heads/) in ``shipped_dir``.

    ``measure(name, prompt) -> mean accepted length`` runs the drafter (greedy, REFERENCE_SETTINGS).
    """
    drafters = {}
    for name in names:
        folder = shipped_dir / name
        metadata = json.loads((folder / "config.json").read_text())
        prompt = REFERENCE_PROMPTS.get(metadata["domain"], REFERENCE_PROMPTS["general"])
        drafters[name] = {
            "domain": metadata["domain"],
            "files": {p.name: file_sha256(p) for p in shipped_files(folder)},
            "reference": {"prompt": prompt, **REFERENCE_SETTINGS, "mean_accepted_length": round(measure(name, prompt), 4)},
        }
    return {"target": target, "target_tokenizer_fingerprint": target_fingerprint, "drafters": drafters}
