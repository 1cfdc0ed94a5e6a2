"""The cancel note: a request's sender needs no answer any more (its stream's client went away, or a
hedged request was answered through another copy); the workers stop its sequence or drop its queued
copies, and keep the note a while for a copy they fetch later (``consumers.cores.Notes``).

Published on the Redis channel ``kinfer:cancel`` (best effort). ``mac`` = HMAC-SHA256(reply_key,
"cancel" NUL id) proves the sender sent the request (``topics.auth.cancel_mac``); a worker stops only
a request whose reply key makes the same MAC (or that carried none).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kinfer.topics.envelope import ModelName, RequestId
from kinfer.topics.names import CANCEL_CHANNEL
from kinfer.topics.record import Record


class CancelNote(Record, frozen=True):
    max_bytes = 512  # three short fields; anything longer is refused unread

    id: RequestId  # the request to stop
    model: ModelName
    mac: Annotated[bytes, msgspec.Meta(max_length=64)] | None = None


__all__ = ["CANCEL_CHANNEL", "CancelNote"]
