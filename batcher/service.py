"""An online model of how long a batch takes: t ≈ a + b·padded_tokens + c·inputs.

Fitted by exponentially weighted recursive least squares, so it follows a device that warms up,
throttles or gets a co-located neighbour. Starts from a prior (a few ms plus a per-token cost) so
its first predictions are sane, and never predicts less than the smallest time it has seen.

Once it has seen ``settled`` batches, one observation counts for at most ``outlier`` times what it
predicted there. A batch that was in flight while its process stood still (SIGSTOP, a VM's steal, a
swap storm) measures the stall, not the model: fed whole, one 10 s batch among 25 ms ones tilts the
three-term fit until a single request predicts over half a second, every request with less time left
is refused as unable to make it, so no batch runs and nothing corrects the fit. Capped, the stall
moves the prediction by a few per cent; a device that really became slower is still followed, its
prediction rising by up to ``outlier`` times at each batch's weight.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServicePrior:
    fixed_s: float = 0.005  # per batch
    per_token_s: float = 0.00005  # per padded token
    per_input_s: float = 0.0  # per sequence
    strength: float = 5.0  # how many observations the prior is worth


class ServiceTimeModel:
    def __init__(self, prior: ServicePrior | None = None, forgetting: float = 0.98, recent: int = 64,
                 outlier: float = 4.0, settled: int = 16) -> None:
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be within (0.5, 1], got {forgetting}")
        if outlier <= 1.0 or settled < 0:
            raise ValueError(f"outlier must be > 1 and settled >= 0, got {outlier} and {settled}")
        p = prior or ServicePrior()
        self.forgetting = forgetting
        self.outlier = outlier
        self.settled = settled
        self.observations = 0
        self._recent_inputs: deque[int] = deque(maxlen=recent)  # batch sizes of the latest observations
        self._floor = 0.0
        # Normal equations of weighted least squares: A·w = r, A seeded as if the prior had been
        # observed ``strength`` times at typical points (1 input of 64 tokens; 16 inputs of 1024).
        self._a = [[0.0] * 3 for _ in range(3)]
        self._r = [0.0] * 3
        for tokens, inputs in ((64.0, 1.0), (1024.0, 16.0), (4096.0, 32.0)):
            y = p.fixed_s + p.per_token_s * tokens + p.per_input_s * inputs
            self._add((1.0, tokens, inputs), y, p.strength / 3.0)
        self._w = self._solve()

    def observe(self, padded_tokens: int, inputs: int, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        seen = seconds
        if self.observations >= self.settled:
            seconds = min(seconds, self.outlier * self.predict(padded_tokens, inputs))
        for i in range(3):
            self._r[i] *= self.forgetting
            for j in range(3):
                self._a[i][j] *= self.forgetting
        self._add((1.0, float(padded_tokens), float(inputs)), seconds, 1.0)
        self._w = self._solve()
        self.observations += 1
        self._recent_inputs.append(inputs)
        self._floor = seen if self.observations == 1 else min(self._floor, seen)

    def predict(self, padded_tokens: int, inputs: int) -> float:
        a, b, c = self._w
        guess = a + b * padded_tokens + c * inputs
        return max(guess, self._floor, 0.0)

    @property
    def largest_recent(self) -> int:
        """The largest batch (inputs) among the latest observations: beyond it, predictions extrapolate."""
        return max(self._recent_inputs, default=0)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(seconds per batch, per padded token, per input)."""
        return self._w[0], self._w[1], self._w[2]

    def _add(self, x: tuple[float, float, float], y: float, weight: float) -> None:
        for i in range(3):
            self._r[i] += weight * x[i] * y
            for j in range(3):
                self._a[i][j] += weight * x[i] * x[j]

    def _solve(self) -> tuple[float, float, float]:
        # A tiny ridge keeps the system solvable when every batch looked the same.
        m = [[self._a[i][j] + (1e-9 if i == j else 0.0) for j in range(3)] + [self._r[i]] for i in range(3)]
        for col in range(3):
            pivot = max(range(col, 3), key=lambda row: abs(m[row][col]))
            m[col], m[pivot] = m[pivot], m[col]
            if abs(m[col][col]) < 1e-18:
                return self._w if hasattr(self, "_w") else (0.0, 0.0, 0.0)
            for row in range(3):
                if row != col:
                    f = m[row][col] / m[col][col]
                    for k in range(col, 4):
                        m[row][k] -= f * m[col][k]
        return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]
