"""Batched verification across sessions: one ``verify_batch`` call vs the same requests through
``verify`` one by one, on the real default target.

    python -m bench.verify_batch --out bench-results/verify-batch

For batch sizes 1, 2, 4, 8 (k = 5, greedy), B sessions each send one round's verification
(their context + 5 drafts, the first 3 of them the target's own greedy tokens, so 3 are accepted
and the rollback runs). System A verifies them with one ``verify_batch`` call; system B calls
``verify`` for each. A and B have their own verifiers (own caches, same model object) kept in the
same logical state, and alternate A B / B A from repetition to repetition (docs/ARCHITECTURE.md,
"Measuring"). Every repetition also checks that A and B return the same accepted counts and
tokens; at the end the raw logits of both paths are compared. Two context settings: the chat
prompt as is (short), and a long user turn of several questions (hundreds of tokens, different
per session), where attention over the caches weighs more (and where the padded batch this
replaced copied every cache out to the longest one: bench/results/ragged-batch).

Writes results.json, report.md and ratio.png to --out.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import default_out, load_prompts, machine_info, summary, write_results
from specpool.services.config import settings_from_env
from specpool.services.engine import EmbeddedEngine
from specpool.target.kv_cache import batched_logits
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest, VerifyResult

BATCH_SIZES = (1, 2, 4, 8)
K = 5
ACCEPTED = 3  # drafts = 3 greedy tokens + 2 that are (almost surely) rejected
PROMPTS = Path("../shared/data/prompts/dev.jsonl")


def pick_texts(questions: list[tuple[str, str]], n: int, long: bool) -> list[str]:
    """n prompts, one per category in turn; ``long`` appends 4 + 3i other questions to prompt i's
    user turn, so the sessions' contexts differ in length by hundreds of tokens."""
    by_category: dict[str, list[str]] = {}
    for category, text in questions:
        by_category.setdefault(category, []).append(text)
    categories = sorted(by_category)
    texts = [by_category[categories[i % len(categories)]][i // len(categories)] for i in range(n)]
    if not long:
        return texts
    pool = [text for _, text in questions]
    return [" ".join([texts[i]] + pool[30 * i : 30 * i + 4 + 3 * i]) for i in range(n)]


def build_requests(engine, verifier: TargetVerifier, texts: list[str], tag: str) -> list[VerifyRequest]:
    """One request per session: context = chat prompt; drafts = 3 greedy tokens of the target
    (found with verify(), k = 0, which also warms ``verifier``'s cache) + 2 altered ones."""
    params = SamplingParams(max_new_tokens=64)
    requests = []
    vocab = int(engine.model.config.vocab_size)
    for i, text in enumerate(texts):
        session = f"{tag}{i}"
        context = engine.encode_prompt(text)
        greedy: list[int] = []
        for _ in range(ACCEPTED + 1):
            greedy += verifier.verify(VerifyRequest(session, context + greedy, [], [], params)).tokens
        drafts = greedy[:ACCEPTED] + [(greedy[ACCEPTED] + 1) % vocab, (greedy[ACCEPTED] + 2) % vocab]
        requests.append(VerifyRequest(session, context, drafts, [SparseDist.one_hot(t) for t in drafts], params))
    return requests


def same(a: VerifyResult, b: VerifyResult) -> bool:
    return a.accepted == b.accepted and a.tokens == b.tokens


def run_setting(engine, name: str, texts: list[str], reps: int, progress: tqdm, on_row=lambda setting: None) -> dict:
    batched = TargetVerifier(engine.model, engine.tokenizer)  # system A
    sequential = TargetVerifier(engine.model, engine.tokenizer)  # system B
    requests = build_requests(engine, sequential, texts, name)
    # Bring A's caches to B's state: the same round once, untimed (A's first batch is a prefill).
    batched.verify_batch(requests)
    for r in requests:
        sequential.verify(r)
    setting = {"setting": name, "context_tokens": [len(r.context_ids) for r in requests], "rows": [], "result_mismatches": 0}
    rows = setting["rows"]
    for size in BATCH_SIZES:
        batch = requests[:size]
        times_a, times_b = [], []
        for rep in range(reps + 1):  # repetition 0 is a warm-up, not recorded
            order = "AB" if rep % 2 == 0 else "BA"
            for system in order:
                started = time.perf_counter()
                if system == "A":
                    got_a = batched.verify_batch(batch)
                    elapsed_a = time.perf_counter() - started
                else:
                    got_b = [sequential.verify(r) for r in batch]
                    elapsed_b = time.perf_counter() - started
            setting["result_mismatches"] += sum(not (isinstance(a, VerifyResult) and same(a, b)) for a, b in zip(got_a, got_b))
            if rep:
                times_a.append(elapsed_a)
                times_b.append(elapsed_b)
            progress.update(1)
        ratios = [a / b for a, b in zip(times_a, times_b)]
        rows.append({
            "batch_size": size,
            "new_tokens": size * (K + 1),
            "batched_s": summary(times_a),
            "sequential_s": summary(times_b),
            "ratio": summary(ratios),  # batched / sequential wall time, per repetition
            "speedup": summary([1.0 / r for r in ratios]),
            "batched_s_all": times_a,
            "sequential_s_all": times_b,
        })
        on_row(setting)
    # Raw logits of both paths over the same caches (both hold context + accepted now).
    inputs = [r.context_ids + r.draft_tokens for r in requests]
    with torch.inference_mode():
        got = batched_logits([batched.caches.get(r.session_id) for r in requests], inputs, [K + 1] * len(requests))
        want = [sequential.caches.get(r.session_id).logits(ids, K + 1) for r, ids in zip(requests, inputs)]
    max_abs = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
    argmax_equal = all(bool((g.argmax(-1) == w.argmax(-1)).all()) for g, w in zip(got, want))
    setting["max_abs_logit_diff_batch8"] = max_abs
    setting["argmax_equal_batch8"] = argmax_equal
    return setting


def fmt_load(load) -> str:
    return "n/a" if load is None else "/".join(f"{x:.1f}" for x in load)


def render(results: dict) -> str:
    lines = [
        "# Batched verification across sessions",
        "",
        f"One `verify_batch` call (A) vs the same requests through `verify` one by one (B), greedy, k = {K}, "
        f"alternating A B / B A, {results['reps']} repetitions per row (+1 warm-up). "
        "Ratio = A wall time / B wall time per repetition: median [p25, p75]; below 1 = batching is faster. "
        "The last column compares each system's fastest repetition, the least disturbed by other jobs.",
        "",
        f"Target: {results['target']}; machine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
        f"torch {results['machine']['torch']} ({results['machine']['torch_threads']} threads), "
        f"transformers {results['machine']['transformers']}, float32, device {results['machine']['device']}. "
        f"Load average (1, 5, 15 min) at start {fmt_load(results['load_average_start'])}, at end "
        f"{fmt_load(results.get('load_average_end'))}: other jobs shared the machine when above ~0.5.",
        "",
    ]
    for setting in results["settings"]:
        lines += [
            f"## {setting['setting']} contexts ({min(setting['context_tokens'])}-{max(setting['context_tokens'])} tokens)",
            "",
            "| sessions | new tokens | batched (s) | sequential (s) | ratio A/B | speed-up B/A | fastest A / fastest B |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in setting["rows"]:
            a, b, r, s = row["batched_s"], row["sequential_s"], row["ratio"], row["speedup"]
            best = min(row["batched_s_all"]) / min(row["sequential_s_all"])
            lines.append(
                f"| {row['batch_size']} | {row['new_tokens']} | {a['median']:.3f} | {b['median']:.3f} | "
                f"{r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}] | {s['median']:.2f} [{s['p25']:.2f}, {s['p75']:.2f}] | "
                f"{best:.2f} ({min(row['batched_s_all']):.3f} / {min(row['sequential_s_all']):.3f} s) |"
            )
        lines += [
            "",
            f"Results of A and B differed in {setting['result_mismatches']} request(s). Raw logits of the "
            f"batch of 8 vs per-session forwards: max |diff| = {setting['max_abs_logit_diff_batch8']:.2e}, "
            f"argmax equal everywhere: {setting['argmax_equal_batch8']}.",
            "",
        ]
    lines += ["![ratio](ratio.png)", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for setting in results["settings"]:
        sizes = [row["batch_size"] for row in setting["rows"]]
        med = [row["speedup"]["median"] for row in setting["rows"]]
        lo = [m - row["speedup"]["p25"] for m, row in zip(med, setting["rows"])]
        hi = [row["speedup"]["p75"] - m for m, row in zip(med, setting["rows"])]
        ax.errorbar(sizes, med, yerr=[lo, hi], marker="o", capsize=3, label=f"{setting['setting']} contexts")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(BATCH_SIZES), [str(b) for b in BATCH_SIZES])
    ax.set_xlabel("sessions in the batch")
    ax.set_ylabel("speed-up of verify_batch\n(sequential / batched time)")
    ax.set_title(f"Batched verification, k = {K}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out("verify-batch"), help=f"output folder (default ./{default_out('verify-batch')})")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per batch size (default 10)")
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help="Spec-Bench style question file")
    parser.add_argument("--settings", default="short,long", help="context settings to run: short,long")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = EmbeddedEngine.default(settings_from_env().home)
    questions = load_prompts(args.prompts)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    results = {
        "target": engine.config.target.name,
        "k": K,
        "reps": args.reps,
        "machine": machine_info(str(engine.model.device)),
        "load_average_start": os.getloadavg(),  # the machine is shared: other jobs show up here
        "settings": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save_partial(setting: dict) -> None:
        """A run cut short (shared, busy machine) still leaves the rows measured so far."""
        partial = dict(results, settings=results["settings"] + [setting], partial=True)
        write_results(out, partial)

    with tqdm(total=len(names) * len(BATCH_SIZES) * (args.reps + 1), desc="verify-batch", unit="rep") as progress:
        for name in names:
            texts = pick_texts(questions, max(BATCH_SIZES), long=(name == "long"))
            results["settings"].append(run_setting(engine, name, texts, args.reps, progress, save_partial))
    results["wall_s"] = time.perf_counter() - started
    results["load_average_end"] = os.getloadavg()
    write_results(out, results)
    plot(results, out / "ratio.png")
    (out / "report.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
