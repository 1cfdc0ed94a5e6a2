"""What a generation request asks for and what a step produces: plain values, no torch.

The engine core (``consumers.cores``) and the generator runner share them; keeping them apart
from the runner keeps torch out of everything that only schedules.

Sampling parameters are total: ``Sampling`` holds only values the runner can use (finite, typed,
within the ranges below), and ``Sampling.from_params`` turns any ``params`` map into one or raises
``ValueError`` saying which parameter is wrong — nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The ranges a request's generation parameters must be in (WIRE_FORMAT.md states them too).
MAX_NEW_TOKENS = 65_536  # tokens one request may ask for (the default KV budget's size: more could never run)
MIN_TEMPERATURE = 1e-4  # besides 0 (greedy): below this, sampling is greedy in all but name
MAX_TEMPERATURE = 100.0  # above this, every token is about as likely as any other
MIN_TOP_P = 1e-6  # below this, nucleus sampling keeps the most likely token alone: ask for greedy
MAX_STOPS = 16  # stop sequences in one request, the chat template's own included
MAX_STOP_CHARS = 1_024  # characters in one stop sequence
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer
STOP_SEPARATOR = "\x1f"  # several stop sequences travel as one string joined by US (0x1F)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Per-request sampling parameters (``params`` of the request envelope)."""

    max_new_tokens: int = 64  # 1 .. MAX_NEW_TOKENS
    temperature: float = 0.0  # 0: greedy; else MIN_TEMPERATURE .. MAX_TEMPERATURE
    top_p: float = 1.0  # MIN_TOP_P .. 1
    stop: tuple[str, ...] = ()  # generation ends when one appears; it is not part of the output
    seed: int | None = None  # default: derived from the request id, so a redelivery samples the same tokens

    def __post_init__(self) -> None:
        _integer("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        t = _real("temperature", self.temperature)
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or within [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                             f"got {t!r}")
        p = _real("top_p", self.top_p)
        if not MIN_TOP_P <= p <= 1:
            raise ValueError(f"top_p must be within [{MIN_TOP_P}, 1], got {p!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        if len(self.stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences (the chat template's included), got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"a stop sequence is longer than {MAX_STOP_CHARS} characters")
        if self.seed is not None:
            _integer("seed", self.seed, *SEED_RANGE)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Sampling:
        """The generation parameters of a request's ``params`` (other keys are other families' and ignored);
        a key set to None counts as absent. ``ValueError`` names the first parameter that is wrong."""
        if not isinstance(params, dict):
            raise ValueError(f"params must be a map, got {type(params).__name__}")
        stop = params.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            if len(stop) > MAX_STOPS * (MAX_STOP_CHARS + 1):
                raise ValueError(f"stop is longer than {MAX_STOPS} sequences of {MAX_STOP_CHARS} characters")
            stops = tuple(s for s in stop.split(STOP_SEPARATOR) if s)
        else:
            raise ValueError(f"stop must be a string (several joined by U+001F), got {type(stop).__name__}")
        defaults = cls()
        return cls(
            max_new_tokens=_given(params, "max_new_tokens", defaults.max_new_tokens),
            temperature=_given(params, "temperature", defaults.temperature),
            top_p=_given(params, "top_p", defaults.top_p),
            stop=stops,
            seed=params.get("seed"),
        )


def _given(params: dict[str, Any], key: str, default: Any) -> Any:
    value = params.get(key)
    return default if value is None else value


def _integer(name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int:  # not a bool, not a float that happens to be whole, not a string
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be within [{low}, {high}], got {value}")
    return value


def _real(name: str, value: object) -> float:
    if type(value) is float:
        number = value
    elif type(value) is int:  # an int beyond any float counts as infinite
        number = float(value) if value.bit_length() <= 1_000 else math.inf
    else:  # not a bool, not a string ("nan" is no number here)
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number!r}")
    return number


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
