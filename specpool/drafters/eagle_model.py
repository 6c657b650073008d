"""The white-box head's network: EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty") at the target's width.

At head position t the input is the token embedding of x_{t+1} and the target's feature f_t (its
final hidden state at position t, specpool/target/features.py); a linear layer fuses the two, one
Llama-style decoder block with its own KV cache runs over them, and a norm gives f^_{t+1}, the
head's guess of the target's next feature. The target's LM head applied to f^_{t+1} gives the
draft distribution of x_{t+2}. Drafting then continues on the head's own features:
(x^_{t+2}, f^_{t+1}) at position t+1, and so on.

As in the zoo (specpool/drafters/zoo_model.py), the token embedding and the output head are the
target's own frozen embedding matrix (tied in the default target; an untied target's ``lm_head``
is used for the output where it has one), the output restricted to a *reduced vocabulary* of
``vocab_ids`` so a draft step costs a (V_r x d) product, not (V x d); q over it maps back to full
ids exactly. A head therefore ships only the fusion layer, its block, two norms, the output biases
and the vocabulary ids: 3-4 M parameters at the default target's width, 6-8 MB in float16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specpool.drafters.zoo_model import Block, KVCache, RMSNorm, rope_tables, vocabulary_index
from specpool.target.cpu_linear import FrozenOutput, InferenceLinear, set_draft_precision


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int = 576  # = the target's: features and embeddings plug in directly
    num_layers: int = 1  # EAGLE's one decoder layer
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536  # SwiGLU width (the default target's own)
    reduced_vocab: int = 8192  # output head size: tokens the head can propose
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    max_positions: int = 8192
    # EAGLE-3's fusion: hidden states of these target layers (indices into the model's
    # ``hidden_states``: 0 = embeddings, i = output of layer i-1) are read beside the final
    # feature at positions whose features the target computed; () = the final feature only.
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))  # a card's JSON list

    @property
    def feature_width(self) -> int:
        """Width of a true feature row: the final feature, then each of ``feature_layers``."""
        return self.hidden_size * (1 + len(self.feature_layers))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)


class EagleHead(nn.Module):
    """``embedding`` (V, d): the target's input embedding, frozen; ``output`` (V, d): its LM head
    (the same tensor when tied); ``vocab_ids`` (V_r,): the reduced vocabulary. Trained and shipped:
    ``fuse``, ``blocks``, ``feature_norm``, ``norm``, ``head_bias``."""

    def __init__(self, config: EagleConfig, embedding: torch.Tensor, vocab_ids: torch.Tensor,
                 output: torch.Tensor | None = None):
        super().__init__()
        if embedding.shape[1] != config.hidden_size:
            raise ValueError(f"embedding width {embedding.shape[1]} != hidden size {config.hidden_size}")
        self.config = config
        d = config.hidden_size
        self.register_buffer("embedding", embedding, persistent=False)  # (V, d), frozen, not shipped
        self.register_buffer("output", embedding if output is None else output, persistent=False)  # (V, d)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)  # (V_r,)
        # Features come post-norm and embeddings at their own scale: normalising the feature keeps
        # the fusion's input balanced (EAGLE-3 normalises both; the embedding of a tied target
        # already has the LM head's scale).
        self.feature_norm = RMSNorm(d, config.rms_eps)
        self.fuse = InferenceLinear(2 * d, d, bias=False)  # [embedding ; feature] -> d
        if config.feature_layers:  # added to the fusion; zero at first, so a warm start drafts as before
            self.layer_norms = nn.ModuleList(RMSNorm(d, config.rms_eps) for _ in config.feature_layers)
            self.layer_fuse = InferenceLinear(d * len(config.feature_layers), d, bias=False)
            nn.init.zeros_(self.layer_fuse.weight)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))  # type: ignore[arg-type]
        self.norm = RMSNorm(d, config.rms_eps)
        self.head_bias = nn.Parameter(torch.zeros(len(vocab_ids)))  # (V_r,)
        self._head_weight: torch.Tensor | None = None
        self._output = FrozenOutput()  # the output head's kernel (specpool/target/cpu_linear.py)
        self._reduced_index: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def vocab_size(self) -> int:
        return self.embedding.shape[0]

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def head_weight(self) -> torch.Tensor:
        """(V_r, d) rows of the target's output matrix, gathered once."""
        stale = self._head_weight is None or self._head_weight.device != self.output.device
        # One gathered under inference_mode (drafting) cannot enter autograd (training): gather again.
        if stale or (self._head_weight.is_inference() and not torch.is_inference_mode_enabled()):
            self._head_weight = self.output[self.vocab_ids]
        return self._head_weight

    def reduced_index(self) -> torch.Tensor:
        """(V,) full id -> 1 + reduced index, 0 outside the reduced vocabulary."""
        if self._reduced_index is None or self._reduced_index.device != self.vocab_ids.device:
            self._reduced_index = vocabulary_index(self.vocab_ids, self.vocab_size)
        return self._reduced_index

    def fused_inputs(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The block's input (B, T, d): the token embedding and the feature (with the target's other
        layers where ``features`` carries them), fused."""
        x = F.embedding(input_ids, self.embedding)  # (B, T, d)
        d = self.config.hidden_size
        features = features.to(x.dtype)
        x = self.fuse(torch.cat([x, self.feature_norm(features[..., :d])], dim=-1))  # (B, T, d)
        if features.shape[-1] > d:  # the target's other layers, one norm each
            layers = features[..., d:].unflatten(-1, (len(self.config.feature_layers), d))  # (B, T, E, d)
            x = x + self.layer_fuse(torch.cat([n(layers[..., i, :]) for i, n in enumerate(self.layer_norms)], dim=-1))
        return x

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, cache: KVCache | None = None,
                start: int | None = None) -> torch.Tensor:
        """Predicted next features (B, T, d) for head positions start .. start+T-1, whose inputs are
        ``input_ids`` (B, T) = x_{t+1} and ``features`` (B, T, d) = f_t, or (B, T,
        ``config.feature_width``) where the target's fused layers are known (true features; the
        head's own guesses are d wide and carry no layers). ``start``: the first position (default:
        the cache's length, or 0)."""
        if start is None:
            start = cache.get_seq_length() if cache is not None else 0
        T = input_ids.shape[1]
        x = self.fused_inputs(input_ids, features)  # (B, T, d)
        cos, sin = rope_tables(self.config, torch.arange(start, start + T, device=x.device))  # type: ignore[arg-type]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        return self.norm(x)

    def forward_rows(self, input_ids: torch.Tensor, features: torch.Tensor, caches: list[KVCache],
                     lengths: list[int]) -> torch.Tensor:
        """``forward`` for B sessions at once (``Block.forward_rows``): row i of ``input_ids`` (B, T)
        and ``features`` (B, T, d) feeds its first ``lengths[i]`` positions after those ``caches[i]``
        holds; padded positions' outputs (B, T, d) mean nothing."""
        T = input_ids.shape[1]
        x = self.fused_inputs(input_ids, features)  # (B, T, d)
        starts = torch.tensor([cache.get_seq_length() for cache in caches], device=x.device)  # (B,)
        positions = (starts[:, None] + torch.arange(T, device=x.device)[None, :]).flatten()  # (B * T,)
        cos, sin = rope_tables(self.config, positions)  # type: ignore[arg-type]
        cos, sin = cos.view(len(caches), T, -1).to(x.dtype), sin.view(len(caches), T, -1).to(x.dtype)
        for block in self.blocks:
            x = block.forward_rows(x, cos, sin, caches, lengths)
        return self.norm(x)

    def reduced_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the reduced vocabulary (..., V_r) from (predicted) features (..., d)."""
        return self._output(hidden, self.head_weight(), self.head_bias)  # packed in inference on a CPU

    def set_draft_precision(self, precision: str) -> None:
        """Run the block's projections and the output head in ``precision`` ("int8": fbgemm's
        quantised linear, specpool/target/cpu_linear.py) in inference on a CPU; training is
        unchanged. The fusion stays float32: its input joins the token embedding (RMS ~0.14 in
        the default target) to the normalised feature (RMS ~0.9, with larger outliers), and one
        7-bit activation scale over both would blur which token the head is told."""
        for block in self.blocks:
            set_draft_precision(block, precision)
        self._output.set_precision(precision)

    @property
    def draft_precision(self) -> str:
        """What ``set_draft_precision`` last set (the output head's kernel holds it)."""
        return self._output.precision

    def own_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_from_target(head: EagleHead, target_state: dict[str, torch.Tensor], layer: int) -> None:
    """Warm start: the block takes the target's decoder layer ``layer`` (its MLP units with the
    largest down-projection norms when the head's MLP is narrower), the final norm the target's;
    the fusion starts as the identity on the feature plus a small embedding term."""
    width = head.config.intermediate_size
    d = head.config.hidden_size
    prefix = f"model.layers.{layer}."
    with torch.no_grad():
        for block in head.blocks:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(block, name).weight.copy_(target_state[f"{prefix}self_attn.{name}.weight"])
            block.attn_norm.weight.copy_(target_state[f"{prefix}input_layernorm.weight"])
            block.mlp_norm.weight.copy_(target_state[f"{prefix}post_attention_layernorm.weight"])
            down = target_state[f"{prefix}mlp.down_proj.weight"]  # (d, I_target)
            keep = down.norm(dim=0).topk(min(width, down.shape[1])).indices.sort().values  # (I,)
            block.gate_proj.weight.copy_(target_state[f"{prefix}mlp.gate_proj.weight"][keep])
            block.up_proj.weight.copy_(target_state[f"{prefix}mlp.up_proj.weight"][keep])
            block.down_proj.weight.copy_(down[:, keep])
        head.norm.weight.copy_(target_state["model.norm.weight"])
        head.fuse.weight.zero_()
        head.fuse.weight[:, d:] = torch.eye(d)
        head.fuse.weight[:, :d] = torch.randn(d, d) * (0.1 / d ** 0.5)
