"""Per-session KV caches with longest-common-prefix reuse and rollback.

Context travels as full token ids (docs/ARCHITECTURE.md); a model keeps the keys/values of the ids it saw
last for a session and reuses the longest common prefix with the new input. A miss costs a
re-prefill, never a wrong answer. Rolling back = cropping the cache to the accepted length, so
rejected draft tokens leave no trace.
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specpool.target.attention import grouped_sdpa_attention, runs_sdpa
from specpool.target.features import Features
from specpool.target.tree import ROOT, tree_attention_mask, tree_depths


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

    def reusable(self, input_ids: list[int], n_last: int) -> int:
        """How many cached ids feeding ``input_ids`` would keep: the common prefix, at most all
        but the last ``n_last`` ids (their logits are wanted, so they must be fed again)."""
        if self.cache is None:
            return 0
        return max(0, min(common_prefix_length(self.token_ids, input_ids), len(input_ids) - n_last))

    def reuse(self, input_ids: list[int], n_last: int) -> int:
        """Prepare to feed ``input_ids``: keep ``reusable(input_ids, n_last)`` cached ids, drop the
        rest. Returns how many are kept; the caller feeds ``input_ids[kept:]``. Afterwards the
        cache is consistent (``token_ids`` describes its keys/values) even if the feed never
        happens."""
        keep = self.reusable(input_ids, n_last)
        if keep == 0:
            # Models with their own cache type (the zoo drafters) say how to make one.
            new_cache = getattr(self.model, "new_cache", None)
            self.cache = new_cache() if new_cache is not None else DynamicCache(config=self.model.config)
            self.token_ids = []
            return 0
        self.truncate(keep)
        return keep

    def logits(self, input_ids: list[int], n_last: int, pad_to: int = 0) -> torch.Tensor:
        """Logits (n_last, V) for the last ``n_last`` positions of ``input_ids``.

        Feeds only the part of ``input_ids`` past the cached common prefix; afterwards the cache
        holds exactly ``input_ids``. ``pad_to``: feed at least that many positions, padding after
        the real ones (see ``specpool.target.verifier.forward_width``). Causal attention keeps pads from
        touching the real positions; their logits are dropped and their keys/values cropped.
        """
        return self.logits_and_features(input_ids, n_last, pad_to)[0]

    @torch.inference_mode()
    def logits_and_features(self, input_ids: list[int], n_last: int, pad_to: int = 0,
                            features: bool = False) -> tuple[torch.Tensor, Features | None]:
        """``logits`` and, with ``features``, the final hidden states of every position fed
        (``specpool/target/features.py``): the rows of positions kept .. len(input_ids)-1."""
        keep = self.reuse(input_ids, n_last)
        fed = input_ids[keep:]
        pads = max(0, pad_to - len(fed))
        new = torch.tensor([fed + fed[-1:] * pads], dtype=torch.long, device=self.model.device)  # (1, T + pads)
        extra = {"output_hidden_states": True} if features else {}  # drafters' own models know no such flag
        out = self.model(input_ids=new, use_cache=True, logits_to_keep=n_last + pads, **extra, **{self._kwarg: self.cache})
        if pads:
            self.cache.crop(-pads)  # negative = remove that many from the end (v4 and v5)
        self.token_ids = list(input_ids)
        rows = Features(keep, out.hidden_states[-1][0, : len(fed)]) if features else None  # (T, d), after the last norm
        return out.logits[0, -n_last - pads:out.logits.shape[1] - pads], rows  # (n_last, V)

    @torch.inference_mode()
    def tree_logits_and_hidden(self, context_ids: list[int], tree_tokens: list[int],
                               parents: Sequence[int], pad_to: int = 0) -> tuple[torch.Tensor, int, torch.Tensor]:
        """One forward over the context's uncached tail and a draft tree (specpool/target/tree.py).
        Returns logits (1 + N, V) after the last context token and after each node, ``keep`` (the
        cached prefix reused) and the final hidden states (len(context) - keep + N, d) of every
        position fed. The cache then holds the context and every node: ``keep_tree_path`` cuts it
        to the accepted path. ``pad_to``: feed at least that many positions (as ``logits``); the pads
        are leaves under the root that no node sees, and ``keep_tree_path`` drops them."""
        keep = self.reuse(context_ids, 1)
        fed = context_ids[keep:]
        n = len(context_ids)
        real = len(tree_tokens)
        pads = max(0, pad_to - len(fed) - real)
        tree_tokens = list(tree_tokens) + fed[-1:] * pads
        parents = list(parents) + [ROOT] * pads
        depths = tree_depths(parents)
        positions = list(range(keep, n)) + [n - 1 + d for d in depths]
        device = self.model.device
        mask = tree_attention_mask(parents, keep, len(fed), self.model.dtype, device)
        out = self.model(input_ids=torch.tensor([fed + list(tree_tokens)], dtype=torch.long, device=device),
                         position_ids=torch.tensor([positions], dtype=torch.long, device=device),
                         attention_mask=mask, use_cache=True, logits_to_keep=len(tree_tokens) + 1,
                         output_hidden_states=True, **{self._kwarg: self.cache})
        # What the cache holds now, in feed order, but for the pads after the nodes (never on a path).
        self.token_ids = list(context_ids) + tree_tokens[:real]
        return out.logits[0, : 1 + real], keep, out.hidden_states[-1][0, : len(fed) + real]

    @torch.inference_mode()  # the cache's tensors are inference tensors: updated in place only in this mode
    def keep_tree_path(self, context_length: int, path: Sequence[int]) -> None:
        """After ``tree_logits_and_hidden``: keep the context and the nodes of ``path``, in order.
        Node i sits at cache position context_length + i and path[j] >= j (parents come first), so
        the path's keys and values move down into positions context_length + j in place, and the
        cache is cut after them: the work is the path's, not the context's (a path that is the tree's
        first nodes, the usual case of a chain with runner-up leaves, moves nothing)."""
        nodes = self.token_ids[context_length:]
        moves = [(context_length + j, context_length + i) for j, i in enumerate(path) if i != j]
        if moves:
            device = self.model.device
            to = torch.tensor([d for d, _ in moves], device=device)
            source = torch.tensor([s for _, s in moves], device=device)
            for layer_idx in range(len(self.cache.layers)):
                keys, values = _layer_kv(self.cache, layer_idx)  # (1, H, S, D); the right side is a copy
                keys[:, :, to] = keys[:, :, source]
                values[:, :, to] = values[:, :, source]
        extra = self.cache.get_seq_length() - context_length - len(path)  # the other nodes and the pads
        if extra > 0:
            self.cache.crop(-extra)  # negative = remove that many from the end (v4 and v5)
        self.token_ids = self.token_ids[:context_length] + [nodes[i] for i in path]


def supports_batched_logits(model: PreTrainedModel) -> bool:
    """Whether ``batched_logits`` can serve ``model``: its caches must be plain ``DynamicCache``s of
    full-attention ``DynamicLayer``s, one per layer (keys/values (1, H, S, D) that a session's rows
    extend), and its attention SDPA. Sliding-window or hybrid layers, models with their own cache
    type, and other attention kernels cannot."""
    if getattr(model, "new_cache", None) is not None:
        return False
    try:
        probe = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 - a config DynamicCache does not understand: not batchable
        return False
    full_attention = bool(probe.layers) and all(type(layer) is DynamicLayer for layer in probe.layers)
    return full_attention and _sdpa(model)


def _sdpa(model: PreTrainedModel) -> bool:
    # The ragged batch stands in for SDPA (``_ragged_attention``); eager or flash attention kernels
    # (and their masks) are not what it computes.
    return runs_sdpa(model)


RAGGED_ATTENTION = "specpool_ragged"  # the attention implementation of ``batched_logits_and_features``
_RAGGED_LOCK = threading.Lock()  # one ragged forward at a time: it swaps the model's attention implementation


@dataclass
class _RaggedBatch:
    """What the attention of one ragged forward needs per row: the session's cache and how many of
    the T fed positions are real; and, per layer, that the ragged path served it."""

    caches: list[PrefixCache]
    keeps: list[int]  # c_i: cached positions reused
    fed: list[int]  # n_i: real new positions
    attended: set[int] = field(default_factory=set)  # layer indices the ragged attention served
    # Per row, the causal mask of its queries (None for one query), the same in every layer: built
    # by the first layer's attention, which knows the heads' grouping and the device.
    masks: list[torch.Tensor | None] | None = None


class _RaggedBatchLayer(DynamicLayer):
    """One layer of the batch cache of ``batched_logits_and_features``: it holds nothing itself.
    ``update`` appends each row's real new keys/values to that session's own cache layer (as the
    session's own forward would) and returns the new ones only; ``_ragged_attention`` reads each
    session's cache directly. So no padded (B, H, L + T, D) buffer is built and nothing is copied
    back out of one: the old padded layout copied every session's whole cache twice a forward,
    about 22 % of a served target's time with 8 sessions."""

    def __init__(self, batch: _RaggedBatch, layer_idx: int):
        super().__init__()
        self.batch = batch
        self.layer_idx = layer_idx

    def get_seq_length(self) -> int:
        return max(self.batch.keeps)  # sizes the attention mask that transformers builds (unused)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for i, (cache, n) in enumerate(zip(self.batch.caches, self.batch.fed)):
            cache.cache.layers[self.layer_idx].update(key_states[i : i + 1, :, :n], value_states[i : i + 1, :, :n])
        return key_states, value_states  # (B, H, T, D): the attention below does not read them


def _ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a ragged batch: row i's n_i real queries (1, Hq, n_i, D) attend to session i's
    own c_i + n_i keys, causally, one small SDPA call per row; pad queries get zeros (their outputs
    are never read). Without a ``_RaggedBatch`` in ``kwargs`` (any other forward of the model
    while one runs) it is plain SDPA, so the swap of implementation changes nothing else.

    Grouped-query attention without copying keys: query head h reads key head h // G, so the G
    query heads of one key head are stacked as G * n_i query rows of that head (the causal mask
    repeated G times), which is the same attention."""
    batch: _RaggedBatch | None = kwargs.get(RAGGED_ATTENTION)
    if batch is None:
        return grouped_sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    rows, heads, _, dim = query.shape  # (B, Hq, T, D)
    out = query.new_zeros(rows, query.shape[2], heads, dim)  # (B, T, Hq, D), the layout attention returns
    layer_idx = module.layer_idx
    groups = heads // key.shape[1]  # G query heads per key head
    if batch.masks is None:  # new position j sees the cached ones and the new ones up to j
        batch.masks = [torch.ones(n, keep + n, dtype=torch.bool, device=query.device).tril(keep).repeat(groups, 1)
                       if n > 1 else None for keep, n in zip(batch.keeps, batch.fed)]  # (G * n_i, c_i + n_i)
    for i, (cache, n, mask) in enumerate(zip(batch.caches, batch.fed, batch.masks)):
        keys, values = _layer_kv(cache.cache, layer_idx)  # (1, Hkv, c_i + n_i, D)
        q = query[i, :, :n].reshape(1, keys.shape[1], groups * n, dim)  # (1, Hkv, G * n_i, D)
        o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)  # (1, Hkv, G * n_i, D)
        out[i, :n] = o.reshape(heads, n, dim).transpose(0, 1)  # (n_i, Hq, D)
    batch.attended.add(layer_idx)
    return out, None


AttentionInterface.register(RAGGED_ATTENTION, _ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)  # as SDPA's: other forwards fall back to it


def _layer_kv(cache: DynamicCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[layer_idx]
    return layer.keys, layer.values  # (1, H, S, D) each


def batched_logits(caches: Sequence[PrefixCache], inputs: Sequence[list[int]], n_lasts: Sequence[int]) -> list[torch.Tensor]:
    """``[caches[i].logits(inputs[i], n_lasts[i]) for i]`` in ONE forward pass of the model
    (``batched_logits_and_features`` without features)."""
    return [logits for logits, _ in batched_logits_and_features(caches, inputs, n_lasts)]


@torch.inference_mode()
def batched_logits_and_features(caches: Sequence[PrefixCache], inputs: Sequence[list[int]], n_lasts: Sequence[int],
                                features: bool = False) -> list[tuple[torch.Tensor, Features | None]]:
    """``[caches[i].logits_and_features(inputs[i], n_lasts[i], features=features) for i]`` in ONE
    forward pass of the model.

    Why: on a shared target, B sessions each verifying k+1 positions cost B forwards of k+1
    tokens; one forward of B x (k+1) tokens reads the weights once (the dominant cost of a small
    batch on CPU and GPU alike). Each session keeps its own cache.

    Layout: a *ragged* batch. The new ids of row i (n_i of them, after the c_i cached ids the
    session reuses) are right-padded to T = max n_i; explicit ``position_ids`` give each real id
    its true position (c_i + j), so RoPE sees what the session's own forward would. Everything
    but attention works on the (B, T) batch as is. Attention (``_ragged_attention``) runs per row
    against the session's own cache, which ``_RaggedBatchLayer`` extends by the row's real keys
    first: no padded copy of the caches is built, and each cache ends up holding exactly
    ``inputs[i]``. Pads feed the linear layers only; their outputs are dropped. Results equal the
    per-session forward up to float round-off (a different matmul shape sums in a different
    order), not bitwise.

    All caches must belong to one model that ``supports_batched_logits`` and be distinct objects.
    """
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("batched_logits needs distinct caches (one request per session per forward)")
    model = caches[0].model
    if not _sdpa(model):  # the cache layout is the caller's to check once (supports_batched_logits)
        raise ValueError("this model's attention cannot be batched (supports_batched_logits)")
    device = model.device
    keeps = [cache.reuse(ids, n) for cache, ids, n in zip(caches, inputs, n_lasts)]
    news = [ids[keep:] for ids, keep in zip(inputs, keeps)]
    batch, width = len(caches), max(len(n) for n in news)

    input_ids = torch.zeros(batch, width, dtype=torch.long)  # (B, T)
    position_ids = torch.zeros(batch, width, dtype=torch.long)  # (B, T)
    for i, (new, keep) in enumerate(zip(news, keeps)):
        n = len(new)
        input_ids[i, :n] = torch.tensor(new)
        input_ids[i, n:] = new[-1]  # any valid id: pads are never attended to
        position_ids[i, :n] = torch.arange(keep, keep + n)
        position_ids[i, n:] = keep + n - 1  # a position the model knows (learned tables too)

    ragged = _RaggedBatch(list(caches), keeps, [len(new) for new in news])
    batch_cache = DynamicCache(config=model.config)
    batch_cache.layers = [_RaggedBatchLayer(ragged, layer_idx) for layer_idx in range(len(batch_cache.layers))]

    # Logits only where some session needs them: the union of each row's last n_last real
    # positions (right padding puts them at n_i - n_last .. n_i - 1, different per row).
    wanted = sorted({j for new, m in zip(news, n_lasts) for j in range(len(new) - m, len(new))})
    try:
        with _RAGGED_LOCK:
            implementation = model.config._attn_implementation
            model.config._attn_implementation = RAGGED_ATTENTION
            try:
                out = model(
                    input_ids=input_ids.to(device),
                    position_ids=position_ids.to(device),
                    use_cache=True,
                    logits_to_keep=torch.tensor(wanted, dtype=torch.long, device=device),  # (U,)
                    **({"output_hidden_states": True} if features else {}),
                    **{caches[0]._kwarg: batch_cache, RAGGED_ATTENTION: ragged},
                )
            finally:
                model.config._attn_implementation = implementation
        if len(ragged.attended) != len(batch_cache.layers):
            raise RuntimeError(f"{type(model).__name__} did not pass attention kwargs to every layer: "
                               "its verification cannot be batched")
    except BaseException:
        for cache in caches:  # the caches may hold some layers' new keys: start them afresh next time
            cache.cache, cache.token_ids = None, []
        raise
    hidden = out.hidden_states[-1] if features else None  # (B, T, d), after the last norm
    logits = out.logits  # (B, U, V)
    column = {j: u for u, j in enumerate(wanted)}
    results = []
    for i, (cache, ids, new, keep, m) in enumerate(zip(caches, inputs, news, keeps, n_lasts)):
        n = len(new)
        cache.token_ids = list(ids)
        rows = Features(keep, hidden[i, :n]) if hidden is not None else None  # (n_i, d)
        results.append((logits[i, column[n - m] : column[n - 1] + 1], rows))  # (n_last, V)
    return results


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

    def sessions(self) -> list[str]:
        """The sessions whose cache is held, least recently used first."""
        return list(self._caches)

    def __len__(self) -> int:
        return len(self._caches)
