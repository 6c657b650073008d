"""Per-session KV caches with longest-common-prefix reuse and rollback.

Context travels as full token ids (DESIGN.md); a model keeps the keys/values of the ids it saw
last for a session and reuses the longest common prefix with the new input. A miss costs a
re-prefill, never a wrong answer. Rolling back = cropping the cache to the accepted length, so
rejected draft tokens leave no trace.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` in v5; accept both."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix. List slices compare in C, so the usual case (one
    extends the other) costs one comparison and a mismatch a binary search of them."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class PrefixCache:
    """The KV cache of one session on one model, and the token ids it holds."""

    model: PreTrainedModel
    cache: DynamicCache | None = None
    token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._kwarg = _cache_kwarg(self.model)

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached positions (rollback of rejected drafts)."""
        extra = len(self.token_ids) - length
        if extra > 0 and self.cache is not None:
            self.cache.crop(-extra)  # negative = remove that many from the end (v4 and v5)
        del self.token_ids[length:]

    @torch.inference_mode()
    def logits(self, input_ids: list[int], n_last: int) -> torch.Tensor:
        """Logits (n_last, V) for the last ``n_last`` positions of ``input_ids``.

        Feeds only the part of ``input_ids`` past the cached common prefix; afterwards the cache
        holds exactly ``input_ids``.
        """
        keep = min(common_prefix_length(self.token_ids, input_ids), len(input_ids) - n_last)
        if keep == 0 or self.cache is None:
            # Models with their own cache type (the zoo drafters) say how to make one.
            new_cache = getattr(self.model, "new_cache", None)
            self.cache = new_cache() if new_cache is not None else DynamicCache(config=self.model.config)
            self.token_ids = []
            keep = 0
        else:
            self.truncate(keep)
        new = torch.tensor([input_ids[keep:]], dtype=torch.long, device=self.model.device)  # (1, T)
        out = self.model(input_ids=new, use_cache=True, logits_to_keep=n_last, **{self._kwarg: self.cache})
        self.token_ids = list(input_ids)
        return out.logits[0, -n_last:]  # (n_last, V)


class SessionCaches:
    """Prefix caches keyed by session id, least recently used evicted beyond ``capacity``."""

    def __init__(self, model: PreTrainedModel, capacity: int = 64):
        self.model = model
        self.capacity = capacity
        self._caches: OrderedDict[str, PrefixCache] = OrderedDict()

    def get(self, session_id: str) -> PrefixCache:
        cache = self._caches.pop(session_id, None) or PrefixCache(self.model)
        self._caches[session_id] = cache
        while len(self._caches) > self.capacity:
            self._caches.popitem(last=False)
        return cache

    def release(self, session_id: str) -> None:
        self._caches.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._caches)
