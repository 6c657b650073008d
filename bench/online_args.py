"""The online benchmark's command line: ``python -m bench.online`` options, the same run as
``specpool bench --online`` (its options and the namespace it stands for), and the command that
repeats a run. No models.
"""

from __future__ import annotations

import argparse
import shlex

from bench.common import default_out
from bench.online_report import SYSTEMS
from specpool.core.defaults import DEFAULT_K
from specpool.core.errors import InvalidArgument, check
from specpool.learning.online import SUPERVISION, OnlineConfig


def add_online_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", default="../shared/data/prose/gutenberg", help="text file or folder of the stream's domain")
    parser.add_argument("--limit", type=int, default=150, help="prompts in the stream (default 150)")
    parser.add_argument("--drafter", default="chat",
                        help="the drafter every system starts from: a zoo drafter, or a white-box head eagle:NAME "
                             "whose records carry the target's features (default chat)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft length (default {DEFAULT_K})")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    online = OnlineConfig()  # the library's defaults are the benchmark's
    parser.add_argument("--lr", type=float, default=online.lr, help=f"OGD / optimistic OGD step size (default {online.lr})")
    parser.add_argument("--hedge-lrs", default=",".join(map(str, online.hedge_lrs)),
                        help=f"the Hedge members' step sizes (default {','.join(map(str, online.hedge_lrs))})")
    parser.add_argument("--precondition", choices=("none", "adagrad"), default=online.precondition,
                        help=f"adagrad: per-coordinate steps; none: one global step (default {online.precondition})")
    parser.add_argument("--grow-vocab", type=int, default=online.grow_vocab,
                        help=f"tokens the learners may add to the drafter's vocabulary (default {online.grow_vocab})")
    parser.add_argument("--copy-window", type=int, default=online.copy_window,
                        help=f"the learners' copy term: inputs looked back over, 0 = none (default {online.copy_window})")
    add_learner_cost_arguments(parser)
    parser.add_argument("--batch-records", type=int, default=4, help="feedback records per gradient step")
    parser.add_argument("--supervision", choices=SUPERVISION, default=online.supervision,
                        help=f"distribution (the target's top-K p) or argmax (its most likely token) (default {online.supervision})")
    parser.add_argument("--context-tail", type=int, default=64, help="context tokens a feedback record keeps (default 64)")
    parser.add_argument("--concurrent", action="store_true", help="learners train while requests run (default: between)")
    add_process_arguments(parser)
    parser.add_argument("--out", default=default_out("online"), help=f"output folder (default ./{default_out('online')})")
    parser.add_argument("--target", default=None, help="target model (default: the embedded default)")
    parser.add_argument("--device", default="cpu")
    add_forgetting_arguments(parser)


def add_learner_cost_arguments(parser) -> None:
    """--merge-records / --detach-context, with the library's defaults (specpool/learning/online.py)."""
    online = OnlineConfig()
    parser.add_argument("--merge-records", action=argparse.BooleanOptionalAction, default=online.merge_records,
                        help=f"the learners fit a session's records that line up as one sequence (default {online.merge_records})")
    parser.add_argument("--detach-context", action=argparse.BooleanOptionalAction, default=online.detach_context,
                        help=f"the learners backpropagate through the draft positions only (default {online.detach_context})")


def learner_cost_flags(args: argparse.Namespace) -> list[str]:
    """The learner-cost options of ``args`` as command-line flags (for the report and the learner processes)."""
    return ["--merge-records" if args.merge_records else "--no-merge-records",
            "--detach-context" if args.detach_context else "--no-detach-context"]


def add_process_arguments(parser) -> None:
    parser.add_argument("--learner-process", default=None, metavar="REDIS_URL",
                        help="each learning system's learner runs as its own `specpool learner` process fed through "
                             "Redis at this URL, during its system's requests only: tokens/s is then net of learning")
    parser.add_argument("--learner-nice", type=int, default=10, help="with --learner-process: the learners' nice value (default 10)")
    parser.add_argument("--learner-threads", type=int, default=1, help="with --learner-process: torch threads per learner (default 1)")
    parser.add_argument("--learner-idle", action="store_true",
                        help="with --learner-process: run the learners under SCHED_IDLE (Linux; as `chrt --idle 0 "
                             "specpool learner` would): any waking serving thread preempts them at once, so they use "
                             "only cycles serving leaves idle")
    parser.add_argument("--publish-every", type=int, default=32,
                        help="with --learner-process: records between published versions (default 32)")
    parser.add_argument("--commit-after-s", type=float, default=30.0,
                        help="with --learner-process: or publish this many seconds after a version's first "
                             "unpublished record, paused time included, whichever comes first (default 30)")


def add_forgetting_arguments(parser) -> None:
    parser.add_argument("--forgetting-prompts", default="../shared/data/prompts/dev.jsonl",
                        help="Spec-Bench question file of the forgetting check (default dev.jsonl)")
    parser.add_argument("--forgetting-per-category", type=int, default=8,
                        help="prompts per own category in the forgetting check (default 8; 0 skips the check)")
    parser.add_argument("--forgetting-categories", default=None,
                        help="comma-separated categories of the check (default: the drafter's own, bench/common.py)")
    parser.add_argument("--forgetting-only", action="store_true",
                        help="only run the forgetting check, on the learned versions an earlier run left in --out")


def command_line(args: argparse.Namespace) -> str:
    if getattr(args, "via_specpool", False):  # the same run, as `specpool bench --online` spells it
        head = ["specpool", "bench", "--online", "--prompts", args.corpus, "--limit", str(args.limit), "--drafters", args.drafter]
    else:
        head = ["python", "-m", "bench.online", "--corpus", args.corpus, "--limit", str(args.limit), "--drafter", args.drafter]
    return shlex.join([
        *head,
        "--systems", args.systems, "-k", str(args.k), "--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr),
        "--hedge-lrs", args.hedge_lrs, "--batch-records", str(args.batch_records), "--supervision", args.supervision, "--context-tail", str(args.context_tail), "--precondition", args.precondition,
        "--grow-vocab", str(args.grow_vocab), "--copy-window", str(args.copy_window), *learner_cost_flags(args),
        "--out", args.out,
        "--device", args.device, *(["--concurrent"] if args.concurrent else []),
        *(["--learner-process", args.learner_process, "--learner-nice", str(args.learner_nice), "--learner-threads",
           str(args.learner_threads), "--publish-every", str(args.publish_every), "--commit-after-s", str(args.commit_after_s),
           *(["--learner-idle"] if args.learner_idle else [])] if args.learner_process else []), *(["--target", args.target] if args.target else []),
        "--forgetting-prompts", args.forgetting_prompts, "--forgetting-per-category", str(args.forgetting_per_category),
        *(["--forgetting-categories", args.forgetting_categories] if args.forgetting_categories else []),
        *(["--forgetting-only"] if args.forgetting_only else []),
    ])


# Options of `specpool bench` whose default differs under --online: their bench defaults are None,
# and each mode fills in its own (bench/cli.py resolve_bench_defaults).
ONLINE_DEFAULTS = {"drafters": "chat", "max_new_tokens": 64, "out": default_out("online")}


def add_bench_online_arguments(parser: argparse.ArgumentParser) -> None:
    """``--online`` and the options only it uses, on the ``specpool bench`` parser. Shared options
    keep their bench names: --prompts is the corpus (a text file or folder), --drafters the one
    drafter every system starts from, -k, --max-new-tokens, --out, --target, --device, --dtype."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_online_arguments(defaults)
    d = vars(defaults.parse_args([]))
    group = parser.add_argument_group(
        "online learning (bench/online.py)",
        "drafters learning on a stream from an unseen domain; --prompts is then "
        f"the corpus (text file or folder, e.g. ../shared/data/prose/gutenberg), --drafters one zoo drafter or "
        f"white-box head (eagle:NAME) "
        f"(default {ONLINE_DEFAULTS['drafters']}), --max-new-tokens defaults to {ONLINE_DEFAULTS['max_new_tokens']}, "
        f"--out to ./{ONLINE_DEFAULTS['out']}")
    group.add_argument("--online", action="store_true", help="switch to the online learning benchmark (frozen vs ogd, optimistic, hedge)")
    group.add_argument("--limit", type=int, default=d["limit"], help=f"prompts in the stream (default {d['limit']})")
    group.add_argument("--systems", default=d["systems"], help=f"comma-separated, from {','.join(SYSTEMS)} (default all)")
    group.add_argument("--lr", type=float, default=d["lr"], help=f"OGD / optimistic OGD step size (default {d['lr']})")
    group.add_argument("--hedge-lrs", default=d["hedge_lrs"], help=f"the Hedge members' step sizes (default {d['hedge_lrs']})")
    group.add_argument("--precondition", choices=("none", "adagrad"), default=d["precondition"],
                       help=f"adagrad: per-coordinate steps; none: one global step (default {d['precondition']})")
    group.add_argument("--grow-vocab", type=int, default=d["grow_vocab"],
                       help=f"tokens the learners may add to the drafter's vocabulary (default {d['grow_vocab']})")
    group.add_argument("--copy-window", type=int, default=d["copy_window"],
                       help=f"the learners' copy term: inputs looked back over, 0 = none (default {d['copy_window']})")
    add_learner_cost_arguments(group)
    group.add_argument("--batch-records", type=int, default=d["batch_records"],
                       help=f"feedback records per gradient step (default {d['batch_records']})")
    group.add_argument("--supervision", choices=SUPERVISION, default=d["supervision"],
                       help=f"distribution (the target's top-K p) or argmax (its most likely token) (default {d['supervision']})")
    group.add_argument("--context-tail", type=int, default=d["context_tail"],
                       help=f"context tokens a feedback record keeps (default {d['context_tail']})")
    group.add_argument("--concurrent", action="store_true", help="learners train while requests run (default: between requests)")
    add_process_arguments(group)
    add_forgetting_arguments(group)


def online_args_from_bench(args: argparse.Namespace) -> argparse.Namespace:
    """The ``python -m bench.online`` namespace a ``specpool bench --online`` command stands for."""
    if args.policies is not None:
        raise InvalidArgument("give either --online or --policies, not both")
    if args.in_domain or args.in_domain_lookup:
        flag = "--in-domain" if args.in_domain else "--in-domain-lookup"
        raise InvalidArgument(f"{flag} does not apply to --online (every system starts from --drafters)")
    drafters = [d.strip() for d in (args.drafters or ONLINE_DEFAULTS["drafters"]).split(",") if d.strip()]
    check(len(drafters) == 1, f"--online trains one drafter; give one in --drafters, got {args.drafters!r}")
    return argparse.Namespace(
        corpus=args.prompts, limit=args.limit, drafter=drafters[0], systems=args.systems, k=args.k,
        max_new_tokens=ONLINE_DEFAULTS["max_new_tokens"] if args.max_new_tokens is None else args.max_new_tokens,
        lr=args.lr, hedge_lrs=args.hedge_lrs, precondition=args.precondition, batch_records=args.batch_records,
        supervision=args.supervision, context_tail=args.context_tail,
        grow_vocab=args.grow_vocab, copy_window=args.copy_window,
        merge_records=args.merge_records, detach_context=args.detach_context,
        concurrent=args.concurrent, out=ONLINE_DEFAULTS["out"] if args.out is None else args.out,
        learner_process=args.learner_process, learner_nice=args.learner_nice, learner_threads=args.learner_threads,
        learner_idle=args.learner_idle,
        publish_every=args.publish_every, commit_after_s=args.commit_after_s,
        target=args.target, device=args.device, dtype=args.dtype, via_specpool=True,
        forgetting_prompts=args.forgetting_prompts, forgetting_per_category=args.forgetting_per_category,
        forgetting_categories=args.forgetting_categories, forgetting_only=args.forgetting_only,
    )
