"""gloo's reduce-scatter against the all-to-all one CPU ranks use (``sharding/cpu_overlap.py``), per buffer size.

Usage::

    python benchmarks/gloo_reduce_scatter.py                 # 2 ranks, 1 / 4 / 8 MiB fp32 buffers
    python benchmarks/gloo_reduce_scatter.py --mib 2 16 --calls 80

gloo's ``reduce_scatter_tensor`` clones its input, all-reduces the clone and keeps this rank's chunk: an
all-reduce's bytes. ``reduce_scatter_on_gloo`` sends each rank its chunk by all-to-all and sums what it received.
One launch (torch's elastic launcher, gloo, one thread per rank); each collective called ``--calls`` times after 3
warm-up calls, a barrier before each timing; ms per call, slowest rank. The all-reduce and all-gather of the same
buffer are there for scale (FSDP2's other collective; DDP's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def time_calls(fn: Callable[[], object], calls: int) -> float:
    import torch.distributed as dist

    for _ in range(3):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def collectives(full, shard, group, reduce_scatter_on_gloo) -> dict[str, Callable[[], object]]:
    """Each row's call on the unsharded buffer ``full`` and this rank's ``shard`` of it."""
    import torch.distributed as dist

    return {
        "gloo reduce-scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all-to-all + sum": lambda: reduce_scatter_on_gloo(shard, full, dist.ReduceOp.SUM, group).wait(),
        "all-reduce": lambda: dist.all_reduce(full),
        "all-gather": lambda: dist.all_gather_into_tensor(full, shard),
    }


def worker(out: str, mibs: list[float], calls: int) -> None:
    import torch
    import torch.distributed as dist

    from lightning_vitscale.sharding.cpu_overlap import reduce_scatter_on_gloo

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, group = dist.get_world_size(), dist.group.WORLD
    results: dict[str, dict[str, float]] = {}
    for mib in mibs:
        numel = int(mib * 2**20 / 4) // world * world
        rows = collectives(torch.randn(numel), torch.empty(numel // world), group, reduce_scatter_on_gloo)
        results[f"{mib:g} MiB"] = {name: time_calls(fn, calls) for name, fn in rows.items()}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, nargs="+", default=[1, 4, 8], help="buffer sizes (fp32, MiB)")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--json", help="also write the merged numbers here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mib, args.calls)
        return
    from tests.helpers.launch import assert_ok, torchrun

    with tempfile.TemporaryDirectory() as out:
        assert_ok(torchrun(Path(__file__), "--worker", out, "--mib", *map(str, args.mib), "--calls", str(args.calls),
                           nprocs=2, timeout=600))
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    merged = {size: {name: max(r[size][name] for r in ranks) for name in ranks[0][size]} for size in ranks[0]}
    names = list(next(iter(merged.values())))
    print("| buffer | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for size, per in merged.items():
        print(f"| {size} | " + " | ".join(f"{per[n]:.2f}" for n in names) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    main()
