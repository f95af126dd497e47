"""Video classification example: ``python examples/video.py fit [--config ...]``.

A factorised space-time ViT learns the direction of motion of generated moving shapes (8 classes,
chance 12.5%). The module knows nothing about sharding: the default ``strategy="vitscale"`` shards
it, ``--trainer.strategy=ddp`` runs it unchanged.
"""

from __future__ import annotations

from typing import Any

if not __package__:  # run as `python examples/video.py`: make the checkout's `examples` package importable
    import _checkout  # noqa: F401

from lightning.pytorch.cli import ArgsType

from examples.models.classifier import ClassificationModule
from examples.models.cli import run_cli
from examples.models.datamodules import MovingShapesVideoDataModule
from examples.models.video import FactorisedVideoViT


class VideoClassifier(ClassificationModule):
    """Video classifier over (B, T, C, H, W) clips with a factorised space-time ViT.

    ``num_classes``, ``in_chans``, ``img_size`` and ``num_frames`` come linked from the datamodule.
    Built in ``configure_model`` so a sharding strategy can build it directly sharded.
    """

    def __init__(
        self,
        size: str = "tiny",
        num_classes: int = 8,
        in_chans: int = 3,
        img_size: int = 32,
        num_frames: int = 8,
        patch_size: int | None = 8,
        tubelet: int = 2,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_frac: float = 0.1,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(size, num_classes, lr, weight_decay, warmup_frac, label_smoothing)
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if self.net is None:
            h: Any = self.hparams
            self.net = FactorisedVideoViT(
                h.size, h.img_size, h.num_frames, h.in_chans, h.num_classes, h.patch_size, h.tubelet
            )


def main(args: ArgsType = None) -> None:
    """CLI entry point; ``args`` lets tests drive it in-process."""
    links = ("num_classes", "in_chans", "img_size", "num_frames")
    run_cli(VideoClassifier, MovingShapesVideoDataModule, "video", links, max_epochs=8, args=args)


if __name__ == "__main__":
    main()
