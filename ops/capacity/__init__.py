"""Capacity planning, no I/O: ``roofline`` (``kinfer plan``: FLOPs, bytes and VRAM to GPUs),
``placement`` (``kinfer place``: models onto pools and nodes) and ``simulate`` (``kinfer simulate``:
a fleet under a load trace, with the real batcher and admission)."""
