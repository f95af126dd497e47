"""The common `main()` of rank scripts: run the named scenarios, write this rank's results as JSON."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch


def run_scenarios(scenarios: dict[str, Callable[[], dict]]) -> None:
    """``script.py OUT_DIR name1,name2``: one thread per rank (2-core CI), results in OUT_DIR/rank<R>.json."""
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    results = {name: scenarios[name]() for name in names}
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(results))


def rank_zero_alone(call: Callable[[], Any], timeout: float = 3.0) -> dict:
    """Only rank 0 makes ``call`` (a collective under the test), with ``timeout`` on the process group; the other
    ranks join nothing for longer than that. Returns rank 0's error text (``None``: it returned) and seconds."""
    import torch.distributed as dist

    from lightning_vitscale.distributed.collective_guard import side_group

    set_timeout(timeout, dist.group.WORLD)
    set_timeout(timeout, side_group())  # where the call's handshake waits for the other ranks
    if dist.get_rank() != 0:
        time.sleep(timeout + 6)  # joins no collective: rank 0's call can only time out
        return {}
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what the scenario records
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def set_timeout(seconds: float, group) -> None:
    """Change the timeout of an existing process group (``None``: nothing to change)."""
    import torch.distributed as dist

    if group is not None:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
