"""Producer-side metrics: what admission decided, and the health levels it saw (Prometheus).

In-process with the client, so the gateway's ``/metrics`` serves them, and so does any service
that embeds the library and exports the default registry.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ADMITTED = Counter("kinfer_admission_admitted_total", "Requests admitted and enqueued", ["model", "priority"])
REFUSED = Counter(
    "kinfer_admission_refused_total",
    "Requests refused before enqueueing, by cause (level, deadline, throttle)",
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
