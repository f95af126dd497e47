"""Reading what rank scripts wrote, and comparing loss curves."""

from __future__ import annotations

import json
from pathlib import Path


def load_ranks(directory: Path, pattern: str = "rank*.json") -> list[dict]:
    files = sorted(directory.glob(pattern))
    assert files, f"no result files matching {pattern} in {directory}"
    return [json.loads(f.read_text()) for f in files]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, f"curves differ in length: {len(a)} vs {len(b)}"
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
