"""The encoders' batch tokenizer: bucketed lengths, and the same ids, masks and counts as transformers'
own tokenizer call."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kinfer.consumers.runners.registry import minilm_path
from kinfer.consumers.runners.tokenize import BatchTokenizer, bucket_for, length_buckets


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(minilm_path()))


def test_the_buckets_of_minilm() -> None:
    assert length_buckets(256) == (16, 32, 48, 64, 96, 144, 224, 256)
    assert length_buckets(16) == (16,) and length_buckets(5) == (5,) and length_buckets(20) == (16, 20)
    with pytest.raises(ValueError):
        length_buckets(0)


@given(st.integers(1, 8192))
def test_buckets_grow_by_half_at_most_and_end_at_the_truncation_length(max_length: int) -> None:
    buckets = length_buckets(max_length)
    assert buckets[-1] == max_length and list(buckets) == sorted(set(buckets))
    assert all(b % 16 == 0 for b in buckets[:-1])
    for small, large in itertools.pairwise(buckets):
        assert large <= max(small + 16, small * 1.5 + 16)  # padding is a bounded share of a row
    assert len(buckets) <= 4 + 2 * max_length.bit_length()  # a few shapes to warm, whatever the length


@given(st.integers(1, 2048), st.integers(1, 2048))
def test_a_length_goes_to_the_smallest_bucket_holding_it(max_length: int, length: int) -> None:
    buckets = length_buckets(max_length)
    length = min(length, max_length)  # the tokenizer truncates: no row is longer
    chosen = bucket_for(length, buckets)
    assert chosen >= length and chosen in buckets
    assert all(b < length for b in buckets if b < chosen)


texts = st.lists(st.text(min_size=0, max_size=300), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(texts, st.sampled_from([8, 32, 256]), st.booleans())
def test_the_same_ids_masks_and_counts_as_transformers(tokenizer: Any, batch: list[str], max_length: int,
                                                       bucketed: bool) -> None:
    encoder = BatchTokenizer(tokenizer, max_length, length_buckets(max_length) if bucketed else None)
    enc = encoder.encode(batch)
    want = tokenizer(batch, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    lengths = want["attention_mask"].sum(axis=1)
    assert enc.lengths.tolist() == lengths.tolist()
    width = want["input_ids"].shape[1]
    assert enc.input_ids.shape[1] == (bucket_for(width, encoder.buckets) if bucketed else width)
    for row, n in enumerate(lengths):
        assert enc.input_ids[row, :n].tolist() == want["input_ids"][row, :n].tolist()
        assert (enc.attention_mask[row, :n] == 1).all() and (enc.attention_mask[row, n:] == 0).all()
        assert (enc.input_ids[row, n:] == tokenizer.pad_token_id).all()
    assert set(enc.arrays(encoder.input_names)) == set(want)
    assert not enc.arrays(["token_type_ids"])["token_type_ids"].any()  # one segment a text


def test_padding_to_a_bucket_changes_no_embedding() -> None:
    """The model sees padding only through the mask: a batch padded to its bucket gives the vectors it
    gives padded to its longest text."""
    from kinfer.consumers.runners.embedding import EmbeddingRunner

    runner = EmbeddingRunner(minilm_path(), runtime="torch")
    runner.load()
    batch = ["short", "a somewhat longer sentence about consumer groups and partitions", "naïve café ✓ 東京"]
    exact = np.array(runner.run(batch))
    assert runner._encoder is not None and runner._encoder.buckets is None  # a CPU pads to the longest
    runner._encoder = BatchTokenizer(runner._tokenizer, runner.max_length, length_buckets(runner.max_length))
    bucketed = np.array(runner.run(batch))
    assert np.allclose(exact, bucketed, atol=1e-5)
    warm = runner._encoder.encode_ids(96, rows=2)
    assert warm.input_ids.shape == (2, 96) and warm.attention_mask.all()


def test_one_encoder_serves_every_executor_thread_at_once(tokenizer: Any) -> None:
    """Set once and never changed after, the Rust tokenizer takes calls from several threads together
    (transformers' own call sets padding on it each time: two threads at once raised "Already borrowed")."""
    from concurrent.futures import ThreadPoolExecutor

    encoder = BatchTokenizer(tokenizer, 64, length_buckets(64))
    batches = [[f"text {i} " * (1 + (i * j) % 40) for j in range(1 + i % 7)] for i in range(200)]
    alone = [encoder.encode(b).input_ids.tolist() for b in batches]
    with ThreadPoolExecutor(4) as pool:
        together = [e.input_ids.tolist() for e in pool.map(encoder.encode, batches)]
    assert together == alone
