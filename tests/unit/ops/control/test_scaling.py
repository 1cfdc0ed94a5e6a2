"""The autoscaler's decisions, closed over a fluid model of a queue (no clock, no processes)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kinfer.ops.control.scaling import Autoscaler, Observation, Reason, ScalePolicy

PER = 100.0  # records/s one replica drains while busy


def run(policy: ScalePolicy, rates: list[float], *, start: int = 1, partitions: int = 6, noise: float = 0.0,
        seed: int = 1, dt: float = 1.0) -> list[tuple[float, int, float]]:
    """Feed one observation per ``dt`` of a queue served by the recommended replicas (each at PER,
    effective at once); ``rates`` is the arrival rate per step. Returns (now, replicas, queued)."""
    rng = random.Random(seed)
    scaler, replicas, queued, out = Autoscaler(policy), start, 0.0, []
    for i, rate in enumerate(rates):
        now = i * dt
        arrival = rate * (1.0 + rng.uniform(-noise, noise))
        queued = max(0.0, queued + (arrival - replicas * PER) * dt)
        rec = scaler.observe(Observation(now, arrival, queued, round(queued), replicas, partitions,
                                         capacity_rps=replicas * PER if replicas else 0.0))
        replicas = rec.replicas
        out.append((now, replicas, queued))
    return out


def changes(trace: list[tuple[float, int, float]]) -> list[tuple[float, int]]:
    return [(t, n) for (t, n, _), (_, before, _) in zip(trace[1:], trace, strict=False) if n != before]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5000), st.floats(0, 50_000), st.integers(0, 20)), min_size=1, max_size=60),
       st.integers(1, 12), st.integers(1, 16))
def test_never_above_the_partitions_nor_the_maximum(steps: list[tuple[float, float, int]], partitions: int,
                                                    maximum: int) -> None:
    scaler = Autoscaler(ScalePolicy(min_replicas=0, max_replicas=maximum, up_cooldown_s=0, down_cooldown_s=0,
                                    down_window_s=0))
    for i, (arrival, queued, replicas) in enumerate(steps):
        rec = scaler.observe(Observation(float(i), arrival, queued, round(queued), replicas, partitions,
                                         capacity_rps=replicas * PER))
        assert 0 <= rec.replicas <= min(partitions, maximum)


@settings(max_examples=60, deadline=None)
@given(st.floats(20, 550), st.floats(0, 0.1), st.integers(0, 1000))
def test_a_steady_load_does_not_flap(rate: float, noise: float, seed: int) -> None:
    """Steady traffic with noise up to the tolerance: at most one move each way while it settles,
    then nothing for the rest of an hour."""
    trace = run(ScalePolicy(max_replicas=8), [rate] * 3600, noise=noise, seed=seed)
    moves = changes(trace)
    assert len(moves) <= 2, moves
    assert all(t < 300 for t, _ in moves), moves
    final = trace[-1][1]
    assert final * PER >= rate * 1.05  # and it carries the load (six partitions: at most 600/s)
    assert trace[-1][2] < PER  # no standing queue


@settings(max_examples=40, deadline=None)
@given(st.floats(10, 500), st.integers(0, 2**32 - 1))
def test_poisson_traffic_seen_as_the_lag_monitor_sees_it_does_not_flap(rate: float, seed: int) -> None:
    """Half-second polls of Poisson arrivals, smoothed as the lag monitor smooths them (2 s): at most
    one turn of direction in an hour (a settling move up, then down, say), never up-down-up."""
    rng = np.random.default_rng(seed)
    scaler, replicas, queued, smoothed, moves = Autoscaler(ScalePolicy(max_replicas=8)), 1, 0.0, None, []
    for i in range(7200):
        raw = rng.poisson(rate * 0.5) / 0.5
        smoothed = raw if smoothed is None else smoothed + (1 - math.exp(-0.25)) * (raw - smoothed)
        queued = max(0.0, queued + (raw - replicas * PER) * 0.5)
        rec = scaler.observe(Observation(i * 0.5, smoothed, queued, round(queued), replicas, 8,
                                         capacity_rps=replicas * PER))
        if rec.replicas != replicas:
            moves.append(1 if rec.replicas > replicas else -1)
        replicas = rec.replicas
    turns = sum(a != b for a, b in itertools.pairwise(moves))
    assert turns <= 1 and len(moves) <= 3, moves


@settings(max_examples=60, deadline=None)
@given(st.floats(40, 100), st.sampled_from([3.0, 5.0]))
def test_a_step_is_answered_within_one_cooldown(rate: float, factor: float) -> None:
    policy = ScalePolicy(max_replicas=8, up_cooldown_s=10.0)
    quiet = 600
    trace = run(policy, [rate] * quiet + [rate * factor] * 300)
    before = trace[quiet - 1][1]
    # What the new load needs (six partitions; a load within the tolerance of the target holds).
    needed = min(6, -(-rate * factor // (PER * policy.target_utilisation * (1 + policy.tolerance))))
    assume(needed > before)
    first_up = next(t for t, n in changes(trace) if t >= quiet and n > before)
    assert first_up - quiet <= policy.up_cooldown_s
    settled = next(t for t, n, _ in trace if t >= quiet and n >= needed)
    assert settled - quiet <= 3 * policy.up_cooldown_s
    assert max(q for t, _, q in trace if t > settled + 30) < PER  # the backlog is gone


def test_down_waits_for_a_whole_window_and_follows_its_highest_recommendation() -> None:
    policy = ScalePolicy(max_replicas=8, down_window_s=60.0, down_cooldown_s=30.0)
    trace = run(policy, [400.0] * 200 + [50.0] * 200)
    assert trace[199][1] == 6
    downs = [(t, n) for t, n in changes(trace) if t >= 200]
    assert downs[0][0] >= 200 + 60 - 1  # not before the window has seen only the low load
    # Down to the window's highest (the decaying arrival rate's), then to what the low load needs.
    assert downs[-1][1] == 1 and len(downs) <= 2, downs


def test_scale_to_zero_after_an_idle_window_and_activate_on_the_first_record() -> None:
    policy = ScalePolicy(min_replicas=0, max_replicas=4, down_window_s=30.0, down_cooldown_s=10.0)
    scaler = Autoscaler(policy)
    replicas = 1
    for i in range(100):  # 20 s of traffic, then nothing
        rate = 50.0 if i < 20 else 0.0
        rec = scaler.observe(Observation(float(i), rate, 0.0, 0, replicas, 3, capacity_rps=replicas * PER))
        replicas = rec.replicas
        if rec.reason is Reason.TO_ZERO:
            break
    assert replicas == 0 and rec.reason is Reason.TO_ZERO
    assert i >= 20 + 30  # the arrival rate decays, then a whole idle window
    rec = scaler.observe(Observation(i + 1.0, 0.0, 1.0, 1, 0, 3))  # one record waits
    assert rec.reason is Reason.ACTIVATE and rec.replicas == 1


def test_lag_counts_by_its_drain_time_not_its_size() -> None:
    """The same 1,000 records: a fast model clears them inside the wait budget, a slow one needs help."""
    fast = Autoscaler(ScalePolicy(max_replicas=8)).observe(
        Observation(0.0, 10.0, 1000.0, 1000, 1, 8, capacity_rps=50_000.0))
    slow = Autoscaler(ScalePolicy(max_replicas=8)).observe(
        Observation(0.0, 10.0, 1000.0, 1000, 1, 8, capacity_rps=20.0))
    assert fast.replicas == 1 and fast.reason is Reason.HOLD
    assert slow.replicas == 8 and slow.reason is Reason.UP  # capped at the maximum


def test_unknown_capacity_keeps_what_runs_and_activates() -> None:
    scaler = Autoscaler(ScalePolicy(min_replicas=0, max_replicas=4))
    assert scaler.observe(Observation(0.0, 30.0, 500.0, 500, 2, 3)).replicas == 2
    assert Autoscaler(ScalePolicy(min_replicas=0)).observe(Observation(0.0, 0.0, 5.0, 5, 0, 3)).replicas == 1


def test_replicas_beyond_the_partitions_are_scaled_down_at_once() -> None:
    rec = Autoscaler(ScalePolicy(max_replicas=8)).observe(Observation(0.0, 500.0, 0.0, 0, 5, 3, capacity_rps=500.0))
    assert rec.replicas == 3 and rec.reason is Reason.DOWN


def test_background_records_keep_one_replica_and_add_none_unless_told_to_keep_a_window() -> None:
    waiting = Observation(0.0, 0.0, 0.0, 0, 0, 8, background=50_000)
    rec = Autoscaler(ScalePolicy(min_replicas=0, replica_rps=PER)).observe(waiting)
    assert (rec.replicas, rec.reason) == (1, Reason.ACTIVATE)  # activated for it, and no more
    busy = Observation(0.0, 0.0, 0.0, 0, 1, 8, capacity_rps=PER, background=50_000)
    assert Autoscaler(ScalePolicy(replica_rps=PER)).observe(busy).replicas == 1
    # Told to drain it within 200 s: 250 records/s at 70 % of 100/s a replica is four replicas.
    told = Autoscaler(ScalePolicy(replica_rps=PER, background_within_s=200.0)).observe(busy)
    assert (told.replicas, told.reason) == (4, Reason.UP)
    empty = Autoscaler(ScalePolicy(min_replicas=0, replica_rps=PER, down_window_s=0.0, down_cooldown_s=0.0))
    assert empty.observe(Observation(0.0, 0.0, 0.0, 0, 1, 8)).replicas == 0  # both queues empty: to zero
