"""The largest and smallest elements of a sharded tensor whose shard is empty on some ranks, as DDP gives them.

FSDP2 shards each parameter along its first dimension; one shorter than the number of ranks (a ViT's class token
``[1, 1, D]``, its position table ``[1, N, D]``, a ``[1]`` scale) leaves some ranks an empty shard. DTensor takes
``p.max()`` / ``p.amax(dim)`` over a sharded dimension as each rank's own, combined later (``Partial("max")``);
torch's max over an empty dimension raises on those ranks alone while the others go on to the combining collective,
so ``p.abs().max()`` in a callback ends the job (gloo: "Received data size doesn't match"; NCCL: a hang) where DDP
returns the number. Here an empty shard gives the reduction's identity (-inf for a max), every rank the same path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_vitscale._compat import dtensor_local, dtensor_op_handlers, wrap_dtensor

_aten = torch.ops.aten
# op -> (the combination over ranks, whether it reduces every dimension: max() / min() take no `dim`)
_EXTREMES = {_aten.max.default: ("max", True), _aten.min.default: ("min", True),
             _aten.amax.default: ("max", False), _aten.amin.default: ("min", False)}


def take_extremes_over_empty_shards() -> None:
    """Route a DTensor's max/min over dimensions through :func:`_extreme` (process-wide, as DTensor's dispatcher)."""
    dtensor_op_handlers().update(dict.fromkeys(_EXTREMES, _extreme))


def _extreme(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensor: DTensor = args[0]
    combine, every_dim = _EXTREMES[op]
    dims, keepdim = _reduced_dims(tensor.ndim, every_dim, args[1:], kwargs)
    if not all(type(placement) in (Shard, Replicate) for placement in tensor.placements):
        # partial sums combined first, as DTensor does; a strided shard (FSDP over tensor parallelism) gathered
        tensor = tensor.redistribute(placements=[Replicate()] * tensor.device_mesh.ndim)
    local = dtensor_local(tensor)
    if tensor.numel() == 0 or not any(local.shape[dim] == 0 for dim in dims):
        value = op(local, *args[1:], **kwargs)  # torch's own (its error where the whole tensor is empty, as DDP's)
    else:
        kept = [1 if dim in dims else size for dim, size in enumerate(local.shape)]
        shape = kept if keepdim else [size for dim, size in enumerate(local.shape) if dim not in dims]
        value = torch.full(shape, _identity(combine, local.dtype), dtype=local.dtype, device=local.device)
    placements = tuple(_placement_after(placement, dims, keepdim, combine) for placement in tensor.placements)
    return wrap_dtensor(value, tensor.device_mesh, placements)


def _reduced_dims(ndim: int, every_dim: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[set[int], bool]:
    """The dimensions reduced (``amax(dim=[])``: all) and whether they are kept."""
    if every_dim:
        return set(range(ndim)), False
    dim = kwargs.get("dim", args[0] if args else [])
    keepdim = bool(kwargs.get("keepdim", args[1] if len(args) > 1 else False))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return ({d % max(ndim, 1) for d in dims} if dims else set(range(ndim))), keepdim


def _placement_after(placement: Any, dims: set[int], keepdim: bool, combine: str) -> Any:
    """A sharded dimension reduced is combined over the ranks; one kept is still sharded (renumbered)."""
    if not placement.is_shard():
        return Replicate()
    if placement.dim in dims:
        return Partial(combine)
    return Shard(placement.dim if keepdim else placement.dim - sum(dim < placement.dim for dim in dims))


def _identity(combine: str, dtype: torch.dtype) -> float | int | bool:
    """The value an empty shard contributes: one that never wins the combination over the ranks."""
    largest = combine == "max"
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point:
        return -float("inf") if largest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if largest else info.max
