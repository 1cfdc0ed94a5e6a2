"""The client's view of the health signal: the latest state per model, pushed over Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kinfer.producers import metrics
from kinfer.producers.replies import stop_task
from kinfer.topics import MalformedRecord, now_ms
from kinfer.topics.backoff import Backoff
from kinfer.topics.health import HEALTH_CHANNEL, HealthState

log = logging.getLogger(__name__)

STALE_MS = 10_000  # a state older than this is no signal at all (the monitor may be down)
# A state dated later than now + this is not believed: clocks differ by less, and a forged state
# dated an hour ahead would otherwise outlive the staleness rule.
MAX_SKEW_MS = 2_000


class HealthWatch:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._states: dict[str, HealthState] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="kinfer-health-watch")

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)

    def get(self, model: str) -> HealthState | None:
        state = self._states.get(model)
        if state is None or not -MAX_SKEW_MS <= now_ms() - state.updated_ms <= STALE_MS:
            return None
        return state

    async def _watch(self) -> None:
        backoff = Backoff(0.5)
        while True:  # best effort: without Redis there is no signal, and admission falls back to throttling
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(HEALTH_CHANNEL)
                backoff.reset()
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    with contextlib.suppress(MalformedRecord):
                        state = HealthState.unpack(msg["data"])
                        if state.updated_ms > now_ms() + MAX_SKEW_MS:
                            metrics.IGNORED_HEALTH.labels("future").inc()
                            continue
                        previous = self._states.get(state.model)
                        if previous is None or previous.level != state.level:
                            metrics.LEVEL_CHANGES_SEEN.labels(state.model, state.level.name.lower()).inc()
                            metrics.LEVEL_SEEN.labels(state.model).set(int(state.level))
                        self._states[state.model] = state
            except (RedisError, OSError) as exc:
                log.debug("health watch lost Redis: %s", exc)
                await asyncio.sleep(backoff.next_delay())
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
