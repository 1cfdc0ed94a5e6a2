"""Sampling a whole batch at once: greedy is the argmax, a seeded row ignores its neighbours, draws follow
the softmax, and no logits or parameters make it fail."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.consumers.runners.devsample import SampledRow, pick_tokens, row_parameters, sample_rows
from kinfer.consumers.runners.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P, Sampling

VOCAB = 50


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def seeded(sampling: Sampling) -> SampledRow:
    """A row as the runner makes it: greedy rows have no generator, sampled ones their own, seeded."""
    if sampling.temperature == 0:
        return sampling, None
    return sampling, torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)


def test_greedy_rows_take_the_argmax_and_a_nan_never() -> None:
    logits = random_logits(8, seed=1)
    logits[0, logits[0].argmax()] = math.nan  # the largest value, gone: the next one wins
    logits[1, :] = math.nan  # no candidate at all: any id in range
    logits[2, 7] = math.inf
    expected = torch.nan_to_num(logits, nan=-math.inf, posinf=math.inf, neginf=-math.inf).argmax(-1)
    zeros = torch.zeros(8)
    assert sample_rows(logits, zeros, torch.ones(8), zeros).tolist() == expected.tolist()
    assert sample_rows(logits, zeros, torch.full((8,), MIN_TOP_P), torch.full((8,), 0.999)).tolist() == \
        expected.tolist()  # neither top_p nor the draw matters to a greedy row
    rows = [seeded(Sampling()) for _ in range(8)]
    assert pick_tokens(logits, rows).tolist() == expected.tolist()
    assert expected[2] == 7 and not math.isnan(logits[0, expected[0]])


def test_greedy_rows_draw_nothing_from_a_generator() -> None:
    generator = torch.Generator().manual_seed(3)
    before = generator.get_state()
    temperature, _, uniform = row_parameters([(Sampling(), generator)], "cpu")
    assert temperature.tolist() == [0.0] and uniform.tolist() == [0.0]
    assert torch.equal(generator.get_state(), before)


ROW = Sampling(temperature=0.8, top_p=0.9, seed=7)
FULL = Sampling(temperature=1.3, seed=11)  # top_p = 1: the whole distribution
NEIGHBOURS = [Sampling(), Sampling(temperature=0.5, seed=1), Sampling(temperature=2.0, top_p=0.3, seed=2),
              Sampling(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P, seed=3), Sampling(temperature=MAX_TEMPERATURE)]


@pytest.mark.parametrize("row", [ROW, FULL], ids=["nucleus", "full"])
@pytest.mark.parametrize("company", [[], [0], [1, 2], [0, 1, 2, 3, 4], [4, 4, 1]], ids=repr)
@pytest.mark.parametrize("position", [0, -1])
def test_a_seeded_rows_tokens_do_not_depend_on_the_rows_beside_it(row: Sampling, company: list[int],
                                                                  position: int) -> None:
    def run(others: list[Sampling]) -> list[int]:
        batch = [seeded(s) for s in others]
        at = 0 if position == 0 else len(batch)
        batch.insert(at, seeded(row))
        tokens = []
        for step in range(40):  # the row's logits are the same whatever its neighbours; theirs differ
            logits = random_logits(len(batch), seed=1_000 + step * 31 + len(batch))
            logits[at] = random_logits(1, seed=step)[0]
            tokens.append(int(pick_tokens(logits, batch)[at]))
        return tokens

    alone = run([])
    assert run([NEIGHBOURS[i] for i in company]) == alone
    assert len(set(alone)) > 1  # it did sample: not one token every time


@pytest.mark.parametrize("top_p", [MIN_TOP_P, 1e-45, 1e-300, 0.05])
def test_a_tiny_top_p_keeps_only_the_most_likely_token(top_p: float) -> None:
    logits = torch.tensor([[0.0, 0.5, 2.0, 1.9, -1.0, 1.0]]).repeat(500, 1)  # the top has about 35 % of the mass
    uniform = torch.rand(500, generator=torch.Generator().manual_seed(5))
    tokens = sample_rows(logits, torch.ones(500), torch.full((500,), top_p), uniform)
    assert set(tokens.tolist()) == {2}


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.5, 0.8), (1.0, 0.5)])
def test_draws_follow_the_softmax_of_the_kept_tokens(temperature: float, top_p: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -math.inf, math.nan, 1.5])
    probs = torch.softmax(torch.nan_to_num(logits, nan=-math.inf) / temperature, -1).double()
    order = probs.argsort(descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    kept = torch.zeros_like(probs)
    kept[order[before < top_p]] = probs[order[before < top_p]]
    expected = kept / kept.sum()

    draws = 40_000
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(123))
    tokens = sample_rows(logits.repeat(draws, 1), torch.full((draws,), temperature), torch.full((draws,), top_p),
                         uniform, nucleus=top_p < 1)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    for token, (count, p) in enumerate(zip(counts.tolist(), expected.tolist(), strict=True)):
        if p == 0:
            assert count == 0, f"token {token} is outside the kept set but was drawn {count} times"
        else:
            sigma = math.sqrt(draws * p * (1 - p))
            assert abs(count - draws * p) <= 5 * sigma + 1, (token, count, draws * p)


def test_draws_use_the_given_uniform_by_inverse_cdf() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).repeat(5, 1)
    uniform = torch.tensor([0.0, 0.09, 0.11, 0.5, 0.99])
    # Whole distribution: vocabulary order, cumulative 0.1, 0.3, 0.6, 1.0.
    assert sample_rows(logits, torch.ones(5), torch.ones(5), uniform).tolist() == [0, 0, 1, 2, 3]
    # Nucleus (top_p just under 1 keeps all four): most likely first, cumulative 0.4, 0.7, 0.9, 1.0.
    assert sample_rows(logits, torch.ones(5), torch.full((5,), 0.99), uniform).tolist() == [3, 3, 3, 2, 0]
    # A draw of 0 takes the first token with any mass, never one without (a -inf logit).
    ahead = torch.tensor([[-math.inf, math.nan, *torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).tolist()]])
    assert sample_rows(ahead, torch.ones(1), torch.ones(1), torch.zeros(1)).tolist() == [2]
    # Equal probabilities go in id order in the nucleus as well: 4,950 of 5,000 equal tokens kept at top_p 0.99.
    even = torch.zeros(4, 5_000)
    draws = torch.tensor([0.1001, 0.3001, 0.6001, 0.9001])  # targets 495.5, 1,485.5, 2,970.5 and 4,455.5
    assert sample_rows(even, torch.ones(4), torch.full((4,), 0.99), draws).tolist() == [495, 1485, 2970, 4455]


LOGIT = st.one_of(st.floats(width=32), st.sampled_from([math.nan, math.inf, -math.inf, 3e38, -3e38]))
TEMPERATURE = st.sampled_from([0.0, MIN_TEMPERATURE, 0.7, 1.0, MAX_TEMPERATURE])
TOP_P = st.sampled_from([1e-300, 1e-45, MIN_TOP_P, 0.5, 0.999, 1.0])
UNIFORM = st.floats(0.0, 1.0, exclude_max=True, width=32)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[list[float]], list[float], list[float], list[float]]:
    vocab = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 4))
    logits = [draw(st.lists(LOGIT, min_size=vocab, max_size=vocab)) for _ in range(rows)]
    return (logits, [draw(TEMPERATURE) for _ in range(rows)], [draw(TOP_P) for _ in range(rows)],
            [draw(UNIFORM) for _ in range(rows)])


@settings(max_examples=400, derandomize=True, deadline=None)
@given(batch=batches(), nucleus=st.booleans())
def test_sampling_never_fails_whatever_the_logits(
    batch: tuple[list[list[float]], list[float], list[float], list[float]], nucleus: bool
) -> None:
    # top_p below float32's range stands for a range check that was bypassed: sampling stays safe anyway.
    logits, temperature, top_p, uniform = batch
    tokens = sample_rows(torch.tensor(logits), torch.tensor(temperature), torch.tensor(top_p), torch.tensor(uniform),
                         nucleus=nucleus)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(logits),)
    for row, token in zip(logits, tokens.tolist(), strict=True):
        assert 0 <= token < len(row)
        finite = [x for x in row if not math.isnan(x)]
        if math.inf in finite:
            assert row[token] == math.inf  # an infinite logit is the certain token
        elif any(x > -math.inf for x in finite):
            assert not math.isnan(row[token]) and row[token] > -math.inf  # a NaN or -inf logit never wins
