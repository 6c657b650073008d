"""Sampling parameters and the distributions they define.

The sampling parameters are applied to the *target's* logits: they define p. The drafter's own
settings only shape q (docs/ARCHITECTURE.md, "Lossless by construction").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specpool.core.defaults import DEFAULT_MAX_NEW_TOKENS, MAX_DRAFT_LENGTH
from specpool.core.errors import check



@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy."""

    temperature: float = 0.0  # 0 = greedy (argmax), otherwise softmax(logits / T)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0  # keep only the k most likely tokens; 0 = no limit
    seed: int = 0  # per-request seed: same seed, same output
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # exactly this many tokens unless a stop token comes first
    stop_token_ids: tuple[int, ...] = field(default=())  # generation ends after emitting one of these

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, context_window: int | None = None, prompt_tokens: int = 0) -> None:
        check(math.isfinite(self.temperature) and self.temperature >= 0.0,
              f"temperature must be >= 0 (and finite), got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top-p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"top-k must be >= 0 (0 = no limit), got {self.top_k}")
        check(self.max_new_tokens >= 1, f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if context_window is not None:
            room = context_window - prompt_tokens
            check(
                self.max_new_tokens <= room,
                f"max-new-tokens {self.max_new_tokens} does not fit: the prompt has {prompt_tokens} "
                f"tokens and the model's context window is {context_window} (room for {max(room, 0)})",
            )


def validate_draft_length(k: int) -> None:
    check(1 <= k <= MAX_DRAFT_LENGTH, f"k (draft length) must be in 1..{MAX_DRAFT_LENGTH}, got {k}")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits (T, V) into the sampling distribution p (T, V) the request defines.

    Greedy gives a one-hot on the argmax, so that the speculative-sampling rules below reduce
    exactly to "accept while the draft equals the argmax".
    """
    logits = logits.float()  # (T, V); half precision loses mass in the tail
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    # Subtract the max first: a tiny temperature then tends to the argmax instead of overflowing.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (T, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # (T, V)
        # Drop a token when the mass strictly before it already reaches top_p; the top token stays.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def request_generator(seed: int, position: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one round of one request, derived from (seed, position, stream).

    Deriving it instead of keeping one per request makes a round's randomness independent of
    which process or replica runs it: a retried or re-routed round draws the same numbers, and the
    same seed gives the same output. ``stream`` separates the drafter's draws from the target's.
    """
    # SplitMix64-style mixing so nearby (seed, position) pairs give unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 27
    gen = torch.Generator(device=device)
    gen.manual_seed(x & ((1 << 63) - 1))
    return gen
