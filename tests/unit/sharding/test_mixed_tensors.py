"""A step's arithmetic mixing a sharded parameter with a plain tensor (an L2 term over ``self.parameters()`` in
``training_step``): on one device's compute copies every parameter is plain in the step and it trains as on the
plain Trainer; on FSDP2's path (``priority="memory"``: block parameters are DTensors outside their forward) it
raises ``MixedTensorsError`` naming the fix instead of torch's bare "got mixed torch.Tensor and DTensor"."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_vitscale import MixedTensorsError, VitScaleStrategy
from tests.helpers.momentum import images
from tests.helpers.zoo import FunctionalAttention, hand_written


class L2Penalty(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = hand_written(FunctionalAttention)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        penalty = 1e-3 * sum(p.pow(2).sum() for p in self.parameters())  # before the forward
        loss = F.cross_entropy(self.net(x), y) + penalty
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(images(), batch_size=4)


def fit(strategy) -> L2Penalty:
    model = L2Penalty()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False).fit(model)
    return model


def test_an_l2_term_over_the_parameters_on_compute_copies_trains_as_on_the_plain_trainer():
    assert fit(VitScaleStrategy()).losses == fit("auto").losses


def test_an_l2_term_mixing_sharded_and_plain_parameters_is_named_with_its_fix():
    with pytest.raises(MixedTensorsError, match="weight_decay") as raised:
        fit(VitScaleStrategy(priority="memory"))
    assert "got mixed torch.Tensor and DTensor" in str(raised.value)  # torch's own words kept first
