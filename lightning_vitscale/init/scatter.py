"""Values into the shards ``fully_shard`` made: storage for meta tensors, and rank 0's values scattered unit by unit."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_vitscale._compat import (
    buffer_slots,
    compute_local_shape_and_global_offset,
    dtensor_local,
    parameter_slots,
)
from lightning_vitscale._utils import shard_rows


def materialize_meta(
    module: nn.Module, device: torch.device, recurse: bool = True, only: set[str] | None = None
) -> None:
    """Give ``module``'s meta parameters and buffers (uninitialised) storage on ``device``; a DTensor its local shard
    only. Parameters are swapped in place, so objects that FSDP, the fp32 norms or an optimizer already hold stay
    valid; FSDP re-pads the new shards at its lazy init. ``only``: those attributes alone (of ``module``)."""
    for owner in module.modules() if recurse else [module]:
        for name, param in parameter_slots(owner).items():
            if param is not None and param.is_meta and (only is None or name in only):
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, new)
        buffers = buffer_slots(owner)
        for name, buffer in list(buffers.items()):
            if buffer is not None and buffer.is_meta and (only is None or name in only):
                buffers[name] = torch.empty_like(buffer, device=device)


@torch.no_grad()
def scatter_from(full: torch.Tensor | None, target: torch.Tensor, mesh: DeviceMesh) -> None:
    """Fill ``target`` with its part of the mesh's first rank's ``full`` (read there only): a dim-0 shard on a 1-D
    mesh receives only its rows, other layouts (replicated norms, buffers, a 2-D mesh) the whole tensor."""
    if mesh.size() == 1:
        return
    src = int(mesh.mesh.flatten()[0])
    # A 1-D mesh may be one data-parallel slice of a larger mesh (tensor parallelism): its own group, not the world.
    group = mesh.get_group() if mesh.ndim == 1 else None
    if isinstance(target, DTensor) and target.placements == (Shard(0),) and mesh.ndim == 1 and target.dim():
        scatter_boxes(full, target, _row_boxes(target.shape, mesh.size()), src, group)
        return
    local = dtensor_local(target)
    if dist.get_rank() == src:
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


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A rank's piece of a full tensor: (local shape, offset of its first element in each dimension)."""


def local_box(target: torch.Tensor) -> Box:
    """Where this rank's part of ``target`` lies in the full tensor: one box on any mesh and placements, since FSDP
    shards the tensor-parallel chunk, and ``compute_local_shape_and_global_offset`` follows that order."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return tuple(shape), tuple(offset)
    return tuple(target.shape), (0,) * target.dim()


def _row_boxes(shape: torch.Size, ranks: int) -> list[Box]:
    """FSDP2's dim-0 shards (``torch.chunk`` sizes) by group rank, as boxes."""
    rows = shard_rows(shape[0], ranks)
    starts = [min(rank * rows, shape[0]) for rank in range(ranks)]
    return [((min(rows, shape[0] - start), *shape[1:]), (start, *[0] * (len(shape) - 1))) for start in starts]


def gather_boxes(targets: list[torch.Tensor]) -> list[list[Box]]:
    """Every rank's box of each of ``targets``, ``[rank][target]``, in one collective per unit: a box depends on
    the rank's own mesh, which the source rank cannot see."""
    mine = [local_box(t) for t in targets]
    everyone: list[list[Box]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return everyone


@torch.no_grad()
def scatter_boxes(
    full: torch.Tensor | None, target: torch.Tensor, boxes: list[Box], src: int = 0, group: Any = None
) -> None:
    """Fill ``target``'s local part with its box (``boxes``: every rank's of ``group``) of global rank ``src``'s
    ``full`` (read there only), each rank receiving its piece only."""
    local = dtensor_local(target)
    shape, _ = boxes[dist.get_rank(group)]
    if tuple(local.shape) != shape:
        raise RuntimeError(f"a shard of shape {tuple(local.shape)} was told its box has shape {shape}")
    numel = max(max(math.prod(s) for s, _ in boxes), 1)
    if local.numel() == numel and local.is_contiguous():
        received = local.view(-1)  # straight into the shard: no buffer per tensor left as a hole in the heap
    else:
        received = torch.empty(numel, dtype=local.dtype, device=local.device)
    chunks = None
    if dist.get_rank() == src:
        assert full is not None
        source = full.detach().to(local.device, local.dtype)
        chunks = [_flat_padded(source[tuple(slice(o, o + n) for n, o in zip(*box))], numel) for box in boxes]
    dist.scatter(received, chunks, src=src, group=group)
    if received.data_ptr() != local.data_ptr():
        local.copy_(received[: local.numel()].view(local.shape))


def _flat_padded(piece: torch.Tensor, numel: int) -> torch.Tensor:
    flat = piece.reshape(-1)
    if flat.numel() == numel:
        return flat.contiguous()
    padded = torch.zeros(numel, dtype=piece.dtype, device=piece.device)
    padded[: flat.numel()].copy_(flat)
    return padded
