"""The device mesh for a sharding layout, and the collectives that work on a 1-D or a 2-D mesh alike.

``("data_parallel",)`` shards over every rank; ``("replicate", "shard")`` over each group of ``shard_size``
consecutive ranks, replicated across groups (HSDP); tensor parallelism splits the last dimension into a last
``"tensor_parallel"`` one of consecutive ranks (inside a node). Lightning numbers ranks ``node_rank *
ranks_per_node + local_rank``, so with ``shard_size = ranks_per_node`` a shard group is one node: only the replicate
dimension's all-reduce crosses nodes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate


def build_mesh(device_type: str, world_size: int, shard_size: int, tensor_parallel: int = 1) -> DeviceMesh:
    """The mesh of the layout (module docstring) ``shard_size`` and ``tensor_parallel`` ask for."""
    if tensor_parallel > 1:
        if world_size % tensor_parallel:
            raise ValueError(
                f"`tensor_parallel={tensor_parallel}` does not divide the world size {world_size}. Choose one of"
                f" {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
            )
        if shard_size % tensor_parallel:
            raise ValueError(
                f"`tensor_parallel={tensor_parallel}` does not divide the shard group of {shard_size} ranks (the"
                " `sharding=` layout's ranks sharing one copy of the state, tensor-parallel ranks included). Choose a"
                f" shard group that is a multiple of {tensor_parallel}, or tensor_parallel among"
                f" {[d for d in range(1, shard_size + 1) if shard_size % d == 0]}."
            )
    hybrid = shard_size != world_size
    dims = {"replicate": world_size // shard_size} if hybrid else {}
    dims["shard" if hybrid else "data_parallel"] = shard_size // tensor_parallel
    if tensor_parallel > 1:
        dims["tensor_parallel"] = tensor_parallel
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def split_tensor_parallel(mesh: DeviceMesh | None) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(the mesh data parallelism shards over, the tensor-parallel sub-mesh or ``None``); under hybrid sharding
    the data-parallel mesh is the 2-D ``("replicate", "shard")`` one, as without tensor parallelism."""
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
        return mesh, None
    data = mesh["data_parallel"] if mesh.ndim == 2 else mesh["replicate", "shard"]
    return data, mesh["tensor_parallel"]


def data_parallel_ranks(mesh: DeviceMesh | None, world_size: int, global_rank: int) -> dict[str, int]:
    """The distributed sampler's ``num_replicas`` and ``rank``: data-parallel ranks only (a tensor-parallel group
    reads the same samples); every rank where there is no tensor parallelism."""
    data, tensor = split_tensor_parallel(mesh)
    if tensor is None or data is None:
        return {"num_replicas": world_size, "rank": global_rank}
    # This rank's place in its data-parallel slice, row-major: (replicate, shard) -> replicate * shard ranks + shard.
    return {"num_replicas": data.size(), "rank": data.mesh.flatten().tolist().index(global_rank)}


def shard_size(mesh: DeviceMesh) -> int:
    """Ranks that share one copy of the state (the last mesh dimension)."""
    return mesh.size(mesh.ndim - 1)


def replicated_placements(mesh: DeviceMesh) -> list[Replicate]:
    return [Replicate() for _ in range(mesh.ndim)]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device collectives on ``mesh`` run on (NCCL needs CUDA tensors even when the data was offloaded)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


@torch.no_grad()
def all_reduce_over(
    tensor: torch.Tensor, mesh: DeviceMesh, dims: list[int] | None = None, op: Any = dist.ReduceOp.SUM
) -> None:
    """All-reduce ``tensor`` in place over the given mesh dimensions (default: all), innermost first: on a hybrid
    mesh within the node before across nodes. An offloaded tensor travels through the mesh's device."""
    device = mesh_device(mesh)
    work = tensor if tensor.device == device else tensor.to(device)
    for dim in reversed(range(mesh.ndim) if dims is None else sorted(dims)):
        if mesh.size(dim) > 1:
            dist.all_reduce(work, op=op, group=mesh.get_group(dim))
    if work is not tensor:
        tensor.copy_(work)


def broadcast_from_rank_zero(tensors: list[torch.Tensor]) -> None:
    """Global rank 0's values into ``tensors`` on every rank, one broadcast per dtype and device (DDP's buffer sync)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for group in groups.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.broadcast(flat, src=0)
            if dist.get_rank() != 0:
                for tensor, chunk in zip(group, flat.split([t.numel() for t in group])):
                    tensor.copy_(chunk.view_as(tensor))
