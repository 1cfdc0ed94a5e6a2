"""The runner interface every model family implements."""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

from kinfer.consumers.runners.sampling import GenInput, TokenEvent


class Runner(Protocol):
    family: str  # "embedding", "noop", ...
    device: str  # "cpu", "cuda", ...

    def load(self) -> None:
        """Load weights onto the device. Slow; called once, off the event loop."""

    def warmup(self) -> None:
        """Run a few representative batches so the first real request does not pay for lazy init."""

    def count_tokens(self, text: str) -> int:
        """Cheap estimate of the tokens ``text`` becomes; called on the event loop for every input."""

    # Residency (a worker under a memory budget swaps models: device -> host RAM -> disk). Each is
    # called off the event loop, only between model calls, and only in the order the tiers allow.

    def footprint_bytes(self) -> int:
        """Device memory the loaded weights take (0 before ``load``)."""

    def offload(self) -> None:
        """Device -> host RAM (pinned on CUDA): the device holds none of it until ``restore``."""

    def restore(self) -> None:
        """Host RAM -> device, after ``offload``."""

    def unload(self) -> None:
        """Drop the weights (-> disk); ``load`` brings them back."""


class BatchRunner(Runner, Protocol):
    """Families whose requests are served by one forward pass each (embedding, classification)."""

    def run(self, texts: list[str]) -> list[Any]:
        """One forward pass over a batch; one msgpack-able output per text, in order."""


class StepRunner(Runner, Protocol):
    """Generative families: the runner keeps the running batch; each call is one step of it."""

    max_prompt_tokens: int  # prompts are truncated to this
    max_rows: int | None  # sequences it can hold at once (its slots), or None: as many as the KV budget allows
    max_sequence_tokens: int | None  # prompt + output one sequence can hold (its slot's context), or None
    spec_proposed: int  # speculative draft tokens verified so far
    spec_accepted: int  # of those, accepted

    @property
    def batch(self) -> Any:
        """The running batch (``cache_tokens``, ``real_tokens``), or None when empty."""

    def step(self, admit: list[GenInput], drop: list[str]) -> list[TokenEvent]:
        """Drop finished or cancelled rows, prefill ``admit``, decode one token for every row."""

    def reset(self) -> None:
        """Drop the running batch and every row, KV caches included: after a ``step`` raised, its state
        is unknown; the next step starts from an empty batch."""

    def render_chat(self, turns: list[tuple[str, str]]) -> tuple[str, tuple[str, ...]]:
        """A chat's (role, content) turns as the model's prompt, and the stop sequences its template
        implies; ``ValueError`` when the template refuses them. Called on the event loop."""


def module_bytes(module: Any) -> int:
    """Bytes of a torch module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class TorchResidency:
    """Residency for runners whose weights are one torch module (``_weights()``).

    On CUDA, ``offload`` moves the module to pinned host memory (a later ``restore`` copies it back
    at full PCIe speed); on a CPU the weights are in host RAM already, so both are no-ops and the
    host tier means "loaded, not served". ``unload`` is the runner's own (what to drop differs).
    """

    device: str

    def _weights(self) -> Any:
        raise NotImplementedError

    def footprint_bytes(self) -> int:
        module = self._weights()
        return module_bytes(module) if module is not None else 0

    def offload(self) -> None:
        module = self._weights()
        if module is None or self.device == "cpu":
            return
        module.to("cpu")
        for t in (*module.parameters(), *module.buffers()):
            t.data = t.data.pin_memory()
        _release_device_cache(self.device)

    def restore(self) -> None:
        module = self._weights()
        if module is not None and self.device != "cpu":
            module.to(self.device, non_blocking=True)
            _synchronize(self.device)


def bring_in(runner: Runner, from_host: bool) -> None:
    """Make a registered model ready to serve: ``restore`` from host RAM or ``load`` from disk, then the
    warm-up passes — except after a restore on a CPU, where nothing moved and the model has served."""
    if from_host:
        runner.restore()
        if runner.device == "cpu":
            return
    else:
        runner.load()
    runner.warmup()


def _release_device_cache(device: str) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and device.startswith("cuda"):
        torch.cuda.empty_cache()


def _synchronize(device: str) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and device.startswith("cuda"):
        torch.cuda.synchronize()


def drop_weights(device: str) -> None:
    """After a runner let go of its weights: collect them now, and give the device's cache back."""
    import gc

    gc.collect()
    _release_device_cache(device)


def estimate_tokens(text: str, max_length: int) -> int:
    """WordPiece/BPE average about four characters a token in English; +2 for the special tokens.

    An estimate is enough for batching: it shapes batches and reserves memory, it truncates nothing.
    """
    return min(max_length, 2 + -(-len(text) // 4))


def choose_attention(device: str) -> None:
    """Scaled-dot-product attention on a GPU runs flash or memory-efficient kernels, never cuDNN's: cuDNN
    attention builds an execution plan on the CPU for every new input shape (94-174 ms each on an H200,
    and a decoder's KV length is new at every step). Process-wide, as torch keeps the choice."""
    torch = sys.modules.get("torch")
    if torch is not None and device.startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)  # the fallback where neither kernel takes a shape


def to_device(arrays: dict[str, Any], device: str) -> dict[str, Any]:
    """Host arrays as tensors on ``device``: on a GPU copied from pinned memory without waiting (the copy
    queues ahead of the forward pass on the same stream)."""
    import torch

    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    if device == "cpu":
        return tensors
    return {k: t.pin_memory().to(device, non_blocking=True) for k, t in tensors.items()}


def default_threads(workers_per_host: int = 1) -> int:
    """Torch threads per worker: the CPUs this process may use (its affinity, which a container's
    cpuset or ``taskset`` sets), less one for the worker's event loop, split among the workers that
    share them. Never fewer than one. Two cores, one worker: one thread (the other core is the
    loop's, the broker's and the gateway's)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cpus - 1) // workers_per_host)


def default_executors(families: list[str], device: str, threads: int | None, workers_per_host: int = 1) -> int:
    """Model calls in flight at once when not set: on CPU, for models that compute there (embedding,
    classifier), the worker's share of the CPUs over the threads each call uses — measured on two
    cores, two single-thread calls from one queue served 1.4x what two workers did, and cut the demo's
    p95 from 113 to 70 ms. A GPU, a generator (one running batch) or a noop model: one. ``device`` may be
    ``auto``: it is resolved (torch imported) only when the families leave the answer to it."""
    if any(f not in ("embedding", "classifier") for f in families) or pick_device(device) != "cpu":
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cpus // workers_per_host)
    return max(1, share // (threads or default_threads(workers_per_host)))


def set_threads(threads: int | None, workers_per_host: int = 1) -> int | None:
    """Size torch's intra-op pool (``None``: ``default_threads``); returns it, or None without torch."""
    torch = sys.modules.get("torch")  # a family without torch (noop) never imports it
    if torch is None:
        return None
    n = threads or default_threads(workers_per_host)
    torch.set_num_threads(n)
    return n


def pick_device(requested: str = "auto", *, probe: bool = True) -> str:
    """``auto`` picks CUDA when torch sees a GPU, else CPU; ``KINFER_DEVICE`` overrides ``auto``. A model
    that computes on no device (noop) asks with ``probe=False``: ``auto`` is the CPU, and torch (3 s of
    CPU to import, most of such a worker's start) is never imported."""
    requested = os.environ.get("KINFER_DEVICE", requested) if requested == "auto" else requested
    if requested != "auto":
        return requested
    if not probe:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
