"""Habits of a step and its hooks that talk to every rank, as written under DDP.

A contrastive step as SimCLR, CLIP and MoCo v3 write it under DDP: two views of this rank's batch through the
model, the normalized embeddings gathered from every rank with their gradients (``self.all_gather(z,
sync_grads=True)``, Lightning's; or ``torch.distributed.nn.functional.all_gather``, open_clip's), the InfoNCE loss
over the global batch. The gather's backward sends each rank's share of the gradient back to it: a collective
inside the backward, before any unit's reduce-scatter.

A step that sends collectives itself (a seed broadcast, a barrier, DETR's ``all_reduce`` of the target count, the
strategy's ``reduce``): the planner runs it at setup on one rank.

Gradients clipped by hand in ``on_before_optimizer_step`` with torch's ``clip_grad_norm_`` (the total norm over every
rank's shards) or ``clip_grad_value_``, instead of the Trainer's ``gradient_clip_val``.

An EMA of the network updated after each batch: timm's ``ModelEmaV3`` made in ``__init__`` (frozen, as DDP needs it),
which updates through ``state_dict()`` values in place (a gather of every sharded tensor here); or torch's
``AveragedModel`` made after setup (``on_fit_start``): a plain copy, which the shards cannot update."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from tests.helpers.tiny_vit_module import TinyViTModule


class Contrastive(TinyViTModule):
    def __init__(self, gather: str) -> None:
        super().__init__()
        self.gather = gather  # "lightning" or "torch"

    def gathered(self, z: torch.Tensor) -> torch.Tensor:
        if self.gather == "lightning":
            return self.all_gather(z, sync_grads=True).flatten(0, 1)
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(z))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        a = self.gathered(F.normalize(self.net(x), dim=-1))
        b = self.gathered(F.normalize(self.net(x.flip(-1)), dim=-1))
        loss = F.cross_entropy(a @ b.T / 0.1, torch.arange(len(a)))
        self.losses.append(loss.item())
        return loss


class Talking(TinyViTModule):
    """A step that sends collectives itself, as DDP code does: an augmentation seed broadcast from rank 0
    (``self.trainer.strategy.broadcast``), a ``barrier()``, DETR's loss normalizer (``torch.distributed.all_reduce``
    of the batch's target count) and the global mean loss (the strategy's ``reduce``) logged. The planner runs this
    step at setup on rank 0 alone while the others wait for its plan."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        seed = self.trainer.strategy.broadcast(1000 + 7 * batch_idx + self.global_rank)  # rank 0's on every rank
        self.trainer.strategy.barrier("augmented")
        x = x.flip(-1) if random.Random(seed).random() < 0.5 else x
        targets = torch.tensor(float(len(y)))
        torch.distributed.all_reduce(targets)
        loss = F.cross_entropy(self.net(x), y, reduction="sum") * self.trainer.world_size / targets
        self.log("global_loss", self.trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean"))
        self.losses.append(loss.item())
        self.seeds.append(seed)
        return loss


class ClippedByHand(TinyViTModule):
    def __init__(self, clip: str) -> None:
        super().__init__()
        self.clip = clip  # "norm" or "value"
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.clip == "value":
            torch.nn.utils.clip_grad_value_(self.parameters(), 0.01)
            return
        total = torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)
        self.norms.append(float(total))  # as a user logs it (a replicated DTensor here: every rank's value is DDP's)


class WithEma(TinyViTModule):
    """``ema``: ``"timm"`` (``ModelEmaV3`` in ``__init__``), ``"averaged_after_setup"`` (``AveragedModel`` made in
    ``on_fit_start``) or ``"none"``."""

    def __init__(self, ema: str) -> None:
        super().__init__()
        self.kind = ema
        if ema == "timm":
            from timm.utils import ModelEmaV3

            self.ema = ModelEmaV3(self.net, decay=0.9)
            self.ema.requires_grad_(False)

    def on_fit_start(self) -> None:
        if self.kind == "averaged_after_setup":
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

            self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.kind == "timm":
            self.ema.update(self.net)
        elif self.kind == "averaged_after_setup":
            self.ema.update_parameters(self.net)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.05)  # not the EMA's
