"""``kinfer bench placement``'s arithmetic: the Zipf mix and what a run's outcomes add up to."""

from __future__ import annotations

import pytest

from kinfer.ops.bench.placement import summarise, zipf_weights


def test_zipf_weights_sum_to_one_and_fall_with_rank() -> None:
    w = zipf_weights(6, 1.5)
    assert sum(w) == pytest.approx(1.0)
    assert w == sorted(w, reverse=True) and w[0] / w[1] == pytest.approx(2 ** 1.5)


def test_summary_separates_hot_from_cold_and_counts_the_lost() -> None:
    outcomes = [
        *({"model": "a", "kind": "ok", "cold_at_send": False, "latency_ms": float(ms)} for ms in range(1, 101)),
        {"model": "b", "kind": "ok", "cold_at_send": True, "latency_ms": 900.0},
        {"model": "b", "kind": "ok", "cold_at_send": True, "latency_ms": 1100.0},
        {"model": "b", "kind": "ok", "cold_at_send": False, "latency_ms": 20.0},
        {"model": "c", "kind": "refused_cold", "cold_at_send": True, "latency_ms": 1.0},
        {"model": "c", "kind": "timed_out", "cold_at_send": True, "latency_ms": 6000.0},
        {"model": "c", "kind": "timed_out", "cold_at_send": True, "latency_ms": 6000.0},
    ]
    s = summarise(outcomes, ["a"], late_replies=1)  # one of the two timed out was answered, late
    assert (s["hot_p95_ms"], s["hot_p99_ms"], s["hot_ok_fraction"], s["hot_meets_sla"]) == (95.0, 99.0, 1.0, True)
    assert (s["cold_requests"], s["cold_requests_served"], s["cold_requests_refused_cold"]) == (6, 3, 1)
    assert s["cold_start_ms"] == 1000.0 and s["cold_start_requests"] == 2  # sent while cold, to its result
    assert (s["timed_out"], s["lost"]) == (2, 1) and s["by_model"]["c"] == {"refused_cold": 1, "timed_out": 2}


def test_a_run_without_hot_results_reports_none_not_nan() -> None:
    s = summarise([{"model": "a", "kind": "timed_out", "cold_at_send": False, "latency_ms": 1.0}], ["a"])
    assert s["hot_p95_ms"] is None and s["cold_start_ms"] is None and not s["hot_meets_sla"]


def test_the_hot_tail_says_where_its_time_went() -> None:
    from kinfer.topics import Timings

    outcomes = [{"model": "a", "kind": "ok", "cold_at_send": False, "latency_ms": float(ms),
                 "timings": Timings(queue_ms=ms / 2, batch_wait_ms=1.0, compute_ms=4.0, batch_size=1)}
                for ms in range(1, 101)]
    tail = summarise(outcomes, ["a"])["hot_tail"]  # the answers at or above p95: 95..100 ms
    assert tail["requests"] == 6 and tail["latency_ms"] == 97.5
    assert (tail["queue_ms"], tail["batch_wait_ms"], tail["compute_ms"]) == (48.8, 1.0, 4.0)
    assert tail["outside_ms"] == pytest.approx(97.5 - 48.75 - 5.0, abs=0.1)
