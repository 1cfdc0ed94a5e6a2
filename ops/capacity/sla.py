"""The service level kinfer promises, and how a run is judged against it (pure: no I/O).

End to end, P95 < 150 ms and P99 < 250 ms, with at least ``SLA_MIN_OK`` of the requests answered
ok in a benchmark's run, and ``SLA_AVAILABILITY`` over the long run (what the alert rules watch,
``ops.deploy.slo``). Percentiles are nearest-rank. Every benchmark and the fleet simulator judge by
this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SLA_P95_MS = 150.0
SLA_P99_MS = 250.0
SLA_MIN_OK = 0.99  # a rate whose requests are refused or lost more than this does not count
SLA_AVAILABILITY = 0.9999  # of requests answered ok, over the long run (the alert rules' objective)


def meets_sla(ok_fraction: float, p95_ms: float | None, p99_ms: float | None, min_ok: float = SLA_MIN_OK) -> bool:
    """P95 < 150 ms, P99 < 250 ms, and at least ``min_ok`` of the requests answered ok."""
    return (ok_fraction >= min_ok and p95_ms is not None and p99_ms is not None
            and p95_ms < SLA_P95_MS and p99_ms < SLA_P99_MS)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    """``percentile`` as a report gives it: to 0.1 ms, and None for no values (strict JSON has no NaN)."""
    return round(percentile(values, q), 1) if values else None
