"""``kinfer bench NAME``: the benchmarks, one entry each in ``BENCHES`` (its flags and what it measures);
every one prints its report as JSON, and with ``--plot`` draws it. ``kinfer bench plot`` draws a saved one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kinfer.ops.cli.common import Command

PLOT = "plot"  # `kinfer bench plot REPORT.json`: draws a saved report, of any benchmark


@dataclasses.dataclass(frozen=True)
class Bench:
    """One ``kinfer bench NAME``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    measure: Callable[[argparse.Namespace], dict[str, Any]]  # runs it: the report


def _floats(value: str) -> list[float]:
    return [float(x) for x in value.split(",")]


def _model_args(bm: argparse.ArgumentParser) -> None:
    bm.add_argument("--model", default="minilm")
    bm.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 32])
    bm.add_argument("--seconds", type=float, default=5.0)
    bm.add_argument("--json", action="store_true", help="one line of JSON")


def _model(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.model import bench_model

    return bench_model(args.model, batch_sizes=args.batch_sizes, seconds=args.seconds)


def _engine_args(be: argparse.ArgumentParser) -> None:
    _json_arg(be)
    be.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: small sizes (MiniLM, a 4-layer Llama); cuda: MiniLM and the 1.1B Llama shape [cpu]")
    be.add_argument("--engine", choices=["auto", "dynamic", "slots"], default="auto",
                    help="the generator's engine; auto: slots on a GPU, dynamic on a CPU [auto]")


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.engine import bench_engine

    return bench_engine(args.device, engine=args.engine)


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")


def _batching_args(bb: argparse.ArgumentParser) -> None:
    _json_arg(bb)
    bb.add_argument("--seconds-per-step", type=float, default=8.0)
    bb.add_argument("--steps", type=int, default=6, help="bisection steps per policy")
    bb.add_argument("--policy", action="append", choices=["batch1", "window100", "kinfer"])
    bb.add_argument("--model", choices=["minilm", "sim"], default="minilm",
                    help="sim: a simulated accelerator (15 ms a batch + 0.5 ms an input)")
    bb.add_argument("--max-rps", type=float, default=256.0, help="upper end of the rate search")


def _batching(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.batching import bench_batching

    return bench_batching(seconds_per_step=args.seconds_per_step, steps=args.steps, policies=args.policy,
                          model=args.model, hi_rps=args.max_rps)


def _generation_args(bg: argparse.ArgumentParser) -> None:
    _json_arg(bg)
    bg.add_argument("--requests", type=int, default=96)
    bg.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson; above capacity)")
    bg.add_argument("--max-running", type=int, default=16)


def _generation(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.generation import bench_generation

    return bench_generation(requests=args.requests, rate=args.rate, max_running=args.max_running)


def _serve_args(bv: argparse.ArgumentParser) -> None:
    _json_arg(bv)
    bv.add_argument("--model", default="minilm")
    bv.add_argument("--alone-seconds", type=float, default=8.0, help="per layout of the model alone")
    bv.add_argument("--seconds", type=float, default=10.0, help="per rate step through the gateway")
    bv.add_argument("--partitions", type=int, default=6, help="per request topic (a multiple of the workers)")


def _serve(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.gateway import bench_serve

    return bench_serve(model=args.model, alone_seconds=args.alone_seconds, seconds_per_step=args.seconds,
                       partitions=args.partitions)


# ``ops.bench.peers``' PEERS, KINFER and RATES, named here so that the command line starts without importing
# the benchmark (a test holds the two together).
PEER_NAMES = ("infinity", "infinity-int8", "mlserver")
KINFER_ENTRIES = ("kinfer", "kinfer-int8")
PEER_RATES = "20,40,60,80,100,120,140,160,180,200,220,240,260,280,300,330,360,400"


def _peers_args(bp: argparse.ArgumentParser) -> None:
    _json_arg(bp)
    bp.add_argument("--model", default="minilm", help="a built-in model with local weights")
    bp.add_argument("--peer", action="append", choices=PEER_NAMES,
                    help="a peer to run (repeatable; default: all). Installed once into the cache, from PyPI")
    bp.add_argument("--kinfer", action="append", choices=KINFER_ENTRIES,
                    help="kinfer's entries to run (repeatable; default: both): the default worker, --runtime onnx-int8")
    bp.add_argument("--seconds", type=float, default=10.0, help="per rate step")
    bp.add_argument("--rates", type=_floats, default=PEER_RATES, help="requests/s, comma-separated, each "
                    "system swept up to the first it misses twice")
    bp.add_argument("--partitions", type=int, default=6, help="per request topic of kinfer's model")


def _peers(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.peers import bench_peers

    return bench_peers(model=args.model, peers=tuple(args.peer or PEER_NAMES),
                       kinfer=tuple(args.kinfer or KINFER_ENTRIES), seconds=args.seconds,
                       rates=tuple(args.rates), partitions=args.partitions)


def _transport_args(bt: argparse.ArgumentParser) -> None:
    _json_arg(bt)
    bt.add_argument("--seconds", type=float, default=10.0, help="per rate step")
    bt.add_argument("--path", action="append", choices=["library", "http"], help="default: both")
    bt.add_argument("--library-rates", type=_floats, help="requests/s, comma-separated (default: ops.transport's)")
    bt.add_argument("--http-rates", type=_floats, help="requests/s, comma-separated (default: ops.transport's)")
    bt.add_argument("--partitions", type=int, default=3, help="per request topic")
    bt.add_argument("--trace-ratio", type=float,
                    help="instead of the sweep: CPU per request with tracing off and sampled at this ratio, side "
                         "by side at one rate per path (e.g. 0.01)")


def _transport(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.transport import bench_transport, compare_tracing

    paths = tuple(args.path or ("library", "http"))
    if args.trace_ratio is not None:
        if not 0 < args.trace_ratio <= 1:
            raise ValueError(f"--trace-ratio must be in (0, 1], not {args.trace_ratio}")
        return compare_tracing(args.trace_ratio, seconds=args.seconds, paths=paths, partitions=args.partitions)
    rates = {k: tuple(v) for k, v in (("library_rates", args.library_rates), ("http_rates", args.http_rates)) if v}
    return bench_transport(seconds=args.seconds, paths=paths,
                           partitions=args.partitions, **rates)


def _faults_args(bf: argparse.ArgumentParser) -> None:
    _json_arg(bf)
    own = " (default: each scenario's own; mostly {})"
    bf.add_argument("--rate", type=float, help="requests/s through the client library" + own.format(40))
    bf.add_argument("--before-s", type=float, help="load before the fault" + own.format(3))
    bf.add_argument("--after-s", type=float, help="load from the fault on" + own.format(15))
    bf.add_argument("--deadline-ms", type=int,
                    help="longer than any recovery: unanswered = lost" + own.format(30_000))
    bf.add_argument("--scenario", action="append", help="run only these (default: all)")
    bf.add_argument("--partitions", type=int, help="partitions of each priority topic of the model" + own.format(4))
    bf.add_argument("--membership", choices=("default", "static", "dynamic"),
                    help="lone workers join as static members (--instance-id) or dynamic ones (default: each "
                         "scenario's own; mostly static)")
    bf.add_argument("--cycles", type=int, default=1, help="apply a repeatable fault this many times in one run")


def _faults(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.faults import bench_faults

    return bench_faults(rate=args.rate, before_s=args.before_s, after_s=args.after_s, deadline_ms=args.deadline_ms,
                        only=tuple(args.scenario or ()), partitions=args.partitions, membership=args.membership,
                        cycles=args.cycles)


def _chaos_args(bc: argparse.ArgumentParser) -> None:
    from kinfer.ops.bench.chaos import FAULTS, VARIANTS, ChaosConfig

    d = ChaosConfig()
    _json_arg(bc)
    bc.add_argument("--minutes", type=float, default=d.minutes, help=f"length of the soak [{d.minutes:g}]")
    bc.add_argument("--rate", type=float, default=d.rate, help=f"requests/s, Poisson [{d.rate:g}]")
    bc.add_argument("--deadline-ms", type=int, default=d.deadline_ms,
                    help=f"every request's deadline; ok within it is the service level [{d.deadline_ms}]")
    bc.add_argument("--seed", type=int, default=d.seed, help="the faults, their order and times [1]")
    bc.add_argument("--every-s", type=float, nargs=2, default=d.every_s, metavar=("MIN", "MAX"),
                    help="seconds between two faults [30 60]")
    bc.add_argument("--fault", action="append", choices=FAULTS, help="only these faults (default: all)")
    bc.add_argument("--variants", default="all",
                    help=f"comma-separated soaks to run side by side, same seed: {', '.join(VARIANTS)} [all]")
    bc.add_argument("--keep", metavar="DIR", help="keep each soak's stack and process logs under DIR")


def _chaos(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.chaos import FAULTS, ChaosConfig, bench_chaos

    config = ChaosConfig(minutes=args.minutes, rate=args.rate, deadline_ms=args.deadline_ms, seed=args.seed,
                         every_s=(args.every_s[0], args.every_s[1]), faults=tuple(args.fault or FAULTS))
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for name in variants:
        config.variant(name)  # an unknown one fails now, not after the first soak
    return bench_chaos(config, variants, keep=args.keep)


def _autoscale_args(ba: argparse.ArgumentParser) -> None:
    _json_arg(ba)
    ba.add_argument("--quiet-rps", type=float, default=30.0)
    ba.add_argument("--step", type=float, default=5.0, help="peak rate / quiet rate")
    ba.add_argument("--quiet-s", type=float, default=90.0, help="quiet before the step")
    ba.add_argument("--peak-s", type=float, default=40.0)
    ba.add_argument("--ramp-s", type=float, default=40.0, help="linear ramp from the peak back to quiet")
    ba.add_argument("--tail-s", type=float, default=90.0, help="quiet after the ramp")
    ba.add_argument("--per-input-ms", type=float, default=10.0, help="the simulated accelerator's cost per input")


def _autoscale(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.autoscale import Trace, bench_autoscale

    trace = Trace(quiet_rps=args.quiet_rps, step=args.step, quiet_s=args.quiet_s, peak_s=args.peak_s,
                  ramp_s=args.ramp_s, tail_s=args.tail_s)
    return bench_autoscale(trace, per_input_ms=args.per_input_ms)


def _overload_args(bo: argparse.ArgumentParser) -> None:
    _json_arg(bo)
    bo.add_argument("--surge-s", type=float, default=30.0)
    bo.add_argument("--normal-s", type=float, default=10.0)
    bo.add_argument("--factor", type=float, default=3.0, help="surge rate / measured capacity")
    bo.add_argument("--per-input-ms", type=float, default=20.0, help="the simulated model's cost per input")
    bo.add_argument("--deadline-ms", type=int, default=250)
    bo.add_argument("--neighbour-s", type=float, default=15.0,
                    help="per phase of the co-located 10x spike run (0: skip it)")


def _overload(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.overload import bench_overload

    return bench_overload(surge_s=args.surge_s, normal_s=args.normal_s, factor=args.factor,
                          per_input_ms=args.per_input_ms, deadline_ms=args.deadline_ms, neighbour_s=args.neighbour_s)


def _fill_args(bf: argparse.ArgumentParser) -> None:
    from kinfer.ops.bench.fill import FillSetup

    _json_arg(bf)
    d = FillSetup()
    bf.add_argument("--seconds", type=float, default=d.seconds, help=f"the compressed day [{d.seconds:g}]")
    bf.add_argument("--valley", type=float, default=d.valley,
                    help=f"interactive rate at the valleys, of capacity [{d.valley:g}]")
    bf.add_argument("--peak", type=float, default=d.peak,
                    help=f"interactive rate at the peak, of capacity [{d.peak:g}]")
    bf.add_argument("--batch", type=int, default=d.batch, help="requests in the batch (0: 80 %% of the idle capacity)")
    bf.add_argument("--workers", type=int, default=d.workers, help=f"simulated accelerators [{d.workers}]")
    bf.add_argument("--slice-ms", type=float, default=d.slice_ms, help=f"--background-slice-ms [{d.slice_ms:g}]")


def _fill(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.fill import FillSetup, bench_fill

    return bench_fill(FillSetup(seconds=args.seconds, valley=args.valley, peak=args.peak, batch=args.batch,
                                workers=args.workers, slice_ms=args.slice_ms))


def _placement_args(bl: argparse.ArgumentParser) -> None:
    _json_arg(bl)
    bl.add_argument("--models", type=int, default=6, help="copies of all-MiniLM-L6-v2 under different names [6]")
    bl.add_argument("--resident", type=int, default=3, help="how many of them the device budget holds [3]")
    bl.add_argument("--rate", type=float, default=10.0, help="requests/s over all models (Poisson) [10]")
    bl.add_argument("--seconds", type=float, default=60.0, help="length of the mixed load [60]")
    bl.add_argument("--zipf-s", type=float, default=1.5, help="the traffic's Zipf exponent over the models [1.5]")
    bl.add_argument("--deadline-ms", type=int, default=5_000, help="every request's deadline [5000]")


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer.ops.bench.placement import bench_placement

    return bench_placement(models=args.models, resident=args.resident, rate=args.rate, seconds=args.seconds,
                           zipf_s=args.zipf_s, deadline_ms=args.deadline_ms)


BENCHES = {bench.name: bench for bench in (
    Bench("model", "the model alone, in process: sequences/s by batch size", _model_args, _model),
    Bench("engine", "the model engine alone beside the reference on one device: is the device busy?",
          _engine_args, _engine),
    Bench("batching", "max rate meeting P95<150/P99<250 ms per batching policy, end to end", _batching_args,
          _batching),
    Bench("generation", "continuous vs static batching on a mixed generation workload", _generation_args,
          _generation),
    Bench("serve", "the model alone (best layout) vs kinfer through the gateway, same machine", _serve_args, _serve),
    Bench("peers", "kinfer's default worker against other embedding servers (Infinity, MLServer), same box",
          _peers_args, _peers),
    Bench("transport", "the pipeline's own cost: max rate at the SLA and CPU per request per process",
          _transport_args, _transport),
    Bench("faults", "faults injected under a steady load: offered, ok, error, lost, recovery", _faults_args,
          _faults),
    Bench("chaos", "availability over a soak with a fault every 30-60 s (workers, brokers, Redis, control)",
          _chaos_args, _chaos),
    Bench("autoscale", "a 5x traffic step: the autoscaler vs static peak provisioning", _autoscale_args, _autoscale),
    Bench("overload", "a 3x capacity surge with and without the health signal, side by side", _overload_args,
          _overload),
    Bench("fill", "a day of interactive traffic and a large batch: the background tier against p2, side by side",
          _fill_args, _fill),
    Bench("placement", "swap-in times, and more models than the memory budget under a Zipf mix", _placement_args,
          _placement),
)}


def add_arguments(b: argparse.ArgumentParser) -> None:
    subs = b.add_subparsers(dest="bench", required=True)
    for bench in BENCHES.values():
        p = subs.add_parser(bench.name, help=bench.help)
        bench.add_arguments(p)
        p.add_argument("--plot", nargs="?", const="", metavar="PNG",
                       help=f"also draw the report as a PNG (default: bench-{bench.name}.png here; "
                            "'kinfer bench plot' draws a saved report)")
    bp = subs.add_parser(PLOT, help="draw a saved report (the JSON a bench printed) as a PNG")
    bp.add_argument("report", help="the report's JSON file (any kinfer bench)")
    bp.add_argument("--out", metavar="PNG", help="default: the report's path with .png")


def run(args: argparse.Namespace) -> int:
    if args.bench == PLOT:
        return plot_saved(Path(args.report), args.out)
    report = BENCHES[args.bench].measure(args)
    drawn = draw_report(report, args.plot, args.bench) if args.plot is not None else True
    print(json.dumps(report, indent=None if args.json else 2, allow_nan=False))
    return 0 if drawn else 2


def draw_report(report: dict[str, Any], path: str, name: str) -> bool:
    """``--plot [PNG]``: draws the report (``report["plot"]`` says where); a picture that fails is
    told on stderr, and the report is printed all the same (it cost minutes to measure)."""
    from kinfer.ops.bench.plots import default_plot_path, plot_report

    try:
        report["plot"] = plot_report(report, path or default_plot_path(None, name))
    except Exception as exc:
        print(f"kinfer bench {name}: the plot failed ({type(exc).__name__}: {exc}); the report follows",
              file=sys.stderr)
        return False
    return True


def plot_saved(path: Path, out: str | None) -> int:
    """``kinfer bench plot REPORT.json [--out PNG]``: draws a saved report, of any benchmark."""
    from kinfer.ops.bench.plots import UnknownReport, default_plot_path, plot_report

    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    try:
        print(plot_report(report, out or default_plot_path(path, "")))
    except UnknownReport as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return 0


COMMAND = Command("bench", "benchmarks", add_arguments, run, principal="admin")
