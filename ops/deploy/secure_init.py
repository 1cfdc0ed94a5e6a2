"""The compose deployment's security: ``python -m kinfer.ops.deploy.secure_init init|setup|rotate|env|ca``.

``docker-compose.yml`` runs Kafka and Redis locked down the way ``kinfer stack up --secure`` does
(``ops.deploy.secure`` decides who may do what; ``ops.localstack.stack`` runs the local processes): SASL_SSL with
SCRAM-SHA-512 on the brokers' client listeners (the in-network one and the host's), the
controller listener on mutual TLS, StandardAuthorizer with nothing allowed without an ACL, the ACL
table of ``ops.deploy.secure``, Redis with ``user default off`` and one ACL user per principal. This module
writes the files that takes, and applies what only a running cluster can take:

``init`` (the one-shot ``secrets`` service, before anything else starts) creates what is missing in
the private state volume and keeps what is there — a random password per principal and the request
signing secret (``ops.deploy.secure.Secrets``), the cluster id, a CA, a certificate per Kafka node whose SANs
are its service name, the host listener's name, localhost and 127.0.0.1 (issued again within 30 days
of its end or when the names change) — and then writes each consumer's own volume from it, owned by
the user that consumer's image runs as (``OWNERS``), so that a container sees its own secrets only:

    state/       secrets.json, cluster-id, ca.key, ca.pem, brokers/<name>.key|.pem,
                 signing-retired, grafana-admin-password            (init, setup, rotate only)
    kafka/       cluster-id, scram-args (StorageTool's --add-scram, one argument a line), ca.pem,
                 admin.properties (the CLI tools' admin login: healthchecks, kafka-configs),
                 <node>/server.properties, <node>/broker-keystore.pem, <node>/ca.pem (brokers and controllers)
    redis/       users.acl (ops.deploy.secure.redis_acl_text: passwords as SHA-256)
    grafana/     admin-password
    <principal>/ ca.pem, password, signing-secret (worker, gateway, admin: current first, then retired)

``setup`` (the one-shot ``setup`` service, as admin, once the brokers are up and the topics exist):
every principal's SCRAM credential (KIP-554 AlterUserScramCredentials: added tenants, passwords
changed), the ACL table (``ops.deploy.secure.create_acls``; tenants on the request topics of every model
the brokers list), and ``ACL LOAD`` on Redis (the file ``init`` wrote).

``rotate --principal P`` draws a new password for P and changes it live on Kafka and Redis (as
admin) before it saves it; ``rotate --signing-secret`` makes a new request signing secret current
and keeps the old one accepted until ``rotate --drop-retired``. ``docker compose up -d`` then writes
the volumes again; restart P's services to pick the new file up. ``env --principal P`` prints P's
environment for a client on the host (the HOST listener), ``ca`` the CA certificate.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import hashlib
import os
import secrets as _random
import shlex
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinfer.ops.deploy import secure as sec

# The users the images run as: apache/kafka's appuser, the redis image's redis, grafana's grafana,
# and kinfer's own (Dockerfile). ``init`` runs as root and hands each volume to its reader.
OWNERS: dict[str, int] = {"kafka": 1000, "redis": 999, "grafana": 472, "kinfer": 10001}
# Principals with a compose service of their own, each with a volume of its own.
COMPOSE_PRINCIPALS = (sec.ADMIN, sec.WORKER, sec.LAGMON, sec.TELEMETRY, sec.GATEWAY)
SIGNERS = (sec.ADMIN, sec.WORKER, sec.GATEWAY)  # those that hold the request signing secret
HOST_LISTENER = "HOST"  # the brokers' listener for clients on the Docker host (published ports)
REDIS_VERSION = (7, 2)  # docker-compose.yml's redis image


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the Kafka nodes are: names, ports, and the paths inside their containers."""

    brokers: tuple[str, ...] = ("kafka-1", "kafka-2", "kafka-3")  # compose service names = node ids 1..n
    # KRaft controllers of their own, as production runs them (compose service names = node ids 101..):
    # a broker that dies or stalls takes no part of the metadata quorum with it. Empty: each broker is a
    # controller voter too (combined mode).
    controllers: tuple[str, ...] = ("kafka-controller-1", "kafka-controller-2", "kafka-controller-3")
    host_name: str = "localhost"  # what the HOST listener advertises (and its certificate names)
    host_port: int = 19092  # the first broker's HOST listener; the next ones count up
    kafka_dir: str = "/run/kinfer/kafka"  # where a broker mounts its secrets volume
    data_dir: str = "/var/lib/kafka/data"
    client_port: int = 9092  # CLIENT: SASL_SSL, the containers' listener (and broker to broker)
    controller_port: int = 9093  # CONTROLLER: mutual TLS, nodes only

    def __post_init__(self) -> None:
        if not self.brokers or len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"brokers and controllers must be distinct names, got {self.nodes}")
        for name in (*self.nodes, self.host_name):
            if not all(part and part.replace("-", "").isalnum() for part in name.split(".")):
                raise ValueError(f"{name!r} is not a host name")

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every Kafka node: the controllers (if any), then the brokers."""
        return (*self.controllers, *self.brokers)

    def node_id(self, name: str) -> int:
        if name in self.controllers:
            return sec.CONTROLLER_IDS + self.controllers.index(name) + 1
        return self.brokers.index(name) + 1

    @property
    def voters(self) -> str:
        """``controller.quorum.voters``: the controllers, or every broker where there are none."""
        return ",".join(f"{self.node_id(n)}@{n}:{self.controller_port}" for n in self.controllers or self.brokers)

    def node_files(self, node: str) -> sec.SecureFiles:
        """A node's keystore and the CA, as its container sees them in its volume."""
        return sec.SecureFiles(Path(self.kafka_dir) / node)

    def host_port_of(self, index: int) -> int:
        return self.host_port + index

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{b}:{self.client_port}" for b in self.brokers)

    @property
    def host_bootstrap(self) -> str:
        return ",".join(f"{self.host_name}:{self.host_port_of(i)}" for i in range(len(self.brokers)))

    def dns_names(self, node: str) -> list[str]:
        """What a node's certificate names: its service name, the host listener's name, localhost."""
        return list(dict.fromkeys([node, self.host_name, "localhost"]))


# ---------------------------------------------------------------------------------------------
# The state: created once, kept


@dataclass(frozen=True, slots=True)
class State:
    root: Path
    secrets: sec.Secrets
    cluster_id: str
    signing_retired: tuple[str, ...] = ()  # older signing secrets still accepted
    grafana_password: str = ""

    @property
    def files(self) -> sec.SecureFiles:
        return sec.SecureFiles(self.root)

    def signing_secrets_text(self) -> str:
        """KINFER_SIGNING_SECRET: the current secret first, then those being retired."""
        return ",".join([self.secrets.signing_secret, *self.signing_retired])

    def broker_key(self, name: str) -> Path:
        return self.root / "brokers" / f"{name}.key"

    def broker_cert(self, name: str) -> Path:
        return self.root / "brokers" / f"{name}.pem"


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, base64url without padding (22 characters)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


def load_state(root: Path) -> State:
    files = sec.SecureFiles(root)
    try:
        secrets = files.load_secrets()
        cluster_id = (root / "cluster-id").read_text().strip()
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"no secrets state in {root} (run `init` first): {exc}") from exc
    retired = root / "signing-retired"
    grafana = root / "grafana-admin-password"
    return State(root, secrets, cluster_id,
                 tuple(retired.read_text().split()) if retired.exists() else (),
                 grafana.read_text().strip() if grafana.exists() else "")


def ensure_state(root: Path, layout: Layout, tenants: Mapping[str, int] | None = None) -> State:
    """Create what is missing under ``root`` and keep what exists (passwords never change here).

    ``tenants`` (name -> best priority): added when new, their best priority updated; tenants
    already in the state and not named stay. Broker certificates are issued again when missing,
    not signed by the CA, naming other hosts than ``layout`` wants, or within 30 days of their end.
    """
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    files = sec.SecureFiles(root)
    if files.secrets.exists():
        secrets = files.load_secrets()
        if tenants:
            secrets = _with_tenants(secrets, tenants)
    else:
        secrets = sec.Secrets.generate(tenants or None)
    sec.write_private(files.secrets, secrets.to_json())
    cluster = root / "cluster-id"
    if not cluster.exists():
        sec.write_private(cluster, new_cluster_id() + "\n")
    grafana = root / "grafana-admin-password"
    if not grafana.exists():
        sec.write_private(grafana, _random.token_hex(16))
    if not (files.ca_key.exists() and files.ca_cert.exists()):
        ca_key, ca_cert = sec.make_ca()
        sec.write_private(files.ca_key, ca_key)
        sec.write_private(files.ca_cert, ca_cert)
    state = load_state(root)
    (root / "brokers").mkdir(mode=0o700, exist_ok=True)
    ca_key_pem, ca_pem = files.ca_key.read_bytes(), files.ca_cert.read_bytes()
    for name in layout.nodes:
        dns, ips = layout.dns_names(name), ["127.0.0.1"]
        key_path, cert_path = state.broker_key(name), state.broker_cert(name)
        if key_path.exists() and cert_path.exists() and cert_is_current(cert_path.read_bytes(), ca_pem, dns, ips):
            continue
        key, cert = sec.make_broker_cert(ca_key_pem, ca_pem, dns_names=dns, ips=ips)
        sec.write_private(key_path, key)
        sec.write_private(cert_path, cert)
    return state


def _with_tenants(secrets: sec.Secrets, tenants: Mapping[str, int]) -> sec.Secrets:
    passwords, merged = dict(secrets.passwords), dict(secrets.tenants)
    for name, best in tenants.items():
        principal = sec.tenant_principal(name)
        if best not in sec.PRIORITIES:
            raise ValueError(f"tenant {name!r}: best priority must be 0, 1 or 2, got {best}")
        merged[name] = best
        passwords.setdefault(principal, _random.token_hex(24))
    return sec.Secrets(passwords, secrets.signing_secret, merged)


def cert_is_current(cert_pem: bytes, ca_pem: bytes, dns_names: Sequence[str], ips: Sequence[str],
                    margin: dt.timedelta = dt.timedelta(days=30)) -> bool:
    """Whether a broker certificate is signed by this CA, names exactly these hosts, and lasts."""
    import ipaddress

    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))  # another CA's: InvalidSignature
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    names_ok = (sorted(san.get_values_for_type(x509.DNSName)) == sorted(dns_names)
                and sorted(san.get_values_for_type(x509.IPAddress)) == sorted(ipaddress.ip_address(a) for a in ips))
    return names_ok and cert.not_valid_after_utc - margin > dt.datetime.now(dt.UTC)


# ---------------------------------------------------------------------------------------------
# What each consumer reads


def broker_properties(layout: Layout, index: int, admin_password: str) -> str:
    """A compose broker's whole server.properties (a controller voter too where the layout has no controllers)."""
    name = layout.brokers[index]
    client, controller = sec.CLIENT_LISTENER, sec.CONTROLLER_LISTENER
    host_port = layout.host_port_of(index)
    replicas = min(3, len(layout.brokers))
    insync = max(1, replicas - 1)
    combined = not layout.controllers
    lines = [
        f"process.roles={'broker,controller' if combined else 'broker'}",
        f"node.id={layout.node_id(name)}",
        f"controller.quorum.voters={layout.voters}",
        f"listeners={client}://0.0.0.0:{layout.client_port},{HOST_LISTENER}://0.0.0.0:{host_port}"
        + (f",{controller}://0.0.0.0:{layout.controller_port}" if combined else ""),
        f"advertised.listeners={client}://{name}:{layout.client_port},"
        f"{HOST_LISTENER}://{layout.host_name}:{host_port}",
        f"controller.listener.names={controller}",
        *sec.kafka_security_properties(layout.node_files(name), admin_password, extra_listeners=[HOST_LISTENER]),
        f"log.dirs={layout.data_dir}",
        "num.partitions=1",
        "auto.create.topics.enable=false",  # topics are the contract: created on purpose
        # Three copies of everything, a write acknowledged by two: one broker may die (or restart)
        # without losing or refusing accepted work.
        f"offsets.topic.replication.factor={replicas}",
        f"transaction.state.log.replication.factor={replicas}",
        f"transaction.state.log.min.isr={insync}",
        f"default.replication.factor={replicas}",
        f"min.insync.replicas={insync}",
        "group.initial.rebalance.delay.ms=0",
        *sec.FAILOVER_PROPERTIES,
    ]
    return "\n".join(lines) + "\n"


def controller_properties(layout: Layout, index: int) -> str:
    """A compose controller's whole server.properties: the metadata quorum's voter, on mutual TLS only."""
    name = layout.controllers[index]
    controller = sec.CONTROLLER_LISTENER
    lines = [
        "process.roles=controller",
        f"node.id={layout.node_id(name)}",
        f"controller.quorum.voters={layout.voters}",
        f"listeners={controller}://0.0.0.0:{layout.controller_port}",
        f"controller.listener.names={controller}",
        *sec.kafka_security_properties(layout.node_files(name), None),  # no client listener: no SASL, no password
        f"log.dirs={layout.data_dir}",
        *sec.FAILOVER_PROPERTIES,  # the controllers fence a broker whose heartbeats stop
    ]
    return "\n".join(lines) + "\n"


def admin_client_properties(ca_file: str, admin_password: str) -> str:
    """Kafka's CLI tools logged in as admin (``--command-config``): the brokers' healthcheck."""
    return "\n".join([
        "security.protocol=SASL_SSL",
        "sasl.mechanism=SCRAM-SHA-512",
        'sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required '
        f'username="{sec.ADMIN}" password="{admin_password}";',
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={ca_file}",
    ]) + "\n"


@dataclass(slots=True)
class Writer:
    """Writes files readable by one owner only (0600 in 0700 folders), atomically (a reader sees
    the old file or the new one), and hands them to ``uid`` when running as root."""

    chown: bool = field(default_factory=lambda: os.geteuid() == 0)
    written: list[Path] = field(default_factory=list)

    def folder(self, path: Path, uid: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        if self.chown:
            os.chown(path, uid, uid)
        return path

    def file(self, path: Path, data: str | bytes, uid: int) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        sec.write_private(tmp, data)
        if self.chown:
            os.chown(tmp, uid, uid)
        os.replace(tmp, path)
        self.written.append(path)


def write_volumes(out: Path, state: State, layout: Layout, principals: Iterable[str] = COMPOSE_PRINCIPALS,
                  owners: Mapping[str, int] | None = None,
                  redis_version: tuple[int, int] = REDIS_VERSION) -> list[Path]:
    """Write every consumer's folder under ``out`` from ``state`` (see the module's docstring)."""
    uid = {**OWNERS, **(owners or {})}
    w = Writer()
    secrets, files = state.secrets, state.files
    ca = files.ca_cert.read_bytes()
    admin_password = secrets.password(sec.ADMIN)

    kafka = w.folder(out / "kafka", uid["kafka"])
    w.file(kafka / "cluster-id", state.cluster_id, uid["kafka"])
    w.file(kafka / "scram-args", "\n".join(sec.storage_scram_args(secrets)) + "\n", uid["kafka"])
    w.file(kafka / "ca.pem", ca, uid["kafka"])
    w.file(kafka / "admin.properties",
           admin_client_properties(f"{layout.kafka_dir}/ca.pem", admin_password), uid["kafka"])
    properties = [*(controller_properties(layout, i) for i in range(len(layout.controllers))),
                  *(broker_properties(layout, i, admin_password) for i in range(len(layout.brokers)))]
    for name, text in zip(layout.nodes, properties, strict=True):
        node = w.folder(kafka / name, uid["kafka"])
        key, cert = state.broker_key(name).read_bytes(), state.broker_cert(name).read_bytes()
        w.file(node / "broker-keystore.pem", key + cert + ca, uid["kafka"])  # ssl.keystore.type=PEM
        w.file(node / "ca.pem", ca, uid["kafka"])
        w.file(node / "server.properties", text, uid["kafka"])

    redis = w.folder(out / "redis", uid["redis"])
    w.file(redis / "users.acl", sec.redis_acl_text(secrets, redis_version), uid["redis"])

    grafana = w.folder(out / "grafana", uid["grafana"])
    w.file(grafana / "admin-password", state.grafana_password, uid["grafana"])

    for principal in principals:
        folder = w.folder(out / principal, uid["kinfer"])
        w.file(folder / "ca.pem", ca, uid["kinfer"])
        w.file(folder / "password", secrets.password(principal), uid["kinfer"])
        if principal in SIGNERS:
            w.file(folder / "signing-secret", state.signing_secrets_text(), uid["kinfer"])
        else:
            (folder / "signing-secret").unlink(missing_ok=True)

    # The state itself: the setup job (kinfer's user) reads it.
    if w.chown:
        for path in [state.root, *state.root.rglob("*")]:
            os.chown(path, uid["kinfer"], uid["kinfer"])
    return w.written


# ---------------------------------------------------------------------------------------------
# Kafka: SCRAM credentials on a running cluster (KIP-554)


SCRAM_SHA_512 = 2  # org.apache.kafka.clients.admin.ScramMechanism


def _scram_request_class() -> Any:
    """AlterUserScramCredentials v0 (api key 51, flexible) in aiokafka's protocol classes, which
    has no such request of its own. Built on first use: aiokafka is imported lazily here."""
    from aiokafka.protocol.api import Request, RequestStruct, Response
    from aiokafka.protocol.types import (
        CompactArray,
        CompactBytes,
        CompactString,
        Int8,
        Int16,
        Int32,
        Schema,
        TaggedFields,
    )

    class AlterUserScramCredentialsResponse_v0(Response):  # type: ignore[misc]
        API_KEY = 51
        API_VERSION = 0
        SCHEMA = Schema(
            ("throttle_time_ms", Int32),
            ("results", CompactArray(("user", CompactString("utf-8")), ("error_code", Int16),
                                     ("error_message", CompactString("utf-8")), ("tags", TaggedFields))),
            ("tags", TaggedFields),
        )

    class AlterUserScramCredentialsRequest_v0(RequestStruct):  # type: ignore[misc]
        FLEXIBLE_VERSION = True
        API_KEY = 51
        API_VERSION = 0
        RESPONSE_TYPE = AlterUserScramCredentialsResponse_v0
        SCHEMA = Schema(
            ("deletions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8), ("tags", TaggedFields))),
            ("upsertions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8), ("iterations", Int32),
                                        ("salt", CompactBytes), ("salted_password", CompactBytes),
                                        ("tags", TaggedFields))),
            ("tags", TaggedFields),
        )

    class AlterUserScramCredentialsRequest(Request[AlterUserScramCredentialsRequest_v0]):  # type: ignore[misc]
        API_KEY = 51

        def __init__(self, upsertions: list[tuple[str, int, int, bytes, bytes]]):
            self._upsertions = upsertions

        def build(self, request_struct_class: type[AlterUserScramCredentialsRequest_v0]
                  ) -> AlterUserScramCredentialsRequest_v0:
            return request_struct_class([], [(*u, {}) for u in self._upsertions], {})

    return AlterUserScramCredentialsRequest


def scram_upsertions(passwords: Mapping[str, str], iterations: int = sec.SCRAM_ITERATIONS
                     ) -> list[tuple[str, int, int, bytes, bytes]]:
    """(user, mechanism, iterations, salt, salted password) per principal: a fresh salt each."""
    out = []
    for user, password in passwords.items():
        salt = os.urandom(32)
        out.append((user, SCRAM_SHA_512, iterations, salt, sec.scram_salted_password(password, salt, iterations)))
    return out


async def upsert_scram(bootstrap: str, options: dict[str, Any], passwords: Mapping[str, str]) -> int:
    """Set the SCRAM-SHA-512 credential of every user in ``passwords`` (as a super user: ``options``,
    ``{}`` for this process's environment). Returns how many."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.errors import KafkaError

    from kinfer.topics.connect import kafka_options, tls_closes_settled

    if not passwords:
        return 0
    request = _scram_request_class()(scram_upsertions(passwords))
    client = AIOKafkaClient(**kafka_options(bootstrap, request_timeout_ms=15_000, **options))
    try:
        await client.bootstrap()
        response = await client.send(client.get_random_node(), request)
        failed = [(user, code, message) for user, code, message, _ in response.results if code != 0]
        if failed:
            raise sec.SetupError(f"setting SCRAM credentials failed: {failed}")
        return len(passwords)
    except KafkaError as exc:
        raise sec.SetupError(f"setting SCRAM credentials on {bootstrap} failed: {exc}") from exc
    finally:
        await client.close()
        await tls_closes_settled()


def _admin_options(state: State) -> dict[str, Any]:
    from kinfer.topics.connect import KafkaAuth

    return KafkaAuth("SASL_SSL", "SCRAM-SHA-512", sec.ADMIN, state.secrets.password(sec.ADMIN),
                     str(state.files.ca_cert)).options()


async def setup(state: State, bootstrap: str, redis_url: str, models: Sequence[str] | None = None) -> dict[str, int]:
    """Make the running cluster and Redis match the state (as admin, from this process's environment)."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError


    scram = await upsert_scram(bootstrap, {}, state.secrets.passwords)
    acls = await sec.create_acls(bootstrap, {}, state.secrets.tenants, models or None)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.acl_load()
    except RedisError as exc:
        raise sec.SetupError(f"ACL LOAD on Redis failed: {exc}") from exc
    finally:
        await client.aclose()
    return {"scram_users": scram, "acls": acls}


async def change_password(state: State, principal: str, password: str, bootstrap: str, redis_url: str) -> None:
    """``principal``'s new password on the running Kafka and Redis, as admin (its current password)."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    await upsert_scram(bootstrap, _admin_options(state), {principal: password})
    client = aioredis.Redis.from_url(sec.redis_url_with_user(redis_url, sec.ADMIN, state.secrets.password(sec.ADMIN)))
    try:
        digest = hashlib.sha256(password.encode()).hexdigest()
        await client.acl_setuser(principal, enabled=True, reset_passwords=True, hashed_passwords=[f"+{digest}"])
    except RedisError as exc:
        raise sec.SetupError(f"changing {principal}'s password on Redis failed: {exc}") from exc
    finally:
        await client.aclose()


def with_password(state: State, principal: str, password: str) -> State:
    secrets = state.secrets
    secrets.password(principal)  # known, or ValueError
    new = sec.Secrets({**secrets.passwords, principal: password}, secrets.signing_secret, dict(secrets.tenants))
    sec.write_private(state.files.secrets, new.to_json())
    return load_state(state.root)


def rotate_signing_secret(state: State, drop_retired: bool = False) -> State:
    """A new current signing secret, the old one retired (still accepted); or drop the retired ones."""
    secrets = state.secrets
    retired: list[str] = [] if drop_retired else [secrets.signing_secret, *state.signing_retired]
    current = secrets.signing_secret if drop_retired else _random.token_hex(32)
    sec.write_private(state.files.secrets, sec.Secrets(dict(secrets.passwords), current,
                                                       dict(secrets.tenants)).to_json())
    sec.write_private(state.root / "signing-retired", "\n".join(retired) + ("\n" if retired else ""))
    return load_state(state.root)


# ---------------------------------------------------------------------------------------------
# The command line (the kinfer image: `python -m kinfer.ops.deploy.secure_init ...`)


def _pairs(values: Sequence[str], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        name, sep, number = value.partition("=")
        if not sep or not number.strip().lstrip("-").isdigit():
            raise ValueError(f"{what} expects NAME=NUMBER, got {value!r}")
        out[name] = int(number)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kinfer.ops.deploy.secure_init", description=__doc__.split("\n\n")[0])
    p.add_argument("--state", default="/secrets/state", help="the private state folder [%(default)s]")
    sub = p.add_subparsers(dest="action", required=True)

    def layout_args(q: argparse.ArgumentParser) -> None:
        d = Layout()
        q.add_argument("--broker", action="append", dest="brokers",
                       help=f"a broker's service name, in node id order (repeat) [{', '.join(d.brokers)}]")
        quorum = q.add_mutually_exclusive_group()
        quorum.add_argument("--controller", action="append", dest="controllers",
                            help=f"a KRaft controller's service name (repeat) [{', '.join(d.controllers)}]")
        quorum.add_argument("--combined", action="store_true",
                            help="no controllers of their own: each broker is a controller voter too")
        q.add_argument("--host-name", default=d.host_name, help="the HOST listener's advertised name [%(default)s]")
        q.add_argument("--host-port", type=int, default=d.host_port,
                       help="the first broker's HOST listener port; the next ones count up [%(default)s]")
        q.add_argument("--kafka-dir", default=d.kafka_dir, help="where brokers mount their volume [%(default)s]")

    i = sub.add_parser("init", help="create what is missing in the state, then write every consumer's volume")
    layout_args(i)
    i.add_argument("--out", default="/secrets", help="the volumes' parent folder [%(default)s]")
    i.add_argument("--tenant", action="append", default=[], metavar="NAME=BEST",
                   help="a tenant and its best priority (0, 1, 2); added if new [first run: demo=1]")
    i.add_argument("--principal", action="append", dest="principals", metavar="P",
                   help=f"principals that get a volume (repeat) [{', '.join(COMPOSE_PRINCIPALS)}]")
    i.add_argument("--owner", action="append", default=[], metavar="NAME=UID",
                   help=f"uid of a volume's reader ({', '.join(f'{k}={v}' for k, v in OWNERS.items())})")
    i.add_argument("--redis-version", default=".".join(map(str, REDIS_VERSION)),
                   help="the Redis server's major.minor, for its ACL rules [%(default)s]")

    s = sub.add_parser("setup", help="as admin (this environment): SCRAM users, the ACL table, Redis ACL LOAD")
    s.add_argument("--model", action="append", default=[],
                   help="models whose topics tenants get (default: every model the brokers list)")

    r = sub.add_parser("rotate", help="a new password (live on Kafka and Redis) or a new signing secret")
    layout_args(r)
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--principal", help="the principal whose password changes")
    what.add_argument("--signing-secret", action="store_true", help="a new current signing secret; the old one "
                                                                    "stays accepted")
    what.add_argument("--drop-retired", action="store_true", help="stop accepting retired signing secrets")
    r.add_argument("--bootstrap", help="the brokers as this container reaches them [the --broker names, port 9092]")
    r.add_argument("--redis-url", default="redis://redis:6379/0", help="[%(default)s]")

    e = sub.add_parser("env", help="a principal's environment for a client on the Docker host")
    layout_args(e)
    e.add_argument("--principal", required=True)
    e.add_argument("--redis-url", default="redis://localhost:6379/0", help="Redis as the host sees it [%(default)s]")
    e.add_argument("--ca-file", default="kinfer-ca.pem", help="where the host keeps `ca`'s output [%(default)s]")

    sub.add_parser("ca", help="print the CA certificate (clients trust it: KINFER_KAFKA_CA_FILE)")
    return p


def layout_from(args: argparse.Namespace) -> Layout:
    controllers = () if args.combined else tuple(args.controllers or Layout().controllers)
    return Layout(brokers=tuple(args.brokers or Layout().brokers), controllers=controllers, host_name=args.host_name,
                  host_port=args.host_port, kafka_dir=args.kafka_dir)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    state_dir = Path(args.state)
    try:
        if args.action == "init":
            layout = layout_from(args)
            major, _, minor = args.redis_version.partition(".")
            state = ensure_state(state_dir, layout, _pairs(args.tenant, "--tenant"))
            written = write_volumes(Path(args.out), state, layout, args.principals or COMPOSE_PRINCIPALS,
                                    _pairs(args.owner, "--owner"), (int(major), int(minor or 0)))
            print(f"secrets: {len(written)} files written for Kafka nodes {', '.join(layout.nodes)}; principals: "
                  f"{', '.join(state.secrets.principals)}")
        elif args.action == "setup":
            bootstrap, redis_url = os.environ.get("KINFER_BOOTSTRAP"), os.environ.get("KINFER_REDIS_URL")
            if not bootstrap or not redis_url:
                raise ValueError("setup needs KINFER_BOOTSTRAP and KINFER_REDIS_URL (admin's)")
            done = asyncio.run(setup(load_state(state_dir), bootstrap, redis_url, args.model))
            print(f"setup: {done['scram_users']} SCRAM users, {done['acls']} ACLs, Redis users reloaded")
        elif args.action == "rotate":
            state = load_state(state_dir)
            if args.principal:
                password = _random.token_hex(24)
                asyncio.run(change_password(state, args.principal, password,
                                            args.bootstrap or layout_from(args).bootstrap, args.redis_url))
                with_password(state, args.principal, password)
                print(f"rotate: {args.principal} has a new password on Kafka and Redis; `docker compose up -d` "
                      f"writes the volumes, then restart {args.principal}'s services")
            else:
                rotate_signing_secret(state, drop_retired=args.drop_retired)
                print("rotate: signing secrets changed; `docker compose up -d`, then restart the workers and "
                      "gateways" + ("" if args.drop_retired else ", then hand tenants their new keys (env)"))
        elif args.action == "env":
            state, layout = load_state(state_dir), layout_from(args)
            env = sec.principal_env(state.secrets, args.principal, layout.host_bootstrap, args.redis_url,
                                    args.ca_file)
            for key, value in env.items():
                print(f"export {key}={shlex.quote(value)}")
        elif args.action == "ca":
            sys.stdout.write(load_state(state_dir).files.ca_cert.read_text())
    except (sec.SetupError, ValueError, OSError) as exc:  # one line that says what is wrong, exit code 2
        print(f"kinfer.ops.deploy.secure_init {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

