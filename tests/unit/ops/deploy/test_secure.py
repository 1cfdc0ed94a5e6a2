"""The secure stack's pure parts: the Kafka ACL table, the Redis ACL file, secrets and certificates."""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kinfer.ops.deploy import secure as sec
from kinfer.ops.localstack.stack import StackInfo, apply_stack_env, resolve_endpoints
from kinfer.topics.health import HEALTH_TOPIC
from kinfer.topics.names import (
    DEFAULT_REPLY_TOPIC,
    DLQ_TOPIC,
    REQUEST_PREFIX,
    consumer_group,
    request_topic,
)
from kinfer.topics.stats import STATS_TOPIC

MODELS = ["minilm", "noop"]
TENANTS = {"fast": 0, "demo": 1, "bulk": 2}
SERVICES = [sec.WORKER, sec.LAGMON, sec.TELEMETRY, sec.AUTOSCALER, sec.GATEWAY]
EVERYONE = [*SERVICES, *(sec.tenant_principal(t) for t in TENANTS)]
TABLE = sec.kafka_acls(TENANTS, MODELS)


def may(principal: str, operation: str, name: str, resource: str = "TOPIC") -> bool:
    return sec.allowed(TABLE, principal, resource, name, operation)


def test_every_record_is_one_kafka_can_create() -> None:
    for acl in TABLE:
        assert acl.principal.startswith("User:") and acl.principal != "User:admin"
        assert acl.resource in sec.RESOURCE_TYPES and acl.pattern in sec.PATTERN_TYPES
        assert acl.operation in sec.OPERATIONS and acl.permission in sec.PERMISSIONS
        assert acl.name and (acl.resource != "CLUSTER" or acl.name == sec.CLUSTER)
    assert len(set(TABLE)) == len(TABLE)


def test_a_tenant_writes_only_the_priorities_its_ceiling_allows() -> None:
    for model in [*MODELS, "not-listed"]:
        topics = [request_topic(model, p) for p in sec.PRIORITIES]
        assert [may("tenant-fast", "WRITE", t) for t in topics] == [True, True, True, True]  # p0: the prefix
        listed = model in MODELS
        assert [may("tenant-demo", "WRITE", t) for t in topics] == [False, listed, listed, listed]
        assert [may("tenant-bulk", "WRITE", t) for t in topics] == [False, False, listed, listed]
    # A p2 tenant has no ACL at all on any p0 or p1 topic (not even DESCRIBE: it cannot tell they exist).
    for acl in sec.tenant_acls("bulk", 2, MODELS):
        assert not acl.name.endswith((".p0", ".p1")) and acl.name != REQUEST_PREFIX
    # The p0 tenant's prefix does not reach the DLQ.
    assert not may("tenant-fast", "WRITE", DLQ_TOPIC)


def test_tenants_read_replies_and_nothing_else() -> None:
    for t in TENANTS:
        principal = sec.tenant_principal(t)
        assert may(principal, "READ", DEFAULT_REPLY_TOPIC)
        assert not may(principal, "WRITE", DEFAULT_REPLY_TOPIC)
        assert not any(may(principal, "READ", request_topic(m, p)) for m in MODELS for p in sec.PRIORITIES)
        for topic in (STATS_TOPIC, HEALTH_TOPIC, DLQ_TOPIC):
            assert not may(principal, "READ", topic)
        assert not may(principal, "READ", consumer_group("minilm"), "GROUP")


def test_only_the_worker_reads_requests_and_commits_its_group() -> None:
    group = consumer_group("minilm")
    for principal in EVERYONE:
        is_worker = principal == sec.WORKER
        assert may(principal, "READ", request_topic("minilm", 0)) == is_worker
        assert may(principal, "READ", group, "GROUP") == is_worker  # OffsetCommit and JoinGroup need READ
    # The lag monitor and the autoscaler fetch the group's offsets and the topics' ends.
    for principal in (sec.LAGMON, sec.AUTOSCALER):
        assert may(principal, "DESCRIBE", group, "GROUP")
        assert may(principal, "DESCRIBE", request_topic("minilm", 2))
        assert not may(principal, "WRITE", request_topic("minilm", 2))
    assert may(sec.WORKER, "WRITE", DLQ_TOPIC) and may(sec.WORKER, "WRITE", "replies.anything")
    assert may(sec.WORKER, "WRITE", STATS_TOPIC)
    assert not may(sec.WORKER, "WRITE", request_topic("minilm", 0))


def test_only_the_lag_monitor_writes_health_and_only_the_worker_stats() -> None:
    assert [p for p in EVERYONE if may(p, "WRITE", HEALTH_TOPIC)] == [sec.LAGMON]
    assert [p for p in EVERYONE if may(p, "WRITE", STATS_TOPIC)] == [sec.WORKER]
    assert [p for p in EVERYONE if may(p, "READ", STATS_TOPIC)] == [sec.TELEMETRY]
    assert may(sec.LAGMON, "CREATE", HEALTH_TOPIC)  # it creates the topic when missing


def test_telemetry_owns_its_prefix_and_nothing_more() -> None:
    for name in ("kinfer-telemetry-inputs-changelog", "kinfer-telemetry-__assignor-__leader"):
        for op in ("READ", "WRITE", "CREATE", "DESCRIBE_CONFIGS"):
            assert may(sec.TELEMETRY, op, name)
    assert may(sec.TELEMETRY, "READ", "kinfer-telemetry", "GROUP")
    assert not may(sec.TELEMETRY, "READ", consumer_group("minilm"), "GROUP")
    assert not may(sec.TELEMETRY, "WRITE", HEALTH_TOPIC)
    assert sec.allowed(sec.service_acls("other-app"), sec.TELEMETRY, "TOPIC", "other-app-x", "WRITE")


def test_the_gateway_writes_requests_and_reads_the_default_replies() -> None:
    assert all(may(sec.GATEWAY, "WRITE", request_topic(m, p)) for m in MODELS for p in sec.PRIORITIES)
    assert may(sec.GATEWAY, "READ", DEFAULT_REPLY_TOPIC) and not may(sec.GATEWAY, "READ", "replies.other")
    assert not may(sec.GATEWAY, "READ", request_topic("minilm", 0))
    assert not any(may(sec.GATEWAY, "READ", g, "GROUP") for g in (consumer_group("minilm"), "anything"))


def test_nobody_but_admin_administers() -> None:
    for principal in EVERYONE:
        for op in ("ALTER", "ALTER_CONFIGS", "CREATE", "DELETE", "CLUSTER_ACTION"):
            assert not may(principal, op, sec.CLUSTER, "CLUSTER")
        assert not may(principal, "DELETE", request_topic("minilm", 1))
        assert not may(principal, "CREATE", request_topic("minilm", 1))
    assert may("admin", "ALTER", sec.CLUSTER, "CLUSTER")  # a super user
    assert sec.allowed(TABLE, sec.BROKER_PRINCIPAL, "CLUSTER", sec.CLUSTER, "CLUSTER_ACTION")


def test_allowed_follows_kafkas_rules() -> None:
    acls = [sec.Acl("User:a", "TOPIC", "x.", "PREFIXED", "READ"),
            sec.Acl("User:a", "TOPIC", "x.secret", "LITERAL", "READ", "DENY")]
    assert sec.allowed(acls, "a", "TOPIC", "x.y", "READ") and sec.allowed(acls, "a", "TOPIC", "x.y", "DESCRIBE")
    assert not sec.allowed(acls, "a", "TOPIC", "x.y", "WRITE")
    assert not sec.allowed(acls, "a", "TOPIC", "x.secret", "READ")  # DENY wins
    assert not sec.allowed(acls, "a", "TOPIC", "y.x", "READ") and not sec.allowed(acls, "b", "TOPIC", "x.y", "READ")
    assert not sec.allowed(acls, "a", "GROUP", "x.y", "READ")


def test_tenant_names_are_checked() -> None:
    for bad in ("Demo", "a:b", "a*", "a.b", "", "-x"):
        with pytest.raises(ValueError):
            sec.tenant_principal(bad)
    with pytest.raises(ValueError):
        sec.tenant_acls("demo", 4, MODELS)


# ---------------------------------------------------------------------------------------------
# Redis


def _user_line(text: str, principal: str) -> str:
    return next(line for line in text.splitlines() if line.split()[:2] == ["user", principal])


def test_redis_acl_file_disables_default_and_stores_no_password() -> None:
    secrets = sec.Secrets.generate(TENANTS)
    text = sec.redis_acl_text(secrets)
    assert text.splitlines()[0].startswith("user default off")
    assert {line.split()[1] for line in text.splitlines()} == {"default", *secrets.passwords}
    for principal, password in secrets.passwords.items():
        assert password not in text
        assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in _user_line(text, principal)


def test_redis_rules_per_principal() -> None:
    text = sec.redis_acl_text(sec.Secrets.generate(TENANTS))
    tenant = _user_line(text, "tenant-demo")
    assert "(+subscribe &kinfer:reply:demo:* &kinfer:health)" in tenant
    assert "(+publish &kinfer:cancel &kinfer:demand)" in tenant  # cancels, and demand notes for cold models
    assert "&kinfer:reply:*" not in tenant and "+pubsub" not in tenant and "+@" not in tenant.replace("-@all", "")
    assert "%R~kinfer:health:*" in tenant and "+set" not in tenant
    # Nobody but the lag monitor publishes health; nobody but admin may list channels.
    for principal in [*SERVICES, *(sec.tenant_principal(t) for t in TENANTS)]:
        line = _user_line(text, principal)
        assert ("+publish &kinfer:health" in line) == (principal == sec.LAGMON), principal
        assert "pubsub" not in line and "~*" not in line and "&*" not in line, principal
    assert "(+publish &kinfer:reply:*)" in _user_line(text, sec.WORKER)
    assert "(+subscribe &kinfer:cancel &kinfer:demand)" in _user_line(text, sec.WORKER)
    assert "~kinfer:residency ~kinfer:answered:* +hset +hdel" in _user_line(text, sec.WORKER)
    assert "+hscan" in _user_line(text, sec.LAGMON) and "+hset" not in _user_line(text, sec.LAGMON)
    assert "%R~kinfer:answered:*" in _user_line(text, sec.AUTOSCALER) and "+hscan" in _user_line(text, sec.AUTOSCALER)
    assert "(+subscribe &kinfer:reply:gateway:* &kinfer:health)" in _user_line(text, sec.GATEWAY)
    assert "~kinfer:stats:*" in _user_line(text, sec.TELEMETRY)
    assert "~kinfer:autoscale:*" in _user_line(text, sec.AUTOSCALER)
    assert _user_line(text, "admin").endswith("~* &* +@all")


def test_client_setinfo_only_where_redis_knows_it() -> None:
    secrets = sec.Secrets.generate({})
    assert "client|setinfo" not in sec.redis_acl_text(secrets, (7, 0))
    assert "+client|setinfo" in sec.redis_acl_text(secrets, (7, 2))
    assert sec.redis_version("Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc") == (7, 0)
    assert sec.redis_version("nonsense") == (7, 0)


# ---------------------------------------------------------------------------------------------
# Secrets, certificates, Kafka settings, StackInfo


def test_secrets_roundtrip_and_principals() -> None:
    secrets = sec.Secrets.generate()
    assert secrets.tenants == {"demo": 1}
    assert secrets.principals == [*sec.SERVICE_PRINCIPALS, "tenant-demo"]
    assert len(set(secrets.passwords.values())) == len(secrets.passwords)
    assert len(bytes.fromhex(secrets.signing_secret)) == 32
    again = sec.Secrets.from_json(secrets.to_json())
    assert again == secrets and again.fingerprint() == secrets.fingerprint()
    assert secrets.tenant_of("tenant-demo") == "demo" and secrets.tenant_of("kinfer-worker") is None
    with pytest.raises(ValueError):
        secrets.password("nobody")


def test_storage_scram_args() -> None:
    secrets = sec.Secrets.generate()
    args = sec.storage_scram_args(secrets)
    assert args[0::2] == ["--add-scram"] * len(secrets.passwords)
    assert args[1] == f"SCRAM-SHA-512=[name=admin,password={secrets.passwords['admin']}]"


def test_secure_dir_modes_certificates_and_a_real_handshake(tmp_path: Path) -> None:
    from cryptography import x509

    root = tmp_path / "secure"
    files, secrets = sec.ensure_secure_dir(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in root.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    cert = x509.load_pem_x509_certificate(files.broker_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(files.ca_cert.read_bytes()))
    keystore = files.keystore.read_text()
    assert keystore.count("BEGIN PRIVATE KEY") == 1 and keystore.count("BEGIN CERTIFICATE") == 2

    # What a client (topics.connect) does: the CA verifies the broker, by IP, from the keystore file.
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(files.keystore)
    client = ssl.create_default_context(cafile=str(files.ca_cert))
    handshake(server, client, "127.0.0.1")
    handshake(server, client, "localhost")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, client, "example.com")

    # Kept as they are when called again.
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    assert sec.ensure_secure_dir(root)[1] == secrets
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, hostname: str) -> None:
    """A TLS handshake over memory buffers (no sockets)."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    done = {"c": False, "s": False}
    for _ in range(20):
        for name, end, out, peer_in in (("c", client, c_out, s_in), ("s", server, s_out, c_in)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


def test_kafka_security_properties(tmp_path: Path) -> None:
    files = sec.SecureFiles(tmp_path)
    props = dict(line.split("=", 1) for line in sec.kafka_security_properties(files, "pw"))
    assert props["listener.security.protocol.map"] == "CLIENT:SASL_SSL,CONTROLLER:SSL"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["inter.broker.listener.name"] == "CLIENT"
    assert props["listener.name.controller.ssl.client.auth"] == "required"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert set(props["super.users"].split(";")) == {"User:admin", sec.BROKER_PRINCIPAL}
    assert props["ssl.keystore.type"] == props["ssl.truststore.type"] == "PEM"
    assert 'password="pw"' in props["listener.name.client.scram-sha-512.sasl.jaas.config"]


def test_stack_env_per_principal(tmp_path: Path) -> None:
    files, secrets = sec.ensure_secure_dir(tmp_path / "secure")
    info = StackInfo(str(tmp_path), "127.0.0.1:9093", "redis://127.0.0.1:6390/0", secure=True)
    worker = info.env("kinfer-worker")
    assert worker["KINFER_REDIS_URL"] == f"redis://kinfer-worker:{secrets.passwords['kinfer-worker']}@127.0.0.1:6390/0"
    assert worker["KINFER_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert worker["KINFER_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert worker["KINFER_KAFKA_USER"] == "kinfer-worker"
    assert worker["KINFER_KAFKA_PASSWORD"] == secrets.passwords["kinfer-worker"]
    assert worker["KINFER_KAFKA_CA_FILE"] == str(files.ca_cert)
    assert worker["KINFER_SIGNING_SECRET"] == secrets.signing_secret
    assert info.env("kinfer-gateway")["KINFER_SIGNING_SECRET"] == secrets.signing_secret
    lagmon = info.env("kinfer-lagmon")
    assert "KINFER_SIGNING_SECRET" not in lagmon and "KINFER_TENANT" not in lagmon
    tenant = info.env("tenant-demo")
    assert tenant["KINFER_TENANT"] == "demo" and "KINFER_SIGNING_SECRET" not in tenant
    from kinfer.topics.auth import TenantCredential

    assert TenantCredential.parse("demo", tenant["KINFER_TENANT_KEY"]) == TenantCredential.derive(
        bytes.fromhex(secrets.signing_secret), "demo")
    assert info.env()["KINFER_KAFKA_USER"] == "admin"
    with pytest.raises(ValueError):
        info.env("nobody")


def test_insecure_stack_info_is_as_before(tmp_path: Path) -> None:
    old = {"home": str(tmp_path), "bootstrap": "127.0.0.1:9092", "redis_url": "redis://127.0.0.1:6379/0",
           "redis_pid": 1, "redis_log": "", "brokers": [{"node_id": 1, "port": 9092, "controller_port": 9093}]}
    info = StackInfo.from_json(json.loads(json.dumps(old)))
    assert info is not None and info.secure is False
    expected = {"KINFER_BOOTSTRAP": "127.0.0.1:9092", "KINFER_REDIS_URL": "redis://127.0.0.1:6379/0"}
    assert info.env() == info.env("kinfer-worker") == expected
    assert info.redis_url_for("kinfer-worker") == info.redis_url
    assert info.kafka_auth().options() == {}


# ---------------------------------------------------------------------------------------------
# apply_stack_env: whose credentials a component takes


@pytest.fixture
def own_environ() -> Iterator[None]:
    """apply_stack_env writes os.environ itself: the test's changes are undone afterwards."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def recorded_secure_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_environ: None) -> Iterator[StackInfo]:
    """A secure stack record whose "Redis" is a live process (``process_alive`` reads its command line: a
    Redis's process title, with its port)."""
    import dataclasses
    import subprocess
    import sys

    sec.ensure_secure_dir(tmp_path / "secure")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "redis-server 127.0.0.1:6390"])
    info = StackInfo(str(tmp_path), "127.0.0.1:9093", "redis://127.0.0.1:6390/0", redis_pid=stand_in.pid, secure=True)
    (tmp_path / "stack.json").write_text(json.dumps(dataclasses.asdict(info)))
    for key in [k for k in os.environ if k.startswith("KINFER_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KINFER_HOME", str(tmp_path))
    try:
        yield info
    finally:
        stand_in.kill()
        stand_in.wait()


def test_a_component_takes_its_own_principal(recorded_secure_stack: StackInfo) -> None:
    info = recorded_secure_stack
    assert resolve_endpoints(principal="kinfer-autoscaler") == (info.bootstrap, info.redis_url_for("kinfer-autoscaler"))
    assert os.environ["KINFER_KAFKA_USER"] == "kinfer-autoscaler" and "KINFER_SIGNING_SECRET" not in os.environ
    # Its local workers start with its environment and become kinfer-worker.
    assert apply_stack_env("kinfer-worker")
    assert {k: os.environ[k] for k in info.env("kinfer-worker")} == info.env("kinfer-worker")
    # A tenant's variables go when a component takes over, and a later plain resolve keeps the worker.
    apply_stack_env("tenant-demo")
    assert os.environ["KINFER_TENANT"] == "demo"
    apply_stack_env("kinfer-worker")
    assert "KINFER_TENANT" not in os.environ and "KINFER_TENANT_KEY" not in os.environ
    assert resolve_endpoints()[1] == info.redis_url_for("kinfer-worker")


def test_credentials_given_by_hand_stay(recorded_secure_stack: StackInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    info = recorded_secure_stack
    for key, value in info.env("tenant-demo").items():  # eval "$(kinfer stack env --principal tenant-demo)"
        monkeypatch.setenv(key, value)
    assert apply_stack_env("kinfer-worker") == {}
    assert os.environ["KINFER_KAFKA_USER"] == "tenant-demo" and "KINFER_SIGNING_SECRET" not in os.environ
    # Another cluster named: nothing is added.
    for key in [k for k in os.environ if k.startswith("KINFER_") and k != "KINFER_HOME"]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KINFER_BOOTSTRAP", "kafka.elsewhere:9092")
    assert apply_stack_env("kinfer-worker") == {} and "KINFER_KAFKA_USER" not in os.environ
    # The stack's own URL without a user (an insecure-era `stack env`) is not a credential.
    monkeypatch.setenv("KINFER_BOOTSTRAP", info.bootstrap)
    monkeypatch.setenv("KINFER_REDIS_URL", info.redis_url)
    apply_stack_env("kinfer-lagmon")
    assert os.environ["KINFER_REDIS_URL"] == info.redis_url_for("kinfer-lagmon")


def test_nothing_happens_without_a_running_secure_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       own_environ: None) -> None:
    for key in [k for k in os.environ if k.startswith("KINFER_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KINFER_HOME", str(tmp_path))
    assert apply_stack_env("kinfer-worker") == {}  # no record at all
    sec.ensure_secure_dir(tmp_path / "secure")
    dead = StackInfo(str(tmp_path), "127.0.0.1:9093", "redis://127.0.0.1:6390/0", redis_pid=2**22 + 1, secure=True)
    (tmp_path / "stack.json").write_text(json.dumps({"home": dead.home, "bootstrap": dead.bootstrap,
                                                     "redis_url": dead.redis_url, "redis_pid": dead.redis_pid,
                                                     "brokers": [], "secure": True}))
    assert apply_stack_env("kinfer-worker") == {}  # recorded, not running
    assert "KINFER_KAFKA_USER" not in os.environ
