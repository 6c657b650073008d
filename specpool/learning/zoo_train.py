"""Training zoo drafters by on-policy knowledge distillation from the target.

Pipeline (``specpool zoo train``), every stage resumable and seeded:
1. *Teacher data.* The target answers the domain's prompts greedily (batched); at every answer
   position we keep its top-K next-token distribution. Shards land in ``<home>/zoo/teacher/<key>``
   and are reused by later runs (this is the "precompute the target's top-K once" step).
2. *Reduced vocabulary.* The drafter's output head covers the tokens that carry the most teacher
   probability mass in this domain (plus the stop tokens).
3. *Distillation.* Soft cross-entropy between the teacher's top-K p and the drafter's q at every
   answer position, i.e. KL(p || q) up to p's entropy (Hinton et al. 2015; on-policy data as in
   DistillSpec, Zhou et al. 2024). AdamW with warm-up and cosine decay; checkpoints every
   ``save_every`` steps. The batch of step s is a pure function of (seed, s), so a resumed run
   continues exactly where a straight run would be.
4. *Output.* ``model.safetensors`` (float16 layers + vocabulary ids), ``config.json`` and a model
   card, written to a temporary folder and renamed into place: nothing half-written is left.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specpool.learning.zoo_data import check_domain, collect_prompts
from specpool.drafters.weight_storage import pack
from specpool.drafters.zoo_model import ZooConfig, ZooLM, init_from_target_layers
from specpool.core.errors import InvalidArgument, NotFound, SpecpoolError

TEACHER_FORMAT = 1  # bump when the shard layout changes


class TrainingError(SpecpoolError):
    code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class TrainConfig:
    domain: str
    data: tuple[str, ...]  # corpus files or folders
    steps: int = 300  # optimiser steps
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    max_prompts: int = 320  # prompts the target answers for the teacher data
    max_new_tokens: int = 64  # length of each teacher answer
    max_prompt_tokens: int = 320  # prompts are cut from the left to this many tokens
    train_context_tokens: int = 160  # prompt tokens kept before the answer when training (speed)
    teacher_top_k: int = 20  # teacher distribution entries kept per position
    teacher_batch: int = 32  # prompts per batched generate call (~5x the tokens/s of one at a time on 2 cores)
    save_every: int = 100  # checkpoint period, in steps
    time_limit_s: float = 0.0  # stop at the first save after this much training time (0: no limit)
    teacher_time_limit_s: float = 0.0  # start no new teacher batch after this long; train on what is there
    init_layers: tuple[int, ...] = (0, 1)  # target layers that warm-start the drafter's blocks
    num_layers: int = 2  # drafter blocks
    intermediate_size: int = 768  # drafter MLP width (capped by the target's)
    reduced_vocab: int = 8192  # drafter output vocabulary (capped by the target's)
    # A trained zoo drafter (shipped name or folder) whose blocks, norm and output biases start
    # this run instead of the target's layers: a small domain fine-tunes a broader drafter.
    init_from: str | None = None
    # > 0: the teacher store also keeps the target's final hidden states (its *features*, what the
    # LM head reads) at the answer positions and this many prompt positions before them: the
    # training data of white-box heads (specpool/learning/eagle_train.py). 0: the zoo's store.
    features_context: int = 0


# --- 1. teacher data --------------------------------------------------------------------------


def teacher_store_key(config: TrainConfig, target_fingerprint: str) -> str:
    """Teacher answers depend on the target and on how it answers, not on the drafter trained:
    every run with the same key shares one store, so the general drafter reuses the domain
    drafters' answers (its prompts are a subset of theirs, specpool/learning/zoo_data.py)."""
    fields = [TEACHER_FORMAT, config.max_new_tokens, config.max_prompt_tokens, config.teacher_top_k, target_fingerprint]
    if config.features_context:  # a separate store: its shards hold features too
        fields.append(["features", config.features_context])
    material = json.dumps(fields)
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def prompt_hash(prompt: str) -> int:
    return int.from_bytes(hashlib.sha1(prompt.encode()).digest()[:7], "big")  # fits int64


def encode_chat(tokenizer, prompt: str, max_prompt_tokens: int) -> list[int]:
    """The prompt as the engine encodes it (chat template), cut from the left to fit."""
    from specpool.target.models import chat_prompt_ids

    return chat_prompt_ids(tokenizer, prompt)[-max_prompt_tokens:]


def teacher_index(store: Path) -> dict[int, tuple[Path, int]]:
    """prompt hash -> (shard, row) over every complete shard in ``store``."""
    index = {}
    for shard in sorted(store.glob("shard-*.safetensors")):
        try:
            with safe_open(str(shard), framework="pt") as handle:
                hashes = handle.get_tensor("prompt_hashes").tolist()
        except Exception as exc:  # noqa: BLE001
            raise TrainingError(f"teacher shard {shard} is unreadable ({exc}); delete it and rerun to regenerate") from exc
        for row, h in enumerate(hashes):
            index[h] = (shard, row)
    return index


@torch.inference_mode()
def generate_teacher(model, tokenizer, prompts: list[str], store: Path, config: TrainConfig,
                     stop_token_ids: tuple[int, ...]) -> dict[int, tuple[Path, int]]:
    """Make sure the target's answer to every prompt is in ``store``; return the store's index.

    The target answers greedily, batched (left padding), keeping its top-K p at each answer
    position. One shard per batch, written atomically, so an interrupted run loses at most the
    batch in flight and a rerun answers only what is missing.

    With ``config.features_context`` > 0 a forward hook on the target's final norm records its
    features during the same generate call (no second pass): shard rows then also hold
    ``features`` (float16, positions ``feature_starts[i]`` .. len-2 of sequence i: the last
    token's is never needed, a head predicts it from the one before).
    """
    entered = time.perf_counter()  # the time limit counts from here, encoding included
    store.mkdir(parents=True, exist_ok=True)
    index = teacher_index(store)
    missing = [p for p in dict.fromkeys(prompts) if prompt_hash(p) not in index]
    encoded = {p: encode_chat(tokenizer, p, config.max_prompt_tokens) for p in missing}
    missing.sort(key=lambda p: len(encoded[p]))  # similar lengths batch well
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(missing), desc=f"teacher answers ({config.domain})",
               unit="prompt", dynamic_ncols=True)
    captured: list[torch.Tensor] = []  # the final norm's output per forward: (B, W, d), then (B, 1, d) per step
    hook = None
    if config.features_context:
        hook = model.get_decoder().norm.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        _answer_batches(model, missing, encoded, store, config, stop_token_ids, entered, index, bar, captured)
    finally:
        if hook is not None:
            hook.remove()
    bar.close()
    return index


def _answer_batches(model, missing, encoded, store, config, stop_token_ids, entered, index, bar, captured) -> None:
    """The batch loop of ``generate_teacher``: one shard per batch of ``config.teacher_batch``."""
    pad = stop_token_ids[0]
    tokens_done, started = 0, time.perf_counter()
    for first in range(0, len(missing), config.teacher_batch):
        if config.teacher_time_limit_s and time.perf_counter() - entered > config.teacher_time_limit_s:
            print(f"teacher time limit reached: {len(missing) - first} prompts left unanswered "
                  "(rerun to answer them)", flush=True)
            break
        batch = missing[first:first + config.teacher_batch]
        width = max(len(encoded[p]) for p in batch)
        captured.clear()
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: answers start at the same column
            input_ids[row, width - len(encoded[p]):] = torch.tensor(encoded[p])
            attention[row, width - len(encoded[p]):] = 1
        out = model.generate(
            input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
            max_new_tokens=config.max_new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=pad, eos_token_id=list(stop_token_ids),
        )
        # Top-K one step at a time: stacking (B, T, V) first would need B*T*V floats at once
        # (19 GB for a 512-prompt batch on a GPU), the per-step tops only B*T*K.
        tops = [torch.softmax(step.float(), dim=-1).topk(config.teacher_top_k, dim=-1) for step in out.logits]
        top_p = torch.stack([t.values for t in tops], dim=1)  # (B, T, K)
        top_ids = torch.stack([t.indices for t in tops], dim=1)  # (B, T, K)
        del tops
        answers = out.sequences[:, width:].cpu()  # (B, T)
        tokens, offsets, starts, label_ids, label_probs = [], [0], [], [], []
        features, feature_starts = [], []
        for row, p in enumerate(batch):
            answer = answers[row].tolist()
            end = next((t + 1 for t, tok in enumerate(answer) if tok in stop_token_ids), len(answer))
            tokens.extend(encoded[p] + answer[:end])
            offsets.append(len(tokens))
            starts.append(len(encoded[p]))
            label_ids.append(top_ids[row, :end].cpu())
            label_probs.append(top_p[row, :end].cpu())
            tokens_done += end
            if captured:
                first_kept = max(len(encoded[p]) - config.features_context, 0)
                prompt_part = captured[0][row, width - len(encoded[p]) + first_kept:]  # (P - first_kept, d)
                # Decode step s fed the answer's token s-1, at position P + s - 1; positions up to
                # len - 2 are wanted, i.e. steps 1 .. end - 1.
                answer_part = [step[row] for step in captured[1:end]]  # end - 1 rows of (1, d)
                features.append(torch.cat([prompt_part, *answer_part]).to(torch.float16).cpu())
                feature_starts.append(first_kept)
        # Named by its prompts, not by a counter: runs of several domains can fill one store at
        # the same time (their prompts differ) without clobbering each other's shards.
        batch_key = hashlib.sha256(",".join(str(prompt_hash(p)) for p in batch).encode()).hexdigest()[:16]
        shard = store / f"shard-{batch_key}.safetensors"
        extra = {}
        if captured:
            extra = {"features": torch.cat(features),  # (rows, d) float16, sequence after sequence
                     "feature_starts": torch.tensor(feature_starts, dtype=torch.int64)}  # (n,)
        _atomic_save({
            **extra,
            "prompt_hashes": torch.tensor([prompt_hash(p) for p in batch], dtype=torch.int64),  # (n,)
            "tokens": torch.tensor(tokens, dtype=torch.int32),  # all sequences, concatenated
            "offsets": torch.tensor(offsets, dtype=torch.int64),  # (n+1,) sequence boundaries
            "answer_starts": torch.tensor(starts, dtype=torch.int64),  # (n,) first answer position
            "label_ids": torch.cat(label_ids).to(torch.int32),  # (answer tokens, K)
            "label_probs": torch.cat(label_probs).to(torch.float16),  # (answer tokens, K)
        }, shard)
        for row, p in enumerate(batch):
            index[prompt_hash(p)] = (shard, row)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - started):.0f}")


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


@dataclass
class Sequence:
    tokens: torch.Tensor  # (L,) prompt + answer
    answer_start: int
    label_ids: torch.Tensor  # (A, K) teacher top-K ids for answer positions
    label_probs: torch.Tensor  # (A, K)


def read_teacher_shards(prompts: list[str], index: dict[int, tuple[Path, int]]):
    """(shard, its tensors, the rows of ``prompts`` in it) for each shard ``prompts`` need, each
    shard read once (the zoo's and the white-box heads' loaders share this)."""
    wanted: dict[Path, list[int]] = {}
    for p in prompts:
        shard, row = index[prompt_hash(p)]
        wanted.setdefault(shard, []).append(row)
    for shard, rows in wanted.items():
        try:
            data = load_file(str(shard))
        except Exception as exc:  # noqa: BLE001
            raise TrainingError(f"teacher shard {shard} is unreadable ({exc}); delete it and rerun to regenerate") from exc
        yield shard, data, rows


def load_teacher(prompts: list[str], index: dict[int, tuple[Path, int]]) -> list[Sequence]:
    """The teacher sequences of ``prompts``, in order, read from the store's shards."""
    by_key: dict[tuple[Path, int], Sequence] = {}
    for shard, data, rows in read_teacher_shards(prompts, index):
        offsets, starts = data["offsets"].tolist(), data["answer_starts"].tolist()
        label_offsets = [0]
        for n, start in enumerate(starts):
            label_offsets.append(label_offsets[-1] + (offsets[n + 1] - offsets[n]) - start)
        for row in rows:
            a, b = label_offsets[row], label_offsets[row + 1]
            by_key[(shard, row)] = Sequence(data["tokens"][offsets[row]:offsets[row + 1]].long(), starts[row],
                                            data["label_ids"][a:b].long(), data["label_probs"][a:b].float())
    return [by_key[index[prompt_hash(p)]] for p in prompts]


def split_heldout(prompts: list[str], fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, held-out) prompts. Held-out membership is a function of the prompt's hash, so it
    stays the same whatever order or subset the corpus yields; none held out below 20 prompts."""
    if len(prompts) < 20:
        return prompts, []
    modulus = max(int(round(1 / fraction)), 2)
    heldout = [p for p in prompts if prompt_hash(p) % modulus == 0]
    train = [p for p in prompts if prompt_hash(p) % modulus != 0]
    return (train, heldout) if train and heldout else (prompts, [])


# --- 2. reduced vocabulary ------------------------------------------------------------------


def build_vocab(sequences: list[Sequence], size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The ``size`` token ids with the most teacher probability mass, stop tokens always in."""
    mass = torch.zeros(vocab_size)
    for seq in sequences:
        mass.index_add_(0, seq.label_ids.reshape(-1), seq.label_probs.reshape(-1))
        mass.index_add_(0, seq.tokens, torch.full((len(seq.tokens),), 1e-3))  # break ties towards seen text
    mass[list(always)] = float("inf")
    return mass.topk(size).indices.sort().values


# --- 3. distillation --------------------------------------------------------------------------


def batch_indices(step: int, n_sequences: int, batch_size: int, seed: int) -> list[int]:
    """Sequences of optimiser step ``step``: epochs are seeded permutations, so any step's batch
    is known without replaying the ones before (exact resume)."""
    first = step * batch_size
    out = []
    for position in range(first, first + batch_size):
        epoch, index = divmod(position, n_sequences)
        perm = torch.randperm(n_sequences, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(perm[index]))
    return out


def trim_context(seq: Sequence, context_tokens: int) -> Sequence:
    """Keep at most ``context_tokens`` prompt tokens before the answer (cut from the left)."""
    cut = max(seq.answer_start - max(context_tokens, 1), 0)  # keep >= 1 token: logits at answer_start-1
    if cut == 0:
        return seq
    return Sequence(seq.tokens[cut:], seq.answer_start - cut, seq.label_ids, seq.label_probs)


def collate(sequences: list[Sequence], vocab_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs (B, L), and for each answer position the teacher's labels mapped into
    the reduced vocabulary: ids (B, L, K) with -1 where absent, probs (B, L, K), mask (B, L)."""
    length = max(len(s.tokens) for s in sequences) - 1
    K = sequences[0].label_ids.shape[1]
    inputs = torch.zeros(len(sequences), length, dtype=torch.long)
    ids = torch.full((len(sequences), length, K), -1, dtype=torch.long)
    probs = torch.zeros(len(sequences), length, K)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for b, s in enumerate(sequences):
        n = len(s.tokens) - 1
        inputs[b, :n] = s.tokens[:-1]
        # Logits at position t predict token t+1, so answer token j sits at t = answer_start+j-1.
        first = s.answer_start - 1
        count = len(s.label_ids)
        ids[b, first:first + count] = vocab_map[s.label_ids]
        probs[b, first:first + count] = s.label_probs
        mask[b, first:first + count] = True
    return inputs, ids, probs, mask


def distillation_loss(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy -sum_i p_i log q_i over the teacher's top-K, mean over positions.

    logits: (N, V_r) at answer positions only; ids/probs: (N, K), id -1 for teacher tokens outside
    the reduced vocabulary (their mass cannot be matched and is left out).
    """
    log_q = F.log_softmax(logits.float(), dim=-1)  # (N, V_r)
    present = ids >= 0
    picked = log_q.gather(-1, ids.clamp_min(0)) * present  # (N, K)
    return -(probs * picked).sum(-1).mean()


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    losses: list[float] = field(default_factory=list)  # mean loss per save period
    stopped_by_time_limit: bool = False
    val_losses: list[float] = field(default_factory=list)  # held-out loss at each check
    best_val: float = float("inf")
    best_step: int = 0


def _lr(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(config.steps - config.warmup, 1)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def save_checkpoint(path: Path, model: ZooLM, optimizer: torch.optim.Optimizer, state: TrainState,
                    best: dict[str, torch.Tensor] | None = None) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": asdict(state),
                "best": best}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: ZooLM, optimizer: torch.optim.Optimizer
                    ) -> tuple[TrainState, dict[str, torch.Tensor] | None]:
    try:
        data = torch.load(path, map_location=model.device, weights_only=True)
        model.load_state_dict(data["model"])
        optimizer.load_state_dict(data["optimizer"])
        return TrainState(**data["state"]), data.get("best")
    except Exception as exc:  # noqa: BLE001 - any failure here means the same to the user
        raise TrainingError(
            f"checkpoint {path} is corrupted or incompatible ({type(exc).__name__}: {exc}); "
            "delete it to start over, or run without --resume"
        ) from exc


@torch.no_grad()
def heldout_loss(model: ZooLM, sequences: list[Sequence], vocab_map: torch.Tensor, config: TrainConfig,
                 batch_size: int = 32) -> float:
    """Distillation loss on held-out sequences, weighted by answer positions."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for first in range(0, len(sequences), batch_size):
        batch = [trim_context(s, config.train_context_tokens) for s in sequences[first:first + batch_size]]
        inputs, ids, probs, mask = (t.to(model.device) for t in collate(batch, vocab_map))
        hidden = model.hidden(inputs)[mask]
        n = int(mask.sum())
        total += float(distillation_loss(model.reduced_logits(hidden), ids[mask], probs[mask])) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


def train_steps(model: ZooLM, sequences: list[Sequence], vocab_map: torch.Tensor, config: TrainConfig,
                checkpoint: Path | None, resume: bool, until: int | None = None,
                heldout: list[Sequence] | None = None) -> TrainState:
    """Run (or continue) distillation up to step ``until`` (default ``config.steps``).

    With ``heldout`` sequences, the loss on them is checked at every save and the model ends
    with the weights of the best check (early stopping by
    selection: long runs on a small domain cannot end overfitted). The best weights travel in the
    checkpoint, so a resumed run selects exactly as a straight one.
    """
    torch.manual_seed(config.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    state, best = TrainState(), None
    if resume and checkpoint is not None and checkpoint.exists():
        state, best = load_checkpoint(checkpoint, model, optimizer)
        state.stopped_by_time_limit = False
    until = config.steps if until is None else until
    if model.device.type == "cuda":
        # TF32 matmuls for the drafter's training on a GPU (~8x fp32 speed); the teacher's
        # answers were made before, in full fp32. Restored on the way out.
        previous_precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")

    def check_heldout() -> float:
        """Held-out loss of the current weights; keeps them if they are the best so far."""
        nonlocal best
        val = heldout_loss(model, heldout, vocab_map, config)
        state.val_losses.append(round(val, 4))
        if val < state.best_val:
            state.best_val, state.best_step = val, state.step
            best = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return val

    if heldout and config.init_from and state.step == 0 and not state.val_losses:
        check_heldout()  # a trained starting point may already be the best there will be
    model.train()
    bar = tqdm(total=until, initial=state.step, desc=f"distil {config.domain}", unit="step", dynamic_ncols=True)
    window_loss, window_steps, started, window_tokens = 0.0, 0, time.perf_counter(), 0
    while state.step < until:
        batch = [trim_context(sequences[i], config.train_context_tokens)
                 for i in batch_indices(state.step, len(sequences), config.batch_size, config.seed)]
        inputs, ids, probs, mask = (t.to(model.device, non_blocking=True) for t in collate(batch, vocab_map))
        for group in optimizer.param_groups:
            group["lr"] = _lr(state.step, config)
        hidden = model.hidden(inputs)[mask]  # (N, d): the head runs on answer positions only
        loss = distillation_loss(model.reduced_logits(hidden), ids[mask], probs[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        state.step += 1
        state.tokens_seen += int(mask.sum())
        window_tokens += inputs.numel()
        window_loss += loss.item()
        window_steps += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{window_tokens / (time.perf_counter() - started):.0f}")
        if heldout and (state.step % config.save_every == 0 or state.step == config.steps):
            val = check_heldout()
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val:.3f}", best_step=state.best_step)
        if state.step % config.save_every == 0 or state.step == until:
            state.losses.append(window_loss / window_steps)
            window_loss, window_steps = 0.0, 0
            if checkpoint is not None:
                save_checkpoint(checkpoint, model, optimizer, state, best)
            if config.time_limit_s and time.perf_counter() - started > config.time_limit_s and state.step < until:
                state.stopped_by_time_limit = True
                print(f"time limit of {config.time_limit_s:.0f} s reached at step {state.step}; "
                      "stopping (rerun with --resume to continue)", flush=True)
                break
    bar.close()
    if model.device.type == "cuda":
        torch.set_float32_matmul_precision(previous_precision)
    if best is not None and (state.step == config.steps or state.stopped_by_time_limit):
        model.load_state_dict(best)  # the finished run ships its best held-out weights
    model.eval()
    return state


# --- 4. output --------------------------------------------------------------------------------


DRAFTER_FILES = ("model.safetensors", "config.json", "README.md")


def check_writable(folder: Path) -> None:
    """Fail before any work if ``folder`` cannot be created or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise InvalidArgument(f"output directory {folder} is not writable ({exc.strerror or exc})") from None


def check_output_dir(out: Path) -> None:
    """``out`` will be replaced by the drafter: it must be absent, empty or a drafter already,
    never a folder of other files, and its parent must be writable. Nothing is created in it."""
    if out.exists() and not out.is_dir():
        raise InvalidArgument(f"output directory {out} is not writable: it exists and is not a folder")
    if out.is_dir() and any(p.name not in DRAFTER_FILES for p in out.iterdir()):
        raise InvalidArgument(f"output directory {out} holds files that are not a zoo drafter's; choose another --out")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidArgument(f"output directory {out} is not writable: {parent} is not a folder")
    check_writable(parent)


def export_drafter(model: ZooLM, out: Path, metadata: dict, card: str, storage: str = "float16") -> None:
    """Write model.safetensors (float16 layers, or int8 matrices with row scales where ``storage``
    is int8: specpool/drafters/weight_storage.py; int32 vocabulary ids), config.json and README.md
    into ``out`` atomically: a temporary sibling folder renamed over the final one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        tensors = pack(model.state_dict(), storage)
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(metadata, indent=2) + "\n")
        (tmp / "README.md").write_text(card)
        tmp.chmod(0o755)  # mkdtemp makes it private; a drafter folder is meant to be shared
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            keep = [p for p in out.iterdir() if p.name in ("checkpoint.pt",)]
            for p in keep:
                shutil.move(str(p), tmp / p.name)
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _heldout_cell(metadata: dict) -> str:
    if metadata.get("best_heldout_loss") is None:
        return "none held out"
    return f"{metadata['best_heldout_loss']:.4f} at step {metadata['best_step']} ({metadata['heldout_prompts']} prompts)"


def model_card(metadata: dict) -> str:
    lines = [
        f"# specpool zoo drafter: {metadata['name']}",
        "",
        f"Domain **{metadata['domain']}**; distilled from the target `{metadata['target']}` on its own greedy answers",
        "(on-policy distillation; soft cross-entropy to the target's top-K distribution).",
        "",
        "| field | value |",
        "|---|---|",
        f"| data files | {', '.join(metadata['data'])} |",
        f"| prompts answered by the target | {metadata['teacher_prompts']} |",
        f"| answer tokens (teacher positions) | {metadata['teacher_tokens']} |",
        f"| steps | {metadata['steps']} |",
        f"| tokens seen (answer positions) | {metadata['tokens_seen']} |",
        f"| final loss | {metadata['final_loss']:.4f} |",
        f"| held-out loss (best, at step) | {_heldout_cell(metadata)} |",
        f"| own parameters | {metadata['own_parameters']} |",
        f"| reduced vocabulary | {metadata['model']['reduced_vocab']} tokens |",
        f"| seed | {metadata['seed']} |",
        *([f"| started from | drafter `{init}` (its blocks, norm and output biases) |"]
          if (init := metadata.get("train_config", {}).get("init_from")) else []),
        "",
        "## Acceptance (specpool zoo eval, k = 5)",
        "",
        metadata.get("acceptance_row") or "Not evaluated yet: run `specpool zoo eval`.",
        "",
    ]
    return "\n".join(lines)


# --- the whole job ----------------------------------------------------------------------------


def zoo_config_for(target_config, config: TrainConfig) -> ZooConfig:
    """A drafter shape that plugs into this target: its width, heads and RoPE, our depth."""
    rope = getattr(target_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    return ZooConfig(
        hidden_size=target_config.hidden_size,
        num_layers=config.num_layers,
        num_heads=target_config.num_attention_heads,
        num_kv_heads=getattr(target_config, "num_key_value_heads", target_config.num_attention_heads),
        intermediate_size=min(config.intermediate_size, target_config.intermediate_size),
        reduced_vocab=min(config.reduced_vocab, target_config.vocab_size),
        rope_theta=float(theta),
        rms_eps=float(target_config.rms_norm_eps),
        max_positions=int(target_config.max_position_embeddings),
    )


def resolve_drafter_folder(spec: str) -> Path:
    """A shipped zoo drafter's name (``general``), ``zoo:PATH`` or a folder -> its folder."""
    from specpool.drafters.zoo import shipped_names, zoo_folder

    folder = zoo_folder(spec.removeprefix("zoo:"))
    if not (folder / "config.json").exists():
        raise NotFound(f"--init-from {spec!r}: neither a shipped zoo drafter ({', '.join(shipped_names())}) "
                       "nor a folder with a trained drafter (config.json, model.safetensors)")
    return folder


def init_from_drafter(model: ZooLM, spec: str, home: Path, target_name: str) -> None:
    """Start ``model`` from a trained drafter: its blocks and norm as they are; each output bias
    from the source's bias of the same token, or, for a token the source's vocabulary lacks,
    the median of the source's biases (a neutral prior for a token it never proposed)."""
    from specpool.drafters.zoo import load_zoo_model

    source, metadata = load_zoo_model(resolve_drafter_folder(spec), home, target_name)
    shape = {k: v for k, v in model.config.to_dict().items() if k != "reduced_vocab"}
    source_shape = {k: v for k, v in source.config.to_dict().items() if k != "reduced_vocab"}
    if shape != source_shape:
        differ = sorted(k for k in shape if shape[k] != source_shape.get(k))
        raise InvalidArgument(f"--init-from {spec!r}: its shape differs from this run's in {', '.join(differ)}")
    with torch.no_grad():
        model.blocks.load_state_dict(source.blocks.state_dict())
        model.norm.load_state_dict(source.norm.state_dict())
        position = torch.full((model.vocab_size,), -1, dtype=torch.long)
        position[source.vocab_ids] = torch.arange(len(source.vocab_ids))
        where = position[model.vocab_ids]  # (V_r,): the source's row of each token, or -1
        bias = torch.full_like(model.head_bias, float(source.head_bias.median()))
        bias[where >= 0] = source.head_bias[where[where >= 0]].to(bias)
        model.head_bias.copy_(bias)
    print(f"{model.config.num_layers} blocks, norm and biases from drafter {metadata.get('name', spec)!r} "
          f"({int((where >= 0).sum())} of {len(where)} tokens in its vocabulary)", flush=True)


def _check_train_config(config: TrainConfig) -> None:
    """The options ``train_drafter`` cannot run with, as one InvalidArgument each."""
    check_domain(config.domain)
    if not config.data:
        raise InvalidArgument("give at least one corpus with --data")
    for path in config.data:
        if not Path(path).exists():
            raise InvalidArgument(f"corpus {path} does not exist")
    for flag, value in (("--steps", config.steps), ("--batch-size", config.batch_size),
                        ("--max-prompts", config.max_prompts), ("--max-new-tokens", config.max_new_tokens),
                        ("--warmup", config.warmup), ("--context-tokens", config.train_context_tokens),
                        ("--save-every", config.save_every), ("--teacher-batch", config.teacher_batch),
                        ("--reduced-vocab", config.reduced_vocab)):
        if value < 1:
            raise InvalidArgument(f"{flag} must be >= 1, got {value}")
    if not config.lr > 0:
        raise InvalidArgument(f"--lr must be > 0, got {config.lr}")


def _drafter_metadata(out: Path, config: TrainConfig, target_name: str, fingerprint: str, model: ZooLM,
                      sequences: list[Sequence], heldout: list[Sequence], state: TrainState, device: str) -> dict:
    """The trained drafter's metadata.json: what it was trained from and how training went."""
    return {
        "name": out.name,
        "kind": "zoo",
        "domain": config.domain,
        "target": target_name,
        "target_tokenizer_fingerprint": fingerprint,
        "model": model.config.to_dict(),
        "own_parameters": model.own_parameters(),
        "data": [str(p) for p in config.data],
        "teacher_prompts": len(sequences),
        "teacher_tokens": int(sum(len(s.label_ids) for s in sequences)),
        "heldout_prompts": len(heldout),
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "final_loss": state.losses[-1] if state.losses else float("nan"),
        "loss_curve": [round(x, 4) for x in state.losses],
        "heldout_loss_curve": state.val_losses,
        "best_heldout_loss": round(state.best_val, 4) if state.val_losses else None,
        "best_step": state.best_step if state.val_losses else state.step,
        "stopped_by_time_limit": state.stopped_by_time_limit,
        "device": str(device),
        "seed": config.seed,
        "train_config": {k: v for k, v in asdict(config).items() if k != "data"},
    }


def train_drafter(config: TrainConfig, home: Path, out: Path, resume: bool, target_name: str,
                  device: str = "cpu", teacher_only: bool = False) -> dict:
    """Teacher data -> vocabulary -> distillation -> exported drafter. Returns its metadata.

    ``device`` runs both the teacher (in float32: its greedy answers are what the drafter must
    predict) and the distillation there. ``teacher_only`` stops after the teacher data is in the
    store and returns a summary of it (precompute once, train many).
    """
    from specpool.target.models import ModelConfig, load_causal_lm, resolve_model, tokenizer_fingerprint

    _check_train_config(config)
    ModelConfig(target_name, device).check_device()  # before any corpus or model is read
    if config.init_from and not teacher_only:
        resolve_drafter_folder(config.init_from)  # a wrong name fails now, not after the teacher's answers
    if not teacher_only:
        check_output_dir(out)
    prompts = collect_prompts([Path(p) for p in config.data], config.max_prompts, config.seed)

    target, tokenizer = load_causal_lm(ModelConfig(target_name, device, dtype="float32"), home)
    fingerprint = tokenizer_fingerprint(tokenizer)
    stop_ids = tuple(sorted({tokenizer.eos_token_id}))
    store = home / "zoo" / "teacher" / teacher_store_key(config, fingerprint)
    index = generate_teacher(target, tokenizer, prompts, store, config, stop_ids)
    answered = [p for p in prompts if prompt_hash(p) in index]  # all, unless a teacher time limit cut it
    if len(answered) < len(prompts):
        print(f"{config.domain}: training on the {len(answered)} of {len(prompts)} prompts the target has answered",
              flush=True)
    prompts = answered
    by_prompt = dict(zip(prompts, load_teacher(prompts, index)))  # each shard read once
    train_prompts, heldout_prompts = split_heldout(prompts)
    sequences = [by_prompt[p] for p in train_prompts]
    heldout = [by_prompt[p] for p in heldout_prompts]
    if not sequences:
        raise TrainingError("the target produced no teacher data")
    if teacher_only:
        return {"domain": config.domain, "store": str(store), "teacher_prompts": len(prompts),
                "teacher_tokens": int(sum(len(s.label_ids) for s in by_prompt.values()))}

    torch.manual_seed(config.seed)
    target_state = load_file(str(Path(resolve_model(target_name, home)) / "model.safetensors"))
    embedding = target_state["model.embed_tokens.weight"].float()  # (V, d)
    zoo_config = zoo_config_for(target.config, config)
    vocab_ids = build_vocab(sequences, zoo_config.reduced_vocab, embedding.shape[0], stop_ids)
    model = ZooLM(zoo_config, embedding, vocab_ids)
    last = target.config.num_hidden_layers - 1
    init_from_target_layers(model, target_state, [min(i, last) for i in config.init_layers][: zoo_config.num_layers])
    del target, target_state
    if config.init_from:
        init_from_drafter(model, config.init_from, home, target_name)
    model.to(device)
    vocab_map = torch.full((embedding.shape[0],), -1, dtype=torch.long)
    vocab_map[vocab_ids] = torch.arange(len(vocab_ids))

    checkpoint_dir = home / "zoo" / "checkpoints"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    run_key = hashlib.sha256(f"{out.resolve()}:{config.domain}".encode()).hexdigest()[:12]
    checkpoint = checkpoint_dir / f"{config.domain}-{run_key}.pt"
    if not resume and checkpoint.exists():
        checkpoint.unlink()
    state = train_steps(model, sequences, vocab_map, config, checkpoint, resume, heldout=heldout)
    model.to("cpu")

    metadata = _drafter_metadata(out, config, target_name, fingerprint, model, sequences, heldout, state, device)
    export_drafter(model, out, metadata, model_card(metadata))
    return metadata
