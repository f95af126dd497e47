"""Step time on CPU ranks: DDP vs VitScaleStrategy's pipeline with the planner's choice (and the recipe defaults).

Usage::

    python benchmarks/planner_speed.py                 # 2 ranks, fp32, 6-block dim-256 ViT, batch 8, 64 tokens
    python benchmarks/planner_speed.py --steps 30

One launch (torch's elastic launcher, gloo, one thread per rank) builds every variant from the same seed and
times them interleaved, step by step: zero_grad -> forward -> backward -> AdamW step, median of ``--steps``
steps after ``--warmup``. Also times one all-gather and one reduce-scatter of one block's parameters, the
per-collective floor gloo sets for each FSDP unit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("ddp", "ac_on", "ac_off", "planner")


def build(variant: str):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_vitscale.cli.demo import TinyViT
    from lightning_vitscale.kernels.optimizers import prefer_foreach
    from lightning_vitscale.precision.settings import resolve_flag
    from lightning_vitscale.sharding import CheckpointingPolicy, ParallelConfig, ShardingPolicy
    from lightning_vitscale.sharding.outer_unit import OuterUnit
    from lightning_vitscale.sharding.parallelize import parallelize

    torch.manual_seed(0)
    model = TinyViT(image=32, patch=4, dim=256, depth=6)
    if variant == "ddp":
        root = DistributedDataParallel(model)
    else:
        root = OuterUnit(model)
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("data_parallel",))
        # The planner's choice under an ample budget: no checkpointing, blocks stay gathered for backward.
        reshard = False if variant == "planner" else None
        config = ParallelConfig(sharding=ShardingPolicy(reshard_after_forward=reshard),
                                checkpointing=CheckpointingPolicy(blocks=variant == "ac_on"))
        parallelize(root, model, mesh, config, resolve_flag("32-true"), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prefer_foreach([optimizer])
    return root, optimizer


def collective_ms(repeats: int = 20) -> dict[str, float]:
    """One block's parameters (789,760 fp32) all-gathered and reduce-scattered, as FSDP does per unit."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    shard = torch.randn(789_760 // world)
    full = torch.empty(shard.numel() * world)
    times: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": []}
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.all_gather_into_tensor(full, shard)
        times["all_gather"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        dist.reduce_scatter_tensor(shard, full)
        times["reduce_scatter"].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def worker(out: str, steps: int, warmup: int) -> None:
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    models = {v: build(v) for v in VARIANTS}
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(warmup + steps):
        for variant, (root, optimizer) in models.items():
            dist.barrier()
            t = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(root(x), y).backward()
            optimizer.step()
            elapsed = time.perf_counter() - t
            if step >= warmup:
                times[variant].append(elapsed)
    result = {v: 1e3 * statistics.median(t) for v, t in times.items()}
    result.update(collective_ms())
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup)
        return
    from tests.helpers.launch import assert_ok, torchrun

    with tempfile.TemporaryDirectory() as out:
        assert_ok(torchrun(Path(__file__), "--worker", out, "--steps", str(args.steps), "--warmup",
                           str(args.warmup), nprocs=args.ranks, timeout=600))
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    merged = {k: max(r[k] for r in ranks) for k in ranks[0]}
    print("| variant | median ms/step (slowest rank) | / DDP |")
    print("|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {merged[v]:.1f} | {merged[v] / merged['ddp']:.2f}x |")
    print(f"\none block's all-gather {merged['all_gather']:.2f} ms, reduce-scatter {merged['reduce_scatter']:.2f} ms")


if __name__ == "__main__":
    main()
