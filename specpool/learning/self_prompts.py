"""Prompts the target writes itself, for training white-box heads on chat-like requests.

The corpora in ``../shared/data`` hold code, math, translation, summarization/QA and a few
hundred self-instruct tasks; nothing like the open questions users ask a chat assistant
("What if the Beatles had never formed?"). A head trained on the corpora drafts 2.1-2.5 tokens a
round on code, math and translation but 1.3-1.5 on chat and QA, and 14 % of the target's chat
answer tokens fall outside its reduced vocabulary (bench/results/white-box-self-prompts;
the same prompts measured there did not make a better head at this scale).

An aligned chat model asked to continue its template right after the user-turn marker writes a
plausible user request (Magpie: Xu et al. 2024, "Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing"). Sampling that many times gives prompts from the target's
own idea of what users ask, and the target then answers them on-policy like any corpus prompt.
Nothing here downloads or copies text: the model writes it.

Output: JSON lines in the Spec-Bench question format that ``specpool zoo train --data`` reads
(specpool/learning/zoo_data.py), one request per line, with the sampling batch that wrote it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.core.errors import InvalidArgument

SENTINEL = "\u2063SPECPOOL-USER-TURN\u2063"  # content no template rewrites: where the user's text goes
MIN_WORDS = 3  # shorter requests ("Hi.") teach the head nothing about answers


@dataclass(frozen=True)
class SelfPromptConfig:
    count: int = 2000  # requests to keep (after de-duplication)
    seed: int = 0
    batch_size: int = 32  # requests sampled together (one generate call)
    max_new_tokens: int = 64  # a request that has not ended by then is dropped (cut mid-sentence)
    temperature: float = 1.0
    top_p: float = 0.95

    def check(self) -> None:
        if self.count < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise InvalidArgument(f"--count, --batch-size and --max-new-tokens must be >= 1, got "
                                  f"{self.count}, {self.batch_size}, {self.max_new_tokens}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"--temperature must be > 0 and --top-p in (0, 1], got {self.temperature}, {self.top_p}")


def user_turn_prefix(tokenizer) -> tuple[list[int], int]:
    """Token ids of the chat template up to where a user's first message starts, and the token
    that ends the user's turn there. Raises for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("self-written prompts need a chat model: the target's tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if SENTINEL not in text:
        raise InvalidArgument("the target's chat template does not place the user's message verbatim")
    before, after = text.split(SENTINEL, 1)
    prefix = tokenizer.encode(before, add_special_tokens=False)
    end = tokenizer.encode(after, add_special_tokens=False)
    if not prefix or not end:
        raise InvalidArgument("the target's chat template has no marker before or after the user's message")
    return prefix, end[0]


def check_output(out: Path) -> None:
    """A finished file is never overwritten (a stopped run's ``OUT.partial`` is resumed instead)."""
    if Path(out).exists():
        raise InvalidArgument(f"{out} exists; give another --out or delete it")


def _read_partial(path: Path) -> list[dict]:
    """Records a stopped run wrote (a torn last line, from a kill mid-write, is dropped)."""
    records = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def clean_request(text: str) -> str | None:
    """A sampled request as a prompt, or None where it is not one."""
    text = text.strip()
    return text if len(text.split()) >= MIN_WORDS else None


@torch.inference_mode()
def write_self_prompts(model, tokenizer, out: Path, config: SelfPromptConfig, progress: bool = True) -> dict:
    """Sample ``config.count`` distinct user requests from ``model`` into ``out`` (JSON lines).

    Resumable: requests are appended to ``OUT.partial`` batch by batch (batch b samples with seed
    ``seed * 1_000_003 + b``, so a rerun continues the same sequence), and ``out`` appears, by a
    rename, only once complete. Returns counts for the caller's report."""
    config.check()
    out = Path(out)
    check_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    records = _read_partial(partial)
    partial.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")  # drop a torn line
    seen = {r["turns"][0] for r in records}
    batch = max((r["batch"] for r in records), default=-1) + 1
    prefix, end_of_turn = user_turn_prefix(tokenizer)
    device = next(model.parameters()).device
    inputs = torch.tensor([prefix], device=device).expand(config.batch_size, -1)  # (B, P): every row the prefix
    mask = torch.ones_like(inputs)
    stops = sorted({end_of_turn, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    sampled = dropped_unfinished = dropped_duplicate = 0
    bar = tqdm(total=config.count, initial=min(len(records), config.count), desc="self-written prompts",
               unit="prompt", disable=not progress, dynamic_ncols=True)
    with partial.open("a", encoding="utf-8") as handle:
        while len(records) < config.count:
            torch.manual_seed(config.seed * 1_000_003 + batch)
            rows = model.generate(inputs, attention_mask=mask, do_sample=True, temperature=config.temperature,
                                  top_p=config.top_p, top_k=0, max_new_tokens=config.max_new_tokens,
                                  eos_token_id=stops, pad_token_id=pad)
            sampled += len(rows)
            for row in rows[:, len(prefix):].tolist():
                end = next((i for i, t in enumerate(row) if t in stops), None)
                if end is None:
                    dropped_unfinished += 1
                    continue
                text = clean_request(tokenizer.decode(row[:end], skip_special_tokens=True))
                if text is None:
                    continue
                if text in seen:
                    dropped_duplicate += 1
                    continue
                seen.add(text)
                record = {"question_id": len(records) + 1, "category": "self", "turns": [text], "batch": batch}
                records.append(record)
                handle.write(json.dumps(record) + "\n")
                bar.update(1)
                if len(records) == config.count:
                    break
            handle.flush()
            os.fsync(handle.fileno())
            batch += 1
    bar.close()
    os.replace(partial, out)
    return {"out": str(out), "prompts": len(records), "batches": batch, "sampled_this_run": sampled,
            "dropped_unfinished": dropped_unfinished, "dropped_duplicate": dropped_duplicate}
