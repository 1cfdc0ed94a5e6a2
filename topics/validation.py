"""Field-level messages for configuration files validated with pydantic (tenants, models).

A file is a list of entries; each problem is reported as ``what[i] ('name').field: why (got …)``,
all of them in one line, so a user fixes the file in one go rather than one error per run.
"""

from __future__ import annotations

from typing import Any

# A field named like these is never echoed: a key pasted where its hash belongs must not reach a log.
_SECRET = ("key", "secret", "password", "token")


def problems(exc: Any, entries: list[Any], what: str) -> str:
    """The pydantic ``ValidationError`` of ``entries`` (validated as a list) as one line."""
    lines = []
    for err in exc.errors():
        index, *where = err["loc"] or ("?",)
        entry = entries[index] if isinstance(index, int) and index < len(entries) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        at = f"{what}[{index}]" + (f" ({name!r})" if isinstance(name, str) else "")
        at += "".join(f".{w}" for w in where)
        secret = any(word in str(where[-1]).lower() for word in _SECRET) if where else False
        got = f" (got {err['input']!r})" if where and err["type"] != "missing" and not secret else ""
        lines.append(f"{at}: {err['msg']}{got}")
    return f"{len(lines)} problem{'s' * (len(lines) != 1)}: " + "; ".join(lines)
