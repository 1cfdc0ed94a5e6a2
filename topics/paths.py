"""Where kinfer writes on this machine: the local stack's state, and caches. Per-user folders, never
beside the code (an installed kinfer lives in site-packages, which may be shared or read-only).

    KINFER_HOME    everything, when set: the local stack's state (``stack.json``, logs, data, secrets)
                   and the caches
    KINFER_CACHE   the caches alone (Kafka's jars, the built-in tiny-lm, ONNX exports); before KINFER_HOME

Otherwise the XDG base directories: state in ``$XDG_STATE_HOME/kinfer`` (``~/.local/state/kinfer``),
caches in ``$XDG_CACHE_HOME/kinfer`` (``~/.cache/kinfer``). Read on every call, so a process that sets
the variables (a test, ``kinfer stack --home``) is followed at once.
"""

from __future__ import annotations

import os
from pathlib import Path


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def _xdg(name: str, default: str) -> Path:
    """An XDG base directory; a relative value is ignored, as the specification says."""
    value = _env_path(name)
    return value if value is not None and value.is_absolute() else Path.home() / default


def state_dir() -> Path:
    """The local stack's folder: ``$KINFER_HOME``, else ``$XDG_STATE_HOME/kinfer`` (``~/.local/state/kinfer``)."""
    return _env_path("KINFER_HOME") or _xdg("XDG_STATE_HOME", ".local/state") / "kinfer"


def cache_dir() -> Path:
    """Caches: ``$KINFER_CACHE``, else ``$KINFER_HOME``, else ``$XDG_CACHE_HOME/kinfer`` (``~/.cache/kinfer``)."""
    return _env_path("KINFER_CACHE") or _env_path("KINFER_HOME") or _xdg("XDG_CACHE_HOME", ".cache") / "kinfer"
