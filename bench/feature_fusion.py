"""Which target features should a white-box head read: the final hidden state alone (what the
shipped heads read), or EAGLE-3's fusion of a low and a middle layer beside it? Measured.

    python -m bench.feature_fusion --data-root ../shared/data --out DIR

1. Prompts: per domain, the first ``--train-prompts / 5`` training prompts and ``--heldout-prompts
   / 5`` held-out prompts (``split_heldout``: prompts no shipped head trained on) of the seeded
   corpus order the heads were trained from (``DEFAULT_RECIPES``).
2. The target answers them greedily (batched ``generate``); one teacher-forced forward over
   prompt + answer then records every hidden state wanted (final, and ``--layers``) and the
   target's top-K at each answer position. The answers are cached under ``--cache`` (a rerun
   does not answer again; the forwards are repeated).
3. Two heads start from the same shipped head (``--init-from``) and train the same steps on the
   same batches: *final* reads the final feature, *fused* also the ``--layers`` hidden states
   through a zero-initialised fusion (``EagleConfig.feature_layers``), so both start equal.
   Recipe ``unroll`` by default: from step 2 of a draft the head reads its own guess (final-width,
   no layers), as it must when drafting, and training must see that too.
4. Held-out tokens per round (k = 5, greedy, no confidence stop, ``heldout_acceptance``) every
   ``--check-every`` steps; the report gives each head's curve, best and last.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.core.defaults import DEFAULT_TARGET
from specpool.drafters.eagle import head_folder, load_eagle_head
from specpool.drafters.eagle_model import EagleHead
from specpool.learning.eagle_train import FeatureSequence, HeadOptions, train_head_steps
from specpool.learning.zoo_data import DEFAULT_RECIPES, DOMAINS, collect_prompts
from specpool.learning.zoo_train import TrainConfig, encode_chat, prompt_hash, split_heldout
from specpool.services.config import settings_from_env

MAX_PROMPT_TOKENS = TrainConfig.__dataclass_fields__["max_prompt_tokens"].default  # prompts cut as the heads' teacher cuts them


def pick_prompts(data_root: Path, train: int, heldout: int, seed: int) -> tuple[list[str], list[str]]:
    train_out, heldout_out = [], []
    domains = [d for d in DOMAINS if d != "general"]
    for domain in domains:
        prompts = collect_prompts([data_root / p for p in DEFAULT_RECIPES[domain]], 100_000, seed)
        t, h = split_heldout(prompts)
        train_out += t[: train // len(domains)]
        heldout_out += h[: heldout // len(domains)]
    return train_out, heldout_out


@torch.inference_mode()
def answer(model, tokenizer, prompts: list[str], max_new_tokens: int, batch: int, stop: int,
           max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> dict[int, list[int]]:
    """The target's greedy answers (ids, the stop token included when reached), batched; prompts
    cut from the left to ``max_prompt_tokens``."""
    encoded = {p: encode_chat(tokenizer, p, max_prompt_tokens) for p in prompts}
    order = sorted(prompts, key=lambda p: len(encoded[p]))
    out = {}
    for first in tqdm(range(0, len(order), batch), desc="target answers", unit="batch"):
        chunk = order[first:first + batch]
        width = max(len(encoded[p]) for p in chunk)
        ids = torch.full((len(chunk), width), stop, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):  # left padding: answers start at one column
            ids[row, width - len(encoded[p]):] = torch.tensor(encoded[p])
            mask[row, width - len(encoded[p]):] = 1
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=stop, eos_token_id=stop)[:, width:]
        for row, p in enumerate(chunk):
            a = gen[row].tolist()
            out[prompt_hash(p)] = a[: a.index(stop) + 1] if stop in a else a
    return out


@torch.inference_mode()
def features_of(model, tokenizer, prompts: list[str], answers: dict[int, list[int]], layers: tuple[int, ...],
                context: int, top_k: int, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> list[FeatureSequence]:
    """One teacher-forced forward per prompt: rows [final ; layer_1 ; ...] (float16) from
    ``context`` prompt positions before the answer to the second-to-last position."""
    lm_head = model.get_output_embeddings()
    out = []
    for p in tqdm(prompts, desc="teacher features", unit="prompt"):
        prompt_ids, ans = encode_chat(tokenizer, p, max_prompt_tokens), answers[prompt_hash(p)]
        tokens = torch.tensor(prompt_ids + ans)
        P, L = len(prompt_ids), len(tokens)
        hs = model(input_ids=tokens[None], output_hidden_states=True).hidden_states
        fs = max(P - context, 0)
        rows = torch.cat([hs[-1][0]] + [hs[i][0] for i in layers], dim=-1)[fs:L - 1]  # (L-1-fs, d(1+E))
        top = torch.softmax(lm_head(hs[-1][0, P - 1:L - 1]).float(), dim=-1).topk(top_k, dim=-1)
        out.append(FeatureSequence(tokens, P, fs, rows.to(torch.float16), top.indices, top.values))
    return out


def final_only(s: FeatureSequence, d: int) -> FeatureSequence:
    return replace(s, features=s.features[:, :d])


def fused_head(base: EagleHead, layers: tuple[int, ...]) -> EagleHead:
    head = EagleHead(replace(base.config, feature_layers=layers), base.embedding, base.vocab_ids, base.output)
    missing = head.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert all(k.startswith(("layer_norms", "layer_fuse")) for k in missing), missing
    return head


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", type=Path, default=None, help="answers cache (default: $SPECPOOL_HOME/bench/feature-fusion)")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--init-from", default="general", help="shipped head (or folder) both heads start from")
    ap.add_argument("--layers", default="3,15", help="hidden_states indices fused beside the final feature")
    ap.add_argument("--train-prompts", type=int, default=200)
    ap.add_argument("--heldout-prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=128, help="prompt positions with features before each answer")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--recipe", default="unroll")
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--teacher-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from specpool.target.models import ModelConfig, load_causal_lm

    layers = tuple(int(x) for x in args.layers.split(","))
    home = settings_from_env().home
    cache = args.cache or home / "bench" / "feature-fusion"
    torch.manual_seed(args.seed)
    train_prompts, heldout_prompts = pick_prompts(args.data_root, args.train_prompts, args.heldout_prompts, args.seed)
    model, tokenizer = load_causal_lm(ModelConfig(args.target, "cpu", dtype="float32"), home)
    stop = tokenizer.eos_token_id
    cache.mkdir(parents=True, exist_ok=True)
    answers_file = cache / f"answers-{args.max_new_tokens}.json"
    answers = {int(k): v for k, v in json.loads(answers_file.read_text()).items()} if answers_file.exists() else {}
    todo = [p for p in train_prompts + heldout_prompts if prompt_hash(p) not in answers]
    if todo:
        answers.update(answer(model, tokenizer, todo, args.max_new_tokens, args.teacher_batch, stop))
        answers_file.write_text(json.dumps({str(k): v for k, v in answers.items()}))
    train = features_of(model, tokenizer, train_prompts, answers, layers, args.context, 20)
    heldout = features_of(model, tokenizer, heldout_prompts, answers, layers, args.context, 20)
    del model

    base, _ = load_eagle_head(head_folder(args.init_from), home, args.target)
    d = base.config.hidden_size
    vocab_map = base.reduced_index() - 1  # (V,) full id -> reduced index, -1 outside
    config = TrainConfig(domain="general", data=(), steps=args.steps, lr=args.lr, warmup=20, seed=args.seed,
                         save_every=args.check_every, train_context_tokens=args.context, batch_size=8)
    options = HeadOptions(recipe=args.recipe, unroll=args.unroll)
    results = {}
    for name in ("final", "fused"):
        if name == "final":
            head, seqs, held = base, [final_only(s, d) for s in train], [final_only(s, d) for s in heldout]
        else:  # a fresh copy of the same start
            head = fused_head(load_eagle_head(head_folder(args.init_from), home, args.target)[0], layers)
            seqs, held = train, heldout
        started = time.perf_counter()
        state = train_head_steps(head, seqs, held, vocab_map, config, options, None, False)
        results[name] = {"curve": state.val_losses, "best": max(state.val_losses),
                         "best_step": state.best_step, "last": state.val_losses[-1],
                         "train_s": round(time.perf_counter() - started, 1), "own_parameters": head.own_parameters()}
        print(name, results[name], flush=True)
    report = {
        "command": "python -m bench.feature_fusion " + " ".join(argv or __import__("sys").argv[1:]),
        "target": args.target, "init_from": args.init_from, "layers": layers,
        "train_prompts": len(train), "heldout_prompts": len(heldout),
        "answer_tokens_train": sum(len(s.label_ids) for s in train), "steps": args.steps, "lr": args.lr,
        "recipe": args.recipe, "unroll": args.unroll, "threads": torch.get_num_threads(),
        "heads": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
