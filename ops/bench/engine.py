"""``kinfer bench engine``: the model engine alone, in process, beside the reference on the same device.

What it answers: is the device busy, or waiting on Python? For encoders, kinfer's runner against
sentence-transformers' ``encode`` (sequences/s and ms a batch at each batch size, the split of a
batch between tokenizing, the device and the copy back, the worst first meeting of a new shape);
for generators, kinfer's runner against HF ``generate`` over a static batch (ms a decode step at each
running batch, and the fraction of the memory-bandwidth roofline: weight bytes over the device's
measured bandwidth), and an open-loop workload through the continuous scheduler (time to first token).

It imports the engine alone (runners, the batcher): no client, no gateway, no Kafka, so it runs on an
accelerator's machine with no network. Generator weights are built from a config (random values:
speed does not depend on them); MiniLM comes from its installed package.
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.texts import make_texts
from kinfer.ops.capacity.sla import percentile


@dataclass(frozen=True, slots=True)
class EngineSizes:
    """What one run measures: small on a CPU (the suite runs it), the issue's sizes on a GPU."""

    encoder_batches: tuple[int, ...]
    decoder_batches: tuple[int, ...]
    decoder: dict[str, int]  # a Llama config's sizes (random weights)
    decode_steps: int  # decode steps timed at each running batch
    prompt_words: int  # words of each prompt of the decode measurement
    open_requests: int
    open_rate: float  # requests/s, Poisson
    open_max_running: int
    open_max_new: int  # outputs of 4 .. this many tokens
    seconds: float  # per encoder batch size and side
    shape_probes: int  # padded lengths met for the first time (spread over the truncation window)


CPU_SIZES = EngineSizes(
    encoder_batches=(1, 8, 32), decoder_batches=(1, 16),
    decoder={"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 4},
    decode_steps=16, prompt_words=40, open_requests=24, open_rate=8.0, open_max_running=16, open_max_new=32,
    seconds=1.0, shape_probes=8,
)
# The 1.1B Llama shape (hidden 2048, 16 layers, 32 heads, 8 KV heads), as TinyLlama-1.1B.
CUDA_SIZES = EngineSizes(
    encoder_batches=(1, 8, 32, 128, 512, 1024), decoder_batches=(1, 16, 64, 128),
    decoder={"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 32,
             "num_key_value_heads": 8},
    decode_steps=32, prompt_words=40, open_requests=400, open_rate=40.0, open_max_running=64, open_max_new=128,
    seconds=3.0, shape_probes=28,
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_engine(device: str = "cpu", sizes: EngineSizes | None = None, seed: int = 5,
                 engine: str = "auto") -> dict[str, Any]:
    """``engine``: the generator's (``auto``: slots on a GPU, dynamic on a CPU)."""
    import torch

    sizes = sizes or (CPU_SIZES if device == "cpu" else CUDA_SIZES)
    report: dict[str, Any] = {"device": _device_name(device), "torch": torch.__version__,
                              "encoder": bench_encoder(device, sizes)}
    report["decoder"], report["open_loop"] = bench_decoder(device, sizes, seed, engine)
    return report


# -- encoders -----------------------------------------------------------------------------------------


def bench_encoder(device: str, sizes: EngineSizes) -> dict[str, Any]:
    from kinfer.consumers.runners.embedding import EmbeddingRunner
    from kinfer.consumers.runners.registry import minilm_path

    runner = EmbeddingRunner(minilm_path(), device=device, runtime="torch")
    runner.load()
    runner.warmup()
    texts = make_texts(4096, seed=3)
    out: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "runtime": runner.runtime, "kinfer": {}, "reference": {}}
    sync = _synchronizer(device)
    for size in sizes.encoder_batches:
        out["kinfer"][str(size)] = _throughput(lambda batch: runner.run(batch), texts, size, sizes.seconds, sync)
        log(f"encoder kinfer batch {size}: {out['kinfer'][str(size)]}")
    reference = _sentence_transformers(device)
    if reference is not None:
        for size in sizes.encoder_batches:
            def encode(batch: list[str], size: int = size) -> Any:
                return reference.encode(batch, batch_size=size, convert_to_numpy=True)
            out["reference"][str(size)] = _throughput(encode, texts, size, sizes.seconds, sync)
            log(f"encoder reference batch {size}: {out['reference'][str(size)]}")
    largest = max(sizes.encoder_batches)
    out["split"] = _encoder_split(runner, texts[:largest], sync)
    out["busy_fraction"] = round(out["split"]["device_ms"] / out["split"]["total_ms"], 3)
    out.update(_new_shapes(runner, sync, sizes.shape_probes))
    best = {side: max((v["seq_per_s"] for v in out[side].values()), default=None) for side in ("kinfer", "reference")}
    out["best_seq_per_s"] = best
    if best["kinfer"] and best["reference"]:
        out["best_ratio"] = round(best["kinfer"] / best["reference"], 2)
    return out


def _throughput(call: Callable[[list[str]], Any], texts: list[str], size: int, seconds: float,
                sync: Callable[[], None]) -> dict[str, float]:
    call(texts[:size])  # this batch size's first call is warm-up
    sync()
    done = i = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or done == 0:
        call([texts[(i + k) % len(texts)] for k in range(size)])
        done += size
        i += size
    sync()
    elapsed = time.perf_counter() - start
    return {"seq_per_s": round(done / elapsed, 1), "ms_per_batch": round(elapsed / (done / size) * 1000, 2)}


def _encoder_split(runner: Any, texts: list[str], sync: Callable[[], None], rounds: int = 5) -> dict[str, float]:
    """The median of ``rounds`` batches, by its whole time, split by stage: tokenizing (the CPU), the device's
    pass with the copy of the vectors to the host, and turning them into the lists a reply carries. The
    stages are one batch's, so they add up to its total."""
    measured: list[dict[str, float]] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        enc = runner.tokenize(texts)
        t1 = time.perf_counter()
        vectors = runner.embed(enc)
        sync()
        t2 = time.perf_counter()
        vectors.tolist()
        t3 = time.perf_counter()
        measured.append({"tokenize_ms": t1 - t0, "device_ms": t2 - t1, "to_host_ms": t3 - t2, "total_ms": t3 - t0})
    median = sorted(measured, key=lambda stages: stages["total_ms"])[len(measured) // 2]
    return {"batch": len(texts), **{k: round(v * 1000, 2) for k, v in median.items()}}


def _new_shapes(runner: Any, sync: Callable[[], None], probes: int, size: int = 32) -> dict[str, Any]:
    """Batches of ``size`` texts at ``probes`` lengths spread over the whole truncation window, each length
    met for the first time and then again: the worst first meeting, and its ratio to the same shape warm."""
    first: list[float] = []
    ratios: list[float] = []
    for words in range(4, runner.max_length, max(1, runner.max_length // probes)):
        batch = [" ".join(["padding"] * words)] * size
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            runner.run(batch)
            sync()
            times.append((time.perf_counter() - t0) * 1000)
        first.append(times[0])
        ratios.append(times[0] / max(times[1], 1e-6))
    return {"new_shape_worst_ms": round(max(first), 2), "new_shape_worst_ratio": round(max(ratios), 2)}


def _sentence_transformers(device: str) -> Any:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        log("sentence-transformers is not installed: no encoder reference")
        return None
    from kinfer.consumers.runners.registry import minilm_path

    model = SentenceTransformer(str(minilm_path()), device=device)
    if device != "cpu":
        model.half()
    return model


# -- generators ---------------------------------------------------------------------------------------


def bench_decoder(device: str, sizes: EngineSizes, seed: int,
                  engine: str = "auto") -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from kinfer.consumers.runners.generator import GeneratorRunner, GenInput, Sampling

    with _decoder_dir(sizes, device) as path:
        # Slots for the largest running batch measured; a context for the open loop's longest prompt
        # (256 words) and output.
        slots = max(*sizes.decoder_batches, sizes.open_max_running)
        runner = GeneratorRunner(path, device=device, max_prompt_tokens=512, engine=engine, slots=slots,
                                 context=1024)
        runner.load()
        runner.warmup()
        weights = sum(t.numel() * t.element_size() for t in runner.model.parameters())
        bandwidth = _bandwidth(device)
        roofline_ms = weights / bandwidth * 1000
        out: dict[str, Any] = {
            "engine": runner.engine,
            "model": "Llama, " + ", ".join(f"{k} {v}" for k, v in sizes.decoder.items()) + " (random weights)",
            "weight_bytes": weights, "bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "roofline_ms_per_step": round(roofline_ms, 3), "kinfer": {}, "reference": {},
        }
        prompt = " ".join(make_texts(1, sizes.prompt_words, sizes.prompt_words, seed=seed))
        sync = _synchronizer(device)
        for rows in sizes.decoder_batches:
            inputs = [GenInput(f"d{i}", prompt, Sampling(max_new_tokens=sizes.decode_steps + 2)) for i in range(rows)]
            runner.step(inputs, [])  # the prefill, and each row's first token
            sync()
            t0 = time.perf_counter()
            for _ in range(sizes.decode_steps):
                runner.step([], [])
            sync()
            ms = (time.perf_counter() - t0) / sizes.decode_steps * 1000
            runner.step([], [i.id for i in inputs])
            runner.reset()
            out["kinfer"][str(rows)] = _step_figures(ms, rows, roofline_ms)
            log(f"decoder kinfer running batch {rows}: {out['kinfer'][str(rows)]}")
        for rows in sizes.decoder_batches:
            ms = _generate_ms_per_step(runner, prompt, rows, sizes.decode_steps, sync)
            out["reference"][str(rows)] = _step_figures(ms, rows, roofline_ms)
            log(f"decoder reference running batch {rows}: {out['reference'][str(rows)]}")
        out["speedup"] = {k: round(out["reference"][k]["ms_per_step"] / v["ms_per_step"], 2)
                          for k, v in out["kinfer"].items() if k in out["reference"]}
        open_loop = _open_loop(runner, sizes, seed)
        log(f"open loop: {open_loop}")
        del runner
        if device != "cpu":
            torch.cuda.empty_cache()
    return out, open_loop


def _step_figures(ms: float, rows: int, roofline_ms: float) -> dict[str, float]:
    return {"ms_per_step": round(ms, 3), "tokens_per_s": round(rows / ms * 1000, 1),
            "roofline_fraction": round(roofline_ms / ms, 4)}


@contextlib.contextmanager
def _decoder_dir(sizes: EngineSizes, device: str) -> Iterator[Path]:
    """A Llama of ``sizes.decoder`` with random weights, saved with MiniLM's tokenizer (as tiny-lm is),
    without an end-of-sequence token: every output is as long as asked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from kinfer.consumers.runners.registry import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    shape: dict[str, Any] = dict(sizes.decoder)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=4096, eos_token_id=None,
                         bos_token_id=tokenizer.cls_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, **shape)
    dtype = torch.float32 if device == "cpu" else torch.float16
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM  # untyped in some transformers releases
    with tempfile.TemporaryDirectory(prefix="kinfer-engine-") as tmp, torch.device(device):
        model = auto.from_config(config, dtype=dtype)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        yield Path(tmp)


def _generate_ms_per_step(runner: Any, prompt: str, rows: int, steps: int, sync: Callable[[], None]) -> float:
    """HF ``generate`` on the same model over a static batch, greedy: the time of ``steps`` more tokens
    than one, per token (so the prefill is left out)."""
    import torch

    enc = runner.tokenizer([prompt] * rows, return_tensors="pt", return_token_type_ids=False).to(runner.device)

    def generate(new: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=runner.tokenizer.pad_token_id)
        sync()
        return time.perf_counter() - t0

    generate(2)  # warm-up
    return (generate(steps + 1) - generate(1)) / steps * 1000


def _open_loop(runner: Any, sizes: EngineSizes, seed: int) -> dict[str, Any]:
    """Poisson arrivals of prompts of 8-256 words and outputs of 4..``open_max_new`` tokens through the
    continuous scheduler and the runner."""
    from kinfer.batcher import ContinuousScheduler, GenPolicy
    from kinfer.consumers.runners.generator import GenInput, Sampling

    rng = random.Random(seed)
    at, workload = 0.0, []
    for i, prompt in enumerate(make_texts(sizes.open_requests, min_words=8, max_words=256, seed=seed)):
        at += rng.expovariate(sizes.open_rate)
        workload.append((at, GenInput(f"o{i}", prompt, Sampling(max_new_tokens=rng.randint(4, sizes.open_max_new)))))
    scheduler = ContinuousScheduler(GenPolicy(max_running=sizes.open_max_running))
    figures = drive_generation(runner, scheduler, workload)
    return {"requests": sizes.open_requests, "rate_rps": sizes.open_rate, **figures}


def drive_generation(runner: Any, sched: Any, workload: list[tuple[float, Any]]) -> dict[str, Any]:
    """Run ``workload`` ((arrival s, GenInput), in order) through ``sched`` and ``runner`` in real time:
    tokens/s, time to first token and latency from each request's scheduled arrival, steps taken."""
    from kinfer.batcher import Sequence

    arrivals = {g.id: t for t, g in workload}
    inputs = {g.id: g for _, g in workload}
    pending = list(workload)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens = steps = 0
    start = time.perf_counter()
    while pending or sched.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, g = pending.pop(0)
            sched.add(Sequence(g.id, prompt_tokens=min(512, len(g.prompt) // 3 + 2),
                               max_new_tokens=g.sampling.max_new_tokens, arrival=now))
        if not sched.has_work():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        plan = sched.schedule(now)
        events = runner.step([inputs[s.id] for s in plan.admit], [s.id for s, _ in plan.evict])
        steps += 1
        t = time.perf_counter() - start
        for e in events:
            tokens += 1
            first.setdefault(e.id, t)
            sched.advance(e.id)
            if e.finish is not None:
                sched.finish(e.id)
                done[e.id] = t
    elapsed = max(done.values()) - min(arrivals.values())
    ttft = [(first[i] - arrivals[i]) * 1000 for i in first]
    latency = [(done[i] - arrivals[i]) * 1000 for i in done]
    return {
        "tokens_per_s": round(tokens / elapsed, 1),
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p95_ms": round(percentile(ttft, 95), 1),
        "latency_p95_ms": round(percentile(latency, 95), 1),
        "steps": steps,
        "completed": len(done),
    }


# -- the device ---------------------------------------------------------------------------------------


def _synchronizer(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def _bandwidth(device: str, mib: int = 256, rounds: int = 5) -> float:
    """The device memory's bandwidth in bytes/s, measured: the best of ``rounds`` copies of ``mib`` MiB
    (each moves its bytes twice: read and write)."""
    import torch

    sync = _synchronizer(device)
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


# -- the picture --------------------------------------------------------------------------------------


def plot_engine(report: dict[str, Any], path: str) -> str:
    """Encoder sequences/s and decoder ms a step, kinfer beside the reference, by batch."""
    plt = draw.pyplot()
    fig, (enc, dec) = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, part, key, ylabel in ((enc, "encoder", "seq_per_s", "sequences/s (higher is better)"),
                                  (dec, "decoder", "ms_per_step", "ms a decode step (lower is better)")):
        block = report.get(part) or {}
        sizes = sorted({*block.get("kinfer", {}), *block.get("reference", {})}, key=int)
        width = 0.4
        for i, side in enumerate(("kinfer", "reference")):
            xs = [j + (i - 0.5) * width for j in range(len(sizes))]
            ax.bar(xs, [(block.get(side, {}).get(s) or {}).get(key) or 0.0 for s in sizes], width, label=side,
                   color=draw.SERIES_COLOURS[i])
        if part == "decoder" and block.get("roofline_ms_per_step"):
            ax.axhline(block["roofline_ms_per_step"], color="grey", linestyle="--", label="bandwidth roofline")
        ax.set_xticks(range(len(sizes)), [f"batch {s}" for s in sizes])
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        draw.label_bars(ax, fmt="{:,.1f}")
    draw.title(fig, f"kinfer bench engine on {report.get('device', '?')}: encoder best "
                    f"{draw.num((report.get('encoder') or {}).get('best_ratio'))}x sentence-transformers, busy "
                    f"{draw.num((report.get('encoder') or {}).get('busy_fraction'))}")
    return draw.save(fig, path)
