"""The only call site of FSDP2's ``fully_shard``, and the FSDP2 policies it is called with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_vitscale.precision import PrecisionPolicy

T = TypeVar("T")


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
    module: nn.Module | list[nn.Module],
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | int,
    ignored_params: set[nn.Parameter] | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> FSDPModule:
    """Make ``module`` (or a list of consecutive modules, together) one FSDP unit over ``mesh`` (1-D: fully sharded;
    2-D: hybrid, sharded along the last dimension). ``reshard_after_forward`` is explicit (see
    ``settings.unit_reshard``): no FSDP default decides. Returns the unit (a list's first module: FSDP2 gives
    every module of the list the one shared state, so any of them stands for the unit)."""
    sharded = fully_shard(
        module if not isinstance(module, list) or len(module) > 1 else module[0],
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        ignored_params=ignored_params or None,
        offload_policy=offload_policy or OffloadPolicy(),
    )
    return cast(FSDPModule, sharded[0] if isinstance(sharded, list) else sharded)


def group_blocks(blocks: list[T], per_unit: int, unit_of: Sequence[int] | None = None) -> list[list[T]]:
    """Consecutive runs of ``per_unit`` blocks (in model order; the last run may be shorter), one FSDP unit each;
    ``unit_of[i]``: block ``i``'s unit as discovered (the modules of a container that is never called themselves
    share one), which a run never splits (it may hold more than ``per_unit`` blocks then).

    Consecutive, so that a unit's blocks run back to back: FSDP2 gathers a list-unit at the first of its modules'
    forwards and reduce-scatters once after the last of their backwards.
    """
    unit_of = range(len(blocks)) if unit_of is None else unit_of
    groups: list[list[T]] = []
    for i, block in enumerate(blocks):
        if groups and (len(groups[-1]) < per_unit or unit_of[i] == unit_of[i - 1]):
            groups[-1].append(block)
        else:
            groups.append([block])
    return groups


def set_prefetch(units: list[FSDPModule], depth: int) -> None:
    """Explicit prefetch along the model order ``units`` (outer unit first, then the blocks in forward order).

    Each unit issues the all-gathers of the next ``depth`` units in forward right after its own, and of the
    previous ``depth`` blocks in backward: the collective then runs (NCCL stream, or gloo's worker thread on
    CPU) while this unit computes, instead of being issued when the next unit's pre-forward hook runs, where
    the caller then waits for it. ``depth=0`` leaves FSDP2's implicit behaviour (backward prefetch of one unit
    by the reverse post-forward order; none in forward on CPU). More than 1 holds more gathered copies at once.
    """
    if depth <= 0:
        return
    for index, unit in enumerate(units):
        following = units[index + 1 : index + 1 + depth]
        if following:
            unit.set_modules_to_forward_prefetch(following)
        blocks_before = units[max(1, index - depth) : index]  # the outer unit stays gathered for backward
        if index >= 1 and blocks_before:
            unit.set_modules_to_backward_prefetch(list(reversed(blocks_before)))
