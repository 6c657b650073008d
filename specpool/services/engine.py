"""The embedded engine: target, drafters and the request orchestrator in one process, no servers.

``EmbeddedEngine`` is the orchestrator (``specpool/services/orchestrator.py``) over in-process
parts: ``LocalDrafters`` (drafters built from specs on first use, checked against the target's
tokenizer), the local ``TargetVerifier``, an in-memory session store (or the one given) and,
with ``learning``, online learning in this process. ``generate`` is the CLI's and the
benchmarks' entry: prompt ids in, the loop's ``GenerationResult`` out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specpool.core.defaults import DEFAULT_DRAFTER, DEFAULT_K, DEFAULT_POLICY, DEFAULT_TENANT, FALLBACK_DRAFTER
from specpool.drafters.base import Drafter
from specpool.drafters.eagle import shipped_heads
from specpool.drafters.registry import DrafterContext, create_drafter
from specpool.drafters.zoo import shipped_names
from specpool.learning.learner import EmbeddedLearning
from specpool.learning.learning_config import LearningConfig
from specpool.router.loop import GenerationResult, RoundRecord
from specpool.router.policies import PolicyOptions
from specpool.router.session_store import InMemorySessionStore, SessionStore
from specpool.services.detokenize import Chunk
from specpool.services.orchestrator import ModelInfo, Orchestrator, OrchestratorSettings
from specpool.target.models import DEFAULT_TARGET, ModelConfig, check_same_tokenizer, load_causal_lm, stop_token_ids
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier


@dataclass(frozen=True)
class EngineConfig:
    home: Path  # specpool cache directory
    target: ModelConfig = field(default_factory=ModelConfig)
    drafter_device: str = "cpu"  # where model drafters run
    drafter_dtype: str = "auto"
    cache_capacity: int = 64  # sessions whose KV caches stay resident, per model


def default_pool(target: str = DEFAULT_TARGET) -> list[str]:
    """The drafters a policy chooses among unless told otherwise (`specpool generate --policy`,
    `specpool serve`, `specpool bench --policies`, the OpenAI API).

    For the target the shipped heads were trained on: every shipped head behind prompt lookup, drafting
    its chain with runner-up leaves, the general head first (DEFAULT_DRAFTER), and n-gram. With
    leaves on every head, `metasd-ucb+warm` ran 0.93x the oracle against 0.90x with leaves on the
    general head alone (bench/results/white-box-leaves/). Side by side with the zoo drafters that were the
    default before (bench/results/zoo-vs-white-box/, 24 dev prompts), `lookup:eagle:general` ran
    1.42x target-only, n-gram 1.25x, each zoo drafter 0.86-1.08x (ahead of it only on code, by 0.06x,
    and on chat, where nothing gains); `metasd-ucb` over this pool ran 1.37x (bench/results/white-box-v5-policies/). Any other target: n-gram and the
    shipped zoo drafters, since a head reads its own target's features.
    """
    heads = shipped_heads()
    if target == DEFAULT_TARGET and "general" in heads:
        arm = DEFAULT_DRAFTER.removesuffix(":general")  # every head drafts as the general one does
        return [DEFAULT_DRAFTER] + [f"{arm}:{name}" for name in heads if name != "general"] + [FALLBACK_DRAFTER]
    return [FALLBACK_DRAFTER] + shipped_names()


def default_drafter(target: str) -> str:
    """The fixed drafter of a request that names none: DEFAULT_DRAFTER for the target the shipped
    heads were trained on, FALLBACK_DRAFTER for any other (a head is refused by another target)."""
    return DEFAULT_DRAFTER if target == DEFAULT_TARGET and "general" in shipped_heads() else FALLBACK_DRAFTER


def default_policy(pool_named: bool, target: str = DEFAULT_TARGET) -> str:
    """The served router's policy when `specpool serve` (and `bench-served`) is given no --policy.

    Over the default pool (no --pool): ``fixed:`` the default drafter, the configuration that
    measured fastest, as `specpool generate` uses it. Side by side over that pool, `metasd-ucb`
    ran behind it: 1.37x against 1.41x target-only on 24 dev prompts and 1.24x against 1.34x on
    held-out ones (bench/results/white-box-v5-policies/, white-box-v5-heldout/), and served, one
    session on 6 dev prompts, 20.7 against 21.8 tokens/s (bench/results/served-default-config/):
    the shipped heads differ too little for the bandit's exploration to pay. A request may still
    name `metasd-ucb` (or any policy) over the pool served. Over a pool the caller names: DEFAULT_POLICY.
    """
    return DEFAULT_POLICY if pool_named else f"fixed:{default_drafter(target)}"


class LocalDrafters:
    """The embedded ``DrafterSource``: any drafter spec, built once on first use and checked
    against the target's tokenizer."""

    def __init__(self, context: DrafterContext, target_fingerprint: str):
        self.context = context
        self.target_fingerprint = target_fingerprint
        self._built: dict[str, Drafter] = {}

    def drafter(self, name: str) -> Drafter:
        if name not in self._built:
            drafter = create_drafter(name, self.context)
            if drafter.tokenizer_fingerprint is not None:
                check_same_tokenizer(self.target_fingerprint, drafter.tokenizer_fingerprint, name)
            self._built[name] = drafter
        return self._built[name]

    def default_pool(self) -> list[str]:
        return default_pool(self.context.target)


class EmbeddedEngine:
    def __init__(self, config: EngineConfig, store: SessionStore | None = None, learning: LearningConfig | None = None):
        self.config = config
        self.model, self.tokenizer = load_causal_lm(config.target, config.home)
        self.verifier = TargetVerifier(self.model, self.tokenizer, config.cache_capacity)
        self.drafters = LocalDrafters(
            DrafterContext(config.home, config.target.name, config.drafter_device, config.drafter_dtype),
            self.verifier.tokenizer_fingerprint,
        )
        # Bandit state per (tenant, session). In memory by default: the embedded mode needs no Redis.
        self.store = store if store is not None else InMemorySessionStore()
        info = ModelInfo(config.target.name, stop_token_ids(self.model, self.tokenizer), self.verifier.context_window,
                         self.verifier.tokenizer_fingerprint)
        self.orchestrator = Orchestrator(self.tokenizer, info, self.drafters, self.verifier, self.store,
                                         OrchestratorSettings(keep_caches=False))
        self.learning = EmbeddedLearning(learning, config.home) if learning is not None else None

    @property
    def learning(self) -> EmbeddedLearning | None:
        """Online learning (specpool/learning/learner.py): feedback stream, learner thread,
        hot-swapped drafters; None: off."""
        return self._learning

    @learning.setter
    def learning(self, learning: EmbeddedLearning | None) -> None:
        # Settable after construction (tests and benchmarks swap in one with other settings):
        # the orchestrator's feedback wiring follows.
        self._learning = learning
        self.orchestrator.feedback = learning

    def close(self) -> None:
        """Stop the learner thread (it commits what it has applied first)."""
        if self.learning is not None:
            self.learning.close()

    @classmethod
    def default(cls, home: Path) -> "EmbeddedEngine":
        return cls(EngineConfig(home=home, target=ModelConfig(DEFAULT_TARGET)))

    def drafter(self, spec: str) -> Drafter:
        """The drafter a spec names, built once and checked against the target's tokenizer."""
        return self.drafters.drafter(spec)

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        return self.orchestrator.encode("raw" if raw else "prompt", prompt)

    def stop_token_ids(self) -> tuple[int, ...]:
        return self.orchestrator.info.stop_token_ids

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        drafter: str | None = None,
        k: int = DEFAULT_K,
        on_tokens: Callable[[list[int]], None] | None = None,
        session_id: str | None = None,
        *,
        policy: str | None = None,
        pool: list[str] | None = None,
        tenant: str = DEFAULT_TENANT,
        policy_options: PolicyOptions | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        trace: bool = False,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """One request. Either ``drafter`` (one fixed drafter, or None: target-only) or ``policy``
        (a bandit over ``pool``, default every drafter we have) picks the drafter each round.
        ``on_tokens`` gets each round's new tokens; ``on_text`` the text they complete (no half
        characters), the rest once the output ends: together, the decoded output."""
        prepared = self.orchestrator.prepare_ids(
            prompt_ids, params, k=k, session_id=session_id, tenant=tenant, drafter=drafter, policy=policy, pool=pool,
            policy_options=policy_options, trace=trace,
        )

        def on_chunk(chunk: Chunk) -> None:
            if on_tokens is not None:
                on_tokens(chunk.token_ids)
            if on_text is not None and chunk.text:
                on_text(chunk.text)

        streaming = on_tokens is not None or on_text is not None
        outcome = self.orchestrator.run(prepared, on_chunk if streaming else None, on_round=on_round)
        if on_text is not None and outcome.tail_text:
            on_text(outcome.tail_text)
        return outcome.result
