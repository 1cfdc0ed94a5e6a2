"""What every benchmark shares: the service level it judges by (P95 < 150 ms, P99 < 250 ms) and its progress log."""

from __future__ import annotations

import sys

SLA_P95_MS = 150.0
SLA_P99_MS = 250.0
SLA_MIN_OK = 0.99  # a rate whose requests are refused or lost more than this does not count


def meets_sla(ok_fraction: float, p95_ms: float | None, p99_ms: float | None, min_ok: float = SLA_MIN_OK) -> bool:
    """P95 < 150 ms, P99 < 250 ms, and at least ``min_ok`` of the requests answered ok."""
    return (ok_fraction >= min_ok and p95_ms is not None and p99_ms is not None
            and p95_ms < SLA_P95_MS and p99_ms < SLA_P99_MS)


def log(text: str) -> None:
    """A benchmark's progress line: on stderr, so that stdout stays the report."""
    print(text, file=sys.stderr, flush=True)
