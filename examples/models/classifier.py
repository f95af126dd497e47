"""Shared cross-entropy LightningModule logic for the image and video classification examples.

Subclasses only build ``self.net`` in ``configure_model`` (so a sharding strategy can create it
already sharded); steps, torchmetrics accuracy and the optimizer live here once.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from examples.models.optim import adamw_cosine
from examples.models.vit import VIT_SIZES


class ClassificationModule(pl.LightningModule):
    """Logs train/val loss and accuracy; ``val_acc`` is the metric the examples report."""

    def __init__(
        self, size: str, num_classes: int, lr: float, weight_decay: float, warmup_frac: float, label_smoothing: float
    ) -> None:
        super().__init__()
        if size not in VIT_SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {sorted(VIT_SIZES)}")
        self.net: nn.Module | None = None
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.lr, self.weight_decay, self.warmup_frac = lr, weight_decay, warmup_frac
        self.label_smoothing = label_smoothing

    def forward(self, x: Tensor) -> Tensor:
        assert self.net is not None, "configure_model() not called"
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        return adamw_cosine(self, self.lr, self.weight_decay, self.warmup_frac)
