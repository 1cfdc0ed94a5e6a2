"""Model runners: blocking code that the worker calls from its executor thread, never the loop."""

from kinfer.consumers.runners.base import BatchRunner, Runner, pick_device
from kinfer.consumers.runners.registry import ModelSpec, build_runner, builtin_models, resolve_model

__all__ = ["BatchRunner", "ModelSpec", "Runner", "build_runner", "builtin_models", "pick_device", "resolve_model"]
