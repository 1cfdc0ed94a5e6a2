"""Generation parameters are total: any ``params`` map gives a usable ``Sampling`` or a ``ValueError``."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.consumers.runners.sampling import (
    MAX_NEW_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SEED_RANGE,
    Sampling,
)

KEYS = ("max_new_tokens", "temperature", "top_p", "stop", "seed")
HOSTILE_NUMBERS = [math.nan, math.inf, -math.inf, 1e-40, 1e-300, 5e-324, -0.0, 1e308, 2**63, 2**64, -(2**63) - 1,
                   10**400, "nan", "inf", "1e-40", "64", True, False]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=40),
    st.sampled_from(HOSTILE_NUMBERS), st.sampled_from(["\x1f", "a\x1fb", "\x1f" * 40, "x" * 2_000]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                          max_size=3), max_leaves=8)
param_maps = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), values, max_size=8)


def within_ranges(s: Sampling) -> None:
    assert type(s.max_new_tokens) is int and 1 <= s.max_new_tokens <= MAX_NEW_TOKENS
    assert type(s.temperature) in (int, float) and math.isfinite(s.temperature)
    assert s.temperature == 0 or MIN_TEMPERATURE <= s.temperature <= MAX_TEMPERATURE
    assert type(s.top_p) in (int, float) and MIN_TOP_P <= s.top_p <= 1
    assert len(s.stop) <= MAX_STOPS and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in s.stop)
    assert s.seed is None or (type(s.seed) is int and SEED_RANGE[0] <= s.seed <= SEED_RANGE[1])


@settings(max_examples=400, derandomize=True, deadline=None)
@given(params=param_maps)
def test_any_params_map_gives_sampling_within_its_ranges_or_a_value_error(params: dict[Any, Any]) -> None:
    try:
        sampling = Sampling.from_params(params)
    except ValueError:
        return
    within_ranges(sampling)


@pytest.mark.parametrize("key", ["max_new_tokens", "temperature", "top_p", "seed"])
@pytest.mark.parametrize("value", HOSTILE_NUMBERS, ids=repr)
def test_hostile_numbers_are_refused_or_within_range(key: str, value: Any) -> None:
    try:
        sampling = Sampling.from_params({key: value})
    except ValueError as exc:
        assert key in str(exc)
        return
    within_ranges(sampling)


@pytest.mark.parametrize("params", [
    {"temperature": math.nan}, {"temperature": "nan"}, {"temperature": "0.7"}, {"temperature": 1e-40},
    {"temperature": True}, {"temperature": math.inf}, {"temperature": MAX_TEMPERATURE * 2}, {"temperature": -1},
    {"top_p": 1e-45}, {"top_p": 1e-300}, {"top_p": 0}, {"top_p": 1.5}, {"top_p": math.nan},
    {"max_new_tokens": math.inf}, {"max_new_tokens": 64.0}, {"max_new_tokens": True}, {"max_new_tokens": 0},
    {"max_new_tokens": MAX_NEW_TOKENS + 1}, {"max_new_tokens": "64"},
    {"seed": math.inf}, {"seed": 2**63}, {"seed": 1.5}, {"seed": "7"},
    {"stop": 3}, {"stop": "\x1f".join(["s"] * (MAX_STOPS + 1))}, {"stop": "x" * (MAX_STOP_CHARS + 1)},
])
def test_what_the_runner_cannot_use_is_refused_by_name(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(params))):
        Sampling.from_params(params)


def test_the_edges_of_every_range_are_served() -> None:
    for params in ({"temperature": 0}, {"temperature": MIN_TEMPERATURE}, {"temperature": MAX_TEMPERATURE},
                   {"top_p": MIN_TOP_P}, {"top_p": 1}, {"max_new_tokens": 1}, {"max_new_tokens": MAX_NEW_TOKENS},
                   {"seed": SEED_RANGE[0]}, {"seed": SEED_RANGE[1]}, {"stop": "\x1f".join(["s"] * MAX_STOPS)},
                   {"temperature": None, "seed": None, "stop": None}, {"other-family": [1, {"x": 2}]}):
        within_ranges(Sampling.from_params(params))
    assert Sampling.from_params({"stop": "a\x1f\x1fb\x1f"}).stop == ("a", "b")  # empty parts are no stops
