"""Online learning inside the embedded engine: ``EmbeddedLearning`` wires a feedback stream, a
``Learner`` (specpool/learning/learner_loop.py) on a background thread (``LearnerThread``) and
hot-swapped drafter slots (specpool/learning/hot_swap.py) into ``EmbeddedEngine(...,
learning=LearningConfig(...))`` (specpool/services/engine.py).

The engine's side of it is ``EmbeddedLearning(config, home)``, ``.prepare(tenant, drafters) ->
(drafters, feedback)``, ``.top_k`` and ``.close()``; its settings are ``LearningConfig``
(specpool/learning/learning_config.py). The learner's other parts: its loop and commit protocol
(specpool/learning/learner_loop.py), a variant's checkpoint (specpool/learning/learner_checkpoint.py)
and the served learner process (specpool/learning/learner_process.py).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Mapping

from torch import nn

from specpool.drafters.base import Drafter
from specpool.learning.feedback import FeedbackEmitter, InProcessFeedbackStream
from specpool.learning.feedback_redis import RedisFeedbackStream
from specpool.learning.hot_swap import DrafterSlot, learnable, network_of
from specpool.learning.learner_loop import Learner
from specpool.learning.learning_config import LearningConfig, scope_for
from specpool.learning.model_store import VariantKey, open_model_store
from specpool.router.loop import RoundFeedback


log = logging.getLogger("specpool.learner")


class LearnerThread:
    """Runs a ``Learner`` in the background (embedded mode). Other threads never touch the
    learner directly: ``commit_now`` asks this thread to commit and waits for it.

    ``continuous`` False: the thread learns only when asked (``commit_now``), never while
    requests run - the CPU-time behaviour of a learner in its own process on other cores."""

    def __init__(self, learner: Learner, continuous: bool = True):
        self.learner = learner
        self.continuous = continuous
        self._stop = threading.Event()
        self._commit_wanted = threading.Event()
        self._committed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specpool-learner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.learner.recover()
        except Exception:  # noqa: BLE001
            log.exception("learner: recovery failed")
        while not self._stop.is_set():
            try:
                if self.continuous:
                    self.learner.poll()
                elif not self._commit_wanted.wait(0.2):
                    continue
                if self._commit_wanted.is_set():
                    self._commit_wanted.clear()
                    self.learner.drain(max_polls=8 if self.continuous else None)
                    self._committed.set()
            except Exception:  # noqa: BLE001 - keep learning; a broken store shows in the log
                self.learner.counters["errors"] += 1
                log.exception("learner: poll failed")
                self._stop.wait(1.0)
        try:
            self.learner.flush()
        except Exception:  # noqa: BLE001
            log.exception("learner: final commit failed")

    def commit_now(self, timeout: float = 60.0) -> bool:
        """Process everything emitted so far and commit every variant; False on timeout."""
        self._committed.clear()
        self._commit_wanted.set()
        return self._committed.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


class EmbeddedLearning:
    """Online learning inside the embedded engine: stream, learner thread, hot-swap slots.

    The engine asks ``prepare`` at the start of each request: it pins, per drafter, the version
    this request will use (for this tenant's scope) and returns the feedback callback (None for
    an opted-out tenant). Rounds of learnable drafters then feed the stream; the learner thread
    trains and promotes; promotion refreshes the variant's slot, so the next request pins the
    new version.

    With ``config.feedback_url`` the records go to that Redis stream instead, for a learner in its
    own process (``specpool learner``) that publishes to the same model store; there is no learner
    here (``learner`` and ``thread`` are None), and slots check the store's serving version
    between requests.
    """

    def __init__(self, config: LearningConfig, home: Path, start: bool = True, continuous: bool = True):
        config.online.validate()
        self.config = config
        self.external = config.feedback_url is not None
        if self.external:
            self.stream = RedisFeedbackStream(config.feedback_url, stream=config.feedback_stream)
        else:
            self.stream = InProcessFeedbackStream(config.queue_capacity)
        self.store = open_model_store(config.store or (Path(home) / "online"))
        self.emitter = FeedbackEmitter(self.stream, config.context_tail)
        self._bases: dict[str, Drafter] = {}
        self._slots: OrderedDict[VariantKey, DrafterSlot] = OrderedDict()  # LRU, at most config.max_variants
        self._lock = threading.Lock()
        self.learner: Learner | None = None
        self.thread: LearnerThread | None = None
        if not self.external:
            self.learner = Learner(config, self.stream, self.store, self._base_model, on_promote=self._on_promote)
            self.thread = LearnerThread(self.learner, continuous)
            if start:
                self.thread.start()

    @property
    def top_k(self) -> int:
        return self.config.top_k

    def _wanted(self, name: str, drafter: Drafter) -> bool:
        return learnable(drafter) and (self.config.drafters is None or name in self.config.drafters)

    def _base_model(self, name: str) -> nn.Module | None:
        drafter = self._bases.get(name)
        return network_of(drafter) if drafter is not None else None

    def slot(self, tenant_scope: str, name: str) -> DrafterSlot | None:
        return self._slots.get(VariantKey(tenant_scope, name))

    def _slot(self, key: VariantKey, base: Drafter) -> DrafterSlot:
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                self._slots.move_to_end(key)
            else:
                # A request in flight keeps the drafter it pinned; the next one of an evicted
                # tenant makes a new slot from the store.
                while len(self._slots) >= self.config.max_variants:
                    self._slots.popitem(last=False)
                self._bases.setdefault(key.drafter, base)
                slot = self._slots[key] = DrafterSlot(key, base, self.store)  # type: ignore[arg-type]
                slot.refresh()  # a version promoted before this process started
            return slot

    def _on_promote(self, key: VariantKey, version: int) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            slot.refresh()

    def prepare(self, tenant: str, drafters: Mapping[str, Drafter]) -> tuple[dict[str, Drafter], Callable[[RoundFeedback], None] | None]:
        """Pin this request's drafter versions; returns (drafters to use, feedback callback)."""
        scope = scope_for(self.config, tenant)
        pinned: dict[str, Drafter] = {}
        versions: dict[str, int] = {}
        for name, drafter in drafters.items():
            if self._wanted(name, drafter):
                slot = self._slot(VariantKey(scope, name), drafter)
                if self.external:
                    slot.maybe_refresh()  # promoted by a learner elsewhere: nobody tells us
                versions[name], pinned[name] = slot.pin()
            else:
                pinned[name] = drafter
        if not versions or tenant in self.config.opt_out:
            return pinned, None
        emit = self.emitter

        def feedback(fb: RoundFeedback) -> None:
            version = versions.get(fb.drafter)
            if version is not None:
                emit(fb, tenant, version)

        return pinned, feedback

    def commit_now(self, timeout: float = 60.0) -> bool:
        """Let the learner apply everything emitted so far and commit (tests, benchmarks).
        False with an external learner (it commits on its own schedule)."""
        if self.thread is None:
            return False
        return self.thread.commit_now(timeout)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        if self.external:
            self.stream.close()
