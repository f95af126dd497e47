"""What the out-of-step handshake costs: one ``collective_guard.agree`` (a 6-integer all-reduce on the side gloo
group) per call, next to a 64 KiB gloo all_gather on the model's group for scale.

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

from lightning_vitscale.distributed import collective_guard


def per_call_us(call, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


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
    if dist.get_rank() == 0:
        print(f"handshake: {statistics.median(guard):.0f} us/call (min {min(guard):.0f}, max {max(guard):.0f});"
              f" 64 KiB all_gather: {statistics.median(gather):.0f} us/call"
              f" (min {min(gather):.0f}, max {max(gather):.0f}); {dist.get_world_size()} ranks, {args.repeats} loops")
    collective_guard.close_side_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
