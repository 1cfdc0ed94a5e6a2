"""The compose deployment's secrets (``ops.secure_init``): state, certificates, every consumer's files,
rotation, the SCRAM request, and the two scripts the containers run (the kinfer image's entrypoint
and the brokers' start script), without Docker: the scripts run here with stand-ins for Kafka."""

from __future__ import annotations

import hashlib
import hmac
import io
import shlex
import shutil
import ssl
import stat
import subprocess
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from kinfer.ops.deploy import secure as sec
from kinfer.ops.deploy import secure_init as si
from kinfer.topics.auth import TenantCredential
from tests import ROOT
from tests.unit.ops.deploy.test_secure import handshake

LAYOUT = si.Layout()


@pytest.fixture
def made(tmp_path: Path) -> tuple[si.State, Path, list[Path]]:
    state = si.ensure_state(tmp_path / "state", LAYOUT, {"demo": 1, "fast": 0})
    out = tmp_path / "out"
    written = si.write_volumes(out, state, LAYOUT)
    return state, out, written


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def _san(cert_pem: bytes) -> tuple[list[str], list[str]]:
    from cryptography import x509

    san = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName), [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


def test_the_state_is_made_once_and_kept(tmp_path: Path) -> None:
    root = tmp_path / "state"
    state = si.ensure_state(root, LAYOUT)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in root.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert state.secrets.tenants == sec.DEFAULT_TENANTS
    assert set(sec.SERVICE_PRINCIPALS) <= set(state.secrets.passwords)
    assert len(state.cluster_id) == 22 and len(state.grafana_password) == 32
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    again = si.ensure_state(root, LAYOUT)
    assert again == state
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    # A tenant named later is added, with its own password; nobody else's changes.
    more = si.ensure_state(root, LAYOUT, {"search": 0})
    assert more.secrets.tenants == {"demo": 1, "search": 0}
    assert more.secrets.passwords["tenant-search"] not in state.secrets.passwords.values()
    assert {k: v for k, v in more.secrets.passwords.items() if k != "tenant-search"} == state.secrets.passwords
    with pytest.raises(ValueError):
        si.ensure_state(root, LAYOUT, {"bad": 5})


def test_node_certificates_verify_against_the_ca_with_their_names(made: tuple[si.State, Path, list[Path]]) -> None:
    from cryptography import x509

    state, out, _ = made
    ca = x509.load_pem_x509_certificate(state.files.ca_cert.read_bytes())
    client = ssl.create_default_context(cafile=str(state.files.ca_cert))
    assert len(LAYOUT.nodes) == 6  # three controllers, three brokers
    for i, name in enumerate(LAYOUT.nodes):
        cert_pem = state.broker_cert(name).read_bytes()
        x509.load_pem_x509_certificate(cert_pem).verify_directly_issued_by(ca)
        dns, ips = _san(cert_pem)
        assert dns == [name, "localhost"] and ips == ["127.0.0.1"]
        assert dns == LAYOUT.dns_names(name)
        keystore = out / "kafka" / name / "broker-keystore.pem"
        text = keystore.read_text()
        assert text.count("BEGIN PRIVATE KEY") == 1 and text.count("BEGIN CERTIFICATE") == 2
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(keystore)  # what Kafka's PEM keystore holds: key, certificate, CA
        handshake(server, client, name)
        handshake(server, client, "localhost")
        other = LAYOUT.nodes[(i + 1) % len(LAYOUT.nodes)]
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(server, client, other)  # a node's certificate does not pass for another


def test_certificates_are_issued_again_when_names_or_the_ca_change(tmp_path: Path) -> None:
    root = tmp_path / "state"
    state = si.ensure_state(root, LAYOUT)
    first = state.broker_cert("kafka-1").read_bytes()
    assert si.ensure_state(root, LAYOUT).broker_cert("kafka-1").read_bytes() == first
    renamed = si.Layout(host_name="kinfer.example.com")
    assert _san(si.ensure_state(root, renamed).broker_cert("kafka-1").read_bytes())[0] == [
        "kafka-1", "kinfer.example.com", "localhost"]
    _, other_ca = sec.make_ca()
    assert not si.cert_is_current(state.broker_cert("kafka-1").read_bytes(), other_ca, ["kafka-1", "localhost"],
                                  ["127.0.0.1"])
    for path in (state.files.ca_key, state.files.ca_cert):
        path.unlink()
    fresh = si.ensure_state(root, LAYOUT)  # a new CA: every broker certificate again
    assert si.cert_is_current(fresh.broker_cert("kafka-3").read_bytes(), fresh.files.ca_cert.read_bytes(),
                              LAYOUT.dns_names("kafka-3"), ["127.0.0.1"])


def test_every_consumer_gets_its_own_files_and_nothing_else(made: tuple[si.State, Path, list[Path]]) -> None:
    state, out, written = made
    secrets = state.secrets
    folders = {p.name for p in out.iterdir()}
    assert folders == {"kafka", "redis", "grafana", *si.COMPOSE_PRINCIPALS}
    for path in out.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
        assert not path.name.endswith(".tmp")
    assert sorted(written) == sorted(p for p in out.rglob("*") if p.is_file())
    ca = state.files.ca_cert.read_bytes()
    for principal in si.COMPOSE_PRINCIPALS:
        folder = out / principal
        assert (folder / "password").read_text() == secrets.password(principal)
        assert (folder / "ca.pem").read_bytes() == ca
        assert (folder / "signing-secret").exists() == (principal in si.SIGNERS)
        others = set(secrets.passwords.values()) - {secrets.password(principal)}
        assert not any(pw in p.read_text() for p in folder.iterdir() for pw in others)
    assert (out / "kinfer-gateway" / "signing-secret").read_text() == secrets.signing_secret
    assert (out / "grafana" / "admin-password").read_text() == state.grafana_password
    assert not (out / "kafka" / "ca.key").exists() and "PRIVATE KEY" not in (out / "kafka" / "ca.pem").read_text()


def test_the_redis_acl_file(made: tuple[si.State, Path, list[Path]]) -> None:
    state, out, _ = made
    text = (out / "redis" / "users.acl").read_text()
    assert text == sec.redis_acl_text(state.secrets, si.REDIS_VERSION)
    lines = text.splitlines()
    assert lines[0].startswith("user default off ")
    users = {line.split()[1] for line in lines}
    assert users == {"default", *state.secrets.principals}
    for principal, password in state.secrets.passwords.items():
        assert password not in text and f"#{hashlib.sha256(password.encode()).hexdigest()}" in text, principal
    assert "+client|setinfo" in text  # Redis 7.2 knows it


def test_broker_properties(made: tuple[si.State, Path, list[Path]]) -> None:
    state, out, _ = made
    admin = state.secrets.password(sec.ADMIN)
    voters = "101@kafka-controller-1:9093,102@kafka-controller-2:9093,103@kafka-controller-3:9093"
    for i, name in enumerate(LAYOUT.brokers):
        props = _props((out / "kafka" / name / "server.properties").read_text())
        assert props["node.id"] == str(i + 1) and props["controller.quorum.voters"] == voters
        assert props["process.roles"] == "broker"
        port = 19092 + i
        assert props["listeners"] == f"CLIENT://0.0.0.0:9092,HOST://0.0.0.0:{port}"
        assert props["controller.listener.names"] == "CONTROLLER"  # how it reaches the quorum
        assert props["advertised.listeners"] == f"CLIENT://{name}:9092,HOST://localhost:{port}"
        assert props["listener.security.protocol.map"] == "CLIENT:SASL_SSL,HOST:SASL_SSL,CONTROLLER:SSL"
        assert props["listener.name.controller.ssl.client.auth"] == "required"
        assert props["listener.name.host.ssl.client.auth"] == "none"
        assert "password" not in props["listener.name.host.scram-sha-512.sasl.jaas.config"]
        assert f'password="{admin}"' in props["listener.name.client.scram-sha-512.sasl.jaas.config"]
        assert props["ssl.keystore.location"] == f"/run/kinfer/kafka/{name}/broker-keystore.pem"
        assert props["ssl.truststore.location"] == f"/run/kinfer/kafka/{name}/ca.pem"
        assert props["allow.everyone.if.no.acl.found"] == "false"
        assert set(props["super.users"].split(";")) == {"User:admin", sec.BROKER_PRINCIPAL}
        assert props["log.dirs"] == "/var/lib/kafka/data" and props["auto.create.topics.enable"] == "false"
        assert props["default.replication.factor"] == props["offsets.topic.replication.factor"] == "3"
        assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"
    for i, name in enumerate(LAYOUT.controllers):
        props = _props((out / "kafka" / name / "server.properties").read_text())
        assert props["process.roles"] == "controller" and props["node.id"] == str(101 + i)
        assert props["controller.quorum.voters"] == voters
        assert props["listeners"] == "CONTROLLER://0.0.0.0:9093" and "advertised.listeners" not in props
        assert props["listener.name.controller.ssl.client.auth"] == "required"  # nodes only: mutual TLS
        assert props["ssl.keystore.location"] == f"/run/kinfer/kafka/{name}/broker-keystore.pem"
        assert set(props["super.users"].split(";")) == {"User:admin", sec.BROKER_PRINCIPAL}
        assert props["allow.everyone.if.no.acl.found"] == "false"
        assert props["broker.session.timeout.ms"] == "3000"  # the controllers fence a silent broker
        assert props["listener.security.protocol.map"] == "CONTROLLER:SSL"
        text = (out / "kafka" / name / "server.properties").read_text()
        assert admin not in text and "sasl" not in text  # it dials no broker: no login, no password
    admin_props = _props((out / "kafka" / "admin.properties").read_text())
    assert admin_props["security.protocol"] == "SASL_SSL" and admin_props["sasl.mechanism"] == "SCRAM-SHA-512"
    assert admin_props["ssl.truststore.location"] == "/run/kinfer/kafka/ca.pem"
    assert f'username="admin" password="{admin}"' in admin_props["sasl.jaas.config"]
    args = (out / "kafka" / "scram-args").read_text().splitlines()
    assert args == sec.storage_scram_args(state.secrets)
    assert (out / "kafka" / "cluster-id").read_text() == state.cluster_id


def test_a_combined_layout_makes_each_broker_a_voter() -> None:
    layout = si.Layout(controllers=())
    assert layout.nodes == layout.brokers
    for i in range(len(layout.brokers)):
        props = _props(si.broker_properties(layout, i, "pw"))
        assert props["process.roles"] == "broker,controller"
        assert props["controller.quorum.voters"] == "1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"
        assert props["listeners"] == f"CLIENT://0.0.0.0:9092,HOST://0.0.0.0:{19092 + i},CONTROLLER://0.0.0.0:9093"
    args = si.build_parser().parse_args(["init", "--combined"])
    assert si.layout_from(args).controllers == ()
    with pytest.raises(SystemExit):  # one or the other
        si.build_parser().parse_args(["init", "--combined", "--controller", "c-1"])


def test_a_single_broker_layout_keeps_one_copy() -> None:
    props = _props(si.broker_properties(si.Layout(brokers=("kafka",)), 0, "pw"))
    assert props["default.replication.factor"] == "1" and props["min.insync.replicas"] == "1"
    with pytest.raises(ValueError):
        si.Layout(brokers=("kafka-1",), controllers=("kafka-1",))
    with pytest.raises(ValueError):
        si.Layout(brokers=("a", "a"))
    with pytest.raises(ValueError):
        si.Layout(host_name="not a host")


def test_volumes_go_to_their_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = si.ensure_state(tmp_path / "state", LAYOUT)
    owners: dict[Path, int] = {}
    monkeypatch.setattr(si.os, "geteuid", lambda: 0)

    def chown(path: str | Path, uid: int, gid: int) -> None:  # files are chowned as .NAME.tmp, then renamed
        path = Path(path)
        owners[path.with_name(path.name.removeprefix(".").removesuffix(".tmp"))] = uid

    monkeypatch.setattr(si.os, "chown", chown)
    out = tmp_path / "out"
    si.write_volumes(out, state, LAYOUT, owners={"kafka": 1234})
    assert owners[out / "kafka"] == owners[out / "kafka" / "kafka-2"] == 1234
    assert owners[out / "redis"] == si.OWNERS["redis"] and owners[out / "grafana"] == si.OWNERS["grafana"]
    assert owners[out / "kinfer-worker"] == owners[state.root / "secrets.json"] == si.OWNERS["kinfer"]
    assert all(path in owners for path in out.rglob("*"))


def test_scram_salted_password_is_rfc5802_hi() -> None:
    password, salt, iterations = "pencil", b"salt-bytes", 4096

    def hi(key: bytes, salt: bytes, i: int) -> bytes:  # RFC 5802, 2.2, written out
        u = hmac.new(key, salt + b"\x00\x00\x00\x01", "sha512").digest()
        result = bytearray(u)
        for _ in range(i - 1):
            u = hmac.new(key, u, "sha512").digest()
            result = bytearray(a ^ b for a, b in zip(result, u, strict=True))
        return bytes(result)

    assert sec.scram_salted_password(password, salt, iterations) == hi(password.encode(), salt, iterations)
    ups = si.scram_upsertions({"a": "x", "b": "y"})
    assert [u[:3] for u in ups] == [("a", 2, sec.SCRAM_ITERATIONS), ("b", 2, sec.SCRAM_ITERATIONS)]
    assert ups[0][3] != ups[1][3] and len(ups[0][3]) == 32
    assert ups[0][4] == sec.scram_salted_password("x", ups[0][3])


def test_the_alter_scram_request_encodes_as_kip_554_says() -> None:
    request = si._scram_request_class()([("kinfer-worker", 2, 8192, b"salt", b"p" * 64)])
    struct = request.prepare({51: (0, 0)})
    assert struct.FLEXIBLE_VERSION and struct.API_KEY == 51 and struct.API_VERSION == 0
    expected = (b"\x01"  # deletions: an empty compact array
                b"\x02"  # upsertions: one
                b"\x0ekinfer-worker" + b"\x02" + (8192).to_bytes(4, "big")
                + b"\x05salt" + b"\x41" + b"p" * 64 + b"\x00"  # salt, salted password, no tags
                + b"\x00")  # no tags
    assert struct.encode() == expected
    response = struct.RESPONSE_TYPE.decode(io.BytesIO(
        (0).to_bytes(4, "big") + b"\x02" + b"\x0ekinfer-worker" + (0).to_bytes(2, "big") + b"\x00" + b"\x00" + b"\x00"))
    assert response.results == [("kinfer-worker", 0, None, {})]


def test_rotation_in_the_state(tmp_path: Path) -> None:
    state = si.ensure_state(tmp_path / "state", LAYOUT)
    new = si.with_password(state, sec.WORKER, "ab" * 24)
    assert new.secrets.passwords == {**state.secrets.passwords, sec.WORKER: "ab" * 24}
    with pytest.raises(ValueError):
        si.with_password(state, "nobody", "x")
    rotated = si.rotate_signing_secret(new)
    assert rotated.secrets.signing_secret != state.secrets.signing_secret
    assert rotated.signing_secrets_text() == f"{rotated.secrets.signing_secret},{state.secrets.signing_secret}"
    out = tmp_path / "out"
    si.write_volumes(out, rotated, LAYOUT)
    assert (out / "kinfer-worker" / "signing-secret").read_text() == rotated.signing_secrets_text()
    assert (out / "kinfer-worker" / "password").read_text() == "ab" * 24
    dropped = si.rotate_signing_secret(rotated, drop_retired=True)
    assert dropped.signing_secrets_text() == rotated.secrets.signing_secret
    assert dropped.secrets.passwords == new.secrets.passwords


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = si.main(argv)
    return code, buf.getvalue()


def test_the_command_line(tmp_path: Path) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    code, text = _run(["--state", str(state_dir), "init", "--out", str(out), "--tenant", "search=0",
                       "--host-port", "29092", "--principal", "admin", "--principal", "kinfer-worker"])
    assert code == 0 and "principals" in text
    assert {p.name for p in out.iterdir()} == {"kafka", "redis", "grafana", "admin", "kinfer-worker"}
    assert "HOST://localhost:29094" in (out / "kafka" / "kafka-3" / "server.properties").read_text()
    state = si.load_state(state_dir)
    assert state.secrets.tenants == {"search": 0}

    code, text = _run(["--state", str(state_dir), "env", "--principal", "tenant-search", "--host-port", "29092"])
    env = dict(line.removeprefix("export ").split("=", 1) for line in text.splitlines())
    env = {k: shlex.split(v)[0] for k, v in env.items()}
    assert env["KINFER_BOOTSTRAP"] == "localhost:29092,localhost:29093,localhost:29094"
    assert env["KINFER_KAFKA_USER"] == "tenant-search" and env["KINFER_KAFKA_CA_FILE"] == "kinfer-ca.pem"
    assert env["KINFER_REDIS_URL"] == f"redis://tenant-search:{state.secrets.passwords['tenant-search']}@localhost:6379/0"
    assert TenantCredential.parse("search", env["KINFER_TENANT_KEY"]) == TenantCredential.derive(
        bytes.fromhex(state.secrets.signing_secret), "search")
    assert "KINFER_SIGNING_SECRET" not in env

    code, text = _run(["--state", str(state_dir), "ca"])
    assert code == 0 and text == state.files.ca_cert.read_text()
    assert _run(["--state", str(tmp_path / "none"), "ca"])[0] == 2
    assert _run(["--state", str(state_dir), "env", "--principal", "nobody"])[0] == 2
    assert _run(["--state", str(state_dir), "rotate", "--signing-secret"])[0] == 0
    assert si.load_state(state_dir).signing_retired == (state.secrets.signing_secret,)


# ---------------------------------------------------------------------------------------------
# The scripts


def _entrypoint(env: dict[str, str], *command: str) -> subprocess.CompletedProcess[str]:
    entrypoint = ROOT / "ops" / "deploy" / "docker-entrypoint.sh"
    return subprocess.run(["sh", str(entrypoint), *command], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, check=False)


def test_the_entrypoint_reads_secrets_from_files(tmp_path: Path) -> None:
    (tmp_path / "password").write_text("f00d" * 12)
    (tmp_path / "signing").write_text("ab" * 32 + ",cd" + "ef" * 31 + "\n")
    done = _entrypoint({"KINFER_KAFKA_PASSWORD_FILE": str(tmp_path / "password"),
                        "KINFER_REDIS_PASSWORD_FILE": str(tmp_path / "password"),
                        "KINFER_SIGNING_SECRET_FILE": str(tmp_path / "signing"),
                        "KINFER_REDIS_URL": "redis://kinfer-worker@redis:6379/0"}, "env")
    assert done.returncode == 0, done.stderr
    env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert env["KINFER_KAFKA_PASSWORD"] == "f00d" * 12
    assert env["KINFER_SIGNING_SECRET"] == "ab" * 32 + ",cd" + "ef" * 31
    assert env["KINFER_REDIS_URL"] == f"redis://kinfer-worker:{'f00d' * 12}@redis:6379/0"
    assert not any(k.endswith("_FILE") for k in env) and "KINFER_REDIS_PASSWORD" not in env


def test_the_entrypoint_without_secrets_only_runs_the_command(tmp_path: Path) -> None:
    done = _entrypoint({"KINFER_REDIS_URL": "redis://redis:6379/0"}, "sh", "-c", "echo \"$KINFER_REDIS_URL\"; exit 3")
    assert done.returncode == 3 and done.stdout == "redis://redis:6379/0\n"
    (tmp_path / "pw").write_text("x")
    for url in ("redis://redis:6379/0", "redis://u:p@redis:6379/0", ""):
        bad = _entrypoint({"KINFER_REDIS_PASSWORD_FILE": str(tmp_path / "pw"), "KINFER_REDIS_URL": url}, "true")
        assert bad.returncode == 2 and "KINFER_REDIS_URL" in bad.stderr, url
    missing = _entrypoint({"KINFER_KAFKA_PASSWORD_FILE": str(tmp_path / "nope")}, "true")
    assert missing.returncode == 2 and "cannot be read" in missing.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash")
def test_the_broker_start_script_formats_once_with_the_scram_users(tmp_path: Path) -> None:
    state = si.ensure_state(tmp_path / "state", LAYOUT)
    data = tmp_path / "data"
    layout = si.Layout(kafka_dir=str(tmp_path / "out" / "kafka"), data_dir=str(data))
    si.write_volumes(tmp_path / "out", state, layout)
    home = tmp_path / "kafka"
    (home / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    # Stand-ins for Kafka's scripts: record the arguments; format writes meta.properties like StorageTool.
    (home / "bin" / "kafka-storage.sh").write_text(
        f'#!/bin/sh\nprintf "%s\\n" storage "$@" >> {calls}\nmkdir -p {data}\ntouch {data}/meta.properties\n')
    (home / "bin" / "kafka-server-start.sh").write_text(f'#!/bin/sh\nprintf "%s\\n" start "$@" >> {calls}\n')
    for script in (home / "bin").iterdir():
        script.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "KINFER_NODE": "kafka-2", "KINFER_KAFKA_SECRETS": layout.kafka_dir,
           "KAFKA_HOME": str(home)}

    def start() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(ROOT / "ops" / "deploy" / "compose" / "kafka-start.sh")], env=env,
                              capture_output=True, text=True, check=False)

    first = start()
    assert first.returncode == 0, first.stderr
    args = calls.read_text().splitlines()
    config = f"{layout.kafka_dir}/kafka-2/server.properties"
    fmt = args[:args.index("start")]
    assert fmt[:7] == ["storage", "format", "--cluster-id", state.cluster_id, "--config", config, "--ignore-formatted"]
    assert fmt[7:] == sec.storage_scram_args(state.secrets)
    assert args[args.index("start"):] == ["start", config]
    assert (data / "kinfer-secure").exists()

    calls.unlink()
    assert start().returncode == 0
    assert calls.read_text().splitlines() == ["start", config]  # formatted already: not again

    (data / "kinfer-secure").unlink()  # storage formatted by something else (a PLAINTEXT stack)
    refused = start()
    assert refused.returncode == 1 and "down -v" in refused.stderr
    env["KINFER_NODE"] = "kafka-9"
    assert "cannot read" in start().stderr
