"""Signatures on requests, seals on replies, MACs on cancels: what is refused and what is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kinfer.topics import ReplyRoute, Request, Result, Status, decode_replies, pack, seal
from kinfer.topics.auth import (
    KID_HEADER,
    SIG_HEADER,
    Refused,
    Signer,
    TenantCredential,
    TenantRule,
    Verifier,
    cancel_mac,
    key_id,
    load_tenant_rules,
    new_reply_key,
    parse_secrets,
    signer_from_env,
)
from kinfer.topics.envelope import ReplyBatch, ReplyRefused

SECRET = bytes(range(32))
OLD = bytes(range(32, 64))


def request(tenant: str = "search", priority: int = 1, **extra: object) -> Request:
    return Request(id="r1", model="m", priority=priority, tenant=tenant, created_ms=1, deadline_ms=2,  # type: ignore[arg-type]
                   inputs=("x",), reply=ReplyRoute.channel("kinfer:reply:search:c"), **extra)  # type: ignore[arg-type]


def signed(req: Request, signer: Signer) -> tuple[bytes, list[tuple[str, bytes]]]:
    data = pack(req)
    return data, signer.headers(req.tenant, data)


def test_a_tenant_credential_signs_what_the_worker_accepts() -> None:
    cred = TenantCredential.derive(SECRET, "search")
    team = Signer(credential=TenantCredential.parse("search", str(cred)))  # as handed over: "<kid>.<hex>"
    data, headers = signed(request(), team)
    Verifier([SECRET]).check(data, headers, "search", 1, 1)
    # the gateway, holding the secret, signs the same way for any tenant
    data, headers = signed(request(tenant="ads"), Signer(secret=SECRET))
    Verifier([SECRET]).check(data, headers, "ads", 1, 1)


@pytest.mark.parametrize("attack", ["unsigned", "edited", "other_tenant", "other_secret", "wrong_kid"])
def test_forged_or_edited_requests_are_refused(attack: str) -> None:
    team = Signer(credential=TenantCredential.derive(SECRET, "search"))
    data, headers = signed(request(), team)
    tenant = "search"
    if attack == "unsigned":
        headers = []
    elif attack == "edited":  # a signed request changed on its way: another tenant named inside
        data = pack(request(tenant="ads"))
        tenant = "ads"
    elif attack == "other_tenant":  # search's key used to speak as ads
        forged = request(tenant="ads")
        data, headers = pack(forged), team.headers("search", pack(forged))
        tenant = "ads"
    elif attack == "other_secret":
        data, headers = signed(request(), Signer(secret=OLD))
    elif attack == "wrong_kid":
        headers = [(KID_HEADER, b"deadbeef"), headers[1]]
    with pytest.raises(Refused) as refused:
        Verifier([SECRET]).check(data, headers, tenant, 1, 1)
    assert refused.value.field == "signature"


def test_tenant_rules_priority_ceiling_topic_and_registry() -> None:
    rules = {"search": TenantRule(max_priority=1), "batch": TenantRule(max_priority=2)}
    gateway = Signer(secret=SECRET)
    verifier = Verifier([SECRET], rules)
    for tenant, priority in [("search", 1), ("search", 2), ("batch", 2)]:
        data, headers = signed(request(tenant, priority), gateway)
        verifier.check(data, headers, tenant, priority, priority)
    for tenant, priority, topic, field in [("search", 0, 0, "priority"), ("batch", 1, 1, "priority"),
                                           ("batch", 2, 0, "priority"), ("nobody", 1, 1, "tenant")]:
        data, headers = signed(request(tenant, priority), gateway)
        with pytest.raises(Refused) as refused:
            verifier.check(data, headers, tenant, priority, topic)
        assert refused.value.field == field, (tenant, priority, topic)


def test_rotation_old_secret_accepted_until_removed_and_key_versions_revoke() -> None:
    data, headers = signed(request(), Signer(secret=OLD))
    Verifier([SECRET, OLD]).check(data, headers, "search", 1, 1)  # during the rotation
    with pytest.raises(Refused):
        Verifier([SECRET]).check(data, headers, "search", 1, 1)  # after it
    # bumping a tenant's key version revokes the key it had
    leaked = Signer(credential=TenantCredential.derive(SECRET, "search", version=1))
    data, headers = signed(request(), leaked)
    with pytest.raises(Refused):
        Verifier([SECRET], {"search": TenantRule(1, key_version=2)}).check(data, headers, "search", 1, 1)
    renewed = Signer(secret=SECRET, versions={"search": 2})
    data, headers = signed(request(), renewed)
    Verifier([SECRET], {"search": TenantRule(1, key_version=2)}).check(data, headers, "search", 1, 1)


def test_a_team_credential_signs_only_its_own_tenant() -> None:
    team = Signer(credential=TenantCredential.derive(SECRET, "search"))
    assert team.default_tenant == "search"
    with pytest.raises(ValueError, match="search"):
        team.headers("ads", b"x")


def test_secrets_and_credentials_from_the_environment() -> None:
    assert signer_from_env({}) is None
    gateway = signer_from_env({"KINFER_SIGNING_SECRET": f"{SECRET.hex()},{OLD.hex()}"})
    assert gateway is not None and gateway.default_tenant is None
    assert gateway.headers("x", b"v")[0] == (KID_HEADER, key_id(SECRET).encode())  # the first is current
    cred = TenantCredential.derive(SECRET, "search")
    team = signer_from_env({"KINFER_TENANT": "search", "KINFER_TENANT_KEY": str(cred)})
    assert team is not None and team.default_tenant == "search"
    with pytest.raises(ValueError, match="KINFER_TENANT"):
        signer_from_env({"KINFER_TENANT_KEY": str(cred)})
    with pytest.raises(ValueError, match="hex"):
        parse_secrets("not hex")
    with pytest.raises(ValueError, match="16 bytes"):
        parse_secrets("abcd")
    assert "key" not in repr(cred).replace("kid", "")  # never printed


def test_tenant_rules_file(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "a", "key_sha256": "00", "max_priority": "p1"},
                                            {"name": "b", "max_priority": 2, "key_version": 3}]}))
    assert load_tenant_rules(str(path)) == {"a": TenantRule(1, 1), "b": TenantRule(2, 3)}
    path.write_text(json.dumps({"tenants": [{"name": "a", "max_priority": 7}]}))
    with pytest.raises(ValueError, match="tenants file"):
        load_tenant_rules(str(path))


def test_sealed_replies_open_only_with_their_key() -> None:
    key, other = new_reply_key(), new_reply_key()
    result = Result("r1", "m", Status.OK, outputs=[1])
    assert decode_replies(seal(result, key), key) == ([result], 2)
    # another client's sealed reply (a shared reply topic), an unsealed one, a tampered one: refused
    tampered = bytearray(seal(result, key))
    tampered[-20] ^= 1  # a bit of the ciphertext
    for data, reason in ((seal(result, other), "unopened"), (pack(result), "unsealed"),
                         (bytes(tampered), "unopened")):
        with pytest.raises(ReplyRefused) as refused:
            decode_replies(data, key)
        assert refused.value.reason == reason
    # batches are sealed whole
    batch = ReplyBatch([result, Result("r2", "m", Status.OK)])
    assert [r.id for r in decode_replies(seal(batch, key), key).replies] == ["r1", "r2"]
    # a client that asked for no seal takes plain replies
    assert decode_replies(pack(result)) == ([result], 0)


def test_reply_key_travels_in_the_request_and_is_bounded() -> None:
    from kinfer.topics import decode_request
    from kinfer.topics.errors import InvalidRequest

    key = new_reply_key()
    assert decode_request(pack(request(reply_key=key))).reply_key == key
    with pytest.raises(InvalidRequest):
        decode_request(pack(request(reply_key=b"short")))


def test_cancel_mac_binds_key_and_id() -> None:
    key = new_reply_key()
    assert cancel_mac(key, "a") != cancel_mac(key, "b")
    assert cancel_mac(key, "a") != cancel_mac(new_reply_key(), "a")
    assert len(cancel_mac(key, "a")) == 32 and SIG_HEADER != KID_HEADER
