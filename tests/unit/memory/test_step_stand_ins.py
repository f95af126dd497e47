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
from tests.helpers.models import BACKBONES, Streamed, loader

PLANNED = "(measured on one batch of the train dataloader, through training_step)"
NOT_PLANNED = "so it cannot plan for speed: every block checkpointed"


class ReadsItsSchedule(L.LightningModule):
    """No ``forward``: the step calls the backbone. It logs the learning rate as its optimizer and its scheduler
    say (and the trainer's lists of them); ``manual``: it also steps both itself, the scheduler every step (its rate
    halves each step); ``stop_at_first``: it ends the run at its first batch (``self.trainer.should_stop``)."""

    def __init__(self, manual: bool = False, stop_at_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = BACKBONES["encoder"]()
        self.automatic_optimization = not manual
        self.stop_at_first = stop_at_first
        self.losses: list[float] = []
        self.rates: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        self.rates.append((optimizer.param_groups[0]["lr"], scheduler.get_last_lr()[0],
                           self.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]))
        if self.stop_at_first and batch_idx == 0:
            self.trainer.should_stop = True
        self.log("trainer_lr", self.trainer.optimizers[0].param_groups[0]["lr"])  # the Trainer's list, as often
        self.log("lr", optimizer.param_groups[0]["lr"])
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        return None

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


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


class OneCycle(ReadsItsSchedule):
    """A OneCycle schedule as long as the run, read in ``configure_optimizers`` (``estimated_stepping_batches``, which
    sets up the train dataloader and draws its iterator's seed), a backbone with dropout, the rate logged each step."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_schedule_sized_by_estimated_stepping_batches_trains_as_ddp():
    """The planner's run of the step reads ``self.trainer.estimated_stepping_batches`` through its stand-in of the
    trainer: Lightning sets up the train dataloader there, once, drawing its iterator's seed, as DDP's setup does.
    Drawn under the planner's fake tensors and random states, the draw was lost: every dropout mask after it differed
    from DDP's (2.466 against DDP's 2.495 at the first step). Mutations seen failing: the stand-in's reads of the
    trainer without ``as_the_run``, and ``as_the_run`` without leaving the fake modes."""
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
    assert ours.losses == ddp.losses
