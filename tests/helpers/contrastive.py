"""A CLIP-style contrastive LightningModule with 0-dim parameters where users put them: a learnable temperature
on the model (CLIP's and open_clip's ``logit_scale``, used in the model's forward), one on the LightningModule used
in ``training_step`` itself, and a ReZero-style gate in every block (used in the block's forward, so checkpointing's
recompute reads it inside backward). open_clip's habit after each step: the temperature clamped in place."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, TOKENS, SAMPLES = 16, 5, 32
FLOOR = 1.5  # above where AdamW takes the temperature in 4 steps at lr 0.5 (1.16): the clamp acts from step 3


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.layer(x)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([GatedBlock() for _ in range(2)])
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj(x.mean(1))


class PairEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = Tower(), Tower()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)
        return self.logit_scale.exp() * a @ b.t()


class TemperatureClip(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = PairEncoder()
        self.margin = nn.Parameter(torch.tensor(0.1))  # added to the matching pairs' logits
        self.losses: list[float] = []
        self.temperatures: list[float] = []  # after each step's clamp

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, texts = batch
        labels = torch.arange(len(images))
        logits = self.net(images, texts) + self.margin * torch.eye(len(images))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.net.logit_scale.clamp_(FLOOR, math.log(100))  # open_clip clamps to [0, log 100]
        self.temperatures.append(float(self.net.logit_scale))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        pairs = (torch.randn(SAMPLES, TOKENS, WIDTH, generator=generator) for _ in range(2))
        return DataLoader(TensorDataset(*pairs), batch_size=8)


def scalars(model: TemperatureClip) -> dict[str, float]:
    """The 0-dim parameters' values, by name (a DTensor's local value: replicated, the same on every rank)."""
    return {name: float(param.to_local() if hasattr(param, "to_local") else param)
            for name, param in model.named_parameters() if param.dim() == 0}


def fit(
    strategy: Any, steps: int = 4, devices: int = 1, ckpt_path: str | None = None, **trainer: Any
) -> TemperatureClip:
    """``devices`` ranks, each with its own 0-dim values at the start (rank 0's: DDP broadcasts them)."""
    model = TemperatureClip()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 0:
                param.add_(int(os.environ.get("RANK", "0")))
    L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              **trainer).fit(model, ckpt_path=ckpt_path)
    return model
