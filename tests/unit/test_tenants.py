from __future__ import annotations

import pytest

from producers.tenants import Tenant, Tenants, TokenBucket, hash_key
from topics import Priority


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
