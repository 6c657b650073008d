"""Admission control and per-tenant quotas, enforced across router replicas (issue 27, item 3).

A quota file (YAML or JSON; ``quotas_file`` in the router's args) sets per-tenant limits, each
optional (absent or ``null``: no limit); a tenant's entry overrides ``default`` field by field:

    default:
      max_concurrent: 8          # requests running at once, over every router replica
      tokens_per_minute: 200000  # prompt + completion tokens, over every router replica
      max_prompt_bytes: 65536    # UTF-8 bytes of the prompt / chat messages, checked before tokenization
      max_new_tokens: 2048       # a request asking more is refused (INVALID_ARGUMENT, HTTP 400)
    tenants:
      acme: {max_concurrent: 32, tokens_per_minute: 1000000}
      ops: {tokens_per_minute: null}   # null: unlimited, whatever default says

No file: no per-tenant limit (only the replica's ``max_concurrent_total``, if set).

A request passes in two steps, because its prompt tokens are known only after tokenization:

1. ``precheck(tenant, prompt_bytes, max_new_tokens)``, before tokenization: the size limits
   (INVALID_ARGUMENT: retrying never helps, and clients retry RESOURCE_EXHAUSTED automatically),
   this replica's bounded queue (``max_concurrent_total``), then one Lua script that takes a
   concurrency slot and reserves ``max_new_tokens`` from the tenant's token bucket, both or
   neither. Returns a ``Ticket``.
2. ``ticket.charge(prompt_tokens)``, after tokenization: reserves the prompt tokens too. A request
   whose prompt + max_new_tokens exceeds tokens_per_minute can never run: INVALID_ARGUMENT.
3. ``ticket.release(used_tokens)`` when it ends, however it ends (idempotent): frees the slot and
   gives back what was reserved and not used. ``None``: used unknown, nothing given back.

``admit(...)`` does 1 and 2 in one call when the prompt tokens are already known.

Over a limit: ``QuotaExceeded`` (a ``ResourceExhausted``: gRPC RESOURCE_EXHAUSTED, HTTP 429) whose
message says when to retry and whose ``retry_after_s`` the APIs send as ``retry-after`` /
``retry-after-ms`` (gRPC trailing metadata: ``retry_metadata``; HTTP headers: ``retry_headers``).
Never a wait: admission answers at once.

Redis keys (the ``{tenant}`` hash tag keeps a tenant's keys in one Redis Cluster slot, like the
session store's; nothing is shared between tenants, so one tenant at its limit never touches
another's keys):

- ``{ns}:{tenant}:admission:inflight``: a sorted set of ticket ids scored by lease expiry (Redis
  server time, ms). Expired members are dropped before counting, so the slots of a router replica
  that crashed come back after ``lease_s``; a background thread renews the leases of the requests
  this replica runs (every ``lease_s / 3``), so a long request keeps its slot.
- ``{ns}:{tenant}:admission:tokens``: a token bucket (a hash: tokens, ts) holding at most
  ``tokens_per_minute`` and refilling continuously at tokens_per_minute / 60 per second: over any
  minute a tenant gets its rate, after a quiet minute it may burst one minute's worth, and the
  retry hint is exact (the time until the bucket holds what the request needs). A release adds
  the unused reservation back (capped at the capacity). The script reads Redis' clock (TIME), so
  the replicas' clocks need not agree.

**Redis outage: fail open, loudly.** When Redis cannot be reached, requests are admitted without
the shared limits, every failed call is counted (``errors``, to export as ``admission.errors``),
and a warning is logged at most once per ``backoff_s``, during which Redis is not tried again (so
an outage costs one socket timeout per backoff, not one per request). Why open: quotas protect
capacity and fairness, not correctness; failing closed would turn a Redis blip into an outage of
every tenant at once, while the per-replica bound (``max_concurrent_total``, in process) still
keeps each replica from being overrun. What was admitted unchecked is counted in ``unchecked``.

Thread-safe; every call is quick (no waiting for a slot).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from specpool.core.errors import InvalidArgument, NotFound, ResourceExhausted
from specpool.router.session_store import NAMESPACE_PATTERN, TENANT_PATTERN, redact_url, redis_error_reason

logger = logging.getLogger(__name__)

LIMITS = ("max_concurrent", "tokens_per_minute", "max_prompt_bytes", "max_new_tokens")
BUCKET_TTL_MS = 61_000  # a bucket refills in at most 60 s: one untouched longer is full, so may vanish


class QuotaExceeded(ResourceExhausted):
    """A tenant (or this replica) is at a limit; ``retry_after_s`` says when a retry may pass."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)

    def __reduce__(self):  # keeps retry_after_s through pickling (Ray moves exceptions that way)
        return type(self), (str(self), self.retry_after_s)


# -- configuration -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Quota:
    """One tenant's limits; None: no limit."""

    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    max_prompt_bytes: int | None = None
    max_new_tokens: int | None = None

    @property
    def shared(self) -> bool:
        """Whether checking it needs Redis (limits across replicas)."""
        return self.max_concurrent is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Quotas:
    default: Quota = Quota()
    tenants: Mapping[str, Quota] = field(default_factory=dict)

    def of(self, tenant: str) -> Quota:
        return self.tenants.get(tenant, self.default)

    @property
    def shared(self) -> bool:
        return self.default.shared or any(q.shared for q in self.tenants.values())


def _limits(raw: Any, where: str, base: Quota) -> Quota:
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"{where} must be a mapping of limits ({', '.join(LIMITS)}), got {raw!r:.60}")
    unknown = sorted(set(map(str, raw)) - set(LIMITS))
    if unknown:
        raise InvalidArgument(f"{where} has unknown fields {unknown} (known: {', '.join(LIMITS)})")
    values = {f.name: getattr(base, f.name) for f in fields(Quota)}
    for name, value in raw.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidArgument(f"{where}.{name} must be a positive integer or null (no limit), got {value!r:.60}")
        values[name] = value
    return Quota(**values)


def parse_quotas(document: Any, source: str, known_tenants: set[str] | None = None) -> Quotas:
    """Check a quota document ({default: {...}, tenants: {name: {...}}}); one line per mistake.
    ``known_tenants``: the key file's tenants when API keys are on (a quota for a tenant no key
    can act as is a typo, refused at start-up); None: any tenant name is accepted."""
    if not isinstance(document, Mapping) or not document:
        raise InvalidArgument(f"{source}: expected a mapping with 'default' and/or 'tenants' "
                              "(remove the file to serve without quotas)")
    unknown = sorted(set(map(str, document)) - {"default", "tenants"})
    if unknown:
        raise InvalidArgument(f"{source}: unknown top-level fields {unknown} (known: default, tenants)")
    default = _limits(document.get("default") or {}, f"{source}: default", Quota())
    raw_tenants = document.get("tenants") or {}
    if not isinstance(raw_tenants, Mapping):
        raise InvalidArgument(f"{source}: tenants must be a mapping of tenant -> limits, got {raw_tenants!r:.60}")
    tenants: dict[str, Quota] = {}
    for name, raw in raw_tenants.items():
        if not isinstance(name, str) or not TENANT_PATTERN.fullmatch(name):
            raise InvalidArgument(f"{source}: tenant names are 1-64 characters from A-Z a-z 0-9 _ . -, got {name!r:.70}")
        if known_tenants is not None and name not in known_tenants:
            raise InvalidArgument(f"unknown tenant {name!r} in {source} (the key file has: "
                                  f"{', '.join(sorted(known_tenants)) or 'no tenants'})")
        tenants[name] = _limits(raw if raw is not None else {}, f"{source}: tenants.{name}", default)
    return Quotas(default, tenants)


def load_quotas(path: str | os.PathLike | None, known_tenants: set[str] | None = None) -> Quotas:
    """The quota file at ``path``; no path: no limits."""
    if path is None:
        return Quotas()
    import yaml

    path = Path(path)
    if not path.is_file():
        raise NotFound(f"quota file {path} does not exist")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{path}: not valid YAML or JSON ({str(exc).splitlines()[0]})") from None
    return parse_quotas(document, str(path), known_tenants)


def retry_headers(exc: BaseException) -> dict[str, str]:
    """HTTP headers of a refusal with a retry hint: ``Retry-After`` in whole seconds (RFC 9110
    allows no fraction) and ``retry-after-ms`` (the openai client reads it first); {} otherwise."""
    hint = getattr(exc, "retry_after_s", None) if isinstance(exc, QuotaExceeded) else None
    if hint is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(hint))), "retry-after-ms": str(max(1, math.ceil(hint * 1000)))}


def retry_metadata(exc: BaseException) -> list[tuple[str, str]]:
    """The same hint as gRPC trailing metadata (lowercase keys): [] for other errors."""
    return [(k.lower(), v) for k, v in retry_headers(exc).items()]


def prompt_bytes(text: str = "", messages: tuple[tuple[str, str], ...] | list = ()) -> int:
    """What ``max_prompt_bytes`` measures: UTF-8 bytes of the prompt text and of every chat
    message (role and content), as sent, before any template or tokenization."""
    return len(text.encode("utf-8")) + sum(len(r.encode("utf-8")) + len(c.encode("utf-8")) for r, c in messages)


# -- Redis scripts -----------------------------------------------------------------------------------
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_BUCKET = """
local function bucket(key, tpm, now)
  local b = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(b[1]) or tpm
  local ts = tonumber(b[2]) or now
  return math.min(tpm, tokens + math.max(0, now - ts) * tpm / 60000.0)
end
"""

# KEYS: inflight, tokens. ARGV: max_concurrent (-1: none), ticket, lease_ms, tokens_per_minute
# (-1: none), cost. Returns {1, 0} admitted; {0, running} at the concurrency limit; {2, wait_ms}
# short of tokens. Takes the slot and the tokens both or neither.
_ADMIT = _NOW + _BUCKET + """
local limit = tonumber(ARGV[1])
local tpm = tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
if limit >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local running = redis.call('ZCARD', KEYS[1])
  if running >= limit then return {0, running} end
end
if tpm >= 0 and cost > 0 then
  local tokens = bucket(KEYS[2], tpm, now)
  if tokens < cost then return {2, math.ceil((cost - tokens) * 60000.0 / tpm)} end
  redis.call('HSET', KEYS[2], 'tokens', tostring(tokens - cost), 'ts', now)
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
if limit >= 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
end
return {1, 0}
"""

# KEYS: inflight, tokens. ARGV: ticket, tokens_per_minute (-1: none), refund.
_RELEASE = _NOW + _BUCKET + """
redis.call('ZREM', KEYS[1], ARGV[1])
local tpm = tonumber(ARGV[2])
local refund = tonumber(ARGV[3])
if tpm >= 0 and refund > 0 and redis.call('EXISTS', KEYS[2]) == 1 then  -- gone: full already
  redis.call('HSET', KEYS[2], 'tokens', tostring(math.min(tpm, bucket(KEYS[2], tpm, now) + refund)), 'ts', now)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return 1
"""

# KEYS: inflight. ARGV: lease_ms, ticket... XX: a ticket released (or lapsed) meanwhile is not re-added.
_RENEW = _NOW + """
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i]) end
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
return 1
"""


# -- admission ---------------------------------------------------------------------------------------
class Ticket:
    """One admitted request. ``max_new_tokens`` is what it may generate (the tenant's limit applied
    to the server default when the request asked for none): run the request with it."""

    def __init__(self, admission: "Admission", tenant: str, max_new_tokens: int, slot: bool, reserved: int, local: bool):
        self.id = uuid.uuid4().hex
        self.tenant = tenant
        self.max_new_tokens = max_new_tokens
        self.reserved = reserved  # tokens taken from the tenant's bucket
        self._admission = admission
        self._slot = slot  # holds a slot in the tenant's Redis set
        self._local = local  # holds one of this replica's max_concurrent_total
        self._lock = threading.Lock()
        self.released = False
        self.unchecked = False  # admitted without (some of) its shared limits: Redis was down

    def charge(self, prompt_tokens: int) -> None:
        self._admission.charge(self, prompt_tokens)

    def renew(self) -> None:
        self._admission.renew([self])

    def release(self, used_tokens: int | None = None) -> None:
        """Free the slot and give back ``reserved - used_tokens`` (None: give nothing back). Idempotent."""
        with self._lock:
            if self.released:
                return
            self.released = True
        self._admission._release(self, used_tokens)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Admission:
    """Checks requests against ``quotas`` (shared over replicas through Redis at ``redis_url``)
    and this replica's ``max_concurrent_total``. ``client``: a configured ``redis.Redis`` instead."""

    def __init__(self, quotas: Quotas = Quotas(), redis_url: str = "redis://127.0.0.1:6379/0", *,
                 namespace: str = "specpool", client: Any = None, max_concurrent_total: int | None = None,
                 lease_s: float = 60.0, busy_retry_s: float = 1.0, backoff_s: float = 5.0,
                 socket_timeout_s: float = 0.5, on_event: Callable[[str, str], None] | None = None):
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise InvalidArgument(f"invalid Redis namespace {namespace!r}: use 1-64 characters from A-Z a-z 0-9 _ . : -")
        if max_concurrent_total is not None and max_concurrent_total < 1:
            raise InvalidArgument(f"max_concurrent_total must be >= 1, got {max_concurrent_total}")
        self.quotas = quotas
        self.namespace = namespace
        self.max_concurrent_total = max_concurrent_total
        self.lease_ms = max(1, round(lease_s * 1000))
        self.busy_retry_s = busy_retry_s  # a slot frees when some request ends: unknown when; ask again soon
        self.backoff_s = backoff_s
        self.errors = 0  # Redis calls that failed (export as admission.errors)
        self.unchecked = 0  # requests admitted without their shared limits (Redis was down)
        self.refused: Counter[str] = Counter()  # by reason: concurrency, tokens, replica, size
        # Each count is also reported as it happens, to the router's metrics
        # (specpool_admission_events): on_event(event, tenant), event "refused_<reason>",
        # "unchecked" or "store_error" (tenant "-": an outage is no one tenant's).
        self.on_event = on_event
        self._lock = threading.Lock()
        self._running = 0  # this replica's admitted requests (max_concurrent_total)
        self._live: dict[str, Ticket] = {}  # tickets holding a Redis slot: their leases are renewed
        self._skip_until = 0.0  # Redis is not tried before this (monotonic) after an error
        self._stop = threading.Event()
        self._redis = None
        self._renewer: threading.Thread | None = None
        self.describe = redact_url(redis_url)
        if quotas.shared:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._redis = redis
            if client is None:
                try:  # short timeouts and one quick retry: admission must answer at once, even in an outage
                    client = redis.Redis.from_url(redis_url, socket_timeout=socket_timeout_s,
                                                  socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 1))
                except ValueError as exc:
                    raise InvalidArgument(f"invalid Redis URL {self.describe}: {exc}") from None
            self._client = client
            self._admit_script = client.register_script(_ADMIT)
            self._release_script = client.register_script(_RELEASE)
            self._renew_script = client.register_script(_RENEW)
            if any(q.max_concurrent is not None for q in [quotas.default, *quotas.tenants.values()]):
                self._renewer = threading.Thread(target=self._renew_loop, name="admission-leases", daemon=True)
                self._renewer.start()

    def close(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)

    def _keys(self, tenant: str) -> list[str]:
        prefix = f"{self.namespace}:{{{tenant}}}:admission"
        return [f"{prefix}:inflight", f"{prefix}:tokens"]

    # -- the two steps ---------------------------------------------------------------------------
    def precheck(self, tenant: str, prompt_bytes: int, max_new_tokens: int, default_max_new_tokens: int | None = None) -> Ticket:
        """Before tokenization. ``max_new_tokens`` as asked (0: the server's default,
        ``default_max_new_tokens``, capped at the tenant's limit)."""
        if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
            raise InvalidArgument(f"invalid tenant id {str(tenant)[:70]!r}: use 1-64 characters from A-Z a-z 0-9 _ . - "
                                  "starting with a letter or digit")  # the session store's words
        quota = self.quotas.of(tenant)
        if quota.max_prompt_bytes is not None and prompt_bytes > quota.max_prompt_bytes:
            self._count("size", tenant)
            raise InvalidArgument(f"the prompt has {prompt_bytes} bytes; tenant {tenant!r} may send at most "
                                  f"{quota.max_prompt_bytes} (max_prompt_bytes)")
        if max_new_tokens and quota.max_new_tokens is not None and max_new_tokens > quota.max_new_tokens:
            self._count("size", tenant)
            raise InvalidArgument(f"max_new_tokens is {max_new_tokens}; tenant {tenant!r} may ask for at most "
                                  f"{quota.max_new_tokens}")
        effective = max_new_tokens or default_max_new_tokens or quota.max_new_tokens or 0
        if quota.max_new_tokens is not None:
            effective = min(effective, quota.max_new_tokens)
        if quota.tokens_per_minute is not None and effective > quota.tokens_per_minute:
            self._count("size", tenant)
            raise InvalidArgument(f"max_new_tokens {effective} alone exceeds the tokens_per_minute of tenant {tenant!r} "
                                  f"({quota.tokens_per_minute}); ask for fewer")
        with self._lock:
            full = self.max_concurrent_total is not None and self._running >= self.max_concurrent_total
            if not full:
                self._running += 1
        if full:
            self._count("replica", tenant)
            raise QuotaExceeded(f"this server is at its limit of {self.max_concurrent_total} requests in flight; "
                                f"retry in {self.busy_retry_s:g} s", self.busy_retry_s)
        ticket = Ticket(self, tenant, effective, slot=False, reserved=0, local=True)
        try:
            if quota.shared:
                cost = effective if quota.tokens_per_minute is not None else 0
                if self._shared(ticket, quota, cost, concurrency=True):
                    ticket._slot = quota.max_concurrent is not None
                    ticket.reserved = cost
                    if ticket._slot:
                        with self._lock:
                            self._live[ticket.id] = ticket
        except BaseException:
            ticket.release(0)
            raise
        return ticket

    def charge(self, ticket: Ticket, prompt_tokens: int) -> None:
        """After tokenization: reserve the prompt's tokens as well (tokens_per_minute)."""
        quota = self.quotas.of(ticket.tenant)
        if quota.tokens_per_minute is None or prompt_tokens <= 0:
            return
        if prompt_tokens + ticket.max_new_tokens > quota.tokens_per_minute:
            self._count("size", ticket.tenant)
            raise InvalidArgument(f"the prompt's {prompt_tokens} tokens plus max_new_tokens {ticket.max_new_tokens} exceed "
                                  f"the tokens_per_minute of tenant {ticket.tenant!r} ({quota.tokens_per_minute}); "
                                  "shorten the prompt or ask for fewer tokens")
        if self._shared(ticket, quota, prompt_tokens, concurrency=False):
            ticket.reserved += prompt_tokens

    def admit(self, tenant: str, prompt_bytes: int, max_new_tokens: int, prompt_tokens: int | None = None,
              default_max_new_tokens: int | None = None) -> Ticket:
        """``precheck`` and, when ``prompt_tokens`` is known, ``charge``, in one call."""
        ticket = self.precheck(tenant, prompt_bytes, max_new_tokens, default_max_new_tokens)
        if prompt_tokens is not None:
            try:
                self.charge(ticket, prompt_tokens)
            except BaseException:
                ticket.release(0)
                raise
        return ticket

    # -- Redis -----------------------------------------------------------------------------------
    def _shared(self, ticket: Ticket, quota: Quota, cost: int, concurrency: bool) -> bool:
        """Run the admit script; True: admitted with the shared limits; False: Redis is down,
        admitted unchecked. Raises QuotaExceeded over a limit."""
        limit = quota.max_concurrent if concurrency and quota.max_concurrent is not None else -1
        tpm = quota.tokens_per_minute if quota.tokens_per_minute is not None else -1
        if limit < 0 and (tpm < 0 or cost <= 0):
            return True
        reply = self._call(lambda: self._admit_script(
            keys=self._keys(ticket.tenant), args=[limit, ticket.id, self.lease_ms, tpm, cost, BUCKET_TTL_MS]))
        if reply is None:
            if not ticket.unchecked:  # once per request
                ticket.unchecked = True
                with self._lock:
                    self.unchecked += 1
                self._report("unchecked", ticket.tenant)
            return False
        status, value = int(reply[0]), int(reply[1])
        if status == 0:
            self._count("concurrency", ticket.tenant)
            raise QuotaExceeded(f"tenant {ticket.tenant!r} has {value} requests running, its limit (max_concurrent); "
                                f"retry in {self.busy_retry_s:g} s", self.busy_retry_s)
        if status == 2:
            self._count("tokens", ticket.tenant)
            wait = max(value, 1) / 1000.0
            raise QuotaExceeded(f"tenant {ticket.tenant!r} is over its tokens_per_minute ({quota.tokens_per_minute}) "
                                f"for this request's {cost} tokens; retry in {wait:.1f} s", wait)
        return True

    def _call(self, fn):
        """fn() against Redis; None when Redis is down (counted, logged once per backoff)."""
        if time.monotonic() < self._skip_until:
            return None
        try:
            return fn()
        except self._redis.RedisError as exc:
            with self._lock:
                self.errors += 1
                self._skip_until = time.monotonic() + self.backoff_s
            self._report("store_error", "-")
            logger.warning("admission: Redis at %s failed (%s); admitting requests without their shared quotas "
                           "for %g s", self.describe, redis_error_reason(exc), self.backoff_s)
            return None

    def _release(self, ticket: Ticket, used_tokens: int | None) -> None:
        with self._lock:
            if ticket._local:
                self._running -= 1
            self._live.pop(ticket.id, None)
        refund = max(0, ticket.reserved - used_tokens) if used_tokens is not None else 0
        if ticket._slot or refund:
            tpm = self.quotas.of(ticket.tenant).tokens_per_minute
            # Best effort: a lost release is a lease that expires and a bucket that refills.
            self._call(lambda: self._release_script(keys=self._keys(ticket.tenant),
                                                    args=[ticket.id, -1 if tpm is None else tpm, refund, BUCKET_TTL_MS]))

    def renew(self, tickets: list[Ticket] | None = None) -> None:
        """Extend the leases of ``tickets`` (default: every live one of this replica)."""
        if tickets is None:
            with self._lock:
                tickets = list(self._live.values())
        by_tenant: dict[str, list[str]] = {}
        for t in tickets:
            if t._slot and not t.released:
                by_tenant.setdefault(t.tenant, []).append(t.id)
        for tenant, ids in by_tenant.items():
            self._call(lambda: self._renew_script(keys=self._keys(tenant)[:1], args=[self.lease_ms, *ids]))

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000.0):
            try:
                self.renew()
            except Exception:  # noqa: BLE001 - the renewer must outlive any one failure
                logger.warning("admission: renewing leases failed", exc_info=True)

    def _count(self, reason: str, tenant: str) -> None:
        with self._lock:
            self.refused[reason] += 1
        self._report(f"refused_{reason}", tenant)

    def _report(self, event: str, tenant: str) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event, tenant)
            except Exception:  # noqa: BLE001 - a metrics hiccup must not change an admission decision
                logger.warning("admission: reporting %s failed", event, exc_info=True)

    def stats(self) -> dict:
        """Counters for metrics: running on this replica, Redis errors, unchecked admits, refusals."""
        with self._lock:
            return {"running": self._running, "errors": self.errors, "unchecked": self.unchecked,
                    "refused": dict(self.refused)}


__all__ = ["Admission", "LIMITS", "Quota", "QuotaExceeded", "Quotas", "Ticket", "load_quotas", "parse_quotas",
           "prompt_bytes", "retry_headers", "retry_metadata"]
