from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kinfer.ops.cli import build_parser, main
from kinfer.producers.tenants import Tenant, Tenants, TokenBucket, hash_key, is_loopback
from kinfer.topics import Priority
from tests import ROOT

EXAMPLE = ROOT / "ops" / "deploy" / "tenants.example.json"


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    b = TokenBucket(rate_per_s=2.0, burst=3)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)  # the next token in half a second
    assert b.take(0.5) == 0.0
    assert b.take(0.5) == pytest.approx(0.5)
    assert b.take(10.0) == 0.0 and b.tokens == pytest.approx(2.0)  # refilled to the burst, not beyond


def test_keys_are_matched_by_hash_and_priorities_clamped() -> None:
    t = Tenant("batch-team", hash_key("s3cret"), rate_per_s=1, burst=1, max_priority=Priority.P2)
    tenants = Tenants([t])
    assert tenants.authenticate("s3cret") is t
    assert tenants.authenticate("wrong") is None and tenants.authenticate(None) is None
    assert t.clamp(Priority.P0) is Priority.P2
    assert "s3cret" not in repr(t) and t.key_sha256 not in repr(t)


def test_a_key_where_its_hash_belongs_and_a_name_twice_are_refused() -> None:
    with pytest.raises(ValueError, match="64 lowercase hex"):
        Tenant("search", "s3cret")
    with pytest.raises(ValueError, match="unique"):
        Tenants([Tenant("a", hash_key("k1")), Tenant("a", hash_key("k2"))])
    with pytest.raises(ValueError, match="same key"):
        Tenants([Tenant("a", hash_key("k1")), Tenant("b", hash_key("k1"))])


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost.", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False), ("192.168.1.2", False),
    ("fe80::1", False), ("example.com", False), ("localhost.example.com", False), ("128.0.0.1", False),
])
def test_only_loopback_addresses_serve_this_machine_alone(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.fixture
def dead_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KINFER_BOOTSTRAP", "127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("KINFER_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("KINFER_DEBUG", raising=False)


@pytest.mark.usefixtures("dead_endpoints")
def test_an_exposed_gateway_without_tenants_refuses_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        assert main(["gateway", "--host", host]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"kinfer gateway: --host {host} can be reached from other machines")
        assert "--tenants" in err and "--allow-anonymous" in err
    # Told so, or on loopback, or with tenants, it goes on (to the dead broker here).
    for argv in (["--host", "0.0.0.0", "--allow-anonymous"], ["--host", "localhost"], [],
                 ["--host", "0.0.0.0", "--tenants", str(EXAMPLE)]):
        assert main(["gateway", *argv]) == 2
        assert "Kafka at 127.0.0.1:1 unreachable" in capsys.readouterr().err, argv


def test_every_deployed_gateway_on_a_shared_address_authenticates() -> None:
    """docker compose and Kubernetes publish the gateway: each runs with a tenants file, and compose's
    default one (the example) loads and admits nobody until its placeholder hash is replaced."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    k8s = ROOT / "ops" / "deploy" / "k8s"
    manifests = [d for p in sorted(k8s.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    commands = [s["command"] for s in compose["services"].values() if s.get("command")]
    commands += [c["command"] for d in manifests if d and d.get("kind") == "Deployment"
                 for c in d["spec"]["template"]["spec"]["containers"]]
    gateways = [build_parser().parse_args(c[1:]) for c in commands if c[:2] == ["kinfer", "gateway"]]
    assert len(gateways) >= 2
    for args in gateways:
        assert args.tenants and not args.allow_anonymous, args
    gateway = compose["services"]["gateway"]
    mounted = {target: source for source, target, _ in (v.rsplit(":", 2) for v in gateway["volumes"])}
    assert mounted["/etc/kinfer/tenants.json"] == "${KINFER_TENANTS:-./ops/deploy/tenants.example.json}"
    tenants = Tenants.from_file(EXAMPLE)
    assert tenants.authenticate("") is None and tenants.authenticate("example") is None


def test_a_tenants_file_is_checked_field_by_field(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    good = hash_key("k")
    path.write_text(json.dumps({"tenants": [
        {"name": "search", "key_sha256": good, "rate_per_s": "fast"},
        {"name": "ads", "key_sha256": "the-key-itself", "rate": 5, "max_priority": 9},
    ]}))
    with pytest.raises(ValueError) as bad:
        Tenants.from_file(path)
    text = str(bad.value)
    assert text.startswith(f"{path}: not a tenants file: 4 problems: ")
    assert "tenants[0] ('search').rate_per_s: Input should be a valid number" in text and "(got 'fast')" in text
    assert "tenants[1] ('ads').key_sha256: Value error, must be 64 lowercase hex characters" in text
    assert "the-key-itself" not in text  # a key pasted where its hash belongs is never echoed
    assert "tenants[1] ('ads').rate: Extra inputs are not permitted" in text
    assert "tenants[1] ('ads').max_priority: Value error, must be 0, 1 or 2" in text
    for data, says in (([], "no 'tenants' list"), ({"tenants": {}}, "no 'tenants' list"),
                       ({"tenants": [{"key_sha256": good}]}, "tenants[0].name: Field required")):
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=re.escape(says)):
            Tenants.from_file(path)
    path.write_text(json.dumps({"tenants": [{"name": "a", "key_sha256": good, "max_priority": "p1"}]}))
    assert Tenants.from_file(path).authenticate("k") is not None
