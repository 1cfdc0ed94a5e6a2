"""``kinfer bench chaos``: availability over a long soak while processes die, one fault every 30–60 s.

The fleet looks like production, on this box: three Kafka brokers (replication 3, min in-sync 2) and
three KRaft controllers of their own, Redis, three workers of a simulated accelerator (``noop`` with a
fixed time per batch, so the box's CPU is not what limits them), the lag monitor and the telemetry
stream, each kept alive by a supervisor that restarts what dies (as Kubernetes would), and the client
library with admission on.
Traffic is open-loop Poisson at ``rate`` (about half the fleet's capacity by default), every request
with the same deadline (``deadline_ms``). Once every worker has joined the model's group and a
warm-up has passed (its traffic not counted), a fault from the menu comes every 30–60 s, drawn from
``seed`` (the same seed, the same faults at the same times):

    worker_sigkill      a worker killed; its supervisor restarts it (same instance id)
    worker_sigstop      a worker paused 5–12 s (past its session timeout), then resumed
    broker_sigkill      a broker killed, restarted 3 s later
    broker_slow         a broker paused 2–4 s, then resumed
    redis_sigkill       Redis killed, restarted 2 s later
    redis_slow          Redis paused 1–3 s, then resumed
    lagmon_sigkill      the lag monitor killed; its supervisor restarts it
    telemetry_sigkill   the telemetry stream killed; its supervisor restarts it

Each request ends as: ``ok`` within its deadline (the service level), ``refused`` (admission said
so before sending), ``expired``/``error`` (a worker answered with a refusal or a failure),
``unaccepted`` (the broker did not take it by the deadline) or ``timed_out`` (taken, no answer by the
deadline). A timed-out request that no reply ever reached, by the end of the soak, is ``lost``:
at-least-once was broken. **availability = ok / offered.** A fault touches the requests in flight
when it strikes (sent up to one deadline before it) and those sent after it. Per fault: what it was,
when, how many of the requests it touched failed (sent from one deadline before it until one deadline
before the next; ``failed_in_flight`` of them were sent before it), its ``bound`` (``FAULT_BOUNDS``,
scaled to the rate) and whether it stayed within it, and ``recovery_s``: from the fault to the end of
its last bad second (over 1 % failed) before five seconds without one.
``availability_outside_faults``: the same ratio over the requests sent outside every fault's window
(from one deadline before the fault to 10 s after its recovery). ``projection``: a month at 200
requests/s with one fault of each kind a day, each costing the worst its kind cost here, and the time
between at the availability outside faults. ``warmup``: how the warm-up's requests ended (not
counted in the rest; runs whose warm-ups went differently started from differently settled fleets).

``variants`` runs the same soak (same seed, same faults) with a mechanism switched off, one after the
other on fresh stacks: ``combined`` (no controllers of their own: each broker is a controller voter
too, so a broker fault may take the active controller with it), ``no-hedging`` (the client never
hedges nor avoids a partition), ``no-failover`` (Kafka's default broker failover timings),
``no-static`` (workers join as dynamic members: a restarted worker waits out its old self's session),
``no-answered`` (the lag monitor counts queues from committed offsets alone: a commit stall reads as a
stopped model), ``no-careful`` (a worker taking over the partitions of one killed works their next
records as usual, not each alone: what the poison guard costs a SIGKILL).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from subprocess import Popen
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import log
from kinfer.ops.capacity.sla import percentile_ms
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process, wait_until_served
from kinfer.ops.localstack.stack import LocalStack, StackInfo
from kinfer.producers import Client
from kinfer.producers.hedging import HedgePolicy
from kinfer.topics import DeadlineExceeded, KinferError, Overloaded
from kinfer.topics.admin import ensure_topics, group_members, model_topic_specs, offset_clients, shared_topic_specs
from kinfer.topics.names import consumer_group

FAULTS = ("worker_sigkill", "worker_sigstop", "broker_sigkill", "broker_slow", "redis_sigkill", "redis_slow",
          "lagmon_sigkill", "telemetry_sigkill")
VARIANTS = ("all", "combined", "no-hedging", "no-failover", "no-static", "no-answered", "no-careful")
MODEL = "chaos"
KINDS = ("ok", "refused", "expired", "error", "unaccepted", "timed_out")  # how a request can end


@dataclass(frozen=True)
class ChaosConfig:
    minutes: float = 20.0
    rate: float = 200.0  # requests/s, open loop (Poisson): about 40 % of the fleet's capacity
    deadline_ms: int = 1_000  # each request's deadline: answered ok within it is the service level
    workers: int = 3
    partitions: int = 6  # per priority topic
    compute_ms: float = 25.0  # one batch on the simulated accelerator
    max_batch: int = 4  # so a worker serves max_batch / compute_ms: 160/s, the fleet 480/s
    every_s: tuple[float, float] = (30.0, 60.0)  # between two faults
    warmup_s: float = 20.0  # traffic before the soak, once every worker joined, not counted: estimates settle
    first_fault_s: float = 10.0  # into the soak
    drain_s: float = 15.0  # after the traffic, time for late replies (lost = none ever came)
    seed: int = 1
    faults: tuple[str, ...] = FAULTS
    hedging: bool = True
    failover: bool = True
    controllers: int = 3  # KRaft controllers of their own (0: the brokers hold the quorum too)
    static: bool = True
    answered: bool = True  # the lag monitor reads the workers' answered reports, not committed offsets alone
    careful: bool = True  # the poison guard: after an owner's SIGKILL, its partitions' next records alone

    def variant(self, name: str) -> ChaosConfig:
        if name == "all":
            return self
        if name == "no-hedging":
            return replace(self, hedging=False)
        if name == "combined":
            return replace(self, controllers=0)
        if name == "no-failover":
            return replace(self, failover=False)
        if name == "no-static":
            return replace(self, static=False)
        if name == "no-answered":
            return replace(self, answered=False)
        if name == "no-careful":
            return replace(self, careful=False)
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")


def schedule(config: ChaosConfig) -> list[tuple[float, str]]:
    """(seconds from the start of traffic, fault) for the whole soak: every kind in turn, in an order and
    at times drawn from the seed."""
    rng = random.Random(config.seed)
    kinds = list(config.faults)
    rng.shuffle(kinds)
    out: list[tuple[float, str]] = []
    at = config.first_fault_s
    end = config.minutes * 60.0
    i = 0
    while kinds and at < end - 10.0:
        out.append((round(at, 1), kinds[i % len(kinds)]))
        i += 1
        at += rng.uniform(*config.every_s)
    return out


@dataclass
class _Call:
    rid: str
    sent: float  # seconds into the soak
    t0: float  # when it was sent, on the monotonic clock
    done: float = math.nan
    kind: str = "timed_out"
    why: str = ""  # refused: admission's cause; error: the error's type
    wrong: bool = False

    @property
    def outcome(self) -> str:
        """How it ended, with the cause where there is one ("refused:deadline", "expired")."""
        return f"{self.kind}:{self.why}" if self.why else self.kind


@dataclass
class _Proc:
    name: str
    start: Callable[[], Popen[bytes]]
    proc: Popen[bytes] | None = None
    restarts: int = 0
    paused: bool = False


class Supervisor:
    """Keeps processes running: one that exits is started again a second later (a kubelet's restart)."""

    def __init__(self) -> None:
        self.procs: dict[str, _Proc] = {}
        self._stopping = False

    def add(self, name: str, start: Callable[[], Popen[bytes]]) -> None:
        self.procs[name] = _Proc(name, start, start())

    async def watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.5)
            for p in self.procs.values():
                if p.proc is not None and p.proc.poll() is not None and not self._stopping:
                    await asyncio.sleep(1.0)
                    p.proc = p.start()
                    p.restarts += 1

    def pid(self, name: str) -> int:
        proc = self.procs[name].proc
        assert proc is not None
        return proc.pid

    def stop(self) -> None:
        self._stopping = True
        for p in self.procs.values():
            if p.proc is not None:
                if p.proc.poll() is None:
                    os.kill(p.proc.pid, signal.SIGCONT)  # a paused one must be able to stop
                stop_process(p.proc)


class _Fleet:
    def __init__(self, config: ChaosConfig, local: LocalStack, info: StackInfo, logs: Path) -> None:
        self.config = config
        self.local = local
        self.info = info
        self.logs = logs
        self.supervisor = Supervisor()
        self.rng = random.Random(config.seed + 1)

    def start(self) -> None:
        c = self.config
        args = ["--family", "noop", "--option", f"compute_ms={c.compute_ms}", "--max-batch-size", str(c.max_batch),
                *([] if c.careful else ["--careful-records", "0"])]
        for i in range(c.workers):
            extra = [*args, *(["--instance-id", f"chaos-{i}"] if c.static else [])]
            self.supervisor.add(f"worker-{i}", lambda extra=extra, i=i: spawn_worker(  # type: ignore[misc]
                self.info, MODEL, *extra, log_path=str(self.logs / f"worker-{i}.log")))
        blind = [] if c.answered else ["--no-answered"]
        self.supervisor.add("lagmon", lambda: spawn(self.info, "lagmon", "--model", MODEL, *blind,
                                                    log_path=str(self.logs / "lagmon.log")))
        self.supervisor.add("telemetry", lambda: spawn(self.info, "telemetry",
                                                       log_path=str(self.logs / "telemetry.log")))

    async def inject(self, kind: str) -> str:
        """Do ``kind``; returns its target. Returns once the fault is over (a pause resumed, a stack part restarted)."""
        info = self.local.load() or self.info
        if kind in ("worker_sigkill", "worker_sigstop"):
            name = f"worker-{self.rng.randrange(self.config.workers)}"
            pid = self.supervisor.pid(name)
            if kind == "worker_sigkill":
                os.kill(pid, signal.SIGKILL)
            else:
                await _pause(pid, self.rng.uniform(5.0, 12.0))
            return name
        if kind in ("lagmon_sigkill", "telemetry_sigkill"):
            name = kind.split("_")[0]
            os.kill(self.supervisor.pid(name), signal.SIGKILL)
            return name
        if kind in ("broker_sigkill", "broker_slow"):
            broker = info.brokers[self.rng.randrange(len(info.brokers))]
            if kind == "broker_sigkill":
                os.kill(broker.pid, signal.SIGKILL)
                await asyncio.sleep(3.0)
                await asyncio.to_thread(self.local.up)
            else:
                await _pause(broker.pid, self.rng.uniform(2.0, 4.0))
            return f"broker-{broker.node_id}"
        if kind == "redis_sigkill":
            os.kill(info.redis_pid, signal.SIGKILL)
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.local.up)
            return "redis"
        if kind == "redis_slow":
            await _pause(info.redis_pid, self.rng.uniform(1.0, 3.0))
            return "redis"
        raise ValueError(f"unknown fault {kind!r}")


async def _pause(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def _soak(config: ChaosConfig, fleet: _Fleet) -> dict[str, Any]:
    info = fleet.info
    await ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(MODEL, config.partitions)])
    fleet.start()
    watcher = asyncio.create_task(fleet.supervisor.watch())
    policy = HedgePolicy() if config.hedging else HedgePolicy(enabled=False)
    try:
        async with Client(info.bootstrap, info.redis_url, tenant="chaos", hedging=policy) as client:
            await wait_until_served(client, MODEL)
            await _all_joined(info.bootstrap, config.workers)
            return await _drive(config, fleet, client)
    finally:
        fleet.supervisor.stop()
        watcher.cancel()


async def _all_joined(bootstrap: str, workers: int, timeout_s: float = 120.0) -> None:
    """Until every worker is a member of the model's group. The fleet's own start is not one of the faults:
    each worker that joins is an eager rebalance that stops every partition for a moment, and a third
    worker joining 20 s into the warm-up once had the level REJECTING in the soak's first two seconds
    (389 refused). The warm-up that follows lets the last rebalance finish and the estimates settle."""
    group, give_up = consumer_group(MODEL), time.monotonic() + timeout_s
    async with offset_clients(bootstrap) as (admin, _):
        while (await group_members(admin, [group]))[group] < workers:
            if time.monotonic() > give_up:
                raise TimeoutError(f"fewer than {workers} workers joined {group} in {timeout_s:g} s")
            await asyncio.sleep(0.5)


async def _drive(config: ChaosConfig, fleet: _Fleet, client: Client) -> dict[str, Any]:
    rng = random.Random(config.seed + 2)
    plan = schedule(config)
    calls: list[_Call] = []
    faults: list[dict[str, Any]] = []
    pending: set[asyncio.Task[None]] = set()

    async def one(call: _Call) -> None:
        try:
            result = await client.infer(MODEL, [call.rid], deadline_ms=config.deadline_ms,
                                        request_id=None if call.rid == "warmup" else call.rid)
            call.kind, call.wrong = "ok", result.id != call.rid and call.rid != "warmup"
        except DeadlineExceeded as exc:
            call.kind = "expired" if exc.answered else "timed_out" if exc.accepted else "unaccepted"
        except Overloaded as exc:  # ColdStart too: admission refused it before sending
            call.kind, call.why = "refused", exc.cause or ""
        except KinferError as exc:
            call.kind, call.why = "error", type(exc).__name__
        call.done = time.monotonic()

    async def fault(at: float, kind: str) -> None:
        entry: dict[str, Any] = {"kind": kind, "at_s": at}
        faults.append(entry)
        log(f"  {at:7.1f} s  {kind}")
        entry["target"] = await fleet.inject(kind)

    warm = time.monotonic() + config.warmup_s
    next_at = time.monotonic()
    warmup: list[_Call] = []
    while (now := time.monotonic()) < warm:  # the same traffic, not counted
        await asyncio.sleep(max(0.0, next_at - now))
        warmup.append(_Call("warmup", 0.0, now))
        task = asyncio.create_task(one(warmup[-1]))
        pending.add(task)
        task.add_done_callback(pending.discard)
        next_at += rng.expovariate(config.rate)
    start = next_at = time.monotonic()
    end = start + config.minutes * 60.0
    i = 0
    injecting: list[asyncio.Task[None]] = []
    while (now := time.monotonic()) < end:
        while plan and start + plan[0][0] <= now:
            at, kind = plan.pop(0)
            injecting.append(asyncio.create_task(fault(at, kind)))
        if next_at > now:
            await asyncio.sleep(next_at - now)
        t0 = time.monotonic()
        call = _Call(f"chaos-{config.seed}-{i}", t0 - start, t0)
        i += 1
        calls.append(call)
        task = asyncio.create_task(one(call))
        pending.add(task)
        task.add_done_callback(pending.discard)
        next_at += rng.expovariate(config.rate)
    await asyncio.gather(*injecting)
    await asyncio.gather(*pending)
    await asyncio.sleep(config.drain_s)  # replies that come late still say the request was not lost
    late = client.late_reply_ids
    report = _report(config, calls, faults, late, client.hedges, fleet)
    # How the warm-up's requests ended: a soak whose warm-up was refused or failed in part started from a
    # fleet (estimates, the hedge window, the bucket) less settled than the others'.
    report["warmup"] = dict(Counter(c.outcome for c in warmup).most_common())
    report["replies"] = {"late": client.late_replies, "duplicates_dropped": client.duplicate_replies,
                         "unknown": client.unknown_replies, "forged": client.forged_replies,
                         "received": client.replies_received}
    return report


def timeline_of(calls: Iterable[tuple[float, str]], seconds: int) -> dict[str, Any]:
    """Per second of the soak, by when each request was sent ((seconds in, outcome) each): how many were
    offered and how many failed, and the failures by outcome (sparse: outcome -> second -> count), which
    tell a fault's first burst (what it held when it struck) from what it cost later."""
    offered, failed = [0] * seconds, [0] * seconds
    how: dict[str, Counter[int]] = {}
    for sent, outcome in calls:
        s = min(seconds - 1, int(sent))
        offered[s] += 1
        if outcome != "ok":
            failed[s] += 1
            how.setdefault(outcome, Counter())[s] += 1
    return {"offered": offered, "failed": failed,
            "failed_by_outcome": {o: {str(s): n for s, n in sorted(by.items())} for o, by in sorted(how.items())}}


def _report(config: ChaosConfig, calls: list[_Call], faults: list[dict[str, Any]], late: set[str],
            hedges: dict[str, float], fleet: _Fleet) -> dict[str, Any]:
    offered = len(calls)
    ok = [c for c in calls if c.kind == "ok"]
    latencies = [(c.done - c.t0) * 1000.0 for c in ok]
    counts = {k: sum(c.kind == k for c in calls) for k in KINDS}
    lost = [c.rid for c in calls if c.kind == "timed_out" and c.rid not in late]
    before_s = config.deadline_ms / 1000.0  # a request sent this long before a fault is still in flight at it
    charge(faults, [(c.sent, c.outcome) for c in calls if c.kind != "ok"], before_s)
    seconds = int(config.minutes * 60.0) + 1
    timeline = timeline_of(((c.sent, c.outcome) for c in calls), seconds)
    for i, f in enumerate(faults):
        until = faults[i + 1]["at_s"] if i + 1 < len(faults) else seconds
        f["recovery_s"] = recovery_s(timeline["failed"], timeline["offered"], f["at_s"], until)
        f["bound"] = fault_bound(f["kind"], config.rate)
        f["within_bound"] = f["failed"] <= f["bound"]
    between, outside = availability_outside(((c.sent, c.kind == "ok") for c in calls), faults, before_s)
    windows = fault_windows(faults, before_s)
    failed_outside = Counter(c.outcome for c in calls if c.kind != "ok" and not in_window(c.sent, windows))
    return {
        "kind": "chaos",
        "availability": round(counts["ok"] / offered, 6) if offered else None,
        "availability_outside_faults": round(between, 6) if between is not None else None,
        "offered_outside_faults": outside,
        "failed_outside_faults": dict(failed_outside.most_common()),
        "projection": projection(faults, between, config.rate),
        "offered": offered,
        **counts,
        "why": dict(Counter(c.outcome for c in calls if c.why).most_common()),
        "lost": len(lost),
        "lost_ids": lost[:20],
        "duplicates_delivered": sum(c.wrong for c in calls),
        "p50_ms": percentile_ms(latencies, 50),
        "p95_ms": percentile_ms(latencies, 95),
        "p99_ms": percentile_ms(latencies, 99),
        "hedged_fraction": round(hedges["fraction"], 5),
        "hedges": {k: int(v) for k, v in hedges.items() if k != "fraction"},
        "faults": faults,
        "restarts": {name: p.restarts for name, p in fleet.supervisor.procs.items()},
        "timeline": timeline,
        "config": {"minutes": config.minutes, "rate": config.rate, "deadline_ms": config.deadline_ms,
                   "workers": config.workers, "partitions": config.partitions, "compute_ms": config.compute_ms,
                   "max_batch": config.max_batch, "seed": config.seed, "hedging": config.hedging,
                   "failover": config.failover, "controllers": config.controllers, "static": config.static,
                   "answered": config.answered},
    }


QUIET_S = 5  # seconds without a failed request that end a fault's effect
WINDOW_AFTER_S = 10.0  # a fault's window: from the fault to this long after its recovery
# What one fault may cost, in failed requests at 200 requests/s (scaled to the soak's rate): a worker's
# death or pause a quarter of a second of traffic; a broker's, whose writes wait for an election or
# for the in-sync set to drop the follower, 1.5 s.
FAULT_BOUNDS = {"worker_sigkill": 50, "worker_sigstop": 50, "redis_sigkill": 100, "redis_slow": 100,
                "lagmon_sigkill": 10, "telemetry_sigkill": 10, "broker_sigkill": 300, "broker_slow": 300}
BOUND_RATE = 200.0
DAY_S = 86_400.0
MONTH_S = 30 * DAY_S


def charge(faults: list[dict[str, Any]], failures: list[tuple[float, str]], before_s: float) -> None:
    """Each fault's cost, set on it: the ``failures`` (seconds into the soak when sent, how it ended) among
    the requests it touched, from ``before_s`` (a deadline: in flight when it struck) before it until as
    long before the next fault; ``failed_in_flight`` of them were sent before it."""
    for i, f in enumerate(faults):
        until = faults[i + 1]["at_s"] - before_s if i + 1 < len(faults) else math.inf
        failed = [(sent, kind) for sent, kind in failures if f["at_s"] - before_s <= sent < until]
        f["failed"] = len(failed)
        f["failed_in_flight"] = sum(sent < f["at_s"] for sent, _ in failed)
        f["by_kind"] = dict(Counter(kind for _, kind in failed).most_common())


def fault_bound(kind: str, rate: float) -> int:
    """The most requests a fault of ``kind`` may fail at ``rate`` requests/s."""
    return math.floor(FAULT_BOUNDS[kind] * rate / BOUND_RATE)


def fault_windows(faults: list[dict[str, Any]], before_s: float) -> list[tuple[float, float]]:
    """Each fault's window, in seconds into the soak: from ``before_s`` before the fault (a request's
    deadline: what was in flight when it struck) to ``WINDOW_AFTER_S`` after its recovery."""
    return [(f["at_s"] - before_s, f["at_s"] + f["recovery_s"] + WINDOW_AFTER_S) for f in faults]


def in_window(sent: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= sent < b for a, b in windows)


def availability_outside(calls: Iterable[tuple[float, bool]], faults: list[dict[str, Any]],
                         before_s: float) -> tuple[float | None, int]:
    """Of the requests (seconds into the soak when sent, answered ok) sent outside every fault's window
    (from ``before_s`` before the fault to ``WINDOW_AFTER_S`` after its recovery): the fraction answered
    ok, and how many."""
    windows = fault_windows(faults, before_s)
    ok = offered = 0
    for sent, answered in calls:
        if not in_window(sent, windows):
            offered += 1
            ok += answered
    return (ok / offered if offered else None), offered


def projection(faults: list[dict[str, Any]], between: float | None, rate: float,
               per_day: float = 1.0, at_rate: float = BOUND_RATE) -> dict[str, Any] | None:
    """A month of traffic at ``at_rate`` with ``per_day`` faults of each kind the soak measured: each
    costs the worst its kind cost in the soak (scaled from the soak's ``rate``), and the seconds between
    faults serve at the soak's availability outside fault windows (``between``). None without traffic
    outside the faults to measure that by."""
    if between is None or rate <= 0:
        return None
    worst: dict[str, float] = {}
    for f in faults:
        worst[f["kind"]] = max(worst.get(f["kind"], 0.0), f["failed"] * at_rate / rate)
    offered = at_rate * MONTH_S
    from_faults = sum(cost * per_day * MONTH_S / DAY_S for cost in worst.values())
    failed = from_faults + (1.0 - between) * offered
    return {"per_day_each": per_day, "rate": at_rate, "cost_per_fault": {k: round(v, 1) for k, v in worst.items()},
            "failed_per_month": round(failed), "availability_month": round(1.0 - failed / offered, 6)}


def recovery_s(failed: list[int], offered: list[int], at_s: float, until_s: float, quiet_s: int = QUIET_S) -> int:
    """Seconds from a fault to the end of its last bad second (over 1 % of that second's requests failed,
    and more than one) before the first ``quiet_s`` seconds without one, counted from its first bad
    second (a fault may take a while to bite: a paused worker's partitions move after the session
    timeout); per-second counts ``failed`` of ``offered``, the fault's window ends at ``until_s``."""
    start, end = int(at_s), min(len(failed), int(until_s))
    last, quiet = None, 0
    for second in range(start, end):
        if failed[second] > max(1.0, 0.01 * offered[second]):
            last, quiet = second + 1, 0
        elif last is not None:
            quiet += 1
            if quiet >= quiet_s:
                break
    return 0 if last is None else last - start


def bench_chaos(config: ChaosConfig, variants: tuple[str, ...] = ("all",), keep: str | None = None,
                stack: LocalStack | None = None) -> dict[str, Any]:
    """One soak per variant, each on a fresh three-broker stack; one variant: its report alone. ``keep``: a
    folder where each variant's stack and process logs stay (default: a temporary one, removed).
    ``stack``: a running stack to soak instead (one variant, whose failover setting and controllers the stack
    has); it is left running, its broker and Redis faults restarted as they would be on a fresh one."""
    if stack is not None and (len(variants) != 1 or (stack.failover, stack.controllers) != (
            (c := config.variant(variants[0])).failover, c.controllers)):
        raise ValueError("a given stack runs one variant, with the stack's own failover setting and controllers")
    reports: dict[str, Any] = {}
    for name in variants:
        c = config.variant(name)
        log(f"chaos {name}: {c.minutes:g} min at {c.rate:g}/s, deadline {c.deadline_ms} ms, seed {c.seed}")
        with tempfile.TemporaryDirectory(prefix="kinfer-chaos-") as tmp:
            home = Path(keep) / name if keep is not None else Path(tmp)
            local = stack or LocalStack(home / "stack", brokers=3, failover=c.failover, controllers=c.controllers)
            info, _ = local.up(timeout_s=180)
            logs = home / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            try:
                fleet = _Fleet(c, local, info, logs)
                reports[name] = asyncio.run(_soak(c, fleet))
            finally:
                if stack is None:
                    local.down()
        r = reports[name]
        month = (r["projection"] or {}).get("availability_month")
        log(f"  availability {r['availability']} ({r['availability_outside_faults']} outside faults, {month} "
            f"projected for a month), lost {r['lost']}, p99 {r['p99_ms']} ms, hedged {r['hedged_fraction']}")
    if len(variants) == 1:
        only: dict[str, Any] = reports[variants[0]]
        return only
    return {"kind": "chaos-variants", "variants": reports}


# -- the picture ----------------------------------------------------------------------------------------


def plot_chaos(report: dict[str, Any], path: str) -> str:
    """Requests per second and those that missed the service level, with the faults marked."""
    plt = draw.pyplot()
    runs = report["variants"] if report.get("kind") == "chaos-variants" else {"all": report}
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items(), strict=True):
        offered, failed = run["timeline"]["offered"], run["timeline"]["failed"]
        xs = list(range(len(offered)))
        ax.plot(xs, offered, color="#1f77b4", lw=0.8, label="offered /s")
        ax.bar(xs, failed, width=1.0, color="#d62728", label="not ok within the deadline /s")
        top = max([*offered, 1])
        for f in run["faults"]:
            ax.axvline(f["at_s"], color="grey", lw=0.6, ls="--")
            ax.annotate(f["kind"].replace("_", " "), (f["at_s"], top), rotation=90, fontsize=6, va="top",
                        ha="right", color="grey")
        ax.set_ylabel("requests/s")
        ax.set_title(f"{name}: availability {run['availability']:.4%}, lost {run['lost']}, "
                     f"p95 {run['p95_ms']} ms, p99 {run['p99_ms']} ms, hedged {run['hedged_fraction']:.2%}",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("seconds into the soak")
    first = next(iter(runs.values()))["config"]
    draw.title(fig, f"kinfer bench chaos: {first['workers']} workers (simulated accelerator), 3 brokers, "
                    f"{first['rate']:g} requests/s, deadline {first['deadline_ms']} ms")
    return draw.save(fig, path)


__all__ = ["FAULTS", "VARIANTS", "ChaosConfig", "bench_chaos", "plot_chaos", "schedule"]
