"""Helpers for the online-learning tests: a tiny zoo drafter built from the tiny target, and
feedback records computed from the target itself (what verification would send)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from specpool.learning.feedback import FeedbackRecord
from specpool.drafters.zoo_model import ZooConfig, ZooLM, init_from_target_layers
from specpool.learning.zoo_train import export_drafter
from specpool.target.models import tokenizer_fingerprint

REDUCED_VOCAB = 48  # of the tiny target's 64 tokens: some target tokens are outside it


def tiny_zoo_model(target_dir: Path) -> ZooLM:
    """A zoo network on the tiny target: its embedding, its first two layers (warm start), and
    the reduced vocabulary 0..47 (stop token 2 included)."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(str(target_dir))
    state = load_file(str(target_dir / "model.safetensors"))
    config = ZooConfig(hidden_size=target_config.hidden_size, num_layers=2, num_heads=target_config.num_attention_heads,
                       num_kv_heads=target_config.num_key_value_heads, intermediate_size=target_config.intermediate_size,
                       reduced_vocab=REDUCED_VOCAB, rope_theta=10000.0, rms_eps=float(target_config.rms_norm_eps),
                       max_positions=target_config.max_position_embeddings)
    torch.manual_seed(0)
    model = ZooLM(config, state["model.embed_tokens.weight"].float(), torch.arange(REDUCED_VOCAB))
    init_from_target_layers(model, state, [0, 1])
    return model.eval()


def write_tiny_zoo(target_dir: Path, tokenizer, out: Path) -> Path:
    model = tiny_zoo_model(target_dir)
    metadata = {"name": out.name, "kind": "zoo", "domain": "chat", "target": str(target_dir),
                "target_tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "model": model.config.to_dict()}
    export_drafter(model, out, metadata, "# tiny test drafter\n")
    return out


@torch.inference_mode()
def target_records(target_model, prompts: list[list[int]], k: int = 4, per_prompt: int = 2, top_k: int = 20,
                   tenant: str = "t1", drafter: str = "d", session: str = "s", version: int = 0,
                   context_tail: int = 64) -> list[FeedbackRecord]:
    """Records as verification would send them, with the target's own continuation as draft."""
    records = []
    for n, ids in enumerate(prompts):
        for i in range(per_prompt):
            cut = len(ids) - (i + 1) * (k + 1)
            context, draft = ids[:cut], ids[cut:cut + k]
            logits = target_model(input_ids=torch.tensor([context + draft])).logits[0, cut - 1:cut + k]  # (k+1, V)
            probs, top = torch.softmax(logits.float(), -1).topk(top_k, -1)
            records.append(FeedbackRecord(
                record_id=f"{tenant}-{session}-{n}-{i}", tenant=tenant, session=session, drafter=drafter,
                version=version, context=tuple(context[-context_tail:]), draft=tuple(draft), accepted=k,
                target_ids=tuple(tuple(r) for r in top.tolist()),
                target_probs=tuple(tuple(round(v, 6) for v in r) for r in probs.tolist()),
            ))
    return records
