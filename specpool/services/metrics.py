"""Served-mode metrics: raw counters per drafter, tenant and endpoint, histograms, and request latencies (docs/ARCHITECTURE.md).

| metric | labels | what |
|---|---|---|
| ``specpool_requests`` (counter) | tenant, endpoint, status | finished requests by gRPC status name (OK, INVALID_ARGUMENT, CANCELLED, UNAUTHENTICATED, ...) |
| ``specpool_rounds`` (counter) | tenant, drafter, endpoint | rounds run; target-only rounds under drafter "none" (the bandit's choices, counted) |
| ``specpool_draft_tokens`` (counter) | tenant, drafter, endpoint | draft tokens proposed |
| ``specpool_accepted_tokens`` (counter) | tenant, drafter, endpoint | draft tokens accepted |
| ``specpool_emitted_tokens`` (counter) | tenant, drafter, endpoint | tokens added to outputs (accepted + recovered/bonus) |
| ``specpool_block_divergence`` (histogram) | tenant, drafter, endpoint | BD = (1/k) Σ (1 − TV(p, q)) over the k positions asked for |
| ``specpool_accepted_length`` (histogram) | tenant, drafter, endpoint | tokens per round, bonus included |
| ``specpool_round_seconds`` (histogram) | tenant, drafter, endpoint, part | round time split: draft, verify, router (the rest: policy, bookkeeping) |
| ``specpool_drafter_failures`` (counter) | drafter, reason | drafter calls that failed and cost a target-only round instead (issue 27): reason "unavailable", "timeout" or "error" (specpool/services/remote.py) |
| ``specpool_admission_events`` (counter) | tenant, event | admission control (specpool/services/admission.py): event ``refused_concurrency``, ``refused_tokens`` (RESOURCE_EXHAUSTED: the tenant's max_concurrent / tokens_per_minute), ``refused_replica`` (this router replica's max_ongoing_requests), ``refused_size`` (INVALID_ARGUMENT: max_prompt_bytes, max_new_tokens), ``unchecked`` (admitted without the shared limits: Redis was down), ``store_error`` (a failed Redis call; tenant ``-``) |
| ``specpool_feature_bytes`` (counter) | link, drafter | white-box drafters: target features on the wire, link "target" (target -> router, drafter "none") or "drafter" (router -> that drafter); (a + 1) x width x 2 bytes a round each way |
| ``specpool_time_to_first_token_seconds`` (histogram) | endpoint | the request's arrival at the router -> its first token ready to send |
| ``specpool_request_seconds`` (histogram) | endpoint | end-to-end latency at the router (arrival -> last token) |
| ``specpool_queue_seconds`` (histogram) | endpoint | arrival -> a worker thread starts the request (waiting for a free one) |
| ``specpool_inter_token_seconds`` (histogram) | endpoint | per request: (last token - first token) / (tokens - 1); speculation emits tokens in bursts, so this is the mean gap a reader sees |
| ``specpool_requests_in_flight`` (gauge) | endpoint | requests between arrival and their answer's end |

``tenant`` values are bounded (``TenantLabels``): the API key file's tenants, or the first 100 seen
without keys; the rest count under ``other``. ``endpoint`` is ``grpc`` or ``http`` (the router's two APIs) or ``embedded``. Latencies are
measured in the router: what happens in Serve's proxy before (a few ms) is not in them.
Derived rates (acceptance rate = accepted / draft tokens, tokens/s, ...) are the reader's job.

Two backends with the same names and labels: ``RayMetrics`` (``ray.util.metrics``; each node's
Ray metrics agent serves them in Prometheus format at ``http://NODE:METRICS_EXPORT_PORT/metrics``,
9464 with `specpool serve`, 8080 on KubeRay pods, as ``ray_specpool_rounds_total``,
``ray_specpool_round_seconds_bucket``, ...) and
``PrometheusMetrics`` (``prometheus_client``, for a process outside Ray, and tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specpool.router.loop import RoundRecord
from specpool.router.policies import round_rewards

BD_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 33)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)

COUNTERS = {
    "specpool_rounds": "Rounds run (draft -> verify -> accept), per drafter; target-only rounds under 'none'",
    "specpool_draft_tokens": "Draft tokens proposed",
    "specpool_accepted_tokens": "Draft tokens accepted by the target",
    "specpool_emitted_tokens": "Tokens added to outputs (accepted + one recovered or bonus token per round)",
}
REQUESTS = ("specpool_requests", "Finished requests by gRPC status name")
HISTOGRAMS = {
    "specpool_block_divergence": ("Block divergence (1/k) sum(1 - TV(p, q)) of drafted rounds", BD_BUCKETS),
    "specpool_accepted_length": ("Tokens per round, bonus included", LENGTH_BUCKETS),
}
ENDPOINTS = ("grpc", "http", "embedded")
ROUND_LABELS = ("tenant", "drafter", "endpoint")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
LATENCIES = {  # histograms by endpoint
    "specpool_time_to_first_token_seconds": ("Time to first token: arrival at the router -> first token ready", LATENCY_BUCKETS),
    "specpool_request_seconds": ("End-to-end request latency at the router", LATENCY_BUCKETS),
    "specpool_queue_seconds": ("Arrival -> a worker thread starts the request", LATENCY_BUCKETS),
    "specpool_inter_token_seconds": ("Per request: (last token - first token) / (tokens - 1)", TOKEN_GAP_BUCKETS),
}
IN_FLIGHT = ("specpool_requests_in_flight", "Requests between arrival and the end of their answer")
ADMISSION_EVENTS = ("specpool_admission_events", "Admission control: refusals by reason, unchecked admits, Redis errors")
DRAFTER_FAILURES = ("specpool_drafter_failures", "Drafter calls that failed; their rounds ran target-only")
FEATURE_BYTES = ("specpool_feature_bytes", "Bytes of the target's features on the wire (white-box drafters), by link")
ROUND_SECONDS = ("specpool_round_seconds", "Round wall time by part: draft, verify, router (policy and bookkeeping)", SECONDS_BUCKETS)


class Metrics(Protocol):
    def request(self, tenant: str, status: str, endpoint: str = "embedded") -> None: ...

    def round(self, tenant: str, record: RoundRecord, endpoint: str = "embedded") -> None: ...

    def latency(self, endpoint: str, timing: "RequestTiming") -> None: ...

    def in_flight(self, endpoint: str, delta: int) -> None: ...


@dataclass(frozen=True)
class RequestTiming:
    """One finished request's latencies, in seconds (None: never reached, e.g. no token came)."""

    queue_s: float
    total_s: float
    first_token_s: float | None = None
    inter_token_s: float | None = None

    def observations(self) -> dict[str, float]:
        out = {"specpool_queue_seconds": self.queue_s, "specpool_request_seconds": self.total_s}
        if self.first_token_s is not None:
            out["specpool_time_to_first_token_seconds"] = self.first_token_s
        if self.inter_token_s is not None:
            out["specpool_inter_token_seconds"] = self.inter_token_s
        return out


class TenantLabels:
    """The ``tenant`` label value of a tenant: every label value is a time series that Prometheus
    keeps, so the set is bounded. With API keys, the key file's tenants (and ``default``, ``-`` for
    refusals); any other value (an admin acting for a tenant without a key) is ``other``. Without
    keys (tenants are whatever requests say), the first ``max_tenants`` seen keep their names and
    the rest are ``other``. Thread-safe enough: a race admits at most a few extra names."""

    OTHER = "other"

    def __init__(self, known: set[str] | frozenset[str] | None = None, max_tenants: int = 100):
        self.fixed = known is not None
        self._names: set[str] = ({*known, "default", "-"} if known is not None else set())
        self.max_tenants = max_tenants

    def __call__(self, tenant: str) -> str:
        if tenant in self._names:
            return tenant
        if not self.fixed and len(self._names) < self.max_tenants:
            self._names.add(tenant)
            return tenant
        return self.OTHER


def exported_metric_labels() -> dict[str, set[str]]:
    """Every Prometheus series name Ray's metrics agent exports for these metrics (prefix
    ``ray_``, counters ``_total``, histograms ``_bucket``/``_sum``/``_count``), with its labels
    (a histogram's ``_bucket`` also has ``le``). The dashboard test checks its queries against it."""
    out: dict[str, set[str]] = {}

    def histogram(name: str, labels) -> None:
        out[f"ray_{name}_bucket"] = {*labels, "le"}
        out[f"ray_{name}_sum"] = set(labels)
        out[f"ray_{name}_count"] = set(labels)

    out[f"ray_{REQUESTS[0]}_total"] = {"tenant", "endpoint", "status"}
    for name in COUNTERS:
        out[f"ray_{name}_total"] = set(ROUND_LABELS)
    for name in HISTOGRAMS:
        histogram(name, ROUND_LABELS)
    histogram(ROUND_SECONDS[0], (*ROUND_LABELS, "part"))
    out[f"ray_{FEATURE_BYTES[0]}_total"] = {"link", "drafter"}
    out[f"ray_{DRAFTER_FAILURES[0]}_total"] = {"drafter", "reason"}
    out[f"ray_{ADMISSION_EVENTS[0]}_total"] = {"tenant", "event"}
    for name in LATENCIES:
        histogram(name, ("endpoint",))
    out[f"ray_{IN_FLIGHT[0]}"] = {"endpoint"}
    return out


def exported_metric_names() -> set[str]:
    return set(exported_metric_labels())


def round_observations(record: RoundRecord) -> dict:
    """What one round adds: counter increments, histogram samples and the round-time split."""
    drafted = record.drafter is not None and record.k > 0
    router_s = max(0.0, record.round_s - record.draft_s - record.verify_s)
    return {
        "drafter": record.drafter or "none",
        "counters": {
            "specpool_rounds": 1,
            "specpool_draft_tokens": record.proposed,
            "specpool_accepted_tokens": record.accepted,
            "specpool_emitted_tokens": record.emitted,
        },
        "histograms": {
            **({"specpool_block_divergence": round_rewards(record)["bd"]} if drafted else {}),
            "specpool_accepted_length": record.emitted,
        },
        "seconds": {"draft": record.draft_s, "verify": record.verify_s, "router": router_s},
    }


class NoMetrics:
    def request(self, tenant: str, status: str, endpoint: str = "embedded") -> None:
        pass

    def feature_bytes(self, link: str, drafter: str, count: int) -> None:
        pass

    def drafter_failure(self, drafter: str, reason: str) -> None:
        pass

    def admission(self, event: str, tenant: str) -> None:
        pass

    def round(self, tenant: str, record: RoundRecord, endpoint: str = "embedded") -> None:
        pass

    def latency(self, endpoint: str, timing: RequestTiming) -> None:
        pass

    def in_flight(self, endpoint: str, delta: int) -> None:
        pass


class PrometheusMetrics:
    """prometheus_client metrics in their own registry (``registry``); expose it with
    ``prometheus_client.start_http_server(port, registry=...)`` or read it in tests."""

    def __init__(self, registry=None, tenant_labels: TenantLabels | None = None):
        import prometheus_client as prom

        self.tenant = tenant_labels or TenantLabels()

        self.registry = registry if registry is not None else prom.CollectorRegistry()
        labels = ROUND_LABELS
        self._requests = prom.Counter(REQUESTS[0], REQUESTS[1], ("tenant", "endpoint", "status"), registry=self.registry)
        self._counters = {name: prom.Counter(name, doc, labels, registry=self.registry) for name, doc in COUNTERS.items()}
        self._histograms = {name: prom.Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
                            for name, (doc, buckets) in HISTOGRAMS.items()}
        self._seconds = prom.Histogram(ROUND_SECONDS[0], ROUND_SECONDS[1], (*labels, "part"), buckets=ROUND_SECONDS[2],
                                       registry=self.registry)
        self._feature_bytes = prom.Counter(FEATURE_BYTES[0], FEATURE_BYTES[1], ("link", "drafter"), registry=self.registry)
        self._drafter_failures = prom.Counter(DRAFTER_FAILURES[0], DRAFTER_FAILURES[1], ("drafter", "reason"),
                                              registry=self.registry)
        self._admission = prom.Counter(ADMISSION_EVENTS[0], ADMISSION_EVENTS[1], ("tenant", "event"), registry=self.registry)
        self._latencies = {name: prom.Histogram(name, doc, ("endpoint",), buckets=buckets, registry=self.registry)
                           for name, (doc, buckets) in LATENCIES.items()}
        self._in_flight = prom.Gauge(IN_FLIGHT[0], IN_FLIGHT[1], ("endpoint",), registry=self.registry)

    def request(self, tenant: str, status: str, endpoint: str = "embedded") -> None:
        self._requests.labels(tenant=self.tenant(tenant), endpoint=endpoint, status=status).inc()

    def latency(self, endpoint: str, timing: RequestTiming) -> None:
        for name, seconds in timing.observations().items():
            self._latencies[name].labels(endpoint=endpoint).observe(seconds)

    def in_flight(self, endpoint: str, delta: int) -> None:
        self._in_flight.labels(endpoint=endpoint).inc(delta)

    def feature_bytes(self, link: str, drafter: str, count: int) -> None:
        """Features carried by one call: ``link`` "target" (verify responses) or "drafter" (propose/replay)."""
        self._feature_bytes.labels(link=link, drafter=drafter).inc(count)

    def drafter_failure(self, drafter: str, reason: str) -> None:
        self._drafter_failures.labels(drafter=drafter, reason=reason).inc()

    def admission(self, event: str, tenant: str) -> None:
        """One admission event (Admission.on_event): a refusal by reason, an unchecked admit, a Redis error."""
        self._admission.labels(tenant=self.tenant(tenant), event=event).inc()

    def round(self, tenant: str, record: RoundRecord, endpoint: str = "embedded") -> None:
        obs = round_observations(record)
        labels = {"tenant": self.tenant(tenant), "drafter": obs["drafter"], "endpoint": endpoint}
        for name, value in obs["counters"].items():
            if value:
                self._counters[name].labels(**labels).inc(value)
        for name, value in obs["histograms"].items():
            self._histograms[name].labels(**labels).observe(value)
        for part, seconds in obs["seconds"].items():
            self._seconds.labels(**labels, part=part).observe(seconds)


class RayMetrics:
    """The same metrics through ``ray.util.metrics``: exported by every node's Ray metrics agent
    (Prometheus format, names prefixed ``ray_``), summed over replicas by the reader."""

    def __init__(self, tenant_labels: TenantLabels | None = None):
        from ray.util import metrics as ray_metrics

        self.tenant = tenant_labels or TenantLabels()

        labels = ROUND_LABELS
        self._requests = ray_metrics.Counter(REQUESTS[0], REQUESTS[1], tag_keys=("tenant", "endpoint", "status"))
        self._counters = {name: ray_metrics.Counter(name, doc, tag_keys=labels) for name, doc in COUNTERS.items()}
        self._histograms = {name: ray_metrics.Histogram(name, doc, boundaries=list(buckets), tag_keys=labels)
                            for name, (doc, buckets) in HISTOGRAMS.items()}
        self._seconds = ray_metrics.Histogram(ROUND_SECONDS[0], ROUND_SECONDS[1], boundaries=list(ROUND_SECONDS[2]),
                                              tag_keys=(*labels, "part"))
        self._feature_bytes = ray_metrics.Counter(FEATURE_BYTES[0], FEATURE_BYTES[1], tag_keys=("link", "drafter"))
        self._drafter_failures = ray_metrics.Counter(DRAFTER_FAILURES[0], DRAFTER_FAILURES[1], tag_keys=("drafter", "reason"))
        self._admission = ray_metrics.Counter(ADMISSION_EVENTS[0], ADMISSION_EVENTS[1], tag_keys=("tenant", "event"))
        self._latencies = {name: ray_metrics.Histogram(name, doc, boundaries=list(buckets), tag_keys=("endpoint",))
                           for name, (doc, buckets) in LATENCIES.items()}
        self._in_flight = ray_metrics.Gauge(IN_FLIGHT[0], IN_FLIGHT[1], tag_keys=("endpoint",))
        self._in_flight_counts = dict.fromkeys(ENDPOINTS, 0)  # a Ray gauge is set, not added to
        for endpoint in ("grpc", "http"):  # exported from the start, so a dashboard shows 0, not "no data"
            self._in_flight.set(0, tags={"endpoint": endpoint})

    def request(self, tenant: str, status: str, endpoint: str = "embedded") -> None:
        self._requests.inc(1, tags={"tenant": self.tenant(tenant), "endpoint": endpoint, "status": status})

    def latency(self, endpoint: str, timing: RequestTiming) -> None:
        for name, seconds in timing.observations().items():
            self._latencies[name].observe(seconds, tags={"endpoint": endpoint})

    def in_flight(self, endpoint: str, delta: int) -> None:
        # Called from the router's event loop only (RequestRunner), so no lock is needed.
        self._in_flight_counts[endpoint] = self._in_flight_counts.get(endpoint, 0) + delta
        self._in_flight.set(self._in_flight_counts[endpoint], tags={"endpoint": endpoint})

    def refresh(self) -> None:
        """Set the gauge again. Ray's metrics agent drops a gauge series that was not set within
        two export intervals (a finished worker's stale value must not linger), so a gauge that
        stays at 0 while nothing runs would vanish from the scrape; the router calls this every
        few seconds (``RouterServer._refresh_metrics``)."""
        for endpoint in ("grpc", "http"):
            self._in_flight.set(self._in_flight_counts.get(endpoint, 0), tags={"endpoint": endpoint})

    def feature_bytes(self, link: str, drafter: str, count: int) -> None:
        if count:
            self._feature_bytes.inc(count, tags={"link": link, "drafter": drafter})

    def drafter_failure(self, drafter: str, reason: str) -> None:
        self._drafter_failures.inc(1, tags={"drafter": drafter, "reason": reason})

    def admission(self, event: str, tenant: str) -> None:
        self._admission.inc(1, tags={"tenant": self.tenant(tenant), "event": event})

    def round(self, tenant: str, record: RoundRecord, endpoint: str = "embedded") -> None:
        obs = round_observations(record)
        tags = {"tenant": self.tenant(tenant), "drafter": obs["drafter"], "endpoint": endpoint}
        for name, value in obs["counters"].items():
            if value:
                self._counters[name].inc(value, tags=tags)
        for name, value in obs["histograms"].items():
            self._histograms[name].observe(value, tags=tags)
        for part, seconds in obs["seconds"].items():
            self._seconds.observe(seconds, tags={**tags, "part": part})
