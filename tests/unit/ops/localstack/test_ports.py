"""Ports for processes the stack and the tests start: free, and out of reach of outgoing connections."""

from __future__ import annotations

import socket

import pytest

from kinfer.ops.localstack import stack
from kinfer.ops.localstack.stack import FIRST_PORT, ephemeral_ports, free_port


def test_a_free_port_is_bindable_and_below_the_range_outgoing_connections_draw_from() -> None:
    low, high = ephemeral_ports()
    assert FIRST_PORT < low <= high
    ports = {free_port() for _ in range(50)}
    assert all(FIRST_PORT <= p < low for p in ports)
    assert len(ports) > 40  # drawn at random, not one port over and over
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken, *range(FIRST_PORT, ephemeral_ports()[0])])  # the held port first, twice

        class Drawn:
            def randrange(self, start: int, stop: int) -> int:
                return next(draws)

        monkeypatch.setattr(stack.random, "SystemRandom", Drawn)
        assert free_port() != taken
