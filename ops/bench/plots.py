"""Pictures of ``kinfer bench`` reports: one PNG per report, drawn from the report alone.

Every ``plot_<kind>`` function takes a report exactly as its benchmark printed it (the JSON object, so
a report saved years ago draws the same picture) and a path, writes a PNG there and returns the path.
Each benchmark's own is beside it, in its module (``plot_transport``, ``plot_serve``,
...), drawn with the helpers of ``drawing``; ``kinfer simulate``'s is here. ``plot_report`` tells a
report's kind from its shape (from its ``kind`` field where a report has one) and calls the right
function, from the one table ``PLOTTERS``; ``kinfer bench plot REPORT.json`` is that, from the command
line, and ``kinfer bench NAME --plot`` calls it when the benchmark ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.autoscale import plot_autoscale
from kinfer.ops.bench.batching import POLICIES, plot_batching
from kinfer.ops.bench.chaos import plot_chaos
from kinfer.ops.bench.engine import plot_engine
from kinfer.ops.bench.faults import plot_faults
from kinfer.ops.bench.fill import plot_fill
from kinfer.ops.bench.gateway import plot_serve
from kinfer.ops.bench.generation import plot_generation
from kinfer.ops.bench.model import plot_model
from kinfer.ops.bench.overload import plot_overload
from kinfer.ops.bench.peers import plot_peers
from kinfer.ops.bench.placement import plot_placement
from kinfer.ops.bench.transport import PATHS, plot_tracing, plot_transport

Report = dict[str, Any]


class UnknownReport(ValueError):
    """The JSON is not a report any ``kinfer bench`` writes (or of a kind this module cannot draw)."""


# -- the dispatcher ---------------------------------------------------------------------------------------


def report_kind(report: Any) -> str:
    """``transport``, ``serve``, ... from the report's ``kind`` field, else from its shape."""
    if not isinstance(report, dict):
        raise UnknownReport(f"not a kinfer bench report: a JSON {type(report).__name__}, not an object")
    if "kind" in report:
        if report["kind"] not in PLOTTERS:
            raise UnknownReport(f"no picture for reports of kind {report['kind']!r} (known: {', '.join(PLOTTERS)})")
        return str(report["kind"])
    for kind, (recognise, _) in PLOTTERS.items():
        if recognise(report):
            return kind
    keys = ", ".join(sorted(map(str, report))[:10]) or "none"
    raise UnknownReport(f"not a kinfer bench report: its keys ({keys}) match none of the kinds "
                        f"{', '.join(PLOTTERS)}")


def plot_report(report: Any, path: str | Path) -> str:
    """Draws ``report`` (any kind ``report_kind`` knows) into the PNG ``path``; returns the path."""
    kind = report_kind(report)
    return PLOTTERS[kind][1](report, str(path))


def default_plot_path(report_path: str | Path | None, name: str) -> str:
    """Next to the JSON report (its name with ``.png``), else ``bench-<name>.png`` here."""
    return str(Path(report_path).with_suffix(".png")) if report_path else f"bench-{name}.png"


# -- simulate -----------------------------------------------------------------------------------------------


def plot_simulate(report: Report, path: str) -> str:
    """The sizing search per model, and the sized fleet's latency: whole, after losing a worker, a broker."""
    plt = draw.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    sla = draw.report_sla(report)
    for i, (model, tries) in enumerate(report.get("search", {}).items()):
        tries = sorted(tries, key=lambda t: t["workers"])
        colour = draw.SERIES_COLOURS[i % len(draw.SERIES_COLOURS)]
        left.plot([t["workers"] for t in tries], [t["p95_ms"] for t in tries], "o-", color=colour,
                  label=f"{model} p95 (sized: {report.get('fleet', {}).get(model, '?')} workers)")
        left.plot([t["workers"] for t in tries], [t["p99_ms"] for t in tries], "s--", color=colour, alpha=0.6)
    draw.sla_lines(left, sla)
    left.set_yscale("log")
    draw.plain_log_ticks(left.yaxis, left.get_ylim(), extra=sla)
    left.set_xlabel("workers in the model's pool (dashed: p99)")
    left.set_ylabel("ms")
    left.set_title("the sizing search: latency by pool size, each model alone")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    found = (("all models together", report.get("together"), "fleet"),
             ("after losing a worker", report.get("worker_failure"), "during_failure"),
             ("after losing a broker", report.get("broker_failure"), "during_failure"))
    cases: list[tuple[str, dict[str, Any]]] = [(name, run[key]) for name, run, key in found
                                               if isinstance(run, dict) and isinstance(run.get(key), dict)]
    for i, (key, label) in enumerate((("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99"))):
        xs = [j + (i - 1) * 0.27 for j in range(len(cases))]
        right.bar(xs, [row.get(key) or 0.0 for _, row in cases], 0.27, label=label, color=draw.SERIES_COLOURS[i])
    draw.label_bars(right, fmt="{:.0f}")
    draw.sla_lines(right, sla)
    right.set_xticks(range(len(cases)), [f"{name}\n{row.get('ok_fraction', 0):.1%} ok" for name, row in cases])
    right.set_ylabel("ms")
    right.set_title("the sized fleet")
    right.legend(fontsize=8)
    right.grid(axis="y", alpha=0.3)
    draw.title(fig, f"kinfer simulate: {draw.num(report.get('qps'))} requests/s, "
                     f"{report.get('total_workers', '?')} workers "
                     f"({', '.join(f'{m} {n}' for m, n in report.get('fleet', {}).items())})")
    return draw.save(fig, path)


# -- shapes ---------------------------------------------------------------------------------------------------


def _has(report: Report, *keys: str) -> bool:
    return all(isinstance(report.get(k), dict) for k in keys)


def _has_steps(report: Report, keys: Iterable[str]) -> bool:
    return any(isinstance(report.get(k), dict) and isinstance(report[k].get("steps"), list) for k in keys)


# A report's kind: the first here whose shape it has, in this order.
PLOTTERS: dict[str, tuple[Callable[[Report], bool], Callable[[Report, str], str]]] = {
    "autoscale": (lambda r: _has(r, "autoscaled", "trace"), plot_autoscale),
    "overload": (lambda r: _has(r, "with_backpressure") or _has(r, "without_backpressure"), plot_overload),
    "fill": (lambda r: _has(r, "with_tier", "without_tier"), plot_fill),
    "faults": (lambda r: _has(r, "scenarios"), plot_faults),
    "chaos": (lambda r: _has(r, "availability", "timeline"), plot_chaos),
    "chaos-variants": (lambda r: _has(r, "variants"), plot_chaos),
    "generation": (lambda r: _has(r, "continuous", "static"), plot_generation),
    "engine": (lambda r: _has(r, "encoder", "decoder", "open_loop"), plot_engine),
    "serve": (lambda r: _has(r, "through_gateway"), plot_serve),
    "peers": (lambda r: _has(r, "systems", "ratios"), plot_peers),
    "batching": (lambda r: _has_steps(r, POLICIES), plot_batching),
    "transport": (lambda r: _has_steps(r, PATHS), plot_transport),
    "transport-tracing": (lambda r: "trace_ratio" in r, plot_tracing),
    "simulate": (lambda r: _has(r, "search", "fleet"), plot_simulate),
    "placement": (lambda r: _has(r, "swap_in_ms", "swap_in_ms_by_model"), plot_placement),
    "model": (lambda r: _has(r, "batch") and all(isinstance(v, dict) for v in r["batch"].values()), plot_model),
}
