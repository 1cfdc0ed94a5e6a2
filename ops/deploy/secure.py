"""The secure local stack's pure parts: secrets, certificates, Kafka's ACL table, Redis's ACL file.

``kinfer stack up --secure`` (``ops.localstack.stack``) runs Kafka with SASL/SCRAM-SHA-512 over TLS, an
authorizer and the ACLs below, and Redis with ACL users; this module decides *what* each principal
may do and writes the files, ``ops.localstack.stack`` starts the processes and applies the ACLs.

Everything secret lives in ``<home>/secure/`` (mode 0700, files 0600):

    ca.key, ca.pem                 the stack's own CA (clients trust ca.pem: KINFER_KAFKA_CA_FILE)
    broker.key, broker.pem         every node's key and certificate (SAN IP 127.0.0.1, DNS localhost),
    broker-keystore.pem            and both in one PEM file for Kafka (ssl.keystore.type=PEM)
    secrets.json                   a random password per principal, the request signing secret,
                                   the tenants and their best priority
    users.acl                      Redis's ACL file (passwords stored as SHA-256)

The same principals exist in Kafka (SCRAM users) and Redis (ACL users), with the same passwords:
``admin`` (super user: the operator, ``kinfer topics``, ``status``, ``infer``, ``bench``, the
stack's own checks), one per component (``kinfer-worker``, ``kinfer-lagmon``, ``kinfer-telemetry``,
``kinfer-autoscaler``, ``kinfer-gateway``) and one per tenant (``tenant-<name>``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import os
import re
import secrets as _random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from kinfer.topics.batches import BATCH_REPLY_PREFIX, BATCH_RUNNER_GROUP, BATCHES_TOPIC, FILES_TOPIC
from kinfer.topics.connect import kafka_options, tls_closes_settled
from kinfer.topics.health import HEALTH_TOPIC
from kinfer.topics.names import (
    DEFAULT_REPLY_TOPIC,
    DLQ_TOPIC,
    REPLY_TOPIC_PREFIX,
    REQUEST_PREFIX,
    WORKER_GROUP_PREFIX,
    Priority,
    request_topic,
)
from kinfer.topics.progress import ANSWERED_PREFIX
from kinfer.topics.residency import DEMAND_CHANNEL, RESIDENCY_KEY
from kinfer.topics.stats import STATS_TOPIC

ADMIN = "admin"
WORKER = "kinfer-worker"
LAGMON = "kinfer-lagmon"
TELEMETRY = "kinfer-telemetry"
AUTOSCALER = "kinfer-autoscaler"
GATEWAY = "kinfer-gateway"
SERVICE_PRINCIPALS = (ADMIN, WORKER, LAGMON, TELEMETRY, AUTOSCALER, GATEWAY)
TENANT_PREFIX = "tenant-"
DEFAULT_TENANTS: dict[str, int] = {"demo": 1}  # tenant -> its best priority (0 = may use p0)

# The nodes' certificate subject. On the controller listener (TLS with client certificates, see
# ``kafka_security_properties``) the nodes authenticate with it, as this principal.
BROKER_CN = "kinfer-broker"
BROKER_PRINCIPAL = f"User:CN={BROKER_CN}"
TELEMETRY_APP_ID = "kinfer-telemetry"  # faust's app id: its group and the prefix of its own topics

PRIORITIES = tuple(int(p) for p in Priority)

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def tenant_principal(tenant: str) -> str:
    return f"{TENANT_PREFIX}{check_tenant_name(tenant)}"


def check_tenant_name(tenant: str) -> str:
    """Tenant names end up in principals, Redis channel patterns and ACLs: no ':', '*', '.', ' '."""
    if not _NAME_RE.match(tenant):
        raise ValueError(f"tenant name {tenant!r} must match {_NAME_RE.pattern}")
    return tenant


# ---------------------------------------------------------------------------------------------
# Secrets


@dataclass(frozen=True, slots=True)
class Secrets:
    passwords: dict[str, str]  # principal -> password (Kafka SCRAM and Redis ACL alike)
    signing_secret: str  # hex, 32 bytes: requests are signed with keys derived from it (topics.auth)
    tenants: dict[str, int] = field(default_factory=dict)  # tenant -> best priority

    @classmethod
    def generate(cls, tenants: Mapping[str, int] | None = None) -> Secrets:
        tenants = dict(DEFAULT_TENANTS if tenants is None else tenants)
        for name, best in tenants.items():
            check_tenant_name(name)
            if best not in PRIORITIES:
                raise ValueError(f"tenant {name!r}: best priority must be 0, 1, 2 or 3, got {best}")
        principals = [*SERVICE_PRINCIPALS, *(tenant_principal(t) for t in tenants)]
        # Hex: safe unquoted in a JAAS line, a Redis ACL rule, a URL and StorageTool's --add-scram.
        return cls({p: _random.token_hex(24) for p in principals}, _random.token_hex(32), tenants)

    @classmethod
    def from_json(cls, text: str) -> Secrets:
        data = json.loads(text)
        return cls(dict(data["passwords"]), str(data["signing_secret"]),
                   {str(k): int(v) for k, v in data.get("tenants", {}).items()})

    def to_json(self) -> str:
        return json.dumps({"passwords": self.passwords, "signing_secret": self.signing_secret,
                           "tenants": self.tenants}, indent=2, sort_keys=True) + "\n"

    @property
    def principals(self) -> list[str]:
        return list(self.passwords)

    def password(self, principal: str) -> str:
        try:
            return self.passwords[principal]
        except KeyError:
            raise ValueError(f"unknown principal {principal!r}; known: {', '.join(self.passwords)}") from None

    def tenant_of(self, principal: str) -> str | None:
        """The tenant a ``tenant-<name>`` principal acts for (None for the others)."""
        if principal.startswith(TENANT_PREFIX) and principal[len(TENANT_PREFIX):] in self.tenants:
            return principal[len(TENANT_PREFIX):]
        return None

    def fingerprint(self) -> str:
        """Changes whenever a Kafka SCRAM credential would (the storage is formatted with them)."""
        return hashlib.sha256(json.dumps(self.passwords, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class SecureFiles:
    root: Path

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def broker_key(self) -> Path:
        return self.root / "broker.key"

    @property
    def broker_cert(self) -> Path:
        return self.root / "broker.pem"

    @property
    def keystore(self) -> Path:
        return self.root / "broker-keystore.pem"

    @property
    def secrets(self) -> Path:
        return self.root / "secrets.json"

    @property
    def redis_acl(self) -> Path:
        return self.root / "users.acl"

    def load_secrets(self) -> Secrets:
        return Secrets.from_json(self.secrets.read_text())


def write_private(path: Path, data: bytes | str) -> None:
    """Write ``path`` readable by its owner only (0600), whatever the umask and whatever it was."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, raw)
    finally:
        os.close(fd)


def ensure_secure_dir(root: Path, tenants: Mapping[str, int] | None = None) -> tuple[SecureFiles, Secrets]:
    """Create what is missing under ``root`` (secrets, CA, broker certificate); keep what exists.

    A broker certificate within 30 days of its end is issued again from the same CA (clients keep
    trusting ca.pem). Returns the files and the secrets.
    """
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    files = SecureFiles(root)
    if files.secrets.exists():
        found = files.load_secrets()
    else:
        found = Secrets.generate(tenants)
        write_private(files.secrets, found.to_json())
    if not (files.ca_key.exists() and files.ca_cert.exists()):
        ca_key_pem, ca_cert_pem = make_ca()
        write_private(files.ca_key, ca_key_pem)
        write_private(files.ca_cert, ca_cert_pem)
        files.broker_cert.unlink(missing_ok=True)  # signed by the old CA: issue it again
    if not (files.broker_key.exists() and files.broker_cert.exists() and files.keystore.exists()
            and _valid_for(files.broker_cert.read_bytes(), dt.timedelta(days=30))):
        key_pem, cert_pem = make_broker_cert(files.ca_key.read_bytes(), files.ca_cert.read_bytes())
        write_private(files.broker_key, key_pem)
        write_private(files.broker_cert, cert_pem)
        write_private(files.keystore, key_pem + cert_pem + files.ca_cert.read_bytes())
    for path in root.iterdir():  # whatever was there before, or copied in with another mode
        if path.is_file():
            os.chmod(path, 0o600)
    return files, found


def redis_url_with_user(url: str, principal: str, password: str) -> str:
    """``url`` (``redis://host:port/db``) with ``principal``'s user and password in it."""
    parts = urlparse(url)
    netloc = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{quote(principal, safe='')}:{quote(password, safe='')}@{netloc}").geturl()


def principal_env(secrets: Secrets, principal: str, bootstrap: str, redis_url: str, ca_file: str) -> dict[str, str]:
    """The environment of a process acting as ``principal`` (kinfer reads nothing else).

    Redis's URL with the principal's user and password, ``KINFER_KAFKA_*`` (SASL_SSL, SCRAM-SHA-512,
    user, password, ``ca_file``), ``KINFER_SIGNING_SECRET`` for those that sign or check requests
    (the worker, the gateway, admin), and for a tenant ``KINFER_TENANT`` and its request key
    ``KINFER_TENANT_KEY``. An unknown principal is a ``ValueError``.
    """
    from kinfer.topics.auth import TenantCredential
    from kinfer.topics.connect import KafkaAuth

    password = secrets.password(principal)
    out = {"KINFER_BOOTSTRAP": bootstrap, "KINFER_REDIS_URL": redis_url_with_user(redis_url, principal, password),
           **KafkaAuth("SASL_SSL", "SCRAM-SHA-512", principal, password, ca_file).env()}
    if principal in (WORKER, GATEWAY, ADMIN):
        out["KINFER_SIGNING_SECRET"] = secrets.signing_secret
    tenant = secrets.tenant_of(principal)
    if tenant is not None:
        out["KINFER_TENANT"] = tenant
        out["KINFER_TENANT_KEY"] = str(TenantCredential.derive(bytes.fromhex(secrets.signing_secret), tenant))
    return out


# ---------------------------------------------------------------------------------------------
# Certificates (cryptography)


def make_ca(days: int = 3650) -> tuple[bytes, bytes]:
    """A fresh CA: (PKCS#8 key PEM, certificate PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kinfer local stack CA")])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def make_broker_cert(ca_key_pem: bytes, ca_cert_pem: bytes, days: int = 825,
                     dns_names: Sequence[str] = ("localhost",),
                     ips: Sequence[str] = ("127.0.0.1",)) -> tuple[bytes, bytes]:
    """The nodes' certificate, signed by the CA: server (client listener, controller listener) and
    client (a node dialling the controllers) alike, valid for ``dns_names`` and ``ips`` (the local
    stack's: localhost and 127.0.0.1; a compose broker's: its service name too).
    Returns (PKCS#8 key PEM, certificate PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the stack's CA key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([*(x509.DNSName(n) for n in dns_names),
                                                    *(x509.IPAddress(ipaddress.ip_address(a)) for a in ips)]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    assert isinstance(key, ec.EllipticCurvePrivateKey)
    # Unencrypted PKCS#8 ("BEGIN PRIVATE KEY"): what Kafka's PEM keystore reads without ssl.key.password.
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _valid_for(cert_pem: bytes, margin: dt.timedelta) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return False
    return cert.not_valid_after_utc - margin > dt.datetime.now(dt.UTC)


# ---------------------------------------------------------------------------------------------
# Kafka: the brokers' security settings


CLIENT_LISTENER = "CLIENT"
CONTROLLER_LISTENER = "CONTROLLER"


def kafka_security_properties(files: SecureFiles, admin_password: str | None,
                              extra_listeners: Sequence[str] = ()) -> list[str]:
    """The lines a secure node's server.properties adds (listeners themselves are the caller's).

    * CLIENT (clients, and broker to broker): SASL_SSL with SCRAM-SHA-512. The nodes talk to each
      other on it as ``admin`` (a super user), whose SCRAM credential is written at format time.
    * CONTROLLER: TLS with *required client certificates* from the stack's CA. KRaft cannot use
      SCRAM there (SCRAM credentials live in the metadata log the controllers serve); of the two
      choices left, mutual TLS needs no shared password in every properties file, and only a holder
      of a CA-signed certificate (the nodes: the CA key never leaves ``secure/``) gets past the
      handshake; everyone else, clients with valid SCRAM passwords included, is refused there.
      The nodes' principal on it is ``User:CN=kinfer-broker``, a super user.
    * StandardAuthorizer, nothing allowed without an ACL (``allow.everyone.if.no.acl.found=false``).
    * ``extra_listeners``: more listeners like CLIENT for clients only (no broker dials them, so
      their login module holds no password), e.g. compose's HOST listener for the host's clients.
    * ``admin_password`` None: a controller of its own, which has the CONTROLLER listener alone and
      dials no broker: no SASL lines, and no password in its file.
    """
    tls = [
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={files.keystore}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={files.ca_cert}",
        "ssl.endpoint.identification.algorithm=https",  # a node checks the SAN of the one it dials
        f"listener.name.{CONTROLLER_LISTENER.lower()}.ssl.client.auth=required",
    ]
    authorizer = [
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        f"super.users=User:{ADMIN};{BROKER_PRINCIPAL}",
    ]
    if admin_password is None:
        return [f"listener.security.protocol.map={CONTROLLER_LISTENER}:SSL", *tls, *authorizer]
    jaas = (f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" '
            f'password="{admin_password}";')
    extra: list[str] = []
    for name in extra_listeners:
        extra += [f"listener.name.{name.lower()}.scram-sha-512.sasl.jaas.config="
                  "org.apache.kafka.common.security.scram.ScramLoginModule required;",
                  f"listener.name.{name.lower()}.ssl.client.auth=none"]
    protocols = ",".join([f"{CLIENT_LISTENER}:SASL_SSL", *(f"{n}:SASL_SSL" for n in extra_listeners),
                          f"{CONTROLLER_LISTENER}:SSL"])
    return [
        f"listener.security.protocol.map={protocols}",
        f"inter.broker.listener.name={CLIENT_LISTENER}",
        "sasl.enabled.mechanisms=SCRAM-SHA-512",
        "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
        f"listener.name.{CLIENT_LISTENER.lower()}.scram-sha-512.sasl.jaas.config={jaas}",
        *tls,
        f"listener.name.{CLIENT_LISTENER.lower()}.ssl.client.auth=none",
        *extra,
        *authorizer,
    ]


SCRAM_ITERATIONS = 8192  # Kafka accepts 4096..16384


def scram_salted_password(password: str, salt: bytes, iterations: int = SCRAM_ITERATIONS) -> bytes:
    """SCRAM-SHA-512's SaltedPassword (RFC 5802: Hi(password, salt, i) is PBKDF2-HMAC), what Kafka's
    AlterUserScramCredentials takes with the salt and the iterations (KIP-554): the broker derives
    the stored and server keys from it, and the password itself never travels."""
    return hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)


def storage_scram_args(secrets: Secrets) -> list[str]:
    """StorageTool ``format`` arguments creating every principal's SCRAM-SHA-512 credential (KIP-900)."""
    args: list[str] = []
    for principal, password in secrets.passwords.items():
        args += ["--add-scram", f"SCRAM-SHA-512=[name={principal},password={password}]"]
    return args


# ---------------------------------------------------------------------------------------------
# Kafka: the ACL table


@dataclass(frozen=True, slots=True, order=True)
class Acl:
    """One ACL binding, spelled as Kafka's AclCommand and the CreateAcls API spell it."""

    principal: str  # "User:<name>"
    resource: str  # TOPIC, GROUP, CLUSTER, TRANSACTIONAL_ID
    name: str  # "kafka-cluster" for the cluster
    pattern: str  # LITERAL or PREFIXED
    operation: str  # READ, WRITE, DESCRIBE, CREATE, ALL, IDEMPOTENT_WRITE, ...
    permission: str = "ALLOW"  # or DENY
    host: str = "*"


CLUSTER = "kafka-cluster"
# Kafka's wire codes (org.apache.kafka.common.{resource,acl}).
RESOURCE_TYPES = {"TOPIC": 2, "GROUP": 3, "CLUSTER": 4, "TRANSACTIONAL_ID": 5}
PATTERN_TYPES = {"LITERAL": 3, "PREFIXED": 4}
OPERATIONS = {"ALL": 2, "READ": 3, "WRITE": 4, "CREATE": 5, "DELETE": 6, "ALTER": 7, "DESCRIBE": 8,
              "CLUSTER_ACTION": 9, "DESCRIBE_CONFIGS": 10, "ALTER_CONFIGS": 11, "IDEMPOTENT_WRITE": 12}
PERMISSIONS = {"DENY": 2, "ALLOW": 3}


def _user(principal: str) -> str:
    return f"User:{principal}"


def _grant(principal: str, resource: str, name: str, pattern: str, *operations: str) -> list[Acl]:
    return [Acl(_user(principal), resource, name, pattern, op) for op in operations]


def service_acls(telemetry_app_id: str = TELEMETRY_APP_ID) -> list[Acl]:
    """What each component may do on Kafka. ``admin`` is a super user and needs none.

    Reading a topic implies describing it, writing too; committing a group's offsets takes READ on
    the group, fetching them (lag) only DESCRIBE: so only the worker can commit ``kinfer.worker.*``.
    Idempotent producers need no IDEMPOTENT_WRITE where they may WRITE some topic (KIP-679).
    """
    acls = [
        # The worker: consumes the request topics in its group, answers, dead-letters, reports.
        *_grant(WORKER, "TOPIC", REQUEST_PREFIX, "PREFIXED", "READ", "DESCRIBE"),
        *_grant(WORKER, "GROUP", WORKER_GROUP_PREFIX, "PREFIXED", "READ"),
        *_grant(WORKER, "TOPIC", REPLY_TOPIC_PREFIX, "PREFIXED", "WRITE", "DESCRIBE"),
        *_grant(WORKER, "TOPIC", DLQ_TOPIC, "LITERAL", "WRITE"),
        *_grant(WORKER, "TOPIC", STATS_TOPIC, "LITERAL", "WRITE", "DESCRIBE"),
        # The lag monitor: log-end offsets (ListOffsets: DESCRIBE), the workers' committed offsets
        # (OffsetFetch: DESCRIBE on group and topic), and the health topic, which it creates if missing.
        *_grant(LAGMON, "TOPIC", REQUEST_PREFIX, "PREFIXED", "DESCRIBE"),
        *_grant(LAGMON, "GROUP", WORKER_GROUP_PREFIX, "PREFIXED", "DESCRIBE"),
        *_grant(LAGMON, "TOPIC", HEALTH_TOPIC, "LITERAL", "WRITE", "DESCRIBE", "CREATE"),
        # The autoscaler reads what the lag monitor reads, and writes nothing to Kafka.
        *_grant(AUTOSCALER, "TOPIC", REQUEST_PREFIX, "PREFIXED", "DESCRIBE"),
        *_grant(AUTOSCALER, "GROUP", WORKER_GROUP_PREFIX, "PREFIXED", "DESCRIBE"),
        # Telemetry (faust): reads kinfer.stats; owns its group, changelog and internal topics, all
        # named after its app id (<app id>-<table>-changelog, <app id>-__assignor-__leader, ...).
        *_grant(TELEMETRY, "TOPIC", STATS_TOPIC, "LITERAL", "READ", "DESCRIBE"),
        *_grant(TELEMETRY, "TOPIC", telemetry_app_id, "PREFIXED", "ALL"),
        *_grant(TELEMETRY, "GROUP", telemetry_app_id, "PREFIXED", "ALL"),
        # The gateway writes requests for every tenant (it signs each with the tenant's key; workers
        # check) and reads the default reply topic by assigned partitions (no group).
        *_grant(GATEWAY, "TOPIC", REQUEST_PREFIX, "PREFIXED", "WRITE", "DESCRIBE"),
        *_grant(GATEWAY, "TOPIC", DEFAULT_REPLY_TOPIC, "LITERAL", "READ", "DESCRIBE"),
        # The Batch API: its files and batches, each batch's reply topic (made, read, deleted), and the
        # group whose one member drives the batches.
        *_grant(GATEWAY, "TOPIC", FILES_TOPIC, "LITERAL", "READ", "WRITE", "DESCRIBE"),
        *_grant(GATEWAY, "TOPIC", BATCHES_TOPIC, "LITERAL", "READ", "WRITE", "DESCRIBE"),
        *_grant(GATEWAY, "TOPIC", BATCH_REPLY_PREFIX, "PREFIXED", "CREATE", "READ", "DELETE", "DESCRIBE"),
        *_grant(GATEWAY, "GROUP", BATCH_RUNNER_GROUP, "LITERAL", "READ"),
    ]
    return acls


def tenant_acls(tenant: str, best: int, models: Iterable[str]) -> list[Acl]:
    """A tenant's own client: writes the request topics its best priority allows, reads replies.

    Priority is a topic-name suffix (``infer.<model>.pN``), which a prefix cannot express: a tenant
    allowed p0 gets the prefix ``infer.`` (every model, present and future; the DLQ denied), any
    other one a literal ACL per model topic ``infer.<model>.pN``, N >= its best, for the ``models``
    given. Those are the models that exist when the ACLs are applied: a model created later needs
    them applied again (``ops.localstack.stack.apply_tenant_acls``; ``kinfer topics`` and ``kinfer stack acls``
    do). IDEMPOTENT_WRITE on the cluster lets its idempotent producer start before any model exists.
    """
    principal = tenant_principal(tenant)
    if best not in PRIORITIES:
        raise ValueError(f"tenant {tenant!r}: best priority must be 0, 1 or 2, got {best}")
    acls = [
        *_grant(principal, "TOPIC", DEFAULT_REPLY_TOPIC, "LITERAL", "READ", "DESCRIBE"),
        *_grant(principal, "CLUSTER", CLUSTER, "LITERAL", "IDEMPOTENT_WRITE"),
    ]
    if best == 0:
        acls += _grant(principal, "TOPIC", REQUEST_PREFIX, "PREFIXED", "WRITE", "DESCRIBE")
        acls.append(Acl(_user(principal), "TOPIC", DLQ_TOPIC, "LITERAL", "WRITE", "DENY"))
    else:
        for model in sorted(set(models)):
            for p in PRIORITIES[best:]:
                acls += _grant(principal, "TOPIC", request_topic(model, p), "LITERAL", "WRITE", "DESCRIBE")
    return acls


def kafka_acls(tenants: Mapping[str, int], models: Iterable[str] = (),
               telemetry_app_id: str = TELEMETRY_APP_ID) -> list[Acl]:
    """The whole table: every component's ACLs and every tenant's for ``models``."""
    models = list(models)
    acls = service_acls(telemetry_app_id)
    for tenant, best in tenants.items():
        acls += tenant_acls(tenant, best, models)
    return acls


_IMPLIES_DESCRIBE = {"READ", "WRITE", "DELETE", "ALTER"}


def allowed(acls: Iterable[Acl], principal: str, resource: str, name: str, operation: str,
            super_users: Iterable[str] = (f"User:{ADMIN}", BROKER_PRINCIPAL)) -> bool:
    """What Kafka's StandardAuthorizer decides for this table (super users, DENY over ALLOW,
    LITERAL and PREFIXED names, ALL, and DESCRIBE implied by READ/WRITE/DELETE/ALTER). For tests."""
    if not principal.startswith("User:"):
        principal = _user(principal)
    if principal in set(super_users):
        return True
    verdict = False
    for acl in acls:
        if acl.principal not in (principal, "User:*") or acl.resource != resource:
            continue
        if acl.pattern == "LITERAL" and acl.name not in (name, "*"):
            continue
        if acl.pattern == "PREFIXED" and not name.startswith(acl.name):
            continue
        implied = (acl.operation in (operation, "ALL")
                   or (operation == "DESCRIBE" and acl.operation in _IMPLIES_DESCRIBE)
                   or (operation == "DESCRIBE_CONFIGS" and acl.operation == "ALTER_CONFIGS"))
        if not implied:
            continue
        if acl.permission == "DENY":
            return False
        verdict = True
    return verdict


# ---------------------------------------------------------------------------------------------
# Redis: the ACL file


# Every user may authenticate, ping and name its connection, and leave pub/sub channels.
# CLIENT SETINFO (redis-py sends it on connect, ignoring a refusal) exists from Redis 7.2 on; an
# ACL rule naming it would not load on 7.0.
_BASE = ["-@all", "+auth", "+hello", "+ping", "+client|setname", "+unsubscribe", "+punsubscribe"]


def _sha(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def redis_rules(secrets: Secrets, version: tuple[int, int] = (7, 0)) -> dict[str, list[str]]:
    """Each Redis user's rules (after ``on #<sha256>``), by principal.

    Root rules hold the commands and keys; each channel command gets its own selector ``(...)``
    (Redis >= 7.0), so "may publish on X" does not also mean "may subscribe to X" and the reverse.
    """
    base = [*_BASE, *(["+client|setinfo"] if version >= (7, 2) else [])]
    reply_any = "&kinfer:reply:*"
    residency, answered, demand = f"~{RESIDENCY_KEY}", f"~{ANSWERED_PREFIX}*", f"&{DEMAND_CHANNEL}"
    rules: dict[str, list[str]] = {
        ADMIN: ["~*", "&*", "+@all"],
        # Replies to every client's channel; cancellations and cold models' demand notes in; the
        # residency and answered hashes (Redis ACLs cannot confine a worker to its own field of them:
        # workers are trusted).
        WORKER: [*base, residency, answered, "+hset", "+hdel", f"(+publish {reply_any})",
                 f"(+subscribe &kinfer:cancel {demand})"],
        # Reads telemetry summaries and the residency and answered hashes (forgets dead workers'
        # entries), writes the health state, its notification and the decisions list.
        LAGMON: [*base, "%R~kinfer:stats:*", "~kinfer:health:*", "~kinfer:decisions", residency, answered,
                 "+get", "+set", "+lpush", "+ltrim", "+hscan", "+hdel", "(+publish &kinfer:health)"],
        TELEMETRY: [*base, "~kinfer:stats:*", "+set"],
        # It runs the lag monitor's poll too: the residency and answered hashes read, not pruned.
        AUTOSCALER: [*base, "%R~kinfer:stats:*", "%R~kinfer:health:*", "~kinfer:autoscale:*", f"%R{residency}",
                     f"%R{answered}", "+get", "+set", "+lpush", "+ltrim", "+hscan"],
        # Its own reply channels and health notifications in, cancellations out, health keys read;
        # its shared per-tenant rate-limit buckets (producers.ratelimit: one Lua script, run by
        # EVALSHA, loaded by SCRIPT LOAD, whose calls Redis checks against these rules too).
        GATEWAY: [*base, "%R~kinfer:health:*", "~kinfer:ratelimit:*", "+get",
                  "+evalsha", "+script|load", "+time", "+hmget", "+hset", "+pexpire",
                  "(+subscribe &kinfer:reply:gateway:* &kinfer:health)", f"(+publish &kinfer:cancel {demand})"],
    }
    for tenant in secrets.tenants:
        rules[tenant_principal(tenant)] = [
            *base, "%R~kinfer:health:*", "+get",
            f"(+subscribe &kinfer:reply:{tenant}:* &kinfer:health)", f"(+publish &kinfer:cancel {demand})",
        ]
    return rules


def redis_acl_text(secrets: Secrets, version: tuple[int, int] = (7, 0)) -> str:
    """The file ``redis-server --aclfile`` loads: ``default`` off, one user per principal."""
    lines = ["user default off resetpass resetkeys resetchannels -@all"]
    for principal, rules in redis_rules(secrets, version).items():
        lines.append(" ".join(["user", principal, "on", "resetpass", f"#{_sha(secrets.password(principal))}",
                               "resetkeys", "resetchannels", *rules]))
    return "\n".join(lines) + "\n"


def redis_version(text: str) -> tuple[int, int]:
    """(major, minor) from ``redis-server --version`` ("Redis server v=7.0.15 sha=..."); (7, 0) if unknown."""
    found = re.search(r"v=(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (7, 0)


class SetupError(RuntimeError):
    """A cluster could not be set up as asked: ACLs, credentials, users."""


async def create_acls(bootstrap: str, options: dict[str, Any], tenants: Mapping[str, int],
                      models: Iterable[str] | None = None, acls: Iterable[Acl] | None = None) -> int:
    """Create ``acls`` on the cluster at ``bootstrap`` with the security ``options`` of a super user
    (``topics.connect`` settings; ``{}``: this process's environment). Default: the whole table of
    ``kafka_acls`` for ``tenants`` and ``models``, default: the models whose request
    topics the brokers list now. Creating an ACL that exists changes nothing. Returns how many."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.errors import KafkaError
    from aiokafka.protocol.admin import CreateAclsRequest

    from kinfer.topics.names import served_models

    client = AIOKafkaClient(**kafka_options(bootstrap, request_timeout_ms=15_000, **options))
    try:
        await client.bootstrap()
        if acls is None:
            if models is None:
                models = served_models((await client.fetch_all_metadata()).topics())
            acls = kafka_acls(tenants, models)
        table = list(acls)
        for acl in table:
            request = CreateAclsRequest(RESOURCE_TYPES[acl.resource], acl.name, PATTERN_TYPES[acl.pattern],
                                        acl.principal, acl.host, OPERATIONS[acl.operation],
                                        PERMISSIONS[acl.permission])
            response = await client.send(client.get_random_node(), request)
            for code, message in response.creation_responses:
                if code != 0:
                    raise SetupError(f"creating ACL {acl} failed: error {code} {message}")
        return len(table)
    except KafkaError as exc:
        raise SetupError(f"applying ACLs on {bootstrap} failed: {exc}") from exc
    finally:
        await client.close()
        await tls_closes_settled()


# A KRaft controller of its own (not a broker too) has node id 101, 102, ...: never a broker's.
CONTROLLER_IDS = 100

# How fast a replicated cluster gets over a broker that died or stalls (Kafka's defaults: 9 s to fence a
# broker that stopped heartbeating, 30 s before a stalled follower leaves the in-sync set). With acks=all,
# every partition that broker follows waits on it until then: with three brokers, every partition. These
# are what ``docs/operations.md`` states for a deployment; the compose file sets the same.
FAILOVER_PROPERTIES = (
    "broker.heartbeat.interval.ms=500",
    "broker.session.timeout.ms=3000",
    "replica.lag.time.max.ms=500",
    "replica.fetch.wait.max.ms=100",
)
