"""The LightningModule the habit tests start from: the zoo's hand-written ViT (2 blocks, seed 0) trained by SGD at
lr 0.05 on ``images()`` in batches of 4, each step's loss kept. A habit overrides only what it changes."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from tests.helpers.momentum import images
from tests.helpers.zoo import FunctionalAttention, hand_written


class TinyViTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = hand_written(FunctionalAttention)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(images(), batch_size=4)
