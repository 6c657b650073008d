"""The online learner's settings (``LearningConfig``), shared by its embedded wiring
(specpool/learning/learner.py), its loop (specpool/learning/learner_loop.py), the served learner
process (specpool/learning/learner_process.py) and the command line (specpool/cli/learning.py); and
the rule that maps a tenant to the drafter variant it trains and drafts with (``scope_for``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpool.learning.feedback import FeedbackLimits
from specpool.learning.model_store import SHARED_SCOPE
from specpool.learning.online import OnlineConfig


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
    # Memory stays bounded however many tenants send feedback: at most this many variants are held
    # (the least recently used one is committed - checkpointed, then acknowledged - and dropped; its
    # next record resumes it from that checkpoint), and the last ``history_kept`` commits are listed.
    max_variants: int = 64
    history_kept: int = 1000
    limits: FeedbackLimits = field(default_factory=FeedbackLimits)
    # Embedded mode only. A Redis URL: emit the feedback to that stream for a learner process
    # (``specpool learner``) and learn nothing in this one; None: the in-process queue and thread.
    feedback_url: str | None = None
    feedback_stream: str = "specpool:feedback"  # the stream key at feedback_url


def scope_for(config: LearningConfig, tenant: str) -> str:
    """The variant scope a tenant's feedback trains and its requests draft with: the tenant's
    own, or the shared pool's (``shared_pool``)."""
    return SHARED_SCOPE if config.shared_pool else tenant
