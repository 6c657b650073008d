"""A Hugging Face causal LM as drafter, with its own prefix-reusing KV cache per session.

It samples each draft token from its own top-K truncated, renormalised distribution and returns
exactly that sparse q, so verification stays exact (docs/ARCHITECTURE.md, "Lossless by construction").
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specpool.drafters.base import CostMeter, Proposal
from specpool.drafters.registry import DrafterContext, register_drafter
from specpool.core.errors import InvalidArgument
from specpool.target.kv_cache import SessionCaches
from specpool.target.models import ModelConfig, load_causal_lm, tokenizer_fingerprint
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams, request_generator

DRAFTER_STREAM = 1  # random stream id of drafter draws (the target uses 0)
LEAF_STREAM = 2  # random stream id of the runner-up leaves a sampled tree draws (specpool/drafters/eagle.py)


def proposal_dist(logits: torch.Tensor, params: SamplingParams, top_k: int,
                  output_ids: torch.Tensor | None = None) -> SparseDist:
    """q for one position from a drafter's logits (V,): one-hot argmax when greedy, else the
    top-K of softmax(logits / T) renormalised, T being the request's temperature. ``output_ids``
    (V,) maps a reduced output vocabulary's indices to token ids (None: identity)."""
    if params.greedy:
        index = int(logits.argmax())
        return SparseDist.one_hot(index if output_ids is None else int(output_ids[index]))
    values, ids = torch.topk(logits.float(), min(top_k, logits.shape[-1]))  # (K,), sorted
    values = (values - values[0]) / params.temperature  # max-shifted: safe at tiny temperatures
    ids = ids.cpu()
    if output_ids is not None:
        ids = output_ids[ids]
    return SparseDist(ids, torch.softmax(values, dim=-1).cpu())


def confidence_stop(logits: torch.Tensor, i: int, k: int, threshold: float) -> bool:
    """Whether drafting stops after position ``i`` of ``k``: the drafter's top probability there
    (logits (V,)) is below ``threshold`` (0: never stops early)."""
    if threshold <= 0.0 or i + 1 >= k:
        return False
    return float(torch.softmax(logits.float(), dim=-1).max()) < threshold


def sample_draft(dist: SparseDist, params: SamplingParams, position: int) -> int:
    """The draft token at context ``position`` drawn from q = ``dist`` (argmax when greedy), on the
    drafters' random stream of the request (the target draws from another)."""
    if params.greedy:
        return int(dist.token_ids[0])
    gen = request_generator(params.seed, position, DRAFTER_STREAM)
    return int(dist.token_ids[torch.multinomial(dist.probs, 1, generator=gen)])


class HFModelDrafter:
    def __init__(
        self,
        name: str,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        top_k: int = 16,  # support of q: wider costs wire and time, narrower costs acceptance
        cache_capacity: int = 64,
        confidence_threshold: float = 0.0,  # stop drafting once the drafter's top probability falls below
        output_ids: torch.Tensor | None = None,  # (V_out,) model output index -> token id; None = identity
    ):
        if top_k < 1:
            raise InvalidArgument(f"drafter top-k must be >= 1, got {top_k}")
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.top_k = top_k
        # Dynamic draft length (as transformers' assistant_confidence_threshold): a token the
        # drafter itself doubts is likely rejected, and on a CPU every extra verify position
        # costs. Where to stop depends only on the drafter's own state, so verification stays exact.
        self.confidence_threshold = confidence_threshold
        self.caches = SessionCaches(model, cache_capacity)
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        self.cost = CostMeter()
        # Models with a reduced output vocabulary (zoo drafters) map their indices to token ids.
        self.output_ids = output_ids

    def proposal_dist(self, logits: torch.Tensor, params: SamplingParams) -> SparseDist:
        return proposal_dist(logits, params, self.top_k, self.output_ids)

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        started = time.perf_counter()
        cache = self.caches.get(session_id)
        tokens: list[int] = []
        q: list[SparseDist] = []
        forward_s = 0.0
        for i in range(k):
            step = time.perf_counter()
            logits = cache.logits(context_ids + tokens, n_last=1)[0]  # (V,)
            forward_s += time.perf_counter() - step
            dist = self.proposal_dist(logits, params)
            token = sample_draft(dist, params, len(context_ids) + i)
            tokens.append(token)
            q.append(dist)
            if self._stops_after(logits, i, k):
                break
        self.cost.record(time.perf_counter() - started, len(tokens))
        return Proposal(tokens, q, forward_s)

    def _stops_after(self, logits: torch.Tensor, i: int, k: int) -> bool:
        """Whether drafting stops after position ``i`` of ``k``: the drafter doubts its own token
        there (confidence stop). ``propose`` and ``replay`` share it, so a replay stops where a
        proposal would have."""
        return confidence_stop(logits, i, k, self.confidence_threshold)

    def replay(self, session_id: str, context_ids: list[int], continuation: list[int], k: int,
               params: SamplingParams) -> int:
        """``specpool.drafters.base.Replayable``: the target's tokens fed teacher-forced in one forward;
        a position is proposed while the drafter agrees with them and its confidence stop (as in
        ``propose``) has not fired. The cache then holds the context and the continuation but its
        last token, so a later ``propose`` only catches up on what follows."""
        if not params.greedy:
            raise InvalidArgument("replay needs greedy decoding: a sampled draft is not determined by the context")
        n = min(k, len(continuation))
        if n <= 0:
            return 0
        logits = self.caches.get(session_id).logits(context_ids + continuation[: n - 1], n_last=n)  # (n, V)
        accepted = 0
        for i in range(n):
            if int(self.proposal_dist(logits[i], params).token_ids[0]) != continuation[i]:
                break
            accepted = i + 1
            if self._stops_after(logits[i], i, k):
                break
        return accepted

    def release(self, session_id: str) -> None:
        self.caches.release(session_id)


@register_drafter("hf")
def _make_hf(name: str, argument: str, context: DrafterContext) -> HFModelDrafter:
    """``hf:PATH_OR_HUB_ID``: any causal LM sharing the target's tokenizer."""
    if not argument:
        raise InvalidArgument("the hf drafter needs a model: hf:PATH_OR_HUB_ID")
    model, tokenizer = load_causal_lm(ModelConfig(argument, context.device, context.dtype), context.home)
    return HFModelDrafter(name, model, tokenizer)


@register_drafter("early-exit")
def _make_early_exit(name: str, argument: str, context: DrafterContext) -> HFModelDrafter:
    """``early-exit:N``: the target's own first N layers plus its norm and LM head, untrained.

    The self-speculative drafter of Draft & Verify (Zhang et al. 2023) and LayerSkip (Elhoushi
    et al. 2024), without their training: a drafter that needs no extra weights and shares the
    tokenizer by construction. Useful as a model drafter baseline and for peer comparisons.
    """
    try:
        layers = int(argument)
    except ValueError:
        raise InvalidArgument(f"bad drafter spec {name!r}; use early-exit:N with N the number of layers") from None
    if layers < 1:
        raise InvalidArgument(f"early-exit needs at least one layer, got {layers}")
    config = ModelConfig(context.target, context.device, context.dtype)
    model, tokenizer = load_causal_lm(config, context.home, num_hidden_layers=layers)
    return HFModelDrafter(name, model, tokenizer)
