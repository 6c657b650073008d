"""The learner loop: feedback records in, published drafter versions out.

It reads the feedback stream as a consumer group member (specpool/learning/feedback.py), applies each
record to its drafter *variant* with an online algorithm (specpool/learning/online.py), and every
``publish_every`` records (or ``commit_after_s`` seconds) *commits* the variant:

1. the variant's candidate weights are written to the model store as a new version;
2. the candidate and the serving version are scored by BD on held-out recent feedback (records
   picked by a hash of their id; the ``holdout_size`` most recent are kept, untrained, and one
   that leaves that window is trained on then, ``train_after_holdout``), paired position by
   position; a drop beyond ``rollback_bd_drop`` that is also significant (z below
   -``rollback_z``: small held-out sets are noisy) rolls the candidate back - it is marked in the
   store, the learner returns to the serving weights, and the rollback is counted and logged -
   otherwise it becomes the serving version;
3. the learner's checkpoint (weights, optimiser hints, Hedge weights, applied record ids, tenant
   budgets, held-out set) replaces the previous one;
4. only then are the variant's records acknowledged.

A crash anywhere before 4 loses the uncommitted effects *and* leaves their records unacknowledged,
so they are redelivered and applied to the checkpointed state: each record's effect counts once.
A record whose id the checkpoint already holds (a crash between 3 and 4, or a producer that sent it
twice) is acknowledged without a second effect. A restarted learner first takes back the records
pending under its own consumer name (``claim_own``: no wait for ``claim_idle_s``), then those other,
dead consumers left. Nothing is acknowledged before what it did is on disk: a record over its
tenant's budget is acknowledged with its variant's commit (the budget it was measured against is
in that checkpoint), and a record given up on (delivered more than ``max_deliveries`` times, or
failing with a bug) is acknowledged only once the store holds it as a dead letter
(``ModelStore.dead_letter``). Only records with no effect at all - malformed, opted out, for a
drafter that is not learnt - are acknowledged at once.

Memory is bounded per tenant: at most ``max_variants`` variants are held, the least recently used
one committed and dropped (``_evict``); ``history`` keeps the last ``history_kept`` commits.

Tenants: a record trains its tenant's own variant of the drafter (scope = tenant), or the shared
pool's (scope ``_shared``) when ``shared_pool`` is on; tenants in ``opt_out`` are never trained on;
``budget_records`` / ``budget_tokens`` cap what one tenant's feedback may train.

Embedded mode runs a ``Learner`` on a background thread (``EmbeddedLearning`` in
specpool/learning/learner.py, used by ``EmbeddedEngine(..., learning=LearningConfig(...))``);
served mode runs the same ``Learner`` over ``RedisFeedbackStream`` in its own process
(``run_learner`` in specpool/learning/learner_process.py). A variant's state and its checkpoint
are specpool/learning/learner_checkpoint.py's; the settings, ``LearningConfig``, are
specpool/learning/learning_config.py's.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict, deque
from typing import Callable

import torch
from torch import nn

from specpool.core.errors import InvalidArgument, ModelUnavailable, StoreUnavailable
from specpool.learning.evaluation import paired
from specpool.learning.feedback import BadFeedback, Delivery, FeedbackRecord, FeedbackSource
from specpool.learning.learner_checkpoint import VariantState, checkpoint_conflict, restore_checkpoint, save_checkpoint
from specpool.learning.learning_config import LearningConfig, scope_for
from specpool.learning.hot_swap import network_kind
from specpool.learning.model_store import ModelStore, VariantKey

log = logging.getLogger("specpool.learner")


def is_held_out(record_id: str, every: int) -> bool:
    """Whether a record is held out (scored, not trained on): one in ``every`` by a hash of its id,
    so every learner, and a learner after a restart, picks the same ones."""
    if every <= 1:
        return False
    return int.from_bytes(hashlib.sha1(record_id.encode()).digest()[:4], "big") % every == 0


class Learner:
    """Consumes feedback, trains variants, publishes versions. Not thread-safe: one thread runs it."""

    def __init__(
        self,
        config: LearningConfig,
        source: FeedbackSource,
        store: ModelStore,
        base_model: Callable[[str], nn.Module | None],
        consumer: str = "learner-1",
        on_promote: Callable[[VariantKey, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        config.online.validate()
        if config.max_variants < 1 or config.history_kept < 0:
            raise InvalidArgument(f"max_variants must be >= 1 and history_kept >= 0, got {config.max_variants}, "
                                  f"{config.history_kept}")
        if config.rollback_metric not in ("greedy", "soft"):
            raise InvalidArgument(f"rollback_metric is greedy or soft, not {config.rollback_metric!r}")
        self.config = config
        self.source = source
        self.store = store
        self.base_model = base_model  # drafter name -> its shipped network (a zoo network or a head), or None (not learnable)
        self.consumer = consumer
        self.on_promote = on_promote
        self.clock = clock
        self.variants: OrderedDict[VariantKey, VariantState] = OrderedDict()  # least recently used first
        self.counters: dict[str, int] = {
            "read": 0, "processed": 0, "applied": 0, "held_out": 0, "trained_after_holdout": 0, "duplicates": 0,
            "rejected": 0, "opted_out": 0, "over_budget": 0, "not_learnable": 0, "dead_lettered": 0, "errors": 0, "steps": 0,
            "published": 0, "promoted": 0, "rollbacks": 0, "acked": 0, "evicted": 0,
        }
        self.rejected: dict[str, int] = {}  # reason -> count
        self.last_loss: dict[VariantKey, float] = {}
        self.history: deque[dict] = deque(maxlen=config.history_kept)  # one row per commit: version, BD before/after, decision
        self.busy_s = 0.0  # wall time spent applying and committing (not waiting for records)
        self._conflicts: OrderedDict[VariantKey, str] = OrderedDict()  # variants whose checkpoint another algorithm made
        # Fault injection for tests (``SPECPOOL_LEARNER_PAUSE_BEFORE_ACK_S``, learner_process.py): sleep
        # between a commit's checkpoint and its acknowledgement, so a test can kill the learner there.
        self.pause_before_ack_s = 0.0

    # -- the loop --------------------------------------------------------------------------------

    def recover(self, limit: int | None = None) -> int:
        """Take back the records this consumer's name left pending (a restart: at once, when the
        source can), then those another (crashed) consumer left unacknowledged; returns how many
        (at most ``limit``: the rest stay pending for a later call)."""
        total = 0
        own = getattr(self.source, "claim_own", None)
        scans = [lambda count, cursor: own(self.consumer, count, cursor)] if own is not None else []
        scans.append(lambda count, cursor: self.source.claim_stale(self.consumer, self.config.claim_idle_s, count, cursor))
        for scan in scans:
            cursor = "0-0"
            while limit is None or total < limit:
                count = self.config.read_count if limit is None else min(self.config.read_count, limit - total)
                cursor, deliveries = scan(count, cursor)
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
            log.exception("feedback entry %s failed (%s); dead-lettered", delivery.entry_id, exc)
            self._dead_letter(delivery, f"failed: {type(exc).__name__}: {exc}")
        finally:
            self.counters["processed"] += 1

    def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Keep the record in the store's dead letters, durably, and only then acknowledge it; when
        the store cannot take it, it stays pending (and comes back)."""
        try:
            self.store.dead_letter(delivery.entry_id, delivery.payload, reason)
        except Exception as exc:  # noqa: BLE001 - an unwritable store: keep the record pending
            self.counters["errors"] += 1
            log.error("feedback entry %s: could not dead-letter it (%s); left pending", delivery.entry_id, exc)
            return
        self.counters["dead_lettered"] += 1
        self._ack([delivery.entry_id])

    def _process(self, delivery: Delivery) -> None:
        if delivery.deliveries > self.config.max_deliveries:
            self._dead_letter(delivery, f"delivered {delivery.deliveries} times (max_deliveries "
                                        f"{self.config.max_deliveries})")
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
        try:
            network_kind(variant.base).check_record(record, variant.base)  # token ids in range; a head's features
        except BadFeedback as exc:
            self._reject(exc.reason)
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
        elif not self._train_on(variant, record):
            # Over budget, measured against usage not checkpointed yet: acknowledged with that
            # checkpoint (a crash before it redelivers the record to the restored usage).
            self._hold(variant, delivery.entry_id)
            return
        else:
            self.counters["applied"] += 1
        self._remember(variant, record.record_id)
        self._hold(variant, delivery.entry_id)

    def _hold(self, variant: VariantState, entry_id: str) -> None:
        """Acknowledge ``entry_id`` with the variant's next commit."""
        if not variant.uncommitted:
            variant.first_uncommitted = self.clock()
        variant.uncommitted.append(entry_id)
        variant.uncommitted_ids.add(entry_id)

    def _train_on(self, variant: VariantState, record: FeedbackRecord) -> bool:
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

    def _remember(self, variant: VariantState, record_id: str) -> None:
        variant.applied[record_id] = None
        while len(variant.applied) > self.config.applied_ids_kept:
            variant.applied.popitem(last=False)

    def _train(self, variant: VariantState) -> None:
        records, variant.batch = variant.batch, []
        report = variant.learner.step(variant.learner.batch(records))
        if report is not None:
            self.counters["steps"] += 1
            variant.steps_since_commit += 1
            self.last_loss[variant.key] = report.loss

    # -- variants --------------------------------------------------------------------------------

    def _variant(self, key: VariantKey) -> VariantState | None:
        """The variant's state, resumed from its checkpoint the first time; None when its drafter
        is not learnable. Raises ModelUnavailable when the checkpoint cannot be continued."""
        variant = self.variants.get(key)
        if variant is not None:
            self.variants.move_to_end(key)
            return variant
        base = self.base_model(key.drafter)
        if base is None:
            return None
        if key in self._conflicts:
            raise ModelUnavailable(self._conflicts[key])
        variant = VariantState(key, network_kind(base).learner(base, self.config.online), base)
        state = self.store.load_state(key)
        conflict = checkpoint_conflict(self.config.online, state, key, self.store.describe)
        if conflict is not None:  # its records stay pending (counted as errors), none is dropped
            self._conflicts[key] = conflict
            while len(self._conflicts) > self.config.max_variants:
                self._conflicts.popitem(last=False)
            raise ModelUnavailable(conflict)
        if state is not None:
            restore_checkpoint(variant, state, self.config.limits)
            log.info("learner: resumed %s/%s at version %d", key.scope, key.drafter, variant.serving_version)
        while len(self.variants) >= self.config.max_variants:
            self._evict(next(iter(self.variants.values())))
        self.variants[key] = variant
        return variant

    def _evict(self, variant: VariantState) -> None:
        """Write the least recently used variant back (commit: checkpoint, then acknowledge) and drop
        it; if the commit fails it stays, and the record that wanted room stays pending."""
        if variant.uncommitted or variant.batch:
            self.commit(variant)
        del self.variants[variant.key]
        self.last_loss.pop(variant.key, None)
        self.counters["evicted"] += 1
        log.info("learner: %s/%s left memory (least recently used of %d)", variant.key.scope, variant.key.drafter,
                 self.config.max_variants)

    def commit_due(self) -> None:
        now = self.clock()
        for variant in list(self.variants.values()):
            if not variant.uncommitted:
                continue
            if len(variant.uncommitted) >= self.config.publish_every or \
                    now - variant.first_uncommitted >= self.config.commit_after_s:
                self.commit(variant)

    def commit(self, variant: VariantState) -> None:
        """Publish what the variant learnt since its last commit (promoted, or rolled back when its
        held-out BD regresses), replace its checkpoint, and only then acknowledge its records."""
        if variant.batch:
            self._train(variant)
        if variant.steps_since_commit > 0:
            self._publish(variant)
            variant.steps_since_commit = 0
        save_checkpoint(self.store, variant)
        if self.pause_before_ack_s > 0:
            log.warning("learner: checkpoint of %s/%s written, %d records not acknowledged yet; pausing %.1f s",
                        variant.key.scope, variant.key.drafter, len(variant.uncommitted), self.pause_before_ack_s)
            time.sleep(self.pause_before_ack_s)
        entry_ids, variant.uncommitted = variant.uncommitted, []
        variant.uncommitted_ids = set()
        self._ack(entry_ids)

    def _publish(self, variant: VariantState) -> None:
        """The candidate as a new version in the store, checked on the held-out records: rolled back
        when it regresses, promoted otherwise; one row of ``history``."""
        key = variant.key
        tensors, metadata = variant.learner.serving_tensors()
        holdout = list(variant.holdout)
        candidate, candidate_scores, comparison = self._check_held_out(variant, tensors, metadata, holdout)
        candidate_bd, serving_bd, z = (None, None, None) if comparison is None else \
            (comparison.candidate_bd, comparison.serving_bd, comparison.z)
        metadata.update(parent=variant.serving_version, heldout_bd=candidate_bd, parent_heldout_bd=serving_bd,
                        heldout_z=z, heldout_records=len(holdout), heldout_metric=self.config.rollback_metric)
        version = self.store.publish(key, tensors, metadata)
        self.counters["published"] += 1
        row = {"scope": key.scope, "drafter": key.drafter, "version": version, "parent": variant.serving_version,
               "heldout_bd": candidate_bd, "parent_heldout_bd": serving_bd, "z": z}
        if comparison is not None and comparison.regressed(self.config.rollback_bd_drop, self.config.rollback_z):
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

    def _check_held_out(self, variant: VariantState, tensors: dict, metadata: dict, holdout: list[FeedbackRecord]):
        """(candidate network, its BD per held-out record, its ``Comparison`` with the serving
        version); all None when fewer than ``min_holdout`` records are held out (promoted unchecked)."""
        if len(holdout) < self.config.min_holdout:
            return None, None, None
        kind = network_kind(variant.base)
        candidate = kind.served_network(variant.base, tensors, metadata)
        candidate_scores = kind.record_bd(candidate, holdout, self.config.rollback_metric)
        comparison = paired(torch.cat(candidate_scores), torch.cat(self._serving_scores(variant, holdout)))
        return candidate, candidate_scores, comparison

    def _serving_scores(self, variant: VariantState, holdout: list[FeedbackRecord]) -> list[torch.Tensor]:
        """The serving version's BD on each held-out record: remembered per record, so a commit
        scores only the records held out since the last one (and the candidate on all)."""
        version, known = variant.serving_bd if variant.serving_bd and variant.serving_bd[0] == variant.serving_version \
            else (variant.serving_version, {})
        missing = [r for r in holdout if r.record_id not in known]
        if missing:
            known.update(zip((r.record_id for r in missing),
                             network_kind(variant.base).record_bd(self._serving_model(variant), missing,
                                                                  self.config.rollback_metric)))
        known = {r.record_id: known[r.record_id] for r in holdout}  # records no longer held out are dropped
        variant.serving_bd = (version, known)
        return [known[r.record_id] for r in holdout]

    def _serving_model(self, variant: VariantState):
        if variant.serving_version == 0:
            return variant.base
        if variant.serving_model is not None and variant.serving_model[0] == variant.serving_version:
            return variant.serving_model[1]  # the candidate this learner built and promoted
        tensors, metadata = self.store.load(variant.key, variant.serving_version)
        model = network_kind(variant.base).served_network(variant.base, tensors, metadata)
        variant.serving_model = (variant.serving_version, model)
        return model

    def _restore_serving(self, variant: VariantState) -> None:
        """Back to the serving version's weights, without the rolled-back steps' optimistic hints
        (stale), but with the AdaGrad sums, so the step sizes do not start over at full size."""
        fresh = network_kind(variant.base).learner(variant.base, self.config.online)
        if variant.serving_version:
            tensors, metadata = self.store.load(variant.key, variant.serving_version)
            fresh.load_serving_tensors(tensors)
        fresh.adopt_step_sizes(variant.learner)
        # What the rolled-back candidate added to its vocabulary must be seen again to come back.
        fresh.outside_mass = variant.learner.outside_mass.clone()
        fresh.steps = variant.learner.steps
        variant.learner = fresh
