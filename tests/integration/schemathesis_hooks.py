"""Schemathesis' check for the gateway (loaded through ``SCHEMATHESIS_HOOKS``): no server error it cannot name.

Schemathesis' own ``not_a_server_error`` fails on any 5xx. The gateway answers two by design when the
fuzzer picks a small ``X-Request-Timeout-Ms``: a 504 ``DeadlineExceeded`` (a generation of up to 4,096
tokens that cannot end in time) and a 503 ``Shed`` (a worker predicting it would miss the deadline).
Those are the caller's deadline, answered by name; every other 5xx, a 500 above all, is a defect.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis

# The deadline's answers (``producers.gateway_pipeline._STATUS``): the status and the error's type.
DEADLINE_ANSWERS = {(504, "DeadlineExceeded"), (503, "Shed")}


def _error_type(body: bytes) -> Any:
    try:
        return json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


@schemathesis.check
def no_unnamed_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 5xx fails unless it is the request's own deadline, answered as such."""
    status = response.status_code
    if status < 500:
        return None
    kind = _error_type(response.content)
    if (status, kind) not in DEADLINE_ANSWERS:
        raise AssertionError(f"server error {status} ({kind or 'no typed error'}): {response.content[:300]!r}")
    return None
