"""The zoo drafter's network: a two-layer Llama-style model that borrows the target's embeddings.

Design (see drafters/README in the zoo issue): the input embedding is the target's own frozen
embedding matrix (full vocabulary, loaded from the target at run time, never shipped), and the
output head is the same matrix restricted to a per-drafter *reduced vocabulary* of the tokens
that carry most of the target's probability mass in the drafter's domain. A drafter therefore
ships only its small layers (hidden size = the target's, so the embedding fits without a
projection) plus the list of vocabulary ids, and its q over the reduced vocabulary maps back to
full-vocabulary token ids exactly (mass outside it is zero, which verification handles).

Optional copy term (``copy_window`` > 0): the logits get ``copy_scale * copy_weight`` added on
every reduced-vocabulary token that occurs among the last ``copy_window`` input tokens (the
current one included). A two-layer drafter barely learns to copy, yet on a new domain many of the
target's tokens are names and words from the prompt (13 % of the answer tokens on Tiny
Shakespeare are outside the chat drafter's vocabulary, most of them names the prompt holds). The
weight is one learned scalar that starts at 0, so a drafter with the term is, until it learns,
exactly the drafter without it; the online learner trains it with the rest (specpool/learning/online.py).
``copy_scale`` makes one per-coordinate step of size eta on it a logit-sized move. The KV cache
keeps the token ids it holds, so the term costs one scatter per draft step.

Compact on purpose (nanoGPT / gpt-fast style): one file, own KV cache, no HF machinery, so a
draft step costs little more than its matrix multiplies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specpool.target.cpu_linear import FrozenOutput, InferenceLinear


@dataclass(frozen=True)
class ZooConfig:
    hidden_size: int = 576  # = the target's, so its embedding matrix plugs in directly
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3  # grouped-query attention, as in the target
    intermediate_size: int = 768  # SwiGLU width; 768 keeps six drafters under the 60 MB budget
    reduced_vocab: int = 8192  # output head size: tokens the drafter can propose
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    max_positions: int = 8192
    copy_window: int = 0  # copy term (module docstring): input tokens looked back over; 0 = none
    copy_scale: float = 100.0  # logits per unit of the learned copy weight

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(config: ZooConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (T, head_dim) for rotary embeddings at ``positions`` (T,)."""
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=positions.device) / config.head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, head_dim)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin  # (B, H, T, D)


def vocabulary_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) full token id -> 1 + its index in ``vocab_ids`` (a reduced vocabulary), 0 outside it."""
    index = torch.zeros(vocab_size, dtype=torch.long, device=vocab_ids.device)
    index[vocab_ids] = torch.arange(1, len(vocab_ids) + 1, device=vocab_ids.device)
    return index


class KVCache:
    """Keys and values per layer, grown by concatenation, cropped for rollback; and, for a drafter
    with a copy term (which looks back over them), the token ids they were computed from."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.tokens: torch.Tensor | None = None  # (B, T_all); None without a copy term

    def append_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Record ``input_ids`` (B, T) as fed after the cached ones; returns all ids (B, T_all)."""
        self.tokens = input_ids if self.tokens is None else torch.cat([self.tokens, input_ids], dim=1)
        return self.tokens

    def get_seq_length(self) -> int:
        return self.layer_length(0)

    def layer_length(self, layer: int) -> int:
        keys = self.keys[layer]
        return 0 if keys is None else keys.shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)  # (B, KV, T_all, D)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens from the end (negative, like transformers' crop)."""
        n = -tokens_to_remove
        if n <= 0:
            return
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :-n]
                self.values[i] = self.values[i][:, :, :-n]
        if self.tokens is not None:
            self.tokens = self.tokens[:, :-n]


class Block(nn.Module):
    def __init__(self, config: ZooConfig, index: int):
        super().__init__()
        self.index = index
        self.config = config
        d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.attn_norm = RMSNorm(d, config.rms_eps)
        self.q_proj = InferenceLinear(d, h * hd, bias=False)
        self.k_proj = InferenceLinear(d, kv * hd, bias=False)
        self.v_proj = InferenceLinear(d, kv * hd, bias=False)
        self.o_proj = InferenceLinear(h * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, config.rms_eps)
        self.gate_proj = InferenceLinear(d, config.intermediate_size, bias=False)
        self.up_proj = InferenceLinear(d, config.intermediate_size, bias=False)
        self.down_proj = InferenceLinear(config.intermediate_size, d, bias=False)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, D), keys and values (B, KV, T, D) of ``x`` (B, T, d), rotated."""
        B, T, _ = x.shape
        c = self.config
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output ``attn`` (B, H, T, D) and the MLP."""
        B, T, _ = x.shape
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        T = x.shape[1]
        c = self.config
        q, k, v = self._qkv(x, cos, sin)
        past = 0
        if cache is not None:
            past = cache.layer_length(self.index)
            k, v = cache.update(self.index, k, v)
        groups = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)  # (B, H, T_all, D)
        v = v.repeat_interleave(groups, dim=1)
        if T == 1:
            attn = F.scaled_dot_product_attention(q, k, v)  # one query sees everything before it
        elif past == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # T new queries after `past` cached positions
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self._out(x, attn)

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache],
                     lengths: list[int]) -> torch.Tensor:
        """Rows of different sessions in one forward (a drafter hosted by the target drafting for a
        verify batch). Row i feeds its first ``lengths[i]`` of the T positions of ``x`` (B, T, d)
        after the positions ``caches[i]`` holds; the rest is padding, whose outputs mean nothing
        and whose keys no cache keeps. ``cos``/``sin`` (B, T, D): each row's own positions.

        Each row's output equals ``forward`` on that row alone with its cache, up to float
        round-off: the keys are right-padded to the longest row and masked, so a query sees its
        own row's cached positions and the new ones up to itself."""
        T = x.shape[1]
        c = self.config
        q, k, v = self._qkv(x, cos.unsqueeze(1), sin.unsqueeze(1))  # cos/sin (B, 1, T, D): broadcast over heads
        keys, values = [], []
        for i, (cache, n) in enumerate(zip(caches, lengths)):  # each cache keeps its row's real positions
            row_k, row_v = cache.update(self.index, k[i:i + 1, :, :n], v[i:i + 1, :, :n])  # (1, KV, P_i + n, D)
            keys.append(row_k)
            values.append(row_v)
        totals = torch.tensor([row.shape[2] for row in keys], device=x.device)  # (B,) P_i + n_i
        width = int(totals.max())
        k = torch.cat([F.pad(row, (0, 0, 0, width - row.shape[2])) for row in keys])  # (B, KV, L, D)
        v = torch.cat([F.pad(row, (0, 0, 0, width - row.shape[2])) for row in values])
        groups = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)  # (B, H, L, D)
        v = v.repeat_interleave(groups, dim=1)
        # Query j of row i sees keys 0 .. P_i + j (its cached positions, then the new ones up to
        # itself); a padded query (j >= n_i) sees its row's keys, so no row of the mask is empty.
        past = totals - torch.tensor(lengths, device=x.device)  # (B,) P_i
        limit = torch.minimum(past[:, None] + torch.arange(1, T + 1, device=x.device)[None, :], totals[:, None])  # (B, T)
        mask = torch.arange(width, device=x.device)[None, None, :] < limit[:, :, None]  # (B, T, L)
        return self._out(x, F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1)))


class ZooLM(nn.Module):
    """Drafter network. ``embedding`` (V, d) is the target's, frozen; ``vocab_ids`` (V_r,) the
    reduced vocabulary. Only ``blocks``, ``norm``, ``head_bias`` (and ``copy_weight`` with a copy
    term) are trained and shipped."""

    def __init__(self, config: ZooConfig, embedding: torch.Tensor, vocab_ids: torch.Tensor):
        super().__init__()
        if embedding.shape[1] != config.hidden_size:
            raise ValueError(f"embedding width {embedding.shape[1]} != hidden size {config.hidden_size}")
        self.config = config
        self.register_buffer("embedding", embedding, persistent=False)  # (V, d), frozen, not shipped
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)  # (V_r,)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.head_bias = nn.Parameter(torch.zeros(len(vocab_ids)))  # (V_r,)
        if config.copy_window < 0 or not math.isfinite(config.copy_scale):
            raise ValueError(f"copy_window must be >= 0 and copy_scale finite, got {config.copy_window}, {config.copy_scale}")
        if config.copy_window:
            self.copy_weight = nn.Parameter(torch.zeros(1))  # 0: the term starts switched off
        self._head_weight: torch.Tensor | None = None
        self._output = FrozenOutput()  # the output head's kernel (specpool/target/cpu_linear.py)
        self._reduced_index: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def vocab_size(self) -> int:
        """The full (target) vocabulary's size; ``vocab_ids`` index into it."""
        return self.embedding.shape[0]

    def extend_vocab(self, token_ids: torch.Tensor, bias: torch.Tensor) -> None:
        """Append ``token_ids`` (n,) to the reduced vocabulary with output biases ``bias`` (n,).
        Their head rows are the frozen embedding's; ``head_bias`` becomes a new, longer Parameter."""
        with torch.no_grad():
            self.vocab_ids = torch.cat([self.vocab_ids, token_ids.to(self.vocab_ids)])
            grown = torch.cat([self.head_bias.detach(), bias.to(self.head_bias)])
        self.head_bias = nn.Parameter(grown, requires_grad=self.head_bias.requires_grad)
        self._head_weight = self._reduced_index = None  # made again for the new vocabulary

    def head_weight(self) -> torch.Tensor:
        # Gathered once: (V_r, d) rows of the frozen embedding matrix.
        if self._head_weight is None or self._head_weight.device != self.embedding.device:
            self._head_weight = self.embedding[self.vocab_ids]
        return self._head_weight

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def hidden(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final hidden states (B, T, d) for ``input_ids`` (B, T), continuing ``cache``."""
        past = cache.get_seq_length() if cache is not None else 0
        T = input_ids.shape[1]
        if cache is not None and self.config.copy_window:  # only the copy term reads them
            cache.append_tokens(input_ids)
        x = F.embedding(input_ids, self.embedding)  # (B, T, d)
        cos, sin = rope_tables(self.config, torch.arange(past, past + T, device=x.device))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        return self.norm(x)

    def reduced_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the reduced vocabulary (..., V_r), without the copy term."""
        return self._output(hidden, self.head_weight(), self.head_bias)  # packed in inference on a CPU

    def reduced_index(self) -> torch.Tensor:
        """``vocabulary_index`` of this drafter, kept until its vocabulary changes."""
        if self._reduced_index is None or self._reduced_index.device != self.vocab_ids.device:
            self._reduced_index = vocabulary_index(self.vocab_ids, self.vocab_size)
        return self._reduced_index

    def copy_windows(self, history: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, W): at each position the 1 + reduced index of the last
        W = ``copy_window`` ids up to it (0 before the start and outside the vocabulary)."""
        reduced = F.pad(self.reduced_index()[history], (self.config.copy_window - 1, 0))
        return reduced.unfold(1, self.config.copy_window, 1)

    def copy_logits(self, logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """``logits`` (..., V_r) plus the copy term on each position's ``windows`` (..., W)."""
        present = torch.zeros(*windows.shape[:-1], logits.shape[-1] + 1, dtype=logits.dtype, device=logits.device)
        present.scatter_(-1, windows, 1.0)  # column 0 gathers tokens outside the vocabulary
        return logits + (self.config.copy_scale * self.copy_weight).to(logits.dtype) * present[..., 1:]

    def logits_at(self, input_ids: torch.Tensor, where: torch.Tensor, detach_before: int = 0) -> torch.Tensor:
        """Reduced-vocabulary logits (N, V_r) at the positions ``where`` (B, T) marks: the output
        head (most of a 2-layer drafter's cost) runs at those positions only. The online learner
        trains through this (with the copy term when there is one). ``detach_before`` t > 0: the
        first t positions run without autograd, into a KV cache the rest attend to, so gradients
        flow through positions t.. only (their keys and values are constants to the loss); no
        position before t may be marked."""
        if detach_before > 0:
            if bool(where[:, :detach_before].any()):
                raise ValueError(f"positions before detach_before={detach_before} are marked")
            cache = self.new_cache()
            with torch.no_grad():
                self.hidden(input_ids[:, :detach_before], cache)
            hidden = self.hidden(input_ids[:, detach_before:], cache)
            where_after = where[:, detach_before:]
            logits = self.reduced_logits(hidden[where_after])
        else:
            logits = self.reduced_logits(self.hidden(input_ids)[where])
        if self.config.copy_window:
            logits = self.copy_logits(logits, self.copy_windows(input_ids)[where])
        return logits

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, use_cache: bool = True,
                logits_to_keep: int = 0) -> "ZooOutput":
        """The subset of the Hugging Face forward that ``specpool.target.kv_cache.PrefixCache`` uses."""
        cache = cache if use_cache else None
        hidden = self.hidden(input_ids, cache)
        keep = logits_to_keep or input_ids.shape[1]
        logits = self.reduced_logits(hidden[:, -keep:])
        if self.config.copy_window:
            history = cache.tokens if cache is not None else input_ids  # (B, T_all), the new ids last
            # Only the ids that the kept positions' windows reach.
            windows = self.copy_windows(history[:, -(keep + self.config.copy_window - 1):])[:, -keep:]
            logits = self.copy_logits(logits, windows)
        return ZooOutput(logits)

    def own_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass
class ZooOutput:
    logits: torch.Tensor  # (B, T, V_r)


def init_from_target_layers(model: ZooLM, target_state: dict[str, torch.Tensor], layers: list[int]) -> None:
    """Warm start: copy the target's attention weights of ``layers`` and the MLP units with the
    largest down-projection norms (the target's MLP is wider than the drafter's)."""
    width = model.config.intermediate_size
    with torch.no_grad():
        for block, source in zip(model.blocks, layers):
            prefix = f"model.layers.{source}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(block, name).weight.copy_(target_state[f"{prefix}self_attn.{name}.weight"])
            block.attn_norm.weight.copy_(target_state[f"{prefix}input_layernorm.weight"])
            block.mlp_norm.weight.copy_(target_state[f"{prefix}post_attention_layernorm.weight"])
            down = target_state[f"{prefix}mlp.down_proj.weight"]  # (d, I_target)
            keep = down.norm(dim=0).topk(width).indices.sort().values  # (I,)
            block.gate_proj.weight.copy_(target_state[f"{prefix}mlp.gate_proj.weight"][keep])
            block.up_proj.weight.copy_(target_state[f"{prefix}mlp.up_proj.weight"][keep])
            block.down_proj.weight.copy_(down[:, keep])
        model.norm.weight.copy_(target_state["model.norm.weight"])
