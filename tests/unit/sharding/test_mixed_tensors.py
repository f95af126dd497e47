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
from lightning_vitscale.sharding.mixed_tensors import READ_AS_WHOLE_FIX
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


class WeightHistograms(L2Penalty):
    """A callback habit under DDP: rank 0 logs every weight's histogram to TensorBoard at each epoch's end;
    ``whole``: the fix the note names, whole values made on every rank first (``self.state_dict()``)."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.whole, self.logged = whole, {}

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def on_train_epoch_end(self) -> None:
        weights = self.state_dict() if self.whole else dict(self.named_parameters())
        if self.global_rank == 0:
            for name, weight in weights.items():
                self.logger.experiment.add_histogram(name, weight, self.current_epoch)
                self.logged[name] = float(weight.double().sum())


def fit_histograms(strategy, whole: bool, tmp_path) -> WeightHistograms:
    from lightning.pytorch.loggers import TensorBoardLogger

    model = WeightHistograms(whole)
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=TensorBoardLogger(tmp_path),
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False).fit(model)
    return model


@pytest.mark.parametrize("priority", ["speed", "memory"])
def test_a_weight_histogram_of_a_shard_fails_with_the_fix_noted_and_the_fix_logs_ddps_values(priority, tmp_path):
    """TensorBoard's ``add_histogram`` of a parameter reads it with ``.numpy()``, which a DTensor refuses in torch's
    words alone (".numpy() is not supported for tensor subclasses"), on one device too. The strategy's
    ``on_exception`` notes the fix under torch's message; the fix logs the plain Trainer's values. Mutation seen
    failing: ``note_the_fix`` not called from ``on_exception``."""
    pytest.importorskip("tensorboard")
    with pytest.raises(RuntimeError, match="not supported for tensor subclasses") as raised:
        fit_histograms(VitScaleStrategy(priority=priority), False, tmp_path / "shards")
    assert READ_AS_WHOLE_FIX in raised.value.__notes__ and "self.state_dict()" in READ_AS_WHOLE_FIX
    fixed = fit_histograms(VitScaleStrategy(priority=priority), True, tmp_path / "whole")
    plain = fit_histograms("auto", True, tmp_path / "plain")
    assert fixed.logged.keys() == plain.logged.keys() and fixed.logged == pytest.approx(plain.logged, rel=1e-6)
