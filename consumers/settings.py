"""A worker's settings: one typed dataclass, checked when it is made; the command line's flags come from it."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from kinfer.batcher import BatchPolicy, GenPolicy
from kinfer.consumers.poison import CAREFUL_RECORDS
from kinfer.consumers.runners import ModelSpec
from kinfer.topics import DEFAULT_LIMITS, Limits


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    models: tuple[ModelSpec, ...]  # one core each; co-located models share the executor fairly
    bootstrap: str  # Kafka bootstrap servers, "host:port[,host:port]"
    redis_url: str  # redis://host:port/db
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    gen_policy: GenPolicy = field(default_factory=GenPolicy)  # for generator models
    weights: dict[str, float] = field(default_factory=dict)  # fair-share weight by model (default 1)
    # Declared device footprint by model, GiB (weights and the KV cache it reserves: what a placement
    # planned with); the residency budget counts the larger of it and the weights measured once loaded.
    footprints: dict[str, float] = field(default_factory=dict)
    fair_quantum_ms: float = 50.0  # compute a model may use per turn; co-located, also the longest batch
    limits: Limits = DEFAULT_LIMITS
    device: str = "auto"  # "auto" picks CUDA when available
    # Torch intra-op threads. None: the CPUs this process may run on (its affinity), less one for
    # the worker's own event loop, shared by the ``workers_per_host`` workers on them.
    threads: int | None = None
    workers_per_host: int = 1
    # Model calls in flight at once (one-shot families only): one worker with N executors serves one
    # queue on N cores (M/M/N), where N single-executor workers split the traffic by partition into N
    # queues that cannot help each other. Each call uses ``threads`` intra-op threads. None: on CPU, for
    # embedding and classifier models, the worker's share of the CPUs over ``threads`` (two cores, one
    # worker: two single-thread calls); else one.
    executors: int | None = None
    max_buffered_inputs: int = 512  # fetched inputs held in memory per model before its partitions pause
    fetch_max_records: int = 500  # records per getmany()
    fetch_max_wait_ms: int = 50  # how long the broker holds a fetch that has no records yet
    commit_interval_ms: int = 100  # commits are coalesced: at most one round of them this often
    # Group liveness: a killed worker's partitions move after this. 6 s is the broker's default floor
    # (group.min.session.timeout.ms); a graceful stop leaves the group at once and does not wait for it.
    session_timeout_ms: int = 6_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000  # must exceed the slowest batch
    instance_id: str | None = None  # static group membership: a restart with the same id rejoins at once
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a container, for a scraper outside it
    drain_timeout_s: float = 30.0  # on SIGTERM, finish buffered work for at most this long
    # After an owner of a partition stopped without handing it over, its next owner works this many
    # records alone, one at a time, so that a record that stops workers is pinned down and dead-lettered
    # (``consumers.poison``). 0: off.
    careful_records: int = CAREFUL_RECORDS
    # The tenant registry (the gateway's tenants file): with it, a request's tenant must be listed and
    # may not ask for better than its ceiling. Requests must be signed whenever the process has
    # signing secrets (KINFER_SIGNING_SECRET); a registry without them is refused at start.
    tenants: str | None = None
    # Residency (``batcher.residency``): with a budget, the models that do not fit are registered, not
    # resident — swapped in when their records wait, the least valuable idle one out to make room.
    memory_budget: float | None = None  # GiB of device memory for weights; None: every model resident
    host_memory_budget: float = 0.0  # GiB of host RAM for weights swapped off the device (0: to disk)
    keep_warm: int = 0  # never swap out a model that has this many warm replicas or fewer, this one included
    swap_quantum_s: float = 10.0  # a model with work keeps the device this long before a waiting one may take it
    prefetch_lag: int = 100  # records waiting for a model others have warm before this worker swaps it in too
    residency_interval_s: float = 0.5  # how often the worker looks at its cold models' lag
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a worker needs at least one model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if self.max_buffered_inputs < self.policy.max_batch_size:
            raise ValueError(
                f"max_buffered_inputs ({self.max_buffered_inputs}) must be >= "
                f"policy.max_batch_size ({self.policy.max_batch_size})"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.workers_per_host < 1:
            raise ValueError(f"workers_per_host must be >= 1, got {self.workers_per_host}")
        if self.executors is not None and self.executors < 1:
            raise ValueError(f"executors must be >= 1, got {self.executors}")
        if (self.executors or 1) > 1 and any(m.family == "generator" for m in self.models):
            raise ValueError("executors > 1 is for one-shot models: a generator's running batch is one")
        if self.commit_interval_ms < 0:
            raise ValueError(f"commit_interval_ms must be >= 0, got {self.commit_interval_ms}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be > 0 GiB, got {self.memory_budget}")
        if self.host_memory_budget < 0 or self.keep_warm < 0 or self.swap_quantum_s < 0:
            raise ValueError("host_memory_budget, keep_warm and swap_quantum_s must be >= 0")
        for what, table in (("weights", self.weights), ("footprints", self.footprints)):
            unknown = set(table) - set(names)
            if unknown:
                raise ValueError(f"{what} for models this worker does not host: {sorted(unknown)}")


__all__ = ["WorkerSettings"]
