"""ViT image classification example: ``python examples/classification.py fit [--config ...]``.

Trains on scikit-learn's real 8x8 digits by default (no download); ``--data=FolderImageDataModule
--data.root=DIR`` for your own ImageFolder data. The module is plain single-device PyTorch: the
default ``strategy="vitscale"`` shards it, ``--trainer.strategy=ddp`` runs it unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `examples.models` imports from a checkout

import lightning.pytorch as pl  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

from examples.models.cli import run_cli  # noqa: E402
from examples.models.datamodules import DigitsDataModule  # noqa: E402
from examples.models.optim import adamw_cosine  # noqa: E402
from examples.models.vit import VIT_SIZES, VisionTransformer  # noqa: E402


class ViTClassifier(pl.LightningModule):
    """Cross-entropy ViT classifier; ``size`` names a ``VIT_SIZES`` entry (tiny ... vit-120b).

    ``num_classes``, ``in_chans`` and ``img_size`` are linked from the datamodule by the CLI.
    The network is built in ``configure_model`` so a sharding strategy can create it on the meta
    device / already sharded -- a 120B model never exists whole on one device.
    """

    def __init__(
        self,
        size: str = "tiny",
        num_classes: int = 10,
        in_chans: int = 1,
        img_size: int = 8,
        patch_size: int | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_frac: float = 0.1,
        label_smoothing: float = 0.1,
    ) -> None:
        super().__init__()
        if size not in VIT_SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {sorted(VIT_SIZES)}")
        self.save_hyperparameters()
        self.net: VisionTransformer | None = None
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)

    def configure_model(self) -> None:
        if self.net is None:
            h = self.hparams
            self.net = VisionTransformer.from_size(h.size, h.img_size, h.in_chans, h.num_classes, h.patch_size)

    def forward(self, x: Tensor) -> Tensor:
        assert self.net is not None, "configure_model() not called"
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
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

    def configure_optimizers(self) -> dict:
        h = self.hparams
        return adamw_cosine(self, h.lr, h.weight_decay, h.warmup_frac)


def main() -> None:
    run_cli(ViTClassifier, DigitsDataModule, "classification", ("num_classes", "in_chans", "img_size"), max_epochs=30)


if __name__ == "__main__":
    main()
