"""Self-supervised pretraining example (DINO): ``python examples/pretraining.py fit [--config ...]``.

A student ViT learns to match an EMA teacher across crops of scikit-learn's digits by default (no labels used,
no download); ``--data=FolderMultiCropDataModule --data.root=DIR`` for your own ImageFolder tree. The metric is
the teacher's k-NN accuracy on the validation split. The module is plain single-device PyTorch: the default
``strategy="vitscale"`` shards student *and* teacher, ``--trainer.strategy=ddp`` runs it unchanged.
"""

from __future__ import annotations

import math
from typing import Any

if not __package__:  # run as `python examples/pretraining.py`: make the checkout's `examples` package importable
    import _checkout  # noqa: F401

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import ArgsType, LightningCLI
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from examples.models.cli import run_cli
from examples.models.dino import DINOHead, DINONet, MultiCropViT, dino_loss, knn_predict
from examples.models.multicrop import DigitsMultiCropDataModule
from examples.models.optim import adamw_cosine
from examples.models.shard_data import ShardMultiCropDataModule  # noqa: F401  -- --data=ShardMultiCropDataModule
from examples.models.vit import VIT_SIZES


class DINOPretraining(pl.LightningModule):
    """DINO student/teacher ViT; ``size`` names a ``VIT_SIZES`` entry, the rest are DINO's knobs.

    The defaults are the digits recipe examples/README.md measures (k-NN ~0.84 against ~0.45 untrained):
    BatchNorm in the head (``head_bn``), 256 prototypes frozen for the first epoch, lr 5e-4; the GPU configs
    set DINO's published ImageNet values instead.

    The teacher is updated in place after every optimizer step: ``teacher <- m * teacher + (1 - m) * student``
    over ``zip(teacher.parameters(), student.parameters())``. Both are built alike, so under a sharding strategy
    each teacher shard meets the matching student shard on the same rank: no gather, no communication.
    """

    def __init__(
        self,
        size: str = "tiny",
        num_classes: int = 10,
        in_chans: int = 1,
        img_size: int = 16,
        n_global: int = 2,
        n_local: int = 4,
        patch_size: int | None = None,
        out_dim: int = 256,
        hidden_dim: int = 256,
        bottleneck_dim: int = 64,
        head_bn: bool = True,
        freeze_last_layer: int = 1,
        momentum: float = 0.99,
        student_temp: float = 0.1,
        teacher_temp: float = 0.04,
        center_momentum: float = 0.9,
        lr: float = 5e-4,
        weight_decay: float = 0.04,
        warmup_frac: float = 0.1,
        knn_k: int = 20,
    ) -> None:
        super().__init__()
        if size not in VIT_SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {sorted(VIT_SIZES)}")
        if n_global < 1 or n_local < 0:
            raise ValueError(f"n_global={n_global} must be >= 1 and n_local={n_local} >= 0")
        self.save_hyperparameters()
        self.student: DINONet | None = None
        self.teacher: DINONet | None = None
        self.register_buffer("center", torch.zeros(1, out_dim))
        # set once the teacher was copied from the student; saved, so a resumed run keeps its teacher
        self.register_buffer("teacher_ready", torch.zeros((), dtype=torch.bool))
        self.knn_acc = MulticlassAccuracy(num_classes)
        self._bank: list[tuple[Tensor, Tensor]] = []
        self._gathered: tuple[Tensor, Tensor] | None = None
        self._ema_step = -1

    def configure_model(self) -> None:
        if self.student is not None:
            return
        h: Any = self.hparams
        for role in ("student", "teacher"):
            backbone = MultiCropViT(h.size, h.img_size, h.in_chans, h.patch_size)
            setattr(
                self,
                role,
                DINONet(backbone, DINOHead(backbone.embed_dim, h.out_dim, h.hidden_dim, h.bottleneck_dim, h.head_bn)),
            )
        assert self.teacher is not None
        self.teacher.requires_grad_(False)  # trained by the EMA only

    def on_fit_start(self) -> None:
        if not bool(self.teacher_ready):
            self._ema(0.0)  # teacher := student, shard by shard
            self.teacher_ready.fill_(True)

    def teacher_momentum(self, step: int) -> float:
        """DINO's cosine schedule from ``momentum`` at step 0 to 1.0 at the last optimizer step."""
        total = max(1, int(self.trainer.estimated_stepping_batches))
        return 1 - (1 - self.hparams["momentum"]) * (math.cos(math.pi * min(step, total) / total) + 1) / 2

    @torch.no_grad()
    def _ema(self, momentum: float) -> None:
        assert self.student is not None and self.teacher is not None
        for t, s in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
            t.lerp_(s, 1.0 - momentum)  # t + (1 - m) * (s - t) = m * t + (1 - m) * s, in place

    def training_step(self, batch: tuple[list[Tensor], Tensor], batch_idx: int) -> Tensor:
        assert self.student is not None and self.teacher is not None
        crops, _ = batch
        h: Any = self.hparams
        with torch.no_grad():
            teacher_out = self.teacher(crops[: h.n_global])
        student_out = self.student(crops)
        loss = dino_loss(student_out, teacher_out, self.center, len(crops), h.student_temp, h.teacher_temp)
        self._update_center(teacher_out)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """DINO keeps the prototypes fixed for the first ``freeze_last_layer`` epochs (no gradient: no step, no decay).

        Moving prototypes and a moving teacher at once is the easiest way to collapse early in training.
        """
        if self.current_epoch < self.hparams["freeze_last_layer"]:
            assert self.student is not None
            self.student.head.prototypes.weight.grad = None

    @torch.no_grad()
    def _update_center(self, teacher_out: Tensor) -> None:
        """Running mean of the teacher's outputs over every rank's batch (``all_gather``: a no-op on one device)."""
        batch_mean = self.all_gather(teacher_out).reshape(-1, teacher_out.shape[-1]).mean(0, keepdim=True)
        self.center.mul_(self.hparams["center_momentum"]).add_(batch_mean, alpha=1 - self.hparams["center_momentum"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step  # counts optimizer steps: no update on an accumulation-only batch
        if step != self._ema_step:
            self._ema_step = step
            self._ema(self.teacher_momentum(step))

    def on_validation_epoch_start(self) -> None:
        self._bank, self._gathered = [], None

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Loader 0: the training images, features into the k-NN bank; loader 1: validation images, the queries."""
        assert self.teacher is not None
        x, y = batch
        feats = self.teacher.backbone(x)
        if dataloader_idx == 0:
            self._bank.append((feats, y))
            return
        if self._gathered is None:  # every rank's bank, once (each rank saw a slice of the training images)
            feats_bank, labels = (torch.cat(t) for t in zip(*self._bank, strict=True))
            self._gathered = (
                self.all_gather(feats_bank).reshape(-1, feats_bank.shape[-1]),
                self.all_gather(labels).reshape(-1),
            )
        scores = knn_predict(feats, *self._gathered, self.hparams["num_classes"], self.hparams["knn_k"])
        self.knn_acc(scores, y)
        self.log("knn_acc", self.knn_acc, prog_bar=True, add_dataloader_idx=False)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        return adamw_cosine(self, self.hparams["lr"], self.hparams["weight_decay"], self.hparams["warmup_frac"])


def main(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """CLI entry point; ``args`` and ``run=False`` (instantiate only) let tests drive it in-process."""
    links: tuple[str, ...] = ("num_classes", "in_chans", "img_size", "n_global", "n_local")
    return run_cli(DINOPretraining, DigitsMultiCropDataModule, "pretraining", links, max_epochs=50, args=args, run=run)


if __name__ == "__main__":
    main()
