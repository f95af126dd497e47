"""The planner predicts the FSDP units setup makes: both list the blocks in the order the measured step calls them
(a stack run last block first, as a top-down pathway runs: HF UperNet's head), end a unit where that order breaks a
run, and join the modules of a container never called itself (lucidrains' ``ModuleList`` layers); the planner once
grouped every run of ``blocks_per_unit`` blocks alike (UperNet planned as 1 unit was made as 5, its summary said "1
of 1 units"). Until 2026-12-07 both listed the blocks in model order, so each block of a stack run in reverse was a
unit of its own.

Through ``Trainer.fit``, with a batch at setup (the planner's measured step says which blocks run back to back) and
without (the first step's plan, for the units setup made from the structure). Each unit's blocks, and which units
keep their gathered parameters for backward, are read off the FSDP units made.

Mutations seen failing: the planner's spans as plain runs (``unit_spans`` ignoring ``inputs.runs``); the measured
step's runs dropped (``step_inputs`` returning no ``runs``); setup not handing its units to the first step's plan
(``units_made`` never set); the sharing keys used where one rank keeps every block; the blocks listed in model
order by setup (``select_units`` without the step's order) or by the planner (``step_inputs`` without it); the
first step's plan measured in its own call order (``Measurement.order`` not set to the units made)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.memory.step_inputs import StepSettings
from lightning_vitscale.memory.step_model import predict_step
from tests.helpers.models import Streamed
from tests.helpers.units import planned_units, units_made
from tests.helpers.zoo import CLASSES, IMAGE, LucidViT, TopDown

BACKBONES = {"top-down": TopDown, "lucid": lambda: LucidViT(depth=4)}


class Net(L.LightningModule):
    def __init__(self, backbone: str, example: bool = True) -> None:
        super().__init__()
        self.backbone = BACKBONES[backbone]()
        if example:
            self.example_input_array = torch.randn(4, 3, IMAGE, IMAGE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fitted(backbone: str, example: bool = True, **options) -> tuple[Net, L.Trainer]:
    module = Net(backbone, example)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VitScaleStrategy(**options), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(8, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (8,))), batch_size=4)
    trainer.fit(module, data if example else Streamed(data))
    return module, trainer


@pytest.mark.parametrize("backbone", ["top-down", "lucid"])
@pytest.mark.parametrize("reshard", [True, None])  # pinned (every unit resharded), or the planner's per unit
def test_the_planner_predicts_the_units_setup_makes(backbone, reshard):
    module, trainer = fitted(backbone, reshard_after_forward=reshard)
    planned, planned_kept, choice = planned_units(trainer)
    made, kept = units_made(module, [n for unit in planned for n in unit])
    assert planned == made, choice.describe()
    assert planned_kept == kept
    assert choice.blocks.units == len(made) and f"of {len(made)} units" in choice.describe()
    block_units = sum(isinstance(module.get_submodule(unit[0]), FSDPModule) for unit in made)
    assert trainer.strategy.plan.units == block_units + 1  # and the outer one
    if reshard is None:  # one rank, free to keep every block: all of them in the outer unit, whatever the runs
        assert made == [[name for unit in made for name in unit]] and block_units == 0, made
        return
    if backbone == "top-down":  # in call order, the decoder's blocks in units of more than one
        order = [f"backbone.layers.{i}" for i in range(4)] + [f"backbone.decoder.{i}" for i in (3, 2, 1, 0)]
        assert [name for unit in made for name in unit] == order and len(made) < 5, made
    else:  # each layer's attention and feed-forward in one unit
        assert all(len(unit) % 2 == 0 for unit in made) and len(made) <= 4, made


def test_a_tight_budget_plans_the_units_made_and_which_stay_gathered():
    """A budget under the ample plan's peak: the plan saves memory (here by checkpointing a block: on one rank a kept
    unit holds the rank's own whole parameters, so keeping costs next to nothing) and still predicts the units made
    and which keep their parameters gathered. Plans mixing resharded and kept units are held to the units made on 2
    ranks (``tests/distributed/test_memory_planner.py``'s ``-11`` cells: the blocks kept gathered are the planned)."""
    _, trainer = fitted("top-down", blocks_per_unit=2)
    ample = trainer.strategy.sharded.auto.choice.plan
    n, per_unit = len(ample.inputs.profile.blocks), ample.blocks.per_unit
    every_resharded = predict_step(ample.inputs, StepSettings(blocks_per_unit=per_unit)).peak
    every_kept = predict_step(ample.inputs, StepSettings(blocks_per_unit=per_unit, kept_gathered=frozenset(range(n))))
    budget = (every_resharded + every_kept.peak) // 2
    module, trainer = fitted("top-down", memory_budget=budget, blocks_per_unit=per_unit)
    planned, planned_kept, choice = planned_units(trainer)
    made, kept = units_made(module, [n for unit in planned for n in unit])
    assert planned == made and planned_kept == kept, choice.describe()
    assert len(made) == 4 and (any(choice.plan.blocks.modes) or not all(kept)), choice.describe()


def test_the_first_steps_plan_predicts_the_units_made_before_it():
    """No batch at setup: the units come from the structure (in model order, a unit never spans two containers), the
    plan from the first step, for those units; the measured step would have listed the decoder last block first
    (``Measurement.order``: the units made, not the step's order)."""
    module, trainer = fitted("top-down", example=False, reshard_after_forward=True, blocks_per_unit=4)
    planned, planned_kept, choice = planned_units(trainer)
    made, kept = units_made(module, [n for unit in planned for n in unit])
    assert made == [[f"backbone.layers.{i}" for i in range(4)], [f"backbone.decoder.{i}" for i in range(4)]]
    assert planned == made and planned_kept == kept == [False, False], choice.describe()
    assert choice.blocks.units == 2
