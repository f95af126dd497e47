"""The FSDP units a fit made and the ones its plan predicted, each as its blocks' names (``Trainer.fit`` done)."""

from __future__ import annotations

import lightning as L
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_vitscale._compat import fsdp_param_groups, unit_keeps_gathered
from lightning_vitscale.memory.step_inputs import unit_spans


def units_made(module: nn.Module, names: list[str]) -> tuple[list[list[str]], list[bool]]:
    """The blocks of each block unit (a unit of several modules shares FSDP2's parameter group), and whether each
    keeps its gathered parameters for backward; blocks in the outer unit (one rank keeping every block) as one,
    kept."""
    units: dict[int, list[str]] = {}
    kept: dict[int, bool] = {}
    for name in names:
        block = module.get_submodule(name)
        key = id(fsdp_param_groups(block)[0]) if isinstance(block, FSDPModule) else 0
        units.setdefault(key, []).append(name)
        kept[key] = unit_keeps_gathered(block) if key else True
    return list(units.values()), list(kept.values())


def planned_units(trainer: L.Trainer) -> tuple[list[list[str]], list[bool], object]:
    """The units the plan "auto" chose predicted (each as its blocks' names), whether each stays gathered, and the
    choice."""
    choice = trainer.strategy.sharded.auto.choice
    plan = choice.plan
    settings = plan.chosen.settings
    names = [block.name for block in plan.inputs.profile.blocks]
    spans = unit_spans(plan.inputs, settings)
    return [[names[i] for i in span] for span in spans], [settings.keeps(span[0]) for span in spans], choice
