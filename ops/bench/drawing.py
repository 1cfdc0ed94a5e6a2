"""What every benchmark's picture is drawn with: matplotlib (the Agg backend, no display, imported on
first use so that the CLI does not pay for it), the PNG written, the title, the SLA lines, latency
against the offered rate, bars that say their value, and numbers written for people.

Each benchmark module draws its own report with these (``plot_<kind>`` beside the benchmark);
``plots.plot_report`` picks the right one for a report.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kinfer.ops.capacity.sla import SLA_P95_MS, SLA_P99_MS

Report = dict[str, Any]

DPI = 100
SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str) -> str:
    """Writes ``fig`` to the PNG ``path`` (its folder made if need be), closes it, returns the path."""
    import matplotlib.pyplot as plt

    fig.set_layout_engine("constrained")  # room for the suptitle, the labels and the legends
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def title(fig: Any, text: str) -> None:
    """The figure's title, wrapped to the width of a picture."""
    fig.suptitle("\n".join(textwrap.wrap(text, 125)))


def report_sla(report: Report) -> tuple[float, float]:
    """(P95, P99) bounds in ms: the report's own, else the SLA's."""
    sla = report.get("sla") or {}
    return float(sla.get("p95_ms", SLA_P95_MS)), float(sla.get("p99_ms", SLA_P99_MS))


def sla_lines(ax: Any, sla: tuple[float, float]) -> None:
    """The P95 (solid) and P99 (dashed) bounds across ``ax``, labelled."""
    ax.axhline(sla[0], color="black", ls="-", lw=0.8, alpha=0.7)
    ax.axhline(sla[1], color="black", ls="--", lw=0.8, alpha=0.7)
    for value, name in zip(sla, ("P95", "P99"), strict=True):
        ax.annotate(f"SLA {name} {value:g} ms", (1.0, value), xycoords=("axes fraction", "data"), xytext=(-3, 2),
                    textcoords="offset points", ha="right", va="bottom", fontsize=7)


def latency_vs_rate(ax: Any, series: dict[str, list[dict[str, Any]]], sla: tuple[float, float],
                     maxima: Iterable[Any] = ()) -> None:
    """P95 (solid) and P99 (dashed) against the offered rate, one colour per series. Where a rate was
    tried more than once, the line goes through the last try (the one that decided) and the earlier
    ones are crosses; a step that met the SLA is a filled marker, one that did not is hollow."""
    rates: list[float] = []
    for i, (label, steps) in enumerate(series.items()):
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        last: dict[float, dict[str, Any]] = {}
        for step in sorted(steps, key=lambda s: (s["rate"], s.get("attempt", 1))):
            if step["rate"] in last:
                for key in ("p95_ms", "p99_ms"):
                    if last[step["rate"]].get(key) is not None:
                        ax.plot(step["rate"], last[step["rate"]][key], "x", color=colour, alpha=0.5, ms=5)
            last[step["rate"]] = step
        decisive = [last[r] for r in sorted(last)]
        rates += list(last)
        for key, style, name in (("p95_ms", "-", "p95"), ("p99_ms", "--", "p99")):
            points = [(s["rate"], s[key], s.get("meets_sla")) for s in decisive if s.get(key) is not None]
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], style, color=colour,
                    label=f"{label} {name}" if name == "p95" else None)
            for rate, value, ok in points:
                ax.plot(rate, value, "o" if key == "p95_ms" else "s", color=colour, ms=5,
                        markerfacecolor=colour if ok else "white")
    for i, top in enumerate(maxima):
        if top:
            ax.axvline(top, color=SERIES_COLOURS[i % len(SERIES_COLOURS)], ls=":", lw=1, alpha=0.8)
    sla_lines(ax, sla)
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis, ax.get_ylim(), extra=sla)
    positive = [r for r in rates if r > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_xscale("log")
        plain_log_ticks(ax.xaxis, ax.get_xlim())
    ax.set_xlabel("offered rate (requests/s, open loop; dotted: max at the SLA)")
    ax.set_ylabel("ms from the scheduled send (dashed: p99)")
    ax.grid(alpha=0.3, which="both")
    if series:
        ax.legend(fontsize=8, loc="upper left")


def plain_log_ticks(axis: Any, limits: tuple[float, float], extra: Iterable[float] = ()) -> None:
    """Ticks at 1, 2, 5 x 10^k (and ``extra``, the SLA lines) written as plain numbers, not 10^k."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    lo, hi = sorted(limits)
    if lo <= 0:
        return
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    ticks = sorted({m * 10.0**k for k in decades for m in (1, 2, 5)} | set(extra))
    axis.set_major_locator(FixedLocator([t for t in ticks if lo <= t <= hi]))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def label_bars(ax: Any, fmt: str) -> None:
    """Each bar's value at its end (none on a zero bar)."""
    for container in ax.containers:
        horizontal = getattr(container, "orientation", "vertical") == "horizontal"
        values = [b.get_width() if horizontal else b.get_height() for b in container]
        ax.bar_label(container, labels=[fmt.format(v) if v else "" for v in values], fontsize=7, padding=2)


def at_sla(max_rps: Any) -> str:
    """A legend's words for the highest rate that met the SLA."""
    if not max_rps:
        return "no rate met the SLA"
    return f"max {max_rps:,.0f}/s at the SLA" if max_rps >= 100 else f"max {max_rps:g}/s at the SLA"


def num(value: Any) -> str:
    """A number for a title or a label: thousands separated, ``?`` for none or not finite."""
    if value is None:
        return "?"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if not math.isfinite(value):
        return "?"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"
