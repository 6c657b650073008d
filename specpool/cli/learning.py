"""Command-line pieces of online learning, for specpool/cli/main.py to mount:

- ``add_learning_arguments(parser)`` + ``learning_config_from_args(args)``: ``--learn`` and its
  options on ``specpool generate`` (embedded mode: ``EmbeddedEngine(..., learning=config)``);
- ``add_learner_command(commands)`` + ``run_learner_command(args, settings)``: ``specpool learner``,
  the served-mode learner process reading the Redis feedback stream;
- ``check_learning_store``, ``learning_versions``, ``finish_learning``, ``learning_line``: what
  ``cmd_generate`` does around one request with ``--learn`` (check before the model load, the
  versions the request drafts with, apply and publish its feedback at the end, the summary).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
from dataclasses import replace

from specpool.core.defaults import DEFAULT_DRAFTER
from specpool.core.errors import InvalidArgument, NotFound, StoreUnavailable, check


def add_learning_arguments(parser: argparse.ArgumentParser, flag: bool = True) -> None:
    """The learning options. ``flag`` True (``generate``): behind ``--learn``, with the aliases
    ``--learner-algo`` and ``--model-store``; False (``learner``): always on, with the short names
    ``--algo``, ``--store``, ``--lr``, ... besides the ``--learn-*`` ones."""
    from specpool.learning.online import ALGORITHMS, SUPERVISION, OnlineConfig

    group = parser.add_argument_group("online learning (drafters learn from verification feedback)")

    def names(long: str, short: str | None = None, alias: str | None = None) -> list[str]:
        if not flag and short:
            return [short, long]
        return [long] + ([alias] if flag and alias else [])

    if flag:
        group.add_argument("--learn", action="store_true",
                           help="train the zoo drafters in use online, in a background thread, and publish the "
                                "learned versions to the model store (the next run drafts with them)")
    group.add_argument(*names("--learn-algorithm", "--algo", "--learner-algo"), dest="learn_algorithm",
                       choices=ALGORITHMS, default="ogd",
                       help="online algorithm: ogd, optimistic (optimistic OGD) or hedge (ensemble of step sizes); default ogd")
    online = OnlineConfig()  # its defaults are the options' defaults
    group.add_argument(*names("--learn-lr", "--lr"), dest="learn_lr", type=float, default=None, metavar="LR",
                       help=f"step size of ogd / optimistic (default {online.lr})")
    group.add_argument(*names("--learn-hedge-lrs", "--hedge-lrs"), dest="learn_hedge_lrs", default=None, metavar="LRS",
                       help=f"comma-separated step sizes of the hedge members (default {','.join(map(str, online.hedge_lrs))})")
    group.add_argument(*names("--learn-precondition", "--precondition"), dest="learn_precondition", default=None,
                       choices=("adagrad", "none"),
                       help=f"adagrad: per-coordinate step sizes; none: one global step (default {online.precondition})")
    group.add_argument(*names("--learn-grow-vocab", "--grow-vocab"), dest="learn_grow_vocab", type=int, default=None, metavar="N",
                       help=f"tokens a drafter variant may add to its vocabulary from the target's feedback (default {online.grow_vocab})")
    group.add_argument(*names("--learn-copy-window", "--copy-window"), dest="learn_copy_window", type=int, default=None, metavar="N",
                       help="give the learnt drafters a copy term: a learned weight on the tokens of the last N "
                            f"inputs, starting at 0 (default {online.copy_window}: none; 64 helped on prose)")
    group.add_argument(*names("--learn-merge-records", "--merge-records"), dest="learn_merge_records",
                       action=argparse.BooleanOptionalAction, default=None,
                       help="fit the feedback records of one session that line up as one sequence (they share "
                            f"most of their context: the learner's cost drops several-fold) (default {online.merge_records})")
    group.add_argument(*names("--learn-detach-context", "--detach-context"), dest="learn_detach_context",
                       action=argparse.BooleanOptionalAction, default=None,
                       help="backpropagate through the draft positions only, the context being a KV cache "
                            f"computed without gradients (cheaper steps) (default {online.detach_context})")
    group.add_argument(*names("--learn-trainable-blocks", "--trainable-blocks"), dest="learn_trainable_blocks", type=int,
                       default=None, metavar="N",
                       help="train only the last N transformer blocks of a drafter (with its output bias and final "
                            "norm; 0: those alone) (default: every block)")
    group.add_argument(*names("--learn-supervision", "--supervision"), dest="learn_supervision", default=None,
                       choices=SUPERVISION,
                       help="what drafters are fit to: distribution (the target's top-K p; right for sampled "
                            "traffic) or argmax (its most likely token; for greedy traffic) "
                            f"(default {online.supervision})")
    group.add_argument(*names("--learn-store", "--store", "--model-store"), dest="learn_store", default=None, metavar="PATH",
                       help="model store: a folder or file:// URI (default $SPECPOOL_HOME/online)")
    group.add_argument(*names("--learn-shared", "--shared"), dest="learn_shared", action="store_true",
                       help="one shared drafter variant for all tenants (default: one per tenant)")
    group.add_argument(*names("--learn-opt-out", "--opt-out"), dest="learn_opt_out", default="", metavar="TENANTS",
                       help="comma-separated tenants whose feedback is never used")
    group.add_argument(*names("--learn-budget-records", "--budget-records"), dest="learn_budget_records", type=int, default=0, metavar="N",
                       help="feedback records one tenant may train on (0: no limit)")
    group.add_argument(*names("--learn-budget-tokens", "--budget-tokens"), dest="learn_budget_tokens", type=int, default=0, metavar="N",
                       help="draft positions one tenant may train on (0: no limit)")
    group.add_argument(*names("--learn-batch-records", "--batch-records"), dest="learn_batch_records", type=int, default=1, metavar="N",
                       help="feedback records per gradient step (default 1)")
    group.add_argument(*names("--learn-publish-every", "--publish-every"), dest="learn_publish_every", type=int, default=32, metavar="N",
                       help="records of a variant between published versions (default 32)")
    group.add_argument(*names("--learn-commit-after-s", "--commit-after-s"), dest="learn_commit_after_s", type=float,
                       default=30.0, metavar="S",
                       help="or publish this many seconds after a variant's first unpublished record, "
                            "whichever comes first (default 30)")
    if flag:
        group.add_argument("--learn-feedback", default=None, metavar="URL",
                           help="a Redis URL: send the feedback to a stream there for a separate `specpool learner` "
                                "(same --learn-store) instead of learning in this process")
        group.add_argument("--learn-stream", default="specpool:feedback", metavar="KEY",
                           help="with --learn-feedback: the stream key (default specpool:feedback)")


def learning_config_from_args(args: argparse.Namespace, drafters: tuple[str, ...] | None = None, **settings):
    """The LearningConfig the options describe (``settings``: other LearningConfig fields), or
    None when ``--learn`` is off."""
    from specpool.learning.learning_config import LearningConfig
    from specpool.learning.online import OnlineConfig, parse_step_sizes

    if not getattr(args, "learn", True):
        return None
    online = OnlineConfig(algorithm=args.learn_algorithm)
    if args.learn_lr is not None:
        online = replace(online, lr=args.learn_lr)
    if args.learn_hedge_lrs:
        online = replace(online, hedge_lrs=parse_step_sizes(args.learn_hedge_lrs))
    if getattr(args, "learn_precondition", None) is not None:
        online = replace(online, precondition=args.learn_precondition)
    if getattr(args, "learn_grow_vocab", None) is not None:
        online = replace(online, grow_vocab=args.learn_grow_vocab)
    if getattr(args, "learn_supervision", None) is not None:
        online = replace(online, supervision=args.learn_supervision)
    if getattr(args, "learn_copy_window", None) is not None:
        online = replace(online, copy_window=args.learn_copy_window)
    for option in ("merge_records", "detach_context", "trainable_blocks"):
        if getattr(args, f"learn_{option}", None) is not None:
            online = replace(online, **{option: getattr(args, f"learn_{option}")})
    online.validate()
    check(args.learn_budget_records >= 0 and args.learn_budget_tokens >= 0, "learning budgets must be >= 0")
    check(args.learn_publish_every >= 1, f"--learn-publish-every must be >= 1, got {args.learn_publish_every}")
    check(args.learn_commit_after_s > 0, f"--learn-commit-after-s must be > 0, got {args.learn_commit_after_s}")
    check(args.learn_batch_records >= 1, f"--learn-batch-records must be >= 1, got {args.learn_batch_records}")
    if getattr(args, "learn_feedback", None) is not None:
        settings = {"feedback_url": args.learn_feedback, "feedback_stream": args.learn_stream, **settings}
    return LearningConfig(
        online=online, store=args.learn_store, shared_pool=args.learn_shared,
        opt_out=frozenset(t.strip() for t in args.learn_opt_out.split(",") if t.strip()),
        budget_records=args.learn_budget_records, budget_tokens=args.learn_budget_tokens,
        publish_every=args.learn_publish_every, commit_after_s=args.learn_commit_after_s,
        batch_records=args.learn_batch_records, drafters=drafters, **settings,
    )


def add_learner_command(commands) -> argparse.ArgumentParser:
    learner = commands.add_parser(
        "learner", help="served mode: train drafters from the Redis feedback stream and publish versions",
        description="Reads verification feedback from a Redis stream as a consumer-group member, trains the drafters' "
                    "per-tenant variants online (zoo drafters and white-box heads, behind prompt lookup too), publishes "
                    "versions to the model store (rolling back a version whose held-out BD regresses) and acknowledges "
                    "records once committed.")
    learner.add_argument("--redis", default="redis://127.0.0.1:6379/0", metavar="URL", help="Redis URL of the feedback stream (default redis://127.0.0.1:6379/0)")
    learner.add_argument("--stream", default="specpool:feedback", help="stream key (default specpool:feedback)")
    learner.add_argument("--group", default="learners", help="consumer group (default learners)")
    learner.add_argument("--consumer", default=None,
                         help="this learner's consumer name (default learner-<hostname>: a restarted learner takes back "
                              "its own unacknowledged records at once)")
    learner.add_argument("--max-variants", type=int, default=64, metavar="N",
                         help="tenant variants held in memory; the least recently used is committed and dropped (default 64)")
    learner.add_argument("--drafters", default=None,
                         help="comma-separated drafters to train (default: the default pool's heads behind prompt lookup, "
                              f"{DEFAULT_DRAFTER} first, and every shipped zoo drafter); others are ignored")
    learner.add_argument("--once", action="store_true", help="process what the stream holds, commit, and exit")
    learner.add_argument("--max-records", type=int, default=None, metavar="N",
                         help="exit after N records (recovered ones included), committing first")
    learner.add_argument("--claim-idle-s", type=float, default=60.0, metavar="S",
                         help="take over records another consumer left unacknowledged this long (default 60)")
    learner.add_argument("--no-progress", action="store_true",
                         help="no progress bar on a terminal; log lines instead (as when stderr is not a terminal)")
    learner.add_argument("--report-every-s", type=float, default=60.0, metavar="S",
                         help="without a progress bar: log the counters this often (default 60)")
    add_learning_arguments(learner, flag=False)
    return learner


@contextlib.contextmanager
def _redis_hint(why: str, alternative: str):
    """An unreachable feedback Redis: one line saying why it is needed and what to do."""
    try:
        yield
    except StoreUnavailable as exc:
        raise StoreUnavailable(f"{exc}; {why}: start redis-server (redis-server --daemonize yes) or {alternative}") from None


def _summary(learner) -> str:
    """One line: the counters that moved and each variant's serving version."""
    c = learner.counters
    records = [f"{c['applied']} applied", f"{c['held_out']} held out"]
    records += [f"{c[k]} {k.replace('_', ' ')}" for k in ("trained_after_holdout", "duplicates", "rejected", "opted_out", "over_budget",
                                                           "not_learnable", "dead_lettered", "errors") if c[k]]
    parts = [f"{c['processed']} records ({', '.join(records)}), {c['acked']} acknowledged",
             f"versions: {c['published']} published, {c['promoted']} promoted, {c['rollbacks']} rolled back"]
    if learner.rejected:
        parts.append("rejected: " + ", ".join(f"{n} {reason}" for reason, n in sorted(learner.rejected.items())))
    serving = [f"{key.scope}/{key.drafter} v{variant.serving_version}" for key, variant in sorted(
        learner.variants.items(), key=lambda kv: (kv[0].scope, kv[0].drafter))]
    if serving:
        parts.append("serving " + ", ".join(serving))
    return "; ".join(parts)


def _show_bar(args: argparse.Namespace) -> bool:
    """A bar on a terminal; in a log (a service, a pipe) a progress line every --report-every-s."""
    return not args.no_progress and sys.stderr.isatty()


def _progress_bar(args: argparse.Namespace):
    """A tqdm bar over records, with the counters that matter; returns (on_progress, close)."""
    from tqdm import tqdm

    bar = tqdm(total=args.max_records, desc="learner", unit=" records", file=sys.stderr, dynamic_ncols=True,
               disable=not _show_bar(args))

    def on_progress(learner) -> None:
        c = learner.counters
        bar.update(c["processed"] - bar.n)
        bar.set_postfix_str(f"applied={c['applied']} held_out={c['held_out']} rejected={c['rejected']} "
                            f"published={c['published']} rollbacks={c['rollbacks']}", refresh=True)

    return on_progress, bar.close


def default_learned(target: str) -> tuple[str, ...]:
    """What `specpool learner` trains without --drafters: the model drafters of the default pool
    (for the heads' own target, every shipped head behind prompt lookup: what `specpool serve`
    deploys), then every shipped zoo drafter (pools that name them). Prompt lookup and n-gram
    have no weights."""
    from specpool.drafters.zoo import shipped_names
    from specpool.services.engine import default_pool

    learned = [name for name in default_pool(target) if name.partition(":")[0] not in ("ngram", "none")]
    return tuple(dict.fromkeys([*learned, *shipped_names()]))


def run_learner_command(args: argparse.Namespace, settings) -> int:
    """``specpool learner``: the served learner process on the Redis feedback stream, until stopped
    (SIGTERM, Ctrl-C), or ``--once`` the stream is empty, or ``--max-records`` are processed."""
    from specpool.learning.feedback_redis import RedisFeedbackStream
    from specpool.learning.model_store import open_model_store
    from specpool.drafters.registry import DrafterContext, known_spec
    from specpool.drafters.zoo import shipped_names
    from specpool.learning.learner_process import registry_base_models, run_learner
    from specpool.target.models import DEFAULT_TARGET

    drafters = tuple(d.strip() for d in args.drafters.split(",") if d.strip()) if args.drafters \
        else default_learned(getattr(args, "target", DEFAULT_TARGET))
    check(bool(drafters), "no drafters to train: give --drafters")
    for name in drafters:
        if not known_spec(name):
            raise NotFound(f"unknown drafter {name!r} in --drafters; the learner trains zoo drafters "
                           f"({', '.join(shipped_names())} or zoo:PATH) and white-box heads (eagle:NAME or eagle:PATH), "
                           "either behind prompt lookup (lookup:eagle:general, lookup:eagle-alt:general)")
    check(args.max_records is None or args.max_records >= 1, f"--max-records must be >= 1, got {args.max_records}")
    check(args.claim_idle_s >= 0, f"--claim-idle-s must be >= 0, got {args.claim_idle_s}")
    check(args.report_every_s > 0, f"--report-every-s must be > 0, got {args.report_every_s}")
    check(args.max_variants >= 1, f"--max-variants must be >= 1, got {args.max_variants}")
    config = learning_config_from_args(args, drafters, claim_idle_s=args.claim_idle_s, max_variants=args.max_variants)
    store = open_model_store(config.store or (settings.home / "online"))  # a bad URI fails before Redis
    with _redis_hint("the learner reads its feedback there", "give --redis URL"):
        stream = RedisFeedbackStream(args.redis, stream=args.stream, group=args.group)
    # --target/--device/--dtype: cli.py's _add_model_options on the learner parser.
    context = DrafterContext(settings.home, getattr(args, "target", DEFAULT_TARGET), getattr(args, "device", "cpu"),
                             getattr(args, "dtype", "auto"))
    consumer = args.consumer or f"learner-{socket.gethostname()}"
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    specpool_log = logging.getLogger("specpool")
    log_level = specpool_log.level
    specpool_log.setLevel(logging.WARNING if _show_bar(args) else logging.INFO)
    mode = "until the stream is empty" if args.once else "until stopped (Ctrl-C)"
    if args.max_records is not None:
        mode = f"for at most {args.max_records} records" + (", or until the stream is empty" if args.once else "")
    print(f"specpool learner {consumer}: {args.learn_algorithm} on {', '.join(drafters)}; reading {stream.describe} "
          f"(group {args.group}), publishing to {store.describe}; {mode}", file=sys.stderr, flush=True)
    on_progress, close_bar = _progress_bar(args)
    try:
        learner = run_learner(config, stream, store, registry_base_models(context, drafters), consumer, stop,
                              report_every_s=args.report_every_s, once=args.once, max_records=args.max_records,
                              on_progress=on_progress)
    finally:
        close_bar()
        specpool_log.setLevel(log_level)
        for s, handler in previous.items():
            signal.signal(s, handler)
        stream.close()
    print(f"specpool learner {consumer}: stopped; {_summary(learner)}", file=sys.stderr, flush=True)
    return 0


# --- specpool generate --learn -------------------------------------------------------------------


def check_learning_store(config) -> None:
    """A model store URI nobody can open, or a feedback Redis nobody can reach, fails before the
    (slow) model load."""
    if config is None:
        return
    if config.store is not None:
        from specpool.learning.model_store import open_model_store

        open_model_store(config.store)
    if config.feedback_url is not None:
        from specpool.learning.feedback_redis import RedisFeedbackStream

        with _redis_hint("--learn-feedback sends feedback there", "learn in this process (no --learn-feedback)"):
            RedisFeedbackStream(config.feedback_url, stream=config.feedback_stream).close()


def learning_versions(engine, tenant: str, specs) -> dict[str, int]:
    """The version of each learnable drafter that a request of ``tenant`` starting now drafts with.
    A checkpoint in the store that this run's algorithm cannot continue is an error, before generating."""
    from specpool.learning.hot_swap import learnable
    from specpool.learning.model_store import VariantKey
    from specpool.learning.learner_checkpoint import checkpoint_conflict
    from specpool.learning.learning_config import scope_for

    learning = engine.learning
    scope = scope_for(learning.config, tenant)
    versions = {}
    for spec in specs:
        if not learnable(engine.drafter(spec)) or (learning.config.drafters is not None and spec not in learning.config.drafters):
            continue
        key = VariantKey(scope, spec)
        if tenant not in learning.config.opt_out and not learning.external:  # (an opted-out tenant never trains)
            conflict = checkpoint_conflict(learning.config.online, learning.store.load_state(key), key, learning.store.describe)
            if conflict is not None:
                raise InvalidArgument(conflict)
        versions[spec] = learning.store.serving(key) or 0
    return versions


def finish_learning(engine, tenant: str, before: dict[str, int], timeout_s: float = 300.0) -> dict:
    """Apply the request's feedback, commit, stop the learner thread; the stats ``generate`` shows."""
    from specpool.learning.model_store import VariantKey
    from specpool.learning.learning_config import scope_for

    learning = engine.learning
    committed = learning.commit_now(timeout_s)
    learning.close()
    scope = scope_for(learning.config, tenant)
    stats = {
        "store": learning.store.describe,
        "opted_out": tenant in learning.config.opt_out,
        "records": learning.emitter.emitted,
        "versions": {spec: {"drafted_with": version, "serving": learning.store.serving(VariantKey(scope, spec)) or 0}
                     for spec, version in before.items()},
    }
    if learning.external:  # a `specpool learner` elsewhere applies them
        return {**stats, "feedback": learning.stream.describe, "dropped": learning.stream.dropped}
    c = learning.learner.counters
    return {
        **stats, "algorithm": learning.config.online.algorithm,
        "applied": c["applied"], "held_out": c["held_out"], "over_budget": c["over_budget"],
        "published": c["published"], "promoted": c["promoted"], "rollbacks": c["rollbacks"],
        "committed": committed,
    }


def learning_line(stats: dict, tenant: str) -> str:
    if not stats["versions"]:
        return "[learn: no zoo drafter in use, nothing to learn]"
    if stats["opted_out"]:
        return f"[learn: tenant {tenant} opted out, no feedback used]"
    if "feedback" in stats:
        versions = ", ".join(f"{spec} v{v['drafted_with']}" for spec, v in stats["versions"].items())
        dropped = f" ({stats['dropped']} dropped: Redis failed)" if stats["dropped"] else ""
        return (f"[learn: {stats['records']} feedback records sent to {stats['feedback']}{dropped} for `specpool learner`; "
                f"tenant {tenant} drafted with {versions}; store {stats['store']}]")
    versions = ", ".join(f"{spec} v{v['drafted_with']} -> v{v['serving']}" for spec, v in stats["versions"].items())
    return (f"[learn ({stats['algorithm']}): {stats['records']} feedback records, {stats['applied']} applied, "
            f"{stats['held_out']} held out, {stats['published']} published, {stats['rollbacks']} rolled back; "
            f"tenant {tenant}: {versions}; store {stats['store']}]")
