"""The local stack: a real KRaft Kafka cluster (one node, or ``--brokers N`` on this one machine)
and a real Redis on 127.0.0.1.

A cluster's nodes are each a broker and a controller voter (KRaft's combined mode), unless it has
controllers of its own (``--controllers N``): then the brokers only serve data and N controller-only
nodes hold the metadata quorum, as production runs them. A broker that dies or stalls then takes no
controller with it: the quorum keeps electing partition leaders and fencing the stalled broker.

Kafka's jars come from Maven Central through Maven (pinned version, cached in ``topics.paths.cache_dir()``);
Redis is Debian's ``redis-server``. Both run as detached processes whose pids, ports and log files
are recorded in ``<home>/stack.json``; ``up`` reuses a running stack and restarts only what is down,
on the ports it had (connected processes reconnect; nothing is stranded); ``down`` stops both and
waits until neither process is left.

``up --secure`` (``LocalStack(secure=True)``) starts the same stack locked down: Kafka's client
listener speaks SASL/SCRAM-SHA-512 over TLS (the brokers too, among themselves), its controller
listener mutual TLS, an authorizer allows only the ACL table of ``ops.deploy.secure``; Redis has ACL users
and no default user. Each principal's credentials: ``StackInfo.env(principal)`` (``kinfer stack env
--principal P``); a ``kinfer`` component started without credentials of its own takes its
principal's from the recorded stack (``apply_stack_env``). Secrets stay in ``<home>/secure/``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kinfer.ops.deploy import secure as sec
from kinfer.topics.connect import KafkaAuth, kafka_options, tls_closes_settled
from kinfer.topics.paths import cache_dir, state_dir

KAFKA_VERSION = "3.9.1"
SCALA_VERSION = "2.13"


class StackError(sec.SetupError):
    """The local stack cannot do what was asked (fetch, start, reach, record)."""


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
    """A port free now on 127.0.0.1, for a process about to bind it. It is drawn below the kernel's
    ephemeral range: outgoing connections are given ports from that range, so between this answer and
    the bind none of them can take it (one took bind(0)'s answer now and then, and a worker died of
    "Address already in use")."""
    low = ephemeral_ports()[0]
    rng = random.SystemRandom()
    for _ in range(200 if low > FIRST_PORT + 1_000 else 0):
        port = rng.randrange(FIRST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a range set so low that there is no room below it
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FIRST_PORT = 10_000  # free_port draws from here up to the ephemeral range


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return low, high


Needle = str | tuple[str, ...]  # what a process's command line holds (a tuple: any one of them)


def process_alive(pid: int, needle: Needle) -> bool:
    """True if ``pid`` runs and its command line contains ``needle`` (guards against pid reuse)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    needles = (needle,) if isinstance(needle, str) else needle
    return state not in ("Z", "X") and any(n in cmdline for n in needles)


def _stop(pid: int, needle: Needle, timeout_s: float = 30.0) -> None:
    _stop_all([(pid, needle)], timeout_s)


def _stop_all(processes: list[tuple[int, Needle]], timeout_s: float = 30.0) -> None:
    """SIGTERM to every process (its group) at once, SIGKILL to those still running ``timeout_s``
    later. At once: a cluster's brokers shut down together while their controller quorum stands,
    rather than the last waiting for a quorum that left before it."""
    try:
        running = [(pid, needle) for pid, needle in processes
                   if process_alive(pid, needle) and _signal(pid, signal.SIGTERM)]
        deadline = time.monotonic() + timeout_s
        while running and time.monotonic() < deadline:
            time.sleep(0.1)
            running = [(pid, needle) for pid, needle in running if not _gone(pid, needle)]
        for pid, _ in running:
            _signal(pid, signal.SIGKILL)
        while running:
            time.sleep(0.05)
            running = [(pid, needle) for pid, needle in running if not _gone(pid, needle)]
    finally:
        for pid, _ in processes:
            _reap(pid)  # a child of ours that exited is a zombie until polled (and Popen warns about it)


def _signal(pid: int, sig: signal.Signals) -> bool:
    """``sig`` to ``pid``'s process group; False if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _gone(pid: int, needle: Needle) -> bool:
    _reap(pid)
    return not process_alive(pid, needle)


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
class KafkaNode:
    """One KRaft node of the local cluster: a broker, a controller, or both in one process (``roles``,
    Kafka's ``process.roles``; a record without it is of a combined node)."""

    node_id: int
    port: int  # the client listener (0: a controller only)
    controller_port: int  # the controller listener (0: a broker only)
    pid: int = 0
    log: str = ""
    roles: str = "broker,controller"

    @property
    def controller(self) -> bool:
        return "controller" in self.roles.split(",")

    @property
    def broker(self) -> bool:
        return "broker" in self.roles.split(",")


@dataclass(slots=True)
class StackInfo:
    home: str
    bootstrap: str  # Kafka bootstrap servers, comma-separated
    redis_url: str
    redis_pid: int = 0
    redis_log: str = ""
    brokers: list[KafkaNode] = field(default_factory=list)  # empty for an external stack
    controllers: list[KafkaNode] = field(default_factory=list)  # empty: every broker is a controller too
    # SASL_SSL + ACLs on Kafka, ACL users on Redis; ``redis_url`` then names no user (see ``env``).
    secure: bool = False

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
            brokers = [KafkaNode(**b) for b in data.pop("brokers")]
            controllers = [KafkaNode(**c) for c in data.pop("controllers", [])]
            return cls(**data, brokers=brokers, controllers=controllers)
        except (KeyError, TypeError):
            return None

    @property
    def kafka_pid(self) -> int:
        """The first broker's process (0 for an external stack)."""
        return self.brokers[0].pid if self.brokers else 0

    @property
    def nodes(self) -> list[KafkaNode]:
        """Every Kafka process: the dedicated controllers (if any), then the brokers."""
        return [*self.controllers, *self.brokers]

    @property
    def voters(self) -> str:
        """``controller.quorum.voters``: the nodes that are controllers."""
        return ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes if n.controller)

    @property
    def redis_port(self) -> int:
        return int(urlparse(self.redis_url).port or 6379)

    @property
    def secure_files(self) -> sec.SecureFiles:
        return sec.SecureFiles(Path(self.home) / "secure")

    def secrets(self) -> sec.Secrets:
        if not self.secure:
            raise StackError("this stack is not secure: it has no credentials")
        try:
            return self.secure_files.load_secrets()
        except (OSError, ValueError, KeyError) as exc:
            raise StackError(f"cannot read {self.secure_files.secrets}: {exc}") from exc

    def kafka_auth(self, principal: str = sec.ADMIN) -> KafkaAuth:
        """How ``principal`` connects to this stack's Kafka (PLAINTEXT for an insecure stack)."""
        if not self.secure:
            return KafkaAuth()
        return KafkaAuth("SASL_SSL", "SCRAM-SHA-512", principal, self.secrets().password(principal),
                         str(self.secure_files.ca_cert))

    def redis_url_for(self, principal: str = sec.ADMIN) -> str:
        """``redis_url`` with ``principal``'s user and password (unchanged for an insecure stack)."""
        if not self.secure:
            return self.redis_url
        return sec.redis_url_with_user(self.redis_url, principal, self.secrets().password(principal))

    def env(self, principal: str = sec.ADMIN) -> dict[str, str]:
        """The environment of a process acting as ``principal`` on this stack.

        Insecure: the endpoints only (``principal`` is ignored). Secure: Redis's URL with the
        principal's user and password, ``KINFER_KAFKA_*`` (SASL_SSL, SCRAM-SHA-512, user, password,
        CA file), ``KINFER_SIGNING_SECRET`` for those that sign or check requests (the worker, the
        gateway, admin), and for a tenant ``KINFER_TENANT`` and its request key ``KINFER_TENANT_KEY``.
        """
        if not self.secure:
            return {"KINFER_BOOTSTRAP": self.bootstrap, "KINFER_REDIS_URL": self.redis_url}
        return sec.principal_env(self.secrets(), principal, self.bootstrap, self.redis_url,
                                 str(self.secure_files.ca_cert))


class LocalStack:
    """``up`` / ``down`` / ``status`` of one stack, identified by its home folder."""

    KAFKA_NEEDLE = "kafka.Kafka"
    REDIS_NEEDLE = "redis-server"

    def __init__(self, home: Path | None = None, kafka_port: int | None = None, redis_port: int | None = None,
                 brokers: int = 1, secure: bool | None = None, failover: bool = True, controllers: int = 0):
        """``failover``: a cluster of several brokers gets over a dead or stalled one in seconds
        (``ops.deploy.secure.FAILOVER_PROPERTIES``); False keeps Kafka's defaults. ``controllers``: that
        many controller-only nodes hold the metadata quorum, and the brokers are brokers only (0: each
        broker is a controller voter too)."""
        if not 1 <= brokers <= 9:
            raise StackError(f"brokers must be within 1..9, got {brokers}")
        if not 0 <= controllers <= 9:
            raise StackError(f"controllers must be within 0..9, got {controllers}")
        self.restarted: list[str] = []  # what the last ``up`` started
        self.home = (home or state_dir()).resolve()
        self.kafka_port = kafka_port
        self.redis_port = redis_port
        self.brokers = brokers
        self.controllers = controllers
        # None: as before (a stack, or storage, that was secure comes back secure); a new stack is not.
        self.secure = secure
        self.failover = failover
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
        brokers and controllers (``brokers`` and ``controllers`` apply to a new one), and its security: ``secure`` that
        differs from a running stack's is an error; a stack that is not running comes back as it
        was (as recorded, or as its Kafka storage was formatted) unless ``secure`` says otherwise.
        """
        info = self.load()
        self.restarted = []
        was_secure = info.secure if info is not None else self._storage_is_secure()
        if info is not None and not (self._any_alive(info)):
            self.down()  # nothing of it runs: nobody is connected, start clean on free ports
            info = None
        secure = was_secure if self.secure is None else self.secure
        if info is not None and info.secure != secure:
            raise StackError(f"the stack running in {self.home} is {'' if info.secure else 'not '}secure: "
                             "stop it first (kinfer stack down) to start it with "
                             f"{'--no-secure' if info.secure else '--secure'}")
        fresh = info is None
        if info is None:
            info = self._new(secure)
        secrets = None
        if secure:  # created once, kept: the brokers' storage is formatted with these passwords
            self.home.mkdir(parents=True, exist_ok=True)
            secrets = sec.ensure_secure_dir(info.secure_files.root)[1]
        redis_url, kafka_opts = info.redis_url_for(), _stack_kafka_options(info)  # admin's, when secure
        dead = [n for n in info.nodes if not process_alive(n.pid, self._kafka(n, info))]
        redis_ok = process_alive(info.redis_pid, self._redis(info)) and _redis_ready(redis_url)
        if not dead and redis_ok:
            if asyncio.run(_kafka_ready(info.bootstrap, timeout_s=5, brokers=len(info.brokers), options=kafka_opts)):
                return info, False
            dead = info.nodes  # alive but not answering: replaced
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
            _stop(info.redis_pid, self._redis(info))
            pid, log = self._start_redis(redis_bin, info.redis_port, secrets)
            info.redis_pid, info.redis_log = pid, str(log)
            self.restarted.append("redis")
            self._record(info)  # recorded at once: `down` finds it even if a broker fails to start
        if java is not None and libs is not None:
            for node in info.nodes:
                if node.controller:
                    node.controller_port = node.controller_port or free_port()  # an older record has none
            if secrets is not None and len(dead) == len(info.nodes):
                for node in dead:
                    _stop(node.pid, self._kafka(node, info))
                self._clear_storage_unless_formatted_for(secrets)
            for node in dead:
                _stop(node.pid, self._kafka(node, info))
                pid, log = self._start_kafka(java, libs, node, info, secrets)
                node.pid, node.log = pid, str(log)
                self.restarted.append(_node_name(node, info))
                self._record(info)
        deadline = time.monotonic() + timeout_s
        while not _redis_ready(redis_url):
            self._check_started(info, deadline)
            time.sleep(0.1)
        ready = asyncio.run(_kafka_ready(info.bootstrap, timeout_s=max(1.0, deadline - time.monotonic()),
                                         brokers=len(info.brokers), options=kafka_opts))
        if not ready:
            self._check_started(info, 0)
        if secrets is not None and java is not None:
            # ACLs live in the metadata log: applied once the brokers answer, again on each broker start
            # (the table may have grown since; creating an ACL that exists changes nothing).
            try:
                asyncio.run(apply_acls(info))
            except Exception as exc:
                self.down()
                raise StackError(f"applying the ACLs failed: {exc}") from exc
        return info, fresh

    def _new(self, secure: bool) -> StackInfo:
        """A new stack's layout, on free ports (or those given): nothing started yet."""
        first = self.kafka_port or free_port()
        ports = [first, *(free_port() for _ in range(self.brokers - 1))]
        redis_port = self.redis_port or free_port()
        if self.controllers:
            brokers = [KafkaNode(i + 1, port, 0, roles="broker") for i, port in enumerate(ports)]
            quorum = [KafkaNode(sec.CONTROLLER_IDS + i + 1, 0, free_port(), roles="controller")
                      for i in range(self.controllers)]
        else:
            brokers, quorum = [KafkaNode(i + 1, port, free_port()) for i, port in enumerate(ports)], []
        return StackInfo(str(self.home), ",".join(f"127.0.0.1:{b.port}" for b in brokers),
                         f"redis://127.0.0.1:{redis_port}/0", brokers=brokers, controllers=quorum, secure=secure)

    def _kafka(self, node: KafkaNode, info: StackInfo) -> str:
        """What this stack's Kafka node has in its command line: its own config file. PIDs are reused (within
        minutes where pid_max is 32768 and JVM threads take PIDs too), and a reused one may well be another
        stack's broker: the class name alone would let ``down`` or ``up`` stop it."""
        return f"{self.KAFKA_NEEDLE} {self.home / f'{_node_name(node, info)}.properties'}"

    def _redis(self, info: StackInfo) -> Needle:
        """What this stack's Redis has in its command line: its own port, in the arguments it was started
        with, then in the process title Redis gives itself once it runs."""
        return (f"{self.REDIS_NEEDLE} --port {info.redis_port} ", f"{self.REDIS_NEEDLE} 127.0.0.1:{info.redis_port}")

    def _any_alive(self, info: StackInfo) -> bool:
        return process_alive(info.redis_pid, self._redis(info)) or any(
            process_alive(n.pid, self._kafka(n, info)) for n in info.nodes)

    def _record(self, info: StackInfo) -> None:
        self.state_file.write_text(json.dumps(asdict(info), indent=2))

    def down(self) -> bool:
        """Stop every process (if any); returns whether something was running."""
        info = self.load()
        if info is None:
            self.state_file.unlink(missing_ok=True)  # an unreadable record of an older layout
            return False
        was = self._any_alive(info)
        # The brokers first, while the quorum they shut down through still stands; then the controllers.
        _stop_all([(b.pid, self._kafka(b, info)) for b in info.brokers])
        _stop_all([(c.pid, self._kafka(c, info)) for c in info.controllers])
        _stop(info.redis_pid, self._redis(info))
        self.state_file.unlink(missing_ok=True)
        return was

    def status(self) -> dict[str, object]:
        info = self.load()
        if info is None:
            return {"home": str(self.home), "state": "down"}
        brokers = [process_alive(b.pid, self._kafka(b, info)) for b in info.brokers]
        controllers = [process_alive(c.pid, self._kafka(c, info)) for c in info.controllers]
        redis = process_alive(info.redis_pid, self._redis(info))
        running = sum(brokers) + sum(controllers) + redis
        return {
            **asdict(info),
            "state": "up" if running == len(info.nodes) + 1 else "degraded" if running else "down",
            "kafka_running": sum(brokers),
            "controllers_running": sum(controllers),
            "redis_running": redis,
        }

    # -- internals ---------------------------------------------------------------------------

    def _check_started(self, info: StackInfo, deadline: float) -> None:
        for pid, needle, name, logfile in (
            *((n.pid, self._kafka(n, info), self.KAFKA_NEEDLE, n.log) for n in info.nodes),
            (info.redis_pid, self._redis(info), self.REDIS_NEEDLE, info.redis_log),
        ):
            if not process_alive(pid, needle):
                tail = Path(logfile).read_text(errors="replace")[-3000:]
                self.down()
                raise StackError(f"{name} exited during start; end of {logfile}:\n{tail}")
        if time.monotonic() > deadline:
            self.down()
            logs = ", ".join([*(n.log for n in info.nodes), info.redis_log])
            raise StackError(f"stack did not become ready; logs: {logs}")

    def _start_redis(self, redis_bin: str, port: int, secrets: sec.Secrets | None = None) -> tuple[int, Path]:
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        log = self.home / "redis.log"
        cmd = [
            redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(data), "--daemonize", "no", "--protected-mode", "yes",
        ]
        if secrets is not None:  # users from the ACL file, written afresh (the rules may have changed)
            files = sec.SecureFiles(self.home / "secure")
            version = subprocess.run([redis_bin, "--version"], capture_output=True, text=True, check=False).stdout
            sec.write_private(files.redis_acl, sec.redis_acl_text(secrets, sec.redis_version(version)))
            cmd += ["--aclfile", str(files.redis_acl)]
        return _spawn(cmd, log), log

    def _clear_storage_unless_formatted_for(self, secrets: sec.Secrets) -> None:
        """A secure cluster needs its SCRAM credentials in the storage from the start (they are written
        when it is formatted): storage formatted without them, or with other passwords, is removed
        (the stack is down; its topics go too) so that it is formatted again."""
        if self._storage_marker.exists() and self._storage_marker.read_text().strip() == _secure_mark(secrets):
            return
        for data in sorted(self.home.glob("kafka*-data")):
            if (data / "meta.properties").exists():
                logging.getLogger(__name__).warning("%s was not formatted for this secure stack: removed", data)
                shutil.rmtree(data)

    @property
    def _storage_marker(self) -> Path:
        return self.home / "kafka-storage-security"

    def _storage_is_secure(self) -> bool:
        """Whether Kafka's storage here was formatted for a secure stack (and is still there)."""
        try:
            marked = self._storage_marker.read_text().startswith("secure:")
        except OSError:
            return False
        return marked and any((d / "meta.properties").exists() for d in self.home.glob("kafka*-data"))

    def _start_kafka(self, java: str, libs: Path, node: KafkaNode, info: StackInfo,
                     secrets: sec.Secrets | None = None) -> tuple[int, Path]:
        """One KRaft node of ``info``'s cluster: a broker, a controller, or both (``node.roles``)."""
        name = _node_name(node, info)
        data = self.home / f"{name}-data"
        config = self.home / f"{name}.properties"
        replicas = min(3, len(info.brokers))
        client, controller = ("PLAINTEXT", "CONTROLLER") if secrets is None else (sec.CLIENT_LISTENER,
                                                                                 sec.CONTROLLER_LISTENER)
        own = [*([f"{client}://127.0.0.1:{node.port}"] if node.broker else []),
               *([f"{controller}://127.0.0.1:{node.controller_port}"] if node.controller else [])]
        listeners = [
            f"listeners={','.join(own)}",
            *([f"advertised.listeners={client}://127.0.0.1:{node.port}"] if node.broker else []),
            f"controller.listener.names={controller}",
            *(["listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"] if secrets is None else
              sec.kafka_security_properties(info.secure_files,
                                            secrets.password(sec.ADMIN) if node.broker else None)),
        ]
        text = (
            "\n".join(
                [
                    f"process.roles={node.roles}",
                    f"node.id={node.node_id}",
                    f"controller.quorum.voters={info.voters}",
                    *listeners,
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
                    *(sec.FAILOVER_PROPERTIES if len(info.brokers) > 1 and self.failover else ()),
                    "",
                ]
            )
        )
        if secrets is None:
            config.write_text(text)
        else:
            sec.write_private(config, text)  # the JAAS line holds admin's password
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
            scram = [] if secrets is None else sec.storage_scram_args(secrets)  # KIP-900: SCRAM users at birth
            fmt = subprocess.run(
                # A one-shot tool: the JIT's first tier alone (a third less CPU than compiling for peak speed)
                [java, "-XX:TieredStopAtLevel=1", "-cp", classpath, f"-Dlog4j.configuration=file:{log4j}",
                 "kafka.tools.StorageTool",
                 "format", "-t", cluster_id.read_text().strip(), "-c", str(config), "--ignore-formatted", *scram],
                capture_output=True, text=True, check=False,
            )
            if fmt.returncode != 0:
                out = fmt.stdout + fmt.stderr
                if secrets is not None:
                    for password in secrets.passwords.values():
                        out = out.replace(password, "***")
                raise StackError(f"formatting Kafka storage failed:\n{out}")
            if secrets is None:
                self._storage_marker.unlink(missing_ok=True)
            else:
                self._storage_marker.write_text(_secure_mark(secrets) + "\n")
        # A controller holds the cluster's metadata alone: a fraction of a broker's heap.
        heap = ["-Xms128m", "-Xmx256m"] if not node.broker else ["-Xms256m", "-Xmx1g" if len(info.brokers) == 1
                                                                 else "-Xmx512m"]
        cmd = [
            java, *heap, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
            *shlex.split(os.environ.get("KAFKA_OPTS", "")),
            f"-Dlog4j.configuration=file:{log4j}", f"-Dkafka.logs.dir={self.home}",
            "-cp", classpath, "kafka.Kafka", str(config),
        ]
        return _spawn(cmd, log), log


def _node_name(node: KafkaNode, info: StackInfo) -> str:
    """A node's name in the stack's folder (its config, data and log) and in ``LocalStack.restarted``."""
    if not node.broker:
        return f"controller-{node.node_id - sec.CONTROLLER_IDS}"
    return "kafka" if len(info.brokers) == 1 else f"kafka-{node.node_id}"


def _redis_ready(url: str) -> bool:
    import redis

    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5) as r:
            return bool(r.ping())
    except (redis.RedisError, OSError):
        return False


def _secure_mark(secrets: sec.Secrets) -> str:
    return f"secure:{secrets.fingerprint()}"


def _stack_kafka_options(info: StackInfo) -> dict[str, Any]:
    """Security settings of the stack's own clients: admin's on a secure stack; PLAINTEXT on an
    insecure one, whatever this process's environment says (it may name another cluster's)."""
    return info.kafka_auth().options() or {"security_protocol": "PLAINTEXT"}


async def _kafka_ready(bootstrap: str, timeout_s: float, brokers: int = 1,
                       options: dict[str, Any] | None = None) -> bool:
    """Every broker of ``bootstrap`` answers metadata listing ``brokers`` brokers (each has its own
    view of the cluster, and one that lags would have topics created with too few copies).
    ``options``: the clients' security settings (``_stack_kafka_options``)."""
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
            client = AIOKafkaClient(**kafka_options(pending[0], request_timeout_ms=2000,
                                                    **(options or {"security_protocol": "PLAINTEXT"})))
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
        if (options or {}).get("security_protocol", "PLAINTEXT") != "PLAINTEXT":
            await tls_closes_settled()


# ---------------------------------------------------------------------------------------------
# The secure stack's ACLs and credentials


async def apply_acls(info: StackInfo, models: Iterable[str] | None = None,
                     acls: Iterable[sec.Acl] | None = None) -> int:
    """Create ``acls`` (default: the whole table of ``ops.deploy.secure.kafka_acls`` for the stack's tenants
    and ``models``, default: the models whose request topics the brokers list now), as admin.
    Creating an ACL that exists changes nothing. Returns how many were sent."""
    secrets = info.secrets()
    return await sec.create_acls(info.bootstrap, _stack_kafka_options(info), secrets.tenants, models, acls)


async def apply_tenant_acls(info: StackInfo, models: Iterable[str]) -> int:
    """Every tenant's ACLs on the request topics of ``models``: what ``kinfer topics --model M`` on
    a secure stack must do after creating them (a tenant whose best priority is p1 or p2 is allowed
    topic by topic, see ``ops.deploy.secure.tenant_acls``). ``kinfer stack acls`` applies the whole table."""
    models = list(models)
    tenants = info.secrets().tenants
    return await apply_acls(info, acls=[acl for tenant, best in tenants.items()
                                        for acl in sec.tenant_acls(tenant, best, models)])


def tenant_acls_after_topics(bootstrap: str, models: Iterable[str], home: Path | None = None) -> int:
    """After ``kinfer topics`` created ``models``' topics at ``bootstrap``: if that is the secure local
    stack, apply its tenants' ACLs on them (``apply_tenant_acls``); returns how many (0: nothing to do)."""
    info = LocalStack(home).load()
    if info is None or not info.secure or bootstrap != info.bootstrap:
        return 0
    return asyncio.run(apply_tenant_acls(info, models))


STACK_PRINCIPAL_VAR = "KINFER_STACK_PRINCIPAL"  # whose credentials apply_stack_env put in this environment


def apply_stack_env(principal: str, home: Path | None = None) -> dict[str, str]:
    """Give this process (and the processes it starts) ``principal``'s credentials on the secure
    local stack recorded in ``home``, where the environment does not give its own; returns what was
    set. Nothing happens without a running secure stack, or when ``KINFER_BOOTSTRAP`` names another
    cluster.

    An environment that carries credentials of its own (``KINFER_KAFKA_USER``, ``KINFER_REDIS_URL``
    with a user, ``KINFER_KAFKA_SECURITY_PROTOCOL``) is left as it is: ``kinfer stack env`` exported
    by hand stays. Credentials this function set earlier for another principal
    (``KINFER_STACK_PRINCIPAL`` says whose) are not the environment's own: an autoscaler's workers,
    started with the autoscaler's environment, become ``kinfer-worker``.
    """
    stack = LocalStack(home)
    try:
        info = stack.load()
    except (OSError, ValueError):
        return {}
    if info is None or not info.secure or not stack._any_alive(info):
        return {}
    if os.environ.get("KINFER_BOOTSTRAP", info.bootstrap) != info.bootstrap:
        return {}
    before = os.environ.get(STACK_PRINCIPAL_VAR)
    try:
        wanted = info.env(principal)
        previous = info.env(before) if before and before != principal else {}
    except ValueError as exc:
        raise StackError(str(exc)) from exc
    # Values that are the stack's rather than given: the previous principal's, and the stack's own
    # Redis URL without a user (what an insecure stack's `kinfer stack env` printed).
    ours = {key: {value} for key, value in previous.items()}
    ours.setdefault("KINFER_REDIS_URL", set()).add(info.redis_url)
    for key in ("KINFER_KAFKA_USER", "KINFER_KAFKA_SECURITY_PROTOCOL", "KINFER_REDIS_URL"):
        if key in os.environ and os.environ[key] not in ours.get(key, set()) | {wanted.get(key)}:
            return {}  # the environment's own identity
    changed: dict[str, str] = {}
    for key in set(previous) - set(wanted):  # e.g. a tenant's KINFER_TENANT, when a worker starts
        if os.environ.get(key) == previous[key]:
            del os.environ[key]
    for key, value in wanted.items():
        current = os.environ.get(key)
        if current is None or (current != value and current in ours.get(key, ())):
            os.environ[key] = changed[key] = value
    os.environ[STACK_PRINCIPAL_VAR] = principal
    return changed


def resolve_endpoints(home: Path | None = None, principal: str | None = None) -> tuple[str, str]:
    """(bootstrap, redis_url): from KINFER_BOOTSTRAP / KINFER_REDIS_URL, else the local stack.

    On a secure local stack, credentials the environment does not give come from the stack:
    ``principal``'s (``apply_stack_env``), or admin's when none was named and none applied yet.
    """
    if principal is not None or STACK_PRINCIPAL_VAR not in os.environ:
        apply_stack_env(principal or sec.ADMIN, home)
    bootstrap, redis_url = os.environ.get("KINFER_BOOTSTRAP"), os.environ.get("KINFER_REDIS_URL")
    if bootstrap and redis_url:
        return bootstrap, redis_url
    info = LocalStack(home).load()
    if info is None:
        raise StackError("no Kafka/Redis given: set KINFER_BOOTSTRAP and KINFER_REDIS_URL, or run `kinfer stack up`")
    return bootstrap or info.bootstrap, redis_url or info.redis_url
