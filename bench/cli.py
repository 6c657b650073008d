"""``specpool bench``: its options and the dispatch to the three benchmarks behind it.

The one entry of the command (specpool/cli/main.py loads it through specpool/cli/bench_loader.py):
it imports the benchmarks, none of them imports it, so bench/ imports run one way:

    cli  ->  speed (side by side), policies (--policies), online (--online)  ->  common, report
"""

from __future__ import annotations

import argparse

from bench.common import default_out
from bench.online import run_online_bench
from bench.online_args import add_bench_online_arguments, online_args_from_bench
from bench.policies import run_policy_bench
from bench.speed import IN_DOMAIN_CHOICES, run_speed_bench
from specpool.core.defaults import DEFAULT_BETA, DEFAULT_K, DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROBE_ROUNDS

# The side-by-side and policy benchmarks' defaults of the options --online shares: the parser's
# defaults are None, and each mode fills in its own (online: bench/online_args.py ONLINE_DEFAULTS).
BENCH_DEFAULTS = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "drafters": "ngram", "out": default_out("latest")}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", required=True,
                        help="Spec-Bench / MT-Bench question file (JSON lines with category and turns); with --online, the corpus")
    parser.add_argument("--limit-per-category", type=int, default=5, help="first N prompts of each category (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=f"new tokens per prompt (default {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--drafters", default=None, help="comma-separated drafter specs to compare, e.g. ngram,hf:PATH (default ngram)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="side-by-side benchmark: sample at this temperature (default 0: greedy, with the lossless token check)")
    parser.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft length per round, for ours and the HF peers (default {DEFAULT_K})")
    parser.add_argument("--out", default=None,
                        help=f"output folder (default ./{BENCH_DEFAULTS['out']} in the working directory)")
    parser.add_argument("--in-domain", nargs="?", const="zoo", default=None, choices=IN_DOMAIN_CHOICES, metavar="FAMILY",
                        help="also run, for each prompt, the shipped drafter of its category: zoo (the default; system "
                             "'in-domain'), eagle (the white-box head, eagle:NAME; system 'in-domain-eagle') or both")
    parser.add_argument("--in-domain-lookup", nargs="?", const="zoo", default=None, choices=IN_DOMAIN_CHOICES, metavar="FAMILY",
                        help="the same behind prompt lookup (lookup:DRAFTER; systems 'in-domain+lookup', 'in-domain-eagle+lookup')")
    policies = parser.add_argument_group("policies (bench/policies.py): drafter selection on a shuffled, mixed stream")
    policies.add_argument("--policies", default=None,
                          help="comma-separated policies, e.g. metasd-ucb,ucb-be,thompson,oracle; switches to the policy benchmark")
    policies.add_argument("--pool", default=None,
                          help="drafters the policies choose among (default: every shipped white-box head behind prompt lookup and ngram, for the default target); "
                               "'white-box' stands for every shipped head (eagle:NAME), 'mixed' for those, lookup:code and ngram")
    policies.add_argument("--beta", type=float, default=DEFAULT_BETA, help=f"UCB exploration weight (default {DEFAULT_BETA})")
    policies.add_argument("--probe-rounds", type=int, default=DEFAULT_PROBE_ROUNDS,
                          help=f"ucb-replay: rounds in which every drafter is replayed on the target's tokens (default {DEFAULT_PROBE_ROUNDS})")
    policies.add_argument("--store", default="memory", help="session store: memory (default) or redis://HOST:PORT/DB")
    policies.add_argument("--seed", type=int, default=0, help="seed of the prompt shuffle and the policies")
    add_bench_online_arguments(parser)  # --online and its options (bench/online_args.py)


def resolve_bench_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the side-by-side and policy benchmarks' defaults of the options --online shares."""
    for name, value in BENCH_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def run_bench(args: argparse.Namespace, settings) -> int:
    """``specpool bench``: --online, --policies, or the side-by-side benchmark."""
    if getattr(args, "online", False):
        return run_online_bench(online_args_from_bench(args), settings)
    resolve_bench_defaults(args)
    if args.policies is not None:
        return run_policy_bench(args, settings)
    return run_speed_bench(args, settings)
