"""Training white-box heads (``specpool zoo train --arch eagle``): EAGLE heads distilled from the
target's own answers and features.

Pipeline, every stage seeded and resumable, sharing the zoo's machinery (zoo_train.py):
1. *Teacher data.* The target answers the domain's prompts greedily (on-policy); the same
   generate call records its features (final hidden states) at the answer positions and up to
   ``features_context`` prompt positions before them (``TrainConfig.features_context``), beside
   its top-K distribution at each answer position. Stored once, reused by every head and recipe.
2. *Reduced vocabulary*, as the zoo's: the tokens with the most teacher mass in the domain.
3. *Training*, by one of two recipes (``RECIPES``), measured against each other on held-out
   prompts (see the README's white-box section for the figures):
   - ``eagle``: EAGLE-1 (Li et al. 2024). Teacher-forced: at head position t the input is
     (x_{t+1}, f_t) with the target's true f_t; loss = SmoothL1(f^_{t+1}, f_{t+1}) on every
     position + ``ce_weight`` x soft cross-entropy to the target's top-K at answer positions.
   - ``unroll``: the same loss over ``unroll`` steps, step j feeding the head the features step
     j-1 predicted (shifted by one position), so the head learns to continue from its own
     guesses, as it must when drafting; a simplification of EAGLE-3's training-time test (Li et
     al. 2025), which in addition masks attention so that step j sees true features before the
     draft's start: here every position of step j reads guesses, a harsher condition.
4. *Held-out acceptance*: the measure that decides. On held-out answers the head drafts greedily
   as ``EagleDrafter`` does (true features up to a start, then its own guesses, k = 5, no
   confidence stop) and the accepted count against the target's own tokens is averaged: the
   expected tokens per round at k = 5 (1 + accepted). Training keeps the weights of the best check.
5. *Output*: ``model.safetensors`` (float16), ``config.json`` (the card: target, width, layers,
   tokenizer fingerprint, data, recipe, curves, held-out acceptance) and README.md, atomically.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from specpool.core.errors import InvalidArgument
from specpool.drafters.eagle import HEAD_KIND, target_card
from specpool.drafters.eagle_model import EagleConfig, EagleHead, init_from_target
from specpool.drafters.weight_storage import STORAGES
from specpool.learning.zoo_data import collect_pairs, collect_prompts
from specpool.learning.zoo_train import (
    TrainConfig, TrainingError, TrainState, _atomic_save, _check_train_config, _lr, batch_indices, build_vocab,
    check_output_dir, distillation_loss, encode_chat, export_drafter, generate_teacher, load_checkpoint, prompt_hash,
    read_teacher_shards, save_checkpoint, split_heldout, teacher_index, teacher_store_key, zoo_config_for,
)

RECIPES = ("eagle", "unroll")
DEFAULT_FEATURES_CONTEXT = 256  # prompt positions with features kept in the store before each answer
HELDOUT_STARTS = 8  # draft starts per held-out answer in the acceptance check
HELDOUT_K = 5
SORT_WINDOW = 256  # reference pairs sorted by length within windows of this many (reference_teacher)


@dataclass(frozen=True)
class HeadOptions:
    """What ``--arch eagle`` adds to the zoo's TrainConfig."""

    recipe: str = "eagle"
    unroll: int = 3  # steps of the ``unroll`` recipe
    intermediate_size: int = 1536  # the head block's MLP width
    num_layers: int = 1  # decoder blocks (EAGLE's one; a warm start's missing blocks begin as the identity)
    # On-disk weights: float16, or int8 with a float16 scale per output row for the blocks' and the
    # fusion's matrices (``specpool.drafters.weight_storage``): two blocks fit the 10 MB a head may take.
    storage: str = "float16"
    init_layer: int = -1  # target layer that warm-starts the block (-1: the last)
    init_from: str | None = None  # a trained head (shipped name or folder) to start from instead
    # Loss = regression_weight * SmoothL1(f^, f) + CE to the target's top-K (EAGLE-1 weighs the
    # token term 0.1 against regression 1; EAGLE-3 drops regression). Measured: see the card.
    regression_weight: float = 1.0
    # Corpus (prompt, reference answer) pairs read teacher-forced beside the on-policy answers
    # (``reference_teacher``): 0 = on-policy answers only.
    reference_answers: int = 0
    # Each on-policy sequence counts this many times in the training mix (they are the
    # drafting distribution; reference answers are only near it).
    onpolicy_weight: int = 1


@dataclass
class FeatureSequence:
    tokens: torch.Tensor  # (L,) prompt + answer
    answer_start: int  # P
    feature_start: int  # fs: features are of positions fs .. L-2
    features: torch.Tensor  # (L-1-fs, d) float16
    label_ids: torch.Tensor  # (A, K) teacher top-K at answer positions
    label_probs: torch.Tensor  # (A, K)


def load_feature_teacher(prompts: list[str], index: dict[int, tuple[Path, int]]) -> list[FeatureSequence]:
    """The teacher sequences of ``prompts`` with their features, read shard by shard."""
    by_key: dict[tuple[Path, int], FeatureSequence] = {}
    for shard, data, rows in read_teacher_shards(prompts, index):
        if "features" not in data:
            raise TrainingError(f"teacher shard {shard} holds no features (a zoo store?); delete it and rerun")
        offsets, starts = data["offsets"].tolist(), data["answer_starts"].tolist()
        fstarts = data["feature_starts"].tolist()
        label_at, feature_at = [0], [0]
        for n, start in enumerate(starts):
            length = offsets[n + 1] - offsets[n]
            label_at.append(label_at[-1] + length - start)
            feature_at.append(feature_at[-1] + length - 1 - fstarts[n])
        for row in rows:
            by_key[(shard, row)] = FeatureSequence(
                data["tokens"][offsets[row]:offsets[row + 1]].long(), starts[row], fstarts[row],
                data["features"][feature_at[row]:feature_at[row + 1]],
                data["label_ids"][label_at[row]:label_at[row + 1]].long(),
                data["label_probs"][label_at[row]:label_at[row + 1]].float())
    return [by_key[index[prompt_hash(p)]] for p in prompts]


def reference_store_key(config: TrainConfig, target_fingerprint: str) -> str:
    """The reference-answer store: like the teacher store's key, marked as teacher-forced."""
    return "ref-" + teacher_store_key(config, target_fingerprint)


@torch.inference_mode()
def reference_teacher(model, tokenizer, pairs: list[tuple[str, str]], store: Path, config: TrainConfig,
                      stop_token_ids: tuple[int, ...], token_budget: int = 4096) -> dict[int, tuple[Path, int]]:
    """Make sure every (prompt, reference answer) pair is in ``store``; return its index (by the
    prompt's hash). The target reads chat(prompt) + the reference (cut to ``max_new_tokens``,
    closed with the stop token when whole) in one teacher-forced forward; a shard row holds what
    an on-policy teacher row holds (``generate_teacher``): tokens, answer start, the target's
    top-K at each answer position and its features from ``features_context`` prompt positions
    before the answer to the second-to-last position. So ``load_feature_teacher`` reads both
    stores, and an interrupted run resumes where it stopped (one shard per batch, atomic)."""
    entered = time.perf_counter()
    store.mkdir(parents=True, exist_ok=True)
    index = teacher_index(store)
    todo = [(p, r) for p, r in dict(pairs).items() if prompt_hash(p) not in index]
    encoded = {}
    for p, r in todo:
        prompt_ids = encode_chat(tokenizer, p, config.max_prompt_tokens)
        answer = tokenizer.encode(r, add_special_tokens=False)
        answer = answer[:config.max_new_tokens] if len(answer) >= config.max_new_tokens else answer + [stop_token_ids[0]]
        encoded[p] = (prompt_ids, answer)
    # Similar lengths pad little; sorting within windows (not over all) keeps the corpus mix of
    # ``pairs`` in every stretch, so a time limit does not leave out the long answers (code, math).
    todo = [pair for w in range(0, len(todo), SORT_WINDOW)
            for pair in sorted(todo[w:w + SORT_WINDOW], key=lambda pair: sum(map(len, encoded[pair[0]])))]
    bar = tqdm(total=len(pairs), initial=len(pairs) - len(todo), desc=f"reference answers ({config.domain})",
               unit="pair", dynamic_ncols=True)
    lm_head = model.get_output_embeddings()
    done_tokens, started, first = 0, time.perf_counter(), 0
    while first < len(todo):
        if config.teacher_time_limit_s and time.perf_counter() - entered > config.teacher_time_limit_s:
            print(f"teacher time limit reached: {len(todo) - first} reference pairs left unread "
                  "(rerun to read them)", flush=True)
            break
        width = sum(map(len, encoded[todo[first][0]]))
        batch = [todo[first]]
        while first + len(batch) < len(todo):  # grow while the padded batch fits the token budget
            nxt = sum(map(len, encoded[todo[first + len(batch)][0]]))
            if (len(batch) + 1) * max(width, nxt) > token_budget:
                break
            batch.append(todo[first + len(batch)])
            width = max(width, nxt)
        first += len(batch)
        input_ids = torch.full((len(batch), width), stop_token_ids[0], dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, _) in enumerate(batch):  # right padding: a causal forward reads no pad before a real token
            ids = encoded[p][0] + encoded[p][1]
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, :len(ids)] = 1
        hidden = model.get_decoder()(input_ids=input_ids.to(model.device),
                                     attention_mask=attention.to(model.device)).last_hidden_state  # (B, W, d)
        tokens, offsets, starts, label_ids, label_probs, features, feature_starts = [], [0], [], [], [], [], []
        for row, (p, _) in enumerate(batch):
            prompt_ids, answer = encoded[p]
            P, L = len(prompt_ids), len(prompt_ids) + len(answer)
            tokens.extend(prompt_ids + answer)
            offsets.append(len(tokens))
            starts.append(P)
            # Answer token t (P .. L-1) is predicted from position t-1.
            top = torch.softmax(lm_head(hidden[row, P - 1:L - 1]).float(), dim=-1).topk(config.teacher_top_k, dim=-1)
            label_ids.append(top.indices.cpu())
            label_probs.append(top.values.cpu())
            first_kept = max(P - config.features_context, 0)
            features.append(hidden[row, first_kept:L - 1].to(torch.float16).cpu())
            feature_starts.append(first_kept)
            done_tokens += L
        batch_key = hashlib.sha256(",".join(str(prompt_hash(p)) for p, _ in batch).encode()).hexdigest()[:16]
        shard = store / f"shard-{batch_key}.safetensors"
        _atomic_save({
            "features": torch.cat(features), "feature_starts": torch.tensor(feature_starts, dtype=torch.int64),
            "prompt_hashes": torch.tensor([prompt_hash(p) for p, _ in batch], dtype=torch.int64),
            "tokens": torch.tensor(tokens, dtype=torch.int32), "offsets": torch.tensor(offsets, dtype=torch.int64),
            "answer_starts": torch.tensor(starts, dtype=torch.int64),
            "label_ids": torch.cat(label_ids).to(torch.int32), "label_probs": torch.cat(label_probs).to(torch.float16),
        }, shard)
        for row, (p, _) in enumerate(batch):
            index[prompt_hash(p)] = (shard, row)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
    bar.close()
    return index


def trim_features(s: FeatureSequence, context_tokens: int) -> FeatureSequence:
    """Train on at most ``context_tokens`` prompt positions before the answer (speed)."""
    cut = max(s.feature_start, s.answer_start - max(context_tokens, 2))
    if cut == s.feature_start:
        return s
    return FeatureSequence(s.tokens, s.answer_start, cut, s.features[cut - s.feature_start:], s.label_ids, s.label_probs)


def collate_heads(batch: list[FeatureSequence], vocab_map: torch.Tensor) -> dict[str, torch.Tensor]:
    """Right-padded head inputs of a batch. Head position t (t = fs .. L-3, row index t - fs)
    reads x_{t+1} and f_t, and is trained towards f_{t+1} and, at answer positions, the
    teacher's top-K for x_{t+2}."""
    T = max(len(s.tokens) - 2 - s.feature_start for s in batch)
    d, K = batch[0].features.shape[1], batch[0].label_ids.shape[1]
    out = {
        "ids": torch.zeros(len(batch), T, dtype=torch.long),
        "features": torch.zeros(len(batch), T, d),
        "targets": torch.zeros(len(batch), T, d),
        "valid": torch.zeros(len(batch), T, dtype=torch.bool),
        "answer": torch.zeros(len(batch), T, dtype=torch.bool),
        "label_ids": torch.full((len(batch), T, K), -1, dtype=torch.long),
        "label_probs": torch.zeros(len(batch), T, K),
        "next_token": torch.full((len(batch), T), -1, dtype=torch.long),
    }
    for b, s in enumerate(batch):
        L, fs, P = len(s.tokens), s.feature_start, s.answer_start
        n = L - 2 - fs
        if n <= 0:
            continue
        feats = s.features.float()  # (L-1-fs, d)
        out["ids"][b, :n] = s.tokens[fs + 1:L - 1]
        out["features"][b, :n] = feats[:n]
        out["targets"][b, :n] = feats[1:n + 1]
        out["valid"][b, :n] = True
        out["next_token"][b, :n] = s.tokens[fs + 2:L]
        first = max(P - 2 - fs, 0)  # row of the first answer token's prediction
        skip = max(fs - (P - 2), 0)  # answer labels before the window (fs > P-2 only when cut)
        count = min(len(s.label_ids) - skip, n - first)
        out["answer"][b, first:first + count] = True
        out["label_ids"][b, first:first + count] = vocab_map[s.label_ids[skip:skip + count]]
        out["label_probs"][b, first:first + count] = s.label_probs[skip:skip + count]
    return out


def head_loss(head: EagleHead, batch: dict[str, torch.Tensor], recipe: str, unroll: int,
              regression_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The recipe's loss (module docstring) and per-step top-1 agreement with the target's token."""
    features = batch["features"]
    valid, answer = batch["valid"], batch["answer"]
    steps = unroll if recipe == "unroll" else 1
    total = features.new_zeros(())
    stats = {}
    for j in range(steps):
        if j >= valid.shape[1]:
            break
        predicted = head(batch["ids"][:, j:], features)  # (B, T-j, d): step j, positions j..
        target = batch["targets"][:, j:, :predicted.shape[-1]]  # the final feature (fused layers are inputs only)
        mask = valid[:, j:]
        regression = F.smooth_l1_loss(predicted[mask], target[mask])
        where = answer[:, j:]
        logits = head.reduced_logits(predicted[where])  # (N, V_r)
        ce = distillation_loss(logits, batch["label_ids"][:, j:][where], batch["label_probs"][:, j:][where])
        total = total + regression_weight * regression + ce
        stats[f"regression{j}"], stats[f"ce{j}"] = float(regression.detach()), float(ce.detach())
        guess = head.vocab_ids[logits.argmax(-1)]
        stats[f"agree{j}"] = float((guess == batch["next_token"][:, j:][where]).float().mean()) if len(guess) else 0.0
        # Step j+1: position t reads the guess of f_t that step j made at position t-1.
        features = predicted[:, :-1] if j + 1 < steps else features
    return total / steps, stats


def heldout_acceptance(head: EagleHead, sequences: list[FeatureSequence], k: int = HELDOUT_K,
                       starts: int = HELDOUT_STARTS) -> float:
    """Mean tokens per round (1 + accepted drafts, greedy, k drafts, no confidence stop) when the
    head drafts from ``starts`` evenly spaced points of each held-out answer, exactly as
    ``EagleDrafter`` drafts: true features before the start, its own guesses after."""
    accepted, rounds = acceptance_counts(head, sequences, k, starts)
    return 1.0 + accepted / max(rounds, 1)


@torch.inference_mode()
def acceptance_counts(head: EagleHead, sequences: list[FeatureSequence], k: int = HELDOUT_K,
                      starts: int = HELDOUT_STARTS) -> tuple[int, int]:
    """(drafts accepted, rounds) of ``heldout_acceptance``'s rounds: sums, so the counts of
    several groups of sequences add up to those of all of them."""
    was_training = head.training
    head.eval()
    accepted_total, rounds = 0, 0
    for s in sequences:
        L, fs, P = len(s.tokens), s.feature_start, s.answer_start
        feats = s.features.float().to(head.device)
        tokens = s.tokens.tolist()
        first = max(P, fs + 2)
        if L - 2 < first:
            continue
        # The true-feature positions once per answer (head positions fs .. L-2); each start then
        # drafts from a copy of that cache cut at its position.
        full_cache = head.new_cache()
        ids = torch.tensor([tokens[fs + 1:L]], device=head.device)  # (1, L-1-fs)
        outputs = head(ids, feats[: L - 1 - fs].unsqueeze(0), full_cache, start=0)[0]  # (L-1-fs, d)
        # A round with context x_0..x_{n-1} (n - 1 >= P - 1: the answer has begun) drafts x_n..
        for n in torch.linspace(first, L - 2, starts).long().unique().tolist():
            cache = head.new_cache()
            cache.keys, cache.values = list(full_cache.keys), list(full_cache.values)
            cache.crop(-(L - 1 - fs - (n - 1 - fs)))  # keep head positions fs .. n-2
            guess = outputs[n - 2 - fs]  # the head's f^_{n-1}
            accepted = 0
            for i in range(min(k, L - n)):
                token = int(head.vocab_ids[head.reduced_logits(guess).argmax()])
                if token != tokens[n + i]:
                    break
                accepted += 1
                step = torch.tensor([[token]], device=head.device)
                guess = head(step, guess.view(1, 1, -1), cache)[0, -1]
            accepted_total += accepted
            rounds += 1
    head.train(was_training)
    return accepted_total, rounds


def train_head_steps(head: EagleHead, sequences: list[FeatureSequence], heldout: list[FeatureSequence],
                     vocab_map: torch.Tensor, config: TrainConfig, options: HeadOptions,
                     checkpoint: Path | None, resume: bool) -> TrainState:
    """Optimiser steps up to ``config.steps`` (seeded batches, checkpoints, time limit); at every
    save the held-out acceptance is checked and the best weights kept (as the zoo's loss)."""
    torch.manual_seed(config.seed)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    state, best = TrainState(), None
    if resume and checkpoint is not None and checkpoint.exists():
        state, best = load_checkpoint(checkpoint, head, optimizer)  # type: ignore[arg-type]
        state.stopped_by_time_limit = False
    # Larger is better for acceptance; TrainState keeps the best as a loss, so it stores -acceptance.
    def check_heldout() -> float:
        nonlocal best
        acceptance = heldout_acceptance(head, heldout)
        state.val_losses.append(round(acceptance, 4))
        if -acceptance <= state.best_val:  # a tie goes to the later, more trained weights
            state.best_val, state.best_step = -acceptance, state.step
            best = {k: v.detach().clone() for k, v in head.state_dict().items()}
        return acceptance

    if heldout and state.step == 0 and not state.val_losses:
        check_heldout()  # the starting point (a trained head, or the warm start) is a candidate
    head.train()
    bar = tqdm(total=config.steps, initial=state.step, desc=f"train {config.domain} head ({options.recipe})",
               unit="step", dynamic_ncols=True)
    started, window_loss, window_steps = time.perf_counter(), 0.0, 0
    while state.step < config.steps:
        chosen = batch_indices(state.step, len(sequences), config.batch_size, config.seed)
        chosen_sequences = [trim_features(sequences[i], config.train_context_tokens) for i in chosen]
        batch = {k: v.to(head.device) for k, v in collate_heads(chosen_sequences, vocab_map).items()}
        for group in optimizer.param_groups:
            group["lr"] = _lr(state.step, config)
        loss, stats = head_loss(head, batch, options.recipe, options.unroll, options.regression_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        state.step += 1
        state.tokens_seen += int(batch["answer"].sum())
        window_loss += loss.item()
        window_steps += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", ce=f"{stats.get('ce0', 0):.2f}", agree=f"{stats.get('agree0', 0):.2f}")
        if state.step % config.save_every == 0 or state.step == config.steps:
            state.losses.append(window_loss / window_steps)
            window_loss, window_steps = 0.0, 0
            if heldout:
                acceptance = check_heldout()
                bar.set_postfix(loss=f"{loss.item():.3f}", heldout_tau=f"{acceptance:.3f}", best_step=state.best_step)
            if checkpoint is not None:
                save_checkpoint(checkpoint, head, optimizer, state, best)  # type: ignore[arg-type]
            if config.time_limit_s and time.perf_counter() - started > config.time_limit_s and state.step < config.steps:
                state.stopped_by_time_limit = True
                print(f"time limit of {config.time_limit_s:.0f} s reached at step {state.step}; "
                      "stopping (rerun with --resume to continue)", flush=True)
                break
    bar.close()
    if best is not None and (state.step == config.steps or state.stopped_by_time_limit):
        head.load_state_dict(best)
    head.eval()
    return state


def head_config_for(target_config, config: TrainConfig, options: HeadOptions) -> EagleConfig:
    """A head shape that plugs into this target: the zoo's (width, heads, RoPE, reduced vocabulary)
    with the head's MLP width and its own number of blocks."""
    shape = zoo_config_for(target_config, replace(config, intermediate_size=options.intermediate_size)).to_dict()
    shape["num_layers"] = options.num_layers
    return EagleConfig(**{k: v for k, v in shape.items() if k in EagleConfig.__dataclass_fields__})


def head_card(metadata: dict) -> str:
    curve = metadata["heldout_acceptance_curve"]
    lines = [
        f"# specpool white-box head: {metadata['name']}",
        "",
        f"EAGLE-style head for the target `{metadata['target']}` (width {metadata['target_card']['hidden_size']}, "
        f"{metadata['target_card']['num_hidden_layers']} layers, tokenizer {metadata['target_tokenizer_fingerprint']}), "
        f"domain **{metadata['domain']}**, recipe `{metadata['recipe']}`; trained on the target's own greedy answers "
        "and its features (specpool/learning/eagle_train.py).",
        "",
        "| field | value |",
        "|---|---|",
        f"| data files | {', '.join(metadata['data'])} |",
        f"| prompts answered by the target (train / held out) | {metadata['teacher_prompts']} / {metadata['heldout_prompts']} |",
        f"| answer tokens | {metadata['teacher_tokens']} |",
        f"| reference answers read teacher-forced (pairs, tokens) | {metadata.get('reference_pairs', 0)}, "
        f"{metadata.get('reference_tokens', 0)} |",
        f"| steps, answer positions seen | {metadata['steps']}, {metadata['tokens_seen']} |",
        f"| held-out tokens per round (k = 5, greedy, no stop): start, best (step) | "
        f"{curve[0] if curve else 'n/a'}, {metadata['best_heldout_acceptance']} ({metadata['best_step']}) |",
        f"| own parameters | {metadata['own_parameters']} |",
        f"| decoder blocks, weights on disk | {metadata['model'].get('num_layers', 1)}, {metadata.get('storage', 'float16')} |",
        f"| reduced vocabulary | {metadata['model']['reduced_vocab']} tokens |",
        f"| seed, device | {metadata['seed']}, {metadata['device']} |",
        "",
        "## Acceptance",
        "",
    ]
    rows = metadata.get("acceptance_rows") or {}  # prompts file -> its table (python -m bench.head_accuracy --write-cards)
    if rows:
        lines += ["The held-out row above is on prompts of the head's own corpora. On benchmark prompts, with the "
                  "target's true features (no prompt lookup, no leaves, no timing):", ""]
        for prompts, table in rows.items():
            lines += [f"### `{prompts}`", "", table, ""]
    else:
        lines += [metadata.get("acceptance_row") or ("Held-out acceptance above (prompts of its own corpora); on other "
                  "prompts, measure it: `python -m bench.head_accuracy --prompts P --heads PATH`."), ""]
    return "\n".join(lines)


def train_head(config: TrainConfig, options: HeadOptions, home: Path, out: Path, resume: bool, target_name: str,
               device: str = "cpu", teacher_only: bool = False) -> dict:
    """Teacher data with features -> vocabulary -> training -> exported head. Returns its metadata."""
    from specpool.target.models import ModelConfig, load_causal_lm, resolve_model, tokenizer_fingerprint

    if options.recipe not in RECIPES:
        raise InvalidArgument(f"unknown recipe {options.recipe!r}; known: {', '.join(RECIPES)}")
    if options.unroll < 1:
        raise InvalidArgument(f"--unroll must be >= 1, got {options.unroll}")
    if options.num_layers < 1:
        raise InvalidArgument(f"--head-layers must be >= 1, got {options.num_layers}")
    if options.storage not in STORAGES:
        raise InvalidArgument(f"unknown --storage {options.storage!r}; known: {', '.join(STORAGES)}")
    if not config.features_context:
        config = replace(config, features_context=DEFAULT_FEATURES_CONTEXT)
    _check_train_config(config)
    ModelConfig(target_name, device).check_device()
    if not teacher_only:
        check_output_dir(out)
    prompts = collect_prompts([Path(p) for p in config.data], config.max_prompts, config.seed)
    target, tokenizer = load_causal_lm(ModelConfig(target_name, device, dtype="float32"), home)
    fingerprint = tokenizer_fingerprint(tokenizer)
    stop_ids = tuple(sorted({tokenizer.eos_token_id}))
    store = home / "zoo" / "teacher" / teacher_store_key(config, fingerprint)
    index = generate_teacher(target, tokenizer, prompts, store, config, stop_ids)
    prompts = [p for p in prompts if prompt_hash(p) in index]
    train_prompts, heldout_prompts = split_heldout(prompts)
    reference_prompts, reference_index, reference_store = [], {}, None
    if options.reference_answers > 0:
        reference_store = home / "zoo" / "teacher" / reference_store_key(config, fingerprint)
        # Every pair of the corpus in its seeded order, the ones the store has already read first: a
        # rerun with another N (or a run that stopped at its time limit) reuses the reads it paid for.
        pairs = collect_pairs([Path(p) for p in config.data], 1 << 62, config.seed)
        # The held-out rule is a function of the prompt (applied over the whole corpus, before any
        # cut): a prompt held out on-policy never trains here either.
        kept = set(split_heldout([p for p, _ in pairs])[0])
        pairs = [(p, r) for p, r in pairs if p in kept]
        stored = set(teacher_index(reference_store)) if reference_store.exists() else set()
        pairs = ([pr for pr in pairs if prompt_hash(pr[0]) in stored]
                 + [pr for pr in pairs if prompt_hash(pr[0]) not in stored])[:options.reference_answers]
        reference_index = reference_teacher(target, tokenizer, pairs, reference_store, config, stop_ids)
        reference_prompts = [p for p, _ in pairs if prompt_hash(p) in reference_index]
    if teacher_only:
        return {"domain": config.domain, "store": str(store), "teacher_prompts": len(prompts),
                "reference_store": str(reference_store), "reference_pairs": len(reference_prompts)}
    by_prompt = dict(zip(prompts, load_feature_teacher(prompts, index)))
    sequences = [by_prompt[p] for p in train_prompts] * max(options.onpolicy_weight, 1)
    sequences += load_feature_teacher(reference_prompts, reference_index)
    heldout = [by_prompt[p] for p in heldout_prompts][:64]  # the acceptance check drafts: keep it bounded
    if not sequences:
        raise TrainingError("the target produced no teacher data")

    torch.manual_seed(config.seed)
    target_dir = Path(resolve_model(target_name, home))
    target_state = load_file(str(target_dir / "model.safetensors"))
    embedding = target_state["model.embed_tokens.weight"].float()
    output = target_state["lm_head.weight"].float() if "lm_head.weight" in target_state else None
    head_config = head_config_for(target.config, config, options)
    # A warm start keeps the vocabulary its head drafted with where the size leaves room: a head
    # continued on new data (self-written chat prompts) must not lose the tokens of the data it
    # learnt before; the slots beyond it go to the new data's most probable tokens.
    source = _source_head(options.init_from, home, target_name) if options.init_from else None
    kept = tuple(source.vocab_ids.tolist()) if source is not None else ()
    if len(kept) > head_config.reduced_vocab:
        kept = ()  # a smaller vocabulary than the source's: chosen by the new data alone
    vocab_ids = build_vocab(sequences, head_config.reduced_vocab, embedding.shape[0], (*stop_ids, *kept))  # type: ignore[arg-type]
    head = EagleHead(head_config, embedding, vocab_ids, output)
    last = target.config.num_hidden_layers - 1
    init_from_target(head, target_state, last if options.init_layer < 0 else min(options.init_layer, last))
    del target, target_state
    if source is not None:
        _init_from_head(head, source)
        del source
    head.to(device)
    vocab_map = torch.full((embedding.shape[0],), -1, dtype=torch.long)
    vocab_map[head.vocab_ids.cpu()] = torch.arange(len(head.vocab_ids))

    checkpoint_dir = home / "zoo" / "checkpoints"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    run_key = hashlib.sha256(f"{out.resolve()}:{config.domain}:eagle".encode()).hexdigest()[:12]
    checkpoint = checkpoint_dir / f"eagle-{config.domain}-{run_key}.pt"
    if not resume and checkpoint.exists():
        checkpoint.unlink()
    state = train_head_steps(head, sequences, heldout, vocab_map, config, options, checkpoint, resume)
    head.to("cpu")
    metadata = {
        "name": out.name,
        "kind": HEAD_KIND,
        "domain": config.domain,
        "target": target_name,
        "target_tokenizer_fingerprint": fingerprint,
        "target_card": target_card(target_dir),
        "feature": "final hidden state (after the target's last norm)",
        "recipe": options.recipe,
        "model": head.config.to_dict(),
        "own_parameters": head.own_parameters(),
        "data": [str(p) for p in config.data],
        "teacher_prompts": len(train_prompts),
        "teacher_tokens": int(sum(len(by_prompt[p].label_ids) for p in train_prompts)),
        "reference_pairs": len(reference_prompts),
        "reference_tokens": int(sum(len(s.label_ids) for s in sequences[len(train_prompts) * max(options.onpolicy_weight, 1):])),
        "onpolicy_weight": options.onpolicy_weight,
        "heldout_prompts": len(heldout),
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "loss_curve": [round(x, 4) for x in state.losses],
        "heldout_acceptance_curve": state.val_losses,
        "best_heldout_acceptance": round(-state.best_val, 4) if state.val_losses else None,
        "best_step": state.best_step,
        "stopped_by_time_limit": state.stopped_by_time_limit,
        "device": str(device),
        "seed": config.seed,
        "train_config": {**{k: v for k, v in asdict(config).items() if k != "data"}, "head": asdict(options)},
    }
    metadata["storage"] = options.storage
    export_drafter(head, out, metadata, head_card(metadata), storage=options.storage)  # type: ignore[arg-type]
    return metadata


def _source_head(spec: str, home: Path, target_name: str) -> EagleHead:
    """The trained head ``--init-from`` names (a shipped head or a folder)."""
    from specpool.drafters.eagle import head_folder, load_eagle_head

    folder = head_folder(spec.removeprefix(f"{HEAD_KIND}:"))
    if not (folder / "config.json").exists():
        raise InvalidArgument(f"--init-from {spec!r} is neither a shipped head nor a trained head's folder")
    return load_eagle_head(folder, home, target_name)[0]


def _init_from_head(head: EagleHead, source: EagleHead) -> None:
    """Start from a trained head's weights (its vocabulary's biases where the vocabularies meet).

    Blocks the source lacks (a deeper head grown from a one-block one) are appended with their
    attention and MLP output projections zeroed: each adds nothing to the residual stream at first,
    so the grown head drafts exactly as its source did and training starts from there (their
    projections still get gradients through the zeroed outputs)."""
    if source.config.num_layers > head.config.num_layers:
        raise InvalidArgument(f"--init-from has {source.config.num_layers} blocks; this head has "
                              f"{head.config.num_layers} (--head-layers cannot drop blocks)")
    state = {k: v for k, v in source.state_dict().items() if k not in ("vocab_ids", "head_bias")}
    head.load_state_dict(state, strict=False)
    with torch.no_grad():
        for block in head.blocks[source.config.num_layers:]:
            block.o_proj.weight.zero_()
            block.down_proj.weight.zero_()
    with torch.no_grad():  # biases of shared vocabulary entries carry over
        index = source.reduced_index()[head.vocab_ids]  # (V_r,) 1 + index in the source, 0 if absent
        present = index > 0
        head.head_bias[present] = source.head_bias[index[present] - 1]


def heldout_report(folder: Path, home: Path, target_name: str, data: list[str], max_prompts: int,
                   config: TrainConfig) -> dict:
    """Held-out acceptance of a trained head on a corpus's held-out prompts (the recipe comparison)."""
    from specpool.drafters.eagle import load_eagle_head

    head, metadata = load_eagle_head(folder, home, target_name)
    prompts = collect_prompts([Path(p) for p in data], max_prompts, config.seed)
    store = home / "zoo" / "teacher" / teacher_store_key(config, metadata["target_tokenizer_fingerprint"])
    index = teacher_index(store)
    _, heldout_prompts = split_heldout([p for p in prompts if prompt_hash(p) in index])
    heldout = load_feature_teacher(heldout_prompts, index)
    return {"head": str(folder), "recipe": metadata["recipe"], "heldout_prompts": len(heldout),
            "tokens_per_round": round(heldout_acceptance(head, heldout), 4)}


