"""What an optimizer step costs the host on FSDP2's DTensor parameters against their local shards.

Usage::

    python benchmarks/optimizer_step.py                       # 32 blocks of width 64 (ViT-H's 390 parameters)
    python benchmarks/optimizer_step.py --depth 12 --width 768 --json out.json

One process (gloo, world size 1; the placements, not the world, decide DTensor's dispatch work), a ViT-shaped
stack of blocks (each: two LayerNorms and four Linears with biases: 12 parameters), every block its own
``fully_shard`` unit. Both optimizers are built on the same parameters' copies and stepped interleaved round by
round: ``dtensor`` = torch's step on the DTensors, ``local`` = the same optimizer with
``kernels/local_step.py``'s step on each parameter's local shard (what ``VitScaleStrategy`` installs at setup).
A narrow width keeps the arithmetic small, so the times are the host's dispatch: the part a GPU step waits for when
the host is behind. Median over ``--rounds`` rounds of ``--steps`` steps each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from lightning_vitscale.kernels.local_step import step_on_local_shards  # noqa: E402

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW (foreach)": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.05, foreach=True),
    "SGD momentum (foreach)": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True),
}


def block(width: int) -> nn.Module:
    """A ViT block's parameters in ``nn.Sequential`` (``fully_shard`` needs a module with a forward)."""
    return nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(3 * width, width),
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width),
    )


def sharded_model(depth: int, width: int, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(block(width) for _ in range(depth)))
    for unit in model:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for param in model.parameters():
        param.grad = torch.distributed.tensor.DTensor.from_local(
            torch.randn_like(param._local_tensor), mesh, param.placements, run_check=False
        )
    return model


def time_steps(optimizer: torch.optim.Optimizer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    rows = {}
    for name, make in OPTIMIZERS.items():
        plain, local = make(sharded_model(args.depth, args.width, mesh).parameters()), None
        local = make(sharded_model(args.depth, args.width, mesh).parameters())
        step_on_local_shards([local])
        for optimizer in (plain, local):
            time_steps(optimizer, 3)  # state created, sharding rules cached
        times: dict[str, list[float]] = {"dtensor": [], "local": []}
        for _ in range(args.rounds):
            times["dtensor"].append(time_steps(plain, args.steps))
            times["local"].append(time_steps(local, args.steps))
        medians = {kind: statistics.median(values) for kind, values in times.items()}
        rows[name] = {**medians, "ratio": medians["dtensor"] / medians["local"]}
        params = sum(1 for group in plain.param_groups for _ in group["params"])
        print(f"{name}: {params} parameters, DTensor step {medians['dtensor']:.2f} ms, local shards"
              f" {medians['local']:.2f} ms ({rows[name]['ratio']:.2f}x)", flush=True)
    if args.json:
        versions = {"torch": torch.__version__}
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "versions": versions}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
