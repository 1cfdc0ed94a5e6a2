"""Who may call the gateway, how often, and at what priority at best.

API keys are stored hashed (SHA-256, hex) in a JSON file, so the file can live in configuration
management without being a secret itself:

    {"tenants": [{"name": "search", "key_sha256": "<hex>", "rate_per_s": 50, "burst": 100,
                  "max_priority": 0}]}

``kinfer gateway --hash-key KEY`` prints the hash of a key; ``ops/deploy/tenants.example.json`` is a
commented example. A tenant's name is also its rate-limit key: gateways sharing a Redis share one
bucket per tenant (``producers.ratelimit``), and the pure ``TokenBucket`` here is each gateway's
fallback while Redis does not answer. The bucket is pure (``now`` is passed in), so its behaviour is
tested without sleeping.

A gateway reachable from other machines must authenticate: ``kinfer gateway`` refuses a
non-loopback ``--host`` (``is_loopback``) without ``--tenants`` unless told ``--allow-anonymous``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinfer.topics import Priority
from kinfer.topics.names import TENANT_PATTERN
from kinfer.topics.validation import problems

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# A key pasted where its hash belongs would lock the tenant out without a word.
_HASH_RULE = ("must be 64 lowercase hex characters, the SHA-256 of the key (`kinfer gateway --hash-key KEY` "
              "prints it), never the key itself")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine alone: 127.0.0.0/8, ::1 or ``localhost``.

    Anything else (0.0.0.0, ::, an interface's address, another host name, "") may be reached from
    other machines.
    """
    name = host.strip().removeprefix("[").removesuffix("]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False  # a name other than localhost may resolve to anything
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1
    return address.is_loopback


@dataclass(slots=True)
class TokenBucket:
    rate_per_s: float  # sustained requests per second
    burst: float  # how many may come at once
    tokens: float = -1.0  # starts full
    updated: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError(f"rate_per_s must be > 0 and burst >= 1, got {self.rate_per_s} and {self.burst}")
        if self.tokens < 0:
            self.tokens = self.burst

    def take(self, now: float) -> float:
        """0.0 if a request may go now (and one token is spent), else seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


@dataclass(slots=True)
class Tenant:
    name: str
    key_sha256: str
    rate_per_s: float = 100.0
    burst: float = 200.0
    max_priority: Priority = Priority.P0  # the best priority this tenant may ask for
    key_version: int = 1  # of its request-signing key (topics.auth): bumping it revokes the old key
    bucket: TokenBucket = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a tenant needs a name")
        if not isinstance(self.key_sha256, str) or not _SHA256_HEX.fullmatch(self.key_sha256):
            raise ValueError(f"tenant {self.name!r}: key_sha256 {_HASH_RULE}")
        self.max_priority = Priority.parse(self.max_priority)
        self.bucket = TokenBucket(self.rate_per_s, self.burst)

    def clamp(self, priority: Priority) -> Priority:
        """Asking for better than allowed gets the best allowed, not an error."""
        return Priority(max(int(priority), int(self.max_priority)))

    def __repr__(self) -> str:  # never print the key hash in logs
        return f"Tenant({self.name!r}, rate_per_s={self.rate_per_s}, max_priority={self.max_priority.label})"


@functools.cache
def _schema() -> Any:
    """The tenants file's entries (pydantic, imported only when a file is read)."""
    from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

    class TenantEntry(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        name: str = Field(min_length=1, max_length=64, pattern=TENANT_PATTERN, description="who is asking")
        key_sha256: str = Field(description="SHA-256 of the API key, hex (kinfer gateway --hash-key KEY)")
        rate_per_s: float = Field(default=100.0, gt=0, allow_inf_nan=False, description="sustained requests/s")
        burst: float = Field(default=200.0, ge=1, allow_inf_nan=False, description="requests at once")
        max_priority: int | str = Field(default=0, description="the best priority it may ask for: 0-2 or p0-p2")
        key_version: int = Field(default=1, ge=1, description="of its request-signing key")

        @field_validator("key_sha256")
        @classmethod
        def _hash(cls, value: str) -> str:
            if not _SHA256_HEX.fullmatch(value):
                raise ValueError(_HASH_RULE)
            return value

        @field_validator("max_priority")
        @classmethod
        def _priority(cls, value: int | str) -> int | str:
            try:
                Priority.parse(value)
            except ValueError:
                raise ValueError("must be 0, 1 or 2 (or p0, p1, p2)") from None
            return value

    return TypeAdapter(list[TenantEntry])


class Tenants:
    def __init__(self, tenants: list[Tenant]) -> None:
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):  # the name keys the shared bucket: two tenants would share one
            raise ValueError(f"tenant names must be unique, got {sorted(n for n in set(names) if names.count(n) > 1)}")
        if len({t.key_sha256 for t in tenants}) != len(tenants):
            raise ValueError("two tenants have the same key")
        self._by_hash = {t.key_sha256: t for t in tenants}
        self.key_versions = {t.name: t.key_version for t in tenants}  # what the gateway signs with

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        """Raises ``ValueError`` naming the file and every field at fault (``tenants[i] ('name').field``)."""
        example = '{"tenants": [{"name": "search", "key_sha256": "<hex>", "rate_per_s": 50}]}'
        try:
            data = json.loads(Path(path).read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not a tenants file: not JSON ({exc}); expected {example}") from None
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"{path}: not a tenants file (no 'tenants' list); expected {example}")
        from pydantic import ValidationError

        try:
            checked = _schema().validate_python(entries)
        except ValidationError as exc:
            raise ValueError(f"{path}: not a tenants file: {problems(exc, entries, 'tenants')}") from None
        try:
            return cls([Tenant(**entry.model_dump()) for entry in checked])
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def authenticate(self, key: str | None) -> Tenant | None:
        if not key:
            return None
        digest = hash_key(key)
        for known, tenant in self._by_hash.items():  # constant-time comparison, every entry
            if hmac.compare_digest(known, digest):
                return tenant
        return None
