"""``kinfer bench peers``: kinfer against other embedding servers, one box, one generator, one workload.

Each system serves all-MiniLM-L6-v2 (or ``--model``) over HTTP on this machine, alone on it, in turn;
the same open-loop Poisson generator (``loadgen``, 5–60-word texts) sweeps the same rates through each
and reports its highest rate meeting the SLA (P95 < 150 ms, P99 < 250 ms, at most 1 % errors), its
latency at every step and the CPU each of its processes spent per request.

The peers are installed here, each in a virtual environment of its own under the cache
(``<cache>/peers/<name>``), from PyPI at the versions ``PEERS`` pins: each one's newest release
pulls dependencies it no longer runs with (torch, transformers, optimum, uvloop), so the set that runs
is pinned too. An install is made once and kept (a marker holds the requirements it was made from).
Nothing is downloaded from a model hub: the peers load the same weights kinfer does, from the local
model directory; Infinity's ONNX engine gets an export of them made by optimum, in its own venv.

kinfer is measured as a user gets it: ``kinfer worker --model M`` with no layout flag, one gateway,
its Kafka broker and Redis on the same box (which the peers, one process each, do not carry); and
with ``--runtime onnx-int8``. Like is compared with like: each system says its precision, and
Infinity is run on the float export and on the int8 graph kinfer serves (on a CPU Infinity prefers a
quantized ONNX file where the model's repository has one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.gateway import TEXT_WORDS, sweep_gateway
from kinfer.ops.bench.harness import descendants, local_stack, log, wait_http
from kinfer.ops.bench.loadgen import LoadGen, sweep
from kinfer.ops.capacity.sla import SLA_MIN_OK, SLA_P95_MS, SLA_P99_MS
from kinfer.ops.localstack.procs import stop_process
from kinfer.ops.localstack.stack import free_port
from kinfer.topics.paths import cache_dir

# The rates every system is swept through (requests/s), up to the first it misses twice.
RATES = (20.0, 40.0, 60.0, 80.0, 100.0, 120.0, 140.0, 160.0, 180.0, 200.0, 220.0, 240.0, 260.0, 280.0,
         300.0, 330.0, 360.0, 400.0)
# Every system is warmed up alike before its sweep, at the first rate: long enough for Kafka's JIT to
# settle (a broker's compiler threads took ~8 % of a core for a minute after a start).
WARMUP_S = 20.0
BATCH_SIZE = 32  # the peers' largest batch (Infinity's --batch-size, MLServer's max_batch_size)


@dataclass(frozen=True)
class Peer:
    """Another server, as ``bench peers`` installs, starts and speaks to it."""

    name: str
    label: str  # what the report calls it
    precision: str  # of the weights it computes with: fp32 or int8
    requirements: tuple[str, ...]  # pip requirements, pinned: the set that runs together
    api: str  # loadgen's --api
    ready_path: str  # answers 200 once the model is loaded ({model}: its name)
    command: Callable[[Path, Path, str, int, Path], list[str]]  # (venv, model dir, model name, port, scratch)
    env: tuple[tuple[str, str], ...] = ()
    prepare: Callable[[Path, Path], Path] | None = None  # (venv, model dir) -> the model dir it serves

    @property
    def venv(self) -> str:
        """Its virtual environment's name: one per package (``infinity-int8`` runs in ``infinity``'s)."""
        return self.name.split("-")[0]


def _infinity_command(venv: Path, model_dir: Path, model: str, port: int, scratch: Path) -> list[str]:
    return [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", str(model_dir), "--served-model-name", model,
            "--engine", "optimum", "--device", "cpu", "--batch-size", str(BATCH_SIZE), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]


def _with_onnx_int8(venv: Path, model_dir: Path) -> Path:
    """As ``_with_onnx``, with the export's weights quantized to int8 as kinfer's ``onnx-int8`` does."""
    from kinfer.consumers.runners.embedding import quantize_int8

    fp32 = _with_onnx(venv, model_dir)

    def fill(staging: Path) -> None:
        shutil.copytree(fp32, staging, copy_function=_link_or_copy, ignore=shutil.ignore_patterns("*.onnx"))
        quantize_int8(fp32 / "onnx" / "model.onnx", staging / "onnx" / "model.onnx")
        os.link(staging / "onnx" / "model.onnx", staging / "model.onnx")

    return _staged(fp32.with_name(fp32.name + "-int8"), fill)


def _with_onnx(venv: Path, model_dir: Path) -> Path:
    """The model directory with ``model.onnx`` beside it, as Infinity's ONNX engine looks for it: a copy
    (hard links) of the weights and an export optimum makes of them, once. The export is at the top
    and again in ``onnx/`` (the same file): optimum 1.27 refuses the path Infinity names it by when it
    finds one ONNX file only."""
    def fill(staging: Path) -> None:
        shutil.copytree(model_dir, staging, copy_function=_link_or_copy)
        export = staging / "export"
        subprocess.run([str(venv / "bin" / "optimum-cli"), "export", "onnx", "--model", str(staging), "--task",
                        "feature-extraction", str(export)], check=True, env=_offline(), stdout=subprocess.DEVNULL)
        (staging / "onnx").mkdir()
        os.replace(export / "model.onnx", staging / "onnx" / "model.onnx")
        os.link(staging / "onnx" / "model.onnx", staging / "model.onnx")
        shutil.rmtree(export)

    return _staged(cache_dir() / "peers" / "models" / f"{model_dir.parent.name}.{model_dir.name}-onnx", fill)


def _staged(target: Path, fill: Callable[[Path], None]) -> Path:
    """``target``, made once by ``fill`` in a folder beside it and renamed into place when whole."""
    if (target / "onnx" / "model.onnx").exists():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    fill(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def _mlserver_command(venv: Path, model_dir: Path, model: str, port: int, scratch: Path) -> list[str]:
    """MLServer's own settings: its HuggingFace runtime's feature-extraction task, adaptive batching up
    to ``BATCH_SIZE`` inputs or 20 ms, one inference worker (its default), ports beside ``port``."""
    (scratch / model).mkdir(parents=True, exist_ok=True)
    (scratch / "settings.json").write_text(json.dumps({
        "http_port": port, "grpc_port": free_port(), "metrics_port": free_port(), "host": "127.0.0.1"}))
    (scratch / model / "model-settings.json").write_text(json.dumps({
        "name": model, "implementation": "mlserver_huggingface.HuggingFaceRuntime",
        "max_batch_size": BATCH_SIZE, "max_batch_time": 0.02,
        "parameters": {"extra": {"task": "feature-extraction", "pretrained_model": str(model_dir)}}}))
    return [str(venv / "bin" / "mlserver"), "start", str(scratch)]


_INFINITY = ("infinity-emb[server,optimum]==0.0.78", "optimum[onnxruntime]==1.27.0", "transformers==4.48.3",
             "torch==2.6.0", "numpy==1.26.4")
_INFINITY_ENV = (("INFINITY_ANONYMOUS_USAGE_STATS", "0"), ("DO_NOT_TRACK", "1"))

PEERS = {peer.name: peer for peer in (
    Peer("infinity", "Infinity 0.0.78, ONNX, batch 32", "fp32", _INFINITY, api="openai", ready_path="/health",
         command=_infinity_command, prepare=_with_onnx, env=_INFINITY_ENV),
    Peer("infinity-int8", "Infinity 0.0.78, ONNX int8, batch 32", "int8", _INFINITY, api="openai",
         ready_path="/health", command=_infinity_command, prepare=_with_onnx_int8, env=_INFINITY_ENV),
    Peer("mlserver", "MLServer 1.7.1, HuggingFace runtime, adaptive batching", "fp32",
         ("mlserver==1.7.1", "mlserver-huggingface==1.7.1", "transformers==4.41.2", "torch==2.6.0",
          "uvloop==0.21.0"),
         api="v2", ready_path="/v2/models/{model}/ready", command=_mlserver_command,
         env=(("USE_TF", "0"),)),  # transformers picks torch (the runtime's import pulls TensorFlow in too)
)}
# kinfer's own entries: (label, worker flags, precision).
KINFER = {
    "kinfer": ("kinfer, default worker", (), "fp32"),
    "kinfer-int8": ("kinfer, --runtime onnx-int8", ("--runtime", "onnx-int8"), "int8"),
}


# -- installing ----------------------------------------------------------------------------------------


def install(peer: Peer, root: Path | None = None) -> Path:
    """``peer``'s virtual environment, made (or made again, when its requirements changed) from PyPI."""
    venv = (root or cache_dir() / "peers") / peer.venv
    marker = venv / ".kinfer-peer"
    wanted = "\n".join(peer.requirements)
    if marker.exists() and marker.read_text() == wanted:
        return venv
    log(f"installing {peer.label} into {venv} (once; several GB with torch)")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([_base_python(), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *peer.requirements], check=True)
    marker.write_text(wanted)
    return venv


def _base_python() -> str:
    """The interpreter kinfer's own venv was made from (a venv made from a venv's python would share it)."""
    return getattr(sys, "_base_executable", sys.executable)


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _offline() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# -- running ---------------------------------------------------------------------------------------------


@contextmanager
def running(peer: Peer, venv: Path, model_dir: Path, model: str, log_path: Path) -> Iterator[tuple[str, list[int]]]:
    """``peer`` serving ``model`` on a free port of 127.0.0.1, until the block ends: its URL and the
    PIDs of its processes (a server that forks workers has several). It runs in a process group of its
    own, which is what is stopped: the processes it started, and no other."""
    served_dir = peer.prepare(venv, model_dir) if peer.prepare else model_dir
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=f"kinfer-peer-{peer.name}-") as scratch, open(log_path, "ab") as out:
        proc = subprocess.Popen(peer.command(venv, served_dir, model, port, Path(scratch)),
                                env={**_offline(), **dict(peer.env)}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=scratch)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url, timeout_s=300.0, path=peer.ready_path.format(model=model), alive=lambda: proc.poll() is None)
            yield url, [proc.pid, *descendants(proc.pid)]
        finally:
            stop_process(proc, group=True)


def sweep_peer(peer: Peer, venv: Path, model_dir: Path, model: str, rates: tuple[float, ...], seconds: float,
               home: Path) -> dict[str, Any]:
    with running(peer, venv, model_dir, model, home / f"peer-{peer.name}.log") as (url, pids):
        gen = LoadGen(None, "http", model, str(home / f"peer-{peer.name}-loadgen.log"), url=url,
                      extra=["--api", peer.api, "--texts", f"{TEXT_WORDS[0]},{TEXT_WORDS[1]}"])
        try:
            gen.step(rates[0], WARMUP_S, seed=99)  # warm-up, not counted
            named = {"client": gen.proc.pid, **{f"{peer.name}{i or ''}": pid for i, pid in enumerate(pids)}}
            return sweep(gen, named, rates, seconds, min_ok=SLA_MIN_OK)
        finally:
            gen.close()


# -- the benchmark ---------------------------------------------------------------------------------------


def bench_peers(model: str = "minilm", peers: tuple[str, ...] = tuple(PEERS),
                kinfer: tuple[str, ...] = tuple(KINFER), seconds: float = 10.0, rates: tuple[float, ...] = RATES,
                partitions: int = 6) -> dict[str, Any]:
    """kinfer's entries through its gateway, then each peer, alone on the box in turn."""
    from kinfer.consumers.runners import resolve_model

    spec = resolve_model(model)
    if not spec.path:
        raise ValueError(f"model {model!r} has no local directory the peers could load")
    model_dir = Path(spec.path)
    venvs = {name: install(PEERS[name]) for name in peers}  # before anything is measured: installs take minutes
    report: dict[str, Any] = {
        "kind": "peers", "model": model, "texts": f"{TEXT_WORDS[0]}-{TEXT_WORDS[1]} words, Poisson arrivals",
        "cpus": os.cpu_count(), "sla": {"p95_ms": SLA_P95_MS, "p99_ms": SLA_P99_MS, "min_ok": SLA_MIN_OK},
        "seconds_per_step": seconds, "systems": {},
    }
    with local_stack() as info:
        home = Path(info.home)
        for name in kinfer:
            label, flags, precision = KINFER[name]
            log(f"{label}: kinfer worker --model {model} {' '.join(flags)}, a gateway, Kafka and Redis")
            swept = sweep_gateway(info, model, list(flags), 1, rates, seconds, partitions, warmup_rps=rates[0],
                                  warmup_s=WARMUP_S)
            report["systems"][name] = {"label": label, "precision": precision, "kinfer": True, **swept}
    for name in peers:
        peer = PEERS[name]
        log(f"{peer.label}: {' '.join(peer.requirements)}")
        report["systems"][name] = {"label": peer.label, "precision": peer.precision, "kinfer": False,
                                   "requirements": list(peer.requirements),
                                   **sweep_peer(peer, venvs[name], model_dir, model, rates, seconds, home)}
    report["ratios"] = ratios(report["systems"])
    return report


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """kinfer's best against the best peer: at each precision both ran, and over all of them."""
    def best(kinfer: bool, precision: str | None) -> tuple[str, float] | None:
        found = [(n, float(s["max_rps_at_sla"])) for n, s in systems.items()
                 if s["kinfer"] is kinfer and precision in (None, s["precision"])]
        return max(found, key=lambda f: f[1]) if found else None

    out: dict[str, Any] = {}
    for precision in (*sorted({s["precision"] for s in systems.values()}), None):
        ours, theirs = best(True, precision), best(False, precision)
        if ours and theirs:
            out[precision or "any"] = {"kinfer": ours[0], "peer": theirs[0],
                                       "ratio": round(ours[1] / theirs[1], 3) if theirs[1] else None}
    return out


def plot_peers(report: dict[str, Any], path: str) -> str:
    """Each system's highest rate at the SLA, and its latency against the offered rate."""
    plt = draw.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=(1, 1.2))
    systems = report.get("systems", {})
    names = sorted(systems, key=lambda n: systems[n].get("max_rps_at_sla") or 0.0)
    values = [systems[n].get("max_rps_at_sla") or 0.0 for n in names]
    colour = {n: draw.SERIES_COLOURS[i % len(draw.SERIES_COLOURS)] for i, n in enumerate(systems)}  # its line's
    left.barh(range(len(names)), values, color=[colour[n] for n in names])
    left.set_yticks(range(len(names)), [systems[n].get("label", n) for n in names], fontsize=8)
    for y, v in enumerate(values):
        left.annotate(f"{v:g}", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    left.set_xlim(0, max([*values, 1.0]) * 1.15)
    left.set_xlabel("highest rate meeting the SLA (requests/s)")
    left.grid(axis="x", alpha=0.3)
    draw.latency_vs_rate(right, {systems[n].get("label", n): systems[n].get("steps", []) for n in systems},
                         draw.report_sla(report), maxima=[systems[n].get("max_rps_at_sla") for n in systems])
    right.set_title("latency against offered rate")
    said = ", ".join(f"{precision} {draw.num(r.get('ratio'))}x" for precision, r in report.get("ratios", {}).items())
    draw.title(fig, f"kinfer bench peers: {report.get('model', '?')} over HTTP on {report.get('cpus', '?')} CPUs: "
                    f"kinfer's best against the best peer: {said}")
    return draw.save(fig, path)
