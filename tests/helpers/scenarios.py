"""The common `main()` of rank scripts: run the named scenarios, write this rank's results as JSON."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def run_scenarios(scenarios: dict[str, Callable[[], dict]]) -> None:
    """``script.py OUT_DIR name1,name2``: one thread per rank (2-core CI), results in OUT_DIR/rank<R>.json."""
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    results = {name: scenarios[name]() for name in names}
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(results))
