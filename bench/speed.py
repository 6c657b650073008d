"""``specpool bench``: speculative decoding vs target-only vs Hugging Face, side by side.

For every prompt, every system runs back to back in one process (the order rotates from prompt to
prompt), so machine noise hits all systems alike and per-prompt ratios stay meaningful
(docs/ARCHITECTURE.md, "Measuring"). Systems, all greedy and sharing one target model object:

    target               our loop, no drafter (target-only decoding)
    <drafter spec>       our loop with that drafter, e.g. ngram, hf:/path
    hf-assisted:<spec>   transformers generate(assistant_model=...) for each hf: drafter
    hf-prompt-lookup     transformers generate(prompt_lookup_num_tokens=k), HF's ngram
    in-domain            per prompt, the shipped zoo drafter of its category (--in-domain [zoo])
    in-domain-eagle      per prompt, the shipped white-box head of its category (--in-domain eagle)
    in-domain[-eagle]+lookup   the same behind prompt lookup (--in-domain-lookup [zoo|eagle|both])

White-box heads also run as drafter specs (--drafters eagle:general,lookup:eagle:code). Besides
speed, the report gives each drafting system's draft cost: its forward time per proposed token and
its propose calls' share of round time.

Writes results.json, per_prompt.jsonl (raw counters), report.md and speedup.png to --out.
Aggregation and rendering live in bench/report.py (pure, unit-tested).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench import report
from bench.common import (GENERAL_DRAFTER, IN_DOMAIN_DRAFTERS, IN_DOMAIN_FAMILIES, WARMUP_PROMPT, WARMUP_TOKENS, Question,
                          in_domain_spec, load_questions, machine_info, parse_drafters)
from specpool.core.errors import NotFound, check

IN_DOMAIN = "in-domain"  # + "-eagle" for the white-box heads, + "+lookup" for lookup:DRAFTER (drafters/lookup_first.py)
# --in-domain / --in-domain-lookup FAMILY: the shipped zoo drafters, the shipped white-box heads, or both.
BOTH = "both"
IN_DOMAIN_CHOICES = (*IN_DOMAIN_FAMILIES, BOTH)


def in_domain_systems(in_domain: str | None, in_domain_lookup: str | None) -> dict[str, tuple[str, str]]:
    """System name -> (family, spec prefix) of the in-domain systems asked for: ``in-domain`` and
    ``in-domain+lookup`` for the zoo (the names of earlier reports), ``in-domain-eagle`` and
    ``in-domain-eagle+lookup`` for the white-box heads."""
    systems = {}
    for wanted, prefix, suffix in ((in_domain, "", ""), (in_domain_lookup, "lookup:", "+lookup")):
        for family in IN_DOMAIN_FAMILIES:
            if wanted in (family, BOTH):
                systems[IN_DOMAIN + ("" if family == "zoo" else f"-{family}") + suffix] = (family, prefix)
    return systems


def in_domain_specs(family: str, prefix: str) -> dict[str, str]:
    """Category -> drafter spec of one in-domain system, ``*`` for a category outside the mapping."""
    return {**{c: prefix + in_domain_spec(family, c) for c in IN_DOMAIN_DRAFTERS}, "*": prefix + in_domain_spec(family, "*")}


def check_in_domain_heads(systems: dict[str, tuple[str, str]]) -> None:
    """Before any model loads: every white-box head an in-domain system needs is shipped."""
    from specpool.drafters.eagle import SHIPPED_DIR, shipped_heads

    if not any(family == "eagle" for family, _ in systems.values()):
        return
    missing = sorted({*IN_DOMAIN_DRAFTERS.values(), GENERAL_DRAFTER} - set(shipped_heads()))
    check(not missing, f"the in-domain white-box systems need the heads {', '.join(missing)} in {SHIPPED_DIR} "
                       "(train them: specpool zoo train --arch eagle)", NotFound)


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run, every option spelled out."""
    return shlex.join([
        "specpool", "bench", "--prompts", str(args.prompts), "--limit-per-category", str(args.limit_per_category),
        "--max-new-tokens", str(args.max_new_tokens), "--drafters", args.drafters, "-k", str(args.k),
        "--out", str(args.out), "--target", args.target, "--device", args.device, "--dtype", args.dtype,
        "--cpu-linear", args.cpu_linear,
    ] + (["--in-domain", args.in_domain] if args.in_domain else [])
      + (["--in-domain-lookup", args.in_domain_lookup] if args.in_domain_lookup else [])
      + (["--temperature", f"{args.temperature:g}"] if getattr(args, "temperature", 0.0) else []))


# -- systems (models) ---------------------------------------------------------------------------
@dataclass
class Run:
    """One system's output on one prompt, and what it cost."""

    token_ids: list[int]
    wall_s: float
    result: object | None = None  # our GenerationResult; None for HF systems


def build_systems(engine, specs: list[str], k: int, in_domain: str | None = None,
                  in_domain_lookup: str | None = None,
                  temperature: float = 0.0) -> dict[str, tuple[bool, Callable[[list[int], int, str], Run]]]:
    """name -> (ours, run(prompt_ids, max_new_tokens, category)). Each run times only the generate call.
    ``in_domain`` / ``in_domain_lookup``: None or a family of IN_DOMAIN_CHOICES (in_domain_systems).
    ``temperature`` > 0: our systems sample (HF's peers are left out)."""
    import torch
    from transformers import PreTrainedModel

    from specpool.target.sampling import SamplingParams

    stop_ids = engine.stop_token_ids()
    device = engine.model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def ours(drafter: str | None):
        def run(prompt_ids: list[int], n: int, category: str) -> Run:
            # Sampled runs: one seed per prompt (its length), the same for every system.
            params = SamplingParams(temperature=temperature, max_new_tokens=n, stop_token_ids=stop_ids,
                                    seed=len(prompt_ids))
            sync()
            started = time.perf_counter()
            result = engine.generate(prompt_ids, params, drafter, k=k)
            sync()
            return Run(result.token_ids, time.perf_counter() - started, result)
        return run

    def hf(**peer_kwargs):
        def run(prompt_ids: list[int], n: int, category: str) -> Run:
            input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
            sync()
            started = time.perf_counter()
            # Same stop tokens as ours; an explicit all-ones mask (pad == eos here, so HF would
            # otherwise guess one); greedy.
            out = engine.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=n,
                eos_token_id=list(stop_ids), pad_token_id=stop_ids[0], **peer_kwargs,
            )  # (1, T + new)
            sync()
            return Run(out[0, len(prompt_ids):].tolist(), time.perf_counter() - started)
        return run

    systems = {report.TARGET: (True, ours(None))}
    for spec in specs:
        systems[spec] = (True, ours(spec))
    for system, (family, prefix) in in_domain_systems(in_domain, in_domain_lookup).items():
        chosen = in_domain_specs(family, prefix)
        for spec in set(chosen.values()):
            engine.drafter(spec)  # load (and check) before timing
        by_category = {c: ours(spec) for c, spec in chosen.items()}
        systems[system] = (True, lambda prompt_ids, n, category, by_category=by_category:
                           by_category.get(category, by_category["*"])(prompt_ids, n, category))
    for spec in specs if temperature == 0 else ():  # HF's peers run greedy only
        drafter = engine.drafter(spec)
        # HF's assisted generation needs a transformers model as assistant (hf:, early-exit:).
        if isinstance(getattr(drafter, "model", None), PreTrainedModel):
            assistant = drafter.model
            # transformers reads the draft length from the *assistant's* generation_config (the
            # generate() kwargs are ignored for it: it would draft up to 20 tokens and stop early
            # on a learned confidence threshold). Pin k, constant, no early stop: same job as ours.
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            systems[report.HF_ASSISTED + spec] = (False, hf(
                assistant_model=assistant, num_assistant_tokens=k, num_assistant_tokens_schedule="constant"))
    if temperature == 0 and any(spec.partition(":")[0] == "ngram" for spec in specs):
        systems[report.HF_PROMPT_LOOKUP] = (False, hf(prompt_lookup_num_tokens=k))
    return systems


def make_record(index: int, question: Question, system: str, is_ours: bool, prompt_ids: list[int], run: Run, target_ids: list[int] | None) -> dict:
    """Raw counters for per_prompt.jsonl; report.aggregate derives every rate from these."""
    result = run.result
    rounds = result.rounds if result is not None else None
    return {
        "prompt_index": index, "question_id": question.question_id, "category": question.category,
        "system": system, "ours": is_ours, "prompt_tokens": len(prompt_ids),
        "new_tokens": len(run.token_ids), "wall_s": run.wall_s,
        "finish_reason": result.finish_reason if result is not None else None,
        "rounds": len(rounds) if rounds is not None else None,
        "round_s": sum(r.round_s for r in rounds) if rounds is not None else None,
        "draft_forward_s": sum(r.draft_forward_s for r in rounds) if rounds is not None else None,
        "verify_forward_s": sum(r.verify_forward_s for r in rounds) if rounds is not None else None,
        "proposed": sum(r.proposed for r in rounds) if rounds is not None else None,
        "draft_s": sum(r.draft_s for r in rounds) if rounds is not None else None,
        "matches_target": None if target_ids is None else run.token_ids == target_ids,
        "token_ids": run.token_ids,
    }


# -- the run ------------------------------------------------------------------------------------
def run_speed_bench(args: argparse.Namespace, settings) -> int:
    """The side-by-side benchmark of ``args`` (bench/cli.py has filled in its defaults)."""
    from specpool.services.engine import EmbeddedEngine, EngineConfig
    from specpool.target.models import ModelConfig
    from specpool.target.sampling import validate_draft_length

    # Everything checkable without a model is checked before the (slow) model load.
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    validate_draft_length(args.k)
    prompts_path = Path(args.prompts).expanduser().resolve()
    questions = load_questions(prompts_path, args.limit_per_category)
    specs = parse_drafters(args.drafters)
    check_in_domain_heads(in_domain_systems(args.in_domain, args.in_domain_lookup))
    out = Path(args.out).expanduser()
    check(not out.exists() or out.is_dir(), f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)

    print(f"specpool bench: loading {args.target} and drafters {', '.join(specs)} ...", file=sys.stderr)
    engine = EmbeddedEngine(EngineConfig(home=settings.home, target=ModelConfig(args.target, args.device, args.dtype, args.cpu_linear),
                                         drafter_device=args.device, drafter_dtype=args.dtype))
    check(args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}")
    systems = build_systems(engine, specs, args.k, args.in_domain, args.in_domain_lookup, args.temperature)
    records, interrupted = measure(engine, systems, questions, args.max_new_tokens, out / "per_prompt.jsonl",
                                   greedy=args.temperature == 0)
    if not records:
        print("specpool: interrupted before the first prompt finished", file=sys.stderr)
        return 130
    rows, mismatches = write_report(out, args, engine, systems, specs, questions, prompts_path, records, interrupted)
    print(report.markdown_table(rows))
    cost = report.draft_cost_table([r for r in rows if r["category"] == report.ALL])
    if cost:
        print("\ndraft cost (all prompts):\n" + cost)
    ours_bad = {s: n for s, n in mismatches.items() if n and systems[s][0]}
    if ours_bad:
        print(f"specpool bench: WARNING: outputs differ from target-only (lossless bug): {ours_bad}", file=sys.stderr)
    print(f"\nwrote {out}/results.json, per_prompt.jsonl, report.md, speedup.png")
    return 130 if interrupted else 0


def measure(engine, systems: dict, questions: list[Question], max_new_tokens: int, raw_path: Path,
            greedy: bool = True) -> tuple[list[dict], bool]:
    """Every system on every prompt, back to back, the order rotated per prompt; the raw records
    (also written to ``raw_path`` as they come) and whether Ctrl-C cut the run short."""
    from tqdm import tqdm

    names = list(systems)
    prompt_ids = [engine.encode_prompt(q.prompt) for q in questions]  # tokenised once, outside timing
    warmup_ids = engine.encode_prompt(WARMUP_PROMPT)
    categories = list(dict.fromkeys(q.category for q in questions))
    for name, (_, run) in systems.items():
        # An in-domain system holds a drafter per category: each is warmed up, not only chat's.
        for category in categories if name.startswith(IN_DOMAIN) else ["chat"]:
            run(warmup_ids, min(WARMUP_TOKENS, max_new_tokens), category)
    records: list[dict] = []
    interrupted = False
    with raw_path.open("w") as raw:
        bar = tqdm(list(enumerate(questions)), desc="bench", unit="prompt", file=sys.stderr, dynamic_ncols=True)
        try:
            for i, question in bar:
                shift = i % len(names)  # rotate the order so no system always runs first
                runs = {name: systems[name][1](prompt_ids[i], max_new_tokens, question.category)
                        for name in names[shift:] + names[:shift]}
                target_ids = runs[report.TARGET].token_ids
                for name in names:
                    # Sampled outputs differ from target-only's draws by design (the same distribution,
                    # other draws): the token check is greedy's only.
                    rec = make_record(i, question, name, systems[name][0], prompt_ids[i], runs[name],
                                      None if name == report.TARGET or not greedy else target_ids)
                    records.append(rec)
                    raw.write(json.dumps(rec) + "\n")
                raw.flush()
                target_s = runs[report.TARGET].wall_s / max(len(target_ids), 1)
                bar.set_postfix_str(" ".join(
                    f"{n}={target_s * len(runs[n].token_ids) / runs[n].wall_s:.2f}x" for n in names[1:] if runs[n].wall_s > 0))
        except KeyboardInterrupt:
            interrupted = True  # report what was measured so far
        bar.close()
    return records, interrupted


def write_report(out: Path, args: argparse.Namespace, engine, systems: dict, specs: list[str], questions: list[Question],
                 prompts_path: Path, records: list[dict], interrupted: bool) -> tuple[list[dict], dict[str, int]]:
    """results.json, speedup.png and report.md of a run; its rows and lossless mismatch counts."""
    names = list(systems)
    rows = report.aggregate(records)
    mismatches = report.mismatch_counts(records)
    n_done = len({r["prompt_index"] for r in records})
    machine = machine_info(args.device)
    categories: dict[str, int] = {}
    for q in questions[:n_done]:
        categories[q.category] = categories.get(q.category, 0) + 1
    config = {
        "target": args.target, "device": args.device, "dtype": str(engine.config.target.torch_dtype()).removeprefix("torch."),
        "drafters": specs, "systems": names,
        # per in-domain system: category -> the drafter it ran ("*": any other category)
        "in_domain_drafters": {name: in_domain_specs(*family) for name, family in
                               in_domain_systems(args.in_domain, args.in_domain_lookup).items()} or None,
        "cpu_linear": args.cpu_linear, "k": args.k, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "prompts_file": str(prompts_path), "n_prompts": n_done, "limit_per_category": args.limit_per_category,
        "categories": categories, "stop_token_ids": list(engine.stop_token_ids()),
        "hf_assisted": {"num_assistant_tokens": args.k, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0},
        "hf_prompt_lookup": {"prompt_lookup_num_tokens": args.k, "max_matching_ngram_size": 2},  # HF's default n-gram size
        "warmup": f"each system once on {WARMUP_PROMPT!r}, {WARMUP_TOKENS} tokens (in-domain systems once per category)",
        "order": "all systems back to back per prompt, order rotated each prompt",
        "command": command_line(args), "interrupted": interrupted,
    }
    (out / "results.json").write_text(json.dumps(
        {"machine": machine, "config": config, "lossless_mismatches": mismatches, "rows": rows}, indent=2) + "\n")

    plot_name = "speedup.png"
    decoding = "greedy" if args.temperature == 0 else f"T={args.temperature}"
    title = f"{args.target}, k={args.k}, {decoding}, {n_done} prompts, {args.max_new_tokens} new tokens"
    report.plot_speedup(rows, out / plot_name, title)
    header = [
        ("machine", f"{machine['cpu']}, {machine['cores']} cores ({machine['torch_threads']} torch threads)"
                    f"{', ' + machine['gpu'] if 'gpu' in machine else ''}; {machine['platform']}; "
                    f"torch {machine['torch']}, transformers {machine['transformers']}"),
        ("target", f"`{args.target}` on {args.device} ({config['dtype']})"),
        ("drafters", ", ".join(f"`{s}`" for s in specs) + "; HF peers: " + (", ".join(f"`{n}`" for n in names if not systems[n][0]) or "none")),
        ("decoding", ("greedy (temperature 0)" if args.temperature == 0 else
                      f"sampled, temperature {args.temperature} (seed = prompt length; no token check, no HF peers)")
                     + f", k = {args.k}, max {args.max_new_tokens} new tokens, "
                     f"stop tokens {config['stop_token_ids']}; HF assisted drafts exactly k (constant, no confidence stop)"),
        ("prompts", f"{n_done} from `{prompts_path}` (first {args.limit_per_category} per category: "
                    + ", ".join(f"{c} {n}" for c, n in categories.items()) + ")" + (" — INTERRUPTED" if interrupted else "")),
        ("method", "systems alternate per prompt in one process (order rotated), each warmed up once (in-domain systems once per category)"),
        ("command", f"`{config['command']}`"),
    ]
    (out / "report.md").write_text(report.markdown_report(header, rows, mismatches, plot_name))
    return rows, mismatches
