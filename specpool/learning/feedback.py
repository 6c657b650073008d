"""Verification feedback for online learning: size-bounded records and the stream that carries them.

The target's verification is free supervision (Liu et al., "Online Speculative Decoding", 2023,
"OnlineSpec"): every round that drafted something becomes one ``FeedbackRecord`` holding the
context tail, the draft tokens, the accepted count and the target's sparse top-K p at each of
the k+1 positions. Records travel as compact JSON bytes, so the same payload goes through the
in-process queue (embedded mode) and Redis Streams (served mode, ``RedisFeedbackStream``).

Stream semantics are those of a Redis Streams consumer group, whichever implementation:

- ``emit`` never blocks serving: the stream is bounded and drops its *oldest* entries when full
  (counted in ``dropped``);
- ``read`` hands entries to a consumer and moves them to the pending list;
- ``ack`` removes them from it; an entry that is never acknowledged (the consumer crashed) is
  handed out again by ``claim_stale`` once it has been idle long enough (XAUTOCLAIM).

A round drafted by a white-box head (``eagle:``) also carries the target's features the head read
and should have predicted (``FeedbackRecord.feature_start`` .. ``position + accepted - 1``: the
context tail's last ``feature_tail`` rows and the accepted drafts'), float16 row-major as on the
wire (specpool/target/features.py), base64 in the JSON: 1,152 bytes a position on the default
target, about 1.5 KB encoded. Such records may be up to ``FeedbackLimits.max_white_box_bytes``;
every other record keeps the ``max_bytes`` bound and its layout (records without features decode
as before, and a record with features is still format 1: the keys are new, not changed).

So delivery is at-least-once; the learner makes the *effect* exactly-once by record id
(specpool/learning/learner.py). Decoding validates everything a producer could get wrong and raises
``BadFeedback`` with a reason, which the learner counts; nothing in a record can crash it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

from specpool.core.errors import InvalidArgument
from specpool.router.loop import RoundFeedback
from specpool.router.session_store import SESSION_PATTERN, TENANT_PATTERN
from specpool.target.features import Features, decode_features, encode_features

FEEDBACK_FORMAT = 1  # bump when the record layout changes
RECORD_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


class BadFeedback(InvalidArgument):
    """A feedback record that cannot be applied; ``reason`` is a counter name."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "oversized" | "malformed" | "out_of_range" | "no_features" (a head's record without them)


@dataclass(frozen=True)
class FeedbackLimits:
    """What a record may hold; anything beyond is rejected, never truncated silently."""

    max_bytes: int = 64 * 1024  # encoded size
    max_context: int = 256  # context-tail tokens
    max_draft: int = 32  # draft tokens
    max_top_k: int = 64  # entries of the target's sparse p per position
    max_drafter_name: int = 512  # characters (a spec may be a path)
    # A record that carries a white-box head's features may be this large (encoded). At the
    # default feature tail (16 rows) and k = 5, a record is about 30 KB on the default target
    # (width 576); the bound leaves room for a longer draft (32 accepted: ~75 KB) or a wider target.
    max_white_box_bytes: int = 512 * 1024
    max_feature_width: int = 16384  # the target's hidden size a record's features may have


@dataclass(frozen=True)
class FeedbackRecord:
    """One verified round. Rows of ``target_ids``/``target_probs`` are the target's p at the k+1
    positions after ``context + draft[:j]`` (j = 0..k; row k is the bonus position), softmax at
    temperature 1, top-K only (the mass outside the top-K is not carried)."""

    record_id: str  # unique; applying is idempotent by it
    tenant: str
    session: str
    drafter: str  # the drafter's name (its spec)
    version: int  # weight version that drafted (0: the shipped weights)
    context: tuple[int, ...]  # the last tokens before the first draft token (a bounded tail)
    draft: tuple[int, ...]  # x_1..x_k
    accepted: int  # accepted draft tokens (a prefix)
    target_ids: tuple[tuple[int, ...], ...]  # (k+1, K) token ids
    target_probs: tuple[tuple[float, ...], ...]  # (k+1, K) their probabilities
    created: float = 0.0  # unix time of the round
    # The session's tokens before the first draft token (the whole context's length; ``context``
    # is its tail). A session's records line up by it, so the learner can fit several of them as
    # one sequence (specpool/learning/batches.py, make_batch). None: not known (records of older servers).
    position: int | None = None
    # White-box rounds (module docstring): the target's features of positions feature_start ..
    # position + accepted - 1, ``feature_width`` wide, float16 row-major. None: no features.
    feature_start: int | None = None
    feature_width: int = 0
    feature_bytes: bytes = b""

    def features(self) -> Features | None:
        """The carried features as float32 rows (None when the record carries none)."""
        if self.feature_start is None:
            return None
        return decode_features(self.feature_start, self.feature_width, self.feature_bytes)

    @property
    def positions(self) -> int:
        """Supervised positions (what a token budget counts)."""
        return len(self.target_ids)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "f": FEEDBACK_FORMAT, "id": self.record_id, "tenant": self.tenant, "session": self.session,
                "drafter": self.drafter, "version": self.version, "context": list(self.context),
                "draft": list(self.draft), "accepted": self.accepted,
                "p_ids": [list(r) for r in self.target_ids], "p": [list(r) for r in self.target_probs],
                "t": self.created, **({"pos": self.position} if self.position is not None else {}),
                **({"fs": self.feature_start, "fw": self.feature_width,
                    "fx": base64.b64encode(self.feature_bytes).decode("ascii")} if self.feature_start is not None else {}),
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(payload: bytes, limits: FeedbackLimits = FeedbackLimits(), vocab_size: int | None = None) -> "FeedbackRecord":
        """Parse and validate; raises ``BadFeedback`` (never anything else) on bad input."""
        if not isinstance(payload, (bytes, bytearray, str)):
            raise BadFeedback("malformed", f"feedback payload is a {type(payload).__name__}, not bytes")
        if len(payload) > limits.max_bytes:  # checked before parsing: only a record with features may be larger
            marker = b'"fx"' if isinstance(payload, (bytes, bytearray)) else '"fx"'
            bound = limits.max_white_box_bytes if marker in payload else limits.max_bytes
            if len(payload) > bound:
                raise BadFeedback("oversized", f"feedback record of {len(payload)} bytes exceeds {bound}")
        try:
            data = json.loads(payload)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise BadFeedback("malformed", f"feedback record is not JSON ({exc})") from None
        if len(payload) > limits.max_bytes and not (isinstance(data, dict) and "fx" in data):
            raise BadFeedback("oversized", f"feedback record of {len(payload)} bytes without features exceeds {limits.max_bytes}")
        try:
            return _from_dict(data, limits, vocab_size)
        except BadFeedback:
            raise
        except Exception as exc:  # noqa: BLE001 - any other surprise is a malformed record too
            raise BadFeedback("malformed", f"feedback record is malformed ({type(exc).__name__}: {exc})") from None


def _require(condition: bool, reason: str, message: str) -> None:
    if not condition:
        raise BadFeedback(reason, message)


def _int(value, name: str) -> int:
    _require(type(value) is int, "malformed", f"{name} must be an integer")  # bool is not accepted
    return value


def _ids(value, name: str, low: int, high: int, vocab_size: int | None) -> tuple[int, ...]:
    _require(isinstance(value, list), "malformed", f"{name} must be a list")
    _require(low <= len(value) <= high, "oversized" if len(value) > high else "malformed",
             f"{name} has {len(value)} entries; allowed {low}..{high}")
    out = tuple(_int(v, name) for v in value)
    limit = vocab_size if vocab_size is not None else 1 << 31
    _require(all(0 <= v < limit for v in out), "out_of_range", f"{name} holds token ids outside 0..{limit - 1}")
    return out


def _from_dict(data, limits: FeedbackLimits, vocab_size: int | None) -> FeedbackRecord:
    _require(isinstance(data, dict), "malformed", "feedback record must be a JSON object")
    _require(data.get("f") == FEEDBACK_FORMAT, "malformed", f"unknown feedback format {data.get('f')!r}")
    record_id, tenant, session, drafter = data.get("id"), data.get("tenant"), data.get("session"), data.get("drafter")
    _require(isinstance(record_id, str) and RECORD_ID_PATTERN.fullmatch(record_id) is not None, "malformed", "bad record id")
    _require(isinstance(tenant, str) and TENANT_PATTERN.fullmatch(tenant) is not None, "malformed", "bad tenant id")
    _require(isinstance(session, str) and SESSION_PATTERN.fullmatch(session) is not None, "malformed", "bad session id")
    _require(isinstance(drafter, str) and 0 < len(drafter) <= limits.max_drafter_name, "malformed", "bad drafter name")
    version = _int(data.get("version"), "version")
    _require(version >= 0, "out_of_range", "version must be >= 0")
    context = _ids(data.get("context"), "context", 1, limits.max_context, vocab_size)
    draft = _ids(data.get("draft"), "draft", 1, limits.max_draft, vocab_size)
    accepted = _int(data.get("accepted"), "accepted")
    _require(0 <= accepted <= len(draft), "out_of_range", f"accepted {accepted} outside 0..{len(draft)}")
    p_ids, p = data.get("p_ids"), data.get("p")
    _require(isinstance(p_ids, list) and isinstance(p, list), "malformed", "target p must be lists")
    _require(len(p_ids) == len(p) == len(draft) + 1, "malformed",
             f"need k+1 = {len(draft) + 1} rows of target p, got {len(p_ids)} ids and {len(p)} probs")
    rows_ids, rows_p = [], []
    for j, (ids_row, p_row) in enumerate(zip(p_ids, p)):
        ids = _ids(ids_row, f"p_ids[{j}]", 1, limits.max_top_k, vocab_size)
        _require(isinstance(p_row, list) and len(p_row) == len(ids), "malformed", f"p[{j}] must match p_ids[{j}]")
        probs = tuple(float(v) for v in p_row if type(v) in (int, float))
        _require(len(probs) == len(ids), "malformed", f"p[{j}] must hold numbers")
        _require(all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in probs), "out_of_range", f"p[{j}] outside [0, 1]")
        _require(sum(probs) <= 1.0 + 1e-3, "out_of_range", f"p[{j}] sums to {sum(probs):.4f} > 1")
        _require(len(set(ids)) == len(ids), "malformed", f"p_ids[{j}] repeats a token")
        rows_ids.append(ids)
        rows_p.append(probs)
    created = data.get("t", 0.0)
    _require(type(created) in (int, float) and math.isfinite(created), "malformed", "bad time")
    position = data.get("pos")
    if position is not None:
        _require(_int(position, "pos") >= len(context), "out_of_range",
                 f"pos {position} is shorter than the context tail ({len(context)} tokens)")
    features = _features(data, position, len(context), accepted, limits) if "fx" in data else (None, 0, b"")
    return FeedbackRecord(record_id, tenant, session, drafter, version, context, draft, accepted,
                          tuple(rows_ids), tuple(rows_p), float(created), position, *features)


def _features(data: dict, position: int | None, context: int, accepted: int,
              limits: FeedbackLimits) -> tuple[int, int, bytes]:
    """(feature_start, feature_width, feature_bytes) of a record that carries features, validated:
    rows of exactly the positions feature_start .. position + accepted - 1, within the context tail,
    whole float16 rows, every value finite."""
    _require(position is not None, "malformed", "a record with features needs its position (pos)")
    start, width, text = data.get("fs"), data.get("fw"), data.get("fx")
    start, width = _int(start, "fs"), _int(width, "fw")
    _require(0 < width <= limits.max_feature_width, "out_of_range",
             f"feature width {width} outside 1..{limits.max_feature_width}")
    end = position + accepted  # one past the last position with a feature (the accepted drafts')
    _require(position - context <= start < end, "out_of_range",
             f"features start at {start}, outside the context tail's positions {position - context}..{end - 1}")
    _require(isinstance(text, str), "malformed", "fx must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadFeedback("malformed", f"fx is not base64 ({exc})") from None
    _require(len(raw) == (end - start) * width * 2, "malformed",
             f"{len(raw)} feature bytes are not the {end - start} float16 rows of width {width} positions "
             f"{start}..{end - 1} need")
    rows = decode_features(start, width, raw).rows  # (end - start, width)
    _require(bool(rows.isfinite().all()), "out_of_range", "features hold non-finite values")
    return start, width, raw


def round_features(fb: RoundFeedback, context: int, feature_tail: int) -> tuple[int | None, int, bytes]:
    """(feature_start, width, float16 bytes) a white-box round's record carries: positions
    max(n - feature_tail, n - context) .. n + accepted - 1 (n: the context's length), where the
    round's features (``RoundFeedback.features``) cover them; (None, 0, b"") otherwise."""
    seen = fb.features
    n, end = len(fb.context_ids), len(fb.context_ids) + fb.result.accepted
    if seen is None or feature_tail < 1:
        return None, 0, b""
    start = max(n - min(feature_tail, context), seen.start)
    if start >= end or seen.end < end:
        return None, 0, b""
    rows = seen.rows[start - seen.start: end - seen.start]  # (end - start, d)
    return start, int(rows.shape[1]), encode_features(Features(start, rows))


def record_from_round(fb: RoundFeedback, tenant: str, version: int, context_tail: int = 64,
                      record_id: str | None = None, feature_tail: int = 16) -> FeedbackRecord | None:
    """The bounded record of one round, or None when the target sent no top-K p. A white-box
    round's record carries up to ``feature_tail`` context positions' features (``round_features``)."""
    rows = fb.result.target_top_k
    if not rows or not fb.proposal.tokens or len(rows) != len(fb.proposal.tokens) + 1:
        return None
    context = fb.context_ids[-context_tail:]
    feature_start, feature_width, feature_bytes = round_features(fb, len(context), feature_tail)
    return FeedbackRecord(
        record_id=record_id or uuid.uuid4().hex,
        tenant=tenant,
        session=fb.session_id,
        drafter=fb.drafter,
        version=version,
        context=tuple(context),
        draft=tuple(fb.proposal.tokens),
        accepted=fb.result.accepted,
        target_ids=tuple(tuple(r.token_ids.tolist()) for r in rows),
        # 6 decimals: the payload stays small and the loss does not notice.
        target_probs=tuple(tuple(round(v, 6) for v in r.probs.tolist()) for r in rows),
        created=time.time(),
        position=len(fb.context_ids),
        feature_start=feature_start,
        feature_width=feature_width,
        feature_bytes=feature_bytes,
    )


# --- the stream -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    entry_id: str  # the stream's id of this entry (not the record id)
    payload: bytes
    deliveries: int  # 1 on the first delivery, more when redelivered after a crash


@runtime_checkable
class FeedbackSink(Protocol):
    """Where serving puts feedback. ``emit`` must never block for long nor raise on a full stream."""

    def emit(self, payload: bytes) -> None: ...


@runtime_checkable
class FeedbackSource(Protocol):
    """Where the learner reads feedback: one consumer group's view of the stream."""

    describe: str

    def read(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        """Up to ``count`` never-delivered entries, oldest first; they become pending for
        ``consumer``. Waits up to ``block_s`` for the first one."""
        ...

    def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledge entries (they leave the pending list); returns how many were pending."""
        ...

    def claim_stale(self, consumer: str, min_idle_s: float, count: int = 100,
                    start: str = "0-0") -> tuple[str, list[Delivery]]:
        """Redeliver, to ``consumer``, pending entries nobody acknowledged for ``min_idle_s``,
        scanning from entry ``start`` on (XAUTOCLAIM). Returns (the cursor to continue from,
        "0-0" once the scan reached the end; the deliveries)."""
        ...

    def pending(self) -> int:
        """Entries delivered and not acknowledged."""
        ...


def _sequence(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Pending:
    payload: bytes
    consumer: str
    delivered_at: float
    deliveries: int


class InProcessFeedbackStream:
    """Embedded mode's stream: a bounded deque of undelivered entries plus a pending list.

    Thread-safe; ``emit`` holds the lock for a deque append (and, when full, a popleft that
    drops the oldest undelivered entry, counted). Pending entries are not dropped: they are
    bounded by what the consumer reads, and acknowledging or reclaiming them is its job.
    """

    describe = "in-process"

    def __init__(self, capacity: int = 4096, clock: Callable[[], float] = time.monotonic):
        if capacity < 1:
            raise InvalidArgument(f"feedback stream capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, bytes]] = deque()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._next = 0
        self.emitted = 0  # entries accepted by emit
        self.dropped = 0  # oldest entries dropped because the stream was full

    def emit(self, payload: bytes) -> None:
        with self._cond:
            if len(self._queue) >= self.capacity:
                self._queue.popleft()
                self.dropped += 1
            self._next += 1
            self._queue.append((f"{self._next}-0", payload))
            self.emitted += 1
            self._cond.notify()

    def read(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        with self._cond:
            if not self._queue and block_s > 0:
                self._cond.wait(block_s)
            out = []
            now = self._clock()
            while self._queue and len(out) < count:
                entry_id, payload = self._queue.popleft()
                self._pending[entry_id] = _Pending(payload, consumer, now, 1)
                out.append(Delivery(entry_id, payload, 1))
            return out

    def ack(self, entry_ids: Sequence[str]) -> int:
        with self._cond:
            return sum(self._pending.pop(e, None) is not None for e in entry_ids)

    def claim_stale(self, consumer: str, min_idle_s: float, count: int = 100,
                    start: str = "0-0") -> tuple[str, list[Delivery]]:
        first = _sequence(start)
        with self._cond:
            now = self._clock()
            out = []
            for entry_id, entry in self._pending.items():  # in entry order
                if _sequence(entry_id) < first:
                    continue
                if len(out) >= count:
                    return entry_id, out
                if now - entry.delivered_at >= min_idle_s:
                    entry.consumer, entry.delivered_at = consumer, now
                    entry.deliveries += 1
                    out.append(Delivery(entry_id, entry.payload, entry.deliveries))
            return "0-0", out

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def backlog(self) -> int:
        """Entries not delivered yet."""
        with self._cond:
            return len(self._queue)


class FeedbackEmitter:
    """Turns rounds into records and emits them; never raises into the serving path."""

    def __init__(self, sink: FeedbackSink, context_tail: int = 64, feature_tail: int = 16):
        self.sink = sink
        self.context_tail = context_tail
        self.feature_tail = feature_tail  # white-box rounds: context positions whose features a record carries
        self.emitted = 0
        self.skipped = 0  # rounds without the target's top-K
        self.errors = 0  # failures while building or emitting (serving went on)

    def __call__(self, fb: RoundFeedback, tenant: str, version: int) -> None:
        try:
            record = record_from_round(fb, tenant, version, self.context_tail, feature_tail=self.feature_tail)
            if record is None:
                self.skipped += 1
                return
            self.sink.emit(record.encode())
            self.emitted += 1
        except Exception:  # noqa: BLE001 - feedback must never fail a request
            self.errors += 1
