"""Rank script: CPU ranks' asynchronous collectives against DDP, on the setup path the strategy runs.

``cpu_overlap.py OUT``: an ``EncoderClassifier`` (dropout off) sharded by ``parallelize`` with the default settings
(one block per unit, collectives asynchronous on CPU, prefetch 1) and, beside it, the same model under DDP.
Three optimizer steps, the third accumulating two micro-batches without clearing gradients in between (FSDP2
then adds each reduce-scatter's output to the existing gradient shard: the case that must wait at once).
Writes losses, gradient differences and what a backward hook of the first block saw in flight.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from lightning_vitscale._compat import fsdp_param_groups
from lightning_vitscale.precision.settings import resolve_flag
from lightning_vitscale.sharding import ParallelConfig
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from tests.helpers.models import EncoderClassifier


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ours = EncoderClassifier(dropout=0.0)
    reference = EncoderClassifier(dropout=0.0)
    reference.load_state_dict(ours.state_dict())
    ddp = DistributedDataParallel(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    root = OuterUnit(ours)
    done = parallelize(root, ours, mesh, ParallelConfig(), resolve_flag("32-true"), torch.device("cpu"))
    pending = fsdp_param_groups(root)[0]._reduce_scatter_comm.pending
    in_flight: list[int] = []
    ours.encoder.layers[0].register_full_backward_hook(lambda *_: in_flight.append(len(pending.works)))

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, reference)]
    g = torch.Generator().manual_seed(rank)
    losses: dict[str, list[float]] = {"ours": [], "ddp": []}
    grad_differences: list[float] = []
    for step in range(3):
        micro_batches = 2 if step == 2 else 1
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
            for name, model in (("ours", root), ("ddp", ddp)):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                losses[name].append(loss.item())
        left_in_flight = len(pending.works)
        grad_differences.append(max(
            (a.grad.full_tensor() - b.grad).abs().max().item() / (b.grad.abs().max().item() + 1e-12)
            for a, b in zip(ours.parameters(), reference.parameters())
        ))
        for optimizer in optimizers:
            optimizer.step()
    result = {"losses": losses, "grad_differences": grad_differences, "in_flight": in_flight,
              "left_in_flight": left_in_flight, "summary": done.plan.summary()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
