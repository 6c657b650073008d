"""Tune online learning offline: replay the online benchmark's prompt stream without serving it.

`specpool bench --online` over 150 prompts takes about 90 minutes on two cores, so step sizes and
preconditioners were chosen with this replay instead (then checked by one real run):

    python scripts/online_replay.py build --limit 150 --max-new-tokens 64 --out /tmp/stream.pt   # ~4 min
    python scripts/online_replay.py run /tmp/stream.pt --drafter chat --config '{"lr": 0.002}'  # ~4 min

``build`` stores, per prompt of bench/online_stream.py's stream, the target's greedy answer and its top-20
p at every answer position (and at every prompt position, for --prefill). ``run`` walks the
stream in order. For each prompt it first *simulates* greedy speculative decoding at k = 5 with
the current drafter, with one teacher-forced drafter pass: a round starting at answer position t
accepts the run of positions where the drafter's argmax is the target's token, up to k, plus the
bonus token; tokens / rounds is the benchmark's mean accepted length. Then it learns from that
prompt's feedback as the learner would: one record per simulated round, on the target's path,
context tail 64, one record in 8 held out, batches of 4, through ``OnlineDrafterLearner`` with the
given ``OnlineConfig``.

Two options bring it close to a real run (``bench --online``), which the defaults are not:
``--confidence 0.4`` stops a draft, as the shipped zoo drafters do, after a token the drafter gave
less than that probability; ``--records drafted`` gives each record only the tokens a real round
would supervise on the target's path (the accepted ones and the next), instead of k from every
round start (overlapping records, which see each position about k times). Replaying the
Shakespeare stream with the defaults of `OnlineConfig`, the defaults here gave +18 % on the last third, the
two options +12 %. With `{"supervision": "argmax"}` the two options gave +18.7 %, and the served
run (`bench/results/online-shakespeare/`) +16.7 %.

``--records served`` goes one step further and gives each record what a served round's has: the
accepted tokens, then the draft token the target rejected and the target's p after it (an off-path
row, computed with the target: about half a served record's rows on prose). It is the closest to a
real run: on the Shakespeare stream with argmax supervision it gave 1.477 on the last third against
the served run's 1.472 (``drafted`` 1.49). Fitting only the on-path rows instead (rows cut at the
first rejection; tried in the learner, not kept) gave 1.470 - no better; two passes over each
prompt's records (``--epochs 2``) 1.491, at twice the learner time; batches of 2 records 1.479;
``--rehearse`` (extra steps on earlier prompts' records) 1.493 at 1x and 1.462 at 3x, in
``drafted`` mode.

The copy term (``"copy_window": 64``; specpool/drafters/zoo_model.py) was found here: with ``--records
served`` it gave 1.502 (+19.1 %; frozen 1.261), and with ``"grow_vocab": 2048, "grow_min_mass":
0.5`` as well 1.522 (+20.7 %; copy_scale 50: 1.518, 400 without growth: 1.464). Those runs used a
monkeypatched prototype of the same arithmetic (git history: scripts/copy_term_replay.py).

The learner's cost options were measured here too (``--records served --confidence 0.4``, config
``{"copy_window": 64, "grow_vocab": 2048, "supervision": "argmax", ...}``; last third, learner
seconds per prompt on two threads): both ``merge_records`` and ``detach_context`` off 1.522 / 0.75,
both on 1.516 / 0.39, both on with ``--batch-records 8`` 1.510 / 0.26; ``detach_context`` alone
1.500 / 0.50; ``--context-tail 32`` 1.485 / 0.52; ``"trainable_blocks": 1`` 1.467 / 0.54, ``0``
1.307 / 0.35. Replayed records carry their session (the prompt) and position, as served ones do.

``--publish-every N`` drafts with a copy of the learner published after every N trained records,
as a served learner's versions are, instead of the learner itself after every prompt. With the
process run's settings (``--records served --confidence 0.4 --batch-records 8``, config
``{"supervision": "argmax", "copy_window": 64, "grow_vocab": 2048, "lr": 0.003}``; last third,
frozen 1.261): after every prompt 1.533, every 256 records 1.526, every 768 records 1.531, so a
version's lag costs little here. At 256: lr 0.004 1.513, 0.006 1.496; two passes 1.514;
``"copy_window": 128`` with ``--context-tail 128`` 1.522; ``"grow_min_mass": 0.25`` 1.533. The
served process runs at lr 0.002 and 0.003 gave about 0.02 less than their replays (1.490, 1.506).

It prints the mean accepted length on the first third, the last third and overall.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specpool.core.defaults import DEFAULT_K  # noqa: E402 (after the checkout is on the path)

K = DEFAULT_K  # draft length
TOP_K = 20  # entries of the target's p per position, as the learner's records carry
CONTEXT_TAIL = 64  # context tokens a record keeps (LearningConfig.context_tail)
HOLDOUT_EVERY = 8  # one record in this many is held out (LearningConfig.holdout_every)


def build(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from bench.online_stream import stream_prompts
    from specpool.services.config import settings_from_env
    from specpool.target.models import DEFAULT_TARGET, ModelConfig, chat_prompt_ids, load_causal_lm

    model, tokenizer = load_causal_lm(ModelConfig(args.target or DEFAULT_TARGET, "cpu", "float32"), settings_from_env().home)
    eos = model.generation_config.eos_token_id
    stop = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [chat_prompt_ids(tokenizer, p) for p in stream_prompts(Path(args.corpus), args.limit)]
    stream = []
    for start in tqdm(range(0, len(prompts), args.batch), desc="target answers", unit="batch"):
        batch = prompts[start:start + args.batch]
        width = max(map(len, batch))  # left padding: every answer starts at column `width`
        inputs = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        with torch.no_grad():
            out = model.generate(input_ids=inputs, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        for row, prompt in zip(out[:, width:].tolist(), batch):
            stops = [i for i, t in enumerate(row) if t in stop]
            stream.append({"prompt": prompt, "output": row[: stops[0] + 1] if stops else row})
    for item in tqdm(stream, desc="target top-K", unit="prompt"):
        sequence = torch.tensor([item["prompt"] + item["output"]])
        with torch.no_grad():
            logits = model(sequence).logits[0, :-1].float()  # row i predicts token i + 1
        top = logits.softmax(-1).topk(TOP_K, -1)
        answer = len(item["prompt"]) - 1
        # Padded batch decoding must give the unpadded greedy answer, or the replay follows a wrong path.
        if not torch.equal(logits[answer:].argmax(-1), torch.tensor(item["output"])):
            raise SystemExit("batched greedy answers differ from teacher-forced argmax; rerun with --batch 1")
        item["top_ids"], item["top_p"] = top.indices[answer:], top.values[answer:]
        item["prompt_top_ids"], item["prompt_top_p"] = top.indices[:answer], top.values[:answer]
    torch.save(stream, args.out)
    print(f"{len(stream)} prompts, {sum(len(x['output']) for x in stream)} answer tokens -> {args.out}")


@torch.no_grad()
def simulate(model, item: dict, stop_below: float = 0.0, rejected: list | None = None) -> list[tuple[int, int]]:
    """(start, accepted) of each round of greedy speculative decoding of ``item``'s answer. With a
    ``rejected`` list, also appends, per round, the draft token the target rejected (the drafter's
    argmax where it differs from the answer), or None when the draft ended without one."""
    sequence = torch.tensor([item["prompt"] + item["output"]])
    logits = model(sequence, use_cache=False).logits[0, len(item["prompt"]) - 1: -1]  # (n, V_r)
    guesses = model.vocab_ids[logits.argmax(-1)]
    match = (guesses == torch.tensor(item["output"])).tolist()
    confidence = torch.softmax(logits.float(), -1).max(-1).values.tolist()  # the drafter's top p
    n, t, rounds = len(match), 0, []
    while t < n:
        accepted, stopped = 0, False
        while accepted < K and t + accepted < n - 1 and match[t + accepted]:
            accepted += 1
            if confidence[t + accepted - 1] < stop_below:  # the draft ended with this token
                stopped = True
                break
        if rejected is not None:
            proposed_wrong = not stopped and accepted < K and t + accepted < n - 1
            rejected.append(int(guesses[t + accepted]) if proposed_wrong else None)
        rounds.append((t, accepted))
        t += accepted + 1  # the accepted tokens and the target's own next token
    return rounds


@torch.no_grad()
def off_path_rows(target, item: dict, rounds: list[tuple[int, int]], rejected: list) -> dict[int, tuple]:
    """The target's top-K p after each round's rejected draft token: {round index: (ids, p)}.
    One forward over prompt + answer, then every rejected token at once, each attending only to
    the prefix its round drafted from (a padding mask over the shared cache, explicit positions)."""
    which = [i for i, w in enumerate(rejected) if w is not None]
    if not which:
        return {}
    full = item["prompt"] + item["output"]
    out = target(torch.tensor([full]), use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(len(which))
    starts = [len(item["prompt"]) + rounds[i][0] + rounds[i][1] for i in which]  # where each rejected token sits
    mask = torch.zeros(len(which), len(full) + 1, dtype=torch.long)
    for b, s in enumerate(starts):
        mask[b, :s] = 1
        mask[b, -1] = 1
    logits = target(torch.tensor([[rejected[i]] for i in which]), past_key_values=cache, attention_mask=mask,
                    position_ids=torch.tensor([[s] for s in starts]), use_cache=True).logits[:, -1].float()
    top = logits.softmax(-1).topk(TOP_K, -1)
    return {i: (top.indices[b], top.values[b]) for b, i in enumerate(which)}


def record(context: list[int], draft: list[int], ids: torch.Tensor, probs: torch.Tensor,
           context_tail: int = CONTEXT_TAIL, accepted: int | None = None, session: str = "s") -> SimpleNamespace:
    """What make_batch reads of a FeedbackRecord: rows j = 0..len(draft) are p after context + draft[:j]
    (``accepted`` None: every draft token is on the target's path)."""
    return SimpleNamespace(context=tuple(context[-context_tail:]), draft=tuple(draft), position=len(context),
                           tenant="replay", session=session,
                           accepted=len(draft) if accepted is None else accepted,
                           target_ids=tuple(map(tuple, ids.tolist())), target_probs=tuple(map(tuple, probs.tolist())))


def round_records(item: dict, rounds: list[tuple[int, int]], rejected: list[int | None] | None,
                  off_path: dict[int, tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace,
                  counted: int, session: str) -> tuple[list[SimpleNamespace], int]:
    """The feedback records of one prompt's verified rounds (--records decides what each holds),
    less the held-out ones: one round in HOLDOUT_EVERY, counted over the whole stream from
    ``counted``. Returns (records, the new count)."""
    full, n = item["prompt"] + item["output"], len(item["output"])
    records = []
    for r, (t, accepted) in enumerate(rounds):  # one record per verified round
        counted += 1
        if r in off_path:  # as served: the accepted tokens, the rejected one, and p after each
            ids, p = off_path[r]
            draft = [*item["output"][t:t + accepted], rejected[r]]
            rows = (torch.cat([item["top_ids"][t:t + accepted + 1], ids[None]]),
                    torch.cat([item["top_p"][t:t + accepted + 1], p[None]]))
        else:
            # path: k tokens from each round start; drafted: the accepted ones and the target's
            # next; served: the accepted ones (a draft that ended unrejected), p after each and the bonus
            width = min({"path": K, "drafted": accepted + 1, "served": accepted}[args.records], n - t - 1)
            if width <= 0:
                continue
            draft, accepted = item["output"][t:t + width], width
            rows = item["top_ids"][t:t + width + 1], item["top_p"][t:t + width + 1]
        if counted % HOLDOUT_EVERY:
            records.append(record(full[: len(item["prompt"]) + t], draft, *rows, args.context_tail, accepted,
                                  session=session))
    return records, counted


def prefill_records(item: dict) -> list[SimpleNamespace]:
    """--prefill: the target's p on the prompt itself, as records of 32 positions each."""
    prompt, records = item["prompt"], []
    for s in range(1, len(prompt) - 1, 32):
        e = min(s + 32, len(prompt) - 1)
        records.append(record(prompt[:s], prompt[s:e], item["prompt_top_ids"][s - 1:e], item["prompt_top_p"][s - 1:e]))
    return records


def run(args: argparse.Namespace) -> None:
    from specpool.learning.ensemble import ZooEnsembleLM
    from specpool.learning.online import OnlineConfig, OnlineDrafterLearner
    from specpool.drafters.zoo import load_zoo_model, zoo_folder
    from specpool.services.config import settings_from_env
    from specpool.target.models import DEFAULT_TARGET

    torch.manual_seed(0)
    stream = torch.load(args.stream, weights_only=False)
    base, _ = load_zoo_model(zoo_folder(args.drafter), settings_from_env().home, args.target or DEFAULT_TARGET)
    learner = None if args.frozen else OnlineDrafterLearner(base, OnlineConfig(**json.loads(args.config)))
    target = None
    if args.records == "served":
        from specpool.target.models import ModelConfig, load_causal_lm
        target, _ = load_causal_lm(ModelConfig(args.target or DEFAULT_TARGET, "cpu", "float32"), settings_from_env().home)
    started, counted, per_prompt, learn_s = time.time(), 0, [], 0.0
    history = []  # every record trained on so far (--rehearse)
    served, unpublished = None, 0  # --publish-every: the version drafting, records trained since it
    for item in stream:
        if learner is None:
            model = base
        elif len(learner.members) == 1:
            model = learner.members[0]
        else:
            model = ZooEnsembleLM(learner.members, learner.served_weights())
        if args.publish_every and learner is not None:  # draft with the last published copy, as served
            if served is None or unpublished >= args.publish_every:
                served, unpublished = copy.deepcopy(model), 0
            model = served
        rejected = [] if args.records == "served" else None
        rounds = simulate(model.eval(), item, args.confidence, rejected)
        per_prompt.append((len(item["output"]), len(rounds)))
        if learner is None:
            continue
        off_path = off_path_rows(target, item, rounds, rejected) if rejected is not None else {}
        records, counted = round_records(item, rounds, rejected, off_path, args, counted, session=str(len(per_prompt)))
        if args.prefill:
            records.extend(prefill_records(item))
        learn_started = time.perf_counter()
        for _ in range(args.epochs):
            for s in range(0, len(records), args.batch_records):
                learner.step(learner.batch(records[s:s + args.batch_records]))
        if args.rehearse and history:  # extra steps on records of earlier prompts, drawn at random
            for _ in range(round(args.rehearse * len(records) / args.batch_records)):
                picks = torch.randint(len(history), (args.batch_records,)).tolist()
                learner.step(learner.batch([history[i] for i in picks]))
        history.extend(records)
        unpublished += len(records)
        learn_s += time.perf_counter() - learn_started
    third = len(per_prompt) // 3

    def mean_accepted_length(rows):
        return round(sum(r[0] for r in rows) / max(sum(r[1] for r in rows), 1), 4)

    print(json.dumps({"drafter": args.drafter, "config": "frozen" if args.frozen else args.config,
                      "prefill": args.prefill, "epochs": args.epochs, "rehearse": args.rehearse,
                      "first_third": mean_accepted_length(per_prompt[:third]),
                      "last_third": mean_accepted_length(per_prompt[-third:]),
                      "all": mean_accepted_length(per_prompt), "seconds": round(time.time() - started),
                      "learn_s_per_prompt": round(learn_s / len(per_prompt), 3), "context_tail": args.context_tail,
                      "confidence": args.confidence, "records": args.records,
                      "publish_every": args.publish_every, "batch_records": args.batch_records}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="target answers and top-K p of the stream")
    b.add_argument("--corpus", default="../shared/data/prose/gutenberg")
    b.add_argument("--limit", type=int, default=150)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--batch", type=int, default=8, help="prompts per batched greedy generate")
    b.add_argument("--target", default=None)
    b.add_argument("--out", required=True)
    r = commands.add_parser("run", help="replay the stream with one configuration")
    r.add_argument("stream")
    r.add_argument("--drafter", default="chat", help="shipped zoo drafter (default chat)")
    r.add_argument("--config", default="{}", help='OnlineConfig fields as JSON, e.g. {"algorithm": "hedge"}')
    r.add_argument("--frozen", action="store_true", help="no learning (the baseline)")
    r.add_argument("--prefill", action="store_true", help="also learn from the target's p on the prompt tokens")
    r.add_argument("--epochs", type=int, default=1, help="passes over each prompt's records")
    r.add_argument("--batch-records", type=int, default=4)
    r.add_argument("--rehearse", type=float, default=0.0,
                   help="after each prompt, this many times its record count again, drawn from earlier prompts' records")
    r.add_argument("--publish-every", type=int, default=0,
                   help="draft with a copy published after this many trained records (0: after every prompt)")
    r.add_argument("--context-tail", type=int, default=CONTEXT_TAIL, help="context tokens a record keeps")
    r.add_argument("--target", default=None)
    r.add_argument("--confidence", type=float, default=0.0,
                   help="simulate the drafter's confidence stop at this top p (the zoo drafters': 0.4; default 0 = none)")
    r.add_argument("--records", choices=("path", "drafted", "served"), default="path",
                   help="path: k target-path tokens per record (default); drafted: the accepted tokens and the "
                        "next; served: as a served round's record, the accepted tokens and the rejected one, with "
                        "the target's p after each (computed with the target)")
    args = parser.parse_args(argv)
    build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    main()
