"""A step function over static buffers, run once per call: captured as a CUDA graph on a GPU, called as it
is elsewhere.

A decode step issues hundreds of kernel launches (555 for a 16-layer Llama), each a few microseconds of
Python and driver time, while the GPU's own work for a small batch is a millisecond or two: launched one by
one, the step is launch-bound. Captured once per batch size and replayed, the whole step is one launch.

The step function reads its inputs from, and writes its outputs to, tensors that live as long as the
engine (a replay reads and writes the same addresses); it takes the shape it runs at (rows, columns) and
returns nothing. Each shape gets its own graph.
``EagerSteps`` is the stand-in where there is no GPU: the same function, the same buffers, called each
time, so the CPU exercises exactly the code a graph captures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["CudaGraphSteps", "EagerSteps", "StepGraphs", "step_graphs"]

log = logging.getLogger(__name__)

StepFn = Callable[[int, int], None]


class StepGraphs(Protocol):
    captured: int  # graphs captured so far (0 for the stand-in)

    def run(self, rows: int, columns: int) -> None:
        """One step over the first ``rows`` rows and ``columns`` columns of the static buffers."""


class EagerSteps:
    """The stand-in: calls the step function."""

    captured = 0

    def __init__(self, fn: StepFn) -> None:
        self._fn = fn

    def run(self, rows: int, columns: int) -> None:
        self._fn(rows, columns)


class CudaGraphSteps:
    """One CUDA graph per shape, captured at its first run (the engine runs every shape at warm-up).

    The graphs share one memory pool, as vLLM's do: they replay one at a time on one stream, and each
    copies what it produces into the engine's own buffers, so what one leaves in the pool is dead before
    the next starts. A capture that fails (a model whose forward synchronises with the host) is logged
    and the step runs eagerly from then on: slower, never wrong.
    """

    def __init__(self, fn: StepFn, device: str, warmups: int = 3) -> None:
        self._fn = fn
        self._device = torch.device(device)
        self._warmups = warmups
        self._graphs: dict[tuple[int, int], Any] = {}
        self._pool: Any = None
        self._eager = False
        self.captured = 0

    def run(self, rows: int, columns: int) -> None:
        if self._eager:
            self._fn(rows, columns)
            return
        graph = self._graphs.get((rows, columns))
        if graph is None:
            try:
                graph = self._capture(rows, columns)
            except Exception:  # anything the capture refuses: run eagerly instead
                log.exception("capturing the decode step as a CUDA graph failed: it runs eagerly from now on")
                self._eager = True
                self._graphs.clear()
                self._fn(rows, columns)
                return
        graph.replay()

    def _capture(self, rows: int, columns: int) -> Any:
        # Warm-up runs on a side stream first (lazy initialisation, autotuning), as torch's docs ask.
        cuda: Any = torch.cuda  # typed differently from one torch release to the next
        side = cuda.Stream(self._device)
        side.wait_stream(cuda.current_stream(self._device))
        with cuda.stream(side):
            for _ in range(self._warmups):
                self._fn(rows, columns)
        cuda.current_stream(self._device).wait_stream(side)
        if self._pool is None:
            self._pool = cuda.graph_pool_handle()
        graph = cuda.CUDAGraph()
        with cuda.graph(graph, pool=self._pool):
            self._fn(rows, columns)
        self._graphs[rows, columns] = graph
        self.captured += 1
        return graph


def step_graphs(fn: StepFn, device: str, capture: bool = True) -> StepGraphs:
    """Graphs on a CUDA device (unless ``capture`` is off), the stand-in elsewhere."""
    if capture and device.startswith("cuda"):
        return CudaGraphSteps(fn, device)
    return EagerSteps(fn)
