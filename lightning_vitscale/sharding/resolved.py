"""What setup resolved from the requested settings: made once, for one device, with a concrete type per field.

:class:`~lightning_vitscale.ParallelConfig` is what the user asked for and never changes (``kernels="auto"`` stays
``"auto"``); :class:`ResolvedConfig` is what the pipeline builds (the :class:`KernelPolicy` ``"auto"`` became on this
device, what ``priority`` made of the settings left at ``None``, the blocks ``activation_checkpointing="auto"``
chose, the blocks per unit and the prefetch depth).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lightning_vitscale.kernels import Compiler, KernelPolicy, resolve_kernels, usable_backends, with_compile_choice
from lightning_vitscale.memory import StepInputs, StepSettings, compile_pays, rates_for
from lightning_vitscale.sharding.activation_checkpointing import CheckpointMode
from lightning_vitscale.sharding.settings import CheckpointingPolicy, ParallelConfig, ShardingPolicy, by_priority


@dataclass(frozen=True)
class ResolvedConfig:
    """The settings the pipeline runs with; ``VitScaleStrategy.resolved`` after setup.

    Attributes:
        requested: what the user asked for (``strategy.config``), unchanged.
        kernels: the kernel policy for this device (``kernels="auto"`` resolved, ``torch.compile(model)`` taken over).
        blocks_per_unit: consecutive blocks per FSDP unit: the user's, the planner's choice, or 1.
        prefetch: units each unit all-gathers ahead (the user's, else 1 on CPU ranks and 0 on GPUs).
        checkpointing: the checkpointing settings with ``priority`` applied (``blocks`` never ``None``).
        planner_units: the planner chooses ``blocks_per_unit`` (left at ``None`` under ``priority="speed"``).
        planner_keeps: the planner may keep block units gathered for backward (``reshard_after_forward=None``
            under ``priority="speed"``).
        checkpoint_choice: the blocks ``activation_checkpointing="auto"`` chose at setup (name -> mode; a block not
            named is not checkpointed); ``None``: the requested setting decides per block.
    """

    requested: ParallelConfig
    kernels: KernelPolicy
    blocks_per_unit: int
    prefetch: int
    checkpointing: CheckpointingPolicy
    planner_units: bool
    planner_keeps: bool
    checkpoint_choice: Mapping[str, CheckpointMode] | None = None

    @property
    def sharding(self) -> ShardingPolicy:
        """The requested sharding settings (what to wrap, reshard, layout, offload, accumulation)."""
        return self.requested.sharding

    def checkpoint_mode(self, index: int, name: str, module: nn.Module) -> CheckpointMode | None:
        """How the ``index``-th block (0-based, model order) is checkpointed: ``"full"``, ``"selective"``, ``None``."""
        if self.checkpoint_choice is not None:
            return self.checkpoint_choice.get(name)
        return self.checkpointing.mode(index, name, module)


def resolve_config(
    config: ParallelConfig, device: torch.device, user_compiler: Compiler | None = None
) -> ResolvedConfig:
    """What ``config`` means on ``device`` (known only once processes are set up).

    ``trainer.fit(torch.compile(model))`` brings the user's compile settings, applied block by block.
    """
    kernels = resolve_kernels(config.kernels, device, usable_backends(device))
    if user_compiler is not None:
        kernels = dataclasses.replace(kernels, compile_blocks=True, compiler=user_compiler)
    left = by_priority(config)
    return ResolvedConfig(config, kernels, left.blocks_per_unit or 1, config.sharding.prefetch_on(device.type),
                          left.checkpointing, left.blocks_per_unit is None, left.planner_keeps)


def compile_where_it_pays(
    resolved: ResolvedConfig, step: tuple[StepInputs, StepSettings] | None, device: torch.device
) -> ResolvedConfig:
    """``kernels="auto"`` on CUDA with the step measured at setup (``step``: the planner's inputs and the settings
    to apply): the blocks compiled only where the planner's step model predicts it pays for this device and batch
    (:func:`~lightning_vitscale.kernels.with_compile_choice`). A user's own policy or ``torch.compile(model)`` is
    left as it is; without a batch, ``"auto"``'s default (compiled) stays, and the summary says why."""
    kernels = resolved.kernels
    if resolved.requested.kernels != "auto" or not kernels.compile_blocks or kernels.compiler is not None:
        return resolved
    if step is None:
        return resolved
    pays, why = compile_pays(*step, rates_for(device))
    return dataclasses.replace(resolved, kernels=with_compile_choice(kernels, pays, why))

