"""The only call site of FSDP2's ``fully_shard``, and the FSDP2 policies it is called with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_vitscale.precision import PrecisionPolicy
from lightning_vitscale.sharding.gather_checks import before_gather
from lightning_vitscale.sharding.whole_terms import paused


def mixed_precision_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP2's per-unit policy: gather parameters in the compute dtype, reduce gradients in the reduce dtype."""
    if policy.compute == policy.master and policy.reduce == policy.master:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.compute, reduce_dtype=policy.reduce)


def batch_as_given(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The outer unit's policy: its forward is the step (:class:`~.outer_unit.OuterUnit`), so FSDP2's cast of its
    inputs would cast the whole batch, targets too (torchvision's detectors refuse bf16 boxes, and bf16 box corners
    past 1024 px are 8 px apart). The step gets the batch as under DDP's AMP; the layers cast what they compute with
    (each block unit's own FSDP2 cast, ``precision.cast_floating_inputs`` on the outer unit's layers)."""
    return dataclasses.replace(policy, cast_forward_inputs=False)


def offload_policy(offload: str | None, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for ``offload=``: host memory pinned on CUDA, so copies overlap with compute."""
    if offload == "cpu":
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def contiguous_parameters(model: nn.Module) -> list[str]:
    """Make every parameter contiguous, in place; returns the names of those that were not. FSDP2 shards rows of
    contiguous parameters only ("does not support non-contiguous parameters yet"), and
    ``model.to(memory_format=torch.channels_last)``, a convolutional network's speed habit under DDP, leaves its
    convolution weights strided: same values, standard layout (convolutions still run channels_last when their
    inputs are)."""
    strided = [(name, p) for name, p in model.named_parameters() if not p.is_contiguous()]
    for _, param in strided:
        param.data = param.data.contiguous()
    return [name for name, _ in strided]


def shard_module(
    module: nn.Module | list[nn.Module], mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | int, ignored_params: set[nn.Parameter] | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> FSDPModule:
    """Make ``module`` (or consecutive modules, together) one FSDP unit over ``mesh`` (2-D: hybrid). Returns the
    unit (a list's first module: its modules share one FSDP state)."""
    sharded = fully_shard(
        module if not isinstance(module, list) or len(module) > 1 else module[0],
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        ignored_params=ignored_params or None,
        offload_policy=offload_policy or OffloadPolicy(),
    )
    return cast(FSDPModule, sharded[0] if isinstance(sharded, list) else sharded)


def set_prefetch(units: list[FSDPModule], depth: int, same_call: Callable[[FSDPModule, FSDPModule], bool]) -> None:
    """Each block unit (``units``: outer first, then the blocks in forward order) issues the next ``depth`` units'
    all-gathers in forward, and the previous ``depth`` blocks' in backward; ``0`` leaves FSDP2's implicit prefetch.

    Not the outer unit: its forward is the whole ``training_step``, so a block gathered as it starts would be
    gathered before the user's code in the step, and a write there to the block's parameters (a momentum encoder
    updated before its forward, as lightly's examples do) would miss this step's forward, which DDP's sees. The
    first block unit gathers as its own forward starts. For the same reason a unit prefetches only units that
    ``same_call`` says one module call runs with it (blocks of one container: no user code between them), not a
    second model's (a teacher's after a student's)."""
    if depth <= 0:
        return
    for index, unit in enumerate(units):
        following = [u for u in units[index + 1 : index + 1 + depth] if same_call(unit, u)] if index >= 1 else []
        if following:
            unit.set_modules_to_forward_prefetch(following)
        blocks_before = units[max(1, index - depth) : index]  # the outer unit stays gathered for backward
        if index >= 1 and blocks_before:
            unit.set_modules_to_backward_prefetch(list(reversed(blocks_before)))


def prefetch_on_entry(unit: FSDPModule, callers: list[nn.Module]) -> None:
    """``unit``'s all-gather issued as soon as one of ``callers`` (the modules whose forward runs it: its container,
    the backbone holding that) starts its forward, where no unit before it prefetches it: the gather then overlaps
    the caller's work before the block (a patch embedding), and the user's code before the call has run. FSDP2
    waits for it in the unit's own pre-forward (``unshard(async_op=True)``'s contract); a gathered unit ignores it."""

    def gather_ahead(module: nn.Module, args: Any) -> None:
        before_gather(cast(nn.Module, unit))  # a lone call refused, the first gather outside inference mode
        with paused():  # FSDP2's own reads of the shards, not through a step's mixed-tensor dispatch
            unit.unshard(async_op=True)

    for caller in callers:
        caller.register_forward_pre_hook(gather_ahead)


def gathered_and_resharded(units: list[nn.Module]) -> None:
    """Each of ``units`` gathered and resharded in turn (one unit whole at a time), outside inference mode and
    without gradients: FSDP2 makes the tensors a unit gathers into at its first gather and keeps them for the run
    (``first_gathers.py`` says when this runs)."""
    with torch.inference_mode(False), torch.no_grad():
        for unit in units:
            assert isinstance(unit, FSDPModule)
            unit.unshard()
            unit.reshard()
