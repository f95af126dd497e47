"""Gradient-norm clipping across shards: one all-reduce, works for sharded DTensor, replicated and plain grads."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement

from lightning_vitscale._compat import dtensor_local
from lightning_vitscale.distributed.mesh import all_reduce_over, mesh_device


def _splits(placement: Placement) -> bool:
    """``Shard``, and also FSDP's strided shard of a tensor-parallel shard (whose ``is_shard()`` is False)."""
    return not placement.is_replicate() and not placement.is_partial()


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(_splits(p) for p in t.placements)


def _partial_norm(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """sum |g|^p (or max |g| for p=inf) over local tensors, in fp32, on ``device`` (no host sync per tensor)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=torch.float32).to(device) for t in tensors])
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients as if unsharded, identical on every rank (``clip_grad_norm_`` cannot mix plain
    tensors and DTensors): sharded parts summed over the mesh dimensions they are sharded along (not a hybrid
    mesh's replicas), replicated and plain ones once. One collective per sharded layout, no host sync."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    sharded = [cast(DTensor, g) for g in grads if _is_sharded(g)]
    device = mesh_device(sharded[0].device_mesh) if sharded else dtensor_local(grads[0]).device
    other = [dtensor_local(g) for g in grads if not _is_sharded(g)]
    shard_part = torch.zeros((), dtype=torch.float32, device=device)
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    layouts: dict[tuple, list[torch.Tensor]] = {}  # (mesh, the mesh dimensions sharded along) -> local parts
    for grad in sharded:
        dims = tuple(i for i, placement in enumerate(grad.placements) if _splits(placement))
        layouts.setdefault((grad.device_mesh, dims), []).append(dtensor_local(grad))
    for (mesh, dims), members in layouts.items():
        part = _partial_norm(members, norm_type, device)
        all_reduce_over(part, mesh, dims, op)
        shard_part = torch.maximum(shard_part, part) if math.isinf(norm_type) else shard_part + part
    other_part = _partial_norm(other, norm_type, device)
    if math.isinf(norm_type):
        return torch.maximum(shard_part, other_part)
    return (shard_part + other_part).pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in [dtensor_local(p.grad) for p in params if p.grad is not None]:
        local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total
