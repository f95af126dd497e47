"""Rank script: the ViTDet detector and the MViTv2-S video model, each trained a few steps under DDP and under
VitScaleStrategy (fp32, same seed, same embedded-default data read from the written files); dump the losses."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch

from examples.detection import ViTDetector
from examples.models.shapes_coco import ShapesDetectionDataModule
from examples.models.shapes_video import MovingShapesVideoDataModule
from examples.video import VideoClassifier
from lightning_vitscale import VitScaleStrategy

warnings.filterwarnings("ignore")
STEPS = 4


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))


def build(name: str, cache: str) -> tuple[L.LightningModule, L.LightningDataModule]:
    if name == "vitdet":
        data = ShapesDetectionDataModule(num_train=32, num_val=8, batch_size=4, cache_dir=cache)
        return ViTDetector(num_classes=3, img_size=64), data
    data = MovingShapesVideoDataModule(num_train=32, num_val=8, batch_size=2, cache_dir=cache)
    return VideoClassifier(backbone="mvit_v2_s", num_classes=8, img_size=32, num_frames=8), data


def run(name: str, strategy: str, cache: str) -> dict:
    L.seed_everything(0, verbose=False)
    model, data = build(name, cache)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=STEPS,
        precision="32-true",
        strategy=VitScaleStrategy() if strategy == "vitscale" else "ddp",
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        val_check_interval=STEPS,
    )
    trainer.fit(model, data)
    plan = getattr(trainer.strategy, "plan", None)
    return {"losses": losses.losses, "blocks": plan.blocks if plan else {}}


def main() -> None:
    out, cache = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    results = {f"{name}/{s}": run(name, s, cache) for name in ("vitdet", "mvit") for s in ("ddp", "vitscale")}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
