"""Client-side admission: refuse early what the system cannot serve in time (pure; time passed in).

Two mechanisms, applied in order:

1. **The health signal** (``topics.health``): a request is refused when the model's predicted wait
   plus its service time would pass its deadline, and by priority as the level rises (SHEDDING
   refuses p2, REJECTING refuses p1 and p2). The level comes smoothed and with hysteresis; the
   wait is brought up to date with what this producer sent since the state was measured. A *cold*
   model (no warm replica, a measured cold start) is judged by that instead: refused, with it as the
   retry-after, when the cold start and the queue before the request outlast its deadline.
   An estimate that is not a finite number refuses (as one too long would): none admits everything.
2. **Adaptive throttling** (Google SRE book, "Handling Overload"): each client tracks its recent
   requests and the ones the backend accepted, and refuses locally with probability
   ``max(0, (requests - K·accepts) / (requests + 1))``. It needs no signal at all, reacts within a
   window, and lets through enough traffic to notice recovery.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from kinfer.topics import Priority
from kinfer.topics.health import HealthState, Level
from kinfer.topics.record import MAX_DURATION_MS


@dataclass(frozen=True, slots=True)
class Decision:
    admit: bool
    reason: str = ""  # why not, for people
    retry_after_s: float = 0.0
    cause: str = ""  # why not, for metrics: "level", "deadline" or "throttle"


ADMIT = Decision(True)

MAX_RETRY_AFTER_S = MAX_DURATION_MS / 1000.0  # the longest retry-after admission names


def retry_after(seconds: float, floor: float = 0.0) -> float:
    """A retry-after within [``floor``, ``MAX_RETRY_AFTER_S``] whatever ``seconds`` is (NaN and inf
    included): it ends up in a ``Retry-After`` header as a whole number."""
    if seconds != seconds:  # NaN
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(floor, seconds))


# Beyond this, a state is too old to bring up to date by arithmetic: it stands as it is.
MAX_EXTRAPOLATION_S = 2.0


def expected_wait_ms(
    health: HealthState, priority: Priority, sent_since: int, now_ms: int, own_rps: float = 0.0,
    answered_rps: float = 0.0,
) -> float:
    """The queueing a request of ``priority`` sent now should expect, between two health states.

    The state is a poll old. Since it was measured, this producer has enqueued ``sent_since``
    requests, the others (``arrival_rps`` less this producer's own ``own_rps``) about their rate
    each second, and the workers have drained at their rate: a surge shows at once instead of a
    poll later. The queue drains for this request at the rate left over by higher priorities,
    which keep arriving and go first (the whole lag counts, not only its own priority's and
    above: workers age waiting work up, so an old p2 backlog does delay a p0 request).
    The rate is the workers' capacity; without one, the drain rate, but only while a queue stands
    (below saturation the drain rate is the arrival rate: an idle model would refuse a burst).
    The result is never below the state's own wait less the time since (a stalled queue stays so).
    ``answered_rps``: how fast this producer's own requests are being answered now, a rate the workers
    certainly drain at, whatever a state measured while its monitor's view was stale says.
    """
    rate = health.capacity_rps or (health.drain_rps if health.lag > 0 else 0.0)
    if rate > 0:
        rate = max(rate, answered_rps)
    if rate <= 0:
        return health.predicted_wait_ms
    elapsed_s = min(MAX_EXTRAPOLATION_S, max(0, now_ms - health.updated_ms) / 1000.0)
    others = max(0.0, health.arrival_rps - own_rps) * elapsed_s
    queued = max(0.0, health.lag + sent_since + others - rate * elapsed_s)
    left = max(rate - sum(health.arrival_by_priority[: int(priority)]), rate * 0.05)
    return max(1000.0 * queued / left, health.predicted_wait_ms - 1000.0 * elapsed_s)


def wait_with_sends(health: HealthState, priority: Priority, sent: SendLog, now_ms: int,
                    answered_rps: float = 0.0) -> float:
    """``expected_wait_ms`` with this producer's own traffic read from its ``SendLog``: what it sent since
    the state was measured (within ``MAX_EXTRAPOLATION_S``: a state that old stays what it said until it is
    stale, never a queue growing by every send), and its own rate over the two seconds that ended when the
    state was measured, the window the monitor's arrival rate saw. A rate taken now falls as this producer
    refuses; its own refused traffic then counted as other producers' arrivals, so every refusal made
    the next one likelier (in a broker kill, a state read mid-failover went from 3.0 to 4.7 s of predicted
    wait while its producer refused everything)."""
    sends = sent.since(health.updated_ms, health.updated_ms + int(1000 * MAX_EXTRAPOLATION_S))
    return expected_wait_ms(health, priority, sends, now_ms, sent.rate(health.updated_ms), answered_rps)


class SendLog:
    """When this producer enqueued its recent requests to one model (wall ms, ascending)."""

    def __init__(self, keep_ms: int = 30_000) -> None:
        self.keep_ms = keep_ms
        self._at: list[int] = []

    def record(self, at_ms: int) -> None:
        self._at.append(at_ms)
        if self._at[0] < at_ms - 2 * self.keep_ms:  # trim now and then, not on every send
            del self._at[: bisect.bisect_left(self._at, at_ms - self.keep_ms)]

    def since(self, at_ms: int, until_ms: int | None = None) -> int:
        """Requests sent after ``at_ms`` (and no later than ``until_ms``)."""
        end = len(self._at) if until_ms is None else bisect.bisect_right(self._at, until_ms)
        return max(0, end - bisect.bisect_right(self._at, at_ms))

    def rate(self, now_ms: int, window_ms: int = 2_000) -> float:
        """Requests per second sent over the last ``window_ms``."""
        return self.since(now_ms - window_ms) * 1000.0 / window_ms


def health_decision(
    health: HealthState | None, priority: Priority, deadline_in_ms: float, service_ms: float | None = None,
    wait_ms: float | None = None,
) -> Decision:
    """What the health signal says about one request (None: no signal, admit).

    ``service_ms`` defaults to the model's recent batch compute time, and ``wait_ms`` to the
    predicted wait, both from the state (``expected_wait_ms`` brings the wait up to date).
    """
    if health is None or priority.background:  # background work waits in Kafka for idle capacity, by design
        return ADMIT
    service_ms = health.service_ms if service_ms is None else service_ms
    if health.warm_replicas == 0 and health.cold_start_ms > 0:
        return _cold_decision(health, deadline_in_ms, service_ms)
    retry = retry_after(health.retry_after_ms / 1000.0)
    if health.level >= Level.REJECTING and priority > Priority.P0:
        return Decision(False, f"{health.model} is rejecting {priority.label}", retry, "level")
    if health.level >= Level.SHEDDING and priority >= Priority.P2:
        return Decision(False, f"{health.model} is shedding {priority.label}", retry, "level")
    wait_ms = health.predicted_wait_ms if wait_ms is None else wait_ms
    if not _fits(wait_ms + service_ms, deadline_in_ms):
        return Decision(
            False,
            f"{health.model}: predicted wait {wait_ms:.0f} ms + service {service_ms:.0f} ms "
            f"exceeds the {deadline_in_ms:.0f} ms deadline",
            retry,
            "deadline",
        )
    return ADMIT


def _fits(total_ms: float, deadline_in_ms: float) -> bool:
    """An estimate that is a finite number within the deadline (NaN and ±inf never fit)."""
    return math.isfinite(total_ms) and total_ms <= deadline_in_ms


def _cold_decision(health: HealthState, deadline_in_ms: float, service_ms: float) -> Decision:
    """No worker has the model warm, and one will swap it in in about ``cold_start_ms``. Its level says
    little (a queue nobody drains looks stalled); what counts is whether the cold start, the records
    queued before this one and its own service fit in its deadline."""
    queue_ms = 1000.0 * health.lag / health.capacity_rps if health.capacity_rps > 0 else 0.0
    if not _fits(health.cold_start_ms + queue_ms + service_ms, deadline_in_ms):
        return Decision(
            False,
            f"{health.model} is cold (no warm worker): expected cold start {health.cold_start_ms:.0f} ms"
            f" + queue {queue_ms:.0f} ms + service {service_ms:.0f} ms exceeds the {deadline_in_ms:.0f} ms deadline",
            retry_after(health.cold_start_ms / 1000.0, floor=1.0),
            "cold",
        )
    return ADMIT


class AdaptiveThrottle:
    """Requests and accepts counted over a sliding window (exponentially decayed, ``now`` passed in).

    A request counts once its outcome is known — the backend took it, or refused it (shed,
    expired). Counting requests still in flight would make a fresh client's first burst look like
    failures; a client-side timeout says nothing about the backend's will (it may be starting), so
    it does not count; and below ``min_requests`` outcomes there is too little evidence to refuse.
    """

    def __init__(self, k: float = 2.0, window_s: float = 60.0, min_requests: float = 20.0) -> None:
        if k < 1.0:
            raise ValueError(f"k must be >= 1 (k = 1 refuses as soon as anything fails), got {k}")
        self.k = k
        self.window_s = window_s
        self.min_requests = min_requests  # fewer outcomes than this are no evidence: never throttle
        self.requests = 0.0
        self.accepts = 0.0
        self._at = 0.0

    def _decay(self, now: float) -> None:
        if now > self._at:
            factor = math.exp(-(now - self._at) / self.window_s)
            self.requests *= factor
            self.accepts *= factor
            self._at = now

    def reject_probability(self, now: float) -> float:
        self._decay(now)
        if self.requests < self.min_requests:
            return 0.0
        return max(0.0, (self.requests - self.k * self.accepts) / (self.requests + 1.0))

    def decide(self, now: float, draw: float) -> Decision:
        """``draw`` uniform in [0, 1): passed in so tests choose it. A local refusal counts as a
        request the backend did not accept (so the ratio keeps track while it refuses)."""
        p = self.reject_probability(now)
        if draw < p:
            self.requests += 1.0
            return Decision(False, f"adaptive throttling: refusing {p:.0%} of requests locally", 1.0, "throttle")
        return ADMIT

    def record(self, now: float, accepted: bool) -> None:
        """The outcome of a request that was sent: taken by the backend, or refused for overload."""
        self._decay(now)
        self.requests += 1.0
        if accepted:
            self.accepts += 1.0
