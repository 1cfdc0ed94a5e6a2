"""Batch tokenization for the encoder families: the ``tokenizers`` library's Rust batch encoder,
padded to a bounded set of lengths.

transformers' ``tokenizer(texts, padding=True, ...)`` wraps the same Rust tokenizer in Python that
converts every encoding to lists and back; on a GPU that call was most of a batch's time (118 ms of
136 for 512 MiniLM texts, where ``encode_batch`` alone took 17 ms). Here the Rust tokenizer truncates
and encodes the whole batch (on every core: it releases the GIL and runs on its own thread pool),
and the ids go straight into one preallocated array.

Padding goes up to a *bucket* when ``buckets`` are given: a device that builds a kernel plan or a
graph per input shape (cuDNN attention, CUDA graphs) then sees a few lengths, all of them at warm-up,
never a new one on the request path. On a CPU, where a shape costs nothing to meet, batches pad to
their longest text only: padding there is compute thrown away.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

FIRST_BUCKETS = (16, 32, 48, 64)  # short texts (most requests): at most 15 padding tokens a row
GROWTH = 1.5  # above them each bucket is half again the last: at most a third of a row is padding


def length_buckets(max_length: int) -> tuple[int, ...]:
    """The padded lengths a batch may take, up to ``max_length`` (always the last): 16, 32, 48, 64, then
    half again each time rounded up to a multiple of 16 (96, 144, 224, ...: the kernels' tile)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    out = [b for b in FIRST_BUCKETS if b < max_length]
    while out and (nxt := -(-int(out[-1] * GROWTH) // 16) * 16) < max_length:
        out.append(nxt)
    return (*out, max_length)


def bucket_for(length: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``length`` tokens (the last bucket is the truncation length, so no
    batch is longer)."""
    i = bisect.bisect_left(buckets, length)
    return buckets[min(i, len(buckets) - 1)]


@dataclass(frozen=True, slots=True)
class Encoded:
    """A padded batch, as the encoder's inputs."""

    input_ids: npt.NDArray[np.int64]  # [rows, width]
    attention_mask: npt.NDArray[np.int64]  # [rows, width]: 1 over each row's real tokens
    lengths: npt.NDArray[np.int64]  # [rows]: real tokens per row, special tokens included

    def arrays(self, names: tuple[str, ...] | list[str]) -> dict[str, npt.NDArray[np.int64]]:
        """The inputs a model takes, by name (``token_type_ids``: zeros, one segment a text)."""
        have = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        return {n: have[n] if n in have else np.zeros_like(self.input_ids) for n in names}


class BatchTokenizer:
    """``encode(texts) -> Encoded`` through the Rust tokenizer of a transformers fast tokenizer.

    The Rust tokenizer is copied and set once (truncation on, padding off: padding is done here), and
    never changed after: one instance serves every executor thread at once.
    """

    def __init__(self, tokenizer: Any, max_length: int, buckets: tuple[int, ...] | None = None) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("a fast (Rust) tokenizer is needed: the model directory has no tokenizer.json")
        self._rust = Tokenizer.from_str(backend.to_str())
        self._rust.no_padding()
        self._rust.enable_truncation(max_length)
        # Without the character offsets nobody here reads: a tenth faster (tokenizers >= 0.21).
        self._encode_batch = getattr(self._rust, "encode_batch_fast", self._rust.encode_batch)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.max_length = int(max_length)
        self.buckets = buckets
        self.input_names = tuple(tokenizer.model_input_names)

    def encode(self, texts: list[str]) -> Encoded:
        rows = [e.ids for e in self._encode_batch(texts)]
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        longest = int(lengths.max()) if len(rows) else 1
        width = bucket_for(longest, self.buckets) if self.buckets else longest
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return Encoded(ids, mask, lengths)

    def encode_ids(self, width: int, rows: int) -> Encoded:
        """A batch of ``rows`` rows all exactly ``width`` tokens long (warm-up: one bucket's shape)."""
        ids = np.full((rows, width), self.pad_id + 1, dtype=np.int64)
        return Encoded(ids, np.ones_like(ids), np.full(rows, width, dtype=np.int64))
