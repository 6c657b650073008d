"""The embedded engine: target, drafters and the speculative loop in one process, no servers."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specpool.drafters.base import Drafter
from specpool.drafters.registry import DrafterContext, create_drafter, shared_sources
from specpool.router.bandit import BanditChooser
from specpool.core.errors import InvalidArgument, check
from specpool.router.loop import DrafterChooser, FixedChooser, GenerationResult, RoundRecord, speculative_generate
from specpool.router.policies import PolicyOptions, make_policy, parse_arm
from specpool.router.session_store import InMemorySessionStore, SessionKey, SessionStore
from specpool.target.models import (DEFAULT_TARGET, ModelConfig, chat_prompt_ids, check_same_tokenizer, load_causal_lm,
                           stop_token_ids)
from specpool.target.sampling import SamplingParams, validate_draft_length
from specpool.target.verifier import TargetVerifier

if TYPE_CHECKING:
    from specpool.learning.learner import EmbeddedLearning, LearningConfig


@dataclass(frozen=True)
class EngineConfig:
    home: Path  # specpool cache directory
    target: ModelConfig = field(default_factory=ModelConfig)
    drafter_device: str = "cpu"  # where model drafters run
    drafter_dtype: str = "auto"
    cache_capacity: int = 64  # sessions whose KV caches stay resident, per model


DEFAULT_TENANT = "default"


def default_pool() -> list[str]:
    """The drafters a policy chooses among unless told otherwise: n-gram and every shipped zoo drafter."""
    from specpool.drafters.zoo import shipped_names

    return ["ngram"] + shipped_names()


class EmbeddedEngine:
    def __init__(self, config: EngineConfig, store: SessionStore | None = None, learning: "LearningConfig | None" = None):
        self.config = config
        self.model, self.tokenizer = load_causal_lm(config.target, config.home)
        self.verifier = TargetVerifier(self.model, self.tokenizer, config.cache_capacity)
        self._drafters: dict[str, Drafter] = {}
        # Bandit state per (tenant, session). In memory by default: the embedded mode needs no Redis.
        self.store = store if store is not None else InMemorySessionStore()
        # Online learning (specpool/learning/learner.py): feedback stream, learner thread, hot-swapped drafters.
        self.learning: EmbeddedLearning | None = None
        if learning is not None:
            from specpool.learning.learner import EmbeddedLearning

            self.learning = EmbeddedLearning(learning, config.home)

    def close(self) -> None:
        """Stop the learner thread (it commits what it has applied first)."""
        if self.learning is not None:
            self.learning.close()

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
        return stop_token_ids(self.model, self.tokenizer)

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        drafter: str | None = None,
        k: int = 5,
        on_tokens: Callable[[list[int]], None] | None = None,
        session_id: str | None = None,
        *,
        policy: str | None = None,
        pool: list[str] | None = None,
        tenant: str = DEFAULT_TENANT,
        policy_options: PolicyOptions | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        trace: bool = False,
    ) -> GenerationResult:
        """One request. Either ``drafter`` (one fixed drafter, or None: target-only) or ``policy``
        (a bandit over ``pool``, default every drafter we have) picks the drafter each round."""
        validate_draft_length(k)
        params.validate(self.verifier.context_window, len(prompt_ids))
        session = session_id or uuid.uuid4().hex
        key = SessionKey(tenant, session)  # validates both before any work
        chooser: DrafterChooser
        if policy is None:
            drafters = {drafter: self.drafter(drafter)} if drafter is not None else {}
            chooser = FixedChooser(drafter)
        else:
            if drafter is not None:
                raise InvalidArgument("give either a drafter or a policy, not both (a fixed drafter is policy fixed:NAME)")
            bandit = make_policy(policy, pool if pool is not None else default_pool(), policy_options)
            drafters = {name: self.drafter(name) for name in dict.fromkeys(parse_arm(a)[0] for a in bandit.arms)}
            chooser = BanditChooser(bandit, self.store, key, seed=params.seed, trace=trace,
                                    shared_sources=shared_sources(list(drafters)))
        feedback = None
        if self.learning is not None:  # pin this request's drafter versions; never mixed within it
            drafters, feedback = self.learning.prepare(key.tenant, drafters)
        try:
            result = speculative_generate(
                prompt_ids, session_id=session, drafters=drafters, chooser=chooser,
                verifier=self.verifier, params=params, k=k, on_tokens=on_tokens, on_round=on_round,
                feedback=feedback, return_top_k=self.learning.top_k if feedback is not None else 0,
            )
        finally:
            self.verifier.release(session)
            for d in drafters.values():
                d.release(session)
        if isinstance(chooser, BanditChooser):
            result.chooser_s = chooser.overhead_s
            result.trace = chooser.trace or []
        return result


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
