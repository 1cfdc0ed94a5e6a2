"""The telemetry processor's summary of its windowed tables, without a broker."""

from __future__ import annotations

from typing import Any

import pytest

from kinfer.ops.control.telemetry import summarize


def test_summary_of_two_windows() -> None:
    windows: dict[str, Any] = {
        "inputs": 30, "requests": 20, "batches": 10, "steps": 0, "service_n": {1: 5, 4: 5},
        "service_ms": {1: 50.0, 4: 150.0}, "shed": {"codel": 2, "expired": 0},
    }
    s = summarize("m", window_s=10.0, elapsed_s=5.0, windows=windows, total=99, workers=1)
    assert s.inputs_rps == pytest.approx(2.0) and s.mean_batch == 3.0
    assert s.service_ms == pytest.approx(20.0) and s.service_ms_by_size == {1: 10.0, 4: 30.0}
    assert s.shed == {"codel": 2} and s.inputs_total == 99
    assert s.capacity_rps == pytest.approx(100.0)  # 2 requests per batch, a batch every 20 ms
