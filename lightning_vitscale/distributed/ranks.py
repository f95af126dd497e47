"""Where this process stands among the ranks: one value that sharding, the planner and checkpoints all take."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_vitscale.distributed.mesh import split_tensor_parallel


@dataclass(frozen=True)
class RankContext:
    """The mesh, this rank's device and place, and how the ranks agree (collectives; the defaults are one process
    alone). ``mesh``: ``None`` outside a sharded model (a checkpoint read by one process); ``ranks_per_node``
    divide the host's memory; ``agree_max``: free memory differs by rank, yet every rank must choose the same;
    ``tensor_mesh``: the tensor-parallel sub-mesh (``mesh`` is then the data-parallel one)."""

    mesh: DeviceMesh | None = None
    device: torch.device = torch.device("cpu")
    rank: int = 0
    ranks_per_node: int = 1
    agree_max: Callable[[int], int] = lambda value: value
    world_size: int = 1
    all_gather_objects: Callable[[Any], list[Any]] = lambda value: [value]
    broadcast: Callable[[Any], Any] = lambda value: value
    barrier: Callable[[], None] = lambda: None
    tensor_mesh: DeviceMesh | None = None

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def sharding_mesh(self) -> DeviceMesh:
        """The mesh, which a sharded model always has."""
        if self.mesh is None:
            raise RuntimeError("This needs the sharding mesh: call it after the strategy set up its process group.")
        return self.mesh


def all_gather_objects(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def largest_over_ranks(value: int, device: torch.device) -> int:
    tensor = torch.tensor(value, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def rank_context(strategy: Any) -> RankContext:
    """The rank context of a Lightning strategy whose process group and mesh are set up (reads, never writes)."""
    device = strategy.root_device
    mesh, tensor_mesh = split_tensor_parallel(strategy.device_mesh)
    return RankContext(
        mesh=mesh, tensor_mesh=tensor_mesh, device=device, rank=strategy.global_rank,
        ranks_per_node=strategy.num_processes,
        agree_max=partial(largest_over_ranks, device=device), world_size=strategy.world_size,
        all_gather_objects=all_gather_objects, broadcast=strategy.broadcast, barrier=strategy.barrier,
    )


def mean_over_ranks(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's ``values`` averaged, on every rank: a SUM, then divided (gloo has no AVG)."""
    total = values.detach().to(device).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / dist.get_world_size()


def reducing_whole(reduce: Callable[..., Any]) -> Callable[..., Any]:
    """``Strategy.reduce`` taking a DTensor whole first: ``self.log(name, p.grad.norm(), sync_dist=True)`` of a
    sharded gradient logs DDP's value (torch's ``all_reduce`` has no rule for a DTensor: "does not have a sharding
    strategy registered"). A ``Partial`` one (a norm's partial sums) is summed over its shards by ``full_tensor``."""

    @functools.wraps(reduce)
    def whole_then_reduce(strategy: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return reduce(strategy, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor, *args, **kwargs)

    return whole_then_reduce
