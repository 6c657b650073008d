"""The target's side of a round: one forward pass over the k+1 positions, then acceptance."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from router.errors import InvalidArgument
from target.kv_cache import SessionCaches
from target.models import context_window, tokenizer_fingerprint
from target.rejection import SparseDist, speculative_verify
from target.sampling import SamplingParams, logits_to_probs, request_generator

TARGET_STREAM = 0  # random stream id of the target's draws (drafters use others)


@dataclass(frozen=True)
class VerifyRequest:
    session_id: str
    context_ids: list[int]  # everything before the first draft token (prompt + generated)
    draft_tokens: list[int]  # x_1..x_k, possibly empty (then this is a plain decode step)
    q: list[SparseDist]  # the proposal each x_i was drawn from
    params: SamplingParams
    return_top_k: int = 0  # > 0: also return the target's sparse top-K p at each position


@dataclass(frozen=True)
class VerifyResult:
    accepted: int  # accepted draft tokens
    tokens: list[int]  # accepted drafts + one recovered or bonus token
    tv: list[float]  # TV(p_j, q_j) per draft position, for the BD reward
    target_top_k: list[SparseDist] | None = None  # softmax(logits) top-K per position, k+1 rows
    forward_s: float = 0.0  # time inside the model forward (the rest is acceptance and bookkeeping)


class TargetVerifier:
    """Verifies drafts for many sessions, each with its own prefix-reusing KV cache."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache_capacity: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.caches = SessionCaches(model, cache_capacity)
        self.vocab_size = int(model.config.vocab_size)
        self.context_window = context_window(model)
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)

    def verify(self, request: VerifyRequest) -> VerifyResult:
        k = len(request.draft_tokens)
        if not request.context_ids:
            raise InvalidArgument("verification needs a non-empty context")
        if len(request.context_ids) + k + 1 > self.context_window:
            raise InvalidArgument(f"context of {len(request.context_ids) + k} tokens exceeds the window {self.context_window}")
        cache = self.caches.get(request.session_id)
        started = time.perf_counter()
        logits = cache.logits(request.context_ids + request.draft_tokens, n_last=k + 1)  # (k+1, V)
        forward_s = time.perf_counter() - started
        p = logits_to_probs(logits, request.params)  # (k+1, V)
        generator = None
        if not request.params.greedy:
            generator = request_generator(request.params.seed, len(request.context_ids), TARGET_STREAM, p.device)
        outcome = speculative_verify(p, request.draft_tokens, request.q, generator, request.params.greedy)
        # Roll back the rejected drafts: the cache keeps context + accepted tokens only.
        cache.truncate(len(request.context_ids) + outcome.accepted)
        top_k = None
        if request.return_top_k > 0:
            probs = torch.softmax(logits.float(), dim=-1)  # (k+1, V) at temperature 1, for distillation
            values, ids = torch.topk(probs, request.return_top_k, dim=-1)  # (k+1, K)
            top_k = [SparseDist(ids[j].cpu(), values[j].cpu()) for j in range(k + 1)]
        return VerifyResult(outcome.accepted, outcome.tokens, outcome.tv, top_k, forward_s)

    def release(self, session_id: str) -> None:
        self.caches.release(session_id)
