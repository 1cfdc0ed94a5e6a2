"""The suite's order: the longest files first.

``make test`` spreads files over its workers, one more than the cores (pytest-xdist, ``--dist
loadfile``), handing each worker the next file in collection order as it finishes one. A minute-long
scenario collected last runs alone while the other workers idle; collected first, the short files fill
in around it. So files holding a ``slow`` test go first, then the other integration files, then the
unit tests (a stable sort: the order within each group, and within each file, is kept). Files marked
``clock`` compare latencies or count missed deadlines: they go last, when the soaks that would starve
them of CPU are over (``make test`` runs them alone, after the rest).

Hypothesis runs without its clock-based checks (a per-example deadline, "data generation is too
slow"): beside the soaks on two cores an example can take seconds, and the suite asserts by counts,
not by the clock. A test's own ``settings`` still add to this profile.

Every Kafka broker the suite starts runs on the JIT's first tier alone (``KAFKA_OPTS``, which the
local stack passes to its brokers): a broker that lives a minute spent more CPU compiling for peak
speed than serving, and the suite's brokers took a third of its CPU. Measured on one broker, 10,000
records through it: 3.2-3.5 s of CPU to ready against 5.3-5.8, 5.6 s under the load against 12-13.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("KAFKA_OPTS", "-XX:TieredStopAtLevel=1")

settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank: dict[str, int] = {}
    for item in items:
        if item.get_closest_marker("clock"):
            here = 3
        else:
            here = 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("integration") else 2
        rank[item.path.as_posix()] = min(here, rank.get(item.path.as_posix(), 3))
    items.sort(key=lambda item: rank[item.path.as_posix()])
