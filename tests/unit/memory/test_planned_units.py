"""The planner predicts the FSDP units setup makes: setup ends a unit where the measured step's call order breaks a run
of blocks (a stack run last block first, as a top-down pathway runs: HF UperNet's head) and joins the modules of a
container never called itself (lucidrains' ``ModuleList`` layers); the planner once grouped every run of
``blocks_per_unit`` blocks alike (UperNet planned as 1 unit was made as 5, its summary said "1 of 1 units").

Through ``Trainer.fit``, with a batch at setup (the planner's measured step says which blocks run back to back) and
without (the first step's plan, for the units setup made from the structure). Each unit's blocks, and which units
keep their gathered parameters for backward, are read off the FSDP units made.

Mutations seen failing: the planner's spans as plain runs (``unit_spans`` ignoring ``inputs.runs``); the measured
step's runs dropped (``step_inputs`` returning no ``runs``); setup not handing its units to the first step's plan
(``units_made`` never set); the sharing keys used where one rank keeps every block."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale._compat import fsdp_param_groups, unit_keeps_gathered
from lightning_vitscale.memory.step_inputs import StepSettings, unit_spans
from lightning_vitscale.memory.step_model import predict_step
from tests.helpers.models import Streamed
from tests.helpers.zoo import CLASSES, IMAGE, LucidViT, PatchClassifier


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class TopDown(PatchClassifier):
    """An encoder stack, then a decoder stack run last block first: in the step, each decoder block runs apart from
    its neighbours in model order, so each is a unit of its own; the encoder's run back to back."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__(dim, nn.ModuleList([Residual(dim) for _ in range(depth)]))
        self.decoder = nn.ModuleList([Residual(dim) for _ in range(depth)])

    def run(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        for block in reversed(self.decoder):
            x = block(x)
        return x


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
    choice = trainer.strategy.sharded.auto.choice
    plan = choice.plan
    settings = plan.chosen.settings
    names = [block.name for block in plan.inputs.profile.blocks]
    spans = unit_spans(plan.inputs, settings)
    return [[names[i] for i in span] for span in spans], [settings.keeps(span[0]) for span in spans], choice


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
    if backbone == "top-down":  # the decoder's blocks each alone, whatever the size chosen
        assert made[-4:] == [[f"backbone.decoder.{i}"] for i in range(4)], made
    else:  # each layer's attention and feed-forward in one unit
        assert all(len(unit) % 2 == 0 for unit in made) and len(made) <= 4, made


def test_a_tight_budget_keeps_only_whole_units_gathered_as_planned():
    """Between the ends some units reshard and the last stay gathered: the kept ones are whole planned units."""
    _, trainer = fitted("top-down")
    ample = trainer.strategy.sharded.auto.choice.plan
    n, per_unit = len(ample.inputs.profile.blocks), ample.blocks.per_unit
    every_resharded = predict_step(ample.inputs, StepSettings(blocks_per_unit=per_unit)).peak
    every_kept = predict_step(ample.inputs, StepSettings(blocks_per_unit=per_unit, kept_gathered=frozenset(range(n))))
    budget = (every_resharded + every_kept.peak) // 2
    module, trainer = fitted("top-down", memory_budget=budget, blocks_per_unit=per_unit)
    planned, planned_kept, choice = planned_units(trainer)
    made, kept = units_made(module, [n for unit in planned for n in unit])
    assert planned == made and planned_kept == kept, choice.describe()
    assert any(kept) and not all(kept), choice.describe()


def test_the_first_steps_plan_predicts_the_units_made_before_it():
    """No batch at setup: the units come from the structure (a unit never spans two containers), the plan from the
    first step, for those units; the measured step's order would have split the decoder, setup did not."""
    module, trainer = fitted("top-down", example=False, reshard_after_forward=True, blocks_per_unit=4)
    planned, planned_kept, choice = planned_units(trainer)
    made, kept = units_made(module, [n for unit in planned for n in unit])
    assert made == [[f"backbone.layers.{i}" for i in range(4)], [f"backbone.decoder.{i}" for i in range(4)]]
    assert planned == made and planned_kept == kept == [False, False], choice.describe()
    assert choice.blocks.units == 2
