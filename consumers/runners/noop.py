"""A model that does no math: measures the pipeline itself, and stands in for a slow model in tests.

Each output is the input's length in characters. ``compute_ms`` makes every batch take that long
(a sleep in the executor thread, like a forward pass that holds no GIL). For residency tests it can
declare a footprint (``footprint_mb``) and take time to load from disk (``load_ms``) or from host
RAM (``restore_ms``), like weights would. ``abort_at_chars`` stands in for a native crash: an input of
exactly that many characters ends the process on the spot (no exception, no cleanup), as a segfault
in a kernel or the OOM killer would.
"""

from __future__ import annotations

import os
import time
from typing import Any


class NoopRunner:
    family = "noop"

    def __init__(self, device: str = "cpu", compute_ms: float = 0.0, per_input_ms: float = 0.0,
                 footprint_mb: float = 0.0, load_ms: float = 0.0, restore_ms: float = 0.0,
                 abort_at_chars: float = -1) -> None:
        self.device = device
        self.compute_ms = compute_ms  # fixed cost of one batch
        self.per_input_ms = per_input_ms  # added cost per input in the batch
        self.footprint_mb = footprint_mb
        self.load_ms = load_ms
        self.restore_ms = restore_ms
        self.loaded = False
        self.abort_at_chars = int(abort_at_chars)  # -1: never

    def load(self) -> None:
        time.sleep(self.load_ms / 1000.0)
        self.loaded = True

    def footprint_bytes(self) -> int:
        return int(self.footprint_mb * (1 << 20)) if self.loaded else 0

    def offload(self) -> None:
        pass

    def restore(self) -> None:
        time.sleep(self.restore_ms / 1000.0)

    def unload(self) -> None:
        self.loaded = False

    def warmup(self) -> None:
        pass

    def count_tokens(self, text: str) -> int:
        return 1 + len(text) // 4

    def run(self, texts: list[str]) -> list[Any]:
        if any(len(t) == self.abort_at_chars for t in texts):
            os._exit(70)
        delay_ms = self.compute_ms + self.per_input_ms * len(texts)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000.0)
        return [len(t) for t in texts]
