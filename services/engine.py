"""The embedded engine: target, drafters and the speculative loop in one process, no servers."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from drafters.base import Drafter
from drafters.registry import DrafterContext, create_drafter
from router.errors import check
from router.loop import FixedChooser, GenerationResult, speculative_generate
from target.models import DEFAULT_TARGET, ModelConfig, chat_prompt_ids, check_same_tokenizer, load_causal_lm
from target.sampling import SamplingParams, validate_draft_length
from target.verifier import TargetVerifier


@dataclass(frozen=True)
class EngineConfig:
    home: Path  # specpool cache directory
    target: ModelConfig = field(default_factory=ModelConfig)
    drafter_device: str = "cpu"  # where model drafters run
    drafter_dtype: str = "auto"
    cache_capacity: int = 64  # sessions whose KV caches stay resident, per model


class EmbeddedEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model, self.tokenizer = load_causal_lm(config.target, config.home)
        self.verifier = TargetVerifier(self.model, self.tokenizer, config.cache_capacity)
        self._drafters: dict[str, Drafter] = {}

    @classmethod
    def default(cls, home: Path) -> "EmbeddedEngine":
        return cls(EngineConfig(home=home, target=ModelConfig(DEFAULT_TARGET)))

    # -- drafters -------------------------------------------------------------------------------
    def drafter(self, spec: str) -> Drafter:
        """The drafter a spec names, built once and checked against the target's tokenizer."""
        if spec not in self._drafters:
            context = DrafterContext(
                self.config.home, self.config.target.name, self.config.drafter_device, self.config.drafter_dtype
            )
            drafter = create_drafter(spec, context)
            if drafter.tokenizer_fingerprint is not None:
                check_same_tokenizer(self.verifier.tokenizer_fingerprint, drafter.tokenizer_fingerprint, spec)
            self._drafters[spec] = drafter
        return self._drafters[spec]

    # -- prompts --------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        check(bool(prompt.strip()), "the prompt is empty")
        if raw:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return chat_prompt_ids(self.tokenizer, prompt)

    def stop_token_ids(self) -> tuple[int, ...]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos])
        return tuple(sorted(i for i in ids if i is not None))

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        drafter: str | None,
        k: int = 5,
        on_tokens: Callable[[list[int]], None] | None = None,
        session_id: str | None = None,
    ) -> GenerationResult:
        validate_draft_length(k)
        params.validate(self.verifier.context_window, len(prompt_ids))
        drafters = {drafter: self.drafter(drafter)} if drafter is not None else {}
        session = session_id or uuid.uuid4().hex
        try:
            return speculative_generate(
                prompt_ids, session_id=session, drafters=drafters, chooser=FixedChooser(drafter),
                verifier=self.verifier, params=params, k=k, on_tokens=on_tokens,
            )
        finally:
            self.verifier.release(session)
            for d in drafters.values():
                d.release(session)


class TextStreamer:
    """Incremental detokenisation: emits only new, complete text (no half UTF-8 characters)."""

    def __init__(self, tokenizer, write: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.write = write
        self.token_ids: list[int] = []
        self.sent = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.token_ids.extend(new_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            return
        if len(text) > self.sent:
            self.write(text[self.sent:])
            self.sent = len(text)

    def flush(self) -> None:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if len(text) > self.sent:
            self.write(text[self.sent:])
            self.sent = len(text)
