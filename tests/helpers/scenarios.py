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
    results = {}
    for name in names:
        start = time.monotonic()
        results[name] = scenarios[name]()
        # where a launch's time goes, in its output (shown when a test fails, or run the script by hand)
        print(f"scenario {name}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(results))


def under_each_strategy(
    compared: dict[str, Callable[[], dict]],
    script_globals: dict[str, Any],
    strategies: tuple[str, ...] = ("ddp", "vitscale"),
) -> dict[str, Callable[[], dict]]:
    """``<scenario>/<strategy>`` -> the scenario run with the script's ``STRATEGY`` global set to ``strategy`` (its
    ``trainer()`` reads it): one launch runs each scenario under DDP and VitScaleStrategy, one process group."""

    def under(strategy: str, scenario: Callable[[], dict]) -> Callable[[], dict]:
        def run() -> dict:
            script_globals["STRATEGY"] = strategy
            return scenario()

        return run

    return {f"{name}/{strategy}": under(strategy, scenario) for name, scenario in compared.items()
            for strategy in strategies}


def rank_zero_alone(call: Callable[[], Any], timeout: float = 3.0) -> dict:
    """Only rank 0 makes ``call`` (a collective under the test), with ``timeout`` on the process group; the other
    ranks join no collective until rank 0's call has returned or failed, which rank 0 says through a file in the
    scenario's output folder (they waited a fixed ``timeout + 6`` s before: ~6 s lost per use). Returns rank 0's
    error text (``None``: it returned) and seconds."""
    import torch.distributed as dist

    from lightning_vitscale.distributed import collective_guard

    set_timeout(timeout, dist.group.WORLD)
    set_timeout(timeout, collective_guard.side_group())
    collective_guard._Side.timeout_s = timeout  # where the call's handshake waits for the other ranks
    global _ALONE_CALLS
    _ALONE_CALLS += 1
    done = Path(sys.argv[1]) / f".rank0-alone-{_ALONE_CALLS}-done"
    if dist.get_rank() != 0:
        deadline = time.monotonic() + timeout + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what the scenario records
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    finally:
        done.touch()
    return {"error": None, "seconds": time.monotonic() - start}


_ALONE_CALLS = 0  # rank_zero_alone's calls so far in this process: each has its own signal file


def set_timeout(seconds: float, group) -> None:
    """Change the timeout of an existing process group (``None``: nothing to change)."""
    import torch.distributed as dist

    if group is not None:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
