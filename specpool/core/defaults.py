"""Defaults and limits, each written once (docs/ARCHITECTURE.md, "Defaults and limits").

Every layer takes these names: the CLI's argparse defaults, the served router's arguments, the
embedded engine, the policies and the request checks. Changing a value here changes it in both
modes and in the help texts. Standard library only.
"""

from __future__ import annotations

# -- models ----------------------------------------------------------------------------------------
DEFAULT_TARGET = "smollm2-135m-instruct"  # the embedded default target (specpool.target.models fetches it)
# `specpool generate`'s drafter when none is named, for DEFAULT_TARGET: prompt lookup, then the
# shipped general white-box head, its chain with runner-up leaves in greedy rounds, drafted with int8
# kernels on a CPU (README, "White-box drafters": ahead of ngram, of the head's plain chain, and of
# the same leaves in float32, per prompt on the dev and on our own held-out prompts). Other targets
# get FALLBACK_DRAFTER: the heads read this target's features.
DEFAULT_DRAFTER = "lookup:eagle-alt-int8:general"
FALLBACK_DRAFTER = "ngram"

# -- a request -------------------------------------------------------------------------------------
DEFAULT_K = 5  # draft length per round: past ~5 a CPU verify costs more than the extra tokens win
MAX_DRAFT_LENGTH = 32  # longest draft a request may ask for; well past where any drafter pays off
DEFAULT_MAX_NEW_TOKENS = 128  # new tokens when a request does not say (or says 0 over gRPC)
DEFAULT_TENANT = "default"  # the tenant of embedded requests and of served ones that name none
MAX_STOP_STRINGS = 16  # stop strings one request may give
MAX_STOP_CHARS = 256  # characters in one stop string

# -- drafter choice --------------------------------------------------------------------------------
# The served router's policy when a request names none (over a pool given by --pool; over the
# default pool, specpool.services.engine.default_policy). MetaSD's UCB with the tenant warm start:
# side by side over the shipped white-box pool, on a shuffled stream of mixed categories under one
# tenant (the case least kind to a prior), it was closer to the oracle than cold-start UCB in all 16
# headline ratios of two runs, held-out 0.977 against 0.939 (bench/results/white-box-warm-policies/).
DEFAULT_POLICY = "metasd-ucb+warm"
DEFAULT_BETA = 0.2  # UCB exploration weight β; tuned on bench/bandit_sim.py (BD has variance ≤ α(1−α)/k)
DEFAULT_PROBE_ROUNDS = 4  # ucb-replay: a session's first rounds in which every drafter is replayed
