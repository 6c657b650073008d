"""Command-line pieces of online learning, for services/cli.py to mount:

- ``add_learning_arguments(parser)`` + ``learning_config_from_args(args)``: ``--learn`` and its
  options on ``specpool generate`` (embedded mode: ``EmbeddedEngine(..., learning=config)``);
- ``add_learner_command(commands)`` + ``run_learner_command(args, settings)``: ``specpool learner``,
  the served-mode learner process reading the Redis feedback stream.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from router.errors import check

ALGORITHMS = ("ogd", "optimistic", "hedge")


def add_learning_arguments(parser: argparse.ArgumentParser, flag: bool = True) -> None:
    group = parser.add_argument_group("online learning (drafters learn from verification feedback)")
    if flag:
        group.add_argument("--learn", action="store_true", help="train zoo drafters online in a background thread")
    group.add_argument("--learn-algorithm", choices=ALGORITHMS, default="ogd", help="online algorithm (default ogd)")
    group.add_argument("--learn-lr", type=float, default=None, help="step size of ogd / optimistic")
    group.add_argument("--learn-hedge-lrs", default=None, help="comma-separated step sizes of the hedge members")
    group.add_argument("--learn-store", default=None, help="model store folder or file:// URI (default <home>/online)")
    group.add_argument("--learn-shared", action="store_true", help="one shared drafter variant for all tenants")
    group.add_argument("--learn-opt-out", default="", help="comma-separated tenants whose feedback is never used")
    group.add_argument("--learn-budget-records", type=int, default=0, help="records one tenant may train on (0: no limit)")
    group.add_argument("--learn-budget-tokens", type=int, default=0, help="positions one tenant may train on (0: no limit)")
    group.add_argument("--learn-publish-every", type=int, default=32, help="records between published versions (default 32)")


def learning_config_from_args(args: argparse.Namespace, drafters: tuple[str, ...] | None = None):
    """The LearningConfig the options describe, or None when ``--learn`` is off."""
    from dataclasses import replace

    from drafters.online import OnlineConfig
    from services.learner import LearningConfig

    if not getattr(args, "learn", True):
        return None
    online = OnlineConfig(algorithm=args.learn_algorithm)
    if args.learn_lr is not None:
        online = replace(online, lr=args.learn_lr)
    if args.learn_hedge_lrs:
        online = replace(online, hedge_lrs=tuple(float(x) for x in args.learn_hedge_lrs.split(",") if x.strip()))
    online.validate()
    check(args.learn_budget_records >= 0 and args.learn_budget_tokens >= 0, "learning budgets must be >= 0")
    check(args.learn_publish_every >= 1, f"--learn-publish-every must be >= 1, got {args.learn_publish_every}")
    return LearningConfig(
        online=online, store=args.learn_store, shared_pool=args.learn_shared,
        opt_out=frozenset(t.strip() for t in args.learn_opt_out.split(",") if t.strip()),
        budget_records=args.learn_budget_records, budget_tokens=args.learn_budget_tokens,
        publish_every=args.learn_publish_every, drafters=drafters,
    )


def add_learner_command(commands) -> argparse.ArgumentParser:
    learner = commands.add_parser("learner", help="served mode: train drafters from the Redis feedback stream")
    learner.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL of the feedback stream")
    learner.add_argument("--stream", default="specpool:feedback", help="stream key (default specpool:feedback)")
    learner.add_argument("--group", default="learners", help="consumer group (default learners)")
    learner.add_argument("--consumer", default=None, help="this learner's consumer name (default learner-<pid>)")
    learner.add_argument("--drafters", default=None,
                         help="comma-separated drafters to train (default: every shipped zoo drafter); others are ignored")
    add_learning_arguments(learner, flag=False)
    return learner


def run_learner_command(args: argparse.Namespace, settings) -> int:
    import os

    from drafters.feedback_redis import RedisFeedbackStream
    from drafters.model_store import open_model_store
    from drafters.registry import DrafterContext
    from drafters.zoo import shipped_names
    from services.learner import registry_base_models, run_learner

    drafters = tuple(d.strip() for d in args.drafters.split(",") if d.strip()) if args.drafters else tuple(shipped_names())
    check(bool(drafters), "no drafters to train: give --drafters")
    config = learning_config_from_args(args, drafters)
    stream = RedisFeedbackStream(args.redis, stream=args.stream, group=args.group)
    store = open_model_store(config.store or (settings.home / "online"))
    from target.models import DEFAULT_TARGET

    # --target/--device/--dtype: cli.py's _add_model_options on the learner parser.
    context = DrafterContext(settings.home, getattr(args, "target", DEFAULT_TARGET), getattr(args, "device", "cpu"),
                             getattr(args, "dtype", "auto"))
    consumer = args.consumer or f"learner-{os.getpid()}"
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    print(f"specpool learner {consumer}: {args.learn_algorithm} on {', '.join(drafters)}; reading {stream.describe}, "
          f"publishing to {store.describe} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        learner = run_learner(config, stream, store, registry_base_models(context, drafters), consumer, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stream.close()
    print(f"specpool learner {consumer}: stopped; {learner.counters}", file=sys.stderr)
    return 0
