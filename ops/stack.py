"""The local stack: a real KRaft Kafka cluster (one node, or ``--brokers N`` on this one machine)
and a real Redis on 127.0.0.1.

Kafka's jars come from Maven Central through Maven (pinned version, cached under ``.cache/``);
Redis is Debian's ``redis-server``. Both run as detached processes whose pids, ports and log files
are recorded in ``<home>/stack.json``; ``up`` reuses a running stack and restarts only what is down,
on the ports it had (connected processes reconnect; nothing is stranded); ``down`` stops both and
waits until neither process is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

KAFKA_VERSION = "3.9.1"
SCALA_VERSION = "2.13"
REPO_ROOT = Path(__file__).resolve().parents[1]


def default_home() -> Path:
    return Path(os.environ.get("KINFER_HOME", REPO_ROOT / ".kinfer"))


def cache_dir() -> Path:
    return Path(os.environ.get("KINFER_CACHE", REPO_ROOT / ".cache"))


class StackError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# Kafka's jars


_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>kinfer.local</groupId><artifactId>kafka-broker</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_{scala}</artifactId>
      <version>{kafka}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-reload4j</artifactId>
      <version>1.7.36</version></dependency>
  </dependencies>
</project>
"""


def fetch_kafka(cache: Path | None = None) -> Path:
    """Copy the broker's jars from Maven Central (once); returns the folder holding them."""
    root = (cache or cache_dir()) / f"kafka_{SCALA_VERSION}-{KAFKA_VERSION}"
    libs, marker = root / "libs", root / ".complete"
    if marker.exists():
        return libs
    if shutil.which("mvn") is None:
        raise StackError("Maven ('mvn') is needed to fetch Kafka's jars; install it (apt-get install maven)")
    root.mkdir(parents=True, exist_ok=True)
    (root / "pom.xml").write_text(_POM.format(scala=SCALA_VERSION, kafka=KAFKA_VERSION))
    cmd = [
        "mvn", "-q", "-B", "-f", str(root / "pom.xml"), "dependency:copy-dependencies",
        f"-DoutputDirectory={libs}", "-DincludeScope=runtime",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise StackError(f"fetching Kafka {KAFKA_VERSION} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    marker.touch()
    return libs


# ---------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int, needle: str) -> bool:
    """True if ``pid`` runs and its command line contains ``needle`` (guards against pid reuse)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and needle in cmdline


def _stop(pid: int, needle: str, timeout_s: float = 30.0) -> None:
    try:
        _terminate(pid, needle, timeout_s)
    finally:
        _reap(pid)  # a child of ours that exited is a zombie until polled (and Popen warns about it)


def _terminate(pid: int, needle: str, timeout_s: float) -> None:
    if not _alive(pid, needle):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        if not _alive(pid, needle):
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    while _alive(pid, needle):
        _reap(pid)
        time.sleep(0.05)


# Processes this Python process started: kept so they are reaped (and not warned about) here.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _spawn(cmd: list[str], log: Path) -> int:
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    return proc.pid


def _reap(pid: int) -> None:
    """Collect the exit status if the process is our child (it is, when started in this process)."""
    proc = _CHILDREN.get(pid)
    if proc is not None and proc.poll() is not None:
        del _CHILDREN[pid]


@dataclass(slots=True)
class BrokerInfo:
    """One KRaft node (broker and controller in one process) of the local cluster."""

    node_id: int
    port: int  # the client listener
    controller_port: int
    pid: int = 0
    log: str = ""


@dataclass(slots=True)
class StackInfo:
    home: str
    bootstrap: str  # Kafka bootstrap servers, comma-separated
    redis_url: str
    redis_pid: int = 0
    redis_log: str = ""
    brokers: list[BrokerInfo] = field(default_factory=list)  # empty for an external stack

    @classmethod
    def external(cls, bootstrap: str, redis_url: str) -> StackInfo:
        return cls("external", bootstrap, redis_url)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StackInfo | None:
        """A recorded stack (the one-broker layout of earlier versions too); None if unreadable."""
        try:
            if "kafka_pid" in data:  # before --brokers: one broker, recorded flat
                port = int(str(data["bootstrap"]).rsplit(":", 1)[1])
                data["brokers"] = [{"node_id": 1, "port": port, "controller_port": data.pop("controller_port", 0),
                                    "pid": data.pop("kafka_pid"), "log": data.pop("kafka_log")}]
            brokers = [BrokerInfo(**b) for b in data.pop("brokers")]
            return cls(**data, brokers=brokers)
        except (KeyError, TypeError):
            return None

    @property
    def kafka_pid(self) -> int:
        """The first broker's process (0 for an external stack)."""
        return self.brokers[0].pid if self.brokers else 0

    @property
    def kafka_pids(self) -> list[int]:
        return [b.pid for b in self.brokers]

    @property
    def redis_port(self) -> int:
        return int(urlparse(self.redis_url).port or 6379)

    def env(self) -> dict[str, str]:
        return {"KINFER_BOOTSTRAP": self.bootstrap, "KINFER_REDIS_URL": self.redis_url}


class LocalStack:
    """``up`` / ``down`` / ``status`` of one stack, identified by its home folder."""

    KAFKA_NEEDLE = "kafka.Kafka"
    REDIS_NEEDLE = "redis-server"

    def __init__(self, home: Path | None = None, kafka_port: int | None = None, redis_port: int | None = None,
                 brokers: int = 1):
        if not 1 <= brokers <= 9:
            raise StackError(f"brokers must be within 1..9, got {brokers}")
        self.restarted: list[str] = []  # what the last ``up`` started
        self.home = (home or default_home()).resolve()
        self.kafka_port = kafka_port
        self.redis_port = redis_port
        self.brokers = brokers
        self.state_file = self.home / "stack.json"

    # -- public ------------------------------------------------------------------------------

    def load(self) -> StackInfo | None:
        if not self.state_file.exists():
            return None
        return StackInfo.from_json(json.loads(self.state_file.read_text()))

    def up(self, timeout_s: float = 90.0) -> tuple[StackInfo, bool]:
        """Start the stack, reuse it, or restart only the parts that are down, on their recorded ports.

        Returns (info, started_now): ``started_now`` is true only when nothing was running before, so a
        caller that stops what it started never stops a stack someone else is using. What was
        restarted is in ``self.restarted``. Prerequisites are checked before anything starts, so a
        missing ``java`` or ``redis-server`` leaves no orphan behind. A running stack keeps its own
        number of brokers (``brokers`` applies to a new one).
        """
        info = self.load()
        self.restarted = []
        if info is not None and not (self._any_alive(info)):
            self.down()  # nothing of it runs: nobody is connected, start clean on free ports
            info = None
        fresh = info is None
        if info is None:
            first = self.kafka_port or free_port()
            ports = [first, *(free_port() for _ in range(self.brokers - 1))]
            redis_port = self.redis_port or free_port()
            nodes = [BrokerInfo(i + 1, port, free_port()) for i, port in enumerate(ports)]
            info = StackInfo(str(self.home), ",".join(f"127.0.0.1:{b.port}" for b in nodes),
                             f"redis://127.0.0.1:{redis_port}/0", brokers=nodes)
        dead = [b for b in info.brokers if not _alive(b.pid, self.KAFKA_NEEDLE)]
        redis_ok = _alive(info.redis_pid, self.REDIS_NEEDLE) and _redis_ready(info.redis_url)
        if not dead and redis_ok:
            if asyncio.run(_kafka_ready(info.bootstrap, timeout_s=5, brokers=len(info.brokers))):
                return info, False
            dead = list(info.brokers)  # alive but not answering: replaced
        java = libs = redis_bin = None
        if dead:
            libs = fetch_kafka()
            java = shutil.which("java")
            if java is None:
                raise StackError("java not found: install a JRE (make deps does: default-jre-headless)")
        if not redis_ok:
            redis_bin = shutil.which("redis-server") or "/usr/bin/redis-server"
            if not Path(redis_bin).exists():
                raise StackError("redis-server not found: install Debian's redis-server (make deps does)")
        self.home.mkdir(parents=True, exist_ok=True)
        if redis_bin is not None:
            _stop(info.redis_pid, self.REDIS_NEEDLE)
            pid, log = self._start_redis(redis_bin, info.redis_port)
            info.redis_pid, info.redis_log = pid, str(log)
            self.restarted.append("redis")
            self._record(info)  # recorded at once: `down` finds it even if a broker fails to start
        if java is not None and libs is not None:
            for broker in info.brokers:
                broker.controller_port = broker.controller_port or free_port()  # an older record has none
            voters = ",".join(f"{b.node_id}@127.0.0.1:{b.controller_port}" for b in info.brokers)
            for broker in dead:
                _stop(broker.pid, self.KAFKA_NEEDLE)
                pid, log = self._start_kafka(java, libs, broker, voters, len(info.brokers))
                broker.pid, broker.log = pid, str(log)
                self.restarted.append("kafka" if len(info.brokers) == 1 else f"kafka-{broker.node_id}")
                self._record(info)
        deadline = time.monotonic() + timeout_s
        while not _redis_ready(info.redis_url):
            self._check_started(info, deadline)
            time.sleep(0.1)
        ready = asyncio.run(_kafka_ready(info.bootstrap, timeout_s=max(1.0, deadline - time.monotonic()),
                                         brokers=len(info.brokers)))
        if not ready:
            self._check_started(info, 0)
        return info, fresh

    def _any_alive(self, info: StackInfo) -> bool:
        return _alive(info.redis_pid, self.REDIS_NEEDLE) or any(
            _alive(b.pid, self.KAFKA_NEEDLE) for b in info.brokers)

    def _record(self, info: StackInfo) -> None:
        self.state_file.write_text(json.dumps(asdict(info), indent=2))

    def down(self) -> bool:
        """Stop every process (if any); returns whether something was running."""
        info = self.load()
        if info is None:
            self.state_file.unlink(missing_ok=True)  # an unreadable record of an older layout
            return False
        was = self._any_alive(info)
        for broker in info.brokers:
            _stop(broker.pid, self.KAFKA_NEEDLE)
        _stop(info.redis_pid, self.REDIS_NEEDLE)
        self.state_file.unlink(missing_ok=True)
        return was

    def status(self) -> dict[str, object]:
        info = self.load()
        if info is None:
            return {"home": str(self.home), "state": "down"}
        brokers = [_alive(b.pid, self.KAFKA_NEEDLE) for b in info.brokers]
        redis = _alive(info.redis_pid, self.REDIS_NEEDLE)
        running = sum(brokers) + redis
        return {
            **asdict(info),
            "state": "up" if running == len(brokers) + 1 else "degraded" if running else "down",
            "kafka_running": sum(brokers),
            "redis_running": redis,
        }

    # -- internals ---------------------------------------------------------------------------

    def _check_started(self, info: StackInfo, deadline: float) -> None:
        for pid, needle, logfile in (
            *((b.pid, self.KAFKA_NEEDLE, b.log) for b in info.brokers),
            (info.redis_pid, self.REDIS_NEEDLE, info.redis_log),
        ):
            if not _alive(pid, needle):
                tail = Path(logfile).read_text(errors="replace")[-3000:]
                self.down()
                raise StackError(f"{needle} exited during start; end of {logfile}:\n{tail}")
        if time.monotonic() > deadline:
            self.down()
            logs = ", ".join([*(b.log for b in info.brokers), info.redis_log])
            raise StackError(f"stack did not become ready; logs: {logs}")

    def _start_redis(self, redis_bin: str, port: int) -> tuple[int, Path]:
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        log = self.home / "redis.log"
        cmd = [
            redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(data), "--daemonize", "no", "--protected-mode", "yes",
        ]
        return _spawn(cmd, log), log

    def _start_kafka(self, java: str, libs: Path, broker: BrokerInfo, voters: str, size: int) -> tuple[int, Path]:
        """One KRaft node; ``size`` nodes in all, each broker and controller (one quorum of ``voters``)."""
        name = "kafka" if size == 1 else f"kafka-{broker.node_id}"
        data = self.home / f"{name}-data"
        config = self.home / f"{name}.properties"
        replicas = min(3, size)
        config.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    f"node.id={broker.node_id}",
                    f"controller.quorum.voters={voters}",
                    f"listeners=PLAINTEXT://127.0.0.1:{broker.port},CONTROLLER://127.0.0.1:{broker.controller_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{broker.port}",
                    "controller.listener.names=CONTROLLER",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                    f"log.dirs={data}",
                    "num.partitions=1",
                    "auto.create.topics.enable=false",  # topics are the contract: created on purpose
                    f"offsets.topic.replication.factor={replicas}",
                    "offsets.topic.num.partitions=8",
                    f"transaction.state.log.replication.factor={replicas}",
                    f"transaction.state.log.min.isr={max(1, replicas - 1)}",
                    f"default.replication.factor={replicas}",
                    f"min.insync.replicas={max(1, replicas - 1)}",
                    "group.initial.rebalance.delay.ms=0",
                    "log.retention.hours=24",
                    "",
                ]
            )
        )
        log4j = self.home / "log4j.properties"
        log4j.write_text(
            "log4j.rootLogger=INFO, stdout\n"
            "log4j.appender.stdout=org.apache.log4j.ConsoleAppender\n"
            "log4j.appender.stdout.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
            "log4j.logger.kafka=INFO\nlog4j.logger.org.apache.kafka=INFO\n"
        )
        classpath = f"{libs}/*"
        log = self.home / f"{name}.log"
        cluster_id = self.home / "kafka-cluster-id"
        if not cluster_id.exists():
            cluster_id.write_text(uuid.uuid4().hex[:22])
        if not (data / "meta.properties").exists():
            fmt = subprocess.run(
                [java, "-cp", classpath, f"-Dlog4j.configuration=file:{log4j}", "kafka.tools.StorageTool",
                 "format", "-t", cluster_id.read_text().strip(), "-c", str(config), "--ignore-formatted"],
                capture_output=True, text=True, check=False,
            )
            if fmt.returncode != 0:
                raise StackError(f"formatting Kafka storage failed:\n{fmt.stdout}{fmt.stderr}")
        heap = "-Xmx1g" if size == 1 else "-Xmx512m"
        cmd = [
            java, "-Xms256m", heap, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{log4j}", f"-Dkafka.logs.dir={self.home}",
            "-cp", classpath, "kafka.Kafka", str(config),
        ]
        return _spawn(cmd, log), log


def _redis_ready(url: str) -> bool:
    import redis

    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5) as r:
            return bool(r.ping())
    except (redis.RedisError, OSError):
        return False


async def _kafka_ready(bootstrap: str, timeout_s: float, brokers: int = 1) -> bool:
    """Every broker of ``bootstrap`` answers metadata listing ``brokers`` brokers (each has its own
    view of the cluster, and one that lags would have topics created with too few copies)."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.errors import KafkaError

    deadline = time.monotonic() + timeout_s
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # refused connections are expected while the broker starts
    try:
        pending = bootstrap.split(",")
        while time.monotonic() < deadline:
            # A client's bootstrap asks that address, and only it, for metadata: its own view.
            client = AIOKafkaClient(bootstrap_servers=pending[0], request_timeout_ms=2000)
            try:
                await client.bootstrap()
                if len(client.cluster.brokers()) >= brokers:
                    pending.pop(0)
                    if not pending:
                        return True
                    continue
            except (KafkaError, OSError):
                pass
            finally:
                await client.close()
            await asyncio.sleep(0.25)
        return False
    finally:
        quiet.setLevel(level)


def resolve_endpoints(home: Path | None = None) -> tuple[str, str]:
    """(bootstrap, redis_url): from KINFER_BOOTSTRAP / KINFER_REDIS_URL, else the local stack."""
    bootstrap, redis_url = os.environ.get("KINFER_BOOTSTRAP"), os.environ.get("KINFER_REDIS_URL")
    if bootstrap and redis_url:
        return bootstrap, redis_url
    info = LocalStack(home).load()
    if info is None:
        raise StackError("no Kafka/Redis given: set KINFER_BOOTSTRAP and KINFER_REDIS_URL, or run `kinfer stack up`")
    return bootstrap or info.bootstrap, redis_url or info.redis_url
