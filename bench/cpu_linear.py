"""Plain ``nn.Linear`` against oneDNN-packed linears (specpool/target/cpu_linear.py) on the real target.

    python -m bench.cpu_linear --out bench-results/cpu-linear

Two copies of the default target, float32 on the CPU: system P (``cpu_linear="packed"``) and
system U (``cpu_linear="plain"``). For every draft count d = 0..7, both verify the same request
through ``TargetVerifier.verify`` with its default CPU forward widths, the first draft wrong (so
both roll back to the same cache), alternating P U / U P, cycling over one prompt per category.
d = 0 is a plain decode step; each system's verify cost is reported in its own decode steps, which
is the ratio that decides whether speculation pays, and P's time against U's. Each repetition
also checks that both return the same accepted count and tokens.

Then target-only greedy decoding (``--decode-tokens`` new tokens, one token per forward) of every
prompt by both systems, alternating: tokens/s P / U per prompt, and whether the two produce the
same tokens (packing must not change what the target says).

Writes results.json and report.md to --out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from bench.common import default_out, load_questions, machine_info, summary, write_results
from bench.verify_width import MAX_DRAFTS, alternate_verifications
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.services.config import settings_from_env
from specpool.target.models import ModelConfig, chat_prompt_ids, load_causal_lm, stop_token_ids
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import TargetVerifier, forward_width

SYSTEMS = {"P": "packed", "U": "plain"}


def render_pair(results: dict, title: str, description: str, digits: int = 2) -> str:
    """The report of this benchmark and its siblings: ``description`` (what the two systems are,
    before the shared words on the method), one row per draft count with each system's time and
    its own decode steps, the mismatch count and the target-only decoding line. Ratios to
    ``digits`` decimals; a second width column where the systems pad to different widths."""
    m = results["machine"]
    rows = results["rows"]
    a, b = (key for key in rows[0] if key not in ("drafts", "width", "ratio") and not key.startswith("width_")
            and not key.endswith("_all"))
    two_widths = any(f"width_{b}" in row for row in rows)
    widths = f"forward width {a} | forward width {b}" if two_widths else "forward width"
    lines = [
        f"# {title}",
        "",
        f"{description}; greedy, the first draft wrong; alternating {a} {b} / {b} {a}, {results['reps']} repetitions "
        f"per row (+1 warm-up) over {results['prompts']} prompts ({results['context_tokens'][0]}-"
        f"{results['context_tokens'][1]} context tokens). Medians [p25, p75]. *steps* = the row's median over "
        "the same system's median decode step (drafts = 0).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
        f"transformers {m['transformers']}.",
        "",
        f"| drafts | {widths} | {a} ms | {a} steps | {b} ms | {b} steps | {a} / {b} per repetition |",
        "|---:|" + "---:|" * (7 if two_widths else 6),
    ]
    step = {s: rows[0][s]["median"] for s in (a, b)}
    for row in rows:
        x, y, r = row[a], row[b], row["ratio"]
        width = f"{row['width']} | {row.get(f'width_{b}', row['width'])}" if two_widths else f"{row['width']}"
        lines.append(f"| {row['drafts']} | {width} | {1000 * x['median']:.1f} | {x['median'] / step[a]:.2f} | "
                     f"{1000 * y['median']:.1f} | {y['median'] / step[b]:.2f} | "
                     f"{r['median']:.{digits}f} [{r['p25']:.{digits}f}, {r['p75']:.{digits}f}] |")
    lines += ["", f"Outcomes (accepted count and tokens) of {a} and {b} differed in {results['mismatches']} verification(s).", ""]
    decode = results["decode"]
    r = decode["ratio"]
    lines += [
        f"Target-only greedy decoding, {decode['tokens']} new tokens per prompt, {len(decode['rows'])} prompts: "
        f"tokens/s {a} / {b} per prompt {r['median']:.{digits}f} [{r['p25']:.{digits}f}, {r['p75']:.{digits}f}]; "
        f"outputs identical on {decode['identical']} of {len(decode['rows'])} prompts.", "",
    ]
    return "\n".join(lines)


def render(results: dict) -> str:
    return render_pair(results, "Packed vs plain linear layers on the CPU",
                       f"`TargetVerifier.verify` on two copies of {results['target']} (float32): P = oneDNN-packed linears "
                       "(`cpu_linear=packed`, the default on a CPU), U = plain `nn.Linear`; both with the verifier's default "
                       "CPU forward widths")


def target_only_decoding(verifiers: dict, contexts: list[list[int]], tokens: int) -> dict:
    """Greedy target-only decoding of each context by both systems (``verifiers``, by name: P and
    U here), alternating which goes first. Ratios are the first system's tokens/s over the second's."""
    a, b = verifiers
    stop = stop_token_ids(verifiers[a].model, verifiers[a].tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, stop_token_ids=stop)
    rows = []
    for i, context in enumerate(tqdm(contexts, desc="target-only decoding", unit="prompt")):
        got = {}
        for system in ((a, b) if i % 2 == 0 else (b, a)):
            result = speculative_generate(context, session_id=f"decode-{i}", drafters={}, chooser=FixedChooser(None),
                                          verifier=verifiers[system], params=params, k=0)
            verifiers[system].release(f"decode-{i}")
            got[system] = result
        rows.append({f"{a}_tokens_per_s": got[a].tokens_per_s, f"{b}_tokens_per_s": got[b].tokens_per_s,
                     "new_tokens": len(got[a].token_ids), "identical": got[a].token_ids == got[b].token_ids})
    ratios = [row[f"{a}_tokens_per_s"] / row[f"{b}_tokens_per_s"] for row in rows]
    return {"tokens": tokens, "rows": rows, "ratio": summary(ratios), "identical": sum(row["identical"] for row in rows)}


def parse_pair_args(prog: str, description: str, name: str, reps: int, argv: list[str] | None) -> argparse.Namespace:
    """The command line of this benchmark and its siblings: prompts, repetitions, decode tokens, --out."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--prompts", default="../shared/data/prompts/dev.jsonl", help="Spec-Bench question file")
    parser.add_argument("--reps", type=int, default=reps, help=f"repetitions per draft count (default {reps})")
    parser.add_argument("--decode-tokens", type=int, default=48, help="new tokens of the target-only decoding part (default 48)")
    parser.add_argument("--out", default=default_out(name), help=f"output folder (default ./{default_out(name)})")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    if args.decode_tokens < 1:
        parser.error(f"--decode-tokens must be >= 1, got {args.decode_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_pair_args("python -m bench.cpu_linear", __doc__.split("\n\n")[0], "cpu-linear", 20, argv)
    home = settings_from_env().home
    verifiers = {}
    for system, mode in SYSTEMS.items():
        model, tokenizer = load_causal_lm(ModelConfig(cpu_linear=mode), home)
        verifiers[system] = TargetVerifier(model, tokenizer)
    return compare_verifiers("python -m bench.cpu_linear", argv, args, verifiers, "packed vs plain", render)


def compare_verifiers(prog: str, argv: list[str] | None, args: argparse.Namespace, verifiers: dict, desc: str,
                      render: Callable[[dict], str], draft_counts: Sequence[int] = range(MAX_DRAFTS + 1)) -> int:
    """The measurement of this benchmark and of its siblings (``bench.grouped_attention``): two
    systems (``verifiers``, by name) verify the same requests per draft count, alternating, then
    decode target-only; writes results.json and ``render``'s report.md to ``args.out``."""
    a, b = verifiers
    tokenizer = verifiers[a].tokenizer
    contexts = [chat_prompt_ids(tokenizer, q.prompt) for q in load_questions(Path(args.prompts), 1)]
    per_draft_count, mismatches = alternate_verifications(verifiers, contexts, args.reps, desc, draft_counts)
    rows = []
    for drafts_n, times in zip(draft_counts, per_draft_count):
        ratios = [x / y for x, y in zip(times[a], times[b])]
        row = {"drafts": drafts_n, "width": forward_width(drafts_n + 1, verifiers[a].forward_widths)}
        if verifiers[b].forward_widths != verifiers[a].forward_widths:
            row[f"width_{b}"] = forward_width(drafts_n + 1, verifiers[b].forward_widths)
        rows.append({**row, a: summary(times[a]), b: summary(times[b]), "ratio": summary(ratios),
                     f"{a}_all": times[a], f"{b}_all": times[b]})
    decode = target_only_decoding(verifiers, contexts, args.decode_tokens)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": f"{prog} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": "smollm2-135m-instruct", "machine": machine_info("cpu"), "reps": args.reps,
        "prompts": len(contexts), "context_tokens": [min(map(len, contexts)), max(map(len, contexts))],
        "rows": rows, "mismatches": mismatches, "decode": decode,
    }
    write_results(out, results)
    (out / "report.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
