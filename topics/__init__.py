"""The contract: topic names, the msgpack envelope, its limits, and the error hierarchy.

``topics`` imports no other kinfer package; producers and consumers meet only here.
"""

from topics.envelope import (
    DEFAULT_LIMITS,
    ENVELOPE_VERSION,
    Chunk,
    Limits,
    ReplyRoute,
    Request,
    Result,
    RouteKind,
    Status,
    Timings,
    decode_reply,
    decode_request,
    decode_result,
    new_request_id,
    now_ms,
    pack,
)
from topics.errors import (
    DeadlineExceeded,
    InvalidRequest,
    KinferError,
    ModelError,
    Overloaded,
    Shed,
    Unavailable,
    UnknownModel,
)
from topics.names import Priority

__all__ = [
    "DEFAULT_LIMITS",
    "ENVELOPE_VERSION",
    "Chunk",
    "DeadlineExceeded",
    "InvalidRequest",
    "KinferError",
    "Limits",
    "ModelError",
    "Overloaded",
    "Priority",
    "ReplyRoute",
    "Request",
    "Result",
    "RouteKind",
    "Shed",
    "Status",
    "Timings",
    "Unavailable",
    "UnknownModel",
    "decode_reply",
    "decode_request",
    "decode_result",
    "new_request_id",
    "now_ms",
    "pack",
]
