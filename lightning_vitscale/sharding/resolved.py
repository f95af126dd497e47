"""What setup resolved from the request (``ParallelConfig``, never changed): made once, for one device."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lightning_vitscale.kernels import (
    NO_BATCH,
    Compiler,
    KernelPolicy,
    resolve_kernels,
    usable_backends,
    with_compile_choice,
)
from lightning_vitscale.memory import StepInputs, StepSettings, compile_pays, rates_for
from lightning_vitscale.sharding.activation_checkpointing import CheckpointMode, is_self_checkpointing
from lightning_vitscale.sharding.checkpointing_settings import CheckpointingPolicy
from lightning_vitscale.sharding.settings import ParallelConfig, ShardingPolicy, by_priority


@dataclass(frozen=True)
class ResolvedConfig:
    """The settings the pipeline runs with (``VitScaleStrategy.resolved``): ``kernels`` for this device,
    ``checkpointing`` with ``priority`` applied; ``planner_units``/``planner_keeps``: ``priority="speed"`` left the
    blocks per unit / the units kept gathered to the planner; ``checkpoint_choice``: ``"auto"``'s, made at setup."""

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
        return self.requested.sharding

    def checkpoint_mode(self, index: int, name: str, module: nn.Module) -> CheckpointMode | None:
        """How the ``index``-th block (0-based, model order) is checkpointed: not by us where it checkpoints itself
        (HF's ``gradient_checkpointing_enable()``: ours around it would recompute twice), so that the step the planner
        measures and predicts is the one that runs (it measured ours, then predicted the step without it: a crash)."""
        if is_self_checkpointing(module):
            return None
        if self.checkpoint_choice is not None:
            return self.checkpoint_choice.get(name)
        return self.checkpointing.mode(index, name, module)


def resolve_config(
    config: ParallelConfig, device: torch.device, user_compiler: Compiler | None = None
) -> ResolvedConfig:
    """What ``config`` means on ``device``; ``user_compiler``: ``trainer.fit(torch.compile(model))``'s settings."""
    kernels = resolve_kernels(config.kernels, device, usable_backends(device))
    if user_compiler is not None:
        kernels = dataclasses.replace(kernels, compile_blocks=True, compiler=user_compiler)
    left = by_priority(config)
    return ResolvedConfig(config, kernels, left.blocks_per_unit or 1, config.sharding.prefetch_on(device.type),
                          left.checkpointing, left.blocks_per_unit is None, left.planner_keeps)


def compile_where_it_pays(
    resolved: ResolvedConfig, step: tuple[StepInputs, StepSettings] | None, device: torch.device
) -> ResolvedConfig:
    """``kernels="auto"`` with the step measured at setup (``step``): the blocks compiled only where the step model
    predicts it pays (:func:`~lightning_vitscale.kernels.with_compile_choice`). A user's own policy or
    ``torch.compile(model)`` stays; without a batch, ``"auto"``'s default (compiled) stays."""
    kernels = resolved.kernels
    if resolved.requested.kernels != "auto" or not kernels.compile_blocks or kernels.compiler is not None or not step:
        return resolved
    return dataclasses.replace(resolved, kernels=with_compile_choice(kernels, *compile_choice(step, device)))


def compile_choice(step: tuple[StepInputs, StepSettings] | None, device: torch.device) -> tuple[bool, str]:
    """``kernels="auto"``'s rule, at setup or at the first step: compile the blocks where the planner's step model
    predicts the compiled step faster (``compile_pays``), and why; a step not measured keeps the default (compiled)."""
    return compile_pays(*step, rates_for(device)) if step else (True, NO_BATCH)


COMPILE_AT_FIRST_STEP = "no batch known at setup: compiled or not at the first training step, from its plan"


def compile_at_first_step(resolved: ResolvedConfig, batch_pending: bool) -> tuple[ResolvedConfig, KernelPolicy | None]:
    """``kernels="auto"`` with no batch at setup while ``"auto"`` checkpointing waits for the first one
    (``batch_pending``): nothing compiled at setup, and the policy to compile with once the first step's plan
    predicts it pays (``ShardedModel.before_training_step``). torch.compile traces at a block's first call, so
    deciding before the first forward costs nothing; compiling blindly did (one H200: ViT-H/14 at batch 32 compiled
    ran at 0.75x eager, at its largest batch 1.18x). Else ``(resolved, None)``."""
    kernels = resolved.kernels
    if not batch_pending or kernels.reason != NO_BATCH or kernels.compiler is not None:
        return resolved, None
    waiting = dataclasses.replace(kernels, compile_blocks=False, reason=COMPILE_AT_FIRST_STEP)
    return dataclasses.replace(resolved, kernels=waiting), kernels
