"""The target's side of a round: one forward pass over the k+1 positions, then acceptance.

``verify`` serves one request; ``verify_batch`` serves requests of many sessions with one
batched forward (the Ray Serve target deployment calls it from a ``@serve.batch`` handler).
Both share the acceptance step, so a request's outcome does not depend on which one served it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specpool.core.errors import InvalidArgument, SpecpoolError
from specpool.target.cpu_linear import has_packed_linears
from specpool.target.features import Features
from specpool.target.kv_cache import PrefixCache, SessionCaches, batched_logits_and_features, supports_batched_logits
from specpool.target.models import context_window, tokenizer_fingerprint
from specpool.target.rejection import SparseDist, sibling_draws, speculative_verify, speculative_verify_tree, tv_distance
from specpool.target.sampling import SamplingParams, logits_to_probs, request_generator
from specpool.target.tree import check_tree, greedy_tree_walk, primary_chain

TARGET_STREAM = 0  # random stream id of the target's draws (drafters use others)
# verify_batch splits a batch where padding would cost more than one more forward: the fixed cost
# of a forward (reading all weights) in tokens' worth of compute. See ``plan_forwards``.
SPLIT_COST_TOKENS = 64
# Forward widths (positions fed) worth padding up to on a CPU. MKL's float32 matmuls at 2-3 rows
# (and 6-7) are slower than at 4 (and 8): on the default target, two cores, a forward of 3
# positions took 88 ms, of 4 positions 67 ms, of 7 positions 90 ms, of 8 positions 69 ms. So a
# round with 1-2 drafts verifies 3 positions padded to 4, one with 5-6 drafts pads to 8.
# Measured by ``bench/verify_width.py``; on a GPU every small width costs the same: no padding.
CPU_FORWARD_WIDTHS = (4, 5, 8)
# With oneDNN-packed linears (specpool/target/cpu_linear.py, the CPU default) small widths cost nearly the
# same, except 3, which is slower than 4 (`python -m bench.verify_width`, 2-core AMD EPYC: 3
# positions padded to 4 took 0.88x as long; 2 padded to 4 took 1.20x, 6 to 8 1.02x): so only 3 is
# padded (2 is a width of its own).
PACKED_CPU_FORWARD_WIDTHS = (2, 4)


def forward_width(fed: int, widths: Sequence[int]) -> int:
    """Positions to feed for ``fed`` real ones: the smallest of ``widths`` that holds them, or
    ``fed`` itself. A single position (a plain decode step) is never padded: it is the cheapest
    forward of all, and it is the target-only baseline."""
    if fed < 2:
        return fed
    return min((w for w in widths if w >= fed), default=fed)


@dataclass(frozen=True)
class VerifyRequest:
    session_id: str
    context_ids: list[int]  # everything before the first draft token (prompt + generated)
    draft_tokens: list[int]  # x_1..x_k, possibly empty (then this is a plain decode step)
    q: list[SparseDist]  # the proposal each x_i was drawn from
    params: SamplingParams
    return_top_k: int = 0  # > 0: also return the target's sparse top-K p at each position
    # Also return the features of the positions the target holds after this round (white-box
    # drafters, specpool/target/features.py); False costs nothing.
    return_features: bool = False
    # A draft tree (specpool/target/tree.py): the parent of each draft token, -1 for the last context
    # token; None: the drafts are a chain. Greedy rounds only, without return_top_k.
    tree_parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class VerifyResult:
    accepted: int  # accepted draft tokens
    tokens: list[int]  # accepted drafts + one recovered or bonus token
    tv: list[float]  # TV(p_j, q_j) per draft position, for the BD reward
    target_top_k: list[SparseDist] | None = None  # softmax(logits) top-K per position, k+1 rows
    forward_s: float = 0.0  # time inside the model forward (the rest is acceptance and bookkeeping)
    # With return_features: rows of positions (first fed) .. len(context)+accepted-1, i.e. what
    # the target's cache now holds past the prefix it reused; the bonus token's comes next round.
    features: Features | None = None


def plan_forwards(new_tokens: Sequence[int], split_cost_tokens: int = SPLIT_COST_TOKENS) -> list[list[int]]:
    """Group batch rows (given by how many new tokens each feeds) into forwards.

    Every row of a padded forward is as wide as the widest one, and a pad costs the compute of a
    real token; a separate forward costs one more pass over the weights instead. Rows sorted by
    width join the current group unless widening its rows to the newcomer's width adds more than
    ``split_cost_tokens`` pads. Rows of verification rounds (k+1 tokens each) stay together; a
    fresh session's prompt prefill does not make every other row hundreds of tokens wide.
    Returns row indices per forward.
    """
    groups: list[list[int]] = []
    width = 0
    for i in sorted(range(len(new_tokens)), key=lambda j: new_tokens[j]):
        n = new_tokens[i]
        if not groups or len(groups[-1]) * (n - width) > split_cost_tokens:
            groups.append([])
        groups[-1].append(i)
        width = n
    return groups


def first_branch(request: VerifyRequest) -> VerifyRequest:
    """A tree request as the chain of its first branch (``primary_chain``: the chain the drafter
    drafts with its leaves added), with the same context and sampling."""
    chain = primary_chain(request.tree_parents)
    return dataclasses.replace(request, draft_tokens=[request.draft_tokens[i] for i in chain],
                               q=[request.q[i] for i in chain], tree_parents=None)


class TargetVerifier:
    """Verifies drafts for many sessions, each with its own prefix-reusing KV cache."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cache_capacity: int = 64,
        split_cost_tokens: int = SPLIT_COST_TOKENS,  # see plan_forwards
        forward_widths: Sequence[int] | None = None,  # see forward_width; None: the CPU's widths (above) on a CPU
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.caches = SessionCaches(model, cache_capacity)
        self.vocab_size = int(model.config.vocab_size)
        self.feature_width = int(model.config.hidden_size)  # width of the features white-box heads read
        self.context_window = context_window(model)
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        # Batching needs plain full-attention caches and SDPA attention; other models verify one by one.
        self.batchable = supports_batched_logits(model)
        self.split_cost_tokens = split_cost_tokens
        if forward_widths is None:
            forward_widths = () if model.device.type != "cpu" else (
                PACKED_CPU_FORWARD_WIDTHS if has_packed_linears(model) else CPU_FORWARD_WIDTHS)
        if any(w < 1 for w in forward_widths):
            raise InvalidArgument(f"forward widths must be >= 1, got {list(forward_widths)}")
        self.forward_widths = tuple(sorted(forward_widths))

    # Draft trees are verified here in one forward each (``_verify_tree``), not batched; sampled
    # ones too, where each node's children were drawn from one q without replacement
    # (``speculative_verify_tree``).
    verifies_trees = True
    verifies_sampled_trees = True

    def verify(self, request: VerifyRequest) -> VerifyResult:
        self._check(request)
        if request.tree_parents is not None:
            return self._verify_tree(request)
        k = len(request.draft_tokens)
        cache = self.caches.get(request.session_id)
        ids = request.context_ids + request.draft_tokens
        fed = self.new_tokens(request)
        pad_to = forward_width(fed, self.forward_widths)
        if len(ids) + pad_to - fed > self.context_window:
            pad_to = fed  # no room for pads at the end of the window
        started = time.perf_counter()
        logits, features = cache.logits_and_features(ids, n_last=k + 1, pad_to=pad_to, features=request.return_features)
        return self._accept(request, cache, logits, time.perf_counter() - started, features)  # logits (k+1, V)

    def verify_batch(self, requests: Sequence[VerifyRequest]) -> list[VerifyResult | SpecpoolError]:
        """Verify requests of DIFFERENT sessions in one batched forward pass. Result i belongs to
        request i; an invalid request yields its SpecpoolError in place (it must not fail the
        others). Requests of the same session in one batch are processed one after another (each
        sees the previous one's cache).

        Why: concurrent sessions each send a k+1-token verification; one forward over all of
        them reads the target's weights once instead of once per session. Each request's result
        equals what ``verify`` alone returns (same acceptance code, same per-request random
        stream; logits equal up to float round-off), and every cache is left holding context +
        accepted tokens, as after ``verify``.

        Same-session requests are split into waves (the j-th request of every session forms
        wave j), each wave normally one forward; ``plan_forwards`` splits a wave only where
        padding would cost more than another forward (a prompt prefill among k+1-token rounds).
        A group of one request, or a model whose caches or attention cannot be
        batched (``supports_batched_logits``), goes through ``verify`` itself. A draft tree in a group of
        several is verified as its first branch (``first_branch``). ``forward_s`` of a
        batched result is the wall time of the whole shared forward.
        """
        results: list[VerifyResult | SpecpoolError | None] = [None] * len(requests)
        waves: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, request in enumerate(requests):
            try:
                self._check(request)
            except SpecpoolError as exc:
                results[i] = exc
                continue
            ordinal = seen.get(request.session_id, 0)
            seen[request.session_id] = ordinal + 1
            if ordinal == len(waves):
                waves.append([])
            waves[ordinal].append(i)
        for wave in waves:
            if not self.batchable:
                groups = [[i] for i in wave]
            else:
                new_tokens = [self.new_tokens(requests[i]) for i in wave]
                groups = [[wave[j] for j in group] for group in plan_forwards(new_tokens, self.split_cost_tokens)]
            for group in groups:
                self._verify_group([requests[i] for i in group], group, results)
        return results  # type: ignore[return-value]  # every slot is filled above

    def new_tokens(self, request: VerifyRequest) -> int:
        """How many tokens the forward must feed for ``request``: all but its reusable cached prefix."""
        ids = request.context_ids + request.draft_tokens
        return len(ids) - self.caches.get(request.session_id).reusable(ids, len(request.draft_tokens) + 1)

    def _verify_group(self, batch: list[VerifyRequest], slots: list[int], results: list) -> None:
        """Requests of distinct sessions in one forward; results[slots[j]] gets request j's."""
        if len(batch) == 1:
            try:
                results[slots[0]] = self.verify(batch[0])
            except SpecpoolError as exc:
                results[slots[0]] = exc
            return
        # A tree needs a forward of its own (its attention mask), so in a shared forward it is
        # verified as its first branch, the chain its drafter would have sent alone: a greedy round
        # over fewer drafts, exact all the same. Verified alone, one tree split the forward into one
        # per session: 8 sessions served with runner-up leaves (eagle-alt) ran at 52 tokens/s
        # against 74 for chains.
        batch = [first_branch(r) if r.tree_parents is not None else r for r in batch]
        caches = [self.caches.get(r.session_id) for r in batch]
        started = time.perf_counter()
        outputs = batched_logits_and_features(
            caches,
            [r.context_ids + r.draft_tokens for r in batch],
            [len(r.draft_tokens) + 1 for r in batch],
            features=any(r.return_features for r in batch),
        )  # B x ((k_i+1, V), features)
        forward_s = time.perf_counter() - started
        for slot, request, cache, (rows, features) in zip(slots, batch, caches, outputs):
            try:
                results[slot] = self._accept(request, cache, rows, forward_s,
                                             features if request.return_features else None)
            except SpecpoolError as exc:
                results[slot] = exc

    def _check(self, request: VerifyRequest) -> None:
        """Reject a request before any model work (and before it can join a batch)."""
        k = len(request.draft_tokens)
        if not request.context_ids:
            raise InvalidArgument("verification needs a non-empty context")
        if len(request.context_ids) + k + 1 > self.context_window:
            raise InvalidArgument(f"context of {len(request.context_ids) + k} tokens exceeds the window {self.context_window}")
        if len(request.q) != k:
            raise InvalidArgument(f"need one proposal distribution per draft token: {k} drafts, {len(request.q)} q")
        if not 0 <= request.return_top_k <= self.vocab_size:
            raise InvalidArgument(f"return-top-k must be in 0..{self.vocab_size} (the vocabulary), got {request.return_top_k}")
        if request.tree_parents is not None:
            check_tree(request.tree_parents, k)
            if not request.params.greedy:
                broken = sibling_draws(request.draft_tokens, request.q, request.tree_parents)
                if broken is not None:
                    raise InvalidArgument(f"a sampled draft tree needs each node's children drawn from one q without "
                                          f"replacement: {broken}")
            if request.return_top_k:
                raise InvalidArgument("a draft tree cannot return the target's top-K (online-learning feedback needs a chain)")

    def _accept(self, request: VerifyRequest, cache: PrefixCache, logits: torch.Tensor, forward_s: float,
                features: Features | None = None) -> VerifyResult:
        """Acceptance over the target's logits (k+1, V) for this request's last k+1 positions, the
        cache rollback to context + accepted, and the optional top-K: the part of a round after
        the forward, shared by ``verify`` and ``verify_batch``."""
        k = len(request.draft_tokens)
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
        if features is not None:  # the rejected drafts' rows go with their keys and values
            kept = len(request.context_ids) + outcome.accepted
            features = Features(features.start, features.rows[: max(kept - features.start, 0)])
        return VerifyResult(outcome.accepted, outcome.tokens, outcome.tv, top_k, forward_s, features)

    def _verify_tree(self, request: VerifyRequest) -> VerifyResult:
        """A round over a draft tree (specpool/target/tree.py): one forward over every node, the
        walk down the target's greedy tokens (greedy) or recursive rejection sampling over each
        node's children (sampled, ``speculative_verify_tree``), the cache cut to the context and the
        accepted path. ``tv`` is over the tree's first branch, the chain the drafter would have sent
        alone, so a tree arm's BD reward means what a chain arm's does."""
        cache = self.caches.get(request.session_id)
        parents = request.tree_parents
        n = len(request.context_ids)
        fed = len(request.context_ids) - cache.reusable(request.context_ids, 1) + len(parents)
        # Padded as a chain of as many positions (``verify``); pads sit at depth 1, inside the window.
        pad_to = forward_width(fed, self.forward_widths)
        started = time.perf_counter()
        logits, keep, hidden = cache.tree_logits_and_hidden(request.context_ids, request.draft_tokens, parents, pad_to)
        forward_s = time.perf_counter() - started
        p = logits_to_probs(logits, request.params)  # (1 + N, V): after the root, then after each node
        if request.params.greedy:
            greedy = logits.argmax(dim=-1).tolist()  # (1 + N,)
            path = greedy_tree_walk(greedy, request.draft_tokens, parents)
            last = greedy[path[-1] + 1 if path else 0]
        else:
            generator = request_generator(request.params.seed, n, TARGET_STREAM, p.device)
            path, last = speculative_verify_tree(p, request.draft_tokens, request.q, parents, generator)
        cache.keep_tree_path(n, path)
        tokens = [request.draft_tokens[i] for i in path] + [last]
        tv = [tv_distance(p[parents[i] + 1], request.q[i]) for i in primary_chain(parents)]
        features = None
        if request.return_features:  # the fed context's rows, then the accepted nodes'
            fed = n - keep
            rows = torch.cat([hidden[:fed], hidden[[fed + i for i in path]]]) if path else hidden[:fed]
            features = Features(keep, rows)
        return VerifyResult(len(path), tokens, tv, None, forward_s, features)

    def release(self, session_id: str) -> None:
        self.caches.release(session_id)
