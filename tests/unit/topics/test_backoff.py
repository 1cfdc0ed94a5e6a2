"""The one retry schedule: doubling up to a ceiling, jittered within the upper half, reset on success."""

from __future__ import annotations

import pytest

from kinfer.topics.backoff import Backoff


def test_doubles_to_the_ceiling_with_jitter_and_resets() -> None:
    b = Backoff(0.1, 1.0)
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for ceiling in ceilings:
        assert ceiling / 2 <= b.next_delay() <= ceiling
    b.reset()
    assert 0.05 <= b.next_delay() <= 0.1
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
