"""Weight and gradient histograms logged to TensorBoard, DDP's habit, through ``Trainer.fit`` on one device.

Before: ``self.logger.experiment.add_histogram(name, p, step)`` raised ".numpy() is not supported for tensor
subclasses." outside the step (the parameters and gradients are DTensors, whole on one rank), and inside it the
step's copies, shared with NumPy, could no longer be freed ("Trying to resize storage that is not resizable"); the
planner's own runs of the step wrote their histograms and prints at batch 0 too."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from lightning_vitscale.distributed.array_reads import read_whole_arrays

HOOKS = ("training_step", "on_after_backward", "on_before_optimizer_step", "on_train_epoch_end")


class Histograms(L.LightningModule):
    """No ``forward``: blocks of linear layers; every parameter's histogram (and its gradient's, where it has one)
    logged in ``where``, as Lightning users log them; the step prints its batch's mean."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.where = where
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), *[nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                                                   for _ in range(3)], nn.Linear(32, 4))

    def histograms(self, where: str) -> None:
        if where != self.where:
            return
        for name, p in self.named_parameters():
            self.logger.experiment.add_histogram(name, p, self.global_step)
            if p.grad is not None:
                self.logger.experiment.add_histogram(f"{name}.grad", p.grad, self.global_step)

    def training_step(self, batch, batch_idx):
        x, y = batch
        print("batch mean", x.mean().item())
        self.histograms("training_step")
        return F.cross_entropy(self.net(x), y)

    def on_after_backward(self):
        self.histograms("on_after_backward")

    def on_before_optimizer_step(self, optimizer):
        self.histograms("on_before_optimizer_step")

    def on_train_epoch_end(self):
        self.histograms("on_train_epoch_end")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def logged(where: str, strategy, root) -> dict[str, list[tuple[int, float, float, float]]]:
    EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(24, 3, 4, 4, generator=g), torch.randint(0, 4, (24,), generator=g)),
                      batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        logger=TensorBoardLogger(root, name=str(strategy)[:8], version=0))
    trainer.fit(Histograms(where), data)
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"histograms": 0})
    events.Reload()
    return {tag: [(e.step, e.histogram_value.num, e.histogram_value.sum, e.histogram_value.sum_squares)
                  for e in events.Histograms(tag)] for tag in events.Tags()["histograms"]}


@pytest.mark.parametrize("where", HOOKS)
def test_histograms_logged_to_tensorboard_are_ddps(where, tmp_path, capsys):
    ours = logged(where, VitScaleStrategy(), tmp_path)
    printed = capsys.readouterr().out
    ddp = logged(where, "ddp", tmp_path)
    weights = {tag for tag in ddp if not tag.endswith(".grad")}
    # The last step's gradients, which DDP keeps until the next zero_grad, are freed after the optimizer step where
    # nothing is known to read them (docs/memory.md): not there in the step or at the epoch's end
    expected = ddp.keys() if where in ("on_after_backward", "on_before_optimizer_step") else weights
    assert ours.keys() == expected and len(weights) == 10
    for tag, events in ((tag, ddp[tag]) for tag in expected):  # one event per step: none from the planner's runs
        assert [e[0] for e in ours[tag]] == [e[0] for e in events], tag
        assert np.allclose([e[1:] for e in ours[tag]], [e[1:] for e in events], rtol=1e-6, atol=1e-9), tag
    means = [line.split()[-1] for line in printed.splitlines() if line.startswith("batch mean")]
    assert len(means) == 3 and all(float(m) == float(m) for m in means), means  # real numbers, no symbolic `zuf0`


def test_numpy_of_a_dtensor_whole_on_this_rank_is_its_values(mesh):
    read_whole_arrays(torch.device("cpu"))
    weight = nn.Parameter(distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh))
    assert isinstance(weight, DTensor)
    with pytest.raises(RuntimeError, match=r"Can't call numpy\(\) on Tensor that requires grad"):  # as torch's
        weight.numpy()
    assert np.array_equal(np.asarray(weight.detach()), np.arange(6.0).reshape(3, 2))
    assert np.array_equal(weight.numpy(force=True), np.arange(6.0).reshape(3, 2))
