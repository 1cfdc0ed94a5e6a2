"""What a generation request asks for and what a step produces: plain values, no torch.

The engine core (``consumers.cores``) and the generator runner share them; keeping them apart
from the runner keeps torch out of everything that only schedules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Sampling:
    """Per-request sampling parameters (``params`` of the request envelope)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # generation ends when one appears; it is not part of the output
    seed: int | None = None  # default: derived from the request id, so a redelivery samples the same tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Sampling:
        stop = params.get("stop") or ()
        if isinstance(stop, str):
            stop = tuple(s for s in stop.split("\x1f") if s)  # several stops travel joined by US (0x1F)
        return cls(
            max_new_tokens=int(params.get("max_new_tokens", 64)),
            temperature=float(params.get("temperature", 0.0)),
            top_p=float(params.get("top_p", 1.0)),
            stop=tuple(stop),
            seed=None if params.get("seed") is None else int(params["seed"]),
        )


@dataclass(frozen=True, slots=True)
class GenInput:
    id: str
    prompt: str
    sampling: Sampling = field(default_factory=Sampling)
    templated: bool = False  # rendered by a chat template, which places special tokens itself


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What one sequence produced in one step."""

    id: str
    token: int  # the token id
    text: str  # text that became final this step (may be empty while a stop sequence might form)
    finish: str | None  # "eos", "length" or "stop" when this was the last token
    prompt_tokens: int
    generated: int  # tokens produced so far, this one included
