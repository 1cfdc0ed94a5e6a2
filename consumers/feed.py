"""The state a worker's tasks share: each hosted model's feed, its lifecycle, and the signals. No I/O.

A feed is the I/O side of one hosted model: where its requests come from (its consumer in the
model's group), how far they are done (offsets, the poison guard), and where the model is in its
lifecycle. The lifecycle is an explicit state with named transitions; a move the table below does
not list is a defect and is refused (``IllegalTransition``), never made:

    transition  from               to        what happened
    load        DISK, HOST         LOADING   a swap-in began: weights on their way to the device
    warm        LOADING            WARM      weights on the device, warmed up, not joining (start-up
                                             joins later; a worker that stops joins no more)
    join        LOADING, WARM      JOINING   the consumer subscribes to the model's topics, fetching starts
    joined      JOINING            SERVING   its first partitions came, or the wait for them ended
    drain       SERVING            DRAINING  its place on the device is wanted: fetch nothing more
    undrain     DRAINING           SERVING   it is not wanted any more
    leave       SERVING, DRAINING  LEAVING   a swap-out began: fetching ends, what is here is answered
    left        LEAVING            WARM      committed and out of the group (a stopping worker keeps the
                                             consumer for its shutdown to stop); weights still on the device
    offload     WARM               HOST      weights copied to host RAM
    unload      WARM, HOST         DISK      weights dropped
    fail        any                DISK      a swap failed: the model goes back to disk

Only a model on the device is in its group (JOINING, SERVING, DRAINING, LEAVING). While LOADING its
weights are still where they came from; a residency report says ``loading`` from the swap-in's start
until its first partitions came (LOADING, JOINING).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from kinfer.batcher.residency import Tier
from kinfer.consumers.cores import EngineCore
from kinfer.consumers.offsets import OffsetTracker
from kinfer.consumers.poison import DeliveryGuard
from kinfer.topics import Priority
from kinfer.topics.names import parse_request_topic


class FeedState(enum.Enum):
    DISK = "disk"  # weights on disk; out of the group
    HOST = "host"  # weights in host RAM; out of the group
    LOADING = "loading"  # swap-in: weights on their way to the device, then warm-up passes
    WARM = "warm"  # weights on the device, warm; out of the group
    JOINING = "joining"  # in the group, fetching; its first partitions have not come yet
    SERVING = "serving"  # in the group, fetching
    DRAINING = "draining"  # in the group, fetching nothing more: its place on the device is wanted
    LEAVING = "leaving"  # swap-out: fetching has ended; answering what is here, committing, leaving


# Every transition: the states it may start from, and the state it leads to.
TRANSITIONS: dict[str, tuple[frozenset[FeedState], FeedState]] = {
    "load": (frozenset({FeedState.DISK, FeedState.HOST}), FeedState.LOADING),
    "warm": (frozenset({FeedState.LOADING}), FeedState.WARM),
    "join": (frozenset({FeedState.LOADING, FeedState.WARM}), FeedState.JOINING),
    "joined": (frozenset({FeedState.JOINING}), FeedState.SERVING),
    "drain": (frozenset({FeedState.SERVING}), FeedState.DRAINING),
    "undrain": (frozenset({FeedState.DRAINING}), FeedState.SERVING),
    "leave": (frozenset({FeedState.SERVING, FeedState.DRAINING}), FeedState.LEAVING),
    "left": (frozenset({FeedState.LEAVING}), FeedState.WARM),
    "offload": (frozenset({FeedState.WARM}), FeedState.HOST),
    "unload": (frozenset({FeedState.WARM, FeedState.HOST}), FeedState.DISK),
    "fail": (frozenset(FeedState), FeedState.DISK),
}
# The states whose weights are off the device. LOADING's are still where they came from; every other
# state's are on the device.
_RESTING_TIER = {FeedState.DISK: Tier.DISK, FeedState.HOST: Tier.HOST}


class IllegalTransition(RuntimeError):
    """A lifecycle move the transition table does not allow: a defect of the caller."""

    def __init__(self, transition: str, state: FeedState) -> None:
        super().__init__(f"{transition!r} is not allowed from {state.name}")
        self.transition = transition
        self.state = state


class FeedLifecycle:
    """Where one model is in its lifecycle; changed only by the named transitions (module docstring)."""

    def __init__(self) -> None:
        self._state = FeedState.DISK
        self._source = Tier.DISK  # where the weights come from while LOADING

    @property
    def state(self) -> FeedState:
        return self._state

    def _go(self, transition: str) -> None:
        sources, target = TRANSITIONS[transition]
        if self._state not in sources:
            raise IllegalTransition(transition, self._state)
        self._state = target

    def load(self) -> None:
        source = self.tier
        self._go("load")
        self._source = source

    def warm(self) -> None:
        self._go("warm")

    def join(self) -> None:
        self._go("join")

    def joined(self) -> None:
        self._go("joined")

    def drain(self) -> None:
        self._go("drain")

    def undrain(self) -> None:
        self._go("undrain")

    def leave(self) -> None:
        self._go("leave")

    def left(self) -> None:
        self._go("left")

    def offload(self) -> None:
        self._go("offload")

    def unload(self) -> None:
        self._go("unload")

    def fail(self) -> None:
        self._go("fail")

    @property
    def tier(self) -> Tier:
        """Where the weights are now."""
        if self._state is FeedState.LOADING:
            return self._source
        return _RESTING_TIER.get(self._state, Tier.DEVICE)

    @property
    def shown(self) -> str:
        """What a residency report says: ``loading`` during a swap-in, else the tier."""
        if self._state in (FeedState.LOADING, FeedState.JOINING):
            return "loading"
        return self.tier.name.lower()

    @property
    def draining(self) -> bool:
        """Flow control holds every priority: nothing more is fetched."""
        return self._state in (FeedState.DRAINING, FeedState.LEAVING)

    @property
    def leaving(self) -> bool:
        """The fetch loop ends."""
        return self._state is FeedState.LEAVING


@dataclass(eq=False)
class Feed:
    """The I/O side of one hosted model: where its requests come from and how far they are done."""

    core: EngineCore
    consumer: AIOKafkaConsumer | None = None  # set while the worker is a member of the model's group
    parked: AIOKafkaConsumer | None = None  # started, out of the group: kept for the next swap-in
    tracker: OffsetTracker[TopicPartition] = field(default_factory=OffsetTracker)
    guard: DeliveryGuard[TopicPartition] = field(default_factory=DeliveryGuard)  # records that stop workers
    held: set[Priority] = field(default_factory=set)  # priorities whose partitions are paused
    priority_of: dict[TopicPartition, Priority] = field(default_factory=dict)
    lifecycle: FeedLifecycle = field(default_factory=FeedLifecycle)
    fetching: asyncio.Task[None] | None = None
    assigned: asyncio.Event = field(default_factory=asyncio.Event)  # partitions came with the last join
    swap_in_ms: dict[str, float] = field(default_factory=dict)  # last measured, by source tier
    retry_at: float = 0.0  # a failed swap: not tried again before this (monotonic)
    running: int = 0  # model calls of it in the executor now

    def busy(self) -> bool:
        """Requests of it in this process: buffered, running, or replies not yet out (a running call
        counts by itself: a rebalance may have dropped its offsets from the tracker)."""
        return self.running > 0 or self.core.has_work() or self.core.buffered() > 0 or self.tracker.in_flight() > 0

    @property
    def name(self) -> str:
        return self.core.name

    @property
    def tier(self) -> Tier:
        """Where its weights are; only a DEVICE model is in its group."""
        return self.lifecycle.tier

    def priority(self, tp: TopicPartition) -> Priority:
        found = self.priority_of.get(tp)
        if found is None:
            found = self.priority_of[tp] = parse_request_topic(tp.topic)[1]
        return found


@dataclass(frozen=True, eq=False)
class Signals:
    """How the worker's tasks tell each other that something changed. One event loop, no locks."""

    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # stop fetching, drain, stop
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # something changed for the dispatch loop
    commit: asyncio.Event = field(default_factory=asyncio.Event)  # some reply went out: commit what is done
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # some request is done: a model may be idle
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # dispatch and publishing over; final commit
