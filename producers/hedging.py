"""Hedged requests and partition avoidance: the client's answer to a partition that stopped moving. No I/O.

A request sits on one partition of its topic, and only that partition's owner can answer it. When
the owner dies or stalls (SIGKILL, a pause, its broker gone), every request on the partition waits
for the group to notice (the session timeout, seconds) or for the broker's leader election; a caller
with a one-second deadline sees an outage. Two mechanisms, driven by what this client sees itself:

- **Hedging** ("The Tail at Scale", Dean and Barroso): a request still unanswered at the model's
  recent p99 (``LatencyWindow``; at most four times its median, so the slow answers of a fault do
  not push the hedge past the deadline, and at the latest a median answer before its deadline, so the
  copy has the time to be answered) is published once more, with the same id and bytes, to
  another partition; should that copy wait as long too, once more again (``max_hedges``). The first
  answer wins; the others are duplicates the client drops by id (workers are idempotent by id
  already). Hedges are paid from a ``HedgeBudget`` that earns a fraction of a hedge for every
  request sent, so the extra work stays bounded (2 % by default). Part of the bucket (``reserve``)
  is kept for requests stranded on a suspect or stalled partition: a slow answer from a partition that answers
  others (a busy box's tail) may spend only what is above it. Without the reserve, calm weather's
  tail wanted about twice what the budget earns, the bucket sat empty, and when a worker stopped the
  requests it stranded found nothing to pay their hedges with. No hedge goes to a suspect
  partition, nor to one whose writes stall: when every other one has stopped too (the whole topic
  waits on a broker), a hedge would only wait as well, and the budget is kept for when it can help.
  The request is put off, unpaid, and looks again later, each time twice as long after: a partition
  suspected for one slow batch is trusted again at its next answer, and one whose writes stalled at its
  next acknowledgement, and the hedge goes there then. With ``acks=all``
  a broker that dies or stalls holds up the writes of every partition it follows until it leaves the
  in-sync set (half a second with kinfer's broker settings) and those it leads until they have new
  leaders (seconds): hedges spent in the first were copies that waited as well, and left the bucket
  empty for the requests stranded by the second.
- **Avoidance** (``PartitionBoard``): a partition whose request had to be hedged after the broker
  took it, and that has answered nothing since that request was sent, is *suspect*: its consumer does
  not answer. New requests go to the others, and the requests already waiting on it are hedged at once
  rather than each at its own delay (a dead owner strands all of them alike). A suspect partition gets
  one probe request every ``probe_s``; an answer it gives clears it. Its writes *stall* when it has
  held our copies unacknowledged since before a given moment, and taken none since (the broker's
  acknowledgements are counted per partition, ``handed``/``acknowledged``): a hedge's copy goes
  elsewhere than a partition stalled since before the copy it replaces was sent, or waits. New
  requests do not avoid a stall: read from acknowledgements, a busy client's own queue looks like one
  (they come late but steadily), and new requests sent only where acknowledgements came last broke the
  library path down at 6,000/s (measured); a stranded request is hedged instead.
  A stall says nothing of the consumer, so it makes no partition suspect, and it ends with the
  broker's next acknowledgement. When a broker dies or pauses, every partition it follows stalls at
  once and all but those it led resume within a second; had the stall made them suspect, each would
  have waited for its probe to be trusted again, and the first few trusted would have taken every new
  request and every hedge between them, more than their consumers could serve (measured: a fault's
  failures kept coming for seconds after the stall, all on one worker's two partitions).

Evidence is per client and needs no other process: a dead lag monitor or a Redis outage does not
blind it. The cost of a false suspicion (a slow batch, a GC pause) is a few hedges and a partition
skipped for ``probe_s``.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When and how much to hedge."""

    enabled: bool = True
    budget: float = 0.02  # hedges earned per request sent: at most this fraction, over time
    burst: float = 50.0  # hedges that may be spent at once (a partition dying strands a burst)...
    burst_s: float = 1.0  # ...or this many seconds of the client's own requests, whichever is more
    reserve: float = 0.5  # of the burst: spent only on requests stranded on a suspect or stalled partition
    # Hedge a request unanswered at this quantile of recent latencies: about 1 - quantile of requests
    # would be hedged in calm weather, which must leave most of the budget for a partition that dies.
    quantile: float = 0.99
    min_delay_ms: float = 20.0  # never sooner (a hedge before the batch window closes is waste)
    median_cap: float = 4.0  # and never later than this many times the recent median
    max_hedges: int = 2  # copies after the first, each a hedge delay after the last, each to a trusted partition
    min_samples: int = 32  # no hedging for a model until this many answers were timed
    window: int = 512  # recent answers a model's quantile is taken over
    probe_s: float = 1.0  # a suspect partition gets one request this often, to see whether it is back

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"budget must be within [0, 1], got {self.budget}")
        if not 0.0 <= self.reserve < 1.0:
            raise ValueError(f"reserve must be within [0, 1), got {self.reserve}")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile must be within (0, 1), got {self.quantile}")
        if not (math.isfinite(self.burst_s) and self.burst_s >= 0):
            raise ValueError(f"burst_s must be a finite number >= 0, got {self.burst_s}")
        if self.burst < 1.0 or self.min_samples < 1 or self.window < self.min_samples or self.max_hedges < 1:
            raise ValueError("need burst >= 1, max_hedges >= 1 and 1 <= min_samples <= window")
        if not (math.isfinite(self.min_delay_ms) and self.min_delay_ms >= 0 and math.isfinite(self.probe_s)
                and self.probe_s > 0 and math.isfinite(self.median_cap) and self.median_cap >= 1):
            raise ValueError("min_delay_ms must be >= 0, probe_s > 0 and median_cap >= 1")

    @property
    def tail_burst(self) -> float:
        """Hedges a slow answer may spend at once: the floor's share above the reserve (all the rest of the
        bucket, however large it grows, is kept for requests stranded on a suspect or stalled partition)."""
        return (1.0 - self.reserve) * self.burst


class LatencyWindow:
    """A model's last ``size`` answer latencies, and their quantile (kept sorted: O(log n) a sample)."""

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque()
        self._sorted: list[float] = []
        self._size = size

    def __len__(self) -> int:
        return len(self._order)

    def add(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        if len(self._order) == self._size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(seconds)
        bisect.insort(self._sorted, seconds)

    def quantile(self, q: float) -> float | None:
        if not self._sorted:
            return None
        return self._sorted[min(len(self._sorted) - 1, int(q * len(self._sorted)))]


class HedgeBudget:
    """A token bucket: each request sent earns ``rate`` of a hedge, up to the bucket's size; a hedge spends one.

    The size is ``burst``, or ``burst_s`` seconds of the requests being sent if that is more (the send
    rate measured over windows of ``RATE_WINDOW_S``, when ``earn`` is told the time): a partition that
    dies strands its share of everything sent until the client notices, so a bucket sized for a slow
    client left most of a busy one's stranded requests unpaid (at 200 requests/s, a broker's death
    stranded a few hundred on its partitions; 50 were paid). The fraction earned per request, which
    bounds the extra work over time, does not change.
    """

    RATE_WINDOW_S = 1.0

    def __init__(self, rate: float, burst: float, burst_s: float = 0.0) -> None:
        self.rate = rate
        self.floor = burst
        self.burst = burst  # the bucket's size now
        self.burst_s = burst_s
        self.tokens = burst
        self.spent = 0
        self.refused = 0  # hedges wanted and not paid for
        self._counted = 0  # requests sent since ``_since``
        self._since: float | None = None

    def earn(self, now: float | None = None) -> None:
        """One request sent (at ``now``, on a monotonic clock: it sizes the bucket by the send rate)."""
        if now is not None and self.burst_s > 0:
            self._counted += 1
            if self._since is None:
                self._since = now
            elif now - self._since >= self.RATE_WINDOW_S:
                self.burst = max(self.floor, self.burst_s * self._counted / (now - self._since))
                self._counted, self._since = 0, now
        self.tokens = min(self.burst, self.tokens + self.rate)

    def spend(self, keep: float = 0.0) -> bool:
        """One hedge, if the bucket holds one more than ``keep`` (what is kept for others)."""
        if self.tokens >= 1.0 + keep:
            self.tokens -= 1.0
            self.spent += 1
            return True
        self.refused += 1
        return False


@dataclass(slots=True)
class _Partition:
    last_answer: float = -math.inf  # when it last answered an unhedged request of ours
    suspect_since: float | None = None  # its request was hedged and it has answered nothing since
    probed: float = -math.inf  # when a suspect partition last got a request anyway
    unacked: int = 0  # our copies handed to the producer for it that the broker has not acknowledged
    unacked_since: float = -math.inf  # it has held some since (the last time it held none)
    last_ack: float = -math.inf  # when the broker last acknowledged one
    stall_seen: float = -math.inf  # when the last stall a hedge reported began (each stall reported once)


def _stalled(part: _Partition, since: float) -> bool:
    """The broker has held a copy of ours for ``part`` unacknowledged since before ``since`` without
    acknowledging one meanwhile."""
    return part.unacked > 0 and max(part.last_ack, part.unacked_since) < since


class PartitionBoard:
    """Per topic and partition: which partitions answer, and where the next request should go."""

    def __init__(self, probe_s: float) -> None:
        self.probe_s = probe_s
        self._parts: dict[tuple[str, int], _Partition] = {}
        self._turn: dict[str, int] = {}

    def _get(self, topic: str, partition: int) -> _Partition:
        key = (topic, partition)
        part = self._parts.get(key)
        if part is None:
            if len(self._parts) >= 65_536:  # topics come and go: forget the ones nothing is known of
                self._parts = {k: p for k, p in self._parts.items() if p.suspect_since is not None or p.unacked}
            part = self._parts[key] = _Partition()
        return part

    def suspect(self, topic: str, partition: int) -> bool:
        part = self._parts.get((topic, partition))
        return part is not None and part.suspect_since is not None

    def pick(self, topic: str, partitions: Sequence[int], now: float, avoid: Iterable[int] = ()) -> int:
        """The partition for the next request (round robin over the trusted ones), or for a hedge (not one
        of ``avoid``). A suspect partition is offered once every ``probe_s``; with every one suspect, any."""
        if not partitions:
            raise ValueError("no partitions to pick from")
        skip = set(avoid)
        turn = self._turn.get(topic, 0)
        self._turn[topic] = turn + 1
        n = len(partitions)
        fallback = None
        for i in range(n):
            p = partitions[(turn + i) % n]
            if p in skip:
                continue
            part = self._parts.get((topic, p))
            if part is None or part.suspect_since is None:
                return p
            if now - part.probed >= self.probe_s:
                part.probed = now
                return p
            fallback = p if fallback is None else fallback
        if fallback is not None:
            return fallback
        return partitions[turn % n]

    def trusted(self, topic: str, partitions: Sequence[int], avoid: Iterable[int] = (),
                since: float = -math.inf) -> int | None:
        """A partition for a hedge of a copy sent at ``since``: round robin over the trusted ones not in
        ``avoid``; None when there is none. Never a suspect one, nor one whose writes are stalled since then
        (a copy there would wait at the broker as long); and a suspect one's probe is left to a new request
        (a hedge looked for and put off must not use it up: the probe is how a partition suspected wrongly
        is trusted again)."""
        skip = set(avoid)
        candidates = [p for p in partitions
                      if p not in skip and not self.suspect(topic, p) and self.writing(topic, p, since)]
        if not candidates:
            return None
        turn = self._turn.get(topic, 0)
        self._turn[topic] = turn + 1
        return candidates[turn % len(candidates)]

    def writing(self, topic: str, partition: int, since: float) -> bool:
        """Whether the broker takes our writes to ``partition``: it has not held a copy of ours
        unacknowledged since before ``since`` without acknowledging one meanwhile. With ``acks=all`` a
        broker that dies or stalls holds up the writes of every partition it follows, not only those it
        leads, until it leaves the in-sync set: a copy sent to one of those then would wait as long as the
        copy it hedges."""
        part = self._parts.get((topic, partition))
        return part is None or not _stalled(part, since)

    def stalled(self, topic: str, partition: int, sent: float) -> bool:
        """Whether a copy sent to ``partition`` at ``sent`` and not yet acknowledged is held by a stall: the
        broker has acknowledged none of our copies there since. (A busy producer acknowledges late but
        steadily: its copies wait in line, and that is the tail's, not a stall.)"""
        part = self._parts.get((topic, partition))
        return part is not None and part.unacked > 0 and part.last_ack < sent

    def handed(self, topic: str, partition: int, now: float) -> None:
        """A copy for ``partition`` is with the producer: acknowledged (or given up on) later, exactly once."""
        part = self._get(topic, partition)
        if not part.unacked:
            part.unacked_since = now
        part.unacked += 1

    def acknowledged(self, topic: str, partition: int, now: float, taken: bool) -> None:
        """The broker answered a copy handed over for ``partition`` (``taken``: it took it; else it refused
        it, or the copy was called off)."""
        part = self._parts.get((topic, partition))
        if part is not None:
            part.unacked = max(0, part.unacked - 1)
            if taken:
                part.last_ack = now

    def answered(self, topic: str, partition: int, now: float) -> None:
        """An unhedged request on ``partition`` was answered: it works."""
        part = self._get(topic, partition)
        part.last_answer = now
        part.suspect_since = None

    def hedged(self, topic: str, partition: int, sent: float, now: float, taken: bool = True) -> bool:
        """A request sent to ``partition`` at ``sent`` is still unanswered at ``now``. ``taken``: the broker
        took its copy there, so unless the partition answered something since, its consumer is suspect.
        Not taken: the broker holds it, which says nothing of its consumer; if the broker has taken none
        of our copies there since (``stalled``), the partition's writes stall. True when this is news: the
        partition turned suspect (it was trusted before), or its stall is seen for the first time; either
        way what else waits there is stranded too."""
        part = self._get(topic, partition)
        if not taken:
            if self.stalled(topic, partition, sent):
                began = max(part.last_ack, part.unacked_since)  # nothing acknowledged there since
                if part.stall_seen != began:
                    part.stall_seen = began
                    return True
            return False
        if part.last_answer < sent and part.suspect_since is None:
            part.suspect_since = now
            part.probed = now
            return True
        return False


class Hedger:
    """The client's hedging state: one budget, a latency window per model, the partition board."""

    def __init__(self, policy: HedgePolicy) -> None:
        self.policy = policy
        self.budget = HedgeBudget(policy.budget, policy.burst, policy.burst_s)
        self.board = PartitionBoard(policy.probe_s)
        self._latency: dict[str, LatencyWindow] = {}
        self.sent = 0  # requests sent (first copies)
        self.nowhere = 0  # requests whose hedge was put off: every other partition was suspect too

    def sent_one(self, now: float | None = None) -> None:
        """A request's first copy sent (at ``now``, monotonic)."""
        self.sent += 1
        self.budget.earn(now)

    def delay_s(self, model: str, left_s: float = math.inf) -> float | None:
        """How long to wait before hedging a request to ``model`` that has ``left_s`` until its deadline
        (None: do not hedge it)."""
        if not self.policy.enabled:
            return None
        window = self._latency.get(model)
        if window is None or len(window) < self.policy.min_samples:
            return None
        q, median = window.quantile(self.policy.quantile), window.quantile(0.5)
        assert q is not None and median is not None
        # A window that took in a fault's slow answers has a p99 of the fault, not of the model: the
        # median barely moves, so the delay is held within a few medians of it. And a copy sent later
        # than a median answer before the deadline comes too late to help: on a busy box (p99 900 ms,
        # median 290 ms, one-second deadlines) the p99 alone put every hedge at the deadline.
        return max(self.policy.min_delay_ms / 1000.0, min(q, self.policy.median_cap * median, left_s - median))

    def observe(self, model: str, seconds: float) -> None:
        """An answer to ``model`` took ``seconds`` from send to result."""
        window = self._latency.get(model)
        if window is None:
            if len(self._latency) >= 1_024:  # a caller cycling through model names: start over
                self._latency.clear()
            window = self._latency[model] = LatencyWindow(self.policy.window)
        window.add(seconds)

    @property
    def fraction(self) -> float:
        """Hedges sent per request sent."""
        return self.budget.spent / self.sent if self.sent else 0.0
