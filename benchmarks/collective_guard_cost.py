"""What the out-of-step handshake costs: one ``collective_guard.agree`` (a few adds and reads on the process
group's store, ``distributed/handshake.py``; a 6-integer all-reduce on a side gloo group before 2026-12-07) per
call, next to a 64 KiB gloo all_gather on the model's group for scale; and what a scalar read of a sharded tensor
costs (``float(w.norm())`` of a ``Shard(0)`` DTensor: ``distributed/scalar_reads.py``'s handshake and reduction)
next to torch's own read (this rank's part, no communication) and the manual ``.full_tensor().item()``.

Run: ``python -m torch.distributed.run --nproc-per-node 2 benchmarks/collective_guard_cost.py`` (CPU, gloo).
Rank 0 prints microseconds per call, median of ``--repeats`` timed loops.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_vitscale._compat import dtensor_op_handlers
from lightning_vitscale.distributed import collective_guard
from lightning_vitscale.distributed.scalar_reads import read_whole_scalars


def per_call_us(call, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def scalar_reads(calls: int, repeats: int) -> dict[str, list[float]]:
    """Per-call times of three ways to read a sharded weight's norm, interleaved loop by loop."""
    weight = distribute_tensor(torch.randn(256, 256), init_device_mesh("cpu", (dist.get_world_size(),)), [Shard(0)])
    handlers = dtensor_op_handlers()
    read = torch.ops.aten._local_scalar_dense.default

    def torch_own() -> None:  # this rank's part of the Partial norm: no communication (and not DDP's number)
        handlers.pop(read, None)
        float(weight.norm())
        read_whole_scalars()

    ways = {"torch's own (local part)": torch_own, "whole (handshake + reduction)": lambda: float(weight.norm()),
            "manual full_tensor().item()": lambda: weight.norm().full_tensor().item()}
    read_whole_scalars()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            times[name].append(per_call_us(way, calls))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    collective_guard.open_side_group(timedelta(seconds=60))
    x = torch.zeros(16384)  # 64 KiB of fp32
    outs = [torch.empty_like(x) for _ in range(dist.get_world_size())]

    def handshake() -> None:
        collective_guard.agree(collective_guard.MODEL_CALL, 0, 1)

    def all_gather() -> None:
        dist.all_gather(outs, x)

    handshake(), all_gather()  # connections made before timing
    guard = [per_call_us(handshake, args.calls) for _ in range(args.repeats)]
    gather = [per_call_us(all_gather, args.calls // 5) for _ in range(args.repeats)]
    reads = scalar_reads(args.calls // 5, args.repeats)
    if dist.get_rank() == 0:
        print(f"handshake: {statistics.median(guard):.0f} us/call (min {min(guard):.0f}, max {max(guard):.0f});"
              f" 64 KiB all_gather: {statistics.median(gather):.0f} us/call"
              f" (min {min(gather):.0f}, max {max(gather):.0f}); {dist.get_world_size()} ranks, {args.repeats} loops")
        shown = [f"{name} {statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f})" for name, t in reads.items()]
        print("scalar read float(w.norm()) of a 256x256 Shard(0) DTensor, us/call (median, min-max):", "; ".join(shown))
    collective_guard.close_side_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
