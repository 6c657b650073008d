"""The feedback stream on Redis Streams (served mode): XADD with MAXLEN ~, a consumer group read
with XREADGROUP, XACK, and XAUTOCLAIM for the records a crashed learner left pending.

Same semantics as ``InProcessFeedbackStream`` (specpool/learning/feedback.py). ``emit`` is on the serving
path, so it must never hold a request up: on a Redis error it counts the record as dropped and
stops trying for ``retry_after_s`` (a request then pays at most one failed call per period).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Sequence

from specpool.learning.feedback import Delivery
from specpool.core.errors import InvalidArgument, StoreUnavailable
from specpool.router.session_store import redact_url, redis_error_reason  # one wording and one redaction for every Redis URL

FIELD = b"r"  # the stream entry's one field: the encoded record


class RedisFeedbackStream:
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        stream: str = "specpool:feedback",
        group: str = "learners",
        maxlen: int = 100_000,  # approximate bound (MAXLEN ~): the oldest entries are trimmed
        retry_after_s: float = 5.0,
        client=None,
    ):
        import redis  # here, so the embedded mode needs no redis-py

        self._redis = redis
        self.stream, self.group, self.maxlen, self.retry_after_s = stream, group, maxlen, retry_after_s
        self.describe = f"{redact_url(url)} stream {stream}"
        try:
            self._client = client or redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)
        except ValueError as exc:  # a malformed URL; redis-py's message does not echo it
            raise InvalidArgument(f"invalid Redis URL {redact_url(url)!r}: {exc}") from None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.emitted = 0
        self.dropped = 0  # not written because Redis failed (trimming by MAXLEN is not counted)
        try:
            self._client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.AuthenticationError as exc:  # before ConnectionError: it is a subclass
            raise StoreUnavailable(f"Redis at {self.describe} rejected the credentials ({redis_error_reason(exc)}); "
                                   "check the user and password in the URL") from None
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise StoreUnavailable(f"cannot create the feedback consumer group on {self.describe}: {exc}") from None
        except redis.RedisError as exc:
            raise StoreUnavailable(f"feedback stream {self.describe} is unreachable ({redis_error_reason(exc)})") from None

    @contextlib.contextmanager
    def _reachable(self, what: str):
        """The learner's calls: a Redis failure becomes one clear StoreUnavailable."""
        try:
            yield
        except self._redis.RedisError as exc:
            raise StoreUnavailable(f"lost the feedback stream {self.describe} while {what} ({redis_error_reason(exc)})") from None

    def emit(self, payload: bytes) -> None:
        if time.monotonic() < self._down_until:
            with self._lock:
                self.dropped += 1
            return
        try:
            self._client.xadd(self.stream, {FIELD: payload}, maxlen=self.maxlen, approximate=True)
        except self._redis.RedisError:
            with self._lock:
                self.dropped += 1
                self._down_until = time.monotonic() + self.retry_after_s
            return
        with self._lock:
            self.emitted += 1

    def _deliveries(self, entries, redelivered: bool) -> list[Delivery]:
        out, missing = [], []
        for entry_id, fields in entries:
            entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if not fields or FIELD not in fields:  # trimmed or deleted while pending
                missing.append(entry_id)
                continue
            out.append(Delivery(entry_id, fields[FIELD], 1))
        if missing:
            self.ack(missing)
        if redelivered and out:
            counts = {}
            for row in self._client.xpending_range(self.stream, self.group, min=out[0].entry_id,
                                                   max=out[-1].entry_id, count=len(out) * 2 + 10):
                message_id = row["message_id"]
                counts[message_id.decode() if isinstance(message_id, bytes) else message_id] = int(row["times_delivered"])
            out = [Delivery(d.entry_id, d.payload, counts.get(d.entry_id, 2)) for d in out]
        return out

    def read(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        block = int(block_s * 1000) if block_s > 0 else None
        with self._reachable("reading"):
            reply = self._client.xreadgroup(self.group, consumer, {self.stream: ">"}, count=count, block=block)
            if not reply:
                return []
            _, entries = reply[0]
            return self._deliveries(entries, redelivered=False)

    def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        with self._reachable("acknowledging"):
            return int(self._client.xack(self.stream, self.group, *entry_ids))

    def claim_stale(self, consumer: str, min_idle_s: float, count: int = 100,
                    start: str = "0-0") -> tuple[str, list[Delivery]]:
        with self._reachable("claiming pending records"):
            return self._claim_stale(consumer, min_idle_s, count, start)

    def _claim_stale(self, consumer: str, min_idle_s: float, count: int, start: str) -> tuple[str, list[Delivery]]:
        reply = self._client.xautoclaim(self.stream, self.group, consumer, int(min_idle_s * 1000),
                                        start_id=start, count=count)
        cursor, entries = reply[0], reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        if deleted:  # entries trimmed away while pending: nothing left to apply
            self.ack([d.decode() if isinstance(d, bytes) else d for d in deleted])
        cursor = cursor.decode() if isinstance(cursor, bytes) else cursor
        return cursor, self._deliveries(entries, redelivered=True)

    def pending(self) -> int:
        with self._reachable("counting pending records"):
            return int(self._client.xpending(self.stream, self.group)["pending"])

    def backlog(self) -> int:
        """Entries never delivered to the group (its lag; Redis >= 7)."""
        with self._reachable("reading the group's lag"):
            groups = self._client.xinfo_groups(self.stream)
        for info in groups:
            name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
            if name == self.group and info.get("lag") is not None:
                return int(info["lag"])
        return 0

    def delete(self) -> None:
        """Remove the stream and its groups (tests, teardown)."""
        self._client.delete(self.stream)

    def close(self) -> None:
        self._client.close()
