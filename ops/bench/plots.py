"""Pictures of ``kinfer bench`` reports: one PNG per report, drawn from the report alone.

Every ``plot_*`` function takes a report exactly as its benchmark printed it (the JSON object, so a
report saved years ago draws the same picture) and a path, writes a PNG there and returns the path.
``plot_report`` tells a report's kind from its shape (from its ``kind`` field where a report has
one) and calls the right function; ``kinfer bench plot REPORT.json`` is that, from the command line,
and ``kinfer bench NAME --plot`` calls it when the benchmark ends.

What each picture shows:

- ``transport``: P95 and P99 against the offered rate, per path, with the SLA lines; under it the
  CPU per request of each process (stacked) at each rate step, library and HTTP;
- ``serve``: the model alone in each layout next to kinfer through the gateway (max rate at the
  SLA), and latency against rate per gateway layout;
- ``batching``: the max rate at the SLA per policy, and latency against rate per policy;
- ``generation``: continuous against static batching: tokens/s, time to first token, forward passes;
- ``overload``: the surge with and without backpressure (over time where the report has a
  timeline), outcomes, latencies against the deadline, each priority, the co-located neighbours;
- ``faults``: recovery time per fault; lost, errors and duplicates per fault;
- ``autoscale``: arrivals, lag, predicted wait and workers over time, autoscaled and static;
- ``simulate``: the sizing search per model and the fleet's latency whole, losing a worker and a broker;
- ``model``: sequences/s by batch size.

matplotlib (Agg backend: no display) is imported inside the functions, so the CLI does not pay for it.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kinfer.ops.bench.harness import SLA_P95_MS, SLA_P99_MS

Report = dict[str, Any]

DPI = 100
POLICIES = ("batch1", "window100", "kinfer")
PATHS = ("library", "http")
# One colour per process wherever CPU is stacked; unknown processes (worker0, ...) take the next free.
PROCESS_COLOURS = {"client": "#1f77b4", "gateway": "#9467bd", "worker": "#ff7f0e", "broker": "#2ca02c",
                   "redis": "#d62728"}
SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


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


# -- transport ----------------------------------------------------------------------------------------------


def plot_transport(report: Report, path: str) -> str:
    plt = _pyplot()
    paths = [p for p in PATHS if isinstance(report.get(p), dict)]
    fig = plt.figure(figsize=(12, 8.5))
    grid = fig.add_gridspec(2, len(paths), height_ratios=(1.1, 1))
    ax = fig.add_subplot(grid[0, :])
    _latency_vs_rate(ax, {f"{p} ({_at_sla(report[p].get('max_rps_at_sla'))})": report[p]["steps"] for p in paths},
                     _sla(report), maxima=[report[p].get("max_rps_at_sla") for p in paths])
    ax.set_title("latency against offered rate (filled: the step met the SLA; x: an earlier try at that rate)")
    shared = None
    for i, name in enumerate(paths):
        bars = fig.add_subplot(grid[1, i], sharey=shared)
        shared = shared or bars
        _cpu_bars(bars, report[name]["steps"])
        bars.set_title(f"{name}: CPU per request by process (hatched: missed the SLA)")
    _title(fig, f"kinfer bench transport: {report.get('model', 'noop')}, "
                 f"{report.get('seconds_per_step', '?')} s a step, {report.get('cpus', '?')} CPUs")
    return _save(fig, path)


# -- serve --------------------------------------------------------------------------------------------------


def plot_serve(report: Report, path: str) -> str:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=(1, 1.2))
    alone = sorted(report.get("model_alone_seq_per_s", {}).items(), key=lambda kv: kv[1])
    gateway = sorted(((k, v.get("max_rps_at_sla") or 0.0) for k, v in report.get("through_gateway", {}).items()),
                     key=lambda kv: kv[1])
    labels = [f"alone: {_layout(k)}" for k, _ in alone] + [f"gateway: {_layout(k)}" for k, _ in gateway]
    values = [v for _, v in alone] + [v for _, v in gateway]
    colours = ["#1f77b4" if k.startswith("torch") else "#17becf" for k, _ in alone] + ["#ff7f0e"] * len(gateway)
    left.barh(range(len(values)), values, color=colours)
    left.set_yticks(range(len(values)), labels, fontsize=8)
    for y, v in enumerate(values):
        left.annotate(f"{v:g}", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    left.set_xlim(0, max([*values, 1.0]) * 1.12)
    left.set_xlabel("the model alone: sequences/s; through the gateway: max requests/s at the SLA")
    left.grid(axis="x", alpha=0.3)
    steps = {f"{_layout(k)} ({_at_sla(v.get('max_rps_at_sla'))})": v.get("steps", [])
             for k, v in report.get("through_gateway", {}).items()}
    _latency_vs_rate(right, steps, _sla(report),
                     maxima=[v.get("max_rps_at_sla") for v in report.get("through_gateway", {}).values()])
    right.set_title("through the gateway: latency against offered rate")
    ratio = report.get("ratio")
    _title(fig, f"kinfer bench serve: {report.get('model', '?')} on {report.get('cpus', '?')} CPUs: through the "
                 f"gateway {_num(report.get('gateway_max_rps_at_sla'))} req/s = {_num(ratio)} of the model alone "
                 f"({_num(report.get('model_alone_best_rps'))} seq/s)")
    return _save(fig, path)


# -- batching -----------------------------------------------------------------------------------------------


def plot_batching(report: Report, path: str) -> str:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=(0.8, 1.2))
    policies = [p for p in POLICIES if isinstance(report.get(p), dict)]
    maxima = [report[p].get("max_sla_rps") or 0.0 for p in policies]
    left.bar(policies, maxima, color=[SERIES_COLOURS[i] for i in range(len(policies))])
    for x, (name, value) in enumerate(zip(policies, maxima, strict=True)):
        run = report[name]
        text = (f"{value:,.1f}/s\nbatch {_num(run.get('mean_batch'))}, padding {_num(run.get('padding_ratio'))}"
                if value else "never meets\nthe SLA")
        left.annotate(text, (x, value), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    alone = sorted(report.get("in_process_seq_per_s", {}).items(), key=lambda kv: int(kv[0]))
    for (size, seq_s), style in zip(alone, (":", "--", "-."), strict=False):
        left.axhline(seq_s, color="grey", ls=style, lw=1, label=f"the model alone, batch {size}: {seq_s:g} seq/s")
    if alone:
        left.legend(fontsize=8, loc="upper left")
    left.set_ylabel("max requests/s at the SLA")
    left.set_ylim(0, max([*maxima, *report.get("in_process_seq_per_s", {}).values(), 1.0]) * 1.25)
    left.grid(axis="y", alpha=0.3)
    _latency_vs_rate(right, {p: report[p].get("steps", []) for p in policies}, _sla(report), maxima=maxima)
    right.set_title("latency against offered rate (every step of the search)")
    _title(fig, f"kinfer bench batching: {report.get('model', '?')} ({report.get('device', '?')}), "
                 f"{report.get('texts', '')}")
    return _save(fig, path)


# -- generation ---------------------------------------------------------------------------------------------


def plot_generation(report: Report, path: str) -> str:
    plt = _pyplot()
    fig, (tokens, times, passes) = plt.subplots(1, 3, figsize=(13, 4.8), width_ratios=(0.7, 1.4, 0.7))
    modes = [m for m in ("continuous", "static") if isinstance(report.get(m), dict)]
    colours = [SERIES_COLOURS[i] for i in range(len(modes))]
    tokens.bar(modes, [report[m].get("tokens_per_s") or 0.0 for m in modes], color=colours)
    tokens.set_ylabel("tokens/s (higher is better)")
    _label_bars(tokens, fmt="{:,.0f}")
    metrics = (("ttft_p50_ms", "TTFT p50"), ("ttft_p95_ms", "TTFT p95"), ("latency_p95_ms", "latency p95"))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(metrics))]
        times.bar(xs, [(report[mode].get(k) or 0.0) / 1000.0 for k, _ in metrics], width, label=mode,
                  color=colours[i])
    times.set_xticks(range(len(metrics)), [label for _, label in metrics])
    times.set_ylabel("seconds (lower is better)")
    times.legend()
    _label_bars(times, fmt="{:.2f}")
    passes.bar(modes, [report[m].get("steps") or 0 for m in modes], color=colours)
    passes.set_ylabel("forward passes")
    _label_bars(passes, fmt="{:,.0f}")
    for ax in (tokens, times, passes):
        ax.grid(axis="y", alpha=0.3)
    _title(fig, f"kinfer bench generation: {report.get('model', '?')} ({report.get('device', '?')}), "
                 f"{report.get('requests', '?')} requests at {report.get('rate_rps', '?')}/s, max_running "
                 f"{report.get('max_running', '?')}: continuous/static tokens/s "
                 f"{_num(report.get('tokens_per_s_ratio'))}x, TTFT p95 {_num(report.get('ttft_p95_ratio'))}x")
    return _save(fig, path)


# -- overload -----------------------------------------------------------------------------------------------


OVERLOAD_RUNS = (("with_backpressure", "with backpressure"), ("without_backpressure", "without"))


def plot_overload(report: Report, path: str) -> str:
    plt = _pyplot()
    runs = [(key, label) for key, label in OVERLOAD_RUNS if isinstance(report.get(key), dict)]
    timelines = [(key, label) for key, label in runs if isinstance(report[key].get("timeline"), dict)]
    rows = (2 if timelines else 0) + 2
    fig = plt.figure(figsize=(13, 4.2 * rows))
    grid = fig.add_gridspec(rows, 2)
    row = 0
    if timelines:
        shared = None
        for col, (key, label) in enumerate(timelines):
            ax = fig.add_subplot(grid[0, col], sharey=shared)
            shared = shared or ax
            _overload_timeline(ax, report, report[key]["timeline"], label)
        lag = fig.add_subplot(grid[1, :])
        for i, (key, label) in enumerate(timelines):
            line = report[key]["timeline"]
            lag.plot(line["t_s"], line["lag"], label=label, color=SERIES_COLOURS[i])
        _surge_span(lag, report)
        lag.set_ylabel("lag (records waiting)")
        lag.set_xlabel("seconds from the start of the surge")
        lag.legend(loc="upper right")
        lag.grid(alpha=0.3)
        row = 2
    _overload_outcomes(fig.add_subplot(grid[row, 0]), report, runs)
    _overload_latency(fig.add_subplot(grid[row, 1]), report, runs)
    _overload_priorities(fig.add_subplot(grid[row + 1, 0]), report, runs)
    _overload_neighbours(fig.add_subplot(grid[row + 1, 1]), report)
    _title(fig, f"kinfer bench overload: {report.get('model', '?')}; capacity {_num(report.get('capacity_rps'))}/s, "
                 f"surge {_num(report.get('surge_rps'))}/s for {_num(report.get('surge_s'))} s, then "
                 f"{_num(report.get('normal_rps'))}/s for {_num(report.get('normal_s'))} s; deadline "
                 f"{report.get('deadline_ms', '?')} ms")
    return _save(fig, path)


def _overload_timeline(ax: Any, report: Report, line: dict[str, Any], label: str) -> None:
    bucket_s = float(line.get("bucket_s") or 1.0)
    per_s = [[n / bucket_s for n in line[k]] for k in ("served_in_time", "missed", "rejected")]
    ax.stackplot(line["t_s"], *per_s, step="post", colors=("#2ca02c", "#d62728", "#c7c7c7"),
                 labels=("served in time", "accepted, missed its deadline", "refused at admission"))
    _surge_span(ax, report)
    ax.set_title(f"{label}: requests by scheduled send (stacked: what was offered)")
    ax.set_ylabel("requests/s")
    ax.set_xlabel("seconds from the start of the surge")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)


def _surge_span(ax: Any, report: Report) -> None:
    if isinstance(report.get("surge_s"), int | float):
        ax.axvspan(0, report["surge_s"], color="orange", alpha=0.08, lw=0)
        ax.axvline(report["surge_s"], color="orange", ls="--", lw=1)


def _overload_outcomes(ax: Any, report: Report, runs: list[tuple[str, str]]) -> None:
    labels = [label for _, label in runs]
    parts = (("served_in_time", "served in time", "#2ca02c"), ("deadline_misses", "accepted, missed", "#d62728"),
             ("rejected", "refused at admission", "#c7c7c7"))
    bottom = [0.0] * len(runs)
    for key, name, colour in parts:
        values = [float(report[r].get(key) or 0) for r, _ in runs]
        ax.bar(labels, values, bottom=bottom, label=name, color=colour)
        for x, (v, b) in enumerate(zip(values, bottom, strict=True)):
            if v:
                ax.annotate(f"{v:,.0f}", (x, b + v / 2), ha="center", va="center", fontsize=8)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (r, _) in enumerate(runs):
        ax.annotate(f"lost {report[r].get('lost', '?')}, peak lag {report[r].get('peak_lag', '?')}",
                    (x, bottom[x]), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylim(0, max([*bottom, 1.0]) * 1.3)
    ax.set_ylabel("requests")
    ax.set_title("every request offered, by outcome")
    ax.legend(loc="upper center", fontsize=8, ncols=3)


def _overload_latency(ax: Any, report: Report, runs: list[tuple[str, str]]) -> None:
    metrics = (("accepted_p95_ms", "accepted p95"), ("accepted_p99_ms", "accepted p99"),
               ("reject_p99_ms", "refusal told, p99"))
    width = 0.8 / max(1, len(runs))
    for i, (key, label) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(metrics))]
        ax.bar(xs, [report[key].get(k) or 0.0 for k, _ in metrics], width, label=label, color=SERIES_COLOURS[i])
    _label_bars(ax, fmt="{:.1f}")
    if isinstance(report.get("deadline_ms"), int | float):
        ax.axhline(report["deadline_ms"], color="black", ls="--", lw=1, label=f"deadline {report['deadline_ms']} ms")
    ax.set_xticks(range(len(metrics)), [label for _, label in metrics])
    ax.set_ylabel("ms from the scheduled send")
    ax.set_title("latency of accepted requests; how fast a refusal is told")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _overload_priorities(ax: Any, report: Report, runs: list[tuple[str, str]]) -> None:
    priorities = sorted({p for r, _ in runs for p in report[r].get("by_priority", {})})
    width = 0.8 / max(1, len(runs))
    for i, (key, label) in enumerate(runs):
        by = report[key].get("by_priority", {})
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(priorities))]
        shares = [by.get(p, {}).get("served_in_time", 0) / max(1, by.get(p, {}).get("offered", 0)) for p in priorities]
        ax.bar(xs, shares, width, label=label, color=SERIES_COLOURS[i])
        for x, p, share in zip(xs, priorities, shares, strict=True):
            row = by.get(p, {})
            ax.annotate(f"{row.get('served_in_time', 0)}/{row.get('offered', 0)}", (x, share), xytext=(0, 2),
                        textcoords="offset points", ha="center", fontsize=7)
    mix = report.get("priority_mix", {})
    ax.set_xticks(range(len(priorities)), [f"{p} ({mix[p]:.0%} of offered)" if p in mix else p for p in priorities])
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("served in time / offered")
    ax.set_title("each priority: share served within its deadline")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _overload_neighbours(ax: Any, report: Report) -> None:
    phases = report.get("neighbours")
    if not isinstance(phases, dict):
        ax.text(0.5, 0.5, "no neighbour run in this report", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    names = [p for p in ("baseline", "spike") if isinstance(phases.get(p), dict)]
    for i, (key, label) in enumerate((("quiet_p95_ms", "p95"), ("quiet_p99_ms", "p99"))):
        xs = [j + (i - 0.5) * 0.38 for j in range(len(names))]
        ax.bar(xs, [phases[n].get(key) or 0.0 for n in names], 0.38, label=f"quiet model {label}",
               color=SERIES_COLOURS[i])
    _label_bars(ax, fmt="{:.0f}")
    _sla_lines(ax, (SLA_P95_MS, SLA_P99_MS))
    ticks = []
    for n in names:
        ph = phases[n]
        ticks.append(f"{n}: neighbour offered {_num(ph.get('busy_offered_rps'))}/s\n"
                     f"(refused {ph.get('busy_refused', '?')}; quiet refused {ph.get('quiet_refused', '?')})")
    ax.set_xticks(range(len(names)), ticks, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(f"co-located: the quiet model while its neighbour spikes {_num(phases.get('spike_factor'))}x")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


# -- faults -------------------------------------------------------------------------------------------------


def plot_faults(report: Report, path: str) -> str:
    plt = _pyplot()
    scenarios = list(report.get("scenarios", {}).items())
    height = 1.5 + 0.45 * len(scenarios)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, height), sharey=True)
    ys = list(range(len(scenarios)))[::-1]  # the first scenario on top
    names = [f"{name.replace('_', ' ')} ({row.get('ok', '?')}/{row.get('offered', '?')} ok)" for name, row in scenarios]
    recovery = [row.get("recovery_s") or 0.0 for _, row in scenarios]
    left.barh(ys, recovery, color="#1f77b4")
    for y, v in zip(ys, recovery, strict=True):
        left.annotate(f"{v:.1f} s", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    left.set_yticks(ys, names, fontsize=8)
    left.set_xlabel("recovery (s): from the fault to the last request slower than 1 s")
    left.set_xlim(0, max([*recovery, 1.0]) * 1.2)
    left.grid(axis="x", alpha=0.3)
    counts = (("lost", "lost"), ("error", "error"), ("unaccepted", "unaccepted"),
              ("duplicates_delivered", "duplicates delivered"), ("duplicates_dropped", "duplicates dropped"))
    width = 0.8 / len(counts)
    colours = ("#d62728", "#ff7f0e", "#8c564b", "#9467bd", "#7f7f7f")
    for i, (key, label) in enumerate(counts):
        offsets = [y + ((len(counts) - 1) / 2 - i) * width for y in ys]
        right.barh(offsets, [row.get(key) or 0 for _, row in scenarios], width, label=label, color=colours[i])
    _label_bars(right, fmt="{:,.0f}")
    for y, (_, row) in zip(ys, scenarios, strict=True):
        if not any(row.get(k) for k, _ in counts):
            right.annotate("none", (0, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
                           color="grey")
    right.set_xlabel("requests")
    right.legend(fontsize=8, loc="lower right")
    right.grid(axis="x", alpha=0.3)
    _title(fig, f"kinfer bench faults: {report.get('workers', '?')} workers, {_num(report.get('rate'))} requests/s "
                 f"for {_num(report.get('seconds'))} s, deadline {report.get('deadline_ms', '?')} ms")
    return _save(fig, path)


# -- autoscale ----------------------------------------------------------------------------------------------


AUTOSCALE_RUNS = (("autoscaled", "autoscaled"), ("static_peak", "static peak"))


def plot_autoscale(report: Report, path: str) -> str:
    """From each run's ``timeline`` (arrivals, lag, predicted wait, workers every half second) when
    the report has one; older reports have only ``replicas_over_time``: workers against the trace."""
    from kinfer.ops.bench.autoscale import Trace

    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    trace = Trace(**report["trace"])
    runs = [(key, label) for key, label in AUTOSCALE_RUNS if isinstance(report.get(key), dict)]
    full = all(isinstance(report[key].get("timeline"), dict) for key, _ in runs)
    panels = (("arrival_rps", "arrivals /s"), ("lag", "lag (records)"), ("wait_ms", "predicted wait (ms)"),
              ("replicas", "workers alive")) if full else (("arrival_rps", "offered /s"), ("replicas", "workers alive"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.5 * len(panels) + 0.5), sharex=True)
    grid = [i * 0.5 for i in range(int(trace.duration_s * 2) + 1)]
    axes[0].plot(grid, [trace.rate_at(x) for x in grid], "k:", label="offered (trace)")
    for i, (key, label) in enumerate(runs):
        run, colour = report[key], SERIES_COLOURS[i]
        legend = (f"{label}: {_num(run.get('worker_seconds'))} worker-s, p95 {_num(run.get('p95_ms'))} / "
                  f"p99 {_num(run.get('p99_ms'))} ms")
        if full:
            line = run["timeline"]
            for ax, (column, _) in zip(axes, panels, strict=True):
                if column == "replicas":
                    ax.step(line["t"], line[column], where="post", label=legend, color=colour)
                else:
                    ax.plot(line["t"], line[column], label=label, color=colour)
        else:
            changes = run.get("replicas_over_time") or [[0.0, run.get("replicas", 0)]]
            ts = [float(t) for t, _ in changes] + [trace.duration_s]
            ns = [n for _, n in changes] + [changes[-1][1]]
            axes[-1].step(ts, ns, where="post", label=legend, color=colour)
    for ax, (_, label) in zip(axes, panels, strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1].yaxis.set_major_locator(MaxNLocator(integer=True))
    if full:
        axes[2].set_yscale("symlog", linthresh=100)
    axes[-1].set_xlabel("seconds into the trace")
    ratio = report.get("worker_seconds_ratio")
    _title(fig, "kinfer bench autoscale: lag-driven autoscaling vs static peak provisioning"
                 + (f" (worker-seconds {ratio} of static)" if ratio is not None else ""))
    return _save(fig, path)


# -- simulate -----------------------------------------------------------------------------------------------


def plot_simulate(report: Report, path: str) -> str:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    sla = _sla(report)
    for i, (model, tries) in enumerate(report.get("search", {}).items()):
        tries = sorted(tries, key=lambda t: t["workers"])
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        left.plot([t["workers"] for t in tries], [t["p95_ms"] for t in tries], "o-", color=colour,
                  label=f"{model} p95 (sized: {report.get('fleet', {}).get(model, '?')} workers)")
        left.plot([t["workers"] for t in tries], [t["p99_ms"] for t in tries], "s--", color=colour, alpha=0.6)
    _sla_lines(left, sla)
    left.set_yscale("log")
    _plain_log_ticks(left.yaxis, left.get_ylim(), extra=sla)
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
        right.bar(xs, [row.get(key) or 0.0 for _, row in cases], 0.27, label=label, color=SERIES_COLOURS[i])
    _label_bars(right, fmt="{:.0f}")
    _sla_lines(right, sla)
    right.set_xticks(range(len(cases)), [f"{name}\n{row.get('ok_fraction', 0):.1%} ok" for name, row in cases])
    right.set_ylabel("ms")
    right.set_title("the sized fleet")
    right.legend(fontsize=8)
    right.grid(axis="y", alpha=0.3)
    _title(fig, f"kinfer simulate: {_num(report.get('qps'))} requests/s, {report.get('total_workers', '?')} workers "
                 f"({', '.join(f'{m} {n}' for m, n in report.get('fleet', {}).items())})")
    return _save(fig, path)


# -- model --------------------------------------------------------------------------------------------------


def plot_model(report: Report, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted(report["batch"].items(), key=lambda kv: int(kv[0]))
    ax.bar([f"batch {k}" for k, _ in sizes], [v.get("seq_per_s") or 0.0 for _, v in sizes], color="#1f77b4")
    for x, (_, v) in enumerate(sizes):
        ax.annotate(f"{_num(v.get('seq_per_s'))} seq/s\n{_num(v.get('ms_per_batch'))} ms a batch",
                    (x, v.get("seq_per_s") or 0.0), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylim(0, max([v.get("seq_per_s") or 0.0 for _, v in sizes] + [1.0]) * 1.25)
    ax.set_ylabel("sequences/s")
    ax.grid(axis="y", alpha=0.3)
    _title(fig, f"kinfer bench model: {report.get('model', '?')} ({report.get('device', '?')}), in process")
    return _save(fig, path)


def plot_placement(report: Report, path: str) -> str:
    """Swap-in per model and tier; the mixed run's outcomes per model (hot first)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 2]})
    models = report.get("swap_in_ms_by_model", {})
    names = list(models)
    for i, tier in enumerate(("disk", "ram")):
        ax1.bar([x + i * 0.38 for x in range(len(names))], [models[n].get(tier) or 0.0 for n in names], 0.38,
                label=f"from {tier}", color=SERIES_COLOURS[i])
    ax1.set_xticks([x + 0.19 for x in range(len(names))], names)
    ax1.set_ylabel("swap-in to serving, ms (in process)")
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)
    by_model = report.get("by_model", {})
    kinds = sorted({k for counts in by_model.values() for k in counts}, key=lambda k: (k != "ok", k))
    order = list(by_model)
    bottom = [0.0] * len(order)
    for i, kind in enumerate(kinds):
        values = [float(by_model[m].get(kind, 0)) for m in order]
        ax2.bar(range(len(order)), values, bottom=bottom, label=kind, color=SERIES_COLOURS[i % len(SERIES_COLOURS)])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    hot = set(report.get("hot_models", []))
    ax2.set_xticks(range(len(order)), [f"{m.rsplit('-', 1)[-1]}{' (hot)' if m in hot else ''}" for m in order])
    ax2.set_ylabel("requests")
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    setup = report.get("setup", {})
    _title(fig, f"kinfer bench placement: {setup.get('models', '?')} models, budget for {setup.get('resident', '?')}, "
                f"{setup.get('rate_rps', '?')}/s Zipf({setup.get('zipf_s', '?')}); hot p95/p99 "
                f"{_num(report.get('hot_p95_ms'))}/{_num(report.get('hot_p99_ms'))} ms, cold start "
                f"{_num(report.get('cold_start_ms'))} ms, lost {report.get('lost', '?')}")
    return _save(fig, path)


# -- shapes ---------------------------------------------------------------------------------------------------


def _has(report: Report, *keys: str) -> bool:
    return all(isinstance(report.get(k), dict) for k in keys)


def _has_steps(report: Report, keys: Iterable[str]) -> bool:
    return any(isinstance(report.get(k), dict) and isinstance(report[k].get("steps"), list) for k in keys)


PLOTTERS: dict[str, tuple[Callable[[Report], bool], Callable[[Report, str], str]]] = {
    "autoscale": (lambda r: _has(r, "autoscaled", "trace"), plot_autoscale),
    "overload": (lambda r: _has(r, "with_backpressure") or _has(r, "without_backpressure"), plot_overload),
    "faults": (lambda r: _has(r, "scenarios"), plot_faults),
    "generation": (lambda r: _has(r, "continuous", "static"), plot_generation),
    "serve": (lambda r: _has(r, "through_gateway"), plot_serve),
    "batching": (lambda r: _has_steps(r, POLICIES), plot_batching),
    "transport": (lambda r: _has_steps(r, PATHS), plot_transport),
    "simulate": (lambda r: _has(r, "search", "fleet"), plot_simulate),
    "placement": (lambda r: _has(r, "swap_in_ms", "swap_in_ms_by_model"), plot_placement),
    "model": (lambda r: _has(r, "batch") and all(isinstance(v, dict) for v in r["batch"].values()), plot_model),
}


# -- drawing helpers ----------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.set_layout_engine("constrained")  # room for the suptitle, the labels and the legends
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _title(fig: Any, text: str) -> None:
    fig.suptitle("\n".join(textwrap.wrap(text, 125)))


def _sla(report: Report) -> tuple[float, float]:
    sla = report.get("sla") or {}
    return float(sla.get("p95_ms", SLA_P95_MS)), float(sla.get("p99_ms", SLA_P99_MS))


def _sla_lines(ax: Any, sla: tuple[float, float]) -> None:
    ax.axhline(sla[0], color="black", ls="-", lw=0.8, alpha=0.7)
    ax.axhline(sla[1], color="black", ls="--", lw=0.8, alpha=0.7)
    for value, name in zip(sla, ("P95", "P99"), strict=True):
        ax.annotate(f"SLA {name} {value:g} ms", (1.0, value), xycoords=("axes fraction", "data"), xytext=(-3, 2),
                    textcoords="offset points", ha="right", va="bottom", fontsize=7)


def _latency_vs_rate(ax: Any, series: dict[str, list[dict[str, Any]]], sla: tuple[float, float],
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
    _sla_lines(ax, sla)
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis, ax.get_ylim(), extra=sla)
    positive = [r for r in rates if r > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis, ax.get_xlim())
    ax.set_xlabel("offered rate (requests/s, open loop; dotted: max at the SLA)")
    ax.set_ylabel("ms from the scheduled send (dashed: p99)")
    ax.grid(alpha=0.3, which="both")
    if series:
        ax.legend(fontsize=8, loc="upper left")


def _plain_log_ticks(axis: Any, limits: tuple[float, float], extra: Iterable[float] = ()) -> None:
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


def _cpu_bars(ax: Any, steps: list[dict[str, Any]]) -> None:
    """CPU ms per request of each process, stacked, one bar per rate step (retries included)."""
    steps = sorted(steps, key=lambda s: (s["rate"], s.get("attempt", 1)))
    processes: list[str] = []
    for step in steps:
        for name in step.get("cpu_ms_per_request") or {}:
            if name != "total" and name not in processes:
                processes.append(name)
    order = list(PROCESS_COLOURS)
    processes.sort(key=lambda p: (order.index(_base(p)) if _base(p) in order else len(order), p))
    spare = iter(c for c in SERIES_COLOURS[5:] * 4)
    colours = {p: PROCESS_COLOURS.get(p) or next(spare) for p in processes}
    xs = list(range(len(steps)))
    bottom = [0.0] * len(steps)
    for name in processes:
        values = [float((s.get("cpu_ms_per_request") or {}).get(name) or 0.0) for s in steps]
        hatches = ["" if s.get("meets_sla") else "//" for s in steps]
        bars = ax.bar(xs, values, bottom=bottom, color=colours[name], label=name)
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in zip(xs, bottom, strict=True):
        ax.annotate(f"{total:.2f}", (x, total), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    ax.set_xticks(xs, [f"{s['rate']:g}" + (f"\ntry {s['attempt']}" if s.get("attempt", 1) > 1 else "")
                       for s in steps], fontsize=8)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("CPU ms per request answered")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)


def _label_bars(ax: Any, fmt: str) -> None:
    """Each bar's value at its end (none on a zero bar)."""
    for container in ax.containers:
        horizontal = getattr(container, "orientation", "vertical") == "horizontal"
        values = [b.get_width() if horizontal else b.get_height() for b in container]
        ax.bar_label(container, labels=[fmt.format(v) if v else "" for v in values], fontsize=7, padding=2)


def _base(process: str) -> str:
    return process.rstrip("0123456789")


def _layout(name: str) -> str:
    """``onnx:2x1t-b1-e2`` -> ``onnx 2 proc x 1 thread, batch 1, 2 executors`` (else the name as it is)."""
    m = re.fullmatch(r"(\w+):(\d+)x(\d+)t-b(\d+)(?:-e(\d+))?", name)
    if m is None:
        return name
    runtime, procs, threads, batch, executors = m.groups()
    text = f"{runtime} {procs} proc x {threads} thread{'s' if threads != '1' else ''}, batch {batch}"
    return text + (f", {executors} executors" if executors else "")


def _at_sla(max_rps: Any) -> str:
    if not max_rps:
        return "no rate met the SLA"
    return f"max {max_rps:,.0f}/s at the SLA" if max_rps >= 100 else f"max {max_rps:g}/s at the SLA"


def _num(value: Any) -> str:
    if value is None:
        return "?"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if not math.isfinite(value):
        return "?"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"
