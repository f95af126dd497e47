"""Tiny backbones for tests: each a plain single-device model, as a user would write or import it."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale.cli.demo import Block, TinyViT

IMAGE = 32
CLASSES = 10


class EncoderClassifier(nn.Module):
    """A ViT-like model built from ``nn.TransformerEncoder`` (with dropout, to exercise RNG replay)."""

    def __init__(self, dim: int = 64, depth: int = 4, patch: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (IMAGE // patch) ** 2, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, dim * 2, dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.encoder(x)).mean(1))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    """A hand-written non-transformer with repeated residual blocks held as plain attributes of a Sequential."""

    def __init__(self, channels: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, stride=2, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.stages = nn.Sequential(*[ResidualBlock(channels) for _ in range(depth)])
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class SdpaBlocks(nn.Module):
    """Two pre-norm blocks calling ``F.scaled_dot_product_attention`` directly, and a head: the smallest model
    with everything the kernel paths touch (attention routing, fp32 norms, compiled blocks, an outer layer)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, 2) for _ in range(2))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def timm_vit() -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, patch_size=8, depth=4, num_classes=CLASSES
    )


class HFViT(nn.Module):
    """HF `transformers` ViT built from a config; returns logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=128, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.vit = ViTForImageClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=x).logits


BACKBONES: dict[str, Callable[[], nn.Module]] = {
    "encoder": EncoderClassifier,
    "encoder_wide": lambda: EncoderClassifier(dim=96),  # same keys as "encoder", other shapes
    "timm": timm_vit,
    "hf": HFViT,
    "resnet": SmallResNet,
}


class Classifier(L.LightningModule):
    """The LightningModule under test: records every rank-local training loss for step-by-step comparison."""

    def __init__(self, backbone: str = "encoder", lr: float = 1e-3, crops: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = BACKBONES[backbone]()
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # crops > 1 runs the backbone several times before backward (multi-crop training).
        loss = sum(F.cross_entropy(self(torch.roll(x, i, dims=-1)), y) for i in range(self.hparams.crops))
        loss = loss / self.hparams.crops
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def random_images(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def loader(n: int = 64, batch_size: int = 4, seed: int = 0) -> DataLoader:
    return DataLoader(random_images(n, seed), batch_size=batch_size, shuffle=False)


class Streamed:
    """A DataLoader's batches as a plain iterable: setup cannot read a batch from it without consuming it, so
    VitScaleStrategy gets none to plan with (as from tar shards)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class DropoutViT(TinyViT):
    """The demo ViT with stock ``nn.TransformerEncoderLayer`` blocks, dropout everywhere (attention, MLP,
    residual), and plain SGD with a large step so that a wrong dropout mask shows in the weights."""

    def __init__(self, dim: int = 128, depth: int = 4, dropout: float = 0.2) -> None:
        super().__init__(dim=dim, depth=depth)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=dropout, batch_first=True, norm_first=True)
            for _ in range(depth)
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def train_dropout_vit(strategy, accelerator: str, devices: int = 1, steps: int = 4) -> dict:
    """Losses, final full weights and dynamo's graph/graph-break counts for one run from seed 0 and fixed data."""
    import warnings

    from torch._dynamo.utils import counters

    from lightning_vitscale.cli.demo import generated_images

    torch._dynamo.reset()
    counters.clear()
    L.seed_everything(0, verbose=False)
    model = DropoutViT()
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, precision="32-true", max_steps=steps, logger=False,
        strategy=strategy, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(generated_images(32 * steps * devices), batch_size=32))
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
               for n, p in model.named_parameters()}
    plan = getattr(trainer.strategy, "plan", None)
    return dict(
        losses=model.losses, weights=weights, graphs=counters["stats"]["unique_graphs"],
        graph_breaks=sum(counters["graph_break"].values()),
        checkpointed=len(plan.checkpointed) if plan is not None else 0,
    )


def largest_weight_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def boxes(count: int = 8, size: int = 64) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Detection samples as torchvision's detectors take them: an image and its target, two boxes of two classes."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(count):
        corner = torch.rand(2, 2, generator=g) * size / 2
        extent = torch.rand(2, 2, generator=g) * size / 3 + 8
        target = {"boxes": torch.cat([corner, corner + extent], 1), "labels": torch.randint(1, 3, (2,), generator=g)}
        samples.append((torch.rand(3, size, size, generator=g), target))
    return samples
