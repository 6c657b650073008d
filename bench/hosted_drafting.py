"""A hosted head drafting for a verify batch's sessions: one session after another (``propose``) vs
all at once (``propose_batch``), on the real default target and a shipped head.

    python -m bench.hosted_drafting --out bench-results/hosted-drafting

Why: the target deployment hosts the white-box heads (specpool/router/hosted.py) and drafts for
every session of a verify batch before the batch's one verify forward, on the same model thread.
One session after another, each draft step is a head forward of one row; the head's forward costs
about as much for eight rows as for one, so a batch of 8 sessions pays ~8 forwards per step where
one would do.

For B sessions (prompts of ``--prompts``, one per category in turn), each session's sequence is
its chat prompt and the target's greedy answer; round r drafts after the prompt plus 4 + 3r answer
tokens (so each round catches up on 3 positions, as a round that accepts 2 drafts does), the
head having the target's features up to there. System A (``propose`` per session) and system B
(``propose_batch``) have their own drafters over one head in the same logical state and alternate
A B / B A from round to round (docs/ARCHITECTURE.md, "Measuring"); every round checks that both
drafted the same tokens. k = 5, greedy, the head's confidence stop as served.

Writes results.json and report.md to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import default_out, load_prompts, machine_info, summary
from specpool.core.defaults import DEFAULT_TARGET
from specpool.drafters.base import DraftRequest
from specpool.drafters.eagle import EagleDrafter, head_folder, load_eagle_head
from specpool.services.config import settings_from_env
from specpool.services.engine import EmbeddedEngine
from specpool.target.features import Features
from specpool.target.sampling import SamplingParams

K = 5
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
PROMPTS = Path("../shared/data/prompts/dev.jsonl")


@torch.inference_mode()
def sequences(engine, texts: list[str], answer_tokens: int) -> list[tuple[list[int], torch.Tensor, int]]:
    """Per text: prompt + the target's greedy answer, its features (L, d) and the prompt's length."""
    out = []
    for text in texts:
        prompt = engine.encode_prompt(text)
        ids = list(prompt)
        for _ in range(answer_tokens):  # plain greedy, no cache: a benchmark's set-up, not its timing
            ids.append(int(engine.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        hidden = engine.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        out.append((ids, hidden.float(), len(prompt)))
    return out


def run_batch(head, metadata, seqs, rounds: int, progress: tqdm) -> dict:
    one, many = EagleDrafter("serial", head, metadata), EagleDrafter("batched", head, metadata)
    told = [0] * len(seqs)  # features handed over so far, per session
    times: dict[str, list[float]] = {"serial": [], "batched": []}
    tokens = {"serial": 0, "batched": 0}
    identical = 0
    for r in range(rounds):
        asks = []
        for s, (ids, hidden, prompt) in enumerate(seqs):
            n = prompt + 4 + 3 * r
            for drafter in (one, many):
                drafter.observe_features(f"s{s}", Features(told[s], hidden[told[s]:n - 1]))
            told[s] = n - 1
            asks.append(DraftRequest(f"s{s}", ids[:n], K, GREEDY))
        out = {}
        for system in (("serial", "batched") if r % 2 == 0 else ("batched", "serial")):
            started = time.perf_counter()
            if system == "serial":
                out[system] = [one.propose(a.session_id, a.context_ids, a.k, a.params) for a in asks]
            else:
                out[system] = many.propose_batch(asks)
            if r > 0:  # the first round catches up on whole prompts: a warm-up, not a round
                times[system].append((time.perf_counter() - started) * 1e3)
                tokens[system] += sum(len(p.tokens) for p in out[system])
        identical += all(a.tokens == b.tokens for a, b in zip(out["serial"], out["batched"]))
        progress.update(1)
    return {
        "sessions": len(seqs), "rounds": rounds, "timed_rounds": rounds - 1,
        "ms_per_batch": {system: summary(values) for system, values in times.items()},
        "ratio_serial_over_batched": summary([a / b for a, b in zip(times["serial"], times["batched"])]),
        "draft_tokens": tokens, "rounds_with_identical_drafts": identical,
    }


def report(results: dict) -> str:
    lines = [
        "# A hosted head drafting for a verify batch: one session after another vs batched", "",
        f"- machine: {results['machine']['cpu']} ({results['machine'].get('cores')} cores), torch {results['machine']['torch']}",
        f"- target `{results['target']}`, head `{results['head']}`, k = {K}, greedy, confidence stop as served; "
        f"{results['rounds']} rounds per batch size, the first (catching up on whole prompts) untimed, A B / B A alternating",
        f"- command: `{results['command']}`", "",
        "Medians over the timed rounds, [p25, p75] in brackets; draft tokens over the timed rounds; identical drafts over all rounds. *serial*: `propose` for each session; *batched*: one "
        "`propose_batch`; *× faster*: the per-round ratio serial / batched.", "",
        "| sessions | serial ms per batch | batched ms per batch | × faster | draft tokens serial / batched | rounds with identical drafts |",
        "|---:|---|---|---|---|---|",
    ]
    fmt = lambda s: f"{s['median']:.1f} [{s['p25']:.1f}, {s['p75']:.1f}]"  # noqa: E731
    for row in results["rows"]:
        t = row["ms_per_batch"]
        r = row["ratio_serial_over_batched"]
        lines.append(f"| {row['sessions']} | {fmt(t['serial'])} | {fmt(t['batched'])} | "
                     f"{r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}] | {row['draft_tokens']['serial']} / "
                     f"{row['draft_tokens']['batched']} | {row['rounds_with_identical_drafts']} of {row['rounds']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hosted_drafting", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help=f"Spec-Bench questions (default {PROMPTS})")
    parser.add_argument("--head", default="general", help="shipped head or head folder (default general)")
    parser.add_argument("--sessions", default="2,4,8", help="batch sizes (default 2,4,8)")
    parser.add_argument("--rounds", type=int, default=16, help="rounds per batch size, the first untimed (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--out", default=default_out("hosted-drafting"), help=f"output folder (default ./{default_out('hosted-drafting')})")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first is a warm-up)")
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sessions.split(",")]
    home = settings_from_env().home
    engine = EmbeddedEngine.default(home)
    head, metadata = load_eagle_head(head_folder(args.head), home, DEFAULT_TARGET)
    questions = load_prompts(args.prompts)
    by_category: dict[str, list[str]] = {}
    for category, text in questions:
        by_category.setdefault(category, []).append(text)
    categories = sorted(by_category)
    texts = [by_category[categories[i % len(categories)]][i // len(categories)] for i in range(max(sizes))]
    seqs = sequences(engine, texts, 4 + 3 * args.rounds)
    rows = []
    with tqdm(total=len(sizes) * args.rounds, desc="rounds", unit="round") as progress:
        for size in sizes:
            row = run_batch(head, metadata, seqs[:size], args.rounds, progress)
            rows.append(row)
    results = {"machine": machine_info("cpu"), "target": DEFAULT_TARGET, "head": args.head, "rounds": args.rounds,
               "command": "python -m bench.hosted_drafting " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
               "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
