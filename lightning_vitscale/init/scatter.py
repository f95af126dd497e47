"""Values into the shards ``fully_shard`` made: storage for meta tensors, and rank 0's values scattered unit by unit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_vitscale._utils import local_tensor


def materialize_meta(module: nn.Module, device: torch.device, recurse: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Give ``module``'s meta parameters and buffers (uninitialised) storage on ``device``; returns them by name.

    A sharded DTensor gets its local shard only. Parameters are swapped in place, so objects that FSDP, the fp32
    norms or an optimizer already hold stay valid; FSDP re-pads the new shards at its lazy init.
    """
    made = []
    modules = module.named_modules() if recurse else [("", module)]
    for prefix, owner in modules:
        for name, param in list(owner._parameters.items()):
            if param is not None and param.is_meta:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, new)
                made.append((f"{prefix}.{name}" if prefix else name, param))
        for name, buffer in list(owner._buffers.items()):
            if buffer is not None and buffer.is_meta:
                owner._buffers[name] = torch.empty_like(buffer, device=device)
                made.append((f"{prefix}.{name}" if prefix else name, owner._buffers[name]))
    return made


@torch.no_grad()
def scatter_from(full: torch.Tensor | None, target: torch.Tensor, mesh: DeviceMesh) -> None:
    """Fill ``target`` (a DTensor shard, or a whole tensor) with its part of the mesh's first rank's ``full``.

    A dim-0 sharded DTensor on a 1-D mesh receives exactly its chunk (``dist.scatter``: each rank gets 1/N of
    the bytes). Other layouts (replicated norms, plain buffers, a 2-D mesh) receive the whole tensor and keep
    their part of it. ``full`` is read on the source rank only (pass ``None`` elsewhere).
    """
    if mesh.size() == 1:
        return
    src = int(mesh.mesh.flatten()[0])
    # A 1-D mesh may be one data-parallel slice of a larger mesh (tensor parallelism): its own group, not the world.
    group = mesh.get_group() if mesh.ndim == 1 else None
    is_src = dist.get_rank() == src
    local = local_tensor(target)
    if isinstance(target, DTensor) and target.placements == (Shard(0),) and mesh.ndim == 1 and target.dim():
        _scatter_rows(full, target, local, mesh.get_group(), src)
        return
    if is_src:
        assert full is not None
        whole = full.detach().to(local.device, local.dtype).contiguous()
    elif isinstance(target, DTensor):
        whole = torch.empty(target.shape, dtype=local.dtype, device=local.device)
    else:
        whole = local
    dist.broadcast(whole, src=src, group=group)
    if isinstance(target, DTensor):
        whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
    if whole is not local:
        local.copy_(whole)


def _scatter_rows(full: torch.Tensor | None, target: DTensor, local: torch.Tensor, group, src: int) -> None:  # type: ignore[no-untyped-def]
    """FSDP2's dim-0 chunks (``torch.chunk`` sizes, padded to equal rows) scattered from ``src``."""
    world = dist.get_world_size(group)
    rows = -(-target.shape[0] // world)
    if local.shape[0] == rows and local.is_contiguous():
        received = local  # straight into the shard: a buffer per tensor piles up while gloo still holds the last
    else:
        received = torch.empty((rows, *target.shape[1:]), dtype=local.dtype, device=local.device)
    chunks = None
    if dist.get_rank() == src:
        assert full is not None
        pieces = list(full.detach().chunk(world))
        chunks = [_padded(pieces[i] if i < len(pieces) else None, received) for i in range(world)]
    dist.scatter(received, chunks, src=src, group=group)
    if received is not local:
        local.copy_(received[: local.shape[0]])


def _padded(piece: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A chunk as ``scatter`` wants it: contiguous, on the target device, of the padded shard size."""
    if piece is not None and piece.shape == like.shape:
        return piece.to(like.device, like.dtype).contiguous()
    padded = torch.zeros_like(like)
    if piece is not None:
        padded[: piece.shape[0]].copy_(piece)
    return padded
