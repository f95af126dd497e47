"""A momentum encoder (MoCo, BYOL, lightly's examples) updated by user code, for the parameter-write tests.

``MomentumModel(update, where)``: a student (the zoo's hand-written ViT, 2 blocks) trained by SGD, and a frozen
copy of it updated toward the student (momentum 0.5: visible in every loss) by ``update``:

- ``"lightly"``: lightly 1.5's ``update_momentum`` verbatim, ``ema.data = ema.data * m + p.data * (1 - m)``
  (a ``.data`` assignment, which FSDP2's DTensors otherwise drop: pytorch#157391);
- ``"dino"``: DINO's ``param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)`` (in place through ``.data``);

at ``where``: ``"start"`` (before the forwards, as lightly's examples do), ``"between"`` (after the student's forward,
before the teacher's), ``"end"`` (after both) of ``training_step``, or ``"batch_end"`` (``on_train_batch_end``, after
the optimizer step). The loss reads the teacher, so an update lost or late changes the next losses.
"""

from __future__ import annotations

import copy

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_vitscale import VitScaleStrategy
from tests.helpers.zoo import CLASSES, IMAGE, FunctionalAttention, hand_written

MOMENTUM = 0.5
# DDP (the oracle), the default and the recipe's plan: what each momentum scenario runs under
STRATEGIES = {"ddp": lambda: "ddp", "default": VitScaleStrategy, "memory": lambda: VitScaleStrategy(priority="memory")}


@torch.no_grad()
def lightly_update_momentum(model: torch.nn.Module, model_ema: torch.nn.Module, m: float) -> None:
    for model_ema, model in zip(model_ema.parameters(), model.parameters()):  # noqa: B020 - lightly's code as is
        model_ema.data = model_ema.data * m + model.data * (1.0 - m)


@torch.no_grad()
def dino_update(student: torch.nn.Module, teacher: torch.nn.Module, m: float) -> None:
    for param_q, param_k in zip(student.parameters(), teacher.parameters()):
        param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


UPDATES = {"lightly": lightly_update_momentum, "dino": dino_update}


def images(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


class MomentumModel(L.LightningModule):
    def __init__(self, update: str, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = hand_written(FunctionalAttention)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.update, self.where = UPDATES[update], where
        self.losses: list[float] = []

    def _update(self, where: str) -> None:
        if where == self.where:
            self.update(self.student, self.teacher, MOMENTUM)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self._update("start")
        q = self.student(x)
        self._update("between")
        with torch.no_grad():
            k = self.teacher(x.flip(-1))
        loss = F.cross_entropy(q, y) + (q - k).pow(2).mean()
        self._update("end")
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._update("batch_end")

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(images(), batch_size=4)


def fit_momentum(strategy, update: str, where: str, devices: int, precision: str = "32-true",
                 steps: int = 4) -> MomentumModel:
    """``steps`` steps from the same weights and data under ``strategy``; the user's sampler kept on every strategy
    (``use_distributed_sampler=False``: one device's order is the plain loop's)."""
    model = MomentumModel(update, where)
    L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_steps=steps,
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False).fit(model)
    return model


def teacher_state(model: MomentumModel) -> dict[str, torch.Tensor]:
    """The teacher's parameters, whole (``state_dict`` gives DDP's full tensors under the strategy too)."""
    return {name: value.detach().clone() for name, value in model.state_dict().items() if name.startswith("teacher.")}
