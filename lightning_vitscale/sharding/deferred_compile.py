"""``kernels="auto"`` with no batch at setup: the blocks compiled, or left eager, at the first training step from its
plan, and again at the first step of a larger batch (:class:`DeferredCompile`, held by ``ShardedModel``).

torch.compile traces at a block's first call, so deciding before the first forward costs nothing; compiling blindly
did (one H200: ViT-H/14 at batch 32 compiled ran at 0.75x eager, at its largest batch 1.18x). Setup leaves the
blocks eager and hands over the policy to compile with (``resolved.compile_at_first_step``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_vitscale.kernels import KernelPolicy, apply_regional_compile
from lightning_vitscale.memory import AutoCheckpointing, StepInputs, StepSettings, batch_size_of
from lightning_vitscale.sharding.resolved import compile_choice
from lightning_vitscale.sharding.summary import SetupSummary


@dataclass
class DeferredCompile:
    """The policy the blocks compile with once a step's plan predicts it pays, and the largest batch decided for
    (0: the first step has not decided yet). Every rank runs the same plan, so every rank decides alike."""

    kernels: KernelPolicy
    decided_at: int = 0
    done: bool = False  # compiled (never uncompiled), or decided once without a plan to decide again from

    def at_first_step(self, module: nn.Module, summary: SetupSummary, auto: AutoCheckpointing | None,
                      device: torch.device) -> None:
        """After ``"auto"`` checkpointing applied the first step's plan (the recompute is traced too): compile where
        that plan predicts it pays (the rule setup applies with a batch: ``compile_where_it_pays``); a step the
        planner could not measure keeps ``"auto"``'s default (compiled)."""
        measured = _measured(auto)
        pays, why = compile_choice(None if measured is None else measured[:2], device)
        _compile_blocks(module, summary, self.kernels, pays, f"{why}; decided at the first training step")
        if pays or measured is None:
            self.done = True
        else:  # eager for now: decided again at a larger batch
            self.decided_at = measured[2]

    def if_the_batch_grew(self, batch: Any, module: nn.Module, summary: SetupSummary, auto: AutoCheckpointing | None,
                          device: torch.device) -> None:
        """A batch larger than any the blocks were left eager for (a batch ramp-up, a benchmark's larger phase):
        the rule again, on the first step's plan scaled to it; compiled from here where it now pays (the step turns
        device-bound: ViT-H/14 on one H200 at batch 32 compiled ran 0.75x eager, at 336 1.18x)."""
        if self.done or not self.decided_at:
            return
        try:
            size = batch_size_of(batch)
        except ValueError:
            return
        measured = _measured(auto)
        if size <= self.decided_at or measured is None:
            return
        self.decided_at = size
        inputs, settings, planned_batch = measured
        scaled = dataclasses.replace(inputs, batch_scale=inputs.batch_scale * size / planned_batch)
        pays, why = compile_choice((scaled, settings), device)
        if pays:
            _compile_blocks(module, summary, self.kernels, True, f"{why}; decided at the first step of batch {size}")
            self.done = True


def _measured(auto: AutoCheckpointing | None) -> tuple[StepInputs, StepSettings, int] | None:
    """The step the first step's plan measured, the settings it chose and the batch it measured, if any."""
    plan = auto.choice.plan if auto is not None and auto.choice is not None else None
    return None if plan is None or plan.inputs is None else (plan.inputs, plan.chosen.settings, plan.batch_size)


def _compile_blocks(module: nn.Module, summary: SetupSummary, kernels: KernelPolicy, pays: bool, why: str) -> None:
    blocks = [module.get_submodule(name) for name in summary.block_names]
    named = "off"
    if pays and blocks:
        apply_regional_compile(blocks, kernels.compile_mode, kernels.compiler)
        named = ", ".join(f"{name} x{count}" for name, count in summary.blocks.items())
    summary.kernels["compiled blocks"] = f"{named} ({why})"
    rank_zero_info(f"VitScaleStrategy compiled blocks: {summary.kernels['compiled blocks']}")
