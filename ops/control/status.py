"""``kinfer status``: per model, its lag, rates, level and throughput, and the latest decisions.

Everything comes from Redis, where the lag monitor (health states, level changes) and the
telemetry stream (throughput, service time, sheds) publish; a model missing from one of them
shows dashes there. A record that does not decode is left out; at most ``MAX_KEYS`` keys of each
kind are read (Redis may hold anything anyone wrote there).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis

from kinfer.ops.control.scaling import SCALE_DECISIONS_KEY, SCALE_STATE_PREFIX, ScaleDecision, ScaleState
from kinfer.topics import MalformedRecord
from kinfer.topics.health import DECISIONS_KEY, HEALTH_KEY_PREFIX, HealthState, LevelChange
from kinfer.topics.record import MAX_SKEW_MS
from kinfer.topics.residency import RESIDENCY_FRESH_MS, RESIDENCY_KEY, WorkerResidency
from kinfer.topics.stats import STATS_KEY_PREFIX, ModelStats

T = TypeVar("T")
GIB = 1 << 30
MAX_KEYS = 1_024  # health states, summaries, autoscaler states read (of each); residency reports read


@dataclass(frozen=True, slots=True)
class Snapshot:
    health: dict[str, HealthState]
    stats: dict[str, ModelStats]
    changes: list[LevelChange]  # newest first
    scaling: dict[str, ScaleState] = field(default_factory=dict)  # the autoscalers' latest state
    scale_changes: list[ScaleDecision] = field(default_factory=list)  # newest first
    residency: list[WorkerResidency] = field(default_factory=list)  # each worker's tiers (fresh reports)

    def models(self) -> list[str]:
        return sorted(set(self.health) | set(self.stats) | set(self.scaling))

    def to_json(self) -> dict[str, Any]:
        return {
            "models": {
                m: {"health": self.health[m].to_wire() if m in self.health else None,
                    "stats": {**self.stats[m].to_wire(), "capacity_rps": round(self.stats[m].capacity_rps, 2)}
                    if m in self.stats else None,
                    "autoscale": self.scaling[m].to_wire() if m in self.scaling else None}
                for m in self.models()
            },
            "scale_decisions": [d.to_wire() for d in self.scale_changes],
            "residency": [r.to_wire() for r in self.residency],
            "decisions": [
                {"at_ms": c.at_ms, "model": c.model, "from": c.before.name.lower() if c.before is not None else None,
                 "to": c.after.name.lower(), "lag": c.lag, "predicted_wait_ms": c.predicted_wait_ms}
                for c in self.changes
            ],
        }


async def _load(redis: aioredis.Redis, prefix: str, parse: Callable[[bytes], T]) -> list[T]:
    keys: list[bytes | str] = []
    cursor = 0
    while True:
        cursor, page = await redis.scan(cursor, match=f"{prefix}*", count=500)
        keys += page[:MAX_KEYS - len(keys)]
        if not cursor or len(keys) >= MAX_KEYS:
            break
    out = []
    for data in await redis.mget(keys) if keys else []:
        if isinstance(data, bytes):  # a key can expire between the scan and the read
            with contextlib.suppress(MalformedRecord):
                out.append(parse(data))
    return out


async def snapshot(redis: aioredis.Redis, decisions: int = 10) -> Snapshot:
    health = {h.model: h for h in await _load(redis, HEALTH_KEY_PREFIX, HealthState.unpack)}
    stats = {s.model: s for s in await _load(redis, STATS_KEY_PREFIX, ModelStats.unpack)}
    scaling = {s.model: s for s in await _load(redis, SCALE_STATE_PREFIX, ScaleState.unpack)}
    changes = await _latest(redis, DECISIONS_KEY, decisions, LevelChange.unpack)
    scale_changes = await _latest(redis, SCALE_DECISIONS_KEY, decisions, ScaleDecision.unpack)
    residency = []
    cursor = 0
    while True:
        cursor, page = await redis.hscan(RESIDENCY_KEY, cursor, count=256)
        for data in page.values() if isinstance(page, dict) else ():
            with contextlib.suppress(MalformedRecord):
                report = WorkerResidency.unpack(data)
                if -MAX_SKEW_MS <= time.time() * 1000 - report.updated_ms <= RESIDENCY_FRESH_MS:
                    residency.append(report)
        if not cursor or len(residency) >= MAX_KEYS:
            break
    return Snapshot(health, stats, changes, scaling, scale_changes, sorted(residency, key=lambda r: r.worker))


async def _latest(redis: aioredis.Redis, key: str, n: int, parse: Callable[[bytes], T]) -> list[T]:
    out = []
    for data in await redis.lrange(key, 0, n - 1) if n > 0 else []:
        if isinstance(data, bytes):
            with contextlib.suppress(MalformedRecord):
                out.append(parse(data))
    return out


def render(snap: Snapshot, now_ms: int | None = None) -> str:
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    rows = [("model", "level", "lag p0/p1/p2", "in/s", "drain/s", "wait ms", "served/s", "batch", "svc ms",
             "shed (window)", "workers", "age s")]
    for m in snap.models():
        h, s, a = snap.health.get(m), snap.stats.get(m), snap.scaling.get(m)
        updated = max(h.updated_ms if h else 0, s.updated_ms if s else 0)
        rows.append((
            m,
            h.level.name.lower() if h else "-",
            "/".join(str(n) for n in h.lag_by_priority) if h else "-",
            f"{h.arrival_rps:.1f}" if h else "-",
            f"{h.drain_rps:.1f}" if h else "-",
            (f"cold {h.cold_start_ms:.0f}" if h.warm_replicas == 0 and h.cold_start_ms else
             f"{h.predicted_wait_ms:.0f}") if h else "-",
            f"{s.inputs_rps:.1f}" if s else "-",
            f"{s.mean_batch:.1f}" if s else "-",
            f"{s.service_ms:.1f}" if s else "-",
            ",".join(f"{r}={n}" for r, n in sorted(s.shed.items())) or "0" if s else "-",
            # serving (telemetry) / run by the autoscaler (wants) [its range]
            f"{s.workers if s else '-'}/{a.replicas} (wants {a.recommended}) [{a.min_replicas}..{a.max_replicas}]"
            if a else str(s.workers) if s else "-",
            f"{(now_ms - updated) / 1000:.1f}",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if len(rows) == 1:
        lines.append("(no model has a health state or statistics: are `kinfer lagmon` and `kinfer telemetry` up?)")
    lines.append("")
    lines.append("recent decisions (newest first):" if snap.changes else "no level changes recorded")
    for c in snap.changes:
        at = time.strftime("%H:%M:%S", time.localtime(c.at_ms / 1000))
        before = c.before.name.lower() if c.before is not None else "(start)"
        lines.append(f"  {at}  {c.model}: {before} -> {c.after.name.lower()}  "
                     f"(lag {c.lag}, predicted wait {c.predicted_wait_ms:.0f} ms)")
    if any(r.budget_bytes for r in snap.residency):
        lines.append("")
        lines.append("residency (workers under a memory budget; swap-in = weights loaded, warm-up, group joined):")
        for r in snap.residency:
            if not r.budget_bytes:
                continue
            used = sum(entry.footprint_bytes for entry in r.models if entry.tier == "device")
            lines.append(f"  {r.worker}: {used / GIB:.2f} of {r.budget_bytes / GIB:.2f} GiB")
            for entry in r.models:
                swaps = ", ".join(f"from {tier} {ms:.0f} ms" for tier, ms in sorted(entry.swap_in_ms.items()))
                lines.append(f"    {entry.model:<24} {entry.tier:<8} {entry.footprint_bytes / GIB:7.2f} GiB  "
                             f"{swaps or '-'}")
    if snap.scale_changes:
        lines.append("")
        lines.append("autoscaler (newest first):")
    for d in snap.scale_changes:
        at = time.strftime("%H:%M:%S", time.localtime(d.at_ms / 1000))
        lines.append(f"  {at}  {d.model}: {d.before} -> {d.after} workers ({d.reason}: load {d.load_rps:.1f}/s, "
                     f"{d.replica_rps:.1f}/s per worker, queued {d.queued:.0f}, drain {d.wait_ms:.0f} ms)")
    return "\n".join(lines)
