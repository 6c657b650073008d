"""Shared fixtures: tiny randomly initialised Llama models and word-level tokenizers, saved to a
session folder so they load through the same paths as real models (``load_causal_lm``, ``hf:DIR``).

Models:
- ``target``: the target (seed 0).
- ``noisy``: the target's weights plus small noise: agrees with the target often, not always.
- ``random``: an unrelated random model with the target's tokenizer: mostly rejected.
- ``other``: a random model with a *different* tokenizer (incompatible drafter).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specpool.target.models import ModelConfig, load_causal_lm
from specpool.target.verifier import TargetVerifier

VOCAB_SIZE = 64
CONTEXT_WINDOW = 256
SPECIALS = ["[UNK]", "<s>", "</s>"]  # ids 0, 1, 2 (LlamaConfig's default bos=1, eos=2)
WORDS = (
    "the a cat dog sat on mat ran to house big small red blue green tree sun moon star sky "
    "and or but if then when where why how is was are were be been have has had do did will "
    "would can could say said go went see saw make made one two three four five six seven eight nine"
).split()
OTHER_WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega red green blue cyan magenta yellow black white grey "
    "north south east west up down left right in out near far hot cold wet dry old new fast slow "
    "low high one two three four five six"
).split()
assert len(SPECIALS) + len(WORDS) == VOCAB_SIZE, len(WORDS)
assert len(SPECIALS) + len(OTHER_WORDS) == VOCAB_SIZE, len(OTHER_WORDS)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def make_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_WINDOW,
        bos_token_id=1,
        eos_token_id=2,
        # Wider than the default 0.02: peakier distributions, so greedy argmaxes are not decided
        # by float round-off and the noisy drafter can agree with the target.
        initializer_range=0.3,
    )


def make_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(make_config()).eval()


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """The same weights plus Gaussian noise of ``scale`` times each tensor's own std."""
    copy = make_model(seed)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        std = float(tensor.float().std()) if tensor.numel() > 1 else 0.0
        state[name] = tensor + scale * std * torch.randn(tensor.shape, generator=gen)
    copy.load_state_dict(state)
    return copy.eval()


def _save(folder: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    """specpool's cache directory for the tests (nothing is ever fetched into it)."""
    return tmp_path_factory.mktemp("specpool-home")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("models")
    tokenizer = make_tokenizer(WORDS)
    target = make_model(0)
    return SimpleNamespace(
        target=_save(root / "target", target, tokenizer),
        noisy=_save(root / "noisy", noisy_copy(target, 0.1, seed=1), tokenizer),
        random=_save(root / "random", make_model(2), tokenizer),
        other=_save(root / "other", make_model(3), make_tokenizer(OTHER_WORDS)),
    )


@pytest.fixture(scope="session")
def target_lm(model_dirs, home):
    """(model, tokenizer) of the target, loaded the way the engine loads any model."""
    return load_causal_lm(ModelConfig(str(model_dirs.target)), home)


@pytest.fixture(scope="session")
def noisy_lm(model_dirs, home):
    return load_causal_lm(ModelConfig(str(model_dirs.noisy)), home)


@pytest.fixture(scope="session")
def random_lm(model_dirs, home):
    return load_causal_lm(ModelConfig(str(model_dirs.random)), home)


@pytest.fixture
def verifier(target_lm) -> TargetVerifier:
    model, tokenizer = target_lm
    return TargetVerifier(model, tokenizer)


def _prompt_texts(n: int = 24) -> list[str]:
    """Deterministic prompts; most repeat a phrase so that n-gram lookup has something to find."""
    rng = random.Random(1234)
    texts = []
    for i in range(n):
        phrase = rng.sample(WORDS, rng.randint(2, 4))
        head = rng.sample(WORDS, rng.randint(0, 3))
        tail = rng.sample(WORDS, rng.randint(1, 3))
        body = phrase * rng.randint(2, 3) if i % 4 else rng.sample(WORDS, 6)
        texts.append(" ".join(head + body + tail + phrase[:2]))
    return texts


@pytest.fixture(scope="session")
def prompt_texts() -> list[str]:
    return _prompt_texts()


PROMPT_CONTINUATION = 24  # target-greedy tokens appended to each prompt (see ``prompts``)


@pytest.fixture(scope="session")
def prompts(target_lm, prompt_texts) -> list[list[int]]:
    """Token ids of 24 prompts (bos included), each followed by the target's own greedy
    continuation of it: the tiny random target drifts into loops, so the contexts contain repeated
    n-grams that the target keeps following, and n-gram drafts are sometimes accepted."""
    model, tokenizer = target_lm
    out = []
    for text in prompt_texts:
        ids = tokenizer.encode(text, add_special_tokens=True)
        out.append(ids + plain_greedy(model, ids, PROMPT_CONTINUATION))
    return out


@torch.inference_mode()
def plain_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Independent reference: a full forward over the whole sequence every step (no KV cache,
    no specpool code), argmax of the last position."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]  # (V,)
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="session")
def greedy_reference():
    return plain_greedy


@pytest.fixture(scope="session")
def engine(model_dirs, home):
    """An embedded engine whose target is the tiny model folder."""
    from specpool.services.engine import EmbeddedEngine, EngineConfig

    return EmbeddedEngine(EngineConfig(home=home, target=ModelConfig(str(model_dirs.target))))


@pytest.fixture
def cli(monkeypatch, tmp_path, capsys, model_dirs):
    """Run ``specpool ARGS`` in-process with the tiny target (``target=None``: no --target);
    returns (exit code, stdout, stderr)."""
    from specpool.cli.main import main

    monkeypatch.setenv("SPECPOOL_HOME", str(tmp_path / "home"))

    def run(*args: str, target: str | None = str(model_dirs.target)):
        argv = list(args) + (["--target", target] if target is not None else [])
        capsys.readouterr()  # drop anything printed before
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse usage errors exit from inside parse_args
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    return run
