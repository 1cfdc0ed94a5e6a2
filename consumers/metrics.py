"""Worker metrics, exported for Prometheus (``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_S_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)

QUEUE_WAIT = Histogram(
    "kinfer_queue_wait_seconds", "Kafka record timestamp to fetched by the worker", ["model", "priority"],
    buckets=_S_BUCKETS,
)
BATCH_WAIT = Histogram(
    "kinfer_batch_wait_seconds", "Fetched to its batch starting compute", ["model", "priority"], buckets=_S_BUCKETS
)
COMPUTE = Histogram("kinfer_compute_seconds", "Forward pass of one batch", ["model"], buckets=_S_BUCKETS)
BACKGROUND_WAIT = Histogram(
    "kinfer_background_wait_seconds", "How long interactive requests that came during a background slice waited for "
    "it to end (the longest of each slice)", ["model"], buckets=_S_BUCKETS,
)
BACKGROUND_WAIT_MAX = Gauge(
    "kinfer_background_wait_max_seconds", "The longest an interactive request has waited for a background slice",
    ["model"],
)
PREDICTED = Histogram(
    "kinfer_predicted_compute_seconds", "The service-time model's forecast for each batch", ["model"],
    buckets=_S_BUCKETS,
)
BATCH_SIZE = Histogram(
    "kinfer_batch_size", "Inputs per batch", ["model"], buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
)
PADDING = Histogram(
    "kinfer_padding_ratio", "Padded tokens / real tokens of a batch (estimated)", ["model"],
    buckets=(1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0),
)
RESULTS = Counter("kinfer_results_total", "Terminal replies published", ["model", "priority", "status"])
SHED = Counter(
    "kinfer_shed_total", "Requests refused before compute, by reason (expired, deadline, codel)",
    ["model", "priority", "reason"],
)
COPIES_DROPPED = Counter(
    "kinfer_copies_dropped_total",
    "Copies dropped unrun: their sender already had its answer (a hedged request answered through another copy)",
    ["model"],
)
DEAD_LETTERS = Counter("kinfer_dead_letters_total", "Records sent to the dead-letter topic", ["model", "field"])
UNDELIVERED = Counter(
    "kinfer_replies_undelivered_total",
    "Replies that reached nobody and were not retried: no subscriber and no fallback topic, or no such reply topic",
    ["model"],
)
BUFFERED = Gauge("kinfer_buffered_inputs", "Inputs fetched and waiting for a batch", ["model"])
PAUSED = Gauge(
    "kinfer_partitions_paused", "1 while a priority's partitions are paused (the buffer reached its share)",
    ["model", "priority"],
)
CODEL_DROPPING = Gauge("kinfer_codel_dropping", "1 while CoDel sees a standing queue and sheds", ["model"])

GEN_STEP = Histogram("kinfer_generation_step_seconds", "One continuous-batching step", ["model"], buckets=_S_BUCKETS)
GEN_TOKENS = Counter("kinfer_generated_tokens_total", "Tokens generated", ["model"])
GEN_RUNNING = Gauge("kinfer_generation_running", "Sequences in the running batch", ["model"])
GEN_CANCELLED = Counter("kinfer_generation_cancelled_total", "Streams cancelled by their client", ["model"])
KV_RESERVED = Gauge("kinfer_kv_reserved_tokens", "KV cache tokens reserved by running sequences", ["model"])
KV_UNUSED = Gauge(
    "kinfer_kv_reserved_unused_tokens", "Reserved KV tokens not generated (yet): the price of never preempting",
    ["model"],
)
KV_PADDING = Histogram(
    "kinfer_kv_padding_ratio", "Share of the running batch's KV cache that is left padding (fragmentation)",
    ["model"], buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9),
)
SPEC_PROPOSED = Counter(
    "kinfer_spec_proposed_tokens_total", "Speculative draft tokens verified (prompt lookup)", ["model"]
)
SPEC_ACCEPTED = Counter(
    "kinfer_spec_accepted_tokens_total", "Draft tokens the model agreed with; accepted/proposed is the rate", ["model"]
)
MODEL_BYTES = Gauge("kinfer_model_bytes", "Device memory of a model's weights (measured once loaded)", ["model"])
MODEL_TIER = Gauge(
    "kinfer_model_resident", "1 for the tier a model's weights are in (device, host, disk)", ["model", "tier"]
)
SWAP_IN = Histogram(
    "kinfer_swap_in_seconds", "Swap-in to serving: weights loaded, warm-up passes, group joined", ["model", "source"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
)
