"""A fetched record → a request this worker may serve, or the reason it may not. Pure and total.

The one boundary where records from any producer enter a worker. Whatever the bytes and headers,
``read_record`` returns a ``Request`` or raises ``InvalidRequest`` (with the field at fault): the
worker dead-letters the record, tells the sender why when it can, commits it and goes on. No other
exception may leave it — one that did would stop the fetch loop, and the record, never committed,
would stop the next worker too. A defect here is therefore also a refusal (field ``message``), logged
with its traceback, never a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kinfer.topics import DEFAULT_LIMITS, InvalidRequest, Limits, Request, decode_request
from kinfer.topics.auth import Headers, Verifier
from kinfer.topics.names import Priority

log = logging.getLogger(__name__)

def read_record(
    value: bytes | None,
    headers: Headers,
    model: str,
    priority: Priority,
    *,
    limits: Limits = DEFAULT_LIMITS,
    verifier: Verifier | None = None,
    topic_missing: Callable[[str], bool] | None = None,
) -> Request:
    """The request in a record of ``infer.<model>.<priority>``, checked against everything this worker
    enforces: the envelope and its limits, the tenant's signature and rules, the topic's model, and a
    reply topic known to be missing (no compute for a result nobody can receive)."""
    try:
        if value is None:
            raise InvalidRequest("the record has no value (a tombstone)", "message")
        request = decode_request(value, limits)
        if verifier is not None:  # raises Refused (an InvalidRequest)
            verifier.check(value, headers, request.tenant, request.priority, priority)
        if request.priority.background != priority.background:  # one tier's rules on the other's topic
            raise InvalidRequest(f"a {request.priority.label} request on a {priority.label} topic: background "
                                 "requests (p3) go to the p3 topic, and only they do", "priority")
        if request.model != model:
            raise InvalidRequest(f"model {request.model!r} sent to a topic of {model!r}", "model")
        route = request.reply
        if route.redis is None and topic_missing is not None and topic_missing(route.name):
            raise InvalidRequest(f"reply topic {route.name!r} does not exist", "reply")
        return request
    except InvalidRequest:
        raise
    except Exception as exc:  # a defect of ours: still this record's refusal, never the worker's end
        log.exception("reading a record of %s failed unexpectedly", model)
        raise InvalidRequest(f"unreadable record ({type(exc).__name__})", "message") from exc

