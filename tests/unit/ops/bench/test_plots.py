"""Pictures of benchmark reports: every saved report draws, unknown JSON is refused, the CLI parses."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kinfer.ops.bench.plots import UnknownReport, plot_report, report_kind
from kinfer.ops.cli import build_parser, main
from kinfer.ops.cli.bench import draw_report
from tests import ROOT

REPORTS = ROOT / "ops" / "bench" / "reports"
SAVED = sorted(REPORTS.glob("*.json"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert 0 < len(data) < 600_000, (path, len(data))  # small enough to keep in the repository


def test_there_are_saved_reports() -> None:
    assert len(SAVED) >= 10, SAVED


@pytest.mark.parametrize("report", SAVED, ids=[p.stem for p in SAVED])
def test_every_saved_report_draws(report: Path, tmp_path: Path) -> None:
    data = json.loads(report.read_text())
    # Each file is named after its benchmark: transport-before.json is a transport report, and so on.
    assert report.stem.startswith(report_kind(data)), (report.stem, report_kind(data))
    out = tmp_path / f"{report.stem}.png"
    assert plot_report(data, out) == str(out)
    assert_png(out)


def test_an_overload_report_with_a_timeline_draws_it(tmp_path: Path) -> None:
    """Saved reports predate the timeline; a new one carries it (``ops.bench.overload.timeline``)."""
    from kinfer.ops.bench.overload import Outcome, timeline
    from kinfer.topics import Priority

    rng, outcomes, t = random.Random(3), [], 0.0
    kinds = ("ok", "ok", "ok", "rejected", "expired", "shed")
    while t < 12.0:
        t += rng.expovariate(60.0)
        outcomes.append(Outcome("surge", Priority.P1, rng.choice(kinds), rng.uniform(5, 400), 1.0, t))
    lags = [(i * 0.1 - 0.5, rng.randint(0, 40)) for i in range(140)]
    line = timeline(outcomes, lags, deadline_ms=250)
    assert sum(line["offered"]) == len(outcomes)
    assert [a + b + c for a, b, c in zip(line["rejected"], line["served_in_time"], line["missed"],
                                         strict=True)] == line["offered"]
    assert len(line["t_s"]) == len(line["lag"]) and line["t_s"][1] == line["bucket_s"]
    report = json.loads((REPORTS / "overload-sim-cpu.json").read_text())
    for run in ("with_backpressure", "without_backpressure"):
        report[run]["timeline"] = line
    json.dumps(report, allow_nan=False)  # what the CLI prints
    assert_png(Path(plot_report(report, tmp_path / "overload.png")))


def test_an_autoscale_report_with_a_timeline_draws_it(tmp_path: Path) -> None:
    from kinfer.ops.bench.autoscale import Trace, timeline

    report = json.loads((REPORTS / "autoscale.json").read_text())
    trace = Trace(**report["trace"])
    samples = [{"t": i * 0.5, "arrival_rps": trace.rate_at(i * 0.5), "lag": float(i % 7),
                "wait_ms": float("inf") if i == 3 else 10.0 * (i % 5), "replicas": 1.0 + (i > 200)}
               for i in range(int(trace.duration_s * 2))]
    for run in ("autoscaled", "static_peak"):
        report[run]["timeline"] = timeline(samples)
    assert report["autoscaled"]["timeline"]["wait_ms"][3] is None  # strict JSON: no inf
    json.dumps(report, allow_nan=False)
    assert_png(Path(plot_report(report, tmp_path / "autoscale.png")))


def test_a_model_report_draws(tmp_path: Path) -> None:
    report = {"model": "minilm", "device": "cpu",
              "batch": {"1": {"seq_per_s": 74.5, "ms_per_batch": 13.4}, "32": {"seq_per_s": 62.6, "ms_per_batch": 511}}}
    assert report_kind(report) == "model"
    assert_png(Path(plot_report(report, tmp_path / "model.png")))


@pytest.mark.parametrize(("report", "says"), [
    ({"rate": 1, "steps": []}, "not a kinfer bench report: its keys (rate, steps) match none of the kinds"),
    ({}, "its keys (none) match none"),
    ([1, 2], "a JSON list, not an object"),
    ({"kind": "nonsense"}, "no picture for reports of kind 'nonsense'"),
])
def test_an_unknown_shape_is_refused(report: Any, says: str, tmp_path: Path) -> None:
    with pytest.raises(UnknownReport) as refused:
        plot_report(report, tmp_path / "x.png")
    assert says in str(refused.value)
    assert not (tmp_path / "x.png").exists()


def test_bench_plot_parses() -> None:
    report = "ops/bench/reports/transport.json"
    args = build_parser().parse_args(["bench", "plot", report, "--out", "/tmp/t.png"])
    assert (args.command, args.bench) == ("bench", "plot") and args.report == report and args.out == "/tmp/t.png"
    assert build_parser().parse_args(["bench", "plot", "r.json"]).out is None


@pytest.mark.parametrize("bench", ["model", "batching", "generation", "serve", "transport", "faults", "autoscale",
                                   "overload"])
def test_every_bench_takes_plot(bench: str) -> None:
    parse = build_parser().parse_args
    assert parse(["bench", bench]).plot is None  # no picture unless asked
    assert parse(["bench", bench, "--plot"]).plot == ""  # asked: the default path
    assert parse(["bench", bench, "--plot", "x.png"]).plot == "x.png"


def test_bench_plot_draws_a_saved_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "generation.json"
    report.write_text((REPORTS / "generation-cpu.json").read_text())
    assert main(["bench", "plot", str(report)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "generation.png")  # next to the JSON by default
    assert_png(tmp_path / "generation.png")


def test_bench_plot_says_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KINFER_DEBUG", raising=False)
    (tmp_path / "odd.json").write_text('{"hello": "world"}')
    (tmp_path / "bad.json").write_text("not json")
    assert main(["bench", "plot", str(tmp_path / "odd.json")]) == 2
    assert f"kinfer bench: {tmp_path / 'odd.json'}: not a kinfer bench report" in capsys.readouterr().err
    assert main(["bench", "plot", str(tmp_path / "bad.json")]) == 2
    assert f"{tmp_path / 'bad.json'}: not JSON" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_a_bench_that_ends_draws_its_report_or_says_why_not(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``kinfer bench NAME --plot``: the picture's path goes into the report; a failed picture is told
    on stderr and the report is printed all the same (``kinfer bench`` then exits 2)."""
    report = json.loads((REPORTS / "generation-cpu.json").read_text())
    assert draw_report(report, str(tmp_path / "g.png"), "generation")
    assert report["plot"] == str(tmp_path / "g.png")
    assert_png(tmp_path / "g.png")
    odd: dict[str, Any] = {"hello": "world"}
    assert not draw_report(odd, str(tmp_path / "odd.png"), "model")
    assert "plot" not in odd and "kinfer bench model: the plot failed (UnknownReport" in capsys.readouterr().err
