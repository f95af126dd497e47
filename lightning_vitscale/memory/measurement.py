"""How setup measures a batch: the step in the trainer's loop (gradients alive through it or released after it) on
fake tensors, once for ``"auto"``'s plan and the summary's prediction alike; what it called, and why it could not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_vitscale.discovery.calls import Calls
from lightning_vitscale.discovery.tensor_plan import TensorPlanError
from lightning_vitscale.memory.activations import ModeOf
from lightning_vitscale.memory.gradient_release import may_release_after_step
from lightning_vitscale.memory.planning_batch import PlanningBatch, briefly, measure_batch
from lightning_vitscale.memory.selective_ops import SelectiveCheckpointingError
from lightning_vitscale.memory.step_inputs import StepInputs, TrainingLoop


class MeasurementError(RuntimeError):
    """The step could not run on fake tensors, so the planner has nothing to choose from."""


def training_loop(module: nn.Module, trainer: pl.Trainer | None) -> TrainingLoop:
    """When ``trainer``'s loop keeps ``module``'s gradients alive (``None``: a plain planning call's defaults)."""
    automatic = bool(getattr(module, "automatic_optimization", True))
    if trainer is None:
        return TrainingLoop(automatic=automatic)
    return TrainingLoop(automatic=automatic, accumulate=trainer.accumulate_grad_batches,
                        released_after_step=may_release_after_step(module, trainer))


@dataclass(frozen=True)
class Measurement:
    """How setup measures a batch, for ``"auto"``'s plan and for the summary's prediction alike: ``world_size``, one
    shard group, ``replicas`` times (hybrid sharding); the step in ``trainer``'s loop; ``calls``: what it called."""

    world_size: int
    precision: str
    blocks: Any = None
    replicas: int = 1
    tensor_parallel: int = 1
    tensor_plan: Any = None
    trainer: pl.Trainer | None = None
    calls: Calls = field(default_factory=Calls)
    order: tuple[str, ...] | None = None  # None: blocks in the step's call order; else so (the units made), () model

    def __call__(self, module: nn.Module, batch: PlanningBatch, device: torch.device | None = None,
                 mode_of: ModeOf | None = None, optimizer: str = "adamw") -> tuple[StepInputs, str]:
        try:
            inputs, how = measure_batch(
                module, batch, loop=training_loop(module, self.trainer), world_size=self.world_size,
                precision=self.precision, optimizer=optimizer, blocks=self.blocks, device=device, mode_of=mode_of,
                tensor_parallel=self.tensor_parallel, tensor_plan=self.tensor_plan, calls=self.calls, order=self.order)
        except (TensorPlanError, SelectiveCheckpointingError):  # a refused plan is what to fix
            raise
        except Exception as error:
            raise MeasurementError(briefly(error)) from error
        return dataclasses.replace(inputs, replicas=self.replicas), how

    def or_why(self, module: nn.Module, batch: PlanningBatch, device: torch.device,
               mode_of: ModeOf) -> tuple[StepInputs | None, str]:
        """For the summary's predicted peak: a step that cannot run on fake tensors gives ``(None, why)``."""
        try:
            return self(module, batch, device, mode_of)
        except MeasurementError as error:
            where = f" in {self.calls.where}" if self.calls.where else ""
            return None, f"{batch.source} could not run on fake tensors{where} ({error})"
