"""LightningModules whose ``training_step`` reads its optimizer and scheduler as users do (the planner runs it at
setup on a twin: ``memory/step_stand_ins.py``), shared by the unit and the 2-rank tests."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from tests.helpers.models import BACKBONES


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
        self.rates: list[tuple[float, ...]] = []
        self.stepping_batches: list[int | float] = []

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


class OneCycle(ReadsItsSchedule):
    """A OneCycle schedule as long as the run, read in ``configure_optimizers`` (``estimated_stepping_batches``, which
    sets up the train dataloader and draws its iterator's seed), a backbone with dropout, the rate logged each step."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = self.trainer.estimated_stepping_batches
        self.stepping_batches.append(total)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
