"""The client's view of the health signal: the latest state per model, pushed over Redis.

Each message on ``kinfer:health`` is taken on its own (``HealthWatch.accept``): one that does not
decode, or is dated ahead of this clock, is counted and skipped. The loop survives Redis outages
(it resubscribes with backoff) and anything else (``Supervised`` restarts it; ``up`` and
``kinfer_reader_up{reader="health-watch"}`` say so while it is down, and admission then runs on
adaptive throttling alone). At most ``MAX_MODELS`` models' states are kept, with their metric labels:
a new one beyond that replaces a stale state, else the oldest.
"""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis

from kinfer.producers import metrics
from kinfer.producers.replies import stop_task
from kinfer.topics import now_ms
from kinfer.topics.backoff import Backoff
from kinfer.topics.health import HEALTH_CHANNEL, HealthState, Level
from kinfer.topics.readers import Supervised, read, subscribed
from kinfer.topics.record import MAX_SKEW_MS

READER = "health-watch"
STALE_MS = 10_000  # a state older than this is no signal at all (the monitor may be down)
MAX_MODELS = 1_024  # models whose latest state (and metric labels) a client keeps

__all__ = ["MAX_MODELS", "MAX_SKEW_MS", "STALE_MS", "HealthWatch"]


class HealthWatch:
    def __init__(self, redis: aioredis.Redis, max_models: int = MAX_MODELS) -> None:
        self._redis = redis
        self._states: dict[str, HealthState] = {}
        self._max_models = max_models
        self._task: asyncio.Task[None] | None = None
        self._reader = Supervised(READER, self._watch)

    def start(self) -> None:
        self._task = asyncio.create_task(self._reader.run(), name="kinfer-health-watch")

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)

    @property
    def up(self) -> bool:
        """False while the watch is not running (not started, or waiting to restart after a failure)."""
        return self._reader.up

    def get(self, model: str) -> HealthState | None:
        state = self._states.get(model)
        if state is None or not _fresh(state, now_ms()):
            return None
        return state

    def accept(self, data: object, now: int) -> HealthState | None:
        """One message off the channel: the state it holds, now the model's latest, or None (counted)."""
        state = read(HealthState, data, READER, now)  # counted when refused, "future" among the reasons
        if state is None:
            return None
        previous = self._states.get(state.model)
        if previous is None:
            self._make_room(now)
        if previous is None or previous.level != state.level:
            metrics.LEVEL_CHANGES_SEEN.labels(state.model, state.level.name.lower()).inc()
            metrics.LEVEL_SEEN.labels(state.model).set(int(state.level))
        self._states[state.model] = state
        return state

    def _make_room(self, now: int) -> None:
        """Below ``max_models`` states: stale ones go first, else the oldest, with their labels."""
        if len(self._states) < self._max_models:
            return
        stale = [m for m, s in self._states.items() if not _fresh(s, now)]
        gone = stale or [min(self._states, key=lambda m: self._states[m].updated_ms)]
        for model in gone:
            del self._states[model]
            with contextlib.suppress(KeyError):
                metrics.LEVEL_SEEN.remove(model)
            for level in Level:
                with contextlib.suppress(KeyError):
                    metrics.LEVEL_CHANGES_SEEN.remove(model, level.name.lower())

    async def _watch(self) -> None:
        # Best effort: without Redis there is no signal, and admission falls back to throttling.
        async for data in subscribed(self._redis, HEALTH_CHANNEL, backoff=Backoff(0.5)):
            self.accept(data, now_ms())


def _fresh(state: HealthState, now: int) -> bool:
    return -MAX_SKEW_MS <= now - state.updated_ms <= STALE_MS
