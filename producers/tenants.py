"""Who may call the gateway, how often, and at what priority at best.

API keys are stored hashed (SHA-256, hex) in a JSON file, so the file can live in configuration
management without being a secret itself:

    {"tenants": [{"name": "search", "key_sha256": "<hex>", "rate_per_s": 50, "burst": 100,
                  "max_priority": 0}]}

``kinfer gateway --hash-key KEY`` prints the hash of a key. The token bucket is pure (``now`` is
passed in), so its behaviour is tested without sleeping.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path

from topics import Priority


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


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
    bucket: TokenBucket = field(init=False)

    def __post_init__(self) -> None:
        self.max_priority = Priority.parse(self.max_priority)
        self.bucket = TokenBucket(self.rate_per_s, self.burst)

    def clamp(self, priority: Priority) -> Priority:
        """Asking for better than allowed gets the best allowed, not an error."""
        return Priority(max(int(priority), int(self.max_priority)))

    def __repr__(self) -> str:  # never print the key hash in logs
        return f"Tenant({self.name!r}, rate_per_s={self.rate_per_s}, max_priority={self.max_priority.label})"


class Tenants:
    def __init__(self, tenants: list[Tenant]) -> None:
        self._by_hash = {t.key_sha256: t for t in tenants}

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        """Raises ``ValueError`` naming the file and what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
            entries = data["tenants"]
            if not isinstance(entries, list):
                raise TypeError("'tenants' must be a list")
            return cls([Tenant(**entry) for entry in entries])
        except (KeyError, TypeError, ValueError) as exc:
            example = '{"tenants": [{"name": "search", "key_sha256": "<hex>", "rate_per_s": 50}]}'
            raise ValueError(f"{path}: not a tenants file ({type(exc).__name__}: {exc}); expected {example}") from exc

    def authenticate(self, key: str | None) -> Tenant | None:
        if not key:
            return None
        digest = hash_key(key)
        for known, tenant in self._by_hash.items():  # constant-time comparison, every entry
            if hmac.compare_digest(known, digest):
                return tenant
        return None
