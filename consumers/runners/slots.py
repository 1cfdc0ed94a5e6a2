"""Which KV slot each running sequence holds: the bookkeeping of the static-shape generation engine.

The engine keeps one fixed block of KV memory, ``slots`` rows of ``context`` token columns each, and a
sequence holds one row from its prefill to its end. A decode step runs over the first ``bucket`` rows
(the smallest bucket size that covers every held row), one captured graph per bucket size; so the held
rows are kept packed at the front. When a sequence leaves a row in the middle, the last row moves into
the hole (``Move``: the engine copies that row's first ``length`` columns).

A step attends over the first ``window`` columns only: the smallest window (64, 128, ... up to ``context``)
that holds every held row's columns and the one it writes. So a step's cost follows the longest row in
the batch, not the context, and its shape still comes from a small set (buckets x windows).

A row's ``length`` is the number of tokens its KV columns hold. Prefill writes a prompt's columns a
chunk at a time (``prefilled`` of ``prompt`` so far); each decode step then writes one column. A row is
full at ``context`` columns: its next token can be sampled but never fed.

Pure Python, no torch: the table says what moves where, the engine moves it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIN_WINDOW", "Move", "SlotTable", "bucket_sizes"]


def bucket_sizes(slots: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to ``slots``, and ``slots``: the decode batch sizes graphs are
    captured for (and, from 64, the column windows a step attends over)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    sizes = []
    size = smallest
    while size < slots:
        sizes.append(size)
        size *= 2
    sizes.append(slots)
    return tuple(sizes)


MIN_WINDOW = 64  # the narrowest span of columns a decode step attends over


@dataclass(frozen=True, slots=True)
class Move:
    """Copy row ``src``'s first ``length`` columns into row ``dst`` (``src`` is then free)."""

    src: int
    dst: int
    length: int


@dataclass(slots=True)
class _Held:
    slot: int
    prompt: int  # prompt tokens to prefill
    length: int = 0  # KV columns written


class SlotTable:
    def __init__(self, slots: int, context: int) -> None:
        if context < 2:
            raise ValueError(f"context must be >= 2 tokens, got {context}")
        self.slots = slots
        self.context = context
        self.buckets = bucket_sizes(slots)
        self.windows = bucket_sizes(context, min(MIN_WINDOW, context))
        self._held: dict[str, _Held] = {}
        self._order: list[str] = []  # _order[slot] holds that slot

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, rid: str) -> bool:
        return rid in self._held

    @property
    def ids(self) -> list[str]:
        """Held sequences in slot order."""
        return list(self._order)

    def slot(self, rid: str) -> int:
        return self._held[rid].slot

    def length(self, rid: str) -> int:
        return self._held[rid].length

    def prefilled(self, rid: str) -> bool:
        held = self._held[rid]
        return held.length >= held.prompt

    def remaining_prompt(self, rid: str) -> int:
        held = self._held[rid]
        return max(0, held.prompt - held.length)

    def room(self, rid: str) -> int:
        """Columns still free in the sequence's row."""
        return self.context - self._held[rid].length

    def admit(self, rid: str, prompt: int) -> int:
        """Give ``rid`` the first free row for a prompt of ``prompt`` tokens (1 .. context - 1: a full
        prompt leaves a column for the first token it samples); returns the slot."""
        if rid in self._held:
            raise ValueError(f"{rid!r} already holds slot {self._held[rid].slot}")
        if len(self._order) >= self.slots:
            raise ValueError(f"every one of the {self.slots} slots is held")
        if not 1 <= prompt < self.context:
            raise ValueError(f"a prompt takes 1 .. {self.context - 1} tokens, got {prompt}")
        slot = len(self._order)
        self._held[rid] = _Held(slot, prompt)
        self._order.append(rid)
        return slot

    def grow(self, rid: str, columns: int) -> None:
        """``columns`` more were written into ``rid``'s row."""
        held = self._held[rid]
        if columns < 0 or held.length + columns > self.context:
            raise ValueError(f"{rid!r}: {held.length} + {columns} columns exceed the context of {self.context}")
        held.length += columns

    def release(self, rid: str) -> Move | None:
        """Free ``rid``'s row; the last held row moves into it unless it was the last (returned: the
        engine must copy it before the next step)."""
        held = self._held.pop(rid)
        last = self._order.pop()
        if last == rid:
            return None
        moved = self._held[last]
        src, moved.slot = moved.slot, held.slot
        self._order[held.slot] = last
        return Move(src, held.slot, moved.length)

    def bucket(self) -> int:
        """The decode batch size covering every held row (0 when none is held)."""
        n = len(self._order)
        return next((b for b in self.buckets if b >= n), 0) if n else 0

    def window(self) -> int:
        """The columns a decode step attends over: every held row's, and the one each writes next."""
        needed = max((min(h.length + 1, self.context) for h in self._held.values()), default=1)
        return next(w for w in self.windows if w >= needed)
