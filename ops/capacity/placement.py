"""``kinfer place``: which models get a worker pool of their own and which share GPUs (pure math).

The inputs are measured, per model: its footprint (GiB of device memory while resident), what one
replica serves at the SLA (``replica_rps``, from ``kinfer bench``) and the traffic it should expect
(``expected_rps``). A model's *compute share* is ``expected_rps / replica_rps``: the GPUs it keeps
busy. The rule:

1. **Dedicated pool** for a hot model: one whose share, over the target utilisation, is at least
   ``dedicated_threshold`` GPUs (0.5 by default). Precisely (:meth:`Fleet.dedicates`): ``gpu_share >=
   dedicated_threshold × (1 - EPS)``, so a share that reaches the threshold in the decimal numbers as
   written but falls a rounding step short in floats (3 of 10 requests/s at 75 % is 0.4 GPU, computed
   0.39999999999999997) is hot, and a model short of it by more than a billionth of the threshold is
   not; the slack is relative, so no threshold, however small, makes an idle model hot. Replicas =
   ``ceil(expected_rps / (replica_rps × target_utilisation))``, at least its keep-warm count, plus
   ``spare_replicas``; one GPU each.
2. **Co-location** for the long tail: first-fit decreasing onto as few GPUs as possible, a GPU
   holding models while the sum of their compute shares stays within the target utilisation and
   the sum of their footprints within the GPU's memory less ``memory_headroom``. Each model's
   fair-share weight on its worker is its share of that GPU's compute.
3. **Weight swapping** when the long tail does not fit resident on the GPUs left: the coldest
   models (fewest requests/s, so fewest swap-ins) are registered on a worker with
   ``--memory-budget`` but not kept resident; they share one swap slot (the largest of them), so a
   swap-in never evicts a resident model. The fewest such models that make it fit are chosen.
4. **Infeasible** when even that does not fit (compute is short): the answer is how many GPUs would
   do (``gpus_needed``).

No I/O here except :func:`load_models`; ``tests/unit/ops/capacity/test_placement.py`` checks the invariants with
Hypothesis and the worked example in docs/capacity.md (``ops/deploy/models.example.yaml``).
"""

from __future__ import annotations

import functools
import math
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kinfer.topics.names import MODEL_PATTERN
from kinfer.topics.validation import problems

EPS = 1e-9  # float slack in every comparison: of sums (absolute), of a share with the threshold (relative)
MIN_WEIGHT = 0.01  # a model with no traffic yet still gets turns: the worker refuses a weight of 0


@dataclass(frozen=True, slots=True)
class ModelLoad:
    name: str
    footprint_gib: float  # device memory while resident: weights, plus KV cache and activations it keeps
    replica_rps: float  # requests/s one replica (one GPU) serves within the SLA, measured
    expected_rps: float  # the traffic to plan for
    family: str | None = None  # runner family, for models that are not built in (--family)
    path: str | None = None  # model directory (--path)
    keep_warm: int | None = None  # warm replicas to keep at least (default: the fleet's)

    @property
    def compute(self) -> float:
        """GPUs of compute the expected traffic keeps busy (1.0: one replica, flat out)."""
        return self.expected_rps / self.replica_rps


@dataclass(frozen=True, slots=True)
class Fleet:
    gpus: int  # GPUs to place on
    gpu_memory_gib: float  # device memory of one GPU
    target_utilisation: float = 0.7  # busy share per GPU that keeps queueing (the P99) in bounds
    dedicated_threshold: float = 0.5  # GPUs of compute (at the target) from which a model gets its own pool
    keep_warm: int = 1  # warm replicas of every model at least (a model's own keep_warm overrides)
    memory_headroom: float = 0.1  # of GPU memory kept free: CUDA context, allocator slack, activations
    spare_replicas: int = 0  # added to every dedicated pool (N+1 with 1)

    def check(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {self.gpus}")
        if not self.gpu_memory_gib > 0:
            raise ValueError(f"gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
        if not 0 < self.target_utilisation <= 1:
            raise ValueError(f"target_utilisation must be in (0, 1], got {self.target_utilisation}")
        if not 0 < self.dedicated_threshold <= 1:
            # Above 1 a long-tail model could need more than one GPU, which co-location cannot give it.
            raise ValueError(f"dedicated_threshold must be in (0, 1] GPU, got {self.dedicated_threshold}")
        if self.keep_warm < 1:
            raise ValueError(f"keep_warm must be >= 1, got {self.keep_warm}")
        if not 0 <= self.memory_headroom < 1:
            raise ValueError(f"memory_headroom must be in [0, 1), got {self.memory_headroom}")
        if self.spare_replicas < 0:
            raise ValueError(f"spare_replicas must be >= 0, got {self.spare_replicas}")

    @property
    def usable_gib(self) -> float:
        """What a worker may keep resident on one GPU (rounded down to 0.01 GiB: its --memory-budget)."""
        return math.floor(self.gpu_memory_gib * (1 - self.memory_headroom) * 100 + EPS) / 100

    def keep_warm_of(self, model: ModelLoad) -> int:
        return model.keep_warm if model.keep_warm is not None else self.keep_warm

    def gpu_share(self, model: ModelLoad) -> float:
        """GPUs the model's traffic needs at the target utilisation."""
        return model.compute / self.target_utilisation

    def dedicates(self, model: ModelLoad) -> bool:
        """Whether the model gets a pool of its own: its GPU share is at least the threshold, less float
        rounding (a relative EPS: the threshold is any positive number, and an idle model is never hot)."""
        return self.gpu_share(model) >= self.dedicated_threshold * (1 - EPS)


@dataclass(frozen=True, slots=True)
class Pool:
    name: str  # the dedicated model's name, or shared-N
    kind: Literal["dedicated", "colocated"]
    models: tuple[str, ...]  # hottest first
    replicas: int  # workers, one GPU each
    weights: dict[str, float]  # fair-share weight by model (--weight)
    resident: tuple[str, ...]  # models kept in device memory
    swapped: tuple[str, ...]  # registered, swapped in on demand (GPU -> pinned host RAM -> disk)
    memory_gib: float  # device memory used on each GPU: resident models plus the swap slot
    memory_budget_gib: float | None  # the worker's --memory-budget (co-located pools)
    utilisation: float  # expected busy share of each GPU
    keep_warm: int | None  # the worker's --keep-warm (None: not emitted; 0 on a pool that swaps)
    command: tuple[str, ...]  # the worker's command line, argv
    rationale: str  # why this pool is what it is
    warnings: tuple[str, ...] = ()  # what the command cannot say (per-model --family/--path)

    @property
    def gpus(self) -> int:
        return self.replicas

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "kind": self.kind, "models": list(self.models), "replicas": self.replicas,
            "gpus": self.gpus, "weights": dict(self.weights), "resident": list(self.resident),
            "swapped": list(self.swapped), "memory_gib": round(self.memory_gib, 3),
            "memory_budget_gib": self.memory_budget_gib, "utilisation": round(self.utilisation, 4),
            "keep_warm": self.keep_warm, "command": shlex.join(self.command), "rationale": self.rationale,
        }
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


@dataclass(frozen=True, slots=True)
class Placement:
    fleet: Fleet
    pools: tuple[Pool, ...]  # dedicated pools first, hottest first; empty when infeasible
    feasible: bool
    gpus_needed: int  # the fewest GPUs this planner fits everything on, swapping what it must
    gpus_needed_resident: int  # the GPUs it takes with nothing swapped
    reason: str = ""  # why not, when infeasible

    @property
    def gpus_used(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def idle_gpus(self) -> int:
        return self.fleet.gpus - self.gpus_used if self.feasible else 0

    @property
    def swapped(self) -> list[str]:
        return [m for p in self.pools for m in p.swapped]

    def to_dict(self) -> dict[str, Any]:
        f = self.fleet
        return {
            "feasible": self.feasible,
            "gpus": f.gpus,
            "gpu_memory_gib": f.gpu_memory_gib,
            "usable_memory_gib": f.usable_gib,
            "assumptions": {
                "target_utilisation": f.target_utilisation, "dedicated_threshold": f.dedicated_threshold,
                "keep_warm": f.keep_warm, "memory_headroom": f.memory_headroom, "spare_replicas": f.spare_replicas,
            },
            "pools": [p.to_dict() for p in self.pools],
            "swapped": self.swapped,
            "totals": {"gpus": f.gpus, "gpus_used": self.gpus_used, "idle_gpus": self.idle_gpus},
            "gpus_needed": self.gpus_needed,
            "gpus_needed_without_swapping": self.gpus_needed_resident,
            **({"reason": self.reason} if self.reason else {}),
        }


# --- the planner ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Bin:
    """One co-located worker (a GPU per replica) while packing."""

    resident: list[ModelLoad] = field(default_factory=list)
    swapped: list[ModelLoad] = field(default_factory=list)

    @property
    def compute(self) -> float:
        return sum(m.compute for m in (*self.resident, *self.swapped))

    @property
    def resident_gib(self) -> float:
        return sum(m.footprint_gib for m in self.resident)

    @property
    def slot_gib(self) -> float:
        return max((m.footprint_gib for m in self.swapped), default=0.0)

    @property
    def memory_gib(self) -> float:
        return self.resident_gib + self.slot_gib

    def replicas(self, fleet: Fleet) -> int:
        return max(fleet.keep_warm_of(m) for m in (*self.resident, *self.swapped))


def _heat(m: ModelLoad) -> tuple[float, float, str]:
    """Colder sorts first: fewer requests/s means fewer swap-ins if it is not resident."""
    return (m.expected_rps, m.compute, m.name)


def _pack(resident: Sequence[ModelLoad], swapped: Sequence[ModelLoad], fleet: Fleet) -> list[_Bin]:
    usable, util = fleet.usable_gib, fleet.target_utilisation
    bins: list[_Bin] = []

    # Residents: first-fit decreasing on the larger of the two dimensions; models that need more warm
    # replicas go first, so they share the few pools that pay for those replicas.
    def size(m: ModelLoad) -> tuple[int, float, float, str]:
        return (fleet.keep_warm_of(m), max(m.footprint_gib / usable, m.compute / util), m.footprint_gib, m.name)

    for m in sorted(resident, key=size, reverse=True):
        for b in bins:
            if b.memory_gib + m.footprint_gib <= usable + EPS and b.compute + m.compute <= util + EPS:
                b.resident.append(m)
                break
        else:
            bins.append(_Bin(resident=[m]))
    # Swapped models share a slot as large as the largest of them, next to a bin's residents.
    for m in sorted(swapped, key=lambda m: (m.footprint_gib, m.compute, m.name), reverse=True):
        for b in bins:
            if (b.resident_gib + max(b.slot_gib, m.footprint_gib) <= usable + EPS
                    and b.compute + m.compute <= util + EPS):
                b.swapped.append(m)
                break
        else:
            bins.append(_Bin(swapped=[m]))
    # A swapped model that fits resident after all (its bin had room) is made resident, hottest first.
    for b in bins:
        for m in sorted(b.swapped, key=_heat, reverse=True):
            rest = [o for o in b.swapped if o is not m]
            if b.resident_gib + m.footprint_gib + max((o.footprint_gib for o in rest), default=0.0) <= usable + EPS:
                b.resident.append(m)
                b.swapped = rest
    return bins


def _pack_tail(tail: Sequence[ModelLoad], gpus_left: int, fleet: Fleet) -> tuple[list[_Bin] | None, int, int]:
    """(bins, or None if nothing fits in gpus_left; the fewest GPUs any packing takes; GPUs with none swapped)."""
    if not tail:
        return [], 0, 0
    coldest_first = sorted(tail, key=_heat)
    # Swap the k coldest models, k = 0, 1, ...: the first k that fits is the plan.
    packings = [_pack(coldest_first[k:], coldest_first[:k], fleet) for k in range(len(tail) + 1)]
    gpus = [sum(b.replicas(fleet) for b in bins) for bins in packings]
    chosen = next((bins for bins, n in zip(packings, gpus, strict=True) if n <= gpus_left), None)
    return chosen, min(gpus), gpus[0]


def _weights(models: Sequence[ModelLoad]) -> dict[str, float]:
    total = sum(m.compute for m in models)
    shares = {m.name: (m.compute / total if total > 0 else 1 / len(models)) for m in models}
    return {name: round(max(share, MIN_WEIGHT), 3) for name, share in shares.items()}


def _common(values: Iterable[str | None]) -> str | None:
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def _worker_command(models: Sequence[ModelLoad], weights: dict[str, float] | None, budget: float | None,
                    keep_warm: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    argv = ["kinfer", "worker"]
    for m in models:
        argv += ["--model", m.name]
    warnings = []
    # The worker takes one --family and one --path for all its models: emit them only when they agree.
    for flag, values in (("--family", [m.family for m in models]), ("--path", [m.path for m in models])):
        common = _common(values)
        if common is not None:
            argv += [flag, common]
        elif any(v is not None for v in values):
            given = ", ".join(f"{m.name}={v}" for m, v in zip(models, values, strict=True) if v is not None)
            warnings.append(f"{flag} differs between the co-located models ({given}); the worker takes one "
                            f"for all its models: start it with a runner that resolves each model, or split the pool")
    for name, w in (weights or {}).items():
        argv += ["--weight", f"{name}={w:g}"]
    if budget is not None:  # a dedicated worker has no budget: its one model stays resident
        # The footprints planned with (weights and KV cache), so the worker budgets what was planned.
        for m in models:
            argv += ["--footprint", f"{m.name}={m.footprint_gib:g}"]
        argv += ["--memory-budget", str(budget), "--keep-warm", str(keep_warm)]
    return tuple(argv), tuple(warnings)


def _dedicated(m: ModelLoad, fleet: Fleet) -> Pool:
    share = fleet.gpu_share(m)
    need = max(1, math.ceil(share - EPS))
    keep = fleet.keep_warm_of(m)
    replicas = max(need, keep) + fleet.spare_replicas
    command, warnings = _worker_command([m], None, None, 0)
    why = (f"{m.expected_rps:g} requests/s need {share:.2f} GPUs of compute at {fleet.target_utilisation:.0%} busy "
           f"(threshold {fleet.dedicated_threshold:g}): a pool of its own, {need} replica{'s' * (need != 1)} "
           f"for the traffic")
    if keep > need:
        why += f", raised to keep-warm {keep}"
    if fleet.spare_replicas:
        why += f", plus {fleet.spare_replicas} spare"
    return Pool(
        name=m.name, kind="dedicated", models=(m.name,), replicas=replicas, weights={m.name: 1.0},
        resident=(m.name,), swapped=(), memory_gib=m.footprint_gib, memory_budget_gib=None,
        utilisation=m.compute / replicas, keep_warm=None, command=command, rationale=why + ".", warnings=warnings,
    )


def _colocated(name: str, b: _Bin, fleet: Fleet) -> Pool:
    # Resident ones first: a worker fills its budget in the order of its --model flags at start.
    models = [*sorted(b.resident, key=_heat, reverse=True), *sorted(b.swapped, key=_heat, reverse=True)]
    weights = _weights(models)
    replicas = b.replicas(fleet)
    budget = fleet.usable_gib
    # The worker never swaps out a model with --keep-warm warm replicas or fewer, and the flag is one
    # number for all its models: on a pool that swaps, it would pin the first cold model swapped in.
    keep = 0 if b.swapped else replicas
    command, warnings = _worker_command(models, weights if len(models) > 1 else None, budget, keep)
    busy = b.compute
    if len(models) == 1:
        why = (f"{models[0].name} is under {fleet.dedicated_threshold:g} GPU of compute, so it goes with the long "
               f"tail ({b.memory_gib:.1f} of {budget:g} GiB, {busy:.0%} busy); no other model is left to fit beside it")
    else:
        why = (f"{len(models)} long-tail models, each under {fleet.dedicated_threshold:g} GPU of compute, share a GPU "
               f"({b.memory_gib:.1f} of {budget:g} GiB, {busy:.0%} busy of {fleet.target_utilisation:.0%}); "
               f"weights follow each model's share of the compute")
    if b.swapped:
        names = ", ".join(m.name for m in sorted(b.swapped, key=_heat))
        why += (f"; the long tail does not fit resident on the GPUs left, so the coldest ({names}) are registered "
                f"but swapped in on demand, one at a time, in a {b.slot_gib:g} GiB slot beside the resident models "
                f"(--keep-warm 0, or the first one swapped in would stay)")
    if replicas > 1:
        why += f"; {replicas} replicas for keep-warm, each able to carry the pool's traffic alone"
    resident = tuple(m.name for m in models if m in b.resident)
    return Pool(
        name=name, kind="colocated", models=tuple(m.name for m in models), replicas=replicas, weights=weights,
        resident=resident, swapped=tuple(m.name for m in sorted(b.swapped, key=_heat)), memory_gib=b.memory_gib,
        memory_budget_gib=budget, utilisation=busy / replicas, keep_warm=keep, command=command,
        rationale=why + ".", warnings=warnings,
    )


def place(models: Sequence[ModelLoad], fleet: Fleet) -> Placement:
    """Dedicated pools for the hot models, the long tail packed onto the rest (see the module docstring).

    Raises ValueError for inputs no placement can serve (a model larger than a GPU, bad settings).
    """
    fleet.check()
    if not models:
        raise ValueError("no models to place")
    names = [m.name for m in models]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"models named more than once: {', '.join(dupes)}")
    usable = fleet.usable_gib
    for m in models:
        if not (m.footprint_gib > 0 and m.replica_rps > 0 and m.expected_rps >= 0):
            raise ValueError(f"model {m.name!r}: footprint_gib and replica_rps must be > 0, expected_rps >= 0")
        if m.footprint_gib > usable + EPS:
            raise ValueError(
                f"model {m.name!r} needs {m.footprint_gib:g} GiB resident, more than one GPU holds: "
                f"{fleet.gpu_memory_gib:g} GiB less {fleet.memory_headroom:.0%} headroom = {usable:g} GiB; "
                "it needs a larger GPU (--gpu-memory), a smaller footprint (quantisation, a shorter KV cache) "
                "or tensor parallelism across GPUs, which this planner does not do")

    hot = sorted((m for m in models if fleet.dedicates(m)),
                 key=lambda m: (-fleet.gpu_share(m), m.name))
    tail = [m for m in models if m not in hot]
    dedicated = [_dedicated(m, fleet) for m in hot]
    dedicated_gpus = sum(p.gpus for p in dedicated)
    bins, tail_gpus, tail_resident_gpus = _pack_tail(tail, fleet.gpus - dedicated_gpus, fleet)
    needed, needed_resident = dedicated_gpus + tail_gpus, dedicated_gpus + tail_resident_gpus
    if bins is None or dedicated_gpus > fleet.gpus:
        reason = (f"{len(hot)} dedicated pool{'s' * (len(hot) != 1)} take {dedicated_gpus} GPUs and the long tail "
                  f"{tail_gpus} more, even with the coldest models swapped: {needed} GPUs needed, {fleet.gpus} given")
        return Placement(fleet, (), False, needed, needed_resident, reason)

    taken = set(names)
    pool_names = (f"shared-{i}" for i in range(1, 10 * len(models) + 2) if f"shared-{i}" not in taken)
    colocated = [_colocated(next(pool_names), b, fleet) for b in bins]
    return Placement(fleet, (*dedicated, *colocated), True, needed, needed_resident)


# --- outputs ----------------------------------------------------------------------------------------


def _k8s_name(text: str) -> str:
    return text.replace("_", "-").strip("-")


def k8s_deployments(placement: Placement, image: str = "kinfer:latest") -> list[dict[str, Any]]:
    """One Deployment per pool, in the conventions of ``ops/deploy/k8s/worker-minilm.yaml``."""
    out = []
    for p in placement.pools:
        pool = _k8s_name(p.name)
        select = {"app.kubernetes.io/component": "worker", "kinfer.pool": pool}
        if p.kind == "dedicated":  # the autoscaler finds kinfer-worker-MODEL and its kinfer.model label
            select["kinfer.model"] = _k8s_name(p.models[0])
        labels = {"app.kubernetes.io/part-of": "kinfer", **select}
        command = [*p.command, "--metrics-port", "9100", "--metrics-host", "0.0.0.0", "--drain-timeout-s", "30"]
        out.append({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": f"kinfer-worker-{pool}", "labels": dict(labels),
                         "annotations": {"kinfer.models": ",".join(p.models)}},
            "spec": {
                "replicas": p.replicas,
                "selector": {"matchLabels": select},
                "template": {
                    "metadata": {"labels": labels,
                                 "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9100"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 45,
                        "containers": [{
                            "name": "worker",
                            "image": image,
                            "command": command,
                            "envFrom": [{"configMapRef": {"name": "kinfer-endpoints"}}],
                            "ports": [{"name": "metrics", "containerPort": 9100}],
                            "readinessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 5},
                            "livenessProbe": {"tcpSocket": {"port": "metrics"}, "initialDelaySeconds": 120,
                                              "periodSeconds": 20},
                            "resources": {
                                "requests": {"cpu": "2", "memory": "2Gi", "nvidia.com/gpu": 1},
                                "limits": {"memory": "4Gi", "nvidia.com/gpu": 1},
                            },
                        }],
                    },
                },
            },
        })
    return out


def k8s_disruption_budget(deployment: dict[str, Any]) -> dict[str, Any]:
    """A pool's PodDisruptionBudget, as ``ops/deploy/k8s/disruption.yaml``'s: a drain takes its workers one at a
    time (each one leaving is a rebalance of its groups)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": deployment["metadata"]["name"], "labels": {"app.kubernetes.io/part-of": "kinfer"}},
            "spec": {"maxUnavailable": 1,
                     "selector": {"matchLabels": dict(deployment["spec"]["selector"]["matchLabels"])}}}


def render_k8s(placement: Placement, image: str = "kinfer:latest") -> str:
    """Multi-document YAML: each pool's Deployment under a comment that says why its pool is what it is,
    then its PodDisruptionBudget."""
    import yaml

    docs = []
    for p, obj in zip(placement.pools, k8s_deployments(placement, image), strict=True):
        kind = "dedicated" if p.kind == "dedicated" else "co-located"
        head = f"# kinfer place: {kind} pool {p.name}, {p.replicas} x 1 GPU. {p.rationale}"
        body = yaml.safe_dump(obj, sort_keys=False, default_flow_style=None, width=120)
        docs.append("\n".join(_wrap_comment(head)) + "\n" + body)
        docs.append(yaml.safe_dump(k8s_disruption_budget(obj), sort_keys=False, default_flow_style=None, width=120))
    return "---\n".join(docs)


def _wrap_comment(text: str, width: int = 100) -> list[str]:
    lines, line = [], "#"
    for word in text.removeprefix("# ").split():
        if len(line) + 1 + len(word) > width and line != "#":
            lines.append(line)
            line = "#"
        line += " " + word
    return [*lines, line]


def render_table(placement: Placement) -> str:
    f = placement.fleet
    if not placement.feasible:
        return f"infeasible: {placement.reason}; rerun with --gpus {placement.gpus_needed}"
    rows = [(p.name, p.kind, str(p.replicas), f"{p.memory_gib:.1f}", f"{p.utilisation:.0%}",
             ", ".join(f"{m} {p.weights[m]:g}" + (" (swapped)" if m in p.swapped else "") for m in p.models)
             if p.kind == "colocated" else p.models[0]) for p in placement.pools]
    head = ("pool", "kind", "GPUs", "GiB/GPU", "busy", "models (weight)")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(5)]
    lines = [f"{f.gpus} GPUs of {f.gpu_memory_gib:g} GiB ({f.usable_gib:g} usable), at most "
             f"{f.target_utilisation:.0%} busy: {placement.gpus_used} used, {placement.idle_gpus} idle"]
    for r in (head, *rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[5])
    for p in placement.pools:
        lines.append(f"{p.name}: {p.rationale}")
        lines.append(f"  {shlex.join(p.command)}")
        lines += [f"  warning: {w}" for w in p.warnings]
    return "\n".join(lines)


# --- the models file --------------------------------------------------------------------------------


@functools.cache
def _entries() -> Any:
    """The models file's schema (pydantic, imported only when a file is read: every kinfer command builds
    the parser, which imports this module)."""
    from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

    class ModelEntry(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        name: str = Field(pattern=MODEL_PATTERN, description="served name (lowercase letters, digits, '_', '-')")
        footprint_gib: float = Field(gt=0, allow_inf_nan=False, description="device memory while resident, GiB")
        replica_rps: float = Field(gt=0, allow_inf_nan=False, description="requests/s one replica serves at the SLA")
        expected_rps: float = Field(ge=0, allow_inf_nan=False, description="expected traffic, requests/s")
        family: str | None = Field(default=None, min_length=1, description="runner family (--family)")
        path: str | None = Field(default=None, min_length=1, description="model directory (--path)")
        keep_warm: int | None = Field(default=None, ge=1, description="warm replicas at least")

    return TypeAdapter(list[ModelEntry])


def parse_models(data: Any, source: str = "models") -> list[ModelLoad]:
    """Validated models from already-parsed data (``[...]`` or ``{"models": [...]}``)."""
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: expected a non-empty list of models (or {{'models': [...]}})")
    from pydantic import ValidationError

    try:
        parsed = _entries().validate_python(entries)
    except ValidationError as exc:
        raise ValueError(f"{source}: {problems(exc, entries, 'models')}") from None
    names = [e.name for e in parsed]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{source}: models named more than once: {', '.join(dupes)}")
    return [ModelLoad(**e.model_dump()) for e in parsed]


def load_models(path: str | Path) -> list[ModelLoad]:
    """Models from a JSON or YAML file (YAML reads JSON too), as ``kinfer simulate --models`` reads them."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not JSON or YAML: {exc}") from None
    return parse_models(data, str(path))
