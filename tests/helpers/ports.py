"""Rendezvous ports for the test and benchmark jobs, chosen so that nothing else takes one before the job listens.

A port from ``bind(0)`` lies in the kernel's ephemeral range, which every outgoing connection draws from too:
between choosing it and the job's TCPStore listening on it, another job's gloo or store connection can take it as
its source port (once in CI: ``EADDRINUSE`` on a world-size-1 launch running beside three others). So a port comes
from below that range, where the kernel never hands one out by itself, and is reserved machine-wide with a marker
file, so two concurrent pytest workers or benchmark launches never pick the same one."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

RESERVATIONS = Path(tempfile.gettempdir()) / "lightning-vitscale-ports"
HELD_FOR_S = 3 * 3600  # longer than a whole CI run (the pytest session's own port included): free again after
_SPAN = 20000  # ports tried below the ephemeral range
_DYNAMIC_LOW = 49152  # IANA's dynamic range (macOS, Windows) where /proc says nothing


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DYNAMIC_LOW


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _forget_stale(now: float) -> None:
    """Markers older than any run: only their own jobs could have held them, and those ended long ago."""
    for marker in RESERVATIONS.iterdir():
        try:
            if now - marker.stat().st_mtime > HELD_FOR_S:
                marker.unlink()
        except FileNotFoundError:
            pass


def _reserve(port: int) -> bool:
    try:
        os.close(os.open(RESERVATIONS / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def free_port() -> int:
    """A port that is free now, outside the ephemeral range, and reserved for this caller for ``HELD_FOR_S``."""
    RESERVATIONS.mkdir(exist_ok=True)
    _forget_stale(time.time())
    high = ephemeral_low()
    low = max(1024, high - _SPAN)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high) if high - low >= 1000 else _kernel_choice()
        if _reserve(port) and _bindable(port):
            return port
    raise RuntimeError(
        f"no free port found below {high} in 200 tries; remove {RESERVATIONS} if old runs left many markers there"
    )


def _kernel_choice() -> int:
    """Where the ephemeral range starts too low to leave room below it: the kernel's choice, reserved all the same."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
