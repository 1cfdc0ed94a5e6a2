"""``kinfer simulate``: a discrete-event simulation of a fleet, to size it for a rate and a model mix.

What is simulated, and with what code:

- **Producers** send Poisson arrivals at each model's share of ``qps``, keyed to a random partition,
  and obey the health signal with the client's own admission code (``producers.admission``). The
  health state comes from the lag monitor's estimator (``ops.control.estimator.HealthEstimator``) fed with the
  simulated offsets every ``lagmon_interval_s``.
- **Kafka** is a delay: ``transport_ms`` from send to fetch (producer linger, broker, fetch) plus
  an exponential jitter, ``reply_ms`` for the result's way back. Partitions are owned by one
  worker of the model's group each (round robin); a partition without a live owner parks its
  records until one takes it over — Kafka is the queue.
- **Workers** run the real batcher: ``batcher.DynamicBatcher`` (batch formation, deadline shedding,
  CoDel) for one-shot models, ``batcher.ContinuousScheduler`` for generators. A forward pass takes
  the model's service-time curve at the batch size (``batch_ms``, linearly interpolated, measured
  with ``kinfer bench model`` on the target device; or from ``kinfer plan``), times a lognormal noise,
  plus the worker's own CPU per request (``worker_cpu_ms``, from ``kinfer bench transport``).
- **Failures**: ``worker`` kills one worker of the largest pool at ``fail_at_s``: its batch in flight
  and everything it held are redone by the partitions' new owners after the session timeout, and
  its partitions park records until then. ``broker`` takes one broker of ``brokers`` away for
  ``broker_failover_s``: records keyed to the partitions it led wait for the new leaders.

``size_fleet`` finds, per model (dedicated pools), the fewest workers whose P95 and P99 meet the
SLA with at least ``min_ok`` of the requests answered ok, then runs the whole fleet together, and
again with each failure, reporting what the failure does to the tail.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kinfer.batcher import BatchPolicy, ContinuousScheduler, DynamicBatcher, GenPolicy, Sequence
from kinfer.ops.capacity.sla import SLA_P95_MS, SLA_P99_MS, meets_sla, percentile
from kinfer.ops.control.estimator import HealthEstimator
from kinfer.producers.admission import health_decision
from kinfer.topics import Priority
from kinfer.topics.health import HealthState


@dataclass(frozen=True, slots=True)
class SimModel:
    name: str
    share: float  # of the fleet's requests
    kind: Literal["batch", "generate"] = "batch"
    # batch: milliseconds for a forward pass of N inputs, interpolated linearly between the points
    batch_ms: dict[int, float] = field(default_factory=lambda: {1: 2.0, 32: 6.0})
    tokens: int = 32  # tokens per request (the batcher's padding arithmetic)
    max_batch_size: int = 32
    # generate: a step costs step_ms + step_ms_per_seq per running sequence + prefill per prompt token
    step_ms: float = 8.0
    step_ms_per_seq: float = 0.05
    prefill_ms_per_token: float = 0.005
    prompt_tokens: int = 128
    output_tokens: int = 16
    max_running: int = 64
    partitions: int = 64  # per request topic: the most workers the model's group can use
    deadline_ms: float = 1_000.0

    def forward_ms(self, size: int) -> float:
        points = sorted(self.batch_ms.items())
        sizes = [s for s, _ in points]
        i = bisect.bisect_left(sizes, size)
        if i < len(points) and sizes[i] == size:
            return points[i][1]
        if i == 0:
            return points[0][1]
        if i == len(points):  # beyond the last point: the last slope
            (s0, t0), (s1, t1) = points[-2] if len(points) > 1 else points[-1], points[-1]
            return t1 + (size - s1) * ((t1 - t0) / (s1 - s0) if s1 != s0 else t1 / s1)
        (s0, t0), (s1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (size - s0) / (s1 - s0)

    def capacity_rps(self) -> float:
        """What one worker serves, always busy, at its best batch size (the search's lower bound)."""
        if self.kind == "generate":
            n = self.max_running
            step = self.step_ms + self.step_ms_per_seq * n + self.prefill_ms_per_token * self.prompt_tokens * n \
                / self.output_tokens
            return n / (self.output_tokens * step / 1000.0)
        return max(b / self.forward_ms(b) * 1000.0 for b in range(1, self.max_batch_size + 1))


@dataclass(frozen=True, slots=True)
class SimConfig:
    transport_ms: float = 6.0  # send -> fetched by a worker (the producer's 5 ms linger included)
    transport_jitter_ms: float = 1.0  # mean of an exponential added to it
    reply_ms: float = 1.0  # result published -> the caller has it
    worker_cpu_ms: float = 0.11  # the worker's own work per request (decode, reply, commit share)
    # The worker's shell per batch, while its executor waits: hand-off to the executor thread, the
    # replies published before the next batch starts. tests/integration/test_simulator.py measures it.
    batch_overhead_ms: float = 2.0
    service_cv: float = 0.05  # lognormal noise on each forward pass
    session_timeout_s: float = 6.0  # a dead worker's partitions move after this
    brokers: int = 3
    broker_failover_s: float = 5.0  # a dead broker's partitions wait this long for new leaders
    lagmon_interval_s: float = 0.5
    admission: bool = True
    min_ok: float = 0.999  # of the requests answered ok, for the SLA
    fail: Literal["none", "worker", "broker"] = "none"
    fail_at_s: float = 0.0  # seconds after warm-up


@dataclass(slots=True)
class Request:
    model: str
    sent: float
    deadline: float
    partition: int
    outcome: str = ""  # ok, refused, or the shed reason
    done: float = 0.0


class _Pool:
    """One model's consumer group: workers, partition ownership, records parked without an owner."""

    def __init__(self, sim: Simulation, model: SimModel, workers: int) -> None:
        self.sim, self.model = sim, model
        self.workers = [_Worker(sim, self, i) for i in range(workers)]
        self.owner: list[_Worker | None] = [self.workers[p % workers] for p in range(model.partitions)]
        self.parked: dict[int, list[Request]] = {}
        self.estimator = HealthEstimator()
        self.health: HealthState | None = None
        self.produced = 0  # records in Kafka (log-end offsets, summed)
        self.finished = 0  # records answered or shed (committed offsets, summed)

    def deliver(self, r: Request) -> None:
        owner = self.owner[r.partition]
        if owner is None or not owner.alive:
            self.parked.setdefault(r.partition, []).append(r)
        else:
            owner.add(r)

    def kill(self, victim: _Worker) -> None:
        victim.alive = False
        orphans = victim.drop_all()
        for p, w in enumerate(self.owner):
            if w is victim:
                self.owner[p] = None

        def rebalance() -> None:
            live = [w for w in self.workers if w.alive]
            for i, p in enumerate([p for p, w in enumerate(self.owner) if w is None]):
                self.owner[p] = live[i % len(live)]
            for r in orphans:  # uncommitted: fetched again by the new owner
                self.deliver(r)
            for p in list(self.parked):
                for r in self.parked.pop(p):
                    self.deliver(r)

        self.sim.at(self.sim.now + self.sim.cfg.session_timeout_s, rebalance)

    def poll(self) -> None:
        """The lag monitor's view, then the state producers obey."""
        now = self.sim.now
        lag = self.produced - self.finished
        self.estimator.observe(now, lag, self.produced, self.finished)
        self.health = self.estimator.state(self.model.name, int(now * 1000),
                                           service_ms=self.model.forward_ms(1) if self.model.kind == "batch" else 0.0)


class _Worker:
    def __init__(self, sim: Simulation, pool: _Pool, index: int) -> None:
        self.sim, self.pool, self.index = sim, pool, index
        self.alive = True
        self.busy = False
        m = pool.model
        self.batcher: DynamicBatcher[Request] | None = None
        self.gen: ContinuousScheduler | None = None
        if m.kind == "batch":
            self.batcher = DynamicBatcher(BatchPolicy(max_batch_size=m.max_batch_size, max_batch_tokens=10**9))
        else:
            self.gen = ContinuousScheduler(GenPolicy(max_running=m.max_running, kv_budget_tokens=10**9,
                                                     max_prefill_tokens=10**9))
        self.requests: dict[str, Request] = {}  # generation: by sequence id
        self.in_flight: list[Request] = []
        self.busy_s = 0.0
        self.batches = 0
        self.inputs = 0

    def add(self, r: Request) -> None:
        now, m = self.sim.now, self.pool.model
        if self.batcher is not None:
            self.batcher.add(r, priority=1, size=1, longest=m.tokens, deadline=r.deadline, now=now)
        else:
            assert self.gen is not None
            sid = f"{id(r)}"
            self.requests[sid] = r
            self.gen.add(Sequence(sid, m.prompt_tokens, m.output_tokens, arrival=now, deadline=r.deadline))
        self.kick()

    def drop_all(self) -> list[Request]:
        out = list(self.in_flight)
        if self.batcher is not None:
            out += [p.payload for p in self.batcher.remove(lambda p: True)]
        else:
            out += list(self.requests.values())
        self.in_flight, self.requests = [], {}
        return [r for r in out if not r.outcome]

    def kick(self) -> None:
        if self.busy or not self.alive:
            return
        now = self.sim.now
        if self.batcher is not None:
            for d in self.batcher.shed(now, free_at=now):
                self.sim.finish(self.pool, d.pending.payload, d.reason.value)
            batch = self.batcher.next_batch(now)
            if batch is None:
                return
            self.in_flight = batch.payloads
            self.batches += 1
            self.inputs += batch.size
            seconds = self.sim.noisy(self.pool.model.forward_ms(batch.size) / 1000.0) \
                + (self.sim.cfg.worker_cpu_ms * batch.size + self.sim.cfg.batch_overhead_ms) / 1000.0
            self.batcher.observe(batch, seconds)
        else:
            assert self.gen is not None
            if not self.gen.has_work():
                return
            m = self.pool.model
            plan = self.gen.schedule(now)
            for s, reason in plan.evict:
                self.sim.finish(self.pool, self.requests.pop(s.id), str(reason.value))
            running = len(plan.admit) + len(plan.decode)
            if not running:
                return
            seconds = self.sim.noisy((m.step_ms + m.step_ms_per_seq * running
                                      + m.prefill_ms_per_token * m.prompt_tokens * len(plan.admit)) / 1000.0) \
                + (self.sim.cfg.worker_cpu_ms * len(plan.admit) + self.sim.cfg.batch_overhead_ms) / 1000.0
            self.in_flight = []
        self.busy = True
        self.busy_s += seconds
        self.sim.at(now + seconds, self._done)

    def _done(self) -> None:
        if not self.alive:
            return
        self.busy = False
        if self.batcher is not None:
            for r in self.in_flight:
                self.sim.finish(self.pool, r, "ok", reply=True)
            self.in_flight = []
        else:
            assert self.gen is not None
            for s in self.gen.running:
                self.gen.advance(s.id)
                if s.generated >= s.max_new_tokens:
                    self.gen.finish(s.id)
                    self.sim.finish(self.pool, self.requests.pop(s.id), "ok", reply=True)
        self.kick()


class Simulation:
    def __init__(self, models: list[SimModel], fleet: dict[str, int], qps: float, cfg: SimConfig | None = None,
                 seed: int = 1) -> None:
        self.cfg = cfg or SimConfig()
        self.rng = random.Random(seed)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.models = [m for m in models if fleet.get(m.name, 0) > 0]
        self.qps = qps * sum(m.share for m in self.models) / max(1e-9, sum(m.share for m in models))
        self.pools = {m.name: _Pool(self, m, fleet[m.name]) for m in self.models}
        self.requests: list[Request] = []
        self._broker_down: tuple[float, float] | None = None

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def noisy(self, seconds: float) -> float:
        cv = self.cfg.service_cv
        if cv <= 0:
            return seconds
        sigma = math.sqrt(math.log(1 + cv * cv))
        return seconds * self.rng.lognormvariate(-sigma * sigma / 2, sigma)

    def finish(self, pool: _Pool, r: Request, outcome: str, reply: bool = False) -> None:
        if r.outcome:  # already answered (a redelivered copy): counted once
            return
        r.outcome, r.done = outcome, self.now + (self.cfg.reply_ms / 1000.0 if reply else 0.0)
        pool.finished += 1

    def run(self, seconds: float, warmup_s: float = 2.0) -> dict[str, Any]:
        end = warmup_s + seconds
        total_share = sum(m.share for m in self.models)
        for m in self.models:
            self._arrivals(m, self.qps * m.share / total_share, end)
        for pool in self.pools.values():
            self._every(self.cfg.lagmon_interval_s, pool.poll, end)
        if self.cfg.fail == "worker":
            largest = max(self.pools.values(), key=lambda p: len(p.workers))
            self.at(warmup_s + self.cfg.fail_at_s, lambda: largest.kill(largest.workers[0]))
        elif self.cfg.fail == "broker":
            start = warmup_s + self.cfg.fail_at_s
            self._broker_down = (start, start + self.cfg.broker_failover_s)
        drain_until = end + 30.0  # everything sent gets its answer (deadlines are shorter)
        while self._events and self._events[0][0] <= drain_until:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        return self._report(warmup_s, end)

    def _every(self, interval: float, fn: Callable[[], None], end: float) -> None:
        def tick() -> None:
            fn()
            if self.now + interval <= end:
                self.at(self.now + interval, tick)

        self.at(interval, tick)

    def _arrivals(self, m: SimModel, rate: float, end: float) -> None:
        pool = self.pools[m.name]

        def arrive() -> None:
            now = self.now
            r = Request(m.name, now, now + m.deadline_ms / 1000.0, self.rng.randrange(m.partitions))
            self.requests.append(r)
            if self.cfg.admission and not health_decision(pool.health, Priority.P1, m.deadline_ms).admit:
                r.outcome, r.done = "refused", now
            else:
                delay = (self.cfg.transport_ms + self.rng.expovariate(1.0 / self.cfg.transport_jitter_ms)
                         if self.cfg.transport_jitter_ms > 0 else self.cfg.transport_ms) / 1000.0
                at = now + delay
                down = self._broker_down
                if down is not None and r.partition % self.cfg.brokers == 0 and down[0] <= now < down[1]:
                    at = down[1] + delay  # its leader died: it waits for the new one
                self.at(at, lambda: self._produced(pool, r))
            nxt = now + self.rng.expovariate(rate)
            if nxt < end:
                self.at(nxt, arrive)

        self.at(self.rng.expovariate(rate), arrive)

    @staticmethod
    def _produced(pool: _Pool, r: Request) -> None:
        """In the log (counted in the log-end offsets the lag monitor reads), and fetched."""
        pool.produced += 1
        pool.deliver(r)

    def _report(self, warmup_s: float, end: float) -> dict[str, Any]:
        measured = [r for r in self.requests if warmup_s <= r.sent < end]
        out: dict[str, Any] = {"models": {}}
        for name, pool in self.pools.items():
            mine = [r for r in measured if r.model == name]
            batches = sum(w.batches for w in pool.workers)
            out["models"][name] = {"workers": len(pool.workers), **_latency(mine),
                                   "mean_batch": round(sum(w.inputs for w in pool.workers) / batches, 1)
                                   if batches else None,
                                   "busy_fraction": round(sum(w.busy_s for w in pool.workers)
                                                        / (len(pool.workers) * end), 3)}
        out["fleet"] = {"workers": sum(len(p.workers) for p in self.pools.values()), **_latency(measured)}
        if self.cfg.fail != "none":
            t0 = warmup_s + self.cfg.fail_at_s
            window = [r for r in measured if t0 <= r.sent < t0 + self.cfg.session_timeout_s + 4.0]
            out["during_failure"] = _latency(window)
        return out


def _latency(requests: list[Request]) -> dict[str, Any]:
    ok = [(r.done - r.sent) * 1000.0 for r in requests if r.outcome == "ok"]
    outcomes: dict[str, int] = {}
    for r in requests:
        outcomes[r.outcome or "unanswered"] = outcomes.get(r.outcome or "unanswered", 0) + 1
    p95, p99 = percentile(ok, 95), percentile(ok, 99)
    ok_fraction = len(ok) / len(requests) if requests else 0.0
    return {
        "requests": len(requests), "ok_fraction": round(ok_fraction, 5),
        "p50_ms": _ms(percentile(ok, 50)), "p95_ms": _ms(p95), "p99_ms": _ms(p99),
        "outcomes": dict(sorted(outcomes.items())),
    }


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 1)


def meets(stats: dict[str, Any], min_ok: float) -> bool:
    return meets_sla(stats["ok_fraction"], stats["p95_ms"], stats["p99_ms"], min_ok=min_ok)


def size_fleet(models: list[SimModel], qps: float, cfg: SimConfig | None = None, seconds: float = 10.0,
               seed: int = 1, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The fewest workers per model meeting the SLA, then the fleet together and under each failure."""
    cfg = cfg or SimConfig()
    total = sum(m.share for m in models)
    fleet: dict[str, int] = {}
    searches: dict[str, list[dict[str, Any]]] = {}
    for m in models:
        rate = qps * m.share / total
        n = max(1, math.ceil(rate / m.capacity_rps()))
        tried: list[dict[str, Any]] = []
        while True:
            stats = Simulation([m], {m.name: n}, rate, cfg, seed).run(seconds)["models"][m.name]
            tried.append({k: stats[k] for k in ("workers", "p95_ms", "p99_ms", "ok_fraction", "busy_fraction")})
            log(f"{m.name}: {n} workers at {rate:.0f}/s: p95 {stats['p95_ms']} p99 {stats['p99_ms']} "
                f"ok {stats['ok_fraction']}")
            if meets(stats, cfg.min_ok) or n >= m.partitions:
                break
            n += 1
        fleet[m.name], searches[m.name] = n, tried
    report: dict[str, Any] = {
        "qps": qps, "sla": {"p95_ms": SLA_P95_MS, "p99_ms": SLA_P99_MS, "min_ok": cfg.min_ok},
        "config": asdict(cfg), "models": [asdict(m) for m in models], "search": searches, "fleet": fleet,
        "total_workers": sum(fleet.values()),
    }
    together = Simulation(models, fleet, qps, cfg, seed).run(seconds)
    report["together"] = together
    report["meets_sla"] = meets(together["fleet"], cfg.min_ok)
    for fail in ("worker", "broker"):
        failed = SimConfig(**{**asdict(cfg), "fail": fail, "fail_at_s": min(3.0, seconds / 3)})
        run = Simulation(models, fleet, qps, failed, seed).run(seconds)
        report[f"{fail}_failure"] = {"fleet": run["fleet"], "during_failure": run["during_failure"]}
        log(f"{fail} failure: during {run['during_failure']}")
    return report


# An illustrative mix on one accelerator type; replace the curves with `kinfer bench model` on yours.
DEFAULT_MIX = [
    SimModel("embed", 0.6, batch_ms={1: 1.8, 8: 2.4, 32: 4.6, 64: 8.0}, max_batch_size=64, partitions=64),
    SimModel("classify", 0.3, batch_ms={1: 1.5, 8: 2.0, 32: 3.8, 64: 6.5}, max_batch_size=64, partitions=64),
    SimModel("generate", 0.1, kind="generate", step_ms=6.0, step_ms_per_seq=0.06, prefill_ms_per_token=0.002,
             prompt_tokens=128, output_tokens=8, max_running=64, partitions=64),
]


def load_models(path: str | None) -> list[SimModel]:
    """Models from a JSON or YAML file (``{"models": [{name, share, ...}, ...]}``), else the default mix."""
    if path is None:
        return list(DEFAULT_MIX)
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not JSON or YAML: {exc}") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a list of models (or {{'models': [...]}})")
    models = []
    for e in entries:
        try:
            if "batch_ms" in e:
                e = {**e, "batch_ms": {int(k): float(v) for k, v in e["batch_ms"].items()}}
            models.append(SimModel(**e))
        except (TypeError, AttributeError, ValueError) as exc:
            name = e.get("name", "?") if isinstance(e, dict) else "?"
            raise ValueError(f"{path}: model {name!r}: {exc}") from None
    return models
