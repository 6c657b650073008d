"""Model-free drafter: prompt lookup / n-gram matching.

Saxena, "Prompt Lookup Decoding" (2023); Yang et al., "Inference with Reference" (2023).
Find the longest suffix of the context (``max_ngram`` down to ``min_ngram`` tokens) that occurred
earlier, and propose what followed its most recent occurrence. q is one-hot. When nothing
matches it proposes nothing, so the round is a plain decode step and costs almost nothing extra.
"""

from __future__ import annotations

import time

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from drafters.base import CostMeter, Proposal
from drafters.registry import DrafterContext, register_drafter
from router.errors import InvalidArgument
from target.rejection import SparseDist
from target.sampling import SamplingParams


class NGramDrafter:
    tokenizer_fingerprint = None  # works with any tokenizer

    def __init__(self, name: str = "ngram", max_ngram: int = 4, min_ngram: int = 2):
        self.name = name
        self.max_ngram = max_ngram  # longest suffix tried first: longer matches are more reliable
        self.min_ngram = min_ngram  # 1-token matches are mostly noise and cost a wider verify pass
        self.cost = CostMeter()

    def propose(self, session_id: str, context_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        started = time.perf_counter()
        tokens = self.lookup(context_ids, k)
        self.cost.record(time.perf_counter() - started, max(len(tokens), 1))
        return Proposal(tokens, [SparseDist.one_hot(t) for t in tokens])

    def lookup(self, context_ids: list[int], k: int) -> list[int]:
        context = np.asarray(context_ids, dtype=np.int64)  # (L,)
        length = len(context)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context[length - n:]  # (n,)
            # Windows that start before the suffix itself and have at least one token after them.
            windows = sliding_window_view(context[: length - 1], n)  # (L-n, n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if starts.size:
                begin = int(starts[-1]) + n  # most recent occurrence
                return context[begin: begin + k].tolist()
        return []

    def release(self, session_id: str) -> None:
        pass


@register_drafter("ngram")
def _make_ngram(name: str, argument: str, context: DrafterContext) -> NGramDrafter:
    """``ngram`` or ``ngram:MAX`` or ``ngram:MIN-MAX`` (n-gram lengths tried)."""
    if not argument:
        return NGramDrafter(name)
    low, dash, high = argument.partition("-")
    if not dash:  # ngram:MAX
        low, high = str(min(2, int(low))) if low.isdigit() else low, low
    try:
        max_ngram, min_ngram = int(high), int(low)
    except ValueError:
        raise InvalidArgument(f"bad n-gram drafter spec {name!r}; use ngram, ngram:MAX or ngram:MIN-MAX") from None
    if not 1 <= min_ngram <= max_ngram:
        raise InvalidArgument(f"bad n-gram drafter spec {name!r}: need 1 <= MIN <= MAX")
    return NGramDrafter(name, max_ngram=max_ngram, min_ngram=min_ngram)
