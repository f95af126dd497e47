"""A ``training_step`` reading its optimizers and schedulers, or stepping them itself (manual optimization), is
planned from the step, through ``Trainer.fit`` as DDP runs it (``memory/step_stand_ins.py``).

Before: setup measures the step before Lightning builds the optimizers, so ``self.optimizers().param_groups`` raised
on the planner's twin (``'list' object has no attribute 'param_groups'``), ``self.lr_schedulers().get_last_lr()``,
``self.trainer.optimizers[0]`` and ``self.trainer.lr_scheduler_configs[0]`` too (``'NoneType' ...``,
``IndexError``), and a manual step was never run (measured through ``forward``); without ``forward`` the default
could not plan for speed and checkpointed every block."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_vitscale import VitScaleStrategy
from tests.helpers.models import Streamed, loader
from tests.helpers.schedules import OneCycle, ReadsItsSchedule

PLANNED = "(measured on one batch of the train dataloader, through training_step)"
NOT_PLANNED = "so it cannot plan for speed: every block checkpointed"


def fit(module: L.LightningModule, strategy, data) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_step_reading_its_optimizer_and_scheduler_is_planned_for_speed_and_trains_as_ddp(manual):
    ours, ddp = ReadsItsSchedule(manual), ReadsItsSchedule(manual)
    summary = fit(ours, VitScaleStrategy(), loader(32)).strategy.plan.summary()
    fit(ddp, "ddp", loader(32))
    assert PLANNED in summary and NOT_PLANNED not in summary, summary
    assert "checkpointed blocks : 0 of " in summary, summary  # the activations fit: nothing recomputed, as DDP
    assert ours.losses == ddp.losses
    assert ours.rates == ddp.rates  # the planner's run stepped nothing of the real run's (manual: 0.1, 0.05, ...)


def test_the_first_steps_plan_steps_nothing_of_the_runs_optimizers():
    """Streamed data: no batch at setup, so the plan is made on the first batch, when Lightning's optimizers and
    schedulers exist; the planner's step reads them, and its ``scheduler.step()`` must not advance the run's
    schedule (mutation seen failing: the trainer's schedulers handed over unwrapped, the run's rates one step
    ahead of DDP's from the first step)."""
    ours, ddp = ReadsItsSchedule(manual=True), ReadsItsSchedule(manual=True)
    streamed = Streamed(DataLoader(loader(128).dataset, batch_size=32))  # in order: DDP's sampler would shuffle
    summary = fit(ours, VitScaleStrategy(memory_budget=6_000_000), streamed).strategy.plan.summary()
    fit(ddp, "ddp", streamed)
    assert "the first training batch" in summary, summary  # planned at the first step, as the test intends
    assert ours.rates == ddp.rates == [(0.1 * 0.5**i,) * 3 for i in range(4)]
    assert ours.losses == ddp.losses


def test_what_the_planned_step_sets_on_the_trainer_stays_with_the_planners_run():
    """A step ending the run at its first batch (``self.trainer.should_stop = True``) trains that batch, as under
    DDP: the planner's run of the step at setup sets it on its stand-in of the trainer (mutation seen failing: the
    stand-in's attributes written through to the trainer, the run ended before its first step)."""
    ours, ddp = ReadsItsSchedule(stop_at_first=True), ReadsItsSchedule(stop_at_first=True)
    trainer = fit(ours, VitScaleStrategy(), loader(32))
    assert PLANNED in trainer.strategy.plan.summary()  # the step ran at setup, setting should_stop there
    assert trainer.global_step == fit(ddp, "ddp", loader(32)).global_step == 1
    assert ours.losses == ddp.losses and len(ours.losses) == 1


def test_a_schedule_sized_by_estimated_stepping_batches_trains_as_ddp():
    """The planner's run of the step reads ``self.trainer.estimated_stepping_batches`` through its stand-in of the
    trainer, before Lightning set up the train data: Lightning set it up there, drawing its iterator's seed under the
    planner's fake tensors and random states, and the draw was lost (every dropout mask after it differed from DDP's:
    2.466 against DDP's 2.495 at the first step; on 2 ranks the data's collectives on the planning rank alone hung:
    ``tests/distributed/test_dropin.py``). The stand-in now gives Lightning's formula on the loader as it is, the
    same number here. Mutation seen failing: the stand-in's property removed (the trainer's read)."""
    def run(strategy) -> tuple[ReadsItsSchedule, L.Trainer]:
        L.seed_everything(0, verbose=False)
        module = OneCycle()
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, limit_train_batches=3,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(module, loader(128))
        return module, trainer

    (ours, trainer), (ddp, _) = run(VitScaleStrategy()), run("ddp")
    assert PLANNED in trainer.strategy.plan.summary()  # the step ran at setup, reading the schedule
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in ours.modules())  # masks drawn every step
    assert ours.rates == ddp.rates and len(ours.rates) == 6
    assert ours.stepping_batches == ddp.stepping_batches == [6]  # the real configure_optimizers' (the twin's: silent)
    assert ours.losses == ddp.losses


class ComparesStepCounts(ReadsItsSchedule):
    """Records the planner's number for the run's trainer beside Lightning's, where Lightning computes it first (its
    ``configure_optimizers`` under DDP, before the train data is set up)."""

    def configure_optimizers(self):
        from lightning_vitscale.memory.step_stand_ins import _steps_before_data_setup

        assert self.trainer.train_dataloader is None  # as at the planner's run
        self.stepping_batches = [_steps_before_data_setup(self.trainer), self.trainer.estimated_stepping_batches]
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.backbone(x), y)


@pytest.mark.parametrize(("limit", "accumulate", "max_steps", "epochs"),
                         [(1.0, 1, -1, 2), (3, 2, -1, 3), (0.5, 3, -1, 1), (1.0, 1, 5, 4), (2, 1, 3, -1)])
def test_the_planners_estimated_stepping_batches_is_lightnings(limit, accumulate, max_steps, epochs):
    """The stand-in's formula (no data set up, no collective) against Lightning's own number for the same trainer:
    train batch limits as a count and a fraction, accumulation, ``max_steps``, ``max_epochs=-1``."""
    module = ComparesStepCounts()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", max_epochs=epochs, max_steps=max_steps,
                        limit_train_batches=limit, accumulate_grad_batches=accumulate, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader(40))
    planned, lightnings = module.stepping_batches
    assert planned == lightnings
