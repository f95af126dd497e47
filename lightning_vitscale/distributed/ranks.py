"""Where this process stands among the ranks: one value that sharding, the planner and checkpoints all take."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_vitscale.distributed.mesh import split_tensor_parallel


def _largest_alone(value: int) -> int:
    return value


def _gather_alone(value: Any) -> list[Any]:
    return [value]


def _broadcast_alone(value: Any) -> Any:
    return value


def _barrier_alone() -> None:
    return None


@dataclass(frozen=True)
class RankContext:
    """The mesh, this rank's device and place, and how the ranks agree. The defaults are one process alone.

    Args:
        mesh: the sharding mesh (``None`` outside a sharded model, e.g. a checkpoint read by one process).
        device: this rank's device.
        rank: this rank's global rank.
        ranks_per_node: how many ranks share this host (they divide its memory).
        agree_max: the largest of every rank's value, on every rank (a collective): free memory differs by rank,
            and every rank must still make the same choice.
        world_size: how many ranks there are.
        all_gather_objects: every rank's object, on every rank (a collective).
        broadcast: rank 0's object, on every rank (a collective).
        barrier: returns once every rank called it.
        tensor_mesh: the tensor-parallel sub-mesh (``tensor_parallel=k``; ``mesh`` is then the data-parallel one).
    """

    mesh: DeviceMesh | None = None
    device: torch.device = torch.device("cpu")
    rank: int = 0
    ranks_per_node: int = 1
    agree_max: Callable[[int], int] = _largest_alone
    world_size: int = 1
    all_gather_objects: Callable[[Any], list[Any]] = _gather_alone
    broadcast: Callable[[Any], Any] = _broadcast_alone
    barrier: Callable[[], None] = _barrier_alone
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
    """Every rank's ``value``, on every rank, over the default process group."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def largest_over_ranks(value: int, device: torch.device) -> int:
    """The largest of every rank's ``value``, on every rank (``RankContext.agree_max`` of a process group)."""
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
