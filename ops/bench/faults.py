"""``kinfer bench faults``: faults injected under a steady load, and what each one cost, counted.

Every scenario runs on a stack this benchmark starts for itself (its own folder, free ports: it
kills brokers and Redis, so never a stack someone else uses), on a model of its own (fresh topics
and consumer group), with ``noop`` workers and an open-loop load through the client library (a
request every ``1/rate`` s, deadline ``deadline_ms``). Each request ends in one of:

- ``ok``: answered with its result;
- ``error``: the caller was told why (a typed error: refused, shed, expired, invalid, unavailable);
- ``unaccepted``: the broker did not take the request by its deadline (the call says so at the
  deadline: ``DeadlineExceeded(accepted=False)``);
- ``lost``: accepted by the broker, and no answer by its deadline from any worker.

The default deadline (30 s) is longer than any scenario's recovery, so an accepted request that
goes unanswered is a loss, not a late answer.

``lost_ids`` names the lost requests (the first 100). ``cycles`` repeats a scenario's fault within one
run where the scenario says it can (one clean cycle proves little), and the load goes on as long as the
fault does; a scenario may bring its own load
(``Shape``: the one a report reproduced), which values given to ``bench_faults`` replace.

``duplicates_delivered`` counts calls that got an answer that was not theirs or a second one
(the client drops repeats: ``duplicates_dropped``); ``recovery_s`` is how long the fault's effect
lasted: from the fault to the completion of the last request that took more than a second;
``worker_exits`` counts workers that died without being killed by the scenario; ``processes_died``
adds the other kinfer processes a scenario ran (the ``hostile`` one runs a lag monitor, a telemetry
stream and a gateway beside the workers, and sends them everything ``ops.hostile`` knows).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

import msgpack
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from redis.exceptions import RedisError

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench import hostile
from kinfer.ops.bench.harness import local_stack, log
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process, wait_until_served
from kinfer.ops.localstack.stack import LocalStack, StackInfo, free_port
from kinfer.producers import Client
from kinfer.topics import DeadlineExceeded, KinferError, Priority, ReplyRoute, Request, now_ms, pack
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs
from kinfer.topics.names import DEFAULT_REPLY_TOPIC, request_topic
from kinfer.topics.readers import close_pubsub

SLOW_S = 1.0  # a request slower than this was disturbed by the fault


@dataclass
class _Call:
    rid: str
    sent: float
    done: float = 0.0
    kind: str = "lost"
    error: str = ""
    wrong: bool = False  # the answer was not this call's


@dataclass
class _Run:
    """What a fault may touch: the stack, the workers, the client, the model."""

    local: LocalStack
    info: StackInfo
    model: str
    client: Client
    log_dir: Path
    worker_args: tuple[str, ...]
    workers: list[Popen[bytes]] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)
    others: list[Popen[bytes]] = field(default_factory=list)  # other kinfer processes a fault started
    notes: dict[str, Any] = field(default_factory=dict)  # what a fault reports beside the counts
    cycles: int = 1  # times a repeatable fault is applied
    beside: list[asyncio.Task[None]] = field(default_factory=list)  # run by a fault until the load is over

    def spawn(self) -> Popen[bytes]:
        proc = spawn_worker(self.info, self.model, *self.worker_args,
                            log_path=str(self.log_dir / f"{self.model}-{len(self.workers)}.log"))
        self.workers.append(proc)
        return proc

    def kill(self, proc: Popen[bytes]) -> None:
        self.killed.add(proc.pid)
        proc.kill()
        proc.wait()

    async def restart_stack(self) -> None:
        await asyncio.to_thread(self.local.up)


Fault = Callable[[_Run], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Shape:
    """A scenario's own load: requests/s, seconds before and from the fault, deadline, partitions of each
    priority topic, and the lone worker's membership (``static`` or ``dynamic``)."""

    rate: float = 40.0
    before_s: float = 3.0
    after_s: float = 15.0
    deadline_ms: int = 30_000
    partitions: int = 4
    membership: str = "default"


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: Fault
    workers: int = 2
    brokers: int = 1
    worker_args: tuple[str, ...] = ()
    shape: Shape = Shape()


# -- the faults ---------------------------------------------------------------------------------


async def _kill_one_of_two(run: _Run) -> None:
    run.kill(run.workers[0])


async def _kill_only_and_restart(run: _Run) -> None:
    run.kill(run.workers[0])
    await asyncio.sleep(1.0)
    run.spawn()  # the same --instance-id: it takes the partitions back without waiting for the session timeout


async def _stop_past_session_timeout(run: _Run) -> None:
    worker = run.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    await asyncio.sleep(8.0)  # past the 6 s session timeout: the group moves its partitions
    os.kill(worker.pid, signal.SIGCONT)


async def _stop_across_redis_restart(run: _Run) -> None:
    """The shape that lost accepted requests: the only worker (dynamic member, 6 s session) is paused 1 s
    before Redis is SIGKILLed, Redis stays down 6 s and comes back on its port, and the worker resumes
    0.1 s after, with a backlog whose replies it publishes at once, while the client is still waiting
    out its back-off before it subscribes again. A second reader of the client's channel (a monitor)
    subscribes again within 0.2 s of Redis returning, so the worker's PUBLISH is heard and not sent to
    the fallback topic. Each cycle ends 4 s after the worker resumed."""
    witness = asyncio.create_task(_second_reader(run.info.redis_url, run.client.reply_channel))
    run.beside.append(witness)
    worker = run.workers[0]
    for cycle in range(run.cycles):
        if cycle:
            await asyncio.sleep(4.0)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
            os.kill(run.info.redis_pid, signal.SIGKILL)
            await asyncio.sleep(6.0)
            await run.restart_stack()  # Redis again, on its port
            run.info = run.local.load() or run.info  # its new pid
            await asyncio.sleep(0.1)
        finally:
            os.kill(worker.pid, signal.SIGCONT)


async def _second_reader(url: str, channel: str) -> None:
    """Subscribed to ``channel`` whenever Redis is up (again 0.2 s after losing it), reading and dropping."""
    while True:
        redis = aioredis.Redis.from_url(url, socket_connect_timeout=1.0)
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            while True:
                await pubsub.get_message(timeout=1.0)
        except (RedisError, OSError):
            await asyncio.sleep(0.2)
        finally:
            await close_pubsub(pubsub)
            with contextlib.suppress(RedisError, OSError):
                await redis.aclose()


async def _kill_broker_and_restart(run: _Run) -> None:
    os.kill(run.info.brokers[0].pid, signal.SIGKILL)
    await asyncio.sleep(2.0)
    await run.restart_stack()  # the same port: every client reconnects


async def _kill_one_broker_of_three(run: _Run) -> None:
    os.kill(run.info.brokers[1].pid, signal.SIGKILL)
    await asyncio.sleep(3.0)
    await run.restart_stack()


async def _kill_redis_and_restart(run: _Run) -> None:
    os.kill(run.info.redis_pid, signal.SIGKILL)
    await asyncio.sleep(2.0)
    await run.restart_stack()


async def _poison_records(run: _Run) -> None:
    """Records at the size limit: raw garbage, and a valid-looking request that is huge once decompressed."""
    producer = AIOKafkaProducer(bootstrap_servers=run.info.bootstrap, max_request_size=4 * 1_048_576)
    compressed = AIOKafkaProducer(bootstrap_servers=run.info.bootstrap, compression_type="gzip",
                                  max_request_size=8 * 1_048_576)
    await producer.start()
    await compressed.start()
    try:
        topic = request_topic(run.model, Priority.P1)
        await producer.send_and_wait(topic, os.urandom(999_000))
        huge = msgpack.packb({"v": 1, "t": "req", "id": "huge", "model": run.model, "priority": 1,
                              "tenant": "faults", "created_ms": now_ms(), "deadline_ms": now_ms() + 60_000,
                              "inputs": ["x" * 16_384] * 256, "reply": {"kafka": DEFAULT_REPLY_TOPIC}})
        await compressed.send_and_wait(topic, huge)  # ~4.2 MB decompressed, a few KB on the wire
    finally:
        await producer.stop()
        await compressed.stop()


async def _missing_reply_topic(run: _Run) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=run.info.bootstrap)
    await producer.start()
    try:
        for i in range(20):
            request = Request(id=f"nowhere-{i}", model=run.model, priority=Priority.P1, tenant="faults",
                              created_ms=now_ms(), deadline_ms=now_ms() + 3_600_000, inputs=("x",),
                              reply=ReplyRoute(kafka=f"replies.nowhere-{uuid.uuid4().hex[:6]}"))
            await producer.send_and_wait(request_topic(run.model, Priority.P1), pack(request))
    finally:
        await producer.stop()


async def _malformed_replies(run: _Run) -> None:
    bad = msgpack.packb({"v": 1, "t": "res", "id": "x", "model": run.model, "status": "ok", "timings": [1]})
    async with aioredis.Redis.from_url(run.info.redis_url) as r:
        channel = run.client.reply_channel
        await r.publish(channel, bad)
        await r.publish(channel, b"\xc1 not msgpack")
    producer = AIOKafkaProducer(bootstrap_servers=run.info.bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(DEFAULT_REPLY_TOPIC, bad)
    finally:
        await producer.stop()


async def _hostile_tenant(run: _Run) -> None:
    """Everything ``ops.hostile`` sends — at the workers, and at a lag monitor, a telemetry stream and a
    gateway started beside them — while the valid load goes on around it."""
    port = free_port()
    side = str(run.log_dir / f"{run.model}-side.log")
    run.others += [spawn(run.info, "lagmon", "--model", run.model, log_path=side),
                   spawn(run.info, "telemetry", log_path=side),
                   spawn(run.info, "gateway", "--port", str(port), log_path=side)]
    await asyncio.sleep(5.0)  # they start while the load runs
    target = hostile.Target(run.info.bootstrap, run.info.redis_url, run.model, tenant="faults",
                            reply_channel=run.client.reply_channel, gateway=("127.0.0.1", port))
    sent = hostile.Sent()
    await hostile.attack_kafka(target, sent)
    await hostile.attack_redis(target, sent)
    statuses = await hostile.attack_gateway(target, sent)
    run.notes["hostile_sent"] = sent.total
    run.notes["hostile_refused_by_transport"] = len(sent.refused)
    run.notes["http_5xx_or_broken"] = sorted(k for k, v in statuses.items() if v >= 500 or v == 0)


SCENARIOS = (
    Scenario("worker_sigkill_one_of_two", _kill_one_of_two),
    Scenario("worker_sigkill_only_and_restart", _kill_only_and_restart, workers=1),
    Scenario("worker_sigstop_past_session_timeout", _stop_past_session_timeout),
    Scenario("worker_sigstop_across_redis_restart", _stop_across_redis_restart, workers=1,
             shape=Shape(rate=50.0, before_s=9.0, after_s=31.0, deadline_ms=10_000, partitions=6,
                         membership="dynamic")),
    Scenario("broker_sigkill_and_restart", _kill_broker_and_restart),
    Scenario("redis_sigkill_and_restart", _kill_redis_and_restart),
    Scenario("one_broker_of_three_sigkilled", _kill_one_broker_of_three, brokers=3),
    Scenario("records_at_the_size_limit", _poison_records),
    Scenario("missing_reply_topics", _missing_reply_topic),
    Scenario("malformed_replies", _malformed_replies),
    Scenario("hostile", _hostile_tenant),
)


# -- running one ------------------------------------------------------------------------------


async def _scenario(scenario: Scenario, local: LocalStack, info: StackInfo, log_dir: Path, shape: Shape,
                    cycles: int = 1) -> dict[str, Any]:
    rate, before_s, after_s, deadline_ms, partitions = (shape.rate, shape.before_s, shape.after_s,
                                                        shape.deadline_ms, shape.partitions)
    static = None if shape.membership == "default" else shape.membership == "static"
    model = f"faults-{uuid.uuid4().hex[:6]}"
    await ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(model, partitions)])
    async with Client(info.bootstrap, info.redis_url, tenant="faults", admission=False) as client:
        if static is None:  # a lone worker is a static member (it takes its partitions back on a restart)
            static = scenario.workers == 1
        instance = f"faults-{uuid.uuid4().hex[:6]}" if static and scenario.workers == 1 else None
        args = ("--family", "noop", *(("--instance-id", instance) if instance else ()), *scenario.worker_args)
        run = _Run(local, info, model, client, log_dir, args, cycles=cycles)
        for _ in range(scenario.workers):
            run.spawn()
        await wait_until_served(client, model)
        calls: list[_Call] = []
        answers: dict[str, int] = {}

        async def one(call: _Call) -> None:
            try:
                result = await client.infer(model, [call.rid], deadline_ms=deadline_ms, request_id=call.rid)
                call.kind = "ok"
                call.wrong = result.id != call.rid
                answers[result.id] = answers.get(result.id, 0) + 1
            except DeadlineExceeded as exc:
                if exc.answered:
                    call.kind, call.error = "error", "DeadlineExceeded"
                else:
                    call.kind = "lost" if exc.accepted else "unaccepted"
            except KinferError as exc:
                call.kind, call.error = "error", type(exc).__name__
            call.done = time.monotonic()

        started = time.monotonic()
        fault_at = started + before_s
        tasks = []
        fault_task = None
        # The load goes on for ``after_s`` from the fault, and as long as the fault goes on (several cycles).
        planned = int(rate * (before_s + after_s))
        i = 0
        while i < planned or (fault_task is not None and not fault_task.done()):
            at = started + i / rate
            i += 1
            if fault_task is None and at >= fault_at:
                fault_task = asyncio.create_task(scenario.fault(run))
                fault_at = time.monotonic()
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            call = _Call(f"{model}-{i - 1}", time.monotonic())
            calls.append(call)
            tasks.append(asyncio.create_task(one(call)))
        if fault_task is not None:
            await fault_task
        await asyncio.gather(*tasks)
        for task in run.beside:
            task.cancel()
        await asyncio.gather(*run.beside, return_exceptions=True)
        slow_done = [c.done for c in calls if c.done - c.sent > SLOW_S and c.done >= fault_at]
        exits = sum(1 for w in run.workers if w.poll() is not None and w.pid not in run.killed)
        died = exits + sum(1 for p in run.others if p.poll() is not None)
        report = {
            "offered": len(calls),
            "ok": sum(c.kind == "ok" for c in calls),
            "error": sum(c.kind == "error" for c in calls),
            "unaccepted": sum(c.kind == "unaccepted" for c in calls),
            "lost": sum(c.kind == "lost" for c in calls),
            "lost_ids": [c.rid for c in calls if c.kind == "lost"][:100],
            "duplicates_delivered": sum(c.wrong for c in calls) + sum(n - 1 for n in answers.values() if n > 1),
            "duplicates_dropped": client.duplicate_replies,
            "recovery_s": round(max(slow_done) - fault_at, 2) if slow_done else 0.0,
            "worker_exits": exits,
            "processes_died": died,  # every kinfer process it ran that ended on its own
            "errors": dict(Counter(c.error for c in calls if c.kind == "error")),
            **run.notes,
        }
        for proc in (*run.workers, *run.others):
            stop_process(proc)
        return report


def bench_faults(rate: float | None = None, before_s: float | None = None, after_s: float | None = None,
                 deadline_ms: int | None = None, only: tuple[str, ...] = (), partitions: int | None = None,
                 membership: str | None = None, cycles: int = 1) -> dict[str, Any]:
    """Each value left ``None`` is the scenario's own (``Shape``: 40 requests/s, 3 s before the fault and
    15 s from it, 30 s deadlines, 4 partitions, lone workers static). ``partitions``: per priority topic;
    ``membership``: ``static`` or ``dynamic`` for the scenarios' lone workers (``default``: static, as
    the restart scenario needs); ``cycles``: times a repeatable fault is applied in one run."""
    chosen = [s for s in SCENARIOS if not only or s.name in only]
    unknown = set(only) - {s.name for s in SCENARIOS}
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
    if membership not in (None, "default", "static", "dynamic"):
        raise ValueError(f"membership is static, dynamic or default, not {membership!r}")
    if cycles < 1:
        raise ValueError(f"cycles must be >= 1, not {cycles}")
    given: dict[str, Any] = {k: v for k, v in (("rate", rate), ("before_s", before_s), ("after_s", after_s),
                                ("deadline_ms", deadline_ms), ("partitions", partitions),
                                ("membership", membership)) if v is not None}
    report: dict[str, Any] = {**given, "cycles": cycles, "workers": "noop", "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="kinfer-faults-") as tmp:
        for brokers in sorted({s.brokers for s in chosen}):
            # Several brokers run as production runs them: a metadata quorum of three controllers of its own.
            local = LocalStack(Path(tmp) / f"stack-{brokers}", brokers=brokers, controllers=3 if brokers > 1 else 0)
            with local_stack(stack=local, timeout_s=180) as info:
                for scenario in (s for s in chosen if s.brokers == brokers):
                    log(f"{scenario.name} ...")
                    info = local.load() or info  # a restart keeps ports, not pids
                    shape = dataclasses.replace(scenario.shape, **given)
                    result = asyncio.run(_scenario(scenario, local, info, Path(tmp), shape, cycles))
                    report["scenarios"][scenario.name] = {**dataclasses.asdict(shape), **result}
                    log(f"  {result}")
    return report


# -- the picture ----------------------------------------------------------------------------------------


def plot_faults(report: dict[str, Any], path: str) -> str:
    """Recovery time per fault; lost, errors and duplicates per fault."""
    plt = draw.pyplot()
    scenarios = list(report.get("scenarios", {}).items())
    height = 1.5 + 0.45 * len(scenarios)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, height), sharey=True)
    ys = list(range(len(scenarios)))[::-1]  # the first scenario on top
    names = [f"{name.replace('_', ' ')} ({row.get('ok', '?')}/{row.get('offered', '?')} ok)" for name, row in scenarios]
    recovery = [row.get("recovery_s") or 0.0 for _, row in scenarios]
    left.barh(ys, recovery, color="#1f77b4")
    for y, v in zip(ys, recovery, strict=True):
        left.annotate(f"{v:.1f} s", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    left.set_yticks(ys, names, fontsize=8)
    left.set_xlabel("recovery (s): from the fault to the last request slower than 1 s")
    left.set_xlim(0, max([*recovery, 1.0]) * 1.2)
    left.grid(axis="x", alpha=0.3)
    counts = (("lost", "lost"), ("error", "error"), ("unaccepted", "unaccepted"),
              ("duplicates_delivered", "duplicates delivered"), ("duplicates_dropped", "duplicates dropped"))
    width = 0.8 / len(counts)
    colours = ("#d62728", "#ff7f0e", "#8c564b", "#9467bd", "#7f7f7f")
    for i, (key, label) in enumerate(counts):
        offsets = [y + ((len(counts) - 1) / 2 - i) * width for y in ys]
        right.barh(offsets, [row.get(key) or 0 for _, row in scenarios], width, label=label, color=colours[i])
    draw.label_bars(right, fmt="{:,.0f}")
    for y, (_, row) in zip(ys, scenarios, strict=True):
        if not any(row.get(k) for k, _ in counts):
            right.annotate("none", (0, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
                           color="grey")
    right.set_xlabel("requests")
    right.legend(fontsize=8, loc="lower right")
    right.grid(axis="x", alpha=0.3)
    draw.title(fig, f"kinfer bench faults: {report.get('workers', '?')} workers, "
                     f"{draw.num(report.get('rate'))} requests/s for {draw.num(report.get('seconds'))} s, "
                     f"deadline {report.get('deadline_ms', '?')} ms")
    return draw.save(fig, path)
