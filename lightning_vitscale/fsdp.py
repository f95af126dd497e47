"""Mechanism: the only call site of FSDP2's ``fully_shard``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vitscale._compat import FSDPModule, MixedPrecisionPolicy, fully_shard
from lightning_vitscale.policies import PrecisionPolicy


def mixed_precision_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP2's per-unit policy: gather parameters in the compute dtype, reduce gradients in the reduce dtype."""
    if policy.compute == policy.master and policy.reduce == policy.master:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.compute, reduce_dtype=policy.reduce)


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | int | None,
    ignored_params: set[nn.Parameter] | None = None,
) -> FSDPModule:
    """Make ``module`` one FSDP unit over ``mesh``; ``reshard_after_forward=None`` keeps FSDP2's default."""
    kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    return fully_shard(module, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored_params or None, **kwargs)


@torch.no_grad()
def broadcast_module_states(module: nn.Module, mesh: DeviceMesh, src: int = 0) -> None:
    """Give every rank rank ``src``'s parameters and buffers before sharding, as DDP does at construction.

    FSDP2 slices each rank's own copy; without this, ranks that were not seeded alike would shard a mixture.
    Meta tensors (materialised later, shard by shard) are skipped.
    """
    if mesh.size() == 1:
        return
    group = mesh.get_group()
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            dist.broadcast(tensor.data, src=dist.get_global_rank(group, src), group=group)
