"""``specpool bench --policies``: drafter-selection policies on a shuffled, mixed prompt stream.

For every prompt (in a seeded shuffle of the categories, so domains interleave as they would in
serving), every system runs back to back in one process, the order rotating from prompt to prompt:

    target            target-only decoding
    fixed:<drafter>   each drafter of the pool alone
    <policy>          each policy over the whole pool (state in the session store, --store)
    oracle            the fixed drafter that was fastest on this prompt, run again in its own slot

--pool takes drafter specs and two shorthands: ``white-box`` (every shipped head, eagle:NAME) and
``mixed`` (those, lookup:code and ngram). With a white-box arm in the pool, a policy's first round
is the target's prefill alone (specpool/router/loop.py), a round of no arm: its record says
drafter None, and the reports count it as a target-only round (rounds, stopping time, call times).

Each policy keeps its own tenant across the stream, so ``+warm`` policies start a prompt's session
from what earlier prompts taught that tenant. Writes results.json (rows with ``system`` = policy),
per_prompt.jsonl, report.md, arm_choices.png and regret.png. Aggregation: bench/policy_report.py.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from bench import policy_report, report
from bench.common import WARMUP_PROMPT, WARMUP_TOKENS, Question, expand_pool, load_questions, machine_info, parse_drafters
from specpool.core.errors import SpecpoolError, check
from specpool.router.policies import PolicyOptions, make_policy
from specpool.router.session_store import open_store
from specpool.services.engine import EmbeddedEngine, EngineConfig, default_pool
from specpool.target.models import ModelConfig
from specpool.target.sampling import SamplingParams, validate_draft_length

ORACLE = policy_report.ORACLE
FIXED = policy_report.FIXED_PREFIX


def parse_policies(text: str, pool: list[str]) -> list[str]:
    """Policy names, validated (unknown name, oracle-only, bad options fail here, before any model)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    check(bool(names), "--policies is empty; give policy names such as metasd-ucb,ucb-be,oracle")
    check(len(set(names)) == len(names), f"--policies names a policy twice: {text}")
    for name in names:
        if name != ORACLE:
            make_policy(name, pool)
    return names


def command_line(args: argparse.Namespace) -> str:
    return shlex.join([
        "specpool", "bench", "--policies", args.policies, "--pool", ",".join(args.pool_list), "--prompts", str(args.prompts),
        "--limit-per-category", str(args.limit_per_category), "--max-new-tokens", str(args.max_new_tokens),
        "-k", str(args.k), "--beta", str(args.beta), "--probe-rounds", str(args.probe_rounds), "--store", args.store, "--seed", str(args.seed),
        "--out", str(args.out), "--target", args.target, "--device", args.device, "--dtype", args.dtype,
        "--cpu-linear", args.cpu_linear,
    ])


def run_policy_bench(args: argparse.Namespace, settings) -> int:
    """The policy benchmark of ``args`` (bench/cli.py has filled in its defaults)."""
    check(args.max_new_tokens >= 2, f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    validate_draft_length(args.k)
    options = PolicyOptions(beta=args.beta, probe_rounds=args.probe_rounds)
    options.validate()
    pool = parse_drafters(expand_pool(args.pool)) if args.pool else default_pool(args.target)
    args.pool_list = pool
    policies = parse_policies(args.policies, pool)
    prompts_path = Path(args.prompts).expanduser().resolve()
    questions = load_questions(prompts_path, args.limit_per_category)
    random.Random(args.seed).shuffle(questions)  # a mixed stream: domains interleave
    out = Path(args.out).expanduser()
    check(not out.exists() or out.is_dir(), f"--out {out} exists and is not a folder")
    # The run's own Redis namespace, so it starts from empty tenant statistics.
    store = open_store(args.store, namespace=f"specpool-bench-{uuid.uuid4().hex[:8]}")
    out.mkdir(parents=True, exist_ok=True)

    print(f"specpool bench: loading {args.target} and pool {', '.join(pool)} ...", file=sys.stderr)
    engine = EmbeddedEngine(EngineConfig(home=settings.home, target=ModelConfig(args.target, args.device, args.dtype, args.cpu_linear),
                                         drafter_device=args.device, drafter_dtype=args.dtype), store=store)
    for name in pool:
        engine.drafter(name)
    systems = [report.TARGET] + [FIXED + d for d in pool] + [p for p in policies if p != ORACLE]
    run = system_runner(engine, args, pool, options)
    try:
        records, interrupted = measure(run, systems, policies, questions, [engine.encode_prompt(q.prompt) for q in questions],
                                       engine.encode_prompt(WARMUP_PROMPT), args.max_new_tokens, out / "per_prompt.jsonl")
    finally:
        store.close()
    if not records:
        print("specpool: interrupted before the first prompt finished", file=sys.stderr)
        return 130

    n_done = len({r["prompt_index"] for r in records})
    config = {
        "target": args.target, "device": args.device, "dtype": str(engine.config.target.torch_dtype()).removeprefix("torch."),
        "pool": pool, "policies": policies, "systems": systems + ([ORACLE] if ORACLE in policies else []),
        "k": args.k, "beta": args.beta, "probe_rounds": args.probe_rounds, "max_new_tokens": args.max_new_tokens, "temperature": 0,
        "store": store.describe, "prompts_file": str(prompts_path), "n_prompts": n_done, "seed": args.seed,
        "limit_per_category": args.limit_per_category, "order": "seeded shuffle of the prompts; systems back to back per prompt, order rotated",
        "command": command_line(args), "interrupted": interrupted,
    }
    rows, _ = write_report(out, records, machine_info(args.device), config)
    print(policy_report.markdown_table(rows, report.ALL))
    print(f"\nwrote {out}/results.json, per_prompt.jsonl, report.md, regret.png and arm-choice plots")
    bad = {r["system"]: r["lossless_mismatches"] for r in rows if r["category"] == report.ALL and r["lossless_mismatches"]}
    if bad:
        print(f"specpool bench: WARNING: outputs differ from target-only (lossless bug): {bad}", file=sys.stderr)
    return 130 if interrupted else 0


def system_runner(engine, args: argparse.Namespace, pool: list[str], options: PolicyOptions):
    """run(system, prompt_ids, max_new_tokens, prompt_index) -> (GenerationResult, wall seconds).
    Each system keeps its own tenant across the stream (what +warm policies start from)."""
    stop_ids = engine.stop_token_ids()
    run_tag = uuid.uuid4().hex[:8]

    def run(system: str, ids: list[int], n: int, index: int):
        params = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=stop_ids, seed=args.seed)
        drafter, policy = None, None
        if system.startswith(FIXED):
            drafter = system.removeprefix(FIXED)
        elif system != report.TARGET:
            policy = system
        tenant = "bench-" + "".join(c if c.isalnum() else "-" for c in system)[:56]
        started = time.perf_counter()
        result = engine.generate(ids, params, drafter, k=args.k, session_id=f"{run_tag}-{index}", policy=policy,
                                 pool=pool, tenant=tenant, policy_options=options, trace=policy is not None)
        return result, time.perf_counter() - started

    return run


def measure(run, systems: list[str], policies: list[str], questions: list[Question], prompt_ids: list[list[int]],
            warmup_ids: list[int], max_new_tokens: int, raw_path: Path) -> tuple[list[dict], bool]:
    """Every system on every prompt, back to back, order rotated per prompt, then the oracle (the
    fastest fixed drafter of the prompt, run again); the records (also written to ``raw_path``)
    and whether Ctrl-C cut the run short."""
    for system in systems:
        run(system, warmup_ids, WARMUP_TOKENS, -1)
    records: list[dict] = []
    interrupted = False
    with raw_path.open("w") as raw:
        bar = tqdm(list(enumerate(questions)), desc="bench policies", unit="prompt", file=sys.stderr, dynamic_ncols=True)
        try:
            for i, question in bar:
                shift = i % len(systems)
                runs = {s: run(s, prompt_ids[i], max_new_tokens, i) for s in systems[shift:] + systems[:shift]}
                pick = None
                if ORACLE in policies:
                    fixed = [s for s in systems if s.startswith(FIXED)]
                    pick = max(fixed, key=lambda s: len(runs[s][0].token_ids) / runs[s][1])
                    runs[ORACLE] = run(pick, prompt_ids[i], max_new_tokens, i)
                target_ids = runs[report.TARGET][0].token_ids
                for system, (result, wall) in runs.items():
                    rec = policy_record(i, question, system, len(prompt_ids[i]), result, wall, target_ids, pick)
                    records.append(rec)
                    raw.write(json.dumps(rec) + "\n")
                raw.flush()
                target_s = runs[report.TARGET][1] / max(len(target_ids), 1)
                bar.set_postfix_str(" ".join(f"{s}={target_s * len(runs[s][0].token_ids) / runs[s][1]:.2f}x"
                                             for s in policies[:3] if s in runs))
        except KeyboardInterrupt:
            interrupted = True
        bar.close()
    return records, interrupted


def policy_record(index: int, question: Question, system: str, prompt_tokens: int, result, wall: float,
                  target_ids: list[int], oracle_pick: str | None) -> dict:
    """One system's raw counters on one prompt (per_prompt.jsonl); bench/policy_report.py derives
    every figure from these."""
    kind = ("target" if system == report.TARGET else "fixed" if system.startswith(FIXED)
            else "oracle" if system == ORACLE else "policy")
    return {
        "prompt_index": index, "question_id": question.question_id, "category": question.category,
        "system": system, "kind": kind, "ours": True, "prompt_tokens": prompt_tokens,
        "new_tokens": len(result.token_ids), "wall_s": wall, "rounds": len(result.rounds),
        "round_s": sum(r.round_s for r in result.rounds), "chooser_s": result.chooser_s,
        "matches_target": None if system == report.TARGET else result.token_ids == target_ids,
        "emitted": [r.emitted for r in result.rounds],
        "proposed": [r.proposed for r in result.rounds],  # verify width - 1: with arms, a cost model can replay a run
        "drafted_k": [r.k for r in result.rounds],
        # Per-round call times and proposal sources: bench/policy_report.steady_walls
        # re-times every run with each call at its median over the prompt's runs.
        "draft_ms": [round(r.draft_s * 1e3, 3) for r in result.rounds],
        "verify_ms": [round(r.verify_s * 1e3, 3) for r in result.rounds],
        "other_ms": [round((r.round_s - r.draft_s - r.verify_s - r.replay_s) * 1e3, 3) for r in result.rounds],
        # ucb-replay's side observations: their time, and which drafters were replayed
        "replay_ms": [round(r.replay_s * 1e3, 3) for r in result.rounds],
        "replayed": [sorted(r.replays) if r.replays else [] for r in result.rounds],
        "sources": [r.source for r in result.rounds],
        "arms": round_arms(result),
        "leaders": [t.leader for t in result.trace] if result.trace else None,
        "oracle_drafter": oracle_pick.removeprefix(FIXED) if system == ORACLE else None,
    }


def round_arms(result) -> list[str | None]:
    """The arm of each round, aligned with ``result.rounds`` (so with emitted, proposed, the call
    times): the policy's own arm name (``code@3``) from its trace where it has one, else the
    round's drafter. The trace skips rounds the policy was not told about: a white-box pool's
    first round (the target's prefill, drafter None) and a last round left nothing to draft (k 0)."""
    trace = list(result.trace or [])
    arms, j = [], 0
    for r in result.rounds:
        if r.drafter is not None and r.k > 0 and j < len(trace):
            arms.append(trace[j].arm)
            j += 1
        else:
            arms.append(r.drafter)
    return arms


def write_report(out: Path, records: list[dict], machine: dict, config: dict) -> tuple[list[dict], dict]:
    """Aggregate, plot and write results.json + report.md from the raw records."""
    rows, summary = policy_report.aggregate(records)
    budgets = list(range(8, config["max_new_tokens"] + 1, 8))
    curves = policy_report.regret_curves(records, budgets)
    (out / "results.json").write_text(json.dumps({
        "machine": machine, "config": config, "summary": summary, "rows": rows,
        "regret": {"budgets": budgets, "curves": curves},
    }, indent=2) + "\n")
    plots = []
    for system in [p for p in config["policies"] if p != ORACLE][:4]:
        name = f"arm_choices_{''.join(c if c.isalnum() else '_' for c in system)}.png"
        policy_report.plot_arm_choices(records, system, out / name)
        plots.append(name)
    policy_report.plot_regret(curves, budgets, out / "regret.png",
                              f"{config['target']}, k={config['k']}, greedy, {config['n_prompts']} mixed prompts: "
                              "regret vs each prompt's fewest-rounds fixed drafter")
    (out / "report.md").write_text(render(machine, config, rows, summary, curves, budgets, plots))
    return rows, summary


def rerender(out: Path) -> None:
    """Rebuild results.json and report.md of a finished run from its per_prompt.jsonl."""
    check((out / "per_prompt.jsonl").is_file(), f"{out / 'per_prompt.jsonl'} does not exist: --rerender needs the raw "
                                                "per-prompt log of a fresh run (committed results keep only the reports)")
    saved = json.loads((out / "results.json").read_text())
    records = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines() if line.strip()]
    write_report(out, records, saved["machine"], saved["config"])


def render(machine: dict, config: dict, rows: list[dict], summary: dict, curves: dict, budgets: list[int], plots: list[str]) -> str:
    lines = [
        "# specpool bench --policies", "",
        f"- **machine**: {machine['cpu']}, {machine['cores']} cores ({machine['torch_threads']} torch threads); "
        f"torch {machine['torch']}, transformers {machine['transformers']}",
        f"- **target**: `{config['target']}` on {config['device']} ({config['dtype']})",
        f"- **pool**: " + ", ".join(f"`{d}`" for d in config["pool"]),
        f"- **decoding**: greedy, k = {config['k']}, β = {config['beta']}, max {config['max_new_tokens']} new tokens",
        f"- **prompts**: {config['n_prompts']} from `{config['prompts_file']}`, first {config['limit_per_category']} per category, "
        f"seeded shuffle (seed {config['seed']})" + (" — INTERRUPTED" if config["interrupted"] else ""),
        f"- **session store**: {config['store']}",
        f"- **command**: `{config['command']}`", "",
        f"Best fixed drafter over the mixed set (pooled tokens/s): `{summary['best_fixed']}` measured, "
        f"`{summary.get('steady_best_fixed')}` in steady time.", "",
        "## Headline", "",
        "*Ratio to oracle*: per category, the median over prompts of the policy's tokens/s over the oracle's on the "
        "same prompt; then the mean over categories. *Ratio to best fixed*: the same against the best fixed drafter "
        "(mean over categories), and the median over all prompts. *Steady*: the same ratios with every run re-timed, "
        "each call (a draft of a given drafter, source and length; a verify of a given width) at its median over all "
        "runs of the prompt, so a run the machine stalled does not decide a ratio; the steady oracle is each "
        "prompt's fixed drafter with the most steady tokens/s. *Rounds / 100 tokens* is the stopping time, free of "
        "clock noise; the stopping-time oracle (each prompt's fewest-rounds fixed drafter) needs "
        f"{policy_report._f(summary['stopping_time_oracle_rounds_per_100_tokens'], 1)}.", "",
        "*Pooled*: per category, the policy's tokens/s over the oracle's, each all tokens over all seconds of "
        "the category's prompts; then the mean over categories.", "",
        "| policy | ratio to oracle (categories) | steady | pooled | steady pooled | ratio to best fixed (categories) | steady "
        "| ratio to best fixed (prompts) | steady | rounds / 100 tokens | rounds to identify (identified) | chooser time / round time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    f = policy_report._f
    for system, s in summary["policies"].items():
        if system == "target":
            continue
        ident = "–" if s["rounds_to_identify"] is None else f"{s['rounds_to_identify']:.0f} ({100 * s['identified_share']:.0f}%)"
        lines.append(f"| `{system}` | {f(s['ratio_to_oracle_category_mean'], 3)} | {f(s.get('steady_ratio_to_oracle_category_mean'), 3)} | "
                     f"{f(s.get('pooled_ratio_to_oracle_category_mean'), 3)} | {f(s.get('steady_pooled_ratio_to_oracle_category_mean'), 3)} | "
                     f"{f(s.get('ratio_to_best_fixed_category_mean'), 3)} | {f(s.get('steady_ratio_to_best_fixed_category_mean'), 3)} | "
                     f"{f(s['ratio_to_best_fixed'], 3)} | {f(s.get('steady_ratio_to_best_fixed'), 3)} | "
                     f"{f(s['rounds_per_100_tokens'], 1)} | {ident} | {f(s['chooser_fraction'], 3, True)} |")
    lines += ["", "## All prompts", "", policy_report.markdown_table(rows, report.ALL), "",
              "## Per category", "", policy_report.markdown_table([r for r in rows if r["category"] != report.ALL]), "",
              "Medians over prompts with [p25, p75]; *ratio to oracle / best fixed* are per-prompt tokens/s ratios "
              "(the headline's first columns average these medians over categories).", "",
              "## Stopping-time regret (rounds, mean over prompts) vs tokens generated", "",
              "| system | " + " | ".join(str(b) for b in budgets[::2]) + " |", "|---" * (len(budgets[::2]) + 1) + "|"]
    for system, curve in curves.items():
        lines.append(f"| `{system}` | " + " | ".join(policy_report._f(v, 1) for v in curve[::2]) + " |")
    lines += ["", "![regret](regret.png)", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.policies --rerender DIR``: re-aggregate a finished run (e.g. after a report
    change) from its raw per_prompt.jsonl, which only a fresh run has (git keeps only the reports)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--rerender":
        try:
            rerender(Path(argv[1]))
        except SpecpoolError as exc:
            print(f"python -m bench.policies: error: {exc}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m bench.policies --rerender DIR (runs are started with specpool bench --policies)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
