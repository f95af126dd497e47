"""The rendezvous ports the launch helpers hand out: never from the ephemeral range, never twice at once."""

from __future__ import annotations

import random
import socket

import pytest

from tests.helpers import ports


@pytest.fixture
def reservations(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "RESERVATIONS", tmp_path / "ports")
    return tmp_path / "ports"


def test_a_port_lies_below_the_ephemeral_range_and_is_free(reservations):
    """Outgoing connections take their source ports from the ephemeral range: a port chosen there can be taken by
    another job's gloo connection before the job listens on it (CI: EADDRINUSE)."""
    for _ in range(20):
        port = ports.free_port()
        assert 1024 <= port < ports.ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free now
        assert (reservations / str(port)).exists()


def test_a_reserved_port_is_not_handed_out_again(reservations, monkeypatch):
    """Two launches at once (four in test_lifecycle, two pytest workers) draw the same port only if a reservation
    does not hold: here the draw is rigged to repeat."""
    draws = iter([23456, 23456, 23457])
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, low, high: next(draws))
    assert [ports.free_port(), ports.free_port()] == [23456, 23457]


def test_a_port_something_listens_on_is_skipped(reservations, monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        draws = iter([taken, 23458])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, low, high: next(draws))
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65535)
        assert ports.free_port() == 23458


def test_stale_reservations_are_forgotten(reservations, monkeypatch):
    reservations.mkdir()
    (reservations / "23459").touch()
    draws = iter([23459, 23459])
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, low, high: next(draws))
    monkeypatch.setattr(ports, "HELD_FOR_S", -1.0)  # every marker is older than a job
    assert ports.free_port() == 23459
