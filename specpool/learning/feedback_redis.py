"""The feedback stream on Redis Streams (served mode): XADD with MAXLEN ~, a consumer group read
with XREADGROUP, XACK, and XAUTOCLAIM for the records a crashed learner left pending.

Same semantics as ``InProcessFeedbackStream`` (specpool/learning/feedback.py). ``emit`` is on the serving
path, so it must never hold a request up: on a Redis error it counts the record as dropped and
stops trying for ``retry_after_s`` (a request then pays at most one failed call per period).

**One stream per tenant.** A record goes to ``<stream>:<tenant>``, bounded by its own MAXLEN, and
its tenant is added to the set ``<stream>:_tenants`` in the same round trip; the learner reads the
streams round-robin, at most an equal share of each read from each. So one tenant's flood trims
only its own oldest records and takes no more than its share of the learner, whatever the others
send. (Per-tenant rate caps at emit would have needed a rate per tenant, shared across router
replicas, and still let the sum of capped tenants trim everyone's records.) A payload that names
no tenant (not a feedback record) goes to ``<stream>`` itself, which the learner reads too.
Entry ids handed out are ``<tenant>/<id>`` (no tenant id holds a "/"), or the bare id on ``<stream>``.

**A Redis that lost the group** (restarted without persistence, or the key deleted) answers
NOGROUP: the group is created again (``XGROUP CREATE ... 0 MKSTREAM``: nothing emitted since is
skipped) and the call retried once, instead of failing until someone recreates it by hand.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Sequence

from specpool.learning.feedback import Delivery
from specpool.core.errors import InvalidArgument, StoreUnavailable
from specpool.router.session_store import TENANT_PATTERN, redact_url, redis_error_reason  # one wording and one redaction for every Redis URL

FIELD = b"r"  # the stream entry's one field: the encoded record
TENANT_IN_PAYLOAD = re.compile(rb'"tenant":"([A-Za-z0-9][A-Za-z0-9_.-]{0,63})"')  # FeedbackRecord.encode's layout
DISCOVER_EVERY_S = 1.0  # how often the learner looks for new tenants' streams

log = logging.getLogger("specpool.feedback")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisFeedbackStream:
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        stream: str = "specpool:feedback",
        group: str = "learners",
        maxlen: int = 100_000,  # per tenant's stream, approximate (MAXLEN ~): its oldest entries are trimmed
        retry_after_s: float = 5.0,
        client=None,
    ):
        import redis  # here, so the embedded mode needs no redis-py

        self._redis = redis
        self.stream, self.group, self.maxlen, self.retry_after_s = stream, group, maxlen, retry_after_s
        self.tenants_key = f"{stream}:_tenants"
        self.describe = f"{redact_url(url)} stream {stream}"
        try:
            self._client = client or redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)
        except ValueError as exc:  # a malformed URL; redis-py's message does not echo it
            raise InvalidArgument(f"invalid Redis URL {redact_url(url)!r}: {exc}") from None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.emitted = 0
        self.dropped = 0  # not written because Redis failed (trimming by MAXLEN is not counted)
        self.groups_recreated = 0  # times the group was found missing (Redis lost it) and created again
        self._tenants: list[str] = []  # the tenants' streams the reader knows, sorted
        self._grouped: set[str] = set()  # stream keys the group was created on
        self._discovered = 0.0
        self._turn = 0  # round-robin: the stream the next read starts with
        try:
            self._create_group(stream)
        except redis.AuthenticationError as exc:  # before ConnectionError: it is a subclass
            raise StoreUnavailable(f"Redis at {self.describe} rejected the credentials ({redis_error_reason(exc)}); "
                                   "check the user and password in the URL") from None
        except redis.ResponseError as exc:
            raise StoreUnavailable(f"cannot create the feedback consumer group on {self.describe}: {exc}") from None
        except redis.RedisError as exc:
            raise StoreUnavailable(f"feedback stream {self.describe} is unreachable ({redis_error_reason(exc)})") from None

    # -- keys and groups -------------------------------------------------------------------------

    def _key(self, tenant: str) -> str:
        return f"{self.stream}:{tenant}" if tenant else self.stream

    @staticmethod
    def _split(entry_id: str) -> tuple[str, str]:
        """(tenant or "" for the bare stream, the stream's own id)."""
        tenant, _, raw = entry_id.rpartition("/")
        return tenant, raw

    @staticmethod
    def _join(tenant: str, raw_id) -> str:
        raw_id = _text(raw_id)
        return f"{tenant}/{raw_id}" if tenant else raw_id

    def _create_group(self, key: str) -> None:
        try:
            self._client.xgroup_create(key, self.group, id="0", mkstream=True)
        except self._redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._grouped.add(key)

    def _with_group(self, call):
        """``call()``, and once more after creating the group again if Redis says it has none."""
        try:
            return call()
        except self._redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
        self.groups_recreated += 1
        log.warning("feedback stream %s: consumer group %s was gone (Redis restarted or lost the key); created again",
                    self.describe, self.group)
        for key in [self.stream, *(self._key(t) for t in self._tenants)]:
            self._grouped.discard(key)
            self._create_group(key)
        return call()

    def _pipelined(self, build) -> list:
        """One round trip: ``build(pipe)`` queues the commands (built again when retried)."""
        pipe = self._client.pipeline(transaction=False)
        build(pipe)
        return pipe.execute()

    def _streams(self) -> list[str]:
        """"" (the bare stream) and every tenant with a stream, sorted; new ones get the group."""
        now = time.monotonic()
        if now - self._discovered >= DISCOVER_EVERY_S:
            self._discovered = now
            self._tenants = sorted(_text(t) for t in self._client.smembers(self.tenants_key))
        for tenant in ["", *self._tenants]:
            if self._key(tenant) not in self._grouped:
                self._create_group(self._key(tenant))
        return ["", *self._tenants]

    @contextlib.contextmanager
    def _reachable(self, what: str):
        """The learner's calls: a Redis failure becomes one clear StoreUnavailable."""
        try:
            yield
        except self._redis.RedisError as exc:
            raise StoreUnavailable(f"lost the feedback stream {self.describe} while {what} ({redis_error_reason(exc)})") from None

    # -- the producer ----------------------------------------------------------------------------

    def emit(self, payload: bytes, tenant: str | None = None) -> None:
        """Append ``payload`` to its tenant's stream (``tenant``, else the one the record names)."""
        if time.monotonic() < self._down_until:
            with self._lock:
                self.dropped += 1
            return
        if tenant is None:
            found = TENANT_IN_PAYLOAD.search(payload[:2048]) if isinstance(payload, (bytes, bytearray)) else None
            tenant = found.group(1).decode() if found else ""
        elif TENANT_PATTERN.fullmatch(tenant) is None:
            tenant = ""
        try:
            if tenant:
                pipe = self._client.pipeline(transaction=False)
                pipe.xadd(self._key(tenant), {FIELD: payload}, maxlen=self.maxlen, approximate=True)
                pipe.sadd(self.tenants_key, tenant)  # every time: a Redis that restarted forgets the set
                pipe.execute()
            else:
                self._client.xadd(self.stream, {FIELD: payload}, maxlen=self.maxlen, approximate=True)
        except self._redis.RedisError:
            with self._lock:
                self.dropped += 1
                self._down_until = time.monotonic() + self.retry_after_s
            return
        with self._lock:
            self.emitted += 1

    # -- the consumer ----------------------------------------------------------------------------

    def _deliveries(self, tenant: str, entries, redelivered: bool) -> list[Delivery]:
        out, missing = [], []
        for entry_id, fields in entries:
            entry_id = self._join(tenant, entry_id)
            if not fields or FIELD not in fields:  # trimmed or deleted while pending
                missing.append(entry_id)
                continue
            out.append(Delivery(entry_id, fields[FIELD], 1))
        if missing:  # nothing left to apply: no effect to hold
            self.ack(missing)
        if redelivered and out:
            counts = {}
            rows = self._with_group(lambda: self._client.xpending_range(
                self._key(tenant), self.group, min=self._split(out[0].entry_id)[1],
                max=self._split(out[-1].entry_id)[1], count=len(out) * 2 + 10))
            for row in rows:
                counts[self._join(tenant, row["message_id"])] = int(row["times_delivered"])
            out = [Delivery(d.entry_id, d.payload, counts.get(d.entry_id, 2)) for d in out]
        return out

    def read(self, consumer: str, count: int, block_s: float = 0.0) -> list[Delivery]:
        """Up to ``count`` new entries, shared max-min fairly among the tenants' streams: each gets an
        equal share, and what a stream with fewer leaves unused goes, in further rounds, to those
        that filled theirs (the rotation changes who gets the odd ones out on each read)."""
        with self._reachable("reading"):
            tenants = self._with_group(self._streams)
            n = len(tenants)
            start = self._turn % n
            self._turn += 1
            open_ = tenants[start:] + tenants[:start]  # streams that may hold more
            out: list[Delivery] = []
            while open_ and len(out) < count:
                budget = count - len(out)
                order = open_[:budget]
                share, extra = divmod(budget, len(order))
                shares = [share + (i < extra) for i in range(len(order))]
                replies = self._with_group(lambda: self._pipelined(
                    lambda pipe: [pipe.xreadgroup(self.group, consumer, {self._key(t): ">"}, count=c)
                                  for t, c in zip(order, shares)]))
                open_ = open_[len(order):]  # not asked this round: still open
                for tenant, wanted, reply in zip(order, shares, replies):
                    entries = reply[0][1] if reply else []
                    out += self._deliveries(tenant, entries, redelivered=False)
                    if len(entries) >= wanted:
                        open_.append(tenant)  # it filled its share: it may have more
            if out or block_s <= 0:
                return out
            if n > count:  # a blocking read over every stream could hand out more than asked
                time.sleep(block_s)
                return []
            reply = self._with_group(lambda: self._client.xreadgroup(
                self.group, consumer, {self._key(t): ">" for t in tenants}, count=1, block=int(block_s * 1000)))
            for key, entries in reply or []:
                key = _text(key)
                tenant = "" if key == self.stream else key[len(self.stream) + 1:]
                out += self._deliveries(tenant, entries, redelivered=False)
            return out

    def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        by_stream: dict[str, list[str]] = {}
        for entry_id in entry_ids:
            tenant, raw = self._split(entry_id)
            by_stream.setdefault(self._key(tenant), []).append(raw)
        with self._reachable("acknowledging"):
            replies = self._with_group(lambda: self._pipelined(
                lambda pipe: [pipe.xack(key, self.group, *ids) for key, ids in by_stream.items()]))
            return sum(int(n) for n in replies)

    def _scan(self, what: str, start: str, fetch) -> tuple[str, list[Delivery]]:
        """Walk the streams from cursor ``start`` (``<tenant>/<id>``; "0-0": the beginning) with
        ``fetch(tenant, from_id) -> (next id or "0-0" at its end, deliveries)`` until some come back."""
        with self._reachable(what):
            tenants = self._with_group(self._streams)
            tenant, position = ("", "0-0") if start == "0-0" else self._split(start)
            index = tenants.index(tenant) if tenant in tenants else 0
            while index < len(tenants):
                cursor, deliveries = fetch(tenants[index], position)
                if cursor != "0-0":
                    return self._join(tenants[index], cursor) if tenants[index] else cursor, deliveries
                index, position = index + 1, "0-0"
                if deliveries:
                    if index == len(tenants):
                        return "0-0", deliveries
                    return f"{tenants[index]}/0-0" if tenants[index] else "0-0", deliveries
            return "0-0", []

    def claim_stale(self, consumer: str, min_idle_s: float, count: int = 100,
                    start: str = "0-0") -> tuple[str, list[Delivery]]:
        def fetch(tenant: str, position: str):
            reply = self._with_group(lambda: self._client.xautoclaim(
                self._key(tenant), self.group, consumer, int(min_idle_s * 1000), start_id=position, count=count))
            cursor, entries = _text(reply[0]), reply[1]
            deleted = reply[2] if len(reply) > 2 else []
            if deleted:  # entries trimmed away while pending: nothing left to apply
                self.ack([self._join(tenant, d) for d in deleted])
            return cursor, self._deliveries(tenant, entries, redelivered=True)

        return self._scan("claiming pending records", start, fetch)

    def claim_own(self, consumer: str, count: int = 100, start: str = "0-0") -> tuple[str, list[Delivery]]:
        """This consumer's own pending entries (XREADGROUP from id 0: a learner restarted under its
        name gets them back at once, not after ``claim_idle_s``), scanned like ``claim_stale``."""
        def fetch(tenant: str, position: str):
            reply = self._with_group(lambda: self._client.xreadgroup(
                self.group, consumer, {self._key(tenant): position}, count=count))
            entries = reply[0][1] if reply else []
            if not entries:
                return "0-0", []
            last = _text(entries[-1][0])
            # Entries trimmed while pending come back without fields: acknowledged by _deliveries.
            deliveries = self._deliveries(tenant, entries, redelivered=True)
            return (last if len(entries) >= count else "0-0"), deliveries

        return self._scan("reading its own pending records", start, fetch)

    def pending(self) -> int:
        with self._reachable("counting pending records"):
            tenants = self._with_group(self._streams)
            return sum(int(self._with_group(lambda: self._client.xpending(self._key(t), self.group))["pending"])
                       for t in tenants)

    def backlog(self) -> int:
        """Entries never delivered to the group, over every tenant's stream (its lag; Redis >= 7)."""
        total = 0
        with self._reachable("reading the group's lag"):
            for tenant in self._with_group(self._streams):
                for info in self._client.xinfo_groups(self._key(tenant)):
                    if _text(info["name"]) == self.group and info.get("lag") is not None:
                        total += int(info["lag"])
        return total

    def delete(self) -> None:
        """Remove the streams, their groups and the tenant set (tests, teardown)."""
        tenants = [_text(t) for t in self._client.smembers(self.tenants_key)]
        self._client.delete(self.stream, self.tenants_key, *(self._key(t) for t in tenants))
        self._grouped.clear()

    def close(self) -> None:
        self._client.close()
