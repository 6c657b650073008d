"""Served mode: the learner as its own process (``specpool learner``, specpool/cli/learning.py).

``run_learner`` is the process's main loop over a feedback source - in production the Redis
stream's consumer group (specpool/learning/feedback_redis.py): it takes over what a dead consumer
left pending, then reads, trains and publishes through a ``Learner``
(specpool/learning/learner_loop.py) until stopped. ``registry_base_models`` gives it the shipped
network of each drafter it may train, built once through the drafter registry.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

from torch import nn

from specpool.core.errors import InvalidArgument, StoreUnavailable
from specpool.drafters.registry import DrafterContext, create_drafter
from specpool.learning.feedback import FeedbackSource
from specpool.learning.hot_swap import network_of
from specpool.learning.learner_loop import Learner
from specpool.learning.learning_config import LearningConfig
from specpool.learning.model_store import ModelStore

log = logging.getLogger("specpool.learner")

# Fault injection for the durability tests: seconds to sleep between writing a commit's checkpoint
# and acknowledging its records (tests/integration/test_learner_durability.py kills the process there).
PAUSE_BEFORE_ACK_ENV = "SPECPOOL_LEARNER_PAUSE_BEFORE_ACK_S"


def registry_base_models(context: DrafterContext, allowed: Sequence[str]) -> Callable[[str], nn.Module | None]:
    """Drafter name -> its shipped network, built once through the drafter registry.

    Only names in ``allowed`` are ever built: a record names its drafter, and a record must not
    make the learner load an arbitrary model (``hf:some/hub-model``)."""
    allowed_names = set(allowed)
    built: dict[str, nn.Module | None] = {}

    def base(name: str) -> nn.Module | None:
        if name not in allowed_names:
            return None
        if name not in built:
            built[name] = network_of(create_drafter(name, context))
            if built[name] is None:
                log.warning("learner: drafter %s does not learn online; its feedback is ignored", name)
        return built[name]

    return base


def run_learner(config: LearningConfig, source: FeedbackSource, store: ModelStore,
                base_model: Callable[[str], nn.Module | None], consumer: str,
                stop: threading.Event, report_every_s: float = 60.0, *, once: bool = False,
                max_records: int | None = None, on_progress: Callable[[Learner], None] | None = None,
                retry_after_s: float = 5.0) -> Learner:
    """The served learner's main loop (``specpool learner``): recover what a dead consumer left,
    then read, train and publish until ``stop`` is set; commits what it applied before returning.

    ``once``: stop as soon as the stream has nothing new (what a test or a cron job wants).
    ``max_records``: stop after that many records (recovered ones included; it never reads more).
    ``on_progress(learner)`` is called after every batch. While running until stopped, a feedback
    stream that becomes unreachable (``StoreUnavailable``) is retried every ``retry_after_s``; with
    ``once`` it ends the run (after committing what was applied). Records left pending by a dead
    consumer are taken over at start and then every ``claim_idle_s``."""
    if max_records is not None and max_records < 1:
        raise InvalidArgument(f"max_records must be >= 1, got {max_records}")
    learner = Learner(config, source, store, base_model, consumer=consumer)
    learner.pause_before_ack_s = float(os.environ.get(PAUSE_BEFORE_ACK_ENV) or 0.0)

    def remaining() -> int | None:
        return None if max_records is None else max_records - learner.counters["processed"]

    def done() -> bool:
        left = remaining()
        return stop.is_set() or (left is not None and left <= 0)

    try:
        recovered = learner.recover(remaining())
        log.info("learner %s: reading %s, publishing to %s; %d records recovered", consumer, source.describe,
                 store.describe, recovered)
        if on_progress is not None:
            on_progress(learner)
        last_report = last_recover = time.monotonic()
        while not done():
            try:
                if time.monotonic() - last_recover >= max(config.claim_idle_s, 1.0):
                    last_recover = time.monotonic()
                    learner.recover(remaining())
                n = learner.poll(0.0 if once else None, remaining())
            except StoreUnavailable as exc:
                if once:
                    raise
                learner.counters["errors"] += 1
                log.error("learner %s: %s; retrying in %.0f s", consumer, exc, retry_after_s)
                stop.wait(retry_after_s)
                continue
            if on_progress is not None and n:
                on_progress(learner)
            if once and n == 0:
                break
            if time.monotonic() - last_report >= report_every_s:
                last_report = time.monotonic()
                log.info("learner %s: %s", consumer, {k: v for k, v in learner.counters.items() if v})
    except BaseException:
        try:  # keep what was applied; records not committed stay pending and come back
            learner.flush()
        except Exception as exc:  # noqa: BLE001 - the first error is the one to report
            log.error("learner %s: final commit failed: %s", consumer, exc)
        raise
    learner.flush()
    if on_progress is not None:
        on_progress(learner)
    return learner
