"""Padded verification forwards: the CPU's forward widths (``specpool.target.verifier.CPU_FORWARD_WIDTHS``)
against no padding, round by round on the real default target.

    python -m bench.verify_width --out bench-results/verify-width

Why: on a CPU, float32 matmuls at 2-3 rows (and 6-7) cost more than at 4 (and 8), so a round
that verifies 1-2 drafts is cheaper padded to 4 positions. This measures it where it matters, in
``TargetVerifier.verify``: for every draft count d = 0..7 (forward width d + 1), system P (the
default widths) and system U (``forward_widths=()``, no padding) verify the same request, the
first draft wrong so both roll back to the same cache, alternating P U / U P per repetition
(docs/ARCHITECTURE.md, "Measuring") and cycling over one prompt per category. Each repetition also checks
that both return the same accepted count and tokens.

Writes results.json and report.md to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from bench.common import default_out, load_questions, machine_info, summary, write_results
from specpool.services.config import settings_from_env
from specpool.services.engine import EmbeddedEngine
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, VerifyRequest, forward_width

MAX_DRAFTS = 7  # forward widths 1..8


def summarize(times_p: list[float], times_u: list[float]) -> dict:
    """One row: each system's seconds and the per-repetition ratio P / U (below 1: padding wins)."""
    ratios = [p / u for p, u in zip(times_p, times_u)]
    return {"padded_s": summary(times_p), "unpadded_s": summary(times_u), "ratio": summary(ratios)}


def render(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Padded verification forwards",
        "",
        f"`TargetVerifier.verify` with the CPU forward widths {tuple(results['widths'])} (P) vs no padding (U), "
        f"greedy, the first draft wrong (both roll back to the same cache), alternating P U / U P, "
        f"{results['reps']} repetitions per row (+1 warm-up), cycling over {results['prompts']} prompts "
        f"({results['context_tokens'][0]}-{results['context_tokens'][1]} context tokens). "
        "Ratio = P / U wall time per repetition, median [p25, p75]; below 1 = padding is faster.",
        "",
        f"Target: {results['target']}, float32; machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}.",
        "",
        "| drafts | positions fed (U) | padded to (P) | P ms | U ms | ratio P/U |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        p, u, r = row["padded_s"], row["unpadded_s"], row["ratio"]
        lines.append(f"| {row['drafts']} | {row['drafts'] + 1} | {row['padded_width']} | {1000 * p['median']:.1f} | "
                     f"{1000 * u['median']:.1f} | {r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}] |")
    lines += ["", f"Outcomes (accepted count and tokens) of P and U differed in {results['mismatches']} verification(s).", ""]
    return "\n".join(lines)


def alternate_verifications(verifiers: dict, contexts: list[list[int]], reps: int, desc: str,
                            draft_counts: Sequence[int] = range(MAX_DRAFTS + 1)) -> tuple[list[dict], int]:
    """Two systems (``verifiers``, by name: P and U here) verify the same requests, alternating
    their order per repetition and cycling over ``contexts``, for every draft count d in
    ``draft_counts``, the first draft wrong so both roll back to the same cache. Returns, per d,
    each system's seconds (repetition 0 is a warm-up, not recorded), and how many verifications'
    outcomes differed."""
    params = SamplingParams(max_new_tokens=64)
    a, b = verifiers
    vocab = int(verifiers[a].vocab_size)
    first = {}  # each session's first token, so that its first draft can be made wrong; warms caches
    for i, context in enumerate(contexts):
        for verifier in verifiers.values():
            first[i] = verifier.verify(VerifyRequest(f"p{i}", context, [], [], params)).tokens[0]
    per_draft_count, mismatches = [], 0
    progress = tqdm(total=len(draft_counts) * (reps + 1), desc=desc, unit="rep")
    for drafts_n in draft_counts:
        times = {a: [], b: []}
        for rep in range(reps + 1):
            i = rep % len(contexts)
            drafts = [(first[i] + 1 + j) % vocab for j in range(drafts_n)]
            request = VerifyRequest(f"p{i}", contexts[i], drafts, [SparseDist.one_hot(t) for t in drafts], params)
            got = {}
            for system in ((a, b) if rep % 2 == 0 else (b, a)):
                started = time.perf_counter()
                got[system] = verifiers[system].verify(request)
                if rep:
                    times[system].append(time.perf_counter() - started)
            mismatches += (got[a].accepted, got[a].tokens) != (got[b].accepted, got[b].tokens)
            progress.update(1)
        per_draft_count.append(times)
    progress.close()
    return per_draft_count, mismatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_width", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="../shared/data/prompts/dev.jsonl", help="Spec-Bench question file")
    parser.add_argument("--reps", type=int, default=30, help="repetitions per draft count (default 30)")
    parser.add_argument("--out", default=default_out("verify-width"), help=f"output folder (default ./{default_out('verify-width')})")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    engine = EmbeddedEngine.default(settings_from_env().home)
    questions = load_questions(Path(args.prompts), 1)
    contexts = [engine.encode_prompt(q.prompt) for q in questions]
    padded = TargetVerifier(engine.model, engine.tokenizer)
    unpadded = TargetVerifier(engine.model, engine.tokenizer, forward_widths=())
    per_draft_count, mismatches = alternate_verifications({"P": padded, "U": unpadded}, contexts, args.reps, "verify widths")
    rows = []
    for drafts_n, times in enumerate(per_draft_count):
        rows.append({"drafts": drafts_n, "padded_width": forward_width(drafts_n + 1, padded.forward_widths),
                     **summarize(times["P"], times["U"]), "padded_s_all": times["P"], "unpadded_s_all": times["U"]})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": "python -m bench.verify_width " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": "smollm2-135m-instruct", "machine": machine_info("cpu"), "widths": list(padded.forward_widths),
        "reps": args.reps, "prompts": len(contexts),
        "context_tokens": [min(map(len, contexts)), max(map(len, contexts))],
        "rows": rows, "mismatches": mismatches,
    }
    write_results(out, results)
    (out / "report.md").write_text(render(results))
    for row in rows:
        r = row["ratio"]
        print(f"drafts {row['drafts']}: {row['drafts'] + 1} -> {row['padded_width']} positions, "
              f"P/U {r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}]")
    print(f"mismatches {mismatches}; wrote {out / 'results.json'}, {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
