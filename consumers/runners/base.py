"""The runner interface every model family implements."""

from __future__ import annotations

import os
from typing import Any, Protocol


class Runner(Protocol):
    family: str  # "embedding", "noop", ...
    device: str  # "cpu", "cuda", ...

    def load(self) -> None:
        """Load weights onto the device. Slow; called once, off the event loop."""

    def warmup(self) -> None:
        """Run a few representative batches so the first real request does not pay for lazy init."""

    def count_tokens(self, text: str) -> int:
        """Cheap estimate of the tokens ``text`` becomes; called on the event loop for every input."""


class BatchRunner(Runner, Protocol):
    """Families whose requests are served by one forward pass each (embedding, classification)."""

    def run(self, texts: list[str]) -> list[Any]:
        """One forward pass over a batch; one msgpack-able output per text, in order."""


def estimate_tokens(text: str, max_length: int) -> int:
    """WordPiece/BPE average about four characters a token in English; +2 for the special tokens.

    An estimate is enough for batching: it shapes batches and reserves memory, it truncates nothing.
    """
    return min(max_length, 2 + -(-len(text) // 4))


def encode(tokenizer: Any, texts: list[str], max_length: int, device: str) -> Any:
    """A padded, truncated batch of ``texts`` as tensors on ``device`` (encoder families)."""
    return tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)


def pick_device(requested: str = "auto") -> str:
    """``auto`` picks CUDA when torch sees a GPU, else CPU. ``KINFER_DEVICE`` overrides ``auto``."""
    requested = os.environ.get("KINFER_DEVICE", requested) if requested == "auto" else requested
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
