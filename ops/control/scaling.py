"""How many workers a model needs: the autoscaler's decisions (pure; ``now`` passed in).

One observation per poll: the model's arrival rate, the records really waiting (the lag monitor's
predicted wait times the capacity, so work in flight between coalesced commits is not a queue),
what one replica drains while busy, how many replicas run and how many partitions the model has.

The load a fleet must carry is the arrival rate plus the backlog drained within ``drain_s``: lag
counts by the time it takes to clear, not by its size (1,000 records of a 2 ms model are nothing;
of a 2 s model, a disaster) — a backlog whose drain time at the current replicas is below
``max_wait_ms`` is batching, not a queue, and counts for nothing. The replicas recommended carry
that load at ``target_utilisation`` (the headroom that keeps the tail short), never more than
``max_replicas`` nor the model's partitions (a consumer beyond them gets none and idles).

Against flapping: the arrival rate is smoothed as it falls (it rises at once); a load within
``tolerance`` of what the current replicas carry at the target changes nothing, and a scale-down
stops where the load would still be below ``1 - tolerance`` of the target (a dead band). Up moves
at once to the recommendation, but for a backlog not twice within ``up_cooldown_s`` (more arrivals
are evidence at once; a backlog waits for the replicas already started to act on it). Down goes
only to the highest recommendation of the last ``down_window_s``, and not within
``down_cooldown_s`` of any change. With ``min_replicas`` 0 the
model scales to zero once nothing has arrived for the window, and is activated (no cooldown) by
the first record that waits: that request pays the cold start (a worker's start, load, warm-up and
group join), which ``kinfer bench autoscale`` measures as ``scale_up_s``.

Background work (p3) is served from capacity the load above leaves idle: it adds nothing to the
load, so it never scales a model up, but a model with background records waiting keeps (or is
activated to) one replica: it scales to zero only when both queues are empty. Told to finish it
within ``background_within_s`` (a completion window to keep), the background records count as a
backlog to drain within that long, beside the arrivals.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from kinfer.topics.record import (
    MAX_COUNT,
    MAX_DURATION_MS,
    MAX_RATE_RPS,
    Label,
    Millis,
    ModelName,
    Rate,
    Record,
    SmallCount,
    WallMs,
)

IDLE_RPS = 0.01  # a smoothed arrival rate below this (one record in 100 s) is no traffic


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    min_replicas: int = 1
    max_replicas: int = 8
    target_utilisation: float = 0.7  # busy share a replica is sized for: the headroom for the tail
    drain_s: float = 10.0  # a backlog is cleared within this long, beside the arrivals
    max_wait_ms: float = 50.0  # a queue that clears within this long is batching, not a backlog
    tolerance: float = 0.1  # a load within this share of what the replicas carry at the target: hold
    up_cooldown_s: float = 10.0  # at least this long between two scale-ups
    down_cooldown_s: float = 30.0  # ... between any change and a scale-down
    down_window_s: float = 60.0  # scale down only to the highest recommendation over this window
    smoothing_s: float = 5.0  # time constant of the arrival rate's smoothing as it falls (it rises at once)
    replica_rps: float = 0.0  # what one replica drains while busy, when known beforehand (0: measured)
    background_within_s: float = 0.0  # drain background records within this long (0: never scale up for them)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        if not 0 < self.target_utilisation <= 1:
            raise ValueError(f"target_utilisation must be within (0, 1], got {self.target_utilisation}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be within [0, 1), got {self.tolerance}")
        if self.drain_s <= 0 or self.smoothing_s < 0 or self.replica_rps < 0 or self.background_within_s < 0:
            raise ValueError("drain_s must be > 0, smoothing_s, replica_rps and background_within_s >= 0")


@dataclass(frozen=True, slots=True)
class Observation:
    now: float  # seconds, any monotonic clock
    arrival_rps: float  # records/s written to the model's request topics
    queued: float  # records really waiting (not in flight)
    lag: int  # records not yet committed (in flight included): 0 with ``arrival_rps`` ~0 is idle
    replicas: int  # workers running now (started ones included)
    partitions: int  # partitions of each of the model's request topics (a member beyond them idles)
    capacity_rps: float = 0.0  # records/s the serving replicas drain while busy, all together (0: unknown)
    serving: int = 0  # replicas the capacity was measured on (0: ``replicas``)
    background: int = 0  # records waiting in the background topic: keep one replica (more only when told)


class Reason(enum.StrEnum):
    HOLD = "hold"
    ACTIVATE = "activate"  # from zero: records wait and nobody serves them
    UP = "up"
    DOWN = "down"
    TO_ZERO = "to-zero"


SCALE_DECISIONS_KEY = "kinfer:autoscale:decisions"  # Redis list, newest first
SCALE_DECISIONS_KEPT = 200
SCALE_STATE_PREFIX = "kinfer:autoscale:state:"


def scale_state_key(model: str) -> str:
    return f"{SCALE_STATE_PREFIX}{model}"


PoolMode = Annotated[str, msgspec.Meta(pattern=r"^(local|kubernetes)\Z")]
Records = Annotated[float, msgspec.Meta(ge=0.0, le=float(MAX_COUNT))]


class ScaleState(Record, frozen=True):
    """The autoscaler's latest view of one model (Redis, for ``kinfer status``)."""

    max_bytes = 1_024

    model: ModelName
    mode: PoolMode  # local | kubernetes
    replicas: SmallCount  # what it runs now
    recommended: SmallCount  # what the load asks for, before cooldowns and the down window
    min_replicas: SmallCount
    max_replicas: SmallCount  # the policy's maximum, capped by the partitions
    load_rps: Rate
    replica_rps: Rate
    updated_ms: WallMs
    restarts: SmallCount = 0  # local workers that died and were started again


class ScaleDecision(Record, frozen=True):
    """One change of the replica count, kept for ``kinfer status`` and exported as metrics."""

    max_bytes = 1_024

    at_ms: WallMs
    model: ModelName
    before: SmallCount
    after: SmallCount
    reason: Label  # a Reason
    load_rps: Rate  # arrivals plus the backlog's drain rate the decision was sized for
    replica_rps: Rate  # what one replica was taken to drain
    queued: Records
    wait_ms: Millis  # the backlog's drain time at ``before`` replicas (at most MAX_DURATION_MS)


@dataclass(slots=True)
class Recommendation:
    replicas: int  # what the policy wants now (after cooldowns: what to run)
    reason: Reason
    load_rps: float
    replica_rps: float
    wait_ms: float
    raw: int  # the recommendation before cooldowns and stabilisation


@dataclass
class Autoscaler:
    policy: ScalePolicy = field(default_factory=ScalePolicy)
    arrival_rps: float = 0.0  # smoothed
    replica_rps: float = 0.0  # per replica, measured (or the policy's)
    _last: float | None = None
    _last_up: float = -math.inf
    _last_change: float = -math.inf
    _history: deque[tuple[float, int]] = field(default_factory=deque)  # (now, raw recommendation)

    def __post_init__(self) -> None:
        self.replica_rps = self.policy.replica_rps

    def observe(self, obs: Observation) -> Recommendation:
        p = self.policy
        self._smooth(obs)
        serving = obs.serving or obs.replicas
        if obs.capacity_rps > 0 and serving > 0 and not p.replica_rps:
            self.replica_rps = obs.capacity_rps / serving  # the latest measurement stands
        per = self.replica_rps
        ceiling = min(p.max_replicas, obs.partitions) if obs.partitions > 0 else p.max_replicas
        wait_ms = (1000.0 * obs.queued / (max(obs.replicas, 1) * per) if per > 0
                   else math.inf if obs.queued > 0 else 0.0)
        backlog_rps = obs.queued / p.drain_s if wait_ms > p.max_wait_ms else 0.0
        if p.background_within_s > 0:  # told to keep a completion window: its records are a backlog too
            backlog_rps += obs.background / p.background_within_s
        load = self.arrival_rps + backlog_rps
        busy = obs.lag > 0 or self.arrival_rps >= IDLE_RPS or obs.background > 0

        raw = min(max(self._replicas_for(load, obs.replicas, busy), p.min_replicas), ceiling)
        arrivals_alone = min(self._replicas_for(self.arrival_rps, obs.replicas, busy), ceiling)
        self._remember(obs.now, raw)

        target, reason = obs.replicas, Reason.HOLD
        if obs.replicas > ceiling:
            target, reason = ceiling, Reason.DOWN  # more than the partitions (or the maximum): idle members
        elif obs.replicas == 0 and raw > 0:
            target, reason = raw, Reason.ACTIVATE
        elif raw > obs.replicas:
            # More arrivals are evidence at once; a backlog waits a cooldown for the replicas already
            # started to act on it (they take a while to start, join and drain it).
            if obs.now - self._last_up >= p.up_cooldown_s:
                target, reason = raw, Reason.UP
            elif arrivals_alone > obs.replicas:
                target, reason = arrivals_alone, Reason.UP
        elif raw < obs.replicas and obs.now - self._last_change >= p.down_cooldown_s:
            settled = max(r for _, r in self._history)  # the highest of the window
            if settled < obs.replicas and obs.now - self._history[0][0] >= p.down_window_s * 0.999:
                target, reason = settled, Reason.TO_ZERO if settled == 0 else Reason.DOWN
        if target != obs.replicas:
            self._last_change = obs.now
            if target > obs.replicas:
                self._last_up = obs.now
        # Reported within the ranges of the records they go into (a wait beyond an hour reads as one).
        return Recommendation(target, reason, round(min(load, MAX_RATE_RPS), 3), round(min(per, MAX_RATE_RPS), 3),
                              round(min(wait_ms, MAX_DURATION_MS), 1), raw)

    def _replicas_for(self, load: float, replicas: int, busy: bool) -> int:
        p, per = self.policy, self.replica_rps
        if not busy:
            return 0  # scaled to zero (with min_replicas 0) once the whole window was like this
        if per <= 0:
            return max(replicas, 1)  # nothing measured yet: keep what runs, activate a model with work
        need = load / (per * p.target_utilisation)  # replicas at exactly the target utilisation
        if replicas > 0 and abs(need / replicas - 1.0) <= p.tolerance:
            return replicas  # close enough to the target: hold
        n = max(1, math.ceil(need - 1e-9))
        if n < replicas and need > n * (1.0 - p.tolerance):
            n += 1  # fewer would sit at the edge of the band and go up again at the next blip: a dead band
        return n

    def _smooth(self, obs: Observation) -> None:
        """Rises at once (a step must be answered now), falls smoothly (a dip must not drop a replica)."""
        if self._last is None or obs.arrival_rps >= self.arrival_rps:
            self.arrival_rps = obs.arrival_rps
        elif obs.now > self._last:
            tau = self.policy.smoothing_s
            alpha = 1.0 - math.exp(-(obs.now - self._last) / tau) if tau > 0 else 1.0
            self.arrival_rps += alpha * (obs.arrival_rps - self.arrival_rps)
        self._last = obs.now

    def _remember(self, now: float, raw: int) -> None:
        self._history.append((now, raw))
        # Keep one sample at or before the window's start: the window is covered whole.
        while len(self._history) > 1 and self._history[1][0] <= now - self.policy.down_window_s:
            self._history.popleft()


__all__ = ["Autoscaler", "Observation", "Reason", "Recommendation", "ScaleDecision", "ScalePolicy", "ScaleState",
           "scale_state_key"]
