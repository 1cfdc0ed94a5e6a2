"""The kinfer error hierarchy: one root, typed leaves, behaviour flags.

    KinferError                  root; ``retriable`` says whether the same call may succeed later,
    │                            ``shed`` says the system refused work to protect its latency
    ├── InvalidRequest           the request breaks the contract (bad field, over a limit)
    │   └── UnknownModel         no such model is served
    ├── Overloaded               refused up front; ``retry_after_s`` says when to try again
    │   └── ColdStart            no worker has the model warm, and its cold start outlasts the deadline
    ├── Shed                     accepted, then dropped by the worker under overload
    ├── DeadlineExceeded         the deadline passed before a result was produced
    ├── ModelError               the model raised while computing this request
    ├── Unavailable              Kafka or Redis could not be reached
    └── MalformedRecord          a record of our own kinds (reply, health, stats) that does not decode:
                                 a bug or a forgery, dropped and counted, never the caller's fault

The worker reports outcomes as a result ``status`` (see ``topics.envelope.Status``);
``Result.raise_for_status()`` turns a non-ok result into the matching exception on the client side.
"""

from __future__ import annotations


class KinferError(Exception):
    """Root of every error kinfer raises on purpose."""

    retriable: bool = False
    shed: bool = False


class InvalidRequest(KinferError):
    """The request does not satisfy the wire contract; ``field`` names the offending part."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnknownModel(InvalidRequest):
    """The model name is well-formed but nothing serves it."""


class Overloaded(KinferError):
    """Refused before enqueueing: the system cannot meet the deadline now."""

    retriable = True
    shed = True

    def __init__(self, message: str, retry_after_s: float = 1.0, level: str | None = None,
                 cause: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.level = level  # the model's degradation level when the health signal refused it
        self.cause = cause  # why admission refused: "level", "deadline", "throttle" or "cold"


class ColdStart(Overloaded):
    """No worker has the model warm (its weights are being swapped in, or will be): the expected cold
    start, ``retry_after_s``, would outlast the request's deadline. Try again then, or with a longer one."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s, "cold", "cold")


class Shed(KinferError):
    """Accepted, then dropped by a worker whose standing queue would have made it late (CoDel)."""

    retriable = True
    shed = True


class DeadlineExceeded(KinferError):
    """No result by the request's deadline (expired in the queue, or the reply never came)."""

    retriable = True

    def __init__(self, message: str, answered: bool = True, accepted: bool = True) -> None:
        super().__init__(message)
        self.answered = answered  # False: the client stopped waiting, no worker ever said why
        self.accepted = accepted  # False: the broker never took the request (it may still arrive, expired)


class ModelError(KinferError):
    """The model runner failed on this request."""


class Unavailable(KinferError):
    """A dependency (Kafka, Redis) is unreachable."""

    retriable = True


class MalformedRecord(KinferError):
    """A reply, health state or stats record that breaks its definition; ``field`` names the part,
    ``reason`` says how, in a word fit for a metric label (size, depth, syntax, schema, memory,
    tombstone, type, future, capacity)."""

    def __init__(self, message: str, field: str | None = None, reason: str = "schema") -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason
