"""Texts for benchmarks and tests: words of the domain, in lengths spread over a range (no I/O, no client:
the in-process benchmarks import it without the transport)."""

from __future__ import annotations

import random

_WORDS = """
kafka broker partition offset consumer group batch window latency deadline priority tenant embedding
vector model worker replica throughput queue backpressure signal redis channel reply token padding
sequence attention layer tensor device memory bandwidth compute schedule request result stream chunk
commit rebalance heartbeat timeout retry shed expire admission quota health
""".split()


def make_texts(n: int, min_words: int = 5, max_words: int = 120, seed: int = 7) -> list[str]:
    """``n`` texts with word counts spread uniformly in [min_words, max_words]."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(min_words, max_words))) for _ in range(n)]
