"""Producer-side metrics: how callers' requests ended and how long they took (the service level
indicators), what admission decided, and the health levels it saw (Prometheus).

In-process with the client, so the gateway's ``/metrics`` serves them, and so does any service
that embeds the library and exports the default registry.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from kinfer.topics import DeadlineExceeded, InvalidRequest, KinferError, ModelError, Overloaded, Shed, Unavailable

ADMITTED = Counter("kinfer_admission_admitted_total", "Requests admitted and enqueued", ["model", "priority"])
REFUSAL_CAUSES = ("level", "deadline", "throttle", "cold")
REFUSED = Counter(
    "kinfer_admission_refused_total",
    "Requests refused before enqueueing, by cause (level, deadline, throttle, cold)",
    ["model", "priority", "cause"],
)
LEVEL_SEEN = Gauge("kinfer_client_health_level", "The model's health level as this process last saw it", ["model"])
LEVEL_CHANGES_SEEN = Counter(
    "kinfer_client_health_level_changes_total", "Health level changes this process saw", ["model", "to"]
)
GATEWAY_ERRORS = Counter(
    "kinfer_gateway_errors_total", "Error answers by HTTP status and error type", ["status", "type"]
)
FORGED_REPLIES = Counter(
    "kinfer_client_forged_replies_total",
    "Messages on this process's own reply channel not sealed with its key (dropped)",
)
REPLIES_REFUSED = Counter(
    "kinfer_client_replies_refused_total",
    "Reply messages a reader dropped, by reader (redis, kafka) and reason (oversize, malformed, unsealed, "
    "unopened, error); other clients' replies on a shared topic are not counted",
    ["reader", "reason"],
)
REPLY_READER_RESTARTS = Counter(
    "kinfer_client_reply_reader_restarts_total", "Reply readers restarted after a failure", ["reader"]
)
LEGACY_SEALED_REPLIES = Counter(
    "kinfer_client_legacy_sealed_replies_total",
    "Replies taken under the older, unencrypted seal (from a worker not upgraded yet)",
)
ASKED_AGAIN = Counter(
    "kinfer_client_requests_asked_again_total",
    "Requests published again because the client's Redis reply channel was lost and subscribed anew before "
    "they were answered (a reply published meanwhile may have reached nobody)",
)
HEDGES = Counter(
    "kinfer_client_hedges_total",
    "Requests published a second time to another partition, unanswered at the model's recent p99 (producers.hedging)",
    ["model"],
)
HEDGES_UNPAID = Counter(
    "kinfer_client_hedges_unpaid_total",
    "Hedges wanted but not sent: the hedge budget was spent",
    ["model"],
)

# The service level as callers see it: every request made through the library (the gateway's too),
# from the call to its result. The alert rules (ops/deploy/prometheus/rules/) are written on these.
OUTCOMES = ("ok", "refused", "shed", "expired", "error", "unavailable", "unaccepted", "timed_out")
REQUESTS = Counter(
    "kinfer_client_requests_total",
    "Requests made through this process, by how they ended: ok; refused (admission, before sending); shed or "
    "expired (a worker said so); error (the model failed); unavailable (Kafka or Redis); unaccepted (the broker "
    "did not take it by its deadline); timed_out (taken, no answer by its deadline). Invalid requests (the "
    "caller's) are not counted",
    ["model", "priority", "outcome"],
)
# Bounds at the service level's thresholds (150 ms for P95, 250 ms for P99), so the share of requests
# within each is exact: what the latency alerts burn on.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY = Histogram(
    "kinfer_client_request_seconds",
    "End to end as the caller sees it, from the call to its result: answered requests (ok) only",
    ["model", "priority"],
    buckets=LATENCY_BUCKETS,
)


def outcome_of(error: KinferError) -> str | None:
    """The ``outcome`` label of a request that ended in ``error`` (None: the caller's own mistake)."""
    if isinstance(error, InvalidRequest):
        return None
    if isinstance(error, Overloaded):
        return "refused"
    if isinstance(error, Shed):
        return "shed"
    if isinstance(error, DeadlineExceeded):
        if error.answered:
            return "expired"
        return "timed_out" if error.accepted else "unaccepted"
    if isinstance(error, Unavailable):
        return "unavailable"
    if isinstance(error, ModelError):
        return "error"
    return "error"


class Outcomes:
    """The two service-level series of one process, their children cached by (model, priority): a
    request costs a dict lookup, a counter and a histogram bucket."""

    def __init__(self) -> None:
        self._ok: dict[tuple[str, str], tuple[Any, Any]] = {}

    def ok(self, model: str, priority: str, seconds: float) -> None:
        found = self._ok.get((model, priority))
        if found is None:
            found = self._first(model, priority)
        found[0].inc()
        found[1].observe(seconds)

    def _first(self, model: str, priority: str) -> tuple[Any, Any]:
        """Every outcome's series starts at zero (a counter born at its first failure hides it from rate())."""
        for outcome in OUTCOMES:
            REQUESTS.labels(model, priority, outcome)
        found = self._ok[(model, priority)] = (REQUESTS.labels(model, priority, "ok"), LATENCY.labels(model, priority))
        return found

    def failed(self, model: str, priority: str, error: KinferError) -> None:
        if (model, priority) not in self._ok:
            self._first(model, priority)
        outcome = outcome_of(error)
        if outcome is not None:
            REQUESTS.labels(model, priority, outcome).inc()
