"""Video classification example: ``python examples/video.py fit [--config ...]``.

Reads your videos (``--data=VideoDataModule --data.root=DIR``: class folders or a ``<path> <label>`` list);
by default generated moving shapes written once as mp4 files (8 motion directions, chance 12.5%).
``--model.backbone`` picks a factorised space-time ViT (default) or torchvision's MViTv2-S. The module
knows nothing about sharding: the default ``strategy="vitscale"`` shards
it, ``--trainer.strategy=ddp`` runs it unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

if not __package__:  # run as `python examples/video.py`: make the checkout's `examples` package importable
    import _checkout  # noqa: F401

from lightning.pytorch.cli import ArgsType, LightningCLI

from examples.models.classifier import ClassificationModule
from examples.models.cli import run_cli
from examples.models.shapes_video import MovingShapesVideoDataModule
from examples.models.video import FactorisedVideoViT, MViTv2S


class VideoClassifier(ClassificationModule):
    """Video classifier over (B, T, C, H, W) clips: a factorised space-time ViT or MViTv2-S.

    ``backbone="factorised"`` uses ``size``/``patch_size``/``tubelet``; ``backbone="mvit_v2_s"`` is
    torchvision's MViTv2-S at the linked clip size (``size`` etc. unused; ``dropout``/``stochastic_depth``
    are its head dropout and drop-path rate, torchvision's defaults). ``num_classes``, ``in_chans``,
    ``img_size`` and ``num_frames`` come linked from the datamodule. Built in ``configure_model`` so a
    sharding strategy can build it directly sharded.
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
        backbone: Literal["factorised", "mvit_v2_s"] = "factorised",
        dropout: float = 0.5,
        stochastic_depth: float = 0.2,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_frac: float = 0.1,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(size, num_classes, lr, weight_decay, warmup_frac, label_smoothing)
        if backbone not in ("factorised", "mvit_v2_s"):
            raise ValueError(f"backbone={backbone!r}: choose 'factorised' or 'mvit_v2_s'")
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if self.net is not None:
            return
        h: Any = self.hparams
        if h.backbone == "mvit_v2_s":
            self.net = MViTv2S(h.img_size, h.num_frames, h.num_classes, h.dropout, h.stochastic_depth)
        else:
            self.net = FactorisedVideoViT(
                h.size, h.img_size, h.num_frames, h.in_chans, h.num_classes, h.patch_size, h.tubelet
            )


def main(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """CLI entry point; ``args`` and ``run=False`` (instantiate only) let tests drive it in-process."""
    links: tuple[str, ...] = ("num_classes", "in_chans", "img_size", "num_frames")
    return run_cli(VideoClassifier, MovingShapesVideoDataModule, "video", links, max_epochs=8, args=args, run=run)


if __name__ == "__main__":
    main()
