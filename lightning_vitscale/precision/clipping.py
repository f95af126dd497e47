"""Gradient norms across shards (clipping, Lightning's ``grad_norm``): one all-reduce per layout, works for sharded
DTensor, replicated and plain grads."""

from __future__ import annotations

import math
import traceback
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement

from lightning_vitscale._compat import dtensor_local
from lightning_vitscale.distributed.mesh import all_reduce_over, mesh_device


def _splits(placement: Placement) -> bool:
    """``Shard``, and also FSDP's strided shard of a tensor-parallel shard (whose ``is_shard()`` is False)."""
    return not placement.is_replicate() and not placement.is_partial()


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(_splits(p) for p in t.placements)


def _local_parts(grads: list[torch.Tensor], norm_type: float) -> tuple[torch.Tensor, dict[tuple, list[int]]]:
    """Each gradient's local sum |g|^p (max |g| for p=inf) in fp32 on one device (no host sync per tensor), and the
    sharded ones' indices by layout: (mesh, the mesh dimensions sharded along; not a hybrid mesh's replicas)."""
    sharded = [g for g in grads if _is_sharded(g)]
    device = mesh_device(cast(DTensor, sharded[0]).device_mesh) if sharded else dtensor_local(grads[0]).device
    parts = torch.stack([_local_norm(dtensor_local(g), norm_type).to(device) for g in grads])
    layouts: dict[tuple, list[int]] = {}
    for index, grad in enumerate(grads):
        if _is_sharded(grad):
            placements = cast(DTensor, grad).placements
            dims = tuple(i for i, placement in enumerate(placements) if _splits(placement))
            layouts.setdefault((cast(DTensor, grad).device_mesh, dims), []).append(index)
    return (parts if math.isinf(norm_type) else parts.pow(norm_type)), layouts


def _local_norm(local: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One shard's norm in fp32; an empty shard's (a ``[1, 1, D]`` token on 2 ranks) is 0, where torch has no
    infinity norm of an empty tensor (0 is the identity of the max over ranks; a p-norm of nothing is 0 too)."""
    if local.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=local.device)
    if local.is_complex():  # of the magnitudes, as torch's clip_grad_norm_ (a complex dtype= is all it takes)
        return torch.linalg.vector_norm(local, norm_type).to(torch.float32)
    return torch.linalg.vector_norm(local, norm_type, dtype=torch.float32)


def _whole_on_every_rank(grads: list[torch.Tensor]) -> bool:
    """Every gradient held whole by each rank (one rank, a mesh dimension of size 1, replicas): nothing to sum
    across ranks. A sum of squares all-reduced would round apart from torch's norm of the per-tensor norms (one rank:
    3e-6 apart from DDP's weights after 6 AdamW steps clipped at 0.05 with a warm-up)."""
    for grad in grads:
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            if any(_splits(placement) and mesh.size(dim) > 1 for dim, placement in enumerate(grad.placements)):
                return False
    return True


def _reduce_op(norm_type: float) -> dist.ReduceOp.RedOpType:
    return dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients as if unsharded, identical on every rank (``clip_grad_norm_`` cannot mix plain
    tensors and DTensors): one scalar all-reduced per layout."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if _whole_on_every_rank(grads):  # torch's own sum over them: one rank clips as DDP does, bit for bit
        return torch.nn.utils.get_total_norm([dtensor_local(g) for g in grads], norm_type)
    parts, layouts = _local_parts(grads, norm_type)
    combine = torch.amax if math.isinf(norm_type) else torch.sum
    sharded = {index for members in layouts.values() for index in members}
    plain = [index for index in range(len(grads)) if index not in sharded]
    totals = [combine(parts[plain]) if plain else parts.new_zeros(())]
    for (mesh, dims), members in layouts.items():
        part = combine(parts[members])
        all_reduce_over(part, mesh, list(dims), _reduce_op(norm_type))
        totals.append(part)
    total = combine(torch.stack(totals))
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def _per_gradient(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each gradient's sum |g|^p (max |g|) as if unsharded, the same on every rank: a vector all-reduced per layout."""
    parts, layouts = _local_parts(grads, norm_type)
    for (mesh, dims), members in layouts.items():
        if len(members) == len(grads):  # every gradient sharded alike (the common case): no gather and scatter
            all_reduce_over(parts, mesh, list(dims), _reduce_op(norm_type))
            break
        chosen = torch.tensor(members, device=parts.device)
        part = parts.index_select(0, chosen)
        all_reduce_over(part, mesh, list(dims), _reduce_op(norm_type))
        parts = parts.index_copy(0, chosen, part)
    return parts


@torch.no_grad()
def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """Lightning's ``lightning.pytorch.utilities.grad_norm`` for a sharded model: the same keys, each parameter's
    gradient norm as if unsharded (DDP's values) and their total, the same on every rank. Lightning's own reads a
    DTensor gradient as a plain tensor and fails under FSDP2 ("its data is not allocated yet"). Collective: call it
    on every rank, as ``on_before_optimizer_step`` runs."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    if not named:
        return {}
    parts = _per_gradient([grad for _, grad in named], norm_type)
    norms = parts if math.isinf(norm_type) else parts.pow(1.0 / norm_type)
    found = {f"grad_{norm_type}_norm{group_separator}{name}": norms[i] for i, (name, _) in enumerate(named)}
    found[f"grad_{norm_type}_norm_total"] = torch.linalg.vector_norm(norms, norm_type)
    return found


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in [dtensor_local(p.grad) for p in params if p.grad is not None]:
        local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total


@contextmanager
def lightning_grad_norm_named() -> Generator[None, None, None]:
    """Lightning's ``grad_norm`` called on sharded gradients (in a step, a hook or a callback) raises an error that
    names :func:`grad_norm`, which takes the same arguments and gives DDP's values, instead of torch's "its data is
    not allocated yet" from inside Lightning."""
    try:
        yield
    except RuntimeError as error:
        frames = traceback.extract_tb(error.__traceback__)
        if not any(f.name == "grad_norm" and f.filename.replace("\\", "/").endswith("utilities/grads.py")
                   for f in frames):
            raise
        raise RuntimeError(
            "Lightning's `grad_norm` reads each gradient as a plain tensor, but under VitScaleStrategy they are"
            " sharded (DTensor). Use `from lightning_vitscale import grad_norm` instead: the same arguments and keys,"
            " each parameter's norm as under DDP (called on every rank)."
        ) from error
