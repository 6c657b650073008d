"""Grouped-query attention without copying keys, for verification forwards on a CPU.

A verify forward feeds k + 1 positions after a cached context, so attention gets a mask (the
causal pattern offset by the context, or a draft tree's). transformers' SDPA path then copies
every key and value head ``num_attention_heads / num_key_value_heads`` times (``repeat_kv``)
before calling the kernel: on the default target (9 query heads, 3 key heads) that is three
copies of the whole cache in each of 30 layers, every round. A one-position decode step does not
pay it (transformers folds the query heads instead), so the copy made verifying dearer than
decoding for no other reason.

PyTorch's CPU flash-attention kernel reads grouped heads itself (``enable_gqa=True``) with a
mask, and gives the same numbers: ``python -m bench.grouped_attention`` measures the effect and
``tests/unit/test_attention.py`` checks the outputs equal. transformers takes that path only on
XPU and MPS, and on CUDA a masked grouped call falls back to SDPA's math kernel, so this
implementation changes CPU forwards with a mask only and hands everything else to transformers'
SDPA unchanged. ``load_causal_lm`` sets it on every model that would run SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "specpool_sdpa"  # the attention implementation name models are given
SDPA_IMPLEMENTATIONS = ("sdpa", GROUPED_SDPA)  # what computes transformers' SDPA attention


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, but a masked grouped-query call on the CPU reads
    the key heads in place. query (B, Hq, T, D), key/value (B, Hkv, S, D) -> (B, T, Hq, D)."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (attention_mask is None or groups == 1 or query.device.type != "cpu" or dropout
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
             or kwargs.get("output_attentions", False))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)  # (B, Hq, T, D)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: torch.nn.Module) -> None:
    """Give ``model`` the grouped implementation if it would run transformers' SDPA."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.config._attn_implementation = GROUPED_SDPA


def runs_sdpa(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention is transformers' SDPA (plain or grouped)."""
    return getattr(model.config, "_attn_implementation", None) in SDPA_IMPLEMENTATIONS


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the same masks as SDPA's
