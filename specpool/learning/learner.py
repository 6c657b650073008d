"""The learner worker: feedback records in, published drafter versions out.

It reads the feedback stream as a consumer group member (specpool/learning/feedback.py), applies each
record to its drafter *variant* with an online algorithm (specpool/learning/online.py), and every
``publish_every`` records (or ``commit_after_s`` seconds) *commits* the variant:

1. the variant's candidate weights are written to the model store as a new version;
2. the candidate and the serving version are scored by BD on held-out recent feedback (records
   picked by a hash of their id; the ``holdout_size`` most recent are kept, untrained, and one
   that leaves that window is trained on then, ``train_after_holdout``), paired position by
   position; a drop beyond
   ``rollback_bd_drop`` that is also significant (z below -``rollback_z``: small held-out sets
   are noisy) rolls the candidate back - it is marked in the store, the learner returns to the
   serving weights, and the rollback is counted and logged - otherwise it becomes the serving
   version;
3. the learner's checkpoint (weights, optimiser hints, Hedge weights, applied record ids, tenant
   budgets, held-out set) replaces the previous one;
4. only then are the variant's records acknowledged.

A crash anywhere before 4 loses the uncommitted effects *and* leaves their records unacknowledged,
so they are redelivered and applied to the checkpointed state: each record's effect counts once.
A record whose id the checkpoint already holds (a crash between 3 and 4, or a producer that sent it
twice) is acknowledged without a second effect.

Tenants: a record trains its tenant's own variant of the drafter (scope = tenant), or the shared
pool's (scope ``_shared``) when ``shared_pool`` is on; tenants in ``opt_out`` are never trained on;
``budget_records`` / ``budget_tokens`` cap what one tenant's feedback may train.

Embedded mode runs a ``Learner`` on a background thread (``EmbeddedLearning``, used by
``EmbeddedEngine(..., learning=LearningConfig(...))``); served mode runs the same ``Learner``
over ``RedisFeedbackStream`` in its own process.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from specpool.drafters.base import Drafter
from specpool.learning.feedback import (
    BadFeedback,
    Delivery,
    FeedbackEmitter,
    FeedbackLimits,
    FeedbackRecord,
    FeedbackSource,
    InProcessFeedbackStream,
)
from specpool.learning.hot_swap import DrafterSlot, learnable
from specpool.learning.model_store import SHARED_SCOPE, ModelStore, VariantKey, open_model_store
from specpool.learning.online import OnlineConfig, OnlineDrafterLearner, build_served_model, paired, record_bd
from specpool.drafters.zoo_model import ZooLM
from specpool.core.errors import InvalidArgument, ModelUnavailable, StoreUnavailable
from specpool.router.loop import RoundFeedback

log = logging.getLogger("specpool.learner")


@dataclass(frozen=True)
class LearningConfig:
    online: OnlineConfig = field(default_factory=OnlineConfig)  # algorithm and its step sizes
    store: str | None = None  # model store URI or folder; None: <home>/online
    top_k: int = 20  # entries of the target's p per position in a record
    context_tail: int = 64  # context tokens a record keeps
    queue_capacity: int = 4096  # embedded stream: undelivered records kept before the oldest drop
    batch_records: int = 1  # records of one variant per gradient step
    publish_every: int = 32  # applied records of a variant between commits (new versions)
    commit_after_s: float = 30.0  # ... or this long after its first uncommitted record
    holdout_every: int = 8  # one record in this many (by id hash) is held out: scored, not trained on ...
    holdout_size: int = 64  # ... while among the most recent held-out records kept per variant
    # A held-out record pushed out of that window is trained on then: no check scores it again, and
    # without this one record in holdout_every would never teach anything (12 % at the default).
    train_after_holdout: bool = True
    min_holdout: int = 16  # fewer held-out records than this: versions are promoted unchecked
    rollback_bd_drop: float = 0.02  # a candidate whose held-out BD is lower by more ...
    rollback_z: float = 2.0  # ... and significantly so (paired z over positions) is rolled back
    rollback_metric: str = "greedy"  # BD of greedy drafting (q one-hot) or "soft" (q = full softmax)
    budget_records: int = 0  # records one tenant may train on; 0 = unlimited
    budget_tokens: int = 0  # supervised positions one tenant may train on; 0 = unlimited
    shared_pool: bool = False  # True: every tenant trains (and is served) one shared variant
    opt_out: frozenset[str] = frozenset()  # tenants whose feedback is never used
    drafters: tuple[str, ...] | None = None  # drafters to train; None: every zoo drafter
    read_count: int = 32  # records per read
    read_block_s: float = 0.2  # how long an idle read waits
    claim_idle_s: float = 60.0  # pending records idle this long are reclaimed (another consumer died)
    max_deliveries: int = 5  # a record delivered more often is dropped as poison (counted)
    applied_ids_kept: int = 100_000  # record ids remembered per variant for idempotence
    limits: FeedbackLimits = field(default_factory=FeedbackLimits)
    # Embedded mode only. A Redis URL: emit the feedback to that stream for a learner process
    # (``specpool learner``) and learn nothing in this one; None: the in-process queue and thread.
    feedback_url: str | None = None
    feedback_stream: str = "specpool:feedback"  # the stream key at feedback_url


def checkpoint_conflict(online: OnlineConfig, state: dict | None, key: VariantKey, where: str) -> str | None:
    """Why a variant's stored learner checkpoint cannot go on under ``online`` - it was made by
    another algorithm, or by an ensemble of another size - or None when it can (or there is none)."""
    if state is None:
        return None
    learner = state.get("learner") or {}
    saved_config = learner.get("config") or {}
    saved = saved_config.get("algorithm")
    saved_members = len(learner.get("members") or ())
    members = len(online.hedge_lrs) if online.algorithm == "hedge" else 1

    def plural(n: int) -> str:
        return f"{n} member" + ("s" if n != 1 else "")

    if saved != online.algorithm or saved_members != members:
        return (f"the learner checkpoint of {key.scope}/{key.drafter} in the model store {where} was made by {saved} "
                f"({plural(saved_members)}), not {online.algorithm} ({plural(members)}); learn on with the algorithm "
                "it was trained with, or use another model store")
    saved_blocks = saved_config.get("trainable_blocks")
    if saved_blocks != online.trainable_blocks:
        # The optimiser state (AdaGrad sums, optimistic hints) holds one tensor per trained parameter.
        def blocks(n: int | None) -> str:
            return "every block" if n is None else f"the last {n} block(s)"

        return (f"the learner checkpoint of {key.scope}/{key.drafter} in the model store {where} trained "
                f"{blocks(saved_blocks)}, not {blocks(online.trainable_blocks)}; learn on with the setting it was "
                "trained with, or use another model store")
    return None


def is_held_out(record_id: str, every: int) -> bool:
    if every <= 1:
        return False
    return int.from_bytes(hashlib.sha1(record_id.encode()).digest()[:4], "big") % every == 0


def scope_for(config: LearningConfig, tenant: str) -> str:
    return SHARED_SCOPE if config.shared_pool else tenant


@dataclass
class _Variant:
    key: VariantKey
    learner: OnlineDrafterLearner
    base: ZooLM
    serving_version: int = 0
    applied: OrderedDict = field(default_factory=OrderedDict)  # record id -> None (bounded)
    usage: dict = field(default_factory=dict)  # tenant -> [records, tokens] trained on
    holdout: deque = field(default_factory=deque)  # recent held-out FeedbackRecords
    batch: list = field(default_factory=list)  # records waiting for a gradient step
    uncommitted: list = field(default_factory=list)  # entry ids to ack at the next commit
    uncommitted_ids: set = field(default_factory=set)  # the same, for lookups
    first_uncommitted: float = 0.0
    steps_since_commit: int = 0
    serving_model: tuple[int, object] | None = None  # (version, network) last built, saves a load per commit
    serving_bd: tuple[int, dict] | None = None  # (version, held-out record id -> its BD per position)


class Learner:
    """Consumes feedback, trains variants, publishes versions. Not thread-safe: one thread runs it."""

    def __init__(
        self,
        config: LearningConfig,
        source: FeedbackSource,
        store: ModelStore,
        base_model: Callable[[str], ZooLM | None],
        consumer: str = "learner-1",
        on_promote: Callable[[VariantKey, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        config.online.validate()
        if config.rollback_metric not in ("greedy", "soft"):
            raise InvalidArgument(f"rollback_metric is greedy or soft, not {config.rollback_metric!r}")
        self.config = config
        self.source = source
        self.store = store
        self.base_model = base_model  # drafter name -> its shipped network, or None (not learnable)
        self.consumer = consumer
        self.on_promote = on_promote
        self.clock = clock
        self.variants: dict[VariantKey, _Variant] = {}
        self.counters: dict[str, int] = {
            "read": 0, "processed": 0, "applied": 0, "held_out": 0, "trained_after_holdout": 0, "duplicates": 0,
            "rejected": 0, "opted_out": 0, "over_budget": 0, "not_learnable": 0, "dead_lettered": 0, "errors": 0, "steps": 0,
            "published": 0, "promoted": 0, "rollbacks": 0, "acked": 0,
        }
        self.rejected: dict[str, int] = {}  # reason -> count
        self.last_loss: dict[VariantKey, float] = {}
        self.history: list[dict] = []  # one row per commit: version, BD before/after, decision
        self.busy_s = 0.0  # wall time spent applying and committing (not waiting for records)
        self._conflicts: dict[VariantKey, str] = {}  # variants whose checkpoint another algorithm made

    # -- the loop --------------------------------------------------------------------------------

    def recover(self, limit: int | None = None) -> int:
        """Take over records another (crashed) consumer left unacknowledged; returns how many
        (at most ``limit``: the rest stay pending for a later call)."""
        total, cursor = 0, "0-0"
        while limit is None or total < limit:
            count = self.config.read_count if limit is None else min(self.config.read_count, limit - total)
            cursor, deliveries = self.source.claim_stale(self.consumer, self.config.claim_idle_s, count, cursor)
            for delivery in deliveries:
                self.process(delivery)
            total += len(deliveries)
            self.commit_due()
            if cursor == "0-0":
                break
        return total

    def poll(self, block_s: float | None = None, count: int | None = None) -> int:
        """Read and process one batch of records (at most ``count``, default ``read_count``),
        then commit the variants that are due."""
        block = self.config.read_block_s if block_s is None else block_s
        wanted = self.config.read_count if count is None else max(1, min(count, self.config.read_count))
        deliveries = self.source.read(self.consumer, wanted, block)
        started = time.perf_counter()
        for delivery in deliveries:
            self.process(delivery)
        self.commit_due()
        self.busy_s += time.perf_counter() - started
        return len(deliveries)

    def drain(self, max_polls: int | None = None) -> int:
        """Process what there is (at most ``max_polls`` reads: under steady traffic the stream
        is never empty), then commit every variant (tests, benchmarks, shutdown)."""
        total, polls = 0, 0
        while max_polls is None or polls < max_polls:
            n = self.poll(0.0)
            total, polls = total + n, polls + 1
            if n == 0:
                break
        self.flush()
        return total

    def flush(self) -> None:
        started = time.perf_counter()
        for variant in list(self.variants.values()):
            if variant.uncommitted or variant.batch:
                self.commit(variant)
        self.busy_s += time.perf_counter() - started

    # -- one record ------------------------------------------------------------------------------

    def _ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            self.source.ack(entry_ids)
            self.counters["acked"] += len(entry_ids)

    def _reject(self, reason: str) -> None:
        self.counters["rejected"] += 1
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def process(self, delivery: Delivery) -> None:
        """Apply one delivery; whatever it holds, the learner goes on."""
        self.counters["read"] += 1
        try:
            self._process(delivery)
        except (OSError, ModelUnavailable, StoreUnavailable) as exc:
            # The store, not the record: leave it pending, so it is redelivered after a restart
            # (and dropped as poison only if it keeps failing).
            self.counters["errors"] += 1
            log.error("feedback entry %s not applied, left pending: %s", delivery.entry_id, exc)
        except Exception as exc:  # noqa: BLE001 - a bug on one record must not stop learning
            self.counters["errors"] += 1
            log.exception("feedback entry %s failed (%s); dropped", delivery.entry_id, exc)
            self._ack([delivery.entry_id])
        finally:
            self.counters["processed"] += 1

    def _process(self, delivery: Delivery) -> None:
        if delivery.deliveries > self.config.max_deliveries:
            self.counters["dead_lettered"] += 1
            self._ack([delivery.entry_id])
            return
        try:
            record = FeedbackRecord.decode(delivery.payload, self.config.limits)
        except BadFeedback as exc:
            self._reject(exc.reason)
            self._ack([delivery.entry_id])
            return
        if record.tenant in self.config.opt_out:
            self.counters["opted_out"] += 1
            self._ack([delivery.entry_id])
            return
        if self.config.drafters is not None and record.drafter not in self.config.drafters:
            self.counters["not_learnable"] += 1
            self._ack([delivery.entry_id])
            return
        variant = self._variant(VariantKey(scope_for(self.config, record.tenant), record.drafter))
        if variant is None:
            self.counters["not_learnable"] += 1
            self._ack([delivery.entry_id])
            return
        vocab_size = variant.base.embedding.shape[0]
        if any(t >= vocab_size for t in record.context + record.draft) or \
                any(t >= vocab_size for row in record.target_ids for t in row):
            self._reject("out_of_range")
            self._ack([delivery.entry_id])
            return
        if record.record_id in variant.applied:
            if delivery.entry_id in variant.uncommitted_ids:
                return  # our own uncommitted entry handed out again: its commit acknowledges it
            self.counters["duplicates"] += 1
            self._ack([delivery.entry_id])
            return
        if is_held_out(record.record_id, self.config.holdout_every):
            variant.holdout.append(record)
            self.counters["held_out"] += 1
            while len(variant.holdout) > self.config.holdout_size:
                # Its effect lands in this record's commit, with the window it left: a crash before
                # that restores the window with it inside, and the redelivered record evicts it again.
                evicted = variant.holdout.popleft()
                if self.config.train_after_holdout and self._train_on(variant, evicted):
                    self.counters["trained_after_holdout"] += 1
        else:
            if not self._train_on(variant, record):
                self._ack([delivery.entry_id])
                return
            self.counters["applied"] += 1
        self._remember(variant, record.record_id)
        if not variant.uncommitted:
            variant.first_uncommitted = self.clock()
        variant.uncommitted.append(delivery.entry_id)
        variant.uncommitted_ids.add(delivery.entry_id)

    def _train_on(self, variant: _Variant, record: FeedbackRecord) -> bool:
        """Add ``record`` to the variant's next gradient step; False (counted) when its tenant's
        training budget is spent."""
        used = variant.usage.setdefault(record.tenant, [0, 0])
        over = (self.config.budget_records and used[0] + 1 > self.config.budget_records) or \
               (self.config.budget_tokens and used[1] + record.positions > self.config.budget_tokens)
        if over:
            self.counters["over_budget"] += 1
            return False
        used[0] += 1
        used[1] += record.positions
        variant.batch.append(record)
        if len(variant.batch) >= self.config.batch_records:
            self._train(variant)
        return True

    def _remember(self, variant: _Variant, record_id: str) -> None:
        variant.applied[record_id] = None
        while len(variant.applied) > self.config.applied_ids_kept:
            variant.applied.popitem(last=False)

    def _train(self, variant: _Variant) -> None:
        records, variant.batch = variant.batch, []
        report = variant.learner.step(variant.learner.batch(records))
        if report is not None:
            self.counters["steps"] += 1
            variant.steps_since_commit += 1
            self.last_loss[variant.key] = report.loss

    # -- variants --------------------------------------------------------------------------------

    def _variant(self, key: VariantKey) -> _Variant | None:
        variant = self.variants.get(key)
        if variant is not None:
            return variant
        base = self.base_model(key.drafter)
        if base is None:
            return None
        if key in self._conflicts:
            raise ModelUnavailable(self._conflicts[key])
        variant = _Variant(key, OnlineDrafterLearner(base, self.config.online), base)
        state = self.store.load_state(key)
        conflict = checkpoint_conflict(self.config.online, state, key, self.store.describe)
        if conflict is not None:  # its records stay pending (counted as errors), none is dropped
            self._conflicts[key] = conflict
            raise ModelUnavailable(conflict)
        if state is not None:
            variant.learner.load_state_dict(state["learner"])
            variant.serving_version = int(state["serving_version"])
            variant.applied = OrderedDict((i, None) for i in state["applied"])
            variant.usage = {t: list(u) for t, u in state["usage"].items()}
            variant.holdout = deque(FeedbackRecord.decode(p, self.config.limits) for p in state["holdout"])
            log.info("learner: resumed %s/%s at version %d", key.scope, key.drafter, variant.serving_version)
        self.variants[key] = variant
        return variant

    def commit_due(self) -> None:
        now = self.clock()
        for variant in list(self.variants.values()):
            if not variant.uncommitted:
                continue
            if len(variant.uncommitted) >= self.config.publish_every or \
                    now - variant.first_uncommitted >= self.config.commit_after_s:
                self.commit(variant)

    def commit(self, variant: _Variant) -> None:
        if variant.batch:
            self._train(variant)
        key = variant.key
        if variant.steps_since_commit > 0:
            tensors, metadata = variant.learner.serving_tensors()
            holdout = list(variant.holdout)
            candidate_bd = serving_bd = z = None
            regressed = False
            candidate = candidate_scores = None
            if len(holdout) >= self.config.min_holdout:
                candidate = build_served_model(variant.base, tensors, metadata)
                candidate_scores = record_bd(candidate, holdout, self.config.rollback_metric)
                comparison = paired(torch.cat(candidate_scores), torch.cat(self._serving_scores(variant, holdout)))
                candidate_bd, serving_bd, z = comparison.candidate_bd, comparison.serving_bd, comparison.z
                regressed = comparison.regressed(self.config.rollback_bd_drop, self.config.rollback_z)
            metadata.update(parent=variant.serving_version, heldout_bd=candidate_bd, parent_heldout_bd=serving_bd,
                            heldout_z=z, heldout_records=len(holdout), heldout_metric=self.config.rollback_metric)
            version = self.store.publish(key, tensors, metadata)
            self.counters["published"] += 1
            row = {"scope": key.scope, "drafter": key.drafter, "version": version, "parent": variant.serving_version,
                   "heldout_bd": candidate_bd, "parent_heldout_bd": serving_bd, "z": z}
            if regressed:
                reason = (f"held-out BD ({self.config.rollback_metric}) {candidate_bd:.4f} < serving version "
                          f"{variant.serving_version}'s {serving_bd:.4f} - {self.config.rollback_bd_drop} (z = {z:.1f})")
                self.store.mark_rolled_back(key, version, reason)
                self.counters["rollbacks"] += 1
                log.warning("learner: rolled back %s/%s version %d: %s", key.scope, key.drafter, version, reason)
                self._restore_serving(variant)
                row["decision"] = "rolled_back"
            else:
                self.store.promote(key, version)
                variant.serving_version = version
                variant.serving_model = None if candidate is None else (version, candidate)
                variant.serving_bd = None if candidate is None else \
                    (version, {r.record_id: v for r, v in zip(holdout, candidate_scores)})
                self.counters["promoted"] += 1
                row["decision"] = "promoted"
                if self.on_promote is not None:
                    self.on_promote(key, version)
            self.history.append(row)
            variant.steps_since_commit = 0
        self.store.save_state(key, {
            "learner": variant.learner.state_dict(),
            "serving_version": variant.serving_version,
            "applied": list(variant.applied),
            "usage": variant.usage,
            "holdout": [r.encode() for r in variant.holdout],
        })
        entry_ids, variant.uncommitted = variant.uncommitted, []
        variant.uncommitted_ids = set()
        self._ack(entry_ids)

    def _serving_scores(self, variant: _Variant, holdout: list[FeedbackRecord]) -> list[torch.Tensor]:
        """The serving version's BD on each held-out record: remembered per record, so a commit
        scores only the records held out since the last one (and the candidate on all)."""
        version, known = variant.serving_bd if variant.serving_bd and variant.serving_bd[0] == variant.serving_version \
            else (variant.serving_version, {})
        missing = [r for r in holdout if r.record_id not in known]
        if missing:
            known.update(zip((r.record_id for r in missing),
                             record_bd(self._serving_model(variant), missing, self.config.rollback_metric)))
        known = {r.record_id: known[r.record_id] for r in holdout}  # records no longer held out are dropped
        variant.serving_bd = (version, known)
        return [known[r.record_id] for r in holdout]

    def _serving_model(self, variant: _Variant):
        if variant.serving_version == 0:
            return variant.base
        if variant.serving_model is not None and variant.serving_model[0] == variant.serving_version:
            return variant.serving_model[1]  # the candidate this learner built and promoted
        tensors, metadata = self.store.load(variant.key, variant.serving_version)
        model = build_served_model(variant.base, tensors, metadata)
        variant.serving_model = (variant.serving_version, model)
        return model

    def _restore_serving(self, variant: _Variant) -> None:
        """Back to the serving version's weights, without the rolled-back steps' optimistic hints
        (stale), but with the AdaGrad sums, so the step sizes do not start over at full size."""
        fresh = OnlineDrafterLearner(variant.base, self.config.online)
        if variant.serving_version:
            tensors, metadata = self.store.load(variant.key, variant.serving_version)
            fresh.load_serving_tensors(tensors)
        fresh.adopt_step_sizes(variant.learner)
        # What the rolled-back candidate added to its vocabulary must be seen again to come back.
        fresh.outside_mass = variant.learner.outside_mass.clone()
        fresh.steps = variant.learner.steps
        variant.learner = fresh


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
            from specpool.learning.feedback_redis import RedisFeedbackStream

            self.stream = RedisFeedbackStream(config.feedback_url, stream=config.feedback_stream)
        else:
            self.stream = InProcessFeedbackStream(config.queue_capacity)
        self.store = open_model_store(config.store or (Path(home) / "online"))
        self.emitter = FeedbackEmitter(self.stream, config.context_tail)
        self._bases: dict[str, Drafter] = {}
        self._slots: dict[VariantKey, DrafterSlot] = {}
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

    def _base_model(self, name: str) -> ZooLM | None:
        drafter = self._bases.get(name)
        return drafter.model if drafter is not None else None

    def slot(self, tenant_scope: str, name: str) -> DrafterSlot | None:
        return self._slots.get(VariantKey(tenant_scope, name))

    def _slot(self, key: VariantKey, base: Drafter) -> DrafterSlot:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
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


# --- served mode: the learner as its own process --------------------------------------------------


def registry_base_models(context, allowed: Sequence[str]) -> Callable[[str], ZooLM | None]:
    """Drafter name -> its shipped network, built once through the drafter registry.

    Only names in ``allowed`` are ever built: a record names its drafter, and a record must not
    make the learner load an arbitrary model (``hf:some/hub-model``)."""
    from specpool.drafters.registry import create_drafter

    allowed_names = set(allowed)
    built: dict[str, ZooLM | None] = {}

    def base(name: str) -> ZooLM | None:
        if name not in allowed_names:
            return None
        if name not in built:
            drafter = create_drafter(name, context)
            built[name] = drafter.model if learnable(drafter) else None
            if built[name] is None:
                log.warning("learner: drafter %s is not a zoo drafter; its feedback is ignored", name)
        return built[name]

    return base


def run_learner(config: LearningConfig, source: FeedbackSource, store: ModelStore,
                base_model: Callable[[str], ZooLM | None], consumer: str,
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
