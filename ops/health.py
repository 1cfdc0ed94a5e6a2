"""From lag to a health level: smoothed, with hysteresis, so a blip does not flap (pure; ``now`` passed in).

The lag monitor feeds one observation per poll: the model's consumer lag and the totals of its
log-end and committed offsets. Arrival and drain rates are the smoothed slopes of those totals;
the predicted wait of a new request is ``lag / drain rate``. The level rises as soon as the
*smoothed* wait crosses a threshold, and falls only once it has stayed below ``exit_ratio`` of that
threshold for ``min_dwell_s`` — a momentary spike or dip changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from topics.health import Level


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    degraded_wait_ms: float = 50.0  # smoothed predicted wait at which each level starts
    shedding_wait_ms: float = 150.0
    rejecting_wait_ms: float = 500.0
    exit_ratio: float = 0.6  # a level ends below this share of its threshold...
    min_dwell_s: float = 2.0  # ...held for this long
    smoothing_s: float = 2.0  # time constant of the exponential smoothing

    def __post_init__(self) -> None:
        if not 0 < self.degraded_wait_ms < self.shedding_wait_ms < self.rejecting_wait_ms:
            raise ValueError(
                "thresholds must rise: degraded_wait_ms < shedding_wait_ms < rejecting_wait_ms, got "
                f"{self.degraded_wait_ms}, {self.shedding_wait_ms}, {self.rejecting_wait_ms}"
            )
        if not 0 < self.exit_ratio < 1:
            raise ValueError(f"exit_ratio must be within (0, 1), got {self.exit_ratio}")

    def threshold(self, level: Level) -> float:
        return {Level.DEGRADED: self.degraded_wait_ms, Level.SHEDDING: self.shedding_wait_ms,
                Level.REJECTING: self.rejecting_wait_ms}.get(level, 0.0)


class HealthEstimator:
    def __init__(self, policy: HealthPolicy | None = None) -> None:
        self.policy = policy or HealthPolicy()
        self.level = Level.OK
        self.lag = 0
        self.arrival_rps = 0.0
        self.drain_rps = 0.0
        self.wait_ms = 0.0  # smoothed predicted wait
        self._last: tuple[float, int, int] | None = None  # (now, log_end_total, committed_total)
        self._below_since: float | None = None
        self._primed = False

    def observe(self, now: float, lag: int, log_end_total: int, committed_total: int) -> Level:
        self.lag = max(0, lag)
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            alpha = 1.0 - math.exp(-dt / self.policy.smoothing_s)
            arrival = max(0, log_end_total - self._last[1]) / dt
            drain = max(0, committed_total - self._last[2]) / dt
            if not self._primed:  # the first slope is the best estimate there is: no ramp from 0
                alpha, self._primed = 1.0, True
            self.arrival_rps += alpha * (arrival - self.arrival_rps)
            self.drain_rps += alpha * (drain - self.drain_rps)
            self.wait_ms += alpha * (self._instant_wait_ms() - self.wait_ms)
        self._last = (now, log_end_total, committed_total)
        self._update_level(now)
        return self.level

    def _instant_wait_ms(self) -> float:
        if self.lag == 0:
            return 0.0
        # Nothing drained yet: the best evidence is how fast records arrive (a lower bound on need).
        rate = self.drain_rps if self.drain_rps > 1e-6 else max(self.arrival_rps, 1.0) / 10.0
        return 1000.0 * self.lag / rate

    def _update_level(self, now: float) -> None:
        target = Level.OK
        for level in (Level.REJECTING, Level.SHEDDING, Level.DEGRADED):
            if self.wait_ms >= self.policy.threshold(level):
                target = level
                break
        if target > self.level:  # rising: at once (the smoothing already filtered blips)
            self.level, self._below_since = target, None
            return
        if self.level == Level.OK:
            return
        exit_at = self.policy.exit_ratio * self.policy.threshold(self.level)
        if self.wait_ms >= exit_at:
            self._below_since = None
            return
        if self._below_since is None:
            self._below_since = now
        if now - self._below_since >= self.policy.min_dwell_s:  # falling: one level at a time
            self.level = Level(self.level - 1)
            self._below_since = None

    def retry_after_ms(self) -> int:
        """How long until the queue should have drained to the DEGRADED threshold."""
        excess_ms = max(0.0, self.wait_ms - self.policy.degraded_wait_ms)
        return int(max(1000.0, excess_ms))
