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

Then the target's whole work under load, as the served target does it
(``HostingVerifier.verify_batch``: draft, one batched verify forward, features to the hosted heads):
``--stream-prompts`` prompts go through as many session slots as the largest ``--sessions``, a slot
taking the next prompt once its answer is done, with the default served arm,
``lookup:eagle:general``, hosted. Four systems, each with its own target caches and drafters, take
turns batch by batch: drafting one session after another, batched, batched behind the load gate
(``LoadGate``: a batch drafts only where drafting has measured faster than not, at its size), and
the target alone. Each is timed while all its slots are busy. This is the served target's work without
Ray, gRPC and the router, whose timings vary from run to run more than these differences.

Writes results.json and report.md to --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import default_out, load_prompts, machine_info, summary, write_results
from specpool.core.defaults import DEFAULT_TARGET
from specpool.drafters.base import DraftRequest
from specpool.drafters.eagle import EagleDrafter, head_folder, load_eagle_head
from specpool.drafters.registry import DrafterContext, create_drafter
from specpool.router.hosted import HostedDraft, HostingVerifier, LoadGate
from specpool.services.config import settings_from_env
from specpool.services.engine import EmbeddedEngine
from specpool.target.features import Features
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest

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


class OneAfterAnother:
    """A drafter without ``propose_batch``: the host then drafts its sessions one after another."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.tokenizer_fingerprint, self.cost = inner.name, inner.tokenizer_fingerprint, inner.cost
        self.feature_width = inner.feature_width

    def propose(self, session_id, context_ids, k, params):
        return self.inner.propose(session_id, context_ids, k, params)

    def observe_features(self, session_id, features):
        self.inner.observe_features(session_id, features)

    def release(self, session_id):
        self.inner.release(session_id)


STREAM_SYSTEMS = {  # name -> (batched drafting, load gate, drafts at all)
    "drafting one session after another": (False, False, True),
    "drafting batched": (True, False, True),
    "drafting batched, load gate": (True, True, True),
    "target only": (False, False, False),
}


def run_stream(engine, texts: list[str], slots: int, new_tokens: int, progress: tqdm) -> dict:
    """Every system answers ``texts`` with ``slots`` sessions busy at once, a session taking the next
    prompt as soon as its answer is done; timed while every slot is busy (until the prompts run
    out), so each batch is full, as on a loaded server."""
    arm = "lookup:eagle:general"
    context = DrafterContext(settings_from_env().home, DEFAULT_TARGET)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    prompts = [engine.encode_prompt(text) for text in texts]
    systems = {}
    for name, (batched, gate, drafting) in STREAM_SYSTEMS.items():
        drafter = create_drafter(arm, context)
        verifier = TargetVerifier(engine.model, engine.tokenizer)
        host = HostingVerifier(verifier, {arm: drafter if batched else OneAfterAnother(drafter)},
                               LoadGate() if gate else None)
        systems[name] = {"host": host, "drafting": drafting, "next": 0, "slots": [None] * slots, "seconds": 0.0,
                         "tokens": 0, "batches": 0, "answers": {}, "timing": True}
    while any(state["timing"] for state in systems.values()):
        for name, state in systems.items():
            if not state["timing"]:
                continue
            for j, slot in enumerate(state["slots"]):
                if slot is None:
                    if state["next"] == len(prompts):
                        state["timing"] = False  # the prompts ran out: batches would no longer be full
                        break
                    state["slots"][j] = (state["next"], [])
                    state["next"] += 1
            if not state["timing"]:
                continue
            items = [(VerifyRequest(f"{name}/{i}", prompts[i] + done, [], [], params),
                      HostedDraft(arm if done and state["drafting"] else None, min(K, new_tokens - len(done) - 1),
                                  False, (arm,)))
                     for i, done in state["slots"]]
            started = time.perf_counter()
            out = state["host"].verify_batch(items)
            state["seconds"] += time.perf_counter() - started
            state["batches"] += 1
            for j, ((i, done), outcome) in enumerate(zip(state["slots"], out)):
                if isinstance(outcome, BaseException):
                    raise outcome
                emitted = outcome[1].tokens[: new_tokens - len(done)]
                done += emitted
                state["tokens"] += len(emitted)
                if len(done) == new_tokens:
                    state["answers"][i] = list(done)
                    state["host"].release(f"{name}/{i}")
                    state["slots"][j] = None
            progress.update(1)
    reference = systems["target only"]["answers"]
    for name, state in systems.items():
        for i, answer in state["answers"].items():
            if i in reference and answer != reference[i]:
                raise RuntimeError(f"{name} answered prompt {i} with other tokens than the target alone")
    return {
        "slots": slots, "new_tokens": new_tokens, "prompts": len(texts),
        "systems": {name: {"batches": s["batches"], "seconds": s["seconds"], "tokens": s["tokens"],
                           "answers": len(s["answers"]), "tokens_per_s": s["tokens"] / s["seconds"],
                           "draft_failures": s["host"].draft_failures,
                           "plain_batches": s["host"].gate.plain_batches if s["host"].gate else None,
                           "gate_rates": s["host"].gate.rates() if s["host"].gate else None} for name, s in systems.items()},
    }


def pick(by_category: dict[str, list[str]], n: int) -> list[str]:
    """n prompts, one per category in turn (categories in name order), cycling if n exceeds them all."""
    categories = sorted(by_category)
    ordered = [by_category[c][i] for i in range(max(map(len, by_category.values())))
               for c in categories if i < len(by_category[c])]
    return [ordered[i % len(ordered)] for i in range(n)]


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
    stream = results.get("stream")
    if stream:
        lines += [
            "", f"## The target's whole work under load: {stream['slots']} sessions always busy, `lookup:eagle:general` hosted", "",
            f"{stream['prompts']} prompts, {stream['new_tokens']} new tokens each (greedy, k = {K}), through {stream['slots']} "
            "session slots: a slot takes the next prompt the moment its answer is done, and each system (its own "
            "target caches and drafters) is timed while all its slots are busy, so every batch is full, as on a "
            "loaded server. Each batch is the served target's work (draft, one batched verify, features to the "
            "hosted heads, new prompts' prefills); the systems take turns batch by batch. Every answer equals "
            "the target-only one.", "",
            "| system | verify batches | of them without drafts | tokens | tokens/s | × target only |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        plain = stream["systems"]["target only"]["tokens_per_s"]
        for name, row in stream["systems"].items():
            plain_batches = row["plain_batches"] if row["plain_batches"] is not None else ("all" if name == "target only" else 0)
            lines.append(f"| {name} | {row['batches']} | {plain_batches} | {row['tokens']} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / plain:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hosted_drafting", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help=f"Spec-Bench questions (default {PROMPTS})")
    parser.add_argument("--head", default="general", help="shipped head or head folder (default general)")
    parser.add_argument("--sessions", default="2,4,8", help="batch sizes (default 2,4,8)")
    parser.add_argument("--rounds", type=int, default=16, help="rounds per batch size, the first untimed (default 16)")
    parser.add_argument("--stream-prompts", type=int, default=48,
                        help="prompts answered under load, through the largest --sessions slots (default 48; 0 skips it)")
    parser.add_argument("--stream-tokens", type=int, default=64, help="new tokens per answer under load (default 64)")
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
    texts = pick(by_category, max(sizes))
    seqs = sequences(engine, texts, 4 + 3 * args.rounds)
    rows = []
    with tqdm(total=len(sizes) * args.rounds, desc="rounds", unit="round") as progress:
        for size in sizes:
            row = run_batch(head, metadata, seqs[:size], args.rounds, progress)
            rows.append(row)
    stream = None
    if args.stream_prompts > 0:
        with tqdm(desc="batches under load (all systems)", unit="batch") as progress:
            stream = run_stream(engine, pick(by_category, args.stream_prompts), max(sizes), args.stream_tokens, progress)
    results = {"machine": machine_info("cpu"), "target": DEFAULT_TARGET, "head": args.head, "rounds": args.rounds,
               "stream": stream,
               "command": "python -m bench.hosted_drafting " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
               "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, results)
    (out / "report.md").write_text(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
