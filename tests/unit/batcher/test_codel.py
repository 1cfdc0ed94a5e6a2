"""CoDel's control law: a drop it allows and the caller does not take leaves the drop rate where it was."""

from __future__ import annotations

import pytest

from kinfer.batcher import CoDel


def _standing(target_s: float = 0.05, interval_s: float = 0.5) -> CoDel:
    c = CoDel(target_s, interval_s)
    c.observe(0.1, 0.0)
    c.observe(0.1, interval_s)  # above target for a whole interval: dropping
    assert c.dropping
    return c


def test_drops_taken_come_ever_closer_and_drops_spared_do_not() -> None:
    taken, spared = _standing(), _standing()
    taken_gaps, spared_gaps = [], []
    for _ in range(50):
        for c, gaps in ((taken, taken_gaps), (spared, spared_gaps)):
            at = c.next_drop_at()
            assert at is not None and c.should_drop(at)
            gaps.append(c.next_drop_at() - at)  # type: ignore[operator]
        spared.spare()  # nothing worth shedding: the standing queue still drains in time
    assert taken_gaps[-1] == pytest.approx(0.5 / 50**0.5)  # interval / sqrt(count)
    assert spared_gaps[0] == pytest.approx(0.5) and max(spared_gaps) == pytest.approx(0.5)  # as at first
    assert spared.count == 1
