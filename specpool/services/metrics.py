"""Served-mode metrics: raw counters per drafter and tenant, and histograms (docs/ARCHITECTURE.md).

| metric | labels | what |
|---|---|---|
| ``specpool_requests`` (counter) | tenant, status | finished requests by gRPC status name (OK, INVALID_ARGUMENT, CANCELLED, ...) |
| ``specpool_rounds`` (counter) | tenant, drafter | rounds run; target-only rounds under drafter "none" |
| ``specpool_draft_tokens`` (counter) | tenant, drafter | draft tokens proposed |
| ``specpool_accepted_tokens`` (counter) | tenant, drafter | draft tokens accepted |
| ``specpool_emitted_tokens`` (counter) | tenant, drafter | tokens added to outputs (accepted + recovered/bonus) |
| ``specpool_block_divergence`` (histogram) | tenant, drafter | BD = (1/k) Σ (1 − TV(p, q)) over the k positions asked for |
| ``specpool_accepted_length`` (histogram) | tenant, drafter | tokens per round, bonus included |
| ``specpool_round_seconds`` (histogram) | tenant, drafter, part | round time split: draft, verify, router (the rest: policy, bookkeeping) |
| ``specpool_feature_bytes`` (counter) | link, drafter | white-box drafters: target features on the wire, link "target" (target -> router, drafter "none") or "drafter" (router -> that drafter); (a + 1) x width x 2 bytes a round each way |

Derived rates (acceptance rate = accepted / draft tokens, tokens/s, ...) are the reader's job.

Two backends with the same names and labels: ``RayMetrics`` (``ray.util.metrics``; each node's
Ray metrics agent serves them in Prometheus format at ``http://NODE:METRICS_EXPORT_PORT/metrics``,
9464 with `specpool serve`, 8080 on KubeRay pods, as ``ray_specpool_rounds_total``,
``ray_specpool_round_seconds_bucket``, ...) and
``PrometheusMetrics`` (``prometheus_client``, for a process outside Ray, and tests).
"""

from __future__ import annotations

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
FEATURE_BYTES = ("specpool_feature_bytes", "Bytes of the target's features on the wire (white-box drafters), by link")
ROUND_SECONDS = ("specpool_round_seconds", "Round wall time by part: draft, verify, router (policy and bookkeeping)", SECONDS_BUCKETS)


class Metrics(Protocol):
    def request(self, tenant: str, status: str) -> None: ...

    def round(self, tenant: str, record: RoundRecord) -> None: ...


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
    def request(self, tenant: str, status: str) -> None:
        pass

    def feature_bytes(self, link: str, drafter: str, count: int) -> None:
        pass

    def round(self, tenant: str, record: RoundRecord) -> None:
        pass


class PrometheusMetrics:
    """prometheus_client metrics in their own registry (``registry``); expose it with
    ``prometheus_client.start_http_server(port, registry=...)`` or read it in tests."""

    def __init__(self, registry=None):
        import prometheus_client as prom

        self.registry = registry if registry is not None else prom.CollectorRegistry()
        labels = ("tenant", "drafter")
        self._requests = prom.Counter(REQUESTS[0], REQUESTS[1], ("tenant", "status"), registry=self.registry)
        self._counters = {name: prom.Counter(name, doc, labels, registry=self.registry) for name, doc in COUNTERS.items()}
        self._histograms = {name: prom.Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
                            for name, (doc, buckets) in HISTOGRAMS.items()}
        self._seconds = prom.Histogram(ROUND_SECONDS[0], ROUND_SECONDS[1], (*labels, "part"), buckets=ROUND_SECONDS[2],
                                       registry=self.registry)
        self._feature_bytes = prom.Counter(FEATURE_BYTES[0], FEATURE_BYTES[1], ("link", "drafter"), registry=self.registry)

    def request(self, tenant: str, status: str) -> None:
        self._requests.labels(tenant=tenant, status=status).inc()

    def feature_bytes(self, link: str, drafter: str, count: int) -> None:
        """Features carried by one call: ``link`` "target" (verify responses) or "drafter" (propose/replay)."""
        self._feature_bytes.labels(link=link, drafter=drafter).inc(count)

    def round(self, tenant: str, record: RoundRecord) -> None:
        obs = round_observations(record)
        drafter = obs["drafter"]
        for name, value in obs["counters"].items():
            if value:
                self._counters[name].labels(tenant=tenant, drafter=drafter).inc(value)
        for name, value in obs["histograms"].items():
            self._histograms[name].labels(tenant=tenant, drafter=drafter).observe(value)
        for part, seconds in obs["seconds"].items():
            self._seconds.labels(tenant=tenant, drafter=drafter, part=part).observe(seconds)


class RayMetrics:
    """The same metrics through ``ray.util.metrics``: exported by every node's Ray metrics agent
    (Prometheus format, names prefixed ``ray_``), summed over replicas by the reader."""

    def __init__(self):
        from ray.util import metrics as ray_metrics

        labels = ("tenant", "drafter")
        self._requests = ray_metrics.Counter(REQUESTS[0], REQUESTS[1], tag_keys=("tenant", "status"))
        self._counters = {name: ray_metrics.Counter(name, doc, tag_keys=labels) for name, doc in COUNTERS.items()}
        self._histograms = {name: ray_metrics.Histogram(name, doc, boundaries=list(buckets), tag_keys=labels)
                            for name, (doc, buckets) in HISTOGRAMS.items()}
        self._seconds = ray_metrics.Histogram(ROUND_SECONDS[0], ROUND_SECONDS[1], boundaries=list(ROUND_SECONDS[2]),
                                              tag_keys=(*labels, "part"))
        self._feature_bytes = ray_metrics.Counter(FEATURE_BYTES[0], FEATURE_BYTES[1], tag_keys=("link", "drafter"))

    def request(self, tenant: str, status: str) -> None:
        self._requests.inc(1, tags={"tenant": tenant, "status": status})

    def feature_bytes(self, link: str, drafter: str, count: int) -> None:
        if count:
            self._feature_bytes.inc(count, tags={"link": link, "drafter": drafter})

    def round(self, tenant: str, record: RoundRecord) -> None:
        obs = round_observations(record)
        tags = {"tenant": tenant, "drafter": obs["drafter"]}
        for name, value in obs["counters"].items():
            if value:
                self._counters[name].inc(value, tags=tags)
        for name, value in obs["histograms"].items():
            self._histograms[name].observe(value, tags=tags)
        for part, seconds in obs["seconds"].items():
            self._seconds.observe(seconds, tags={**tags, "part": part})
