"""The memory a step may use: ``memory_budget`` (bytes, or a fraction of the device's memory) and device memory named
or given in GiB, read the same way wherever a budget is resolved (the planner, setup, the CLI)."""

from __future__ import annotations

import re

from lightning_vitscale._utils import GIB, MIB
from lightning_vitscale.memory.devices import device_named, memory_names

DEFAULT_FRACTION = 0.9
"""The share of a device's memory a step may use when ``memory_budget`` is not given (headroom for the allocator)."""


def check_budget(budget: object, name: str = "memory_budget") -> None:
    """Raise unless ``budget`` is ``None``, bytes (an int >= 1) or a fraction of device memory (a float in (0, 1])."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"`{name}` must be an int (bytes) or a float fraction in (0, 1]; got {budget!r}.")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(
            f"`{name}={budget}` as a float is a fraction of device memory and must be in (0, 1];"
            " give bytes as an int, e.g. memory_budget=30 * 2**30."
        )
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"`{name}={budget}` bytes must be >= 1.")


def resolve_budget(budget: int | float | None, total: int, name: str = "memory_budget") -> int:
    """``memory_budget`` -> bytes: an int is bytes, a float (``None``: :data:`DEFAULT_FRACTION`) of ``total``."""
    check_budget(budget, name)
    if isinstance(budget, int) and not isinstance(budget, bool):
        return budget
    return int(total * (DEFAULT_FRACTION if budget is None else budget))


def parse_memory(spec: str | int | float) -> int:
    """``"a100-40gb"``, ``"40"`` / ``40`` (GiB), ``"40GiB"``, ``"512MiB"`` -> bytes."""
    if isinstance(spec, (int, float)):
        return int(spec * GIB)
    key = spec.strip().lower()
    if key in memory_names():
        return int(device_named(key).memory_bytes or 0)
    match = re.fullmatch(r"([0-9.]+)\s*(gib|gb|g|mib|mb|m)?", key)
    if match is None:
        raise ValueError(
            f"device memory {spec!r} is not understood: give GiB (e.g. 40 or '40GiB'), MiB ('512MiB') or one of"
            f" {', '.join(memory_names())}."
        )
    unit = match.group(2) or "gib"
    return int(float(match.group(1)) * (GIB if unit.startswith("g") else MIB))
