"""Per-session bandit state, and per-tenant aggregate arm statistics, kept between requests.

A policy's state for one conversation (its bandit counts, last context, ...) lives under a
``SessionKey`` (tenant, session); every tenant also has an aggregate ``ArmStats`` table that new
sessions can start from. Two implementations of one ``SessionStore`` protocol:

- ``InMemorySessionStore``: one process, a lock, lazy TTL and LRU eviction (tests, single replica).
- ``RedisSessionStore``: shared by every replica; survives restarts (with Redis persistence).

Updates are *transactions over a pure function*: ``transact(key, fn)`` reads the state, calls
``fn(state) -> (new_state, increments)``, and stores the result only if nobody wrote the session
in between, else calls ``fn`` again on the fresher state. So concurrent requests of one session
(two replicas, two streams) never lose an update, whatever Python the policy runs.

States are JSON: both stores keep the encoded text, so a state that works in memory works in Redis,
and no caller can mutate a stored state through a reference it kept.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from specpool.core.errors import InvalidArgument, SpecpoolError, StoreUnavailable, check

# Ids end up inside Redis keys and ACL patterns, so neither may contain glob characters (* ? [ ]),
# hash-tag braces or path tricks; a tenant has no ':' either, so "{ns}:{tenant}:" is a closed prefix.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SESSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")

ArmStats = dict[str, dict[str, float]]  # arm name -> {stat name -> value}, e.g. {"code": {"n": 3.0}}
UpdateFn = Callable[[dict | None], tuple[dict, ArmStats]]

MAX_TRANSACT_TRIES = 200  # optimistic retries before transact gives up (contention on one session)


def _shown(value: object, limit: int = 80) -> str:
    """An id as an error message shows it: repr, cut short (ids come from clients)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class SessionKey:
    """Which session: validated on construction, so a key can always be embedded in a store key."""

    tenant: str
    session: str

    def __post_init__(self) -> None:
        check(
            isinstance(self.tenant, str) and TENANT_PATTERN.fullmatch(self.tenant) is not None,
            f"invalid tenant id {_shown(self.tenant)}: use 1-64 characters from A-Z a-z 0-9 _ . - "
            "starting with a letter or digit",
        )
        check(
            isinstance(self.session, str) and SESSION_PATTERN.fullmatch(self.session) is not None,
            f"invalid session id {_shown(self.session)}: use 1-128 characters from A-Z a-z 0-9 _ . : - "
            "starting with a letter or digit",
        )


@runtime_checkable
class SessionStore(Protocol):
    describe: str  # where the state lives, for logs: "memory", "redis://host:6379/0" (no password)
    # Whether a write costs a round trip worth taking off a round's path: the bandit then writes
    # each round on a thread of its own (specpool/router/bandit.py). A store without it: False.
    write_behind: bool

    def read(self, key: SessionKey) -> tuple[dict | None, ArmStats]:
        """One atomic snapshot: (the session's state, or None if absent/expired; the tenant's
        aggregate arm stats)."""
        ...

    def transact(self, key: SessionKey, fn: UpdateFn) -> dict:
        """Atomically: ``new_state, increments = fn(current state or None)``; store new_state
        (refreshing the session TTL) and add ``increments`` to the tenant's arm stats, all or
        nothing. ``fn`` must be pure and must not call the store: it may run more than once
        (optimistic retries) and gets its own copy of the state. If ``fn`` raises, nothing is
        stored and the exception propagates. Returns new_state as stored (JSON round-tripped)."""
        ...

    def delete(self, key: SessionKey) -> None:
        """Forget the session's state (the tenant's aggregate keeps what it learned)."""
        ...

    def close(self) -> None: ...


def _encode(new_state: object, increments: object) -> tuple[str, list[tuple[str, str, float]]]:
    """Validate what ``fn`` returned: (state as JSON text, [(arm, stat, delta)]). Raises before
    anything is written, so a bad update is all-or-nothing like any other failure of ``fn``."""
    if not isinstance(new_state, dict):
        raise SpecpoolError(f"session state must be a dict, got {type(new_state).__name__}")
    try:  # allow_nan=False: NaN/Infinity are not JSON, and other readers of the store reject them
        encoded = json.dumps(new_state, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SpecpoolError(f"session state must be JSON-serialisable ({exc})") from None
    if not isinstance(increments, Mapping):
        raise SpecpoolError(f"arm stat increments must be a dict, got {type(increments).__name__}")
    deltas = []
    for arm, stats in increments.items():
        if not (isinstance(arm, str) and arm and isinstance(stats, Mapping)):
            raise SpecpoolError(f"arm stat increments must map arm names to dicts, got {_shown(arm)}")
        for stat, value in stats.items():
            # A Redis hash field is "stat:arm": stats have no ':' so arms may contain one.
            if not (isinstance(stat, str) and stat and ":" not in stat):
                raise SpecpoolError(f"invalid arm stat name {_shown(stat)}: non-empty, without ':'")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SpecpoolError(f"arm stat increment {arm}/{stat} must be a finite number, got {_shown(value)}")
            deltas.append((arm, stat, float(value)))
    return encoded, deltas


class InMemorySessionStore:
    """Sessions in one ordered dict under one lock: for tests and single-process serving.

    Entries are ordered by last write, and every write sets the same TTL, so the front of the dict
    is at once the least recently written and the first to expire: expiry is lazy (on access, and
    popped from the front on writes) and eviction beyond ``max_sessions`` pops the front too.
    Reads do not refresh a session (as in Redis, where GET leaves the TTL alone); the router writes
    every session it serves. Tenant arm stats are kept for the life of the store.
    """

    describe = "memory"
    write_behind = False  # a write is a dict update under a lock

    def __init__(self, ttl_s: float = 3600.0, max_sessions: int = 100_000, clock: Callable[[], float] = time.monotonic):
        check(ttl_s > 0, f"session TTL must be positive, got {ttl_s}")
        check(max_sessions >= 1, f"max_sessions must be at least 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[SessionKey, tuple[float, str]] = OrderedDict()  # key -> (expires at, JSON)
        self._arms: dict[str, ArmStats] = {}  # tenant -> arm -> stat -> value

    def _live(self, key: SessionKey, now: float) -> str | None:
        entry = self._sessions.get(key)
        if entry is not None and entry[0] <= now:
            del self._sessions[key]
            return None
        return entry[1] if entry is not None else None

    def _tenant_stats(self, tenant: str) -> ArmStats:
        return {arm: dict(stats) for arm, stats in self._arms.get(tenant, {}).items()}

    def read(self, key: SessionKey) -> tuple[dict | None, ArmStats]:
        with self._lock:
            encoded = self._live(key, self._clock())
            return (None if encoded is None else json.loads(encoded)), self._tenant_stats(key.tenant)

    def transact(self, key: SessionKey, fn: UpdateFn) -> dict:
        # fn runs under the lock: it is pure and quick, and no other writer can interleave, so it
        # is called exactly once here (the Redis store may call it again).
        with self._lock:
            now = self._clock()
            current = self._live(key, now)
            encoded, deltas = _encode(*fn(None if current is None else json.loads(current)))
            while self._sessions and next(iter(self._sessions.values()))[0] <= now:
                self._sessions.popitem(last=False)  # expired, oldest first
            self._sessions[key] = (now + self.ttl_s, encoded)
            self._sessions.move_to_end(key)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)  # least recently written
            arms = self._arms.setdefault(key.tenant, {})
            for arm, stat, delta in deltas:
                stats = arms.setdefault(arm, {})
                stats[stat] = stats.get(stat, 0.0) + delta
            return json.loads(encoded)

    def delete(self, key: SessionKey) -> None:
        with self._lock:
            self._sessions.pop(key, None)

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        """Sessions held, expired ones not yet dropped included."""
        return len(self._sessions)


def redact_url(url: str) -> str:
    """A store URL fit for logs and messages: the password (userinfo or ?password=) as ***."""
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed (e.g. "[::1"): hide everything before an "@"
        return re.sub(r"[^/@]*@", "***@", url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at:  # "user:pw@" -> "user:***@"; a lone "x@" may be a password too: "***@"
        userinfo = userinfo.split(":", 1)[0] + ":***" if ":" in userinfo else "***"
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    if not at and query == parts.query:
        return url  # nothing to hide (and urlunsplit would turn "unix:///p" into "unix:/p")
    return urlunsplit((parts.scheme, userinfo + at + hostport, parts.path, query, parts.fragment))


def tenant_key_pattern(namespace: str, tenant: str) -> str:
    """The Redis ACL key pattern covering exactly one tenant's keys, e.g. for
    ``ACL SETUSER tenant-a on >PASSWORD resetkeys ~specpool:{a}:* +@all -@dangerous``.

    Braces are literal in Redis globs, and validated namespaces and tenants contain no glob
    characters nor ':' in a tenant, so tenant "a" cannot reach "specpool:{ab}:..." or "specpool:{b}:...".
    """
    check(NAMESPACE_PATTERN.fullmatch(namespace) is not None, f"invalid namespace {_shown(namespace)}")
    SessionKey(tenant, "x")  # validates the tenant id
    return f"{namespace}:{{{tenant}}}:*"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redis_error_reason(exc: BaseException) -> str:
    """The root cause in a few words: "Connection refused" rather than redis-py's full sentence."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return str(exc).rstrip(".") or type(exc).__name__


class RedisSessionStore:
    """Sessions and tenant aggregates in Redis, shared by every replica.

    Keys (the ``{tenant}`` hash tag puts a tenant's keys in one Redis Cluster slot, so a MULTI over
    a session and its tenant's aggregate is allowed there too):
    - ``{namespace}:{tenant}:session:{session}``: the state as JSON text, expiring ``ttl_s`` after
      the last write;
    - ``{namespace}:{tenant}:arms``: a hash of ``"{stat}:{arm}"`` -> float, grown with
      HINCRBYFLOAT, expiring ``tenant_ttl_s`` after the tenant's last write.

    ``transact`` is optimistic (WATCH, GET, fn, MULTI/EXEC, retry on conflict) rather than a Lua
    script: the update is arbitrary, pure Python policy code, and this keeps one implementation for
    every policy; aggregates are commutative increments, so they need no watch of their own.
    ``client`` lets tests and callers pass a configured ``redis.Redis``; the store then does not
    close it, and ``url`` only names it in messages. Connection failures raise ``StoreUnavailable``; Redis' own refusals (NOPERM from an
    ACL, ...) propagate as redis-py errors.
    """

    write_behind = True  # a write is two round trips (WATCH+GET, MULTI..EXEC) to a server

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: float = 3600.0,
        tenant_ttl_s: float = 7 * 24 * 3600,
        namespace: str = "specpool",
        client: Any = None,
    ):
        import redis  # here, so the in-memory store works without redis-py installed
        from redis.backoff import EqualJitterBackoff
        from redis.retry import Retry

        check(ttl_s > 0 and tenant_ttl_s > 0, f"TTLs must be positive, got {ttl_s} and {tenant_ttl_s}")
        check(
            NAMESPACE_PATTERN.fullmatch(namespace) is not None,
            f"invalid namespace {_shown(namespace)}: use 1-64 characters from A-Z a-z 0-9 _ . : -",
        )
        self._redis = redis
        self.describe = redact_url(url)
        self.namespace = namespace
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._tenant_ttl_ms = max(1, round(tenant_ttl_s * 1000))
        self._rng = random.Random()  # jitter between retries only; never affects results
        self._owns_client = client is None
        if client is None:
            try:
                client = redis.Redis.from_url(
                    url,
                    decode_responses=True,
                    socket_connect_timeout=2.0,  # fail fast at startup when Redis is not there
                    socket_timeout=5.0,
                    retry=Retry(EqualJitterBackoff(cap=0.5, base=0.05), 1),  # one quick reconnect
                )
            except ValueError as exc:  # a malformed URL; redis-py's message does not echo it
                raise InvalidArgument(f"invalid Redis URL {self.describe}: {exc}") from None
        self._client = client
        try:
            client.ping()
        except redis.AuthenticationError as exc:  # before ConnectionError: it is a subclass
            self.close()
            raise StoreUnavailable(
                f"Redis at {self.describe} rejected the credentials ({redis_error_reason(exc)}); "
                "check the user and password in the store URL"
            ) from None
        except redis.RedisError as exc:
            self.close()
            raise StoreUnavailable(
                f"cannot reach Redis at {self.describe} ({redis_error_reason(exc)}); "
                "start redis-server or use the in-memory store (--store memory)"
            ) from None

    def _session_key(self, key: SessionKey) -> str:
        return f"{self.namespace}:{{{key.tenant}}}:session:{key.session}"

    def _arms_key(self, tenant: str) -> str:
        return f"{self.namespace}:{{{tenant}}}:arms"

    def _lost(self, exc: BaseException, what: str = "") -> StoreUnavailable:
        return StoreUnavailable(f"lost the connection to Redis at {self.describe} ({redis_error_reason(exc)}){what}")

    def read(self, key: SessionKey) -> tuple[dict | None, ArmStats]:
        try:
            with self._client.pipeline(transaction=True) as pipe:  # MULTI/EXEC: one snapshot
                pipe.get(self._session_key(key))
                pipe.hgetall(self._arms_key(key.tenant))
                raw, fields = pipe.execute()
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            raise self._lost(exc) from None
        stats: ArmStats = {}
        for field, value in fields.items():
            stat, _, arm = _text(field).partition(":")
            stats.setdefault(arm, {})[stat] = float(value)
        return (None if raw is None else json.loads(raw)), stats

    def transact(self, key: SessionKey, fn: UpdateFn) -> dict:
        WatchError = self._redis.WatchError
        skey, akey = self._session_key(key), self._arms_key(key.tenant)
        for attempt in range(MAX_TRANSACT_TRIES):
            committing = False
            try:
                with self._client.pipeline(transaction=True) as pipe:
                    pipe.watch(skey)  # EXEC fails if anyone writes the session after this
                    raw = pipe.get(skey)
                    encoded, deltas = _encode(*fn(None if raw is None else json.loads(raw)))
                    pipe.multi()
                    pipe.set(skey, encoded, px=self._ttl_ms)
                    for arm, stat, delta in deltas:
                        pipe.hincrbyfloat(akey, f"{stat}:{arm}", delta)
                    pipe.pexpire(akey, self._tenant_ttl_ms)  # no-op while the tenant has no stats
                    committing = True
                    pipe.execute()
                return json.loads(encoded)
            except WatchError as exc:
                lost = exc.__context__
                if isinstance(lost, (self._redis.ConnectionError, self._redis.TimeoutError)):
                    if committing:  # the EXEC may or may not have run: retrying could apply fn twice
                        raise self._lost(lost, "; the update may or may not have been applied") from None
                    continue  # lost before MULTI: nothing was written, start over
                # Another writer won: retry on its state, after a short random pause so that
                # writers that keep colliding spread out.
                time.sleep(self._rng.uniform(0, min(0.02, 0.0005 * 2**attempt)))
            except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
                raise self._lost(exc) from None
        raise SpecpoolError(
            f"session {key.tenant}/{key.session}: gave up after {MAX_TRANSACT_TRIES} conflicting writes; "
            "contention on this session is too high (are many requests of one session running at once?)"
        )

    def delete(self, key: SessionKey) -> None:
        try:
            self._client.delete(self._session_key(key))
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            raise self._lost(exc) from None

    def close(self) -> None:
        if self._owns_client and self._client is not None:
            self._client.close()


def open_store(spec: str, ttl_s: float = 3600.0, namespace: str = "specpool") -> SessionStore:
    """The store a ``--store`` value names: "memory", or a Redis URL (redis://, rediss://, unix://).
    ``namespace`` prefixes Redis keys (a benchmark run uses its own, to start from empty stats)."""
    if spec == "memory":
        return InMemorySessionStore(ttl_s=ttl_s)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisSessionStore(spec, ttl_s=ttl_s, namespace=namespace)
    shown = re.sub(r"[^/@]*@", "***@", spec)  # a mistyped URL may still carry a password
    raise InvalidArgument(
        f"unknown session store {shown!r}: use 'memory' or a Redis URL "
        "(redis://[user:password@]host:port/db, rediss://... for TLS, unix:///path/to/redis.sock)"
    )
