"""Ports for engines: below the kernel's ephemeral range, so that no implicit bind on the host
can take one between the pick and the engine's own bind; free when picked."""

from __future__ import annotations

import random
import socket

import pytest

from elastickv import ports


def test_a_port_is_below_the_ephemeral_range_and_free() -> None:
    first, _ = ports.ephemeral_range()
    picked = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST_PORT <= port < first for port in picked), picked
    assert len(picked) > 1  # random: two pickers rarely meet
    for port in picked:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both ports below the ephemeral range, where no implicit bind of any process on the host
    # can take one meanwhile (an ephemeral port's neighbour may be anyone's connection).
    busy, spare = ports.free_port(), ports.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", busy))
        held.listen()
        assert spare != busy
        # Room below the range whatever this host's range is: the draws are scripted anyway.
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT + 1000, 65535))
        # Every random draw lands on the busy port first; the pick moves past it.
        draws = iter([busy, busy, spare])

        class Scripted(random.Random):
            def randrange(self, *args: object, **kwargs: object) -> int:
                return next(draws)

        port = ports.free_port(rng=Scripted())
    assert ports.is_free(busy) is True  # released now (it never had a connection)
    assert port == spare


def test_no_room_below_the_range_falls_back_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    assert ports.is_free(port)
    assert 1024 <= port <= 65535


def test_the_range_is_read_from_the_kernel() -> None:
    first, last = ports.ephemeral_range()
    expected = ports.EPHEMERAL_RANGE_FILE.read_text().split()
    assert (first, last) == (int(expected[0]), int(expected[1]))
