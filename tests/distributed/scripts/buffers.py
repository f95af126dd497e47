"""Rank script: a BatchNorm model's buffers under DDP and ``VitScaleStrategy`` (``buffers.py OUT batchnorm,resume``).

``batchnorm``: three training steps and two validations on 2 CPU ranks, fp32, from the same weights, then
``validate``, per kind of loop (automatic, accumulating, manual): DDP, the default plan, and the recipe's every block
checkpointed. ``resume``: two steps saved by ``ModelCheckpoint``, then a fit to
four resumed from it, under DDP and under the sharded and the full layout. Writes each rank's losses, validation
losses, the logged validation metric and the running statistics after the fit.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from tests.helpers.scenarios import run_scenarios

warnings.filterwarnings("ignore")


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class BatchNormNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)
        self.blocks = nn.Sequential(*[ConvBlock() for _ in range(3)])
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("val_loss", loss, sync_dist=True)
        self.val_losses.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(64, 3, 8, 8, generator=g) * 3 + 1, torch.randint(0, 4, (64,), generator=g)
    return DataLoader(TensorDataset(images, labels), batch_size=4)


class ManualBatchNormNet(BatchNormNet):
    """Manual optimization, two forwards a step (Lightning's DDP turns the gradient sync off around its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = F.cross_entropy(self(batch[0]), batch[1]) + 0.5 * F.cross_entropy(self(batch[0].flip(-1)), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        self.losses.append(loss.item())


class Trace(L.Callback):
    """Every rank's running means after each training and validation batch: when DDP syncs them shows here."""

    def __init__(self) -> None:
        self.seen: list[list[float]] = []

    def on_train_batch_end(self, trainer, module, *args) -> None:
        self.seen.append([float(b.double().sum()) for n, b in module.named_buffers() if "running_mean" in n])

    on_validation_batch_end = on_train_batch_end


def batchnorm() -> dict:
    """Per kind of loop (automatic, accumulating 2 micro-batches, manual), DDP and VitScaleStrategy's default and
    every-block-checkpointed plans: a fit with validation, then ``validate`` on the same Trainer."""
    found: dict = {}
    for loop in ("automatic", "accumulating", "manual"):
        for name, strategy in (("ddp", "ddp"), ("default", VitScaleStrategy()),
                               ("checkpointed", VitScaleStrategy(priority="memory"))):
            model, trace = (ManualBatchNormNet() if loop == "manual" else BatchNormNet()), Trace()
            trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                                max_steps=3, val_check_interval=2, limit_val_batches=2, logger=False,
                                accumulate_grad_batches=2 if loop == "accumulating" else 1, callbacks=[trace],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(model, loader(), loader())
            logged = float(trainer.callback_metrics["val_loss"])
            validated = trainer.validate(model, loader(), verbose=False)[0]["val_loss"]
            found.setdefault(loop, {})[name] = {
                "losses": model.losses, "val_losses": model.val_losses, "logged": logged, "validated": validated,
                "statistics": statistics(model), "seen": trace.seen}
    return found


def statistics(model: nn.Module) -> list[list[float]]:
    return [b.tolist() for n, b in model.named_buffers() if "running" in n]


def strategy_for(layout: str):
    return "ddp" if layout == "ddp" else VitScaleStrategy(state_dict_type=layout)


def resume() -> dict:
    folder, found = os.path.join(os.path.dirname(sys.argv[1].rstrip("/")), "resume"), {}
    common = dict(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), logger=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0)
    for name in ("ddp", "sharded", "full"):
        saver = ModelCheckpoint(dirpath=os.path.join(folder, name), save_last=True, every_n_train_steps=2)
        L.Trainer(strategy=strategy_for(name), max_steps=2, callbacks=[saver], **common).fit(BatchNormNet(), loader())
        model = BatchNormNet()
        L.Trainer(strategy=strategy_for(name), max_steps=4, enable_checkpointing=False, **common).fit(
            model, loader(), ckpt_path=saver.last_model_path)
        found[name] = {"losses": model.losses, "statistics": statistics(model)}
    return found


if __name__ == "__main__":
    run_scenarios({"batchnorm": batchnorm, "resume": resume})
