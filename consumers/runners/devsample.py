"""Picking the next token of every row at once, on the logits' device: one host copy per step.

A row is greedy (temperature 0: the argmax) or sampled: its logits are scaled by the temperature, turned
into probabilities, cut to the top-``top_p`` mass, and one token is drawn by inverse CDF with a uniform
number the row brings. The uniform comes from the row's own CPU generator (seeded from the request's seed,
else from its id), drawn once per sampled step: a row's tokens depend on its logits, its parameters and its
draws alone, never on which rows share its batch, so a redelivered request samples the same tokens.

Sampling is total: whatever the logits hold — NaN (no candidate), +inf (that token wins), nothing but
-inf (any token will do) — and however small ``top_p`` is (float32 underflow), every row gets a token id
within the vocabulary, and a finite candidate whenever one exists.

Rows with ``top_p`` below 1 walk the probabilities most likely first (the nucleus is a prefix of that
order). Rows with ``top_p`` = 1 need no order, so they walk the vocabulary in id order: the same
distribution without a sort, which costs more than the rest of sampling on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kinfer.consumers.runners.sampling import MIN_TEMPERATURE, Sampling

__all__ = ["SampledRow", "pick_tokens", "row_parameters", "sample_rows"]

SampledRow = tuple[Sampling, torch.Generator | None]  # a row's parameters and its generator (None: greedy)


def row_parameters(rows: Sequence[SampledRow], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """``temperature``, ``top_p`` and ``uniform`` [rows] float32 on ``device``, in one host-to-device copy.

    Each sampled row draws its uniform from its own generator; a greedy row (temperature 0 or no
    generator) draws nothing and gets temperature 0.
    """
    temperature, top_p, uniform = [], [], []
    for sampling, generator in rows:
        sampled = sampling.temperature != 0 and generator is not None
        temperature.append(float(sampling.temperature) if sampled else 0.0)
        top_p.append(float(sampling.top_p))
        uniform.append(float(torch.rand((), generator=generator)) if sampled else 0.0)
    values = torch.tensor([temperature, top_p, uniform], dtype=torch.float32).to(device)
    return tuple(values.unbind(0))


def pick_tokens(logits: torch.Tensor, rows: Sequence[SampledRow]) -> torch.Tensor:
    """The next token of every row [rows] int64 on the logits' device, nothing copied to the host.

    What the rows ask for is known on the host: a batch of greedy rows is one argmax, and the sort
    that nucleus sampling needs runs only when some row has ``top_p`` below 1.
    """
    if all(s.temperature == 0 or g is None for s, g in rows):
        return _finite(logits).max(-1).indices  # the first of equal maxima, as argmax
    temperature, top_p, uniform = row_parameters(rows, logits.device)
    nucleus = any(s.top_p < 1 and s.temperature != 0 and g is not None for s, g in rows)
    return sample_rows(logits, temperature, top_p, uniform, nucleus=nucleus)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor,
                *, nucleus: bool = True) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: [B] int64, on the same device.

    ``temperature`` [B]: 0 is greedy, else the logits are divided by it (at least ``MIN_TEMPERATURE``).
    ``top_p`` [B]: a sampled row keeps the most likely tokens whose mass before each is below it (always
    the most likely one). ``uniform`` [B] in [0, 1): the row's draw; it picks the first token whose
    cumulative kept probability exceeds ``uniform`` × the kept total. ``nucleus=False`` promises that no
    sampled row has ``top_p`` below 1 and skips the sort.

    Probabilities stay unnormalised (the top token weighs exp(0) = 1): the draw and ``top_p`` are scaled
    by the total instead, which saves a pass over the vocabulary.
    """
    logits = _finite(logits.float())
    top, best = logits.max(-1, keepdim=True)  # best: greedy's pick, and any row whose top is not finite
    finite = torch.isfinite(top)  # else +inf somewhere (that token wins) or nothing but -inf (any will do)
    scale = temperature.clamp(min=MIN_TEMPERATURE)[:, None]
    weights = torch.sub(logits, top).div_(scale).exp_()  # NaN in a row whose top is not finite:
    weights.masked_fill_(~finite, 1.0)  # such a row takes ``best``; its weights need only be numbers
    draw = uniform[:, None]

    # Vocabulary order, for rows that keep the whole distribution.
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:].contiguous()
    last = torch.searchsorted(cdf, total)  # the first id that reaches the total: it has mass
    sampled = torch.minimum(torch.searchsorted(cdf, draw * total, right=True), last)

    if nucleus:  # most likely first (ties in id order, on any device); the kept tokens are a prefix of it
        sorted_w, order = weights.sort(dim=-1, descending=True, stable=True)
        sorted_cdf = sorted_w.cumsum(-1)
        before = torch.nn.functional.pad(sorted_cdf[:, :-1], (1, 0))  # mass before each token
        kept = (before < top_p[:, None] * sorted_cdf[:, -1:]).sum(-1, keepdim=True).clamp(min=1)  # at least the top
        kept_total = sorted_cdf.gather(-1, kept - 1)
        rank = torch.minimum(torch.searchsorted(sorted_cdf, draw * kept_total, right=True), kept - 1)
        sampled = torch.where(top_p[:, None] < 1, order.gather(-1, rank), sampled)

    # A parallel cumsum may round a step without mass up by an ulp: such a pick falls back to the argmax.
    sampled = torch.where(weights.gather(-1, sampled) > 0, sampled, best)
    return torch.where((temperature[:, None] > 0) & finite, sampled, best).squeeze(-1)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN becomes -inf (no candidate); ±inf stay as they are."""
    return torch.nan_to_num(logits, nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
