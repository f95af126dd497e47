"""ViT image classification example: ``python examples/classification.py fit [--config ...]``.

Trains on scikit-learn's real 8x8 digits by default (no download); ``--data=FolderImageDataModule
--data.root=DIR`` for your own ImageFolder data. The module is plain single-device PyTorch: the
default ``strategy="vitscale"`` shards it, ``--trainer.strategy=ddp`` runs it unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

if not __package__:  # run as `python examples/classification.py`: make the checkout's `examples` package importable
    import _checkout  # noqa: F401

from lightning.pytorch.cli import ArgsType, LightningCLI
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig

from examples.models.backbones import build_backbone, parse_spec
from examples.models.classifier import ClassificationModule
from examples.models.cli import run_cli
from examples.models.datamodules import DigitsDataModule
from examples.models.finetune import check_options, freeze_backbone, layer_decay_lr_scale, load_pretrained
from examples.models.optim import adamw_cosine
from examples.models.shard_data import ShardImageDataModule  # noqa: F401  -- --data=ShardImageDataModule
from examples.models.vit import VisionTransformer


class ViTClassifier(ClassificationModule):
    """ViT image classifier; ``size`` names a ``VIT_SIZES`` entry (tiny, small, vit-b16 ... vit-120b).

    ``backbone`` replaces the built-in ViT by a published one (``timm:vit_base_patch16_224``,
    ``torchvision:vit_b_16``, ``hf:/path/to/config_or_model``), ``weights`` names local pretrained weights
    (``examples/models/backbones.py``).

    Fine-tuning the built-in ViT from a run (``examples/models/finetune.py``): ``weights`` may be a pretraining
    or classification run's checkpoint (sharded folder or ``.ckpt``) or an exported file, ``weights_key`` picks
    its trained weights, its ``ShardedEMA`` average or its DINO ``teacher``, ``weights_module`` the submodule
    (found by name when left out). ``layer_decay`` scales block ``i``'s learning rate by
    ``layer_decay ** (depth - i)`` (e.g. 0.65-0.75), ``drop_path`` is the stochastic-depth rate of the last
    block (linear from 0), ``freeze_backbone`` trains the head only (a linear probe).

    ``num_classes``, ``in_chans`` and ``img_size`` are linked from the datamodule by the CLI.
    The network is built in ``configure_model`` so a sharding strategy can create it on the meta
    device / already sharded -- a 120B model never exists whole on one device.
    """

    def __init__(
        self,
        size: str = "tiny",
        num_classes: int = 10,
        in_chans: int = 1,
        img_size: int = 16,
        patch_size: int | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.05,
        warmup_frac: float = 0.1,
        label_smoothing: float = 0.1,
        backbone: str | None = None,
        weights: str | None = None,
        weights_key: Literal["model", "ema", "teacher"] = "model",
        weights_module: str | None = None,
        layer_decay: float | None = None,
        drop_path: float = 0.0,
        freeze_backbone: bool = False,
    ) -> None:
        super().__init__(size, num_classes, lr, weight_decay, warmup_frac, label_smoothing)
        self.save_hyperparameters()
        if backbone is not None:
            parse_spec(backbone, weights)  # a typo fails here, before any process starts
            if weights_key != "model" or weights_module is not None or drop_path:
                raise ValueError(
                    "--model.weights_key, --model.weights_module and --model.drop_path apply to the built-in ViT"
                    " (fine-tuning from a run); for a published backbone give its weights file as --model.weights."
                )
        check_options(weights, weights_key, weights_module, layer_decay, drop_path)

    def configure_model(self) -> None:
        if self.net is None:
            h: Any = self.hparams
            if h.backbone is not None:
                self.net = build_backbone(h.backbone, h.num_classes, h.in_chans, h.img_size, h.weights)
            else:
                self.net = VisionTransformer.from_size(
                    h.size, h.img_size, h.in_chans, h.num_classes, h.patch_size, drop_path_rate=h.drop_path
                )
                if h.weights is not None:
                    load_pretrained(self.net, h.weights, h.weights_key, h.weights_module)
            if h.freeze_backbone:
                freeze_backbone(self.net)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        lr_scale = layer_decay_lr_scale(self, self.hparams["layer_decay"])
        return adamw_cosine(self, self.lr, self.weight_decay, self.warmup_frac, lr_scale=lr_scale)


def main(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """CLI entry point; ``args`` and ``run=False`` (instantiate only) let tests drive it in-process."""
    links: tuple[str, ...] = ("num_classes", "in_chans", "img_size")
    return run_cli(ViTClassifier, DigitsDataModule, "classification", links, max_epochs=20, args=args, run=run)


if __name__ == "__main__":
    main()
