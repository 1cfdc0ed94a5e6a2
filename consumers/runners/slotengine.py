"""Generation over fixed shapes: one block of KV slots, a decode step per batch-size bucket (a CUDA graph
on a GPU), prompts prefilled a chunk at a time into their slots.

The dynamic engine (``GenBatch``) grows, trims and concatenates its caches as rows come and go, so every
step has a new shape: nothing can be captured, and each step pays hundreds of launches from Python. Here
the shapes come from a small set. Each layer's keys and values are one tensor ``[slots, kv_heads,
context, head_dim]``; a sequence holds one row of it from prefill to end (``SlotTable`` says which), and
its token at position ``p`` lives in column ``p``. Rows grow independently: the step writes each row's new
column at that row's own position, and an additive mask ``[rows, 1, 1, window]`` lets each row attend to
its own columns only. The step attends over the first ``window`` columns, the smallest window that holds
the longest row: it costs what the batch holds, not the context. A bucket's rows past the held ones are
idle: they write column 0 of a free row and read it back, harmless and finite.

Prefill writes a prompt's columns ``[start, start + n)`` for one row or for several starting at 0 (right
padded: the padding's columns are written but masked, and overwritten by the row's own decode steps). A
long prompt is prefilled ``prefill_chunk`` tokens a step, between decode steps, so the running rows never
wait on it for long. A rejected speculative draft needs no cache surgery: its columns are simply written
over.

The model sees the block through ``SlotCache``, which has the one method transformers' attention layers
call on a cache, ``update(keys, values, layer)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from kinfer.consumers.runners.graphs import StepGraphs, step_graphs
from kinfer.consumers.runners.slots import SlotTable

__all__ = ["PREFILL_ROWS", "SlotBatch", "SlotCache", "SlotEngine"]

PREFILL_ROWS = 8  # whole prompts prefilled in one forward pass (its logits take rows² x vocab)


class SlotCache:
    """The KV block as transformers' models use a cache: each layer's ``update`` writes where the engine
    set (``decode`` or ``prefill``) and returns the rows the forward pass attends over. Layers allocate
    their block at their first write, from the shapes the model gives them."""

    def __init__(self, slots: int, context: int) -> None:
        self.slots, self.context = slots, context
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._size = 0  # decode: rows [0, size), each writing at its own position, over columns [0, window)
        self._window = 0
        self._positions: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # prefill: these rows, from column ``_start``
        self._start = 0

    def decode(self, size: int, window: int, positions: torch.Tensor) -> None:
        self._size, self._window, self._positions, self._rows = size, window, positions, None

    def prefill(self, rows: torch.Tensor, start: int) -> None:
        self._rows, self._start = rows, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):
            _, heads, _, dim = key_states.shape
            shape = (self.slots, heads, self.context, dim)
            self.keys.append(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))
            self.values.append(torch.zeros(shape, dtype=value_states.dtype, device=value_states.device))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._rows is None:  # one new column per row, at the row's own position
            assert self._positions is not None
            rows = torch.arange(self._size, device=keys.device)
            keys[rows, :, self._positions, :] = key_states[:, :, 0, :]
            values[rows, :, self._positions, :] = value_states[:, :, 0, :]
            return keys[: self._size, :, : self._window], values[: self._size, :, : self._window]
        end = self._start + key_states.shape[2]
        keys[self._rows, :, self._start : end, :] = key_states
        values[self._rows, :, self._start : end, :] = value_states
        return keys[self._rows, :, :end], values[self._rows, :, :end]  # the columns written so far

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly

    def move(self, src: int, dst: int, length: int) -> None:
        for block in (*self.keys, *self.values):
            block[dst, :, :length] = block[src, :, :length]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class SlotBatch:
    """The running batch as the worker's core reads it: ids, and allocated against used KV columns."""

    def __init__(self, table: SlotTable) -> None:
        self.ids = table.ids
        self.cache_tokens = len(table) * table.context
        self.real_tokens = sum(table.length(i) for i in self.ids)

    def __len__(self) -> int:
        return len(self.ids)


class SlotEngine:
    """The device side: the KV block, the static decode buffers and their graphs, prefill.

    The runner decides what runs (which rows, which tokens); the engine runs it and returns logits.
    """

    def __init__(self, model: Any, slots: int, context: int, device: str, dtype: torch.dtype,
                 capture: bool = True) -> None:
        self.model = model
        self.device = device
        self.table = SlotTable(slots, context)
        self.cache = SlotCache(slots, context)
        self._ids = torch.zeros(slots, dtype=torch.long, device=device)
        self._positions = torch.zeros(slots, dtype=torch.long, device=device)
        # Each step's ids and positions go in from here (pinned on a GPU: the copy does not wait). Reused:
        # a step's copy has finished before the next fills it, since every step ends with its tokens on
        # the host.
        self._host = torch.zeros(2, slots, dtype=torch.long, pin_memory=device.startswith("cuda"))
        self._columns = torch.arange(context, device=device)
        self._open = torch.zeros(slots, context, dtype=dtype, device=device)
        self._closed = torch.finfo(dtype).min
        vocab = model.get_output_embeddings().weight.shape[0]
        self._logits = torch.zeros(slots, vocab, dtype=dtype, device=device)
        keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._keep_last: dict[str, Any] = {"logits_to_keep": 1} if keep else {}
        self._keeps = keep
        self.steps: StepGraphs = step_graphs(self._decode, device, capture)

    def _decode(self, size: int, window: int) -> None:
        """The captured step: rows [0, size) feed ``_ids`` at ``_positions``, attending over columns [0, window);
        logits into ``_logits``."""
        positions = self._positions[:size]
        mask = self._open[:size, :window].masked_fill(self._columns[None, :window] > positions[:, None], self._closed)
        self.cache.decode(size, window, positions)
        out = self.model(input_ids=self._ids[:size, None], position_ids=positions[:, None],
                         attention_mask=mask[:, None, None, :], past_key_values=self.cache, use_cache=True,
                         **self._keep_last)
        self._logits[:size].copy_(out.logits[:, -1, :])

    @torch.inference_mode()
    def warm(self) -> None:
        """Run (capture) every shape's step once, over idle rows: nothing is held yet."""
        assert len(self.table) == 0
        for size in self.table.buckets:
            for window in self.table.windows:
                self.steps.run(size, window)

    def decode(self, feed: dict[int, int]) -> torch.Tensor:
        """One step over every held row (``feed``: slot -> the token it feeds; a held row not in it, one
        still prefilling, idles at its current length). Returns the bucket's logits, row = slot."""
        size, window = self.table.bucket(), self.table.window()
        ids = [0] * size
        positions = [0] * size
        for rid in self.table.ids:
            slot = self.table.slot(rid)
            positions[slot] = self.table.length(rid)
        for slot, token in feed.items():
            ids[slot] = token
        self._host[:, :size] = torch.tensor([ids, positions], dtype=torch.long)
        self._ids[:size].copy_(self._host[0, :size], non_blocking=True)
        self._positions[:size].copy_(self._host[1, :size], non_blocking=True)
        self.steps.run(size, window)
        return self._logits[:size]

    def prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]], start: int,
                every: bool = False) -> torch.Tensor:
        """Write ``chunks`` (one per slot, right padded) into their rows from column ``start``. Returns each
        chunk's last logits [rows, vocab], or with ``every`` each position's [rows, length, vocab].

        The model computes logits at every chunk's last position for every row ([rows, rows, vocab]: the
        positions to keep are one list for the whole batch), so callers pass at most ``PREFILL_ROWS``."""
        width = max(len(c) for c in chunks)
        ids = torch.tensor([[*c, *([0] * (width - len(c)))] for c in chunks], device=self.device)
        positions = torch.arange(start, start + width, device=self.device)
        end = start + width  # attention runs over the columns written so far, not the whole context
        mask = torch.zeros(width, end, dtype=self._open.dtype, device=self.device)
        mask = mask.masked_fill(self._columns[None, :end] > positions[:, None], self._closed)
        rows = torch.tensor(list(slots), device=self.device)
        self.cache.prefill(rows, start)
        lasts = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        keep: dict[str, Any] = {"logits_to_keep": lasts} if self._keeps and not every else {}
        out = self.model(input_ids=ids, position_ids=positions[None, :].expand(len(chunks), -1),
                         attention_mask=mask[None, None].expand(len(chunks), -1, -1, -1),
                         past_key_values=self.cache, use_cache=True, **keep)
        logits: torch.Tensor = out.logits
        if every:
            return logits
        index = torch.arange(len(chunks), device=self.device)
        return logits[index, index if keep else lasts]

    def release(self, rid: str) -> None:
        move = self.table.release(rid)
        if move is not None:
            self.cache.move(move.src, move.dst, move.length)

    def reset(self) -> None:
        """Forget every row (the block's memory stays)."""
        self.table = SlotTable(self.table.slots, self.table.context)
