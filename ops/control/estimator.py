"""From lag to a health level: smoothed, with hysteresis, so a blip does not flap (pure; ``now`` passed in).

The lag monitor feeds one observation per poll: the model's consumer lag and the totals of its
log-end and committed offsets. Arrival and drain rates are the smoothed slopes of those totals.
Capacity is the drain rate of intervals the workers were certainly busy throughout (the queue at
the start held more than they drained), smoothed faster and kept while no queue stands: a drain
rate measured below saturation is only the arrival rate. The predicted wait of a new request is
``lag / capacity`` (Little's law; ``lag / drain rate`` until a busy interval has been seen).
The level rises once the *smoothed* wait crosses a threshold and the queue stood over it at two polls
in a row (one reading of a stall the next poll finds drained would hold the level up for seconds of
hysteresis), and falls only once the smoothed wait has stayed below ``exit_ratio`` of that threshold
for ``min_dwell_s`` — a blip changes nothing. An
observation after a gap (polls that failed or hung: a broker paused or gone) only re-anchors: the
queue a fault left behind is judged one poll later, by whether it stands or drains.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from kinfer.topics.health import HealthState, Level
from kinfer.topics.record import MAX_COUNT, MAX_DURATION_MS, MAX_RATE_RPS

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    degraded_wait_ms: float = 50.0  # smoothed predicted wait at which each level starts
    shedding_wait_ms: float = 150.0
    rejecting_wait_ms: float = 500.0
    exit_ratio: float = 0.6  # a level ends below this share of its threshold...
    min_dwell_s: float = 2.0  # ...held for this long
    smoothing_s: float = 2.0  # time constant of the exponential smoothing
    capacity_smoothing_s: float = 0.5  # ... of the capacity estimate (busy intervals only)
    # The workers commit every this often (their --commit-interval-ms): up to that much answered
    # traffic still counts as lag between two commits, and is not a queue.
    commit_interval_ms: float = 100.0
    # An observation more than this many usual poll intervals (and at least ``min_gap_s``) after the
    # one before follows a spell the monitor could not see (a broker it reads paused or gone, a
    # restart): a record of where things are, not a slope. It starts the rates again and leaves the
    # level alone; the next poll, one interval on, says whether a queue stands or is draining.
    gap_polls: float = 4.0
    min_gap_s: float = 1.0

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
        self.capacity_rps = 0.0  # 0: not measured yet
        self.arrival_by_priority = [0.0, 0.0, 0.0]  # records/s written to the p0, p1, p2 topics (smoothed)
        self._ends_by_priority: tuple[int, int, int] | None = None
        self.wait_ms = 0.0  # smoothed predicted wait
        self._instants = (0.0, 0.0)  # the unsmoothed wait at the poll before and at the last one
        self._last: tuple[float, int, int, int] | None = None  # (now, log_end_total, committed_total, lag)
        self._below_since: float | None = None
        self._primed = False
        self._drain_primed = False
        self._capacity_known = False  # given by the caller: not estimated from offsets
        self._stalled_since: float | None = None  # waiting records and nothing drained since then
        self._last_arrival = (0, 0.0)  # records written in the last poll interval, and their rate
        self._now = 0.0
        self._interval_s = 0.0  # the usual time between two observations (smoothed; 0: not known yet)
        self.gaps = 0  # observations that followed a spell the monitor could not see

    def observe(
        self, now: float, lag: int, log_end_total: int, committed_total: int,
        log_end_by_priority: tuple[int, int, int] | None = None, capacity_rps: float | None = None,
        progressing: bool = False, cold: bool = False,
    ) -> Level:
        """One poll.

        ``capacity_rps``: the workers' capacity measured elsewhere (the telemetry stream: compute
        time, not offsets — a record the workers refuse is committed at once and would make the
        offset-based estimate look faster than any forward pass); taken as given while it comes,
        and the offset-based estimate resumes from it when it stops. ``progressing``: the workers
        are seen running batches or steps (telemetry), so a queue whose offsets do not move is not
        stalled — a long generation commits only when it ends. ``cold``: no worker has the model warm
        and one is bringing it in; its queue is the cold start's, which producers are told apart
        (``cold_start_ms``): the wait and the level hold, so the model does not come back warm with a
        level its cold spell raised (nor is it a stall).
        """
        self.lag = max(0, lag)
        self._capacity_known = capacity_rps is not None and capacity_rps > 0
        if capacity_rps is not None and capacity_rps > 0:
            self.capacity_rps = capacity_rps
        if self._last is not None and now > self._last[0] and self._gap(now - self._last[0]):
            self.gaps += 1
            self._stalled_since = None  # waiting since before the gap is not known: counted again from here
            self._now = now
        elif self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            alpha = 1.0 - math.exp(-dt / self.policy.smoothing_s)
            arrived = max(0, log_end_total - self._last[1])
            arrival = arrived / dt
            self._last_arrival = (arrived, arrival)
            drained = max(0, committed_total - self._last[2])
            # The first slope is the best estimate there is (no ramp from 0); for the drain rate, the
            # first slope of work actually done: an idle start says nothing about how fast it goes.
            first = 1.0 if not self._primed else alpha
            self._primed = True
            self.arrival_rps += first * (arrival - self.arrival_rps)
            if log_end_by_priority is not None and self._ends_by_priority is not None:
                for p, (end, before) in enumerate(zip(log_end_by_priority, self._ends_by_priority, strict=True)):
                    self.arrival_by_priority[p] += first * (max(0, end - before) / dt - self.arrival_by_priority[p])
            if self._last[3] > 0 or drained > 0:  # something to drain: an idle spell says nothing of speed
                self.drain_rps += (alpha if self._drain_primed else 1.0) * (drained / dt - self.drain_rps)
                self._drain_primed = True
            if self._queued(self._last[3]) > drained > 0 and not self._capacity_known:  # busy all interval long
                self._observe_capacity(drained / dt, dt)
            if drained > 0 or self.lag == 0 or progressing or cold:
                self._stalled_since = None
            elif self._stalled_since is None:  # waiting since the last poll, or since now if they just came
                self._stalled_since = self._last[0] if self._last[3] > 0 else now
            self._now = now
            if not cold:
                instant = self.instant_wait_ms()
                self._instants = (self._instants[1], instant)
                self.wait_ms += alpha * (instant - self.wait_ms)
        self._last = (now, log_end_total, committed_total, self.lag)
        self._ends_by_priority = log_end_by_priority
        self._update_level(now)
        return self.level

    def _gap(self, dt: float) -> bool:
        """Whether ``dt`` since the last observation is a gap (``gap_polls`` usual intervals, at least
        ``min_gap_s``). The usual interval follows every observation, gaps included, so a monitor that
        polls slower for good is soon not seeing gaps any more."""
        usual = self._interval_s
        self._interval_s = dt if usual <= 0 else usual + 0.2 * (dt - usual)
        return usual > 0 and dt > max(self.policy.min_gap_s, self.policy.gap_polls * usual)

    def _observe_capacity(self, sample: float, dt: float) -> None:
        if self.capacity_rps <= 0:
            self.capacity_rps = sample
        else:
            self.capacity_rps += (1.0 - math.exp(-dt / self.policy.capacity_smoothing_s)) * (sample - self.capacity_rps)

    def instant_wait_ms(self) -> float:
        """The wait the current lag means, unsmoothed: Little's law, lag over throughput.

        The throughput is the capacity once known (the telemetry's as given, an offset-based one no
        lower than the drain rate), else the drain rate measured while there was something to
        drain (idle spells leave it alone: decayed towards zero it would turn the next burst into
        seconds of imagined wait). A queue that has not moved at all has waited at least that
        long, whatever the rates say (a stuck or missing worker).
        """
        if self.lag == 0:
            return 0.0
        stalled_ms = 0.0 if self._stalled_since is None else 1000.0 * (self._now - self._stalled_since)
        # A measured capacity stands; an estimated one is a floor under the drain rate.
        rate = self.capacity_rps if self._capacity_known else max(self.capacity_rps, self.drain_rps)
        arrived, arrival = self._last_arrival
        if self.lag <= arrived:
            # Less lag than one poll's arrivals is work in flight, not a standing queue: it goes at
            # the rate it comes (smoothed rates still ramp up from an idle spell).
            rate = max(rate, arrival)
        if rate <= 1e-6:
            return stalled_ms
        return max(1000.0 * self._queued(self.lag) / rate, stalled_ms)

    def queued(self) -> float:
        """Of the lag, the records really waiting (not answered-but-uncommitted work in flight)."""
        return self._queued(self.lag)

    def _queued(self, lag: int) -> float:
        """Of ``lag``, what is really waiting: records answered since the workers' last commit still
        count as lag (commits are coalesced) — up to a commit interval of traffic, at the rate records
        come in or go out (the arrival rate is the one known from the first poll)."""
        return max(0.0, lag - max(self.drain_rps, self.arrival_rps) * self.policy.commit_interval_ms / 1000.0)

    def _level_at(self, wait_ms: float) -> Level:
        for level in (Level.REJECTING, Level.SHEDDING, Level.DEGRADED):
            if wait_ms >= self.policy.threshold(level):
                return level
        return Level.OK

    def _update_level(self, now: float) -> None:
        target = self._level_at(self.wait_ms)
        # Rising: as far as the queue stood at the last two polls too. A slow poll that read a second's
        # stall weighs heavily in the smoothed wait (its interval is long), and the hysteresis below would
        # hold the level it raised for seconds after the next poll found the queue gone.
        target = min(target, self._level_at(min(self._instants)))
        if target > self.level:
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

    def state(self, model: str, updated_ms: int, *, lag_by_priority: tuple[int, int, int] = (0, 0, 0),
              service_ms: float = 0.0, warm_replicas: int = -1, cold_start_ms: float = 0.0,
              background_lag: int = 0) -> HealthState:
        """What producers are told: the level and the estimate it was decided on, as of ``updated_ms``,
        each number within the range the record holds it to (a wait beyond ``MAX_DURATION_MS`` reads
        as that: every deadline is shorter)."""
        return HealthState(
            model=model, level=self.level, predicted_wait_ms=clamp_ms(self.instant_wait_ms()),
            retry_after_ms=self.retry_after_ms(), lag=_count(self.lag), arrival_rps=clamp_rps(self.arrival_rps),
            drain_rps=clamp_rps(self.drain_rps), updated_ms=updated_ms,
            lag_by_priority=(_count(lag_by_priority[0]), _count(lag_by_priority[1]), _count(lag_by_priority[2])),
            arrival_by_priority=(clamp_rps(self.arrival_by_priority[0]), clamp_rps(self.arrival_by_priority[1]),
                                 clamp_rps(self.arrival_by_priority[2])),
            service_ms=clamp_ms(service_ms), capacity_rps=clamp_rps(self.capacity_rps),
            warm_replicas=warm_replicas, cold_start_ms=clamp_ms(cold_start_ms), background_lag=_count(background_lag),
        )

    def retry_after_ms(self) -> int:
        """How long until the queue should have drained to the DEGRADED threshold."""
        excess_ms = max(0.0, self.wait_ms - self.policy.degraded_wait_ms)
        return int(clamp_ms(max(1000.0, excess_ms)))


def clamp_ms(value: float) -> float:
    """A wait within [0, MAX_DURATION_MS]; NaN reads as the longest (an estimate gone wrong is no
    reason to admit)."""
    return MAX_DURATION_MS if math.isnan(value) else round(min(MAX_DURATION_MS, max(0.0, value)), 1)


def clamp_rps(value: float) -> float:
    """A rate within [0, MAX_RATE_RPS]; NaN reads as 0 (not measured)."""
    return 0.0 if math.isnan(value) else round(min(MAX_RATE_RPS, max(0.0, value)), 2)


def _count(value: int) -> int:
    return min(MAX_COUNT, max(0, value))


class PartitionProgress(Generic[K]):
    """Which partitions of a model stopped moving while the others go on (pure; ``now`` passed in).

    A partition whose committed offset has not moved for ``after_s`` while records wait on it, when
    another partition of the same model did move meanwhile, is stuck on something of its own: its
    owner paused or dead, its leader gone. Its records are not a queue a new request joins (kinfer's
    client steers new requests away from a partition that stopped answering), so the wait new requests
    can expect leaves them out; when every partition with records waiting has stopped, nothing is
    left out (the model itself is stuck, and the usual stall rules apply).
    """

    def __init__(self, after_s: float = 1.0) -> None:
        self.after_s = after_s
        self._moved: dict[K, tuple[int, float]] = {}  # committed offset, and when it last changed

    def stuck_lag(self, by_partition: Mapping[K, tuple[int, int]], now: float) -> int:
        """Records waiting on stuck partitions, of ``by_partition`` (log end, committed) read at ``now``."""
        stuck, moving = 0, False
        for tp, (end, done) in by_partition.items():
            last = self._moved.get(tp)
            if last is None or done != last[0]:
                self._moved[tp] = (done, now)
                last = self._moved[tp]
            if end <= done:
                continue
            if now - last[1] >= self.after_s:
                stuck += end - done
            else:
                moving = True
        for tp in [tp for tp in self._moved if tp not in by_partition]:
            del self._moved[tp]
        return stuck if moving else 0
