"""ViTDet-style object detection example: ``python examples/detection.py fit [--config ...]``.

Reads COCO-format data (``--data=CocoDetectionDataModule --data.root=DIR``); by default generated shapes
(rectangles/ellipses/triangles, deterministic by seed) written once as a COCO folder in a cache directory.
Reports COCO mAP via torchmetrics' faster_coco_eval backend. The module knows nothing about sharding: the
default ``strategy="vitscale"`` shards it, ``--trainer.strategy=ddp`` runs it unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

if not __package__:  # run as `python examples/detection.py`: make the checkout's `examples` package importable
    import _checkout  # noqa: F401

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningCLI
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torchmetrics.detection import MeanAveragePrecision

from examples.models.cli import run_cli
from examples.models.finetune import check_options, freeze_backbone, layer_decay_lr_scale, load_pretrained
from examples.models.optim import adamw_cosine
from examples.models.shapes_coco import ShapesDetectionDataModule
from examples.models.vit import VIT_SIZES
from examples.models.vitdet import ViTDet

Batch = tuple[Tensor, list[dict[str, Tensor]]]
HEADS = ("pyramid", "head")  # ViTDet's detection-specific parts: trained on a frozen backbone


class ViTDetector(pl.LightningModule):
    """Anchor-free ViTDet: ``size`` names the backbone in ``VIT_SIZES``; boxes are xyxy pixels.

    ``num_classes``, ``in_chans`` and ``img_size`` come linked from the datamodule (``img_size`` sizes the
    learned position embedding, interpolated to each batch's padded size). ``window_size`` is the side of
    the attention windows in patches (ViTDet: 14); ``global_blocks`` the indices of the global-attention
    blocks (default: ViTDet's, the last block of each quarter of the depth). The network is
    built in ``configure_model`` so a sharding strategy can build it directly sharded.

    Fine-tuning from a run (``examples/models/finetune.py``, the classification example's options): ``weights``
    may be a pretraining or classification run's checkpoint (sharded folder or ``.ckpt``) or an exported file;
    its ViT (patch and position embeddings, blocks, final norm; the class token and any classifier head left
    out) starts the ViTDet backbone, the pyramid and heads keep their init. ``weights_key`` picks the run's
    trained weights, its ``ShardedEMA`` average or its DINO ``teacher``, ``weights_module`` the submodule (found
    by name when left out). Weights of another shape (patch size, channels, position grid) keep their init
    (logged). ``layer_decay`` scales block ``i``'s learning rate by ``layer_decay ** (depth - i)``, the patch
    and position embeddings by ``layer_decay ** (depth + 1)``, the pyramid and heads not at all; ``drop_path``
    is the stochastic-depth rate of the last block (linear from 0); ``freeze_backbone`` trains the pyramid and
    heads only.
    """

    def __init__(
        self,
        size: str = "tiny",
        num_classes: int = 3,
        in_chans: int = 3,
        img_size: int = 64,
        patch_size: int | None = 8,
        fpn_dim: int = 32,
        strides: tuple[int, ...] = (4, 8, 16),
        window_size: int = 4,
        global_blocks: list[int] | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_frac: float = 0.05,
        iou_thresholds: list[float] | None = None,
        weights: str | None = None,
        weights_key: Literal["model", "ema", "teacher"] = "model",
        weights_module: str | None = None,
        layer_decay: float | None = None,
        drop_path: float = 0.0,
        freeze_backbone: bool = False,
    ) -> None:
        super().__init__()
        if size not in VIT_SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {sorted(VIT_SIZES)}")
        check_options(weights, weights_key, weights_module, layer_decay, drop_path)
        self.save_hyperparameters()
        self.net: ViTDet | None = None
        self.val_map = MeanAveragePrecision(
            box_format="xyxy", iou_type="bbox", backend="faster_coco_eval", iou_thresholds=iou_thresholds or [0.5, 0.75]
        )

    def configure_model(self) -> None:
        if self.net is None:
            h: Any = self.hparams
            blocks = None if h.global_blocks is None else tuple(h.global_blocks)
            self.net = ViTDet(
                h.size,
                h.img_size,
                h.patch_size,
                h.in_chans,
                h.num_classes,
                h.fpn_dim,
                tuple(h.strides),
                h.window_size,
                blocks,
                drop_path_rate=h.drop_path,
            )
            if h.weights is not None:
                load_pretrained(self.net.backbone, h.weights, h.weights_key, h.weights_module)
            if h.freeze_backbone:
                freeze_backbone(self.net, HEADS)

    def forward(self, x: Tensor) -> list[dict[str, Tensor]]:
        """Images -> per-image detections (boxes, scores, labels)."""
        assert self.net is not None, "configure_model() not called"
        return self.net.decode(self.net(x))

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        assert self.net is not None
        x, targets = batch
        losses = self.net.loss(self.net(x), targets)
        loss = losses["heat"] + losses["box"]
        logs = {"train_loss": loss, "train_heat": losses["heat"], "train_box": losses["box"]}
        self.log_dict(logs, prog_bar=True, batch_size=len(targets))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        assert self.net is not None
        x, targets = batch
        outs = self.net(x)
        losses = self.net.loss(outs, targets)
        self.log("val_loss", losses["heat"] + losses["box"], sync_dist=True, batch_size=len(targets))
        self.val_map.update(self.net.decode(outs), targets)

    def on_validation_epoch_end(self) -> None:
        res = self.val_map.compute()  # gathers predictions from all ranks
        self.log("map_50", res["map_50"], prog_bar=True, sync_dist=True)
        self.log("map", res["map"], sync_dist=True)
        self.val_map.reset()

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        h: Any = self.hparams
        lr_scale = layer_decay_lr_scale(self, h.layer_decay)
        return adamw_cosine(self, h.lr, h.weight_decay, h.warmup_frac, lr_scale=lr_scale)


def main(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """CLI entry point; ``args`` and ``run=False`` (instantiate only) let tests drive it in-process."""
    links: tuple[str, ...] = ("num_classes", "in_chans", "img_size")
    return run_cli(ViTDetector, ShapesDetectionDataModule, "detection", links, max_epochs=10, args=args, run=run)


if __name__ == "__main__":
    main()
