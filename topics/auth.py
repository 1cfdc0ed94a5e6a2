"""Proof of who sent a record: tenant signatures on requests, seals on replies, MACs on cancels.

Everything here is HMAC-SHA256 (the stdlib's C implementation, ~1 us a record) and, for replies,
ChaCha20-Poly1305 (``cryptography``, ~3 us a reply), and pure: keys are bytes passed in, nothing is
read from the environment except by the ``from_env`` constructors.

**Requests** are signed by their tenant. A deployment holds one or more *signing secrets* (the
first is current, the others are being retired); each tenant's key is derived from a secret and the
tenant's name and key version, so the secrets stay with the gateway and the workers while a team
gets only its own key. A request record carries two Kafka headers: ``kinfer-kid`` (which secret)
and ``kinfer-sig`` = HMAC(tenant key, the record's value, exactly as sent). A worker that holds the
secrets recomputes it: a record from someone without the tenant's key, or one edited on its way, is
refused as ``invalid`` and dead-lettered.

**Replies** are sealed with a key the client chose (``reply_key`` in its request, random per
client process): encrypted and authenticated with ChaCha20-Poly1305 under a key of their own,
``HMAC(reply_key, "kinfer-reply-seal" NUL "2" NUL salt)`` for a fresh random 16-byte ``salt``
(``{"t": "sealed", "v": 2, "salt": ..., "box": ...}``). Only principals that may read the request
topics see the key (the workers), so a reply that opens with it came from one of them and nobody
else can read it, on whichever shared topic it travels; anything else on the client's channel is
dropped and counted. The older seal (``v`` 1: ``mac`` = HMAC(reply_key, body), the body in clear) is
still opened, never made.

**Cancels** for a request that had a reply key carry ``mac`` = HMAC(reply_key, "cancel" NUL id):
only the client that sent the request can stop it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from kinfer.topics.errors import InvalidRequest
from kinfer.topics.names import TENANT_PATTERN, Priority, exact

SIG_HEADER = "kinfer-sig"
KID_HEADER = "kinfer-kid"
REPLY_KEY_BYTES = 16  # what a client draws; requests may carry 16..64 bytes
SEAL_SALT_BYTES = 16  # per reply: its own key, so no key ever seals two replies
SEAL_TAG_BYTES = 16  # Poly1305's tag, at the end of the box
_SEAL_LABEL = b"kinfer-reply-seal\x002\x00"  # starts with "k": never the start of a msgpack map (a v1 body)
_SEAL_NONCE = bytes(12)  # each key seals one message, so a fixed nonce is safe
Headers = Sequence[tuple[str, bytes | None]]  # a Kafka header's value may be null


def _mac(key: bytes, data: bytes | memoryview) -> bytes:
    return hmac.digest(key, data, "sha256")


def key_id(secret: bytes) -> str:
    """The public name of a signing secret (8 hex characters), carried in ``kinfer-kid``."""
    return hashlib.sha256(b"kinfer-kid\0" + secret).hexdigest()[:8]


def tenant_key(secret: bytes, tenant: str, version: int = 1) -> bytes:
    """Tenant ``tenant``'s signing key under ``secret`` (bumping ``version`` revokes the old key)."""
    return _mac(secret, b"kinfer-tenant\0" + tenant.encode() + b"\0" + str(version).encode())


def signing_secrets(env: Mapping[str, str] | None = None) -> list[bytes]:
    """This process's signing secrets (``KINFER_SIGNING_SECRET``), the current one first; [] when unset."""
    return parse_secrets((os.environ if env is None else env).get("KINFER_SIGNING_SECRET", ""))


def parse_secrets(text: str) -> list[bytes]:
    """``KINFER_SIGNING_SECRET``: one or more hex secrets, comma-separated, the current one first."""
    secrets = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            secret = bytes.fromhex(part)
        except ValueError as exc:
            raise ValueError("KINFER_SIGNING_SECRET must be hex (comma-separated for rotation)") from exc
        if len(secret) < 16:
            raise ValueError("a signing secret must be at least 16 bytes (32 hex characters)")
        secrets.append(secret)
    return secrets


def new_secret() -> str:
    return os.urandom(32).hex()


# ---------------------------------------------------------------------------------------------
# Signing requests


@dataclass(frozen=True, slots=True)
class TenantCredential:
    """One tenant's key, as handed to a team: ``<kid>.<hex key>`` (``KINFER_TENANT_KEY``)."""

    tenant: str
    kid: str
    key: bytes

    @classmethod
    def parse(cls, tenant: str, text: str) -> TenantCredential:
        kid, _, hexkey = text.strip().partition(".")
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            key = b""
        if len(kid) != 8 or len(key) != 32:
            raise ValueError("a tenant key reads '<8-character key id>.<64 hex characters>' "
                             "(kinfer tenant-key prints one)")
        return cls(tenant, kid, key)

    @classmethod
    def derive(cls, secret: bytes, tenant: str, version: int = 1) -> TenantCredential:
        return cls(tenant, key_id(secret), tenant_key(secret, tenant, version))

    def __str__(self) -> str:
        return f"{self.kid}.{self.key.hex()}"

    def __repr__(self) -> str:  # never print a key
        return f"TenantCredential({self.tenant!r}, kid={self.kid!r})"


class Signer:
    """Signs request records: with one tenant's credential (a team's client), or with the current
    signing secret for whichever tenant the record names (the gateway, which speaks for many)."""

    def __init__(self, credential: TenantCredential | None = None, secret: bytes | None = None,
                 versions: Mapping[str, int] | None = None) -> None:
        if (credential is None) == (secret is None):
            raise ValueError("a Signer needs a tenant credential or a signing secret, not both")
        self._credential = credential
        self._secret = secret
        self._versions = versions or {}
        self._derived: dict[str, TenantCredential] = {}

    @property
    def default_tenant(self) -> str | None:
        """The tenant a team's credential belongs to (None for a gateway's secret)."""
        return None if self._credential is None else self._credential.tenant

    def credential(self, tenant: str) -> TenantCredential:
        if self._credential is not None:
            if tenant != self._credential.tenant:
                raise ValueError(f"this client holds the key of tenant {self._credential.tenant!r}, not {tenant!r}")
            return self._credential
        found = self._derived.get(tenant)
        if found is None:
            assert self._secret is not None
            found = TenantCredential.derive(self._secret, tenant, self._versions.get(tenant, 1))
            if len(self._derived) < 10_000:
                self._derived[tenant] = found
        return found

    def headers(self, tenant: str, value: bytes) -> list[tuple[str, bytes]]:
        cred = self.credential(tenant)
        return [(KID_HEADER, cred.kid.encode()), (SIG_HEADER, _mac(cred.key, value))]


# ---------------------------------------------------------------------------------------------
# Verifying requests (the worker)


@dataclass(frozen=True, slots=True)
class TenantRule:
    """What the worker enforces for one tenant: its best priority and its key version."""

    max_priority: int = 0  # 0 = may use p0
    key_version: int = 1


class _TenantEntry(msgspec.Struct, frozen=True):
    """What a worker reads of one entry of the tenants file (the gateway reads more of it)."""

    name: Annotated[str, msgspec.Meta(pattern=exact(TENANT_PATTERN))]
    max_priority: Annotated[int, msgspec.Meta(ge=0, le=2)] | Annotated[str, msgspec.Meta(pattern=r"^[pP][0-2]$")] = 0
    key_version: Annotated[int, msgspec.Meta(ge=1, lt=2**31)] = 1


class _TenantsFile(msgspec.Struct, frozen=True):
    tenants: list[_TenantEntry]


MAX_TENANTS_FILE_BYTES = 16 * 1_048_576


def load_tenant_rules(path: str) -> dict[str, TenantRule]:
    """The rules a worker enforces, from the tenants file the gateway reads (the same JSON:
    ``{"tenants": [{"name": ..., "max_priority": 1, "key_version": 1, ...}]}``; other keys ignored).
    As strict as the gateway's reading of the same file: integers are integers (no floats or
    booleans), names are tenant names and each appears once. Raises ``ValueError`` naming the file
    and what is wrong with it."""
    try:
        data = Path(path).read_bytes()
        if len(data) > MAX_TENANTS_FILE_BYTES:
            raise ValueError(f"{len(data)} bytes, over the limit of {MAX_TENANTS_FILE_BYTES}")
        entries = msgspec.json.decode(data, type=_TenantsFile).tenants
    except (OSError, ValueError, RecursionError, msgspec.MsgspecError) as exc:
        raise ValueError(f"{path}: not a tenants file ({type(exc).__name__}: {exc})") from exc
    rules: dict[str, TenantRule] = {}
    for entry in entries:
        if entry.name in rules:
            raise ValueError(f"{path}: not a tenants file (tenant {entry.name!r} is listed twice)")
        rules[entry.name] = TenantRule(int(Priority.parse(entry.max_priority)), entry.key_version)
    return rules


class Refused(InvalidRequest):
    """A request that fails its signature or its tenant's rules (``field``: signature, tenant, priority)."""


@dataclass
class Verifier:
    """Checks a request record's signature and its tenant's rules.

    ``secrets``: every accepted signing secret. ``tenants``: the registry (None: any tenant whose
    signature is valid, any priority). The priority a request claims must be the topic's own.
    """

    secrets: Sequence[bytes]
    tenants: Mapping[str, TenantRule] | None = None
    _keys: dict[tuple[str, str], bytes] = field(default_factory=dict)
    _by_kid: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ValueError("a Verifier needs at least one signing secret")
        self._by_kid = {key_id(s): s for s in self.secrets}

    def check(self, value: bytes, headers: Headers, tenant: str, priority: int, topic_priority: int) -> None:
        """Raises ``Refused`` unless the record is signed by ``tenant`` and within its rules."""
        kid = sig = None
        for name, data in headers:
            if name == SIG_HEADER and isinstance(data, bytes):
                sig = data
            elif name == KID_HEADER and isinstance(data, bytes):
                kid = data
        if sig is None or kid is None:
            raise Refused("unsigned request: this deployment needs the kinfer-kid and kinfer-sig headers", "signature")
        rule = TenantRule()
        if self.tenants is not None:
            found = self.tenants.get(tenant)
            if found is None:
                raise Refused(f"unknown tenant {tenant!r}", "tenant")
            rule = found
        key = self._key(kid.decode(errors="replace"), tenant, rule.key_version)
        if key is None:
            raise Refused("unknown signing key id (rotated out?)", "signature")
        if not hmac.compare_digest(_mac(key, value), sig):
            raise Refused(f"bad signature for tenant {tenant!r}", "signature")
        if priority != topic_priority:
            raise Refused(f"priority {priority} on a p{topic_priority} topic", "priority")
        if priority < rule.max_priority:
            raise Refused(f"tenant {tenant!r} may not use p{priority} (its best is p{rule.max_priority})", "priority")

    def _key(self, kid: str, tenant: str, version: int) -> bytes | None:
        cached = self._keys.get((kid, tenant))
        if cached is not None:
            return cached
        secret = self._by_kid.get(kid)
        if secret is None:
            return None
        key = tenant_key(secret, tenant, version)
        if len(self._keys) < 10_000:
            self._keys[(kid, tenant)] = key
        return key


# ---------------------------------------------------------------------------------------------
# Sealing replies and cancels


def _seal_key(reply_key: bytes, salt: bytes | memoryview) -> ChaCha20Poly1305:
    return ChaCha20Poly1305(_mac(reply_key, _SEAL_LABEL + salt))


def seal_box(reply_key: bytes, body: bytes) -> tuple[bytes, bytes]:
    """``body`` encrypted and authenticated for the holder of ``reply_key``: (salt, ciphertext + tag).

    Each reply gets its own key from a fresh random salt: random 96-bit nonces under one long-lived
    key would make a repeat (which breaks ChaCha20-Poly1305) likely within ~2^32 replies to one
    client, days for a busy gateway; 128-bit salts push that past 2^64.
    """
    salt = os.urandom(SEAL_SALT_BYTES)
    return salt, _seal_key(reply_key, salt).encrypt(_SEAL_NONCE, body, None)


def open_box(reply_key: bytes, salt: bytes | memoryview, box: bytes | memoryview) -> bytes | None:
    """The body ``seal_box`` sealed, or None when the box was not sealed with ``reply_key`` for this
    salt (another client's, forged, cut short or changed on its way)."""
    if len(salt) != SEAL_SALT_BYTES or len(box) < SEAL_TAG_BYTES:
        return None
    try:
        return _seal_key(reply_key, salt).decrypt(_SEAL_NONCE, box, None)
    except InvalidTag:
        return None


def reply_mac(reply_key: bytes, body: bytes) -> bytes:
    """The older seal's MAC (``v`` 1): what workers sent before replies were encrypted."""
    return _mac(reply_key, body)


def reply_authentic(reply_key: bytes, body: bytes | memoryview, mac: bytes | memoryview) -> bool:
    return hmac.compare_digest(_mac(reply_key, body), mac)


def reply_record_key(reply_key: bytes, request_id: str) -> bytes:
    """The Kafka record key of a sealed reply: the same for every reply to one request (they share a
    partition, in order), and says nothing about the request to a reader of the shared topic."""
    return _mac(reply_key, b"partition\0" + request_id.encode())[:16]


def cancel_mac(reply_key: bytes, request_id: str) -> bytes:
    return _mac(reply_key, b"cancel\0" + request_id.encode())


def new_reply_key() -> bytes:
    return os.urandom(REPLY_KEY_BYTES)


def signer_from_env(env: Mapping[str, str] | None = None) -> Signer | None:
    """The signer this process is configured with: ``KINFER_SIGNING_SECRET`` (a gateway: signs for
    any tenant) or ``KINFER_TENANT`` + ``KINFER_TENANT_KEY`` (a team's client); None: unsigned."""
    env = os.environ if env is None else env
    secrets = signing_secrets(env)
    if secrets:
        return Signer(secret=secrets[0])
    key = env.get("KINFER_TENANT_KEY")
    if key:
        tenant = env.get("KINFER_TENANT")
        if not tenant:
            raise ValueError("KINFER_TENANT_KEY needs KINFER_TENANT (the tenant the key belongs to)")
        return Signer(credential=TenantCredential.parse(tenant, key))
    return None


def verifier_from_env(tenants: str | None, env: Mapping[str, str] | None = None) -> Verifier | None:
    """What a worker checks: signatures when it holds signing secrets, and the rules of the tenants
    file when it has one; None when it holds no secret (raises ``ValueError`` for a tenants file
    without secrets: a tenant named in an unsigned request could be anyone)."""
    secrets = signing_secrets(env)
    if not secrets:
        if tenants is not None:
            raise ValueError("--tenants needs KINFER_SIGNING_SECRET: a tenant named in an unsigned request "
                             "could be anyone")
        return None
    return Verifier(secrets, load_tenant_rules(tenants) if tenants is not None else None)
