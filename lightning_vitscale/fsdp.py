"""Mechanism: the only call site of FSDP2's ``fully_shard``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vitscale._compat import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from lightning_vitscale.mesh import broadcast_over
from lightning_vitscale.policies import PrecisionPolicy


def mixed_precision_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP2's per-unit policy: gather parameters in the compute dtype, reduce gradients in the reduce dtype."""
    if policy.compute == policy.master and policy.reduce == policy.master:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.compute, reduce_dtype=policy.reduce)


def offload_policy(offload: str | None, device: torch.device) -> OffloadPolicy:
    """FSDP2's offload policy for ``offload=``: ``"cpu"`` keeps sharded parameters, gradients and optimizer state
    in host memory (pinned on CUDA, so copies overlap with compute); ``None`` keeps them on the device."""
    if offload == "cpu":
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | int | None,
    ignored_params: set[nn.Parameter] | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> FSDPModule:
    """Make ``module`` one FSDP unit over ``mesh`` (1-D: fully sharded; 2-D: hybrid, sharded along the last
    dimension); ``reshard_after_forward=None`` keeps FSDP2's default."""
    kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    return fully_shard(module, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored_params or None, **kwargs)


@torch.no_grad()
def broadcast_module_states(module: nn.Module, mesh: DeviceMesh, src: int = 0) -> None:
    """Give every rank rank ``src``'s parameters and buffers before sharding, as DDP does at construction.

    FSDP2 slices each rank's own copy; without this, ranks that were not seeded alike would shard a mixture.
    Meta tensors (materialised later, shard by shard) are skipped.
    """
    if mesh.size() == 1:
        return
    if src != 0:
        raise ValueError(f"broadcast_module_states broadcasts from the mesh's first rank; got src={src}.")
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            broadcast_over(tensor.data, mesh)  # any mesh dimension (get_group() alone fails on a 2-D mesh)
