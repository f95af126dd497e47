"""Rank script: CPU ranks' asynchronous collectives against DDP, on the setup path the strategy runs.

``cpu_overlap.py OUT``: an ``EncoderClassifier`` (dropout off) sharded by ``parallelize`` with the default settings
(one block per unit, collectives asynchronous on CPU, prefetch 1) and, beside it, the same model under DDP.
Three optimizer steps, the third accumulating two micro-batches without clearing gradients in between (FSDP2
then adds each reduce-scatter's output to the existing gradient shard: the case that must wait at once).
Writes losses, gradient differences, what a backward hook of the first block saw in flight, the collectives a step
called, and ``reduce_scatter_on_gloo`` against gloo's own reduce-scatter for each op and dtype.
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
from lightning_vitscale.sharding.cpu_overlap import reduce_scatter_on_gloo
from lightning_vitscale.sharding.outer_unit import OuterUnit
from lightning_vitscale.sharding.parallelize import parallelize
from tests.helpers.models import EncoderClassifier
from tests.helpers.recording import count_collectives


def against_gloos_reduce_scatter(rank: int, world: int) -> dict[str, float]:
    """Max absolute difference to ``reduce_scatter_tensor`` per op and dtype (inputs differ per rank)."""
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}  # max: gloo's own
    differences = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, op in ops.items():
            x = torch.randn(world * 1000, generator=torch.Generator().manual_seed(rank)).to(dtype)
            ours, theirs = torch.empty(1000, dtype=dtype), torch.empty(1000, dtype=dtype)
            reduce_scatter_on_gloo(ours, x, op, dist.group.WORLD).wait()
            dist.reduce_scatter_tensor(theirs, x, op=op)
            differences[f"{name}-{dtype}"] = (ours.float() - theirs.float()).abs().max().item()
    return differences


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
                with count_collectives() as counts:
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                if name == "ours":
                    collectives = dict(counts)
                losses[name].append(loss.item())
        left_in_flight = len(pending.works)
        grad_differences.append(max(
            (a.grad.full_tensor() - b.grad).abs().max().item() / (b.grad.abs().max().item() + 1e-12)
            for a, b in zip(ours.parameters(), reference.parameters())
        ))
        for optimizer in optimizers:
            optimizer.step()
    result = {"losses": losses, "grad_differences": grad_differences, "in_flight": in_flight,
              "left_in_flight": left_in_flight, "summary": done.plan.summary(), "collectives": collectives,
              "against_gloo": against_gloos_reduce_scatter(rank, dist.get_world_size())}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
